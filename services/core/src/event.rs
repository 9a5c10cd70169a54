//! Job events: the facts the pipeline records, as CloudEvents 1.0 in structured JSON.
//!
//! This module owns the event contract. Every event is past tense and versioned in its
//! `type` (`io.stemq.job.<kind>.v1`); a new incompatible shape gets a new `.v2` type and
//! readers keep accepting the old one: [`Event::from_slice`] brings older types to the
//! current shape through the upcasters in [`crate::upcast`]. The CloudEvents `subject` is the job id. The
//! JSON Schemas under `schemas/` are generated from these types (see [`crate::schema`]).

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::device::Device;
pub use crate::failure::FailureCode;
use crate::request::{JobId, NormalizedRequest, Webhook};

/// CloudEvents spec version we write.
pub const SPEC_VERSION: &str = "1.0";

/// A job event in its CloudEvents envelope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    /// Always `1.0`.
    pub specversion: String,
    /// Unique per source. For `requested` it is the job id (also the `Nats-Msg-Id`).
    pub id: String,
    /// Who recorded the fact: `/stemq/ingress`, `/stemq/worker/<name>`, ...
    pub source: String,
    /// The job id.
    pub subject: JobId,
    /// When the fact was recorded (RFC 3339).
    pub time: DateTime<Utc>,
    /// Always `application/json`.
    pub datacontenttype: String,
    /// W3C trace context of the request that caused this event (CloudEvents
    /// distributed-tracing extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// `type` and `data`.
    #[serde(flatten)]
    pub body: EventBody,
}

/// The event types and their data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", content = "data")]
pub enum EventBody {
    /// A job was asked for.
    #[serde(rename = "io.stemq.job.requested.v1")]
    Requested(Requested),
    /// A worker took the job (one per delivery).
    #[serde(rename = "io.stemq.job.started.v1")]
    Started(Started),
    /// A running job moved on (kept out of the main log: see `nats/`).
    #[serde(rename = "io.stemq.job.progress.v1")]
    Progress(Progress),
    /// The stems are stored.
    #[serde(rename = "io.stemq.job.succeeded.v1")]
    Succeeded(Succeeded),
    /// An attempt failed. `transient` failures are retried; `permanent` ones end the job.
    #[serde(rename = "io.stemq.job.failed.v1")]
    Failed(Failed),
    /// The job kept failing (or kept killing its worker) and was set aside.
    #[serde(rename = "io.stemq.job.dead_lettered.v1")]
    DeadLettered(DeadLettered),
    /// The request event was not acceptable (forged id, invalid request); never run.
    #[serde(rename = "io.stemq.job.rejected.v1")]
    Rejected(Rejected),
    /// A finished job was re-run as a new job (dead-letter replay, retry).
    #[serde(rename = "io.stemq.job.retried.v1")]
    Retried(Retried),
    /// Someone asked to stop the job (`POST .../cancel`, `stemq cancel`). Not terminal:
    /// the worker running it (or the next one to pull it) records `cancelled`.
    #[serde(rename = "io.stemq.job.cancel_requested.v1")]
    CancelRequested(CancelRequested),
    /// The job was stopped on request; no outputs are kept.
    #[serde(rename = "io.stemq.job.cancelled.v1")]
    Cancelled(Cancelled),
    /// The job had not started by its `start_before` deadline; it never ran.
    #[serde(rename = "io.stemq.job.expired.v1")]
    Expired(Expired),
    /// The relay tried to deliver a webhook (one event per HTTP attempt).
    #[serde(rename = "io.stemq.job.delivery_attempted.v1")]
    DeliveryAttempted(DeliveryAttempted),
    /// Someone asked the relay to send one delivery again.
    #[serde(rename = "io.stemq.job.delivery_replay_requested.v1")]
    DeliveryReplayRequested(DeliveryReplayRequested),
}

/// Data of `io.stemq.job.cancel_requested.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CancelRequested {
    /// Who asked (`http`, `cli`, ...), for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// Data of `io.stemq.job.cancelled.v1` (a terminal event).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Cancelled {
    /// The attempt that was stopped; 0 when the job never started.
    pub attempt: u32,
    /// True when a running attempt was interrupted (its partial outputs were deleted).
    #[serde(default)]
    pub interrupted: bool,
}

