//! `stemq ingress|worker|projector|relay`: each service alone, as deployed, and the
//! options they take.
//!
//! Every service connects, checks the server version, creates whatever NATS definitions
//! are missing (existing ones are left as the server has them: `stemq nats apply` is the
//! one command that changes them) and then calls its crate's `run` with a shutdown token
//! tied to SIGTERM and Ctrl-C. This module also owns loading an engine (in process, or
//! in engine host processes) from [`EngineArgs`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use stemq_core::engine::{Engine, FakeEngine};
use stemq_core::netpolicy::HostPolicy;
use stemq_core::request::Model;
use stemq_storage::Store;
use stemq_telemetry::readiness::Readiness;
use tokio_util::sync::CancellationToken;

use crate::global::{shutdown_on_signals, Global, MetricsArg, ServerSettings, StoreArg};

/// `stemq ingress`.
#[derive(Debug, Args, Clone)]
pub struct IngressArgs {
    /// HTTP listen address.
    #[arg(long = "http", env = "STEMQ_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    #[command(flatten)]
    pub auth: AuthArg,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub audio_urls: AudioUrlArg,
    /// Export the queue figures (`stemq_queue_*`, `stemq_projector_lag_events`, read from
    /// NATS per scrape) on `/metrics`. Give it to one process of a deployment only
    /// (docs/operations.md, "Metrics").
    #[arg(long = "queue-metrics", env = "STEMQ_QUEUE_METRICS")]
    pub queue_metrics: bool,
    /// Refuse (422 `model_not_served`) a submit for a model that no live worker serves,
    /// instead of queueing it until one does (the default: a fleet's workers come and go).
    #[arg(long = "refuse-unserved-models", env = "STEMQ_REFUSE_UNSERVED_MODELS")]
    pub refuse_unserved: bool,
    #[command(flatten)]
    pub public: PublicArgs,
    #[command(flatten)]
    pub server: ServerSettings,
}

/// How the HTTP API presents itself to clients and browsers, and how long it waits for
/// them (`stemq ingress`, `stemq dev`).
#[derive(Debug, Args, Clone, Default)]
pub struct PublicArgs {
    /// The URL clients reach the API at (`https://stemq.example.com`, with a path prefix
    /// if a proxy adds one): answers link a job's resources (`urls`) under it. Default:
    /// the request's Host header with this listener's scheme; set it behind a proxy.
    #[arg(long = "public-url", env = "STEMQ_PUBLIC_URL", value_name = "URL")]
    pub public_url: Option<stemq_ingress::links::PublicUrl>,
    /// Let web pages of ORIGIN (`https://app.example.com`) call the API from a browser
    /// (CORS). Repeatable or comma-separated; exact origins only. Off by default.
    #[arg(long = "cors-origin", env = "STEMQ_CORS_ORIGINS", value_name = "ORIGIN", value_delimiter = ',')]
    pub cors_origins: Vec<stemq_ingress::cors::Origin>,
    /// Close a connection that has not sent a whole request head this long after it
    /// opened or after its last answer (so also the longest idle keep-alive). Default
    /// 20 000.
    #[arg(long = "http-header-timeout-ms", env = "STEMQ_HTTP_HEADER_TIMEOUT_MS", value_name = "MS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: Option<u64>,
    /// Answer 408 when a request body pauses this long, or takes this long plus what its
    /// bytes take at --http-body-min-rate. Default 30 000.
    #[arg(long = "http-body-timeout-ms", env = "STEMQ_HTTP_BODY_TIMEOUT_MS", value_name = "MS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout_ms: Option<u64>,
    /// The slowest sustained request body rate, in bytes per second. Default 16 384.
    #[arg(long = "http-body-min-rate", env = "STEMQ_HTTP_BODY_MIN_RATE", value_name = "BYTES",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub body_min_rate: Option<u64>,
}

impl PublicArgs {
    /// The listener's time limits: the flags given, the defaults for the others.
    pub fn http_timeouts(&self) -> stemq_ingress::serve::HttpTimeouts {
        let d = stemq_ingress::serve::HttpTimeouts::default();
        stemq_ingress::serve::HttpTimeouts {
            header: self.header_timeout_ms.map(Duration::from_millis).unwrap_or(d.header),
            body: self.body_timeout_ms.map(Duration::from_millis).unwrap_or(d.body),
            body_min_rate: self.body_min_rate.unwrap_or(d.body_min_rate),
        }
    }
}

