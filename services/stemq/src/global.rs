//! What every command shares, apart from the parser: the global options, the option
//! groups that several subcommands flatten (server settings, object store, metrics
//! address, the HTTP API), the log format, and the shutdown signal.
//!
//! This module owns the process-wide context a command runs in. `cli.rs` parses into
//! these types and dispatches; the command modules (`services`, `client`, `dev`, ...)
//! read them from here, so none of them depends on the parser.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use stemq_nats::{ClientTls, ConnectAuth, Settings};
use stemq_telemetry::logging::LogFormat;
use tokio_util::sync::CancellationToken;

/// Options every command takes.
#[derive(Debug, Args, Clone)]
pub struct Global {
    /// NATS server URL, or a cluster's URLs separated by commas
    /// (`nats://n1:4222,nats://n2:4222,nats://n3:4222`): the client connects to any of
    /// them and reconnects to another when its node goes away. `stemq dev` starts its
    /// own server when this is not set.
    #[arg(long, env = "NATS_URL", global = true, help_heading = "Global options")]
    pub nats_url: Option<String>,
    /// Data directory (NATS store of `stemq dev`, local object store, scratch, models).
    #[arg(long, env = "STEMQ_DATA_DIR", default_value = ".stemq", global = true, help_heading = "Global options")]
    pub data_dir: PathBuf,
    /// The owner of jobs submitted straight to NATS (without `--api`), and of their
    /// uploads. Over the HTTP API the owner comes from the key.
    #[arg(long, env = "STEMQ_OWNER", default_value = "local", global = true, help_heading = "Global options")]
    pub owner: String,
    /// Log format (default: text on a terminal and for `stemq dev`, json otherwise).
    #[arg(long, env = "STEMQ_LOG_FORMAT", value_enum, global = true, help_heading = "Global options")]
    pub log_format: Option<LogFormatArg>,
    /// NATS credentials file of the user to connect as (an nkey seed file written by
    /// `stemq dev` or `stemq nats users`; it names the user's inbox prefix). Default:
    /// `<data-dir>/nats/creds/operator.nk` when `stemq dev` wrote one, else anonymous.
    #[arg(long, env = "STEMQ_NATS_CREDS", global = true, help_heading = "Global options")]
    pub nats_creds: Option<PathBuf>,
    /// PEM file of the CA that signed the NATS server's certificate (turns TLS on).
    #[arg(long, env = "STEMQ_NATS_CA", global = true, help_heading = "Global options")]
    pub nats_ca: Option<PathBuf>,
    /// PEM client certificate, for a NATS server that verifies clients (with --nats-key).
    #[arg(long, env = "STEMQ_NATS_CERT", global = true, requires = "nats_key", help_heading = "Global options")]
    pub nats_cert: Option<PathBuf>,
    /// PEM private key of --nats-cert.
    #[arg(long, env = "STEMQ_NATS_KEY", global = true, requires = "nats_cert", help_heading = "Global options")]
    pub nats_key: Option<PathBuf>,
}

impl Global {
    /// The NATS URL (or comma-separated URL list), or the default local one.
    pub fn nats_url(&self) -> String {
        self.nats_url.clone().unwrap_or_else(|| "nats://127.0.0.1:4222".to_string())
    }

    /// The credentials file to connect with: `--nats-creds`, else the operator's that
    /// `stemq dev` keeps in the data dir, if there is one.
    pub fn nats_creds(&self) -> Option<PathBuf> {
        if let Some(p) = &self.nats_creds {
            return Some(p.clone());
        }
        let dev = self.data_dir.join("nats/creds").join(format!("{}.nk", stemq_nats::users::OPERATOR));
        dev.is_file().then_some(dev)
    }

    /// The client TLS settings of the flags.
    pub fn nats_tls(&self) -> ClientTls {
        ClientTls {
            ca: self.nats_ca.clone(),
            cert: self.nats_cert.clone(),
            key: self.nats_key.clone(),
            required: false,
        }
    }

    /// How to connect: the credentials ([`Global::nats_creds`]) and TLS of the flags.
    pub fn nats_auth(&self) -> Result<ConnectAuth> {
        let auth = match self.nats_creds() {
            Some(path) => ConnectAuth::credentials_file(&path)?,
            None => ConnectAuth::default(),
        };
        Ok(auth.with_tls(self.nats_tls()))
    }

    /// Connects to [`Global::nats_url`] as [`Global::nats_auth`] says, naming the
    /// connection `name`.
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client> {
        Ok(stemq_nats::connect_with(&self.nats_url(), name, &self.nats_auth()?).await?)
    }
}

