//! Test harness: a real `nats-server` per test and the stemq services around it.
//!
//! This crate owns how integration tests stand the system up. [`Stack::start`] starts a
//! fresh `nats-server` (random port, temp store; killable and restartable) with stemq's
//! NATS users, applies the NATS definitions with short timers as `operator`, and runs
//! the ingress (HTTP on port 0), the projector and, if asked, in-process workers with the
//! fake engine — each connected as its own NATS user, as in production, while the test's
//! own client is `operator`. Workers can also be started as child processes of the real
//! `stemq` command ([`Stack::spawn_worker`], as user `worker`) for SIGKILL, SIGTERM and
//! crash-loop tests. Waiting is always polling with a deadline, never a fixed sleep.
//! [`cluster`] does the same on a three-node JetStream cluster with every service
//! replicated.

pub mod cluster;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use serde_json::Value;
use stemq_core::engine::{Engine, FakeEngine};
use stemq_core::netpolicy::HostPolicy;
use stemq_core::{Event, JobId, JobStatus, JobView};
use stemq_devkit::nats_server::NatsServer;
use stemq_nats::users::{INGRESS, OPERATOR, PROJECTOR, RELAY, WORKER};
use stemq_nats::{self as names, Settings};
use stemq_storage::Store;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Knobs of a test stack.
#[derive(Clone)]
pub struct StackOptions {
    /// NATS definition overrides (short ack wait etc.).
    pub settings: Settings,
    /// In-process fake workers (job loops).
    pub workers: usize,
    /// Backoff base of in-process workers.
    pub backoff_base: Duration,
    /// Hard time limit of in-process workers.
    pub time_limit: Duration,
    /// External audio URLs the ingress and in-process workers accept (`None`: off).
    pub audio_urls: Option<HostPolicy>,
    /// The ingress refuses models no live worker serves (as in `stemq dev`).
    pub refuse_unserved: bool,
    /// Run a projector in the test process (off: the test runs its own, e.g. as a child
    /// process it can kill).
    pub projector: bool,
    /// The ingress's public URL (`--public-url`; `None`: links follow the Host header).
    pub public_url: Option<stemq_ingress::links::PublicUrl>,
    /// Origins the ingress lets call it from a browser (`--cors-origin`; empty: off).
    pub cors_origins: Vec<stemq_ingress::cors::Origin>,
    /// How long an HTTP client may take to send a request head or body.
    pub http_timeouts: stemq_ingress::serve::HttpTimeouts,
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            settings: Settings {
                ack_wait: Duration::from_secs(2),
                max_deliver: 5,
                duplicate_window: Duration::from_secs(120),
                replicas: 1,
            },
            workers: 1,
            backoff_base: Duration::from_millis(100),
            time_limit: Duration::from_secs(60),
            audio_urls: None,
            refuse_unserved: false,
            projector: true,
            public_url: None,
            cors_origins: Vec::new(),
            http_timeouts: Default::default(),
        }
    }
}

/// A running test system.
pub struct Stack {
    /// The server (kill / restart it for fault tests).
    pub server: NatsServer,
    /// Temp dir holding the server store, object store and scratch.
    pub dir: tempfile::TempDir,
    /// A client for the test itself (NATS user `operator`).
    pub client: async_nats::Client,
    /// JetStream on that client.
    pub js: jetstream::Context,
    /// The status bucket.
    pub kv: kv::Store,
    /// The ingress address.
    pub http: SocketAddr,
    /// The object store the workers write to.
    pub store: Store,
    /// Options it was started with.
    pub options: StackOptions,
    /// An operator key of the owner [`TEST_OWNER`], sent by every HTTP helper here.
    pub key: String,
    /// The keys bucket (tests create more keys with `stemq_accounts::auth::create`).
    pub keys: kv::Store,
    http_client: reqwest::Client,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    workers: Vec<(CancellationToken, JoinHandle<()>)>,
}

