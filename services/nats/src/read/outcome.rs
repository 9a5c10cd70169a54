//! A job's outcome: the one way every service reads it.
//!
//! A job ends once: its outcome is the one message on `stemq.jobs.<id>.outcome` in the
//! stream `STEMQ_OUTCOMES`, which keeps one message per subject and discards any later
//! one, so the server itself refuses a second outcome whoever sends it and whatever its
//! headers say. The job log `STEMQ_JOBS` sources a copy of each outcome (its consumers
//! see a job's events in one order). Outcomes recorded before `STEMQ_OUTCOMES` existed
//! are in `STEMQ_JOBS` only, where a later one could follow them.
//!
//! So "the" outcome is the first message on the job's outcome subject in `STEMQ_JOBS`
//! (an earlier outcome there is the job's; otherwise it is the copy of the one in
//! `STEMQ_OUTCOMES`), else, while the copy is on its way, the one in `STEMQ_OUTCOMES`.
//! Never the last: a later message on that subject is never the job's outcome.

use async_nats::jetstream::{self, message::StreamMessage, stream::DirectGetErrorKind};

use crate::error::JetStreamError;
use crate::{job_subject, SubjectKind, JOBS_STREAM, OUTCOMES_STREAM};
use stemq_core::JobId;

/// Where a read goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum From {
    /// Any replica (a direct get): may lag the leader by a moment.
    Replica,
    /// The streams' leaders: what is committed.
    Leader,
}

/// The outcome event of job `id` as stored (`None`: the job has not ended).
pub async fn outcome(js: &jetstream::Context, id: &JobId, from: From) -> Result<Option<StreamMessage>, JetStreamError> {
    let subject = job_subject(id, SubjectKind::Outcome);
    let open = |name: &'static str| async move {
        js.get_stream_no_info(name).await.map_err(JetStreamError::open("open a job outcome stream"))
    };
    for (stream, first) in [(open(JOBS_STREAM).await?, true), (open(OUTCOMES_STREAM).await?, false)] {
        let found = match from {
            From::Replica => {
                let got = if first {
                    stream.direct_get_first_for_subject(subject.as_str()).await
                } else {
                    stream.direct_get_last_for_subject(subject.as_str()).await
                };
                match got {
                    Ok(m) => Some(m),
                    Err(e) if e.kind() == DirectGetErrorKind::NotFound => None,
                    Err(e) => return Err(JetStreamError::read("get a job outcome")(e)),
                }
            }
            From::Leader => match stream.get_first_raw_message_by_subject(subject.as_str(), 1).await {
                Ok(m) => Some(m),
                Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => None,
                Err(e) => return Err(JetStreamError::read("get a job outcome")(e)),
            },
        };
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}

/// True when job `id` has ended (its outcome is stored).
pub async fn has_ended(js: &jetstream::Context, id: &JobId) -> Result<bool, JetStreamError> {
    Ok(outcome(js, id, From::Replica).await?.is_some())
}
