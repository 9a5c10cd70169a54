//! Paying for a job before its engine starts (the ledger: `stemq_accounts::ledger`).
//!
//! This module owns the worker's side of credits: with a price list in the
//! configuration bucket, every attempt reserves what the job's audio costs before the
//! engine runs (idempotent: a redelivery finds its reservation open), and a job the
//! owner's available credits cannot pay fails at once with `insufficient_credits`,
//! before any engine time is spent. The reservation is closed by the ledger consumer
//! when the job's outcome is recorded (`stemq_projector::ledger`). One race is closed
//! here: a job that ended (cancelled, expired) between this worker's start checks and
//! its reservation is released by the worker itself, since the ledger consumer may have
//! seen that outcome before the reservation existed; a reservation that a succeeded
//! attempt opened is left for the ledger consumer to settle.

use std::path::Path;

use async_nats::jetstream;
use stemq_accounts::ledger::{self, Close, Ledger, LedgerError, PriceCache};
use stemq_core::event::{Event, EventBody, Requested};
use stemq_core::failure::FailureCode;
use stemq_core::JobId;
use tracing::{info, warn};

use crate::job::Failure;
use crate::Shared;

/// The ledger and the price list, as a worker uses them.
pub(crate) struct Credits {
    ledger: Ledger,
    prices: PriceCache,
}

impl Credits {
    /// Opens the configuration bucket; without one (an older deployment), credits are
    /// off.
    pub(crate) async fn open(js: &jetstream::Context) -> Credits {
        let config = match js.get_key_value(ledger::CONFIG_BUCKET).await {
            Ok(kv) => Some(kv),
            Err(e) => {
                warn!(error = %e, "no configuration bucket (stemq nats apply creates it): credits are off");
                None
            }
        };
        Credits { ledger: Ledger::new(js.clone()), prices: PriceCache::new(config) }
    }
}

/// Reserves the job's cost before its engine runs (nothing when credits are off).
pub(crate) async fn reserve(
    shared: &Shared,
    job_id: &JobId,
    requested: &Requested,
    input: &Path,
) -> Result<(), Failure> {
    let unavailable =
        |e: LedgerError| Failure::transient(FailureCode::CreditsUnavailable, stemq_nats::error::report(&e));
    let prices = match shared.credits.prices.get().await {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(()),
        Err(e) => return Err(unavailable(e)),
    };
    let r = &requested.request;
    let metadata = stemq_core::engine::metadata_for(shared.engine.as_ref(), requested.metadata.as_ref());
    let audio_ms = shared
        .engine
        .audio_ms(r, metadata)
        .or_else(|| shared.config.audio_probe.and_then(|probe| probe(input)))
        .unwrap_or(0);
    let reservation = match shared.credits.ledger.reserve(&r.owner, job_id, r.model, audio_ms, &prices).await {
        Ok(reservation) => {
            let amount = ledger::credits(reservation.open.amount);
            info!(event = "credits.reserved", amount, audio_ms, opened = reservation.opened, "credits set aside");
            reservation
        }
        Err(e @ LedgerError::Insufficient { .. }) => {
            return Err(Failure::permanent(FailureCode::InsufficientCredits, format!("{e} ({})", prices.unit)))
        }
        Err(e) => return Err(unavailable(e)),
    };
    // Ended meanwhile (a cancel of the queued job, or another attempt that finished)?
    // Then nothing runs here.
    if let Some(succeeded) = ended(shared, job_id).await {
        if release_when_ended(reservation.opened, succeeded) {
            let how = Close::Release { reason: "ended before it ran".into() };
            if let Err(e) = shared.credits.ledger.close(&r.owner, job_id, &how).await {
                warn!(error = %e, "cannot release the reservation of a job that ended before it ran");
            }
        }
        return Err(Failure::permanent(FailureCode::Cancelled, "the job ended before it ran".into()));
    }
    Ok(())
}

/// Whether an attempt that finds its job ended gives the reservation back. One this
/// attempt opened: yes, since the ledger consumer may have closed the job before it
/// existed. One an earlier attempt opened: only when the job did not succeed. A success
/// is recorded after its attempt reserved, so the ledger consumer settles it; releasing
/// it first would refund a job that ran.
fn release_when_ended(opened: bool, succeeded: bool) -> bool {
    opened || !succeeded
}

/// How job `id` ended, if it has: `Some(true)` when it succeeded. A read that fails
/// counts as not ended (the reservation stays for the ledger consumer).
async fn ended(shared: &Shared, id: &JobId) -> Option<bool> {
    use stemq_nats::read::outcome::{outcome, From};
    let m = outcome(&shared.js, id, From::Replica).await.ok()??;
    Some(Event::from_slice(&m.payload).is_ok_and(|e| matches!(e.body, EventBody::Succeeded(_))))
}

#[cfg(test)]
mod tests {
    use super::release_when_ended;

    #[test]
    fn a_redelivery_leaves_a_succeeded_jobs_reservation_to_be_settled() {
        assert!(!release_when_ended(false, true), "an earlier attempt's success is settled, not released");
        assert!(release_when_ended(false, false), "an earlier attempt's reservation of a cancelled job");
        assert!(release_when_ended(true, false), "this attempt's reservation of a cancelled job");
        assert!(release_when_ended(true, true), "a reservation opened after the job was settled");
    }
}