impl Stack {
    /// Starts server, ingress, projector and `options.workers` in-process fake workers.
    pub async fn start(options: StackOptions) -> Stack {
        let dir = tempfile::tempdir().expect("temp dir");
        let server = NatsServer::start_async(dir.path().join("nats"), 0)
            .await
            .expect("nats-server starts (is nats-server >= 2.11 on PATH? scripts/install-nats.sh)");
        let client = server.connect_as(OPERATOR, "test").await.expect("connect as operator");
        let js = jetstream::new(client.clone());
        let (kv, keys, key) = provision(&js, &options.settings).await;
        let store = Store::local(&dir.path().join("store")).expect("store");
        let stop = CancellationToken::new();
        let listener = stemq_ingress::bind("127.0.0.1:0".parse().unwrap()).await.expect("bind");
        let http = listener.local_addr().unwrap();
        let mut tasks = Vec::new();
        {
            let c = server.connect_as(INGRESS, "ingress").await.expect("connect as ingress");
            let s = stop.clone();
            let ingress_store = store.clone();
            let audio_urls = options.audio_urls.clone();
            let refuse_unserved = options.refuse_unserved;
            let (public_url, cors_origins) = (options.public_url.clone(), options.cors_origins.clone());
            let http_timeouts = options.http_timeouts;
            tasks.push(tokio::spawn(async move {
                stemq_ingress::run(
                    c,
                    listener,
                    stemq_ingress::Config {
                        listen: http,
                        nats_submit: true,
                        storage: Some(stemq_ingress::uploads::StorageConfig::new(ingress_store)),
                        auth: true,
                        tls: None,
                        audio_urls,
                        // The stack's ingress is its queue exporter, as in `stemq dev`.
                        queue_metrics: true,
                        refuse_unserved,
                        signin: None,
                        public_url,
                        cors_origins,
                        readiness: Default::default(),
                        http_timeouts,
                    },
                    s,
                )
                .await
                .expect("ingress runs");
            }));
        }
        if options.projector {
            let c = server.connect_as(PROJECTOR, "projector").await.expect("connect as projector");
            let s = stop.clone();
            tasks.push(tokio::spawn(async move {
                stemq_projector::run(c, Default::default(), s).await.expect("projector runs");
            }));
        }
        let mut stack = Stack {
            server,
            dir,
            client,
            js,
            kv,
            http,
            store,
            options: options.clone(),
            key,
            keys,
            http_client: reqwest::Client::new(),
            stop,
            tasks,
            workers: Vec::new(),
        };
        for _ in 0..options.workers {
            stack.add_worker(Arc::new(FakeEngine::default())).await;
        }
        stack
    }

    /// Starts one more in-process worker with `engine`; returns its index.
    pub async fn add_worker(&mut self, engine: Arc<dyn Engine>) -> usize {
        self.add_worker_with(engine, 1).await
    }

    /// Starts an in-process worker with `concurrency` job loops on `engine`.
    pub async fn add_worker_with(&mut self, engine: Arc<dyn Engine>, concurrency: usize) -> usize {
        let c = self.connect_as(WORKER).await;
        let mut config = stemq_worker::Config::new(self.store.clone(), self.dir.path().join("scratch"));
        config.concurrency = concurrency;
        config.name = format!("inproc-{}", self.workers.len());
        config.backoff.base = self.options.backoff_base;
        config.time_limit = self.options.time_limit;
        config.grace = Duration::from_secs(30);
        config.audio_urls = self.options.audio_urls.clone().map(stemq_worker::fetch::AudioUrls::new);
        let token = CancellationToken::new();
        let t = token.clone();
        let handle = tokio::spawn(async move {
            stemq_worker::run(c, engine, config, t).await.expect("worker runs");
        });
        self.workers.push((token, handle));
        self.workers.len() - 1
    }

    /// Starts the webhook relay in-process (stopped with the stack).
    pub async fn start_relay(&mut self, config: stemq_relay::Config) {
        let c = self.connect_as(RELAY).await;
        let s = self.stop.clone();
        self.tasks.push(tokio::spawn(async move {
            stemq_relay::run(c, config, s).await.expect("relay runs");
        }));
    }

    /// A new connection as NATS user `user` (`worker`, `status-reader`,
    /// `publisher-acme` once [`Stack::add_publisher`] made it, ...), named after it.
    pub async fn connect_as(&self, user: &str) -> async_nats::Client {
        self.server.connect_as(user, user).await.unwrap_or_else(|e| panic!("connect as {user}: {e}"))
    }

