//! The job status view and the pure fold that builds it from events.
//!
//! This module owns the job state machine:
//!
//! ```text
//! queued ──started──▶ running ──succeeded──▶ succeeded
//!   ▲                   │  ├────failed(permanent)──▶ failed
//!   └─failed(transient)─┘  └────dead_lettered──────▶ dead_lettered
//! (any non-terminal) ──rejected──▶ rejected
//! (any non-terminal) ──cancelled─▶ cancelled   (after a cancel request)
//! queued ──expired──▶ expired                  (start_before passed)
//! ```
//!
//! [`apply`] is the only way a view changes. It is pure, idempotent by stream position
//! (an event at or below the last applied position is ignored), and tolerant of events
//! arriving out of order: a terminal view absorbs everything, progress and failures of
//! an older attempt are ignored, and an event seen before the request still opens a view.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::{Event, EventBody, FailureClass, Output};
use crate::failure::FailureCode;
use crate::request::{JobId, NormalizedRequest, Webhook};

/// Where a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Waiting for a worker (first time or after a transient failure).
    Queued,
    /// A worker is on it.
    Running,
    /// Stems stored.
    Succeeded,
    /// Failed for good.
    Failed,
    /// Set aside after too many deliveries.
    DeadLettered,
    /// Its request event was not acceptable; never ran.
    Rejected,
    /// Stopped on request; no outputs kept.
    Cancelled,
    /// Not started before its `start_before` deadline; never ran.
    Expired,
}

impl JobStatus {
    /// Every status.
    pub const ALL: [JobStatus; 8] = [
        JobStatus::Queued,
        JobStatus::Running,
        JobStatus::Succeeded,
        JobStatus::Failed,
        JobStatus::DeadLettered,
        JobStatus::Rejected,
        JobStatus::Cancelled,
        JobStatus::Expired,
    ];

    /// True when nothing will change the job any more.
    pub fn is_terminal(self) -> bool {
        !matches!(self, JobStatus::Queued | JobStatus::Running)
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Succeeded => "succeeded",
            JobStatus::Failed => "failed",
            JobStatus::DeadLettered => "dead_lettered",
            JobStatus::Rejected => "rejected",
            JobStatus::Cancelled => "cancelled",
            JobStatus::Expired => "expired",
        }
    }

    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<JobStatus> {
        JobStatus::ALL.into_iter().find(|x| x.as_str() == s)
    }
}

/// Latest progress of a running job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ProgressView {
    /// 0–100.
    pub percent: f32,
    /// Current stage.
    pub stage: String,
    /// Optional detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Last error seen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorView {
    /// `permanent` or `transient`.
    pub class: FailureClass,
    /// Machine-readable code.
    pub code: FailureCode,
    /// For people.
    pub message: String,
}

