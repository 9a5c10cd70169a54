//! Prometheus metrics of the worker, named `stemq_<name>_<unit>`.
//!
//! This module owns what a worker records: per-job durations, queue waits and realtime
//! factors (labels `model`, `device`), outcomes, deliveries per job, its heartbeat and
//! the GPU memory in use. The families live in the process-wide registry of
//! [`stemq_telemetry::metrics`], registered by [`metrics`] once per process ([`run`]
//! calls it at start, so every family is exported before its first sample).
//!
//! [`run`]: crate::run

use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

/// Labels of per-job measurements.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabels {
    /// Model of the job.
    pub model: String,
    /// Device it ran on.
    pub device: String,
}

/// Labels of outcomes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Model of the job.
    pub model: String,
    /// `succeeded`, `degraded`, `failed_permanent`, `failed_transient`, `dead_lettered`,
    /// `cancelled`, `rejected`, `expired`.
    pub outcome: String,
}

/// Labels of per-device gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabels {
    /// `cuda:0`, ...
    pub device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
}

/// The worker's metric families.
pub struct WorkerMetrics {
    /// Wall time of successful attempts.
    pub job_duration: Family<JobLabels, Histogram>,
    /// Time from request to first start.
    pub queue_wait: Family<JobLabels, Histogram>,
    /// Processing seconds per second of audio.
    pub realtime_factor: Family<JobLabels, Histogram>,
    /// Outcomes, including transient failures that are retried.
    pub outcomes: Family<OutcomeLabels, Counter>,
    /// Delivery count of jobs when they end (1 = first try).
    pub deliveries: Histogram,
    heartbeat: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    /// GPU memory in use per device (set by GPU engines; absent on CPU-only workers).
    pub gpu_memory: Family<DeviceLabels, Gauge>,
}

/// The worker's metrics, registered in the process-wide registry on first use.
pub fn metrics() -> &'static WorkerMetrics {
    static M: OnceLock<WorkerMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let secs = || Histogram::new(exponential_buckets(0.01, 2.0, 18));
        let m = WorkerMetrics {
            job_duration: Family::new_with_constructor(secs),
            queue_wait: Family::new_with_constructor(secs),
            realtime_factor: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.005, 2.0, 14))),
            outcomes: Family::default(),
            deliveries: Histogram::new([1.0, 2.0, 3.0, 4.0, 5.0, 10.0]),
            heartbeat: Family::default(),
            gpu_memory: Family::default(),
        };
        stemq_telemetry::metrics::metrics().register(|r| {
            r.register("stemq_gpu_memory_used_bytes", "GPU memory in use, per device", m.gpu_memory.clone());
            r.register("stemq_job_duration_seconds", "Wall time of successful attempts", m.job_duration.clone());
            r.register("stemq_job_queue_wait_seconds", "Time from request to the first start", m.queue_wait.clone());
            r.register(
                "stemq_job_realtime_factor",
                "Processing seconds per second of audio (lower is faster)",
                m.realtime_factor.clone(),
            );
            r.register(
                "stemq_job_outcomes",
                "Job outcomes: succeeded, degraded, failed_permanent, failed_transient (retried), dead_lettered, \
                 cancelled, rejected, expired",
                m.outcomes.clone(),
            );
            r.register("stemq_job_deliveries", "Deliveries a job took before it ended", m.deliveries.clone());
            r.register(
                "stemq_worker_heartbeat_timestamp_seconds",
                "Last heartbeat of each worker (Unix seconds)",
                m.heartbeat.clone(),
            );
        });
        m
    })
}

impl WorkerMetrics {
    /// Counts one outcome.
    pub fn outcome(&self, model: &str, outcome: &str) {
        self.outcomes.get_or_create(&OutcomeLabels { model: model.into(), outcome: outcome.into() }).inc();
    }

    /// Records a worker heartbeat.
    pub fn heartbeat(&self, worker: &str) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        self.heartbeat.get_or_create(&WorkerLabels { worker: worker.into() }).set(now.as_secs_f64());
    }
}
