//! TLS on the ingress's HTTP listener: a test CA signs a server certificate for
//! 127.0.0.1 and localhost; a client that trusts the CA gets `/healthz` over https, a
//! plaintext request to the same port fails, and so does a client that does not trust
//! the CA. With a client CA, only clients presenting a certificate it signed get in.
//! Shutdown stays graceful.

use std::path::PathBuf;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use stemq_ingress::serve::HttpTimeouts;
use stemq_ingress::tls::TlsConfig;
use stemq_tests::{Stack, StackOptions};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A CA, and PEM files of what it signed, in a temp dir.
struct Pki {
    dir: tempfile::TempDir,
    ca_pem: String,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Pki { dir: tempfile::tempdir().unwrap(), ca_pem: ca.pem(), ca }
    }

    /// Signs a certificate for `names` with `usage`; returns (cert PEM, key PEM).
    fn sign(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &*self.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write(&self, name: &str, pem: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p
    }

    /// Server cert and key files for 127.0.0.1 and localhost.
    fn server_files(&self) -> (PathBuf, PathBuf) {
        let (cert, key) = self.sign(&["localhost", "127.0.0.1"], ExtendedKeyUsagePurpose::ServerAuth);
        (self.write("server.pem", &cert), self.write("server.key", &key))
    }
}

/// A second ingress on `stack`'s NATS, serving TLS; returns its port, its stop token and
/// its task.
async fn tls_ingress(
    stack: &Stack,
    tls: TlsConfig,
) -> (u16, CancellationToken, JoinHandle<Result<(), stemq_ingress::IngressError>>) {
    tls_ingress_with(stack, tls, Default::default()).await
}

/// [`tls_ingress`] with the listener's time limits.
async fn tls_ingress_with(
    stack: &Stack,
    tls: TlsConfig,
    http_timeouts: HttpTimeouts,
) -> (u16, CancellationToken, JoinHandle<Result<(), stemq_ingress::IngressError>>) {
    let listener = stemq_ingress::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client = stack.connect_as(stemq_nats::users::INGRESS).await;
    let stop = CancellationToken::new();
    let config = stemq_ingress::Config {
        listen: addr,
        nats_submit: false,
        storage: None,
        auth: true,
        tls: Some(tls),
        audio_urls: None,
        queue_metrics: false,
        refuse_unserved: false,
        signin: None,
        public_url: None,
        cors_origins: Vec::new(),
        readiness: Default::default(),
        http_timeouts,
    };
    let task = tokio::spawn(stemq_ingress::run(client, listener, config, stop.clone()));
    (addr.port(), stop, task)
}

fn trusting(pki: &Pki) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(10))
}