/// `--insecure-no-auth`.
#[derive(Debug, Args, Clone, Default)]
pub struct AuthArg {
    /// Serve without API keys: every caller is an operator of the owner `local`. Refused
    /// unless the HTTP address is loopback.
    #[arg(long, env = "STEMQ_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
}

/// TLS on the HTTP listener (`stemq ingress`, `stemq dev`).
#[derive(Debug, Args, Clone, Default)]
pub struct TlsArgs {
    /// Serve HTTPS with this PEM certificate chain (the server's certificate first);
    /// needs --tls-key.
    #[arg(long = "tls-cert", env = "STEMQ_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long = "tls-key", env = "STEMQ_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by a CA in this PEM file (mutual TLS); needs
    /// --tls-cert.
    #[arg(long = "tls-client-ca", env = "STEMQ_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The ingress's TLS settings, when a certificate is given.
    pub fn config(&self) -> Option<stemq_ingress::tls::TlsConfig> {
        Some(stemq_ingress::tls::TlsConfig {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            client_ca: self.tls_client_ca.clone(),
        })
    }
}

/// External audio URLs (`stemq ingress`, `stemq worker`, `stemq dev`): the ingress and
/// the worker must agree, so both read the same setting.
#[derive(Debug, Args, Clone, Default)]
pub struct AudioUrlArg {
    /// Accept http(s) `audio_uri`s whose host is listed (off when unset): `*` (any host
    /// whose addresses are all public), `*.example.com` (its subdomains, public
    /// addresses only), host names, addresses and CIDRs (these may be private and use
    /// plain http). Comma-separated.
    #[arg(long = "audio-url-allow", env = "STEMQ_AUDIO_URL_ALLOW", value_parser = parse_host_policy)]
    pub audio_url_allow: Option<HostPolicy>,
}

fn parse_host_policy(s: &str) -> Result<HostPolicy, String> {
    HostPolicy::parse(s).map_err(|e| e.to_string())
}

impl AudioUrlArg {
    /// The policy, when external audio is on (an empty list is off).
    pub fn policy(&self) -> Option<HostPolicy> {
        self.audio_url_allow.clone().filter(|p| !p.is_empty())
    }

    /// The worker's fetch settings, when external audio is on.
    pub fn worker(&self) -> Option<stemq_worker::fetch::AudioUrls> {
        self.policy().map(stemq_worker::fetch::AudioUrls::new)
    }
}

/// `stemq worker`.
#[derive(Debug, Args, Clone)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub opts: WorkerOpts,
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub audio_urls: AudioUrlArg,
    #[command(flatten)]
    pub metrics: MetricsArg,
    #[command(flatten)]
    pub server: ServerSettings,
}

/// `stemq projector`.
#[derive(Debug, Args, Clone)]
pub struct ProjectorArgs {
    /// Drop the view, replay the whole log into it, and exit when caught up.
    #[arg(long)]
    pub rebuild: bool,
    #[command(flatten)]
    pub metrics: MetricsArg,
    #[command(flatten)]
    pub server: ServerSettings,
}

/// `stemq relay`.
#[derive(Debug, Args, Clone)]
pub struct RelayServiceArgs {
    #[command(flatten)]
    pub relay: RelayArgs,
    #[command(flatten)]
    pub metrics: MetricsArg,
    #[command(flatten)]
    pub server: ServerSettings,
}

