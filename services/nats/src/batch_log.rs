//! The batch log: where a batch's facts are kept (`STEMQ_BATCHES`), and how they are
//! read and written.
//!
//! This module owns the batch subjects and the two writes of a batch:
//!
//! - `stemq.batches.<batch id>.submitted`: one [`BatchSubmitted`] per submission round,
//!   each the whole state merged with the one before ([`stemq_core::batch::merge`]); the
//!   latest is the batch. A round is written with compare-and-set on the subject's last
//!   sequence ([`record_round`]), so two rounds of one batch at once (two ingresses, a
//!   client that retries) both land, merged, and neither is lost;
//! - `stemq.batch_jobs.<job id>.<batch id>`: one message per job and batch holding it
//!   (`Nats-Msg-Id` `<job id>.<batch id>`), written before the round that submits the
//!   job: which batches to look at when a job ends ([`BatchLog::batches_of`]);
//! - `stemq.batches.<batch id>.ended`: the batch's end, once ([`record_end`]: message id
//!   `<batch id>.ended` and expected last subject sequence 0), written by the relay when
//!   every item is refused or a finished job;
//! - `stemq.batches.<batch id>.delivery`: the relay's attempts at the batch's webhook
//!   (`io.stemq.batch.delivery_attempted.v1`), read back to number them
//!   ([`BatchLog::delivery_attempts`]).
//!
//! Reads go to any replica ([`Read::Any`], direct gets) where a stale answer is harmless
//! (an HTTP read, the compare-and-set that retries), and to the stream's leader
//! ([`Read::Leader`]) where a decision rests on them (is this batch over?).

use std::time::Duration;

use async_nats::jetstream::{self, stream::Stream};
use async_nats::HeaderMap;
use chrono::{DateTime, Utc};

use crate::error::JetStreamError;
use crate::publish::{publish_payload, publish_payload_once, Once, PublishError};
use crate::{BATCHES_PREFIX, BATCHES_STREAM, BATCH_JOBS_PREFIX, JOBS_STREAM};
use stemq_core::batch::{merge, BatchEvent, BatchEventBody, BatchId, BatchSubmitted, BatchView};
use stemq_core::event::DeliveryAttempted;
use stemq_core::request::JobId;

/// The body of a membership (`stemq.batch_jobs.<job id>.<batch id>`): batch
/// `batch_id` holds job `job_id`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Membership {
    /// The batch.
    pub batch_id: BatchId,
    /// The job.
    pub job_id: JobId,
}

/// The subject families of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchSubject {
    /// `stemq.batches.<id>.submitted`: the submission rounds.
    Submitted,
    /// `stemq.batches.<id>.ended`: the one end.
    Ended,
    /// `stemq.batches.<id>.delivery`: webhook attempts.
    Delivery,
}

/// The subject of one kind of a batch's events.
pub fn batch_subject(id: &BatchId, kind: BatchSubject) -> String {
    let token = match kind {
        BatchSubject::Submitted => "submitted",
        BatchSubject::Ended => "ended",
        BatchSubject::Delivery => "delivery",
    };
    format!("{BATCHES_PREFIX}.{id}.{token}")
}

/// `stemq.batch_jobs.<job id>.<batch id>`: batch `batch` holds job `job`.
pub fn member_subject(job: &JobId, batch: &BatchId) -> String {
    format!("{BATCH_JOBS_PREFIX}.{job}.{batch}")
}

/// The batch id in a batch subject (`stemq.batches.<id>.<kind>`) or a membership
/// (`stemq.batch_jobs.<job id>.<id>`).
pub fn batch_id_of_subject(subject: &str) -> Option<BatchId> {
    let t: Vec<&str> = subject.split('.').collect();
    match t.as_slice() {
        ["stemq", "batches", id, _] => BatchId::parse(id),
        ["stemq", "batch_jobs", _, id] => BatchId::parse(id),
        _ => None,
    }
}

/// Which server answers a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// Any replica (a direct get): fast, possibly a little behind on R3.
    Any,
    /// The stream's leader: everything stored before the read.
    Leader,
}

