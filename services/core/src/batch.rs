//! Batches: up to [`MAX_BATCH_ITEMS`] separation requests submitted as one
//! (`POST /v1/batches`), followed as one (`GET /v1/batches/{id}`), and announced once
//! when they end (a `batch_ended` webhook).
//!
//! This module owns the batch contract, with no I/O (the log side is
//! `stemq_nats::batch_log`):
//!
//! - [`BatchRequest`]: what a client sends — the items in order (each a request as
//!   `POST /v1/separations` takes it), an optional `webhook` for the batch's end, and
//!   `metadata`;
//! - [`BatchId`], derived like a job id from content ([`batch_id`]): the SHA-256 of the
//!   JCS form of the owner and, per item in order, its job id, or the item as sent when it
//!   is not a valid request. The same items for the same owner are the same batch, so a
//!   resubmitted batch finds its record and carries on;
//! - [`ItemState`]: what became of each item — `submitted` (its job id), `refused` (an
//!   invalid item: its own error; the others go on) or `not_submitted` (the batch stopped
//!   on a limit of the caller's budget before this item: the reason; submitting the batch
//!   again submits it) — and [`merge`], the pure rule that folds a new round into the
//!   recorded state;
//! - [`BatchView`]: the batch as readers see it, built from its record and its jobs'
//!   statuses ([`BatchView::build`]), with counts and a status: `running`, `stopped`
//!   (items wait for a resubmission) or `ended` (every item refused or a finished job);
//! - [`BatchEvent`]: the CloudEvents the batch log holds (`io.stemq.batch.submitted.v1`,
//!   `io.stemq.batch.ended.v1`, `io.stemq.batch.delivery_attempted.v1`).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::de::{Deserializer, Error as _, Unexpected};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::event::DeliveryAttempted;
use crate::request::{JobId, JobRequest, RequestError, MAX_METADATA_BYTES};
use crate::view::JobStatus;

/// Most items in one batch.
pub const MAX_BATCH_ITEMS: usize = 1000;

/// Longest error message kept per item (longer ones are cut), so that a batch record of
/// a thousand refused items stays small.
pub const MAX_ITEM_MESSAGE: usize = 500;

