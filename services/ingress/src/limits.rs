//! Fair limits per API key: the counters every ingress replica shares through NATS.
//!
//! This module owns the two limits of a key ([`Limits`]) as the `stemq_limits` bucket
//! keeps them, updated with compare-and-set, so two replicas never both spend the last
//! token or the last slot:
//!
//! - a token bucket of submits (`rate.<key id>`: tokens and when they were counted):
//!   `burst` at once, refilled at `rate` per second. A replica takes tokens out in
//!   leases ([`lease_tokens`]) and gives back what it did not spend ([`give_back_tokens`]);
//! - the slots of the cap on jobs queued or running (`slots.<key id>`: how many slots
//!   each replica holds, at most `max_in_flight` in all, and when each last renewed its
//!   hold; [`grow_slots`], [`set_slots`]). Which jobs fill a replica's slots it lists
//!   in `slots.<key id>.<replica>` ([`list_jobs`]), so that when a replica stops renewing
//!   for [`HOLD_TTL`] another takes its hold over with its jobs ([`take_over_list`]).
//!
//! What one replica holds and spends locally is [`crate::leases`]. The cap is what keeps
//! one owner from starving the others: however fast a key submits, at most
//! `max_in_flight` of its jobs are ahead of anyone else's.
//! Over a limit the caller gets 429 with `Retry-After` and the `RateLimit-Policy` /
//! `RateLimit` headers of the IETF draft (draft-ietf-httpapi-ratelimit-headers), and
//! nothing is published. Replays of one webhook delivery use a token bucket too
//! ([`replay`]). Every operation on the bucket has [`OP_BOUND`] to answer, and one retry.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use stemq_core::JobId;
use stemq_nats::error::JetStreamError;
use stemq_nats::read::ListIndex;

use crate::{ApiError, ErrorCode};

/// How long an admitted job may take to appear in the log before its slot is freed.
pub const FORGET_UNRECORDED: Duration = Duration::from_secs(30);
/// How long one read or write of the bucket may take before it is tried once more (a
/// node restarting in a cluster answers nothing; the retry goes to another).
pub const OP_BOUND: Duration = Duration::from_secs(2);
/// A replica that has not renewed its hold of a key's slots for this long is taken to
/// have stopped: the next replica that needs slots takes the hold over.
pub const HOLD_TTL: Duration = Duration::from_secs(30);
/// A lease takes, beyond the checks waiting, this share (1/n) of what is left.
const LEASE_SHARE: u64 = 8;
/// The most a lease takes beyond the checks waiting.
pub const MAX_LEASE: u64 = 256;
/// Replays of one delivery: 3 at once, then one every 10 s.
pub const REPLAY_LIMITS: (f64, u32) = (0.1, 3);

