//! Logs and traces, set up once per process.
//!
//! This module owns the telemetry wiring of every stemq binary:
//! - logs: JSON lines for services (span fields such as `job_id`, `attempt` and
//!   `trace_id` on every line inside a job), human-readable text for `stemq dev` on a
//!   terminal; `RUST_LOG` filters (default `info`);
//! - traces: OpenTelemetry over OTLP, **off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set**; then the standard variables apply
//!   (`OTEL_EXPORTER_OTLP_PROTOCOL` = `http/protobuf` (default) or `grpc`,
//!   `OTEL_SERVICE_NAME`, `OTEL_BSP_*`, ...). When off, no exporter, no layer: nothing
//!   but the log subscriber runs;
//! - propagation: one trace per job across processes. The W3C `traceparent` of the
//!   request travels in the events (CloudEvents tracing extension, and the NATS header
//!   of the same name); a service continues it with [`set_parent`], and stamps new
//!   events with [`current_traceparent`].

use std::collections::HashMap;
use std::sync::OnceLock;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, EnvFilter, Layer};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// For people at a terminal.
    Text,
}

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// True when an OTLP endpoint is configured.
pub fn tracing_enabled() -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|k| std::env::var(k).map(|v| !v.is_empty()).unwrap_or(false))
}

fn tracer_provider(service: &str) -> Option<SdkTracerProvider> {
    if !tracing_enabled() {
        return None;
    }
    let grpc = std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").map(|p| p == "grpc").unwrap_or(false);
    let exporter = if grpc {
        opentelemetry_otlp::SpanExporter::builder().with_tonic().build()
    } else {
        opentelemetry_otlp::SpanExporter::builder().with_http().build()
    };
    let exporter = match exporter {
        Ok(e) => e,
        Err(e) => {
            eprintln!("OpenTelemetry exporter not started: {e}");
            return None;
        }
    };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_string());
    }
    Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build())
}

/// Installs the global subscriber (once; later calls are ignored). `service` names the
/// process in traces unless `OTEL_SERVICE_NAME` says otherwise.
pub fn init(format: LogFormat, service: &str) {
    init_with_writer(format, service, std::io::stderr)
}

/// [`init`] with another log destination (tests capture logs this way).
pub fn init_with_writer<W>(format: LogFormat, service: &str, writer: W)
where
    W: for<'a> fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,async_nats=warn"));
    let logs = match format {
        LogFormat::Json => {
            fmt::layer().json().with_current_span(true).with_span_list(false).with_writer(writer).boxed()
        }
        LogFormat::Text => {
            use std::io::IsTerminal;
            fmt::layer().compact().with_ansi(std::io::stderr().is_terminal()).with_writer(writer).boxed()
        }
    };
    let otel = tracer_provider(service).map(|p| {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let tracer = p.tracer("stemq");
        let _ = PROVIDER.set(p);
        tracing_opentelemetry::layer().with_tracer(tracer)
    });
    let _ = tracing_subscriber::registry().with(filter).with(logs).with(otel).try_init();
}

/// Exports what is buffered (call before exit; tests call it before asserting).
pub fn flush() {
    if let Some(p) = PROVIDER.get() {
        let _ = p.force_flush();
    }
}

/// The W3C `traceparent` of the current span, when tracing is on.
pub fn current_traceparent() -> Option<String> {
    PROVIDER.get()?;
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` a child of the remote span `traceparent` (no-op when tracing is off or
/// the header is absent or malformed), and records its `trace_id` field if it has one.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if PROVIDER.get().is_none() {
        return;
    }
    if let Some(tp) = traceparent {
        let carrier: HashMap<String, String> = [("traceparent".to_string(), tp.to_string())].into();
        let cx = TraceContextPropagator::new().extract(&carrier);
        if cx.span().span_context().is_valid() {
            let _ = span.set_parent(cx);
        }
    }
    let id = span.context().span().span_context().trace_id();
    span.record("trace_id", tracing::field::display(id));
}