/// A batch's latest submission round.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Its sequence in `STEMQ_BATCHES` (the compare-and-set of the next round).
    pub seq: u64,
    /// When it was recorded.
    pub time: DateTime<Utc>,
    /// The batch's state.
    pub state: BatchSubmitted,
}

/// A `delivery_attempted` record of a batch's webhook.
#[derive(Debug, Clone)]
pub struct RecordedAttempt {
    /// Its sequence in `STEMQ_BATCHES`.
    pub seq: u64,
    /// When it was recorded.
    pub time: DateTime<Utc>,
    /// The attempt.
    pub attempt: DeliveryAttempted,
}

/// A stored message, as either read returns it.
struct Stored {
    seq: u64,
    subject: String,
    payload: bytes::Bytes,
}

fn unreadable(what: &'static str, e: serde_json::Error) -> JetStreamError {
    JetStreamError::read(what)(e)
}

/// The batch log as a reader or writer holds it.
#[derive(Clone)]
pub struct BatchLog {
    stream: Stream<()>,
}

impl BatchLog {
    /// Opens `STEMQ_BATCHES`.
    pub async fn open(js: &jetstream::Context) -> Result<BatchLog, JetStreamError> {
        let stream = js.get_stream_no_info(BATCHES_STREAM).await.map_err(JetStreamError::open("open batch stream"))?;
        Ok(BatchLog { stream })
    }

    /// The last message on `subject`, `None` when there is none.
    async fn last(&self, subject: &str, read: Read) -> Result<Option<Stored>, JetStreamError> {
        match read {
            Read::Any => match self.stream.direct_get_last_for_subject(subject).await {
                Ok(m) => Ok(Some(Stored { seq: m.sequence, subject: m.subject.to_string(), payload: m.payload })),
                Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => Ok(None),
                Err(e) => Err(JetStreamError::read("direct get of the batch log")(e)),
            },
            Read::Leader => match self.stream.get_last_raw_message_by_subject(subject).await {
                Ok(m) => Ok(Some(Stored { seq: m.sequence, subject: m.subject.to_string(), payload: m.payload })),
                Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(e) => Err(JetStreamError::read("get from the batch log")(e)),
            },
        }
    }

    /// The first message matching `filter` at or after sequence `from`.
    async fn next(&self, filter: &str, from: u64, read: Read) -> Result<Option<Stored>, JetStreamError> {
        match read {
            Read::Any => match self.stream.direct_get_builder().sequence(from).next_by_subject(filter).send().await {
                Ok(m) => Ok(Some(Stored { seq: m.sequence, subject: m.subject.to_string(), payload: m.payload })),
                Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => Ok(None),
                Err(e) => Err(JetStreamError::read("direct get of the batch log")(e)),
            },
            Read::Leader => match self.stream.raw_message_builder().sequence(from).next_by_subject(filter).send().await
            {
                Ok(m) => Ok(Some(Stored { seq: m.sequence, subject: m.subject.to_string(), payload: m.payload })),
                Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
                Err(e) => Err(JetStreamError::read("get from the batch log")(e)),
            },
        }
    }

    /// The batch's latest submission round; `None` for a batch never submitted.
    pub async fn record(&self, id: &BatchId, read: Read) -> Result<Option<Recorded>, JetStreamError> {
        let Some(m) = self.last(&batch_subject(id, BatchSubject::Submitted), read).await? else { return Ok(None) };
        let event = BatchEvent::from_slice(&m.payload).map_err(|e| unreadable("read a batch round", e))?;
        match event.body {
            BatchEventBody::Submitted(state) => Ok(Some(Recorded { seq: m.seq, time: event.time, state })),
            _ => Err(JetStreamError::read("read a batch round")(format!(
                "{} holds a {} event",
                m.subject,
                event.event_type()
            ))),
        }
    }