/// One lock per name in this process, for work on one shared entry that must take turns
/// here rather than race and retry (the rounds of one batch of jobs). Replicas still
/// race each other; the compare-and-set settles that.
#[derive(Default)]
pub struct KeyLocks(std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl KeyLocks {
    /// Waits for `key_id`'s turn.
    pub async fn lock(&self, key_id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut g = self.0.lock().expect("key locks");
            if g.len() >= 10_000 {
                g.retain(|_, l| Arc::strong_count(l) > 1);
            }
            g.entry(key_id.to_string()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

/// What a check answers: allowed with so many left, or refused.
pub type Outcome = Result<u64, Limited>;

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// The key's token bucket of submits.
    Rate,
    /// The key's cap on jobs queued or running.
    InFlight,
    /// The token bucket of one webhook delivery's replays.
    Replay,
}

impl Limit {
    /// Its name in the `RateLimit-Policy` and `RateLimit` headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Rate => "rate",
            Limit::InFlight => "in_flight",
            Limit::Replay => "replay",
        }
    }

    /// The error code of its refusal.
    pub fn code(self) -> ErrorCode {
        match self {
            Limit::Rate | Limit::Replay => ErrorCode::RateLimited,
            Limit::InFlight => ErrorCode::TooManyInFlight,
        }
    }
}

/// A refusal: which limit, and when trying again can succeed.
#[derive(Debug, Clone, PartialEq)]
pub struct Limited {
    /// Which limit.
    pub limit: Limit,
    /// Seconds until a retry can succeed (at least 1).
    pub retry_after: u64,
    /// The limit's quota (burst or cap).
    pub quota: u64,
    /// Its window in seconds (time to refill the bucket; 0 for the cap).
    pub window: u64,
    /// What the caller should read.
    pub message: String,
}

/// Why a limit could not be checked.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// The `stemq_limits` bucket could not be read or written.
    #[error("limits bucket")]
    Store(#[from] JetStreamError),
    /// A counter could not be written as JSON.
    #[error("limits bucket: encoding `{key}`")]
    Encode {
        /// The counter's key.
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The counter kept changing under concurrent writers (other replicas, other
    /// requests of the key) until the attempts ran out.
    #[error("limits bucket: `{key}` kept changing under concurrent writers")]
    Contended {
        /// The counter's key.
        key: String,
    },
    /// The bucket did not answer within [`OP_BOUND`], twice.
    #[error("limits bucket: no answer about `{key}` within {OP_BOUND:?}")]
    TimedOut {
        /// The counter's key.
        key: String,
    },
}

/// 429 ([`ApiError`]'s answer for a limit) with the limit's headers.
impl IntoResponse for Limited {
    fn into_response(self) -> Response {
        let mut resp = ApiError::from(&self).into_response();
        headers(resp.headers_mut(), &self, 0);
        resp
    }
}

/// `Retry-After`, `RateLimit-Policy` and `RateLimit` for `l` with `remaining` left.
pub fn headers(h: &mut HeaderMap, l: &Limited, remaining: u64) {
    let mut set = |name: &'static str, v: String| {
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(name, v);
        }
    };
    if remaining == 0 {
        set("retry-after", l.retry_after.to_string());
    }
    let window = if l.window > 0 { format!(";w={}", l.window) } else { String::new() };
    let name = l.limit.as_str();
    set("ratelimit-policy", format!("\"{name}\";q={}{window}", l.quota));
    set("ratelimit", format!("\"{name}\";r={remaining};t={}", if remaining == 0 { l.retry_after } else { 0 }));
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Bucket {
    tokens: f64,
    at_ms: i64,
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// `op` within [`OP_BOUND`], tried twice.
async fn bounded<T, E, F, Fut>(key: &str, mut op: F) -> Result<Result<T, E>, LimitsError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    for _ in 0..2 {
        if let Ok(answer) = tokio::time::timeout(OP_BOUND, op()).await {
            return Ok(answer);
        }
    }
    Err(LimitsError::TimedOut { key: key.to_string() })
}

/// Reads, changes and compare-and-sets one entry until it sticks. `change` returns the
/// new value and the result, or an early result that writes nothing.
async fn cas<T, R>(
    bucket: &kv::Store,
    key: &str,
    mut change: impl FnMut(Option<T>) -> Result<(T, R), R>,
) -> Result<R, LimitsError>
where
    T: Serialize + DeserializeOwned,
{
    for attempt in 0..100u32 {
        if attempt > 0 {
            // Many replicas or requests on one key: spread the retries out.
            let ms = rand::random::<u64>() % u64::from(attempt.min(10) + 1);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let entry = bounded(key, || bucket.entry(key)).await?.map_err(JetStreamError::read("read a limit counter"))?;
        let (current, revision) = match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                (serde_json::from_slice::<T>(&e.value).ok(), Some(e.revision))
            }
            Some(e) => (None, Some(e.revision)),
            None => (None, None),
        };
        let (next, result) = match change(current) {
            Ok(x) => x,
            Err(early) => return Ok(early),
        };
        let value: bytes::Bytes =
            serde_json::to_vec(&next).map_err(|source| LimitsError::Encode { key: key.to_string(), source })?.into();
        let wrote = match revision {
            Some(r) => bounded(key, || bucket.update(key, value.clone(), r)).await?.is_ok(),
            None => bounded(key, || bucket.create(key, value.clone())).await?.is_ok(),
        };
        if wrote {
            return Ok(result);
        }
    }
    Err(LimitsError::Contended { key: key.to_string() })
}

/// A lease of tokens: how many it took, and how many whole tokens the bucket kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Tokens taken.
    pub granted: u64,
    /// Whole tokens left in the shared bucket.
    pub left: u64,
}

/// A bucket with no whole token: the refusal, and how long until the next token is due.
pub type Empty = (Limited, Duration);

fn refill(b: Option<Bucket>, rate: f64, burst: f64, now: i64) -> f64 {
    let b = b.unwrap_or(Bucket { tokens: burst, at_ms: now });
    (b.tokens + (now - b.at_ms).max(0) as f64 / 1000.0 * rate).min(burst)
}

