//! Prometheus metrics shared by every stemq process.
//!
//! This module owns the metric names (`stemq_<name>_<unit>`, low-cardinality labels:
//! model, device, outcome, class, consumer, kind) and the process-wide registry. Each service
//! records into it; whichever serves `/metrics` (the ingress, or the small metrics
//! listener of a worker or projector process) renders all of it, so `stemq dev` shows
//! everything on one endpoint. Queue figures that NATS already knows (pending, in
//! flight, oldest pending, projector lag) are read from consumer info at scrape time by
//! [`crate::metrics::refresh_queue`].

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::nats as names;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabels {
    consumer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookLabels {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProjectorErrorLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: String,
}

/// Every metric stemq records.
pub struct Metrics {
    registry: Mutex<Registry>,
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
    pending: Family<ConsumerLabels, Gauge>,
    in_flight: Family<ConsumerLabels, Gauge>,
    oldest_pending_age: Gauge<f64, std::sync::atomic::AtomicU64>,
    projector_lag: Gauge,
    projector_errors: Family<ProjectorErrorLabels, Counter>,
    heartbeat: Family<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    webhooks: Family<WebhookLabels, Counter>,
    webhook_latency: Histogram,
    /// GPU memory in use per device (set by GPU engines; absent on CPU-only workers).
    pub gpu_memory: Family<DeviceLabels, Gauge>,
}

/// Labels of per-device gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabels {
    /// `cuda:0`, ...
    pub device: String,
}

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let mut r = Registry::default();
        let secs = || Histogram::new(exponential_buckets(0.01, 2.0, 18));
        let job_duration = Family::<JobLabels, Histogram>::new_with_constructor(secs);
        let queue_wait = Family::<JobLabels, Histogram>::new_with_constructor(secs);
        let realtime_factor = Family::<JobLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 14))
        });
        let outcomes = Family::<OutcomeLabels, Counter>::default();
        let deliveries = Histogram::new([1.0, 2.0, 3.0, 4.0, 5.0, 10.0]);
        let pending = Family::<ConsumerLabels, Gauge>::default();
        let in_flight = Family::<ConsumerLabels, Gauge>::default();
        let oldest_pending_age = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        let projector_lag = Gauge::default();
        let projector_errors = Family::<ProjectorErrorLabels, Counter>::default();
        let heartbeat = Family::<WorkerLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        let gpu_memory = Family::<DeviceLabels, Gauge>::default();
        r.register("stemq_gpu_memory_used_bytes", "GPU memory in use, per device", gpu_memory.clone());
        let webhooks = Family::<WebhookLabels, Counter>::default();
        let webhook_latency = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        r.register(
            "stemq_webhook_deliveries",
            "Webhook delivery attempts by outcome (delivered, retrying, failed, disabled)",
            webhooks.clone(),
        );
        r.register("stemq_webhook_delivery_duration_seconds", "Webhook attempt latency", webhook_latency.clone());
        r.register("stemq_job_duration_seconds", "Wall time of successful attempts", job_duration.clone());
        r.register("stemq_job_queue_wait_seconds", "Time from request to the first start", queue_wait.clone());
        r.register(
            "stemq_job_realtime_factor",
            "Processing seconds per second of audio (lower is faster)",
            realtime_factor.clone(),
        );
        r.register(
            "stemq_job_outcomes",
            "Job outcomes: succeeded, degraded, failed_permanent, failed_transient (retried), dead_lettered, \
             cancelled, rejected, expired",
            outcomes.clone(),
        );
        r.register("stemq_job_deliveries", "Deliveries a job took before it ended", deliveries.clone());
        r.register("stemq_queue_pending_jobs", "Messages not yet delivered to the consumer", pending.clone());
        r.register("stemq_queue_in_flight_jobs", "Messages delivered and not yet acked", in_flight.clone());
        r.register(
            "stemq_queue_oldest_pending_age_seconds",
            "Age of the oldest job request not yet finished by a worker",
            oldest_pending_age.clone(),
        );
        r.register(
            "stemq_projector_lag_events",
            "Job events not yet applied to the status view",
            projector_lag.clone(),
        );
        r.register(
            "stemq_projector_errors",
            "Events the projector could not apply yet, by kind (corrupt_view, kv_read, kv_write, \
             unreadable_event); each is retried or held, never skipped",
            projector_errors.clone(),
        );
        r.register(
            "stemq_worker_heartbeat_timestamp_seconds",
            "Last heartbeat of each worker (Unix seconds)",
            heartbeat.clone(),
        );
        Metrics {
            registry: Mutex::new(r),
            job_duration,
            queue_wait,
            realtime_factor,
            outcomes,
            deliveries,
            pending,
            in_flight,
            oldest_pending_age,
            projector_lag,
            projector_errors,
            heartbeat,
            webhooks,
            webhook_latency,
            gpu_memory,
        }
    })
}

