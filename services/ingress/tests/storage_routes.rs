//! Uploads and stem downloads over HTTP, end to end: a real nats-server, the ingress
//! with a local store, the projector, and a worker running the `dsp` engine.
//!
//! upload a WAV → submit it (model `dsp`) → the worker separates it → the stems and
//! the manifest are in the store → download a stem whole and by ranges, at the URL the
//! job's view links it under.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use stemq_devkit::nats_server::NatsServer;
use stemq_ingress::uploads::StorageConfig;
use stemq_nats::{self as names, Settings};
use stemq_storage::Store;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

struct Stack {
    _server: NatsServer,
    _dir: tempfile::TempDir,
    http: SocketAddr,
    store: Store,
    key: String,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Stack {
    async fn start(max_upload_bytes: u64) -> Stack {
        let dir = tempfile::tempdir().unwrap();
        let server = NatsServer::start_async(dir.path().join("nats"), 0)
            .await
            .expect("nats-server starts (is nats-server on PATH?)");
        let settings = Settings { ack_wait: Duration::from_secs(5), ..Settings::default() };
        let client = server.connect_as(stemq_nats::users::OPERATOR, "test").await.unwrap();
        let js = async_nats::jetstream::new(client.clone());
        names::apply(&js, &settings).await.unwrap();
        let keys = js.get_key_value(names::KEYS_BUCKET).await.unwrap();
        let role = stemq_accounts::auth::Role::Submit;
        let (key, _) = stemq_accounts::auth::create(&keys, "acme", role, Default::default(), "").await.unwrap();
        let store = Store::local(&dir.path().join("store")).unwrap();
        let stop = CancellationToken::new();
        let listener = stemq_ingress::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let http = listener.local_addr().unwrap();
        let mut tasks = Vec::new();

        let storage = StorageConfig { max_upload_bytes, ..StorageConfig::new(store.clone()) };
        let (c, s) = (client.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let config = stemq_ingress::Config {
                listen: http,
                nats_submit: false,
                storage: Some(storage),
                auth: true,
                tls: None,
                audio_urls: None,
                queue_metrics: false,
                refuse_unserved: false,
                signin: None,
                public_url: None,
                cors_origins: Vec::new(),
                readiness: Default::default(),
                http_timeouts: Default::default(),
            };
            stemq_ingress::run(c, listener, config, s).await.expect("ingress runs");
        }));
        let (c, s) = (client.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            stemq_projector::run(c, Default::default(), s).await.expect("projector runs");
        }));
        let mut wc = stemq_worker::Config::new(store.clone(), dir.path().join("scratch"));
        wc.name = "test-worker".into();
        wc.grace = Duration::from_secs(1);
        let (c, s) = (client.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            stemq_worker::run(c, Arc::new(stemq_audio::DspEngine::default()), wc, s).await.expect("worker runs");
        }));
        Stack { _server: server, _dir: dir, http, store, key: key.expose(), stop, tasks }
    }

    /// An HTTP client that sends the stack's key.
    fn client(&self) -> reqwest::Client {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("authorization", format!("Bearer {}", self.key).parse().unwrap());
        reqwest::Client::builder().default_headers(h).build().unwrap()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            tokio::time::timeout(Duration::from_secs(20), t).await.expect("service stops").expect("no panic");
        }
    }
}

/// A 2-second stereo WAV (16-bit, 44.1 kHz) of two tones.
fn song() -> Vec<u8> {
    let frames = 2 * 44_100u32;
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&(36 + frames * 4).to_le_bytes());
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&16u32.to_le_bytes());
    v.extend_from_slice(&1u16.to_le_bytes());
    v.extend_from_slice(&2u16.to_le_bytes());
    v.extend_from_slice(&44_100u32.to_le_bytes());
    v.extend_from_slice(&(44_100u32 * 4).to_le_bytes());
    v.extend_from_slice(&4u16.to_le_bytes());
    v.extend_from_slice(&16u16.to_le_bytes());
    v.extend_from_slice(b"data");
    v.extend_from_slice(&(frames * 4).to_le_bytes());
    for i in 0..frames {
        let t = f64::from(i) / 44_100.0;
        let l = (0.3 * (2.0 * std::f64::consts::PI * 220.0 * t).sin() * 32767.0) as i16;
        let r = (0.3 * (2.0 * std::f64::consts::PI * 330.0 * t).sin() * 32767.0) as i16;
        v.extend_from_slice(&l.to_le_bytes());
        v.extend_from_slice(&r.to_le_bytes());
    }
    v
}

