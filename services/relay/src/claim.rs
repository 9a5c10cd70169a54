//! Who makes attempt `n` of a delivery: one claim per delivery in the
//! `stemq_delivery_claims` bucket, so two relays never send the same attempt.
//!
//! The queue alone cannot promise that: when an attempt outlasts the consumer's
//! `ack_wait` (a slow receiver, an event that waited in a relay's buffer, a paused
//! process) or an ack is lost in a NATS fault, the event is handed to a relay again —
//! often the other one — while the first may still be sending it. So before it sends
//! (or records without sending: a disabled or refused URL), a relay claims the attempt:
//! the delivery's key (`<job id>.<id of the event handed over>`: the event for a normal
//! delivery, the replay request for a replay) holds the number of the attempt claimed,
//! written with create (attempt 1) or compare-and-set on the revision it read (the next
//! ones). Exactly one relay wins each number; the loser leaves the event alone (no ack,
//! no nak): the winner acks it or hands it back when its attempt is over, so the
//! schedule stays the winner's.
//!
//! A claim with no recorded attempt behind it, older than the lease (the request
//! timeout plus [`LEASE_MARGIN`]), belongs to a relay that died between claim and record
//! (or could not record): another relay takes the claim over, again by compare-and-set,
//! and makes that attempt again with the same `webhook-id` — the one case where a
//! receiver may see an attempt twice, and why Standard Webhooks receivers de-duplicate
//! by `webhook-id`. Ages are read on the claimant's clock against the reader's; the
//! margin absorbs the skew of clocks kept by NTP.
//!
//! Entries expire after a day (the bucket's `max_age`): a claim only has to outlive the
//! copies of its event that relays may hold at once, minutes at most; an expired claim
//! is simply created again by the next attempt.
//!
//! [`decide`] is the pure rule; [`Claims::claim`] applies it against the bucket.

use std::time::Duration;

use async_nats::jetstream::kv;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use stemq_nats::error::JetStreamError;
use tracing::{debug, warn};

/// What the lease adds to the request timeout: the URL check, the record's publish with
/// its retries, and clock skew.
pub(crate) const LEASE_MARGIN: Duration = Duration::from_secs(60);

/// The value of a claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Claim {
    /// The attempt claimed (from 1).
    pub attempt: u32,
    /// Who claimed it (the relay's name and a per-process id), for people reading the
    /// bucket.
    pub relay: String,
    /// When, on the claimant's clock.
    pub at: DateTime<Utc>,
}

/// What to do about attempt `n`, given the delivery's claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// No claim yet: create it.
    Create,
    /// An older attempt's claim (or a deleted one): write ours over this revision.
    Update(u64),
    /// Attempt `n` was claimed longer ago than the lease and is still not recorded: take
    /// it over at this revision.
    TakeOver(u64),
    /// Attempt `n` or a later one is another relay's (or was, and is recorded).
    Taken,
}

/// The rule: `current` is the stored claim (attempt, age, revision), `None` when there
/// is none; `deleted` carries the revision of a deleted or purged entry.
pub(crate) fn decide(current: Option<(u32, Duration, u64)>, deleted: Option<u64>, n: u32, lease: Duration) -> Decision {
    match (current, deleted) {
        (None, None) => Decision::Create,
        (None, Some(revision)) => Decision::Update(revision),
        (Some((claimed, _, revision)), _) if claimed < n => Decision::Update(revision),
        (Some((claimed, age, revision)), _) if claimed == n && age > lease => Decision::TakeOver(revision),
        (Some(_), _) => Decision::Taken,
    }
}

/// The result of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claimed {
    /// Attempt `n` is ours to make and record.
    Mine,
    /// Attempt `n` (or a later one) is another relay's: leave the event alone.
    Taken {
        /// Who holds the claim.
        by: String,
        /// The attempt it holds.
        attempt: u32,
    },
}

/// A claim that could not be made: the bucket did not answer.
#[derive(Debug, thiserror::Error)]
#[error("claiming attempt {attempt} of delivery {key}")]
pub(crate) struct ClaimError {
    /// The delivery's key.
    pub key: String,
    /// The attempt.
    pub attempt: u32,
    /// The failed KV call.
    #[source]
    pub source: JetStreamError,
}

/// The claims bucket, as one relay process uses it.
pub(crate) struct Claims {
    pub kv: kv::Store,
    /// This relay, as written in its claims: `<name>/<process id>`.
    pub relay: String,
    /// How long a claimed, unrecorded attempt stays its claimant's.
    pub lease: Duration,
}

/// The delivery's key: `<job id>.<event id>` (`<batch id>.<event id>` for a batch's
/// end), the event id hashed when it holds characters a key may not (stemq's own events
/// have UUIDs).
pub(crate) fn key(job: &str, event_id: &str) -> String {
    let plain = !event_id.is_empty() && event_id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if plain {
        format!("{job}.{event_id}")
    } else {
        format!("{job}.h{}", hex::encode(&Sha256::digest(event_id.as_bytes())[..16]))
    }
}

