//! API keys: their format, the stored record, the roles and what each may do, and the
//! `stemq_keys` bucket that holds them.
//!
//! This module owns who a caller is. A key is `sk_<id>_<secret>`:
//!
//! - `id` (16 hex digits) names the record in the bucket, so a key can be listed, found
//!   and revoked from its prefix without the key itself ever being stored;
//! - `secret` (64 hex digits, 256 random bits) is kept only as its SHA-256, and the
//!   comparison is constant-time ([`subtle`]). A plain hash is enough for a secret with
//!   256 bits of entropy: there is nothing to guess.
//!
//! A key may expire ([`KeyRecord::expires_at`]): the session keys a sign-in link mints for
//! a browser ([`create_session`]) do, after [`SESSION_LIFETIME`]; keys made by `stemq keys
//! create` do not.
//!
//! The key is shown once, by `stemq keys create`; it never appears in the log, the view,
//! metrics or traces ([`ApiKey`]'s `Debug` hides the secret). Revocation marks the record;
//! [`KeyRing`] re-reads a record at most [`KeyRing::TTL`] after it last read it, so a
//! revocation takes effect on every ingress replica within seconds. While the bucket
//! cannot be read (a node restarting, a lost quorum), a key read in the last
//! [`KeyRing::STALE_IF_ERROR`] still authenticates from the cache: callers that were
//! just served keep being served, and a revocation waits for the bucket to answer again.
//!
//! Roles, from least to most: `read` (see the owner's jobs), `submit` (also submit,
//! upload, cancel, retry, replay), `admin` (also the owner's webhook secret), `operator`
//! (every owner's jobs; the operations team). See [`Permission`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use stemq_nats::error::JetStreamError;

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Read the owner's jobs, stems, events and deliveries.
    Read,
    /// `read`, plus submit, upload, cancel, retry and replay.
    Submit,
    /// `submit`, plus the owner's webhook secret and endpoints.
    Admin,
    /// Everything, for every owner.
    Operator,
}

/// An operation a route performs, checked against the caller's [`Role`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permission {
    /// Reading jobs, stems, events, deliveries.
    Read,
    /// Submitting, uploading, cancelling, retrying, replaying.
    Write,
    /// The webhook signing secret and endpoint settings.
    WebhookAdmin,
    /// Seeing and managing every owner's jobs; operational views.
    Operate,
}

impl Role {
    /// Every role, least to most.
    pub const ALL: [Role; 4] = [Role::Read, Role::Submit, Role::Admin, Role::Operator];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Submit => "submit",
            Role::Admin => "admin",
            Role::Operator => "operator",
        }
    }

    /// Parses the wire name.
    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// True when this role may perform `p`.
    pub fn allows(self, p: Permission) -> bool {
        match p {
            Permission::Read => true,
            Permission::Write => self != Role::Read,
            Permission::WebhookAdmin => matches!(self, Role::Admin | Role::Operator),
            Permission::Operate => self == Role::Operator,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-key limits: a token bucket of submits and a cap on jobs queued or running. A
/// `rate` of 0 turns the token bucket off, a `max_in_flight` of 0 the cap (for trusted
/// services and benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Limits {
    /// Submits per second, sustained (0: no rate limit).
    pub rate: f64,
    /// Submits allowed at once above the rate.
    pub burst: u32,
    /// Jobs of this key queued or running at once (0: no cap; at most
    /// [`Limits::MAX_IN_FLIGHT`]).
    pub max_in_flight: u32,
}

impl Limits {
    /// The largest cap: the jobs in flight of a key are one KV value.
    pub const MAX_IN_FLIGHT: u32 = 10_000;
    /// No limits at all.
    pub const NONE: Limits = Limits { rate: 0.0, burst: 0, max_in_flight: 0 };

    /// Refuses limits that cannot be enforced.
    pub fn check(&self) -> Result<(), String> {
        if !(self.rate >= 0.0 && self.rate.is_finite()) {
            return Err("the rate must be 0 (no limit) or a positive number".into());
        }
        if self.rate > 0.0 && self.burst == 0 {
            return Err("a rate needs a burst of at least 1".into());
        }
        if self.max_in_flight > Limits::MAX_IN_FLIGHT {
            return Err(format!("max_in_flight is at most {} (0: no cap)", Limits::MAX_IN_FLIGHT));
        }
        Ok(())
    }
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { rate: 20.0, burst: 100, max_in_flight: 200 }
    }
}