/// What anyone can read about a job (the value in the KV bucket, the body of
/// `GET /v1/separations/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobView {
    /// The job id.
    pub job_id: JobId,
    /// Where the job is.
    pub status: JobStatus,
    /// The normalised request (absent only while the request event has not been seen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<NormalizedRequest>,
    /// Webhook target, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<Webhook>,
    /// Client metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// When the request was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
    /// When the view last changed.
    pub updated_at: DateTime<Utc>,
    /// When the first attempt started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// When the job reached a terminal state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    /// Latest attempt (delivery number), 0 before the first start.
    pub attempt: u32,
    /// Transient failures so far.
    pub retries: u32,
    /// Worker of the latest attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// Device of the latest attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Progress of the running attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<ProgressView>,
    /// The stems, once succeeded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<Output>,
    /// Manifest of the stems.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_uri: Option<String>,
    /// True when computed on a fallback (smaller segment or CPU after out-of-memory).
    #[serde(default)]
    pub degraded: bool,
    /// Last error (also kept after a successful retry, for the record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorView>,
    /// The job this one re-runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_of: Option<JobId>,
    /// The job that re-ran this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_by: Option<JobId>,
    /// Deadline to start; past it a queued job becomes `expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_before: Option<DateTime<Utc>>,
    /// Per-job time limit in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_runtime: Option<u64>,
    /// The lane it waits in, when the request named one or its key did (absent:
    /// interactive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<crate::request::Priority>,
    /// Why a queued job is not running yet, when the reader knows (`waiting for a
    /// worker that serves htdemucs_6s`). Added by the API when it answers, from the
    /// worker registry; never part of the stored view (the fold leaves it absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// Where a queued job is in its queue: how many queued jobs of the same pool and
    /// lane (model and priority) were queued before it; 0 means it is next. A batch
    /// job also waits for every queued interactive job of its pool, which this count
    /// leaves out (its `eta` does not). Added by the API when it answers, from its index
    /// of the jobs; never part of the stored view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<u64>,
    /// When the job is expected to *finish* (RFC 3339, UTC). For a queued job: the jobs
    /// ahead of it, the job slots of the live workers that serve its model, and the
    /// typical (median) run time of the model's recent successful jobs; for a running
    /// job: its progress, else that typical run time from its start. Absent when it
    /// cannot be told: no recent success of the model, no live worker serving it, a
    /// running job past its typical time without progress. An estimate, added by the API
    /// when it answers (see `docs/events.md`, "Queue position and ETA"); never part of
    /// the stored view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta: Option<DateTime<Utc>>,
    /// Whole seconds from the answer to `eta`, rounded up (0 when it is due); present
    /// with `eta`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<u64>,
    /// When a cancel was asked for (the job stops at its worker's next check).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_requested_at: Option<DateTime<Utc>>,
    /// Stream sequence of the last applied job event (idempotency).
    pub last_seq: u64,
    /// Stream sequence of the last applied progress event.
    #[serde(default)]
    pub progress_seq: u64,
}

/// Which log an event came from: progress lives in a compacted stream of its own, so it
/// has its own sequence space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// The job event stream.
    Log(u64),
    /// The progress stream.
    Progress(u64),
}

impl JobView {
    /// The owner of the job (empty while its request has not been seen).
    pub fn owner(&self) -> &str {
        self.request.as_ref().map(|r| r.owner.as_str()).unwrap_or_default()
    }

    fn empty(job_id: JobId, at: DateTime<Utc>) -> JobView {
        JobView {
            job_id,
            status: JobStatus::Queued,
            request: None,
            webhook: None,
            metadata: None,
            created_at: None,
            updated_at: at,
            started_at: None,
            finished_at: None,
            attempt: 0,
            retries: 0,
            worker: None,
            device: None,
            progress: None,
            outputs: Vec::new(),
            manifest_uri: None,
            degraded: false,
            error: None,
            retry_of: None,
            retried_by: None,
            start_before: None,
            max_runtime: None,
            priority: None,
            waiting: None,
            queue_position: None,
            eta: None,
            eta_seconds: None,
            cancel_requested_at: None,
            last_seq: 0,
            progress_seq: 0,
        }
    }

    fn finish(&mut self, status: JobStatus, at: DateTime<Utc>) {
        self.status = status;
        self.finished_at = Some(at);
        if status != JobStatus::Succeeded {
            self.progress = None;
        }
    }
}