/// The engine a worker (or its engine host) loads: shared by `stemq worker`, `stemq
/// dev` and the hidden `stemq engine-host`.
#[derive(Debug, Args, Clone)]
pub struct EngineArgs {
    /// Separation engine. `auto` serves `dsp` and every demucs model whose weights are
    /// in the model folder (in a build with the demucs engine).
    #[arg(long, env = "STEMQ_ENGINE", value_enum, default_value_t = EngineKind::Auto)]
    pub engine: EngineKind,
    /// Model folder of the `demucs` engine (demucs `--repo` layout: `<sig>.th`,
    /// `<name>.yaml`); default `<data-dir>/models`.
    #[arg(long, env = "STEMQ_MODELS")]
    pub models: Option<PathBuf>,
    /// Memory one attempt of the `demucs` engine may use for its forward passes, on top
    /// of the loaded model (e.g. `2GiB`, `512MiB`, `1.5GB`, or bytes). Estimated before
    /// running: over it the engine runs fewer passes at once, then a smaller segment (the
    /// out-of-memory ladder), then fails the job with `over_memory_budget`. Default: no
    /// limit.
    #[arg(long, env = "STEMQ_MEMORY_BUDGET", value_parser = parse_bytes)]
    pub memory_budget: Option<u64>,
    /// Segments per forward pass that the jobs running at the same time in this process
    /// may share (the `demucs` engine; needs `--isolation shared` or `none`, and
    /// `--concurrency` 2 or more to have jobs to share with): the chunks of several jobs
    /// then run as one batch, which is what a GPU is fast at. Each job's stems stay bit
    /// for bit what it gets alone. 0 (the default): each job runs its own passes.
    #[arg(long, env = "STEMQ_BATCH_ACROSS_JOBS", default_value_t = 0)]
    pub batch_across_jobs: usize,
    /// How long an idle engine waits for other jobs' passes to share a forward pass, in
    /// ms (with `--batch-across-jobs`; a job alone never waits for it).
    #[arg(long, env = "STEMQ_BATCH_LINGER_MS", default_value_t = 20)]
    pub batch_linger_ms: u64,
    /// How the `demucs` engine keeps a model's weights on a GPU: `f16` takes half the
    /// device memory and is lossless for the official checkpoints (they are stored in
    /// f16); the arithmetic runs in f32 either way. The CPU keeps f32.
    #[arg(long, env = "STEMQ_GPU_WEIGHTS", value_enum, default_value_t = GpuWeights::F32)]
    pub gpu_weights: GpuWeights,
    /// The device the `demucs` engine runs on, the CPU kept as the out-of-memory
    /// ladder's last rung: `cpu`, `cuda`, `vulkan` (a build with `--features vulkan`: the
    /// first Vulkan GPU, or a software driver such as Mesa's lavapipe when it is the only
    /// one) or `vulkan:N` (the N-th device `vulkaninfo --summary` lists). Default: CUDA
    /// when present, else a Vulkan GPU (never a software driver), else the CPU.
    #[arg(long, env = "STEMQ_DEVICE", value_parser = crate::job_opts::parse_device)]
    pub device: Option<crate::job_opts::DeviceArg>,
    /// No single allocation above this size in a Vulkan device's memory pool (e.g.
    /// `64MiB`): the device then runs out of memory at that size, as a smaller GPU
    /// would, and the out-of-memory ladder takes over. For testing the ladder on a real
    /// device; default: the driver's limits.
    #[arg(long, env = "STEMQ_DEVICE_MAX_ALLOC", value_parser = parse_bytes, hide = true)]
    pub device_max_alloc: Option<u64>,
    /// Extra delay of every fake job, in ms.
    #[arg(long, env = "STEMQ_FAKE_DELAY_MS", default_value_t = 0)]
    pub fake_delay_ms: u64,
    /// How long the fake engine takes to load, in ms (as a model's weights would).
    #[arg(long, env = "STEMQ_FAKE_LOAD_MS", default_value_t = 0)]
    pub fake_load_ms: u64,
    /// The models the fake engine pretends to run, comma-separated (default: all).
    #[arg(long, env = "STEMQ_FAKE_MODELS", value_delimiter = ',', value_parser = parse_model)]
    pub fake_models: Vec<Model>,
}

/// A model's wire name, for flags.
pub fn parse_model(s: &str) -> Result<Model, String> {
    Model::parse(s).ok_or_else(|| {
        let known: Vec<&str> = Model::ALL.iter().map(|m| m.as_str()).collect();
        format!("unknown model `{s}`; stemq knows {}", known.join(", "))
    })
}

/// A separation engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// `dsp`, plus `demucs` for the models whose weights are in the model folder.
    Auto,
    /// Built-in signal processing, no weights (runs model `dsp` only).
    Dsp,
    /// HTDemucs on Burn: needs a build with `--features demucs` and a model folder.
    Demucs,
    /// No audio work, for tests and benchmarks.
    Fake,
}

impl EngineKind {
    /// The spelling on the command line (to hand it on to an engine host).
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Auto => "auto",
            EngineKind::Dsp => "dsp",
            EngineKind::Demucs => "demucs",
            EngineKind::Fake => "fake",
        }
    }
}

/// The type a GPU keeps a model's weights in (`--gpu-weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuWeights {
    /// 4 bytes a weight.
    F32,
    /// 2 bytes a weight, widened to f32 at each use.
    F16,
}

impl GpuWeights {
    /// The spelling on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuWeights::F32 => "f32",
            GpuWeights::F16 => "f16",
        }
    }
}

#[cfg(feature = "demucs")]
impl From<GpuWeights> for stemq_demucs::nn::WeightPrecision {
    fn from(w: GpuWeights) -> Self {
        match w {
            GpuWeights::F32 => stemq_demucs::nn::WeightPrecision::Full,
            GpuWeights::F16 => stemq_demucs::nn::WeightPrecision::Half,
        }
    }
}

