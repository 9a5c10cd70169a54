//! The HTTP side against an attacker, each attack tried for real and seen refused:
//! thousands of silent and slow connections (cut off on time, their descriptors freed,
//! other clients served as usual), a sign-in link that must not hand out a long-lived
//! key, answers with secrets that a cache must not keep, two `Authorization` headers,
//! a client that keeps sending a body already refused (it still reads its 413), a
//! refused `file://` URI that must not say where the store is, and loopback hidden in
//! IPv6 forms while loopback itself is allowed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::{AUTHORIZATION, CACHE_CONTROL};
use serde_json::{json, Value};
use stemq_accounts::auth::{self, Limits, Role};
use stemq_core::netpolicy::HostPolicy;
use stemq_ingress::serve::HttpTimeouts;
use stemq_ingress::session::{SessionGrant, SigninLink};
use stemq_tests::{Stack, StackOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Open file descriptors of this process (the ingress runs in it).
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

/// Raises this process's soft limit on descriptors to what `want` needs (up to the
/// hard limit); the attack below holds two per connection (client and server side).
fn raise_fd_limit(want: u64) {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        if l.rlim_cur < want {
            l.rlim_cur = want.min(l.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
        }
    }
    assert!(l.rlim_cur >= want, "this test needs {want} open files; the hard limit is {}", l.rlim_max);
}

/// What an attacking connection must see, and by when (from its last byte sent).
#[derive(Clone, Copy, Debug)]
enum Seen {
    /// Closed without an answer.
    Closed(Duration),
    /// This status, then closed.
    Answer(u16, Duration),
}

/// One attacking connection's outcome: the bytes it got and when the server closed it
/// (`None`: still open at the deadline).
struct Outcome {
    got: Vec<u8>,
    closed_after: Option<Duration>,
}

/// Sends `prefix` on `conn` and reads until the server closes it, or `deadline`.
async fn attack(mut conn: TcpStream, prefix: Vec<u8>, deadline: Duration) -> Outcome {
    if !prefix.is_empty() {
        conn.write_all(&prefix).await.expect("send");
    }
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_sub(t0.elapsed());
        match tokio::time::timeout(left, conn.read(&mut buf)).await {
            Err(_) => return Outcome { got, closed_after: None },
            Ok(Ok(0)) | Ok(Err(_)) => return Outcome { got, closed_after: Some(t0.elapsed()) },
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

fn status_of(got: &[u8]) -> Option<u16> {
    let text = String::from_utf8_lossy(got);
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// 2 000 connections that never finish a request: silent ones, a partial head, the
/// public sign-in with `Content-Length: 2147483648` and no body, a short body on the
/// sign-in and on an authenticated JSON POST, and an idle keep-alive. Each is cut off
/// on time (408 where a request was read, 413 at once for the 2 GiB body), the server's
/// descriptors come back, and meanwhile other clients are served as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_and_silent_clients_are_cut_off_without_holding_descriptors_or_slowing_others() {
    const CONNECTIONS: usize = 2_000;
    raise_fd_limit(3 * CONNECTIONS as u64 + 1_000);
    let t = HttpTimeouts { header: Duration::from_secs(1), body: Duration::from_secs(2), body_min_rate: 16 << 10 };
    let stack = Stack::start(StackOptions { workers: 0, http_timeouts: t, ..Default::default() }).await;
    let addr: SocketAddr = stack.http;
    let key = stack.key.clone();
    // Scheduling on a busy 2-core machine: generous, and still far below "never".
    let slack = Duration::from_secs(4);
    let head = |h: &str| format!("{h}Host: {addr}\r\n");
    let kinds: Vec<(&str, String, Seen)> = vec![
        ("silent", String::new(), Seen::Closed(t.header + slack)),
        ("a partial head", format!("{}Content-Type: appl", head("POST /v1/signin HTTP/1.1\r\n")), Seen::Closed(t.header + slack)),
        (
            "the sign-in with Content-Length: 2147483648 and no body",
            format!("{}Content-Type: application/json\r\nContent-Length: 2147483648\r\n\r\n", head("POST /v1/signin HTTP/1.1\r\n")),
            Seen::Answer(413, slack),
        ),
        (
            "the sign-in with a short body",
            format!("{}Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"token\":", head("POST /v1/signin HTTP/1.1\r\n")),
            Seen::Answer(408, t.body + slack),
        ),
        (
            "an authenticated submit with a short body",
            format!(
                "{}Authorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{{\"audio_uri\":",
                head("POST /v1/separations HTTP/1.1\r\n")
            ),
            Seen::Answer(408, t.body + slack),
        ),
        ("an idle keep-alive", format!("{}\r\n", head("GET /healthz HTTP/1.1\r\n")), Seen::Answer(200, t.header + slack)),
    ];

    let baseline = open_fds();
    let mut tasks = Vec::with_capacity(CONNECTIONS);
    for i in 0..CONNECTIONS {
        let (name, prefix, seen) = kinds[i % kinds.len()].clone();
        let conn = TcpStream::connect(addr).await.expect("connect");
        let deadline = match seen {
            Seen::Closed(d) | Seen::Answer(_, d) => d,
        };
        tasks.push((name, seen, tokio::spawn(attack(conn, prefix.into_bytes(), deadline))));
    }
    let during = open_fds();
    assert!(during >= baseline + CONNECTIONS, "the connections are open: {baseline} -> {during} descriptors");

    // Other clients meanwhile: served at once.
    let http = reqwest::Client::new();
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let t0 = Instant::now();
        let r = http.get(stack.url("/v1/me")).bearer_auth(&key).send().await.expect("a client is served");
        assert_eq!(r.status(), 200);
        let r = http.get(stack.url("/healthz")).send().await.expect("a client is served");
        assert_eq!(r.status(), 200);
        slowest = slowest.max(t0.elapsed());
    }
    assert!(slowest < Duration::from_secs(1), "other clients waited {slowest:?} during the attack");

    let mut late = Vec::new();
    for (name, seen, task) in tasks {
        let o = task.await.unwrap();
        let ok = match (seen, o.closed_after) {
            (_, None) => false,
            (Seen::Closed(_), Some(_)) => o.got.is_empty(),
            (Seen::Answer(code, _), Some(_)) => status_of(&o.got) == Some(code),
        };
        if !ok {
            late.push(format!(
                "{name}: closed after {:?}, got {:?}",
                o.closed_after,
                String::from_utf8_lossy(&o.got[..o.got.len().min(80)])
            ));
        }
    }
    assert!(
        late.is_empty(),
        "{} of {CONNECTIONS} connections not cut off as they should be, e.g. {:?}",
        late.len(),
        &late[..late.len().min(5)]
    );
    // Every server side is closed: only the client sockets (still held) remain.
    let after = open_fds();
    assert!(
        after <= baseline + CONNECTIONS + 50,
        "the server still holds descriptors: {baseline} -> {during} -> {after}"
    );
    stack.shutdown().await;
}

/// A client that sends all of a body the ingress refuses at once (413 on the declared
/// length, before a byte of it is read) still reads the 413: the closing connection
/// reads and drops the rest instead of resetting the client mid-write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_sending_a_refused_body_reads_the_413() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let body = vec![b' '; 8 << 20];
    for (i, path) in ["/v1/separations", "/v1/webhooks/enable", "/v1/signin"].iter().cycle().take(12).enumerate() {
        let mut conn = TcpStream::connect(stack.http).await.expect("connect");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            stack.http,
            stack.key,
            body.len()
        );
        conn.write_all(head.as_bytes()).await.expect("send the head");
        // The whole body, as a client that does not read while it writes sends it.
        let sent = conn.write_all(&body).await;
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut got)).await.expect("closed");
        assert!(
            sent.is_ok() && read.is_ok() && status_of(&got) == Some(413),
            "request {i} to {path}: sending {sent:?}, reading {read:?}, got {:?}",
            String::from_utf8_lossy(&got[..got.len().min(80)])
        );
    }
    stack.shutdown().await;
}

