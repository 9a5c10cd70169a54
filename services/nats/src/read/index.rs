//! The list index: job ids ordered newest first, per status, kept in memory.
//!
//! This module owns what the list query needs. The KV bucket is keyed by job id, and a
//! NATS KV cannot list keys in time order without reading them all; so a reader (the
//! ingress, `stemq list`, `stemq top`) keeps this secondary index, fed by a watch on the bucket. A page of 50 out of
//! 100 000 jobs is then a walk of 50 entries in a B-tree plus 50 KV reads, whatever the
//! bucket holds. The index is a projection of the view and, like it, disposable: it is
//! rebuilt from the bucket at start.
//!
//! It also keeps when each ended job ended ([`ListIndex::finished_per_minute`]), so the
//! operators' throughput over the last minutes is a walk of a B-tree too; and what a
//! job's place in its queue needs ([`ListIndex::place`]): the queued jobs of every pool
//! and lane in the order they were queued, the running jobs with their worker, start
//! and progress, and the run times of each model's recent successes (the arithmetic is
//! in [`super::queue`]).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::queue::{self, Place, RUN_TIME_WINDOW};
use crate::registry::WorkerInfo;
use stemq_core::request::{Model, Priority};
use stemq_core::{JobId, JobStatus, JobView};

type Key = (Reverse<i64>, JobId);

/// A pool's lane: the jobs of one model and priority (`workers-<model>-<lane>`).
type Lane = (Model, Priority);

/// The sets a page can be taken from: every job, or one owner's (`Some(owner)`), of
/// every status or of one.
type SetKey = (Option<String>, Option<JobStatus>);

/// What the index knows of one job.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    /// Creation time, Unix ns ([`created_key`]).
    created: i64,
    status: JobStatus,
    owner: String,
    /// Its pool's lane (absent while its request has not been seen).
    lane: Option<Lane>,
    /// The attempt running now, for a running job.
    run: Option<Run>,
}

/// A running attempt.
#[derive(Debug, Clone, PartialEq)]
struct Run {
    worker: String,
    attempt: u32,
    /// When this attempt started, Unix ms: the view's `started_at` for the first attempt
    /// (exact), else when the index first saw the job run this attempt (the view keeps
    /// only the first attempt's start).
    started_ms: i64,
    /// Its latest progress: percent, and when it was reported (the view's `updated_at`,
    /// Unix ms).
    progress: Option<(f32, i64)>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<JobId, Entry>,
    sets: HashMap<SetKey, BTreeSet<Key>>,
    /// Ended jobs by when they ended (Unix ms), with how.
    finished: BTreeMap<(i64, JobId), JobStatus>,
    /// When each ended job ended (the key into `finished`).
    finished_at: HashMap<JobId, i64>,
    /// Queued jobs of each pool's lane, oldest first (creation ns, id).
    queued: HashMap<Lane, BTreeSet<(i64, JobId)>>,
    /// Running jobs, with their model.
    running: HashMap<JobId, (Model, Run)>,
    /// Run times (ms) of each model's latest successful jobs, by when they ended (ms):
    /// at most [`RUN_TIME_WINDOW`] per model.
    run_times: HashMap<Model, BTreeMap<(i64, JobId), i64>>,
    caught_up: bool,
}

/// Jobs that ended within one minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, schemars::JsonSchema)]
pub struct MinuteCount {
    /// Start of the minute, Unix seconds.
    pub minute: i64,
    /// Jobs that succeeded in it.
    pub succeeded: u32,
    /// Jobs that ended otherwise (failed, dead-lettered, rejected, cancelled, expired).
    pub other: u32,
}

impl Inner {
    fn set_keys(owner: &str, status: JobStatus) -> [SetKey; 4] {
        [(None, None), (None, Some(status)), (Some(owner.to_string()), None), (Some(owner.to_string()), Some(status))]
    }
}

/// The in-memory list index.
#[derive(Default)]
pub struct ListIndex {
    inner: RwLock<Inner>,
}

