//! Credits: each owner's balance, as an event-sourced ledger.
//!
//! This module owns every movement of credits and the rules they follow. Each owner has
//! one subject in the stream `STEMQ_LEDGER`, `stemq.ledger.<owner token>`, and every
//! movement is one message there ([`Entry`]): a grant by an operator, a reservation
//! before the engine starts, its settlement at the actual audio duration when the job
//! succeeds, or its refund in full when the job ends any other way. Each entry also
//! carries the account as it is after the movement ([`Account`]): the balance is the
//! fold of the movements, and the fold's result is always one direct get away (the last
//! message of the owner's subject). The tests check that the two agree.
//!
//! Writes are optimistic: a movement is published with
//! `Nats-Expected-Last-Subject-Sequence` set to the sequence of the entry it was computed
//! from, so two writers (two workers reserving for one owner, the ledger consumer
//! settling) never both commit against the same state; the loser reads again and
//! decides again. Every movement is also idempotent in the state it is decided from: a
//! job is reserved only when it has no open reservation, and a reservation is closed
//! (settled or refunded) only while it is open, so a retried delivery, a redelivered
//! outcome or two ledger consumers at once move nothing twice.
//!
//! Amounts are integers of micro-credits ([`Micro`], a millionth of a credit); prices
//! are credits per minute of audio per model ([`Prices`], kept in the KV bucket
//! `stemq_config` under `prices`, from `nats/prices.json` by `stemq credits prices
//! set`). Without prices, credits are off: nothing is reserved or charged.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, kv};
use async_nats::HeaderMap;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::publish::{publish_payload, PATIENCE};
use crate::request::{owner_token, Model};
use crate::JobId;

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

/// `stemq.ledger.<owner token>`.
pub fn ledger_subject(owner: &str) -> String {
    format!("stemq.ledger.{}", owner_token(owner))
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
    pub fn parse(text: &[u8]) -> Result<Prices, String> {
        let p: Prices = serde_json::from_slice(text).map_err(|e| e.to_string())?;
        for (model, price) in &p.per_audio_minute {
            if Model::parse(model).is_none() {
                return Err(format!("unknown model `{model}` in the price list"));
            }
            if !(price.is_finite() && *price >= 0.0) {
                return Err(format!("the price of `{model}` must be a number of credits ≥ 0"));
            }
        }
        Ok(p)
    }
}

