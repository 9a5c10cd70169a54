//! The command line: arguments, shared options, and dispatch to the subcommands.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use stemq_core::nats::Settings;
use stemq_core::telemetry::LogFormat;
use tokio_util::sync::CancellationToken;

/// stemq: music source separation as a service, on NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "stemq", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args, Clone)]
pub struct Global {
    /// NATS server URL. `stemq dev` starts its own server when this is not set.
    #[arg(long, env = "NATS_URL", global = true)]
    pub nats_url: Option<String>,
    /// Data directory (NATS store of `stemq dev`, local object store, scratch).
    #[arg(long, env = "STEMQ_DATA_DIR", default_value = ".stemq", global = true)]
    pub data_dir: PathBuf,
    /// Object store URL for inputs and outputs (default: file://<data-dir>/store).
    #[arg(long, env = "STEMQ_STORE", global = true)]
    pub store: Option<String>,
    /// Worker ack deadline in ms (progress acks keep long jobs alive).
    #[arg(long, env = "STEMQ_ACK_WAIT_MS", default_value_t = 30_000, global = true)]
    pub ack_wait_ms: u64,
    /// Deliveries before a job is dead-lettered.
    #[arg(long, env = "STEMQ_MAX_DELIVER", default_value_t = 5, global = true)]
    pub max_deliver: i64,
    /// Dedupe window of the job stream in ms.
    #[arg(long, env = "STEMQ_DEDUPE_WINDOW_MS", default_value_t = 120_000, global = true)]
    pub dedupe_window_ms: u64,
    /// Serve Prometheus `/metrics` on this address (worker, projector and relay
    /// processes; the ingress serves its own on its HTTP port).
    #[arg(long = "metrics", env = "STEMQ_METRICS_ADDR", global = true)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Log format: json or text (default: text on a terminal, json otherwise).
    #[arg(long, env = "STEMQ_LOG_FORMAT", global = true)]
    pub log_format: Option<String>,
}

impl Global {
    /// NATS definition knobs.
    pub fn settings(&self) -> Settings {
        Settings {
            ack_wait: Duration::from_millis(self.ack_wait_ms),
            max_deliver: self.max_deliver,
            duplicate_window: Duration::from_millis(self.dedupe_window_ms),
            ..Settings::default()
        }
    }

    /// The NATS URL, or the default local one.
    pub fn nats_url(&self) -> String {
        self.nats_url.clone().unwrap_or_else(|| "nats://127.0.0.1:4222".to_string())
    }

