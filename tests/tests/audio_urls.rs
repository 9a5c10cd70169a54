//! External audio URLs (`STEMQ_AUDIO_URL_ALLOW`): a job reads its input from an
//! allowlisted local HTTP server and succeeds; a host not on the list, and a name that
//! resolves to a private address, are refused at submit (422); the worker checks again
//! when it connects (a redirect to a host not on the list, or a request published
//! around the ingress, fails the job with `input_not_allowed`), and a 404 fails it with
//! `input_not_found`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::{json, Value};
use stemq_core::netpolicy::HostPolicy;
use stemq_core::JobStatus;
use stemq_nats::{job_subject, SubjectKind};
use stemq_tests::{job_id, Stack, StackOptions};
use tokio_util::sync::CancellationToken;

/// A local HTTP server with a WAV at `/song.wav`, a 404 at `/missing.wav` and, at
/// `/elsewhere.wav`, a redirect to the same song by the name `localhost`.
struct SongServer {
    addr: SocketAddr,
    stop: CancellationToken,
}

impl SongServer {
    async fn start(dir: &std::path::Path) -> SongServer {
        let path = dir.join("song.wav");
        stemq_audio::synth::write_demo_song(&path, 1.0, 44_100).expect("demo song");
        let wav = bytes::Bytes::from(std::fs::read(&path).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let port = addr.port();
        let app = axum::Router::new()
            .route("/song.wav", get(move || async move { ([(header::CONTENT_TYPE, "audio/wav")], wav.clone()) }))
            .route("/missing.wav", get(|| async { StatusCode::NOT_FOUND }))
            .route(
                "/elsewhere.wav",
                get(move || async move {
                    (StatusCode::FOUND, [(header::LOCATION, format!("http://localhost:{port}/song.wav"))])
                        .into_response()
                }),
            );
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            axum::serve(listener, app).with_graceful_shutdown(async move { s.cancelled().await }).await.unwrap();
        });
        SongServer { addr, stop }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for SongServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn stack_allowing(allow: &str, dsp_worker: bool) -> Stack {
    let options =
        StackOptions { workers: 0, audio_urls: Some(HostPolicy::parse(allow).unwrap()), ..Default::default() };
    let mut stack = Stack::start(options).await;
    if dsp_worker {
        stack.add_worker(Arc::new(stemq_audio::DspEngine::default())).await;
    }
    stack
}

fn request(uri: &str) -> Value {
    json!({ "audio_uri": uri, "model": "dsp" })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowlisted_url_is_fetched_and_the_job_succeeds() {
    let stack = stack_allowing("127.0.0.1", true).await;
    let songs = SongServer::start(stack.dir.path()).await;

    let (code, body) = stack.submit(&request(&songs.url("/song.wav"))).await;
    assert_eq!(code, 202, "{body}");
    let v = stack.wait_terminal(&job_id(&body), Duration::from_secs(120)).await;
    assert_eq!(v.status, JobStatus::Succeeded, "{v:#?}");
    assert!(!v.outputs.is_empty(), "{v:#?}");

    // A 404 is a permanent failure with its own code.
    let (code, body) = stack.submit(&request(&songs.url("/missing.wav"))).await;
    assert_eq!(code, 202, "{body}");
    let v = stack.wait_terminal(&job_id(&body), Duration::from_secs(60)).await;
    assert_eq!(v.status, JobStatus::Failed, "{v:#?}");
    let e = v.error.as_ref().unwrap();
    assert_eq!((e.code.as_str(), e.message.contains("404")), ("input_not_found", true), "{e:?}");

    // A redirect is checked again: `localhost` is not on the list.
    let (code, body) = stack.submit(&request(&songs.url("/elsewhere.wav"))).await;
    assert_eq!(code, 202, "{body}");
    let v = stack.wait_terminal(&job_id(&body), Duration::from_secs(60)).await;
    assert_eq!(v.status, JobStatus::Failed, "{v:#?}");
    let e = v.error.as_ref().unwrap();
    assert_eq!(e.code, "input_not_allowed", "{e:?}");
    assert!(e.message.contains("localhost") && e.message.contains("allow-list"), "{e:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_not_on_the_list_is_refused_at_submit() {
    let stack = stack_allowing("127.0.0.1, *.songs.example.com", false).await;
    for uri in ["https://songs.example.org/a.wav", "https://songs.example.com/a.wav", "https://10.0.0.7/a.wav"] {
        let (code, body) = stack.submit(&request(uri)).await;
        assert_eq!(code, 422, "{uri}: {body}");
        assert_eq!(body["error"]["field"], "audio_uri", "{uri}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("allow-list"), "{uri}: {message}");
    }
    // Other schemes and store URIs keep their own rules.
    let (code, body) = stack.submit(&request("ftp://127.0.0.1/a.wav")).await;
    assert_eq!((code, body["error"]["field"].as_str()), (422, Some("audio_uri")), "{body}");
    let (code, body) = stack.submit(&request("file:///etc/passwd")).await;
    assert_eq!(code, 422, "{body}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_resolves_to_a_private_address_is_refused() {
    // `*`: any host whose addresses are public. `localhost` is not allowlisted itself.
    let stack = stack_allowing("*", true).await;
    let songs = SongServer::start(stack.dir.path()).await;
    let port = songs.addr.port();
    for uri in [
        format!("https://localhost:{port}/song.wav"),
        "https://169.254.169.254/latest/meta-data/".to_string(),
        "https://[64:ff9b::a9fe:a9fe]/x.wav".to_string(),
    ] {
        let (code, body) = stack.submit(&request(&uri)).await;
        assert_eq!(code, 422, "{uri}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("non-public address"), "{uri}: {message}");
    }
    let (_, body) = stack.submit(&request(&format!("https://localhost:{port}/song.wav"))).await;
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("loopback"), "{message}");

    // Published around the ingress, the worker refuses it when it connects.
    let req = stemq_core::JobRequest::from_value(request(&songs.url("/song.wav"))).unwrap();
    let ev = stemq_core::Event::requested(req.normalize("anonymous").unwrap(), None, None, "/test");
    let id = ev.subject.clone();
    stemq_nats::publish::publish(&stack.js, &job_subject(&id, SubjectKind::Requested), &ev, Some(id.as_str()))
        .await
        .unwrap();
    let v = stack.wait_terminal(&id, Duration::from_secs(60)).await;
    assert_eq!(v.status, JobStatus::Failed, "{v:#?}");
    let e = v.error.as_ref().unwrap();
    assert_eq!(e.code, "input_not_allowed", "{e:?}");
    assert!(e.message.contains("127.0.0.0/8 loopback (RFC 1122)"), "{e:?}");
    stack.shutdown().await;
}