/// A key as a caller presents it. `Debug` shows the id only.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    id: String,
    secret: String,
}

/// The prefix of every key.
pub const KEY_PREFIX: &str = "sk_";
const ID_HEX: usize = 16;
const SECRET_HEX: usize = 64;

impl ApiKey {
    /// A new random key.
    pub fn generate() -> ApiKey {
        ApiKey { id: hex::encode(rand::random::<[u8; ID_HEX / 2]>()), secret: hex::encode(rand::random::<[u8; 32]>()) }
    }

    /// Parses `sk_<id>_<secret>`; `None` for anything else.
    pub fn parse(s: &str) -> Option<ApiKey> {
        let rest = s.strip_prefix(KEY_PREFIX)?;
        let (id, secret) = rest.split_once('_')?;
        let hex_of =
            |x: &str, n: usize| x.len() == n && x.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        (hex_of(id, ID_HEX) && hex_of(secret, SECRET_HEX)).then(|| ApiKey { id: id.into(), secret: secret.into() })
    }

    /// The key id (safe to log).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The whole key, to be shown once.
    pub fn expose(&self) -> String {
        format!("{KEY_PREFIX}{}_{}", self.id, self.secret)
    }

    fn secret_hash(&self) -> String {
        hex::encode(Sha256::digest(self.secret.as_bytes()))
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKey({KEY_PREFIX}{}_…)", self.id)
    }
}

/// A key's record in the `stemq_keys` bucket (key = the key id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The key id.
    pub id: String,
    /// Whose jobs this key submits and sees.
    pub owner: String,
    /// What it may do.
    pub role: Role,
    /// Lowercase hex SHA-256 of the secret part.
    pub secret_sha256: String,
    /// Its limits.
    pub limits: Limits,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it was revoked; a revoked key authenticates nobody.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime<Utc>>,
    /// A note for people (`stemq keys create --name`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// The lane of this key's jobs when a request names none (absent: interactive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<stemq_core::request::Priority>,
    /// When it stops authenticating (absent: never; a session key has one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

impl KeyRecord {
    /// True when `key` is this record's key (constant-time in the secret).
    pub fn matches(&self, key: &ApiKey) -> bool {
        key.id == self.id && bool::from(key.secret_hash().as_bytes().ct_eq(self.secret_sha256.as_bytes()))
    }

    /// True unless revoked.
    pub fn active(&self) -> bool {
        self.revoked_at.is_none()
    }

    /// True once its expiry (if it has one) is past at `now`.
    pub fn expired(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_some_and(|t| t <= now)
    }
}

/// An owner name must be usable as a NATS subject token, a KV key and a path segment:
/// 1–64 of `a-z 0-9 _ -`, starting with a letter or digit.
pub fn valid_owner(owner: &str) -> bool {
    !owner.is_empty()
        && owner.len() <= 64
        && owner.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && owner.as_bytes()[0].is_ascii_alphanumeric()
}

