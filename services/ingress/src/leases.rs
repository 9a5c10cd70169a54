//! What this replica holds of each key's limits, so that a submit well inside its key's
//! limits costs no round trip to NATS.
//!
//! This module owns the replica's share of the counters of [`crate::limits`]:
//!
//! - **Tokens.** A submit spends a token this replica already holds. With none, the
//!   replica leases tokens from the key's bucket: one for each submit of the key waiting
//!   here, plus an eighth of what the bucket would keep beyond them (at most
//!   [`limits::MAX_LEASE`]). Near the limit that spare is nothing, so the last tokens go
//!   one by one to whichever replica asks, as with no leases. Tokens not spent within
//!   [`TOKEN_LEASE`] go back to the bucket. A bucket found empty is remembered empty until
//!   its next token is due: refusals then cost nothing.
//! - **Slots of the cap.** The replica holds slots of the key's cap and knows which of
//!   its jobs fill them; a job that has ended (the list index says so) frees its slot
//!   here at once. With no free slot it grows its hold (the submits waiting, plus the
//!   same spare); slots it has not filled for [`SWEEP`] go back. Its jobs are listed in
//!   the bucket within [`SWEEP`] of a change, so when a replica stops (crash, deploy) and
//!   its hold lapses ([`limits::HOLD_TTL`]), the replica that takes the hold over counts
//!   those jobs until they end. Slots of jobs admitted after the last listing stay
//!   taken for [`UNLISTED`].
//!
//! Neither limit is ever exceeded: tokens and slots are taken out of the shared entry
//! before they are spent. What leasing costs is that a replica's unspent share waits at
//! most [`TOKEN_LEASE`] or [`SWEEP`] before another replica can have it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv;
use stemq_accounts::auth::Caller;
use stemq_core::JobId;
use tokio::time::Instant;
use tracing::warn;

use crate::limits::{self, JobState, Limit, LimitsError, Outcome, FORGET_UNRECORDED};

/// Tokens a replica has leased and not spent go back after this long.
pub const TOKEN_LEASE: Duration = Duration::from_secs(1);
/// How often the replica tends its holds: gives back what it has not used, lists its
/// jobs, renews its holds of slots.
pub const SWEEP: Duration = Duration::from_secs(1);
/// How long the slots of a stopped replica's unlisted jobs stay taken.
pub const UNLISTED: Duration = Duration::from_secs(600);
/// A replica whose slots are all filled looks for ended jobs at most this often (the
/// look is a walk of its jobs).
const PRUNE_EVERY: Duration = Duration::from_millis(20);
/// A hold is renewed when older than this (well inside [`limits::HOLD_TTL`]).
const RENEW_AFTER: Duration = Duration::from_secs(10);

/// This replica's leases, per key.
pub struct Leases {
    replica: String,
    keys: Mutex<HashMap<String, Arc<KeyHold>>>,
}

/// What the replica holds of one key.
#[derive(Default)]
struct KeyHold {
    tokens_waiting: AtomicU64,
    tokens: tokio::sync::Mutex<Tokens>,
    slots_waiting: AtomicU64,
    slots: tokio::sync::Mutex<Slots>,
}

#[derive(Default)]
struct Tokens {
    /// Leased, not yet spent.
    held: u64,
    /// Whole tokens the shared bucket kept at the last lease.
    left: u64,
    /// When the tokens held were leased, and under which limits.
    leased: Option<(Instant, (f64, u32))>,
    /// The bucket was empty: refuse until then with this.
    empty_until: Option<(Instant, limits::Limited)>,
}

#[derive(Default)]
struct Slots {
    /// Slots held in the shared entry.
    held: u32,
    /// The jobs in them: id → when admitted (Unix ms).
    jobs: HashMap<JobId, i64>,
    /// Slots of a stopped replica's unlisted jobs, and until when they stay taken.
    unlisted: Vec<(Instant, u32)>,
    /// The bucket's list of the jobs is behind.
    unlisted_changes: bool,
    /// Since when some held slot has been empty.
    spare_since: Option<Instant>,
    /// When the hold was last renewed.
    renewed: Option<Instant>,
    /// When the jobs were last looked over.
    pruned: Option<Instant>,
    /// No slot was free in the shared entry then.
    full_at: Option<Instant>,
    /// The cap the hold was taken under.
    cap: u32,
}

impl Slots {
    fn used(&self) -> u32 {
        self.jobs.len() as u32 + self.unlisted.iter().map(|u| u.1).sum::<u32>()
    }

