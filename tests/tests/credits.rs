//! Credits, end to end against a real nats-server: reserved before the engine, settled
//! at the actual audio on success, refunded in full otherwise, refused with 402 at
//! submit when the cost is known and cannot be paid, and exact under faults: workers
//! and the projector killed mid-run and the server restarted while 300 jobs of mixed
//! outcomes run.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use stemq_accounts::auth::{self, Limits, Role};
use stemq_accounts::ledger::{self, fold, Ledger, Movement, Prices, MICRO};
use stemq_core::request::Model;
use stemq_core::{JobId, JobStatus};
use stemq_tests::{job_body, job_id, signal, wait_exit, Stack, StackOptions, SIGKILL, SIGTERM, TEST_OWNER};

const T: Duration = Duration::from_secs(30);

/// Turns credits on: `dsp` at `per_minute` credits a minute of audio.
async fn set_prices(stack: &Stack, per_minute: f64, enforce: bool) -> Prices {
    let p = Prices {
        unit: "credit".into(),
        per_audio_minute: [("dsp".to_string(), per_minute)].into_iter().collect(),
        enforce,
    };
    let kv = stack.js.get_key_value(ledger::CONFIG_BUCKET).await.unwrap();
    kv.put(ledger::PRICES_KEY, serde_json::to_vec(&p).unwrap().into()).await.unwrap();
    // Readers cache the list for 2 s.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    p
}

async fn call(stack: &Stack, key: &str, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut r = reqwest::Client::new().request(method, stack.url(path)).bearer_auth(key);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let resp = r.send().await.unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap_or(Value::Null))
}