/// Sort key of a view: its creation time in Unix nanoseconds.
fn created_key(view: &JobView) -> i64 {
    let t = view.created_at.unwrap_or(view.updated_at);
    t.timestamp_nanos_opt().unwrap_or_else(|| t.timestamp_micros().saturating_mul(1000))
}

/// The pool's lane of a view: its model and priority (absent without its request).
fn lane_of(view: &JobView) -> Option<Lane> {
    view.request.as_ref().map(|r| (r.model, view.priority.unwrap_or_default()))
}

/// The running attempt of a view, given what the index knew of the job before.
fn run_of(view: &JobView, was: Option<&Run>) -> Option<Run> {
    if view.status != JobStatus::Running {
        return None;
    }
    let started_ms = match was {
        Some(r) if r.attempt == view.attempt => r.started_ms,
        _ => match view.started_at {
            Some(t) if view.attempt <= 1 => t.timestamp_millis(),
            _ => view.updated_at.timestamp_millis(),
        },
    };
    Some(Run {
        worker: view.worker.clone().unwrap_or_default(),
        attempt: view.attempt,
        started_ms,
        progress: view.progress.as_ref().map(|p| (p.percent, view.updated_at.timestamp_millis())),
    })
}

/// A page position: the creation time (ns) and id of the last job of the previous page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// Creation time of the last job shown, in Unix nanoseconds.
    pub created_ns: i64,
    /// Its id.
    pub id: JobId,
}

impl Cursor {
    /// `<created_ns>.<id>`.
    pub fn encode(&self) -> String {
        format!("{}.{}", self.created_ns, self.id)
    }

    /// Parses [`Cursor::encode`]'s form.
    pub fn decode(s: &str) -> Option<Cursor> {
        let (ms, id) = s.split_once('.')?;
        Some(Cursor { created_ns: ms.parse().ok()?, id: JobId::parse(id)? })
    }
}

impl ListIndex {
    /// Records a view (insert or move between statuses).
    pub fn upsert(&self, view: &JobView) {
        let mut g = self.inner.write().expect("index lock");
        let old = g.by_id.get(&view.job_id).cloned();
        let entry = Entry {
            created: created_key(view),
            status: view.status,
            owner: view.owner().to_string(),
            lane: lane_of(view),
            run: run_of(view, old.as_ref().and_then(|o| o.run.as_ref())),
        };
        if old.as_ref() == Some(&entry) {
            return;
        }
        if let Some(old) = &old {
            Self::unlink(&mut g, &view.job_id, old);
        }
        let k = (Reverse(entry.created), view.job_id.clone());
        for sk in Inner::set_keys(&entry.owner, entry.status) {
            g.sets.entry(sk).or_default().insert(k.clone());
        }
        if let Some(lane) = entry.lane {
            if entry.status == JobStatus::Queued {
                g.queued.entry(lane).or_default().insert((entry.created, view.job_id.clone()));
            }
            if let Some(run) = &entry.run {
                g.running.insert(view.job_id.clone(), (lane.0, run.clone()));
            }
            if view.status == JobStatus::Succeeded {
                Self::track_run_time(&mut g, view, lane.0, old.as_ref().and_then(|o| o.run.as_ref()));
            }
        }
        g.by_id.insert(view.job_id.clone(), entry);
        Self::track_finish(&mut g, view);
    }

    /// Takes a job out of the sets, queues and running jobs it was in as `old`.
    fn unlink(g: &mut Inner, id: &JobId, old: &Entry) {
        let k = (Reverse(old.created), id.clone());
        for sk in Inner::set_keys(&old.owner, old.status) {
            if let Some(s) = g.sets.get_mut(&sk) {
                s.remove(&k);
            }
        }
        if let Some(lane) = old.lane {
            if let Some(q) = g.queued.get_mut(&lane) {
                q.remove(&(old.created, id.clone()));
            }
        }
        g.running.remove(id);
    }