/// Data of `io.stemq.job.expired.v1` (a terminal event).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Expired {
    /// The deadline that passed.
    pub start_before: DateTime<Utc>,
}

/// What became of one webhook delivery attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryResult {
    /// 2xx: delivered.
    Delivered,
    /// Timeout, connection error, 5xx or 429: another attempt follows.
    Retrying,
    /// Not retried (3xx, other 4xx, refused URL) or the schedule ran out.
    Failed,
    /// 410 Gone: the endpoint is disabled for the owner; nothing more is sent to it.
    Disabled,
}

/// Data of `io.stemq.job.delivery_attempted.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeliveryAttempted {
    /// The `webhook-id` header: the same for every attempt (and replay) of one delivery.
    pub webhook_id: String,
    /// The event type the delivery reports (`io.stemq.job.succeeded.v1`, ...).
    pub event_type: String,
    /// The receiver.
    pub url: String,
    /// Attempt number within this delivery, from 1 (a replay starts again at 1).
    pub attempt: u32,
    /// HTTP status, when an answer came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
    /// Time to the answer (or the error), in milliseconds.
    pub latency_ms: u64,
    /// What it means.
    pub result: DeliveryResult,
    /// Transport error or refusal reason, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the next attempt is due, in milliseconds (`retrying` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_in_ms: Option<u64>,
    /// True when this attempt belongs to a replay.
    #[serde(default)]
    pub replay: bool,
}

/// Data of `io.stemq.job.delivery_replay_requested.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeliveryReplayRequested {
    /// The delivery to send again.
    pub webhook_id: String,
    /// Its event type.
    pub event_type: String,
}

/// Data of `io.stemq.job.retried.v1` (recorded on the old job).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Retried {
    /// The new job.
    pub retried_by: JobId,
}

/// Data of `io.stemq.job.requested.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Requested {
    /// The normalised request; its job id must equal the event's subject.
    pub request: NormalizedRequest,
    /// Notification target (not part of the job id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<Webhook>,
    /// Client metadata (not part of the job id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// Deadline to start (not part of the job id: it does not change the output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_before: Option<DateTime<Utc>>,
    /// Per-job time limit in seconds (not part of the job id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_runtime: Option<u64>,
    /// The lane it waits in; absent means interactive (and in requests recorded before
    /// lanes). Not part of the job id. The request subject carries it too, for routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<crate::request::Priority>,
}

impl Requested {
    /// The lane (absent: interactive).
    pub fn lane(&self) -> crate::request::Priority {
        self.priority.unwrap_or_default()
    }
}

/// Data of `io.stemq.job.started.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Started {
    /// Delivery attempt, from 1.
    pub attempt: u32,
    /// The worker's name.
    pub worker: String,
    /// `cpu`, `cuda:0`, `fake-gpu`, ...
    pub device: Device,
}

/// Data of `io.stemq.job.progress.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Progress {
    /// The attempt this progress belongs to.
    pub attempt: u32,
    /// 0–100.
    pub percent: f32,
    /// `download`, `decode`, `separate`, `encode`, `upload`.
    pub stage: String,
    /// Optional detail for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One stored stem.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Output {
    /// Stem name (`vocals`, `no_vocals`, ...).
    pub stem: String,
    /// Where it is stored.
    pub uri: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Lowercase hex SHA-256 of the file.
    pub sha256: String,
}

/// Data of `io.stemq.job.succeeded.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Succeeded {
    /// The attempt that succeeded.
    pub attempt: u32,
    /// The stems.
    pub outputs: Vec<Output>,
    /// The manifest (`jobs/<id>/manifest.json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_uri: Option<String>,
    /// True when the out-of-memory ladder had to step down (smaller segment or CPU).
    #[serde(default)]
    pub degraded: bool,
    /// Device the result was computed on.
    pub device: Device,
    /// Segment length finally used, when the engine has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment: Option<f64>,
    /// Wall time of the attempt in milliseconds.
    pub duration_ms: u64,
    /// Length of the audio separated, in milliseconds, when the engine said (what
    /// credits are charged for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio_ms: Option<u64>,
}

