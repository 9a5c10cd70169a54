//! `stemq ingress|worker|projector`: each service alone, as deployed.
//!
//! Every service connects, checks the server version, creates whatever NATS definitions
//! are missing (existing ones are left as the server has them: `stemq nats apply` is the
//! one command that changes them) and then calls its crate's `run` with a shutdown token
//! tied to SIGTERM and Ctrl-C.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use stemq_core::engine::{Engine, FakeEngine};
use stemq_core::storage::Store;
use tokio_util::sync::CancellationToken;

use crate::cli::{Global, IngressArgs, Isolation, ProjectorArgs, RelayArgs, WorkerOpts};

/// Connects and creates the definitions that are missing.
pub async fn connect(g: &Global, name: &str) -> Result<async_nats::Client> {
    let client = stemq_core::nats::connect(&g.nats_url(), name).await?;
    stemq_core::nats::ensure(&async_nats::jetstream::new(client.clone()), &g.settings()).await?;
    Ok(client)
}

/// Loads the engine named in the options, isolated in engine host processes unless
/// `--isolation none`.
pub fn engine(g: &Global, opts: &WorkerOpts) -> Result<Arc<dyn Engine>> {
    if opts.isolation == Isolation::None {
        return engine_in_process(g, opts);
    }
    let program = std::env::current_exe().context("finding the stemq executable for the engine host")?;
    let mut args: Vec<std::ffi::OsString> = vec!["--data-dir".into(), g.data_dir.clone().into()];
    if let Some(f) = &g.log_format {
        args.extend(["--log-format".into(), f.into()]);
    }
    args.extend(["engine-host".into(), "--engine".into(), opts.engine.clone().into()]);
    if let Some(m) = &opts.models {
        args.extend(["--models".into(), m.clone().into()]);
    }
    if let Some(b) = opts.memory_budget {
        args.extend(["--memory-budget".into(), b.to_string().into()]);
    }
    args.extend(["--fake-delay-ms".into(), opts.fake_delay_ms.to_string().into()]);
    let engine = stemq_worker::isolate::IsolatedEngine::start(program, args, Duration::from_secs(600))?;
    Ok(Arc::new(engine))
}

/// Loads the engine named in the options in this process.
pub fn engine_in_process(g: &Global, opts: &WorkerOpts) -> Result<Arc<dyn Engine>> {
    engine_named(g, &opts.engine, opts.models.clone(), opts.memory_budget, Duration::from_millis(opts.fake_delay_ms))
}

/// Loads engine `name`: `models` is the demucs model folder (default
/// `<data-dir>/models`), `memory_budget` the demucs engine's budget in bytes,
/// `fake_delay` the fake engine's extra delay.
pub fn engine_named(
    g: &Global,
    name: &str,
    models: Option<PathBuf>,
    memory_budget: Option<u64>,
    fake_delay: Duration,
) -> Result<Arc<dyn Engine>> {
    match name {
        "fake" => Ok(Arc::new(FakeEngine { base_delay: fake_delay })),
        // The weight-free baseline: runs model `dsp` only; htdemucs* fail with
        // `model_unavailable` on a dsp worker.
        "dsp" => Ok(Arc::new(stemq_audio::DspEngine::default())),
        "demucs" => demucs_engine(g, models, memory_budget),
        other => bail!("unknown engine `{other}`; available: fake, dsp, demucs"),
    }
}

#[cfg(feature = "demucs")]
fn demucs_engine(g: &Global, models: Option<PathBuf>, memory_budget: Option<u64>) -> Result<Arc<dyn Engine>> {
    let repo = models.unwrap_or_else(|| g.data_dir.join("models"));
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // This process runs the model (a worker, `stemq dev`, `stemq separate`): tune the
    // allocator for its working set.
    stemq_demucs::cpu::tune_allocator();
    let engine = stemq_demucs::engine::DemucsEngine::new(stemq_demucs::engine::DemucsEngineConfig {
        repo: repo.clone(),
        clip: stemq_audio::ClipMode::Rescale,
        max_duration_secs: Some(stemq_audio::engine::DEFAULT_MAX_DURATION_SECS),
        gpu_batch: 4,
        cpu_jobs: cores.min(2),
        memory_budget,
    })
    .with_context(|| format!("loading the model folder {}", repo.display()))?;
    Ok(Arc::new(engine))
}