    /// Keeps a succeeded job's run time (its last attempt, start to outcome) among its
    /// model's latest [`RUN_TIME_WINDOW`].
    fn track_run_time(g: &mut Inner, view: &JobView, model: Model, was: Option<&Run>) {
        let Some(end) = view.finished_at.map(|t| t.timestamp_millis()) else { return };
        // The attempt's start: seen running, or the view's own start for a first attempt
        // (the view keeps only the first attempt's start).
        let start = match was {
            Some(r) if r.attempt == view.attempt => Some(r.started_ms),
            _ if view.attempt <= 1 => view.started_at.map(|t| t.timestamp_millis()),
            _ => None,
        };
        let Some(start) = start.filter(|s| *s <= end) else { return };
        let times = g.run_times.entry(model).or_default();
        times.insert((end, view.job_id.clone()), end - start);
        while times.len() > RUN_TIME_WINDOW {
            times.pop_first();
        }
    }

    /// The typical run time (ms) of `model`'s recent successful jobs: the median of the
    /// latest [`RUN_TIME_WINDOW`]; `None` before the first.
    pub fn typical_run_ms(&self, model: Model) -> Option<i64> {
        let g = self.inner.read().expect("index lock");
        queue::typical(g.run_times.get(&model).into_iter().flat_map(|t| t.values().copied()))
    }

    /// Where `view`'s job stands at `now` with the live `workers` (see [`super::queue`]):
    /// for a queued job its position in its pool's lane and when it should finish, for a
    /// running job when it should finish; nothing for an ended job, a job whose request
    /// has not been seen, or before the index has read the bucket.
    ///
    /// The view is the caller's (it may be newer than what the index holds, right after
    /// a submit); the jobs around it are the index's.
    pub fn place(&self, view: &JobView, workers: &[WorkerInfo], now: chrono::DateTime<chrono::Utc>) -> Place {
        let Some((model, lane)) = lane_of(view) else { return Place::default() };
        let g = self.inner.read().expect("index lock");
        if !g.caught_up {
            return Place::default();
        }
        let now_ms = now.timestamp_millis();
        let typical = |m: Model| queue::typical(g.run_times.get(&m).into_iter().flat_map(|t| t.values().copied()));
        let run = typical(model);
        match view.status {
            JobStatus::Queued => {
                let empty = BTreeSet::new();
                let mine = g.queued.get(&(model, lane)).unwrap_or(&empty);
                let position = mine.range(..(created_key(view), view.job_id.clone())).count() as u64;
                // A worker takes every queued interactive job of its pools before a batch job.
                let interactive = match lane {
                    Priority::Batch => g.queued.get(&(model, Priority::Interactive)).map_or(0, |q| q.len() as u64),
                    Priority::Interactive => 0,
                };
                let eta_ms = run.and_then(|run| {
                    // When each slot of the pool frees: now, or when the job on it ends.
                    let mut free = Vec::new();
                    for w in workers.iter().filter(|w| w.models.contains(&model)) {
                        let mut on: Vec<i64> = g
                            .running
                            .values()
                            .filter(|(_, r)| r.worker == w.name)
                            .map(|(m, r)| {
                                queue::running_end(r.started_ms, now_ms, typical(*m), r.progress).unwrap_or(now_ms)
                            })
                            .collect();
                        on.sort_unstable();
                        on.resize(w.concurrency, now_ms);
                        free.extend(on);
                    }
                    queue::start_of(&free, position + interactive, run).map(|start| start + run)
                });
                Place { queue_position: Some(position), eta_ms }
            }
            JobStatus::Running => {
                let old = g.by_id.get(&view.job_id).and_then(|e| e.run.as_ref());
                let eta_ms = run_of(view, old).and_then(|r| queue::running_end(r.started_ms, now_ms, run, r.progress));
                Place { queue_position: None, eta_ms }
            }
            _ => Place::default(),
        }
    }