    fn admit(&mut self, job: &JobId) -> Outcome {
        self.jobs.insert(job.clone(), chrono::Utc::now().timestamp_millis());
        self.unlisted_changes = true;
        Ok(u64::from(self.cap.saturating_sub(self.used())))
    }

    /// Frees the slots of jobs that ended (and of unlisted ones whose time is up).
    fn prune_known(&mut self, known: &impl Fn(&JobId) -> JobState) {
        let now = Instant::now();
        self.unlisted.retain(|u| u.0 > now);
        let before = self.jobs.len();
        self.jobs.retain(|id, _| !matches!(known(id), JobState::Gone));
        if self.jobs.len() != before {
            self.unlisted_changes = true;
        }
        self.pruned = Some(now);
    }
}

impl Default for Leases {
    fn default() -> Leases {
        Leases::new(uuid::Uuid::new_v4().simple().to_string())
    }
}

impl Leases {
    /// The leases of replica `replica` (a name no other replica has).
    pub fn new(replica: String) -> Leases {
        Leases { replica, keys: Mutex::default() }
    }

    fn hold(&self, key_id: &str) -> Arc<KeyHold> {
        self.keys.lock().expect("leases").entry(key_id.to_string()).or_default().clone()
    }

    /// Spends one of `caller`'s tokens: `Ok(left)`, about how many remain to the key.
    pub async fn spend(&self, bucket: &kv::Store, caller: &Caller) -> Result<Outcome, LimitsError> {
        let hold = self.hold(&caller.key_id);
        hold.tokens_waiting.fetch_add(1, Ordering::SeqCst);
        let mut t = hold.tokens.lock().await;
        let waiting = hold.tokens_waiting.fetch_sub(1, Ordering::SeqCst);
        if t.held > 0 {
            t.held -= 1;
            return Ok(Ok(t.left + t.held));
        }
        if let Some((until, refusal)) = &t.empty_until {
            let now = Instant::now();
            if now < *until {
                let retry_after = (*until - now).as_secs_f64().ceil().max(1.0) as u64;
                return Ok(Err(limits::Limited { retry_after, ..refusal.clone() }));
            }
        }
        let l = (caller.limits.rate, caller.limits.burst);
        let key = limits::rate_counter(&caller.key_id);
        match limits::lease_tokens(bucket, &key, l, Limit::Rate, waiting, true).await? {
            Ok(lease) => {
                t.empty_until = None;
                t.held = lease.granted - 1;
                t.left = lease.left;
                t.leased = Some((Instant::now(), l));
                Ok(Ok(t.left + t.held))
            }
            Err((refusal, wait)) => {
                t.empty_until = Some((Instant::now() + wait, refusal.clone()));
                Ok(Err(refusal))
            }
        }
    }

