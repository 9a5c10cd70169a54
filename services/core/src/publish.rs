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
//! A "no responders" answer (stream not yet there, server restarting) is retried with the
//! same message id, which keeps the retry idempotent.
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
//!   routed ones are one wildcard expectation of the publish).

use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use async_nats::HeaderMap;
use tracing::warn;

use crate::event::Event;
use crate::nats::{job_subject, request_subject, unrouted_request_subject, SubjectKind, JOBS_STREAM};
use crate::request::JobId;

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
}

const ATTEMPTS: u32 = 5;

fn headers_of(event: &Event, msg_id: Option<&str>, first: bool) -> HeaderMap {
    headers_with(event, msg_id, first, None)
}

/// `first_of`: with `first`, the expected-last-subject-sequence 0 holds for every
/// subject matching this wildcard (nats-server 2.11+), not only the one published to.
fn headers_with(event: &Event, msg_id: Option<&str>, first: bool, first_of: Option<&str>) -> HeaderMap {
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
    if let Some(tp) = &event.traceparent {
        h.insert("traceparent", tp.as_str());
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

/// Publishes `event` to `subject` only if the subject holds nothing yet.
pub async fn publish_once(
    js: &jetstream::Context,
    subject: &str,
    event: &Event,
    msg_id: &str,
) -> Result<Once, PublishError> {
    publish_first(js, subject, None, event, msg_id).await
}

/// [`publish_once`], where "nothing yet" holds for every subject matching `first_of`
/// (or only `subject` itself when `None`).
async fn publish_first(
    js: &jetstream::Context,
    subject: &str,
    first_of: Option<&str>,
    event: &Event,
    msg_id: &str,
) -> Result<Once, PublishError> {
    let payload = event.to_bytes();
    let mut attempt = 0;
    let mut msg_id = Some(msg_id);
    loop {
        attempt += 1;
        let msg = PublishMessage::build().payload(payload.clone()).headers(headers_with(event, msg_id, true, first_of));
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
                return Ok(Once::AlreadyThere);
            }
            Ok(ack) => return Ok(Once::Stored(ack.sequence)),
            Err(e) if already_there(&e) => return Ok(Once::AlreadyThere),
            Err(e) if retryable(&e) && attempt < ATTEMPTS => backoff(attempt).await,
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
/// the job's request is recorded for its owner in any form and any lane. The earlier
/// forms are looked up first (the oldest `stemq.jobs.<id>.requested` and the unrouted
/// `stemq.jobs.<id>.requested.<owner token>`); the routed ones of the owner, in either
/// lane, are one wildcard expectation of the publish (`stemq.jobs.<id>.requested.<owner
/// token>.>`). Only the owner's own subjects count: a request of this id on another
/// owner's subject is forged (the id hashes the owner) and must not block the real one.
pub async fn publish_request(js: &jetstream::Context, id: &JobId, event: &Event) -> Result<Once, PublishError> {
    let subject = request_subject_of(id, event);
    let owner = match &event.body {
        crate::EventBody::Requested(r) => r.request.owner.as_str(),
        _ => crate::request::ANONYMOUS,
    };
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
    let routed_of_owner = format!("{}.>", unrouted_request_subject(id, owner));
    publish_first(js, &subject, Some(&routed_of_owner), event, id.as_str()).await
}

/// Publishes an unrouted request again on its routed subject (the ingress's router),
/// once per owner and job like [`publish_request`] (a routed request of the owner in
/// either lane means it is done), with its own message id.
pub async fn route_request(js: &jetstream::Context, id: &JobId, event: &Event) -> Result<Once, PublishError> {
    let subject = request_subject_of(id, event);
    let owner = match &event.body {
        crate::EventBody::Requested(r) => r.request.owner.as_str(),
        _ => crate::request::ANONYMOUS,
    };
    let routed_of_owner = format!("{}.>", unrouted_request_subject(id, owner));
    publish_first(js, &subject, Some(&routed_of_owner), event, &format!("{id}.routed")).await
}

/// The routed subject of a `requested` event: its owner, model and lane (a
/// non-request event, which nobody should publish here, gets the subject of an
/// anonymous interactive `htdemucs` request, which the worker refuses).
pub fn request_subject_of(id: &JobId, event: &Event) -> String {
    match &event.body {
        crate::EventBody::Requested(r) => request_subject(id, &r.request.owner, r.request.model, r.lane()),
        _ => request_subject(id, crate::request::ANONYMOUS, crate::request::Model::Htdemucs, Default::default()),
    }
}

/// The pause after failed attempt `attempt` (1-based): 50 ms, doubling.
async fn backoff(attempt: u32) {
    tokio::time::sleep(Duration::from_millis(50 << (attempt - 1))).await;
}

fn retryable(e: &jetstream::context::PublishError) -> bool {
    matches!(e.kind(), PublishErrorKind::StreamNotFound | PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe)
}

/// Publishes `event` to `subject` and waits for the PubAck. `msg_id` makes retries
/// idempotent within the dedupe window.
pub async fn publish(
    js: &jetstream::Context,
    subject: &str,
    event: &Event,
    msg_id: Option<&str>,
) -> Result<u64, PublishError> {
    let payload = event.to_bytes();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let msg = PublishMessage::build().payload(payload.clone()).headers(headers_of(event, msg_id, false));
        let res = match js.send_publish(subject.to_string(), msg).await {
            Ok(fut) => fut.await,
            Err(e) => Err(e),
        };
        match res {
            Ok(ack) => return Ok(ack.sequence),
            Err(e)
                if retryable(&e)
                    && (msg_id.is_some() || e.kind() == PublishErrorKind::StreamNotFound)
                    && attempt < ATTEMPTS =>
            {
                backoff(attempt).await
            }
            Err(source) => return Err(PublishError { subject: subject.to_string(), source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