/// Worker options shared by `stemq worker` and `stemq dev`.
#[derive(Debug, Args, Clone)]
pub struct WorkerOpts {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Job loops in this process (one job at a time each).
    #[arg(long, env = "STEMQ_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
    /// Seconds a SIGTERM waits for running jobs.
    #[arg(long, env = "STEMQ_GRACE_S", default_value_t = 600)]
    pub grace_s: u64,
    /// Hard limit on one attempt, in seconds.
    #[arg(long, env = "STEMQ_TIME_LIMIT_S", default_value_t = 3600)]
    pub time_limit_s: u64,
    /// First retry delay in ms (doubles per attempt).
    #[arg(long, env = "STEMQ_BACKOFF_BASE_MS", default_value_t = 2000)]
    pub backoff_base_ms: u64,
    /// Largest retry delay in ms.
    #[arg(long, env = "STEMQ_BACKOFF_CAP_MS", default_value_t = 300_000)]
    pub backoff_cap_ms: u64,
    /// Worker name (default host-pid).
    #[arg(long, env = "STEMQ_WORKER_NAME")]
    pub name: Option<String>,
    /// Where attempts run: `process` (each job loop's attempts in an engine host
    /// process of its own, so a job that crashes its process fails alone), `shared` (one
    /// engine host for every job loop: jobs can share forward passes with
    /// `--batch-across-jobs`, and a crash fails the jobs running in it, not the worker)
    /// or `none` (in the worker process; a crash takes the worker and every running job
    /// down with it).
    #[arg(long, env = "STEMQ_ISOLATION", value_enum, default_value_t = Isolation::Process)]
    pub isolation: Isolation,
}

impl WorkerOpts {
    /// Refuses combinations that cannot work, before anything starts.
    pub fn check(&self) -> Result<()> {
        if self.engine.batch_across_jobs == 1 {
            bail!("--batch-across-jobs 1 shares nothing: give 0 (off) or the segments per shared pass (2 or more)");
        }
        if self.engine.batch_across_jobs > 1 && self.isolation == Isolation::Process {
            bail!(
                "--batch-across-jobs needs --isolation shared (or none): jobs share forward passes inside one \
                 process, and `--isolation process` gives each job loop an engine host of its own"
            );
        }
        Ok(())
    }
}

/// Where a worker runs its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Isolation {
    /// In engine host processes (one per job loop in use).
    Process,
    /// In one engine host process for every job loop.
    Shared,
    /// In the worker process.
    None,
}

/// Webhook relay options (`stemq relay`, `stemq dev`).
#[derive(Debug, Args, Clone)]
pub struct RelayArgs {
    /// Delays before each attempt, in ms, comma-separated (default: 0, 5 s, 5 min,
    /// 30 min, 2 h, 5 h, 10 h, 14 h, 20 h, 24 h).
    #[arg(long = "webhook-schedule-ms", env = "STEMQ_WEBHOOK_SCHEDULE_MS", value_parser = parse_schedule)]
    pub schedule: Option<Schedule>,
    /// Request timeout in ms.
    #[arg(long = "webhook-timeout-ms", env = "STEMQ_WEBHOOK_TIMEOUT_MS", default_value_t = 15_000)]
    pub timeout_ms: u64,
    /// Deliveries in flight at once.
    #[arg(
        long = "webhook-concurrency",
        id = "webhook_concurrency",
        env = "STEMQ_WEBHOOK_CONCURRENCY",
        default_value_t = 256
    )]
    pub concurrency: usize,
}

/// A webhook retry schedule: the delay before each attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule(pub Vec<Duration>);

/// Parses `--webhook-schedule-ms`: comma-separated milliseconds, at least one.
pub fn parse_schedule(s: &str) -> Result<Schedule, String> {
    let delays = s
        .split(',')
        .map(|x| x.trim().parse::<u64>().map(Duration::from_millis))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| format!("`{s}` is not a comma-separated list of milliseconds"))?;
    Ok(Schedule(delays))
}

impl RelayArgs {
    /// The relay configuration (the SSRF allow-list comes from `STEMQ_WEBHOOK_ALLOW`).
    pub fn config(&self) -> stemq_relay::Config {
        let mut c = stemq_relay::Config {
            timeout: Duration::from_millis(self.timeout_ms),
            concurrency: self.concurrency,
            ..Default::default()
        };
        if let Some(Schedule(s)) = &self.schedule {
            c.schedule = s.clone();
        }
        c
    }
}

