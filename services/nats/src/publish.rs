//! Publishing job events with the guarantees the pipeline relies on.
//!
//! This module owns the two publish shapes of stemq:
//! - [`publish_once`]: to a subject that may hold only one message (a job's request or
//!   its terminal outcome), with `Nats-Msg-Id` and expected-last-subject-sequence 0.
//!   Every way the server says "already there" (`duplicate: true`, error 10071, 10164,
//!   10158) comes back as [`Once::AlreadyThere`], so callers never run or record a job
//!   twice.
//! - [`publish`]: a plain event, waiting for the PubAck.
//!
//! A transient failure is retried, with the same message id where there is one (which
//! keeps the retry idempotent), for up to [`PATIENCE`] (15 s), longer than a JetStream
//! leader election (4–9 s): while a stream's leader is being elected every publish is
//! answered "no responders" at once (nothing was stored, so a retry without a message id
//! is safe too), and a publish whose ack did not come (a node died with it) is retried
//! only with a message id. The `_within` forms take another patience: short for what may
//! be dropped (progress), long for a record that must not be lost.
//!
//! Two guards against other publishers:
//! - *message-id squatting*: the stream's dedupe window covers every subject, so anyone
//!   allowed to publish anywhere in the stream could take a job's message id first (a
//!   `publisher` sending its own request with `Nats-Msg-Id: <another job>`), and the real
//!   publish would be acked `duplicate` with nothing stored. [`publish_once`] therefore
//!   reads the acked sequence back on a duplicate; if it holds another subject, it
//!   publishes again without a message id (expected-last-subject-sequence 0 still keeps
//!   the subject to one message).
//! - [`publish_request`]: a new request goes to its routed subject
//!   (`stemq.jobs.<id>.requested.<owner token>.<model>.<lane>`), only if no request of
//!   the job is recorded for its owner in any form (the earlier forms are looked up, the
//!   routed ones are one wildcard expectation of the publish). A new job costs no
//!   look-up: its publish first expects nothing at all on the job's subjects, and only
//!   when that fails are the forms looked up.

use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use async_nats::HeaderMap;
use tokio::time::Instant;
use tracing::warn;

use crate::{job_filter, job_subject, request_subject, unrouted_request_subject, SubjectKind, JOBS_STREAM};
use stemq_core::event::Event;
use stemq_core::request::JobId;

/// Result of [`publish_once`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Once {
    /// Stored now, at this stream sequence.
    Stored(u64),
    /// The subject already had its message: nothing was stored.
    AlreadyThere,
}

/// Publish failures (after retries): the subject and the client's last error.
#[derive(Debug, thiserror::Error)]
#[error("publishing to {subject}: {source}")]
pub struct PublishError {
    /// Where.
    pub subject: String,
    /// Why: the client's error of the last attempt.
    #[source]
    pub source: jetstream::context::PublishError,
}

impl PublishError {
    /// What kind of failure the client saw, to match on.
    pub fn kind(&self) -> PublishErrorKind {
        self.source.kind()
    }

    /// True when the failure may clear by itself: no responders (an election, a node
    /// restarting), no ack in time, a broken connection, or JetStream saying it is
    /// temporarily unavailable (no quorum, 10008). Retrying with the same message id is
    /// then safe.
    pub fn is_transient(&self) -> bool {
        retryable(&self.source)
    }
}

/// How long [`publish_once`] and [`publish`] keep retrying a transient failure: longer
/// than a JetStream leader election (randomised 4–9 s, measured 4.4–7.2 s on three
/// nodes), so a record survives a node's death.
pub const PATIENCE: Duration = Duration::from_secs(15);

/// Longest pause between two attempts.
const MAX_PAUSE: Duration = Duration::from_secs(1);

fn headers_of(event: &Event, msg_id: Option<&str>, first: bool) -> HeaderMap {
    headers_with(event.traceparent.as_deref(), msg_id, first, None)
}