/// A batch id: 64 lowercase hex characters (see [`batch_id`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, JsonSchema)]
#[serde(transparent)]
pub struct BatchId(#[schemars(regex(pattern = r"^[0-9a-f]{64}$"))] String);

impl BatchId {
    /// Accepts only the exact form (64 lowercase hex digits), so an id is always safe in
    /// a subject or a path.
    pub fn parse(s: &str) -> Option<BatchId> {
        (s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then(|| BatchId(s.to_string()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for BatchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for BatchId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        BatchId::parse(&s).ok_or_else(|| D::Error::invalid_value(Unexpected::Str(&s), &"64 lowercase hex digits"))
    }
}

/// Where the end of a batch is announced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchWebhook {
    /// The receiver's URL (https and public, as for job webhooks). It gets one
    /// `io.stemq.batch.ended.v1` delivery, signed with the owner's webhook secret.
    #[schemars(regex(pattern = r"\S"))]
    pub url: String,
}

/// A batch as a client sends it (`POST /v1/batches`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// The separation requests, in order, 1 to 1000 of them, each as
    /// `POST /v1/separations` takes it. An invalid item is refused alone; the others go
    /// on. Items may carry their own `webhook` (per job), `metadata` and `priority`.
    #[schemars(with = "Vec<JobRequest>", length(min = 1, max = 1000))]
    pub items: Vec<Value>,
    /// Told once when the batch ends (every item refused or a finished job). Not part of
    /// the batch id: the first submission's is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<BatchWebhook>,
    /// Client metadata, returned with the batch (an object of at most 16 KiB; not part of
    /// the batch id; the first submission's is kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<serde_json::Map<String, Value>>")]
    pub metadata: Option<Value>,
}

fn invalid(field: &str, message: impl Into<String>) -> RequestError {
    RequestError { field: field.to_string(), message: message.into() }
}

impl BatchRequest {
    /// Parses a batch body and checks its shape (the items themselves are checked one by
    /// one when submitted): 1 to [`MAX_BATCH_ITEMS`] items, `metadata` an object of at
    /// most 16 KiB, a `webhook` with a URL.
    pub fn from_slice(body: &[u8]) -> Result<BatchRequest, RequestError> {
        let value: Value = serde_json::from_slice(body).map_err(|e| invalid("body", format!("not valid JSON: {e}")))?;
        let Value::Object(map) = &value else { return Err(invalid("body", "expected a JSON object")) };
        match map.get("items") {
            None => return Err(invalid("items", "is required")),
            Some(Value::Array(items)) if items.is_empty() => {
                return Err(invalid("items", "holds no item; a batch has 1 to 1000"))
            }
            Some(Value::Array(items)) if items.len() > MAX_BATCH_ITEMS => {
                let n = items.len();
                return Err(invalid(
                    "items",
                    format!("holds {n} items; a batch has at most {MAX_BATCH_ITEMS}: split it into batches"),
                ));
            }
            Some(Value::Array(_)) => {}
            Some(_) => return Err(invalid("items", "must be an array of separation requests")),
        }
        let req: BatchRequest = serde_json::from_value(value).map_err(|e| invalid("body", e.to_string()))?;
        if let Some(m) = &req.metadata {
            if !m.is_object() {
                return Err(invalid("metadata", "must be a JSON object"));
            }
            if serde_json::to_vec(m).map(|b| b.len()).unwrap_or(usize::MAX) > MAX_METADATA_BYTES {
                return Err(invalid("metadata", format!("is larger than {MAX_METADATA_BYTES} bytes")));
            }
        }
        if let Some(w) = &req.webhook {
            if w.url.trim().is_empty() {
                return Err(invalid("webhook.url", "is empty"));
            }
        }
        Ok(req)
    }
}

/// The job id an item stands for, when it is a valid request for `owner` (its
/// normalised form hashes to it); `None` for an item that is not.
pub fn item_job_id(owner: &str, item: &Value) -> Option<JobId> {
    let req = JobRequest::from_value(item.clone()).ok()?;
    req.normalize(owner).ok().map(|n| n.job_id())
}

/// The batch id of `items` for `owner`, and the job id of each item (`None` for an
/// invalid one): lowercase hex SHA-256 of the JCS form of
/// `{"owner": <owner>, "items": [<job id> | {"invalid": <item as sent>}, ...]}`.
/// Job ids leave out what the output does not depend on (per-item `webhook`,
/// `metadata`, `priority`, deadlines), and so does the batch id, like the batch's own
/// `webhook` and `metadata`: a batch is its jobs, in order, for its owner. Items are
/// hashed as given: a caller that rewrites `audio_uri` before a job id is computed (the
/// ingress resolves `upload:` names) does the same here first.
pub fn batch_id(owner: &str, items: &[Value]) -> (BatchId, Vec<Option<JobId>>) {
    let jobs: Vec<Option<JobId>> = items.iter().map(|i| item_job_id(owner, i)).collect();
    let keys: Vec<Value> = jobs
        .iter()
        .zip(items)
        .map(|(j, item)| match j {
            Some(id) => Value::String(id.to_string()),
            None => json!({ "invalid": item }),
        })
        .collect();
    let canonical =
        crate::request::canonical::to_vec(&json!({"owner": owner, "items": keys})).expect("JSON values serialise");
    (BatchId(hex::encode(Sha256::digest(canonical))), jobs)
}

/// Why an item was refused or not submitted: the error the same request would have got
/// alone from `POST /v1/separations`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ItemError {
    /// The API's error code: `invalid_request`, `model_not_served` (refused);
    /// `rate_limited`, `too_many_in_flight`, `insufficient_credits`, `unavailable` (not
    /// submitted).
    pub code: String,
    /// For people.
    pub message: String,
    /// The offending field of the item (refused items).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Seconds until submitting the batch again can get further (not submitted items,
    /// when the limit says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

impl ItemError {
    /// An error with `code` and `message` (cut to [`MAX_ITEM_MESSAGE`] bytes).
    pub fn new(code: &str, message: impl Into<String>) -> ItemError {
        let mut message = message.into();
        if message.len() > MAX_ITEM_MESSAGE {
            let mut end = MAX_ITEM_MESSAGE;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push('…');
        }
        ItemError { code: code.to_string(), message, field: None, retry_after: None }
    }
}

/// What became of one item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ItemState {
    /// Its job is queued (new, or the same job submitted before: job ids are content).
    Submitted {
        /// The job.
        job_id: JobId,
    },
    /// The item is not a valid request (or names a model nobody serves here): refused
    /// alone, for good in this batch.
    Refused {
        /// Why.
        error: ItemError,
    },
    /// The batch stopped before this item, on a limit of the caller's budget (rate,
    /// jobs in flight, credits) or because the queue was unavailable. Submitting the
    /// same batch again submits it.
    NotSubmitted {
        /// Why.
        reason: ItemError,
    },
}

impl ItemState {
    /// Precedence when two rounds disagree: a job beats a refusal beats waiting.
    fn rank(&self) -> u8 {
        match self {
            ItemState::Submitted { .. } => 2,
            ItemState::Refused { .. } => 1,
            ItemState::NotSubmitted { .. } => 0,
        }
    }

    /// The job, for a submitted item.
    pub fn job_id(&self) -> Option<&JobId> {
        match self {
            ItemState::Submitted { job_id } => Some(job_id),
            _ => None,
        }
    }

    /// True once nothing more will be done with the item in this batch (submitted or
    /// refused); false for an item that waits for a resubmission.
    pub fn is_settled(&self) -> bool {
        !matches!(self, ItemState::NotSubmitted { .. })
    }
}

/// Data of `io.stemq.batch.submitted.v1`: the batch's state after a submission round.
/// Each round records the whole state, merged with the one before ([`merge`]), so the
/// latest record is the batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BatchSubmitted {
    /// Who submitted it (the API key's owner).
    pub owner: String,
    /// Each item's state, in the order of the request.
    pub items: Vec<ItemState>,
    /// The batch's webhook (the first round's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<BatchWebhook>,
    /// Client metadata (the first round's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// When the first round was recorded.
    pub created_at: DateTime<Utc>,
    /// Submission rounds recorded so far (1 for the first).
    pub rounds: u32,
}

