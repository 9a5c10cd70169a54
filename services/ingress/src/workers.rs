//! `GET /v1/workers`: the fleet as the worker registry and the pools' queues see it.
//!
//! This module owns the operators' view of the workers: every live worker with what it
//! serves (from the registry, `stemq_core::registry`), and for every model stemq knows,
//! its pool: live workers serving it, and per lane the jobs waiting and the jobs
//! running (the pool consumer's pending and ack-pending counts). A pool with jobs and
//! no worker says so (`waiting`). It also owns [`check_served`], the refusal of a model
//! nobody serves where the ingress is told to refuse rather than queue.

use async_nats::jetstream::consumer::PullConsumer;
use axum::extract::State;
use axum::Json;
use serde::Serialize;
use stemq_core::nats as names;
use stemq_core::registry::{self, Registry, WorkerInfo};
use stemq_core::request::{Model, Priority};

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
/// than queues). Before the registry has been read, nothing is refused.
pub fn check_served(registry: &Registry, model: Model) -> Result<(), SubmitError> {
    if !registry.is_ready() {
        return Ok(());
    }
    let live = registry.live();
    if registry::serving(&live, model) > 0 {
        return Ok(());
    }
    let mut served: Vec<Model> = live.iter().flat_map(|w| w.models.iter().copied()).collect();
    served.sort_by_key(|m| Model::ALL.iter().position(|x| x == m));
    served.dedup();
    Err(SubmitError::Unserved { model, served })
}
