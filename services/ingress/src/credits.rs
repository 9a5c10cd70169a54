//! Credits at the front door: what an upload lasts, the 402 before a job is queued, and
//! `GET /v1/account`.
//!
//! This module owns the ingress's side of credits (the ledger itself is
//! `stemq_accounts::ledger`; workers reserve, the projector settles):
//!
//! - An upload's length is read from its header while it streams in (WAV and FLAC state
//!   it; other formats are measured by the worker) and kept beside it as
//!   `<upload>.meta.json`; the upload answer says it (`duration_ms`).
//! - With an enforcing price list, a submit whose upload's length is known and whose
//!   cost the owner's available credits (balance less reservations) cannot pay is
//!   refused with 402 `insufficient_credits` before anything is queued; one whose
//!   account cannot be read then is refused as well (503 `unavailable`, `Retry-After`),
//!   never let through unpaid. Otherwise the worker's reservation decides, before the
//!   engine starts (and it, too, refuses to run what it cannot reserve).
//! - `GET /v1/account` (any key; `?owner=` for operators): balance, reserved, available,
//!   totals, and usage per model over a period (`from`, `to`, RFC 3339; default the
//!   last 30 days): jobs, audio seconds, engine seconds, credits.

use std::collections::BTreeMap;

use axum::extract::{Extension, State};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use stemq_accounts::auth::{Caller, Permission};
use stemq_accounts::ledger::{self, credits, Account, Movement, Prices};
use stemq_core::request::Model;
use tracing::warn;

use crate::rejection::Query;
use crate::{ApiError, AppState, ErrorCode};

/// The price list; `None` when credits are off, or when it cannot be read (the workers
/// then decide, at their reservation).
pub(crate) async fn prices(state: &AppState) -> Option<Prices> {
    state.prices.get().await.unwrap_or_else(|e| {
        warn!(error = %e, "cannot read the price list; the workers decide about credits");
        None
    })
}

/// The sidecar object of an upload: `<key>.meta.json`.
pub fn meta_key(upload_key: &str) -> String {
    format!("{upload_key}.meta.json")
}

/// What the ingress keeps about an upload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UploadMeta {
    /// How long it plays, in milliseconds, when its header says.
    pub duration_ms: Option<u64>,
}

/// How long the audio plays, from the first bytes of a WAV or FLAC file (`None`: not
/// stated there, or another format).
pub fn header_duration_ms(head: &[u8]) -> Option<u64> {
    let u32le = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if head.len() >= 12 && &head[0..4] == b"RIFF" && &head[8..12] == b"WAVE" {
        let (mut pos, mut byte_rate) = (12usize, 0u64);
        while pos + 8 <= head.len() {
            let (id, size) = (&head[pos..pos + 4], u32le(&head[pos + 4..pos + 8]) as u64);
            if id == b"fmt " && pos + 20 <= head.len() {
                byte_rate = u32le(&head[pos + 16..pos + 20]) as u64;
            }
            if id == b"data" {
                return (byte_rate > 0 && size != u32::MAX as u64).then(|| size * 1000 / byte_rate);
            }
            pos += 8 + size as usize + (size as usize & 1);
        }
        return None;
    }
    if head.len() >= 42 && &head[0..4] == b"fLaC" && head[4] & 0x7f == 0 {
        let si = &head[8..42];
        let rate = ((si[10] as u64) << 12) | ((si[11] as u64) << 4) | ((si[12] as u64) >> 4);
        let total = (((si[13] & 0x0f) as u64) << 32) | u32::from_be_bytes([si[14], si[15], si[16], si[17]]) as u64;
        return (rate > 0 && total > 0).then(|| total * 1000 / rate);
    }
    None
}