/// Key management and authentication failures.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Not of the form `sk_<id>_<secret>`.
    #[error("not a stemq API key (expected sk_<id>_<secret>)")]
    Malformed,
    /// No such key, or the secret does not match.
    #[error("unknown API key")]
    Unknown,
    /// The key was revoked.
    #[error("API key {0} was revoked")]
    Revoked(String),
    /// The key's lifetime is over (a session key).
    #[error("API key {0} expired; sign in again")]
    Expired(String),
    /// The owner name is unusable.
    #[error("owner `{0}` is not valid: use 1-64 of a-z, 0-9, `_`, `-`, starting with a letter or digit")]
    BadOwner(String),
    /// Limits that cannot be enforced.
    #[error("{0}")]
    BadLimits(String),
    /// The keys bucket could not be read or written (or did not answer in time).
    #[error("keys bucket")]
    Store(#[from] JetStreamError),
    /// A record of the keys bucket could not be written or read as JSON.
    #[error("keys bucket: the record of key {id}")]
    Record {
        /// The key id.
        id: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The record kept changing under concurrent writers until the attempts ran out.
    #[error("keys bucket: the record of key {0} kept changing under concurrent writers")]
    Contended(String),
}

impl KeyError {
    /// True when the keys could not be checked (the bucket, not the key): worth
    /// retrying, and never the caller's fault.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, KeyError::Store(_) | KeyError::Record { .. } | KeyError::Contended(_))
    }
}

fn record_err(id: &str) -> impl FnOnce(serde_json::Error) -> KeyError + '_ {
    move |source| KeyError::Record { id: id.to_string(), source }
}

/// Creates a key for `owner`; returns the key (to show once) and its record.
pub async fn create(
    bucket: &kv::Store,
    owner: &str,
    role: Role,
    limits: Limits,
    name: &str,
) -> Result<(ApiKey, KeyRecord), KeyError> {
    create_with(bucket, owner, role, limits, name, None).await
}

/// [`create`], with the lane of the key's jobs when a request names none.
pub async fn create_with(
    bucket: &kv::Store,
    owner: &str,
    role: Role,
    limits: Limits,
    name: &str,
    priority: Option<stemq_core::request::Priority>,
) -> Result<(ApiKey, KeyRecord), KeyError> {
    insert(bucket, owner, role, limits, name, priority, None).await
}

/// How long a session key lives ([`create_session`]).
pub const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 3600);

/// A session key: a key of `owner` with `role` that stops authenticating after
/// `lifetime` (a browser's, minted by a sign-in link). Listed and revoked as any key.
pub async fn create_session(
    bucket: &kv::Store,
    owner: &str,
    role: Role,
    limits: Limits,
    name: &str,
    lifetime: Duration,
) -> Result<(ApiKey, KeyRecord), KeyError> {
    let lifetime = chrono::Duration::from_std(lifetime).map_err(|e| KeyError::BadLimits(e.to_string()))?;
    insert(bucket, owner, role, limits, name, None, Some(Utc::now() + lifetime)).await
}

/// Stores the record of a new key.
async fn insert(
    bucket: &kv::Store,
    owner: &str,
    role: Role,
    limits: Limits,
    name: &str,
    priority: Option<stemq_core::request::Priority>,
    expires_at: Option<DateTime<Utc>>,
) -> Result<(ApiKey, KeyRecord), KeyError> {
    if !valid_owner(owner) {
        return Err(KeyError::BadOwner(owner.to_string()));
    }
    limits.check().map_err(KeyError::BadLimits)?;
    let key = ApiKey::generate();
    let record = KeyRecord {
        id: key.id.clone(),
        owner: owner.to_string(),
        role,
        secret_sha256: key.secret_hash(),
        limits,
        created_at: Utc::now(),
        revoked_at: None,
        name: name.to_string(),
        priority,
        expires_at,
    };
    let value = serde_json::to_vec(&record).map_err(record_err(&record.id))?;
    bucket.create(&record.id, value.into()).await.map_err(JetStreamError::write("create a key"))?;
    Ok((key, record))
}

/// Reads one record.
pub async fn get(bucket: &kv::Store, id: &str) -> Result<Option<KeyRecord>, KeyError> {
    match bucket.get(id).await.map_err(JetStreamError::read("read a key"))? {
        Some(v) => Ok(Some(serde_json::from_slice(&v).map_err(record_err(id))?)),
        None => Ok(None),
    }
}