/// Folds one event into a view. Returns `None` when the event changes nothing
/// (duplicate, stale, or after the end), so callers can skip the write.
pub fn apply(view: Option<&JobView>, pos: Position, event: &Event) -> Option<JobView> {
    if let Some(v) = view {
        match pos {
            Position::Log(s) if s <= v.last_seq => return None,
            Position::Progress(s) if s <= v.progress_seq => return None,
            _ => {}
        }
    }
    let at = event.time;
    let mut v = view.cloned().unwrap_or_else(|| JobView::empty(event.subject.clone(), at));
    match pos {
        Position::Log(s) => v.last_seq = s,
        Position::Progress(s) => v.progress_seq = s,
    }
    let terminal = v.status.is_terminal();
    match &event.body {
        EventBody::Requested(r) => {
            if v.request.is_some() {
                return None;
            }
            v.retry_of = r.request.retry_of.clone();
            v.request = Some(r.request.clone());
            v.webhook = r.webhook.clone();
            v.metadata = r.metadata.clone();
            v.start_before = r.start_before;
            v.max_runtime = r.max_runtime;
            v.priority = r.priority;
            v.created_at = Some(at);
        }
        EventBody::Retried(r) => {
            if v.retried_by.as_ref() == Some(&r.retried_by) {
                return None;
            }
            v.retried_by = Some(r.retried_by.clone());
        }
        // Delivery records live in the log, not in the view (`GET .../deliveries`).
        EventBody::DeliveryAttempted(_) | EventBody::DeliveryReplayRequested(_) => return None,
        _ if terminal => return None,
        EventBody::CancelRequested(_) => {
            if v.cancel_requested_at.is_some() {
                return None;
            }
            v.cancel_requested_at = Some(at);
        }
        EventBody::Cancelled(c) => {
            v.attempt = v.attempt.max(c.attempt);
            v.finish(JobStatus::Cancelled, at);
        }
        EventBody::Expired(e) => {
            v.error = Some(ErrorView {
                class: FailureClass::Permanent,
                code: FailureCode::Expired,
                message: format!("not started before {}", e.start_before.to_rfc3339()),
            });
            v.finish(JobStatus::Expired, at);
        }
        EventBody::Started(s) => {
            if s.attempt < v.attempt {
                return None;
            }
            v.status = JobStatus::Running;
            v.attempt = s.attempt;
            v.worker = Some(s.worker.clone());
            v.device = Some(s.device.to_string());
            v.started_at.get_or_insert(at);
            v.progress = None;
        }
        EventBody::Progress(p) => {
            if v.status != JobStatus::Running || p.attempt != v.attempt {
                return None;
            }
            v.progress = Some(ProgressView { percent: p.percent, stage: p.stage.clone(), message: p.message.clone() });
        }
        EventBody::Succeeded(s) => {
            v.attempt = v.attempt.max(s.attempt);
            v.outputs = s.outputs.clone();
            v.manifest_uri = s.manifest_uri.clone();
            v.degraded = s.degraded;
            v.device = Some(s.device.to_string());
            v.progress = Some(ProgressView { percent: 100.0, stage: "done".into(), message: None });
            v.finish(JobStatus::Succeeded, at);
        }
        EventBody::Failed(f) => {
            if f.attempt < v.attempt {
                return None;
            }
            v.attempt = f.attempt;
            v.error = Some(ErrorView { class: f.class, code: f.code.clone(), message: f.message.clone() });
            match f.class {
                FailureClass::Transient => {
                    v.retries += 1;
                    v.status = JobStatus::Queued;
                    v.progress = None;
                }
                FailureClass::Permanent => v.finish(JobStatus::Failed, at),
            }
        }
        EventBody::DeadLettered(d) => {
            v.attempt = v.attempt.max(d.deliveries);
            if let Some(e) = &d.last_error {
                v.error =
                    Some(ErrorView { class: FailureClass::Transient, code: d.reason.clone(), message: e.clone() });
            } else {
                v.error = Some(ErrorView {
                    class: FailureClass::Transient,
                    code: d.reason.clone(),
                    message: format!("delivered {} times without an outcome", d.deliveries),
                });
            }
            v.finish(JobStatus::DeadLettered, at);
        }
        EventBody::Rejected(r) => {
            v.error =
                Some(ErrorView { class: FailureClass::Permanent, code: r.code.clone(), message: r.message.clone() });
            v.finish(JobStatus::Rejected, at);
        }
    }
    v.updated_at = at;
    Some(v)
}

#[cfg(test)]
mod tests {
    //! Given / when / then: given the events so far, when one more arrives, then the view.
    use super::*;
    use crate::event::*;
    use crate::request::{JobRequest, ANONYMOUS};
    use serde_json::json;

    fn job() -> (JobId, NormalizedRequest) {
        let n = JobRequest::from_value(json!({"audio_uri": "file:///a.wav"})).unwrap().normalize(ANONYMOUS).unwrap();
        (n.job_id(), n)
    }

