//! Credits: each owner's balance, as an event-sourced ledger.
//!
//! This module owns every movement of credits and the rules they follow. Every movement
//! is one message ([`Entry`]) in the stream `STEMQ_LEDGER`, on a subject that names its
//! owner and its kind, `stemq.ledger.<owner token>.<kind>` ([`ledger_subject`]), and
//! each kind is recorded by one NATS user only ([`Kind::writer`], `nats/users.json`): a
//! grant by an operator, a reservation before the engine starts (and its release, when
//! the job ended before it ran) by a worker, its settlement at the actual audio duration
//! or its refund in full by the projector.
//!
//! An account ([`Account`]) is the fold of its owner's entries, and the fold trusts no
//! writer: an entry is applied only where it fits ([`Account::apply`], [`Entry::check`]):
//! its kind on its own kind's subject, its owner the subject's, a reservation only once,
//! a settlement or refund only of an open reservation and of exactly what was reserved,
//! amounts that are the price times the audio. An entry that does not fit (unreadable,
//! out of place, inconsistent) is skipped, logged and counted
//! (`stemq_ledger_entries_skipped_total`, alert `StemqLedgerEntrySkipped`): it never
//! stops an account from being read, and never moves credits. Each process keeps the
//! folds it has read ([`Ledger`]) and reads only the entries recorded since.
//!
//! Writes are optimistic: a movement is published with
//! `Nats-Expected-Last-Subject-Sequence` (over all of the owner's subjects,
//! `Nats-Expected-Last-Subject-Sequence-Subject`) set to the last entry it was decided
//! from, so two writers never both commit against the same state; the loser reads again
//! and decides again. Every movement is also idempotent in the state it is decided
//! from: a job is reserved only when it has no open reservation, and a reservation is
//! closed only while it is open, so a retried delivery, a redelivered outcome or two
//! ledger consumers at once move nothing twice.
//!
//! Entries on `stemq.ledger.<owner token>` (one subject for every kind) are read too,
//! before the owner's other entries, under the same rules; nothing writes there.
//!
//! Amounts are integers of micro-credits ([`Micro`], a millionth of a credit); prices
//! are credits per minute of audio per model ([`Prices`], kept in the KV bucket
//! `stemq_config` under `prices`, from `nats/prices.json` by `stemq credits prices
//! set`). Without prices, credits are off: nothing is reserved or charged.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, kv};
use async_nats::HeaderMap;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use stemq_core::request::{owner_token, Model};
use stemq_core::JobId;
use stemq_nats::error::JetStreamError;
use stemq_nats::publish::{publish_payload, PublishError, PATIENCE};

/// A millionth of a credit.
pub type Micro = i64;
/// Micro-credits in one credit.
pub const MICRO: Micro = 1_000_000;

/// The ledger stream.
pub const LEDGER_STREAM: &str = "STEMQ_LEDGER";
/// The consumer that settles or refunds reservations from job outcomes.
pub const LEDGER_CONSUMER: &str = "ledger";
/// The configuration bucket.
pub const CONFIG_BUCKET: &str = "stemq_config";
/// The key of the price list in [`CONFIG_BUCKET`].
pub const PRICES_KEY: &str = "prices";

/// `stemq.ledger.<owner token>.<kind>`: where `owner`'s movements of `kind` are recorded.
pub fn ledger_subject(owner: &str, kind: Kind) -> String {
    format!("stemq.ledger.{}.{}", owner_token(owner), kind.token())
}

/// `stemq.ledger.<owner token>.*`: every movement of `owner`.
pub fn ledger_filter(owner: &str) -> String {
    format!("stemq.ledger.{}.*", owner_token(owner))
}

/// `stemq.ledger.<owner token>`: one subject for every kind of movement (read, never
/// written).
pub fn legacy_subject(owner: &str) -> String {
    format!("stemq.ledger.{}", owner_token(owner))
}

/// The kinds of movement: each has a subject token of its own, and one NATS user that
/// may record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// [`Movement::Granted`]
    Granted,
    /// [`Movement::Reserved`]
    Reserved,
    /// [`Movement::Released`]
    Released,
    /// [`Movement::Settled`]
    Settled,
    /// [`Movement::Refunded`]
    Refunded,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 5] = [Kind::Granted, Kind::Reserved, Kind::Released, Kind::Settled, Kind::Refunded];

    /// Its subject token (and the `kind` of its JSON).
    pub fn token(self) -> &'static str {
        match self {
            Kind::Granted => "granted",
            Kind::Reserved => "reserved",
            Kind::Released => "released",
            Kind::Settled => "settled",
            Kind::Refunded => "refunded",
        }
    }

    /// The kind of a subject token.
    pub fn parse(token: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.token() == token)
    }

    /// The NATS user that records it (`nats/users.json` grants it that subject only).
    pub fn writer(self) -> &'static str {
        match self {
            Kind::Granted => "operator",
            Kind::Reserved | Kind::Released => "worker",
            Kind::Settled | Kind::Refunded => "projector",
        }
    }
}

/// Credits as a decimal number, for people and JSON.
pub fn credits(m: Micro) -> f64 {
    m as f64 / MICRO as f64
}

