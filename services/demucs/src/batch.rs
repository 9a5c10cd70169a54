//! Cross-job batching: chunks of different jobs that run the same model share one
//! forward pass.
//!
//! This module owns the meeting point, [`Hub`], one per loaded bag. A bag with a hub
//! sends every forward pass through it (`BagOfModels::forward`); each
//! job that runs on the bag holds a [`JobSlot`] for as long as it runs. The hub runs one
//! forward at a time, as a device does: passes that arrive while one runs wait, and
//! make the next one. When the engine is idle, a waiting pass runs, taking along every
//! waiting pass of the same model and input shape that fits, up to `max_rows` segments
//! in all, as soon as one of these holds:
//!
//! - the waiting passes already fill `max_rows`;
//! - every job on the bag has a pass waiting (a job is known by the slot its thread
//!   holds, so the passes a job runs on several threads count once);
//! - the engine has been idle for `linger` since the pass arrived (a job between
//!   chunks, reading or encoding, is not waited for longer than that).
//!
//! Jobs that start apart fall into step: the linger only counts while the engine is
//! idle, so a job whose pass waited through another job's forward still waits for that
//! job's next pass. A job alone on the bag never waits for the linger.
//!
//! The caller whose pass leads the
//! shared forward runs it on its own thread; the others sleep until their rows are cut
//! out of the result. Each segment of a forward pass is computed on its own (per-item
//! normalisation, attention within the item), so a job's stems do not depend on who it
//! shared its passes with: `tests/engine.rs` checks they are bit for bit the same.
//!
//! Failures reach every job of the shared pass: an error as
//! [`DemucsError::SharedPass`] (with the leader's message), a panic (a device out of
//! memory) as a panic with the same message, so each job's out-of-memory ladder sees
//! it.

use std::cell::Cell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::checkpoint::HostTensor;
use crate::error::DemucsError;

/// How jobs share forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrossJobBatching {
    /// Segments per shared forward pass, at most (2 or more; a job's own batch counts).
    pub max_rows: usize,
    /// How long a pass waits for the passes of other jobs.
    pub linger: Duration,
}

/// Which passes can share a forward: same model of the bag, same input shape, same
/// training length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(crate) model: usize,
    pub(crate) channels: usize,
    pub(crate) length: usize,
    pub(crate) training_length: usize,
}

/// Counters of a hub (for tests, benchmarks and logs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Forward passes run.
    pub forwards: u64,
    /// Forward passes that carried the passes of more than one caller.
    pub shared: u64,
    /// Segments (rows) run, over all forward passes.
    pub rows: u64,
}

/// The meeting point of one bag's forward passes.
#[derive(Debug)]
pub struct Hub {
    config: CrossJobBatching,
    /// Segments that fit the memory budget in one forward ([`Hub::limit_rows`]).
    row_limit: AtomicUsize,
    next_job: AtomicU64,
    state: Mutex<State>,
    changed: Condvar,
    forwards: AtomicU64,
    shared: AtomicU64,
    rows: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    /// Jobs holding a [`JobSlot`].
    jobs: usize,
    /// A shared forward is running.
    running: bool,
    /// When the last forward ended.
    idle_since: Option<Instant>,
    next_id: u64,
    waiting: Vec<Waiting>,
    /// Results of passes run by another caller, by pass id.
    done: HashMap<u64, Outcome>,
}

#[derive(Debug)]
struct Waiting {
    id: u64,
    /// The job it is of ([`current_job`], or a number of its own).
    job: u64,
    key: Key,
    input: HostTensor,
}

#[derive(Debug)]
enum Outcome {
    Ok(HostTensor),
    Failed(String),
    Panicked(String),
}

thread_local! {
    /// The job whose slot this thread holds ([`Hub::join`]).
    static CURRENT_JOB: Cell<Option<u64>> = const { Cell::new(None) };
}

