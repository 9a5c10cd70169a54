//! Webhooks: Standard Webhooks signing, the per-owner signing secrets, and the SSRF
//! policy for receiver URLs.
//!
//! This module owns the webhook contract shared by the ingress (secret endpoints, URL
//! check at submit) and the relay (signing, URL check and address pinning at delivery):
//! - [`Secret`], [`sign`], [`verify`]: Standard Webhooks 1.0 symmetric signatures,
//!   `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` with `whsec_` secrets;
//! - [`OwnerWebhooks`] in the `stemq_webhooks` bucket (key = owner): the current secret,
//!   the previous one while a rotation's grace period lasts (both sign), and the
//!   endpoints a receiver disabled with `410 Gone` ([`disable`]) until the owner turns
//!   them on again ([`enable`], behind `POST /v1/webhooks/enable` and
//!   `stemq webhooks enable`);
//! - [`delivery_attempts`]: the `delivery_attempted` record of a job read back from the
//!   log (direct gets), which the relay numbers its attempts from and the ingress lists;
//! - [`check_url`]: a receiver URL under the address policy of [`stemq_core::netpolicy`]:
//!   https only, public addresses only, unless `STEMQ_WEBHOOK_ALLOW` ([`ALLOW_ENV`])
//!   names the host or a CIDR holding its address (which then also permits plain http).
//!   The check resolves the host once and returns the address, so the caller connects to
//!   exactly what was checked (no DNS rebinding).

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use stemq_core::event::{DeliveryAttempted, EventBody};
pub use stemq_core::netpolicy::{is_public, Allowlist, Target};
use stemq_core::netpolicy::{HostPolicy, UrlError};
use stemq_core::{Event, JobId};
use stemq_nats::{job_subject, SubjectKind, JOBS_STREAM};

/// Prefix of symmetric secrets.
pub const SECRET_PREFIX: &str = "whsec_";
/// Largest accepted clock difference when verifying, in seconds.
pub const TOLERANCE_S: i64 = 300;

/// A symmetric signing secret (24–64 random bytes).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A new random secret of 32 bytes.
    pub fn generate() -> Secret {
        Secret(rand::random::<[u8; 32]>().to_vec())
    }

    /// Parses `whsec_<base64>` (the prefix is optional).
    pub fn parse(s: &str) -> Option<Secret> {
        let b = B64.decode(s.strip_prefix(SECRET_PREFIX).unwrap_or(s)).ok()?;
        (!b.is_empty()).then_some(Secret(b))
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{SECRET_PREFIX}{}", B64.encode(&self.0))
    }
}

/// The `v1,<base64>` signature of one message.
pub fn sign(secret: &Secret, msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret.0).expect("HMAC takes any key length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", B64.encode(mac.finalize().into_bytes()))
}

/// The `webhook-signature` header value: one signature per secret, space-separated.
pub fn signature_header(secrets: &[Secret], msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    secrets.iter().map(|s| sign(s, msg_id, timestamp, body)).collect::<Vec<_>>().join(" ")
}

/// Why a signature did not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// The timestamp is more than [`TOLERANCE_S`] away from now.
    #[error("timestamp too far from now")]
    Timestamp,
    /// No `v1` signature matched.
    #[error("no matching signature")]
    Signature,
}

/// Verifies a `webhook-signature` header against `secret` (constant-time compare).
pub fn verify(
    secret: &Secret,
    msg_id: &str,
    timestamp: i64,
    body: &[u8],
    header: &str,
    now: i64,
) -> Result<(), VerifyError> {
    if (now - timestamp).abs() > TOLERANCE_S {
        return Err(VerifyError::Timestamp);
    }
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret.0).expect("HMAC takes any key length");
    mac.update(format!("{msg_id}.{timestamp}.").as_bytes());
    mac.update(body);
    for sig in header.split(' ') {
        let Some(b64) = sig.strip_prefix("v1,") else {
            continue;
        };
        let Ok(bytes) = B64.decode(b64) else { continue };
        if mac.clone().verify_slice(&bytes).is_ok() {
            return Ok(());
        }
    }
    Err(VerifyError::Signature)
}