impl Metrics {
    /// Adds service-specific metrics to the shared registry.
    pub fn register(&self, f: impl FnOnce(&mut Registry)) {
        f(&mut self.registry.lock().expect("registry lock"));
    }

    /// Counts one outcome.
    pub fn outcome(&self, model: &str, outcome: &str) {
        self.outcomes.get_or_create(&OutcomeLabels { model: model.into(), outcome: outcome.into() }).inc();
    }

    /// Records one webhook attempt.
    pub fn webhook(&self, outcome: &str, latency: Duration) {
        self.webhooks.get_or_create(&WebhookLabels { outcome: outcome.into() }).inc();
        self.webhook_latency.observe(latency.as_secs_f64());
    }

    /// Counts one projector error of `kind` (`corrupt_view`, `kv_read`, `kv_write`,
    /// `unreadable_event`).
    pub fn projector_error(&self, kind: &str) {
        self.projector_errors.get_or_create(&ProjectorErrorLabels { kind: kind.into() }).inc();
    }

    /// Records a worker heartbeat.
    pub fn heartbeat(&self, worker: &str) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        self.heartbeat.get_or_create(&WorkerLabels { worker: worker.into() }).set(now.as_secs_f64());
    }

    /// The Prometheus text format of everything.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry.lock().expect("registry lock"))
            .expect("metrics encode");
        out
    }
}