    /// Admits `job` into `key_id`'s slots of `cap`, or refuses it. `known` says whether a
    /// job counted still runs; `recorded`, for one unknown to the index after
    /// [`FORGET_UNRECORDED`], whether the log holds it and it has not ended.
    pub async fn admit<F, Fut>(
        &self,
        bucket: &kv::Store,
        key_id: &str,
        cap: u32,
        job: &JobId,
        known: impl Fn(&JobId) -> JobState,
        recorded: F,
    ) -> Result<Outcome, LimitsError>
    where
        F: Fn(JobId) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let hold = self.hold(key_id);
        hold.slots_waiting.fetch_add(1, Ordering::SeqCst);
        let mut s = hold.slots.lock().await;
        let waiting = hold.slots_waiting.fetch_sub(1, Ordering::SeqCst);
        s.cap = cap;
        // A cap lowered since the hold was taken counts at once.
        let room = |s: &Slots| s.used() < s.held.min(cap);
        if s.jobs.contains_key(job) {
            return Ok(Ok(u64::from(cap.saturating_sub(s.used()))));
        }
        if room(&s) {
            return Ok(s.admit(job));
        }
        let recently = |t: Option<Instant>| t.is_some_and(|t| t.elapsed() < PRUNE_EVERY);
        if !recently(s.pruned) {
            s.prune_known(&known);
            let now = chrono::Utc::now().timestamp_millis();
            let old: Vec<JobId> = s
                .jobs
                .iter()
                .filter(|(id, at)| {
                    now - **at > FORGET_UNRECORDED.as_millis() as i64 && matches!(known(id), JobState::Unknown)
                })
                .map(|(id, _)| id.clone())
                .collect();
            for id in old {
                if !recorded(id.clone()).await {
                    s.jobs.remove(&id);
                    s.unlisted_changes = true;
                }
            }
            if room(&s) {
                return Ok(s.admit(job));
            }
        }
        if recently(s.full_at) {
            return Ok(Err(limits::over_cap(cap)));
        }
        let want = u32::try_from(waiting).unwrap_or(u32::MAX).clamp(1, cap.max(1));
        match limits::grow_slots(bucket, key_id, &self.replica, cap, want).await? {
            Some(grant) => {
                s.full_at = None;
                s.held += grant.granted;
                s.renewed = Some(Instant::now());
                for (replica, slots) in grant.taken_over {
                    s.held += slots;
                    let jobs = limits::take_over_list(bucket, key_id, &replica).await?;
                    let unlisted = slots.saturating_sub(jobs.len() as u32);
                    if unlisted > 0 {
                        s.unlisted.push((Instant::now() + UNLISTED, unlisted));
                    }
                    s.jobs.extend(jobs);
                    s.unlisted_changes = true;
                }
            }
            None => s.full_at = Some(Instant::now()),
        }
        if room(&s) {
            Ok(s.admit(job))
        } else {
            Ok(Err(limits::over_cap(cap)))
        }
    }

    /// Tends every hold once: unspent tokens older than [`TOKEN_LEASE`] go back, empty
    /// slots older than [`SWEEP`] go back, changed lists of jobs are written, holds are
    /// renewed. A hold busy with a submit is tended next time.
    pub async fn sweep(&self, bucket: &kv::Store, known: &impl Fn(&JobId) -> JobState) {
        let holds: Vec<(String, Arc<KeyHold>)> =
            self.keys.lock().expect("leases").iter().map(|(k, h)| (k.clone(), h.clone())).collect();
        for (key_id, hold) in holds {
            if let Ok(mut t) = hold.tokens.try_lock() {
                if let Some((_, l)) = t.leased.filter(|(at, _)| at.elapsed() >= TOKEN_LEASE) {
                    let key = limits::rate_counter(&key_id);
                    match limits::give_back_tokens(bucket, &key, l, t.held).await {
                        Ok(()) => {
                            t.held = 0;
                            t.leased = None;
                        }
                        Err(e) => warn!(key = %key_id, error = %stemq_nats::error::report(&e), "giving back tokens"),
                    }
                }
            }
            if let Ok(mut s) = hold.slots.try_lock() {
                if let Err(e) = self.tend(bucket, &key_id, &mut s, known).await {
                    warn!(key = %key_id, error = %stemq_nats::error::report(&e), "tending a hold of slots");
                }
            }
            let idle = |h: &KeyHold| {
                matches!(h.tokens.try_lock(), Ok(t) if t.held == 0)
                    && matches!(h.slots.try_lock(), Ok(s) if s.held == 0 && !s.unlisted_changes)
            };
            let mut keys = self.keys.lock().expect("leases");
            if keys.get(&key_id).is_some_and(|h| Arc::strong_count(h) == 2 && idle(h)) {
                keys.remove(&key_id);
            }
        }
    }

    async fn tend(
        &self,
        bucket: &kv::Store,
        key_id: &str,
        s: &mut Slots,
        known: &impl Fn(&JobId) -> JobState,
    ) -> Result<(), LimitsError> {
        s.prune_known(known);
        let used = s.used();
        let now = Instant::now();
        let mut set = None;
        if s.held > used {
            match s.spare_since {
                Some(t) if now - t >= SWEEP => set = Some(used),
                Some(_) => {}
                None => s.spare_since = Some(now),
            }
        } else {
            s.spare_since = None;
        }
        if s.held > 0 && s.renewed.is_none_or(|t| now - t >= RENEW_AFTER) {
            set = Some(set.unwrap_or(s.held));
        }
        if s.unlisted_changes {
            limits::list_jobs(bucket, key_id, &self.replica, &s.jobs).await?;
            s.unlisted_changes = false;
        }
        if let Some(slots) = set {
            if limits::set_slots(bucket, key_id, &self.replica, slots).await? {
                s.held = slots;
                s.renewed = Some(now);
                s.spare_since = None;
            } else if s.held > 0 {
                // Another replica took this hold over, and counts these jobs now.
                warn!(key = %key_id, jobs = s.jobs.len(), "this replica's hold of slots was taken over");
                *s = Slots::default();
            }
        }
        Ok(())
    }

    /// Tends the holds every [`SWEEP`] until `stop`, then lists every hold's jobs once more.
    pub async fn run(
        self: Arc<Self>,
        bucket: kv::Store,
        known: impl Fn(&JobId) -> JobState,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(SWEEP);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => self.sweep(&bucket, &known).await,
            }
        }
        self.sweep(&bucket, &known).await;
    }
}