/// Polls `/healthz` until the listener answers (it binds before the state opens).
async fn healthz(client: &reqwest::Client, url: &str) -> Result<(u16, String), reqwest::Error> {
    let r = client.get(url).send().await?;
    Ok((r.status().as_u16(), r.text().await?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_a_trusted_ca_plaintext_and_untrusted_clients_fail() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let pki = Pki::new("stemq test CA");
    let (cert, key) = pki.server_files();
    let (port, stop, task) = tls_ingress(&stack, TlsConfig { cert, key, client_ca: None }).await;

    let good = trusting(&pki).build().unwrap();
    for host in ["127.0.0.1", "localhost"] {
        let url = format!("https://{host}:{port}/healthz");
        assert_eq!(healthz(&good, &url).await.expect(&url), (200, "ok".to_string()), "{url}");
    }
    // The API itself is served over the same listener.
    let r = good.get(format!("https://127.0.0.1:{port}/openapi.json")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);

    // Plain http to the TLS port gets no HTTP answer.
    let plain = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let r = plain.get(format!("http://127.0.0.1:{port}/healthz")).send().await;
    assert!(r.is_err(), "plaintext HTTP to the TLS port answered: {:?}", r.map(|r| r.status()));

    // A client that does not trust the CA refuses the certificate.
    let stranger = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let e = stranger.get(format!("https://127.0.0.1:{port}/healthz")).send().await.unwrap_err();
    assert!(e.is_connect(), "{e:?}");
    // Nor does one trusting another CA.
    let other = Pki::new("another CA");
    let e = trusting(&other).build().unwrap().get(format!("https://localhost:{port}/healthz")).send().await;
    assert!(e.is_err());

    // Graceful shutdown: the server stops, the port closes.
    stop.cancel();
    let ran = tokio::time::timeout(Duration::from_secs(20), task).await.expect("the TLS ingress stops").unwrap();
    assert!(ran.is_ok(), "{ran:?}");
    assert!(good.get(format!("https://127.0.0.1:{port}/healthz")).send().await.is_err());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_ca_requires_client_certificates_it_signed() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let pki = Pki::new("stemq test CA");
    let (cert, key) = pki.server_files();
    let clients = Pki::new("stemq clients CA");
    let client_ca = Some(clients.write("clients-ca.pem", &clients.ca_pem));
    let (port, stop, task) = tls_ingress(&stack, TlsConfig { cert, key, client_ca }).await;
    let url = format!("https://127.0.0.1:{port}/healthz");

    let (c, k) = clients.sign(&["worker-1"], ExtendedKeyUsagePurpose::ClientAuth);
    let id = reqwest::Identity::from_pem(format!("{c}{k}").as_bytes()).unwrap();
    let with_cert = trusting(&pki).identity(id).build().unwrap();
    assert_eq!(healthz(&with_cert, &url).await.unwrap(), (200, "ok".to_string()));

    // No certificate, or one signed by another CA: no answer.
    assert!(healthz(&trusting(&pki).build().unwrap(), &url).await.is_err());
    let (c, k) = pki.sign(&["intruder"], ExtendedKeyUsagePurpose::ClientAuth);
    let wrong = trusting(&pki).identity(reqwest::Identity::from_pem(format!("{c}{k}").as_bytes()).unwrap());
    assert!(healthz(&wrong.build().unwrap(), &url).await.is_err());

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task).await.unwrap().unwrap().unwrap();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_tls_files_stop_the_ingress_at_start() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let pki = Pki::new("stemq test CA");
    let (cert, _) = pki.server_files();
    let other_key = pki.write("other.key", &KeyPair::generate().unwrap().serialize_pem());
    let missing = pki.dir.path().join("missing.pem");
    for (cert, key, why) in [
        (missing.clone(), other_key.clone(), "reading"),
        (other_key.clone(), other_key.clone(), "holds no certificate"),
        (cert.clone(), other_key.clone(), "with key"),
    ] {
        let (_, _, task) = tls_ingress(&stack, TlsConfig { cert, key, client_ca: None }).await;
        let r = tokio::time::timeout(Duration::from_secs(20), task).await.unwrap().unwrap();
        let e = r.expect_err("bad TLS files refused");
        let text = stemq_nats::error::report(&e);
        assert!(matches!(e, stemq_ingress::IngressError::Tls(_)) && text.contains(why), "{text}");
    }
    stack.shutdown().await;
}

/// Over TLS too, a client that opens a connection and never says hello is cut off within
/// the request head's limit (not the TLS library's own 10 s), and others are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tls_client_is_cut_off_within_the_head_limit() {
    use tokio::io::AsyncReadExt;
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let pki = Pki::new("stemq test CA");
    let (cert, key) = pki.server_files();
    let t = HttpTimeouts { header: Duration::from_secs(1), ..Default::default() };
    let (port, stop, task) = tls_ingress_with(&stack, TlsConfig { cert, key, client_ca: None }, t).await;
    let good = trusting(&pki).build().unwrap();
    let url = format!("https://127.0.0.1:{port}/healthz");
    let t0 = std::time::Instant::now();
    while healthz(&good, &url).await.is_err() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the TLS listener did not come up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let t0 = std::time::Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(6), silent.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "a silent TLS connection stayed open: {read:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "cut off only after {:?}", t0.elapsed());
    assert_eq!(healthz(&good, &url).await.unwrap().0, 200);
    stop.cancel();
    task.await.unwrap().unwrap();
    stack.shutdown().await;
}