impl BatchSubmitted {
    /// The jobs of the batch, each once, in item order.
    pub fn jobs(&self) -> Vec<JobId> {
        let mut seen = std::collections::HashSet::new();
        self.items.iter().filter_map(ItemState::job_id).filter(|j| seen.insert((*j).clone())).cloned().collect()
    }

    /// True when an item waits for a resubmission.
    pub fn has_unsubmitted(&self) -> bool {
        self.items.iter().any(|i| !i.is_settled())
    }
}

/// Folds a new submission `round` into the `stored` state: per item, a job beats a
/// refusal, which beats waiting; between two refusals the stored one stays, between two
/// waits the newer reason wins. The batch's owner, webhook, metadata and creation time
/// stay the first round's. Applying the same round twice gives the same state (so a
/// round retried after a lost acknowledgement, or two concurrent rounds in either order,
/// end the same).
pub fn merge(stored: Option<&BatchSubmitted>, round: BatchSubmitted) -> BatchSubmitted {
    let Some(stored) = stored else {
        return BatchSubmitted { rounds: round.rounds.max(1), ..round };
    };
    let n = stored.items.len().max(round.items.len());
    let items = (0..n)
        .map(|i| match (stored.items.get(i), round.items.get(i)) {
            (Some(s), Some(r)) if r.rank() > s.rank() => r.clone(),
            (Some(s @ ItemState::NotSubmitted { .. }), Some(r @ ItemState::NotSubmitted { .. })) if s != r => r.clone(),
            (Some(s), _) => s.clone(),
            (None, Some(r)) => r.clone(),
            (None, None) => unreachable!("i < the longer length"),
        })
        .collect();
    BatchSubmitted {
        owner: stored.owner.clone(),
        items,
        webhook: stored.webhook.clone(),
        metadata: stored.metadata.clone(),
        created_at: stored.created_at,
        rounds: stored.rounds + 1,
    }
}