/// Takes up to `want` tokens from `key`'s bucket of `(rate, burst)` (all it has, if
/// fewer), and with `spare` also an eighth of what would be left beyond them (at most
/// [`MAX_LEASE`]), or says when the next token is due.
pub async fn lease_tokens(
    bucket: &kv::Store,
    key: &str,
    (rate, burst): (f64, u32),
    what: Limit,
    want: u64,
    spare: bool,
) -> Result<Result<Lease, Empty>, LimitsError> {
    let burst_f = f64::from(burst.max(1));
    let rate = if rate > 0.0 { rate } else { f64::MIN_POSITIVE };
    cas(bucket, key, |b: Option<Bucket>| {
        let now = now_ms();
        let tokens = refill(b, rate, burst_f, now);
        let whole = tokens.floor() as u64;
        if whole == 0 {
            let wait = ((1.0 - tokens) / rate).min(86_400.0);
            let retry = wait.ceil().max(1.0) as u64;
            let refusal = Limited {
                limit: what,
                retry_after: retry,
                quota: u64::from(burst),
                window: (burst_f / rate).ceil() as u64,
                message: format!("too many requests: {burst} at once, then {rate} per second; retry in {retry} s"),
            };
            return Err(Err((refusal, Duration::from_secs_f64(wait.max(0.0)))));
        }
        let extra = if spare { (whole.saturating_sub(want) / LEASE_SHARE).min(MAX_LEASE) } else { 0 };
        let granted = (want.max(1) + extra).min(whole);
        let left = tokens - granted as f64;
        Ok((Bucket { tokens: left, at_ms: now }, Ok(Lease { granted, left: left.floor() as u64 })))
    })
    .await
}

/// Puts `n` unspent tokens back into `key`'s bucket (never above `burst`).
pub async fn give_back_tokens(
    bucket: &kv::Store,
    key: &str,
    (rate, burst): (f64, u32),
    n: u64,
) -> Result<(), LimitsError> {
    if n == 0 {
        return Ok(());
    }
    let burst_f = f64::from(burst.max(1));
    let rate = if rate > 0.0 { rate } else { f64::MIN_POSITIVE };
    cas(bucket, key, |b: Option<Bucket>| {
        let now = now_ms();
        let tokens = (refill(b, rate, burst_f, now) + n as f64).min(burst_f);
        Ok((Bucket { tokens, at_ms: now }, ()))
    })
    .await
}

/// The counter of a key's rate.
pub fn rate_counter(key_id: &str) -> String {
    format!("rate.{key_id}")
}

/// The entry of the holds of a key's slots.
pub fn slots_counter(key_id: &str) -> String {
    format!("slots.{key_id}")
}

/// The entry listing the jobs in `replica`'s slots of a key.
fn list_entry(key_id: &str, replica: &str) -> String {
    format!("slots.{key_id}.{replica}")
}

/// One replay of delivery `n` of `job`.
pub async fn replay(bucket: &kv::Store, job: &JobId, n: usize) -> Result<Outcome, LimitsError> {
    let key = format!("replay.{job}.{n}");
    Ok(match lease_tokens(bucket, &key, (REPLAY_LIMITS.0, REPLAY_LIMITS.1), Limit::Replay, 1, false).await? {
        Ok(lease) => Ok(lease.left),
        Err((refusal, _)) => Err(refusal),
    })
}

/// The holds of one key's slots: per replica, how many and when renewed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Holds {
    by: BTreeMap<String, Hold>,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct Hold {
    slots: u32,
    at_ms: i64,
}

/// What growing a hold got.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    /// New slots.
    pub granted: u32,
    /// The holds of stopped replicas taken over (replica, slots), now part of this one.
    pub taken_over: Vec<(String, u32)>,
}

/// Grows `replica`'s hold of `key_id`'s slots (at most `cap` held in all) by up to
/// `want` (all that is free, if fewer), with a spare eighth of what would be left free
/// beyond them (at most [`MAX_LEASE`]); takes over the holds not renewed for
/// [`HOLD_TTL`], whose slots stay taken by their jobs. `None`: no slot is free and no
/// hold was taken over (nothing written).
pub async fn grow_slots(
    bucket: &kv::Store,
    key_id: &str,
    replica: &str,
    cap: u32,
    want: u32,
) -> Result<Option<Grant>, LimitsError> {
    cas(bucket, &slots_counter(key_id), |h: Option<Holds>| {
        let now = now_ms();
        let mut h = h.unwrap_or_default();
        let stale: Vec<(String, u32)> =
            h.by.iter()
                .filter(|(r, x)| r.as_str() != replica && now - x.at_ms > HOLD_TTL.as_millis() as i64)
                .map(|(r, x)| (r.clone(), x.slots))
                .collect();
        let held: u32 = h.by.values().map(|x| x.slots).sum();
        let free = cap.saturating_sub(held);
        let extra = (u64::from(free.saturating_sub(want)) / LEASE_SHARE).min(MAX_LEASE) as u32;
        let granted = (want.max(1) + extra).min(free);
        if granted == 0 && stale.is_empty() {
            return Err(None);
        }
        let adopted: u32 = stale.iter().map(|s| s.1).sum();
        for (r, _) in &stale {
            h.by.remove(r);
        }
        let mine = h.by.entry(replica.to_string()).or_default();
        mine.slots += granted + adopted;
        mine.at_ms = now;
        Ok((h, Some(Grant { granted, taken_over: stale.clone() })))
    })
    .await
}