/// Parses a byte size: a number with an optional binary (`KiB`, `MiB`, `GiB`, `TiB`) or
/// decimal (`kB`, `MB`, `GB`, `TB`) suffix, or `B`; case-insensitive, spaces allowed.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|ch: char| !(ch.is_ascii_digit() || ch == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{s}` is not a size (e.g. 2GiB, 512MiB, 1000000)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => return Err(format!("unknown size unit `{other}` in `{s}` (B, kB, MB, GB, KiB, MiB, GiB)")),
    };
    let v = n * mult as f64;
    if !v.is_finite() || v < 1.0 {
        return Err(format!("`{s}` is not a positive size"));
    }
    Ok(v as u64)
}

/// Connects and, on a server without users (anonymous), creates the definitions that
/// are missing. As a user the definitions are the operator's (`stemq nats apply`): a
/// service only opens what exists, and says so when something is missing.
pub async fn connect(g: &Global, server: &ServerSettings, name: &str) -> Result<async_nats::Client> {
    let auth = g.nats_auth()?;
    let client = stemq_nats::connect_with(&g.nats_url(), name, &auth).await?;
    if may_provision(&auth) {
        stemq_nats::ensure(&async_nats::jetstream::new(client.clone()), &server.settings()).await?;
    } else {
        let user = auth.credentials.as_ref().and_then(|c| c.user.clone()).unwrap_or_default();
        tracing::info!(%user, "connected as a NATS user: streams, consumers and buckets are the operator's (`stemq nats apply`)");
    }
    Ok(client)
}

/// A connection for a one-shot command (`keys`, `webhooks`, `nats apply`), which
/// creates nothing at start: as `--nats-creds` says (the operator, for these).
pub async fn connect_cli(g: &Global) -> Result<async_nats::Client> {
    g.connect("stemq-cli").await
}

/// True when this identity may create definitions: anonymous (a server without users)
/// or the operator. Any other user opens what exists.
fn may_provision(auth: &stemq_nats::ConnectAuth) -> bool {
    match &auth.credentials {
        None => true,
        Some(c) => c.user.as_deref() == Some(stemq_nats::users::OPERATOR),
    }
}

/// The `/readyz` conditions of the services (`stemq dev` waits for all of them).
pub const WORKER_READY: &str = "the worker (engine loaded, announced in the registry)";
/// See [`WORKER_READY`].
pub const PROJECTOR_READY: &str = "the projector (consuming)";
/// See [`WORKER_READY`].
pub const RELAY_READY: &str = "the webhook relay (consuming)";

/// [`engine`] off the async threads: loading a model takes seconds, and the probes and
/// the NATS connection go on meanwhile.
pub async fn load_engine(g: &Global, opts: &WorkerOpts) -> Result<Arc<dyn Engine>> {
    let (g, opts) = (g.clone(), opts.clone());
    tokio::task::spawn_blocking(move || engine(&g, &opts)).await.context("the engine loader panicked")?
}

/// Loads the engine named in the options, isolated in engine host processes unless
/// `--isolation none`.
pub fn engine(g: &Global, opts: &WorkerOpts) -> Result<Arc<dyn Engine>> {
    opts.check()?;
    if opts.isolation == Isolation::None {
        return engine_in_process(g, &opts.engine);
    }
    let program = std::env::current_exe().context("finding the stemq executable for the engine host")?;
    let args = engine_host_args(g, &opts.engine);
    let mut engine = start_isolated(opts.isolation, program, args, Duration::from_secs(600))?;
    if opts.engine.engine == EngineKind::Fake {
        // The fake engine says how long its pretend input lasts (credits); it reads none.
        engine = engine.with_lengths(Arc::new(FakeEngine::default()));
    }
    Ok(Arc::new(engine))
}

/// Starts the engine hosts of `isolation` (`shared`: one for every job loop, else one
/// per job loop) running `program args…`.
pub fn start_isolated(
    isolation: Isolation,
    program: PathBuf,
    args: Vec<std::ffi::OsString>,
    startup: Duration,
) -> Result<stemq_worker::isolate::IsolatedEngine, stemq_worker::isolate::IsolateError> {
    if isolation == Isolation::Shared {
        stemq_worker::isolate::IsolatedEngine::start_shared(program, args, startup)
    } else {
        stemq_worker::isolate::IsolatedEngine::start(program, args, startup)
    }
}