/// Reads the price list from the configuration bucket (`None`: credits are off).
pub async fn prices(config: &kv::Store) -> Result<Option<Prices>, LedgerError> {
    match config.get(PRICES_KEY).await.map_err(|e| LedgerError::Read(e.to_string()))? {
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

    /// Applies one movement.
    pub fn apply(&mut self, m: &Movement) {
        match m {
            Movement::Granted { amount, .. } => {
                self.balance += amount;
                self.granted += amount;
            }
            Movement::Reserved { job_id, model, audio_ms, per_minute, amount } => {
                self.reserved += amount;
                self.open.insert(
                    job_id.clone(),
                    Open { model: *model, amount: *amount, per_minute: *per_minute, audio_ms: *audio_ms },
                );
            }
            Movement::Settled { job_id, model, reserved, charged, audio_ms, engine_ms } => {
                self.open.remove(job_id);
                self.reserved -= reserved;
                self.balance -= charged;
                self.charged += charged;
                let u = self.usage.entry(model.as_str().to_string()).or_default();
                u.jobs += 1;
                u.audio_ms += audio_ms;
                u.engine_ms += engine_ms;
                u.charged += charged;
            }
            Movement::Refunded { job_id, amount, .. } => {
                self.open.remove(job_id);
                self.reserved -= amount;
                self.refunded += amount;
            }
        }
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
    /// The account after it.
    pub after: Account,
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
    /// The ledger cannot be read.
    #[error("cannot read the ledger: {0}")]
    Read(String),
    /// A stored entry or the price list does not parse.
    #[error("ledger data does not parse: {0}")]
    Decode(String),
    /// The movement could not be recorded.
    #[error("cannot record the movement: {0}")]
    Publish(String),
    /// Too many concurrent writers: the state kept changing under us.
    #[error("the account of {0} kept changing; try again")]
    Contended(String),
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
}

/// The ledger: reads and writes of owners' accounts.
#[derive(Clone)]
pub struct Ledger {
    js: jetstream::Context,
}

/// How many times a movement is decided again after losing a race.
const MAX_RETRIES: usize = 200;

impl Ledger {
    /// The ledger on `js` (the stream must exist: `stemq nats apply`).
    pub fn new(js: jetstream::Context) -> Ledger {
        Ledger { js }
    }

    /// An owner's account and the sequence of its last entry (0: none yet).
    pub async fn account(&self, owner: &str) -> Result<(Account, u64), LedgerError> {
        let stream = self.js.get_stream_no_info(LEDGER_STREAM).await.map_err(|e| LedgerError::Read(e.to_string()))?;
        match stream.direct_get_last_for_subject(ledger_subject(owner)).await {
            Ok(msg) => {
                let e: Entry = serde_json::from_slice(&msg.payload).map_err(|e| LedgerError::Decode(e.to_string()))?;
                Ok((e.after, msg.sequence))
            }
            Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => Ok((Account::default(), 0)),
            Err(e) => Err(LedgerError::Read(e.to_string())),
        }
    }

    /// Decides a movement from the current account and records it, again and again
    /// while another writer gets there first. `None`: nothing to record.
    async fn commit<F>(&self, owner: &str, msg_id: &str, mut decide: F) -> Result<Option<Entry>, LedgerError>
    where
        F: FnMut(&Account) -> Result<Option<Movement>, LedgerError>,
    {
        let subject = ledger_subject(owner);
        for attempt in 0..MAX_RETRIES {
            let (account, seq) = self.account(owner).await?;
            let Some(movement) = decide(&account)? else { return Ok(None) };
            let mut after = account;
            after.apply(&movement);
            let entry = Entry { owner: owner.to_string(), time: Utc::now(), movement, after };
            let body = serde_json::to_vec(&entry).map_err(|e| LedgerError::Decode(e.to_string()))?;
            let mut h = HeaderMap::new();
            h.insert("Nats-Expected-Last-Subject-Sequence", seq.to_string().as_str());
            h.insert("Nats-Msg-Id", msg_id);
            // Transient failures (an election, a lost ack) are retried there: every
            // movement carries a message id, so a retry that was stored already is a
            // duplicate, not a second movement.
            match publish_payload(&self.js, &subject, body.into(), h, PATIENCE).await {
                Ok(_) => return Ok(Some(entry)),
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence || wrong_last(&e.source) => {
                    // Someone else moved first: decide again on the new state.
                    if attempt > 3 {
                        tokio::time::sleep(Duration::from_millis(1 + (attempt as u64 % 7))).await;
                    }
                }
                Err(e) => return Err(LedgerError::Publish(e.to_string())),
            }
        }
        Err(LedgerError::Contended(owner.to_string()))
    }

    /// Adds `amount` micro-credits (negative: takes them away) to `owner`. `grant_id`
    /// makes a retried grant count once (within the stream's duplicate window).
    pub async fn grant(
        &self,
        owner: &str,
        amount: Micro,
        by: &str,
        note: Option<String>,
        grant_id: &str,
    ) -> Result<Entry, LedgerError> {
        let m = Movement::Granted { amount, by: by.to_string(), note };
        let id = format!("grant.{grant_id}");
        match self.commit(owner, &id, |_| Ok(Some(m.clone()))).await? {
            Some(e) => Ok(e),
            None => Err(LedgerError::Publish("nothing recorded".into())),
        }
    }

    /// Sets aside what `audio_ms` of `model` costs for `job_id`, unless it is already
    /// set aside (a redelivery). With `enforce`, refuses what the available credits
    /// cannot pay. Returns the open reservation.
    pub async fn reserve(
        &self,
        owner: &str,
        job_id: &JobId,
        model: Model,
        audio_ms: u64,
        prices: &Prices,
    ) -> Result<Open, LedgerError> {
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
            Some(_) => Open { model, amount, per_minute, audio_ms },
            None => existing.expect("an existing reservation"),
        })
    }

    /// Closes `job_id`'s reservation if it is open: settles it or refunds it. `None`:
    /// there was nothing open (never reserved, or closed already).
    pub async fn close(&self, owner: &str, job_id: &JobId, how: &Close) -> Result<Option<Entry>, LedgerError> {
        let id = format!("{job_id}.credits.closed");
        self.commit(owner, &id, |acc| {
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
            }))
        })
        .await
    }

    /// Every entry of `owner` recorded at or after `since` (all when `None`), in order.
    pub async fn entries(&self, owner: &str, since: Option<DateTime<Utc>>) -> Result<Vec<Entry>, LedgerError> {
        let stream = self.js.get_stream_no_info(LEDGER_STREAM).await.map_err(|e| LedgerError::Read(e.to_string()))?;
        let deliver_policy = match since {
            Some(t) => jetstream::consumer::DeliverPolicy::ByStartTime {
                start_time: time::OffsetDateTime::from_unix_timestamp_nanos(
                    t.timestamp_nanos_opt().unwrap_or_default() as i128,
                )
                .map_err(|e| LedgerError::Read(e.to_string()))?,
            },
            None => jetstream::consumer::DeliverPolicy::All,
        };
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: ledger_subject(owner),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| LedgerError::Read(e.to_string()))?;
        let pending = consumer.cached_info().num_pending;
        let mut out = Vec::with_capacity(pending as usize);
        if pending == 0 {
            return Ok(out);
        }
        let mut messages = consumer.messages().await.map_err(|e| LedgerError::Read(e.to_string()))?;
        while let Some(m) = messages.next().await {
            let m = m.map_err(|e| LedgerError::Read(e.to_string()))?;
            out.push(serde_json::from_slice(&m.payload).map_err(|e| LedgerError::Decode(e.to_string()))?);
            let left = m.info().map(|i| i.pending).unwrap_or(0);
            if left == 0 {
                break;
            }
        }
        Ok(out)
    }
}

