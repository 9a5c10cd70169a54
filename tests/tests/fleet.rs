//! A mixed fleet: pools per model, lanes per priority, the worker registry.
//!
//! Against a real nats-server: real `dsp` workers and fake `htdemucs` workers side by
//! side, each job runs on a worker of its own model's pool and never fails for the
//! worker it landed on; a job for a model nobody serves waits (and says so) until a
//! worker for it starts; an interactive job overtakes a backlog of batch jobs; and an
//! ingress told to refuse such models (as `stemq dev` is) refuses them with a message.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use stemq_core::engine::FakeEngine;
use stemq_core::event::EventBody;
use stemq_core::request::Model;
use stemq_core::{JobId, JobStatus};
use stemq_tests::{job_body, job_id, upload_key, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);

/// A one-second demo song uploaded for the test owner; its `audio_uri`.
async fn song(stack: &Stack, name: &str) -> String {
    let path = stack.dir.path().join(format!("{name}.wav"));
    stemq_audio::synth::write_demo_song(&path, 1.0, 44_100).expect("demo song");
    let key = upload_key(&format!("{name}.wav"));
    stack.store.put_file(&key, &path).await.expect("upload");
    stack.store.uri(&key)
}

/// The attempts (`started` events) of a job, as (worker, attempt).
async fn attempts(stack: &Stack, id: &JobId) -> Vec<(String, u32)> {
    stack
        .events(id)
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            EventBody::Started(s) => Some((s.worker, s.attempt)),
            _ => None,
        })
        .collect()
}