    fn ev(body: EventBody) -> Event {
        Event::new(&job().0, "/test", body)
    }
    fn requested() -> Event {
        Event::requested(job().1, None, None, "/test")
    }
    fn started(attempt: u32) -> Event {
        ev(EventBody::Started(Started { attempt, worker: "w1".into(), device: "fake".into() }))
    }
    fn progress(attempt: u32, percent: f32) -> Event {
        ev(EventBody::Progress(Progress { attempt, percent, stage: "separate".into(), message: None }))
    }
    fn failed(attempt: u32, class: FailureClass) -> Event {
        ev(EventBody::Failed(Failed {
            attempt,
            class,
            code: "boom".into(),
            message: "it broke".into(),
            retry_in_ms: None,
        }))
    }
    fn succeeded(attempt: u32) -> Event {
        ev(EventBody::Succeeded(Succeeded {
            attempt,
            outputs: vec![],
            manifest_uri: None,
            degraded: false,
            device: "fake".into(),
            segment: None,
            duration_ms: 5,
            audio_ms: None,
        }))
    }

    /// Given events (each at the next log position), the final view.
    fn given(events: &[Event]) -> JobView {
        let mut view: Option<JobView> = None;
        for (i, e) in events.iter().enumerate() {
            if let Some(v) = apply(view.as_ref(), Position::Log(i as u64 + 1), e) {
                view = Some(v);
            }
        }
        view.expect("some event applied")
    }

    #[test]
    fn happy_path() {
        let v = given(&[requested()]);
        assert_eq!(v.status, JobStatus::Queued);
        assert!(v.request.is_some() && v.created_at.is_some());
        let v = given(&[requested(), started(1)]);
        assert_eq!((v.status, v.attempt, v.worker.as_deref()), (JobStatus::Running, 1, Some("w1")));
        let v = given(&[requested(), started(1), succeeded(1)]);
        assert_eq!(v.status, JobStatus::Succeeded);
        assert!(v.finished_at.is_some());
        assert_eq!(v.last_seq, 3);
    }

    #[test]
    fn transient_failure_requeues_then_success() {
        let v = given(&[requested(), started(1), failed(1, FailureClass::Transient)]);
        assert_eq!((v.status, v.retries), (JobStatus::Queued, 1));
        assert_eq!(v.error.as_ref().unwrap().class, FailureClass::Transient);
        let v = given(&[requested(), started(1), failed(1, FailureClass::Transient), started(2), succeeded(2)]);
        assert_eq!((v.status, v.attempt, v.retries), (JobStatus::Succeeded, 2, 1));
    }

    #[test]
    fn permanent_failure_is_terminal() {
        let v = given(&[requested(), started(1), failed(1, FailureClass::Permanent), started(2)]);
        assert_eq!(v.status, JobStatus::Failed);
        assert_eq!(v.attempt, 1);
    }

    #[test]
    fn duplicate_positions_change_nothing() {
        let v = given(&[requested(), started(1)]);
        assert_eq!(apply(Some(&v), Position::Log(2), &succeeded(1)), None);
        assert_eq!(apply(Some(&v), Position::Log(1), &requested()), None);
        // the same event again at a new position (a re-publish) is harmless too
        let again = apply(Some(&v), Position::Log(3), &started(1)).unwrap();
        assert_eq!((again.status, again.attempt), (JobStatus::Running, 1));
    }

    #[test]
    fn terminal_absorbs_late_events() {
        let done = given(&[requested(), started(1), succeeded(1)]);
        for late in
            [started(2), progress(1, 50.0), failed(1, FailureClass::Transient), failed(2, FailureClass::Permanent)]
        {
            assert_eq!(apply(Some(&done), Position::Log(99), &late), None);
        }
        let dl = ev(EventBody::DeadLettered(DeadLettered {
            deliveries: 5,
            reason: "max_deliveries".into(),
            last_error: None,
            request_seq: 1,
        }));
        assert_eq!(apply(Some(&done), Position::Log(99), &dl), None);
    }

    #[test]
    fn stale_attempts_are_ignored() {
        // attempt 2 started; a late failure and progress from attempt 1 arrive afterwards
        let v = given(&[requested(), started(1), started(2), failed(1, FailureClass::Transient)]);
        assert_eq!((v.status, v.attempt, v.retries), (JobStatus::Running, 2, 0));
        let p = apply(Some(&v), Position::Progress(1), &progress(1, 40.0));
        assert_eq!(p, None);
        let p = apply(Some(&v), Position::Progress(2), &progress(2, 40.0)).unwrap();
        assert_eq!(p.progress.unwrap().percent, 40.0);
        assert_eq!(p.last_seq, v.last_seq, "progress has its own position");
    }

