//! Prometheus metrics of the projector's fold, named `stemq_projector_<name>`.
//!
//! This module owns the fold's own figures: events it could not apply yet, by kind, and
//! jobs it refolded from the log. The families live in the process-wide registry of
//! [`stemq_telemetry::metrics`], registered by [`metrics`] once per process ([`run`]
//! calls it at start). The charge-side figures are the ledger's ([`crate::ledger`]).
//!
//! [`run`]: crate::run

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: String,
}

/// The projector's metric families.
pub struct ProjectorMetrics {
    errors: Family<ErrorLabels, Counter>,
    refolds: Counter,
}

/// The projector's metrics, registered in the process-wide registry on first use.
pub fn metrics() -> &'static ProjectorMetrics {
    static M: OnceLock<ProjectorMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = ProjectorMetrics { errors: Family::default(), refolds: Counter::default() };
        stemq_telemetry::metrics::metrics().register(|r| {
            r.register(
                "stemq_projector_errors",
                "Events the projector could not apply yet, by kind (corrupt_view, kv_read, kv_write, \
                 log_read, log_behind, kv_conflict, unreadable_event); each is retried, never skipped",
                m.errors.clone(),
            );
            r.register(
                "stemq_projector_refolds",
                "Jobs the projector refolded from the log because an event came behind its view \
                 (overtaken by another projector, a redelivery or a retried fold)",
                m.refolds.clone(),
            );
        });
        m
    })
}

impl ProjectorMetrics {
    /// Counts one projector error of `kind` (`corrupt_view`, `kv_read`, `kv_write`,
    /// `log_read`, `kv_conflict`, `unreadable_event`, ...).
    pub fn error(&self, kind: &str) {
        self.errors.get_or_create(&ErrorLabels { kind: kind.into() }).inc();
    }

    /// Counts one job refolded from the log.
    pub fn refold(&self) {
        self.refolds.inc();
    }
}