/// Waits until the owner has no open reservation (the ledger consumer caught up).
async fn settled(ledger: &Ledger, owner: &str, timeout: Duration) -> ledger::Account {
    let t0 = Instant::now();
    loop {
        let (a, _) = ledger.account(owner).await.unwrap();
        if a.open.is_empty() {
            return a;
        }
        assert!(t0.elapsed() < timeout, "reservations still open after {timeout:?}: {:?}", a.open.keys());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_pay_for_what_they_separate_and_nothing_else() {
    let stack = Stack::start(StackOptions { workers: 2, ..Default::default() }).await;
    let ledger = Ledger::new(stack.js.clone());

    // Off by default: a job runs and nothing moves.
    let (code, v) = stack.submit(&job_body(&stack, "free", None)).await;
    assert_eq!(code, 202, "{v}");
    assert_eq!(stack.wait_terminal(&job_id(&v), T).await.status, JobStatus::Succeeded);
    assert_eq!(ledger.account(TEST_OWNER).await.unwrap().1, 0, "credits are off: no ledger entry");
    // With nothing in the ledger, the closer pulls no outcome at all (it would cost each
    // job a delivery and an ack); it starts once the ledger has an entry (below).
    let mut closer: async_nats::jetstream::consumer::PullConsumer =
        stack.js.get_consumer_from_stream(ledger::LEDGER_CONSUMER, stemq_nats::JOBS_STREAM).await.unwrap();
    let info = closer.info().await.unwrap().clone();
    assert_eq!(
        (info.delivered.stream_sequence, info.num_pending),
        (0, 1),
        "an empty ledger's closer pulled outcomes: {info:?}"
    );

    // 6 credits a minute: the fake engine's 10 s cost 1 credit.
    let prices = set_prices(&stack, 6.0, true).await;
    let acme = auth::create(&stack.keys, "acme", Role::Submit, Limits::NONE, "t").await.unwrap().0.expose();
    ledger.grant("acme", 3 * MICRO + MICRO / 2, "test", Some("start".into()), "g1").await.unwrap();
    let body = |name: &str, fake: Value| json!({"audio_uri": stack.store.uri(&format!("uploads/acme/{name}.wav")), "model": "dsp", "metadata": {"fake": fake}});
    let submit = |b: Value| {
        let acme = acme.clone();
        let stack = &stack;
        async move {
            let (code, v) = call(stack, &acme, reqwest::Method::POST, "/v1/separations", Some(b)).await;
            assert_eq!(code, 202, "{v}");
            job_id(&v)
        }
    };

    // A success is charged its audio.
    let ok = submit(body("ok", json!({"sleep_ms": 100}))).await;
    assert_eq!(stack.wait_terminal(&ok, T).await.status, JobStatus::Succeeded);
    // A failure costs nothing.
    let bad = submit(body("bad", json!({"fail_permanent": true}))).await;
    assert_eq!(stack.wait_terminal(&bad, T).await.status, JobStatus::Failed);
    // A job cancelled while it runs costs nothing.
    let long = submit(body("long", json!({"sleep_ms": 20_000}))).await;
    stack.wait_status(&long, JobStatus::Running, T).await;
    let (code, _) = call(&stack, &acme, reqwest::Method::POST, &format!("/v1/separations/{long}/cancel"), None).await;
    assert!(code == 200 || code == 202);
    assert_eq!(stack.wait_terminal(&long, T).await.status, JobStatus::Cancelled);
    let a = settled(&ledger, "acme", T).await;
    assert_eq!((a.balance, a.charged, a.reserved), (2 * MICRO + MICRO / 2, MICRO, 0), "{a:?}");
    assert_eq!(a.refunded, 2 * MICRO, "the failure's and the cancelled job's reservations came back: {a:?}");

    // 30 s cost 3 credits; 2.5 are available: refused before the engine runs (its 20 s
    // of work never start).
    let t0 = Instant::now();
    let poor = submit(body("poor", json!({"sleep_ms": 20_000, "audio_ms": 30_000}))).await;
    let v = stack.wait_terminal(&poor, T).await;
    assert_eq!(v.status, JobStatus::Failed);
    assert_eq!(v.error.as_ref().map(|e| e.code.as_str()), Some("insufficient_credits"), "{v:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "the engine ran: {:?}", t0.elapsed());

    // The account as the owner sees it.
    let (code, acc) = call(&stack, &acme, reqwest::Method::GET, "/v1/account", None).await;
    assert_eq!(code, 200, "{acc}");
    assert_eq!((acc["balance"].as_f64(), acc["available"].as_f64()), (Some(2.5), Some(2.5)), "{acc}");
    assert_eq!((acc["credits_on"].as_bool(), acc["enforced"].as_bool()), (Some(true), Some(true)), "{acc}");
    let usage = &acc["usage"][0];
    assert_eq!((usage["model"].as_str(), usage["jobs"].as_u64()), (Some("dsp"), Some(1)), "{acc}");
    assert_eq!((usage["audio_seconds"].as_f64(), usage["credits"].as_f64()), (Some(10.0), Some(1.0)), "{acc}");
    // A period without the job shows no usage; a bad time is a 422.
    let (_, old) = call(&stack, &acme, reqwest::Method::GET, "/v1/account?to=2020-01-01T00:00:00Z", None).await;
    assert_eq!(old["usage"], json!([]), "{old}");
    let (code, _) = call(&stack, &acme, reqwest::Method::GET, "/v1/account?from=yesterday", None).await;
    assert_eq!(code, 422);
    // Another owner's account is the operator's business only.
    let (code, _) = call(&stack, &acme, reqwest::Method::GET, "/v1/account?owner=test", None).await;
    assert_eq!(code, 403);
    let (code, other) = call(&stack, &stack.key, reqwest::Method::GET, "/v1/account?owner=acme", None).await;
    assert_eq!((code, other["balance"].as_f64()), (200, Some(2.5)), "{other}");

    // An upload whose length is known and cannot be paid: 402 before anything is queued.
    let up = stack.upload_song(&acme, "minute.wav", 60.0).await;
    assert_eq!(up["duration_ms"].as_u64(), Some(60_000), "{up}");
    let submit_upload = || {
        let body = json!({"audio_uri": up["audio_uri"], "model": "dsp"});
        call(&stack, &acme, reqwest::Method::POST, "/v1/separations", Some(body))
    };
    let (code, refused) = submit_upload().await;
    assert_eq!((code, refused["error"]["code"].as_str()), (402, Some("insufficient_credits")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("nothing was queued"), "{refused}");
    // The upload's name stands for its store URI, which the job id is derived from.
    let stored = stack.store.uri(&format!("uploads/acme/{}.wav", up["sha256"].as_str().unwrap()));
    let would_be = stemq_core::JobRequest::from_slice(
        serde_json::to_vec(&json!({"audio_uri": stored, "model": "dsp"})).unwrap().as_slice(),
    )
    .unwrap()
    .normalize("acme")
    .unwrap()
    .job_id();
    assert!(stack.view(&would_be).await.is_none(), "a refused job must not be queued");
    // With credits, it goes through.
    ledger.grant("acme", 10 * MICRO, "test", None, "g2").await.unwrap();
    let (code, v) = submit_upload().await;
    assert_eq!(code, 202, "{v}");
    assert_eq!(job_id(&v), would_be, "the job the refusal did not queue");
    assert_eq!(stack.wait_terminal(&job_id(&v), T).await.status, JobStatus::Succeeded);
    let a = settled(&ledger, "acme", T).await;
    assert_eq!(a.charged, MICRO + prices.cost(Model::Dsp, 10_000), "the fake engine's 10 s: {a:?}");

    // The account is the fold of the movements.
    let entries = ledger.entries("acme", None).await.unwrap();
    assert_eq!(fold(&entries), ledger.account("acme").await.unwrap().0);
    stack.shutdown().await;
}

/// Issue 39, finding 1: a worker's credentials could write `{}` on an owner's ledger,
/// after which `GET /v1/account` answered 503 and, with prices enforced, the ingress
/// accepted that owner's submits with no credits (it could not read the account and
/// let the worker decide). Now the worker may write only reservations, a misfit there
/// is left out of the account (which reads as before), and a submit whose account
/// cannot be read at all is refused (503), never let through unpaid.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broken_ledger_entry_neither_bricks_an_account_nor_lets_an_unpaid_submit_through() {
    use stemq_nats::users::WORKER;
    // No workers: whatever the ingress accepts stays queued.
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    set_prices(&stack, 6.0, true).await;
    let alice = auth::create(&stack.keys, "alice", Role::Submit, Limits::NONE, "t").await.unwrap().0.expose();
    let up = stack.upload_song(&alice, "minute.wav", 60.0).await;
    let submit = || {
        let body = json!({"audio_uri": up["audio_uri"], "model": "dsp"});
        call(&stack, &alice, reqwest::Method::POST, "/v1/separations", Some(body))
    };
    // The worker's credentials write what they may: their own kind's subject.
    let worker = async_nats::jetstream::new(stack.connect_as(WORKER).await);
    let forged_grant = json!({"owner": "alice", "time": chrono::Utc::now(),
        "movement": {"kind": "granted", "amount": 1_000_000 * MICRO, "by": "worker"}});
    for body in [b"{}".to_vec(), serde_json::to_vec(&forged_grant).unwrap()] {
        let subject = ledger::ledger_subject("alice", ledger::Kind::Reserved);
        worker.publish(subject, body.into()).await.unwrap().await.expect("a worker writes reservations");
    }
    let (code, acc) = call(&stack, &alice, reqwest::Method::GET, "/v1/account", None).await;
    assert_eq!((code, acc["balance"].as_f64(), acc["available"].as_f64()), (200, Some(0.0), Some(0.0)), "{acc}");
    let (code, refused) = submit().await;
    assert_eq!((code, refused["error"]["code"].as_str()), (402, Some("insufficient_credits")), "{refused}");
    // The ledger cannot be read at all (its stream is gone): refused, nothing queued.
    stack.js.delete_stream(ledger::LEDGER_STREAM).await.unwrap();
    let (code, refused) = submit().await;
    assert_eq!((code, refused["error"]["code"].as_str()), (503, Some("unavailable")), "{refused}");
    assert_eq!(stack.count_on("stemq.jobs.*.requested.alice.>").await, 0, "a submit of alice was queued");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_attempt_finds_the_first_attempts_reservation_and_is_told_so() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let prices = set_prices(&stack, 6.0, false).await;
    let ledger = Ledger::new(stack.js.clone());
    let id = JobId::parse(&"c4".repeat(32)).unwrap();
    let first = ledger.reserve(TEST_OWNER, &id, Model::Dsp, 30_000, &prices).await.unwrap();
    let second = ledger.reserve(TEST_OWNER, &id, Model::Dsp, 30_000, &prices).await.unwrap();
    assert!(first.opened, "the first attempt opens the reservation");
    assert!(!second.opened, "a redelivery finds it open: {second:?}");
    assert_eq!(first.open, second.open);
    let (account, _) = ledger.account(TEST_OWNER).await.unwrap();
    assert_eq!(account.open.len(), 1, "one reservation: {:?}", account.open);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_ledger_is_exact_when_workers_the_projector_and_the_server_die() {
    const JOBS: usize = 300;
    let options = StackOptions { workers: 0, projector: false, ..Default::default() };
    let mut stack = Stack::start(options).await;
    let ledger = Ledger::new(stack.js.clone());
    let prices = set_prices(&stack, 6.0, true).await;
    ledger.grant(TEST_OWNER, 100_000 * MICRO, "test", None, "fault").await.unwrap();
    let mut workers: Vec<_> = (0..3).map(|i| stack.spawn_worker(&format!("w{i}"), &[])).collect();
    let mut projector = stack.spawn_projector("p0");

    // Mixed outcomes: successes of many lengths, permanent failures, dead letters
    // (transient failures past max_deliver), and cancels.
    let mut audio = HashMap::new();
    let mut ids = Vec::new();
    for i in 0..JOBS {
        let audio_ms = 1_000 + (i as u64 * 7_919) % 50_000;
        let fake = match i % 10 {
            0 => json!({"fail_permanent": true, "audio_ms": audio_ms}),
            1 => json!({"fail_transient": 99, "audio_ms": audio_ms}),
            _ => json!({"sleep_ms": 50 + (i as u64 * 37) % 300, "audio_ms": audio_ms}),
        };
        let (code, v) = stack.submit(&job_body(&stack, &format!("f{i}"), Some(fake))).await;
        assert_eq!(code, 202, "{v}");
        let id = job_id(&v);
        audio.insert(id.clone(), audio_ms);
        ids.push(id);
    }
    let cancel = |i: usize| i % 10 == 2;
    for (i, id) in ids.iter().enumerate() {
        if cancel(i) {
            let _ = stack.request(reqwest::Method::POST, &format!("/v1/separations/{id}/cancel")).send().await;
        }
    }

    // The faults, while the jobs run.
    tokio::time::sleep(Duration::from_secs(2)).await;
    signal(&workers[0], SIGKILL);
    let _ = wait_exit(&mut workers[0], Duration::from_secs(5));
    workers[0] = stack.spawn_worker("w3", &[]);
    signal(&projector, SIGKILL);
    let _ = wait_exit(&mut projector, Duration::from_secs(5));
    tokio::time::sleep(Duration::from_secs(1)).await;
    projector = stack.spawn_projector("p1");
    tokio::time::sleep(Duration::from_secs(1)).await;
    stack.server.restart().expect("the server restarts");
    tokio::time::sleep(Duration::from_secs(2)).await;
    signal(&workers[1], SIGKILL);
    let _ = wait_exit(&mut workers[1], Duration::from_secs(5));
    workers[1] = stack.spawn_worker("w4", &[]);

    // Every job ends, and every reservation is closed.
    let t0 = Instant::now();
    let mut views = HashMap::new();
    for id in &ids {
        let v = stack.wait_terminal(id, Duration::from_secs(240).saturating_sub(t0.elapsed())).await;
        views.insert(id.clone(), v);
    }
    let account = settled(&ledger, TEST_OWNER, Duration::from_secs(60)).await;
    println!("all {JOBS} jobs ended after {:?}", t0.elapsed());

    let entries = ledger.entries(TEST_OWNER, None).await.unwrap();
    assert_eq!(fold(&entries), account, "the balance is the fold of the ledger");
    let (mut reserved, mut closed) = (HashMap::<JobId, i64>::new(), HashSet::<JobId>::new());
    let (mut charged, mut refunded) = (0i64, 0i64);
    for e in &entries {
        match &e.movement {
            Movement::Reserved { job_id, amount, .. } => {
                assert!(reserved.insert(job_id.clone(), *amount).is_none(), "{job_id} reserved twice");
            }
            Movement::Settled { job_id, charged: c, .. } => {
                assert!(closed.insert(job_id.clone()), "{job_id} closed twice");
                assert_eq!(views[job_id].status, JobStatus::Succeeded, "{job_id} charged but not succeeded");
                assert_eq!(*c, prices.cost(Model::Dsp, audio[job_id]), "{job_id} charged its audio");
                charged += c;
            }
            Movement::Refunded { job_id, amount, .. } | Movement::Released { job_id, amount, .. } => {
                assert!(closed.insert(job_id.clone()), "{job_id} closed twice");
                assert_ne!(views[job_id].status, JobStatus::Succeeded, "{job_id} refunded but succeeded");
                refunded += amount;
            }
            Movement::Granted { .. } => {}
        }
    }
    let succeeded: Vec<&JobId> = ids.iter().filter(|id| views[*id].status == JobStatus::Succeeded).collect();
    let expected: i64 = succeeded.iter().map(|id| prices.cost(Model::Dsp, audio[*id])).sum();
    assert_eq!(charged, expected, "charged = the sum over succeeded jobs");
    assert!(succeeded.iter().all(|id| closed.contains(*id)), "every success was settled");
    let others: i64 = reserved.iter().filter(|(id, _)| views[*id].status != JobStatus::Succeeded).map(|(_, a)| a).sum();
    assert_eq!(refunded, others, "refunded = what the other jobs had set aside");
    assert_eq!(reserved.len(), closed.len(), "every reservation was closed");
    assert_eq!(account.balance, 100_000 * MICRO - expected);
    let by_status = views.values().fold(HashMap::new(), |mut m, v| {
        *m.entry(v.status.as_str()).or_insert(0) += 1;
        m
    });
    println!("outcomes: {by_status:?}; {} reservations, charged {charged}, refunded {refunded}", reserved.len());
    assert!(by_status.len() >= 3, "mixed outcomes: {by_status:?}");

    for mut w in workers.into_iter().chain([projector]) {
        signal(&w, SIGTERM);
        if wait_exit(&mut w, Duration::from_secs(20)).is_none() {
            let _ = w.kill();
        }
    }
    stack.shutdown().await;
}

/// The operators' commands: set the prices from `nats/prices.json`, grant, show, log,
/// usage; a job's charge shows in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operators_grant_and_read_credits_from_the_command_line() {
    let stack = Stack::start(StackOptions { workers: 1, ..Default::default() }).await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(Stack::stemq_bin())
            .args(args)
            .current_dir(&root)
            .env("STEMQ_DATA_DIR", stack.dir.path())
            .env("NATS_URL", stack.server.url())
            .env("STEMQ_NATS_CREDS", stack.server.credentials(stemq_nats::users::OPERATOR))
            .env_remove("STEMQ_API")
            .output()
            .unwrap();
        let (so, se) =
            (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string());
        assert!(out.status.success(), "stemq {args:?} failed:\n{so}\n{se}");
        so
    };
    assert!(cli(&["credits", "prices", "show"]).contains("credits are off"));
    assert!(cli(&["credits", "prices", "set", "nats/prices.json"]).contains("credits are on (enforced)"));
    let out = cli(&["credits", "grant", TEST_OWNER, "12.5", "--note", "welcome"]);
    assert!(out.contains("balance 12.500000"), "{out}");
    let out = cli(&["credits", "grant", TEST_OWNER, "-2.5"]);
    assert!(out.contains("balance 10.000000"), "{out}");
    tokio::time::sleep(Duration::from_millis(2100)).await; // the workers' price cache
    let (code, v) = stack.submit(&job_body(&stack, "cli", None)).await;
    assert_eq!(code, 202, "{v}");
    assert_eq!(stack.wait_terminal(&job_id(&v), T).await.status, JobStatus::Succeeded);
    let ledger = Ledger::new(stack.js.clone());
    let a = settled(&ledger, TEST_OWNER, T).await;
    // nats/prices.json: dsp at 0.1 a minute; the fake engine's 10 s.
    assert_eq!(a.charged, Prices::cost_at(MICRO / 10, 10_000));
    let show = cli(&["credits", "show", TEST_OWNER]);
    assert!(show.contains("available  9.98333") && show.contains("dsp"), "{show}");
    let log = cli(&["credits", "log", TEST_OWNER]);
    assert!(
        log.contains("granted  +12.500000") && log.contains("(welcome)") && log.contains("charged  0.016667"),
        "{log}"
    );
    let usage = cli(&["usage"]);
    assert!(usage.lines().any(|l| l.starts_with(TEST_OWNER) && l.contains("dsp") && l.contains("10.0")), "{usage}");
    assert!(cli(&["credits", "prices", "off"]).contains("credits are off"));
    stack.shutdown().await;
}