    /// The object store URL.
    pub fn store_url(&self) -> Result<String> {
        if let Some(s) = &self.store {
            return Ok(s.clone());
        }
        let dir = self.data_dir.join("store");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let abs = dir.canonicalize()?;
        Ok(url::Url::from_directory_path(abs).map_err(|_| anyhow::anyhow!("bad data dir"))?.to_string())
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Everything in one process for a laptop: nats-server, ingress, worker, projector.
    Dev(DevArgs),
    /// Run the HTTP ingress alone.
    Ingress(IngressArgs),
    /// Run a worker alone.
    Worker(WorkerArgs),
    /// Run the projector alone (or rebuild the view).
    Projector(ProjectorArgs),
    /// Run the webhook relay alone.
    Relay(RelayArgs),
    /// Apply the stream, consumer and bucket definitions of nats/.
    Nats {
        #[command(subcommand)]
        command: NatsCommand,
    },
    /// The Demucs model folder: pull released checkpoints, list what is installed.
    Models {
        #[command(subcommand)]
        command: ModelsCommand,
        /// The model folder (default `<data-dir>/models`).
        #[arg(long, env = "STEMQ_MODELS", global = true)]
        dir: Option<PathBuf>,
    },
    /// Separate local files right here, like the `demucs` command (no queue needed).
    Separate(crate::separate::SeparateArgs),
    /// Submit a job (a file path is uploaded to the store first).
    Submit(SubmitArgs),
    /// Print a job's status view.
    Status {
        /// Job id.
        id: String,
    },
    /// List jobs, newest first.
    List {
        /// Only jobs with this status.
        #[arg(long)]
        status: Option<String>,
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Follow a job with a progress bar until it ends.
    Watch {
        /// Job id.
        id: String,
    },
    /// Cancel a queued or running job (a running job stops within about a second).
    Cancel {
        /// Job id.
        id: String,
    },
    /// Re-run a failed, dead-lettered, cancelled or expired job as a new job.
    Retry {
        /// Job id.
        id: String,
    },
    /// Dead letters.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Webhook settings (re-enable a URL a 410 Gone disabled).
    Webhooks {
        #[command(subcommand)]
        command: crate::webhooks::WebhooksCommand,
    },
    /// Write the JSON Schemas of the contracts.
    Schemas {
        /// Folder to write into.
        #[arg(long, default_value = "schemas")]
        write: PathBuf,
    },
    /// A live terminal view: queue, running jobs with progress, failures, throughput.
    Top {
        /// Refresh interval in seconds.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Print one screen and exit.
        #[arg(long)]
        once: bool,
    },
    /// Write the synthetic demo song (voice, drums, bass, pad) as a 16-bit WAV.
    Synth {
        /// Length in seconds.
        #[arg(long, default_value_t = 20.0)]
        seconds: f64,
        /// Output file.
        #[arg(short = 'o', long, default_value = "demo-song.wav")]
        output: PathBuf,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: crate::bench::BenchCommand,
    },
    /// Internal: the engine host process of a worker (`--isolation process`); speaks
    /// the host protocol on stdin/stdout.
    #[command(hide = true)]
    EngineHost(WorkerArgs),
}

#[derive(Debug, Subcommand)]
pub enum ModelsCommand {
    /// Download a released model (htdemucs, htdemucs_ft, htdemucs_6s), checksums verified.
    Pull {
        /// Model name.
        name: String,
        /// Download root (default: the one the demucs package uses).
        #[arg(long, env = "STEMQ_MODELS_URL", default_value = crate::models::ROOT_URL)]
        url: String,
    },
    /// Released models and local bags, and whether each is installed.
    List,
}

#[derive(Debug, Subcommand)]
pub enum NatsCommand {
    /// Create or update every stream, consumer and bucket (idempotent), and print what
    /// changed. This is the only command that changes existing definitions: services
    /// create what is missing and otherwise follow what the server has.
    Apply,
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Dead-lettered jobs, newest first.
    List {
        /// How many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Run a dead-lettered job again, as a new job linked to the old one.
    Replay {
        /// Job id.
        id: String,
    },
}

#[derive(Debug, Args, Clone)]
pub struct DevArgs {
    /// HTTP listen address.
    #[arg(long = "http", env = "STEMQ_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    #[command(flatten)]
    pub worker: WorkerOpts,
    #[command(flatten)]
    pub relay: RelayArgs,
}

#[derive(Debug, Args, Clone)]
pub struct IngressArgs {
    /// HTTP listen address.
    #[arg(long = "http", env = "STEMQ_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
}

#[derive(Debug, Args, Clone)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub opts: WorkerOpts,
}

/// Worker options shared by `stemq worker` and `stemq dev`.
#[derive(Debug, Args, Clone)]
pub struct WorkerOpts {
    /// Separation engine: `dsp` (built-in, no weights), `demucs` (HTDemucs on Burn; needs
    /// a build with `--features demucs` and a model folder), or `fake` (no audio work;
    /// for tests and benchmarks).
    #[arg(long, env = "STEMQ_ENGINE", default_value = "dsp")]
    pub engine: String,
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
    /// Extra delay of every fake job, in ms.
    #[arg(long, env = "STEMQ_FAKE_DELAY_MS", default_value_t = 0)]
    pub fake_delay_ms: u64,
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
    /// process of its own, so a job that crashes its process fails alone) or `none` (in
    /// the worker process; a crash takes every running job down with it).
    #[arg(long, env = "STEMQ_ISOLATION", value_enum, default_value_t = Isolation::Process)]
    pub isolation: Isolation,
}

/// Where a worker runs its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Isolation {
    /// In engine host processes (one per job loop in use).
    Process,
    /// In the worker process.
    None,
}

/// Webhook relay options (`stemq relay`, `stemq dev`).
#[derive(Debug, Args, Clone)]
pub struct RelayArgs {
    /// Delays before each attempt, in ms, comma-separated (default: 0, 5 s, 5 min,
    /// 30 min, 2 h, 5 h, 10 h, 14 h, 20 h, 24 h).
    #[arg(long = "webhook-schedule-ms", env = "STEMQ_WEBHOOK_SCHEDULE_MS")]
    pub schedule_ms: Option<String>,
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

impl RelayArgs {
    /// The relay configuration (the SSRF allow-list comes from `STEMQ_WEBHOOK_ALLOW`).
    pub fn config(&self) -> Result<stemq_relay::Config> {
        let mut c = stemq_relay::Config {
            timeout: Duration::from_millis(self.timeout_ms),
            concurrency: self.concurrency,
            ..Default::default()
        };
        if let Some(s) = &self.schedule_ms {
            c.schedule = s
                .split(',')
                .map(|x| x.trim().parse::<u64>().map(Duration::from_millis))
                .collect::<Result<_, _>>()
                .context("--schedule-ms: comma-separated milliseconds")?;
            if c.schedule.is_empty() {
                anyhow::bail!("--schedule-ms needs at least one delay");
            }
        }
        Ok(c)
    }
}

#[derive(Debug, Args, Clone)]
pub struct ProjectorArgs {
    /// Drop the view, replay the whole log into it, and exit when caught up.
    #[arg(long)]
    pub rebuild: bool,
}

#[derive(Debug, Args, Clone)]
pub struct SubmitArgs {
    /// An audio URI in the store, or a local file to upload first.
    pub input: String,
    /// Model (`dsp` until the neural engine is installed on the workers).
    #[arg(short = 'n', long, default_value = "dsp")]
    pub model: String,
    #[command(flatten)]
    pub split: SplitOpts,
    /// Output container: wav or flac.
    #[arg(long)]
    pub format: Option<String>,
    /// Sample encoding: s16 (default), s24, f32 (wav only).
    #[arg(long)]
    pub encoding: Option<String>,
    /// Clipping: rescale (default), clamp, none.
    #[arg(long)]
    pub clip_mode: Option<String>,
    /// Metadata (a JSON object).
    #[arg(long)]
    pub metadata: Option<String>,
    /// Wait for the job to end, with a progress bar.
    #[arg(long)]
    pub wait: bool,
    /// With `--wait`: copy the stems into this folder as `<stem>.<ext>` once the job
    /// has succeeded.
    #[arg(short = 'o', long = "output-dir", value_name = "DIR", requires = "wait")]
    pub output_dir: Option<PathBuf>,
}

/// How to split, as the job request says it: shared by `submit` and `separate`.
#[derive(Debug, Args, Clone)]
pub struct SplitOpts {
    /// Only this stem and its complement (`no_<stem>`).
    #[arg(long)]
    pub two_stems: Option<String>,
    /// With `--two-stems`: `no_<stem>` as the sum of the other stems (`add`, the
    /// default), as the mixture minus the stem (`minus`), or not at all (`none`).
    #[arg(long, value_parser = ["add", "minus", "none"], requires = "two_stems")]
    pub other_method: Option<String>,
    /// Segment length in seconds.
    #[arg(long)]
    pub segment: Option<f64>,
    /// Overlap between segments.
    #[arg(long)]
    pub overlap: Option<f64>,
    /// Random shifts (test-time augmentation).
    #[arg(long)]
    pub shifts: Option<u32>,
}

impl SplitOpts {
    /// Sets the given options on a request document.
    pub fn fill(&self, req: &mut serde_json::Value) {
        use serde_json::Value;
        let fields = [
            ("two_stems", self.two_stems.clone().map(Value::from)),
            ("other_method", self.other_method.clone().map(Value::from)),
            ("segment", self.segment.map(Value::from)),
            ("overlap", self.overlap.map(Value::from)),
            ("shifts", self.shifts.map(Value::from)),
        ];
        for (k, v) in fields {
            if let Some(v) = v {
                req[k] = v;
            }
        }
    }
}

impl Cli {
    /// The service name in traces.
    pub fn service_name(&self) -> &'static str {
        match self.command {
            Command::Dev(_) => "stemq-dev",
            Command::Ingress(_) => "stemq-ingress",
            Command::Worker(_) => "stemq-worker",
            Command::Projector(_) => "stemq-projector",
            Command::Relay(_) => "stemq-relay",
            Command::EngineHost(_) => "stemq-engine-host",
            _ => "stemq-cli",
        }
    }

