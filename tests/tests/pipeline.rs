//! The pipeline end to end against a real nats-server: the five verification cases of
//! the Celery seed (normal run, duplicate submits, transient retry, SIGKILL mid-job,
//! many jobs) and the failure paths around them.

use std::time::Duration;

use serde_json::json;
use stemq_core::event::{EventBody, FailureClass};
use stemq_core::request::{Model, Priority};
use stemq_core::JobStatus;
use stemq_nats::{job_subject, SubjectKind};
use stemq_tests::{job_body, job_id, signal, wait_exit, Stack, StackOptions, SIGKILL, SIGTERM};

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_run_stores_stems_and_reports_status() {
    let stack = Stack::start(StackOptions::default()).await;
    let (code, body) = stack.submit(&job_body(&stack, "song", None)).await;
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["cached"], false);
    assert_eq!(body["status"], "queued");
    let id = job_id(&body);
    assert_eq!(body["status_url"], format!("/v1/separations/{id}"));

    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    assert_eq!(v.attempt, 1);
    assert_eq!(v.outputs.iter().map(|o| o.stem.as_str()).collect::<Vec<_>>(), ["drums", "bass", "other", "vocals"]);
    for o in &v.outputs {
        let key = o.uri.strip_prefix(&format!("{}/", stack.store.base_url())).expect("output in the store");
        assert_eq!(key, format!("jobs/{id}/{}.wav", o.stem));
        let bytes = stack.store.get_bytes(key).await.expect("stem stored");
        assert_eq!(bytes.len() as u64, o.bytes);
    }
    assert!(v.manifest_uri.as_deref().unwrap().ends_with(&format!("jobs/{id}/manifest.json")));

    let (code, got) = stack.get(&format!("/v1/separations/{id}")).await;
    assert_eq!(code, 200);
    assert_eq!(got["status"], "succeeded");
    let (code, _) = stack.get(&format!("/v1/separations/{}", "0".repeat(64))).await;
    assert_eq!(code, 404);
    let (code, _) = stack.get("/v1/separations/not-an-id").await;
    assert_eq!(code, 404);

    // The log holds requested, started, succeeded — one of each.
    let kinds: Vec<_> = stack.events(&id).await.iter().map(|e| e.body.kind()).collect();
    assert_eq!(kinds, ["requested", "started", "succeeded"]);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_submits_create_one_job() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let body = job_body(&stack, "dup", None);
    let (c1, b1) = stack.submit(&body).await;
    // Same request with keys reordered, an explicit default and other metadata.
    let same = json!({"overlap": 0.25, "model": "dsp", "metadata": {"x": 1}, "audio_uri": body["audio_uri"]});
    let (c2, b2) = stack.submit(&same).await;
    assert_eq!((c1, c2), (202, 200));
    assert_eq!(b1["job_id"], b2["job_id"]);
    assert_eq!(b2["cached"], true);

    // 200 concurrent identical requests: exactly one creates the job.
    let body = job_body(&stack, "burst", None);
    let answers = futures::future::join_all((0..200).map(|_| stack.submit(&body))).await;
    let created = answers.iter().filter(|(c, _)| *c == 202).count();
    let cached = answers.iter().filter(|(c, b)| *c == 200 && b["cached"] == true).count();
    assert_eq!((created, cached), (1, 199), "{:?}", answers.iter().map(|a| a.0).collect::<Vec<_>>());
    let ids: std::collections::HashSet<_> = answers.iter().map(|(_, b)| b["job_id"].clone()).collect();
    assert_eq!(ids.len(), 1);
    let id = job_id(&answers[0].1);
    // One request in every form and lane, on the routed subject of its pool.
    assert_eq!(stack.count_on(&stemq_nats::request_filter(&id)).await, 1);
    let routed = stemq_nats::request_subject(&id, stemq_tests::TEST_OWNER, Model::Dsp, Priority::Interactive);
    assert_eq!(stack.count_on(&routed).await, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_after_the_dedupe_window_is_still_the_same_job() {
    let mut opts = StackOptions { workers: 0, ..Default::default() };
    opts.settings.duplicate_window = Duration::from_millis(500);
    let stack = Stack::start(opts).await;
    let body = job_body(&stack, "later", None);
    let (c1, b1) = stack.submit(&body).await;
    assert_eq!(c1, 202);
    // Well past the window: the server no longer remembers the Nats-Msg-Id.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (c2, b2) = stack.submit(&body).await;
    assert_eq!(c2, 200, "{b2}");
    assert_eq!(b1["job_id"], b2["job_id"]);
    // The lane is not part of the job: the same request in the other lane is the same
    // job too, though it would go to another subject.
    let mut batch = body.clone();
    batch["priority"] = "batch".into();
    let (c3, b3) = stack.submit(&batch).await;
    assert_eq!((c3, &b3["job_id"]), (200, &b1["job_id"]), "{b3}");
    assert_eq!(stack.count_on(&stemq_nats::request_filter(&job_id(&b1))).await, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_are_retried_with_backoff_then_succeed() {
    let stack = Stack::start(StackOptions { backoff_base: Duration::from_millis(200), ..Default::default() }).await;
    let (_, b) = stack.submit(&job_body(&stack, "flaky", Some(json!({"fail_transient": 2})))).await;
    let id = job_id(&b);
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!((v.status, v.attempt, v.retries), (JobStatus::Succeeded, 3, 2), "{v:#?}");

    let events = stack.events(&id).await;
    let failures: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::Failed(f) => Some((f.clone(), e.time)),
            _ => None,
        })
        .collect();
    assert_eq!(failures.len(), 2);
    assert!(failures.iter().all(|(f, _)| f.class == FailureClass::Transient));
    let d1 = failures[0].0.retry_in_ms.unwrap();
    let d2 = failures[1].0.retry_in_ms.unwrap();
    // 200 ms then 400 ms, ±20 % jitter.
    assert!((160..=240).contains(&d1) && (320..=480).contains(&d2), "{d1} {d2}");
    // The next attempt did wait for the backoff.
    let starts: Vec<_> = events.iter().filter(|e| e.body.kind() == "started").map(|e| e.time).collect();
    assert_eq!(starts.len(), 3);
    assert!((starts[1] - failures[0].1).num_milliseconds() >= d1 as i64 - 20);
    assert!((starts[2] - failures[1].1).num_milliseconds() >= d2 as i64 - 20);
    assert_eq!(stack.count_on(&job_subject(&id, SubjectKind::Outcome)).await, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_is_not_retried() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "bad", Some(json!({"fail_permanent": true})))).await;
    let id = job_id(&b);
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!((v.status, v.attempt), (JobStatus::Failed, 1));
    assert_eq!(v.error.as_ref().unwrap().class, FailureClass::Permanent);
    assert_eq!(v.error.as_ref().unwrap().code, "invalid_audio");
    // Twice the ack wait later, still exactly one attempt.
    tokio::time::sleep(stack.options.settings.ack_wait * 2).await;
    let starts = stack.events(&id).await.iter().filter(|e| e.body.kind() == "started").count();
    assert_eq!(starts, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_job_is_redelivered_and_succeeds_once() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let mut w1 = stack.spawn_worker("w1", &[]);
    let (_, b) = stack.submit(&job_body(&stack, "long", Some(json!({"sleep_ms": 1500})))).await;
    let id = job_id(&b);
    let v = stack.wait_status(&id, JobStatus::Running, T).await;
    assert_eq!((v.status, v.worker.as_deref()), (JobStatus::Running, Some("w1")));
    signal(&w1, SIGKILL);
    wait_exit(&mut w1, T).expect("w1 died");

    let mut w2 = stack.spawn_worker("w2", &[]);
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!((v.status, v.attempt, v.worker.as_deref()), (JobStatus::Succeeded, 2, Some("w2")), "{v:#?}");
    // Give any stray redelivery time to happen: still one outcome.
    tokio::time::sleep(stack.options.settings.ack_wait + Duration::from_millis(500)).await;
    assert_eq!(stack.count_on(&job_subject(&id, SubjectKind::Outcome)).await, 1);
    signal(&w2, SIGTERM);
    assert!(wait_exit(&mut w2, T).expect("w2 exits").success());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_current_job_then_exits_zero() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let mut w = stack.spawn_worker("graceful", &[]);
    let (_, b) = stack.submit(&job_body(&stack, "term", Some(json!({"sleep_ms": 2000})))).await;
    let id = job_id(&b);
    stack.wait_status(&id, JobStatus::Running, T).await;
    signal(&w, SIGTERM);
    // A job submitted after the signal, while the worker is still finishing its current
    // one and alive: it must not be pulled (issue 11, item 10: submitted after the exit,
    // as before, this check held whatever the worker did).
    let (_, b2) = stack.submit(&job_body(&stack, "after-term", None)).await;
    let late = job_id(&b2);
    assert!(w.try_wait().unwrap().is_none(), "still finishing its job when the late one arrives");
    let status = wait_exit(&mut w, T).expect("worker exits after its job");
    assert!(status.success(), "exit status {status:?}\n{}", stack.worker_log("graceful"));
    let v = stack.wait_terminal(&id, Duration::from_secs(5)).await;
    assert_eq!((v.status, v.attempt), (JobStatus::Succeeded, 1), "finished by the same worker, first attempt");
    assert_eq!(stack.count_on(&job_subject(&late, SubjectKind::Started)).await, 0, "pulled nothing after the signal");
    assert_eq!(stack.view(&late).await.map(|v| v.status), Some(JobStatus::Queued));
    // It was left for the next worker, on its first delivery.
    let mut w2 = stack.spawn_worker("next", &[]);
    let v = stack.wait_terminal(&late, T).await;
    assert_eq!((v.status, v.attempt, v.worker.as_deref()), (JobStatus::Succeeded, 1, Some("next")));
    signal(&w2, SIGTERM);
    assert!(wait_exit(&mut w2, T).expect("exits").success());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_looping_job_is_dead_lettered_while_others_flow() {
    let mut opts = StackOptions { workers: 0, ..Default::default() };
    opts.settings.ack_wait = Duration::from_millis(1000);
    opts.settings.max_deliver = 3;
    let stack = Stack::start(opts).await;
    let (_, b) = stack.submit(&job_body(&stack, "poison", Some(json!({"abort": u32::MAX})))).await;
    let poison = job_id(&b);

    // Two worker processes without engine isolation (with it, only the engine host
    // dies: see faults.rs), each restarted by a supervisor when it dies, as Kubernetes
    // would. Whichever takes the poison job dies; the other jobs keep flowing.
    let mut restarts = 0;
    let no_iso = [("STEMQ_ISOLATION", "none")];
    let mut ws = vec![stack.spawn_worker("a", &no_iso), stack.spawn_worker("b", &no_iso)];
    let mut others = Vec::new();
    for i in 0..5 {
        let (_, b) = stack.submit(&job_body(&stack, &format!("ok-{i}"), None)).await;
        others.push(job_id(&b));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = stack.view(&poison).await {
            if v.status.is_terminal() {
                break;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "poison job never dead-lettered");
        for (i, w) in ws.iter_mut().enumerate() {
            if let Ok(Some(_)) = w.try_wait() {
                restarts += 1;
                *w = stack.spawn_worker(if i == 0 { "a" } else { "b" }, &no_iso);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v = stack.view(&poison).await.unwrap();
    assert_eq!(v.status, JobStatus::DeadLettered, "{v:#?}");
    assert_eq!(v.error.as_ref().unwrap().code, "crash_loop");
    assert!(restarts >= 3, "a worker process died on each of the 3 deliveries ({restarts} restarts)");
    for id in &others {
        assert_eq!(stack.wait_terminal(id, T).await.status, JobStatus::Succeeded);
    }
    assert_eq!(stack.count_on(&job_subject(&poison, SubjectKind::Outcome)).await, 1);
    for w in &mut ws {
        signal(w, SIGKILL);
        let _ = wait_exit(w, T);
    }

    // The dead letter is listed, and a replay is a new job linked both ways.
    let (_, page) = stack.get("/v1/separations?status=dead_lettered").await;
    assert_eq!(page["jobs"][0]["job_id"], poison.as_str());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failure_on_the_last_delivery_dead_letters() {
    let mut opts = StackOptions::default();
    opts.settings.max_deliver = 2;
    let stack = Stack::start(opts).await;
    let (_, b) = stack.submit(&job_body(&stack, "always-flaky", Some(json!({"fail_transient": 99})))).await;
    let id = job_id(&b);
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!((v.status, v.attempt), (JobStatus::DeadLettered, 2), "{v:#?}");
    assert_eq!(v.error.as_ref().unwrap().code, "max_deliveries");
    assert!(v.error.as_ref().unwrap().message.contains("scripted transient failure"));
    // The advisory that follows must not produce a second outcome.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stack.count_on(&job_subject(&id, SubjectKind::Outcome)).await, 1);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_steps_down_the_ladder_and_marks_degraded() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "oom-cpu", Some(json!({"oom_until": "cpu"})))).await;
    let v = stack.wait_terminal(&job_id(&b), T).await;
    assert_eq!((v.status, v.degraded, v.device.as_deref()), (JobStatus::Succeeded, true, Some("cpu")), "{v:#?}");
    // A model with segments: the middle rung halves the trained 7.8 s.
    let mut body = job_body(&stack, "oom-seg", Some(json!({"oom_until": "segment"})));
    body["model"] = json!("htdemucs");
    let (_, b) = stack.submit(&body).await;
    let id = job_id(&b);
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!((v.status, v.degraded, v.device.as_deref()), (JobStatus::Succeeded, true, Some("fake-gpu")));
    let seg = stack.events(&id).await.iter().find_map(|e| match &e.body {
        EventBody::Succeeded(s) => s.segment,
        _ => None,
    });
    assert_eq!(seg, Some(3.9), "half the trained segment");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_time_limit_fails_the_job() {
    let stack = Stack::start(StackOptions { time_limit: Duration::from_millis(500), ..Default::default() }).await;
    let (_, b) = stack.submit(&job_body(&stack, "slow", Some(json!({"sleep_ms": 5000})))).await;
    let v = stack.wait_terminal(&job_id(&b), T).await;
    assert_eq!(v.status, JobStatus::Failed);
    assert_eq!(v.error.as_ref().unwrap().code, "time_limit");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ack_does_not_run_the_job_again() {
    // An outcome is already recorded (a worker finished, its ack was lost): the
    // redelivered request must be skipped, not run.
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let req = stemq_core::JobRequest::from_value(job_body(&stack, "acked-late", None)).unwrap();
    let ev = stemq_core::Event::requested(req.normalize("anonymous").unwrap(), None, None, "/test");
    let id = ev.subject.clone();
    let done = stemq_core::Event::new(
        &id,
        "/test",
        EventBody::Succeeded(stemq_core::event::Succeeded {
            attempt: 1,
            outputs: vec![],
            manifest_uri: None,
            degraded: false,
            device: "fake-gpu".into(),
            segment: None,
            duration_ms: 1,
            audio_ms: None,
        }),
    );
    stemq_nats::publish::publish(&stack.js, &job_subject(&id, SubjectKind::Requested), &ev, Some(id.as_str()))
        .await
        .unwrap();
    stemq_nats::publish::publish(&stack.js, &job_subject(&id, SubjectKind::Outcome), &done, None).await.unwrap();
    let mut stack = stack;
    stack.add_worker(std::sync::Arc::new(stemq_core::engine::FakeEngine::default())).await;
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded);
    // Wait until the worker consumer has nothing pending, then check nothing started.
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            stack.js.get_consumer_from_stream(stemq_nats::WORKERS_CONSUMER, stemq_nats::JOBS_STREAM).await.unwrap();
        let info = c.info().await.unwrap();
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stack.count_on(&job_subject(&id, SubjectKind::Started)).await, 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_jobs_all_succeed() {
    let stack = Stack::start(StackOptions { workers: 8, ..Default::default() }).await;
    let bodies: Vec<_> = (0..300).map(|i| job_body(&stack, &format!("many-{i}"), None)).collect();
    let answers = futures::future::join_all(bodies.iter().map(|b| stack.submit(b))).await;
    assert!(answers.iter().all(|(c, _)| *c == 202));
    for (_, b) in &answers {
        assert_eq!(stack.wait_terminal(&job_id(b), T).await.status, JobStatus::Succeeded);
    }
    // Listing is newest first and pages with a cursor.
    let (_, p1) = stack.get("/v1/separations?limit=100").await;
    let (_, p2) = stack.get(&format!("/v1/separations?limit=100&cursor={}", p1["next_cursor"].as_str().unwrap())).await;
    let jobs: Vec<_> = p1["jobs"].as_array().unwrap().iter().chain(p2["jobs"].as_array().unwrap()).collect();
    assert_eq!(jobs.len(), 200);
    let created: Vec<_> = jobs.iter().map(|j| j["created_at"].as_str().unwrap().to_string()).collect();
    let parsed: Vec<_> = created.iter().map(|c| chrono::DateTime::parse_from_rfc3339(c).expect("RFC 3339")).collect();
    assert!(parsed.windows(2).all(|w| w[0] >= w[1]), "not newest first: {created:?}");
    let (_, ok) = stack.get("/v1/separations?status=succeeded&limit=1000").await;
    assert_eq!(ok["jobs"].as_array().unwrap().len(), 300);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restart_loses_nothing() {
    let mut stack = Stack::start(StackOptions::default()).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let (_, b) = stack.submit(&job_body(&stack, &format!("before-{i}"), None)).await;
        ids.push(job_id(&b));
    }
    for id in &ids {
        stack.wait_terminal(id, T).await;
    }
    stack.server.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stack.server.restart().expect("restart");
    // Clients reconnect by themselves; new work flows again.
    let deadline = tokio::time::Instant::now() + T;
    let id = loop {
        let (c, b) = stack.submit(&job_body(&stack, "after-restart", None)).await;
        if c == 202 || c == 200 {
            break job_id(&b);
        }
        assert!(tokio::time::Instant::now() < deadline, "ingress never recovered: {c} {b}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Succeeded);
    for old in &ids {
        assert_eq!(stack.view(old).await.unwrap().status, JobStatus::Succeeded, "durable view survived");
    }
    stack.shutdown().await;
}

/// A new job goes from submit to its terminal view without anyone reading the log: the
/// submit's publish expects nothing of the job in it, and the worker's `started`
/// expects none of its one-token events. The look-ups run only when something is
/// there: a repeated submit, or a job whose cancel came before its request (which the
/// worker then finds, and the job is cancelled, never run). Direct gets carry the
/// subject they read, so the operator sees which of them name the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_job_runs_without_a_look_up_and_what_is_recorded_is_looked_up() {
    use futures::{FutureExt, StreamExt};
    let stack = Stack::start(StackOptions::default()).await;
    let id_of = |body: &serde_json::Value| {
        stemq_core::JobRequest::from_value(body.clone()).unwrap().normalize(stemq_tests::TEST_OWNER).unwrap().job_id()
    };
    let mut gets = stack.client.subscribe(format!("$JS.API.DIRECT.GET.{}.>", stemq_nats::JOBS_STREAM)).await.unwrap();
    stack.client.flush().await.unwrap();
    let looked_up = |gets: &mut async_nats::Subscriber, id: &stemq_core::JobId| {
        let mut n = 0;
        while let Some(Some(m)) = gets.next().now_or_never() {
            n += usize::from(m.subject.as_str().contains(id.as_str()));
        }
        n
    };
    let body = job_body(&stack, "one-round-trip", None);
    let id = id_of(&body);
    let (code, b) = stack.submit(&body).await;
    assert_eq!((code, job_id(&b)), (202, id.clone()), "{b}");
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Succeeded);
    stack.client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(looked_up(&mut gets, &id), 0, "the log was read for a new job");
    // The same request again: found (by its message id or the look-ups), nothing stored.
    let events = stack.count_on(&format!("stemq.jobs.{id}.>")).await;
    let (code, b) = stack.submit(&body).await;
    assert_eq!((code, job_id(&b), b["cached"].as_bool()), (200, id.clone(), Some(true)), "{b}");
    assert_eq!(stack.count_on(&format!("stemq.jobs.{id}.>")).await, events);

    // A cancel recorded before the request: the request is still stored, once, and the
    // worker's `started` is refused, so it looks the job up and cancels it unrun.
    let later = job_body(&stack, "cancelled-first", None);
    let later_id = id_of(&later);
    let cancel = stemq_core::Event::new(
        &later_id,
        "urn:test",
        EventBody::CancelRequested(stemq_core::event::CancelRequested { by: None }),
    );
    stack
        .js
        .publish(job_subject(&later_id, SubjectKind::CancelRequested), cancel.to_bytes())
        .await
        .unwrap()
        .await
        .unwrap();
    let (code, b) = stack.submit(&later).await;
    assert_eq!((code, job_id(&b)), (202, later_id.clone()), "{b}");
    assert_eq!(stack.wait_terminal(&later_id, T).await.status, JobStatus::Cancelled);
    assert_eq!(stack.count_on(&job_subject(&later_id, SubjectKind::Started)).await, 0, "a cancelled job started");
    assert_eq!(stack.count_on(&format!("stemq.jobs.{later_id}.requested.>")).await, 1);
    stack.client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(looked_up(&mut gets, &later_id) > 0, "a recorded cancel was not looked up");
    let (code, _) = stack.submit(&later).await;
    assert_eq!(code, 200);
    assert_eq!(stack.count_on(&format!("stemq.jobs.{later_id}.requested.>")).await, 1);
    stack.shutdown().await;
}

/// A recreated pool consumer delivers a finished job again as its first delivery, with
/// the same `started` message id inside the dedupe window. The `started` that expects
/// nothing of the job is refused (as a duplicate or as an occupied subject, whichever
/// the server checks first), so the worker looks the job up, finds the outcome and
/// skips it: the stems are not written again, and nothing more is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_job_delivered_again_as_new_is_skipped_not_run() {
    let stack = Stack::start(StackOptions::default()).await;
    let (code, b) = stack.submit(&job_body(&stack, "delivered-twice", None)).await;
    assert_eq!(code, 202, "{b}");
    let id = job_id(&b);
    assert_eq!(stack.wait_terminal(&id, T).await.status, JobStatus::Succeeded);
    let written = |dir: &std::path::Path| {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let m = e.metadata().unwrap();
                if m.is_dir() {
                    todo.push(e.path());
                } else {
                    out.push((e.path(), m.modified().unwrap()));
                }
            }
        }
        out.sort();
        out
    };
    let outputs = stack.dir.path().join("store").join("jobs").join(id.as_str());
    let before = written(&outputs);
    assert!(!before.is_empty(), "no stems under {}", outputs.display());
    let events = stack.count_on(&format!("stemq.jobs.{id}.>")).await;

    let pool = stemq_nats::pool_consumer(Model::Dsp, Priority::Interactive);
    stack.js.delete_consumer_from_stream(&pool, stemq_nats::JOBS_STREAM).await.unwrap();
    stemq_nats::ensure(&stack.js, &stack.options.settings).await.unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            stack.js.get_consumer_from_stream(&pool, stemq_nats::JOBS_STREAM).await.unwrap();
        let info = c.info().await.unwrap().clone();
        if info.delivered.stream_sequence > 0 && info.num_pending == 0 && info.num_ack_pending == 0 {
            assert_eq!(info.num_redelivered, 0, "{info:?}");
            break;
        }
        assert!(t0.elapsed() < T, "the request was not delivered and acked again: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(written(&outputs), before, "the finished job ran again");
    assert_eq!(stack.count_on(&format!("stemq.jobs.{id}.>")).await, events);
    assert_eq!(stack.count_on(&job_subject(&id, SubjectKind::Started)).await, 1);
    stack.shutdown().await;
}
