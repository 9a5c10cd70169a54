//! Readiness of each service as a deploy pipeline's readiness gate sees it: a worker
//! answers `/readyz` 200 only once its engine is loaded and it has announced itself, and
//! an ingress that refuses unserved models does not refuse during its start-up window
//! because no worker has announced itself yet. (`stemq dev` as a whole: `dev.rs`.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use stemq_core::engine::FakeEngine;
use stemq_core::request::Model;
use stemq_core::JobStatus;
use stemq_nats::users::OPERATOR;
use stemq_tests::{job_body, job_id, KillOnDrop, Stack, StackOptions};

const T: Duration = Duration::from_secs(30);

/// A worker whose engine takes 3 s to load is not ready for those 3 s: its `/readyz`
/// answers 503 (naming the worker) meanwhile, and 200 only once its registry entry is
/// there. Its `/healthz` answers all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_not_ready_while_its_engine_loads() {
    const LOAD: Duration = Duration::from_secs(3);
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let started = Instant::now();
    let worker = stack.spawn_worker(
        "slow-load",
        &[("STEMQ_FAKE_LOAD_MS", &LOAD.as_millis().to_string()), ("STEMQ_METRICS_ADDR", &metrics.to_string())],
    );
    let mut worker = KillOnDrop(Some(worker));
    let registry = async_nats::jetstream::new(stack.connect_as(OPERATOR).await)
        .get_key_value(stemq_nats::WORKERS_BUCKET)
        .await
        .expect("the registry bucket");
    let http = reqwest::Client::new();
    let (mut not_ready, mut healthy) = (0, false);
    let ready_after = loop {
        let answer = match http.get(format!("http://{metrics}/readyz")).send().await {
            Ok(r) => Some((r.status().as_u16(), r.text().await.unwrap_or_default())),
            Err(_) => None,
        };
        match answer {
            Some((200, _)) => break started.elapsed(),
            Some((503, text)) => {
                assert!(text.contains("worker"), "{text}");
                not_ready += 1;
                if let Ok(r) = http.get(format!("http://{metrics}/healthz")).send().await {
                    healthy |= r.status().as_u16() == 200;
                }
            }
            Some((code, text)) => panic!("/readyz answered {code}: {text}"),
            None => {}
        }
        assert!(started.elapsed() < T, "never ready:\n{}", stack.worker_log("slow-load"));
        assert!(worker.0.as_mut().unwrap().try_wait().unwrap().is_none(), "{}", stack.worker_log("slow-load"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let live = stemq_nats::registry::live(&registry).await.unwrap();
    assert!(live.iter().any(|w| w.name == "slow-load"), "ready before it announced itself: {live:?}");
    assert!(ready_after >= LOAD, "ready after {ready_after:?}, while its engine took {LOAD:?} to load");
    assert!(not_ready > 0 && healthy, "503 answers: {not_ready}; /healthz answered: {healthy}");
    drop(worker.0.take().map(|mut c| {
        let _ = c.kill();
        c.wait()
    }));
    stack.shutdown().await;
}

/// An ingress that refuses models no worker serves (as `stemq dev`'s does) starts with an
/// empty registry copy: a submit in its start-up window waits for the worker starting
/// beside it instead of being refused, and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_does_not_refuse_while_its_workers_start() {
    let mut stack = Stack::start(StackOptions { workers: 0, refuse_unserved: true, ..Default::default() }).await;
    let submit =
        stack.request(reqwest::Method::POST, "/v1/separations").json(&job_body(&stack, "while-starting", None)).send();
    let submit = tokio::spawn(submit);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!submit.is_finished(), "answered before any worker announced itself");
    stack.add_worker(Arc::new(FakeEngine::serving(&[Model::Dsp]))).await;
    let r = submit.await.unwrap().expect("http");
    let code = r.status().as_u16();
    let b: serde_json::Value = r.json().await.unwrap();
    assert_eq!(code, 202, "{b}");
    assert_eq!(stack.wait_terminal(&job_id(&b), T).await.status, JobStatus::Succeeded);
    stack.shutdown().await;
}
