//! Prometheus metrics of the ingress, named `stemq_<name>_<unit>`.
//!
//! This module owns what `/metrics` shows: HTTP traffic, submits by outcome, and the
//! queue as NATS sees it (pending and in-flight jobs of the worker consumer, projector
//! lag), read from consumer info at scrape time so they need no extra bookkeeping.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use stemq_core::nats as names;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabels {
    consumer: &'static str,
}

/// The ingress's metrics.
pub struct Metrics {
    registry: Registry,
    http: Family<HttpLabels, Counter>,
    http_latency: Family<HttpLabels, Histogram>,
    submits: Family<SubmitLabels, Counter>,
    pending: Family<ConsumerLabels, Gauge>,
    in_flight: Family<ConsumerLabels, Gauge>,
    js: jetstream::Context,
}

impl Metrics {
    /// Registers every metric.
    pub fn new(js: jetstream::Context) -> Metrics {
        let mut registry = Registry::default();
        let http = Family::<HttpLabels, Counter>::default();
        let http_latency = Family::<HttpLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 14))
        });
        let submits = Family::<SubmitLabels, Counter>::default();
        let pending = Family::<ConsumerLabels, Gauge>::default();
        let in_flight = Family::<ConsumerLabels, Gauge>::default();
        registry.register("stemq_http_requests", "HTTP requests by route and status", http.clone());
        registry.register(
            "stemq_http_request_duration_seconds",
            "HTTP request latency",
            http_latency.clone(),
        );
        registry.register(
            "stemq_submits",
            "Job submits by outcome (created, cached, invalid, unavailable)",
            submits.clone(),
        );
        registry.register(
            "stemq_queue_pending_jobs",
            "Messages not yet delivered to the consumer",
            pending.clone(),
        );
        registry.register(
            "stemq_queue_in_flight_jobs",
            "Messages delivered and not yet acked",
            in_flight.clone(),
        );
        Metrics {
            registry,
            http,
            http_latency,
            submits,
            pending,
            in_flight,
            js,
        }
    }

    /// Records one HTTP request.
    pub fn observe_http(&self, method: &str, route: &str, status: u16, took: Duration) {
        let l = HttpLabels {
            method: method.to_string(),
            route: route.to_string(),
            status,
        };
        self.http.get_or_create(&l).inc();
        self.http_latency.get_or_create(&l).observe(took.as_secs_f64());
    }

    /// Records one submit.
    pub fn observe_submit<T>(&self, r: &Result<(SubmitResponse, T), SubmitError>) {
        let outcome = match r {
            Ok((s, _)) if s.cached => "cached",
            Ok(_) => "created",
            Err(SubmitError::Invalid(_)) => "invalid",
            Err(SubmitError::Unavailable(_)) => "unavailable",
        };
        self.submits.get_or_create(&SubmitLabels { outcome }).inc();
    }

    /// Refreshes the queue gauges and renders the text format.
    pub async fn render(&self) -> String {
        for (stream, consumer) in [
            (names::JOBS_STREAM, names::WORKERS_CONSUMER),
            (names::JOBS_STREAM, names::PROJECTOR_CONSUMER),
        ] {
            let c: Result<PullConsumer, _> = self.js.get_consumer_from_stream(consumer, stream).await;
            if let Ok(mut c) = c {
                if let Ok(info) = c.info().await {
                    let l = ConsumerLabels {
                        consumer: if consumer == names::WORKERS_CONSUMER {
                            "workers"
                        } else {
                            "projector"
                        },
                    };
                    self.pending.get_or_create(&l).set(info.num_pending as i64);
                    self.in_flight.get_or_create(&l).set(info.num_ack_pending as i64);
                }
            }
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("metrics encode");
        out
    }
}
