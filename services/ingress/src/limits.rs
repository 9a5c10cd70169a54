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
//!
//! The checks of one counter that arrive while another is being settled are settled
//! together ([`Batcher`]): one compare-and-set for all of them, in arrival order, so a
//! key's busy submits cost a round trip per batch rather than per submit, and every
//! check is still counted in the shared entry before its submit goes on.
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
use stemq_accounts::auth::Caller;
use stemq_core::JobId;
use stemq_nats::error::JetStreamError;
use stemq_nats::read::ListIndex;

use crate::{ApiError, ErrorCode};

/// How long an admitted job may take to appear in the log before its slot is freed.
pub const FORGET_UNRECORDED: Duration = Duration::from_secs(30);
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

/// A check's answer as its batch's settling hands it over.
type Answer = Result<Outcome, Arc<LimitsError>>;

/// Checks of one counter (a key's rate, a key's jobs in flight) settled in batches: a
/// check that arrives while the counter's previous batch is being settled waits, and the
/// next batch settles everything that waited, in arrival order, with one
/// compare-and-set. Settling runs in its own task, so a caller that goes away (a client
/// that disconnects) does not leave the others of its batch unanswered.
pub struct Batcher<I> {
    turns: std::sync::Mutex<HashMap<String, Arc<Turn<I>>>>,
}

/// One counter's waiting checks and the turn to settle them.
struct Turn<I> {
    waiting: std::sync::Mutex<Vec<(I, tokio::sync::oneshot::Sender<Answer>)>>,
    settling: Arc<tokio::sync::Mutex<()>>,
}

impl<I> Default for Batcher<I> {
    fn default() -> Batcher<I> {
        Batcher { turns: std::sync::Mutex::default() }
    }
}