/// The command line of an engine host process for `engine`: `stemq --data-dir DIR
/// [--log-format F] engine-host --engine E ...` (parsed back by [`EngineArgs`]).
pub fn engine_host_args(g: &Global, engine: &EngineArgs) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec!["--data-dir".into(), g.data_dir.clone().into()];
    if let Some(f) = g.log_format {
        args.extend(["--log-format".into(), f.as_str().into()]);
    }
    args.extend(["engine-host".into(), "--engine".into(), engine.engine.as_str().into()]);
    if let Some(m) = &engine.models {
        args.extend(["--models".into(), m.clone().into()]);
    }
    if let Some(b) = engine.memory_budget {
        args.extend(["--memory-budget".into(), b.to_string().into()]);
    }
    if engine.batch_across_jobs > 0 {
        args.extend(["--batch-across-jobs".into(), engine.batch_across_jobs.to_string().into()]);
        args.extend(["--batch-linger-ms".into(), engine.batch_linger_ms.to_string().into()]);
    }
    args.extend(["--gpu-weights".into(), engine.gpu_weights.as_str().into()]);
    if let Some(d) = &engine.device {
        args.extend(["--device".into(), d.to_string().into()]);
    }
    if let Some(b) = engine.device_max_alloc {
        args.extend(["--device-max-alloc".into(), b.to_string().into()]);
    }
    args.extend(["--fake-delay-ms".into(), engine.fake_delay_ms.to_string().into()]);
    args.extend(["--fake-load-ms".into(), engine.fake_load_ms.to_string().into()]);
    if !engine.fake_models.is_empty() {
        let models: Vec<&str> = engine.fake_models.iter().map(|m| m.as_str()).collect();
        args.extend(["--fake-models".into(), models.join(",").into()]);
    }
    args
}

/// Loads the engine named in the options in this process.
pub fn engine_in_process(g: &Global, opts: &EngineArgs) -> Result<Arc<dyn Engine>> {
    if opts.engine == EngineKind::Fake {
        std::thread::sleep(Duration::from_millis(opts.fake_load_ms));
    }
    if opts.engine == EngineKind::Fake && !opts.fake_models.is_empty() {
        let fake =
            FakeEngine { base_delay: Duration::from_millis(opts.fake_delay_ms), models: opts.fake_models.clone() };
        return Ok(Arc::new(fake));
    }
    engine_named(g, opts)
}

/// Loads the engine `opts` name (`opts.models` is the demucs model folder, default
/// `<data-dir>/models`).
fn engine_named(g: &Global, opts: &EngineArgs) -> Result<Arc<dyn Engine>> {
    match opts.engine {
        EngineKind::Fake => {
            Ok(Arc::new(FakeEngine { base_delay: Duration::from_millis(opts.fake_delay_ms), ..FakeEngine::default() }))
        }
        EngineKind::Auto => {
            let dsp: Arc<dyn Engine> = Arc::new(stemq_audio::DspEngine::default());
            match auto_demucs(g, opts)? {
                Some(demucs) => Ok(Arc::new(stemq_core::engine::Engines::new(vec![dsp, demucs]))),
                None => Ok(dsp),
            }
        }
        // The weight-free baseline: runs model `dsp` only; htdemucs* fail with
        // `model_unavailable` on a dsp worker.
        EngineKind::Dsp => Ok(Arc::new(stemq_audio::DspEngine::default())),
        EngineKind::Demucs => demucs_engine(g, opts),
    }
}

#[cfg(feature = "demucs")]
fn demucs_engine(g: &Global, opts: &EngineArgs) -> Result<Arc<dyn Engine>> {
    let cross_job = (opts.batch_across_jobs > 1).then(|| stemq_demucs::batch::CrossJobBatching {
        max_rows: opts.batch_across_jobs,
        linger: Duration::from_millis(opts.batch_linger_ms),
    });
    let place = DemucsPlacement {
        memory_budget: opts.memory_budget,
        cross_job,
        gpu_weights: opts.gpu_weights,
        device: opts.device.as_ref().map(|d| d.0.clone()),
        device_max_alloc: opts.device_max_alloc,
    };
    Ok(Arc::new(demucs_engine_here(g, opts.models.clone(), place)?))
}

/// How the demucs engine uses its devices: the fields of the same names in
/// [`stemq_demucs::engine::DemucsEngineConfig`].
#[cfg(feature = "demucs")]
#[derive(Debug, Clone)]
pub struct DemucsPlacement {
    /// Bytes an attempt's forward passes may use.
    pub memory_budget: Option<u64>,
    /// Forward passes shared across jobs.
    pub cross_job: Option<stemq_demucs::batch::CrossJobBatching>,
    /// The type a GPU keeps the weights in.
    pub gpu_weights: GpuWeights,
    /// The device offered first (`--device`, `-d`).
    pub device: Option<stemq_core::device::Device>,
    /// The largest single allocation on a Vulkan device (`--device-max-alloc`).
    pub device_max_alloc: Option<u64>,
}

