//! The projector under faults (issue 11, "No innocent job pays for a bad one"): a fold
//! that fails is never lost behind a later event of the same job; a stored view that
//! does not parse is reported and never overwritten; the projector keeps projecting
//! after its message stream ends. Issue 12: two projectors on the same consumers, with
//! redeliveries behind newer events, keep every view equal to the fold of its log.
//!
//! Events are published straight to the log (no workers), so each test controls exactly
//! which events exist and when.

use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{self, PullConsumer};
use serde_json::{json, Value};
use stemq_core::event::Started;
use stemq_core::{Event, EventBody, JobId, JobRequest, JobStatus};
use stemq_nats::{self as names, job_subject, SubjectKind};
use stemq_tests::{job_body, Stack, StackOptions};
use tokio_util::sync::CancellationToken;

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
    let text = stemq_telemetry::metrics::metrics().render();
    let series = format!("stemq_projector_errors_total{{kind=\"{kind}\"}}");
    text.lines().find_map(|l| l.strip_prefix(&series).map(|v| v.trim().parse().unwrap())).unwrap_or(0.0)
}

/// `stemq_projector_refolds_total` in this process.
fn refolds() -> f64 {
    let text = stemq_telemetry::metrics::metrics().render();
    text.lines()
        .find_map(|l| l.strip_prefix("stemq_projector_refolds_total ").map(|v| v.trim().parse().unwrap()))
        .unwrap_or(0.0)
}

/// Issue 11: the fold of a job's request fails (its view is too large for the bucket)
/// while the job's next event is applied. The request, redelivered later, is behind the
/// view: it must not be skipped as already applied (lost until a rebuild) but refolded
/// with the rest of the job's log (issue 12 replaced holding the job back with that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_11_a_failed_fold_is_never_lost_behind_a_later_event_of_its_job() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    // A view with 8 KB of metadata cannot be written; one without it can.
    limit_view_size(&stack, 4096).await;
    let req = requested(&stack, "big", Some(json!({ "blob": "x".repeat(8 * 1024) })));
    let id = req.subject.clone();
    publish(&stack, SubjectKind::Requested, &req).await;
    wait_consumer(&stack, "the request's fold failed and it came back", |i| i.num_redelivered >= 1).await;

    let started_seq = publish(&stack, SubjectKind::Started, &started(&id)).await;
    // The projector has handled `started` one way or the other: applied and acked
    // (only the request left in flight), or its fold failed too and it came again.
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
    // Where the projector writes the job's view: under its owner's key.
    let bad_key = names::view_key(Some("anonymous"), &bad.subject);
    stack.kv.put(bad_key.as_str(), garbage.clone()).await.unwrap();
    let before = projector_errors("corrupt_view");

    publish(&stack, SubjectKind::Requested, &bad).await;
    let last = publish(&stack, SubjectKind::Requested, &good).await;
    stack.wait_status(&good.subject, JobStatus::Queued, T).await;
    // The projector has handled both: acked everything, or handed the bad job's back.
    wait_consumer(&stack, "both requests handled", |i| {
        i.delivered.stream_sequence >= last && (i.num_ack_pending == 0 || i.num_redelivered >= 1)
    })
    .await;

    let entry = stack.kv.entry(bad_key.as_str()).await.unwrap().expect("entry kept");
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

/// Every event of a job with its log sequence, in log order (direct gets, next message
/// on `stemq.jobs.<id>.>`).
async fn log_of(stack: &Stack, id: &JobId) -> Vec<(u64, Event)> {
    let log = stack.js.get_stream_no_info(names::JOBS_STREAM).await.unwrap();
    let filter = format!("{}.{id}.>", names::JOBS_PREFIX);
    let mut out = Vec::new();
    let mut from = 1;
    loop {
        match log.direct_get_builder().sequence(from).next_by_subject(filter.as_str()).send().await {
            Ok(m) => {
                out.push((m.sequence, Event::from_slice(&m.payload).expect("stored events parse")));
                from = m.sequence + 1;
            }
            Err(e) if e.kind() == async_nats::jetstream::stream::DirectGetErrorKind::NotFound => return out,
            Err(e) => panic!("reading the log of {id}: {e}"),
        }
    }
}