impl Claims {
    /// Claims attempt `n` of the delivery `key`: [`Claimed::Mine`] when this relay may
    /// make it. Conflicting writers are read again and decided again.
    pub async fn claim(&self, key: &str, n: u32) -> Result<Claimed, ClaimError> {
        let fail = |what: &'static str| {
            move |e: Box<dyn std::error::Error + Send + Sync>| ClaimError {
                key: key.to_string(),
                attempt: n,
                source: JetStreamError::write(what)(e),
            }
        };
        let mine = Claim { attempt: n, relay: self.relay.clone(), at: Utc::now() };
        let body: bytes::Bytes = serde_json::to_vec(&mine).expect("claims serialise").into();
        // A first attempt is most likely unclaimed: try creating before paying for a read.
        let mut decision = if n == 1 { Decision::Create } else { self.read_and_decide(key, n).await? };
        for _ in 0..5 {
            let (written, holder) = match decision {
                Decision::Taken => {
                    let (by, attempt) = self.holder(key).await;
                    return Ok(Claimed::Taken { by, attempt });
                }
                Decision::Create => (self.kv.create(key, body.clone()).await.map(|_| ()).map_err(|e| e.into()), None),
                Decision::Update(rev) => (self.update(key, &body, rev).await, None),
                Decision::TakeOver(rev) => (self.update(key, &body, rev).await, Some(self.holder(key).await)),
            };
            match written {
                Ok(()) => {
                    if let Some((by, attempt)) = holder {
                        warn!(key, attempt, by, "taking over an attempt its relay claimed but never recorded");
                    }
                    return Ok(Claimed::Mine);
                }
                Err(Conflict::Lost) => {
                    debug!(key, attempt = n, "another relay wrote the claim first; reading it");
                    decision = self.read_and_decide(key, n).await?;
                }
                Err(Conflict::Failed(e)) => return Err(fail("write claim")(e)),
            }
        }
        let (by, attempt) = self.holder(key).await;
        Ok(Claimed::Taken { by, attempt })
    }

    async fn update(&self, key: &str, body: &bytes::Bytes, revision: u64) -> Result<(), Conflict> {
        match self.kv.update(key, body.clone(), revision).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Err(Conflict::Lost),
            Err(e) => Err(Conflict::Failed(e.into())),
        }
    }

    /// Reads the claim and decides.
    async fn read_and_decide(&self, key: &str, n: u32) -> Result<Decision, ClaimError> {
        let entry = self.kv.entry(key).await.map_err(|e| ClaimError {
            key: key.to_string(),
            attempt: n,
            source: JetStreamError::read("read claim")(e),
        })?;
        Ok(match entry {
            None => decide(None, None, n, self.lease),
            Some(e) if e.operation != kv::Operation::Put => decide(None, Some(e.revision), n, self.lease),
            Some(e) => match serde_json::from_slice::<Claim>(&e.value) {
                Ok(c) => {
                    let age = (Utc::now() - c.at).to_std().unwrap_or_default();
                    decide(Some((c.attempt, age, e.revision)), None, n, self.lease)
                }
                // Not a claim (hand-written?): ours replaces it.
                Err(_) => Decision::Update(e.revision),
            },
        })
    }

    /// Who holds the claim, for the logs (best effort).
    async fn holder(&self, key: &str) -> (String, u32) {
        match self.kv.entry(key).await {
            Ok(Some(e)) => serde_json::from_slice::<Claim>(&e.value).map(|c| (c.relay, c.attempt)).unwrap_or_default(),
            _ => Default::default(),
        }
    }
}

/// Why a claim's write did not go through.
enum Conflict {
    /// Another writer moved the entry first.
    Lost,
    /// The bucket did not answer.
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

impl From<kv::CreateError> for Conflict {
    fn from(e: kv::CreateError) -> Conflict {
        if e.kind() == kv::CreateErrorKind::AlreadyExists {
            Conflict::Lost
        } else {
            Conflict::Failed(e.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stemq_core::JobId;

    const LEASE: Duration = Duration::from_secs(75);
    const NOW: Duration = Duration::ZERO;

    #[test]
    fn the_first_claim_of_an_attempt_wins() {
        assert_eq!(decide(None, None, 1, LEASE), Decision::Create);
        // The next attempt after a recorded one: over the previous claim's revision.
        assert_eq!(decide(Some((1, Duration::from_secs(6), 41)), None, 2, LEASE), Decision::Update(41));
        // A deleted entry (or claims from before the bucket) does not block anyone.
        assert_eq!(decide(None, Some(7), 3, LEASE), Decision::Update(7));
    }

    #[test]
    fn an_attempt_in_flight_is_the_claimants() {
        // Given relay A claimed attempt 1 just now, when relay B is handed the event
        // again (A's ack wait ran out mid-request): B leaves it alone.
        assert_eq!(decide(Some((1, NOW, 3)), None, 1, LEASE), Decision::Taken);
        // A copy that thinks an older attempt is due (it read the record before the
        // claimant wrote the next): never takes a later attempt back.
        assert_eq!(decide(Some((3, Duration::from_secs(3600), 3)), None, 2, LEASE), Decision::Taken);
    }

    #[test]
    fn an_unrecorded_claim_past_the_lease_is_taken_over() {
        assert_eq!(decide(Some((2, LEASE + Duration::from_secs(1), 9)), None, 2, LEASE), Decision::TakeOver(9));
        assert_eq!(decide(Some((2, LEASE, 9)), None, 2, LEASE), Decision::Taken, "at the lease, not yet");
    }

    #[test]
    fn keys_are_valid_kv_keys() {
        let job = JobId::parse(&"ab".repeat(32)).unwrap();
        let k = key(job.as_str(), "0b1e8a2c-5c1d-4d7e-9a55-7a1c3a0e9f10");
        assert_eq!(k, format!("{job}.0b1e8a2c-5c1d-4d7e-9a55-7a1c3a0e9f10"));
        let odd = key(job.as_str(), "a.b c*>");
        assert!(odd.starts_with(&format!("{job}.h")) && odd.len() == 64 + 2 + 32, "{odd}");
        assert_eq!(odd, key(job.as_str(), "a.b c*>"), "stable");
    }
}