/// The demucs engine itself (not behind the [`Engine`] trait), for `stemq separate`'s
/// choices beyond a request: `models` is the model folder (default `<data-dir>/models`).
#[cfg(feature = "demucs")]
pub fn demucs_engine_here(
    g: &Global,
    models: Option<PathBuf>,
    place: DemucsPlacement,
) -> Result<stemq_demucs::engine::DemucsEngine> {
    let repo = models.unwrap_or_else(|| g.data_dir.join("models"));
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // This process runs the model (a worker, `stemq dev`, `stemq separate`): tune the
    // allocator for its working set.
    stemq_demucs::cpu::tune_allocator();
    stemq_demucs::engine::DemucsEngine::new(stemq_demucs::engine::DemucsEngineConfig {
        repo: repo.clone(),
        clip: stemq_audio::ClipMode::Rescale,
        max_duration_secs: Some(stemq_audio::engine::DEFAULT_MAX_DURATION_SECS),
        gpu_batch: 4,
        cpu_jobs: cores.min(2),
        memory_budget: place.memory_budget,
        cross_job: place.cross_job,
        gpu_weights: place.gpu_weights.into(),
        device: place.device,
        device_max_alloc: place.device_max_alloc,
    })
    .with_context(|| format!("loading the model folder {}", repo.display()))
}

/// The demucs engine for `--engine auto`: `None` when this build has no demucs engine or
/// the model folder holds no model's weights.
#[cfg(feature = "demucs")]
fn auto_demucs(g: &Global, opts: &EngineArgs) -> Result<Option<Arc<dyn Engine>>> {
    let repo = opts.models.clone().unwrap_or_else(|| g.data_dir.join("models"));
    if !repo.is_dir() {
        return Ok(None);
    }
    let engine = demucs_engine(g, opts)?;
    Ok((!engine.models().is_empty()).then_some(engine))
}

#[cfg(not(feature = "demucs"))]
fn auto_demucs(_: &Global, _: &EngineArgs) -> Result<Option<Arc<dyn Engine>>> {
    Ok(None)
}

#[cfg(not(feature = "demucs"))]
fn demucs_engine(_: &Global, _: &EngineArgs) -> Result<Arc<dyn Engine>> {
    bail!("this stemq was built without the demucs engine; build it with `cargo build --release -p stemq --features demucs`")
}

/// The worker configuration from the options.
pub fn worker_config(g: &Global, store: &StoreArg, opts: &WorkerOpts) -> Result<stemq_worker::Config> {
    let store = Store::open(&store.url(&g.data_dir)?).context("opening the object store")?;
    let mut c = stemq_worker::Config::new(store, g.data_dir.join("scratch"));
    c.concurrency = opts.concurrency;
    c.grace = Duration::from_secs(opts.grace_s);
    c.time_limit = Duration::from_secs(opts.time_limit_s);
    c.backoff.base = Duration::from_millis(opts.backoff_base_ms);
    c.backoff.cap = Duration::from_millis(opts.backoff_cap_ms);
    // Credits are reserved for what the input's header says it lasts.
    c.audio_probe = Some(stemq_audio::probe_duration_ms);
    if let Some(n) = &opts.name {
        c.name = n.clone();
    }
    Ok(c)
}

pub async fn ingress(g: &Global, a: IngressArgs) -> Result<()> {
    let client = connect(g, &a.server, "stemq-ingress").await?;
    let shutdown = shutdown_on_signals();
    let listener = stemq_ingress::bind(a.http).await?;
    let store = Store::open(&a.store.url(&g.data_dir)?).context("opening the object store")?;
    let storage = stemq_ingress::uploads::StorageConfig::new(store);
    let config = stemq_ingress::Config {
        listen: a.http,
        nats_submit: true,
        storage: Some(storage),
        auth: !a.auth.insecure_no_auth,
        tls: a.tls.config(),
        audio_urls: a.audio_urls.policy(),
        queue_metrics: a.queue_metrics,
        refuse_unserved: a.refuse_unserved,
        signin: None,
        http_timeouts: a.public.http_timeouts(),
        public_url: a.public.public_url,
        cors_origins: a.public.cors_origins,
        // Ready on its own conditions (NATS, the registry read).
        readiness: Default::default(),
    };
    stemq_ingress::run(client, listener, config, shutdown).await?;
    Ok(())
}

