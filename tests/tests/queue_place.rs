//! "Where am I in the queue": `queue_position` and `eta` of queued jobs under steady
//! load, against a real nats-server.
//!
//! One worker, one slot, the fake engine taking a fixed time per job, and a backlog of
//! interactive jobs in one pool: the positions read over `GET` count down as the jobs
//! ahead finish, the ETA of every job after the first few is within ±50 % of when it
//! really finished, and the event stream of a queued job sends its position as it moves.
//! Jobs of the other lane or of another model never count in a position, and a job
//! whose model no live worker serves has a position but no ETA.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use stemq_core::engine::FakeEngine;
use stemq_core::request::Model;
use stemq_core::{JobId, JobStatus};
use stemq_tests::{job_body, job_id, take_sse_messages, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);
/// What each job takes in the fake engine.
const JOB_MS: u64 = 250;
/// Interactive jobs in the backlog.
const N: usize = 24;
/// The ETA of jobs from this index on (in queue order) is held to ±50 %.
const CHECKED_FROM: usize = 4;

/// One look at a job over the API.
#[derive(Debug, Clone)]
struct Seen {
    at: DateTime<Utc>,
    status: String,
    position: Option<u64>,
    eta: Option<DateTime<Utc>>,
    eta_seconds: Option<u64>,
}

fn seen(v: &Value, at: DateTime<Utc>) -> Seen {
    Seen {
        at,
        status: v["status"].as_str().unwrap_or_default().to_string(),
        position: v["queue_position"].as_u64(),
        eta: v["eta"].as_str().map(|s| DateTime::parse_from_rfc3339(s).expect("eta is RFC 3339").to_utc()),
        eta_seconds: v["eta_seconds"].as_u64(),
    }
}

/// The job's view over the API.
async fn get(stack: &Stack, id: &JobId) -> Value {
    let (code, v) = stack.get(&format!("/v1/separations/{id}")).await;
    assert_eq!(code, 200, "{v}");
    v
}

/// Every job of the test owner, by id, as one list answer shows it.
async fn look(stack: &Stack) -> BTreeMap<String, Seen> {
    let (code, page) = stack.get("/v1/separations?limit=1000").await;
    let at = Utc::now();
    assert_eq!(code, 200, "{page}");
    page["jobs"].as_array().unwrap().iter().map(|v| (v["job_id"].as_str().unwrap().to_string(), seen(v, at))).collect()
}

