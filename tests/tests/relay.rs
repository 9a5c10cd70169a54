//! The webhook relay against a real nats-server and real HTTP receivers on loopback
//! (issue 5): signing, retries, Retry-After, 410, 3xx, the delivery record, replay,
//! secret rotation, and the SSRF check at submit. Issue 11: retries wait on the queue,
//! not in the relay (a restart continues them, a failing receiver stalls no other), the
//! progress memory is cleaned up, and a URL a 410 disabled can be enabled again.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use stemq_core::{JobId, JobStatus};
use stemq_tests::{job_body, job_id, Stack, StackOptions};
use stemq_webhook::{verify, Secret};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const T: Duration = Duration::from_secs(30);

/// How long `slow` paths take to answer.
const SLOW: Duration = Duration::from_millis(1500);

/// One request a receiver got.
#[derive(Debug, Clone)]
struct Got {
    path: String,
    headers: HeaderMap,
    body: Bytes,
    at: Instant,
}

/// A loopback receiver: each path answers with its script of status codes (the last
/// one repeats); `hang` paths never answer in time, `slow` paths answer after [`SLOW`].
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<Got>>>,
    scripts: Arc<Mutex<HashMap<String, Vec<u16>>>>,
}

async fn receive(State(r): State<Receiver>, Path(path): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    r.got.lock().unwrap().push(Got { path: path.clone(), headers, body, at: Instant::now() });
    if path.starts_with("hang") {
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
    if path.starts_with("slow") {
        tokio::time::sleep(SLOW).await;
    }
    let code = {
        let mut s = r.scripts.lock().unwrap();
        let script = s.entry(path).or_insert_with(|| vec![204]);
        if script.len() > 1 {
            script.remove(0)
        } else {
            script[0]
        }
    };
    let status = StatusCode::from_u16(code).unwrap();
    match code {
        429 => (status, [("retry-after", "1")]).into_response(),
        302 => (status, [("location", "http://127.0.0.1:1/elsewhere")]).into_response(),
        _ => status.into_response(),
    }
}

impl Receiver {
    async fn start() -> (Receiver, SocketAddr) {
        let r = Receiver::default();
        let app = axum::Router::new().route("/{path}", axum::routing::post(receive)).with_state(r.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        (r, addr)
    }

    fn script(&self, path: &str, codes: &[u16]) {
        self.scripts.lock().unwrap().insert(path.into(), codes.to_vec());
    }

    fn on(&self, path: &str) -> Vec<Got> {
        self.got.lock().unwrap().iter().filter(|g| g.path == path).cloned().collect()
    }

    async fn wait(&self, path: &str, n: usize) -> Vec<Got> {
        let deadline = Instant::now() + T;
        loop {
            let got = self.on(path);
            if got.len() >= n {
                return got;
            }
            assert!(Instant::now() < deadline, "{path}: got {} requests, wanted {n}", got.len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Every test in this binary uses the same allow-list (the variable is process-wide).
fn allow_loopback() {
    std::env::set_var("STEMQ_WEBHOOK_ALLOW", "127.0.0.1");
}

/// A relay configuration for tests: loopback allowed, short timeout.
fn relay_config(concurrency: usize, schedule_ms: &[u64]) -> stemq_relay::Config {
    stemq_relay::Config {
        schedule: schedule_ms.iter().map(|ms| Duration::from_millis(*ms)).collect(),
        timeout: Duration::from_millis(800),
        max_retry_after: Duration::from_secs(5),
        allow: stemq_webhook::Allowlist::parse("127.0.0.1"),
        concurrency,
        name: "relay-test".into(),
        progress_jobs: 1000,
        ready: None,
    }
}

async fn stack_with_relay() -> Stack {
    allow_loopback();
    let mut stack = Stack::start(StackOptions::default()).await;
    stack.start_relay(relay_config(16, &[0, 200, 300, 400])).await;
    stack
}

/// A relay of its own (stopped with `stop`, not with the stack), watching `memo`.
async fn own_relay(
    stack: &Stack,
    config: stemq_relay::Config,
    memo: stemq_relay::ProgressMemo,
    stop: CancellationToken,
) -> JoinHandle<()> {
    let c = stack.connect_as(stemq_nats::users::RELAY).await;
    tokio::spawn(async move { stemq_relay::serve(c, config, memo, stop).await.expect("relay runs") })
}

fn verify_got(g: &Got, secret: &str) -> Value {
    let id = g.headers["webhook-id"].to_str().unwrap();
    let ts: i64 = g.headers["webhook-timestamp"].to_str().unwrap().parse().unwrap();
    let sig = g.headers["webhook-signature"].to_str().unwrap();
    let secret = Secret::parse(secret).unwrap();
    verify(&secret, id, ts, &g.body, sig, chrono::Utc::now().timestamp()).expect("signature verifies");
    serde_json::from_slice(&g.body).unwrap()
}

async fn submit_with_hook(stack: &Stack, name: &str, url: String, events: Option<Value>) -> JobId {
    let mut body = job_body(stack, name, None);
    body["webhook"] = json!({"url": url});
    if let Some(e) = events {
        body["webhook"]["events"] = e;
    }
    let (code, b) = stack.submit(&body).await;
    assert_eq!(code, 202, "{b}");
    job_id(&b)
}

async fn deliveries(stack: &Stack, id: &JobId, n: usize, attempts: usize) -> Value {
    let deadline = Instant::now() + T;
    loop {
        let (code, d) = stack.get(&format!("/v1/separations/{id}/deliveries")).await;
        assert_eq!(code, 200);
        let ds = d["deliveries"].as_array().unwrap();
        let total: usize = ds.iter().map(|x| x["attempts"].as_array().unwrap().len()).sum();
        if ds.len() >= n && total >= attempts {
            return d;
        }
        assert!(Instant::now() < deadline, "deliveries: {d:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_completion_webhook_recorded_and_replayable() {
    let stack = stack_with_relay().await;
    let (rx, addr) = Receiver::start().await;
    let (code, s) = stack.get("/v1/webhooks/secret").await;
    assert_eq!(code, 200);
    let secret = s["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"));

    let id = submit_with_hook(&stack, "hooked", format!("http://{addr}/ok"), None).await;
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Succeeded);
    let got = rx.wait("ok", 1).await;
    let payload = verify_got(&got[0], &secret);
    assert_eq!(payload["type"], "io.stemq.job.succeeded.v1");
    assert_eq!(payload["data"]["job_id"], id.as_str());
    assert_eq!(payload["data"]["status"], "succeeded");
    assert_eq!(payload["data"]["outputs"].as_array().unwrap().len(), 4);
    assert_eq!(got[0].headers["content-type"], "application/json");

    let d = deliveries(&stack, &id, 1, 1).await;
    let first = &d["deliveries"][0];
    assert_eq!(first["n"], 1);
    assert_eq!(first["result"], "delivered");
    assert_eq!(first["attempts"][0]["status_code"], 204);
    assert!(first["attempts"][0]["latency_ms"].is_u64());
    assert_eq!(first["webhook_id"], got[0].headers["webhook-id"].to_str().unwrap());

    // Replay: the same webhook-id, signed again.
    let (code, r) = stack.post_raw(&format!("/v1/separations/{id}/deliveries/1/replay"), vec![]).await;
    assert_eq!(code, 202, "{r}");
    let got = rx.wait("ok", 2).await;
    assert_eq!(got[1].headers["webhook-id"], got[0].headers["webhook-id"]);
    verify_got(&got[1], &secret);
    let d = deliveries(&stack, &id, 1, 2).await;
    assert_eq!(d["deliveries"][0]["attempts"][1]["replay"], true);
    let (code, _) = stack.post_raw(&format!("/v1/separations/{id}/deliveries/9/replay"), vec![]).await;
    assert_eq!(code, 404);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn started_and_progress_when_asked() {
    let stack = stack_with_relay().await;
    let (rx, addr) = Receiver::start().await;
    let mut body = job_body(&stack, "all-events", Some(json!({"sleep_ms": 1500})));
    body["webhook"] = json!({"url": format!("http://{addr}/all"), "events": ["started", "progress", "completed"]});
    let (_, b) = stack.submit(&body).await;
    let id = job_id(&b);
    stack.wait_terminal(&id, T).await;
    let deadline = Instant::now() + T;
    loop {
        let types: Vec<String> = rx
            .on("all")
            .iter()
            .map(|g| serde_json::from_slice::<Value>(&g.body).unwrap()["type"].as_str().unwrap().to_string())
            .collect();
        if types.iter().any(|t| t.ends_with("succeeded.v1")) {
            assert!(types.iter().any(|t| t.ends_with("started.v1")), "{types:?}");
            assert!(types.iter().any(|t| t.ends_with("progress.v1")), "{types:?}");
            break;
        }
        assert!(Instant::now() < deadline, "{types:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_on_5xx_and_429_honouring_retry_after() {
    let stack = stack_with_relay().await;
    let (rx, addr) = Receiver::start().await;
    rx.script("flaky", &[503, 429, 200]);
    let id = submit_with_hook(&stack, "flaky", format!("http://{addr}/flaky"), None).await;
    let got = rx.wait("flaky", 3).await;
    let ids: Vec<_> = got.iter().map(|g| g.headers["webhook-id"].clone()).collect();
    assert!(ids.iter().all(|x| *x == ids[0]), "webhook-id is stable across retries");
    // Retry-After: 1 beats the 300 ms of the schedule.
    assert!(got[2].at - got[1].at >= Duration::from_millis(950), "{:?}", got[2].at - got[1].at);
    let d = deliveries(&stack, &id, 1, 3).await;
    let codes: Vec<_> = d["deliveries"][0]["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["status_code"].as_u64().unwrap(), a["result"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(codes, [(503, "retrying".into()), (429, "retrying".into()), (200, "delivered".into())]);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_disables_redirect_fails_and_the_schedule_is_bounded() {
    let stack = stack_with_relay().await;
    let (rx, addr) = Receiver::start().await;
    rx.script("gone", &[410]);
    rx.script("moved", &[302]);
    rx.script("down", &[500]);
    let gone = submit_with_hook(&stack, "g1", format!("http://{addr}/gone"), None).await;
    let d = deliveries(&stack, &gone, 1, 1).await;
    assert_eq!(d["deliveries"][0]["result"], "disabled");
    // The next job to the same URL is not sent at all.
    let again = submit_with_hook(&stack, "g2", format!("http://{addr}/gone"), None).await;
    let d = deliveries(&stack, &again, 1, 1).await;
    assert_eq!(d["deliveries"][0]["result"], "disabled");
    assert!(d["deliveries"][0]["attempts"][0]["status_code"].is_null());
    assert_eq!(rx.on("gone").len(), 1);
    let (_, s) = stack.get("/v1/webhooks/secret").await;
    assert!(s["disabled_urls"].to_string().contains("/gone"));

    let moved = submit_with_hook(&stack, "m", format!("http://{addr}/moved"), None).await;
    let d = deliveries(&stack, &moved, 1, 1).await;
    assert_eq!(d["deliveries"][0]["result"], "failed");
    assert_eq!(d["deliveries"][0]["attempts"][0]["status_code"], 302);

    let down = submit_with_hook(&stack, "d", format!("http://{addr}/down"), None).await;
    let d = deliveries(&stack, &down, 1, 4).await;
    assert_eq!(d["deliveries"][0]["attempts"].as_array().unwrap().len(), 4);
    assert_eq!(d["deliveries"][0]["result"], "failed");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(rx.on("down").len(), 4, "no attempt after the schedule ends");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_receiver_slows_no_worker() {
    let stack = stack_with_relay().await;
    let (rx, addr) = Receiver::start().await;
    let t0 = Instant::now();
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(submit_with_hook(&stack, &format!("dead{i}"), format!("http://{addr}/hang{i}"), None).await);
    }
    for id in &ids {
        assert_eq!(stack.wait_terminal(id, T).await.status, JobStatus::Succeeded);
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // The relay times out and retries each of them, concurrently.
    let d = deliveries(&stack, &ids[0], 1, 2).await;
    assert_eq!(d["deliveries"][0]["attempts"][0]["error"], "timeout");
    assert!(!rx.on("hang3").is_empty());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_signs_with_both_secrets_during_the_grace_period() {
    let stack = stack_with_relay().await;
    let (rx, addr) = Receiver::start().await;
    let (_, old) = stack.get("/v1/webhooks/secret").await;
    let (code, new) = stack.post_raw("/v1/webhooks/secret/rotate", vec![]).await;
    assert_eq!(code, 200);
    assert_ne!(old["secret"], new["secret"]);
    assert_eq!(new["previous"], old["secret"]);
    assert!(new["previous_valid_until"].is_string());
    let id = submit_with_hook(&stack, "rot", format!("http://{addr}/rot"), None).await;
    stack.wait_terminal(&id, T).await;
    let got = rx.wait("rot", 1).await;
    let sig = got[0].headers["webhook-signature"].to_str().unwrap();
    assert_eq!(sig.split(' ').count(), 2, "{sig}");
    verify_got(&got[0], old["secret"].as_str().unwrap());
    verify_got(&got[0], new["secret"].as_str().unwrap());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_urls_are_checked_against_ssrf_at_submit() {
    allow_loopback();
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    for url in [
        "http://10.0.0.1/h",
        "https://169.254.169.254/latest/meta-data",
        "https://192.168.1.10/h",
        "https://[::1]/h",
        "http://93.184.216.34/h",
        "ftp://127.0.0.1/h",
        "not a url",
    ] {
        let mut body = job_body(&stack, "ssrf", None);
        body["webhook"] = json!({"url": url});
        let (code, b) = stack.submit(&body).await;
        assert_eq!(code, 422, "{url}: {b}");
        assert_eq!(b["error"]["field"], "webhook", "{b}");
    }
    let mut body = job_body(&stack, "ssrf-ok", None);
    body["webhook"] = json!({"url": "http://127.0.0.1:9/h"});
    let (code, b) = stack.submit(&body).await;
    assert_eq!(code, 202, "{b}");
    stack.shutdown().await;
}

/// `(attempt, status_code, result)` of every attempt of delivery `n` (from 0).
fn attempts_of(d: &Value, n: usize) -> Vec<(u64, Option<u64>, String)> {
    d["deliveries"][n]["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["attempt"].as_u64().unwrap(), a["status_code"].as_u64(), a["result"].as_str().unwrap().into()))
        .collect()
}

/// Issue 11: a retry waits on the queue, not in a relay. The relay is stopped while a
/// delivery waits for its second attempt; a new relay makes that attempt, with the same
/// `webhook-id` and the attempt number read from the log (2, not 1 again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_retry_survives_a_relay_restart() {
    allow_loopback();
    let stack = Stack::start(StackOptions::default()).await;
    let (rx, addr) = Receiver::start().await;
    rx.script("later", &[500, 200]);
    let config = relay_config(16, &[0, 1500, 300]);
    let memo = stemq_relay::ProgressMemo::new(100);
    let first = CancellationToken::new();
    let relay = own_relay(&stack, config.clone(), memo.clone(), first.clone()).await;
    let id = submit_with_hook(&stack, "restart", format!("http://{addr}/later"), None).await;
    let got = rx.wait("later", 1).await;
    let d = deliveries(&stack, &id, 1, 1).await;
    assert_eq!(attempts_of(&d, 0), [(1, Some(500), "retrying".to_string())]);
    // Stop the relay while the retry is pending (due about 1.5 s after the first try).
    first.cancel();
    tokio::time::timeout(Duration::from_secs(10), relay).await.expect("relay stops").unwrap();
    let stopped = got[0].at.elapsed();
    assert!(stopped < Duration::from_millis(1500), "stopped {stopped:?} after the first attempt: too late to test");
    let second = CancellationToken::new();
    let relay = own_relay(&stack, config, memo, second.clone()).await;
    let got = rx.wait("later", 2).await;
    assert_eq!(got[1].headers["webhook-id"], got[0].headers["webhook-id"]);
    let gap = got[1].at - got[0].at;
    assert!(gap >= Duration::from_millis(1400), "the retry kept its delay: {gap:?}");
    let d = deliveries(&stack, &id, 1, 2).await;
    assert_eq!(attempts_of(&d, 0), [(1, Some(500), "retrying".to_string()), (2, Some(200), "delivered".to_string())]);
    eprintln!("retry after a relay restart: {gap:?} after the first attempt (scheduled 1.5-1.8 s)");
    second.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), relay).await;
    stack.shutdown().await;
}

/// Issue 11: receivers that keep failing hold no relay slot while they wait for their
/// retries, so with 2 slots and 4 failing receivers a healthy one is still served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_receiver_stalls_no_other_webhook() {
    allow_loopback();
    let stack = Stack::start(StackOptions::default()).await;
    let (rx, addr) = Receiver::start().await;
    let stop = CancellationToken::new();
    let relay = own_relay(
        &stack,
        relay_config(2, &[0, 3000, 3000, 3000, 3000, 3000]),
        stemq_relay::ProgressMemo::new(100),
        stop.clone(),
    )
    .await;
    for i in 0..4 {
        rx.script(&format!("fail{i}"), &[500]);
        submit_with_hook(&stack, &format!("failing{i}"), format!("http://{addr}/fail{i}"), None).await;
    }
    // Both slots have met a failing receiver.
    let deadline = Instant::now() + T;
    while (0..4).map(|i| rx.on(&format!("fail{i}")).len()).sum::<usize>() < 2 {
        assert!(Instant::now() < deadline, "the failing receivers were never called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let submitted = Instant::now();
    let ok = submit_with_hook(&stack, "healthy", format!("http://{addr}/healthy"), None).await;
    stack.wait_terminal(&ok, T).await;
    let ended = Instant::now();
    let deadline = ended + Duration::from_secs(2);
    while rx.on("healthy").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the healthy receiver waited more than 2 s behind failing ones (calls to failing: {})",
            (0..4).map(|i| rx.on(&format!("fail{i}")).len()).sum::<usize>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at = rx.on("healthy")[0].at;
    eprintln!(
        "healthy webhook {:?} after submit (job ended in the view after {:?}); 4 failing receivers, 2 slots",
        at - submitted,
        ended - submitted
    );
    // The failing ones are still retried, on the queue.
    for i in 0..4 {
        rx.wait(&format!("fail{i}"), 2).await;
    }
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), relay).await;
    stack.shutdown().await;
}

/// Issue 11: the relay's per-job progress memory is emptied when the job ends, even when
/// the job's webhook asks for progress only (no `completed` delivery).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_memory_is_cleared_for_a_progress_only_filter() {
    allow_loopback();
    let stack = Stack::start(StackOptions::default()).await;
    let (rx, addr) = Receiver::start().await;
    let memo = stemq_relay::ProgressMemo::new(100);
    let stop = CancellationToken::new();
    let relay = own_relay(&stack, relay_config(16, &[0, 200]), memo.clone(), stop.clone()).await;
    let mut body = job_body(&stack, "progress-only", Some(json!({"sleep_ms": 1500})));
    body["webhook"] = json!({"url": format!("http://{addr}/prog"), "events": ["progress"]});
    let (code, b) = stack.submit(&body).await;
    assert_eq!(code, 202, "{b}");
    let id = job_id(&b);
    stack.wait_terminal(&id, T).await;
    let got = rx.wait("prog", 1).await;
    assert!(got.iter().all(|g| verify_type(g).ends_with("progress.v1")));
    let deadline = Instant::now() + Duration::from_secs(10);
    while memo.contains(&id) {
        assert!(Instant::now() < deadline, "the relay still remembers progress of an ended job ({memo:?})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(memo.is_empty(), "{memo:?}");
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), relay).await;
    stack.shutdown().await;
}

fn verify_type(g: &Got) -> String {
    serde_json::from_slice::<Value>(&g.body).unwrap()["type"].as_str().unwrap().to_string()
}

/// Runs `stemq webhooks ARGS` against the stack's server.
fn stemq_webhooks(stack: &Stack, args: &[&str]) -> std::process::Output {
    std::process::Command::new(Stack::stemq_bin())
        .arg("webhooks")
        .args(args)
        .env("NATS_URL", stack.server.url())
        .env("STEMQ_NATS_CREDS", stack.server.credentials(stemq_nats::users::OPERATOR))
        .env("STEMQ_LOG_FORMAT", "json")
        .output()
        .expect("run stemq webhooks")
}

/// Issue 11: a URL that a 410 disabled can be enabled again, over HTTP and from the
/// command line; the next event is then delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_url_can_be_enabled_again_over_http_and_the_cli() {
    let stack = stack_with_relay().await;
    let (rx, addr) = Receiver::start().await;
    for (path, via_cli) in [("gone-http", false), ("gone-cli", true)] {
        rx.script(path, &[410, 204]);
        let url = format!("http://{addr}/{path}");
        let first = submit_with_hook(&stack, &format!("{path}-1"), url.clone(), None).await;
        let d = deliveries(&stack, &first, 1, 1).await;
        assert_eq!(d["deliveries"][0]["result"], "disabled");
        let (_, s) = stack.get("/v1/webhooks/secret").await;
        assert!(s["disabled_urls"].as_array().unwrap().contains(&json!(url)), "{s}");

        if via_cli {
            let out = stemq_webhooks(&stack, &["enable", &url, "--owner", stemq_tests::TEST_OWNER]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
            assert!(stdout.contains("enabled again"), "{stdout}");
        } else {
            let (code, b) = stack.post_raw("/v1/webhooks/enable", json!({ "url": url }).to_string().into_bytes()).await;
            assert_eq!(code, 200, "{b}");
            assert_eq!(b["was_disabled"], true, "{b}");
            assert!(!b["disabled_urls"].as_array().unwrap().contains(&json!(url)), "{b}");
        }
        let (_, s) = stack.get("/v1/webhooks/secret").await;
        assert!(!s["disabled_urls"].as_array().unwrap().contains(&json!(url)), "{s}");

        let second = submit_with_hook(&stack, &format!("{path}-2"), url.clone(), None).await;
        let d = deliveries(&stack, &second, 1, 1).await;
        assert_eq!(d["deliveries"][0]["result"], "delivered", "{d:#}");
        assert_eq!(rx.on(path).len(), 2);
    }
    let (code, b) = stack.post_raw("/v1/webhooks/enable", b"{}".to_vec()).await;
    assert_eq!(code, 422, "{b}");
    assert_eq!(b["error"]["field"], "url");
    let (_, doc) = stack.get("/openapi.json").await;
    assert!(doc["paths"]["/v1/webhooks/enable"]["post"].is_object());
    stack.shutdown().await;
}

/// Issue 12: two relays share the `relay` consumer, whose `ack_wait` (1 s) is shorter
/// than the receivers take to answer (1.5 s): every event is handed out again while its
/// attempt is still in flight, to the other relay or to the same one. Each attempt is
/// still sent once and recorded once, and each event is delivered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_12_two_relays_never_send_an_attempt_twice() {
    allow_loopback();
    let stack = Stack::start(StackOptions { workers: 2, ..Default::default() }).await;
    {
        let s = stack.js.get_stream(stemq_nats::JOBS_STREAM).await.unwrap();
        let mut config = s.consumer_info(stemq_nats::RELAY_CONSUMER).await.unwrap().config.clone();
        config.ack_wait = Duration::from_secs(1);
        s.create_consumer(config).await.unwrap();
    }
    let (rx, addr) = Receiver::start().await;
    let stop = CancellationToken::new();
    let mut relays = Vec::new();
    for name in ["relay-a", "relay-b"] {
        let config = stemq_relay::Config {
            timeout: Duration::from_secs(5),
            name: name.into(),
            ..relay_config(16, &[0, 300, 300, 300])
        };
        relays.push(own_relay(&stack, config, stemq_relay::ProgressMemo::new(100), stop.clone()).await);
    }
    const JOBS: usize = 10;
    let mut ids = Vec::new();
    for i in 0..JOBS {
        // Half the receivers fail their first request: a retry, also slow, follows.
        let path = if i % 2 == 0 { format!("slow-ok{i}") } else { format!("slow-flaky{i}") };
        if i % 2 == 1 {
            rx.script(&path, &[500, 204]);
        }
        let events = json!(["started", "completed"]);
        ids.push(
            submit_with_hook(&stack, &format!("two-relays-{i}"), format!("http://{addr}/{path}"), Some(events)).await,
        );
    }
    for id in &ids {
        stack.wait_terminal(id, T).await;
    }
    // Every delivery is over when the relay consumer has nothing left to hand out.
    let deadline = Instant::now() + T;
    loop {
        let s = stack.js.get_stream(stemq_nats::JOBS_STREAM).await.unwrap();
        let info = s.consumer_info(stemq_nats::RELAY_CONSUMER).await.unwrap();
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the relays never finished: {info:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each job has one `started` and one outcome: any hand-out beyond those is a redelivery.
    let handed_out = {
        let s = stack.js.get_stream(stemq_nats::JOBS_STREAM).await.unwrap();
        s.consumer_info(stemq_nats::RELAY_CONSUMER).await.unwrap().delivered.consumer_sequence
    };
    let redelivered = handed_out.saturating_sub(2 * JOBS as u64);
    let got = rx.got.lock().unwrap().clone();
    let mut problems = Vec::new();
    let mut deliveries = 0;
    for id in &ids {
        let recorded = stemq_webhook::delivery_attempts(&stack.js, id, 0).await.unwrap();
        let mut by_hook: std::collections::BTreeMap<String, Vec<(u32, String)>> = Default::default();
        for r in &recorded {
            assert!(!r.attempt.replay);
            by_hook
                .entry(r.attempt.webhook_id.clone())
                .or_default()
                .push((r.attempt.attempt, format!("{:?}", r.attempt.result)));
        }
        if by_hook.len() != 2 {
            problems.push(format!("job {id}: {} deliveries recorded, wanted started and completed", by_hook.len()));
        }
        for (hook, attempts) in &by_hook {
            deliveries += 1;
            let numbers: Vec<u32> = attempts.iter().map(|a| a.0).collect();
            let expected: Vec<u32> = (1..=attempts.len() as u32).collect();
            if numbers != expected {
                problems.push(format!("{hook}: attempts recorded {numbers:?}, wanted each once: {expected:?}"));
            }
            if attempts.iter().filter(|a| a.1 == "Delivered").count() != 1 {
                problems.push(format!("{hook}: {attempts:?}, wanted exactly one delivered"));
            }
            let sent = got.iter().filter(|g| g.headers["webhook-id"] == hook.as_str()).count();
            if sent != attempts.len() {
                problems.push(format!("{hook}: sent {sent} times, {} attempts recorded", attempts.len()));
            }
        }
    }
    eprintln!("{deliveries} deliveries, {} requests, {redelivered} events handed out again", got.len());
    assert!(redelivered > 0, "no event was handed out twice: the test shows nothing");
    assert!(problems.is_empty(), "{} problems:\n{}", problems.len(), problems.join("\n"));
    stop.cancel();
    for r in relays {
        let _ = tokio::time::timeout(Duration::from_secs(10), r).await;
    }
    stack.shutdown().await;
}
