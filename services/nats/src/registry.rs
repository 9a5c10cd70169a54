//! The worker registry: which workers live now, and what each serves.
//!
//! This module owns the `stemq_workers` bucket. Every worker writes its
//! [`WorkerInfo`] (models, devices, version, free memory, jobs running) under its own
//! key when it starts and again every [`HEARTBEAT`], and deletes it when it stops. An
//! entry whose heartbeat is older than [`TTL`] belongs to a dead worker and is not
//! live; the bucket's own `max_age` removes it later. Readers keep a live copy with
//! [`Registry::watch`] (the ingress: `GET /v1/workers`, the refusal of models nobody
//! serves, the reason a queued job waits) or read it once with [`live`] (`stemq top`,
//! the queue metrics).
//!
//! The registry says who *announced* what; it never routes work. Routing is the pool
//! consumers' (`stemq_nats::pool_consumer`): a job waits in its pool whatever the
//! registry says, and runs when a worker of that pool pulls it.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::jetstream::kv;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use stemq_core::request::Model;

/// How often a worker writes its entry.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// An entry older than this is a dead worker's (three missed heartbeats).
pub const TTL: Duration = Duration::from_secs(15);

/// What a worker announces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkerInfo {
    /// The worker's name (`<host>-<pid>` unless configured).
    pub name: String,
    /// The models it runs: the pools it pulls from.
    pub models: Vec<Model>,
    /// Its devices, preferred first.
    pub devices: Vec<String>,
    /// Its engine (`dsp`, `demucs`, `dsp+demucs`, `fake`).
    pub engine: String,
    /// The stemq version it runs.
    pub version: String,
    /// Job loops (jobs it runs at once at most).
    pub concurrency: usize,
    /// Jobs it runs now.
    pub running: usize,
    /// Memory available to it now, in bytes (the host's `MemAvailable`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_memory_bytes: Option<u64>,
    /// Free memory of each GPU (`cuda:<index>` to bytes, from `nvidia-smi`), for a worker
    /// with a CUDA device.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub gpu_free_memory_bytes: std::collections::BTreeMap<String, u64>,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When it wrote this entry.
    pub heartbeat_at: DateTime<Utc>,
}

impl WorkerInfo {
    /// True when the heartbeat is at most [`TTL`] old at `now`.
    pub fn is_live(&self, now: DateTime<Utc>) -> bool {
        now.signed_duration_since(self.heartbeat_at).to_std().map(|age| age <= TTL).unwrap_or(true)
    }
}