/// `first_of`: with `first`, the expected-last-subject-sequence 0 holds for every
/// subject matching this wildcard (nats-server 2.11+), not only the one published to.
fn headers_with(traceparent: Option<&str>, msg_id: Option<&str>, first: bool, first_of: Option<&str>) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Content-Type", "application/cloudevents+json");
    if let Some(id) = msg_id {
        h.insert("Nats-Msg-Id", id);
    }
    if first {
        h.insert("Nats-Expected-Last-Subject-Sequence", "0");
        if let Some(filter) = first_of {
            h.insert("Nats-Expected-Last-Subject-Sequence-Subject", filter);
        }
    }
    if let Some(tp) = traceparent {
        h.insert("traceparent", tp);
    }
    h
}

fn already_there(e: &jetstream::context::PublishError) -> bool {
    if e.kind() == PublishErrorKind::WrongLastSequence {
        return true;
    }
    use std::error::Error as _;
    e.source()
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(|je| matches!(je.error_code().0, 10071 | 10164 | 10158))
        .unwrap_or(false)
}

/// Publishes `event` to `subject` only if the subject holds nothing yet, retrying
/// transient failures for up to [`PATIENCE`].
pub async fn publish_once(
    js: &jetstream::Context,
    subject: &str,
    event: &Event,
    msg_id: &str,
) -> Result<Once, PublishError> {
    publish_expecting(js, subject, None, event.to_bytes(), event.traceparent.as_deref(), msg_id, PATIENCE)
        .await
        .map(Once::from)
}

/// [`publish_once`] of a payload that is not a job event (a batch's end, see
/// [`crate::batch_log`]).
pub async fn publish_payload_once(
    js: &jetstream::Context,
    subject: &str,
    payload: bytes::Bytes,
    msg_id: &str,
) -> Result<Once, PublishError> {
    publish_expecting(js, subject, None, payload, None, msg_id, PATIENCE).await.map(Once::from)
}

/// [`publish_once`], retrying transient failures for up to `patience`.
pub async fn publish_once_within(
    js: &jetstream::Context,
    subject: &str,
    event: &Event,
    msg_id: &str,
    patience: Duration,
) -> Result<Once, PublishError> {
    publish_expecting(js, subject, None, event.to_bytes(), event.traceparent.as_deref(), msg_id, patience)
        .await
        .map(Once::from)
}

/// How a publish expecting "nothing yet" ended ([`publish_first_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum First {
    /// Stored now, at this stream sequence.
    Stored(u64),
    /// Our message id was stored before, on our subject (a retry, a duplicate submit).
    Duplicate,
    /// A subject matching the expectation holds a message: nothing was stored.
    Occupied,
}

impl From<First> for Once {
    fn from(f: First) -> Once {
        match f {
            First::Stored(seq) => Once::Stored(seq),
            First::Duplicate | First::Occupied => Once::AlreadyThere,
        }
    }
}

/// Publishes `event` to `subject` only if no subject matching `first_of` holds a
/// message yet, retrying transient failures for up to `patience`; tells a duplicate of
/// our own message id ([`First::Duplicate`]: stored before, by us) from a subject
/// already taken ([`First::Occupied`]).
pub async fn publish_first_of(
    js: &jetstream::Context,
    subject: &str,
    first_of: &str,
    event: &Event,
    msg_id: &str,
    patience: Duration,
) -> Result<First, PublishError> {
    publish_expecting(js, subject, Some(first_of), event.to_bytes(), event.traceparent.as_deref(), msg_id, patience)
        .await
}

