//! The relay's one piece of per-job memory: the last progress percent seen per job, so
//! that progress heartbeats repeating the same figure are not delivered again.
//!
//! It is an optimisation, never a source of truth: losing an entry only means one more
//! progress webhook. So it is bounded (the least recently updated job goes first when
//! it is full) and an entry goes as soon as its job ends, whatever the job's webhook
//! asks for.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use stemq_core::JobId;

/// Last progress percent per job, bounded; cheap to clone (clones share the memory).
#[derive(Clone)]
pub struct ProgressMemo {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    cap: usize,
    /// Job → (percent, tick of its last update).
    by_job: HashMap<JobId, (i32, u64)>,
    /// Tick → job: the eviction order (oldest first).
    by_tick: BTreeMap<u64, JobId>,
    tick: u64,
}

impl std::fmt::Debug for ProgressMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.inner.lock().expect("lock");
        f.debug_struct("ProgressMemo").field("cap", &i.cap).field("len", &i.by_job.len()).finish()
    }
}

impl ProgressMemo {
    /// An empty memo holding at most `cap` jobs (at least one).
    pub fn new(cap: usize) -> ProgressMemo {
        ProgressMemo {
            inner: Arc::new(Mutex::new(Inner {
                cap: cap.max(1),
                by_job: HashMap::new(),
                by_tick: BTreeMap::new(),
                tick: 0,
            })),
        }
    }

    /// Records `percent` for `job`; true when it differs from the last one recorded
    /// (or there was none), i.e. when the progress is news.
    pub fn changed(&self, job: &JobId, percent: i32) -> bool {
        let mut i = self.inner.lock().expect("lock");
        i.tick += 1;
        let tick = i.tick;
        let previous = i.by_job.insert(job.clone(), (percent, tick));
        if let Some((_, old_tick)) = previous {
            i.by_tick.remove(&old_tick);
        }
        i.by_tick.insert(tick, job.clone());
        while i.by_job.len() > i.cap {
            let Some((_, oldest)) = i.by_tick.pop_first() else { break };
            i.by_job.remove(&oldest);
        }
        previous.map(|(p, _)| p) != Some(percent)
    }

    /// Forgets `job` (it ended).
    pub fn forget(&self, job: &JobId) {
        let mut i = self.inner.lock().expect("lock");
        if let Some((_, tick)) = i.by_job.remove(job) {
            i.by_tick.remove(&tick);
        }
    }

    /// True when `job` has an entry.
    pub fn contains(&self, job: &JobId) -> bool {
        self.inner.lock().expect("lock").by_job.contains_key(job)
    }

    /// Number of jobs remembered.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("lock").by_job.len()
    }

    /// True when no job is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(n: u8) -> JobId {
        JobId::parse(&format!("{n:02x}").repeat(32)).expect("a job id")
    }

    #[test]
    fn repeats_are_not_news_and_changes_are() {
        let m = ProgressMemo::new(10);
        assert!(m.changed(&job(1), 10));
        assert!(!m.changed(&job(1), 10));
        assert!(m.changed(&job(1), 11));
        m.forget(&job(1));
        assert!(!m.contains(&job(1)));
        assert!(m.changed(&job(1), 11), "after forget, the same figure is news again");
    }

    #[test]
    fn it_is_bounded_and_evicts_the_least_recently_updated() {
        let m = ProgressMemo::new(3);
        for n in 1..=3 {
            m.changed(&job(n), 1);
        }
        m.changed(&job(1), 2); // job 1 is now the most recent
        m.changed(&job(4), 1); // full: job 2 (oldest) goes
        assert_eq!(m.len(), 3);
        assert!(!m.contains(&job(2)));
        assert!(m.contains(&job(1)) && m.contains(&job(3)) && m.contains(&job(4)));
        for n in 10..200 {
            m.changed(&job(n), 5);
        }
        assert_eq!(m.len(), 3);
    }
}