/// A second ingress on the stack's NATS whose sign-in link mints session keys of an
/// operator of `local` living `lifetime`; its base URL and the link's token.
async fn ingress_with_signin(stack: &Stack, stop: &CancellationToken, lifetime: Duration) -> (String, String) {
    let grant = SessionGrant { owner: "local".into(), role: Role::Operator, limits: Limits::NONE, lifetime };
    // The link writes keys through a connection that may (the operator's, as in `stemq dev`).
    let (link, token) = SigninLink::new(stack.keys.clone(), grant);
    let listener = stemq_ingress::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let c = stack.connect_as(stemq_nats::users::INGRESS).await;
    let config = stemq_ingress::Config {
        listen: addr,
        nats_submit: false,
        storage: Some(stemq_ingress::uploads::StorageConfig::new(stack.store.clone())),
        auth: true,
        tls: None,
        audio_urls: None,
        queue_metrics: false,
        refuse_unserved: false,
        signin: Some(Arc::new(link)),
        public_url: None,
        cors_origins: Vec::new(),
        readiness: Default::default(),
        http_timeouts: Default::default(),
    };
    let s = stop.clone();
    tokio::spawn(async move { stemq_ingress::run(c, listener, config, s).await.expect("ingress runs") });
    let base = format!("http://{addr}");
    let t0 = Instant::now();
    while reqwest::get(format!("{base}/healthz")).await.is_err() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the ingress did not come up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (base, token)
}