/// Credits (a decimal number) as micro-credits, refusing what is not a finite amount.
pub fn micro(credits: f64) -> Option<Micro> {
    (credits.is_finite() && credits.abs() < 9.0e12).then(|| (credits * MICRO as f64).round() as Micro)
}

/// The price list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Prices {
    /// What a credit is called in messages (default `credit`).
    #[serde(default = "default_unit")]
    pub unit: String,
    /// Credits per minute of audio, per model name. A model not listed is free.
    pub per_audio_minute: BTreeMap<String, f64>,
    /// Refuse (402 at submit, `insufficient_credits` before the engine) a job the
    /// owner's available credits cannot pay. Off: usage is still recorded and the
    /// balance may go below zero.
    #[serde(default = "yes")]
    pub enforce: bool,
}

fn default_unit() -> String {
    "credit".into()
}

fn yes() -> bool {
    true
}

impl Prices {
    /// Micro-credits per minute of `model`'s audio.
    pub fn per_minute(&self, model: Model) -> Micro {
        self.per_audio_minute.get(model.as_str()).and_then(|c| micro(*c)).unwrap_or(0).max(0)
    }

    /// What `audio_ms` of audio costs at `per_minute`, rounded up to a micro-credit.
    pub fn cost_at(per_minute: Micro, audio_ms: u64) -> Micro {
        let num = per_minute as i128 * audio_ms as i128;
        ((num + 59_999) / 60_000) as Micro
    }

    /// What `audio_ms` of `model` costs.
    pub fn cost(&self, model: Model, audio_ms: u64) -> Micro {
        Prices::cost_at(self.per_minute(model), audio_ms)
    }

    /// Parses and checks a price list (non-negative, finite prices of known models).
    pub fn parse(text: &[u8]) -> Result<Prices, PricesError> {
        let p: Prices = serde_json::from_slice(text).map_err(PricesError::Json)?;
        for (model, price) in &p.per_audio_minute {
            if Model::parse(model).is_none() {
                return Err(PricesError::UnknownModel(model.clone()));
            }
            if !(price.is_finite() && *price >= 0.0) {
                return Err(PricesError::BadPrice(model.clone()));
            }
        }
        Ok(p)
    }
}

/// Why a price list is refused.
#[derive(Debug, thiserror::Error)]
pub enum PricesError {
    /// Not the JSON of a price list.
    #[error("not a price list")]
    Json(#[source] serde_json::Error),
    /// A model this build does not know.
    #[error("unknown model `{0}` in the price list")]
    UnknownModel(String),
    /// A price that is negative or not a number.
    #[error("the price of `{0}` must be a number of credits ≥ 0")]
    BadPrice(String),
}

/// Reads the price list from the configuration bucket (`None`: credits are off).
pub async fn prices(config: &kv::Store) -> Result<Option<Prices>, LedgerError> {
    match config.get(PRICES_KEY).await.map_err(|e| LedgerError::Read(JetStreamError::read("read the price list")(e)))? {
        None => Ok(None),
        Some(b) if b.is_empty() => Ok(None),
        Some(b) => Prices::parse(&b).map(Some).map_err(LedgerError::Decode),
    }
}

/// How long a read price list is used before it is read again.
pub const PRICES_TTL: Duration = Duration::from_secs(2);

/// The price list as a service reads it: from the configuration bucket, at most every
/// [`PRICES_TTL`] (a change reaches every worker and ingress within that).
pub struct PriceCache {
    config: Option<kv::Store>,
    cache: std::sync::Mutex<Option<(std::time::Instant, Option<Prices>)>>,
}

impl PriceCache {
    /// Over the configuration bucket; without one (an older deployment), credits are off.
    pub fn new(config: Option<kv::Store>) -> PriceCache {
        PriceCache { config, cache: std::sync::Mutex::new(None) }
    }

    /// The price list (`None`: credits are off).
    pub async fn get(&self) -> Result<Option<Prices>, LedgerError> {
        let Some(config) = &self.config else { return Ok(None) };
        if let Some((at, p)) = self.cache.lock().expect("prices lock").as_ref() {
            if at.elapsed() < PRICES_TTL {
                return Ok(p.clone());
            }
        }
        let p = prices(config).await?;
        *self.cache.lock().expect("prices lock") = Some((std::time::Instant::now(), p.clone()));
        Ok(p)
    }
}

/// One movement of credits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Movement {
    /// Credits added (or, negative, taken away) by an operator.
    Granted {
        /// Micro-credits.
        amount: Micro,
        /// Who granted them.
        by: String,
        /// Why.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
    },
    /// A job's cost set aside before its engine starts.
    Reserved {
        /// The job.
        job_id: JobId,
        /// Its model.
        model: Model,
        /// Audio the reservation is for, in milliseconds.
        audio_ms: u64,
        /// Micro-credits per minute of audio at the time of the reservation.
        per_minute: Micro,
        /// Micro-credits set aside.
        amount: Micro,
    },
    /// A reservation given back by the worker that made it, because the job ended
    /// (cancelled, expired) before its engine ran: nothing is charged.
    Released {
        /// The job.
        job_id: JobId,
        /// Its model.
        model: Model,
        /// What was set aside and is now free again.
        amount: Micro,
        /// Why.
        reason: String,
    },
    /// A reservation closed by a success: the actual cost is charged.
    Settled {
        /// The job.
        job_id: JobId,
        /// Its model.
        model: Model,
        /// What was set aside.
        reserved: Micro,
        /// What is charged (the actual audio at the reserved price).
        charged: Micro,
        /// Audio separated, in milliseconds.
        audio_ms: u64,
        /// Engine time of the successful attempt, in milliseconds.
        engine_ms: u64,
    },
    /// A reservation closed by any other end (failure, dead letter, cancel, expiry,
    /// rejection): nothing is charged.
    Refunded {
        /// The job.
        job_id: JobId,
        /// Its model.
        model: Model,
        /// What was set aside and is now free again.
        amount: Micro,
        /// How the job ended (`failed`, `dead_lettered`, `cancelled`, ...).
        reason: String,
    },
}