/// Every record, oldest first.
pub async fn list(bucket: &kv::Store) -> Result<Vec<KeyRecord>, KeyError> {
    let mut keys = bucket.keys().await.map_err(JetStreamError::read("list the keys"))?;
    let mut out = Vec::new();
    while let Some(k) = keys.next().await {
        if let Some(r) = get(bucket, &k.map_err(JetStreamError::read("list the keys"))?).await? {
            out.push(r);
        }
    }
    out.sort_by_key(|r| r.created_at);
    Ok(out)
}

/// Revokes key `id` (the key or just its id); returns the record. Revoking twice keeps
/// the first time.
pub async fn revoke(bucket: &kv::Store, id: &str) -> Result<KeyRecord, KeyError> {
    let id = ApiKey::parse(id).map(|k| k.id).unwrap_or_else(|| id.trim_start_matches(KEY_PREFIX).to_string());
    for _ in 0..10 {
        let Some(entry) = bucket.entry(&id).await.map_err(JetStreamError::read("read a key"))? else {
            return Err(KeyError::Unknown);
        };
        let mut r: KeyRecord = serde_json::from_slice(&entry.value).map_err(record_err(&id))?;
        if r.revoked_at.is_some() {
            return Ok(r);
        }
        r.revoked_at = Some(Utc::now());
        let value = serde_json::to_vec(&r).map_err(record_err(&id))?;
        if bucket.update(&id, value.into(), entry.revision).await.is_ok() {
            return Ok(r);
        }
    }
    Err(KeyError::Contended(id))
}

/// The authenticated caller of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Caller {
    /// The key id.
    pub key_id: String,
    /// Whose jobs.
    pub owner: String,
    /// What it may do.
    pub role: Role,
    /// Its limits.
    pub limits: Limits,
    /// The lane of its jobs when a request names none.
    pub priority: stemq_core::request::Priority,
}

impl Caller {
    /// True when the caller may see or act on a job of `owner`.
    pub fn sees(&self, owner: &str) -> bool {
        self.role == Role::Operator || self.owner == owner
    }
}

/// Authenticates keys against the bucket, re-reading each record at most every
/// [`KeyRing::TTL`]. Shared by the HTTP and NATS submit paths.
///
/// A read is bounded by [`KeyRing::READ_TIMEOUT`] and tried twice. When both fail, a
/// record read in the last [`KeyRing::STALE_IF_ERROR`] is used (stale-if-error); only a
/// key not read that recently gets [`KeyError::Store`] (the ingress answers 503).
pub struct KeyRing {
    bucket: kv::Store,
    cache: Mutex<HashMap<String, (Instant, KeyRecord)>>,
}

impl KeyRing {
    /// How stale a cached record may be (a revocation takes at most this long).
    pub const TTL: Duration = Duration::from_secs(2);
    /// How stale a cached record may be while the bucket cannot be read.
    pub const STALE_IF_ERROR: Duration = Duration::from_secs(60);
    /// How long one read of a record may take; a read is tried twice.
    pub const READ_TIMEOUT: Duration = Duration::from_millis(1500);
    const MAX_CACHED: usize = 10_000;

    /// A ring over `bucket`.
    pub fn new(bucket: kv::Store) -> KeyRing {
        KeyRing { bucket, cache: Mutex::new(HashMap::new()) }
    }

