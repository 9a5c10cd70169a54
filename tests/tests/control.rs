//! Cancel, retry and deadlines against a real nats-server (issue 5).

use std::time::{Duration, Instant};

use serde_json::json;
use stemq_core::event::EventBody;
use stemq_core::JobStatus;
use stemq_tests::{job_body, job_id, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_cancelled_never_starts() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let (_, b) = stack.submit(&job_body(&stack, "queued", None)).await;
    let id = job_id(&b);
    stack.wait_status(&id, JobStatus::Queued, T).await;
    let (code, body) = stack.post_raw(&format!("/v1/separations/{id}/cancel"), vec![]).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["status"], "cancelled");
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Cancelled);
    // A worker that comes later skips it.
    stack.add_worker(std::sync::Arc::new(stemq_core::engine::FakeEngine::default())).await;
    let (_, other) = stack.submit(&job_body(&stack, "after", None)).await;
    stack.wait_terminal(&job_id(&other), T).await;
    let kinds: Vec<_> = stack.events(&id).await.iter().map(|e| e.body.kind()).collect();
    assert!(!kinds.contains(&"started"), "{kinds:?}");
    assert!(kinds.contains(&"cancel_requested") && kinds.contains(&"cancelled"), "{kinds:?}");
    // Cancelling again is harmless.
    let (code, _) = stack.post_raw(&format!("/v1/separations/{id}/cancel"), vec![]).await;
    assert_eq!(code, 200);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_job_stops_within_a_second_and_leaves_no_outputs() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "long", Some(json!({"sleep_ms": 8000})))).await;
    let id = job_id(&b);
    stack.wait_status(&id, JobStatus::Running, T).await;
    let t0 = Instant::now();
    let (code, body) = stack.post_raw(&format!("/v1/separations/{id}/cancel"), vec![]).await;
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["status"], "cancelling");
    let v = stack.wait_terminal(&id, T).await;
    let took = t0.elapsed();
    assert_eq!(v.status, JobStatus::Cancelled, "{v:#?}");
    assert!(took < Duration::from_millis(1500), "stopped after {took:?}");
    assert!(v.outputs.is_empty());
    let left = stack.store.list(&format!("jobs/{id}/")).await.unwrap();
    assert!(left.is_empty(), "outputs left behind: {left:?}");
    let cancelled = stack
        .events(&id)
        .await
        .into_iter()
        .find_map(|e| match e.body {
            EventBody::Cancelled(c) => Some(c),
            _ => None,
        })
        .expect("a cancelled event");
    assert!(cancelled.interrupted);
    assert_eq!(cancelled.attempt, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_jobs_cannot_be_cancelled_and_only_ended_ones_retried() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "done", None)).await;
    let id = job_id(&b);
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Succeeded);
    let (code, body) = stack.post_raw(&format!("/v1/separations/{id}/cancel"), vec![]).await;
    assert_eq!(code, 409, "{body}");
    assert_eq!(body["error"]["code"], "conflict");
    let (code, _) = stack.post_raw(&format!("/v1/separations/{id}/retry"), vec![]).await;
    assert_eq!(code, 409);
    let missing = "0".repeat(64);
    let (code, _) = stack.post_raw(&format!("/v1/separations/{missing}/cancel"), vec![]).await;
    assert_eq!(code, 404);
    let (code, _) = stack.post_raw(&format!("/v1/separations/{missing}/retry"), vec![]).await;
    assert_eq!(code, 404);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_of_a_failed_job_is_a_new_job_linked_both_ways() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "bad", Some(json!({"fail_permanent": true})))).await;
    let id = job_id(&b);
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Failed);
    let (code, r) = stack.post_raw(&format!("/v1/separations/{id}/retry"), vec![]).await;
    assert_eq!(code, 202, "{r}");
    let new_id = job_id(&r);
    assert_ne!(new_id, id);
    let new = stack.wait_terminal(&new_id, T).await;
    assert_eq!(new.retry_of.as_ref(), Some(&id));
    let old = stack.wait_for(&id, T, |v| v.retried_by.is_some()).await;
    assert_eq!(old.retried_by.as_ref(), Some(&new_id));
    assert_eq!(old.status, JobStatus::Failed, "the old job is unchanged");
    // Retrying the same job again finds the same new job.
    let (code, again) = stack.post_raw(&format!("/v1/separations/{id}/retry"), vec![]).await;
    assert_eq!(code, 200, "{again}");
    assert_eq!(job_id(&again), new_id);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_cancel_and_retry() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let (_, b) = stack.submit(&job_body(&stack, "cli", None)).await;
    let id = job_id(&b);
    stack.wait_status(&id, JobStatus::Queued, T).await;
    let run = |args: &[&str]| {
        let out = std::process::Command::new(Stack::stemq_bin())
            .args(args)
            .env("NATS_URL", stack.server.url())
            .env("STEMQ_NATS_CREDS", stack.server.credentials(stemq_nats::users::OPERATOR))
            .env("STEMQ_DATA_DIR", stack.dir.path())
            .output()
            .expect("run stemq");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string())
    };
    let (ok, out) = run(&["cancel", id.as_str()]);
    assert!(ok, "{out}");
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Cancelled);
    let (ok, out) = run(&["retry", id.as_str()]);
    assert!(ok && out.contains("retrying"), "{out}");
    let new = stack.wait_for(&id, T, |v| v.retried_by.is_some()).await;
    let new_id = new.retried_by.unwrap();
    let v = stack.wait_status(&new_id, JobStatus::Queued, T).await;
    assert_eq!(v.retry_of.as_ref(), Some(&id));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_are_validated_and_kept_out_of_the_job_id() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    for (extra, field) in [
        (json!({"start_before": "soon"}), "start_before"),
        (json!({"start_before": "2001-01-01T00:00:00Z"}), "start_before"),
        (json!({"max_runtime": 0}), "max_runtime"),
        (json!({"max_runtime": "10"}), "max_runtime"),
    ] {
        let mut body = job_body(&stack, "deadline", None);
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (code, b) = stack.submit(&body).await;
        assert_eq!(code, 422, "{extra}: {b}");
        assert_eq!(b["error"]["field"], field, "{b}");
    }
    let plain = job_body(&stack, "same", None);
    let mut timed = plain.clone();
    timed["max_runtime"] = json!(30);
    timed["start_before"] = json!((chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339());
    let (_, a) = stack.submit(&timed).await;
    let (_, b) = stack.submit(&plain).await;
    assert_eq!(a["job_id"], b["job_id"]);
    let v = stack.wait_status(&job_id(&a), JobStatus::Queued, T).await;
    assert_eq!(v.max_runtime, Some(30));
    assert!(v.start_before.is_some());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_not_started_in_time_expires_and_never_runs() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let mut body = job_body(&stack, "late", None);
    body["start_before"] = json!((chrono::Utc::now() + chrono::Duration::milliseconds(700)).to_rfc3339());
    let (code, b) = stack.submit(&body).await;
    assert_eq!(code, 202, "{b}");
    let id = job_id(&b);
    // No worker until the deadline has passed.
    tokio::time::sleep(Duration::from_millis(900)).await;
    stack.add_worker(std::sync::Arc::new(stemq_core::engine::FakeEngine::default())).await;
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Expired, "{v:#?}");
    assert!(v.started_at.is_none());
    let kinds: Vec<_> = stack.events(&id).await.iter().map(|e| e.body.kind()).collect();
    assert_eq!(kinds, ["requested", "expired"]);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_runtime_limits_one_job() {
    let stack = Stack::start(StackOptions::default()).await;
    let mut body = job_body(&stack, "slow", Some(json!({"sleep_ms": 4000})));
    body["max_runtime"] = json!(1);
    let (_, b) = stack.submit(&body).await;
    let v = stack.wait_terminal(&job_id(&b), T).await;
    assert_eq!(v.status, JobStatus::Failed, "{v:#?}");
    assert_eq!(v.error.unwrap().code, "time_limit");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_describes_cancel_retry_events_deliveries_and_webhook_secrets() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let (code, doc) = stack.get("/openapi.json").await;
    assert_eq!(code, 200);
    for (path, method) in [
        ("/v1/separations/{id}/cancel", "post"),
        ("/v1/separations/{id}/retry", "post"),
        ("/v1/separations/{id}/events", "get"),
        ("/v1/separations/{id}/deliveries", "get"),
        ("/v1/separations/{id}/deliveries/{n}/replay", "post"),
        ("/v1/webhooks/secret", "get"),
        ("/v1/webhooks/secret/rotate", "post"),
    ] {
        assert!(doc["paths"][path][method].is_object(), "{path} {method} missing");
    }
    let req = &doc["components"]["schemas"]["JobRequest"]["properties"];
    assert!(req["start_before"].is_object() && req["max_runtime"].is_object());
    let attempt = &doc["components"]["schemas"]["DeliveryAttempt"]["properties"];
    assert!(attempt["status_code"].is_object() && attempt["time"].is_object(), "{attempt}");
    let text = doc.to_string();
    assert!(!text.contains("#/$defs/"), "dangling $defs reference");
    stack.shutdown().await;
}