/// The refusal of a submit the owner cannot pay, when that is known before queueing.
pub async fn check_affordable(state: &AppState, owner: &str, model: Model, audio_uri: &str) -> Result<(), ApiError> {
    let Some(prices) = prices(state).await else { return Ok(()) };
    if !prices.enforce || prices.per_minute(model) == 0 {
        return Ok(());
    }
    let Some(storage) = state.storage.as_ref() else { return Ok(()) };
    let Ok((_, key)) = stemq_core::uri::store_key(audio_uri, state.stores()) else { return Ok(()) };
    let Ok(bytes) = storage.store.get_bytes(&meta_key(key)).await else { return Ok(()) };
    let Some(ms) = serde_json::from_slice::<UploadMeta>(&bytes).ok().and_then(|m| m.duration_ms) else {
        return Ok(());
    };
    let needed = prices.cost(model, ms);
    let (account, _) = state.ledger().account(owner).await.map_err(ledger_unavailable)?;
    if account.available() >= needed {
        return Ok(());
    }
    Err(ApiError {
        code: ErrorCode::InsufficientCredits,
        message: format!(
            "this job costs {:.6} {unit}s ({:.1} s of {model} at {} {unit}s a minute) and {:.6} are available; \
             nothing was queued. Ask an operator for credits (stemq credits grant)",
            credits(needed),
            ms as f64 / 1000.0,
            credits(prices.per_minute(model)),
            credits(account.available()),
            unit = prices.unit,
        ),
        field: None,
    })
}

/// `GET /v1/account` query.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct AccountQuery {
    /// Another owner's account (operator keys only); default the caller's own.
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9_-]{0,63}$"))]
    owner: Option<String>,
    /// Start of the usage period (RFC 3339); default 30 days before `to`.
    #[schemars(with = "Option<DateTime<Utc>>")]
    from: Option<String>,
    /// End of the usage period (RFC 3339); default now.
    #[schemars(with = "Option<DateTime<Utc>>")]
    to: Option<String>,
}

/// One model's usage.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct ModelUsage {
    /// The model.
    pub model: String,
    /// Jobs charged.
    pub jobs: u64,
    /// Audio separated, seconds.
    pub audio_seconds: f64,
    /// Engine time, seconds.
    pub engine_seconds: f64,
    /// Credits charged.
    pub credits: f64,
}

/// The answer of `GET /v1/account`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct AccountView {
    /// The owner.
    pub owner: String,
    /// `false` when no price list is set: nothing is charged.
    pub credits_on: bool,
    /// Whether jobs the balance cannot pay are refused.
    pub enforced: bool,
    /// What a credit is called.
    pub unit: String,
    /// Credits per minute of audio, per model (when credits are on).
    pub prices: BTreeMap<String, f64>,
    /// Granted minus charged.
    pub balance: f64,
    /// Set aside for jobs not yet ended.
    pub reserved: f64,
    /// What new jobs may use: balance less reserved.
    pub available: f64,
    /// Every grant.
    pub granted: f64,
    /// Every charge.
    pub charged: f64,
    /// Every refund.
    pub refunded: f64,
    /// Jobs with credits set aside now.
    pub open_jobs: usize,
    /// Start of the usage period.
    pub from: DateTime<Utc>,
    /// End of the usage period.
    pub to: DateTime<Utc>,
    /// Usage per model within the period.
    pub usage: Vec<ModelUsage>,
}

fn bad_time(field: &str, v: &str) -> ApiError {
    ApiError {
        code: ErrorCode::InvalidRequest,
        message: format!("`{field}` must be an RFC 3339 time, got `{v}`"),
        field: Some(field.into()),
    }
}

fn ledger_unavailable(e: ledger::LedgerError) -> ApiError {
    warn!(error = %stemq_nats::error::report(&e), "cannot read the ledger");
    ApiError {
        code: ErrorCode::Unavailable,
        message: "the credits ledger is unavailable; try again".into(),
        field: None,
    }
}