    fn track_finish(g: &mut Inner, view: &JobView) {
        if let Some(old) = g.finished_at.remove(&view.job_id) {
            g.finished.remove(&(old, view.job_id.clone()));
        }
        if view.status.is_terminal() {
            let at = view.finished_at.unwrap_or(view.updated_at).timestamp_millis();
            g.finished.insert((at, view.job_id.clone()), view.status);
            g.finished_at.insert(view.job_id.clone(), at);
        }
    }

    /// Jobs that ended per minute, for the `minutes` minutes up to and including the one
    /// holding `now`, oldest first (minutes without any are there with zeros).
    pub fn finished_per_minute(&self, now: chrono::DateTime<chrono::Utc>, minutes: usize) -> Vec<MinuteCount> {
        let last = now.timestamp().div_euclid(60) * 60;
        let first = last - 60 * (minutes as i64 - 1).max(0);
        let mut out: Vec<MinuteCount> =
            (0..minutes as i64).map(|i| MinuteCount { minute: first + 60 * i, ..Default::default() }).collect();
        let g = self.inner.read().expect("index lock");
        for ((ms, _), status) in g.finished.iter().rev().take_while(|((ms, _), _)| *ms >= first * 1000) {
            let i = ((ms.div_euclid(1000) - first) / 60) as usize;
            let Some(m) = out.get_mut(i) else { continue };
            if *status == JobStatus::Succeeded {
                m.succeeded += 1;
            } else {
                m.other += 1;
            }
        }
        out
    }

    /// The oldest job of `status` (by creation), with its creation time in Unix ns.
    pub fn oldest(&self, status: JobStatus) -> Option<(JobId, i64)> {
        let g = self.inner.read().expect("index lock");
        g.sets.get(&(None, Some(status)))?.iter().next_back().map(|(Reverse(ns), id)| (id.clone(), *ns))
    }

    /// Forgets a job.
    pub fn remove(&self, id: &JobId) {
        let mut g = self.inner.write().expect("index lock");
        if let Some(old) = g.by_id.remove(id) {
            Self::unlink(&mut g, id, &old);
            if let (Some((model, _)), Some(at)) = (old.lane, g.finished_at.get(id).copied()) {
                if let Some(t) = g.run_times.get_mut(&model) {
                    t.remove(&(at, id.clone()));
                }
            }
        }
        if let Some(at) = g.finished_at.remove(id) {
            g.finished.remove(&(at, id.clone()));
        }
    }

    /// Up to `limit` ids, newest first, optionally of one status, after `cursor`.
    pub fn page(&self, status: Option<JobStatus>, limit: usize, after: Option<&Cursor>) -> Vec<(JobId, i64)> {
        self.page_of(None, status, limit, after)
    }

    /// Like [`ListIndex::page`], of one owner's jobs only when `owner` is given.
    pub fn page_of(
        &self,
        owner: Option<&str>,
        status: Option<JobStatus>,
        limit: usize,
        after: Option<&Cursor>,
    ) -> Vec<(JobId, i64)> {
        let g = self.inner.read().expect("index lock");
        let empty = BTreeSet::new();
        let set = g.sets.get(&(owner.map(str::to_string), status)).unwrap_or(&empty);
        let iter: Box<dyn Iterator<Item = &Key>> = match after {
            Some(c) => {
                let start = (Reverse(c.created_ns), c.id.clone());
                Box::new(set.range(start..).skip_while(move |k| k.0 .0 == c.created_ns && k.1 == c.id))
            }
            None => Box::new(set.iter()),
        };
        iter.take(limit).map(|(Reverse(ms), id)| (id.clone(), *ms)).collect()
    }

    /// A job's status as the index knows it.
    pub fn status(&self, id: &JobId) -> Option<JobStatus> {
        self.inner.read().expect("index lock").by_id.get(id).map(|x| x.status)
    }

    /// Jobs known, per status.
    pub fn counts(&self) -> HashMap<JobStatus, usize> {
        let g = self.inner.read().expect("index lock");
        g.sets.iter().filter_map(|((o, s), v)| (o.is_none()).then_some((*s)?).map(|s| (s, v.len()))).collect()
    }