/// Registry failures.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Writing the entry failed.
    #[error("writing the worker registry: {0}")]
    Put(#[from] kv::PutError),
    /// Deleting the entry failed.
    #[error("removing from the worker registry: {0}")]
    Delete(#[from] kv::DeleteError),
    /// Reading the bucket failed.
    #[error("reading the worker registry: {0}")]
    Read(#[source] async_nats::jetstream::stream::DirectGetError),
}

/// The bucket key of a worker: its name when that is a valid key of letters, digits,
/// `-`, `_` and `=`, else `h-` and the hex SHA-256 of the name.
pub fn key_of(name: &str) -> String {
    stemq_core::request::owner_token(name)
}

/// Writes (or refreshes) `info`.
pub async fn announce(bucket: &kv::Store, info: &WorkerInfo) -> Result<(), RegistryError> {
    let body = serde_json::to_vec(info).expect("worker info serialises");
    bucket.put(key_of(&info.name), body.into()).await?;
    Ok(())
}

/// Removes a worker's entry (it stops).
pub async fn withdraw(bucket: &kv::Store, name: &str) -> Result<(), RegistryError> {
    bucket.delete(key_of(name)).await?;
    Ok(())
}

/// The live workers now, by name. Reads the bucket's messages one by one by direct get
/// (no consumer: the services that read the registry this way may create none, see
/// `docs/security.md`).
pub async fn live(bucket: &kv::Store) -> Result<Vec<WorkerInfo>, RegistryError> {
    let filter = format!("{}>", bucket.prefix);
    let mut latest: HashMap<String, Option<WorkerInfo>> = HashMap::new();
    let mut seq = 0;
    loop {
        match bucket.stream.direct_get_next_for_subject(filter.as_str(), Some(seq + 1)).await {
            Ok(msg) => {
                seq = msg.sequence;
                let key = msg.subject.as_str().strip_prefix(bucket.prefix.as_str()).unwrap_or(msg.subject.as_str());
                // A delete or purge marker carries `KV-Operation`; a put does not.
                let removed = msg.headers.get("KV-Operation").is_some();
                let info = if removed { None } else { serde_json::from_slice::<WorkerInfo>(&msg.payload).ok() };
                latest.insert(key.to_string(), info);
            }
            Err(e) if e.kind() == async_nats::jetstream::stream::DirectGetErrorKind::NotFound => break,
            Err(e) => return Err(RegistryError::Read(e)),
        }
    }
    let now = Utc::now();
    let mut out: Vec<WorkerInfo> = latest.into_values().flatten().filter(|w| w.is_live(now)).collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The live workers that serve `model`, from `workers`.
pub fn serving(workers: &[WorkerInfo], model: Model) -> usize {
    workers.iter().filter(|w| w.models.contains(&model)).count()
}

/// Why a queued job of `model` waits, when no live worker serves its model.
pub fn waiting_reason(workers: &[WorkerInfo], model: Model) -> Option<String> {
    (serving(workers, model) == 0).then(|| format!("waiting for a worker that serves {model}"))
}

/// A live copy of the registry, kept by a watch on the bucket.
#[derive(Clone, Default)]
pub struct Registry {
    entries: Arc<RwLock<HashMap<String, WorkerInfo>>>,
    /// False until the watch has delivered the bucket's current entries.
    ready: Arc<std::sync::atomic::AtomicBool>,
    /// The newest revision the watch has applied.
    applied: Arc<std::sync::atomic::AtomicU64>,
    /// The bucket watched ([`Registry::catch_up`] reads how far it is).
    bucket: Option<kv::Store>,
    /// Woken whenever the watch applies an entry ([`Registry::wait_serving`]).
    changed: Arc<tokio::sync::Notify>,
}

impl Registry {
    /// Starts watching `bucket` (in a task that lives as long as the connection); the
    /// copy fills in as the watch delivers. The watch restarts when it ends.
    pub fn watch(bucket: kv::Store) -> Registry {
        let registry = Registry { bucket: Some(bucket.clone()), ..Registry::default() };
        let r = registry.clone();
        {
            // Entries that expired between the count and the watch never come: ready
            // anyway after a while.
            let ready = registry.ready.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(2)).await;
                ready.store(true, std::sync::atomic::Ordering::Release);
            });
        }
        tokio::spawn(async move {
            loop {
                // The current entries come first, the last of them with nothing pending
                // after it (`delta` 0); an empty bucket sends none, so the copy is ready
                // at once.
                let stored = crate::bucket_messages(&bucket).await;
                match bucket.watch_all().await {
                    Ok(mut w) => {
                        if stored == 0 {
                            r.ready.store(true, std::sync::atomic::Ordering::Release);
                        }
                        while let Some(entry) = w.next().await {
                            let Ok(entry) = entry else { break };
                            let caught_up = entry.delta == 0;
                            let mut map = r.entries.write().unwrap_or_else(|p| p.into_inner());
                            match entry.operation {
                                kv::Operation::Put => match serde_json::from_slice::<WorkerInfo>(&entry.value) {
                                    Ok(info) => {
                                        map.insert(entry.key, info);
                                    }
                                    Err(_) => {
                                        map.remove(&entry.key);
                                    }
                                },
                                kv::Operation::Delete | kv::Operation::Purge => {
                                    map.remove(&entry.key);
                                }
                            }
                            // Applied: counted once the copy holds it ([`Registry::catch_up`]).
                            r.applied.fetch_max(entry.revision, std::sync::atomic::Ordering::AcqRel);
                            if caught_up {
                                r.ready.store(true, std::sync::atomic::Ordering::Release);
                            }
                            drop(map);
                            r.changed.notify_waiters();
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "worker registry watch failed; retrying"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        registry
    }

    /// A copy that never changes (tests, and readers without NATS).
    pub fn fixed(workers: Vec<WorkerInfo>) -> Registry {
        let r = Registry::default();
        r.entries.write().expect("fresh lock").extend(workers.into_iter().map(|w| (key_of(&w.name), w)));
        r.ready.store(true, std::sync::atomic::Ordering::Release);
        r
    }

    /// The live workers now, by name.
    pub fn live(&self) -> Vec<WorkerInfo> {
        let now = Utc::now();
        let map = self.entries.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<WorkerInfo> = map.values().filter(|w| w.is_live(now)).cloned().collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// True once the watch has read the bucket.
    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Waits until the watch has read the bucket, or `within` has passed (it is ready
    /// at most 2 s after [`Registry::watch`] anyway); says whether it is ready.
    pub async fn wait_ready(&self, within: Duration) -> bool {
        poll_until(tokio::time::Instant::now() + within, Duration::from_millis(5), || self.is_ready()).await
    }

    /// Waits, at most `within`, until this copy holds what the bucket holds now (a
    /// worker that announced itself a moment ago reaches the copy only when the watch
    /// delivers its entry); says whether it does. A copy that watches nothing is
    /// caught up; one whose bucket does not answer is not.
    pub async fn catch_up(&self, within: Duration) -> bool {
        let Some(bucket) = &self.bucket else { return true };
        let deadline = tokio::time::Instant::now() + within;
        let state = match tokio::time::timeout_at(deadline, crate::bucket_state(bucket)).await {
            Ok(Some(state)) => state,
            _ => return false,
        };
        // The newest message is the newest entry's, and the watch delivers it (an
        // empty bucket has nothing to deliver).
        if state.messages == 0 {
            return true;
        }
        poll_until(deadline, Duration::from_millis(2), || {
            self.applied.load(std::sync::atomic::Ordering::Acquire) >= state.last_sequence
        })
        .await
    }

    /// Live workers that serve `model`.
    pub fn serving(&self, model: Model) -> usize {
        serving(&self.live(), model)
    }

    /// Waits until a live worker serves `model`, at most until `deadline`; says whether
    /// one does. Wakes on each entry the watch applies, not on a timer.
    pub async fn wait_serving(&self, model: Model, deadline: tokio::time::Instant) -> bool {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.serving(model) > 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.serving(model) > 0;
            }
        }
    }
}

/// Checks `done` every `step` until it holds or `deadline` has passed; says whether it
/// holds.
async fn poll_until(deadline: tokio::time::Instant, step: Duration, done: impl Fn() -> bool) -> bool {
    while !done() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(step).await;
    }
    true
}

/// The host's `MemAvailable` in bytes (Linux), for [`WorkerInfo::free_memory_bytes`].
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A worker of the `fake` engine on the CPU serving `models`, last heard of `age_s`
/// seconds ago (tests of the registry and its readers, here and in `stemq-tests`).
pub fn test_worker(name: &str, models: &[Model], age_s: i64) -> WorkerInfo {
    let now = Utc::now();
    WorkerInfo {
        name: name.into(),
        models: models.to_vec(),
        devices: vec!["cpu".into()],
        engine: "fake".into(),
        version: "0".into(),
        concurrency: 1,
        running: 0,
        free_memory_bytes: None,
        gpu_free_memory_bytes: Default::default(),
        started_at: now,
        heartbeat_at: now - chrono::Duration::seconds(age_s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(name: &str, models: &[Model], age_s: i64) -> WorkerInfo {
        test_worker(name, models, age_s)
    }

    #[test]
    fn a_worker_past_its_ttl_is_not_live_and_serves_nothing() {
        let r = Registry::fixed(vec![
            worker("a", &[Model::Dsp], 0),
            worker("b", &[Model::Htdemucs], 60),
            worker("c", &[Model::Dsp, Model::Htdemucs6s], 1),
        ]);
        let names: Vec<_> = r.live().into_iter().map(|w| w.name).collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!(r.serving(Model::Dsp), 2);
        assert_eq!(r.serving(Model::Htdemucs), 0);
        let live = r.live();
        assert_eq!(
            waiting_reason(&live, Model::Htdemucs).as_deref(),
            Some("waiting for a worker that serves htdemucs")
        );
        assert_eq!(waiting_reason(&live, Model::Htdemucs6s), None);
    }

    #[test]
    fn keys_are_valid_bucket_keys() {
        assert_eq!(key_of("gpu-7-1234"), "gpu-7-1234");
        let odd = key_of("host.example:42");
        assert!(odd.starts_with("h-") && odd.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'), "{odd}");
    }
}