    /// The batch's end, once recorded: the event (its time, its final view).
    pub async fn ended(&self, id: &BatchId, read: Read) -> Result<Option<BatchEvent>, JetStreamError> {
        let Some(m) = self.last(&batch_subject(id, BatchSubject::Ended), read).await? else { return Ok(None) };
        BatchEvent::from_slice(&m.payload).map(Some).map_err(|e| unreadable("read a batch end", e))
    }

    /// The batches that hold job `job`, in the order they took it.
    pub async fn batches_of(&self, job: &JobId, read: Read) -> Result<Vec<BatchId>, JetStreamError> {
        let filter = format!("{BATCH_JOBS_PREFIX}.{job}.*");
        let mut out = Vec::new();
        let mut from = 1;
        while let Some(m) = self.next(&filter, from, read).await? {
            if let Some(id) = batch_id_of_subject(&m.subject) {
                if !out.contains(&id) {
                    out.push(id);
                }
            }
            from = m.seq + 1;
        }
        Ok(out)
    }

    /// Every attempt recorded for batch `id`'s webhook after stream sequence `after_seq`
    /// (0: all), in log order.
    pub async fn delivery_attempts(
        &self,
        id: &BatchId,
        after_seq: u64,
    ) -> Result<Vec<RecordedAttempt>, JetStreamError> {
        let subject = batch_subject(id, BatchSubject::Delivery);
        let mut out = Vec::new();
        let mut from = after_seq + 1;
        while let Some(m) = self.next(&subject, from, Read::Leader).await? {
            if let Ok(BatchEvent { time, body: BatchEventBody::DeliveryAttempted(attempt), .. }) =
                BatchEvent::from_slice(&m.payload)
            {
                out.push(RecordedAttempt { seq: m.seq, time, attempt });
            }
            from = m.seq + 1;
        }
        Ok(out)
    }
}

/// How long a write of the batch log keeps retrying while NATS cannot store it.
const PATIENCE: Duration = Duration::from_secs(10);

fn headers(msg_id: &str, expect_last: Option<u64>, content_type: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Content-Type", content_type);
    h.insert("Nats-Msg-Id", msg_id);
    if let Some(seq) = expect_last {
        h.insert("Nats-Expected-Last-Subject-Sequence", seq.to_string().as_str());
    }
    h
}

/// A write of the batch log that did not happen.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The log could not be read (the state to merge with).
    #[error(transparent)]
    Read(#[from] JetStreamError),
    /// NATS did not store it.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// Other rounds of the same batch kept landing first.
    #[error("batch {0}: too many concurrent submissions")]
    Contended(BatchId),
}