/// An owner's webhook settings, the value in the `stemq_webhooks` bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct OwnerWebhooks {
    /// The current signing secret (`whsec_...`).
    pub secret: String,
    /// The secret before the last rotation, still signing until `previous_until`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    /// End of the rotation grace period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_until: Option<DateTime<Utc>>,
    /// Receiver URLs that answered `410 Gone`: nothing more is sent to them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disabled: Vec<String>,
}

impl OwnerWebhooks {
    fn fresh() -> OwnerWebhooks {
        OwnerWebhooks {
            secret: Secret::generate().to_string(),
            previous: None,
            previous_until: None,
            disabled: Vec::new(),
        }
    }

    /// The secrets that sign now: the current one, and the previous one during the
    /// grace period.
    pub fn signing_secrets(&self, now: DateTime<Utc>) -> Vec<Secret> {
        let mut out: Vec<Secret> = Secret::parse(&self.secret).into_iter().collect();
        if let (Some(p), Some(until)) = (&self.previous, self.previous_until) {
            if now < until {
                out.extend(Secret::parse(p));
            }
        }
        out
    }
}

/// Failures reading or writing the secrets bucket.
#[derive(Debug, thiserror::Error)]
#[error("webhook settings of {owner}: {message}")]
pub struct SecretsError {
    /// Whose.
    pub owner: String,
    /// Why.
    pub message: String,
}

/// The bucket key of an owner: its [`stemq_core::request::owner_token`] (the owner itself
/// when it is a plain name).
pub fn owner_key(owner: &str) -> String {
    stemq_core::request::owner_token(owner)
}

fn secrets_err(owner: &str, e: impl std::fmt::Display) -> SecretsError {
    SecretsError { owner: owner.to_string(), message: e.to_string() }
}

/// Reads an owner's settings, creating them (with a new secret) on first use.
pub async fn owner_webhooks(bucket: &kv::Store, owner: &str) -> Result<(OwnerWebhooks, u64), SecretsError> {
    let key = owner_key(owner);
    for _ in 0..5 {
        if let Some(e) = bucket.entry(&key).await.map_err(|e| secrets_err(owner, e))? {
            if e.operation == kv::Operation::Put {
                let v = serde_json::from_slice(&e.value).map_err(|e| secrets_err(owner, e))?;
                return Ok((v, e.revision));
            }
        }
        let fresh = OwnerWebhooks::fresh();
        let body = serde_json::to_vec(&fresh).expect("serialises");
        match bucket.create(&key, body.into()).await {
            Ok(rev) => return Ok((fresh, rev)),
            // Someone else created it first: read theirs.
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
            Err(e) => return Err(secrets_err(owner, e)),
        }
    }
    Err(secrets_err(owner, "too many concurrent writers"))
}

/// Changes an owner's settings with compare-and-set.
async fn update_owner(
    bucket: &kv::Store,
    owner: &str,
    change: impl Fn(&mut OwnerWebhooks) -> bool,
) -> Result<OwnerWebhooks, SecretsError> {
    for _ in 0..10 {
        let (mut v, rev) = owner_webhooks(bucket, owner).await?;
        if !change(&mut v) {
            return Ok(v);
        }
        let body = serde_json::to_vec(&v).expect("serialises");
        match bucket.update(owner_key(owner), body.into(), rev).await {
            Ok(_) => return Ok(v),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
            Err(e) => return Err(secrets_err(owner, e)),
        }
    }
    Err(secrets_err(owner, "too many concurrent writers"))
}

/// Rotates an owner's secret; the old one keeps signing for `grace`.
pub async fn rotate(bucket: &kv::Store, owner: &str, grace: Duration) -> Result<OwnerWebhooks, SecretsError> {
    update_owner(bucket, owner, |v| {
        v.previous = Some(std::mem::replace(&mut v.secret, Secret::generate().to_string()));
        v.previous_until = Some(Utc::now() + chrono::Duration::from_std(grace).unwrap_or_default());
        true
    })
    .await
}