impl Movement {
    /// Its kind.
    pub fn kind(&self) -> Kind {
        match self {
            Movement::Granted { .. } => Kind::Granted,
            Movement::Reserved { .. } => Kind::Reserved,
            Movement::Released { .. } => Kind::Released,
            Movement::Settled { .. } => Kind::Settled,
            Movement::Refunded { .. } => Kind::Refunded,
        }
    }
}

/// Why an entry was left out of an account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Misfit {
    /// Not an entry (not JSON, or not one of the movements).
    #[error("not a ledger entry")]
    Unreadable,
    /// Recorded for another owner than its subject's.
    #[error("recorded on another owner's subject")]
    WrongOwner,
    /// A movement on another kind's subject (so recorded by a user that may not make it).
    #[error("on another kind's subject")]
    WrongSubject,
    /// A reservation of a job that has one open already.
    #[error("the job has an open reservation already")]
    AlreadyOpen,
    /// A settlement, refund or release of a job with no open reservation.
    #[error("the job has no open reservation")]
    NotOpen,
    /// Amounts or the model that disagree with the price, the audio or the reservation.
    #[error("amounts or model disagree with the reservation or the price")]
    Mismatch,
    /// Amounts beyond what an account can hold.
    #[error("amounts out of range")]
    Overflow,
}

impl Misfit {
    /// Its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Misfit::Unreadable => "unreadable",
            Misfit::WrongOwner => "wrong_owner",
            Misfit::WrongSubject => "wrong_subject",
            Misfit::AlreadyOpen => "already_open",
            Misfit::NotOpen => "not_open",
            Misfit::Mismatch => "mismatch",
            Misfit::Overflow => "overflow",
        }
    }

    /// Every reason.
    pub const ALL: [Misfit; 7] = [
        Misfit::Unreadable,
        Misfit::WrongOwner,
        Misfit::WrongSubject,
        Misfit::AlreadyOpen,
        Misfit::NotOpen,
        Misfit::Mismatch,
        Misfit::Overflow,
    ];
}

/// What `audio_ms` at `per_minute` costs, exactly (no cast that could wrap).
fn cost_wide(per_minute: Micro, audio_ms: u64) -> i128 {
    (per_minute as i128 * audio_ms as i128 + 59_999).div_euclid(60_000)
}

/// A reservation not yet closed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Open {
    /// The job's model.
    pub model: Model,
    /// Micro-credits set aside.
    pub amount: Micro,
    /// Micro-credits per minute of audio it was reserved at.
    pub per_minute: Micro,
    /// Audio it was reserved for, in milliseconds.
    pub audio_ms: u64,
}

/// What [`Ledger::reserve`] found or made.
#[derive(Debug, Clone, PartialEq)]
pub struct Reservation {
    /// The job's open reservation.
    pub open: Open,
    /// True when this call opened it; false when an earlier attempt had (a redelivery).
    pub opened: bool,
}

/// What one model cost an owner.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    /// Jobs charged.
    pub jobs: u64,
    /// Audio separated, in milliseconds.
    pub audio_ms: u64,
    /// Engine time, in milliseconds.
    pub engine_ms: u64,
    /// Micro-credits charged.
    pub charged: Micro,
}

/// An owner's account: the fold of its movements.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Account {
    /// Granted minus charged, in micro-credits.
    pub balance: Micro,
    /// Set aside for jobs not yet ended.
    pub reserved: Micro,
    /// Every grant, summed.
    pub granted: Micro,
    /// Every charge, summed.
    pub charged: Micro,
    /// Every refund, summed.
    pub refunded: Micro,
    /// The open reservations, by job.
    #[serde(default)]
    pub open: BTreeMap<JobId, Open>,
    /// Lifetime usage per model.
    #[serde(default)]
    pub usage: BTreeMap<String, Usage>,
}

impl Account {
    /// What a new reservation may take: the balance less what is set aside.
    pub fn available(&self) -> Micro {
        self.balance - self.reserved
    }