#[cfg(not(feature = "demucs"))]
fn demucs_engine(_: &Global, _: Option<PathBuf>, _: Option<u64>) -> Result<Arc<dyn Engine>> {
    bail!("this stemq was built without the demucs engine; build it with `cargo build --release -p stemq --features demucs`")
}

/// The worker configuration from the options.
pub fn worker_config(g: &Global, opts: &WorkerOpts) -> Result<stemq_worker::Config> {
    let store = Store::open(&g.store_url()?).context("opening the object store")?;
    let mut c = stemq_worker::Config::new(store, g.data_dir.join("scratch"));
    c.concurrency = opts.concurrency;
    c.grace = Duration::from_secs(opts.grace_s);
    c.time_limit = Duration::from_secs(opts.time_limit_s);
    c.backoff.base = Duration::from_millis(opts.backoff_base_ms);
    c.backoff.cap = Duration::from_millis(opts.backoff_cap_ms);
    if let Some(n) = &opts.name {
        c.name = n.clone();
    }
    Ok(c)
}

pub async fn ingress(g: &Global, a: IngressArgs) -> Result<()> {
    let client = connect(g, "stemq-ingress").await?;
    let shutdown = crate::cli::shutdown_on_signals();
    let listener = stemq_ingress::bind(a.http).await?;
    let store = Store::open(&g.store_url()?).context("opening the object store")?;
    let storage = stemq_ingress::uploads::StorageConfig::new(store);
    let config = stemq_ingress::Config { listen: a.http, nats_submit: true, storage: Some(storage) };
    stemq_ingress::run(client, listener, config, shutdown).await?;
    Ok(())
}

/// Serves `/metrics` (the process-wide registry, queue figures refreshed per scrape) on
/// `--metrics ADDR` until `shutdown`, when asked to.
pub async fn serve_metrics(g: &Global, client: &async_nats::Client, shutdown: CancellationToken) -> Result<()> {
    let Some(addr) = g.metrics_addr else { return Ok(()) };
    let js = async_nats::jetstream::new(client.clone());
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let js = js.clone();
            async move {
                stemq_core::metrics::refresh_queue(&js).await;
                ([("content-type", "text/plain; version=0.0.4")], stemq_core::metrics::metrics().render())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("metrics listener on {addr}"))?;
    tracing::info!(%addr, "serving /metrics");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await;
    });
    Ok(())
}

pub async fn worker(g: &Global, opts: WorkerOpts) -> Result<()> {
    let client = connect(g, "stemq-worker").await?;
    serve_metrics(g, &client, crate::cli::shutdown_on_signals()).await?;
    let engine = engine(g, &opts)?;
    let config = worker_config(g, &opts)?;
    let shutdown = crate::cli::shutdown_on_signals();
    stemq_worker::run(client.clone(), engine, config, shutdown).await?;
    client.flush().await.ok();
    Ok(())
}

pub async fn projector(g: &Global, a: ProjectorArgs) -> Result<()> {
    let client = connect(g, "stemq-projector").await?;
    let shutdown = crate::cli::shutdown_on_signals();
    serve_metrics(g, &client, shutdown.clone()).await?;
    if a.rebuild {
        let js = async_nats::jetstream::new(client.clone());
        let events = stemq_projector::reset(&js, &g.settings()).await?;
        eprintln!("view dropped; replaying {events} events");
        let run_token = CancellationToken::new();
        let task = tokio::spawn(stemq_projector::run(client.clone(), Default::default(), run_token.clone()));
        let caught_up = stemq_projector::wait_caught_up(&js, Duration::from_secs(3600)).await?;
        run_token.cancel();
        task.await??;
        if !caught_up {
            bail!("the rebuild did not catch up within an hour");
        }
        eprintln!("view rebuilt");
        return Ok(());
    }
    stemq_projector::run(client, Default::default(), shutdown).await?;
    Ok(())
}

pub async fn relay(g: &Global, a: RelayArgs) -> Result<()> {
    let client = connect(g, "stemq-relay").await?;
    let shutdown = crate::cli::shutdown_on_signals();
    serve_metrics(g, &client, shutdown.clone()).await?;
    stemq_relay::run(client, a.config()?, shutdown).await?;
    Ok(())
}