/// Where a batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BatchStatus {
    /// Some of its jobs are queued or running.
    Running,
    /// None of its jobs is queued or running, but items were not submitted (a limit
    /// stopped the batch): submit the same batch again to go on.
    Stopped,
    /// Every item was refused or its job has finished. Final.
    Ended,
}

/// How many items are where.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BatchCounts {
    /// Items in the batch.
    pub items: usize,
    /// Items whose job is queued (or finished): `submitted` = the sum of the job
    /// statuses below.
    pub submitted: usize,
    /// Items refused as invalid.
    pub refused: usize,
    /// Items waiting for a resubmission.
    pub not_submitted: usize,
    /// Submitted items by their job's status.
    pub queued: usize,
    /// Running.
    pub running: usize,
    /// Succeeded.
    pub succeeded: usize,
    /// Failed.
    pub failed: usize,
    /// Dead-lettered.
    pub dead_lettered: usize,
    /// Rejected.
    pub rejected: usize,
    /// Cancelled.
    pub cancelled: usize,
    /// Expired.
    pub expired: usize,
}

impl BatchCounts {
    fn add(&mut self, status: JobStatus) {
        let slot = match status {
            JobStatus::Queued => &mut self.queued,
            JobStatus::Running => &mut self.running,
            JobStatus::Succeeded => &mut self.succeeded,
            JobStatus::Failed => &mut self.failed,
            JobStatus::DeadLettered => &mut self.dead_lettered,
            JobStatus::Rejected => &mut self.rejected,
            JobStatus::Cancelled => &mut self.cancelled,
            JobStatus::Expired => &mut self.expired,
        };
        *slot += 1;
    }
}

/// One item as readers see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ItemView {
    /// Its position in the request, from 0.
    pub index: usize,
    /// What became of it.
    #[serde(flatten)]
    pub state: ItemState,
    /// Its job's status (submitted items).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<JobStatus>,
}

/// A batch as readers see it (`GET /v1/batches/{id}`, and the `data` of its
/// `io.stemq.batch.ended.v1` webhook).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BatchView {
    /// The batch id.
    pub batch_id: BatchId,
    /// Whose it is.
    pub owner: String,
    /// `running`, `stopped` or `ended`.
    pub status: BatchStatus,
    /// How many items are where.
    pub counts: BatchCounts,
    /// Why items were not submitted (the first such item's reason), while any waits for
    /// a resubmission.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<ItemError>,
    /// The batch's webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<BatchWebhook>,
    /// Client metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// When the batch was first submitted.
    pub created_at: DateTime<Utc>,
    /// When its latest submission round was recorded.
    pub updated_at: DateTime<Utc>,
    /// Submission rounds so far.
    pub rounds: u32,
    /// When its end was recorded (the `io.stemq.batch.ended.v1` event), once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<DateTime<Utc>>,
    /// Every item, in order.
    pub items: Vec<ItemView>,
}

