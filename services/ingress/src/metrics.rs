//! Prometheus metrics of the ingress, named `stemq_<name>_<unit>`.
//!
//! This module owns what the ingress records: HTTP traffic by route and status, and
//! submits by outcome. They live in the process-wide registry of
//! [`stemq_telemetry::metrics`], so `/metrics` also shows, in `stemq dev`, the worker's and
//! projector's metrics, and the queue figures (read from NATS at scrape time) when this
//! ingress is the queue exporter (`Config::queue_metrics`).

use std::time::Duration;

use async_nats::jetstream;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use stemq_telemetry::metrics::Format;

use crate::submit::{SubmitError, SubmitResponse};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    method: String,
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubmitLabels {
    outcome: &'static str,
}

/// The ingress's metrics.
pub struct Metrics {
    http: Family<HttpLabels, Counter>,
    http_latency: Family<HttpLabels, Histogram>,
    submits: Family<SubmitLabels, Counter>,
    js: jetstream::Context,
}

impl Metrics {
    /// Registers the ingress's metrics in the shared registry (once per process).
    pub fn new(js: jetstream::Context) -> Metrics {
        type Families = (Family<HttpLabels, Counter>, Family<HttpLabels, Histogram>, Family<SubmitLabels, Counter>);
        static FAMILIES: std::sync::OnceLock<Families> = std::sync::OnceLock::new();
        let (http, http_latency, submits) = FAMILIES
            .get_or_init(|| {
                let http = Family::<HttpLabels, Counter>::default();
                let http_latency = Family::<HttpLabels, Histogram>::new_with_constructor(|| {
                    Histogram::new(exponential_buckets(0.0005, 2.0, 14))
                });
                let submits = Family::<SubmitLabels, Counter>::default();
                stemq_telemetry::metrics::metrics().register(|r| {
                    r.register("stemq_http_requests", "HTTP requests by route and status", http.clone());
                    r.register("stemq_http_request_duration_seconds", "HTTP request latency", http_latency.clone());
                    r.register(
                        "stemq_submits",
                        "Job submits by outcome (created, cached, invalid, unavailable)",
                        submits.clone(),
                    );
                });
                (http, http_latency, submits)
            })
            .clone();
        Metrics { http, http_latency, submits, js }
    }

    /// Records one HTTP request.
    pub fn observe_http(&self, method: &str, route: &str, status: u16, took: Duration) {
        let l = HttpLabels { method: method.to_string(), route: route.to_string(), status };
        self.http.get_or_create(&l).inc();
        self.http_latency.get_or_create(&l).observe(took.as_secs_f64());
    }

    /// Records one submit.
    pub fn observe_submit<T>(&self, r: &Result<(SubmitResponse, T), SubmitError>) {
        let outcome = match r {
            Ok((s, _)) if s.cached => "cached",
            Ok(_) => "created",
            Err(SubmitError::Invalid(_) | SubmitError::Unserved { .. }) => "invalid",
            Err(SubmitError::Unavailable { .. }) => "unavailable",
            Err(SubmitError::Limited(_)) => "limited",
            Err(SubmitError::Refused(_)) => "refused",
        };
        self.submits.get_or_create(&SubmitLabels { outcome }).inc();
    }

    /// A scrape's body in `format`, with the queue figures read from NATS when this
    /// ingress is the queue exporter (`queue`).
    pub async fn render(&self, format: Format, queue: bool) -> String {
        let figures = match queue {
            true => Some(stemq_nats::queue_figures::read_queue(&self.js).await),
            false => None,
        };
        stemq_telemetry::metrics::metrics().encode(format, figures.as_ref())
    }
}
