//! The lanes: every job event goes to the lane of its job (a hash of the id), so one
//! process applies a job's events in order while lanes run concurrently. A lane takes
//! what has arrived as one batch, holds the writes of unfinished jobs up to
//! [`LINGER`], and has the writes of all the batch's jobs in flight together.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv, AckKind};
use futures::StreamExt;
use stemq_core::{Event, JobId, Position};
use stemq_nats as names;
use stemq_nats::{pull, read};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{error, warn};

use crate::acks::Acks;
use crate::plan::{in_log_order, refusal, waits_for_more};
use crate::write::{Cached, Job};
use crate::{Pending, ProjectorError, LINGER, MAX_RETRY_DELAY};

/// How a delivered event is answered once folded.
#[derive(Clone)]
pub(crate) enum Answer {
    /// Acked alone (the progress stream's consumer acks explicitly).
    Each,
    /// Acked with the folded prefix of the job log ([`Acks`]), of subscription `.1`.
    Prefix(Acks, u64),
}

/// A delivered event on its way to its lane.
pub(crate) struct Delivery {
    pub msg: jetstream::Message,
    /// From the progress stream (else the job log).
    pub progress: bool,
    pub answer: Answer,
}

impl Delivery {
    /// Folded: acked (at once, or with its prefix).
    pub(crate) async fn folded(&self) -> Result<(), async_nats::Error> {
        match &self.answer {
            Answer::Each => self.msg.ack().await,
            Answer::Prefix(acks, generation) => {
                acks.folded(self.msg.clone(), *generation);
                Ok(())
            }
        }
    }

    /// Never to be folded (not an event, or not its subject's job's): it stays in the
    /// log and is not delivered again.
    pub(crate) async fn refused(&self) {
        match &self.answer {
            Answer::Each => {
                let _ = self.msg.ack_with(AckKind::Term).await;
            }
            // A cumulative ack would cover it anyway; a `term` could ack what precedes it.
            Answer::Prefix(acks, generation) => acks.folded(self.msg.clone(), *generation),
        }
    }

    /// Handed back: delivered again after a delay.
    pub(crate) async fn handed_back(&self) {
        let _ = self.msg.ack_with(AckKind::Nak(Some(retry_delay(&self.msg)))).await;
    }
}

/// Routes each message to its job's lane until the messages end (on shutdown): the
/// progress stream's, acked one by one.
pub(crate) async fn pump(mut messages: pull::Messages, lanes: Vec<mpsc::Sender<Delivery>>) {
    while let Some(msg) = messages.next().await {
        if !route(Delivery { msg, progress: true, answer: Answer::Each }, &lanes).await {
            return;
        }
    }
}

/// Sends `d` to its job's lane; false when the lanes are gone.
pub(crate) async fn route(d: Delivery, lanes: &[mpsc::Sender<Delivery>]) -> bool {
    let lane = match names::job_id_of_subject(&d.msg.subject) {
        Some(id) => lane_of(&id, lanes.len()),
        None => {
            warn!(subject = %d.msg.subject, "not a job subject; skipping");
            d.refused().await;
            return true;
        }
    };
    lanes[lane].send(d).await.is_ok()
}

fn lane_of(id: &JobId, n: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    (h.finish() % n as u64) as usize
}

/// The delay before a handed-back message comes again: 100 ms doubling with each
/// delivery, capped at [`MAX_RETRY_DELAY`].
fn retry_delay(msg: &jetstream::Message) -> Duration {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).clamp(1, 16) as u32;
    (Duration::from_millis(100) * 2u32.pow(delivered - 1)).min(MAX_RETRY_DELAY)
}

/// One lane: applies the events of its jobs, one job after the other.
pub(crate) struct Lane {
    lane: usize,
    kv: kv::Store,
    /// The job log, read back when a job is refolded.
    log: jetstream::stream::Stream<()>,
    cap: usize,
    /// Views as last written, with their revision.
    cache: HashMap<JobId, read::Stored>,
    resubscriptions: [Arc<AtomicU64>; 2],
    seen_resubscriptions: u64,
}

impl Lane {
    pub(crate) fn new(
        lane: usize,
        kv: kv::Store,
        log: jetstream::stream::Stream<()>,
        cap: usize,
        resubscriptions: [Arc<AtomicU64>; 2],
    ) -> Lane {
        Lane { lane, kv, log, cap, cache: HashMap::new(), resubscriptions, seen_resubscriptions: 0 }
    }

