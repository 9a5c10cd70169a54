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
//! operators' throughput over the last minutes is a walk of a B-tree too.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::{JobId, JobStatus, JobView};

type Key = (Reverse<i64>, JobId);

/// The sets a page can be taken from: every job, or one owner's (`Some(owner)`), of
/// every status or of one.
type SetKey = (Option<String>, Option<JobStatus>);

#[derive(Default)]
struct Inner {
    by_id: HashMap<JobId, (i64, JobStatus, String)>,
    sets: HashMap<SetKey, BTreeSet<Key>>,
    /// Ended jobs by when they ended (Unix ms), with how.
    finished: BTreeMap<(i64, JobId), JobStatus>,
    /// When each ended job ended (the key into `finished`).
    finished_at: HashMap<JobId, i64>,
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
        let created = created_key(view);
        let owner = view.owner().to_string();
        let mut g = self.inner.write().expect("index lock");
        if let Some((old_created, old_status, old_owner)) = g.by_id.get(&view.job_id).cloned() {
            if old_created == created && old_status == view.status && old_owner == owner {
                return;
            }
            let k = (Reverse(old_created), view.job_id.clone());
            for sk in Inner::set_keys(&old_owner, old_status) {
                if let Some(s) = g.sets.get_mut(&sk) {
                    s.remove(&k);
                }
            }
        }
        let k = (Reverse(created), view.job_id.clone());
        for sk in Inner::set_keys(&owner, view.status) {
            g.sets.entry(sk).or_default().insert(k.clone());
        }
        g.by_id.insert(view.job_id.clone(), (created, view.status, owner));
        Self::track_finish(&mut g, view);
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
        if let Some((created, status, owner)) = g.by_id.remove(id) {
            let k = (Reverse(created), id.clone());
            for sk in Inner::set_keys(&owner, status) {
                if let Some(s) = g.sets.get_mut(&sk) {
                    s.remove(&k);
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
        self.inner.read().expect("index lock").by_id.get(id).map(|x| x.1)
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
                if kv.status().await.map(|s| s.values() == 0).unwrap_or(false) {
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
                                    if let Some(id) = JobId::parse(&entry.key) {
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

    fn stemq_core_request(owner: &str) -> crate::NormalizedRequest {
        crate::JobRequest::from_slice(br#"{"audio_uri":"file:///s/uploads/x.wav"}"#).unwrap().normalize(owner).unwrap()
    }
}
