//! Batches against a real nats-server, the fake engine and a loopback webhook receiver:
//! `POST /v1/batches` takes items in order, refuses an invalid item alone, stops on the
//! key's rate limit with the rest `not_submitted` and goes on when the same batch is
//! submitted again; the batch id is its content (a resubmission queues no new job);
//! `GET /v1/batches/{id}` counts the items until every job has ended; the batch's
//! webhook fires once, signed; another owner's batch is a 404; 1 001 items are a 422.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use reqwest::Method;
use serde_json::{json, Value};
use stemq_accounts::auth::{self, Limits, Role};
use stemq_nats as names;
use stemq_tests::{Stack, StackOptions, TEST_OWNER};
use stemq_webhook::{verify, Secret};

const T: Duration = Duration::from_secs(30);

/// A loopback receiver that answers 204 and keeps what it got.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> axum::http::StatusCode {
    r.got.lock().unwrap().push((headers, body));
    axum::http::StatusCode::NO_CONTENT
}

impl Receiver {
    async fn start() -> (Receiver, SocketAddr) {
        let r = Receiver::default();
        let app = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(r.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        (r, addr)
    }

    fn got(&self) -> Vec<(HeaderMap, Bytes)> {
        self.got.lock().unwrap().clone()
    }

    async fn wait(&self, n: usize) -> Vec<(HeaderMap, Bytes)> {
        let deadline = Instant::now() + T;
        loop {
            let got = self.got();
            if got.len() >= n {
                return got;
            }
            assert!(Instant::now() < deadline, "the receiver got {} requests, wanted {n}", got.len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A stack with one fake worker and the relay; loopback receivers allowed.
async fn stack() -> Stack {
    // Every test in this binary uses the same allow-list (the variable is process-wide).
    std::env::set_var("STEMQ_WEBHOOK_ALLOW", "127.0.0.1");
    let mut stack = Stack::start(StackOptions::default()).await;
    stack
        .start_relay(stemq_relay::Config {
            schedule: vec![Duration::ZERO, Duration::from_millis(200)],
            timeout: Duration::from_secs(2),
            max_retry_after: Duration::from_secs(1),
            allow: stemq_webhook::Allowlist::parse("127.0.0.1"),
            concurrency: 16,
            name: "relay-test".into(),
            progress_jobs: 100,
            ready: None,
        })
        .await;
    stack
}

/// A key of `owner` with `limits`.
async fn key(stack: &Stack, owner: &str, role: Role, limits: Limits) -> String {
    auth::create(&stack.keys, owner, role, limits, "test").await.expect("key").0.expose()
}

/// One HTTP call with `key`: (status, headers, JSON body or Null).
async fn call(stack: &Stack, method: Method, path: &str, key: &str, body: Option<&Value>) -> (u16, HeaderMap, Value) {
    let mut r = reqwest::Client::new().request(method, stack.url(path)).bearer_auth(key);
    if let Some(b) = body {
        r = r.json(b);
    }
    let resp = r.send().await.expect("http");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    (status, headers, resp.json().await.unwrap_or(Value::Null))
}

/// A valid item: upload `name` of `owner`, a short fake job.
fn item(stack: &Stack, owner: &str, name: &str) -> Value {
    json!({"audio_uri": stack.store.uri(&format!("uploads/{owner}/{name}.wav")), "model": "dsp",
           "metadata": {"fake": {"sleep_ms": 50}}})
}

/// Requests recorded in the job log.
async fn requests(stack: &Stack) -> u64 {
    stack.count_on("stemq.jobs.*.requested.>").await
}

/// Messages stored on `subject` in the batch log.
async fn in_batch_log(stack: &Stack, subject: &str) -> u64 {
    use futures::StreamExt;
    let stream = stack.js.get_stream(names::BATCHES_STREAM).await.unwrap();
    let info = stream.info_with_subjects(subject).await.unwrap();
    futures::pin_mut!(info);
    let mut n = 0;
    while let Some(Ok((_, c))) = info.next().await {
        n += c as u64;
    }
    n
}

/// Polls `GET /v1/batches/{id}` until `pred` holds; panics with the last view.
async fn wait_batch(stack: &Stack, key: &str, id: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + T;
    loop {
        let (code, _, v) = call(stack, Method::GET, &format!("/v1/batches/{id}"), key, None).await;
        assert_eq!(code, 200, "{v}");
        if pred(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "batch {id} did not get there; last view: {v:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn states(v: &Value) -> Vec<String> {
    v["items"].as_array().unwrap().iter().map(|i| i["state"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refuses_its_invalid_item_alone_ends_once_and_is_its_content() {
    let stack = stack().await;
    let (rx, addr) = Receiver::start().await;
    let owner_key = stack.key.clone();
    let mut items: Vec<Value> = (0..5).map(|i| item(&stack, TEST_OWNER, &format!("song{i}"))).collect();
    // The fourth item names a model that does not exist: refused alone. The last one
    // is a job that fails: it ends the batch as much as a success does.
    items.insert(3, json!({"audio_uri": stack.store.uri(&format!("uploads/{TEST_OWNER}/bad.wav")), "model": "nope"}));
    let mut failing = item(&stack, TEST_OWNER, "fails");
    failing["metadata"] = json!({"fake": {"fail_permanent": true}});
    items.push(failing);
    let body = json!({"items": items, "webhook": {"url": format!("http://{addr}/hook")}, "metadata": {"album": "x"}});
    let before = requests(&stack).await;

    let (code, h, v) = call(&stack, Method::POST, "/v1/batches", &owner_key, Some(&body)).await;
    assert_eq!(code, 202, "{v:#}");
    let id = v["batch_id"].as_str().unwrap().to_string();
    assert_eq!(h["location"].to_str().unwrap(), format!("/v1/batches/{id}"));
    assert!(h.get("retry-after").is_none());
    assert_eq!(states(&v), ["submitted", "submitted", "submitted", "refused", "submitted", "submitted", "submitted"]);
    let bad = &v["items"][3];
    assert_eq!(
        (bad["error"]["code"].as_str(), bad["error"]["field"].as_str()),
        (Some("invalid_request"), Some("model"))
    );
    assert_eq!((v["counts"]["submitted"].as_u64(), v["counts"]["refused"].as_u64()), (Some(6), Some(1)));
    assert_eq!(v["metadata"]["album"], "x");
    assert_eq!(requests(&stack).await - before, 6, "six jobs queued");
    // Each item's job is the one the same request gets alone.
    let (_, alone) = stack.submit(&items[0]).await;
    assert_eq!(alone["job_id"], v["items"][0]["job_id"]);
    assert_eq!(alone["cached"], true);

    // The same batch again: the same id, nothing new queued (whatever the key order or
    // the batch's own webhook and metadata).
    let mut again = body.clone();
    again["metadata"] = json!({"album": "other"});
    let (code, _, v2) = call(&stack, Method::POST, "/v1/batches", &owner_key, Some(&again)).await;
    assert_eq!(code, 200, "{v2:#}");
    assert_eq!(v2["batch_id"], id.as_str());
    assert_eq!(v2["metadata"]["album"], "x", "the first submission's metadata stays");
    assert_eq!(requests(&stack).await - before, 6, "no new job");

    // Every job ends; the counts say so and the batch ends.
    let done = wait_batch(&stack, &owner_key, &id, |v| v["status"] == "ended").await;
    let counts = (done["counts"]["succeeded"].as_u64(), done["counts"]["failed"].as_u64());
    assert_eq!(counts, (Some(5), Some(1)), "{done:#}");
    assert_eq!((done["counts"]["queued"].as_u64(), done["counts"]["running"].as_u64()), (Some(0), Some(0)));
    assert_eq!(done["items"][6]["status"], "failed");

    // The webhook fires once, signed with the owner's secret.
    let got = rx.wait(1).await;
    let (code, _, s) = call(&stack, Method::GET, "/v1/webhooks/secret", &owner_key, None).await;
    assert_eq!(code, 200);
    let secret = Secret::parse(s["secret"].as_str().unwrap()).unwrap();
    let (headers, raw) = &got[0];
    let ts: i64 = headers["webhook-timestamp"].to_str().unwrap().parse().unwrap();
    let wid = headers["webhook-id"].to_str().unwrap();
    verify(&secret, wid, ts, raw, headers["webhook-signature"].to_str().unwrap(), chrono::Utc::now().timestamp())
        .expect("the signature verifies");
    let payload: Value = serde_json::from_slice(raw).unwrap();
    assert_eq!(payload["type"], "io.stemq.batch.ended.v1");
    assert_eq!(payload["data"]["batch_id"], id.as_str());
    assert_eq!(payload["data"]["status"], "ended");
    assert_eq!(payload["data"]["counts"]["succeeded"], 5);
    assert_eq!(payload["data"]["counts"]["failed"], 1);
    assert!(payload["data"]["ended_at"].is_string());
    // Submitting the ended batch again changes nothing, and no second end is recorded.
    let (code, _, _) = call(&stack, Method::POST, "/v1/batches", &owner_key, Some(&body)).await;
    assert_eq!(code, 200);
    let ended = wait_batch(&stack, &owner_key, &id, |v| v["ended_at"].is_string()).await;
    assert_eq!(ended["ended_at"], payload["data"]["ended_at"]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rx.got().len(), 1, "one delivery");
    assert_eq!(in_batch_log(&stack, &format!("stemq.batches.{id}.ended")).await, 1);
    assert_eq!(in_batch_log(&stack, &format!("stemq.batches.{id}.delivery")).await, 1);

    // Another owner: the batch is not there; its own submission of the same items is
    // another batch (and its items are not its uploads).
    let other = key(&stack, "globex", Role::Submit, Limits::NONE).await;
    let (code, _, e) = call(&stack, Method::GET, &format!("/v1/batches/{id}"), &other, None).await;
    assert_eq!((code, e["error"]["code"].as_str()), (404, Some("not_found")));
    let (code, _, theirs) = call(&stack, Method::POST, "/v1/batches", &other, Some(&body)).await;
    assert_eq!(code, 202);
    assert_ne!(theirs["batch_id"], id.as_str());
    assert_eq!(theirs["counts"]["refused"], 7, "another owner's uploads: {theirs:#}");
    // A read key may look but not submit; no key is 401.
    let reader = key(&stack, TEST_OWNER, Role::Read, Limits::NONE).await;
    assert_eq!(call(&stack, Method::GET, &format!("/v1/batches/{id}"), &reader, None).await.0, 200);
    assert_eq!(call(&stack, Method::POST, "/v1/batches", &reader, Some(&body)).await.0, 403);
    let anonymous = reqwest::Client::new().get(stack.url(&format!("/v1/batches/{id}"))).send().await.unwrap();
    assert_eq!(anonymous.status().as_u16(), 401);
    assert_eq!(call(&stack, Method::GET, &format!("/v1/batches/{}", "0".repeat(64)), &owner_key, None).await.0, 404);
    assert_eq!(call(&stack, Method::GET, "/v1/batches/nothex", &owner_key, None).await.0, 404);

    // Not batches: 1 001 items, none, an unknown field, a receiver the policy refuses.
    let too_many = json!({"items": vec![items[0].clone(); 1001]});
    let (code, _, e) = call(&stack, Method::POST, "/v1/batches", &owner_key, Some(&too_many)).await;
    assert_eq!((code, e["error"]["field"].as_str()), (422, Some("items")), "{e}");
    for (bad, field) in [
        (json!({"items": []}), "items"),
        (json!({"items": [items[0]], "priority": "batch"}), "body"),
        (json!({"items": [items[0]], "webhook": {"url": "https://10.0.0.1/hook"}}), "webhook.url"),
    ] {
        let (code, _, e) = call(&stack, Method::POST, "/v1/batches", &owner_key, Some(&bad)).await;
        assert_eq!((code, e["error"]["field"].as_str()), (422, Some(field)), "{bad}: {e}");
    }
    assert_eq!(requests(&stack).await - before, 6, "nothing refused was queued");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_stops_the_batch_and_the_same_batch_goes_on_later() {
    let stack = stack().await;
    let (rx, addr) = Receiver::start().await;
    // Two submits at once, then two a second.
    let k = key(&stack, TEST_OWNER, Role::Submit, Limits { rate: 2.0, burst: 2, max_in_flight: 1000 }).await;
    let mut items: Vec<Value> = (0..5).map(|i| item(&stack, TEST_OWNER, &format!("rated{i}"))).collect();
    // An invalid item after the stop is still told its own error.
    items.push(json!({"audio_uri": stack.store.uri(&format!("uploads/{TEST_OWNER}/x.wav")), "shifts": -1}));
    let body = json!({"items": items, "webhook": {"url": format!("http://{addr}/hook")}});
    let before = requests(&stack).await;

    let (code, h, v) = call(&stack, Method::POST, "/v1/batches", &k, Some(&body)).await;
    assert_eq!(code, 202, "{v:#}");
    let id = v["batch_id"].as_str().unwrap().to_string();
    assert_eq!(states(&v), ["submitted", "submitted", "not_submitted", "not_submitted", "not_submitted", "refused"]);
    let reason = &v["items"][2]["reason"];
    assert_eq!(reason["code"], "rate_limited", "{v:#}");
    assert!(reason["retry_after"].as_u64().unwrap() >= 1);
    assert_eq!(v["stopped"]["code"], "rate_limited");
    assert_eq!(v["items"][5]["error"]["field"], "shifts");
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry), "{retry}");
    assert_eq!(requests(&stack).await - before, 2);

    // The two jobs end; the batch is stopped, not ended: no end, no webhook.
    let stopped = wait_batch(&stack, &k, &id, |v| v["status"] == "stopped").await;
    assert_eq!(
        (stopped["counts"]["succeeded"].as_u64(), stopped["counts"]["not_submitted"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(in_batch_log(&stack, &format!("stemq.batches.{id}.ended")).await, 0);
    assert!(rx.got().is_empty());

    // Submitting the same batch again, after Retry-After each time, goes on where it
    // stopped, and never queues an item twice.
    let mut rounds = 1;
    let mut wait = retry;
    loop {
        tokio::time::sleep(Duration::from_secs(wait)).await;
        let (code, h, v) = call(&stack, Method::POST, "/v1/batches", &k, Some(&body)).await;
        rounds += 1;
        assert!(code == 202 || code == 200, "{code}: {v:#}");
        assert_eq!(v["batch_id"], id.as_str());
        assert_eq!(v["items"][0]["state"], "submitted");
        if v["counts"]["not_submitted"] == 0 {
            assert_eq!(v["counts"]["submitted"], 5);
            assert!(h.get("retry-after").is_none());
            break;
        }
        assert!(rounds < 6, "the batch does not get through: {v:#}");
        wait = h["retry-after"].to_str().unwrap().parse().unwrap();
    }
    assert_eq!(requests(&stack).await - before, 5, "each job queued once");
    let done = wait_batch(&stack, &k, &id, |v| v["status"] == "ended").await;
    assert_eq!((done["counts"]["succeeded"].as_u64(), done["counts"]["refused"].as_u64()), (Some(5), Some(1)));
    assert!(done["rounds"].as_u64().unwrap() >= 2);
    let got = rx.wait(1).await;
    let payload: Value = serde_json::from_slice(&got[0].1).unwrap();
    assert_eq!(payload["data"]["counts"]["succeeded"], 5);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rx.got().len(), 1, "one delivery");
    stack.shutdown().await;
}

/// `stemq ARGS` in `dir` against the stack's API only (a NATS URL and a store that
/// would fail if the command used them).
async fn stemq(stack: &Stack, dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(Stack::stemq_bin());
    cmd.args(args)
        .current_dir(dir)
        .env("STEMQ_DATA_DIR", dir.join(".stemq"))
        .env("NATS_URL", "nats://127.0.0.1:1")
        .env("STEMQ_STORE", "file:///nonexistent/store/")
        .env("STEMQ_API", format!("http://{}", stack.http))
        .env("STEMQ_API_KEY", &stack.key)
        .env_remove("STEMQ_NATS_CREDS")
        .env_remove("STEMQ_LOG_FORMAT");
    tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap()
}

fn ok(out: &std::process::Output, what: &str) -> (String, String) {
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_submits_a_folder_as_one_batch_and_downloads_its_stems() {
    let stack = stack().await;
    let dir = tempfile::tempdir().unwrap();
    let songs = dir.path().join("songs");
    std::fs::create_dir(&songs).unwrap();
    for (name, seconds) in [("one.wav", "1"), ("two.wav", "1.5")] {
        let out = stemq(&stack, dir.path(), &["synth", "--seconds", seconds, "-o", &format!("songs/{name}")]).await;
        ok(&out, "synth");
    }
    std::fs::write(songs.join("cover.jpg"), b"not audio").unwrap();

    let out = stemq(&stack, dir.path(), &["batch", "songs", "--wait", "-o", "stems"]).await;
    let (stdout, stderr) = ok(&out, "batch --wait");
    assert!(stderr.contains("skipping 1 files that are not audio: cover.jpg"), "{stderr}");
    let first = stdout.lines().next().unwrap();
    assert!(first.contains("2 items, 2 submitted, 0 refused, 0 not submitted"), "{stdout}");
    let id = first.split_whitespace().nth(1).unwrap().trim_end_matches(':').to_string();
    assert!(stdout.contains("2 succeeded"), "{stdout}");
    for song in ["one", "two"] {
        let stems: Vec<_> = std::fs::read_dir(dir.path().join("stems").join(song)).unwrap().collect();
        assert_eq!(stems.len(), 4, "stems/{song}");
    }
    let (code, _, v) = call(&stack, Method::GET, &format!("/v1/batches/{id}"), &stack.key, None).await;
    assert_eq!((code, v["status"].as_str()), (200, Some("ended")), "{v:#}");
    assert_eq!(v["items"][0]["state"], "submitted");

    // The same folder again is the same batch, and nothing new; a watch of it
    // downloads the stems by song name (from each job's `metadata.file`).
    let before = requests(&stack).await;
    let (stdout, _) = ok(&stemq(&stack, dir.path(), &["batch", "songs"]).await, "batch again");
    assert!(stdout.contains(&format!("batch {id}:")), "{stdout}");
    assert_eq!(requests(&stack).await, before);
    let (stdout, _) = ok(&stemq(&stack, dir.path(), &["watch", "--batch", &id, "-o", "again"]).await, "watch --batch");
    assert!(stdout.contains("2 succeeded"), "{stdout}");
    assert!(dir.path().join("again/one").is_dir() && dir.path().join("again/two").is_dir());
    let (stdout, _) = ok(&stemq(&stack, dir.path(), &["status", "--batch", &id]).await, "status --batch");
    assert!(stdout.contains("\"ended\""), "{stdout}");
    // A folder given to `submit` points to `batch`.
    let out = stemq(&stack, dir.path(), &["submit", "songs"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("stemq batch songs"));
    stack.shutdown().await;
}

/// Turns credits on (enforced): `dsp` at 6 credits a minute of audio (readers cache the
/// price list for 2 s).
async fn set_prices(stack: &Stack) {
    use stemq_accounts::ledger::{Prices, CONFIG_BUCKET, PRICES_KEY};
    let p = Prices {
        unit: "credit".into(),
        per_audio_minute: [("dsp".to_string(), 6.0)].into_iter().collect(),
        enforce: true,
    };
    let kv = stack.js.get_key_value(CONFIG_BUCKET).await.unwrap();
    kv.put(PRICES_KEY, serde_json::to_vec(&p).unwrap().into()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
}

/// Credits are a budget like the rate: a song the owner cannot pay stops the batch (402
/// `insufficient_credits`, no `Retry-After`: waiting does not bring credits), and once
/// credits are granted the same batch goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_credits_stops_the_batch_until_credits_are_granted() {
    use stemq_accounts::ledger::{Ledger, MICRO};
    // No workers: the jobs stay queued, so nothing is reserved or charged meanwhile.
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    set_prices(&stack).await;
    let ledger = Ledger::new(stack.js.clone());
    ledger.grant("acme", MICRO, "test", None, "batch-g1").await.unwrap();
    let k = key(&stack, "acme", Role::Submit, Limits::NONE).await;
    // 1 s (0.1 credit), 20 s (2 credits: more than the 1 granted), 1.5 s.
    let mut items = Vec::new();
    for (name, seconds) in [("short.wav", 1.0), ("long.wav", 20.0), ("other.wav", 1.5)] {
        let up = stack.upload_song(&k, name, seconds).await;
        assert!(up["duration_ms"].is_u64(), "the upload's length is known: {up}");
        items.push(json!({"audio_uri": up["audio_uri"], "model": "dsp"}));
    }
    let body = json!({"items": items});
    let (code, h, v) = call(&stack, Method::POST, "/v1/batches", &k, Some(&body)).await;
    assert_eq!(code, 202, "{v:#}");
    assert_eq!(states(&v), ["submitted", "not_submitted", "not_submitted"]);
    // An upload's name and its store URI are one job, and so one batch.
    let job = stemq_core::JobId::parse(v["items"][0]["job_id"].as_str().unwrap()).unwrap();
    let stored_uri = stack.wait_for(&job, T, |_| true).await.request.unwrap().audio_uri;
    assert!(items[0]["audio_uri"].as_str().unwrap().starts_with("upload:"), "{items:?}");
    let mut spelled = body.clone();
    spelled["items"][0]["audio_uri"] = json!(stored_uri);
    let (_, _, same) = call(&stack, Method::POST, "/v1/batches", &k, Some(&spelled)).await;
    assert_eq!(same["batch_id"], v["batch_id"], "{same:#}");
    assert_eq!(v["stopped"]["code"], "insufficient_credits", "{v:#}");
    assert!(v["stopped"]["retry_after"].is_null());
    assert!(h.get("retry-after").is_none());
    // Nothing changes until credits come; then the same batch goes on.
    let (code, _, again) = call(&stack, Method::POST, "/v1/batches", &k, Some(&body)).await;
    assert_eq!((code, again["counts"]["not_submitted"].as_u64()), (200, Some(2)), "{again:#}");
    ledger.grant("acme", 10 * MICRO, "test", None, "batch-g2").await.unwrap();
    let (code, _, v) = call(&stack, Method::POST, "/v1/batches", &k, Some(&body)).await;
    assert_eq!(code, 202, "{v:#}");
    assert_eq!(states(&v), ["submitted", "submitted", "submitted"]);
    assert!(v["stopped"].is_null());
    stack.shutdown().await;
}