    #[test]
    fn events_before_the_request_still_open_a_view() {
        let v = given(&[started(1), requested()]);
        assert_eq!(v.status, JobStatus::Running);
        assert!(v.request.is_some());
        let v = given(&[succeeded(1), requested()]);
        assert_eq!(v.status, JobStatus::Succeeded);
        assert!(v.request.is_some(), "request filled in after the end");
    }

    #[test]
    fn progress_only_while_running() {
        let v = given(&[requested()]);
        assert_eq!(apply(Some(&v), Position::Progress(1), &progress(1, 10.0)), None);
    }

    #[test]
    fn retried_links_a_finished_job() {
        let done = given(&[requested(), started(1), failed(1, FailureClass::Permanent)]);
        let new_id = JobId::parse(&"b".repeat(64)).unwrap();
        let r = ev(EventBody::Retried(Retried { retried_by: new_id.clone() }));
        let v = apply(Some(&done), Position::Log(10), &r).unwrap();
        assert_eq!((v.status, v.retried_by), (JobStatus::Failed, Some(new_id)));
    }

    #[test]
    fn cancel_request_then_cancelled_is_terminal() {
        let asked = ev(EventBody::CancelRequested(CancelRequested { by: Some("http".into()) }));
        let v = given(&[requested(), started(1), asked.clone()]);
        assert_eq!(v.status, JobStatus::Running);
        assert!(v.cancel_requested_at.is_some());
        let c = ev(EventBody::Cancelled(Cancelled { attempt: 1, interrupted: true }));
        let v = given(&[requested(), started(1), asked, c]);
        assert_eq!(v.status, JobStatus::Cancelled);
        assert!(v.finished_at.is_some() && v.progress.is_none());
        // a late success of the interrupted attempt changes nothing
        assert_eq!(apply(Some(&v), Position::Log(99), &succeeded(1)), None);
    }

    #[test]
    fn queued_job_expires() {
        let e = ev(EventBody::Expired(Expired { start_before: chrono::Utc::now() }));
        let v = given(&[requested(), e]);
        assert_eq!(v.status, JobStatus::Expired);
        assert_eq!(v.error.unwrap().code, FailureCode::Expired);
        assert!(v.started_at.is_none());
    }

    #[test]
    fn the_error_code_is_written_as_its_string_and_an_unknown_one_is_kept() {
        let v = given(&[requested(), started(1), failed(1, FailureClass::Permanent)]);
        let error = v.error.clone().unwrap();
        assert_eq!(error.code, FailureCode::Other("boom".into()));
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["error"], serde_json::json!({"class": "permanent", "code": "boom", "message": "it broke"}));
        let back: JobView = serde_json::from_value(json).unwrap();
        assert_eq!(back, v);
        let known: ErrorView =
            serde_json::from_str(r#"{"class":"transient","code":"time_limit","message":"m"}"#).unwrap();
        assert_eq!(known.code, FailureCode::TimeLimit);
        assert_eq!(
            serde_json::to_string(&known).unwrap(),
            r#"{"class":"transient","code":"time_limit","message":"m"}"#
        );
    }

    #[test]
    fn delivery_records_do_not_touch_the_view() {
        let v = given(&[requested()]);
        let d = ev(EventBody::DeliveryReplayRequested(DeliveryReplayRequested {
            webhook_id: "msg_1".into(),
            event_type: "io.stemq.job.succeeded.v1".into(),
        }));
        assert_eq!(apply(Some(&v), Position::Log(9), &d), None);
    }

    #[test]
    fn rejected_and_dead_lettered() {
        let r = ev(EventBody::Rejected(Rejected { code: "id_mismatch".into(), message: "forged".into() }));
        let v = given(&[r]);
        assert_eq!(v.status, JobStatus::Rejected);
        let dl = ev(EventBody::DeadLettered(DeadLettered {
            deliveries: 5,
            reason: "max_deliveries".into(),
            last_error: None,
            request_seq: 1,
        }));
        let v = given(&[requested(), started(5), dl]);
        assert_eq!((v.status, v.attempt), (JobStatus::DeadLettered, 5));
    }
}
