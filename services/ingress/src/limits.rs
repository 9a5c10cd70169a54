//! Fair limits per API key, shared by every ingress replica through NATS.
//!
//! This module owns the two limits of a key ([`Limits`]), kept in the `stemq_limits`
//! bucket and updated with compare-and-set, so two replicas never both spend the last
//! token or the last slot:
//!
//! - a token bucket of submits (`rate.<key id>`: tokens and when they were counted):
//!   `burst` at once, refilled at `rate` per second;
//! - the jobs of the key that are queued or running (`flight.<key id>`: job id → when it
//!   was admitted), at most `max_in_flight`. Admitting a job first drops the jobs that
//!   have ended (from the status view); a job admitted but never recorded (its publish
//!   failed) is dropped once it has had [`FORGET_UNRECORDED`] to show up in the log.
//!
//! The cap is what keeps one owner from starving the others: however fast a key
//! submits, at most `max_in_flight` of its jobs are ahead of anyone else's.
//! Over a limit the caller gets 429 with `Retry-After` and the `RateLimit-Policy` /
//! `RateLimit` headers of the IETF draft (draft-ietf-httpapi-ratelimit-headers), and
//! nothing is published. Replays of one webhook delivery use the same token bucket
//! ([`replay`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use stemq_accounts::auth::{Caller, Limits};
use stemq_core::JobId;
use stemq_nats::error::JetStreamError;
use stemq_nats::read::ListIndex;

use crate::{ApiError, ErrorCode};

/// How long an admitted job may take to appear in the log before its slot is freed.
pub const FORGET_UNRECORDED: Duration = Duration::from_secs(30);
/// Replays of one delivery: 3 at once, then one every 10 s.
pub const REPLAY_LIMITS: (f64, u32) = (0.1, 3);

/// One lock per key in this process: the concurrent submits of one key take turns at the
/// compare-and-set instead of racing and retrying against each other (32 connections of
/// one key otherwise spend most of their time in retries). Replicas still race each
/// other; the compare-and-set settles that.
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

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Flight {
    jobs: BTreeMap<String, i64>,
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
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
        let entry = bucket.entry(key).await.map_err(JetStreamError::read("read a limit counter"))?;
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
        let value = serde_json::to_vec(&next).map_err(|source| LimitsError::Encode { key: key.to_string(), source })?;
        let wrote = match revision {
            Some(r) => bucket.update(key, value.into(), r).await.is_ok(),
            None => bucket.create(key, value.into()).await.is_ok(),
        };
        if wrote {
            return Ok(result);
        }
    }
    Err(LimitsError::Contended { key: key.to_string() })
}

/// Takes one token from `key`'s bucket of `(rate, burst)`; returns the tokens left.
async fn take(
    bucket: &kv::Store,
    key: &str,
    rate: f64,
    burst: u32,
    what: Limit,
) -> Result<Result<u64, Limited>, LimitsError> {
    let burst_f = f64::from(burst.max(1));
    let rate = if rate > 0.0 { rate } else { f64::MIN_POSITIVE };
    cas(bucket, key, |b: Option<Bucket>| {
        let now = now_ms();
        let b = b.unwrap_or(Bucket { tokens: burst_f, at_ms: now });
        let tokens = (b.tokens + (now - b.at_ms).max(0) as f64 / 1000.0 * rate).min(burst_f);
        if tokens < 1.0 {
            let wait = ((1.0 - tokens) / rate).ceil().max(1.0) as u64;
            return Err(Err(Limited {
                limit: what,
                retry_after: wait,
                quota: u64::from(burst),
                window: (burst_f / rate).ceil() as u64,
                message: format!("too many requests: {burst} at once, then {rate} per second; retry in {wait} s"),
            }));
        }
        Ok((Bucket { tokens: tokens - 1.0, at_ms: now }, Ok((tokens - 1.0).floor() as u64)))
    })
    .await
}

/// One submit of `caller` against its rate; `Ok(remaining)` when allowed.
pub async fn rate(bucket: &kv::Store, caller: &Caller) -> Result<Result<u64, Limited>, LimitsError> {
    let l = caller.limits;
    take(bucket, &format!("rate.{}", caller.key_id), l.rate, l.burst, Limit::Rate).await
}

/// One replay of delivery `n` of `job`.
pub async fn replay(bucket: &kv::Store, job: &JobId, n: usize) -> Result<Result<u64, Limited>, LimitsError> {
    let (rate, burst) = REPLAY_LIMITS;
    take(bucket, &format!("replay.{job}.{n}"), rate, burst, Limit::Replay).await
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

/// Admits `job` into `caller`'s jobs in flight, or refuses it. `known` tells whether an
/// id counted earlier still runs (`Unknown` ones older than [`FORGET_UNRECORDED`] are
/// looked up with `recorded`, which answers whether the log holds the job and it has not
/// ended). A job already counted is admitted again (a retried submit).
pub async fn admit<F, Fut>(
    bucket: &kv::Store,
    caller: &Caller,
    job: &JobId,
    known: impl Fn(&JobId) -> JobState,
    recorded: F,
) -> Result<Result<u64, Limited>, LimitsError>
where
    F: Fn(JobId) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let key = format!("flight.{}", caller.key_id);
    let Limits { max_in_flight, .. } = caller.limits;
    // The slow lookups happen outside the compare-and-set loop.
    let current: Flight = match bucket.get(&key).await.map_err(JetStreamError::read("read the jobs in flight"))? {
        Some(v) => serde_json::from_slice(&v).unwrap_or_default(),
        None => Flight::default(),
    };
    let now = now_ms();
    let mut gone = Vec::new();
    for (id, at) in &current.jobs {
        let Some(id) = JobId::parse(id) else {
            gone.push(id.clone());
            continue;
        };
        match known(&id) {
            JobState::Gone => gone.push(id.to_string()),
            JobState::Unknown if now - at > FORGET_UNRECORDED.as_millis() as i64 && !recorded(id.clone()).await => {
                gone.push(id.to_string())
            }
            _ => {}
        }
    }
    cas(bucket, &key, |f: Option<Flight>| {
        let mut f = f.unwrap_or_default();
        for id in &gone {
            f.jobs.remove(id);
        }
        if f.jobs.contains_key(job.as_str()) {
            let left = u64::from(max_in_flight).saturating_sub(f.jobs.len() as u64);
            return Ok((f, Ok(left)));
        }
        if f.jobs.len() as u64 >= u64::from(max_in_flight) {
            return Err(Err(Limited {
                limit: Limit::InFlight,
                retry_after: 1,
                quota: u64::from(max_in_flight),
                window: 0,
                message: format!(
                    "this key has {} jobs queued or running, its limit; submit more when some have finished",
                    f.jobs.len()
                ),
            }));
        }
        f.jobs.insert(job.to_string(), now_ms());
        let left = u64::from(max_in_flight) - f.jobs.len() as u64;
        Ok((f, Ok(left)))
    })
    .await
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