async fn wait_terminal(http: &reqwest::Client, url: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v: Value = http.get(url).send().await.unwrap().json().await.unwrap();
        let status = v["status"].as_str().unwrap_or_default().to_string();
        if ["succeeded", "failed", "dead_lettered", "rejected"].contains(&status.as_str()) {
            return v;
        }
        assert!(Instant::now() < deadline, "job did not end: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upload_separate_and_download_stems() {
    let stack = Stack::start(1 << 30).await;
    let http = stack.client();
    let wav = song();

    // Upload: content-addressed, the same bytes twice give the same URI.
    let resp = http.post(stack.url("/v1/uploads?filename=My%20Song.WAV")).body(wav.clone()).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let up: Value = resp.json().await.unwrap();
    let sha = hex::encode(Sha256::digest(&wav));
    assert_eq!(up["sha256"], sha);
    assert_eq!(up["bytes"], wav.len());
    let audio_uri = up["audio_uri"].as_str().unwrap().to_string();
    // An opaque name of the caller's upload: no server path, no store.
    assert_eq!(audio_uri, format!("upload:{sha}.wav"));
    let fields: Vec<&String> = up.as_object().unwrap().keys().collect();
    assert_eq!(fields, ["audio_uri", "bytes", "duration_ms", "sha256"], "{up}");
    assert!(!up.to_string().contains(stack.store.base_url()), "{up}");
    let again: Value = http
        .post(stack.url("/v1/uploads"))
        .header("content-type", "audio/wav")
        .body(wav.clone())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again["audio_uri"], audio_uri);
    assert_eq!(
        stack.store.list("uploads").await.unwrap(),
        vec![format!("uploads/acme/{sha}.wav"), format!("uploads/acme/{sha}.wav.meta.json")],
        "the upload and what it lasts, no temp objects left"
    );

    // Separate it with the dsp engine.
    let resp = http
        .post(stack.url("/v1/separations"))
        .json(&json!({"audio_uri": audio_uri, "model": "dsp", "two_stems": "vocals"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let job: Value = resp.json().await.unwrap();
    let id = job["job_id"].as_str().unwrap().to_string();
    assert_eq!(job["urls"]["get"], stack.url(&format!("/v1/separations/{id}")), "{job}");
    // The upload's name stands for its store URI: naming that is the same job.
    let store_uri = stack.store.uri(&format!("uploads/acme/{sha}.wav"));
    let same: Value = http
        .post(stack.url("/v1/separations"))
        .json(&json!({"audio_uri": store_uri, "model": "dsp", "two_stems": "vocals"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!((&same["job_id"], &same["cached"]), (&job["job_id"], &json!(true)), "{same}");

    // Not ready yet, or already done: never a 404 for a known job's known stem.
    let early = http.get(stack.url(&format!("/v1/separations/{id}/stems/vocals"))).send().await.unwrap();
    assert!(early.status() == StatusCode::CONFLICT || early.status() == StatusCode::OK, "{}", early.status());

    let view = wait_terminal(&http, &stack.url(&format!("/v1/separations/{id}"))).await;
    assert_eq!(view["status"], "succeeded", "{view}");
    let outputs = view["outputs"].as_array().unwrap();
    assert_eq!(outputs.iter().map(|o| o["stem"].as_str().unwrap()).collect::<Vec<_>>(), ["vocals", "no_vocals"]);
    assert_eq!(view["request"]["audio_uri"], store_uri, "the job reads the upload from the store");
    // Each stem is linked where the download route serves it.
    let links = view["urls"]["stems"].as_object().expect("stem links once succeeded").clone();
    assert_eq!(links.len(), 2, "{view}");
    for stem in ["vocals", "no_vocals"] {
        assert_eq!(links[stem], stack.url(&format!("/v1/separations/{id}/stems/{stem}")));
    }

    // The manifest describes every stem.
    let manifest: Value =
        serde_json::from_slice(&stack.store.get_bytes(&format!("jobs/{id}/manifest.json")).await.unwrap()).unwrap();
    assert_eq!(manifest["format"], "wav");
    assert_eq!(manifest["sample_rate"], 44_100);
    assert_eq!(manifest["duration_secs"], 2.0);
    let stems = manifest["stems"].as_array().unwrap();
    assert_eq!(stems.len(), 2);
    for (m, o) in stems.iter().zip(outputs) {
        assert_eq!(m["stem"], o["stem"]);
        assert_eq!(m["sha256"], o["sha256"]);
        assert_eq!(m["bytes"], o["bytes"]);
        assert_eq!(m["frames"], 2 * 44_100);
    }

    // The whole stem, at its link.
    let url = links["vocals"].as_str().unwrap().to_string();
    let resp = http.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["accept-ranges"], "bytes");
    assert_eq!(resp.headers()["content-type"], "audio/wav");
    let body = resp.bytes().await.unwrap();
    assert_eq!(hex::encode(Sha256::digest(&body)), outputs[0]["sha256"].as_str().unwrap());
    let size = body.len();
    assert_eq!(&body[..4], b"RIFF");

    // Ranges.
    let resp = http.get(&url).header("range", "bytes=0-3").send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(resp.headers()["content-range"], format!("bytes 0-3/{size}"));
    assert_eq!(&resp.bytes().await.unwrap()[..], b"RIFF");
    let resp = http.get(&url).header("range", "bytes=-10").send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(resp.bytes().await.unwrap(), body[size - 10..]);
    let resp = http.get(&url).header("range", format!("bytes={size}-")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::RANGE_NOT_SATISFIABLE);
    assert_eq!(resp.headers()["content-range"], format!("bytes */{size}"));

    // Unknown stem, unknown job, not a job id.
    let resp = http.get(stack.url(&format!("/v1/separations/{id}/stems/drums"))).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let err: Value = resp.json().await.unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("vocals, no_vocals"), "{err}");
    let other = "0".repeat(64);
    let resp = http.get(stack.url(&format!("/v1/separations/{other}/stems/vocals"))).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let resp = http.get(stack.url("/v1/separations/..%2Fetc/stems/vocals")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);

    // The routes are documented.
    let doc: Value = http.get(stack.url("/openapi.json")).send().await.unwrap().json().await.unwrap();
    assert!(doc["paths"]["/v1/uploads"]["post"].is_object());
    assert!(doc["paths"]["/v1/separations/{id}/stems/{stem}"]["get"].is_object());

    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uploads_over_the_limit_are_refused() {
    let stack = Stack::start(1000).await;
    let http = stack.client();
    // Declared too large: refused before reading.
    // Each refusal that leaves the body unread ends its connection and says so, so the
    // client never sends its next request on a connection the server is closing.
    let closes = |resp: &reqwest::Response| {
        assert_eq!(resp.headers().get("connection").map(|v| v.as_bytes()), Some(&b"close"[..]), "{resp:?}")
    };
    let resp = http.post(stack.url("/v1/uploads")).body(vec![7u8; 1001]).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    closes(&resp);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "too_large");
    // Streamed without a length: refused while reading, nothing kept.
    let chunks = futures::stream::iter((0..5).map(|_| Ok::<_, std::io::Error>(vec![1u8; 300])));
    let resp = http.post(stack.url("/v1/uploads")).body(reqwest::Body::wrap_stream(chunks)).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    closes(&resp);
    // At the limit: fine.
    let resp = http.post(stack.url("/v1/uploads?filename=a.flac")).body(vec![7u8; 1000]).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let keys: Vec<String> =
        stack.store.list("uploads").await.unwrap().into_iter().filter(|k| !k.ends_with(".meta.json")).collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].ends_with(".flac"));
    // Empty and badly named uploads.
    let resp = http.post(stack.url("/v1/uploads")).body(Vec::<u8>::new()).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let resp = http.post(stack.url("/v1/uploads?filename=a.w/../x")).body(vec![1u8; 10]).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY);
    stack.stop().await;
}