/// The job whose slot the calling thread holds, if any: the forward passes it starts
/// (on this thread or on threads it spawns for them) are that job's.
pub(crate) fn current_job() -> Option<u64> {
    CURRENT_JOB.with(Cell::get)
}

/// A job's presence on a bag with a hub, held by the thread that runs the job (it is not
/// `Send`); dropping it leaves.
#[derive(Debug)]
pub struct JobSlot<'h> {
    hub: Option<&'h Hub>,
    /// What the thread held before, restored on drop.
    previous: Option<u64>,
    _thread: PhantomData<*const ()>,
}

impl Drop for JobSlot<'_> {
    fn drop(&mut self) {
        if let Some(hub) = self.hub {
            CURRENT_JOB.with(|c| c.set(self.previous));
            hub.lock().jobs -= 1;
            hub.changed.notify_all();
        }
    }
}

impl JobSlot<'_> {
    /// A slot of a bag without a hub.
    pub(crate) fn none() -> Self {
        JobSlot { hub: None, previous: None, _thread: PhantomData }
    }
}

impl Hub {
    /// A hub; `max_rows` below 2 is taken as 2.
    pub fn new(config: CrossJobBatching) -> Self {
        Hub {
            config: CrossJobBatching { max_rows: config.max_rows.max(2), linger: config.linger },
            row_limit: AtomicUsize::new(usize::MAX),
            next_job: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            forwards: AtomicU64::new(0),
            shared: AtomicU64::new(0),
            rows: AtomicU64::new(0),
        }
    }

    /// Its settings.
    pub fn config(&self) -> CrossJobBatching {
        self.config
    }

    /// Caps the segments of one shared forward at `rows` (at least 1: no sharing), for
    /// a memory budget that does not fit `max_rows` of them.
    pub fn limit_rows(&self, rows: usize) {
        self.row_limit.fetch_min(rows.max(1), Ordering::Relaxed);
    }

    /// Segments one shared forward may take now.
    pub fn max_rows(&self) -> usize {
        self.config.max_rows.min(self.row_limit.load(Ordering::Relaxed))
    }

    /// The counters so far.
    pub fn stats(&self) -> BatchStats {
        BatchStats {
            forwards: self.forwards.load(Ordering::Relaxed),
            shared: self.shared.load(Ordering::Relaxed),
            rows: self.rows.load(Ordering::Relaxed),
        }
    }

