//! Reading one job's view.
//!
//! This module owns the two ways to read a view, and the one error they fail with:
//!
//! - [`get_view`] (and [`stored_view`], which the projector writes over): the KV entry
//!   as the projector last wrote it, under the owner's key or the job id alone
//!   ([`crate::view_key`]). No entry is `None`; an entry that does not parse is
//!   [`ViewError::Corrupt`], never an absent view. [`watch_view`] follows it.
//! - [`current_view`] ([`Views::current`]): what a reader answers with. The KV view,
//!   else — or when the stored view has not seen the request yet — the job's
//!   `requested` event read from the log (direct gets, no projector lag; [`request_of`])
//!   and folded with [`stemq_core::apply`]. So a job that exists is never "not found", even
//!   right after its submit. A request on `stemq.jobs.<id>.requested.<token>` whose
//!   owner is not the token's is not the job's request (the projector refuses it too).

use async_nats::jetstream::{self, kv};

use crate::error::JetStreamError;
use crate::{check_request_owner, job_subject, request_filter, SubjectKind};
use stemq_core::{apply, Event, JobId, JobView, Position};

/// A view that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The bucket or the log did not answer.
    #[error("reading the view of job {id}")]
    Unavailable {
        /// The job.
        id: JobId,
        /// The failed call.
        #[source]
        source: JetStreamError,
    },
    /// The stored view is not a view (hand-edited, or written by an incompatible
    /// version). Never overwritten as if absent: `stemq projector --rebuild` replaces it.
    #[error("the stored view of job {id} (revision {revision}) does not parse")]
    Corrupt {
        /// The job.
        id: JobId,
        /// The entry's revision.
        revision: u64,
        /// Why it does not parse.
        #[source]
        source: serde_json::Error,
    },
}

impl ViewError {
    /// The job whose view could not be read.
    pub fn job_id(&self) -> &JobId {
        match self {
            ViewError::Unavailable { id, .. } | ViewError::Corrupt { id, .. } => id,
        }
    }
}

/// A job's entry in the status bucket: the view, the revision to write over, and the
/// key it is under.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stored {
    /// The view; `None` when the key was never written or was deleted.
    pub view: Option<JobView>,
    /// The entry's revision (0: never written).
    pub revision: u64,
    /// The key ([`crate::view_key`]'s either form); `None` when never written.
    pub key: Option<String>,
}

/// The job's entry as stored, under its owner's key or else the job id alone
/// ([`crate::view_key`]): `Stored::default()` when neither was ever written.
pub async fn stored_view(kv: &kv::Store, id: &JobId) -> Result<Stored, ViewError> {
    use jetstream::stream::DirectGetErrorKind::NotFound;
    // Any owner's key of the job first (one token per owner), then the key without one.
    for subject in [format!("{}*.{id}", kv.prefix), format!("{}{id}", kv.prefix)] {
        let m = match kv.stream.direct_get_last_for_subject(subject.as_str()).await {
            Ok(m) => m,
            Err(e) if e.kind() == NotFound => continue,
            Err(e) => return Err(ViewError::Unavailable { id: id.clone(), source: JetStreamError::read("kv get")(e) }),
        };
        let key = m.subject.as_str().strip_prefix(kv.prefix.as_str()).unwrap_or(id.as_str()).to_string();
        let removed = m.headers.get("KV-Operation").is_some_and(|op| op.as_str() != "PUT")
            || m.headers.get("Nats-Marker-Reason").is_some();
        let view = match removed {
            true => None,
            false => match serde_json::from_slice::<JobView>(&m.payload) {
                Ok(v) => Some(v),
                Err(source) => return Err(ViewError::Corrupt { id: id.clone(), revision: m.sequence, source }),
            },
        };
        return Ok(Stored { view, revision: m.sequence, key: Some(key) });
    }
    Ok(Stored::default())
}

/// Follows one job's view under either form of its key ([`crate::view_key`]), from its
/// latest revision on.
pub async fn watch_view(kv: &kv::Store, id: &JobId) -> Result<kv::Watch, kv::WatchError> {
    kv.watch_many_with_history([format!("*.{id}"), id.to_string()]).await
}

/// One job's view as stored, with its revision: `None` when there is none (never
/// written, or deleted); an error when the stored entry is not a view.
pub async fn get_view(kv: &kv::Store, id: &JobId) -> Result<Option<(JobView, u64)>, ViewError> {
    let stored = stored_view(kv, id).await?;
    Ok(stored.view.map(|v| (v, stored.revision)))
}

