//! The projector under faults (issue 11, "No innocent job pays for a bad one"): a fold
//! that fails never lets a later event of the same job overtake it; a stored view that
//! does not parse is reported and never overwritten; the projector keeps projecting
//! after its message stream ends.
//!
//! Events are published straight to the log (no workers), so each test controls exactly
//! which events exist and when.

use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{self, PullConsumer};
use serde_json::{json, Value};
use stemq_core::event::Started;
use stemq_core::nats::{self as names, job_subject, SubjectKind};
use stemq_core::{Event, EventBody, JobId, JobRequest, JobStatus};
use stemq_tests::{job_body, Stack, StackOptions};

const T: Duration = Duration::from_secs(20);

/// A `requested` event for a fresh job named `name`, with `metadata`.
fn requested(stack: &Stack, name: &str, metadata: Option<Value>) -> Event {
    let req = JobRequest::from_value(job_body(stack, name, None)).unwrap().normalize("anonymous").unwrap();
    Event::requested(req, None, metadata, "/test")
}

/// Publishes `ev` on its job's `kind` subject; returns its stream sequence.
async fn publish(stack: &Stack, kind: SubjectKind, ev: &Event) -> u64 {
    stack.js.publish(job_subject(&ev.subject, kind), ev.to_bytes()).await.unwrap().await.unwrap().sequence
}

fn started(id: &JobId) -> Event {
    Event::new(id, "/test", EventBody::Started(Started { attempt: 1, worker: "w".into(), device: "cpu".into() }))
}

async fn projector_info(stack: &Stack) -> consumer::Info {
    let c: PullConsumer =
        stack.js.get_consumer_from_stream(names::PROJECTOR_CONSUMER, names::JOBS_STREAM).await.unwrap();
    c.get_info().await.unwrap()
}

/// Polls `cond` on the projector consumer's info until it holds; panics after `T`.
async fn wait_consumer(stack: &Stack, what: &str, cond: impl Fn(&consumer::Info) -> bool) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let info = projector_info(stack).await;
        if cond(&info) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "projector consumer never got to: {what}; {info:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sets the largest message the view bucket's stream accepts (-1: no limit).
async fn limit_view_size(stack: &Stack, max: i32) {
    let mut s = stack.js.get_stream(format!("KV_{}", names::JOBS_BUCKET)).await.unwrap();
    let mut config = s.info().await.unwrap().config.clone();
    config.max_message_size = max;
    stack.js.update_stream(config).await.unwrap();
}

/// `stemq_projector_errors_total{kind}` in this process.
fn projector_errors(kind: &str) -> f64 {
    let text = stemq_core::metrics::metrics().render();
    let series = format!("stemq_projector_errors_total{{kind=\"{kind}\"}}");
    text.lines().find_map(|l| l.strip_prefix(&series).map(|v| v.trim().parse().unwrap())).unwrap_or(0.0)
}

/// Issue 11: the fold of a job's request fails (its view is too large for the bucket);
/// the job's next event must not be applied before it, or the request, redelivered
/// later, is skipped as older than the view and lost until a rebuild.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_11_a_failed_fold_is_not_overtaken_by_a_later_event_of_its_job() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    // A view with 8 KB of metadata cannot be written; one without it can.
    limit_view_size(&stack, 4096).await;
    let req = requested(&stack, "big", Some(json!({ "blob": "x".repeat(8 * 1024) })));
    let id = req.subject.clone();
    publish(&stack, SubjectKind::Requested, &req).await;
    wait_consumer(&stack, "the request's fold failed and it came back", |i| i.num_redelivered >= 1).await;

    let started_seq = publish(&stack, SubjectKind::Started, &started(&id)).await;
    // The projector has handled `started` one way or the other: applied and acked
    // (only the request left in flight), or handed back and delivered again.
    wait_consumer(&stack, "started handled", |i| {
        i.delivered.stream_sequence >= started_seq && (i.num_ack_pending == 1 || i.num_redelivered >= 2)
    })
    .await;

    limit_view_size(&stack, -1).await;
    let lifted = Instant::now();
    let v = stack.wait_for(&id, T, |v| v.request.is_some() && v.status == JobStatus::Running).await;
    eprintln!("recovered {:?} after the fault was lifted", lifted.elapsed());
    assert_eq!(v.last_seq, started_seq);
    assert_eq!(v.metadata.as_ref().unwrap()["blob"].as_str().unwrap().len(), 8 * 1024);
    assert!(projector_errors("kv_write") >= 1.0, "the failed write is counted");
    stack.shutdown().await;
}

