//! Another service as a real client: tests/python/foreign_service.py (nats-py and
//! standardwebhooks from PyPI) publishes a JobRequested CloudEvent straight to the
//! stream, follows the KV status to the end and verifies the signed webhook (issue 5).
//!
//! The Python packages come from `scripts/install-test-deps.sh` (into ./.stemq/venv).
//! Without them the test prints `SKIPPED` on a developer's machine and fails in CI
//! (`CI=true`), so a broken install step cannot pass as green.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use stemq_core::JobStatus;
use stemq_tests::{Stack, StackOptions};

fn python() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let candidates = [root.join(".stemq/venv/bin/python"), PathBuf::from("python3")];
    candidates.into_iter().find(|p| {
        Command::new(p)
            .args(["-c", "import nats, nkeys, standardwebhooks"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_service_submits_watches_and_verifies_the_webhook() {
    let Some(py) = python() else {
        stemq_tests::missing_tool("the foreign Python service", "python with nats-py, nkeys and standardwebhooks");
        return;
    };
    let mut stack = Stack::start(StackOptions::default()).await;
    // The foreign service is a NATS user for one owner (and reads as status-reader).
    let publisher = stack.add_publisher(stemq_tests::TEST_OWNER).await;
    stack
        .start_relay(stemq_relay::Config {
            schedule: vec![Duration::ZERO, Duration::from_millis(200), Duration::from_millis(400)],
            timeout: Duration::from_secs(2),
            allow: stemq_webhook::Allowlist::parse("127.0.0.1"),
            ..Default::default()
        })
        .await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/foreign_service.py");
    let audio = stack.store.uri(&stemq_tests::upload_key("from-python.wav"));
    let (url, http, key) = (stack.server.url(), stack.url(""), stack.key.clone());
    let (publisher, reader) =
        (stack.server.credentials(&publisher), stack.server.credentials(stemq_nats::users::STATUS_READER));
    let out = tokio::task::spawn_blocking(move || {
        Command::new(py)
            .arg(script)
            .env("NATS_URL", url)
            .env("STEMQ_PUBLISHER_CREDS", publisher)
            .env("STEMQ_STATUS_READER_CREDS", reader)
            .env("STEMQ_HTTP", http)
            .env("STEMQ_AUDIO_URI", audio)
            .env("STEMQ_API_KEY", key)
            .env("STEMQ_OWNER", stemq_tests::TEST_OWNER)
            .env("STEMQ_OWNER_TOKEN", stemq_core::request::owner_token(stemq_tests::TEST_OWNER))
            .output()
            .expect("run python")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("OK"), "{stdout}");
    // The job it created is an ordinary job.
    let id = stdout
        .lines()
        .find_map(|l| l.strip_prefix("published "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(stemq_core::JobId::parse)
        .expect("the script prints the job id");
    assert_eq!(stack.view(&id).await.unwrap().status, JobStatus::Succeeded);
    stack.shutdown().await;
}