/// One job's view as a reader should see it: the stored view, with the job's
/// `requested` event from the log folded in when the projector has not applied it yet
/// (no view, or a view opened by a later event). `None` only when the log has no
/// request and the bucket no view.
pub async fn current_view(
    kv: &kv::Store,
    log: &jetstream::stream::Stream<()>,
    id: &JobId,
) -> Result<Option<JobView>, ViewError> {
    let view = get_view(kv, id).await?.map(|(v, _)| v);
    if view.as_ref().is_some_and(|v| v.request.is_some()) {
        return Ok(view);
    }
    let requested = request_of(log, id).await.map_err(|e| ViewError::Unavailable {
        id: id.clone(),
        source: JetStreamError::read("direct get request")(e),
    })?;
    let Some((seq, event)) = requested else { return Ok(view) };
    let folded = match &view {
        // Opened by a later event (a second projector folded it first, or this read
        // came from a replica behind): the request goes under it, whatever the
        // positions say, and the view keeps its own.
        Some(v) if v.last_seq >= seq => {
            let mut under = v.clone();
            under.last_seq = seq.saturating_sub(1);
            apply(Some(&under), Position::Log(seq), &event).map(|mut f| {
                f.last_seq = v.last_seq;
                f
            })
        }
        _ => apply(view.as_ref(), Position::Log(seq), &event),
    };
    Ok(folded.or(view))
}

/// How many requests with a wrong owner [`request_of`] reads past before giving up.
const MAX_REFUSED_REQUESTS: usize = 16;

/// The job's request as recorded in the log, with its sequence: the first request on
/// `stemq.jobs.<id>.requested.<token>` whose owner matches its token, else the one on
/// the old `stemq.jobs.<id>.requested`. A request that does not read as an event is the
/// worker's to reject and counts as none.
pub async fn request_of(
    log: &jetstream::stream::Stream<()>,
    id: &JobId,
) -> Result<Option<(u64, Event)>, jetstream::stream::DirectGetError> {
    use jetstream::stream::DirectGetErrorKind::NotFound;
    let filter = request_filter(id);
    let mut from = 1;
    for _ in 0..MAX_REFUSED_REQUESTS {
        let m = match log.direct_get_builder().sequence(from).next_by_subject(filter.as_str()).send().await {
            Ok(m) => m,
            Err(e) if e.kind() == NotFound => break,
            Err(e) => return Err(e),
        };
        if let Ok(event) = Event::from_slice(&m.payload) {
            // Only the job's own request: hashing to its id, for its subject's owner.
            let owner_ok = match &event.body {
                stemq_core::EventBody::Requested(r) => {
                    r.request.job_id() == *id
                        && check_request_owner(m.subject.as_str(), &r.request.owner).is_ok()
                        && crate::check_request_route(m.subject.as_str(), r.request.model, r.lane()).is_ok()
                }
                _ => false,
            };
            if owner_ok {
                return Ok(Some((m.sequence, event)));
            }
        }
        from = m.sequence + 1;
    }
    match log.direct_get_last_for_subject(job_subject(id, SubjectKind::Requested)).await {
        Ok(m) => Ok(Event::from_slice(&m.payload).ok().map(|e| (m.sequence, e))),
        Err(e) if e.kind() == NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The reader every service holds: the status bucket and the job log, for
/// [`current_view`].
#[derive(Clone)]
pub struct Views {
    kv: kv::Store,
    log: jetstream::stream::Stream<()>,
}

impl Views {
    /// Opens the `stemq_jobs` bucket and the job stream.
    pub async fn open(js: &jetstream::Context) -> Result<Views, JetStreamError> {
        let kv = js.get_key_value(crate::JOBS_BUCKET).await.map_err(JetStreamError::open("open bucket"))?;
        let log = js.get_stream_no_info(crate::JOBS_STREAM).await.map_err(JetStreamError::open("open job stream"))?;
        Ok(Views { kv, log })
    }

    /// From a bucket and a stream already open.
    pub fn new(kv: kv::Store, log: jetstream::stream::Stream<()>) -> Views {
        Views { kv, log }
    }

    /// The status bucket (to watch it, or to follow it with a [`super::ListIndex`]).
    pub fn bucket(&self) -> &kv::Store {
        &self.kv
    }

    /// The job stream.
    pub fn log(&self) -> &jetstream::stream::Stream<()> {
        &self.log
    }

    /// [`current_view`]: the stored view, else the request from the log.
    pub async fn current(&self, id: &JobId) -> Result<Option<JobView>, ViewError> {
        current_view(&self.kv, &self.log, id).await
    }

    /// [`get_view`]: the stored view only, with its revision.
    pub async fn stored(&self, id: &JobId) -> Result<Option<(JobView, u64)>, ViewError> {
        get_view(&self.kv, id).await
    }
}