/// [`publish_first_of`] of a payload, where "nothing yet" holds for every subject
/// matching `first_of` (or only `subject` itself when `None`).
async fn publish_expecting(
    js: &jetstream::Context,
    subject: &str,
    first_of: Option<&str>,
    payload: bytes::Bytes,
    traceparent: Option<&str>,
    msg_id: &str,
    patience: Duration,
) -> Result<First, PublishError> {
    let t0 = Instant::now();
    let mut attempt = 0;
    let mut msg_id = Some(msg_id);
    loop {
        attempt += 1;
        let msg =
            PublishMessage::build().payload(payload.clone()).headers(headers_with(traceparent, msg_id, true, first_of));
        let res = match js.send_publish(subject.to_string(), msg).await {
            Ok(fut) => fut.await,
            Err(e) => Err(e),
        };
        match res {
            Ok(ack) if ack.duplicate => {
                if msg_id.is_some() && squatted(js, &ack.stream, ack.sequence, subject).await {
                    warn!(
                        subject,
                        msg_id = msg_id.unwrap_or_default(),
                        squatter_seq = ack.sequence,
                        "the message id was taken by a message on another subject; publishing without it"
                    );
                    msg_id = None;
                    attempt = 0;
                    continue;
                }
                return Ok(First::Duplicate);
            }
            Ok(ack) => return Ok(First::Stored(ack.sequence)),
            Err(e) if already_there(&e) => return Ok(First::Occupied),
            Err(e) if retryable(&e) && again(t0, attempt, patience).await => {}
            Err(source) => return Err(PublishError { subject: subject.to_string(), source }),
        }
    }
}

/// True when the message a duplicate ack points at is on another subject than ours
/// (someone else published with our message id). When it cannot be read, the duplicate
/// is taken at its word.
async fn squatted(js: &jetstream::Context, stream: &str, seq: u64, subject: &str) -> bool {
    let Ok(s) = js.get_stream_no_info(stream).await else { return false };
    match s.direct_get(seq).await {
        Ok(m) => m.subject.as_str() != subject,
        Err(_) => false,
    }
}

/// Publishes a new job's request on its routed subject (`stemq.jobs.<id>.requested.<owner
/// token>.<model>.<lane>`, [`request_subject_of`]), once: [`Once::AlreadyThere`] when
/// the job's request is recorded for its owner in any form and any lane. When anything
/// of the job is in the log, the earlier forms are looked up (the oldest
/// `stemq.jobs.<id>.requested` and the unrouted `stemq.jobs.<id>.requested.<owner
/// token>`); the routed ones of the owner, in either
/// lane, are one wildcard expectation of the publish (`stemq.jobs.<id>.requested.<owner
/// token>.>`). Only the owner's own subjects count: a request of this id on another
/// owner's subject is forged (the id hashes the owner) and must not block the real one.
pub async fn publish_request(js: &jetstream::Context, id: &JobId, event: &Event) -> Result<Once, PublishError> {
    // A new job has nothing at all in the log: its publish expects exactly that, over
    // every subject of the job, and is stored in one round trip. Only when something is
    // there (the request in an earlier form, another event, a forged request on another
    // owner's subject) are the forms looked up, and the publish made with the narrower
    // expectation.
    let subject = request_subject_of(id, event);
    let (payload, traceparent) = (event.to_bytes(), event.traceparent.as_deref());
    let everything = job_filter(id);
    match publish_expecting(js, &subject, Some(&everything), payload, traceparent, id.as_str(), PATIENCE).await? {
        First::Stored(seq) => return Ok(Once::Stored(seq)),
        First::Duplicate => return Ok(Once::AlreadyThere),
        First::Occupied => {}
    }
    let owner = owner_of(event);
    if let Ok(log) = js.get_stream_no_info(JOBS_STREAM).await {
        // A request from before routing: the job exists. Any other answer than "found"
        // (not found, or the log unreadable now) leaves it to the publish below.
        let (oldest, unrouted) = tokio::join!(
            log.direct_get_last_for_subject(job_subject(id, SubjectKind::Requested)),
            log.direct_get_last_for_subject(unrouted_request_subject(id, owner)),
        );
        if oldest.is_ok() || unrouted.is_ok() {
            return Ok(Once::AlreadyThere);
        }
    }
    publish_routed(js, id, event, id.as_str()).await
}

