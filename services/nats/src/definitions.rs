//! The definitions of stemq's streams, consumers and buckets, and applying them.
//!
//! The definitions are data in the repository's `nats/` folder (embedded at build time)
//! and are applied idempotently by `stemq nats apply` ([`apply`]) and, on a server
//! without users, created when missing by every service at start ([`ensure`]).
//! [`Settings`] are the knobs applied on top of them (tests shorten the timers).

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use serde::Deserialize;

use stemq_core::request::{Model, Priority};

use crate::connect::NatsError;
use crate::subjects::*;

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
    for (stream_name, mut c) in consumer_configs(settings)? {
        let name = c.durable_name.clone().unwrap_or_default();
        let what = format!("consumer {stream_name}/{name}");
        let stream = js.get_stream_no_info(&stream_name).await.map_err(|e| apply_err(&what, e))?;
        let existing = stream.consumer_info(&name).await.ok();
        if let Some(x) = &existing {
            // Where a consumer starts is fixed when it is made: one recreated where its
            // predecessor's acks stood (below) starts there.
            if matches!(x.config.deliver_policy, consumer::DeliverPolicy::ByStartSequence { .. })
                && c.deliver_policy == consumer::DeliverPolicy::All
            {
                c.deliver_policy = x.config.deliver_policy;
            }
            // The server never changes a consumer's ack policy: it is recreated, starting
            // after the last event acked, so nothing acked comes again and nothing
            // unacked is lost.
            if update && x.config.ack_policy != c.ack_policy {
                let floor = x.ack_floor.stream_sequence;
                let from = format!("{:?}", x.config.ack_policy).to_lowercase();
                stream.delete_consumer(&name).await.map_err(|e| apply_err(&what, e))?;
                c.deliver_policy = consumer::DeliverPolicy::ByStartSequence { start_sequence: floor + 1 };
                let to = format!("{:?}", c.ack_policy).to_lowercase();
                stream.create_consumer(c).await.map_err(|e| apply_err(&what, e))?;
                let recreated = format!("ack_policy: {from} -> {to} (recreated from event {})", floor + 1);
                changes.push(Change { what, action: Action::Updated(vec![recreated]) });
                continue;
            }
        }
        let differences = existing.as_ref().map(|x| diff(&json(&c), &json(&x.config))).unwrap_or_default();
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
    use stemq_core::request::JobId;

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
}