impl<I: Send + 'static> Batcher<I> {
    /// Checks `item` against `counter`: `settle` is handed the items of one batch and
    /// answers each, in order (its result for this item is this call's).
    pub async fn check<F, Fut>(&self, counter: &str, item: I, settle: F) -> Result<Outcome, LimitsError>
    where
        F: FnOnce(Vec<I>) -> Fut,
        Fut: std::future::Future<Output = Result<Vec<Outcome>, LimitsError>> + Send + 'static,
    {
        let turn = {
            let mut turns = self.turns.lock().expect("limit turns");
            if turns.len() >= 10_000 {
                turns.retain(|_, t| Arc::strong_count(t) > 1);
            }
            turns
                .entry(counter.to_string())
                .or_insert_with(|| Arc::new(Turn { waiting: Default::default(), settling: Default::default() }))
                .clone()
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        turn.waiting.lock().expect("waiting checks").push((item, tx));
        let guard = turn.settling.clone().lock_owned().await;
        // Everything that waited, this check included unless an earlier batch took it.
        let batch = std::mem::take(&mut *turn.waiting.lock().expect("waiting checks"));
        if !batch.is_empty() {
            let (items, answers): (Vec<I>, Vec<_>) = batch.into_iter().unzip();
            let settled = settle(items);
            tokio::spawn(async move {
                let _turn = guard;
                match settled.await {
                    Ok(outcomes) => {
                        for (answer, outcome) in answers.into_iter().zip(outcomes) {
                            let _ = answer.send(Ok(outcome));
                        }
                    }
                    Err(e) => {
                        let e = Arc::new(e);
                        for answer in answers {
                            let _ = answer.send(Err(e.clone()));
                        }
                    }
                }
            });
        }
        match rx.await {
            Ok(Ok(outcome)) => Ok(outcome),
            Ok(Err(e)) => Err(LimitsError::Batch(e)),
            Err(_) => Err(LimitsError::Unsettled { counter: counter.to_string() }),
        }
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
    /// The batch this check was settled in failed (the same error for each check in it).
    #[error("limits bucket: settling a batch of checks")]
    Batch(#[source] Arc<LimitsError>),
    /// The batch this check was in ended without answering it.
    #[error("limits bucket: the checks of `{counter}` were not settled")]
    Unsettled {
        /// The counter's key.
        counter: String,
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

/// Takes `n` tokens from `key`'s bucket of `(rate, burst)`, one per check in order: a
/// check is allowed (with the whole tokens left after it) while a token remains.
async fn take(
    bucket: &kv::Store,
    key: &str,
    rate: f64,
    burst: u32,
    what: Limit,
    n: usize,
) -> Result<Vec<Outcome>, LimitsError> {
    let burst_f = f64::from(burst.max(1));
    let rate = if rate > 0.0 { rate } else { f64::MIN_POSITIVE };
    cas(bucket, key, |b: Option<Bucket>| {
        let now = now_ms();
        let b = b.unwrap_or(Bucket { tokens: burst_f, at_ms: now });
        let mut tokens = (b.tokens + (now - b.at_ms).max(0) as f64 / 1000.0 * rate).min(burst_f);
        let mut outcomes = Vec::with_capacity(n);
        for _ in 0..n {
            if tokens < 1.0 {
                let wait = ((1.0 - tokens) / rate).ceil().max(1.0) as u64;
                outcomes.push(Err(Limited {
                    limit: what,
                    retry_after: wait,
                    quota: u64::from(burst),
                    window: (burst_f / rate).ceil() as u64,
                    message: format!("too many requests: {burst} at once, then {rate} per second; retry in {wait} s"),
                }));
            } else {
                tokens -= 1.0;
                outcomes.push(Ok(tokens.floor() as u64));
            }
        }
        if outcomes.iter().all(Result::is_err) {
            return Err(outcomes);
        }
        Ok((Bucket { tokens, at_ms: now }, outcomes))
    })
    .await
}

/// `n` submits of `caller` against its rate, in order.
pub async fn rate(bucket: &kv::Store, caller: &Caller, n: usize) -> Result<Vec<Outcome>, LimitsError> {
    let l = caller.limits;
    take(bucket, &rate_counter(&caller.key_id), l.rate, l.burst, Limit::Rate, n).await
}

/// The counter of a key's rate.
pub fn rate_counter(key_id: &str) -> String {
    format!("rate.{key_id}")
}

/// The counter of a key's jobs in flight.
pub fn flight_counter(key_id: &str) -> String {
    format!("flight.{key_id}")
}

/// One replay of delivery `n` of `job`.
pub async fn replay(bucket: &kv::Store, job: &JobId, n: usize) -> Result<Outcome, LimitsError> {
    let (rate, burst) = REPLAY_LIMITS;
    let mut outcomes = take(bucket, &format!("replay.{job}.{n}"), rate, burst, Limit::Replay, 1).await?;
    Ok(outcomes.pop().expect("one check, one outcome"))
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

/// Admits `jobs`, in order, into the jobs in flight of key `key_id` (at most
/// `max_in_flight`), or refuses each that does not fit. `known` tells whether an id
/// counted earlier still runs (`Unknown` ones older than [`FORGET_UNRECORDED`] are
/// looked up with `recorded`, which answers whether the log holds the job and it has not
/// ended). A job already counted is admitted again (a retried submit).
pub async fn admit<F, Fut>(
    bucket: &kv::Store,
    key_id: &str,
    max_in_flight: u32,
    jobs: &[JobId],
    known: impl Fn(&JobId) -> JobState,
    recorded: F,
) -> Result<Vec<Outcome>, LimitsError>
where
    F: Fn(JobId) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let key = flight_counter(key_id);
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
    let cap = u64::from(max_in_flight);
    cas(bucket, &key, |f: Option<Flight>| {
        let mut f = f.unwrap_or_default();
        for id in &gone {
            f.jobs.remove(id);
        }
        let mut outcomes = Vec::with_capacity(jobs.len());
        let mut added = false;
        for job in jobs {
            if f.jobs.contains_key(job.as_str()) {
                outcomes.push(Ok(cap.saturating_sub(f.jobs.len() as u64)));
            } else if f.jobs.len() as u64 >= cap {
                outcomes.push(Err(Limited {
                    limit: Limit::InFlight,
                    retry_after: 1,
                    quota: cap,
                    window: 0,
                    message: format!(
                        "this key has {} jobs queued or running, its limit; submit more when some have finished",
                        f.jobs.len()
                    ),
                }));
            } else {
                f.jobs.insert(job.to_string(), now_ms());
                added = true;
                outcomes.push(Ok(cap - f.jobs.len() as u64));
            }
        }
        if !added && gone.is_empty() {
            return Err(outcomes);
        }
        Ok((f, outcomes))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Checks that arrive while a batch settles are settled together, each gets its own
    /// answer, and a failed batch fails every check in it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checks_are_settled_in_batches_and_each_gets_its_own_answer() {
        let batcher = Arc::new(Batcher::<u64>::default());
        let batches = Arc::new(AtomicUsize::new(0));
        let checks = (0..64u64).map(|i| {
            let (batcher, batches) = (batcher.clone(), batches.clone());
            tokio::spawn(async move {
                let settle = move |items: Vec<u64>| async move {
                    batches.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok(items.into_iter().map(|i| if i % 2 == 0 { Ok(i * 10) } else { Err(refused(i)) }).collect())
                };
                (i, batcher.check("rate.k", i, settle).await)
            })
        });
        for check in futures::future::join_all(checks).await {
            let (i, answer) = check.unwrap();
            let outcome = answer.expect("settled");
            if i % 2 == 0 {
                assert_eq!(outcome, Ok(i * 10));
            } else {
                assert_eq!(outcome.unwrap_err().retry_after, i);
            }
        }
        let n = batches.load(Ordering::SeqCst);
        assert!((2..=8).contains(&n), "64 checks arriving at once took {n} batches");

        let failing = (0..8u64).map(|i| {
            let batcher = batcher.clone();
            tokio::spawn(async move {
                let settle = |_: Vec<u64>| async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Err(LimitsError::Contended { key: "rate.k".into() })
                };
                batcher.check("rate.k", i, settle).await
            })
        });
        for check in futures::future::join_all(failing).await {
            let e = check.unwrap().expect_err("the batch failed");
            assert!(matches!(&e, LimitsError::Batch(s) if matches!(**s, LimitsError::Contended { .. })), "{e:?}");
        }
    }

    fn refused(retry_after: u64) -> Limited {
        Limited { limit: Limit::Rate, retry_after, quota: 1, window: 1, message: String::new() }
    }

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