/// Publishes an unrouted request again on its routed subject (the ingress's router),
/// once per owner and job like [`publish_request`] (a routed request of the owner in
/// either lane means it is done), with its own message id.
pub async fn route_request(js: &jetstream::Context, id: &JobId, event: &Event) -> Result<Once, PublishError> {
    publish_routed(js, id, event, &format!("{id}.routed")).await
}

/// The owner of a `requested` event (anonymous for any other event, which the worker
/// refuses).
fn owner_of(event: &Event) -> &str {
    match &event.body {
        stemq_core::EventBody::Requested(r) => r.request.owner.as_str(),
        _ => stemq_core::request::ANONYMOUS,
    }
}

/// Publishes a request on its routed subject unless a routed request of the same owner
/// and job is stored in either lane (`stemq.jobs.<id>.requested.<owner token>.>`).
async fn publish_routed(
    js: &jetstream::Context,
    id: &JobId,
    event: &Event,
    msg_id: &str,
) -> Result<Once, PublishError> {
    let routed_of_owner = format!("{}.>", unrouted_request_subject(id, owner_of(event)));
    let (payload, traceparent) = (event.to_bytes(), event.traceparent.as_deref());
    publish_expecting(
        js,
        &request_subject_of(id, event),
        Some(&routed_of_owner),
        payload,
        traceparent,
        msg_id,
        PATIENCE,
    )
    .await
    .map(Once::from)
}

/// The routed subject of a `requested` event: its owner, model and lane (a
/// non-request event, which nobody should publish here, gets the subject of an
/// anonymous interactive `htdemucs` request, which the worker refuses).
pub fn request_subject_of(id: &JobId, event: &Event) -> String {
    match &event.body {
        stemq_core::EventBody::Requested(r) => request_subject(id, &r.request.owner, r.request.model, r.lane()),
        _ => request_subject(
            id,
            stemq_core::request::ANONYMOUS,
            stemq_core::request::Model::Htdemucs,
            Default::default(),
        ),
    }
}

/// The pause after failed attempt `attempt` (1-based): 50 ms, doubling, at most 1 s.
fn pause(attempt: u32) -> Duration {
    Duration::from_millis(50u64 << (attempt.max(1) - 1).min(10)).min(MAX_PAUSE)
}

/// The pause before the attempt after failed attempt `attempt`, `elapsed` after the
/// first began; `None` when the pause would end past `patience`.
fn next_pause(elapsed: Duration, attempt: u32, patience: Duration) -> Option<Duration> {
    let p = pause(attempt);
    (elapsed + p < patience).then_some(p)
}

/// Waits before the next attempt and says yes, or says no when patience is spent.
async fn again(t0: Instant, attempt: u32, patience: Duration) -> bool {
    match next_pause(t0.elapsed(), attempt, patience) {
        Some(p) => {
            tokio::time::sleep(p).await;
            true
        }
        None => false,
    }
}

fn retryable(e: &jetstream::context::PublishError) -> bool {
    if matches!(e.kind(), PublishErrorKind::StreamNotFound | PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe)
    {
        return true;
    }
    use std::error::Error as _;
    // "JetStream system temporarily unavailable": no meta leader (quorum lost).
    e.source().and_then(|s| s.downcast_ref::<jetstream::Error>()).is_some_and(|je| je.error_code().0 == 10008)
}

/// Publishes `event` to `subject` and waits for the PubAck, retrying transient
/// failures for up to [`PATIENCE`]. `msg_id` makes retries idempotent within the dedupe
/// window; without one only failures that stored nothing (no responders) are retried.
pub async fn publish(
    js: &jetstream::Context,
    subject: &str,
    event: &Event,
    msg_id: Option<&str>,
) -> Result<u64, PublishError> {
    publish_within(js, subject, event, msg_id, PATIENCE).await
}