impl BatchView {
    /// The view of batch `id` recorded as `record` at `recorded_at`, with each job's
    /// status from `status_of` (`None`, a job whose view is not readable yet: queued).
    pub fn build(
        id: &BatchId,
        record: &BatchSubmitted,
        recorded_at: DateTime<Utc>,
        status_of: impl Fn(&JobId) -> Option<JobStatus>,
    ) -> BatchView {
        let mut counts = BatchCounts { items: record.items.len(), ..Default::default() };
        let mut stopped = None;
        let items = record
            .items
            .iter()
            .enumerate()
            .map(|(index, state)| {
                let status = match state {
                    ItemState::Submitted { job_id } => {
                        let s = status_of(job_id).unwrap_or(JobStatus::Queued);
                        counts.submitted += 1;
                        counts.add(s);
                        Some(s)
                    }
                    ItemState::Refused { .. } => {
                        counts.refused += 1;
                        None
                    }
                    ItemState::NotSubmitted { reason } => {
                        counts.not_submitted += 1;
                        stopped.get_or_insert_with(|| reason.clone());
                        None
                    }
                };
                ItemView { index, state: state.clone(), status }
            })
            .collect();
        let open = counts.queued + counts.running;
        let status = match (open, counts.not_submitted) {
            (0, 0) => BatchStatus::Ended,
            (0, _) => BatchStatus::Stopped,
            _ => BatchStatus::Running,
        };
        BatchView {
            batch_id: id.clone(),
            owner: record.owner.clone(),
            status,
            counts,
            stopped,
            webhook: record.webhook.clone(),
            metadata: record.metadata.clone(),
            created_at: record.created_at,
            updated_at: recorded_at,
            rounds: record.rounds,
            ended_at: None,
            items,
        }
    }
}

/// A batch event in its CloudEvents envelope (structured JSON), as the batch log
/// stores it. The CloudEvents `subject` is the batch id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BatchEvent {
    /// Always `1.0`.
    pub specversion: String,
    /// Unique per source.
    pub id: String,
    /// Who recorded it: `/stemq/ingress`, `/stemq/relay`.
    pub source: String,
    /// The batch id.
    pub subject: BatchId,
    /// When it was recorded.
    pub time: DateTime<Utc>,
    /// Always `application/json`.
    pub datacontenttype: String,
    /// `type` and `data`.
    #[serde(flatten)]
    pub body: BatchEventBody,
}

/// The batch event types and their data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", content = "data")]
pub enum BatchEventBody {
    /// A submission round: the batch's whole state after it.
    #[serde(rename = "io.stemq.batch.submitted.v1")]
    Submitted(BatchSubmitted),
    /// The batch ended: its final view. One per batch, ever.
    #[serde(rename = "io.stemq.batch.ended.v1")]
    Ended(Box<BatchView>),
    /// The relay tried to deliver the batch's webhook.
    #[serde(rename = "io.stemq.batch.delivery_attempted.v1")]
    DeliveryAttempted(DeliveryAttempted),
}

impl BatchEvent {
    /// Wraps `body` for batch `id`, recorded now by `source`, with a fresh id.
    pub fn new(id: &BatchId, source: &str, body: BatchEventBody) -> BatchEvent {
        BatchEvent {
            specversion: crate::event::SPEC_VERSION.to_string(),
            id: uuid::Uuid::new_v4().to_string(),
            source: source.to_string(),
            subject: id.clone(),
            time: Utc::now(),
            datacontenttype: "application/json".to_string(),
            body,
        }
    }

