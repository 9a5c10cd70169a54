//! Test harness: stemq on a three-node JetStream cluster, with every service replicated.
//!
//! This module owns how the cluster fault tests stand the system up. [`ClusterStack::start`]
//! starts three `nats-server` nodes on loopback with routes ([`NatsCluster`]: each its
//! own store and ports, stemq's NATS users on every node), applies the NATS definitions
//! at R3 as `operator`, and runs in this process two ingresses (HTTP on port 0), three
//! workers with the fake engine, two projectors and two relays, each connected as its
//! own NATS user to the *whole* URL list, as a deployment would be. The nodes can be
//! killed (SIGKILL), restarted on the same ports and store, and restarted one by one
//! (lame duck, then wait for `/healthz`). Waiting is polling with a deadline.
//!
//! What it reads back for assertions: every event of the job log at once
//! ([`ClusterStack::log`]), a job's view, and the services that stopped on their own
//! ([`ClusterStack::stopped_services`]: a service whose `run` returned during a fault is a
//! finding, not noise).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use serde_json::Value;
use stemq_core::engine::{Engine, FakeEngine};
use stemq_core::{Event, JobId, JobView};
use stemq_devkit::nats_cluster::NatsCluster;
use stemq_devkit::nats_server::ServerOptions;
use stemq_nats::users::{INGRESS, OPERATOR, PROJECTOR, RELAY, WORKER};
use stemq_nats::{self as names, Settings};
use stemq_storage::Store;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What runs against the cluster.
#[derive(Clone)]
pub struct ClusterOptions {
    /// NATS definition overrides; `replicas` is 3.
    pub settings: Settings,
    /// Ingress replicas.
    pub ingresses: usize,
    /// Worker processes (in-process, each its own connection and `run`).
    pub workers: usize,
    /// Job loops per worker.
    pub worker_loops: usize,
    /// Projector replicas.
    pub projectors: usize,
    /// Relay replicas.
    pub relays: usize,
    /// The relays' configuration.
    pub relay: stemq_relay::Config,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            settings: Settings {
                // As in production: far longer than a leader election (4–9 s), so that a
                // job whose progress acks are lost while its consumer has no leader is not
                // handed to a second worker.
                ack_wait: Duration::from_secs(30),
                max_deliver: 5,
                duplicate_window: Duration::from_secs(120),
                replicas: 3,
            },
            ingresses: 2,
            workers: 3,
            worker_loops: 32,
            projectors: 2,
            relays: 2,
            relay: stemq_relay::Config {
                schedule: [0, 500, 1000, 2000, 4000].map(Duration::from_millis).to_vec(),
                timeout: Duration::from_secs(5),
                max_retry_after: Duration::from_secs(5),
                allow: stemq_webhook::Allowlist::parse("127.0.0.1"),
                concurrency: 64,
                name: "relay".into(),
                progress_jobs: 10_000,
                ready: None,
            },
        }
    }
}

/// The answer to one HTTP submit, and how long it took.
#[derive(Debug, Clone)]
pub struct Answer {
    /// HTTP status; 0 when no answer came within the client's timeout (a hang).
    pub status: u16,
    /// The JSON body (Null when none).
    pub body: Value,
    /// When the request was sent.
    pub sent: Instant,
    /// Time to the answer.
    pub took: Duration,
    /// The `retry-after` header, if any.
    pub retry_after: Option<String>,
}

/// The HTTP side of the stack: submits to either ingress with the test's key. Cheap to
/// clone, so a background task can keep submitting while the test kills nodes.
#[derive(Clone)]
pub struct Api {
    /// The ingress addresses.
    pub ingresses: Vec<SocketAddr>,
    /// An operator key of [`TEST_OWNER`], sent with every submit.
    pub key: String,
    /// The object store the inputs are named in.
    pub store: Store,
    http_client: reqwest::Client,
}

impl Api {
    /// A request body for job `name` of the test owner, with a fake script and,
    /// optionally, a webhook.
    pub fn job_body(&self, name: &str, fake: Value, webhook: Option<Value>) -> Value {
        let uri = self.store.uri(&crate::upload_key(&format!("{name}.wav")));
        let mut v = serde_json::json!({ "audio_uri": uri, "model": "dsp", "metadata": { "fake": fake } });
        if let Some(w) = webhook {
            v["webhook"] = w;
        }
        v
    }