    /// Creates the `publisher` of `owner` (the server reloads its users); returns the
    /// user name to [`Stack::connect_as`] with.
    pub async fn add_publisher(&mut self, owner: &str) -> String {
        let path = tokio::task::block_in_place(|| self.server.add_publisher(owner)).expect("add a publisher");
        path.file_stem().expect("a credentials file").to_string_lossy().into_owned()
    }

    /// Adds the NATS `reader` of `owner` (reloading the server); returns its user name.
    pub async fn add_reader(&mut self, owner: &str) -> String {
        let path = tokio::task::block_in_place(|| self.server.add_reader(owner)).expect("add a reader");
        path.file_stem().expect("a credentials file").to_string_lossy().into_owned()
    }

    /// Stops in-process worker `i` (graceful) and waits for it.
    pub async fn stop_worker(&mut self, i: usize) {
        let (t, h) = &mut self.workers[i];
        t.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), h).await;
    }

    /// Base URL of the HTTP API.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.http, path)
    }

    /// POSTs a JSON body to /v1/separations; returns (status, body).
    pub async fn submit(&self, body: &Value) -> (u16, Value) {
        self.post_raw("/v1/separations", serde_json::to_vec(body).unwrap()).await
    }

    /// A request with the stack's key.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http_client.request(method, self.url(path)).bearer_auth(&self.key)
    }

    /// POSTs raw bytes.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .request(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("http");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// GETs a path; returns (status, JSON body or Null).
    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.request(reqwest::Method::GET, path).send().await.expect("http");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// GETs a path as text.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let r = self.request(reqwest::Method::GET, path).send().await.expect("http");
        (r.status().as_u16(), r.text().await.unwrap_or_default())
    }

    /// Reads a job's view from the bucket.
    pub async fn view(&self, id: &JobId) -> Option<JobView> {
        stemq_projector::get_view(&self.kv, id).await.ok().flatten().map(|(v, _)| v)
    }

    /// Waits until the job's view satisfies `pred`; panics with the last view after
    /// `timeout`.
    pub async fn wait_for(&self, id: &JobId, timeout: Duration, pred: impl Fn(&JobView) -> bool) -> JobView {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let v = self.view(id).await;
            if let Some(v) = &v {
                if pred(v) {
                    return v.clone();
                }
            }
            if tokio::time::Instant::now() > deadline {
                panic!("job {id} did not reach the expected state in {timeout:?}; last view: {v:#?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for a terminal view.
    pub async fn wait_terminal(&self, id: &JobId, timeout: Duration) -> JobView {
        self.wait_for(id, timeout, |v| v.status.is_terminal()).await
    }

    /// Waits until `status`.
    pub async fn wait_status(&self, id: &JobId, status: JobStatus, timeout: Duration) -> JobView {
        self.wait_for(id, timeout, |v| v.status == status || v.status.is_terminal()).await
    }

    /// Every event stored for a job, in log order (job stream only).
    pub async fn events(&self, id: &JobId) -> Vec<Event> {
        let stream = self.js.get_stream(names::JOBS_STREAM).await.unwrap();
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: format!("{}.{id}.>", names::JOBS_PREFIX),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut info = consumer.clone();
        let pending = info.info().await.unwrap().num_pending;
        let mut out = Vec::new();
        if pending == 0 {
            return out;
        }
        let mut msgs = consumer.messages().await.unwrap();
        while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(2), msgs.next()).await {
            out.push(Event::from_slice(&m.payload).expect("stored events parse"));
            if out.len() as u64 >= pending {
                break;
            }
        }
        out
    }

    /// Number of messages stored on `subject`.
    pub async fn count_on(&self, subject: &str) -> u64 {
        let stream = self.js.get_stream(names::JOBS_STREAM).await.unwrap();
        let info = stream.info_with_subjects(subject).await.unwrap();
        futures::pin_mut!(info);
        let mut n = 0;
        while let Some(Ok((_, c))) = info.next().await {
            n += c as u64;
        }
        n
    }

    /// Starts `stemq worker` as a child process with the fake engine and the stack's
    /// settings; `extra` adds environment variables.
    pub fn spawn_worker(&self, name: &str, extra: &[(&str, &str)]) -> Child {
        let s = &self.options.settings;
        let mut cmd = Command::new(Stack::stemq_bin());
        cmd.arg("worker")
            .env("NATS_URL", self.server.url())
            .env("STEMQ_NATS_CREDS", self.server.credentials(WORKER))
            .env("STEMQ_DATA_DIR", self.dir.path())
            .env("STEMQ_STORE", self.store.base_url())
            .env("STEMQ_ACK_WAIT_MS", s.ack_wait.as_millis().to_string())
            .env("STEMQ_MAX_DELIVER", s.max_deliver.to_string())
            .env("STEMQ_DEDUPE_WINDOW_MS", s.duplicate_window.as_millis().to_string())
            .env("STEMQ_BACKOFF_BASE_MS", self.options.backoff_base.as_millis().to_string())
            .env("STEMQ_WORKER_NAME", name)
            .env("STEMQ_ENGINE", "fake")
            .env("STEMQ_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(self.dir.path().join(format!("{name}.log"))).expect("log file")));
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd.spawn().expect("spawn stemq worker")
    }

    /// Uploads a synthesised song of `seconds` as `key`'s owner; the upload's answer
    /// (`audio_uri`, `duration_ms`, ...).
    pub async fn upload_song(&self, key: &str, name: &str, seconds: f64) -> Value {
        let path = self.dir.path().join(name);
        stemq_audio::synth::write_demo_song(&path, seconds, 44_100).expect("the demo song");
        let resp = reqwest::Client::new()
            .post(self.url(&format!("/v1/uploads?filename={name}")))
            .bearer_auth(key)
            .body(std::fs::read(&path).expect("the song"))
            .send()
            .await
            .expect("upload");
        resp.json().await.expect("the upload's answer")
    }

    /// Starts `stemq projector` as a child process (NATS user `projector`).
    pub fn spawn_projector(&self, name: &str) -> Child {
        Command::new(Stack::stemq_bin())
            .arg("projector")
            .env("NATS_URL", self.server.url())
            .env("STEMQ_NATS_CREDS", self.server.credentials(PROJECTOR))
            .env("STEMQ_DATA_DIR", self.dir.path())
            .env("STEMQ_LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(self.dir.path().join(format!("{name}.log"))).expect("log file")))
            .spawn()
            .expect("spawn stemq projector")
    }

    /// The log file of a spawned worker.
    pub fn worker_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Path of the `stemq` binary under test: `target/<profile>/stemq-under-test`, next
    /// to the `deps/` folder of the running test executable (Cargo builds it for this
    /// package's integration tests).
    pub fn stemq_bin() -> PathBuf {
        if let Some(p) = std::env::var_os("STEMQ_BIN") {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().expect("test executable path");
        let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
        dir.join("stemq-under-test")
    }

    /// The server's log lines about denied operations (`... Violation ...`), to show
    /// what a user was refused.
    pub fn permission_violations(&self) -> Vec<String> {
        std::fs::read_to_string(self.server.log_file())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("Violation"))
            .map(str::to_string)
            .collect()
    }

    /// Stops everything.
    pub async fn shutdown(mut self) {
        for v in self.permission_violations() {
            eprintln!("nats-server: {v}");
        }
        for (t, _) in &self.workers {
            t.cancel();
        }
        for (_, h) in self.workers.drain(..) {
            // A worker stopped with `stop_worker` was awaited there already.
            if !h.is_finished() {
                let _ = tokio::time::timeout(Duration::from_secs(30), h).await;
            }
        }
        self.stop.cancel();
        for h in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(10), h).await;
        }
    }
}

/// Applies the NATS definitions with `settings` and creates the harness's operator key
/// of [`TEST_OWNER`]: the status bucket, the keys bucket and the key.
pub(crate) async fn provision(js: &jetstream::Context, settings: &Settings) -> (kv::Store, kv::Store, String) {
    names::apply(js, settings).await.expect("apply definitions");
    let kv = js.get_key_value(names::JOBS_BUCKET).await.expect("bucket");
    let keys = js.get_key_value(names::KEYS_BUCKET).await.expect("keys bucket");
    let limits = stemq_accounts::auth::Limits::NONE;
    let (key, _) =
        stemq_accounts::auth::create(&keys, TEST_OWNER, stemq_accounts::auth::Role::Operator, limits, "harness")
            .await
            .expect("test key");
    (kv, keys, key.expose())
}

/// The owner of the stack's key: jobs submitted through the stack are this owner's.
pub const TEST_OWNER: &str = "test";

/// The store key of an upload `name` of [`TEST_OWNER`].
pub fn upload_key(name: &str) -> String {
    format!("{}{name}", stemq_core::uri::uploads_prefix(TEST_OWNER))
}

/// A request body with a unique audio URI among the test owner's uploads.
pub fn job_body(stack: &Stack, name: &str, fake: Option<Value>) -> Value {
    let mut v =
        serde_json::json!({ "audio_uri": stack.store.uri(&upload_key(&format!("{name}.wav"))), "model": "dsp" });
    if let Some(f) = fake {
        v["metadata"] = serde_json::json!({ "fake": f });
    }
    v
}

/// One Server-Sent Events message: its `id:` (when it has one), `event:` and `data:`.
pub struct SseMessage {
    /// `id:`, when the message has one.
    pub id: Option<u64>,
    /// `event:` (empty when none).
    pub event: String,
    /// `data:` (empty for a keep-alive comment).
    pub data: String,
}

/// Takes every complete message (up to a blank line) off the front of `buf`, the bytes
/// read so far of an event stream; an incomplete one stays for the next read.
pub fn take_sse_messages(buf: &mut String) -> Vec<SseMessage> {
    let mut out = Vec::new();
    while let Some(end) = buf.find("\n\n") {
        let block: String = buf.drain(..end + 2).collect();
        let mut m = SseMessage { id: None, event: String::new(), data: String::new() };
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                m.id = v.trim().parse().ok();
            } else if let Some(v) = line.strip_prefix("event:") {
                m.event = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                m.data.push_str(v.trim_start());
            }
        }
        out.push(m);
    }
    out
}

