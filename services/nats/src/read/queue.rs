//! Where a job stands in its queue, and when it should be done.
//!
//! This module owns the arithmetic behind the read-time fields `queue_position`, `eta`
//! and `eta_seconds` of a job's view; the [`ListIndex`](super::ListIndex) feeds it the
//! facts (the queued jobs of each pool and lane, the running jobs and where they run,
//! recent run times) and the worker registry the slots. Everything here is pure, so
//! the estimate is tested without a clock or a server.
//!
//! The model, in the words of the API docs (`docs/events.md`, "Queue position and
//! ETA"): every slot of a live worker that serves the model takes the next job as soon
//! as it is free, and every job takes the model's typical run time (the median of its
//! last [`RUN_TIME_WINDOW`] successful jobs, start to outcome). A slot is free now, or
//! when the job running on it is expected to finish. The job's start is when the
//! `ahead + 1`-th free slot comes up; its `eta` is that start plus the typical run time.
//! Times are Unix milliseconds.

use chrono::{DateTime, Utc};

use stemq_core::JobView;

/// How many of a model's most recent successful jobs make its typical run time.
pub const RUN_TIME_WINDOW: usize = 20;

/// Progress (percent) from which a running job's own progress predicts its end better
/// than the model's typical run time.
pub const PROGRESS_TRUSTED_FROM: f32 = 10.0;

/// A job's place, as the API adds it to its view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Place {
    /// See [`JobView::queue_position`].
    pub queue_position: Option<u64>,
    /// Expected end, Unix ms (see [`JobView::eta`]).
    pub eta_ms: Option<i64>,
}

impl Place {
    /// Writes the place into `view` as answered at `now` (`eta_seconds` counts from it).
    pub fn write_into(self, view: &mut JobView, now: DateTime<Utc>) {
        view.queue_position = self.queue_position;
        view.eta = self.eta_ms.and_then(DateTime::<Utc>::from_timestamp_millis);
        view.eta_seconds = self.eta_ms.map(|eta| {
            let ms = (eta - now.timestamp_millis()).max(0) as u64;
            ms.div_ceil(1000)
        });
    }
}

/// The typical run time of `samples` (ms): their median (the mean of the middle two
/// for an even count); `None` without samples.
pub fn typical(samples: impl IntoIterator<Item = i64>) -> Option<i64> {
    let mut v: Vec<i64> = samples.into_iter().collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2 })
}

/// When a job running since `started` (ms) is expected to end, at `now`: extrapolated
/// from its progress (`percent` reached at `at`, ms) once that says enough
/// ([`PROGRESS_TRUSTED_FROM`]), else its start plus the typical run time `run` while that
/// lies ahead, else from any progress at all; `None` when nothing tells (past its
/// typical time, no progress), and never in the past.
///
/// Progress is extrapolated from when it was reported, not from `now`: a view's progress
/// is as old as its last progress event, and dividing the time elapsed since the start
/// by a stale percent would push the end out further at every look.
pub fn running_end(started: i64, now: i64, run: Option<i64>, progress: Option<(f32, i64)>) -> Option<i64> {
    let by_progress = progress.filter(|(p, _)| *p > 0.0 && *p < 100.0).map(|(p, at)| {
        let elapsed = (at - started).max(0);
        (started + (elapsed as f64 * 100.0 / p as f64) as i64, p)
    });
    if let Some((end, p)) = by_progress {
        if p >= PROGRESS_TRUSTED_FROM {
            return Some(end.max(now));
        }
    }
    match run.map(|r| started + r) {
        Some(end) if end > now => Some(end),
        _ => by_progress.map(|(end, _)| end.max(now)),
    }
}