/// `--log-format`: how log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormatArg {
    /// One JSON object per line (for log collectors).
    Json,
    /// Human-readable lines.
    Text,
}

impl LogFormatArg {
    /// The telemetry crate's format.
    pub fn format(self) -> LogFormat {
        match self {
            LogFormatArg::Json => LogFormat::Json,
            LogFormatArg::Text => LogFormat::Text,
        }
    }

    /// The spelling on the command line (to hand it on to a child process).
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormatArg::Json => "json",
            LogFormatArg::Text => "text",
        }
    }
}

/// The NATS definition settings: what a process creates when a stream or consumer is
/// missing (and what `stemq nats apply` writes). Flattened into the commands that
/// create definitions: `dev`, `ingress`, `worker`, `projector`, `relay`, `nats apply`,
/// `bench`.
#[derive(Debug, Args, Clone)]
pub struct ServerSettings {
    /// Worker ack deadline in ms (progress acks keep long jobs alive).
    #[arg(long, env = "STEMQ_ACK_WAIT_MS", default_value_t = 30_000)]
    pub ack_wait_ms: u64,
    /// Deliveries before a job is dead-lettered.
    #[arg(long, env = "STEMQ_MAX_DELIVER", default_value_t = 5)]
    pub max_deliver: i64,
    /// Dedupe window of the job stream in ms.
    #[arg(long, env = "STEMQ_DEDUPE_WINDOW_MS", default_value_t = 120_000)]
    pub dedupe_window_ms: u64,
    /// Replicas of every stream, consumer and bucket: 1 on a single server, 3 on a
    /// three-node JetStream cluster (`stemq nats apply --replicas 3` moves existing ones).
    #[arg(long, env = "STEMQ_NATS_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub replicas: u8,
}

impl ServerSettings {
    /// The definitions' knobs.
    pub fn settings(&self) -> Settings {
        Settings {
            ack_wait: Duration::from_millis(self.ack_wait_ms),
            max_deliver: self.max_deliver,
            duplicate_window: Duration::from_millis(self.dedupe_window_ms),
            replicas: usize::from(self.replicas),
        }
    }
}

/// `--store`: the object store of inputs and outputs (`dev`, `ingress`, `worker`, and
/// `submit` when it talks to NATS directly).
#[derive(Debug, Args, Clone, Default)]
pub struct StoreArg {
    /// Object store URL for inputs and outputs (default: file://<data-dir>/store).
    #[arg(long, env = "STEMQ_STORE")]
    pub store: Option<String>,
}

impl StoreArg {
    /// The object store URL: `--store`, or `file://<data_dir>/store` (created).
    pub fn url(&self, data_dir: &Path) -> Result<String> {
        if let Some(s) = &self.store {
            return Ok(s.clone());
        }
        let dir = data_dir.join("store");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let abs = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
        let url = url::Url::from_directory_path(&abs)
            .map_err(|()| anyhow::anyhow!("{} cannot be a file:// URL", abs.display()))?;
        Ok(url.to_string())
    }
}

/// `--metrics`: where a worker, projector or relay process serves Prometheus metrics
/// (the ingress serves its own on its HTTP port).
#[derive(Debug, Args, Clone, Default)]
pub struct MetricsArg {
    /// Serve Prometheus `/metrics` on this address.
    #[arg(long = "metrics", env = "STEMQ_METRICS_ADDR")]
    pub addr: Option<SocketAddr>,
    /// Export the queue figures (`stemq_queue_*`, `stemq_projector_lag_events`, read from
    /// NATS per scrape) on that `/metrics`. Give it to one process of a deployment only
    /// (docs/operations.md, "Metrics").
    #[arg(long = "queue-metrics", env = "STEMQ_QUEUE_METRICS", requires = "addr")]
    pub queue: bool,
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

/// `--api URL` and `--api-key KEY`: send the client commands to the HTTP API.
#[derive(Debug, Args, Clone, Default)]
pub struct ApiArgs {
    /// The stemq HTTP API (e.g. `http://127.0.0.1:8080`): talk to it instead of NATS, so
    /// no NATS URL or store is needed.
    #[arg(long, env = "STEMQ_API", global = true, value_name = "URL", help_heading = "HTTP API")]
    pub api: Option<url::Url>,
    /// The API key, sent as `Authorization: Bearer KEY` (with `--api`); default: the key
    /// `stemq dev` wrote to `<data-dir>/admin.key`, if any.
    #[arg(
        long,
        env = "STEMQ_API_KEY",
        global = true,
        value_name = "KEY",
        hide_env_values = true,
        help_heading = "HTTP API"
    )]
    pub api_key: Option<String>,
}