/// Serves `/metrics` (the process-wide registry, and the queue figures read per scrape
/// with `--queue-metrics`) on `--metrics ADDR` until `shutdown`, when asked to:
/// OpenMetrics when the scraper asks for it, classic text 0.0.4 otherwise. The same
/// listener answers the probes: `/healthz` (the process answers) and `/readyz` (200 once
/// NATS is connected and `readiness` holds, else 503 naming what it waits for).
pub async fn serve_metrics(
    metrics: &MetricsArg,
    client: &async_nats::Client,
    readiness: &Readiness,
    shutdown: CancellationToken,
) -> Result<()> {
    let Some(addr) = metrics.addr else { return Ok(()) };
    let js = async_nats::jetstream::new(client.clone());
    let queue = metrics.queue;
    let (nats, readiness) = (client.clone(), readiness.clone());
    let ready = move || {
        let mut waiting = Vec::new();
        if nats.connection_state() != async_nats::connection::State::Connected {
            waiting.push("NATS (connected)");
        }
        waiting.extend(readiness.pending());
        let (code, text) = stemq_telemetry::readiness::probe_answer(&waiting);
        (axum::http::StatusCode::from_u16(code).unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE), text)
    };
    let app = axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route("/readyz", axum::routing::get(move || std::future::ready(ready())))
        .route(
            "/metrics",
            axum::routing::get(move |headers: axum::http::HeaderMap| {
                let js = js.clone();
                async move {
                    let accept = headers.get_all(axum::http::header::ACCEPT).iter().filter_map(|v| v.to_str().ok());
                    let format = stemq_telemetry::metrics::Format::negotiate(accept);
                    let figures = match queue {
                        true => Some(stemq_nats::queue_figures::read_queue(&js).await),
                        false => None,
                    };
                    let body = stemq_telemetry::metrics::metrics().encode(format, figures.as_ref());
                    ([(axum::http::header::CONTENT_TYPE, format.content_type())], body)
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

pub async fn worker(g: &Global, a: WorkerArgs) -> Result<()> {
    a.opts.check()?;
    let client = connect(g, &a.server, "stemq-worker").await?;
    let readiness = Readiness::new();
    let ready = readiness.require(WORKER_READY);
    serve_metrics(&a.metrics, &client, &readiness, shutdown_on_signals()).await?;
    let engine = load_engine(g, &a.opts).await?;
    let mut config = worker_config(g, &a.store, &a.opts)?;
    config.audio_urls = a.audio_urls.worker();
    config.ready = Some(ready);
    if engine.devices().iter().any(|d| matches!(d, stemq_core::device::Device::Cuda(_))) {
        config.gpu_probe = Some("nvidia-smi".into());
    }
    let shutdown = shutdown_on_signals();
    stemq_worker::run(client.clone(), engine, config, shutdown).await?;
    client.flush().await.ok();
    Ok(())
}

pub async fn projector(g: &Global, a: ProjectorArgs) -> Result<()> {
    let client = connect(g, &a.server, "stemq-projector").await?;
    let shutdown = shutdown_on_signals();
    let readiness = Readiness::new();
    let ready = readiness.require(PROJECTOR_READY);
    serve_metrics(&a.metrics, &client, &readiness, shutdown.clone()).await?;
    if a.rebuild {
        let js = async_nats::jetstream::new(client.clone());
        let events = stemq_projector::reset(&js, &a.server.settings()).await?;
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
    let config = stemq_projector::Config { ready: Some(ready), ..Default::default() };
    stemq_projector::run(client, config, shutdown).await?;
    Ok(())
}

pub async fn relay(g: &Global, a: RelayServiceArgs) -> Result<()> {
    let client = connect(g, &a.server, "stemq-relay").await?;
    let shutdown = shutdown_on_signals();
    let readiness = Readiness::new();
    let ready = readiness.require(RELAY_READY);
    serve_metrics(&a.metrics, &client, &readiness, shutdown.clone()).await?;
    let config = stemq_relay::Config { ready: Some(ready), ..a.relay.config() };
    stemq_relay::run(client, config, shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_budget_sizes_parse() {
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
    }

    #[test]
    fn webhook_schedules_parse() {
        assert_eq!(parse_schedule("0, 5000").unwrap(), Schedule(vec![Duration::ZERO, Duration::from_secs(5)]));
        assert!(parse_schedule("").is_err());
        assert!(parse_schedule("5s").is_err());
    }
}