/// When the job with `ahead` jobs before it starts, given when each slot frees (`free`,
/// ms, any order) and that every job takes `run` ms: each job takes the earliest free
/// slot. `None` without slots.
///
/// Simulated job by job only while the slots' free times spread over more than one
/// run; from then on the slots take jobs in turn, and the rest is arithmetic, so a
/// queue of a million costs no more than one of ten.
pub fn start_of(free: &[i64], ahead: u64, run: i64) -> Option<i64> {
    if free.is_empty() {
        return None;
    }
    let run = run.max(1);
    let mut slots = std::collections::BinaryHeap::new();
    let mut latest = i64::MIN;
    for f in free {
        slots.push(std::cmp::Reverse(*f));
        latest = latest.max(*f);
    }
    let mut ahead = ahead;
    loop {
        let std::cmp::Reverse(first) = *slots.peek().expect("slots");
        if latest - first <= run {
            break;
        }
        if ahead == 0 {
            return Some(first);
        }
        slots.pop();
        slots.push(std::cmp::Reverse(first + run));
        latest = latest.max(first + run);
        ahead -= 1;
    }
    // Every slot frees within one run of the first: they take jobs in turn, earliest
    // first, each one run later than its previous job.
    let mut sorted: Vec<i64> = slots.into_iter().map(|std::cmp::Reverse(f)| f).collect();
    sorted.sort_unstable();
    let n = sorted.len() as u64;
    let rounds = i64::try_from(ahead / n).unwrap_or(i64::MAX);
    Some(sorted[(ahead % n) as usize].saturating_add(rounds.saturating_mul(run)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_typical_run_is_the_median() {
        assert_eq!(typical([]), None);
        assert_eq!(typical([300]), Some(300));
        assert_eq!(typical([100, 900, 300]), Some(300));
        // One outlier does not move it.
        assert_eq!(typical([250, 260, 240, 30_000]), Some(255));
    }

    #[test]
    fn free_slots_take_the_queue_in_turns() {
        // One slot, free now (t = 0), 250 ms per job: the 5th job (4 ahead) starts at 1 s.
        assert_eq!(start_of(&[0], 0, 250), Some(0));
        assert_eq!(start_of(&[0], 4, 250), Some(1000));
        // Two slots: jobs go two by two.
        assert_eq!(start_of(&[0, 0], 4, 250), Some(500));
        assert_eq!(start_of(&[0, 0], 5, 250), Some(500));
        assert_eq!(start_of(&[0, 0], 6, 250), Some(750));
        // No slot: no start.
        assert_eq!(start_of(&[], 0, 250), None);
    }

    #[test]
    fn a_busy_slot_is_taken_when_its_job_ends() {
        // One slot busy until 100, one until 200, 250 ms per job.
        assert_eq!(start_of(&[200, 100], 0, 250), Some(100));
        assert_eq!(start_of(&[200, 100], 1, 250), Some(200));
        assert_eq!(start_of(&[200, 100], 2, 250), Some(350));
        assert_eq!(start_of(&[200, 100], 3, 250), Some(450));
    }

    #[test]
    fn slots_far_apart_are_simulated_until_they_take_turns() {
        // A slot busy for 10 s more (a long job of another model on a shared worker),
        // one free now, 1 s per job: the free one takes the first ten jobs alone.
        let free = [10_000, 0];
        for ahead in 0..10 {
            assert_eq!(start_of(&free, ahead, 1000), Some(ahead as i64 * 1000), "ahead {ahead}");
        }
        assert_eq!(start_of(&free, 10, 1000), Some(10_000));
        assert_eq!(start_of(&free, 11, 1000), Some(10_000));
        assert_eq!(start_of(&free, 12, 1000), Some(11_000));
        // Against a plain simulation, for a big queue too.
        let naive = |free: &[i64], ahead: u64, run: i64| {
            let mut f = free.to_vec();
            for _ in 0..ahead {
                let i = (0..f.len()).min_by_key(|i| f[*i]).unwrap();
                f[i] += run;
            }
            *f.iter().min().unwrap()
        };
        let free = [5_000, 0, 1_200, 7];
        for ahead in [0, 1, 3, 17, 100, 999] {
            assert_eq!(start_of(&free, ahead, 700), Some(naive(&free, ahead, 700)), "ahead {ahead}");
        }
        assert_eq!(start_of(&[0], 1_000_000, 250), Some(250_000_000));
    }

    #[test]
    fn a_running_job_ends_by_its_progress_or_else_by_the_typical_run() {
        // Started at 0, typical 1 000 ms.
        assert_eq!(running_end(0, 400, Some(1000), None), Some(1000));
        assert_eq!(running_end(0, 400, Some(1000), Some((5.0, 400))), Some(1000)); // too little progress to tell
        assert_eq!(running_end(0, 400, Some(1000), Some((20.0, 400))), Some(2000)); // 20 % in 400 ms
        assert_eq!(running_end(0, 400, None, Some((50.0, 400))), Some(800));
        // Progress counts from when it was reported: 20 % at 100 ms, looked at later.
        assert_eq!(running_end(0, 400, Some(1000), Some((20.0, 100))), Some(500));
        assert_eq!(running_end(0, 450, Some(1000), Some((20.0, 100))), Some(500));
        // Past its typical time: progress, if any, else unknown.
        assert_eq!(running_end(0, 1500, Some(1000), None), None);
        assert_eq!(running_end(0, 1500, Some(1000), Some((5.0, 1500))), Some(30_000));
        // Never in the past.
        assert_eq!(running_end(0, 1500, Some(1000), Some((99.99, 1500))), Some(1500));
        assert_eq!(running_end(0, 1500, Some(1000), Some((50.0, 100))), Some(1500));
    }

    #[test]
    fn the_answer_counts_whole_seconds_up_to_the_eta() {
        let now = DateTime::<Utc>::from_timestamp_millis(1_000_000).unwrap();
        let mut v: JobView = serde_json::from_value(serde_json::json!({
            "job_id": "0".repeat(64), "status": "queued", "updated_at": now, "attempt": 0, "retries": 0, "last_seq": 1
        }))
        .unwrap();
        Place { queue_position: Some(3), eta_ms: Some(1_002_001) }.write_into(&mut v, now);
        assert_eq!((v.queue_position, v.eta_seconds), (Some(3), Some(3)));
        assert_eq!(v.eta.unwrap().timestamp_millis(), 1_002_001);
        Place { queue_position: None, eta_ms: Some(999_000) }.write_into(&mut v, now);
        assert_eq!((v.queue_position, v.eta_seconds), (None, Some(0)));
        Place::default().write_into(&mut v, now);
        assert_eq!((v.eta, v.eta_seconds), (None, None));
    }
}