/// Sends a signal to a child.
pub fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours; the pid is our
    // own child's, not yet reaped (the caller holds its `Child`), so it names no other
    // process.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// SIGKILL.
pub const SIGKILL: i32 = libc::SIGKILL;
/// SIGTERM.
pub const SIGTERM: i32 = libc::SIGTERM;

/// A child process stopped when the guard drops (a test that failed early leaves no
/// process behind): SIGTERM first, so it stops what it started, then SIGKILL after 10 s.
pub struct KillOnDrop(pub Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            signal(c, SIGTERM);
            if wait_exit(c, Duration::from_secs(10)).is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Waits for a child to exit, up to `timeout`.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Parses the `job_id` of a submit answer.
pub fn job_id(v: &Value) -> JobId {
    JobId::parse(v["job_id"].as_str().expect("job_id in answer")).expect("valid job id")
}

/// Whether `program` runs (`program arg` exits 0). When it does not, the skip rule
/// applies ([`missing_tool`]) and this returns `false` for the test to return.
pub fn have_tool(program: &str, arg: &str, what: &str) -> bool {
    let ok = Command::new(program).arg(arg).output().is_ok_and(|o| o.status.success());
    if !ok {
        missing_tool(what, program);
    }
    ok
}

/// The skip rule for a test that needs a tool `scripts/install-test-deps.sh` installs:
/// in CI (`CI=true`) a missing tool fails the test; elsewhere the test prints
/// `SKIPPED: <what>` and the caller returns.
pub fn missing_tool(what: &str, tool: &str) {
    assert_ne!(
        std::env::var("CI").as_deref(),
        Ok("true"),
        "{what}: {tool} is missing under CI (scripts/install-test-deps.sh installs it)"
    );
    eprintln!("SKIPPED: {what} ({tool} is not installed: scripts/install-test-deps.sh installs it)");
}
