//! Prometheus metrics: the process-wide registry every stemq service registers into.
//!
//! This module owns the registry and how it is exposed: a service registers its own
//! families once per process ([`Metrics::register`]; the ingress's, the worker's, the
//! projector's, the relay's and the ledger's live in their crates), and whichever serves
//! `/metrics` (the ingress, or the small metrics listener of a worker or projector
//! process) renders all of it, so `stemq dev` shows every service on one endpoint. Names
//! are `stemq_<name>_<unit>` with low-cardinality labels (model, device, outcome, class,
//! consumer, kind). Queue figures that NATS already knows (pending and in flight per pool
//! consumer and lane, oldest pending, projector lag, live workers per model from the
//! worker registry) are read at scrape time by [`read_queue`], and only in the one
//! process that exports them ([`QueueFigures`]).
//! It also owns the exposition formats ([`Format`]): classic text 0.0.4 unless the
//! scraper asks for OpenMetrics.

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use stemq_core::request::{Model, Priority};
use stemq_nats as names;
use stemq_nats::registry::{self, WorkerInfo};

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
        let queue = queue.map(QueueFigures::registry);
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

/// What NATS knows about one consumer of the job stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsumerFigures {
    /// Messages not yet delivered to the consumer.
    pub pending: u64,
    /// Messages delivered and not yet acked.
    pub in_flight: u64,
}

/// One pool's lane: its consumer (`workers-<model>-<lane>`) as NATS knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneFigures {
    /// The pool's model.
    pub model: Model,
    /// The lane.
    pub lane: Priority,
    /// The lane consumer's figures.
    pub queue: ConsumerFigures,
}

/// The queue figures (`stemq_queue_*`, `stemq_pool_workers`,
/// `stemq_jobs_waiting_for_worker`, `stemq_projector_lag_events`), read from NATS at
/// scrape time by [`read_queue`].
///
/// They describe the stream and the worker registry, not the process that reads them, so
/// exactly one process exports them: the one started with `--queue-metrics` (and
/// `stemq dev`). Were every process to export them, `sum()` over the scrape targets
/// would count the same jobs once per process; the rules and the dashboard use `max`
/// so that two exporters (during a rolling upgrade of that process) still do not double
/// them.
///
/// Every label set is bounded: one series per pool consumer (models are a fixed enum,
/// lanes two), plus the unrouted `workers` consumer and the `projector` consumer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueFigures {
    /// The pool consumers that exist, models in [`Model::ALL`] order, lanes in
    /// [`Priority::ALL`] order.
    pub lanes: Vec<LaneFigures>,
    /// The `workers` consumer (requests of earlier releases, published without a route,
    /// that the ingress's router has not moved into their pools yet), when it exists.
    pub unrouted: Option<ConsumerFigures>,
    /// The `projector` consumer, when it exists.
    pub projector: Option<ConsumerFigures>,
    /// Age of the oldest job request the workers have not finished, over every pool and
    /// the unrouted consumer (zero when none).
    pub oldest_pending_age: Duration,
    /// Job events not yet applied to the status view, when the projector consumer exists.
    pub projector_lag: Option<u64>,
    /// The live workers (the worker registry), by name, when it was readable.
    pub workers: Option<Vec<WorkerInfo>>,
}

