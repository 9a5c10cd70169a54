//! Prometheus metrics of the relay, named `stemq_webhook_<name>`.
//!
//! This module owns what the relay records: webhook delivery attempts by outcome and
//! their latency. The families live in the process-wide registry of
//! [`stemq_telemetry::metrics`], registered by [`metrics`] once per process ([`run`]
//! calls it at start).
//!
//! [`run`]: crate::run

use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookLabels {
    outcome: String,
}

/// The relay's metric families.
pub struct RelayMetrics {
    webhooks: Family<WebhookLabels, Counter>,
    webhook_latency: Histogram,
}

/// The relay's metrics, registered in the process-wide registry on first use.
pub fn metrics() -> &'static RelayMetrics {
    static M: OnceLock<RelayMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = RelayMetrics {
            webhooks: Family::default(),
            webhook_latency: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
        };
        stemq_telemetry::metrics::metrics().register(|r| {
            r.register(
                "stemq_webhook_deliveries",
                "Webhook delivery attempts by outcome (delivered, retrying, failed, disabled)",
                m.webhooks.clone(),
            );
            r.register("stemq_webhook_delivery_duration_seconds", "Webhook attempt latency", m.webhook_latency.clone());
        });
        m
    })
}

impl RelayMetrics {
    /// Records one webhook attempt.
    pub fn webhook(&self, outcome: &str, latency: Duration) {
        self.webhooks.get_or_create(&WebhookLabels { outcome: outcome.into() }).inc();
        self.webhook_latency.observe(latency.as_secs_f64());
    }
}