    pub(crate) async fn run(mut self, mut rx: mpsc::Receiver<Delivery>) {
        let mut batch = Vec::new();
        // Unfinished jobs whose write waits for their next event ([`LINGER`]): until
        // when, and their events so far (not acked yet).
        let mut held: HashMap<JobId, (Instant, Vec<Pending>)> = HashMap::new();
        loop {
            // The next message, or `None` when a held job is due first; the lane ends
            // when the channel does (on shutdown), writing what it holds.
            let next = match held.values().map(|(until, _)| *until).min() {
                None => rx.recv().await.map(Some),
                Some(due) => match tokio::time::timeout_at(due, rx.recv()).await {
                    Ok(m) => m.map(Some),
                    Err(_) => Some(None),
                },
            };
            let closed = next.is_none();
            // Take whatever else is already waiting: events of one job that arrive together
            // (requested, started, outcome under load) become one KV write.
            batch.clear();
            batch.extend(next.flatten());
            while !closed && batch.len() < 256 {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let resubscriptions = self.resubscriptions.iter().map(|r| r.load(Ordering::SeqCst)).sum();
            if resubscriptions != self.seen_resubscriptions {
                self.seen_resubscriptions = resubscriptions;
                self.cache.clear();
            }
            let mut per_job = self.group(&mut batch).await;
            // A held job's earlier events go before its new ones; held jobs that are due
            // (or all of them, when the lane is closing) are written now.
            let now = Instant::now();
            let mut holds: Vec<(JobId, Instant)> = Vec::new();
            for (id, events) in &mut per_job {
                let until = match held.remove(id) {
                    Some((until, mut before)) => {
                        before.append(events);
                        *events = before;
                        in_log_order(events);
                        until
                    }
                    None => now + LINGER,
                };
                if !closed && until > now && waits_for_more(events) {
                    holds.push((id.clone(), until));
                }
            }
            for (id, until) in holds {
                let at = per_job.iter().position(|(j, _)| *j == id).expect("the job is in the batch");
                let (_, events) = per_job.swap_remove(at);
                held.insert(id, (until, events));
            }
            let due: Vec<JobId> =
                held.iter().filter(|(_, (until, _))| closed || *until <= now).map(|(id, _)| id.clone()).collect();
            for id in due {
                let (_, events) = held.remove(&id).expect("listed");
                per_job.push((id, events));
            }
            self.jobs(per_job).await;
            if self.cache.len() > self.cap {
                // Terminal views rarely change again: drop them first, then anything.
                self.cache.retain(|_, s| s.view.as_ref().map(|v| !v.status.is_terminal()).unwrap_or(false));
                if self.cache.len() > self.cap {
                    self.cache.clear();
                }
            }
            if closed {
                return;
            }
        }
    }

    /// Reads the batch into events per job, each job's log events in log order.
    async fn group(&self, batch: &mut Vec<Delivery>) -> Vec<(JobId, Vec<Pending>)> {
        let lane = self.lane;
        let mut per_job: Vec<(JobId, Vec<Pending>)> = Vec::new();
        for d in batch.drain(..) {
            let msg = &d.msg;
            let seq = match msg.info() {
                Ok(i) => i.stream_sequence,
                Err(e) => {
                    warn!(error = %e, "message without JetStream info");
                    continue;
                }
            };
            let pos = if d.progress { Position::Progress(seq) } else { Position::Log(seq) };
            let event = match Event::from_slice(&msg.payload) {
                Ok(e) => e,
                Err(e) => {
                    // Not an event we can read: never retried, never lost (it stays in the log).
                    warn!(lane, seq, subject = %msg.subject, error = %e, "unreadable event; terminating it");
                    crate::metrics::metrics().error("unreadable_event");
                    d.refused().await;
                    continue;
                }
            };
            if let Some((kind, error)) = refusal(&msg.subject, &event) {
                warn!(lane, seq, subject = %msg.subject, %error, "refusing an event that is not its subject's job's");
                crate::metrics::metrics().error(kind);
                d.refused().await;
                continue;
            }
            match per_job.iter_mut().find(|(id, _)| *id == event.subject) {
                Some((_, v)) => v.push((pos, event, d)),
                None => per_job.push((event.subject.clone(), vec![(pos, event, d)])),
            }
        }
        for (_, events) in &mut per_job {
            in_log_order(events);
        }
        per_job
    }

    /// Folds the batch's jobs into their views, all at once (their KV writes are in
    /// flight together, one round trip for the batch rather than one per job), then
    /// acks each job's events, or hands them all back when its fold failed. Each job
    /// appears once per batch, so the folds touch different views.
    async fn jobs(&mut self, per_job: Vec<(JobId, Vec<Pending>)>) {
        let (kv, log, cache) = (&self.kv, &self.log, &self.cache);
        let folds = per_job.iter().map(|(id, events)| {
            let refs: Vec<(Position, &Event)> = events.iter().map(|(p, e, _)| (*p, e)).collect();
            let span =
                tracing::info_span!("project", job_id = %id, events = refs.len(), trace_id = tracing::field::Empty);
            let tp = refs.iter().rev().find_map(|(_, e)| e.traceparent.as_deref());
            stemq_telemetry::logging::set_parent(&span, tp);
            let cached = cache.get(id).cloned();
            let job = Job { kv, log, id };
            tracing::Instrument::instrument(async move { job.fold(cached, &refs).await }, span)
        });
        let results = futures::future::join_all(folds).await;
        for ((id, events), result) in per_job.into_iter().zip(results) {
            match result {
                Ok(cached) => {
                    match cached {
                        Cached::Keep => {}
                        Cached::Set(stored) => {
                            self.cache.insert(id.clone(), stored);
                        }
                        Cached::Drop => {
                            self.cache.remove(&id);
                        }
                    }
                    for (_, _, d) in &events {
                        if let Err(e) = d.folded().await {
                            warn!(job_id = %id, error = %e, "ack failed; the event will be redelivered and refolded");
                        }
                    }
                }
                Err(e) => {
                    crate::metrics::metrics().error(e.kind());
                    let error = stemq_nats::error::report(&e);
                    if matches!(e, ProjectorError::CorruptView { .. }) {
                        error!(job_id = %id, kind = e.kind(), %error, "stored view does not parse; not overwriting it (stemq projector --rebuild replaces it)");
                    } else {
                        warn!(job_id = %id, kind = e.kind(), %error, "projection failed; handing the job's events back");
                    }
                    self.cache.remove(&id);
                    for (_, _, d) in &events {
                        match (&d.answer, &e) {
                            // Only a rebuild mends it, and the rebuild replays the whole log:
                            // the job log's acks go past it rather than hold every later
                            // event back behind it.
                            (Answer::Prefix(..), ProjectorError::CorruptView { .. }) => d.refused().await,
                            _ => d.handed_back().await,
                        }
                    }
                }
            }
        }
    }
}