/// The view the job's log folds to: `apply` over its events, in log order.
fn fold_of(log: &[(u64, Event)]) -> Option<stemq_core::JobView> {
    let mut view = None;
    for (seq, e) in log {
        if let Some(v) = stemq_core::apply(view.as_ref(), stemq_core::Position::Log(*seq), e) {
            view = Some(v);
        }
    }
    view
}

/// A projector of its own on the shared consumers (stopped with `stop`).
async fn own_projector(stack: &Stack, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    let c = stack.connect_as(stemq_nats::users::PROJECTOR).await;
    tokio::spawn(async move { stemq_projector::run(c, Default::default(), stop).await.expect("projector runs") })
}

/// Sets the `ack_wait` of a durable consumer (as `stemq nats apply` would).
async fn set_ack_wait(stack: &Stack, stream: &str, consumer: &str, ack_wait: Duration) {
    let s = stack.js.get_stream(stream).await.unwrap();
    let mut config = s.consumer_info(consumer).await.unwrap().config.clone();
    config.ack_wait = ack_wait;
    s.create_consumer(config).await.unwrap();
}

/// A pull of up to `n` messages on the shared `projector` consumer whose messages are
/// dropped unacked: a projector that dies mid-run. Its request waits beside the live
/// projectors' ones (armed before the events are published), so it gets a share of them;
/// they come back after `ack_wait`, behind later events of their jobs that the live
/// projectors have applied meanwhile.
async fn thief(stack: &Stack, n: usize) -> async_nats::jetstream::consumer::pull::Batch {
    let c: PullConsumer =
        stack.js.get_consumer_from_stream(names::PROJECTOR_CONSUMER, names::JOBS_STREAM).await.unwrap();
    c.batch().max_messages(n).expires(Duration::from_millis(500)).messages().await.expect("pull from projector")
}

/// Drops what the thief got; returns how many.
async fn drop_all(mut batch: async_nats::jetstream::consumer::pull::Batch) -> usize {
    let mut taken = 0;
    while let Some(Ok(_dropped)) = futures::StreamExt::next(&mut batch).await {
        taken += 1;
    }
    taken
}

/// Views that differ from the fold of their job's log, as `(job, stored, folded)` JSON
/// (progress position left out: it is the progress stream's, not the log's).
async fn views_unlike_their_log(stack: &Stack, kv: &async_nats::jetstream::kv::Store, ids: &[JobId]) -> Vec<String> {
    let mut wrong = Vec::new();
    for id in ids {
        let stored = stemq_projector::get_view(kv, id).await.unwrap().map(|(mut v, _)| {
            v.progress_seq = 0;
            v
        });
        let folded = fold_of(&log_of(stack, id).await);
        if stored != folded {
            wrong.push(format!(
                "job {id}\n  stored: {}\n  folded: {}",
                serde_json::to_string(&stored).unwrap(),
                serde_json::to_string(&folded).unwrap()
            ));
        }
    }
    wrong
}