/// [`publish`], retrying transient failures for up to `patience`.
pub async fn publish_within(
    js: &jetstream::Context,
    subject: &str,
    event: &Event,
    msg_id: Option<&str>,
    patience: Duration,
) -> Result<u64, PublishError> {
    publish_payload(js, subject, event.to_bytes(), headers_of(event, msg_id, false), patience).await
}

/// Publishes `payload` to `subject` with `headers` and waits for the PubAck, retrying
/// transient failures for up to `patience`: any that stored nothing, and, when
/// `headers` hold a `Nats-Msg-Id`, any other transient one (the id keeps the retry
/// idempotent). For what is not a job event (a batch's rounds, see
/// [`crate::batch_log`]); a refused expectation (`Nats-Expected-Last-Subject-Sequence`)
/// is returned as the error it is ([`PublishErrorKind::WrongLastSequence`]).
pub async fn publish_payload(
    js: &jetstream::Context,
    subject: &str,
    payload: bytes::Bytes,
    headers: HeaderMap,
    patience: Duration,
) -> Result<u64, PublishError> {
    let has_id = headers.get("Nats-Msg-Id").is_some();
    let t0 = Instant::now();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let msg = PublishMessage::build().payload(payload.clone()).headers(headers.clone());
        let res = match js.send_publish(subject.to_string(), msg).await {
            Ok(fut) => fut.await,
            Err(e) => Err(e),
        };
        match res {
            Ok(ack) => return Ok(ack.sequence),
            Err(e)
                if retryable(&e)
                    && (has_id || e.kind() == PublishErrorKind::StreamNotFound)
                    && again(t0, attempt, patience).await => {}
            Err(source) => return Err(PublishError { subject: subject.to_string(), source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_a_second() {
        let p: Vec<u64> = (1..=8).map(|a| pause(a).as_millis() as u64).collect();
        assert_eq!(p, [50, 100, 200, 400, 800, 1000, 1000, 1000]);
        assert_eq!(pause(u32::MAX), MAX_PAUSE);
    }

    #[test]
    fn transient_failures_are_told_apart() {
        let e = |kind| PublishError { subject: "s".into(), source: jetstream::context::PublishError::new(kind) };
        for kind in [PublishErrorKind::StreamNotFound, PublishErrorKind::TimedOut, PublishErrorKind::BrokenPipe] {
            assert!(e(kind).is_transient(), "{kind:?}");
        }
        assert!(!e(PublishErrorKind::WrongLastSequence).is_transient());
        assert!(!e(PublishErrorKind::Other).is_transient());
    }

    #[test]
    fn patience_bounds_the_retries() {
        // Attempts that fail at once: only the pauses count.
        let (mut elapsed, mut attempt) = (Duration::ZERO, 1);
        while let Some(p) = next_pause(elapsed, attempt, Duration::from_secs(3)) {
            elapsed += p;
            attempt += 1;
        }
        // 50 + 100 + 200 + 400 + 800 + 1000 ms = 2.55 s; one more second would pass 3 s.
        assert_eq!((attempt, elapsed), (7, Duration::from_millis(2550)));
        // The default outlasts a leader election (at most about 9 s).
        assert!(next_pause(Duration::from_secs(9), 20, PATIENCE).is_some());
        assert!(next_pause(PATIENCE, 1, PATIENCE).is_none());
    }

    #[test]
    fn publish_errors_keep_the_clients_error_and_its_kind() {
        let e = PublishError {
            subject: "stemq.jobs.x.outcome".into(),
            source: jetstream::context::PublishError::new(PublishErrorKind::TimedOut),
        };
        assert_eq!(e.kind(), PublishErrorKind::TimedOut);
        assert!(e.to_string().starts_with("publishing to stemq.jobs.x.outcome: "), "{e}");
        let source = std::error::Error::source(&e).expect("the source is kept");
        assert!(source.downcast_ref::<jetstream::context::PublishError>().is_some());
    }
}