    /// The CloudEvents `type` (`io.stemq.batch.<kind>.v1`).
    pub fn event_type(&self) -> &'static str {
        match self.body {
            BatchEventBody::Submitted(_) => "io.stemq.batch.submitted.v1",
            BatchEventBody::Ended(_) => "io.stemq.batch.ended.v1",
            BatchEventBody::DeliveryAttempted(_) => "io.stemq.batch.delivery_attempted.v1",
        }
    }

    /// Serialises to the structured-mode JSON body.
    pub fn to_bytes(&self) -> bytes::Bytes {
        serde_json::to_vec(self).expect("events always serialise").into()
    }

    /// Parses a structured-mode JSON body.
    pub fn from_slice(b: &[u8]) -> Result<BatchEvent, serde_json::Error> {
        serde_json::from_slice(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(name: &str) -> Value {
        json!({"audio_uri": format!("file:///s/uploads/acme/{name}.wav"), "model": "dsp"})
    }

    fn job(owner: &str, v: &Value) -> JobId {
        item_job_id(owner, v).expect("a valid item")
    }

    #[test]
    fn the_batch_id_is_its_owner_and_its_jobs_in_order() {
        let (a, b) = (item("a"), item("b"));
        let (id, jobs) = batch_id("acme", &[a.clone(), b.clone()]);
        assert_eq!(jobs, vec![Some(job("acme", &a)), Some(job("acme", &b))]);
        // Key order, explicit defaults, per-item webhook, metadata and lane: same jobs,
        // same batch.
        let mut a2 = json!({"model": "dsp", "output_format": "wav", "priority": "batch", "metadata": {"k": 1}});
        a2["audio_uri"] = a["audio_uri"].clone();
        assert_eq!(batch_id("acme", &[a2, b.clone()]).0, id);
        // Order, owner and content matter.
        assert_ne!(batch_id("acme", &[b.clone(), a.clone()]).0, id);
        assert_ne!(batch_id("globex", &[a.clone(), b.clone()]).0, id);
        assert_ne!(batch_id("acme", std::slice::from_ref(&a)).0, id);
        // An invalid item counts as sent, and never as a job id that happens to be its
        // text.
        let bad = json!({"audio_uri": "file:///x.wav", "shifts": -1});
        let (with_bad, jobs) = batch_id("acme", &[a.clone(), bad.clone()]);
        assert_eq!(jobs[1], None);
        assert_eq!(batch_id("acme", &[a.clone(), bad]).0, with_bad);
        let text = Value::String(job("acme", &b).to_string());
        assert_ne!(batch_id("acme", &[a.clone(), text]).0, id);
        assert!(BatchId::parse(id.as_str()).is_some());
    }

    /// The example of `docs/job-id.md`.
    #[test]
    fn the_documented_batch_id() {
        let items = [
            json!({"audio_uri": "file:///a.wav", "segment": 5.0}),
            json!({"audio_uri": "file:///b.wav", "shifts": -1}),
        ];
        let (id, jobs) = batch_id(crate::request::ANONYMOUS, &items);
        assert_eq!(
            jobs[0].as_ref().map(JobId::as_str),
            Some("542ebe90ff7f7b97334d77cb5a4d19f44862779d40f2a7724461aa270fbef4d0")
        );
        assert_eq!(jobs[1], None);
        assert_eq!(id.as_str(), "db490f649a5b3ae2f3dd52e8b1e44bed508069ed1867ebf4179fb3265b0ea22a");
    }

    #[test]
    fn batch_bodies_are_checked_before_any_item() {
        let body = |v: Value| BatchRequest::from_slice(&serde_json::to_vec(&v).unwrap());
        assert!(body(json!({"items": [item("a")]})).is_ok());
        for (bad, field) in [
            (json!({}), "items"),
            (json!({"items": []}), "items"),
            (json!({"items": {}}), "items"),
            (json!({"items": vec![item("a"); MAX_BATCH_ITEMS + 1]}), "items"),
            (json!({"items": [item("a")], "extra": 1}), "body"),
            (json!({"items": [item("a")], "metadata": [1]}), "metadata"),
            (json!({"items": [item("a")], "webhook": {"url": " "}}), "webhook.url"),
            (json!([item("a")]), "body"),
        ] {
            assert_eq!(body(bad.clone()).unwrap_err().field, field, "{bad}");
        }
        assert!(body(json!({"items": vec![item("a"); MAX_BATCH_ITEMS]})).is_ok());
        assert!(BatchRequest::from_slice(b"{").is_err());
    }

    fn submitted(j: &str) -> ItemState {
        ItemState::Submitted { job_id: JobId::parse(&j.repeat(64)).unwrap() }
    }

    fn waiting(code: &str) -> ItemState {
        ItemState::NotSubmitted { reason: ItemError::new(code, "later") }
    }

    fn refused() -> ItemState {
        ItemState::Refused { error: ItemError::new("invalid_request", "no") }
    }

    fn round(items: Vec<ItemState>) -> BatchSubmitted {
        BatchSubmitted { owner: "acme".into(), items, webhook: None, metadata: None, created_at: Utc::now(), rounds: 1 }
    }

    #[test]
    fn rounds_merge_towards_jobs_and_keep_the_first_rounds_settings() {
        let first = round(vec![submitted("a"), refused(), waiting("rate_limited"), waiting("rate_limited")]);
        assert_eq!(merge(None, first.clone()), first);
        let mut second = round(vec![waiting("rate_limited"), refused(), submitted("c"), waiting("too_many_in_flight")]);
        second.webhook = Some(BatchWebhook { url: "https://example.com/h".into() });
        let merged = merge(Some(&first), second.clone());
        assert_eq!(merged.items, vec![submitted("a"), refused(), submitted("c"), waiting("too_many_in_flight")]);
        assert_eq!((merged.rounds, merged.webhook.clone(), merged.created_at), (2, None, first.created_at));
        assert!(merged.has_unsubmitted());
        // The same round again changes no item; rounds in either order end the same.
        assert_eq!(merge(Some(&merged), second.clone()).items, merged.items);
        let other = merge(Some(&merge(Some(&first), round(vec![refused(); 4]))), second);
        assert_eq!(other.items[0], submitted("a"));
        assert_eq!(other.items[2], submitted("c"));
    }

    #[test]
    fn the_view_counts_items_and_says_where_the_batch_is() {
        let id = BatchId::parse(&"e".repeat(64)).unwrap();
        let rec = round(vec![submitted("a"), submitted("b"), refused(), waiting("rate_limited")]);
        let status =
            |a: JobStatus, b: JobStatus| move |j: &JobId| Some(if j.as_str().starts_with('a') { a } else { b });
        let v = BatchView::build(&id, &rec, Utc::now(), status(JobStatus::Succeeded, JobStatus::Running));
        assert_eq!(v.status, BatchStatus::Running);
        assert_eq!((v.counts.items, v.counts.submitted, v.counts.refused, v.counts.not_submitted), (4, 2, 1, 1));
        assert_eq!((v.counts.succeeded, v.counts.running), (1, 1));
        assert_eq!(v.stopped.as_ref().map(|s| s.code.as_str()), Some("rate_limited"));
        assert_eq!(v.items[1].status, Some(JobStatus::Running));
        let v = BatchView::build(&id, &rec, Utc::now(), status(JobStatus::Succeeded, JobStatus::Failed));
        assert_eq!(v.status, BatchStatus::Stopped);
        let done = round(vec![submitted("a"), submitted("b"), refused()]);
        let v = BatchView::build(&id, &done, Utc::now(), status(JobStatus::Succeeded, JobStatus::Cancelled));
        assert_eq!((v.status, v.counts.cancelled, v.stopped.clone()), (BatchStatus::Ended, 1, None));
        // A job whose view is not there yet counts as queued.
        let v = BatchView::build(&id, &done, Utc::now(), |_| None);
        assert_eq!((v.status, v.counts.queued), (BatchStatus::Running, 2));
        // Items serialise with their state inline.
        let j = serde_json::to_value(&v.items[0]).unwrap();
        assert_eq!((j["index"].as_u64(), j["state"].as_str()), (Some(0), Some("submitted")));
        assert!(j["job_id"].is_string());
    }

    #[test]
    fn batch_events_round_trip_with_their_type() {
        let id = BatchId::parse(&"f".repeat(64)).unwrap();
        let ev = BatchEvent::new(&id, "/stemq/ingress", BatchEventBody::Submitted(round(vec![refused()])));
        let v = serde_json::to_value(&ev).unwrap();
        assert_eq!(v["type"], ev.event_type());
        assert_eq!(v["subject"], id.as_str());
        assert_eq!(v["data"]["items"][0]["state"], "refused");
        assert_eq!(BatchEvent::from_slice(&ev.to_bytes()).unwrap(), ev);
    }

    #[test]
    fn long_messages_are_cut_on_a_character() {
        let e = ItemError::new("invalid_request", "é".repeat(MAX_ITEM_MESSAGE));
        assert!(e.message.len() <= MAX_ITEM_MESSAGE + '…'.len_utf8());
        assert!(e.message.ends_with('…'));
    }
}