    /// Registers a job, run by the calling thread, for as long as the slot lives.
    pub fn join(&self) -> JobSlot<'_> {
        let id = self.next_job.fetch_add(1, Ordering::Relaxed);
        let previous = CURRENT_JOB.with(|c| c.replace(Some(id)));
        self.lock().jobs += 1;
        JobSlot { hub: Some(self), previous, _thread: PhantomData }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `input` (`[B, C, L]`) through `forward`, possibly together with the waiting
    /// inputs of other callers with the same key; returns this input's rows of the
    /// output (`[B, …]`).
    pub(crate) fn forward(
        &self,
        key: Key,
        job: Option<u64>,
        input: HostTensor,
        forward: impl FnOnce(&HostTensor) -> Result<HostTensor, DemucsError>,
    ) -> Result<HostTensor, DemucsError> {
        let max_rows = self.max_rows();
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        // A pass of no job counts as a job of its own.
        let job = job.unwrap_or(u64::MAX - id);
        let arrived = Instant::now();
        state.waiting.push(Waiting { id, job, key, input });
        self.changed.notify_all();
        let group = loop {
            if let Some(outcome) = state.done.remove(&id) {
                return match outcome {
                    Outcome::Ok(t) => Ok(t),
                    Outcome::Failed(m) => Err(DemucsError::SharedPass(m)),
                    Outcome::Panicked(m) => panic!("{m}"),
                };
            }
            // Taken into another caller's forward: wait for its result. Or, one shared
            // forward at a time: the passes that arrive meanwhile make the next one.
            let mine = match state.waiting.iter().position(|w| w.id == id) {
                Some(mine) if !state.running => mine,
                _ => {
                    state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
                    continue;
                }
            };
            let rows: usize = state.waiting.iter().filter(|w| w.key == key).map(|w| w.input.shape[0]).sum();
            let mut waiting_jobs: Vec<u64> = state.waiting.iter().map(|w| w.job).collect();
            waiting_jobs.sort_unstable();
            waiting_jobs.dedup();
            let everyone_in = waiting_jobs.len() >= state.jobs;
            // The linger counts while the engine is idle, not while it runs a forward.
            let deadline = arrived.max(state.idle_since.unwrap_or(arrived)) + self.config.linger;
            let now = Instant::now();
            if rows >= max_rows || everyone_in || now >= deadline {
                // Lead: this pass first, then the others of its key in arrival order.
                let mut group = vec![state.waiting.remove(mine)];
                let mut taken = group[0].input.shape[0];
                let mut i = 0;
                while i < state.waiting.len() {
                    let w = &state.waiting[i];
                    if w.key == key && taken + w.input.shape[0] <= max_rows {
                        taken += w.input.shape[0];
                        group.push(state.waiting.remove(i));
                    } else {
                        i += 1;
                    }
                }
                state.running = true;
                break group;
            }
            state = self.changed.wait_timeout(state, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        };
        drop(state);
        let n = group.len();
        let rows: usize = group.iter().map(|w| w.input.shape[0]).sum();
        self.forwards.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        if n == 1 {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| forward(&group[0].input)));
            self.finish(Vec::new());
            return out.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        }
        self.shared.fetch_add(1, Ordering::Relaxed);
        let merged = merge(&group);
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| forward(&merged)));
        drop(merged);
        let others = group[1..].iter().map(|w| w.id);
        match out {
            Ok(Ok(out)) => {
                let mut parts = split(out, group.iter().map(|w| w.input.shape[0])).into_iter();
                let mine = parts.next().expect("one part per pass");
                self.finish(others.zip(parts.map(Outcome::Ok)).collect());
                Ok(mine)
            }
            Ok(Err(e)) => {
                let message = e.to_string();
                self.finish(others.map(|id| (id, Outcome::Failed(message.clone()))).collect());
                Err(e)
            }
            Err(panic) => {
                let message = stemq_core::engine::panic_message(panic.as_ref())
                    .unwrap_or_else(|| "a shared forward pass panicked".into());
                self.finish(others.map(|id| (id, Outcome::Panicked(message.clone()))).collect());
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// Hands the other callers their outcomes; the forward is over.
    fn finish(&self, outcomes: Vec<(u64, Outcome)>) {
        let mut state = self.lock();
        state.running = false;
        state.idle_since = Some(Instant::now());
        state.done.extend(outcomes);
        drop(state);
        self.changed.notify_all();
    }
}

/// The inputs of `group` stacked on the batch axis.
fn merge(group: &[Waiting]) -> HostTensor {
    let mut shape = group[0].input.shape.clone();
    shape[0] = group.iter().map(|w| w.input.shape[0]).sum();
    let mut data = Vec::with_capacity(shape.iter().product());
    for w in group {
        data.extend_from_slice(&w.input.data);
    }
    HostTensor { shape, data }
}

/// `out` (`[ΣB, …]`) cut back into parts of `rows` items each.
fn split(out: HostTensor, rows: impl Iterator<Item = usize>) -> Vec<HostTensor> {
    let per_row: usize = out.shape[1..].iter().product();
    let mut parts = Vec::new();
    let mut at = 0;
    for b in rows {
        let mut shape = out.shape.clone();
        shape[0] = b;
        parts.push(HostTensor { shape, data: out.data[at * per_row..(at + b) * per_row].to_vec() });
        at += b;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn key() -> Key {
        Key { model: 0, channels: 1, length: 3, training_length: 3 }
    }

    fn input(b: usize, v: f32) -> HostTensor {
        HostTensor { shape: vec![b, 1, 3], data: (0..b * 3).map(|i| v + i as f32).collect() }
    }

    /// A forward that doubles every value and records the batch it saw.
    fn double(seen: &Mutex<Vec<usize>>) -> impl FnOnce(&HostTensor) -> Result<HostTensor, DemucsError> + '_ {
        move |x| {
            seen.lock().unwrap().push(x.shape[0]);
            std::thread::sleep(Duration::from_millis(20));
            Ok(HostTensor { shape: x.shape.clone(), data: x.data.iter().map(|v| v * 2.0).collect() })
        }
    }

    #[test]
    fn a_job_alone_runs_at_once() {
        let hub = Hub::new(CrossJobBatching { max_rows: 4, linger: Duration::from_secs(30) });
        let _job = hub.join();
        let seen = Mutex::new(Vec::new());
        let t0 = Instant::now();
        let out = hub.forward(key(), current_job(), input(1, 1.0), double(&seen)).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "waited for nobody: {:?}", t0.elapsed());
        assert_eq!(out.data, vec![2.0, 4.0, 6.0]);
        assert_eq!(hub.stats(), BatchStats { forwards: 1, shared: 0, rows: 1 });
    }

    #[test]
    fn passes_of_two_jobs_share_one_forward_and_get_their_own_rows() {
        let hub = Arc::new(Hub::new(CrossJobBatching { max_rows: 4, linger: Duration::from_secs(30) }));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let threads: Vec<_> = [(1usize, 10.0f32), (2, 100.0)]
            .into_iter()
            .map(|(b, v)| {
                let (hub, seen, barrier) = (hub.clone(), seen.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let _job = hub.join();
                    barrier.wait();
                    hub.forward(key(), current_job(), input(b, v), double(&seen)).unwrap()
                })
            })
            .collect();
        let outs: Vec<HostTensor> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(outs[0], HostTensor { shape: vec![1, 1, 3], data: vec![20.0, 22.0, 24.0] });
        assert_eq!(outs[1].shape, vec![2, 1, 3]);
        assert_eq!(outs[1].data, (0..6).map(|i| 2.0 * (100.0 + i as f32)).collect::<Vec<_>>());
        // Both jobs were in: one forward of 3 rows, no linger (30 s) waited out.
        assert_eq!(*seen.lock().unwrap(), vec![3]);
        assert_eq!(hub.stats(), BatchStats { forwards: 1, shared: 1, rows: 3 });
    }

    #[test]
    fn a_full_batch_leaves_the_rest_for_the_next_forward_and_other_keys_never_mix() {
        let hub = Arc::new(Hub::new(CrossJobBatching { max_rows: 2, linger: Duration::from_secs(30) }));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let other = Key { length: 4, ..key() };
        let threads: Vec<_> = [(key(), 1.0f32), (key(), 2.0), (key(), 3.0), (other, 4.0)]
            .into_iter()
            .map(|(k, v)| {
                let (hub, seen, barrier) = (hub.clone(), seen.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let _job = hub.join();
                    barrier.wait();
                    let x = HostTensor { shape: vec![1, 1, k.length], data: vec![v; k.length] };
                    hub.forward(k, current_job(), x, double(&seen)).unwrap()
                })
            })
            .collect();
        for (t, v) in threads.into_iter().zip([1.0f32, 2.0, 3.0, 4.0]) {
            let out = t.join().unwrap();
            assert!(out.data.iter().all(|x| *x == 2.0 * v), "{v}: {out:?}");
        }
        let mut seen = seen.lock().unwrap().clone();
        seen.sort();
        assert_eq!(seen, vec![1, 1, 2], "never more than 2 rows, never two keys in one forward");
    }

    /// A job whose passes run on two threads is one job: its two passes wait for the
    /// other job's, and the three run as one forward.
    #[test]
    fn passes_of_one_job_on_two_threads_wait_for_the_other_job() {
        let hub = Arc::new(Hub::new(CrossJobBatching { max_rows: 4, linger: Duration::from_secs(30) }));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let two = {
            let (hub, seen, barrier) = (hub.clone(), seen.clone(), barrier.clone());
            std::thread::spawn(move || {
                let _job = hub.join();
                let job = current_job();
                barrier.wait();
                std::thread::scope(|scope| {
                    for v in [1.0, 2.0] {
                        let (hub, seen) = (&hub, &seen);
                        scope.spawn(move || hub.forward(key(), job, input(1, v), double(seen)).unwrap());
                    }
                });
            })
        };
        let _job = hub.join();
        barrier.wait();
        // The other job's passes are waiting (or about to): this one joins them.
        std::thread::sleep(Duration::from_millis(100));
        hub.forward(key(), current_job(), input(1, 3.0), double(&seen)).unwrap();
        two.join().unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![3], "one forward of the three passes");
    }

    /// A memory budget that fits one segment per forward: jobs do not share then.
    #[test]
    fn a_row_limit_below_two_stops_the_sharing() {
        let hub = Arc::new(Hub::new(CrossJobBatching { max_rows: 4, linger: Duration::from_millis(10) }));
        hub.limit_rows(8);
        assert_eq!(hub.max_rows(), 4, "a limit above the setting changes nothing");
        hub.limit_rows(0);
        assert_eq!(hub.max_rows(), 1);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let threads: Vec<_> = (0..2)
            .map(|v| {
                let (hub, seen, barrier) = (hub.clone(), seen.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let _job = hub.join();
                    barrier.wait();
                    hub.forward(key(), current_job(), input(1, v as f32), double(&seen)).unwrap()
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*seen.lock().unwrap(), vec![1, 1]);
    }

    #[test]
    fn a_job_between_chunks_is_waited_for_at_most_the_linger() {
        let hub = Hub::new(CrossJobBatching { max_rows: 4, linger: Duration::from_millis(50) });
        // Another job, run by another thread, that sends no pass.
        let other = std::thread::scope(|scope| scope.spawn(|| std::mem::forget(hub.join())).join());
        other.unwrap();
        let _job = hub.join();
        let seen = Mutex::new(Vec::new());
        let t0 = Instant::now();
        hub.forward(key(), current_job(), input(1, 0.0), double(&seen)).unwrap();
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(50), "the other job was given its linger: {waited:?}");
        assert_eq!(*seen.lock().unwrap(), vec![1]);
    }

    #[test]
    fn a_failed_or_panicking_shared_forward_reaches_every_job() {
        for panics in [false, true] {
            let hub = Arc::new(Hub::new(CrossJobBatching { max_rows: 4, linger: Duration::from_secs(30) }));
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let (hub, barrier) = (hub.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let _job = hub.join();
                        barrier.wait();
                        hub.forward(key(), current_job(), input(1, 0.0), |_| {
                            std::thread::sleep(Duration::from_millis(20));
                            if panics {
                                panic!("CUDA_ERROR_OUT_OF_MEMORY: out of memory");
                            }
                            Err(DemucsError::InvalidArgument("bad input".into()))
                        })
                    })
                })
                .collect();
            for t in threads {
                match t.join() {
                    Ok(Err(e)) if !panics => assert!(e.to_string().contains("bad input"), "{e}"),
                    Err(panic) if panics => {
                        let m = stemq_core::engine::panic_message(panic.as_ref()).unwrap();
                        assert!(crate::engine::is_out_of_memory(&m), "{m}");
                    }
                    other => panic!("panics={panics}: {:?}", other.map(|r| r.map(|t| t.shape))),
                }
            }
            assert!(!hub.lock().running);
            assert!(hub.lock().done.is_empty());
        }
    }
}
