//! The `/metrics` body of a process that runs every service, as `stemq dev` serves it:
//! each service registers its own families into the process-wide registry
//! ([`stemq_telemetry::metrics`]); together they follow the naming convention, parse
//! as Prometheus's classic text and OpenMetrics, and hold every name that the alert
//! rules, the dashboard and the operations guide use.

use std::time::Duration;

use stemq_core::request::{Model, Priority};
use stemq_nats::queue_figures::{ConsumerFigures, LaneFigures, QueueFigures};
use stemq_nats::registry::WorkerInfo;
use stemq_telemetry::metrics::{metrics, Format, Metrics};
use stemq_worker::metrics::{DeviceLabels, JobLabels};

/// A live worker serving `models`.
fn worker(name: &str, models: &[Model]) -> WorkerInfo {
    stemq_nats::registry::test_worker(name, models, 0)
}

/// Queue figures as the exporting process reads them: 3 interactive dsp jobs
/// waiting with a dsp worker up, 2 batch htdemucs jobs waiting with no htdemucs
/// worker, 1 unrouted request.
fn queue() -> QueueFigures {
    let lane =
        |model, lane, pending, in_flight| LaneFigures { model, lane, queue: ConsumerFigures { pending, in_flight } };
    QueueFigures {
        lanes: vec![
            lane(Model::Dsp, Priority::Interactive, 3, 1),
            lane(Model::Dsp, Priority::Batch, 0, 0),
            lane(Model::Htdemucs, Priority::Interactive, 0, 0),
            lane(Model::Htdemucs, Priority::Batch, 2, 0),
        ],
        unrouted: Some(ConsumerFigures { pending: 1, in_flight: 0 }),
        projector: Some(ConsumerFigures { pending: 0, in_flight: 0 }),
        oldest_pending_age: Duration::from_secs(42),
        projector_lag: Some(0),
        workers: Some(vec![worker("cpu-1", &[Model::Dsp])]),
    }
}

/// Registers every service's families and gives each a sample, so each one appears in
/// the text format.
fn populate() -> &'static Metrics {
    let w = stemq_worker::metrics::metrics();
    w.outcome("dsp", "succeeded");
    w.heartbeat("w1");
    let l = JobLabels { model: "dsp".into(), device: "cpu".into() };
    w.job_duration.get_or_create(&l).observe(1.5);
    w.queue_wait.get_or_create(&l).observe(0.1);
    w.realtime_factor.get_or_create(&l).observe(0.05);
    w.gpu_memory.get_or_create(&DeviceLabels { device: "cuda:0".into() }).set(1 << 30);
    stemq_projector::metrics::metrics().error("corrupt_view");
    stemq_relay::metrics::metrics().webhook("delivered", Duration::from_millis(30));
    stemq_accounts::ledger::register_metrics();
    metrics()
}

#[test]
fn names_follow_the_convention() {
    let m = populate();
    let text = m.encode(Format::Classic, Some(&queue()));
    for name in [
        "stemq_job_duration_seconds",
        "stemq_job_queue_wait_seconds",
        "stemq_job_realtime_factor",
        "stemq_job_outcomes_total",
        "stemq_job_deliveries",
        "stemq_queue_pending_jobs",
        "stemq_queue_in_flight_jobs",
        "stemq_queue_oldest_pending_age_seconds",
        "stemq_pool_workers",
        "stemq_jobs_waiting_for_worker",
        "stemq_projector_lag_events",
        "stemq_projector_errors_total",
        "stemq_projector_refolds_total",
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

/// Issue "alerts that tell the truth" (c): the classic body is what the classic
/// parser expects: counters' TYPE names the `_total` series, a HELP line for every
/// family, no OpenMetrics-only lines.
#[test]
fn classic_text_types_counters_as_their_total_series() {
    let m = populate();
    let text = m.encode(Format::Classic, Some(&queue()));
    assert!(text.contains("# TYPE stemq_job_outcomes_total counter\n"), "{text}");
    assert!(text.contains("# TYPE stemq_webhook_deliveries_total counter\n"), "{text}");
    for line in ["# EOF", "# UNIT", "_created"] {
        assert!(!text.contains(line), "{line} in the classic body:\n{text}");
    }
    let helped: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# HELP ")?.split(' ').next()).collect();
    let typed: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
    assert_eq!(helped, typed, "a HELP line before every TYPE line");
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = &line[..line.find(['{', ' ']).unwrap()];
        assert!(
            typed.iter().any(|t| name == *t || ["_bucket", "_sum", "_count"].iter().any(|s| name == format!("{t}{s}"))),
            "{name} has no TYPE line"
        );
    }
}

#[test]
fn openmetrics_body_ends_with_one_eof() {
    let m = populate();
    let text = m.encode(Format::OpenMetrics, Some(&queue()));
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert_eq!(text.matches("# EOF").count(), 1, "{text}");
    assert!(text.contains("# TYPE stemq_job_outcomes counter\n"), "{text}");
    assert!(text.contains("stemq_queue_pending_jobs{consumer=\"workers\"} 1\n"), "{text}");
}

/// `promtool check metrics` (Debian's `prometheus` package) accepts the classic body.
/// Without promtool it fails in CI and is skipped elsewhere (`promtool::available`).
#[test]
fn promtool_accepts_the_classic_body() {
    let m = populate();
    let text = m.encode(Format::Classic, Some(&queue()));
    let Some(report) = stemq_devkit::promtool::check_metrics(&text) else { return };
    assert!(report.ok, "promtool check metrics:\n{}\n{text}", report.output);
}

/// Every `stemq_*` name the alert rules and the dashboard in deploy/ use is one we
/// export, so a rename cannot silently break paging.
#[test]
fn deploy_rules_and_dashboard_use_exported_names() {
    let m = populate();
    let exported = m.encode(Format::OpenMetrics, Some(&queue()));
    let mut names: Vec<String> = exported
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    // Families registered by the ingress and by the ledger (stemq-accounts).
    names.extend(
        ["stemq_http_requests", "stemq_http_request_duration_seconds", "stemq_submits", "stemq_ledger_entries_skipped"]
            .map(String::from),
    );
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/prometheus/tests.yml",
        "deploy/grafana/stemq-dashboard.json",
        "docs/operations.md",
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("stemq_") {
            let tail = &rest[i..];
            let end =
                tail.find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
            let used = &tail[..end];
            rest = &tail[end..];
            if ["stemq_jobs", "stemq_keys", "stemq_limits", "stemq_webhooks", "stemq_delivery_claims", "stemq_workers"]
                .contains(&used)
            {
                continue; // the KV buckets, not metrics
            }
            if used.ends_with('_') {
                continue; // a prefix, as in `stemq_queue_*`
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