/// Disables `url` for `owner` (after a 410).
pub async fn disable(bucket: &kv::Store, owner: &str, url: &str) -> Result<(), SecretsError> {
    update_owner(bucket, owner, |v| {
        if v.disabled.iter().any(|u| u == url) {
            return false;
        }
        v.disabled.push(url.to_string());
        true
    })
    .await
    .map(|_| ())
}

/// Enables `url` for `owner` again after a 410 disabled it. Returns whether it was
/// disabled (enabling an enabled URL changes nothing).
pub async fn enable(bucket: &kv::Store, owner: &str, url: &str) -> Result<(OwnerWebhooks, bool), SecretsError> {
    // Set by the change that was written (the compare-and-set loop may run it again).
    let was_disabled = std::sync::atomic::AtomicBool::new(false);
    let after = update_owner(bucket, owner, |v| {
        let n = v.disabled.len();
        v.disabled.retain(|u| u != url);
        let changed = v.disabled.len() != n;
        was_disabled.store(changed, std::sync::atomic::Ordering::Relaxed);
        changed
    })
    .await?;
    Ok((after, was_disabled.load(std::sync::atomic::Ordering::Relaxed)))
}

/// One recorded `delivery_attempted` event and where it is in the job stream.
#[derive(Debug, Clone)]
pub struct RecordedAttempt {
    /// Its sequence in `STEMQ_JOBS`.
    pub seq: u64,
    /// The event (its `time` is when the attempt was recorded).
    pub event: Event,
    /// The attempt.
    pub attempt: DeliveryAttempted,
}

/// Why the delivery record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The job stream could not be opened.
    #[error("opening the job stream: {0}")]
    Stream(#[source] async_nats::Error),
    /// The record could not be read.
    #[error("reading the delivery record of {job}: {source}")]
    Consumer {
        /// Whose record.
        job: JobId,
        /// Why.
        #[source]
        source: async_nats::Error,
    },
}

/// Every `delivery_attempted` event of job `id` stored after stream sequence
/// `after_seq` (0: all of them), in log order. Reads `stemq.jobs.<id>.delivery` with
/// direct gets (next message on the subject after a sequence), so the cost is the job's
/// own record, not the stream, and the reader needs no right to create consumers on the
/// job stream (which, through the unnamed create API, would also let it rewrite a
/// durable consumer such as `workers`).
pub async fn delivery_attempts(
    js: &jetstream::Context,
    id: &JobId,
    after_seq: u64,
) -> Result<Vec<RecordedAttempt>, RecordError> {
    let stream = js.get_stream_no_info(JOBS_STREAM).await.map_err(|e| RecordError::Stream(e.into()))?;
    let subject = job_subject(id, SubjectKind::Delivery);
    let mut out = Vec::new();
    let mut from = after_seq + 1;
    loop {
        let m = match stream.direct_get_builder().sequence(from).next_by_subject(subject.as_str()).send().await {
            Ok(m) => m,
            Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => break,
            Err(e) => return Err(RecordError::Consumer { job: id.clone(), source: e.into() }),
        };
        if let Ok(event) = Event::from_slice(&m.payload) {
            if let EventBody::DeliveryAttempted(attempt) = event.body.clone() {
                out.push(RecordedAttempt { seq: m.sequence, event, attempt });
            }
        }
        from = m.sequence + 1;
    }
    Ok(out)
}

/// The environment variable of the webhook allow-list: hosts and networks receivers may
/// be at although not public, and where plain http is allowed
/// (`STEMQ_WEBHOOK_ALLOW=127.0.0.1,10.0.0.0/8,hooks.internal`).
pub const ALLOW_ENV: &str = "STEMQ_WEBHOOK_ALLOW";

/// The webhook allow-list from [`ALLOW_ENV`] (empty when unset).
pub fn allowlist_from_env() -> Allowlist {
    Allowlist::from_env(ALLOW_ENV)
}