    /// The log format to install.
    pub fn log_format(&self) -> LogFormat {
        match self.global.log_format.as_deref() {
            Some("json") => LogFormat::Json,
            Some("text") => LogFormat::Text,
            _ => {
                use std::io::IsTerminal;
                if matches!(self.command, Command::Dev(_)) || std::io::stderr().is_terminal() {
                    LogFormat::Text
                } else {
                    LogFormat::Json
                }
            }
        }
    }
}

/// A token cancelled on Ctrl-C or SIGTERM.
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutdown requested");
        t.cancel();
    });
    token
}

/// Dispatches a parsed command line.
pub async fn run(cli: Cli) -> Result<()> {
    let g = cli.global;
    match cli.command {
        Command::Dev(a) => crate::dev::run(&g, a).await,
        Command::Ingress(a) => crate::services::ingress(&g, a).await,
        Command::Worker(a) => crate::services::worker(&g, a.opts).await,
        Command::Projector(a) => crate::services::projector(&g, a).await,
        Command::Relay(a) => crate::services::relay(&g, a).await,
        Command::Nats { command: NatsCommand::Apply } => {
            let client = stemq_core::nats::connect(&g.nats_url(), "stemq-cli").await?;
            let changes = stemq_core::nats::apply(&async_nats::jetstream::new(client), &g.settings()).await?;
            for c in &changes {
                println!("{c}");
            }
            let changed = changes.iter().filter(|c| c.is_change()).count();
            println!("{} objects, {changed} created or changed, at {}", changes.len(), g.nats_url());
            Ok(())
        }
        Command::Models { command, dir } => {
            let dir = dir.unwrap_or_else(|| g.data_dir.join("models"));
            match command {
                ModelsCommand::Pull { name, url } => crate::models::pull(&name, &dir, &url).await,
                ModelsCommand::List => crate::models::list(&dir),
            }
        }
        Command::Separate(a) => tokio::task::spawn_blocking(move || crate::separate::run(&g, a)).await?,
        Command::Submit(a) => crate::client::submit(&g, a).await,
        Command::Status { id } => crate::client::status(&g, &id).await,
        Command::List { status, limit } => crate::client::list(&g, status.as_deref(), limit).await,
        Command::Watch { id } => crate::client::watch(&g, &id).await.map(|_| ()),
        Command::Dlq { command: DlqCommand::List { limit } } => {
            crate::client::list(&g, Some("dead_lettered"), limit).await
        }
        Command::Dlq { command: DlqCommand::Replay { id } } => crate::client::replay(&g, &id).await,
        Command::Webhooks { command } => crate::webhooks::run(&g, command).await,
        Command::Cancel { id } => crate::client::cancel(&g, &id).await,
        Command::Retry { id } => crate::client::replay(&g, &id).await,
        Command::Schemas { write } => {
            stemq_core::schema::write_all(&write)?;
            println!("wrote {} schemas to {}", stemq_core::schema::all().len(), write.display());
            Ok(())
        }
        Command::Top { interval, once } => crate::top::run(&g, Duration::from_secs_f64(interval), once).await,
        Command::Synth { seconds, output } => {
            let o = output.clone();
            tokio::task::spawn_blocking(move || stemq_audio::synth::write_demo_song(&o, seconds, 44_100)).await??;
            println!("wrote {seconds} s of the demo song to {}", output.display());
            Ok(())
        }
        Command::Bench { command } => crate::bench::run(&g, command).await,
        Command::EngineHost(a) => {
            let engine = crate::services::engine_in_process(&g, &a.opts)?;
            tokio::task::spawn_blocking(move || stemq_worker::isolate::serve(engine)).await??;
            Ok(())
        }
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

#[cfg(test)]
mod tests {

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
    use super::*;

    /// Clap's own consistency checks (duplicate ids, conflicting flags): `stemq dev`
    /// flattens worker and relay options, which once both defined `--concurrency`.
    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let dev = Cli::try_parse_from(["stemq", "dev", "--concurrency", "8", "--webhook-concurrency", "3"]).unwrap();
        match dev.command {
            Command::Dev(a) => assert_eq!((a.worker.concurrency, a.relay.concurrency), (8, 3)),
            _ => unreachable!(),
        }
    }
}