/// A stored view that does not parse is an error: reported with a metric, never
/// overwritten as if absent, while other jobs keep flowing; a rebuild replaces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_11_a_view_that_does_not_parse_is_reported_and_never_overwritten() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let bad = requested(&stack, "bad-view", None);
    let good = requested(&stack, "innocent", None);
    let garbage = bytes::Bytes::from_static(b"{\"this is\": \"not a view\"");
    stack.kv.put(bad.subject.as_str(), garbage.clone()).await.unwrap();
    let before = projector_errors("corrupt_view");

    publish(&stack, SubjectKind::Requested, &bad).await;
    let last = publish(&stack, SubjectKind::Requested, &good).await;
    stack.wait_status(&good.subject, JobStatus::Queued, T).await;
    // The projector has handled both: acked everything, or handed the bad job's back.
    wait_consumer(&stack, "both requests handled", |i| {
        i.delivered.stream_sequence >= last && (i.num_ack_pending == 0 || i.num_redelivered >= 1)
    })
    .await;

    let entry = stack.kv.entry(bad.subject.as_str()).await.unwrap().expect("entry kept");
    assert_eq!(entry.value, garbage, "the unparseable view was overwritten");
    match stemq_projector::get_view(&stack.kv, &bad.subject).await {
        Err(e @ stemq_projector::ProjectorError::CorruptView { .. }) => assert_eq!(e.kind(), "corrupt_view"),
        other => panic!("get_view of a corrupt view: {other:?}"),
    }
    let deadline = tokio::time::Instant::now() + T;
    while projector_errors("corrupt_view") <= before {
        assert!(tokio::time::Instant::now() < deadline, "corrupt view never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // `stemq projector --rebuild`'s reset, while this projector keeps running: the
    // replay replaces the garbage with the job's real view.
    stemq_projector::reset(&stack.js, &stack.options.settings).await.unwrap();
    let kv = stack.js.get_key_value(names::JOBS_BUCKET).await.unwrap();
    let deadline = tokio::time::Instant::now() + T;
    loop {
        if let Ok(Some((v, _))) = stemq_projector::get_view(&kv, &bad.subject).await {
            assert_eq!(v.status, JobStatus::Queued);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the rebuild did not replace the corrupt view");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stack.shutdown().await;
}

/// The projector's message stream ends when its consumer is deleted (and recreated, as
/// a rebuild does) or the server restarts: it subscribes again and new jobs still get a
/// view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_11_the_projector_keeps_projecting_after_its_message_stream_ends() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let first = requested(&stack, "before", None);
    publish(&stack, SubjectKind::Requested, &first).await;
    stack.wait_status(&first.subject, JobStatus::Queued, T).await;

    // The consumer goes away and comes back (`stemq nats apply`).
    let jobs = stack.js.get_stream(names::JOBS_STREAM).await.unwrap();
    jobs.delete_consumer(names::PROJECTOR_CONSUMER).await.unwrap();
    names::apply(&stack.js, &stack.options.settings).await.unwrap();
    let recreated = Instant::now();
    let second = requested(&stack, "after-recreate", None);
    publish(&stack, SubjectKind::Requested, &second).await;
    stack.wait_status(&second.subject, JobStatus::Queued, T).await;
    eprintln!("projecting again {:?} after the consumer was recreated", recreated.elapsed());

    // The server restarts (same store, same port).
    tokio::task::block_in_place(|| stack.server.restart().unwrap());
    let restarted = Instant::now();
    let third = requested(&stack, "after-restart", None);
    let deadline = tokio::time::Instant::now() + T;
    // The test's own client reconnects too: retry the publish until it is stored.
    loop {
        if let Ok(ack) = stack.js.publish(job_subject(&third.subject, SubjectKind::Requested), third.to_bytes()).await {
            if ack.await.is_ok() {
                break;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "cannot publish after the restart");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stack.wait_status(&third.subject, JobStatus::Queued, T).await;
    eprintln!("projecting again {:?} after the server restarted", restarted.elapsed());
    stack.shutdown().await;
}
