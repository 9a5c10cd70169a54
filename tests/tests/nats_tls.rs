//! NATS over TLS: a test CA (rcgen) signs the server's certificate (IP SAN 127.0.0.1)
//! and a client certificate; nats-server serves TLS only, with stemq's users.
//!
//! - services connect over TLS: the projector in process, and a `stemq worker` process
//!   configured by `--nats-ca` (`STEMQ_NATS_CA`) and `--nats-creds`, run a job to the end;
//! - a plaintext client is refused, and so is a TLS client that does not trust the CA;
//! - with `verify`, a client without a certificate is refused and one with a
//!   certificate from the CA connects.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::jetstream;
use stemq_core::JobStatus;
use stemq_devkit::nats_server::{NatsServer, ServerOptions, ServerTls};
use stemq_nats::users::{OPERATOR, PROJECTOR, WORKER};
use stemq_nats::{self as names, ClientTls, ConnectAuth};
use stemq_storage::Store;
use stemq_tests::{signal, wait_exit, Stack, SIGTERM};
use tokio_util::sync::CancellationToken;

const T: Duration = Duration::from_secs(60);

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files.
struct Pki {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn pki(dir: &Path) -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    ca.distinguished_name.push(DnType::CommonName, "stemq test CA");
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let mut p = CertificateParams::new(names).unwrap();
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        (p.signed_by(&key, &issuer).unwrap().pem(), key.serialize_pem())
    };
    let (server_pem, server_key) =
        leaf(vec!["127.0.0.1".into(), "localhost".into()], ExtendedKeyUsagePurpose::ServerAuth);
    let (client_pem, client_key) = leaf(vec!["worker.stemq.test".into()], ExtendedKeyUsagePurpose::ClientAuth);
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    Pki {
        ca: write("ca.pem", &ca_pem),
        server_cert: write("server.pem", &server_pem),
        server_key: write("server-key.pem", &server_key),
        client_cert: write("client.pem", &client_pem),
        client_key: write("client-key.pem", &client_key),
    }
}

async fn start(dir: &Path, tls: ServerTls) -> NatsServer {
    let store = dir.join("nats");
    tokio::task::spawn_blocking(move || {
        NatsServer::start_with(&store, ServerOptions { tls: Some(tls), ..Default::default() })
    })
    .await
    .unwrap()
    .expect("nats-server starts with TLS")
}

/// What a client that speaks no TLS gets: the server's INFO (saying TLS is required),
/// then no PONG to its CONNECT and PING.
fn plaintext_exchange(port: u16) -> (String, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut info = vec![0u8; 4096];
    let n = s.read(&mut info).unwrap();
    let info = String::from_utf8_lossy(&info[..n]).into_owned();
    let _ = s.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"name\":\"plain\"}\r\nPING\r\n");
    let mut rest = Vec::new();
    let mut buf = [0u8; 1024];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        rest.extend_from_slice(&buf[..n]);
    }
    (info, String::from_utf8_lossy(&rest).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_connect_over_tls_and_plaintext_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let tls = ServerTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        ca: Some(pki.ca.clone()),
        verify: false,
    };
    let server = start(dir.path(), tls).await;

    // The operator provisions over TLS.
    let op = server.connect_as(OPERATOR, "test").await.expect("the operator connects over TLS");
    assert!(op.server_info().tls_required, "the server does not require TLS");
    let js = jetstream::new(op.clone());
    let settings = names::Settings { ack_wait: Duration::from_secs(5), ..Default::default() };
    names::apply(&js, &settings).await.unwrap();
    let kv = js.get_key_value(names::JOBS_BUCKET).await.unwrap();

    // The projector in process, as its user, over TLS.
    let stop = CancellationToken::new();
    let projector = server.connect_as(PROJECTOR, "projector").await.expect("the projector connects over TLS");
    let p = tokio::spawn(stemq_projector::run(projector, Default::default(), stop.clone()));

    // A worker process, configured by the command line's TLS and credentials flags.
    let store = Store::local(&dir.path().join("store")).unwrap();
    let log = std::fs::File::create(dir.path().join("worker.log")).unwrap();
    let mut worker = std::process::Command::new(Stack::stemq_bin())
        .arg("worker")
        .env("NATS_URL", server.url())
        .env("STEMQ_NATS_CREDS", server.credentials(WORKER))
        .env("STEMQ_NATS_CA", &pki.ca)
        .env("STEMQ_DATA_DIR", dir.path().join("worker"))
        .env("STEMQ_STORE", store.base_url())
        .env("STEMQ_ENGINE", "fake")
        .env("STEMQ_LOG_FORMAT", "json")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();

    let owner = "tls-owner";
    let audio = store.uri(&format!("{}tls.wav", stemq_core::uri::uploads_prefix(owner)));
    let body = serde_json::json!({"audio_uri": audio, "model": "dsp"});
    let stores = [store.base_url().to_string()];
    let (resp, _) =
        stemq_ingress::submit::submit(&js, body.to_string().as_bytes(), owner, None, &stores, None).await.unwrap();
    let deadline = tokio::time::Instant::now() + T;
    let view = loop {
        if let Some((v, _)) = stemq_nats::read::get_view(&kv, &resp.job_id).await.unwrap() {
            if v.status.is_terminal() {
                break v;
            }
        }
        let log = std::fs::read_to_string(dir.path().join("worker.log")).unwrap_or_default();
        assert!(tokio::time::Instant::now() < deadline, "no outcome over TLS; worker log:\n{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}");
    signal(&worker, SIGTERM);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()), "the worker did not stop");

    // Plaintext: the server insists on TLS and never answers the PING.
    let (info, answer) = tokio::task::spawn_blocking({
        let port = server.port();
        move || plaintext_exchange(port)
    })
    .await
    .unwrap();
    assert!(info.contains("\"tls_required\":true"), "{info}");
    assert!(!answer.contains("PONG"), "a plaintext client was served: {answer:?}");

    // TLS without trusting the CA (system roots only): the handshake fails.
    let creds = stemq_nats::credentials::Credentials::load(&server.credentials(WORKER)).unwrap();
    let untrusting =
        async_nats::ConnectOptions::with_nkey(creds.seed().to_string()).require_tls(true).connect(server.url()).await;
    assert!(untrusting.is_err(), "a client that does not trust the CA connected");

    stop.cancel();
    p.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verifying_server_wants_a_client_certificate_from_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let tls = ServerTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        ca: Some(pki.ca.clone()),
        verify: true,
    };
    let server = start(dir.path(), tls).await;
    let creds = stemq_nats::credentials::Credentials::load(&server.credentials(WORKER)).unwrap();
    let without = async_nats::ConnectOptions::with_nkey(creds.seed().to_string())
        .add_root_certificates(pki.ca.clone())
        .require_tls(true)
        .connect(server.url())
        .await;
    assert!(without.is_err(), "a client without a certificate connected");

    let mut auth: ConnectAuth = server.connect_auth(WORKER).unwrap();
    auth.tls = ClientTls {
        ca: Some(pki.ca.clone()),
        cert: Some(pki.client_cert.clone()),
        key: Some(pki.client_key.clone()),
        required: true,
    };
    let c = names::connect_with(&server.url(), "worker", &auth).await.expect("a client with a certificate connects");
    assert!(c.server_info().tls_required);
}