    /// Applies one movement where it fits (see [`Misfit`]); one that does not fit
    /// changes nothing.
    pub fn apply(&mut self, m: &Movement) -> Result<(), Misfit> {
        let add = |a: Micro, b: Micro| a.checked_add(b).ok_or(Misfit::Overflow);
        let sub = |a: Micro, b: Micro| a.checked_sub(b).ok_or(Misfit::Overflow);
        match m {
            Movement::Granted { amount, .. } => {
                let (balance, granted) = (add(self.balance, *amount)?, add(self.granted, *amount)?);
                (self.balance, self.granted) = (balance, granted);
            }
            Movement::Reserved { job_id, model, audio_ms, per_minute, amount } => {
                if self.open.contains_key(job_id) {
                    return Err(Misfit::AlreadyOpen);
                }
                if *per_minute < 0 || cost_wide(*per_minute, *audio_ms) != *amount as i128 {
                    return Err(Misfit::Mismatch);
                }
                self.reserved = add(self.reserved, *amount)?;
                self.open.insert(
                    job_id.clone(),
                    Open { model: *model, amount: *amount, per_minute: *per_minute, audio_ms: *audio_ms },
                );
            }
            Movement::Settled { job_id, model, reserved, charged, audio_ms, engine_ms } => {
                let o = self.open.get(job_id).ok_or(Misfit::NotOpen)?;
                if o.model != *model || o.amount != *reserved || cost_wide(o.per_minute, *audio_ms) != *charged as i128
                {
                    return Err(Misfit::Mismatch);
                }
                let u = self.usage.get(model.as_str()).cloned().unwrap_or_default();
                let (reserved_now, balance, charged_all, u_charged) = (
                    sub(self.reserved, *reserved)?,
                    sub(self.balance, *charged)?,
                    add(self.charged, *charged)?,
                    add(u.charged, *charged)?,
                );
                self.open.remove(job_id);
                (self.reserved, self.balance, self.charged) = (reserved_now, balance, charged_all);
                self.usage.insert(
                    model.as_str().to_string(),
                    Usage {
                        jobs: u.jobs.saturating_add(1),
                        audio_ms: u.audio_ms.saturating_add(*audio_ms),
                        engine_ms: u.engine_ms.saturating_add(*engine_ms),
                        charged: u_charged,
                    },
                );
            }
            Movement::Refunded { job_id, model, amount, .. } | Movement::Released { job_id, model, amount, .. } => {
                let o = self.open.get(job_id).ok_or(Misfit::NotOpen)?;
                if o.model != *model || o.amount != *amount {
                    return Err(Misfit::Mismatch);
                }
                let (reserved, refunded) = (sub(self.reserved, *amount)?, add(self.refunded, *amount)?);
                self.open.remove(job_id);
                (self.reserved, self.refunded) = (reserved, refunded);
            }
        }
        Ok(())
    }

    /// Applies the message `payload` stored on `subject` to `owner`'s account where it
    /// fits: an [`Entry`] of `owner`, on its kind's subject (or the legacy subject), that
    /// [`Account::apply`] accepts.
    pub fn apply_message(&mut self, owner: &str, subject: &str, payload: &[u8]) -> Result<Entry, Misfit> {
        let entry: Entry = serde_json::from_slice(payload).map_err(|_| Misfit::Unreadable)?;
        entry.check(owner, subject)?;
        self.apply(&entry.movement)?;
        Ok(entry)
    }
}

/// One message of an owner's ledger subject.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Entry {
    /// The owner.
    pub owner: String,
    /// When it was decided.
    pub time: DateTime<Utc>,
    /// What moved.
    pub movement: Movement,
}

impl Entry {
    /// Whether the entry belongs where it is stored: `owner`'s, on `owner`'s subject of
    /// its movement's kind (or on `owner`'s legacy subject).
    pub fn check(&self, owner: &str, subject: &str) -> Result<(), Misfit> {
        if self.owner != owner {
            return Err(Misfit::WrongOwner);
        }
        if subject == legacy_subject(owner) || subject == ledger_subject(owner, self.movement.kind()) {
            Ok(())
        } else {
            Err(Misfit::WrongSubject)
        }
    }
}