    /// POSTs `body` to /v1/separations on ingress `i` (modulo their number). No answer
    /// within 30 s is status 0.
    pub async fn submit(&self, i: usize, body: &Value) -> Answer {
        let url = format!("http://{}/v1/separations", self.ingresses[i % self.ingresses.len()]);
        let sent = Instant::now();
        let r = self.http_client.post(url).bearer_auth(&self.key).json(body).send().await;
        match r {
            Ok(r) => {
                let status = r.status().as_u16();
                let retry_after = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
                let body = r.json().await.unwrap_or(Value::Null);
                Answer { status, body, sent, took: sent.elapsed(), retry_after }
            }
            Err(_) => Answer { status: 0, body: Value::Null, sent, took: sent.elapsed(), retry_after: None },
        }
    }
}

impl Api {
    /// GETs `path` on ingress `i` (modulo their number): (status, JSON body or Null);
    /// status 0 when no answer came within 30 s.
    pub async fn get(&self, i: usize, path: &str) -> (u16, Value) {
        let url = format!("http://{}{path}", self.ingresses[i % self.ingresses.len()]);
        match self.http_client.get(url).bearer_auth(&self.key).send().await {
            Ok(r) => (r.status().as_u16(), r.json().await.unwrap_or(Value::Null)),
            Err(_) => (0, Value::Null),
        }
    }
}

/// A running replicated stemq on a three-node cluster.
pub struct ClusterStack {
    /// The nodes (kill / restart them).
    pub cluster: NatsCluster,
    /// Temp dir holding the nodes' stores, the object store and scratch.
    pub dir: tempfile::TempDir,
    /// A client of the test itself (NATS user `operator`, all URLs).
    pub client: async_nats::Client,
    /// JetStream on that client.
    pub js: jetstream::Context,
    /// The status bucket.
    pub kv: kv::Store,
    /// Submits over HTTP.
    pub api: Api,
    /// The object store the workers write to.
    pub store: Store,
    /// Options it was started with.
    pub options: ClusterOptions,
    stop: CancellationToken,
    services: Vec<(String, JoinHandle<()>)>,
}

impl ClusterStack {
    /// Starts the cluster, applies the definitions at R3, and starts every service.
    pub async fn start(options: ClusterOptions) -> ClusterStack {
        let dir = tempfile::tempdir().expect("temp dir");
        let cluster = NatsCluster::start_async(dir.path().join("nats"), 3, ServerOptions::default())
            .await
            .expect("three nats-servers start (is nats-server >= 2.11 on PATH? scripts/install-nats.sh)");
        let client = cluster.connect_as(OPERATOR, "test").await.expect("connect as operator");
        let js = jetstream::new(client.clone());
        let (kv, _keys, key) = crate::provision(&js, &options.settings).await;
        let store = Store::local(&dir.path().join("store")).expect("store");
        let mut stack = ClusterStack {
            cluster,
            dir,
            client,
            js,
            kv,
            api: Api {
                ingresses: Vec::new(),
                key,
                store: store.clone(),
                http_client: reqwest::Client::builder()
                    .timeout(Duration::from_secs(30))
                    .pool_max_idle_per_host(64)
                    .build()
                    .expect("http client"),
            },
            store,
            options: options.clone(),
            stop: CancellationToken::new(),
            services: Vec::new(),
        };
        for i in 0..options.ingresses {
            stack.start_ingress(i).await;
        }
        for i in 0..options.projectors {
            let c = stack.connect_as(PROJECTOR, &format!("projector-{i}")).await;
            let s = stack.stop.clone();
            stack.spawn(format!("projector-{i}"), async move {
                stemq_projector::run(c, Default::default(), s).await.expect("projector runs");
            });
        }
        for i in 0..options.relays {
            let c = stack.connect_as(RELAY, &format!("relay-{i}")).await;
            let s = stack.stop.clone();
            let config = stemq_relay::Config { name: format!("relay-{i}"), ..options.relay.clone() };
            stack.spawn(format!("relay-{i}"), async move {
                stemq_relay::run(c, config, s).await.expect("relay runs");
            });
        }
        for i in 0..options.workers {
            stack.start_worker(i, Arc::new(FakeEngine::default())).await;
        }
        stack
    }

    fn spawn(&mut self, name: String, f: impl std::future::Future<Output = ()> + Send + 'static) {
        self.services.push((name, tokio::spawn(f)));
    }