/// Whether a failure is worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// The same input will fail again (bad audio, unsupported model, time limit).
    Permanent,
    /// It may work next time (storage hiccup, out of memory, lost connection).
    Transient,
}

/// Data of `io.stemq.job.failed.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Failed {
    /// The attempt that failed.
    pub attempt: u32,
    /// Retry or not.
    pub class: FailureClass,
    /// Stable machine-readable code (`invalid_audio`, `engine_error`, `time_limit`, ...).
    pub code: FailureCode,
    /// For people.
    pub message: String,
    /// For transient failures: when the next attempt is due, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_in_ms: Option<u64>,
}

/// Data of `io.stemq.job.dead_lettered.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeadLettered {
    /// How many times the job was delivered.
    pub deliveries: u32,
    /// Why it was set aside (`max_deliveries`, `crash_loop`).
    pub reason: FailureCode,
    /// The last error a worker reported, if any did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Stream sequence of the request event, for replay.
    pub request_seq: u64,
}

/// Data of `io.stemq.job.rejected.v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Rejected {
    /// `id_mismatch`, `owner_mismatch`, `invalid_request`, `invalid_event`.
    pub code: FailureCode,
    /// For people.
    pub message: String,
}

/// The job events a webhook may be sent for, by kind, with the name a request's
/// `webhook.events` picks them by (`started`, `progress`, `completed`): the payload is
/// `{"type": "io.stemq.job.<kind>.v1", "timestamp", "data": <the job's view>}`. A
/// `failed` event is sent only when it ends the job (a permanent failure).
pub const WEBHOOK_KINDS: [(&str, &str); 8] = [
    ("started", "started"),
    ("progress", "progress"),
    ("succeeded", "completed"),
    ("failed", "completed"),
    ("dead_lettered", "completed"),
    ("rejected", "completed"),
    ("cancelled", "completed"),
    ("expired", "completed"),
];

/// The body of a webhook the relay sends (`schemas/webhook-job.json` with the job's view
/// as `data`, `schemas/webhook-batch.json` with the batch's), signed with Standard
/// Webhooks (docs/events.md, "Webhooks").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(rename = "WebhookBodyOf{T}")]
pub struct WebhookBody<T> {
    /// The event type (`io.stemq.job.succeeded.v1`, `io.stemq.batch.ended.v1`, ...).
    #[serde(rename = "type")]
    pub event_type: String,
    /// When the attempt was made (RFC 3339).
    pub timestamp: String,
    /// The job's (or the batch's) view as of the event.
    pub data: T,
}

impl EventBody {
    /// The short kind name: `requested`, `started`, ...
    pub fn kind(&self) -> &'static str {
        match self {
            EventBody::Requested(_) => "requested",
            EventBody::Started(_) => "started",
            EventBody::Progress(_) => "progress",
            EventBody::Succeeded(_) => "succeeded",
            EventBody::Failed(_) => "failed",
            EventBody::DeadLettered(_) => "dead_lettered",
            EventBody::Rejected(_) => "rejected",
            EventBody::Retried(_) => "retried",
            EventBody::CancelRequested(_) => "cancel_requested",
            EventBody::Cancelled(_) => "cancelled",
            EventBody::Expired(_) => "expired",
            EventBody::DeliveryAttempted(_) => "delivery_attempted",
            EventBody::DeliveryReplayRequested(_) => "delivery_replay_requested",
        }
    }

    /// Which of a webhook's `events` this event is sent under ([`WEBHOOK_KINDS`]); `None`
    /// for events no webhook is sent for (a retryable failure among them).
    pub fn webhook_class(&self) -> Option<&'static str> {
        if matches!(self, EventBody::Failed(_)) && !self.is_terminal() {
            return None;
        }
        WEBHOOK_KINDS.iter().find(|(k, _)| *k == self.kind()).map(|(_, class)| *class)
    }

    /// True for events that end a job. They go to the job's terminal subject, where the
    /// first one wins.
    pub fn is_terminal(&self) -> bool {
        match self {
            EventBody::Succeeded(_)
            | EventBody::DeadLettered(_)
            | EventBody::Rejected(_)
            | EventBody::Cancelled(_)
            | EventBody::Expired(_) => true,
            EventBody::Failed(f) => f.class == FailureClass::Permanent,
            _ => false,
        }
    }
}