/// Sets `replica`'s hold of `key_id`'s slots to `slots` (never more than it holds; 0
/// ends it) and renews it. `false`: the replica held nothing there (another took its
/// hold over, with its jobs).
pub async fn set_slots(bucket: &kv::Store, key_id: &str, replica: &str, slots: u32) -> Result<bool, LimitsError> {
    cas(bucket, &slots_counter(key_id), |h: Option<Holds>| {
        let mut h = h.unwrap_or_default();
        let Some(mine) = h.by.get_mut(replica) else { return Err(slots == 0) };
        if slots == 0 {
            h.by.remove(replica);
        } else {
            mine.slots = slots.min(mine.slots);
            mine.at_ms = now_ms();
        }
        Ok((h, true))
    })
    .await
}

/// The jobs in one replica's slots: id → when admitted (Unix ms).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Listed {
    jobs: BTreeMap<String, i64>,
}

/// Writes which jobs fill `replica`'s slots of `key_id` (none: the entry goes).
pub async fn list_jobs(
    bucket: &kv::Store,
    key_id: &str,
    replica: &str,
    jobs: &HashMap<JobId, i64>,
) -> Result<(), LimitsError> {
    let key = list_entry(key_id, replica);
    if jobs.is_empty() {
        bounded(&key, || bucket.delete(&key)).await?.map_err(JetStreamError::write("forget a list of jobs"))?;
        return Ok(());
    }
    let listed = Listed { jobs: jobs.iter().map(|(id, at)| (id.to_string(), *at)).collect() };
    let value: bytes::Bytes =
        serde_json::to_vec(&listed).map_err(|source| LimitsError::Encode { key: key.clone(), source })?.into();
    bounded(&key, || bucket.put(&key, value.clone())).await?.map_err(JetStreamError::write("list the jobs"))?;
    Ok(())
}

/// Takes over the list of a stopped replica's jobs of `key_id`: reads it, deletes it,
/// and gives its jobs (id, when admitted).
pub async fn take_over_list(bucket: &kv::Store, key_id: &str, replica: &str) -> Result<Vec<(JobId, i64)>, LimitsError> {
    let key = list_entry(key_id, replica);
    let value = bounded(&key, || bucket.get(&key)).await?.map_err(JetStreamError::read("read a list of jobs"))?;
    let listed: Listed = value.and_then(|v| serde_json::from_slice(&v).ok()).unwrap_or_default();
    bounded(&key, || bucket.delete(&key)).await?.map_err(JetStreamError::write("forget a list of jobs"))?;
    Ok(listed.jobs.into_iter().filter_map(|(id, at)| Some((JobId::parse(&id)?, at))).collect())
}

/// What the admission needs to know about a job it already counts.
pub enum JobState {
    /// Queued or running (or just submitted).
    Live,
    /// Ended, or never recorded.
    Gone,
    /// Not in the index yet: ask the log.
    Unknown,
}

/// Whether a counted job still counts, from the list index alone.
pub fn state_in(index: &ListIndex, id: &JobId) -> JobState {
    match index.status(id) {
        Some(s) if s.is_terminal() => JobState::Gone,
        Some(_) => JobState::Live,
        None => JobState::Unknown,
    }
}

/// The refusal of the cap `cap`.
pub fn over_cap(cap: u32) -> Limited {
    Limited {
        limit: Limit::InFlight,
        retry_after: 1,
        quota: u64::from(cap),
        window: 0,
        message: format!("this key has {cap} jobs queued or running, its limit; submit more when some have finished"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_follow_the_draft() {
        let l = Limited { limit: Limit::Rate, retry_after: 3, quota: 100, window: 5, message: String::new() };
        let mut h = HeaderMap::new();
        headers(&mut h, &l, 0);
        assert_eq!(h["retry-after"], "3");
        assert_eq!(h["ratelimit-policy"], "\"rate\";q=100;w=5");
        assert_eq!(h["ratelimit"], "\"rate\";r=0;t=3");
        let mut h = HeaderMap::new();
        headers(&mut h, &l, 7);
        assert!(h.get("retry-after").is_none());
        assert_eq!(h["ratelimit"], "\"rate\";r=7;t=0");
    }
}