async fn me(base: &str, key: &str) -> (u16, Value) {
    let r = reqwest::Client::new().get(format!("{base}/v1/me")).bearer_auth(key).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// The sign-in link hands the browser a key of its own that expires and can be revoked
/// (never a long-lived key that exists elsewhere), and neither it nor the webhook
/// secret may be kept by a cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signing_in_mints_a_session_key_that_expires_and_can_be_revoked() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let stop = CancellationToken::new();
    let before: Vec<String> = auth::list(&stack.keys).await.unwrap().into_iter().map(|r| r.id).collect();
    let lifetime = Duration::from_secs(3600);
    let (base, token) = ingress_with_signin(&stack, &stop, lifetime).await;
    let http = reqwest::Client::new();
    let signin = |token: String| {
        let (http, base) = (http.clone(), base.clone());
        async move { http.post(format!("{base}/v1/signin")).json(&json!({ "token": token })).send().await.unwrap() }
    };

    let r = signin(token.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers().get(CACHE_CONTROL).map(|v| v.to_str().unwrap()), Some("no-store"));
    let b: Value = r.json().await.unwrap();
    let key = b["key"].as_str().unwrap().to_string();
    let id = b["key_id"].as_str().unwrap().to_string();
    assert!(key.starts_with(&format!("sk_{id}_")), "{b}");
    assert!(!before.contains(&id), "the link handed out an existing key");
    // Listed as any key (what `stemq keys list` prints), with its end.
    let record = auth::list(&stack.keys).await.unwrap().into_iter().find(|r| r.id == id).expect("listed");
    assert_eq!((record.owner.as_str(), record.role), ("local", Role::Operator));
    let expires = record.expires_at.expect("a session key expires");
    let want = chrono::Utc::now() + chrono::Duration::from_std(lifetime).unwrap();
    assert!((expires - want).num_seconds().abs() < 30, "expires {expires}, wanted about {want}");
    assert_eq!(b["expires_at"].as_str().map(|s| s.parse::<chrono::DateTime<chrono::Utc>>().unwrap()), Some(expires));
    let (code, who) = me(&base, &key).await;
    assert_eq!((code, who["owner"].as_str(), who["role"].as_str()), (200, Some("local"), Some("operator")), "{who}");
    // Once only.
    assert_eq!(signin(token).await.status(), 401);

    // Revoked: refused within seconds.
    auth::revoke(&stack.keys, &id).await.unwrap();
    let t0 = Instant::now();
    while me(&base, &key).await.0 != 401 {
        assert!(t0.elapsed() < Duration::from_secs(5), "a revoked session key still works");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Expired: refused, saying so.
    let (base2, token2) = ingress_with_signin(&stack, &stop, Duration::from_secs(1)).await;
    let b: Value = http
        .post(format!("{base2}/v1/signin"))
        .json(&json!({ "token": token2 }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let short = b["key"].as_str().expect("a session key").to_string();
    assert_eq!(me(&base2, &short).await.0, 200);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (code, err) = me(&base2, &short).await;
    assert_eq!(code, 401, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("expired"), "{err}");

    // The webhook signing secret is not for caches either.
    for (m, path) in
        [(reqwest::Method::GET, "/v1/webhooks/secret"), (reqwest::Method::POST, "/v1/webhooks/secret/rotate")]
    {
        let r = stack.request(m, path).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(r.headers().get(CACHE_CONTROL).map(|v| v.to_str().unwrap()), Some("no-store"), "{path}");
    }
    stop.cancel();
    stack.shutdown().await;
}

/// Two `Authorization` headers: refused (400) whichever comes first, even both valid:
/// a proxy in front may check one while the ingress reads the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_two_authorization_headers_is_refused() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let other = auth::create(&stack.keys, "acme", Role::Read, Limits::NONE, "test").await.unwrap().0.expose();
    let bearer = |k: &str| format!("Bearer {k}");
    let pairs = [
        (bearer(&stack.key), bearer(&other)),
        (bearer(&other), bearer(&stack.key)),
        (bearer(&stack.key), bearer(&stack.key)),
        (bearer(&stack.key), "Bearer sk_0000000000000000_x".to_string()),
    ];
    for (first, second) in pairs {
        for path in ["/v1/me", "/v1/separations"] {
            let r = reqwest::Client::new()
                .get(stack.url(path))
                .header(AUTHORIZATION, &first)
                .header(AUTHORIZATION, &second)
                .send()
                .await
                .unwrap();
            let code = r.status().as_u16();
            let b: Value = r.json().await.unwrap_or(Value::Null);
            assert_eq!((code, b["error"]["code"].as_str()), (400, Some("bad_request")), "{path}: {b}");
        }
    }
    // One header is served as always.
    assert_eq!(stack.get("/v1/me").await.0, 200);
    stack.shutdown().await;
}

/// An `audio_uri` outside the store is refused without saying where the store is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_file_uri_does_not_name_the_store() {
    let stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    let root = stack.store.base_url().trim_start_matches("file://").to_string();
    assert!(root.len() > 1 && root.starts_with('/'), "{root}");
    for uri in ["file:///etc/passwd", "file:///tmp/a.wav", &format!("file://{root}-other/a.wav")] {
        let (code, b) = stack.submit(&json!({ "audio_uri": uri, "model": "dsp" })).await;
        assert_eq!(code, 422, "{uri}: {b}");
        let text = b.to_string();
        assert!(!text.contains(&root), "{uri}: the answer names the store: {text}");
    }
    stack.shutdown().await;
}

/// With loopback allowed next to `*` (`--audio-url-allow '*,127.0.0.1'`), loopback is
/// reachable only as itself: every IPv6 form embedding it is refused at submit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_in_ipv6_clothing_is_refused_even_when_loopback_is_allowed() {
    let policy = HostPolicy::parse("*,127.0.0.1").unwrap();
    let stack = Stack::start(StackOptions { workers: 0, audio_urls: Some(policy), ..Default::default() }).await;
    for ok in ["http://127.0.0.1:9/a.wav", "http://127.1:9/b.wav"] {
        let (code, b) = stack.submit(&json!({ "audio_uri": ok, "model": "dsp" })).await;
        assert_eq!(code, 202, "{ok}: {b}");
    }
    for host in [
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[::127.0.0.1]",
        "[::ffff:0:127.0.0.1]",
        "[64:ff9b::127.0.0.1]",
        "[64:ff9b:1::7f00:1]",
        "[2002:7f00:1::1]",
        "[2001:0:4136:e378:8000:63bf:80ff:fffe]",
    ] {
        for scheme in ["http", "https"] {
            let uri = format!("{scheme}://{host}:9/a.wav");
            let (code, b) = stack.submit(&json!({ "audio_uri": uri, "model": "dsp" })).await;
            assert_eq!((code, b["error"]["field"].as_str()), (422, Some("audio_uri")), "{uri}: {b}");
        }
    }
    stack.shutdown().await;
}