/// Records a submission round of batch `id` (`source`: who records it): first that the
/// batch holds `new_jobs` (the jobs this round submitted), then the round merged with
/// the latest one stored, by compare-and-set (merged again and retried when another round
/// landed in between). Returns the batch's state and when it was recorded; a round that
/// changes no item writes nothing and returns the stored state.
pub async fn record_round(
    js: &jetstream::Context,
    log: &BatchLog,
    id: &BatchId,
    round: BatchSubmitted,
    new_jobs: &[JobId],
    source: &str,
) -> Result<Recorded, WriteError> {
    // The memberships first: a job that ends after this round is stored then finds the
    // batch, and one that ended before is seen by the check the round itself triggers.
    let writes = new_jobs.iter().map(|job| {
        let payload =
            serde_json::to_vec(&Membership { batch_id: id.clone(), job_id: job.clone() }).expect("serialises");
        let subject = member_subject(job, id);
        let h = headers(&format!("{job}.{id}"), None, "application/json");
        async move { publish_payload(js, &subject, payload.into(), h, PATIENCE).await }
    });
    for r in futures::future::join_all(writes).await {
        r?;
    }
    let subject = batch_subject(id, BatchSubject::Submitted);
    for _ in 0..50 {
        let stored = log.record(id, Read::Leader).await?;
        let merged = merge(stored.as_ref().map(|r| &r.state), round.clone());
        if let Some(s) = &stored {
            if s.state.items == merged.items {
                return Ok(s.clone());
            }
        }
        let expect = stored.as_ref().map_or(0, |s| s.seq);
        let event = BatchEvent::new(id, source, BatchEventBody::Submitted(merged.clone()));
        let h = headers(&format!("{id}.{expect}"), Some(expect), "application/cloudevents+json");
        match publish_payload(js, &subject, event.to_bytes(), h, PATIENCE).await {
            Ok(seq) => return Ok(Recorded { seq, time: event.time, state: merged }),
            // Another round landed first: merge with it.
            Err(e) if e.kind() == jetstream::context::PublishErrorKind::WrongLastSequence => {
                tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 20)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(WriteError::Contended(id.clone()))
}

/// Records that batch `id` ended, with its final `view`, once: the first end recorded
/// wins; any later one is [`Once::AlreadyThere`].
pub async fn record_end(
    js: &jetstream::Context,
    id: &BatchId,
    mut view: BatchView,
    source: &str,
) -> Result<Once, PublishError> {
    let now = Utc::now();
    view.ended_at = Some(now);
    let mut event = BatchEvent::new(id, source, BatchEventBody::Ended(Box::new(view)));
    event.time = now;
    publish_payload_once(js, &batch_subject(id, BatchSubject::Ended), event.to_bytes(), &format!("{id}.ended")).await
}

/// Records one attempt at batch `id`'s webhook on `stemq.batches.<id>.delivery`, with
/// message id `msg_id` (a retried publish is one record).
pub async fn record_attempt(
    js: &jetstream::Context,
    id: &BatchId,
    attempt: DeliveryAttempted,
    msg_id: &str,
    source: &str,
    patience: Duration,
) -> Result<u64, PublishError> {
    let event = BatchEvent::new(id, source, BatchEventBody::DeliveryAttempted(attempt));
    let h = headers(msg_id, None, "application/cloudevents+json");
    publish_payload(js, &batch_subject(id, BatchSubject::Delivery), event.to_bytes(), h, patience).await
}

/// The terminal status of job `id` from its outcome event (`crate::read::outcome`), read
/// from the streams' leaders: `None` while the job has not ended.
pub async fn job_outcome(js: &jetstream::Context, id: &JobId) -> Result<Option<stemq_core::JobStatus>, JetStreamError> {
    match crate::read::outcome::outcome(js, id, crate::read::outcome::From::Leader).await? {
        Some(m) => {
            let event = stemq_core::Event::from_slice(&m.payload).map_err(|e| unreadable("read a job outcome", e))?;
            let status = stemq_core::apply(None, stemq_core::Position::Log(m.sequence), &event).map(|v| v.status);
            // An outcome that does not fold into a terminal status is still an end.
            Ok(Some(status.filter(|s| s.is_terminal()).unwrap_or(stemq_core::JobStatus::Failed)))
        }
        None => Ok(None),
    }
}

/// Opens the job stream for [`job_outcome`].
pub async fn jobs_stream(js: &jetstream::Context) -> Result<Stream<()>, JetStreamError> {
    js.get_stream_no_info(JOBS_STREAM).await.map_err(JetStreamError::open("open job stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_carry_the_batch_id() {
        let b = BatchId::parse(&"b".repeat(64)).unwrap();
        let j = JobId::parse(&"a".repeat(64)).unwrap();
        for kind in [BatchSubject::Submitted, BatchSubject::Ended, BatchSubject::Delivery] {
            assert_eq!(batch_id_of_subject(&batch_subject(&b, kind)), Some(b.clone()));
        }
        assert_eq!(batch_subject(&b, BatchSubject::Ended), format!("stemq.batches.{b}.ended"));
        assert_eq!(member_subject(&j, &b), format!("stemq.batch_jobs.{j}.{b}"));
        assert_eq!(batch_id_of_subject(&member_subject(&j, &b)), Some(b));
        assert_eq!(batch_id_of_subject("stemq.batches.nothex.ended"), None);
        assert_eq!(batch_id_of_subject(&format!("stemq.jobs.{j}.outcome")), None);
    }
}
