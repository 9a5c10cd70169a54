//! Live progress: `GET /v1/separations/{id}/events` read by a real HTTP client while a
//! job runs against a real nats-server (issue 5).

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use stemq_core::JobStatus;
use stemq_tests::{job_body, job_id, take_sse_messages, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);

/// One parsed SSE message, with when it arrived.
#[derive(Debug, Clone)]
struct Msg {
    id: u64,
    event: String,
    data: Value,
    at: Instant,
}

/// Reads the whole event stream (until the server ends it), parsing messages.
async fn read_stream(stack: &Stack, path: &str, last_event_id: Option<u64>) -> Vec<Msg> {
    let mut req = stack.request(reqwest::Method::GET, path).header("accept", "text/event-stream");
    if let Some(id) = last_event_id {
        req = req.header("last-event-id", id.to_string());
    }
    let mut resp = req.send().await.expect("GET events");
    assert_eq!(resp.status().as_u16(), 200);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let mut buf = String::new();
    let mut out = Vec::new();
    let deadline = Instant::now() + T;
    loop {
        let chunk = tokio::time::timeout_at(deadline.into(), resp.chunk())
            .await
            .expect("the stream ends after the terminal event")
            .expect("read");
        let Some(chunk) = chunk else { break };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        for m in take_sse_messages(&mut buf) {
            if let Some(id) = m.id {
                out.push(Msg {
                    id,
                    event: m.event,
                    data: serde_json::from_str(&m.data).expect("data is JSON"),
                    at: Instant::now(),
                });
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_streams_status_and_progress_until_the_end_and_resumes() {
    let stack = Stack::start(StackOptions::default()).await;
    // Progress every tenth of 4 s; the worker's heartbeat keeps gaps under 2 s anyway.
    let (_, b) = stack.submit(&job_body(&stack, "sse", Some(json!({"sleep_ms": 4000})))).await;
    let id = job_id(&b);
    let url = format!("/v1/separations/{id}/events");
    let msgs = read_stream(&stack, &url, None).await;
    assert!(!msgs.is_empty());
    let statuses: Vec<&str> = msgs.iter().map(|m| m.data["status"].as_str().unwrap()).collect();
    assert_eq!(*statuses.last().unwrap(), "succeeded", "{statuses:?}");
    assert!(statuses.contains(&"running"), "{statuses:?}");
    assert_eq!(msgs.last().unwrap().event, "status");
    // ids are KV revisions: strictly increasing
    assert!(msgs.windows(2).all(|w| w[0].id < w[1].id));
    // progress with percent and stage
    let progress: Vec<&Msg> = msgs.iter().filter(|m| m.event == "progress").collect();
    assert!(progress.len() >= 3, "{msgs:#?}");
    assert!(progress.iter().all(|m| m.data["progress"]["stage"].is_string()));
    assert!(progress.iter().any(|m| m.data["progress"]["percent"].as_f64().unwrap() > 0.0));
    // while running, never more than 2 s without a message
    let running: Vec<&Msg> = msgs.iter().filter(|m| m.data["status"] == "running").collect();
    for w in running.windows(2) {
        let gap = w[1].at - w[0].at;
        assert!(gap <= Duration::from_secs(2), "gap of {gap:?} while running");
    }

    // Resuming from the middle gives only what came after.
    let mid = msgs[msgs.len() / 2].id;
    let rest = read_stream(&stack, &url, Some(mid)).await;
    assert!(rest.iter().all(|m| m.id > mid));
    assert_eq!(rest.last().unwrap().data["status"], "succeeded");
    // Resuming after the end returns at once with nothing.
    let none = read_stream(&stack, &url, Some(msgs.last().unwrap().id)).await;
    assert!(none.is_empty(), "{none:?}");
    // Unknown job: 404.
    let (code, _) = stack.get(&format!("/v1/separations/{}/events", "0".repeat(64))).await;
    assert_eq!(code, 404);
    assert_eq!(stack.view(&id).await.unwrap().status, JobStatus::Succeeded);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_costs_the_log_one_message_per_job() {
    let stack = Stack::start(StackOptions::default()).await;
    let (_, b) = stack.submit(&job_body(&stack, "o1", Some(json!({"sleep_ms": 2500})))).await;
    let id = job_id(&b);
    stack.wait_terminal(&id, T).await;
    let stream = stack.js.get_stream(stemq_nats::PROGRESS_STREAM).await.unwrap();
    let info = stream.info_with_subjects(format!("stemq.progress.{id}")).await.unwrap();
    futures::pin_mut!(info);
    use futures::StreamExt;
    let mut n = 0;
    while let Some(Ok((_, c))) = info.next().await {
        n += c;
    }
    assert_eq!(n, 1, "the compacted progress stream keeps one message per job");
    stack.shutdown().await;
}