impl Event {
    /// Wraps `body` for `job`, recorded now by `source`, with a fresh id.
    pub fn new(job: &JobId, source: &str, body: EventBody) -> Event {
        let id = match &body {
            EventBody::Requested(_) => job.to_string(),
            _ => uuid::Uuid::new_v4().to_string(),
        };
        Event {
            specversion: SPEC_VERSION.to_string(),
            id,
            source: source.to_string(),
            subject: job.clone(),
            time: Utc::now(),
            datacontenttype: "application/json".to_string(),
            traceparent: None,
            body,
        }
    }

    /// The `requested` event for a normalised request.
    pub fn requested(
        request: NormalizedRequest,
        webhook: Option<Webhook>,
        metadata: Option<Value>,
        source: &str,
    ) -> Event {
        let id = request.job_id();
        Event::new(
            &id,
            source,
            EventBody::Requested(Requested {
                request,
                webhook,
                metadata,
                start_before: None,
                max_runtime: None,
                priority: None,
            }),
        )
    }

    /// The CloudEvents `type` of this event (`io.stemq.job.<kind>.v1`).
    pub fn event_type(&self) -> String {
        serde_json::to_value(&self.body)
            .ok()
            .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_string))
            .unwrap_or_default()
    }

    /// Serialises to the structured-mode JSON body.
    pub fn to_bytes(&self) -> bytes::Bytes {
        serde_json::to_vec(self).expect("events always serialise").into()
    }

    /// Parses a structured-mode JSON body; an event of an older type is first brought
    /// to the current one by the upcasters in [`crate::upcast::UPCASTERS`].
    pub fn from_slice(b: &[u8]) -> Result<Event, serde_json::Error> {
        Event::read(b, crate::upcast::UPCASTERS)
    }

    /// [`Event::from_slice`] with a given upcaster table. The current shape is parsed
    /// directly; only when that fails is the envelope read again to look for an
    /// upcaster of its `type` (so current events are parsed once).
    pub fn read(b: &[u8], upcasters: &[crate::upcast::Upcaster]) -> Result<Event, serde_json::Error> {
        use crate::upcast::{upcast, UpcastError};
        let direct = match serde_json::from_slice(b) {
            Ok(event) => return Ok(event),
            Err(e) => e,
        };
        match upcast(b, upcasters) {
            Ok(Some(current)) => serde_json::from_value(current),
            Ok(None) | Err(UpcastError::NotAnEvent(_)) => Err(direct),
            Err(e) => Err(serde::de::Error::custom(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{JobRequest, ANONYMOUS};
    use serde_json::json;

    #[test]
    fn envelope_is_structured_cloudevents() {
        let req = JobRequest::from_value(json!({"audio_uri": "file:///a.wav"})).unwrap();
        let n = req.normalize(ANONYMOUS).unwrap();
        let ev = Event::requested(n.clone(), None, Some(json!({"k": "v"})), "/stemq/ingress");
        let v: Value = serde_json::to_value(&ev).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["type"], "io.stemq.job.requested.v1");
        assert_eq!(v["id"], n.job_id().as_str());
        assert_eq!(v["subject"], n.job_id().as_str());
        assert_eq!(v["data"]["request"]["model"], "htdemucs");
        assert_eq!(v["data"]["metadata"]["k"], "v");
        let back = Event::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(back, ev);
    }

    #[test]
    fn terminal_kinds() {
        let failed = |class| {
            EventBody::Failed(Failed { attempt: 1, class, code: "x".into(), message: "y".into(), retry_in_ms: None })
        };
        assert!(failed(FailureClass::Permanent).is_terminal());
        assert!(!failed(FailureClass::Transient).is_terminal());
        assert!(!EventBody::Started(Started { attempt: 1, worker: "w".into(), device: "cpu".into() }).is_terminal());
    }
}
