//! One job's fold, written: the view read (or taken from the lane's cache), the plan
//! carried out, and the result written with compare-and-set on the entry's revision;
//! a job whose events were overtaken is refolded from the log.

use async_nats::jetstream::{self, kv};
use stemq_core::{apply, Event, EventBody, JobId, JobView, Position};
use stemq_nats as names;
use stemq_nats::error::JetStreamError;
use stemq_nats::read;
use tracing::{debug, info};

use crate::plan::{keep_progress, plan, refusal, Plan};
use crate::ProjectorError;

/// What a lane's cache holds for a job after its fold.
#[derive(Debug)]
pub(crate) enum Cached {
    /// What it held.
    Keep,
    /// This entry as written.
    Set(read::Stored),
    /// Nothing (the view was re-read and not written: the next fold reads it again).
    Drop,
}

/// One job's view and where its events are.
pub(crate) struct Job<'a> {
    pub(crate) kv: &'a kv::Store,
    pub(crate) log: &'a jetstream::stream::Stream<()>,
    pub(crate) id: &'a JobId,
}

impl Job<'_> {
    /// Applies the job's events in order to `cached` (the lane's cached view, if any)
    /// and writes the result once, with compare-and-set; on a concurrent writer it
    /// re-reads and plans again. An event behind the view refolds the job from the log
    /// (the crate docs). A stored entry that is not a view is an error
    /// ([`ProjectorError::CorruptView`]), never overwritten. Returns what the lane's
    /// cache should hold for the job now.
    pub(crate) async fn fold(
        &self,
        cached: Option<read::Stored>,
        events: &[(Position, &Event)],
    ) -> Result<Cached, ProjectorError> {
        let id = self.id;
        // An unknown job whose request is among the events is most likely new: try
        // creating its view under its owner's key before paying for a read. Any other
        // unknown job is read first: its view may be under either form of its key, and a
        // create under the other form would not conflict with it.
        let mut reread = false;
        let mut current = match cached {
            Some(c) => c,
            None if events.iter().any(|(_, e)| matches!(e.body, EventBody::Requested(_))) => read::Stored::default(),
            None => {
                reread = true;
                read::stored_view(self.kv, id).await?
            }
        };
        let unchanged = |reread: bool| if reread { Cached::Drop } else { Cached::Keep };
        for _ in 0..10 {
            let next = match plan(current.view.as_ref(), events) {
                Plan::Unchanged => {
                    debug!(job_id = %id, "events change nothing");
                    return Ok(unchanged(reread));
                }
                Plan::Write(v) => *v,
                Plan::Refold { upto } => {
                    crate::metrics::metrics().refold();
                    let Some(v) = self.refold(upto, current.view.as_ref(), events).await? else {
                        return Ok(unchanged(reread));
                    };
                    if current.view.as_ref() == Some(&v) {
                        debug!(job_id = %id, upto, "refolded: the view was right");
                        return Ok(unchanged(reread));
                    }
                    info!(job_id = %id, upto, "refolded from the log: an event had been overtaken");
                    v
                }
            };
            let body = serde_json::to_vec(&next).expect("views serialise");
            // Where the view is, else its owner's key (`view_key`).
            let key = match &current.key {
                Some(k) => k.clone(),
                None => self.new_key(&next).await?,
            };
            match self.kv.update(key.as_str(), body.into(), current.revision).await {
                Ok(revision) => return Ok(Cached::Set(read::Stored { view: Some(next), revision, key: Some(key) })),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    // It exists (or another writer moved it): read the real revision, retry.
                    reread = true;
                    current = read::stored_view(self.kv, id).await?;
                }
                Err(source) => return Err(ProjectorError::KvWrite { id: id.clone(), source }),
            }
        }
        Err(ProjectorError::Conflicts { id: id.clone() })
    }

    /// The key a job's first view is written under: its owner's ([`names::view_key`]),
    /// the owner read from the job's request in the log when the view has none yet (a
    /// progress folded before the request). The job id alone only when the log's request
    /// is not a request of the job (it will never be folded, so the view never moves);
    /// no request read at all is [`ProjectorError::RequestUnread`] (a replica behind):
    /// the events come again.
    async fn new_key(&self, view: &JobView) -> Result<String, ProjectorError> {
        use jetstream::stream::DirectGetErrorKind::NotFound;
        if let Some(r) = &view.request {
            return Ok(names::view_key(Some(&r.owner), self.id));
        }
        let log_read =
            |e| ProjectorError::LogRead { id: self.id.clone(), source: JetStreamError::read("direct get request")(e) };
        if let Some((_, e)) = read::request_of(self.log, self.id).await.map_err(log_read)? {
            if let EventBody::Requested(r) = e.body {
                return Ok(names::view_key(Some(&r.request.owner), self.id));
            }
        }
        for subject in [names::request_filter(self.id), names::job_subject(self.id, names::SubjectKind::Requested)] {
            match self.log.direct_get_last_for_subject(subject).await {
                Ok(_) => return Ok(names::view_key(None, self.id)),
                Err(e) if e.kind() == NotFound => {}
                Err(e) => return Err(log_read(e)),
            }
        }
        Err(ProjectorError::RequestUnread { id: self.id.clone() })
    }

    /// The job's view as its log up to `upto` folds it (refused requests and unreadable
    /// events left out, as the projector leaves them out), with the live progress of
    /// `stored` and the batch's progress events on top. `None` when the log holds no
    /// event of the job.
    async fn refold(
        &self,
        upto: u64,
        stored: Option<&JobView>,
        events: &[(Position, &Event)],
    ) -> Result<Option<JobView>, ProjectorError> {
        use jetstream::stream::DirectGetErrorKind::NotFound;
        let filter = format!("{}.{}.>", names::JOBS_PREFIX, self.id);
        let mut view: Option<JobView> = None;
        let mut from = 1;
        let mut read = 0;
        while from <= upto {
            let m = match self.log.direct_get_builder().sequence(from).next_by_subject(filter.as_str()).send().await {
                Ok(m) => m,
                Err(e) if e.kind() == NotFound => break,
                Err(e) => {
                    return Err(ProjectorError::LogRead {
                        id: self.id.clone(),
                        source: JetStreamError::read("direct get")(e),
                    })
                }
            };
            from = m.sequence + 1;
            if m.sequence > upto {
                break;
            }
            read = m.sequence;
            let Ok(event) = Event::from_slice(&m.payload) else { continue };
            if refusal(m.subject.as_str(), &event).is_some() {
                continue;
            }
            if let Some(v) = apply(view.as_ref(), Position::Log(m.sequence), &event) {
                view = Some(v);
            }
        }
        // `upto` is the position of one of the job's events (the batch's, or the one the
        // view was last moved by): a read that stops short of it is behind, not the log.
        if read < upto {
            return Err(ProjectorError::LogBehind { id: self.id.clone(), wanted: upto, read });
        }
        let Some(mut view) = view else { return Ok(stored.cloned()) };
        if let Some(stored) = stored {
            keep_progress(&mut view, stored);
        }
        for (pos, event) in events.iter().filter(|(p, _)| matches!(p, Position::Progress(_))) {
            if let Some(v) = apply(Some(&view), *pos, event) {
                view = v;
            }
        }
        Ok(Some(view))
    }
}