fn wrong_last(e: &jetstream::context::PublishError) -> bool {
    use std::error::Error as _;
    e.source().and_then(|s| s.downcast_ref::<jetstream::Error>()).map(|je| je.error_code().0 == 10071).unwrap_or(false)
}

/// The fold of `entries` from an empty account: what the snapshots must agree with.
pub fn fold<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> Account {
    let mut a = Account::default();
    for e in entries {
        a.apply(&e.movement);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(Prices::parse(br#"{"per_audio_minute": {"nope": 1}}"#).is_err());
        assert!(Prices::parse(br#"{"per_audio_minute": {"dsp": -1}}"#).is_err());
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
            a.apply(m);
        }
        assert_eq!((a.balance, a.reserved, a.available()), (10 * MICRO, 3 * MICRO, 7 * MICRO));
        a.apply(&Movement::Settled {
            job_id: id(1),
            model: Model::Dsp,
            reserved: MICRO,
            charged: MICRO / 2,
            audio_ms: 30_000,
            engine_ms: 900,
        });
        a.apply(&Movement::Refunded { job_id: id(2), model: Model::Dsp, amount: 2 * MICRO, reason: "failed".into() });
        assert_eq!((a.balance, a.reserved, a.charged, a.refunded), (10 * MICRO - MICRO / 2, 0, MICRO / 2, 2 * MICRO));
        assert!(a.open.is_empty());
        assert_eq!(a.usage["dsp"], Usage { jobs: 1, audio_ms: 30_000, engine_ms: 900, charged: MICRO / 2 });
    }
}