/// Issue 18: before a start, the worker reads the log with one direct get on the job's
/// one-token events (`stemq.jobs.<id>.*`). Whatever came last there, it still tells an
/// outcome from a cancel request: a cancel request with no outcome yet (the ingress
/// recorded only the first of its two events) ends the job `cancelled` without running
/// it, and an outcome followed by another event (a retry link) is skipped, not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_look_up_before_a_start_reads_past_whatever_came_last() {
    use stemq_core::event::{CancelRequested, Cancelled, Retried};
    use stemq_core::request::{Model, Priority};
    use stemq_core::{Event, JobRequest};
    use stemq_nats::publish::{publish, publish_request};
    use stemq_nats::{job_subject, pool_consumer, SubjectKind};

    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let request = |name: &str| {
        let req = JobRequest::from_value(job_body(&stack, name, None)).unwrap();
        Event::requested(req.normalize("anonymous").unwrap(), None, None, "/test")
    };
    let record = |id: &stemq_core::JobId, kind, body| {
        let (js, subject) = (stack.js.clone(), job_subject(id, kind));
        let ev = Event::new(id, "/test", body);
        async move { publish(&js, &subject, &ev, None).await.unwrap() }
    };
    // A cancel request, and nothing after it.
    let asked = request("cancel-only");
    let asked_id = asked.subject.clone();
    publish_request(&stack.js, &asked_id, &asked).await.unwrap();
    record(&asked_id, SubjectKind::CancelRequested, EventBody::CancelRequested(CancelRequested { by: None })).await;
    // An outcome, then a retry link after it.
    let ended = request("ended-then-linked");
    let ended_id = ended.subject.clone();
    publish_request(&stack.js, &ended_id, &ended).await.unwrap();
    let done = EventBody::Cancelled(Cancelled { attempt: 1, interrupted: false });
    record(&ended_id, SubjectKind::Outcome, done).await;
    let link = EventBody::Retried(Retried { retried_by: asked_id.clone() });
    record(&ended_id, SubjectKind::Retried, link).await;

    stack.add_worker(std::sync::Arc::new(stemq_core::engine::FakeEngine::default())).await;
    let v = stack.wait_terminal(&asked_id, T).await;
    assert_eq!((v.status, v.attempt), (JobStatus::Cancelled, 1), "{v:?}");
    // Both deliveries answered: nothing pending in the pool.
    let deadline = Instant::now() + T;
    loop {
        let name = pool_consumer(Model::Dsp, Priority::Interactive);
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            stack.js.get_consumer_from_stream(&name, stemq_nats::JOBS_STREAM).await.unwrap();
        let info = c.info().await.unwrap();
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the pool still holds {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in [&asked_id, &ended_id] {
        let kinds: Vec<_> = stack.events(id).await.iter().map(|e| e.body.kind()).collect();
        assert!(!kinds.contains(&"started"), "{id}: {kinds:?}");
        assert_eq!(kinds.iter().filter(|k| **k == "cancelled").count(), 1, "{id}: one outcome: {kinds:?}");
    }
    stack.shutdown().await;
}
