//! The contracts other services rely on: raw CloudEvents on the stream, forged ids,
//! validation, the NATS submit endpoint, the rebuildable view, and the HTTP surface.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob, FakeEngine, StemFile};
use stemq_core::{JobRequest, JobStatus};
use stemq_nats::{job_subject, SubjectKind, JOBS_STREAM, SUBMIT_SUBJECT};
use stemq_tests::{job_body, job_id, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);

async fn stream_messages(stack: &Stack) -> u64 {
    let mut s = stack.js.get_stream(JOBS_STREAM).await.unwrap();
    s.info().await.unwrap().state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_cloudevent_on_the_stream_is_run() {
    let stack = Stack::start(StackOptions::default()).await;
    // Written by hand, as a service in another language would: canonical request,
    // sha256 of its JCS form as id, subject and Nats-Msg-Id.
    let req = JobRequest::from_value(job_body(&stack, "foreign", None)).unwrap().normalize("anonymous").unwrap();
    let id = req.job_id();
    let ce = json!({
        "specversion": "1.0",
        "id": id,
        "source": "urn:example:catalog-service",
        "type": "io.stemq.job.requested.v1",
        "subject": id,
        "time": "2026-11-30T12:00:00Z",
        "datacontenttype": "application/json",
        "data": {"request": serde_json::to_value(&req).unwrap(), "metadata": {"from": "elsewhere"}}
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.as_str());
    stack
        .js
        .publish_with_headers(
            stemq_nats::request_subject(
                &id,
                "anonymous",
                stemq_core::request::Model::Dsp,
                stemq_core::request::Priority::Interactive,
            ),
            headers,
            serde_json::to_vec(&ce).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let v = stack.wait_terminal(&id, T).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    assert_eq!(v.metadata, Some(json!({"from": "elsewhere"})));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_id_is_dropped_never_run_and_cannot_block_the_real_job() {
    let stack = Stack::start(StackOptions::default()).await;
    let req =
        JobRequest::from_value(job_body(&stack, "forged", None)).unwrap().normalize(stemq_tests::TEST_OWNER).unwrap();
    // Claims someone else's id (say, to overwrite their outputs).
    let victim =
        JobRequest::from_value(job_body(&stack, "victim", None)).unwrap().normalize(stemq_tests::TEST_OWNER).unwrap();
    let claimed = victim.job_id();
    let mut ev = stemq_core::Event::requested(req, None, None, "urn:example:attacker");
    ev.id = claimed.to_string();
    ev.subject = claimed.clone();
    stack
        .js
        // On a subject of the attacker's own owner: the only request subjects a publisher may
        // use (`nats_access.rs`); unrouted, so the ingress's router is the one to drop it.
        .publish(stemq_nats::unrouted_request_subject(&claimed, "mallory"), ev.to_bytes())
        .await
        .unwrap()
        .await
        .unwrap();
    // Garbage on a job subject too.
    let junk_id = JobRequest::from_value(job_body(&stack, "junk", None)).unwrap().normalize("x").unwrap().job_id();
    stack.js.publish(job_subject(&junk_id, SubjectKind::Requested), "not json".into()).await.unwrap().await.unwrap();
    // Both are dropped: no attempt, no outcome, no view (the workers and the projector
    // have seen them once the consumers are past them).
    let t0 = std::time::Instant::now();
    while stack
        .js
        .get_stream(JOBS_STREAM)
        .await
        .unwrap()
        .consumer_info(stemq_nats::WORKERS_CONSUMER)
        .await
        .unwrap()
        .num_pending
        > 0
    {
        assert!(t0.elapsed() < T, "the workers never took the forged requests");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    for id in [&claimed, &junk_id] {
        assert_eq!(stack.count_on(&format!("stemq.jobs.{id}.>")).await, 1, "only the forged request: {id}");
        assert!(stack.view(id).await.is_none(), "a view for a job nobody submitted: {id}");
    }
    // The victim's real submit runs.
    let (code, b) = stack.submit(&job_body(&stack, "victim", None)).await;
    assert_eq!((code, job_id(&b)), (202, claimed.clone()), "{b}");
    assert_eq!(stack.wait_terminal(&claimed, T).await.status, JobStatus::Succeeded);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_get_422_naming_the_field_and_publish_nothing() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let before = stream_messages(&stack).await;
    let uri = job_body(&stack, "x", None)["audio_uri"].clone();
    let cases: Vec<(Value, &str)> = vec![
        (json!({"model": "dsp"}), "audio_uri"),
        (json!({"audio_uri": uri, "model": "nope"}), "model"),
        (json!({"audio_uri": uri, "overlap": 2}), "overlap"),
        (json!({"audio_uri": uri, "segment": 30, "model": "htdemucs"}), "segment"),
        (json!({"audio_uri": uri, "two_stems": "kazoo"}), "two_stems"),
        (json!({"audio_uri": uri, "surprise": true}), "surprise"),
        // Every enum-valued option names itself, not `body`.
        (json!({"audio_uri": uri, "encoding": "s32"}), "encoding"),
        (json!({"audio_uri": uri, "clip_mode": "soft"}), "clip_mode"),
        (json!({"audio_uri": uri, "output_format": "ogg"}), "output_format"),
        (json!({"audio_uri": uri, "output_format": "mp3", "mp3_bitrate": 300}), "mp3_bitrate"),
        (json!({"audio_uri": uri, "output_format": "mp3", "mp3_preset": 9}), "mp3_preset"),
        (json!({"audio_uri": uri, "two_stems": "vocals", "other_method": "mul"}), "other_method"),
        (json!({"audio_uri": uri, "shifts": 1u64 << 32}), "shifts"),
        // Untrusted URIs: refused before anything is published.
        (json!({"audio_uri": "file:///etc/passwd"}), "audio_uri"),
        (json!({"audio_uri": "http://169.254.169.254/latest/meta-data/"}), "audio_uri"),
        (json!({"audio_uri": "https://10.0.0.7/song.wav"}), "audio_uri"),
        (json!({"audio_uri": format!("{}/../../etc/passwd", stack.store.base_url())}), "audio_uri"),
        (json!({"audio_uri": format!("{}/uploads/%2e%2e/x.wav", stack.store.base_url())}), "audio_uri"),
        (json!({"audio_uri": "gs://bucket/song.wav"}), "audio_uri"),
    ];
    for (body, field) in cases {
        let (code, resp) = stack.submit(&body).await;
        assert_eq!(code, 422, "{body} → {resp}");
        assert_eq!(resp["error"]["field"], field, "{resp}");
        assert_eq!(resp["error"]["code"], "invalid_request");
    }
    // The message lists what the enum accepts.
    let (_, resp) = stack.submit(&json!({"audio_uri": uri, "encoding": "s32"})).await;
    let message = resp["error"]["message"].as_str().unwrap_or_default();
    for name in ["s16", "s24", "f32"] {
        assert!(message.contains(name), "`{name}` missing from {resp}");
    }
    let (code, resp) = stack.post_raw("/v1/separations", b"{not json".to_vec()).await;
    assert_eq!((code, resp["error"]["field"].as_str()), (422, Some("body")));
    assert_eq!(stream_messages(&stack).await, before, "nothing was published");
    let (code, resp) = stack.get("/v1/separations?status=bogus").await;
    assert_eq!((code, resp["error"]["field"].as_str()), (422, Some("status")));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_request_reply_submit_answers_like_http() {
    let stack = Stack::start(StackOptions::default()).await;
    let body = job_body(&stack, "via-nats", None);
    let ask = |b: &Value| {
        let c = stack.client.clone();
        let payload = serde_json::to_vec(b).unwrap();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Authorization", format!("Bearer {}", stack.key).as_str());
        async move {
            let m = c.request_with_headers(SUBMIT_SUBJECT, headers, payload.into()).await.expect("reply");
            serde_json::from_slice::<Value>(&m.payload).unwrap()
        }
    };
    let first = ask(&body).await;
    assert_eq!((first["http_status"].as_u64(), first["cached"].as_bool()), (Some(202), Some(false)), "{first}");
    let again = ask(&body).await;
    assert_eq!((again["http_status"].as_u64(), again["cached"].as_bool()), (Some(200), Some(true)));
    assert_eq!(first["job_id"], again["job_id"]);
    let (code, http) = stack.submit(&body).await;
    assert_eq!((code, http["job_id"].clone()), (200, first["job_id"].clone()));
    let bad = ask(&json!({"audio_uri": 5})).await;
    assert_eq!((bad["http_status"].as_u64(), bad["error"]["field"].as_str()), (Some(422), Some("audio_uri")));
    assert_eq!(stack.wait_terminal(&job_id(&first), T).await.status, JobStatus::Succeeded);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilding_the_view_from_the_log_gives_the_same_view() {
    let stack = Stack::start(StackOptions::default()).await;
    let mut ids = Vec::new();
    for (name, fake) in [
        ("ok", None),
        ("flaky", Some(json!({"fail_transient": 1}))),
        ("bad", Some(json!({"fail_permanent": true}))),
        ("oom", Some(json!({"oom_until": "cpu"}))),
    ] {
        let (_, b) = stack.submit(&job_body(&stack, name, fake)).await;
        ids.push(job_id(&b));
    }
    let mut before = Vec::new();
    for id in &ids {
        before.push(stack.wait_terminal(id, T).await);
    }
    stemq_projector::wait_caught_up(&stack.js, T).await.unwrap();

    // Drop the view and replay the log (what `stemq projector --rebuild` does), while the
    // running projector keeps going.
    let replayed = stemq_projector::reset(&stack.js, &stack.options.settings).await.unwrap();
    assert!(replayed >= 12, "{replayed} events to replay");
    let kv = stack.js.get_key_value(stemq_nats::JOBS_BUCKET).await.unwrap();
    let rebuild = tokio_util::sync::CancellationToken::new();
    let c = stack.connect_as(stemq_nats::users::PROJECTOR).await;
    let task = tokio::spawn(stemq_projector::run(c, Default::default(), rebuild.clone()));
    assert!(stemq_projector::wait_caught_up(&stack.js, T).await.unwrap());
    for (id, old) in ids.iter().zip(&before) {
        let (new, _) = stemq_projector::get_view(&kv, id).await.unwrap().expect("view rebuilt");
        assert_eq!(&new, old, "view of {id} differs after rebuild");
    }
    rebuild.cancel();
    task.await.unwrap().unwrap();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_metrics_and_openapi() {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    assert_eq!(stack.get_text("/healthz").await.0, 200);
    assert_eq!(stack.get_text("/readyz").await.0, 200);
    // Counters are process-wide (other tests in this binary submit too): compare deltas.
    let value = |text: &str, series: &str| -> f64 {
        text.lines().find_map(|l| l.strip_prefix(series).map(|v| v.trim().parse().unwrap())).unwrap_or(0.0)
    };
    let created = "stemq_submits_total{outcome=\"created\"}";
    let before = value(&stack.get_text("/metrics").await.1, created);
    for i in 0..3 {
        stack.submit(&job_body(&stack, &format!("m{i}"), None)).await;
    }
    let (code, text) = stack.get_text("/metrics").await;
    assert_eq!(code, 200);
    assert!(value(&text, created) - before >= 3.0, "{text}");
    // The jobs wait in their pool's lane (dsp, interactive: the API's default), which no
    // live worker serves (the stack has none).
    for series in [
        r#"stemq_queue_pending_jobs{consumer="workers-dsp-interactive",model="dsp",lane="interactive"} 3"#,
        r#"stemq_queue_pending_jobs{consumer="workers-htdemucs-batch",model="htdemucs",lane="batch"} 0"#,
        r#"stemq_queue_pending_jobs{consumer="workers"} 0"#,
        r#"stemq_pool_workers{model="dsp"} 0"#,
        r#"stemq_jobs_waiting_for_worker{model="dsp"} 3"#,
        r#"stemq_jobs_waiting_for_worker{model="htdemucs"} 0"#,
    ] {
        assert!(text.contains(series), "missing {series} in\n{text}");
    }
    // The oldest unfinished request is found in its pool (after the pool consumer's ack
    // floor, on the pool's routed filter).
    let oldest = value(&text, "stemq_queue_oldest_pending_age_seconds ");
    assert!(oldest > 0.0 && oldest < 60.0, "oldest pending age {oldest} in\n{text}");
    assert!(text.contains("stemq_http_request_duration_seconds_bucket"), "{text}");
    let (code, doc) = stack.get("/openapi.json").await;
    assert_eq!(code, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/v1/separations"]["post"]["responses"]["422"].is_object());
    assert!(doc["components"]["schemas"]["JobRequest"]["properties"]["audio_uri"].is_object());
    // Every $ref resolves.
    let text = doc.to_string();
    for r in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
        let name = &r[..r.find('"').unwrap()];
        assert!(doc["components"]["schemas"][name].is_object(), "dangling $ref {name}");
    }
    // The NATS side's contract is served as checked in.
    let (code, doc) = stack.get("/asyncapi.json").await;
    assert_eq!(code, 200);
    let checked_in: Value = serde_json::from_str(include_str!("../../schemas/asyncapi.json")).unwrap();
    assert_eq!(doc, checked_in);
    // Not ready while NATS is down.
    stack.server.kill();
    let deadline = tokio::time::Instant::now() + T;
    while stack.get_text("/readyz").await.0 != 503 {
        assert!(tokio::time::Instant::now() < deadline, "readyz stayed 200 with NATS down");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stack.server.restart().unwrap();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_dlq_replay_creates_a_linked_job() {
    let mut opts = StackOptions::default();
    opts.settings.max_deliver = 1;
    let stack = Stack::start(opts).await;
    let (_, b) = stack.submit(&job_body(&stack, "dead", Some(json!({"fail_transient": 1})))).await;
    let old = job_id(&b);
    assert_eq!(stack.wait_terminal(&old, T).await.status, JobStatus::DeadLettered);

    let cli = |args: &[&str]| {
        let out = std::process::Command::new(Stack::stemq_bin())
            .args(args)
            .env("NATS_URL", stack.server.url())
            .env("STEMQ_NATS_CREDS", stack.server.credentials(stemq_nats::users::OPERATOR))
            .env("STEMQ_MAX_DELIVER", "1")
            .env("STEMQ_ACK_WAIT_MS", stack.options.settings.ack_wait.as_millis().to_string())
            .output()
            .expect("run stemq");
        assert!(out.status.success(), "stemq {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let listed = cli(&["dlq", "list"]);
    assert!(listed.contains(old.as_str()), "{listed}");
    let out = cli(&["dlq", "replay", old.as_str()]);
    let new = stemq_core::JobId::parse(out.trim().rsplit(' ').next().unwrap()).expect(&out);
    assert_ne!(new, old);
    // attempt 1 of the new job: `fail_transient: 1` fails again on its first attempt,
    // so the replay dead-letters too — what matters here is the link and the new id.
    let v = stack.wait_terminal(&new, T).await;
    assert_eq!(v.retry_of.as_ref(), Some(&old));
    let o = stack.wait_for(&old, T, |v| v.retried_by.is_some()).await;
    assert_eq!(o.retried_by.as_ref(), Some(&new));
    assert_eq!(o.status, JobStatus::DeadLettered, "the old job is unchanged");
    // Replaying twice is idempotent.
    let again = cli(&["dlq", "replay", old.as_str()]);
    assert!(again.contains(new.as_str()) && again.contains("already"), "{again}");
    let status = cli(&["status", new.as_str()]);
    assert!(status.contains("retry_of"), "{status}");
    stack.shutdown().await;
}

/// The `Accept` header Prometheus 2.42 sends when it scrapes.
const OPENMETRICS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                                  version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// GETs a /metrics URL; returns (Content-Type, body).
async fn scrape(url: &str, key: Option<&str>, accept: Option<&str>) -> (String, String) {
    let mut r = reqwest::Client::new().get(url);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    if let Some(a) = accept {
        r = r.header("accept", a);
    }
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 200);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    (ct, r.text().await.unwrap())
}

/// Issue "alerts that tell the truth" (c): the ingress's /metrics answers OpenMetrics to
/// a scraper that asks for it and the classic text format 0.0.4 to everyone else, and
/// the classic body passes `promtool check metrics` (help text, counters typed as
/// their `_total` series).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_classic_text_unless_openmetrics_is_asked_for() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.submit(&job_body(&stack, "negotiated", None)).await;
    let url = stack.url("/metrics");
    let (ct, om) = scrape(&url, Some(&stack.key), Some(OPENMETRICS_ACCEPT)).await;
    assert_eq!(ct, "application/openmetrics-text; version=1.0.0; charset=utf-8");
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(om.contains("# TYPE stemq_submits counter\n"), "{om}");
    for accept in [None, Some("text/plain;version=0.0.4"), Some("*/*")] {
        let (ct, text) = scrape(&url, Some(&stack.key), accept).await;
        assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8", "Accept: {accept:?}");
        assert!(!text.contains("# EOF"), "{text}");
        assert!(text.contains("# TYPE stemq_submits_total counter\n"), "{text}");
        assert!(text.contains("# HELP stemq_submits_total "), "{text}");
        // The stack's ingress is its queue exporter.
        assert!(text.contains("# TYPE stemq_queue_pending_jobs gauge\n"), "{text}");
        if let Some(r) = stemq_devkit::promtool::check_metrics(&text) {
            assert!(r.ok, "promtool check metrics:\n{}\n{text}", r.output);
        }
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_metrics_endpoint_and_stemq_top() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = stack.spawn_worker("metered", &[("STEMQ_METRICS_ADDR", addr.as_str())]);
    let (_, ok) = stack.submit(&job_body(&stack, "metered-ok", None)).await;
    let (_, bad) = stack.submit(&job_body(&stack, "metered-bad", Some(json!({"fail_permanent": true})))).await;
    assert_eq!(stack.wait_terminal(&job_id(&ok), T).await.status, JobStatus::Succeeded);
    assert_eq!(stack.wait_terminal(&job_id(&bad), T).await.status, JobStatus::Failed);

    // The worker process's own /metrics, named stemq_<name>_<unit>.
    let text = reqwest::get(format!("http://{addr}/metrics")).await.unwrap().text().await.unwrap();
    for series in [
        r#"stemq_job_outcomes_total{model="dsp",outcome="succeeded"} 1"#,
        r#"stemq_job_outcomes_total{model="dsp",outcome="failed_permanent"} 1"#,
        r#"stemq_job_duration_seconds_count{model="dsp",device="fake-gpu"} 1"#,
        r#"stemq_job_queue_wait_seconds_count{model="dsp",device="fake-gpu"} 2"#,
        "stemq_job_deliveries_count 2",
        r#"stemq_worker_heartbeat_timestamp_seconds{worker="metered"}"#,
    ] {
        assert!(text.contains(series), "missing {series} in\n{text}");
    }
    for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
        assert!(line.starts_with("# TYPE stemq_"), "{line}");
    }
    // Not the queue exporter (no --queue-metrics): no queue figure at all, so a sum over
    // scrape targets cannot count the same jobs twice.
    for family in ["stemq_queue_", "stemq_projector_lag_events"] {
        assert!(!text.contains(family), "{family} exported by a worker without --queue-metrics:\n{text}");
    }
    // The --metrics listener negotiates the format like the ingress does.
    let (ct, body) = scrape(&format!("http://{addr}/metrics"), None, Some(OPENMETRICS_ACCEPT)).await;
    assert_eq!(ct, "application/openmetrics-text; version=1.0.0; charset=utf-8");
    assert!(body.ends_with("# EOF\n"), "{body}");
    let (ct, body) = scrape(&format!("http://{addr}/metrics"), None, None).await;
    assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8");
    if let Some(r) = stemq_devkit::promtool::check_metrics(&body) {
        assert!(r.ok, "promtool check metrics:\n{}\n{body}", r.output);
    }

    // `stemq top --once` shows the queue and the failure, fed by NATS only.
    let out = std::process::Command::new(Stack::stemq_bin())
        .args(["top", "--once"])
        .env("NATS_URL", stack.server.url())
        .env("STEMQ_NATS_CREDS", stack.server.credentials(stemq_nats::users::OPERATOR))
        .output()
        .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(screen.contains("queue: 0 pending"), "{screen}");
    assert!(screen.contains("succeeded 1") && screen.contains("failed 1"), "{screen}");
    assert!(screen.contains(&job_id(&bad).as_str()[..12]) && screen.contains("invalid_audio"), "{screen}");
    // The fleet: the worker with what it serves (the fake engine: every model) and its
    // devices, and per pool and lane pending/running; every pool is served, so no pool
    // is marked as waiting for a worker.
    assert!(screen.contains("workers (1):"), "{screen}");
    let line = screen.lines().find(|l| l.trim_start().starts_with("metered")).unwrap_or_else(|| panic!("{screen}"));
    let every: Vec<&str> = stemq_core::request::Model::ALL.iter().map(|m| m.as_str()).collect();
    assert!(line.contains(&every.join(",")) && line.contains("fake-gpu,cpu"), "{line}");
    let dsp = screen.lines().find(|l| l.trim_start().starts_with("dsp ")).unwrap_or_else(|| panic!("{screen}"));
    assert!(dsp.contains("0/0"), "{dsp}");
    assert!(!screen.contains("waiting for a worker"), "{screen}");
    stemq_tests::signal(&w, stemq_tests::SIGTERM);
    stemq_tests::wait_exit(&mut w, T);
    stack.shutdown().await;
}

/// An engine that records the client metadata each attempt was handed.
struct Recorder {
    wants: bool,
    seen: std::sync::Mutex<Vec<Option<Value>>>,
}

impl Engine for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    fn devices(&self) -> Vec<stemq_core::device::Device> {
        vec![stemq_core::device::Device::Cpu]
    }
    fn models(&self) -> Vec<stemq_core::request::Model> {
        stemq_core::request::Model::ALL.to_vec()
    }
    fn reads_input(&self) -> bool {
        false
    }
    fn wants_metadata(&self) -> bool {
        self.wants
    }
    fn separate(&self, job: &EngineJob<'_>, _ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        self.seen.lock().unwrap().push(job.metadata.cloned());
        let ext = job.request.output_format.extension();
        job.request
            .stems()
            .into_iter()
            .map(|stem| {
                let path = job.out_dir.join(format!("{stem}.{ext}"));
                std::fs::write(&path, b"recorded").map_err(|e| EngineError::transient("writing the stem", e))?;
                Ok(StemFile { stem, path, audio: None })
            })
            .collect()
    }
}

/// Runs one job with `metadata` on a stack whose only worker runs `engine`.
async fn run_with_metadata(engine: Arc<dyn Engine>, metadata: &Value) -> stemq_core::JobView {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.add_worker(engine).await;
    let mut body = job_body(&stack, "with-metadata", None);
    body["metadata"] = metadata.clone();
    let (_, v) = stack.submit(&body).await;
    let view = stack.wait_terminal(&job_id(&v), T).await;
    stack.shutdown().await;
    view
}

/// Issue 17: client metadata is the client's. An engine sees it only when it asks
/// (`Engine::wants_metadata`); the fake engine asks, and still follows its script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_metadata_reaches_only_an_engine_that_asks() {
    let metadata = json!({"customer": "c-42", "fake": {"fail_permanent": true}});
    for wants in [false, true] {
        let engine = Arc::new(Recorder { wants, seen: Default::default() });
        let view = run_with_metadata(engine.clone(), &metadata).await;
        assert_eq!(view.status, JobStatus::Succeeded, "{view:?}");
        let expected = if wants { Some(metadata.clone()) } else { None };
        assert_eq!(*engine.seen.lock().unwrap(), vec![expected], "wants_metadata = {wants}");
    }
    // The fake engine asks: its script (fail for good) reaches it.
    let view = run_with_metadata(Arc::new(FakeEngine::default()), &metadata).await;
    assert_eq!(view.status, JobStatus::Failed, "{view:?}");
    assert_eq!(view.error.as_ref().unwrap().code, "invalid_audio");
}