    /// The caller a presented key stands for.
    pub async fn authenticate(&self, presented: &str) -> Result<Caller, KeyError> {
        let key = ApiKey::parse(presented.trim()).ok_or(KeyError::Malformed)?;
        let cached = self.cache.lock().expect("key cache").get(&key.id).cloned();
        let record = match cached {
            Some((at, r)) if at.elapsed() < Self::TTL => r,
            cached => match self.read(&key.id).await {
                Ok(r) => {
                    let r = r.ok_or(KeyError::Unknown)?;
                    let mut c = self.cache.lock().expect("key cache");
                    if c.len() >= Self::MAX_CACHED {
                        c.retain(|_, (at, _)| at.elapsed() < Self::STALE_IF_ERROR);
                    }
                    c.insert(key.id.clone(), (Instant::now(), r.clone()));
                    r
                }
                Err(e) => match cached {
                    Some((at, r)) if at.elapsed() < Self::STALE_IF_ERROR => {
                        tracing::warn!(key_id = %key.id, age_ms = at.elapsed().as_millis() as u64,
                            error = %stemq_nats::error::report(&e),
                            "keys bucket unreadable: using the key's cached record");
                        r
                    }
                    _ => return Err(e),
                },
            },
        };
        if !record.matches(&key) {
            return Err(KeyError::Unknown);
        }
        if !record.active() {
            return Err(KeyError::Revoked(record.id));
        }
        if record.expired(Utc::now()) {
            return Err(KeyError::Expired(record.id));
        }
        Ok(Caller {
            key_id: record.id,
            owner: record.owner,
            role: record.role,
            limits: record.limits,
            priority: record.priority.unwrap_or_default(),
        })
    }

    /// One record, read with [`KeyRing::READ_TIMEOUT`] and one retry.
    async fn read(&self, id: &str) -> Result<Option<KeyRecord>, KeyError> {
        let once = || async {
            match tokio::time::timeout(Self::READ_TIMEOUT, get(&self.bucket, id)).await {
                Ok(r) => r,
                Err(elapsed) => Err(KeyError::Store(JetStreamError::read("read a key")(elapsed))),
            }
        };
        match once().await {
            Err(KeyError::Store(_)) => once().await,
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_hide_their_secret() {
        let k = ApiKey::generate();
        let s = k.expose();
        assert!(s.starts_with("sk_"));
        assert_eq!(ApiKey::parse(&s), Some(k.clone()));
        assert!(!format!("{k:?}").contains(&k.secret));
        for bad in ["", "sk_", "sk_abc_def", &s[..s.len() - 1], &s.to_uppercase(), &format!("{s}0"), "Bearer x"] {
            assert_eq!(ApiKey::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_record_matches_only_its_own_secret() {
        let k = ApiKey::generate();
        let r = KeyRecord {
            id: k.id.clone(),
            owner: "acme".into(),
            role: Role::Submit,
            secret_sha256: k.secret_hash(),
            limits: Limits::default(),
            created_at: Utc::now(),
            revoked_at: None,
            name: String::new(),
            priority: None,
            expires_at: None,
        };
        assert!(r.matches(&k));
        assert!(!r.expired(Utc::now()));
        let session = KeyRecord { expires_at: Some(Utc::now() + chrono::Duration::seconds(60)), ..r.clone() };
        assert!(!session.expired(Utc::now()));
        assert!(session.expired(Utc::now() + chrono::Duration::seconds(61)));
        let mut other = ApiKey::generate();
        other.id = k.id.clone();
        assert!(!r.matches(&other));
        assert!(!serde_json::to_string(&r).unwrap().contains(&k.secret));
    }

    #[test]
    fn roles_allow_what_they_say() {
        use Permission::*;
        let table = [
            (Role::Read, [true, false, false, false]),
            (Role::Submit, [true, true, false, false]),
            (Role::Admin, [true, true, true, false]),
            (Role::Operator, [true, true, true, true]),
        ];
        for (role, want) in table {
            let got = [Read, Write, WebhookAdmin, Operate].map(|p| role.allows(p));
            assert_eq!(got, want, "{role}");
            assert_eq!(Role::parse(role.as_str()), Some(role));
        }
    }

    #[test]
    fn owners_are_safe_tokens() {
        for ok in ["local", "acme-music", "a_1", "0x"] {
            assert!(valid_owner(ok), "{ok}");
        }
        for bad in ["", "Acme", "a.b", "a*", "a>", "-a", "a/b", "a b", &"x".repeat(65)] {
            assert!(!valid_owner(bad), "{bad}");
        }
    }
}