/// Issue 12: two projectors share the `projector` consumer (and `projector-progress`),
/// one of them is restarted mid-run, and a third taker drops messages unacked (a
/// projector killed mid-run), so older events of a job come back after its newer ones
/// were applied, by either projector. No event is lost: every view equals the fold of
/// its log, and stays so through `stemq projector --rebuild` with both running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_12_two_projectors_and_redeliveries_keep_every_view_equal_to_its_log() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    set_ack_wait(&stack, names::JOBS_STREAM, names::PROJECTOR_CONSUMER, Duration::from_secs(1)).await;
    let mut second_stop = CancellationToken::new();
    let mut second = own_projector(&stack, second_stop.clone()).await;

    const JOBS: usize = 60;
    let jobs: Vec<Event> = (0..JOBS).map(|i| requested(&stack, &format!("dual-{i}"), None)).collect();
    let ids: Vec<JobId> = jobs.iter().map(|e| e.subject.clone()).collect();
    let attempt = |id: &JobId, n: u32| {
        Event::new(
            id,
            "/test",
            EventBody::Started(Started { attempt: n, worker: format!("w{n}"), device: "cpu".into() }),
        )
    };
    let mut stolen = 0;
    // Round by round, each job's next event: requested, started 1, failed (transient),
    // started 2, progress, succeeded. After each round the thief takes what it can.
    for round in 0..6 {
        // Three pulls beside the projectors' two get about three fifths of a round.
        let mut thieves = Vec::new();
        for _ in 0..3 {
            thieves.push(thief(&stack, 10).await);
        }
        for (i, id) in ids.iter().enumerate() {
            let (kind, ev) = match round {
                0 => (SubjectKind::Requested, jobs[i].clone()),
                1 => (SubjectKind::Started, attempt(id, 1)),
                2 => (
                    SubjectKind::Failed,
                    Event::new(
                        id,
                        "/test",
                        EventBody::Failed(stemq_core::event::Failed {
                            attempt: 1,
                            class: stemq_core::event::FailureClass::Transient,
                            code: "boom".into(),
                            message: "transient".into(),
                            retry_in_ms: Some(10),
                        }),
                    ),
                ),
                3 => (SubjectKind::Started, attempt(id, 2)),
                4 => (
                    SubjectKind::Progress,
                    Event::new(
                        id,
                        "/test",
                        EventBody::Progress(stemq_core::event::Progress {
                            attempt: 2,
                            percent: 50.0,
                            stage: "separate".into(),
                            message: None,
                        }),
                    ),
                ),
                _ => (
                    SubjectKind::Outcome,
                    Event::new(
                        id,
                        "/test",
                        EventBody::Succeeded(stemq_core::event::Succeeded {
                            attempt: 2,
                            outputs: vec![],
                            manifest_uri: None,
                            degraded: false,
                            device: "cpu".into(),
                            segment: None,
                            duration_ms: 5,
                            audio_ms: None,
                        }),
                    ),
                ),
            };
            let subject = match &ev.body {
                EventBody::Requested(r) => names::request_subject(id, "anonymous", r.request.model, r.lane()),
                _ => job_subject(id, kind),
            };
            stack.js.publish(subject, ev.to_bytes()).await.unwrap().await.unwrap();
        }
        for t in thieves {
            stolen += drop_all(t).await;
        }
        if round == 2 {
            // The second projector stops mid-run and a new one takes its place.
            second_stop.cancel();
            tokio::time::timeout(T, second).await.expect("the second projector stops").unwrap();
            second_stop = CancellationToken::new();
            second = own_projector(&stack, second_stop.clone()).await;
        }
    }
    assert!(stolen > 0, "the thief never got a message: the test shows nothing");
    let t0 = Instant::now();
    assert!(stemq_projector::wait_caught_up(&stack.js, T).await.unwrap(), "the projectors never caught up");
    eprintln!(
        "{stolen} events dropped unacked and redelivered; caught up {:?} after the last publish; {} jobs refolded",
        t0.elapsed(),
        refolds()
    );
    let wrong = views_unlike_their_log(&stack, &stack.kv, &ids).await;
    assert!(
        wrong.is_empty(),
        "{} of {JOBS} views differ from the fold of their log:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    for id in &ids {
        assert_eq!(stack.view(id).await.unwrap().status, JobStatus::Succeeded);
    }
    assert!(refolds() > 0.0, "no job was refolded: the redeliveries never came behind their jobs' views");

    // `stemq projector --rebuild` with both projectors running: the replay is shared
    // between them, and the views come back the same.
    stemq_projector::reset(&stack.js, &stack.options.settings).await.unwrap();
    let kv = stack.js.get_key_value(names::JOBS_BUCKET).await.unwrap();
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let wrong = views_unlike_their_log(&stack, &kv, &ids).await;
        if wrong.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after a rebuild, {} views differ from their log:\n{}",
            wrong.len(),
            wrong.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    second_stop.cancel();
    let _ = tokio::time::timeout(T, second).await;
    stack.shutdown().await;
}

