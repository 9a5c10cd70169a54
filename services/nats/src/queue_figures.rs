//! The queue figures: what NATS knows about the backlog, read in one go.
//!
//! This module owns reading them ([`read_queue`]): pending and in flight per pool
//! consumer and lane, the unrouted `workers` consumer and the projector, the age of the
//! oldest unfinished request, the projector's lag, and the live workers from the
//! registry. The queue exporter turns them into gauges (`stemq_telemetry::metrics`) at
//! scrape time; `stemq top` and `GET /v1/workers` read them too.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use stemq_core::request::{Model, Priority};

use crate::registry::{self, WorkerInfo};

/// What NATS knows about one consumer of the job stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsumerFigures {
    /// Messages not yet delivered to the consumer.
    pub pending: u64,
    /// Messages delivered and not yet acked.
    pub in_flight: u64,
}

/// One pool's lane: its consumer (`workers-<model>-<lane>`) as NATS knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneFigures {
    /// The pool's model.
    pub model: Model,
    /// The lane.
    pub lane: Priority,
    /// The lane consumer's figures.
    pub queue: ConsumerFigures,
}

/// The queue figures (`stemq_queue_*`, `stemq_pool_workers`,
/// `stemq_jobs_waiting_for_worker`, `stemq_projector_lag_events`), read from NATS at
/// scrape time by [`read_queue`] and exported as gauges by `stemq_telemetry::metrics`.
///
/// They describe the stream and the worker registry, not the process that reads them, so
/// exactly one process exports them: the one started with `--queue-metrics` (and
/// `stemq dev`). Were every process to export them, `sum()` over the scrape targets
/// would count the same jobs once per process; the rules and the dashboard use `max`
/// so that two exporters (during a rolling upgrade of that process) still do not double
/// them.
///
/// Every label set is bounded: one series per pool consumer (models are a fixed enum,
/// lanes two), plus the unrouted `workers` consumer and the `projector` consumer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueFigures {
    /// The pool consumers that exist, models in [`Model::ALL`] order, lanes in
    /// [`Priority::ALL`] order.
    pub lanes: Vec<LaneFigures>,
    /// The `workers` consumer (requests of earlier releases, published without a route,
    /// that the ingress's router has not moved into their pools yet), when it exists.
    pub unrouted: Option<ConsumerFigures>,
    /// The `projector` consumer, when it exists.
    pub projector: Option<ConsumerFigures>,
    /// Age of the oldest job request the workers have not finished, over every pool and
    /// the unrouted consumer (zero when none).
    pub oldest_pending_age: Duration,
    /// Job events not yet applied to the status view, when the projector consumer exists.
    pub projector_lag: Option<u64>,
    /// The live workers (the worker registry), by name, when it was readable.
    pub workers: Option<Vec<WorkerInfo>>,
}

impl QueueFigures {
    /// Live workers serving `model`; `None` when the registry was not readable.
    pub fn serving(&self, model: Model) -> Option<usize> {
        self.workers.as_deref().map(|w| registry::serving(w, model))
    }

    /// Jobs pending in the pool of `model` (both lanes).
    pub fn pending(&self, model: Model) -> u64 {
        self.lanes.iter().filter(|l| l.model == model).map(|l| l.queue.pending).sum()
    }

    /// Jobs pending in the pool of `model` (both lanes) while no live worker serves it;
    /// `None` when the registry was not readable (nobody knows who serves what).
    pub fn waiting_for_worker(&self, model: Model) -> Option<u64> {
        Some(if self.serving(model)? > 0 { 0 } else { self.pending(model) })
    }
}

/// Consumer info of `consumer` on the job stream: its figures and its ack floor (stream
/// sequence), or `None` (logged) when it cannot be read.
async fn consumer_figures(js: &jetstream::Context, consumer: &str) -> Option<(ConsumerFigures, u64)> {
    let c: Result<PullConsumer, _> = js.get_consumer_from_stream(consumer, crate::JOBS_STREAM).await;
    let info = match c {
        Ok(mut c) => c.info().await.cloned().map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match info {
        Ok(info) => Some((
            ConsumerFigures { pending: info.num_pending, in_flight: info.num_ack_pending as u64 },
            info.ack_floor.stream_sequence,
        )),
        Err(error) => {
            tracing::warn!(consumer, %error, "queue figures: consumer info not readable");
            None
        }
    }
}

/// Reads the queue figures from NATS (called at scrape time by the queue exporter, and
/// by `stemq top`): every pool consumer, the unrouted `workers` consumer, the projector,
/// and the worker registry. What cannot be read is left out.
pub async fn read_queue(js: &jetstream::Context) -> QueueFigures {
    let mut q = QueueFigures::default();
    let pools: Vec<(Model, Priority)> =
        Model::ALL.iter().flat_map(|m| Priority::ALL.iter().map(move |l| (*m, *l))).collect();
    let pool_names: Vec<String> = pools.iter().map(|(m, l)| crate::pool_consumer(*m, *l)).collect();
    let (pool_infos, unrouted, projector) = futures::join!(
        futures::future::join_all(pool_names.iter().map(|name| consumer_figures(js, name))),
        consumer_figures(js, crate::WORKERS_CONSUMER),
        consumer_figures(js, crate::PROJECTOR_CONSUMER),
    );
    // The oldest unfinished request of each busy consumer is the first request after its
    // ack floor that its filter matches.
    let busy = |c: &ConsumerFigures| c.pending + c.in_flight > 0;
    let mut starts: Vec<(u64, String)> = Vec::new();
    for ((model, lane), info) in pools.iter().zip(pool_infos) {
        let Some((figures, floor)) = info else { continue };
        q.lanes.push(LaneFigures { model: *model, lane: *lane, queue: figures });
        if busy(&figures) {
            starts.push((floor, crate::pool_filter(*model, *lane)));
        }
    }
    if let Some((figures, floor)) = unrouted {
        q.unrouted = Some(figures);
        if busy(&figures) {
            starts.extend(crate::UNROUTED_FILTERS.iter().map(|f| (floor, f.to_string())));
        }
    }
    q.projector = projector.map(|(figures, _)| figures);
    let projector_floor = projector.map(|(_, floor)| floor);

    q.workers = match js.get_key_value(crate::WORKERS_BUCKET).await {
        Ok(bucket) => match registry::live(&bucket).await {
            Ok(live) => Some(live),
            Err(error) => {
                tracing::warn!(%error, "queue figures: worker registry not readable");
                None
            }
        },
        Err(error) => {
            tracing::warn!(%error, "queue figures: worker registry not readable");
            None
        }
    };

    let Ok(stream) = js.get_stream_no_info(crate::JOBS_STREAM).await else {
        return q;
    };
    let mut oldest: Option<(u64, std::time::SystemTime)> = None;
    for (floor, filter) in &starts {
        if let Ok(msg) = stream.direct_get_builder().sequence(floor + 1).next_by_subject(filter).send().await {
            if oldest.is_none_or(|(seq, _)| msg.sequence < seq) {
                oldest = Some((msg.sequence, msg.time.into()));
            }
        }
    }
    if let Some((_, t)) = oldest {
        q.oldest_pending_age = t.elapsed().unwrap_or(Duration::ZERO);
    }
    if let (Some(floor), Ok(mut s)) = (projector_floor, js.get_stream(crate::JOBS_STREAM).await) {
        if let Ok(info) = s.info().await {
            q.projector_lag = Some(info.state.last_sequence.saturating_sub(floor));
        }
    }
    q
}
