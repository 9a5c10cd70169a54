//! Prometheus metrics of the projector's fold, named `stemq_projector_<name>`.
//!
//! This module owns the fold's own figures: events it could not apply yet, by kind, jobs
//! it refolded from the log, and view writes by how they were stored. The families live in the process-wide registry of
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    how: &'static str,
}

/// The projector's metric families.
pub struct ProjectorMetrics {
    errors: Family<ErrorLabels, Counter>,
    refolds: Counter,
    writes: Family<WriteLabels, Counter>,
}

/// The projector's metrics, registered in the process-wide registry on first use.
pub fn metrics() -> &'static ProjectorMetrics {
    static M: OnceLock<ProjectorMetrics> = OnceLock::new();
    M.get_or_init(|| {
        let m = ProjectorMetrics { errors: Family::default(), refolds: Counter::default(), writes: Family::default() };
        for how in ["batch", "alone"] {
            m.writes.get_or_create(&WriteLabels { how });
        }
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
            r.register(
                "stemq_projector_view_writes",
                "Views written, by how: `batch` (stored with other jobs' views in one atomic batch) \
                 or `alone` (one compare-and-set)",
                m.writes.clone(),
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

    /// Counts one view written, in a batch or alone.
    pub fn view_written(&self, batch: bool) {
        self.writes.get_or_create(&WriteLabels { how: if batch { "batch" } else { "alone" } }).inc();
    }
}