/// An HTTP/2 frame: its 9-byte header (length, type, flags, stream) and payload.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HTTP/2 (prior knowledge, plain HTTP): a client that made one request and then sits on
/// the connection, acknowledging every ping and setting the server sends, is closed once
/// no request has been in flight for the head limit; pings do not keep it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_even_when_it_answers_every_ping() {
    const SETTINGS: u8 = 4;
    const PING: u8 = 6;
    const HEADERS: u8 = 1;
    const ACK: u8 = 1;
    let t = HttpTimeouts { header: Duration::from_secs(1), ..Default::default() };
    let stack = Stack::start(StackOptions { workers: 0, http_timeouts: t, ..Default::default() }).await;
    let mut c = TcpStream::connect(stack.http).await.unwrap();
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    c.write_all(&h2_frame(SETTINGS, 0, 0, &[])).await.unwrap();
    // GET /healthz on stream 1: :method GET, :scheme http, :path (literal), :authority
    // (literal), in HPACK without Huffman coding.
    let authority = stack.http.to_string();
    let mut block = vec![0x82, 0x86, 0x44, 8];
    block.extend_from_slice(b"/healthz");
    block.extend_from_slice(&[0x41, authority.len() as u8]);
    block.extend_from_slice(authority.as_bytes());
    c.write_all(&h2_frame(HEADERS, 0x5, 1, &block)).await.unwrap();

    let t0 = Instant::now();
    let (mut answered_at, mut pings) = (None, 0);
    let closed = loop {
        let mut head = [0u8; 9];
        match tokio::time::timeout(Duration::from_secs(8).saturating_sub(t0.elapsed()), c.read_exact(&mut head)).await {
            Err(_) => break false,
            Ok(Err(_)) => break true,
            Ok(Ok(_)) => {}
        }
        let len = (head[0] as usize) << 16 | (head[1] as usize) << 8 | head[2] as usize;
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        if c.read_exact(&mut payload).await.is_err() {
            break true;
        }
        match kind {
            SETTINGS if flags & ACK == 0 => c.write_all(&h2_frame(SETTINGS, ACK, 0, &[])).await.unwrap(),
            PING if flags & ACK == 0 => {
                pings += 1;
                c.write_all(&h2_frame(PING, ACK, 0, &payload)).await.unwrap();
            }
            // :status 200 is the static table's entry 8.
            HEADERS if stream == 1 => {
                assert_eq!(payload.first(), Some(&0x88), "GET /healthz over HTTP/2: {payload:?}");
                answered_at.get_or_insert(t0.elapsed());
            }
            _ => {}
        }
    };
    let answered_at = answered_at.expect("the request was answered");
    assert!(closed, "an idle HTTP/2 connection stayed open 8 s ({pings} pings answered)");
    let idle_for = t0.elapsed() - answered_at;
    assert!(idle_for < Duration::from_secs(5), "closed only after {idle_for:?} idle");
    stack.shutdown().await;
}