/// Issue 37: the job log is pulled by the projector holding the lease. A lease left by a
/// projector that died (never renewed, never given back) holds a new projector back
/// until it is [`stemq_projector::lease::TAKEOVER_AFTER`] old by the new one's clock;
/// then it takes over and folds everything that came meanwhile, and its acks catch up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_projectors_lease_is_taken_over_and_nothing_is_lost() {
    let stack = Stack::start(StackOptions { workers: 0, projector: false, ..Default::default() }).await;
    stack.kv.put(stemq_projector::lease::LEASE_KEY, "a projector that died".into()).await.unwrap();
    let stop = CancellationToken::new();
    let projector = own_projector(&stack, stop.clone()).await;
    let started = Instant::now();
    let req = requested(&stack, "waits-for-the-lease", None);
    publish(&stack, SubjectKind::Requested, &req).await;
    let v = stack.wait_status(&req.subject, JobStatus::Queued, T).await;
    let waited = started.elapsed();
    eprintln!("folded {waited:?} after the projector started, behind a dead projector's lease");
    assert!(
        waited >= stemq_projector::lease::TAKEOVER_AFTER - Duration::from_millis(500),
        "folded after {waited:?}: the log was pulled while another projector held the lease"
    );
    assert!(v.request.is_some());
    let lease = stack.kv.get(stemq_projector::lease::LEASE_KEY).await.unwrap().unwrap();
    assert_ne!(&lease[..], b"a projector that died", "the lease is the new projector's");
    assert!(stemq_projector::wait_caught_up(&stack.js, T).await.unwrap(), "the acks caught up");

    // A projector that stops gives the lease back: the next one pulls at once.
    stop.cancel();
    projector.await.unwrap();
    assert!(stack.kv.get(stemq_projector::lease::LEASE_KEY).await.unwrap().is_none(), "given back");
    let next = own_projector(&stack, CancellationToken::new()).await;
    let started = Instant::now();
    let req = requested(&stack, "after-a-clean-stop", None);
    publish(&stack, SubjectKind::Requested, &req).await;
    stack.wait_status(&req.subject, JobStatus::Queued, T).await;
    assert!(
        started.elapsed() < stemq_projector::lease::TAKEOVER_AFTER,
        "after a lease given back the next projector pulls at once, not after {:?}",
        started.elapsed()
    );
    next.abort();
    stack.shutdown().await;
}

/// Issue 37: a projector consumer made by an earlier release acks each event
/// (`ack_policy: explicit`), which the server never changes in place. `stemq nats apply`
/// recreates it acking all, starting after its ack floor: nothing acked comes again,
/// nothing unacked is skipped, and applying again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_apply_recreates_an_explicitly_acked_projector_consumer_from_its_floor() {
    let stack = Stack::start(StackOptions { workers: 0, projector: false, ..Default::default() }).await;
    let jobs = stack.js.get_stream(names::JOBS_STREAM).await.unwrap();
    jobs.delete_consumer(names::PROJECTOR_CONSUMER).await.unwrap();
    let mut old = stemq_nats::consumer_configs(&stack.options.settings)
        .unwrap()
        .into_iter()
        .find(|(_, c)| c.durable_name.as_deref() == Some(names::PROJECTOR_CONSUMER))
        .unwrap()
        .1;
    old.ack_policy = consumer::AckPolicy::Explicit;
    let c: PullConsumer = jobs.create_consumer(old).await.unwrap();
    // Three requests, on their pool's subject (the router copies no request published
    // there); the first two acked by an old projector.
    let evs: Vec<Event> = (0..3).map(|i| requested(&stack, &format!("old-{i}"), None)).collect();
    let mut seqs = Vec::new();
    for ev in &evs {
        let EventBody::Requested(r) = &ev.body else { unreachable!() };
        let subject = names::request_subject(&ev.subject, "anonymous", r.request.model, r.lane());
        seqs.push(stack.js.publish(subject, ev.to_bytes()).await.unwrap().await.unwrap().sequence);
    }
    let mut batch = c.fetch().max_messages(2).messages().await.unwrap();
    let mut acked = 0;
    while let Some(Ok(m)) = futures::StreamExt::next(&mut batch).await {
        acked = m.info().unwrap().stream_sequence;
        m.double_ack().await.unwrap();
    }
    assert!(acked >= seqs[0] && acked < seqs[2], "acked up to {acked} of {seqs:?}");

    let applied = names::apply(&stack.js, &stack.options.settings).await.unwrap();
    let what = format!("consumer {}/{}", names::JOBS_STREAM, names::PROJECTOR_CONSUMER);
    let change = applied.iter().find(|c| c.what == what).unwrap();
    assert_eq!(
        change.to_string(),
        format!("updated {what}: ack_policy: explicit -> all (recreated from event {})", acked + 1)
    );
    let info = projector_info(&stack).await;
    assert_eq!(info.config.ack_policy, consumer::AckPolicy::All);
    assert_eq!(info.config.deliver_policy, consumer::DeliverPolicy::ByStartSequence { start_sequence: acked + 1 });
    let last = stack.js.get_stream(names::JOBS_STREAM).await.unwrap().info().await.unwrap().state.last_sequence;
    assert_eq!(info.num_pending, last - acked, "only the events after the floor are left to fold: {info:#?}");
    let again = names::apply(&stack.js, &stack.options.settings).await.unwrap();
    assert!(again.iter().all(|c| c.action == stemq_nats::Action::Unchanged), "{again:?}");

    // A projector folds the one left (the acked two were folded by the old one).
    let _p = own_projector(&stack, CancellationToken::new()).await;
    stack.wait_status(&evs[2].subject, JobStatus::Queued, T).await;
    assert!(stemq_projector::wait_caught_up(&stack.js, T).await.unwrap());
    for (ev, seq) in evs.iter().zip(&seqs) {
        let folded = stack.view(&ev.subject).await.is_some();
        assert_eq!(folded, *seq > acked, "event {seq}: an acked event is not delivered again, the others are");
    }
    stack.shutdown().await;
}