/// Reads the queue figures from NATS into the gauges (called at scrape time).
pub async fn refresh_queue(js: &jetstream::Context) {
    let m = metrics();
    let mut workers_floor = None;
    let mut projector_floor = None;
    for consumer in [names::WORKERS_CONSUMER, names::PROJECTOR_CONSUMER] {
        let c: Result<PullConsumer, _> = js.get_consumer_from_stream(consumer, names::JOBS_STREAM).await;
        let Ok(mut c) = c else { continue };
        let Ok(info) = c.info().await else { continue };
        let l = ConsumerLabels { consumer: consumer.to_string() };
        m.pending.get_or_create(&l).set(info.num_pending as i64);
        m.in_flight.get_or_create(&l).set(info.num_ack_pending as i64);
        let floor = info.ack_floor.stream_sequence;
        let busy = info.num_pending + info.num_ack_pending as u64 > 0;
        if consumer == names::WORKERS_CONSUMER {
            workers_floor = busy.then_some(floor);
        } else {
            projector_floor = Some(floor);
        }
    }
    let Ok(stream) = js.get_stream_no_info(names::JOBS_STREAM).await else {
        return;
    };
    // The oldest unfinished request: the first `requested` after the workers' ack floor.
    let mut age = 0.0;
    if let Some(floor) = workers_floor {
        // Requests come in two subject forms (with and without the owner token): the
        // oldest of the first of each.
        let mut oldest: Option<(u64, std::time::SystemTime)> = None;
        for filter in names::REQUESTED_FILTERS {
            if let Ok(msg) = stream.direct_get_builder().sequence(floor + 1).next_by_subject(filter).send().await {
                if oldest.is_none_or(|(seq, _)| msg.sequence < seq) {
                    oldest = Some((msg.sequence, msg.time.into()));
                }
            }
        }
        if let Some((_, t)) = oldest {
            age = t.elapsed().unwrap_or(Duration::ZERO).as_secs_f64();
        }
    }
    m.oldest_pending_age.set(age);
    if let (Some(floor), Ok(mut s)) = (projector_floor, js.get_stream(names::JOBS_STREAM).await) {
        if let Ok(info) = s.info().await {
            m.projector_lag.set(info.state.last_sequence.saturating_sub(floor) as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `stemq_*` name the alert rules and the dashboard in deploy/ use is one we
    /// export, so a rename cannot silently break paging.
    /// Gives every family a sample, so each one appears in the text format.
    fn populate(m: &Metrics) {
        m.outcome("dsp", "succeeded");
        m.heartbeat("w1");
        m.projector_error("corrupt_view");
        m.webhook("delivered", Duration::from_millis(30));
        let l = JobLabels { model: "dsp".into(), device: "cpu".into() };
        m.job_duration.get_or_create(&l).observe(1.5);
        m.queue_wait.get_or_create(&l).observe(0.1);
        m.realtime_factor.get_or_create(&l).observe(0.05);
        let c = ConsumerLabels { consumer: "workers".into() };
        m.pending.get_or_create(&c).set(3);
        m.in_flight.get_or_create(&c).set(1);
        m.gpu_memory.get_or_create(&DeviceLabels { device: "cuda:0".into() }).set(1 << 30);
    }

    #[test]
    fn deploy_rules_and_dashboard_use_exported_names() {
        let m = metrics();
        populate(m);
        let mut exported = String::new();
        prometheus_client::encoding::text::encode(&mut exported, &m.registry.lock().unwrap()).unwrap();
        let mut names: Vec<String> = exported
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect();
        // Families registered by the ingress.
        names.extend(["stemq_http_requests", "stemq_http_request_duration_seconds", "stemq_submits"].map(String::from));
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for file in ["deploy/prometheus/alerts.yml", "deploy/grafana/stemq-dashboard.json", "docs/operations.md"] {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            let mut rest = text.as_str();
            while let Some(i) = rest.find("stemq_") {
                let tail = &rest[i..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                    .unwrap_or(tail.len());
                let used = &tail[..end];
                rest = &tail[end..];
                if ["stemq_jobs", "stemq_keys", "stemq_limits", "stemq_webhooks", "stemq_"].contains(&used) {
                    continue; // the KV buckets, not metrics
                }
                let base =
                    ["_bucket", "_count", "_sum", "_total"].iter().find_map(|s| used.strip_suffix(s)).unwrap_or(used);
                assert!(
                    names.iter().any(|n| n == used || n == base),
                    "{file} uses `{used}`, which no stemq process exports"
                );
            }
        }
    }

    #[test]
    fn names_follow_the_convention() {
        let m = metrics();
        populate(m);
        let text = m.render();
        for name in [
            "stemq_job_duration_seconds",
            "stemq_job_queue_wait_seconds",
            "stemq_job_realtime_factor",
            "stemq_job_outcomes_total",
            "stemq_job_deliveries",
            "stemq_queue_pending_jobs",
            "stemq_queue_in_flight_jobs",
            "stemq_queue_oldest_pending_age_seconds",
            "stemq_projector_lag_events",
            "stemq_projector_errors_total",
            "stemq_worker_heartbeat_timestamp_seconds",
            "stemq_webhook_deliveries_total",
            "stemq_webhook_delivery_duration_seconds",
        ] {
            assert!(text.contains(&format!("# TYPE {name}")) || text.contains(&format!("{name}{{")), "{name}");
        }
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            assert!(line.starts_with("# TYPE stemq_"), "{line}");
        }
        assert!(text.contains(r#"stemq_job_outcomes_total{model="dsp",outcome="succeeded"} "#), "{text}");
    }
}