/// `GET /v1/account`.
pub async fn account(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<AccountQuery>,
) -> Result<Json<AccountView>, ApiError> {
    let owner = match q.owner.as_deref() {
        None => caller.owner.clone(),
        Some(o) if o == caller.owner => o.to_string(),
        Some(o) => {
            crate::access::require(&caller, Permission::Operate)?;
            if !stemq_accounts::auth::valid_owner(o) {
                return Err(ApiError {
                    code: ErrorCode::InvalidRequest,
                    message: format!("`{o}` is not an owner name (1-64 of a-z, 0-9, `_`, `-`)"),
                    field: Some("owner".into()),
                });
            }
            o.to_string()
        }
    };
    let parse = |field: &str, v: &Option<String>| -> Result<Option<DateTime<Utc>>, ApiError> {
        v.as_deref()
            .map(|s| DateTime::parse_from_rfc3339(s).map(|t| t.with_timezone(&Utc)).map_err(|_| bad_time(field, s)))
            .transpose()
    };
    let to = parse("to", &q.to)?.unwrap_or_else(Utc::now);
    let from = parse("from", &q.from)?.unwrap_or(to - chrono::Duration::days(30));
    let ledger = state.ledger();
    let (acc, _): (Account, u64) = ledger.account(&owner).await.map_err(ledger_unavailable)?;
    let mut per: BTreeMap<String, ModelUsage> = BTreeMap::new();
    if acc != Account::default() {
        for e in ledger.entries(&owner, Some(from)).await.map_err(ledger_unavailable)? {
            if e.time > to {
                break;
            }
            if let Movement::Settled { model, charged, audio_ms, engine_ms, .. } = e.movement {
                let u = per.entry(model.as_str().to_string()).or_insert_with(|| ModelUsage {
                    model: model.as_str().to_string(),
                    jobs: 0,
                    audio_seconds: 0.0,
                    engine_seconds: 0.0,
                    credits: 0.0,
                });
                u.jobs += 1;
                u.audio_seconds += audio_ms as f64 / 1000.0;
                u.engine_seconds += engine_ms as f64 / 1000.0;
                u.credits += credits(charged);
            }
        }
    }
    let prices = prices(&state).await;
    Ok(Json(AccountView {
        owner,
        credits_on: prices.is_some(),
        enforced: prices.as_ref().is_some_and(|p| p.enforce),
        unit: prices.as_ref().map(|p| p.unit.clone()).unwrap_or_else(|| "credit".into()),
        prices: prices.map(|p| p.per_audio_minute).unwrap_or_default(),
        balance: credits(acc.balance),
        reserved: credits(acc.reserved),
        available: credits(acc.available()),
        granted: credits(acc.granted),
        charged: credits(acc.charged),
        refunded: credits(acc.refunded),
        open_jobs: acc.open.len(),
        from,
        to,
        usage: per.into_values().collect(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_length_of_wav_and_flac_headers() {
        // 1 s of 44.1 kHz 16-bit stereo: 176 400 bytes of data.
        let mut wav = Vec::new();
        wav.extend_from_slice(b"RIFF\0\0\0\0WAVEfmt ");
        wav.extend_from_slice(&16u32.to_le_bytes());
        wav.extend_from_slice(&[1, 0, 2, 0]);
        wav.extend_from_slice(&44_100u32.to_le_bytes());
        wav.extend_from_slice(&176_400u32.to_le_bytes());
        wav.extend_from_slice(&[4, 0, 16, 0]);
        wav.extend_from_slice(b"LIST");
        wav.extend_from_slice(&3u32.to_le_bytes());
        wav.extend_from_slice(&[0, 0, 0, 0]); // odd chunk + pad byte
        wav.extend_from_slice(b"data");
        wav.extend_from_slice(&(176_400u32 * 3).to_le_bytes());
        assert_eq!(header_duration_ms(&wav), Some(3000));
        // FLAC STREAMINFO: 48 kHz, 96 000 samples.
        let mut flac = b"fLaC".to_vec();
        flac.extend_from_slice(&[0x80, 0, 0, 34]);
        let mut si = [0u8; 34];
        let rate: u32 = 48_000;
        si[10] = (rate >> 12) as u8;
        si[11] = (rate >> 4) as u8;
        si[12] = ((rate & 0x0f) << 4) as u8 | (1 << 1); // 2 channels - 1 in bits 1..3
        si[14..18].copy_from_slice(&96_000u32.to_be_bytes());
        flac.extend_from_slice(&si);
        assert_eq!(header_duration_ms(&flac), Some(2000));
        assert_eq!(header_duration_ms(b"ID3\x04 not a header we read"), None);
        assert_eq!(header_duration_ms(&wav[..30]), None, "a header cut short says nothing");
    }
}
