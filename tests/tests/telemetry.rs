//! Telemetry: one trace per job across the services, exported over OTLP to a receiver
//! on loopback; JSON logs that carry job_id and trace_id and never carry secrets.
//!
//! This test binary installs the process-wide subscriber itself (with the OTLP
//! endpoint set), so it holds only tests that want that subscriber.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;
use serde_json::{json, Value};
use stemq_core::JobStatus;
use stemq_tests::{job_body, job_id, Stack, StackOptions};

#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber_make_writer::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

mod tracing_subscriber_make_writer {
    pub use tracing_subscriber::fmt::MakeWriter;
}

#[derive(Debug, Clone)]
struct SpanRec {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
}

/// An OTLP/HTTP (protobuf) trace receiver on loopback.
async fn receiver() -> (String, Arc<Mutex<Vec<SpanRec>>>) {
    let spans: Arc<Mutex<Vec<SpanRec>>> = Default::default();
    let s2 = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let spans = s2.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                let mut out = spans.lock().unwrap();
                for rs in req.resource_spans {
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            out.push(SpanRec {
                                name: s.name,
                                trace_id: hex(&s.trace_id),
                                span_id: hex(&s.span_id),
                                parent: hex(&s.parent_span_id),
                            });
                        }
                    }
                }
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), spans)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_per_job_and_clean_logs() {
    let (endpoint, spans) = receiver().await;
    // SAFETY-free: set before any thread reads the environment (the subscriber is not
    // installed yet and this binary has this one test).
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
    std::env::set_var("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf");
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    std::env::set_var("STEMQ_WEBHOOK_ALLOW", "127.0.0.1");
    let logs = Logs::default();
    stemq_telemetry::logging::init_with_writer(stemq_telemetry::logging::LogFormat::Json, "stemq-test", logs.clone());

    let mut stack = Stack::start(StackOptions::default()).await;
    stack
        .start_relay(stemq_relay::Config { allow: stemq_webhook::Allowlist::parse("127.0.0.1"), ..Default::default() })
        .await;
    // A webhook receiver on loopback (its URL carries a secret-shaped token).
    let hits = Arc::new(Mutex::new(0usize));
    let h2 = hits.clone();
    let hook = axum::Router::new().route(
        "/in",
        post(move || {
            let h = h2.clone();
            async move {
                *h.lock().unwrap() += 1;
                "ok"
            }
        }),
    );
    let hook_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_addr = hook_listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(hook_listener, hook).await.unwrap() });
    // The caller's own trace: the job's spans must join it.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let secret = "sk_live_51HzTOPSECRETvalue9f8e7d6c5b4a";
    let mut body = job_body(&stack, "traced", None);
    body["metadata"] = json!({"api_key": secret, "note": "secret-shaped values must not be logged"});
    body["webhook"] = json!({"url": format!("http://{hook_addr}/in?token={secret}")});
    let resp = stack
        .request(reqwest::Method::POST, "/v1/separations")
        .header("traceparent", format!("00-{client_trace}-{client_span}-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 202);
    let id = job_id(&resp.json::<Value>().await.unwrap());
    assert_eq!(stack.wait_terminal(&id, Duration::from_secs(30)).await.status, JobStatus::Succeeded);
    stemq_projector::wait_caught_up(&stack.js, Duration::from_secs(30)).await.unwrap();

    // Wait for the spans of the job's trace to arrive.
    let want = [
        "http.submit",
        "nats.publish",
        "job",
        "engine.separate",
        "store_outputs",
        "publish_outcome",
        "project",
        "webhook.delivery",
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let trace: Vec<SpanRec> = loop {
        stemq_telemetry::logging::flush();
        let t: Vec<SpanRec> = spans.lock().unwrap().iter().filter(|s| s.trace_id == client_trace).cloned().collect();
        let outcome_spans: Vec<&str> =
            t.iter().filter(|s| s.name == "publish_outcome").map(|s| s.span_id.as_str()).collect();
        let delivered = t.iter().any(|s| s.name == "webhook.delivery" && outcome_spans.contains(&s.parent.as_str()));
        if delivered && want.iter().all(|w| t.iter().any(|s| s.name == *w)) {
            break t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "spans of the job's trace: {:?}",
            t.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let by_id: HashMap<&str, &SpanRec> = trace.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let one = |name: &str| trace.iter().find(|s| s.name == name).unwrap();
    let parent_name = |s: &SpanRec| by_id.get(s.parent.as_str()).map(|p| p.name.clone());
    // The structure: client → http.submit → nats.publish; http.submit → job (in the
    // worker, across NATS) → engine.separate, store_outputs, publish_outcome; the
    // projector's spans continue the events' context.
    assert_eq!(one("http.submit").parent, client_span);
    assert_eq!(parent_name(one("nats.publish")).as_deref(), Some("http.submit"));
    assert_eq!(parent_name(one("job")).as_deref(), Some("http.submit"), "worker joined across the queue");
    for child in ["engine.separate", "store_outputs", "publish_outcome"] {
        assert_eq!(parent_name(one(child)).as_deref(), Some("job"), "{child}");
    }
    for p in trace.iter().filter(|s| s.name == "project") {
        assert!(by_id.contains_key(p.parent.as_str()), "project span's parent is in the trace");
    }
    // The relay looks at every event of the job; the delivery of the outcome continues
    // from the span that published it.
    assert!(
        trace
            .iter()
            .filter(|s| s.name == "webhook.delivery")
            .any(|s| parent_name(s).as_deref() == Some("publish_outcome")),
        "the relay's delivery of the outcome joined the trace"
    );
    assert!(*hits.lock().unwrap() >= 1, "the webhook was delivered");

    // Logs: JSON, job lines carry job_id and trace_id, and no secret anywhere.
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(!text.contains(secret), "a secret reached the logs");
    assert!(!text.contains("SECRET"), "part of a secret reached the logs");
    // Nor the API key every request of this test carried (its secret part).
    let key_secret = stack.key.rsplit('_').next().unwrap();
    assert!(!text.contains(key_secret), "an API key reached the logs");
    let done = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["fields"]["event"] == "job.succeeded" && v["span"]["job_id"] == id.as_str())
        .expect("a job.succeeded log line for the job");
    assert_eq!(done["span"]["trace_id"], client_trace, "{done}");
    assert_eq!(done["span"]["attempt"], 1);
    stack.shutdown().await;
}