    async fn start_ingress(&mut self, i: usize) {
        let listener = stemq_ingress::bind("127.0.0.1:0".parse().unwrap()).await.expect("bind");
        let http = listener.local_addr().unwrap();
        let c = self.connect_as(INGRESS, &format!("ingress-{i}")).await;
        let s = self.stop.clone();
        let config = stemq_ingress::Config {
            listen: http,
            nats_submit: true,
            storage: Some(stemq_ingress::uploads::StorageConfig::new(self.store.clone())),
            auth: true,
            tls: None,
            audio_urls: None,
            // One queue exporter per deployment.
            queue_metrics: i == 0,
            refuse_unserved: false,
            signin: None,
            public_url: None,
            cors_origins: Vec::new(),
            readiness: Default::default(),
            http_timeouts: Default::default(),
        };
        self.spawn(format!("ingress-{i}"), async move {
            stemq_ingress::run(c, listener, config, s).await.expect("ingress runs");
        });
        self.api.ingresses.push(http);
    }

    /// Starts worker `i` with `engine` and `options.worker_loops` job loops.
    pub async fn start_worker(&mut self, i: usize, engine: Arc<dyn Engine>) {
        let c = self.connect_as(WORKER, &format!("worker-{i}")).await;
        let mut config = stemq_worker::Config::new(self.store.clone(), self.dir.path().join(format!("scratch-{i}")));
        config.name = format!("worker-{i}");
        config.concurrency = self.options.worker_loops;
        config.backoff.base = Duration::from_millis(100);
        config.time_limit = Duration::from_secs(60);
        config.grace = Duration::from_secs(30);
        let s = self.stop.clone();
        self.spawn(format!("worker-{i}"), async move {
            stemq_worker::run(c, engine, config, s).await.expect("worker runs");
        });
    }

    /// A new connection as NATS user `user` to every node's URL.
    pub async fn connect_as(&self, user: &str, name: &str) -> async_nats::Client {
        self.cluster.connect_as(user, name).await.unwrap_or_else(|e| panic!("connect as {user}: {e}"))
    }

    /// A job's view in the bucket (`None` when absent or unreadable now).
    pub async fn view(&self, id: &JobId) -> Option<JobView> {
        stemq_nats::read::get_view(&self.kv, id).await.ok().flatten().map(|(v, _)| v)
    }

    /// Every event of the job log, by job, each with its stream sequence, in log order.
    pub async fn log(&self) -> HashMap<JobId, Vec<(u64, Event)>> {
        let stream = self.js.get_stream(names::JOBS_STREAM).await.expect("job stream");
        let last = stream.get_info().await.expect("stream info").state.last_sequence;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
            .await
            .expect("ordered consumer");
        let mut out: HashMap<JobId, Vec<(u64, Event)>> = HashMap::new();
        if last == 0 {
            return out;
        }
        let mut msgs = consumer.messages().await.expect("messages");
        while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(10), msgs.next()).await {
            let seq = m.info().expect("JetStream metadata").stream_sequence;
            let ev = Event::from_slice(&m.payload).expect("stored events parse");
            out.entry(ev.subject.clone()).or_default().push((seq, ev));
            if seq >= last {
                break;
            }
        }
        out
    }

    /// The services whose `run` has returned (or panicked): none should, short of
    /// shutdown.
    pub fn stopped_services(&self) -> Vec<String> {
        self.services.iter().filter(|(_, h)| h.is_finished()).map(|(n, _)| n.clone()).collect()
    }

    /// The node that leads `stream` now, as its index (`None` during an election, or
    /// when no answer comes within a second).
    pub async fn leader_of(&self, stream: &str) -> Option<usize> {
        let leader = stemq_devkit::nats_cluster::stream_leader(&self.js, stream);
        let name = tokio::time::timeout(Duration::from_secs(1), leader).await.ok()??;
        self.cluster.index_of(&name)
    }

    /// SIGKILL node `i`.
    pub fn kill(&mut self, i: usize) {
        tokio::task::block_in_place(|| self.cluster.kill(i));
    }

    /// Starts node `i` again (same ports and store) and waits for its `/healthz`.
    pub fn restart(&mut self, i: usize) -> Duration {
        tokio::task::block_in_place(|| self.cluster.restart(i)).unwrap_or_else(|e| panic!("restart node {i}: {e}"))
    }

    /// Restarts every node one at a time (lame duck, start, `/healthz`); returns how
    /// long each was gone.
    pub fn rolling_restart(&mut self) -> Vec<Duration> {
        let mut gone = Vec::new();
        tokio::task::block_in_place(|| self.cluster.rolling_restart(|_, d| gone.push(d)))
            .unwrap_or_else(|e| panic!("rolling restart: {e}"));
        gone
    }

    /// Stops every service, then the nodes (on drop).
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        for (_, h) in self.services.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(30), h).await;
        }
    }
}
