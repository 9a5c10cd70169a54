//! Prometheus metrics: the process-wide registry every stemq service registers into.
//!
//! This module owns the registry and how it is exposed: a service registers its own
//! families once per process ([`Metrics::register`]; the ingress's, the worker's, the
//! projector's, the relay's and the ledger's live in their crates), and whichever serves
//! `/metrics` (the ingress, or the small metrics listener of a worker or projector
//! process) renders all of it, so `stemq dev` shows every service on one endpoint. Names
//! are `stemq_<name>_<unit>` with low-cardinality labels (model, device, outcome, class,
//! consumer, kind). The queue figures ([`QueueFigures`]: pending and in flight per pool
//! consumer and lane, oldest pending, projector lag, live workers per model), read from
//! NATS at scrape time, become gauges here, only in the one process that exports them.
//! It also owns the exposition formats ([`Format`]): classic text 0.0.4 unless the
//! scraper asks for OpenMetrics.

use std::sync::{Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use stemq_core::request::Model;
use stemq_nats as names;
use stemq_nats::queue_figures::{ConsumerFigures, QueueFigures};

/// The process-wide registry.
pub struct Metrics {
    registry: Mutex<Registry>,
}

/// The process-wide registry (empty until the services register their families).
pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| Metrics { registry: Mutex::new(Registry::default()) })
}

impl Metrics {
    /// Adds a service's families to the registry (once per process: a name registered
    /// twice is exported twice).
    pub fn register(&self, f: impl FnOnce(&mut Registry)) {
        f(&mut self.registry.lock().expect("registry lock"));
    }

    /// The classic Prometheus text format of this process's own metrics (no queue
    /// figures): what tests and `stemq top` read.
    pub fn render(&self) -> String {
        self.encode(Format::Classic, None)
    }

    /// A scrape's body in `format`: this process's metrics and, in the one process that
    /// exports them (see [`QueueFigures`]), the queue figures read for this scrape.
    pub fn encode(&self, format: Format, queue: Option<&QueueFigures>) -> String {
        let mut out = String::new();
        let own = self.registry.lock().expect("registry lock");
        let queue = queue.map(queue_registry);
        let parts = std::iter::once(&*own).chain(queue.as_ref());
        // Writing into a String cannot fail, and every family's name and labels are ours.
        for r in parts {
            match format {
                Format::Classic => prometheus_client::encoding::prometheus_text::encode(&mut out, r),
                Format::OpenMetrics => prometheus_client::encoding::text::encode_registry(&mut out, r),
            }
            .expect("metrics encode");
        }
        if format == Format::OpenMetrics {
            prometheus_client::encoding::text::encode_eof(&mut out).expect("metrics encode");
        }
        out
    }
}

/// The exposition format a scrape asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4: counters' HELP and TYPE name the `_total` series,
    /// no `# EOF`. The answer to every scraper that does not ask for OpenMetrics.
    Classic,
    /// OpenMetrics 1.0.0 (`# EOF` at the end, counters' TYPE on the family name).
    OpenMetrics,
}

impl Format {
    /// The format for the `Accept` header values of a request: OpenMetrics when a media
    /// range `application/openmetrics-text` is acceptable (q > 0) and preferred at least
    /// as much as the classic text format (`text/plain`, `text/*`, `*/*`); classic text
    /// otherwise, also when there is no header.
    pub fn negotiate<'a>(accept: impl IntoIterator<Item = &'a str>) -> Format {
        let (mut openmetrics, mut classic) = (0.0f32, 0.0f32);
        for range in accept.into_iter().flat_map(|v| v.split(',')) {
            let mut params = range.split(';').map(str::trim);
            let media = params.next().unwrap_or("").to_ascii_lowercase();
            let q = params
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map(|(_, v)| v.trim().parse::<f32>().unwrap_or(0.0))
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(q),
                "text/plain" | "text/*" | "*/*" => classic = classic.max(q),
                _ => {}
            }
        }
        if openmetrics > 0.0 && openmetrics >= classic {
            Format::OpenMetrics
        } else {
            Format::Classic
        }
    }

    /// The `Content-Type` of a body in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Classic => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Labels of the queue gauges: `consumer`, and for a pool consumer `model` and `lane`.