async fn wait_until(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let t0 = Instant::now();
    while !check().await {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleet_runs_each_job_in_its_pool_and_a_job_nobody_serves_waits_for_its_worker() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let dsp = stack.add_worker(Arc::new(stemq_audio::DspEngine::default())).await; // inproc-0
    let htdemucs = stack.add_worker(Arc::new(FakeEngine::serving(&[Model::Htdemucs]))).await; // inproc-1
    let name = |i: usize| format!("inproc-{i}");
    wait_until("both workers in the registry", T, async || {
        stack.get("/v1/workers").await.1["workers"].as_array().map(|w| w.len()) == Some(2)
    })
    .await;

    let mut dsp_jobs = Vec::new();
    let mut htdemucs_jobs = Vec::new();
    for i in 0..4 {
        let uri = song(&stack, &format!("mix-{i}")).await;
        let (code, b) = stack.submit(&json!({"audio_uri": uri, "model": "dsp"})).await;
        assert_eq!(code, 202, "{b}");
        dsp_jobs.push(job_id(&b));
        let mut fake = job_body(&stack, &format!("ht-{i}"), Some(json!({"sleep_ms": 50})));
        fake["model"] = "htdemucs".into();
        let (code, b) = stack.submit(&fake).await;
        assert_eq!(code, 202, "{b}");
        htdemucs_jobs.push(job_id(&b));
    }
    // Nobody serves htdemucs_6s: it is accepted and waits, saying why.
    let mut six = job_body(&stack, "six", None);
    six["model"] = "htdemucs_6s".into();
    let (code, b) = stack.submit(&six).await;
    assert_eq!(code, 202, "{b}");
    let six_id = job_id(&b);

    for (jobs, worker) in [(&dsp_jobs, name(dsp)), (&htdemucs_jobs, name(htdemucs))] {
        for id in jobs {
            let v = stack.wait_terminal(id, T).await;
            assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
            // One attempt, on a worker of its own pool: never failed for where it landed.
            assert_eq!(attempts(&stack, id).await, [(worker.clone(), 1)], "job {id}");
        }
    }
    let (code, v) = stack.get(&format!("/v1/separations/{six_id}")).await;
    assert_eq!(code, 200);
    assert_eq!(v["status"], "queued", "{v}");
    assert_eq!(v["waiting"], "waiting for a worker that serves htdemucs_6s", "{v}");
    assert!(attempts(&stack, &six_id).await.is_empty(), "a worker that does not serve it took it");
    // The operators' view says the same, per pool.
    let (code, fleet) = stack.get("/v1/workers").await;
    assert_eq!(code, 200, "{fleet}");
    let pool = |model: &str| -> Value {
        fleet["pools"].as_array().unwrap().iter().find(|p| p["model"] == model).cloned().unwrap()
    };
    assert_eq!(pool("htdemucs_6s")["workers"], 0);
    assert_eq!(pool("htdemucs_6s")["waiting"], "waiting for a worker that serves htdemucs_6s");
    assert_eq!(pool("htdemucs_6s")["lanes"][0]["pending"], 1, "{fleet}");
    assert_eq!(pool("dsp")["workers"], 1);
    let served: Vec<Value> = fleet["workers"].as_array().unwrap().iter().map(|w| w["models"].clone()).collect();
    assert!(served.contains(&json!(["dsp"])) && served.contains(&json!(["htdemucs"])), "{fleet}");

    // A worker for it starts: the job runs there.
    let six_worker = stack.add_worker(Arc::new(FakeEngine::serving(&[Model::Htdemucs6s]))).await;
    let v = stack.wait_terminal(&six_id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    assert_eq!(attempts(&stack, &six_id).await, [(name(six_worker), 1)]);
    assert_eq!(v.waiting, None);

    // A worker that stops leaves the registry at once.
    stack.stop_worker(six_worker).await;
    let (_, fleet) = stack.get("/v1/workers").await;
    assert!(!fleet["workers"].as_array().unwrap().iter().any(|w| w["name"] == name(six_worker)), "{fleet}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_job_starts_within_one_job_behind_500_batch_jobs() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    // One worker, one job at a time, 200 ms per job.
    stack.add_worker(Arc::new(FakeEngine::default())).await;
    let job_ms = 200;
    let bodies: Vec<Value> = (0..500)
        .map(|i| {
            let mut b = job_body(&stack, &format!("bulk-{i}"), Some(json!({"sleep_ms": job_ms})));
            b["priority"] = "batch".into();
            b
        })
        .collect();
    let mut batch = Vec::new();
    for chunk in bodies.chunks(50) {
        for (code, b) in futures::future::join_all(chunk.iter().map(|b| stack.submit(b))).await {
            assert_eq!(code, 202, "{b}");
            batch.push(job_id(&b));
        }
    }
    // The backlog is running.
    wait_until("the first batch job", T, async || !attempts(&stack, &batch[0]).await.is_empty()).await;
    let body = job_body(&stack, "urgent", Some(json!({"sleep_ms": job_ms})));
    let submitted = chrono::Utc::now();
    let (code, b) = stack.submit(&body).await;
    assert_eq!(code, 202, "{b}");
    let urgent = job_id(&b);
    let v = stack.wait_for(&urgent, T, |v| v.started_at.is_some()).await;
    let started = v.started_at.unwrap();
    let waited = (started - submitted).to_std().unwrap_or_default();
    // How many batch jobs started between its submit and its start: at most the one
    // whose slot it waited for.
    let mut overtaken_by = 0;
    for id in &batch {
        if let Some(view) = stack.view(id).await {
            if view.started_at.is_some_and(|t| t > submitted && t < started) {
                overtaken_by += 1;
            }
        }
    }
    println!("interactive job waited {waited:?} behind 500 batch jobs of {job_ms} ms; {overtaken_by} batch job(s) started in between");
    assert!(overtaken_by <= 1, "{overtaken_by} batch jobs started before the interactive one");
    assert!(waited < Duration::from_millis(2 * job_ms + 1_000), "waited {waited:?}");
    // Most of the backlog is still waiting: it really was behind them.
    let done = futures::future::join_all(batch.iter().map(|id| stack.view(id))).await;
    let finished = done.iter().filter(|v| v.as_ref().is_some_and(|v| v.status.is_terminal())).count();
    assert!(finished < 100, "{finished} batch jobs already finished");
    assert_eq!(stack.view(&urgent).await.and_then(|v| v.priority), None, "interactive is the default, left implicit");
    assert_eq!(stack.view(&batch[0]).await.and_then(|v| v.priority), Some(stemq_core::request::Priority::Batch));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_that_refuses_unserved_models_says_what_to_do() {
    let mut stack = Stack::start(StackOptions { workers: 0, refuse_unserved: true, ..Default::default() }).await;
    stack.add_worker(Arc::new(FakeEngine::serving(&[Model::Dsp]))).await;
    wait_until("the worker in the registry", T, async || {
        stack.get("/v1/workers").await.1["workers"].as_array().is_some_and(|w| !w.is_empty())
    })
    .await;
    let mut body = job_body(&stack, "default-model", None);
    body.as_object_mut().unwrap().remove("model"); // the default, htdemucs
    let (code, b) = stack.submit(&body).await;
    assert_eq!(code, 422, "{b}");
    assert_eq!(b["error"]["code"], "model_not_served", "{b}");
    assert_eq!(b["error"]["field"], "model");
    let message = b["error"]["message"].as_str().unwrap();
    assert!(message.contains("htdemucs") && message.contains("serve dsp"), "{message}");
    assert!(message.contains("stemq models pull htdemucs"), "{message}");
    // Nothing was queued.
    assert_eq!(stack.count_on("stemq.jobs.*.requested.>").await, 0);
    // What it serves runs.
    let (code, b) = stack.submit(&job_body(&stack, "served", None)).await;
    assert_eq!(code, 202, "{b}");
    assert_eq!(stack.wait_terminal(&job_id(&b), T).await.status, JobStatus::Succeeded);
    // A model stemq does not know is refused by any ingress.
    let mut unknown = job_body(&stack, "unknown", None);
    unknown["model"] = "spleeter".into();
    let (code, b) = stack.submit(&unknown).await;
    assert_eq!((code, b["error"]["field"].as_str()), (422, Some("model")), "{b}");
    stack.shutdown().await;
}

/// A worker that announced itself a moment ago serves at once: before an ingress refuses
/// a model nobody serves, its copy of the registry (a watch on the bucket) catches up
/// with the bucket, so the entry the watch has not delivered yet counts. Each model in
/// turn is announced by one connection (the worker's) and read at once on another (the
/// ingress's), as `stemq dev`'s first submit does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_catches_up_with_a_worker_that_just_announced_itself() {
    use stemq_nats::registry::{announce, test_worker, Registry};
    use stemq_nats::users::{INGRESS, WORKER};
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let bucket_as = async |user: &str| {
        async_nats::jetstream::new(stack.connect_as(user).await)
            .get_key_value(stemq_nats::WORKERS_BUCKET)
            .await
            .expect("the registry bucket")
    };
    let copy = Registry::watch(bucket_as(INGRESS).await);
    assert!(copy.wait_ready(T).await, "the copy reads the bucket");
    assert!(copy.catch_up(T).await, "an empty bucket: nothing to catch up with");
    let worker = bucket_as(WORKER).await;
    for (i, model) in Model::ALL.iter().copied().enumerate() {
        let info = test_worker(&format!("new-{i}"), &[model], 0);
        announce(&worker, &info).await.unwrap();
        assert!(copy.catch_up(T).await, "{model}");
        assert_eq!(copy.serving(model), 1, "{model}: announced, and not in the copy that caught up");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_an_earlier_release_is_routed_into_its_pool() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.add_worker(Arc::new(FakeEngine::serving(&[Model::Dsp]))).await;
    // The oldest form, `stemq.jobs.<id>.requested`, as the operator may still publish it.
    let req = stemq_core::JobRequest::from_value(job_body(&stack, "old", None))
        .unwrap()
        .normalize(stemq_tests::TEST_OWNER)
        .unwrap();
    let ev = stemq_core::Event::requested(req, None, None, "urn:test:old-release");
    let id = ev.subject.clone();
    let old = stemq_nats::job_subject(&id, stemq_nats::SubjectKind::Requested);
    stack.js.publish(old.clone(), ev.to_bytes()).await.unwrap().await.unwrap();
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    assert_eq!(attempts(&stack, &id).await.len(), 1);
    // Routed once: the original and one copy in the dsp pool.
    assert_eq!(stack.count_on(&old).await, 1);
    assert_eq!(stack.count_on(&format!("stemq.jobs.{id}.requested.*.dsp.interactive")).await, 1);
    // Submitting it again through the API finds the job.
    let (code, b) = stack.submit(&job_body(&stack, "old", None)).await;
    assert_eq!((code, job_id(&b)), (200, id), "{b}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_can_default_its_jobs_to_the_batch_lane() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let (key, _) = stemq_accounts::auth::create_with(
        &stack.keys,
        stemq_tests::TEST_OWNER,
        stemq_accounts::auth::Role::Submit,
        stemq_accounts::auth::Limits::NONE,
        "bulk",
        Some(stemq_core::request::Priority::Batch),
    )
    .await
    .unwrap();
    let submit = |body: Value| {
        let key = key.expose();
        let url = stack.url("/v1/separations");
        async move {
            let r = reqwest::Client::new().post(url).bearer_auth(key).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    // No priority in the request: the key's lane.
    let (code, b) = submit(job_body(&stack, "bulk-default", None)).await;
    assert_eq!(code, 202, "{b}");
    let id = job_id(&b);
    assert_eq!(stack.count_on(&format!("stemq.jobs.{id}.requested.*.dsp.batch")).await, 1);
    // A request that names its lane keeps it.
    let mut urgent = job_body(&stack, "bulk-urgent", None);
    urgent["priority"] = "interactive".into();
    let (code, b) = submit(urgent).await;
    assert_eq!(code, 202, "{b}");
    let id = job_id(&b);
    assert_eq!(stack.count_on(&format!("stemq.jobs.{id}.requested.*.dsp.interactive")).await, 1);
    stack.shutdown().await;
}

/// Issue 37: an idle worker costs the server little, and still finds what is never
/// announced. A worker serving every model (30 lanes) idles: it looks only at lanes that
/// hold something, less and less often, and reads the consumer of a lane that holds
/// nothing every 30 s (looking at every lane every 250 ms and reading each consumer every
/// second would be about 200 messages a second). A job whose first delivery is dropped comes back
/// after the ack wait unannounced, and the idle worker runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_worker_costs_little_and_still_takes_an_unannounced_redelivery() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let client = stack.connect_as(stemq_nats::users::WORKER).await;
    let stats = client.statistics();
    let mut config = stemq_worker::Config::new(stack.store.clone(), stack.dir.path().join("scratch"));
    config.name = "idle".into();
    let stop = tokio_util::sync::CancellationToken::new();
    let worker = tokio::spawn(stemq_worker::run(client, Arc::new(FakeEngine::default()), config, stop.clone()));
    let messages = || {
        stats.in_messages.load(std::sync::atomic::Ordering::Relaxed)
            + stats.out_messages.load(std::sync::atomic::Ordering::Relaxed)
    };
    // Past its start (a first read of every lane, first looks at all of them), then over
    // one whole period of a quiet lane's reads (30 s, read on the 5 s ticks).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (n0, t0) = (messages(), Instant::now());
    tokio::time::sleep(Duration::from_secs(35)).await;
    let per_sec = (messages() - n0) as f64 / t0.elapsed().as_secs_f64();
    eprintln!("an idle worker serving 30 lanes: {per_sec:.1} messages a second");
    assert!(per_sec < 6.0, "an idle worker sends and receives {per_sec:.1} messages a second");

    // A pull armed before the submit takes the job's first delivery and drops it.
    let pool = stemq_nats::pool_consumer(Model::Dsp, stemq_core::request::Priority::Interactive);
    let consumer: async_nats::jetstream::consumer::PullConsumer =
        stack.js.get_consumer_from_stream(&pool, stemq_nats::JOBS_STREAM).await.unwrap();
    let mut thief = consumer.batch().max_messages(1).expires(Duration::from_secs(5)).messages().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, body) = stack.submit(&job_body(&stack, "dropped", None)).await;
    assert_eq!(status, 202, "{body}");
    let id = job_id(&body);
    let dropped = futures::StreamExt::next(&mut thief).await.expect("the thief's pull answers").unwrap();
    assert!(dropped.subject.contains(id.as_str()), "the thief took the job: {}", dropped.subject);
    drop(dropped);
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    // Its second delivery (the thief had the first), run by the idle worker.
    assert_eq!(attempts(&stack, &id).await, vec![("idle".to_string(), 2)], "the redelivery ran on the idle worker");
    stop.cancel();
    worker.await.unwrap().unwrap();
    stack.shutdown().await;
}