/// Issue 37: this release's projector on a consumer that still acks each event (binaries
/// upgraded, `stemq nats apply` not run yet) acks each event, so nothing comes back
/// after the ack wait; once `nats apply` recreates the consumer, it acks cumulatively.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_on_an_explicitly_acked_consumer_acks_each_event_until_apply() {
    let mut opts = StackOptions { workers: 0, projector: false, ..Default::default() };
    opts.settings.ack_wait = Duration::from_secs(1);
    let stack = Stack::start(opts).await;
    let jobs = stack.js.get_stream(names::JOBS_STREAM).await.unwrap();
    jobs.delete_consumer(names::PROJECTOR_CONSUMER).await.unwrap();
    let (_, mut old) = stemq_nats::consumer_configs(&stack.options.settings)
        .unwrap()
        .into_iter()
        .find(|(_, c)| c.durable_name.as_deref() == Some(names::PROJECTOR_CONSUMER))
        .unwrap();
    old.ack_policy = consumer::AckPolicy::Explicit;
    jobs.create_consumer(old).await.unwrap();
    let _p = own_projector(&stack, CancellationToken::new()).await;
    let evs: Vec<Event> = (0..5).map(|i| requested(&stack, &format!("each-{i}"), None)).collect();
    for ev in &evs {
        publish(&stack, SubjectKind::Requested, ev).await;
    }
    for ev in &evs {
        stack.wait_status(&ev.subject, JobStatus::Queued, T).await;
    }
    assert!(stemq_projector::wait_caught_up(&stack.js, T).await.unwrap(), "every event acked");
    // Past the ack wait, nothing was handed out again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let info = projector_info(&stack).await;
    assert_eq!((info.num_ack_pending, info.num_redelivered), (0, 0), "{info:#?}");

    names::apply(&stack.js, &stack.options.settings).await.unwrap();
    assert_eq!(projector_info(&stack).await.config.ack_policy, consumer::AckPolicy::All);
    let after = requested(&stack, "after-apply", None);
    publish(&stack, SubjectKind::Requested, &after).await;
    stack.wait_status(&after.subject, JobStatus::Queued, T).await;
    assert!(stemq_projector::wait_caught_up(&stack.js, T).await.unwrap(), "acked all after the apply");
    stack.shutdown().await;
}