/// A receiver URL the address policy refuses; the message is a sentence for the person
/// who gave the URL (`` `url` must use https``).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`url` {0}")]
pub struct ReceiverUrlError(#[source] pub UrlError);

/// Checks a receiver URL against the address policy (any public host, and the hosts and
/// networks of `allow`) and resolves it once.
pub async fn check_url(raw: &str, allow: &Allowlist) -> Result<Target, ReceiverUrlError> {
    stemq_core::netpolicy::check_url(raw, &HostPolicy::public(allow.clone())).await.map_err(ReceiverUrlError)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test vector of the Standard Webhooks specification.
    #[test]
    fn standard_webhooks_test_vector() {
        let secret = Secret::parse("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
        let body = br#"{"email":"test@example.com","username":"test_user"}"#;
        let sig = sign(&secret, "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk", 1649367553, body);
        assert_eq!(sig, "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=");
        let ok = verify(
            &secret,
            "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
            1649367553,
            body,
            &format!("v1,bm90IGl0 {sig}"),
            1649367553 + 10,
        );
        assert_eq!(ok, Ok(()));
        assert_eq!(verify(&secret, "msg_x", 1649367553, body, &sig, 1649367553), Err(VerifyError::Signature));
        assert_eq!(
            verify(&secret, "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk", 1649367553, body, &sig, 1649367553 + 301),
            Err(VerifyError::Timestamp)
        );
    }

    #[test]
    fn secrets_round_trip_and_rotation_signs_with_both() {
        let s = Secret::generate();
        assert!(s.to_string().starts_with("whsec_"));
        assert_eq!(Secret::parse(&s.to_string()), Some(s.clone()));
        let now = Utc::now();
        let mut o = OwnerWebhooks::fresh();
        assert_eq!(o.signing_secrets(now).len(), 1);
        o.previous = Some(s.to_string());
        o.previous_until = Some(now + chrono::Duration::seconds(60));
        assert_eq!(o.signing_secrets(now).len(), 2);
        assert_eq!(o.signing_secrets(now + chrono::Duration::seconds(61)).len(), 1);
        let header = signature_header(&o.signing_secrets(now), "m", 5, b"x");
        assert_eq!(header.split(' ').count(), 2);
        assert_eq!(verify(&s, "m", 5, b"x", &header, 5), Ok(()));
    }

    #[tokio::test]
    async fn ssrf_policy() {
        let none = Allowlist::default();
        for bad in [
            "http://example.com/h",
            "https://127.0.0.1/h",
            "https://10.1.2.3/h",
            "https://169.254.169.254/latest",
            "https://[::1]/h",
            "https://[fe80::1]/h",
            "https://192.168.0.1:8443/h",
            "https://user:pw@93.184.216.34/h",
            "ftp://93.184.216.34/h",
            "https://localhost/h",
            "not a url",
            // the reported bypasses: IPv4 embedded in IPv6, benchmarking, discard-only
            "https://[64:ff9b::a9fe:a9fe]/",
            "https://[2002:a9fe:a9fe::]/",
            "https://[::127.0.0.1]/",
            "https://[::ffff:0:7f00:1]/",
            "https://[64:ff9b:1::a00:1]/",
            "https://198.18.0.1/",
            "https://[100::1]/",
        ] {
            assert!(check_url(bad, &none).await.is_err(), "{bad}");
        }
        let t = check_url("https://93.184.216.34/h", &none).await.unwrap();
        assert_eq!(t.addr, "93.184.216.34:443".parse().unwrap());
        let local = Allowlist::parse("127.0.0.1, 10.0.0.0/8");
        let t = check_url("http://127.0.0.1:9000/h", &local).await.unwrap();
        assert_eq!(t.addr, "127.0.0.1:9000".parse().unwrap());
        assert!(check_url("http://10.9.8.7/h", &local).await.is_ok());
        assert!(check_url("http://192.168.1.1/h", &local).await.is_err());
        // plain http stays refused for public hosts even with an allow-list
        assert!(check_url("http://93.184.216.34/h", &local).await.is_err());
        assert!(check_url("http://localhost:1/h", &Allowlist::parse("localhost")).await.is_ok());
    }

    #[test]
    fn owner_keys_are_valid_kv_keys() {
        assert_eq!(owner_key("anonymous"), "anonymous");
        assert!(owner_key("a b/c").starts_with("h-"));
    }
}
