//! The read side (issue 17, "one read side"): every reader answers with the KV view,
//! else the job's request folded from the log, so a job that exists is never "not
//! found" — not even right after its submit, before any projector has seen it.
//!
//! No projector and no ingress run here: events are published straight to the log, and
//! the bucket is written by hand, so each test controls what the view holds.

use std::time::Duration;

use async_nats::jetstream;
use stemq_core::event::Started;
use stemq_core::{apply, Event, EventBody, JobRequest, JobStatus, Position};
use stemq_devkit::nats_server::NatsServer;
use stemq_nats::read::{ViewError, Views};
use stemq_nats::{self as names, job_subject, SubjectKind};
use stemq_tests::Stack;

/// A bare server with the definitions applied: no projector, so the bucket stays empty.
async fn bare() -> (NatsServer, tempfile::TempDir, jetstream::Context) {
    let dir = tempfile::tempdir().unwrap();
    let server = NatsServer::start_async(dir.path().join("nats"), 0).await.expect("nats-server");
    let js = jetstream::new(server.connect_as(stemq_nats::users::OPERATOR, "test").await.unwrap());
    names::apply(&js, &names::Settings::default()).await.unwrap();
    (server, dir, js)
}

fn requested(name: &str) -> Event {
    let body = serde_json::json!({"audio_uri": format!("file:///in/{name}.wav"), "metadata": {"name": name}});
    Event::requested(JobRequest::from_value(body).unwrap().normalize("anonymous").unwrap(), None, None, "/test")
}

async fn publish(js: &jetstream::Context, kind: SubjectKind, ev: &Event) -> u64 {
    js.publish(job_subject(&ev.subject, kind), ev.to_bytes()).await.unwrap().await.unwrap().sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_17_a_job_not_yet_projected_is_read_from_its_request() {
    let (server, _dir, js) = bare().await;
    let views = Views::open(&js).await.unwrap();
    let ev = requested("fresh");
    let id = ev.subject.clone();
    assert!(views.current(&id).await.unwrap().is_none(), "no request, no view");

    publish(&js, SubjectKind::Requested, &ev).await;
    assert!(views.stored(&id).await.unwrap().is_none(), "nothing projected");
    let v = views.current(&id).await.unwrap().expect("the request is a view");
    assert_eq!((v.status, v.request.is_some()), (JobStatus::Queued, true));

    // `stemq status` reads the same way: the job exists, so it is never "no job".
    let out = tokio::task::spawn_blocking({
        let (url, id) = (server.url(), id.to_string());
        let creds = server.credentials(stemq_nats::users::OPERATOR);
        move || {
            std::process::Command::new(Stack::stemq_bin())
                .args(["status", &id])
                .env("NATS_URL", url)
                .env("STEMQ_NATS_CREDS", creds)
                .output()
                .expect("run stemq")
        }
    })
    .await
    .unwrap();
    assert!(out.status.success(), "stemq status: {}", String::from_utf8_lossy(&out.stderr));
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stemq status prints the view");
    assert_eq!((shown["job_id"].as_str(), shown["status"].as_str()), (Some(id.as_str()), Some("queued")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_17_a_view_opened_before_its_request_gets_the_request_folded_in() {
    let (_server, _dir, js) = bare().await;
    let views = Views::open(&js).await.unwrap();
    let ev = requested("early");
    let id = ev.subject.clone();
    // `started` was logged and projected first: a view without the request.
    let started =
        Event::new(&id, "/test", EventBody::Started(Started { attempt: 1, worker: "w".into(), device: "cpu".into() }));
    let seq = publish(&js, SubjectKind::Started, &started).await;
    let partial = apply(None, Position::Log(seq), &started).expect("an event opens a view");
    assert!(partial.request.is_none());
    views.bucket().put(id.as_str(), serde_json::to_vec(&partial).unwrap().into()).await.unwrap();
    // The request comes after (a raw publisher), and the projector has not applied it yet.
    publish(&js, SubjectKind::Requested, &ev).await;

    let v = views.current(&id).await.unwrap().expect("a view");
    assert_eq!((v.status, v.request.is_some()), (JobStatus::Running, true), "{v:?}");
}

/// Issue 12: with two projectors, one may fold a job's `started` before the other folds
/// its earlier `requested`. The view then holds a later position than the request, and
/// the request must still be read under it (a relay deciding whether the job has a
/// webhook reads this view).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_12_a_view_opened_by_a_later_event_gets_the_earlier_request_folded_in() {
    let (_server, _dir, js) = bare().await;
    let views = Views::open(&js).await.unwrap();
    let mut ev = requested("overtaken");
    if let EventBody::Requested(r) = &mut ev.body {
        r.webhook = Some(stemq_core::request::Webhook { url: "https://hooks.example/x".into(), events: vec![] });
    }
    let id = ev.subject.clone();
    publish(&js, SubjectKind::Requested, &ev).await;
    let started =
        Event::new(&id, "/test", EventBody::Started(Started { attempt: 1, worker: "w".into(), device: "cpu".into() }));
    let seq = publish(&js, SubjectKind::Started, &started).await;
    let partial = apply(None, Position::Log(seq), &started).expect("an event opens a view");
    views.bucket().put(id.as_str(), serde_json::to_vec(&partial).unwrap().into()).await.unwrap();

    let v = views.current(&id).await.unwrap().expect("a view");
    assert_eq!((v.status, v.request.is_some()), (JobStatus::Running, true), "{v:?}");
    assert!(v.webhook.is_some(), "the request's webhook is read under the later view");
    assert_eq!(v.last_seq, seq, "the view keeps its own position");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_17_a_stored_view_that_does_not_parse_is_an_error_not_a_fallback() {
    let (_server, _dir, js) = bare().await;
    let views = Views::open(&js).await.unwrap();
    let ev = requested("corrupt");
    let id = ev.subject.clone();
    publish(&js, SubjectKind::Requested, &ev).await;
    views.bucket().put(id.as_str(), "not a view".into()).await.unwrap();
    match views.current(&id).await {
        Err(ViewError::Corrupt { id: bad, revision, .. }) => assert_eq!((bad, revision > 0), (id, true)),
        other => panic!("a corrupt view must be an error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue_17_an_unreachable_log_is_unavailable_with_its_cause_kept() {
    let (mut server, _dir, js) = bare().await;
    let views = Views::open(&js).await.unwrap();
    let id = requested("gone").subject;
    server.kill();
    let err = tokio::time::timeout(Duration::from_secs(30), views.current(&id)).await.expect("answers").unwrap_err();
    match &err {
        ViewError::Unavailable { source, .. } => {
            assert_eq!(source.kind(), stemq_nats::error::JetStreamErrorKind::Read);
            assert!(std::error::Error::source(source).is_some(), "the client's error is kept");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}
