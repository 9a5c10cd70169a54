//! `GET /v1/workers`: the fleet as the worker registry and the pools' queues see it.
//!
//! This module owns the operators' view of the workers: every live worker with what it
//! serves (from the registry, `stemq_nats::registry`), and for every model stemq knows,
//! its pool: live workers serving it, and per lane the jobs waiting and the jobs
//! running (the pool consumer's pending and ack-pending counts). A pool with jobs and
//! no worker says so (`waiting`). It also owns [`check_served`], the refusal of a model
//! nobody serves where the ingress is told to refuse rather than queue.

use async_nats::jetstream::consumer::PullConsumer;
use axum::extract::State;
use axum::Json;
use serde::Serialize;
use stemq_core::request::{Model, Priority};
use stemq_nats as names;
use stemq_nats::registry::{self, Registry, WorkerInfo};

use crate::submit::SubmitError;
use crate::{ApiError, AppState};

/// The answer of `GET /v1/workers`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Fleet {
    /// Live workers, by name.
    pub workers: Vec<WorkerInfo>,
    /// One entry per model stemq knows.
    pub pools: Vec<Pool>,
}

/// One model's pool.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Pool {
    /// The model.
    pub model: Model,
    /// Live workers serving it.
    pub workers: usize,
    /// Its lanes, interactive first.
    pub lanes: Vec<Lane>,
    /// Why its queued jobs wait, when they wait for a worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
}

/// One lane of a pool.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Lane {
    /// The lane.
    pub lane: Priority,
    /// Its consumer.
    pub consumer: String,
    /// Jobs waiting (not yet delivered to a worker); absent when unreadable.
    pub pending: Option<u64>,
    /// Jobs delivered and not finished.
    pub running: Option<u64>,
}

/// Reads the fleet: the registry's live workers and each pool's queue.
pub async fn fleet(state: &AppState) -> Fleet {
    let workers = state.registry().live();
    let mut pools = Vec::new();
    for model in Model::ALL.iter().copied() {
        let mut lanes = Vec::new();
        for lane in Priority::ALL.iter().copied() {
            let consumer = names::pool_consumer(model, lane);
            let info = match state.jetstream().get_consumer_from_stream(&consumer, names::JOBS_STREAM).await {
                Ok(c) => {
                    let mut c: PullConsumer = c;
                    c.info().await.ok().map(|i| (i.num_pending, i.num_ack_pending as u64))
                }
                Err(_) => None,
            };
            lanes.push(Lane { lane, consumer, pending: info.map(|i| i.0), running: info.map(|i| i.1) });
        }
        let queued: u64 = lanes.iter().filter_map(|l| l.pending).sum();
        let waiting = if queued > 0 { registry::waiting_reason(&workers, model) } else { None };
        pools.push(Pool { model, workers: registry::serving(&workers, model), lanes, waiting });
    }
    Fleet { workers, pools }
}

/// `GET /v1/workers` (operators).
pub async fn list(State(state): State<AppState>) -> Result<Json<Fleet>, ApiError> {
    Ok(Json(fleet(&state).await))
}

/// Refuses `model` when no live worker serves it (for an ingress that refuses rather
/// than queues). While no worker at all is known, until `grace_until` (the ingress's
/// start-up window, when the workers started with it may still be loading), it waits
/// for a worker serving `model` to announce itself instead. Nothing is refused before
/// the registry has been read, and before refusing the registry's copy catches up with
/// the bucket (at most [`CATCH_UP`]): a worker that has just announced itself serves,
/// even when the watch has not delivered its entry.
pub async fn check_served(
    registry: &Registry,
    model: Model,
    grace_until: tokio::time::Instant,
) -> Result<(), SubmitError> {
    if registry.serving(model) > 0 {
        return Ok(());
    }
    let starting = registry.live().is_empty();
    if (starting && registry.wait_serving(model, grace_until).await) || !registry.is_ready() {
        return Ok(());
    }
    if registry.catch_up(CATCH_UP).await && registry.serving(model) > 0 {
        return Ok(());
    }
    let live = registry.live();
    let mut served: Vec<Model> = live.iter().flat_map(|w| w.models.iter().copied()).collect();
    served.sort_by_key(|m| Model::ALL.iter().position(|x| x == m));
    served.dedup();
    Err(SubmitError::Unserved { model, served })
}