/// Labels of the queue gauges: `consumer`, and for a pool consumer `model` and `lane`.
type QueueLabels = Vec<(&'static str, String)>;

impl QueueFigures {
    /// Live workers serving `model`; `None` when the registry was not readable.
    pub fn serving(&self, model: Model) -> Option<usize> {
        self.workers.as_deref().map(|w| registry::serving(w, model))
    }

    /// Jobs pending in the pool of `model` (both lanes).
    pub fn pending(&self, model: Model) -> u64 {
        self.lanes.iter().filter(|l| l.model == model).map(|l| l.queue.pending).sum()
    }

    /// Jobs pending in the pool of `model` (both lanes) while no live worker serves it;
    /// `None` when the registry was not readable (nobody knows who serves what).
    pub fn waiting_for_worker(&self, model: Model) -> Option<u64> {
        Some(if self.serving(model)? > 0 { 0 } else { self.pending(model) })
    }

    /// The figures as a registry of gauges, built for one scrape.
    fn registry(&self) -> Registry {
        let mut r = Registry::default();
        let pending = Family::<QueueLabels, Gauge>::default();
        let in_flight = Family::<QueueLabels, Gauge>::default();
        let set = |labels: QueueLabels, c: ConsumerFigures| {
            pending.get_or_create(&labels).set(c.pending as i64);
            in_flight.get_or_create(&labels).set(c.in_flight as i64);
        };
        for l in &self.lanes {
            let labels = vec![
                ("consumer", names::pool_consumer(l.model, l.lane)),
                ("model", l.model.as_str().to_string()),
                ("lane", l.lane.as_str().to_string()),
            ];
            set(labels, l.queue);
        }
        for (name, c) in [(names::WORKERS_CONSUMER, self.unrouted), (names::PROJECTOR_CONSUMER, self.projector)] {
            let Some(c) = c else { continue };
            set(vec![("consumer", name.to_string())], c);
        }
        let oldest = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        oldest.set(self.oldest_pending_age.as_secs_f64());
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
        if self.workers.is_some() {
            let workers = Family::<ModelLabels, Gauge>::default();
            let waiting = Family::<ModelLabels, Gauge>::default();
            for model in Model::ALL.iter().copied() {
                let l = ModelLabels { model: model.as_str().to_string() };
                workers.get_or_create(&l).set(self.serving(model).unwrap_or(0) as i64);
                waiting.get_or_create(&l).set(self.waiting_for_worker(model).unwrap_or(0) as i64);
            }
            r.register("stemq_pool_workers", "Live workers (worker registry) serving each model", workers);
            r.register(
                "stemq_jobs_waiting_for_worker",
                "Jobs pending in a model's pool while no live worker serves that model",
                waiting,
            );
        }
        if let Some(lag) = self.projector_lag {
            let g = Gauge::<i64>::default();
            g.set(lag as i64);
            r.register("stemq_projector_lag_events", "Job events not yet applied to the status view", g);
        }
        r
    }
}

/// The `model` label of the per-pool gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

/// Consumer info of `consumer` on the job stream: its figures and its ack floor (stream
/// sequence), or `None` (logged) when it cannot be read.
async fn consumer_figures(js: &jetstream::Context, consumer: &str) -> Option<(ConsumerFigures, u64)> {
    let c: Result<PullConsumer, _> = js.get_consumer_from_stream(consumer, names::JOBS_STREAM).await;
    let info = match c {
        Ok(mut c) => c.info().await.cloned().map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match info {
        Ok(info) => Some((
            ConsumerFigures { pending: info.num_pending, in_flight: info.num_ack_pending as u64 },
            info.ack_floor.stream_sequence,
        )),
        Err(error) => {
            tracing::warn!(consumer, %error, "queue figures: consumer info not readable");
            None
        }
    }
}

/// Reads the queue figures from NATS (called at scrape time by the queue exporter, and
/// by `stemq top`): every pool consumer, the unrouted `workers` consumer, the projector,
/// and the worker registry. What cannot be read is left out.
pub async fn read_queue(js: &jetstream::Context) -> QueueFigures {
    let mut q = QueueFigures::default();
    let pools: Vec<(Model, Priority)> =
        Model::ALL.iter().flat_map(|m| Priority::ALL.iter().map(move |l| (*m, *l))).collect();
    let pool_names: Vec<String> = pools.iter().map(|(m, l)| names::pool_consumer(*m, *l)).collect();
    let (pool_infos, unrouted, projector) = futures::join!(
        futures::future::join_all(pool_names.iter().map(|name| consumer_figures(js, name))),
        consumer_figures(js, names::WORKERS_CONSUMER),
        consumer_figures(js, names::PROJECTOR_CONSUMER),
    );
    // The oldest unfinished request of each busy consumer is the first request after its
    // ack floor that its filter matches.
    let busy = |c: &ConsumerFigures| c.pending + c.in_flight > 0;
    let mut starts: Vec<(u64, String)> = Vec::new();
    for ((model, lane), info) in pools.iter().zip(pool_infos) {
        let Some((figures, floor)) = info else { continue };
        q.lanes.push(LaneFigures { model: *model, lane: *lane, queue: figures });
        if busy(&figures) {
            starts.push((floor, names::pool_filter(*model, *lane)));
        }
    }
    if let Some((figures, floor)) = unrouted {
        q.unrouted = Some(figures);
        if busy(&figures) {
            starts.extend(names::UNROUTED_FILTERS.iter().map(|f| (floor, f.to_string())));
        }
    }
    q.projector = projector.map(|(figures, _)| figures);
    let projector_floor = projector.map(|(_, floor)| floor);

    q.workers = match js.get_key_value(names::WORKERS_BUCKET).await {
        Ok(bucket) => match registry::live(&bucket).await {
            Ok(live) => Some(live),
            Err(error) => {
                tracing::warn!(%error, "queue figures: worker registry not readable");
                None
            }
        },
        Err(error) => {
            tracing::warn!(%error, "queue figures: worker registry not readable");
            None
        }
    };

    let Ok(stream) = js.get_stream_no_info(names::JOBS_STREAM).await else {
        return q;
    };
    let mut oldest: Option<(u64, std::time::SystemTime)> = None;
    for (floor, filter) in &starts {
        if let Ok(msg) = stream.direct_get_builder().sequence(floor + 1).next_by_subject(filter).send().await {
            if oldest.is_none_or(|(seq, _)| msg.sequence < seq) {
                oldest = Some((msg.sequence, msg.time.into()));
            }
        }
    }
    if let Some((_, t)) = oldest {
        q.oldest_pending_age = t.elapsed().unwrap_or(Duration::ZERO);
    }
    if let (Some(floor), Ok(mut s)) = (projector_floor, js.get_stream(names::JOBS_STREAM).await) {
        if let Ok(info) = s.info().await {
            q.projector_lag = Some(info.state.last_sequence.saturating_sub(floor));
        }
    }
    q
}

#[cfg(test)]
mod tests {
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

    /// The alert rules are valid and pass their unit tests (`deploy/prometheus/tests.yml`:
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