/// Why a ledger call failed.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The account cannot pay: it has `available` micro-credits, the job needs `needed`.
    #[error("insufficient credits: the job needs {:.6} and {:.6} are available", credits(*needed), credits(*available))]
    Insufficient {
        /// What the job costs.
        needed: Micro,
        /// What the owner may still spend.
        available: Micro,
    },
    /// The ledger (or the price list) cannot be read.
    #[error("cannot read the ledger")]
    Read(#[source] JetStreamError),
    /// The price list does not parse.
    #[error("the price list does not parse")]
    Decode(#[source] PricesError),
    /// An entry could not be written as JSON.
    #[error("cannot encode a ledger entry")]
    Encode(#[source] serde_json::Error),
    /// The movement would not fit the account (an amount out of range).
    #[error("the movement does not fit the account: {0}")]
    Refused(#[source] Misfit),
    /// The movement could not be recorded.
    #[error("cannot record the movement")]
    Publish(#[source] PublishError),
    /// The movement was decided to be nothing: there was nothing to record.
    #[error("the movement recorded nothing")]
    NothingRecorded,
    /// Too many concurrent writers: the state kept changing under us.
    #[error("the account of {0} kept changing; try again")]
    Contended(String),
}

/// For `map_err`: reading `what` of the ledger failed.
fn read<E: Into<stemq_nats::error::BoxError>>(what: &'static str) -> impl FnOnce(E) -> LedgerError {
    move |e| LedgerError::Read(JetStreamError::read(what)(e))
}

/// How a reservation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Close {
    /// Succeeded: charge the actual audio (`None`: what was reserved).
    Settle {
        /// Audio separated, in milliseconds, when the engine said.
        audio_ms: Option<u64>,
        /// Engine time, in milliseconds.
        engine_ms: u64,
    },
    /// Any other end: refund in full.
    Refund {
        /// How the job ended.
        reason: String,
    },
    /// The job ended before its engine ran: the worker that reserved gives it back.
    Release {
        /// How the job ended.
        reason: String,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SkipLabels {
    reason: &'static str,
}

/// `stemq_ledger_entries_skipped_total{reason}`: entries a fold left out, each counted
/// once per process. Every reason is exported from the start (at 0), so the first skip
/// is an increase the alert sees.
fn skipped() -> &'static Family<SkipLabels, Counter> {
    static F: OnceLock<Family<SkipLabels, Counter>> = OnceLock::new();
    F.get_or_init(|| {
        let f = Family::<SkipLabels, Counter>::default();
        for m in Misfit::ALL {
            let _ = f.get_or_create(&SkipLabels { reason: m.as_str() });
        }
        stemq_telemetry::metrics::metrics().register(|r| {
            r.register(
                "stemq_ledger_entries_skipped",
                "Ledger entries left out of an account (unreadable, out of place or inconsistent), per reason",
                f.clone(),
            )
        });
        f
    })
}

/// Registers the ledger's metrics (done by [`Ledger::new`]; for a process that exports
/// them before it reads an account).
pub fn register_metrics() {
    let _ = skipped();
}

/// An owner's account as this process has folded it.
#[derive(Debug, Clone, Default)]
struct Folded {
    account: Account,
    /// The legacy subject has been read.
    legacy_read: bool,
    /// The last sequence folded from the owner's kind subjects (0: none yet).
    seq: u64,
}

/// The ledger: reads and writes of owners' accounts. Clones share the folds read so
/// far, so keep one per process.
#[derive(Clone)]
pub struct Ledger {
    js: jetstream::Context,
    folds: Arc<Mutex<HashMap<String, Folded>>>,
}

/// How many times a movement is decided again after losing a race.
const MAX_RETRIES: usize = 200;

impl Ledger {
    /// The ledger on `js` (the stream must exist: `stemq nats apply`).
    pub fn new(js: jetstream::Context) -> Ledger {
        register_metrics();
        Ledger { js, folds: Arc::default() }
    }

    /// Folds `msg` into `f` where it fits; a misfit is logged and counted.
    fn fold_in(f: &mut Folded, owner: &str, msg: &jetstream::message::StreamMessage) {
        if let Err(m) = f.account.apply_message(owner, msg.subject.as_str(), &msg.payload) {
            skipped().get_or_create(&SkipLabels { reason: m.as_str() }).inc();
            tracing::warn!(
                event = "ledger.entry_skipped",
                owner,
                subject = %msg.subject,
                seq = msg.sequence,
                reason = m.as_str(),
                "a ledger entry does not fit the account: left out"
            );
        }
    }

    /// Reads the messages on `filter` after sequence `after` into `f`; returns the last
    /// sequence read.
    async fn read_after(
        stream: &jetstream::stream::Stream<()>,
        f: &mut Folded,
        owner: &str,
        filter: &str,
        mut after: u64,
    ) -> Result<u64, LedgerError> {
        loop {
            match stream.direct_get_next_for_subject(filter, Some(after + 1)).await {
                Ok(msg) => {
                    Self::fold_in(f, owner, &msg);
                    after = msg.sequence;
                }
                Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => return Ok(after),
                Err(e) => return Err(LedgerError::Read(JetStreamError::read("read a ledger entry")(e))),
            }
        }
    }

    /// An owner's account and the sequence of its last entry on its kind subjects (0:
    /// none yet), the one a movement decided from it expects.
    pub async fn account(&self, owner: &str) -> Result<(Account, u64), LedgerError> {
        let stream = self.js.get_stream_no_info(LEDGER_STREAM).await.map_err(read("open the ledger stream"))?;
        let mut f = self.folds.lock().expect("ledger folds").get(owner).cloned().unwrap_or_default();
        if !f.legacy_read {
            Self::read_after(&stream, &mut f, owner, &legacy_subject(owner), 0).await?;
            f.legacy_read = true;
        }
        let from = f.seq;
        f.seq = Self::read_after(&stream, &mut f, owner, &ledger_filter(owner), from).await?;
        let out = (f.account.clone(), f.seq);
        let mut folds = self.folds.lock().expect("ledger folds");
        if folds.get(owner).is_none_or(|old| old.seq <= f.seq) {
            folds.insert(owner.to_string(), f);
        }
        Ok(out)
    }

    /// Decides a movement from the current account and records it, again and again
    /// while another writer gets there first. `None`: nothing to record.
    async fn commit<F>(&self, owner: &str, msg_id: &str, mut decide: F) -> Result<Option<(Entry, Account)>, LedgerError>
    where
        F: FnMut(&Account) -> Result<Option<Movement>, LedgerError>,
    {
        let filter = ledger_filter(owner);
        for attempt in 0..MAX_RETRIES {
            let (account, seq) = self.account(owner).await?;
            let Some(movement) = decide(&account)? else { return Ok(None) };
            let mut after = account;
            after.apply(&movement).map_err(LedgerError::Refused)?;
            let subject = ledger_subject(owner, movement.kind());
            let entry = Entry { owner: owner.to_string(), time: Utc::now(), movement };
            let body = serde_json::to_vec(&entry).map_err(LedgerError::Encode)?;
            let mut h = HeaderMap::new();
            h.insert("Nats-Expected-Last-Subject-Sequence", seq.to_string().as_str());
            h.insert("Nats-Expected-Last-Subject-Sequence-Subject", filter.as_str());
            h.insert("Nats-Msg-Id", msg_id);
            // Transient failures (an election, a lost ack) are retried there: every
            // movement carries a message id, so a retry that was stored already is a
            // duplicate, not a second movement.
            match publish_payload(&self.js, &subject, body.into(), h, PATIENCE).await {
                Ok(_) => return Ok(Some((entry, after))),
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence || wrong_last(&e.source) => {
                    // Someone else moved first: decide again on the new state.
                    if attempt > 3 {
                        tokio::time::sleep(Duration::from_millis(1 + (attempt as u64 % 7))).await;
                    }
                }
                Err(e) => return Err(LedgerError::Publish(e)),
            }
        }
        Err(LedgerError::Contended(owner.to_string()))
    }

    /// Adds `amount` micro-credits (negative: takes them away) to `owner`. `grant_id`
    /// makes a retried grant count once (within the stream's duplicate window). Returns
    /// the entry and the account after it.
    pub async fn grant(
        &self,
        owner: &str,
        amount: Micro,
        by: &str,
        note: Option<String>,
        grant_id: &str,
    ) -> Result<(Entry, Account), LedgerError> {
        let m = Movement::Granted { amount, by: by.to_string(), note };
        let id = format!("grant.{grant_id}");
        match self.commit(owner, &id, |_| Ok(Some(m.clone()))).await? {
            Some(e) => Ok(e),
            None => Err(LedgerError::NothingRecorded),
        }
    }

    /// Sets aside what `audio_ms` of `model` costs for `job_id`, unless it is already
    /// set aside (a redelivery). With `enforce`, refuses what the available credits
    /// cannot pay. Returns the open reservation, and whether this call opened it.
    pub async fn reserve(
        &self,
        owner: &str,
        job_id: &JobId,
        model: Model,
        audio_ms: u64,
        prices: &Prices,
    ) -> Result<Reservation, LedgerError> {
        let per_minute = prices.per_minute(model);
        let amount = Prices::cost_at(per_minute, audio_ms);
        let mut existing = None;
        let id = format!("{job_id}.credits.reserved");
        let entry = self
            .commit(owner, &id, |acc| {
                if let Some(o) = acc.open.get(job_id) {
                    existing = Some(o.clone());
                    return Ok(None);
                }
                if prices.enforce && amount > 0 && acc.available() < amount {
                    return Err(LedgerError::Insufficient { needed: amount, available: acc.available() });
                }
                Ok(Some(Movement::Reserved { job_id: job_id.clone(), model, audio_ms, per_minute, amount }))
            })
            .await?;
        Ok(match entry {
            Some(_) => Reservation { open: Open { model, amount, per_minute, audio_ms }, opened: true },
            None => Reservation { open: existing.expect("an existing reservation"), opened: false },
        })
    }

    /// Closes `job_id`'s reservation if it is open: settles, refunds or releases it.
    /// `None`: there was nothing open (never reserved, or closed already).
    pub async fn close(&self, owner: &str, job_id: &JobId, how: &Close) -> Result<Option<Entry>, LedgerError> {
        let id = format!("{job_id}.credits.closed");
        let entry = self
            .commit(owner, &id, |acc| {
                let Some(o) = acc.open.get(job_id) else { return Ok(None) };
                Ok(Some(match how {
                    Close::Settle { audio_ms, engine_ms } => {
                        let audio_ms = audio_ms.unwrap_or(o.audio_ms);
                        Movement::Settled {
                            job_id: job_id.clone(),
                            model: o.model,
                            reserved: o.amount,
                            charged: Prices::cost_at(o.per_minute, audio_ms),
                            audio_ms,
                            engine_ms: *engine_ms,
                        }
                    }
                    Close::Refund { reason } => Movement::Refunded {
                        job_id: job_id.clone(),
                        model: o.model,
                        amount: o.amount,
                        reason: reason.clone(),
                    },
                    Close::Release { reason } => Movement::Released {
                        job_id: job_id.clone(),
                        model: o.model,
                        amount: o.amount,
                        reason: reason.clone(),
                    },
                }))
            })
            .await?;
        Ok(entry.map(|(e, _)| e))
    }

    /// The entries of `owner` that its account is the fold of (misfits left out), in
    /// order; only those recorded at or after `since` when given (the fold still starts
    /// at the first entry).
    pub async fn entries(&self, owner: &str, since: Option<DateTime<Utc>>) -> Result<Vec<Entry>, LedgerError> {
        let stream = self.js.get_stream_no_info(LEDGER_STREAM).await.map_err(read("open the ledger stream"))?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subjects: vec![legacy_subject(owner), ledger_filter(owner)],
                ..Default::default()
            })
            .await
            .map_err(read("read the ledger"))?;
        let pending = consumer.cached_info().num_pending;
        let mut out = Vec::new();
        if pending == 0 {
            return Ok(out);
        }
        // Legacy entries first (they precede the kind subjects' in every account).
        let (mut legacy, mut kinds) = (Vec::new(), Vec::new());
        let legacy_subject = legacy_subject(owner);
        let mut messages = consumer.messages().await.map_err(read("read the ledger"))?;
        while let Some(m) = messages.next().await {
            let m = m.map_err(read("read the ledger"))?;
            let left = m.info().map(|i| i.pending).unwrap_or(0);
            let seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
            let item = (m.subject.to_string(), seq, m.payload.clone());
            if m.subject.as_str() == legacy_subject {
                legacy.push(item);
            } else {
                kinds.push(item);
            }
            if left == 0 {
                break;
            }
        }
        let mut f = Folded::default();
        for (subject, seq, payload) in legacy.into_iter().chain(kinds) {
            match f.account.apply_message(owner, &subject, &payload) {
                Ok(e) => {
                    if since.is_none_or(|t| e.time >= t) {
                        out.push(e);
                    }
                }
                Err(m) => {
                    skipped().get_or_create(&SkipLabels { reason: m.as_str() }).inc();
                    tracing::warn!(
                        event = "ledger.entry_skipped",
                        owner,
                        subject,
                        seq,
                        reason = m.as_str(),
                        "a ledger entry does not fit the account: left out"
                    );
                }
            }
        }
        Ok(out)
    }
}

fn wrong_last(e: &jetstream::context::PublishError) -> bool {
    use std::error::Error as _;
    e.source().and_then(|s| s.downcast_ref::<jetstream::Error>()).map(|je| je.error_code().0 == 10071).unwrap_or(false)
}

/// The fold of `entries` from an empty account, leaving out what does not fit.
pub fn fold<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> Account {
    let mut a = Account::default();
    for e in entries {
        let _ = a.apply(&e.movement);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_credit_movement_has_one_writer() {
        use stemq_nats::users::{User, INGRESS, OPERATOR, PROJECTOR, RELAY, STATUS_READER, WORKER};
        let may = |user: &str, subject: &str| {
            User::from_name(user).permissions().unwrap().is_none_or(|p| p.publish.allow.iter().any(|s| s == subject))
        };
        let users = [OPERATOR, INGRESS, WORKER, PROJECTOR, RELAY, STATUS_READER, "publisher-acme"];
        for kind in Kind::ALL {
            let subject = format!("stemq.ledger.*.{}", kind.token());
            for user in users {
                let writer = user == kind.writer() || user == OPERATOR;
                assert_eq!(may(user, &subject), writer, "{user} on {subject}");
            }
        }
        for user in users {
            for wide in ["stemq.ledger.*", "stemq.ledger.>", "stemq.ledger.*.*", ">"] {
                assert_eq!(may(user, wide), user == OPERATOR, "{user} on {wide}");
            }
        }
    }

    fn id(n: u8) -> JobId {
        JobId::parse(&format!("{n:064x}")).unwrap()
    }

    #[test]
    fn costs_round_up_to_a_micro_credit_per_started_millisecond() {
        let p = Prices::parse(br#"{"per_audio_minute": {"htdemucs": 1.5, "dsp": 0}}"#).unwrap();
        assert!(p.enforce);
        assert_eq!(p.cost(Model::Htdemucs, 60_000), 1_500_000);
        assert_eq!(p.cost(Model::Htdemucs, 1), 25);
        assert_eq!(p.cost(Model::Dsp, 600_000), 0);
        assert_eq!(p.cost(Model::HtdemucsFt, 60_000), 0, "a model not listed is free");
        assert!(matches!(
            Prices::parse(br#"{"per_audio_minute": {"nope": 1}}"#),
            Err(PricesError::UnknownModel(m)) if m == "nope"
        ));
        assert!(matches!(Prices::parse(br#"{"per_audio_minute": {"dsp": -1}}"#), Err(PricesError::BadPrice(_))));
        let e = Prices::parse(b"{").unwrap_err();
        assert!(matches!(e, PricesError::Json(_)));
        let e = LedgerError::Decode(e);
        assert!(
            stemq_nats::error::report(&e).starts_with("the price list does not parse: not a price list: EOF"),
            "{e}"
        );
    }

    #[test]
    fn an_account_is_the_fold_of_its_movements() {
        let mut a = Account::default();
        let moves = [
            Movement::Granted { amount: 10 * MICRO, by: "op".into(), note: None },
            Movement::Reserved { job_id: id(1), model: Model::Dsp, audio_ms: 60_000, per_minute: MICRO, amount: MICRO },
            Movement::Reserved {
                job_id: id(2),
                model: Model::Dsp,
                audio_ms: 120_000,
                per_minute: MICRO,
                amount: 2 * MICRO,
            },
        ];
        for m in &moves {
            a.apply(m).unwrap();
        }
        assert_eq!((a.balance, a.reserved, a.available()), (10 * MICRO, 3 * MICRO, 7 * MICRO));
        a.apply(&Movement::Settled {
            job_id: id(1),
            model: Model::Dsp,
            reserved: MICRO,
            charged: MICRO / 2,
            audio_ms: 30_000,
            engine_ms: 900,
        })
        .unwrap();
        a.apply(&Movement::Refunded { job_id: id(2), model: Model::Dsp, amount: 2 * MICRO, reason: "failed".into() })
            .unwrap();
        assert_eq!((a.balance, a.reserved, a.charged, a.refunded), (10 * MICRO - MICRO / 2, 0, MICRO / 2, 2 * MICRO));
        assert!(a.open.is_empty());
        assert_eq!(a.usage["dsp"], Usage { jobs: 1, audio_ms: 30_000, engine_ms: 900, charged: MICRO / 2 });
    }

    #[test]
    fn entries_that_do_not_fit_are_left_out_and_change_nothing() {
        let owner = "alice";
        let at = |kind: Kind| ledger_subject(owner, kind);
        let body = |who: &str, m: Movement| {
            serde_json::to_vec(&Entry { owner: who.into(), time: Utc::now(), movement: m }).unwrap()
        };
        let grant = |amount| Movement::Granted { amount, by: "op".into(), note: None };
        let reserve = |n, amount| Movement::Reserved {
            job_id: id(n),
            model: Model::Dsp,
            audio_ms: 60_000,
            per_minute: MICRO,
            amount,
        };
        let mut a = Account::default();
        a.apply_message(owner, &at(Kind::Granted), &body(owner, grant(5 * MICRO))).unwrap();
        a.apply_message(owner, &at(Kind::Reserved), &body(owner, reserve(1, MICRO))).unwrap();
        let before = a.clone();
        let refund = |amount| Movement::Refunded { job_id: id(1), model: Model::Dsp, amount, reason: "x".into() };
        let settle = |n, charged, audio_ms| Movement::Settled {
            job_id: id(n),
            model: Model::Dsp,
            reserved: MICRO,
            charged,
            audio_ms,
            engine_ms: 1,
        };
        for (what, subject, payload, why) in [
            ("an empty object", at(Kind::Reserved), b"{}".to_vec(), Misfit::Unreadable),
            ("not JSON", at(Kind::Settled), b"\xff".to_vec(), Misfit::Unreadable),
            ("a grant on the workers' subject", at(Kind::Reserved), body(owner, grant(MICRO)), Misfit::WrongSubject),
            ("a grant on the projector's subject", at(Kind::Settled), body(owner, grant(MICRO)), Misfit::WrongSubject),
            ("a refund on the workers' subject", at(Kind::Reserved), body(owner, refund(MICRO)), Misfit::WrongSubject),
            ("bob's grant on alice's subject", at(Kind::Granted), body("bob", grant(MICRO)), Misfit::WrongOwner),
            ("a second reservation", at(Kind::Reserved), body(owner, reserve(1, MICRO)), Misfit::AlreadyOpen),
            ("a reservation off the price", at(Kind::Reserved), body(owner, reserve(2, 0)), Misfit::Mismatch),
            ("a settlement of nothing", at(Kind::Settled), body(owner, settle(2, 0, 0)), Misfit::NotOpen),
            ("a negative charge", at(Kind::Settled), body(owner, settle(1, -MICRO, 60_000)), Misfit::Mismatch),
            ("a charge off the audio", at(Kind::Settled), body(owner, settle(1, 7, 60_000)), Misfit::Mismatch),
            ("a refund of more", at(Kind::Refunded), body(owner, refund(2 * MICRO)), Misfit::Mismatch),
            ("a grant past the range", at(Kind::Granted), body(owner, grant(Micro::MAX)), Misfit::Overflow),
        ] {
            assert_eq!(a.apply_message(owner, &subject, &payload).err(), Some(why), "{what}");
            assert_eq!(a, before, "{what} changed the account");
        }
        // What fits still moves, on the kind's own subject or the legacy one.
        a.apply_message(owner, &at(Kind::Settled), &body(owner, settle(1, MICRO / 2, 30_000))).unwrap();
        a.apply_message(owner, &legacy_subject(owner), &body(owner, grant(MICRO))).unwrap();
        assert_eq!((a.balance, a.reserved, a.open.len()), (5 * MICRO + MICRO / 2, 0, 0));
    }

    #[test]
    fn each_kind_has_its_subject_and_its_writer() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.token()), Some(k));
            assert_eq!(ledger_subject("acme", k), format!("stemq.ledger.acme.{}", k.token()));
        }
        assert_eq!(ledger_filter("acme"), "stemq.ledger.acme.*");
        assert_eq!(
            Kind::ALL.map(Kind::writer),
            ["operator", "worker", "worker", "projector", "projector"],
            "grants by operators, reservations (and their release) by workers, closes by the projector"
        );
    }
}