/// Reads a job's event stream (`url`, with API key `key`) to its end: every message,
/// with or without an `id:`, as (id, event, view); `first` hears of the first one.
async fn sse(url: String, key: String, first: tokio::sync::oneshot::Sender<()>) -> Vec<(Option<u64>, String, Value)> {
    let mut first = Some(first);
    let mut resp = reqwest::Client::new()
        .get(url)
        .bearer_auth(key)
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("GET events");
    assert_eq!(resp.status().as_u16(), 200);
    let (mut buf, mut out) = (String::new(), Vec::new());
    let deadline = Instant::now() + T;
    while let Some(chunk) =
        tokio::time::timeout_at(deadline.into(), resp.chunk()).await.expect("the stream ends").expect("read")
    {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        for m in take_sse_messages(&mut buf) {
            if !m.data.is_empty() {
                out.push((m.id, m.event, serde_json::from_str(&m.data).expect("data is JSON")));
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        }
    }
    out
}

async fn wait_until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !check().await {
        assert!(t0.elapsed() < T, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positions_count_down_and_the_eta_holds_under_steady_load() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let fake = Some(json!({ "sleep_ms": JOB_MS }));
    let submit = async |body: Value| {
        let (code, b) = stack.submit(&body).await;
        assert_eq!(code, 202, "{b}");
        job_id(&b)
    };
    // Queued before any worker, in between the backlog: the batch lane of the same
    // pool, and a model nobody serves.
    let mut batch = Vec::new();
    let mut jobs = Vec::new();
    let mut unserved = None;
    for i in 0..N {
        if i == 1 || i == 2 {
            let mut b = job_body(&stack, &format!("batch-{i}"), fake.clone());
            b["priority"] = "batch".into();
            batch.push(submit(b).await);
        }
        if i == 3 {
            let mut b = job_body(&stack, "six", fake.clone());
            b["model"] = "htdemucs_6s".into();
            unserved = Some(submit(b).await);
        }
        jobs.push(submit(job_body(&stack, &format!("job-{i}"), fake.clone())).await);
    }
    let unserved = unserved.unwrap();

    // No worker yet: exact positions, each lane and model counted apart; no ETA.
    wait_until("every job in the ingress's index", async || {
        let all = look(&stack).await;
        jobs.iter().chain(&batch).all(|id| all.get(id.as_str()).is_some_and(|s| s.position.is_some()))
    })
    .await;
    let all = look(&stack).await;
    let at = |id: &JobId| all[id.as_str()].clone();
    assert_eq!(jobs.iter().map(|id| at(id).position).collect::<Vec<_>>(), (0..N as u64).map(Some).collect::<Vec<_>>());
    assert_eq!(batch.iter().map(|id| at(id).position).collect::<Vec<_>>(), [Some(0), Some(1)]);
    assert_eq!(at(&unserved).position, Some(0));
    assert!(all.values().all(|s| s.eta.is_none() && s.eta_seconds.is_none()), "an ETA without a worker: {all:#?}");

    // The event stream of the last job, from before the queue moves.
    let last = jobs[N - 1].clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let stream = tokio::spawn(sse(stack.url(&format!("/v1/separations/{last}/events")), stack.key.clone(), tx));
    // It has sent the first message before the queue moves.
    tokio::time::timeout(T, rx).await.expect("a first event").expect("the stream runs");

    // One worker, one slot, serving dsp only.
    stack.add_worker(Arc::new(FakeEngine::serving(&[Model::Dsp]))).await;
    let mut history: BTreeMap<String, Vec<Seen>> = BTreeMap::new();
    let t0 = Instant::now();
    loop {
        let all = look(&stack).await;
        for (id, s) in &all {
            history.entry(id.clone()).or_default().push(s.clone());
        }
        let ended = jobs.iter().chain(&batch).all(|id| {
            all.get(id.as_str()).is_some_and(|s| JobStatus::parse(&s.status).is_some_and(|s| s.is_terminal()))
        });
        if ended {
            break;
        }
        assert!(t0.elapsed() < T, "the backlog did not drain in {T:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // What really happened.
    let mut finished = BTreeMap::new();
    for id in jobs.iter().chain(&batch) {
        let v = stack.view(id).await.unwrap();
        assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
        finished.insert(id.to_string(), v.finished_at.unwrap());
    }

    // Positions count down, never up, while a job is queued.
    for (k, id) in jobs.iter().enumerate() {
        let queued: Vec<u64> =
            history[id.as_str()].iter().filter(|s| s.status == "queued").filter_map(|s| s.position).collect();
        assert!(queued.windows(2).all(|w| w[1] <= w[0]), "job {k}: positions went up: {queued:?}");
        assert!(history[id.as_str()].iter().all(|s| s.status == "queued" || s.position.is_none()), "job {k}");
    }
    let counted: BTreeSet<u64> =
        history[last.as_str()].iter().filter(|s| s.status == "queued").filter_map(|s| s.position).collect();
    assert!(counted.len() >= N / 3, "the last job's positions did not count down: {counted:?}");

    // The ETA first given to each queued job after the first few, against its real end.
    println!("job  position  predicted_s  actual_s  error");
    for (k, id) in jobs.iter().enumerate().skip(CHECKED_FROM) {
        let first = history[id.as_str()]
            .iter()
            .find(|s| s.status == "queued" && s.eta.is_some())
            .unwrap_or_else(|| panic!("job {k} was never given an ETA while queued: {:#?}", history[id.as_str()]));
        let (eta, end) = (first.eta.unwrap(), finished[id.as_str()]);
        let actual = (end - first.at).num_milliseconds() as f64;
        let predicted = (eta - first.at).num_milliseconds() as f64;
        let error = (predicted - actual) / actual;
        println!(
            "{k:>3}  {:>8}  {:>11.2}  {:>8.2}  {:>+5.0} %",
            first.position.unwrap(),
            predicted / 1e3,
            actual / 1e3,
            error * 100.0
        );
        assert!(error.abs() <= 0.5, "job {k}: ETA {eta} given at {} for an end at {end} ({error:+.2})", first.at);
        let secs = first.eta_seconds.expect("eta_seconds with eta");
        // `eta_seconds` is rounded up from the server's clock when it answered, a moment
        // before the client saw it (`at`): up to 1 s above, plus that moment.
        assert!(secs as f64 >= predicted / 1e3 - 1.0 && secs as f64 <= predicted / 1e3 + 1.25, "{first:?}");
    }
    // A running job has an ETA too, once the model has a typical run time.
    assert!(
        jobs[CHECKED_FROM..]
            .iter()
            .any(|id| history[id.as_str()].iter().any(|s| s.status == "running" && s.eta.is_some())),
        "no running job had an ETA"
    );
    // A batch job waits for the interactive backlog, and its ETA says so.
    let b0 = history[batch[0].as_str()].iter().find(|s| s.eta.is_some()).expect("the batch job had an ETA").clone();
    let same_look: Vec<DateTime<Utc>> = jobs
        .iter()
        .filter_map(|id| {
            history[id.as_str()].iter().find(|s| s.at == b0.at && s.status == "queued").and_then(|s| s.eta)
        })
        .collect();
    assert!(!same_look.is_empty() && same_look.iter().all(|e| *e < b0.eta.unwrap()), "{b0:?} vs {same_look:?}");
    assert!(finished[batch[0].as_str()] > finished[jobs[N - 1].as_str()]);

    // Nobody serves htdemucs_6s: it keeps its place, says why, and has no ETA.
    let v = get(&stack, &unserved).await;
    assert_eq!((v["status"].as_str(), v["queue_position"].as_u64()), (Some("queued"), Some(0)), "{v}");
    assert_eq!(v["waiting"], "waiting for a worker that serves htdemucs_6s", "{v}");
    assert!(v.get("eta").is_none() && v.get("eta_seconds").is_none(), "{v}");
    // An ended job has neither, and the stored view never has any of them.
    let v = get(&stack, &jobs[0]).await;
    assert!(v.get("queue_position").is_none() && v.get("eta").is_none(), "{v}");
    let key = stemq_nats::view_key(Some(stemq_tests::TEST_OWNER), &unserved);
    let raw = stack.kv.get(key).await.unwrap().expect("the view under its owner's key");
    let stored: Value = serde_json::from_slice(&raw).unwrap();
    for field in ["queue_position", "eta", "eta_seconds", "waiting"] {
        assert!(stored.get(field).is_none(), "{field} stored: {stored}");
    }

    // The event stream of the last job: its position came down while it was queued,
    // between revisions of its view too (messages without an id), then it ran and ended.
    let msgs = stream.await.unwrap();
    let positions: Vec<u64> = msgs.iter().filter_map(|(_, _, v)| v["queue_position"].as_u64()).collect();
    assert!(positions.windows(2).all(|w| w[1] <= w[0]), "{positions:?}");
    let distinct: BTreeSet<u64> = positions.iter().copied().collect();
    assert!(distinct.len() >= 4, "the stream did not count down: {positions:?}");
    assert_eq!(positions.first(), Some(&(N as u64 - 1)), "{positions:?}");
    assert!(msgs.iter().any(|(id, event, _)| id.is_none() && event == "progress"), "no recheck message: {msgs:?}");
    assert!(msgs.iter().any(|(_, _, v)| v["status"] == "queued" && v["eta"].is_string()), "no ETA over SSE");
    assert_eq!(msgs.last().unwrap().2["status"], "succeeded");
    stack.shutdown().await;
}