    /// True once the initial load from the bucket is done.
    pub fn caught_up(&self) -> bool {
        self.inner.read().expect("index lock").caught_up
    }

    /// Loads the bucket and follows it until `shutdown`.
    pub async fn follow(kv: kv::Store, shutdown: CancellationToken) -> Arc<ListIndex> {
        let index = Arc::new(ListIndex::default());
        let me = index.clone();
        tokio::spawn(async move {
            loop {
                let mut watch = match kv.watch_with_history(">").await {
                    Ok(w) => w,
                    Err(e) => {
                        warn!(error = %e, "list index: cannot watch the bucket; retrying");
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => continue,
                        }
                    }
                };
                // An empty bucket sends nothing: count as caught up at once.
                if crate::bucket_messages(&kv).await == 0 {
                    me.inner.write().expect("index lock").caught_up = true;
                }
                loop {
                    let next = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        n = watch.next() => n,
                    };
                    match next {
                        Some(Ok(entry)) => {
                            match entry.operation {
                                // Keys that end in no job id hold no view (the projector's lease).
                                kv::Operation::Put if crate::job_of_view_key(&entry.key).is_none() => {}
                                kv::Operation::Put => {
                                    match serde_json::from_slice::<JobView>(&entry.value) {
                                        Ok(v) => me.upsert(&v),
                                        // The projector reports and holds it; the index keeps
                                        // whatever it knew of the job.
                                        Err(e) => {
                                            warn!(job_id = %entry.key, error = %e, "list index: stored view does not parse")
                                        }
                                    }
                                }
                                _ => {
                                    if let Some(id) = crate::job_of_view_key(&entry.key) {
                                        me.remove(&id);
                                    }
                                }
                            }
                            if entry.delta == 0 || entry.seen_current {
                                me.inner.write().expect("index lock").caught_up = true;
                            }
                        }
                        Some(Err(e)) => {
                            warn!(error = %e, "list index: watch error; re-watching");
                            break;
                        }
                        None => break,
                    }
                }
            }
        });
        index
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn view(n: u8, created_ns: i64, status: JobStatus) -> JobView {
        let at = chrono::Utc.timestamp_nanos(created_ns);
        let mut v: JobView = serde_json::from_value(serde_json::json!({
            "job_id": format!("{:064x}", n),
            "status": "queued",
            "updated_at": at,
            "attempt": 0, "retries": 0, "last_seq": 1
        }))
        .unwrap();
        v.created_at = Some(at);
        v.status = status;
        v
    }

    #[test]
    fn pages_newest_first_per_status_with_cursor() {
        let idx = ListIndex::default();
        for i in 0..10u8 {
            idx.upsert(&view(i, 1000 + i as i64, JobStatus::Queued));
        }
        idx.upsert(&view(3, 1003, JobStatus::Succeeded));
        idx.upsert(&view(7, 1007, JobStatus::Succeeded));
        let all = idx.page(None, 4, None);
        assert_eq!(all.iter().map(|x| x.1).collect::<Vec<_>>(), [1009, 1008, 1007, 1006]);
        let ok = idx.page(Some(JobStatus::Succeeded), 10, None);
        assert_eq!(ok.iter().map(|x| x.1).collect::<Vec<_>>(), [1007, 1003]);
        assert_eq!(idx.page(Some(JobStatus::Queued), 100, None).len(), 8);
        let c = Cursor { created_ns: all[3].1, id: all[3].0.clone() };
        let next = idx.page(None, 3, Some(&Cursor::decode(&c.encode()).unwrap()));
        assert_eq!(next.iter().map(|x| x.1).collect::<Vec<_>>(), [1005, 1004, 1003]);
        idx.remove(&all[0].0);
        assert_eq!(idx.page(None, 1, None)[0].1, 1008);
        assert_eq!(idx.counts()[&JobStatus::Succeeded], 2);
        assert_eq!(idx.status(&all[1].0), Some(JobStatus::Queued));
    }

    #[test]
    fn pages_of_one_owner_hold_only_its_jobs() {
        let idx = ListIndex::default();
        for i in 0..6u8 {
            let mut v = view(i, 1000 + i as i64, JobStatus::Queued);
            let owner = if i % 2 == 0 { "a" } else { "b" };
            v.request = Some(stemq_core_request(owner));
            idx.upsert(&v);
        }
        let a = idx.page_of(Some("a"), None, 10, None);
        assert_eq!(a.iter().map(|x| x.1).collect::<Vec<_>>(), [1004, 1002, 1000]);
        assert_eq!(idx.page_of(Some("b"), Some(JobStatus::Queued), 10, None).len(), 3);
        assert!(idx.page_of(Some("c"), None, 10, None).is_empty());
        assert_eq!(idx.page(None, 10, None).len(), 6);
    }

    #[test]
    fn counts_ended_jobs_per_minute_and_finds_the_oldest_queued() {
        let idx = ListIndex::default();
        let t0 = chrono::Utc.with_ymd_and_hms(2026, 12, 1, 10, 0, 0).unwrap();
        let ns = |s: i64| (t0 + chrono::Duration::seconds(s)).timestamp_nanos_opt().unwrap();
        let ended = |n: u8, at_s: i64, status: JobStatus| {
            let mut v = view(n, ns(0), status);
            v.finished_at = Some(t0 + chrono::Duration::seconds(at_s));
            v
        };
        idx.upsert(&ended(1, 5, JobStatus::Succeeded));
        idx.upsert(&ended(2, 59, JobStatus::Succeeded));
        idx.upsert(&ended(3, 61, JobStatus::Failed));
        idx.upsert(&ended(4, 125, JobStatus::Succeeded));
        idx.upsert(&ended(5, -600, JobStatus::Succeeded)); // before the window
                                                           // The same job seen again (a later revision) counts once.
        idx.upsert(&ended(4, 125, JobStatus::Succeeded));
        idx.upsert(&view(6, ns(-30), JobStatus::Queued));
        idx.upsert(&view(7, ns(-10), JobStatus::Queued));
        let per = idx.finished_per_minute(t0 + chrono::Duration::seconds(130), 3);
        let row = |m: &MinuteCount| (m.minute - t0.timestamp(), m.succeeded, m.other);
        assert_eq!(per.iter().map(row).collect::<Vec<_>>(), [(0, 2, 0), (60, 0, 1), (120, 1, 0)]);
        // A job that is queued again (a retry in place would not, but a removal does)
        // leaves the timeline.
        idx.remove(&ended(1, 5, JobStatus::Succeeded).job_id);
        assert_eq!(idx.finished_per_minute(t0 + chrono::Duration::seconds(130), 3)[0].succeeded, 1);
        assert_eq!(idx.oldest(JobStatus::Queued).map(|x| x.1), Some(ns(-30)));
        assert_eq!(idx.oldest(JobStatus::Running), None);
    }

    /// A view of job `n` of `model` in `lane`, created at `created_ms`.
    fn pooled(n: u8, created_ms: i64, model: &str, lane: Priority, status: JobStatus) -> JobView {
        let mut v = view(n, created_ms * 1_000_000, status);
        let body = format!(r#"{{"audio_uri":"file:///s/uploads/{n}.wav","model":"{model}"}}"#);
        v.request = Some(stemq_core::JobRequest::from_slice(body.as_bytes()).unwrap().normalize("a").unwrap());
        v.priority = (lane == Priority::Batch).then_some(lane);
        v
    }

    fn at(ms: i64) -> chrono::DateTime<chrono::Utc> {
        chrono::Utc.timestamp_millis_opt(ms).unwrap()
    }

    /// `v` running on `worker` since `since_ms` (first attempt).
    fn running(mut v: JobView, worker: &str, since_ms: i64) -> JobView {
        v.status = JobStatus::Running;
        v.attempt = 1;
        v.worker = Some(worker.into());
        v.started_at = Some(at(since_ms));
        v.updated_at = at(since_ms);
        v
    }

    /// `v` succeeded after running from `from_ms` to `to_ms` (first attempt).
    fn succeeded(v: JobView, from_ms: i64, to_ms: i64) -> JobView {
        let mut v = running(v, "w", from_ms);
        v.status = JobStatus::Succeeded;
        v.finished_at = Some(at(to_ms));
        v.updated_at = at(to_ms);
        v
    }

    fn caught_up(idx: &ListIndex) {
        idx.inner.write().unwrap().caught_up = true;
    }

    fn worker(name: &str, models: &[Model], concurrency: usize) -> WorkerInfo {
        WorkerInfo { concurrency, ..crate::registry::test_worker(name, models, 0) }
    }

    #[test]
    fn a_queued_job_counts_only_the_queued_jobs_of_its_pool_and_lane_before_it() {
        let idx = ListIndex::default();
        caught_up(&idx);
        let (i, b) = (Priority::Interactive, Priority::Batch);
        let dsp: Vec<JobView> = (0..5).map(|n| pooled(n, 1000 + n as i64, "dsp", i, JobStatus::Queued)).collect();
        // Other lanes and models, queued in between.
        let batch = pooled(10, 1001, "dsp", b, JobStatus::Queued);
        let other = pooled(11, 1002, "htdemucs", i, JobStatus::Queued);
        for v in dsp.iter().chain([&batch, &other]) {
            idx.upsert(v);
        }
        let pos = |v: &JobView| idx.place(v, &[], at(2000)).queue_position;
        assert_eq!(dsp.iter().map(pos).collect::<Vec<_>>(), [Some(0), Some(1), Some(2), Some(3), Some(4)]);
        assert_eq!((pos(&batch), pos(&other)), (Some(0), Some(0)));
        // The first one runs, the second ends (cancelled): the others move up.
        idx.upsert(&running(dsp[0].clone(), "w", 1500));
        let mut cancelled = dsp[1].clone();
        cancelled.status = JobStatus::Cancelled;
        idx.upsert(&cancelled);
        assert_eq!(dsp[2..].iter().map(pos).collect::<Vec<_>>(), [Some(0), Some(1), Some(2)]);
        // A job back in the queue after a transient failure takes its place by creation.
        idx.upsert(&dsp[0]);
        assert_eq!(dsp[2..].iter().map(pos).collect::<Vec<_>>(), [Some(1), Some(2), Some(3)]);
        // A view newer than the index (right after its submit) is placed behind the rest.
        let fresh = pooled(20, 3000, "dsp", i, JobStatus::Queued);
        assert_eq!(pos(&fresh), Some(4));
        // No place for a running or ended job, nor before the index has read the bucket.
        assert_eq!(idx.place(&running(dsp[3].clone(), "w", 1), &[], at(2000)), Place::default());
        assert_eq!(pos(&cancelled), None);
        assert_eq!(ListIndex::default().place(&dsp[4], &[], at(2000)), Place::default());
        // Forgotten jobs leave the queue.
        idx.remove(&dsp[0].job_id);
        assert_eq!(pos(&dsp[4]), Some(2));
    }

    #[test]
    fn the_typical_run_time_is_the_median_of_the_latest_successes_of_the_model() {
        let idx = ListIndex::default();
        let i = Priority::Interactive;
        assert_eq!(idx.typical_run_ms(Model::Dsp), None);
        // 25 jobs of 100..=124 ms, ended in order: the last 20 count (105..=124).
        for n in 0..25u8 {
            let end = 10_000 + 1000 * n as i64;
            idx.upsert(&succeeded(pooled(n, 1, "dsp", i, JobStatus::Queued), end - 100 - n as i64, end));
        }
        assert_eq!(idx.typical_run_ms(Model::Dsp), Some(114));
        assert_eq!(idx.typical_run_ms(Model::Htdemucs), None);
        // Failures do not count; a second attempt counts from its own start, when the
        // index saw it.
        let mut failed = succeeded(pooled(30, 1, "htdemucs", i, JobStatus::Queued), 0, 50_000);
        failed.status = JobStatus::Failed;
        idx.upsert(&failed);
        let retried = pooled(31, 1, "htdemucs", i, JobStatus::Queued);
        let mut second = running(retried.clone(), "w", 1_000);
        second.attempt = 2;
        second.updated_at = at(40_000);
        idx.upsert(&second);
        let mut done = succeeded(retried, 1_000, 43_000);
        done.attempt = 2;
        idx.upsert(&done);
        assert_eq!(idx.typical_run_ms(Model::Htdemucs), Some(3_000));
        // A second attempt whose start the index never saw tells nothing.
        let mut unseen = succeeded(pooled(32, 1, "htdemucs", i, JobStatus::Queued), 0, 44_000);
        unseen.attempt = 2;
        idx.upsert(&unseen);
        assert_eq!(idx.typical_run_ms(Model::Htdemucs), Some(3_000));
        // A job forgotten takes its run time along.
        idx.remove(&done.job_id);
        assert_eq!(idx.typical_run_ms(Model::Htdemucs), None);
    }

    #[test]
    fn the_eta_comes_from_the_jobs_ahead_the_slots_and_the_typical_run() {
        let idx = ListIndex::default();
        caught_up(&idx);
        let (i, b) = (Priority::Interactive, Priority::Batch);
        let workers = [worker("w1", &[Model::Dsp], 1)];
        let queued: Vec<JobView> = (0..3).map(|n| pooled(n, 100 + n as i64, "dsp", i, JobStatus::Queued)).collect();
        for v in &queued {
            idx.upsert(v);
        }
        // No run time yet: a position, no eta.
        assert_eq!(idx.place(&queued[0], &workers, at(1000)), Place { queue_position: Some(0), eta_ms: None });
        idx.upsert(&succeeded(pooled(9, 1, "dsp", i, JobStatus::Queued), 0, 1000));
        // w1 runs a job since 9 500 ms (1 000 ms typical, so it ends at 10 500); now is
        // 10 000: the queue starts at 10 500 and each job takes 1 000 ms.
        let busy = running(pooled(8, 50, "dsp", i, JobStatus::Queued), "w1", 9_500);
        idx.upsert(&busy);
        let eta = |v: &JobView, w: &[WorkerInfo]| idx.place(v, w, at(10_000)).eta_ms;
        assert_eq!(
            queued.iter().map(|v| eta(v, &workers)).collect::<Vec<_>>(),
            [Some(11_500), Some(12_500), Some(13_500)]
        );
        // The running job itself.
        assert_eq!(eta(&busy, &workers), Some(10_500));
        // A batch job waits for every queued interactive job of its pool too.
        let batch = pooled(20, 10, "dsp", b, JobStatus::Queued);
        idx.upsert(&batch);
        assert_eq!(idx.place(&batch, &workers, at(10_000)), Place { queue_position: Some(0), eta_ms: Some(14_500) });
        // A second worker with two slots, free: three slots take the queue.
        let more = [workers[0].clone(), worker("w2", &[Model::Dsp, Model::Htdemucs], 2)];
        assert_eq!(
            queued.iter().map(|v| eta(v, &more)).collect::<Vec<_>>(),
            [Some(11_000), Some(11_000), Some(11_500)]
        );
        // No live worker of the model: no eta, the position stays.
        let elsewhere = [worker("w3", &[Model::Htdemucs], 4)];
        assert_eq!(idx.place(&queued[2], &elsewhere, at(10_000)), Place { queue_position: Some(2), eta_ms: None });
        assert_eq!(eta(&queued[2], &[]), None);
    }

    fn stemq_core_request(owner: &str) -> stemq_core::NormalizedRequest {
        stemq_core::JobRequest::from_slice(br#"{"audio_uri":"file:///s/uploads/x.wav"}"#)
            .unwrap()
            .normalize(owner)
            .unwrap()
    }
}