/// How long a refusal of an unserved model waits for the registry's copy to catch up.
pub const CATCH_UP: std::time::Duration = std::time::Duration::from_millis(500);

/// One model as a submitter sees it (`GET /v1/models`).
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct ModelInfo {
    /// The model's name, as `model` of a request takes it.
    pub name: Model,
    /// The stems it writes, in order.
    pub stems: Vec<&'static str>,
    /// True when a live worker serves it now (a submit then runs); `None` while the
    /// worker registry has not been read.
    pub served: Option<bool>,
    /// Live workers serving it.
    pub workers: usize,
}

/// The answer of `GET /v1/models`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Models {
    /// Every model stemq knows, the ones served first.
    pub models: Vec<ModelInfo>,
    /// The containers a request's `output_format` takes.
    pub output_formats: Vec<&'static str>,
}

/// Every model, whether it is served now, and its stems (any key: submitters pick a
/// model with it; workers' names and hosts are for operators, on `GET /v1/workers`).
pub async fn models(State(state): State<AppState>) -> Json<Models> {
    let ready = state.registry().is_ready();
    let live = state.registry().live();
    let mut models: Vec<ModelInfo> = Model::ALL
        .iter()
        .map(|m| {
            let workers = registry::serving(&live, *m);
            ModelInfo { name: *m, stems: m.sources().to_vec(), served: ready.then_some(workers > 0), workers }
        })
        .collect();
    models.sort_by_key(|m| m.served != Some(true));
    let output_formats = stemq_core::request::OutputFormat::ALL.iter().map(|f| f.as_str()).collect();
    Json(Models { models, output_formats })
}

/// The answer of `GET /v1/overview`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Overview {
    /// Jobs the status view holds, per status.
    pub counts: std::collections::BTreeMap<String, usize>,
    /// Age in seconds of the oldest request no worker has finished (0 when none).
    pub oldest_pending_seconds: f64,
    /// The oldest queued job, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oldest_queued: Option<OldestJob>,
    /// Job events the projector has not applied yet, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub projector_lag: Option<u64>,
    /// Jobs that ended per minute over the last 15 minutes, oldest first.
    pub throughput: Vec<stemq_nats::read::MinuteCount>,
    /// False while the list index is still loading (the counts are then partial).
    pub complete: bool,
}

/// A job and when it was created.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct OldestJob {
    /// The job.
    pub job_id: stemq_core::JobId,
    /// Its creation time.
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// Minutes of throughput `GET /v1/overview` shows.
pub const THROUGHPUT_MINUTES: usize = 15;

/// `GET /v1/overview` (operators): the queue and the jobs at a glance, beside
/// `GET /v1/workers`.
pub async fn overview(State(state): State<AppState>) -> Json<Overview> {
    let queue = stemq_nats::queue_figures::read_queue(state.jetstream()).await;
    let index = state.index();
    let counts = index.counts().into_iter().map(|(s, n)| (s.as_str().to_string(), n)).collect();
    let oldest_queued = index
        .oldest(stemq_core::JobStatus::Queued)
        .map(|(job_id, ns)| OldestJob { job_id, created_at: chrono::DateTime::from_timestamp_nanos(ns) });
    Json(Overview {
        counts,
        oldest_pending_seconds: queue.oldest_pending_age.as_secs_f64(),
        oldest_queued,
        projector_lag: queue.projector_lag,
        throughput: index.finished_per_minute(chrono::Utc::now(), THROUGHPUT_MINUTES),
        complete: index.caught_up(),
    })
}