type QueueLabels = Vec<(&'static str, String)>;

/// The queue figures as a registry of gauges, built for one scrape.
fn queue_registry(q: &QueueFigures) -> Registry {
    let mut r = Registry::default();
    let pending = Family::<QueueLabels, Gauge>::default();
    let in_flight = Family::<QueueLabels, Gauge>::default();
    let set = |labels: QueueLabels, c: ConsumerFigures| {
        pending.get_or_create(&labels).set(c.pending as i64);
        in_flight.get_or_create(&labels).set(c.in_flight as i64);
    };
    for l in &q.lanes {
        let labels = vec![
            ("consumer", names::pool_consumer(l.model, l.lane)),
            ("model", l.model.as_str().to_string()),
            ("lane", l.lane.as_str().to_string()),
        ];
        set(labels, l.queue);
    }
    for (name, c) in [(names::WORKERS_CONSUMER, q.unrouted), (names::PROJECTOR_CONSUMER, q.projector)] {
        let Some(c) = c else { continue };
        set(vec![("consumer", name.to_string())], c);
    }
    let oldest = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    oldest.set(q.oldest_pending_age.as_secs_f64());
    r.register(
        "stemq_queue_pending_jobs",
        "Messages not yet delivered to the consumer (per pool consumer and lane, the unrouted workers \
         consumer, the projector)",
        pending,
    );
    r.register("stemq_queue_in_flight_jobs", "Messages delivered and not yet acked", in_flight);
    r.register(
        "stemq_queue_oldest_pending_age_seconds",
        "Age of the oldest job request not yet finished by a worker, over every pool",
        oldest,
    );
    if q.workers.is_some() {
        let workers = Family::<ModelLabels, Gauge>::default();
        let waiting = Family::<ModelLabels, Gauge>::default();
        for model in Model::ALL.iter().copied() {
            let l = ModelLabels { model: model.as_str().to_string() };
            workers.get_or_create(&l).set(q.serving(model).unwrap_or(0) as i64);
            waiting.get_or_create(&l).set(q.waiting_for_worker(model).unwrap_or(0) as i64);
        }
        r.register("stemq_pool_workers", "Live workers (worker registry) serving each model", workers);
        r.register(
            "stemq_jobs_waiting_for_worker",
            "Jobs pending in a model's pool while no live worker serves that model",
            waiting,
        );
    }
    if let Some(lag) = q.projector_lag {
        let g = Gauge::<i64>::default();
        g.set(lag as i64);
        r.register("stemq_projector_lag_events", "Job events not yet applied to the status view", g);
    }
    r
}

/// The `model` label of the per-pool gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use stemq_core::request::Priority;
    use stemq_nats::queue_figures::LaneFigures;
    use stemq_nats::registry::WorkerInfo;

    use super::*;

    /// A live worker serving `models`.
    fn worker(name: &str, models: &[Model]) -> WorkerInfo {
        stemq_nats::registry::test_worker(name, models, 0)
    }

    /// Queue figures as the exporting process reads them: 3 interactive dsp jobs
    /// waiting with a dsp worker up, 2 batch htdemucs jobs waiting with no htdemucs
    /// worker, 1 unrouted request.
    fn queue() -> QueueFigures {
        let lane = |model, lane, pending, in_flight| LaneFigures {
            model,
            lane,
            queue: ConsumerFigures { pending, in_flight },
        };
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

    /// Issue 12: the queue figures are per pool and lane, with the pool's model and lane
    /// as labels; live workers per model; jobs waiting in a pool nobody serves.
    #[test]
    fn queue_figures_are_per_pool_and_lane() {
        let m = metrics();
        let text = m.encode(Format::Classic, Some(&queue()));
        for series in [
            r#"stemq_queue_pending_jobs{consumer="workers-dsp-interactive",model="dsp",lane="interactive"} 3"#,
            r#"stemq_queue_in_flight_jobs{consumer="workers-dsp-interactive",model="dsp",lane="interactive"} 1"#,
            r#"stemq_queue_pending_jobs{consumer="workers-htdemucs-batch",model="htdemucs",lane="batch"} 2"#,
            r#"stemq_queue_pending_jobs{consumer="workers"} 1"#,
            r#"stemq_queue_pending_jobs{consumer="projector"} 0"#,
            r#"stemq_pool_workers{model="dsp"} 1"#,
            r#"stemq_pool_workers{model="htdemucs_6s"} 0"#,
            // dsp is served: its jobs wait for their turn, not for a worker.
            r#"stemq_jobs_waiting_for_worker{model="dsp"} 0"#,
            r#"stemq_jobs_waiting_for_worker{model="htdemucs"} 2"#,
            r#"stemq_jobs_waiting_for_worker{model="htdemucs_ft"} 0"#,
        ] {
            assert!(text.contains(&format!("{series}\n")), "missing {series} in\n{text}");
        }
        // One series per model for the per-model gauges: a bounded label set.
        for family in ["stemq_pool_workers{", "stemq_jobs_waiting_for_worker{"] {
            assert_eq!(text.lines().filter(|l| l.starts_with(family)).count(), Model::ALL.len(), "{family}");
        }
        // Without the registry nobody knows who serves what: no claim either way.
        let blind = QueueFigures { workers: None, ..queue() };
        assert_eq!(blind.waiting_for_worker(Model::Htdemucs), None);
        let text = m.encode(Format::Classic, Some(&blind));
        assert!(!text.contains("stemq_pool_workers") && !text.contains("stemq_jobs_waiting_for_worker"), "{text}");
    }

    /// Issue "alerts that tell the truth" (a): a process that is not the queue exporter
    /// exports no queue figure at all (not even a zero), so `max` and `sum` over the scrape
    /// targets see each job once.
    #[test]
    fn only_the_queue_exporter_exports_queue_figures() {
        let m = metrics();
        for format in [Format::Classic, Format::OpenMetrics] {
            let other = m.encode(format, None);
            for family in
                ["stemq_queue_", "stemq_projector_lag_events", "stemq_pool_workers", "stemq_jobs_waiting_for_worker"]
            {
                assert!(!other.contains(family), "{family} exported by a non-exporter:\n{other}");
            }
            let exporter = m.encode(format, Some(&queue()));
            assert!(exporter.contains("stemq_queue_oldest_pending_age_seconds 42.0"), "{exporter}");
            assert!(exporter.contains("stemq_projector_lag_events 0"), "{exporter}");
        }
    }

    #[test]
    fn accept_headers_choose_the_format() {
        // Prometheus 2.42's scrape Accept header.
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;\
                          q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate([prometheus]), Format::OpenMetrics);
        assert_eq!(Format::negotiate([]), Format::Classic);
        assert_eq!(Format::negotiate(["*/*"]), Format::Classic);
        assert_eq!(Format::negotiate(["text/plain;version=0.0.4"]), Format::Classic);
        assert_eq!(Format::negotiate(["application/openmetrics-text; version=1.0.0"]), Format::OpenMetrics);
        assert_eq!(Format::negotiate(["Application/OpenMetrics-Text;q=0"]), Format::Classic);
        assert_eq!(Format::negotiate(["text/plain", "application/openmetrics-text;q=0.5"]), Format::Classic);
        assert_eq!(Format::negotiate(["application/json"]), Format::Classic);
        assert_eq!(Format::OpenMetrics.content_type(), "application/openmetrics-text; version=1.0.0; charset=utf-8");
        assert_eq!(Format::Classic.content_type(), "text/plain; version=0.0.4; charset=utf-8");
    }

    /// The alert rules are valid and their unit tests succeed (`deploy/prometheus/tests.yml`:
    /// every alert, and two queue exporters that must not double the backlog).
    #[test]
    fn alert_rules_pass_their_promtool_tests() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/prometheus");
        let (rules, tests) = (dir.join("alerts.yml"), dir.join("tests.yml"));
        for args in [["check", "rules", rules.to_str().unwrap()], ["test", "rules", tests.to_str().unwrap()]] {
            let Some(report) = stemq_devkit::promtool::run(&args) else { return };
            assert!(report.ok, "promtool {args:?}:\n{}", report.output);
        }
    }
}
