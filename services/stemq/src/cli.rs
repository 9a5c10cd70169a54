//! The command line: the parser and the dispatch.
//!
//! This module owns the shape of `stemq`'s arguments — which subcommand takes which
//! options — and hands each parsed command to the module that runs it. The options
//! shared by several commands live with what uses them ([`crate::global`] for the
//! process-wide ones, [`crate::services`], [`crate::client`], [`crate::api`],
//! [`crate::job_opts`]), so no command module depends on this one.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Parser, Subcommand};
use stemq_core::batch::BatchId;
use stemq_core::{JobId, JobStatus};
use stemq_telemetry::logging::LogFormat;

use crate::client::SubmitArgs;
use crate::dev::DevArgs;
use crate::global::ApiArgs;
use crate::global::{Global, ServerSettings};
use crate::services::{EngineArgs, IngressArgs, ProjectorArgs, RelayServiceArgs, WorkerArgs};

/// stemq: music source separation as a service, on NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "stemq", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
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
    Relay(RelayServiceArgs),
    /// NATS: apply the stream, consumer and bucket definitions of nats/; manage users.
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
    #[command(mut_arg("shifts", |a| a
        .default_value("1")
        .help("Random shifts (test-time augmentation), as demucs; a job sent to the service has none unless it asks")))]
    Separate(crate::separate::SeparateArgs),
    /// Submit a job (a file path is uploaded to the store first).
    Submit(SubmitArgs),
    /// Submit every song of a folder as one batch, over the HTTP API (`--api`): the
    /// `submit` flags make each song's request; `--wait` follows the whole batch with one
    /// progress bar (submitting what a rate limit held back once it allows), `-o OUT`
    /// then downloads each song's stems into `OUT/<song>/`. The same folder is the same
    /// batch: running the command again goes on where it stopped.
    #[command(
        mut_arg("input", |a| a
            .value_name("DIR")
            .help("A folder of songs (any format stemq reads, known by its bytes; not its subfolders): each is uploaded and becomes one item")),
        mut_arg("output_dir", |a| a.help("With `--wait`: copy each song's stems into DIR/<song>/<stem>.<ext>")),
        mut_arg("wait", |a| a.help("Wait for every job of the batch to end, with one progress bar")),
        mut_arg("store", |a| a.hide(true))
    )]
    Batch(crate::batch::BatchArgs),
    /// Print a job's status view (or a batch's, with `--batch`).
    Status {
        /// Job id (a batch id with `--batch`).
        #[arg(value_parser = parse_id)]
        id: JobId,
        /// ID is a batch (over the HTTP API).
        #[arg(long)]
        batch: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// List jobs, newest first.
    List {
        /// Only jobs with this status.
        #[arg(long, value_parser = parse_status)]
        status: Option<JobStatus>,
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Follow a job with a progress bar until it ends (or a batch, with `--batch`).
    Watch {
        /// Job id (a batch id with `--batch`).
        #[arg(value_parser = parse_id)]
        id: JobId,
        /// ID is a batch (over the HTTP API): one bar for all its jobs, then a summary.
        #[arg(long)]
        batch: bool,
        /// With `--batch`: copy each succeeded song's stems into DIR/<song>/.
        #[arg(short = 'o', long = "output-dir", value_name = "DIR", requires = "batch")]
        output_dir: Option<PathBuf>,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Cancel a queued or running job (a running job stops within about a second).
    Cancel {
        /// Job id.
        #[arg(value_parser = parse_id)]
        id: JobId,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Re-run a failed, dead-lettered, cancelled or expired job as a new job.
    Retry {
        /// Job id.
        #[arg(value_parser = parse_id)]
        id: JobId,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Dead letters.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// API keys: create (printed once), list, revoke.
    Keys {
        #[command(subcommand)]
        command: crate::keys::KeysCommand,
    },
    /// Credits (operators): grant, show an owner's account or movements, the price list.
    Credits {
        #[command(subcommand)]
        command: crate::credits::CreditsCommand,
    },
    /// Usage per owner and model from the credits ledger (operators).
    Usage {
        /// Only these owners (default: every owner with a ledger).
        owners: Vec<String>,
        /// Only since this RFC 3339 time.
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
    },
    /// Webhook settings (re-enable a URL a 410 Gone disabled).
    Webhooks {
        #[command(subcommand)]
        command: crate::webhooks::WebhooksCommand,
    },
    /// Write the JSON Schemas of the contracts and the AsyncAPI document of the NATS side.
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
    /// the host protocol on stdin/stdout. Started by the worker with
    /// [`crate::services::engine_host_args`].
    #[command(hide = true)]
    EngineHost(EngineArgs),
}

#[derive(Debug, Subcommand)]
pub enum ModelsCommand {
    /// Download released models (htdemucs, htdemucs_ft, htdemucs_6s), checksums verified.
    Pull {
        /// Model names, one or more.
        #[arg(required = true)]
        names: Vec<String>,
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
    Apply(ServerSettings),
    /// NATS users and their credentials (e.g. a publisher for one owner).
    Users {
        #[command(subcommand)]
        command: crate::users::UsersCommand,
    },
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
        #[arg(value_parser = parse_id)]
        id: JobId,
    },
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
        match self.global.log_format {
            Some(f) => f.format(),
            None => {
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

/// `--status`: a job status the view knows.
fn parse_status(s: &str) -> Result<JobStatus, String> {
    JobStatus::parse(s).ok_or_else(|| {
        let known: Vec<_> = JobStatus::ALL.iter().map(|x| x.as_str()).collect();
        format!("unknown status `{s}`; one of: {}", known.join(", "))
    })
}

/// `ID`: a job id, or a batch id where `--batch` says so (both are 64 lowercase hex
/// digits, the form [`JobId::parse`] accepts).
fn parse_id(s: &str) -> Result<JobId, String> {
    JobId::parse(s).ok_or_else(|| format!("`{s}` is not an id: expected 64 lowercase hex digits"))
}

/// The batch a `--batch` command names: `ID` in the form of every id.
fn batch_id(id: &JobId) -> BatchId {
    BatchId::parse(id.as_str()).expect("a batch id has the form of a job id")
}

/// The API client of the batch commands: batches are an HTTP API feature.
fn batch_api(g: &Global, api: &ApiArgs) -> Result<crate::api::Api> {
    api.client(&g.data_dir).ok_or_else(|| {
        anyhow::anyhow!(
            "batches go through the HTTP API: pass --api URL (or set STEMQ_API), e.g. --api http://127.0.0.1:8080 \
             for `stemq dev`"
        )
    })
}

/// Dispatches a parsed command line.
pub async fn run(cli: Cli) -> Result<()> {
    let g = cli.global;
    match cli.command {
        Command::Dev(a) => crate::dev::run(&g, a).await,
        Command::Ingress(a) => crate::services::ingress(&g, a).await,
        Command::Worker(a) => crate::services::worker(&g, a).await,
        Command::Projector(a) => crate::services::projector(&g, a).await,
        Command::Relay(a) => crate::services::relay(&g, a).await,
        Command::Nats { command: NatsCommand::Apply(server) } => {
            let client = g.connect("stemq-cli").await?;
            let changes = stemq_nats::apply(&async_nats::jetstream::new(client), &server.settings()).await?;
            for c in &changes {
                println!("{c}");
            }
            let changed = changes.iter().filter(|c| c.is_change()).count();
            println!("{} objects, {changed} created or changed, at {}", changes.len(), g.nats_url());
            Ok(())
        }
        Command::Nats { command: NatsCommand::Users { command } } => crate::users::run(&g, command),
        Command::Models { command, dir } => {
            let dir = dir.unwrap_or_else(|| g.data_dir.join("models"));
            match command {
                ModelsCommand::Pull { names, url } => {
                    for name in &names {
                        crate::models::pull(name, &dir, &url).await?;
                    }
                    Ok(())
                }
                ModelsCommand::List => crate::models::list(&dir),
            }
        }
        Command::Separate(a) => tokio::task::spawn_blocking(move || crate::separate::run(&g, a)).await?,
        Command::Submit(a) if std::path::Path::new(&a.input).is_dir() => {
            anyhow::bail!("{} is a folder: `stemq batch {}` submits its songs as one batch", a.input, a.input)
        }
        Command::Submit(a) => match a.api.client(&g.data_dir) {
            Some(api) => crate::api::submit(&api, a).await,
            None => crate::client::submit(&g, a).await,
        },
        Command::Batch(a) => crate::batch::submit(&batch_api(&g, &a.job.api)?, a).await,
        Command::Status { id, batch: true, api } => crate::batch::status(&batch_api(&g, &api)?, &batch_id(&id)).await,
        Command::Status { id, api, .. } => match api.client(&g.data_dir) {
            Some(api) => crate::api::status(&api, &id).await,
            None => crate::client::status(&g, &id).await,
        },
        Command::Watch { id, batch: true, output_dir, api } => {
            crate::batch::watch(&batch_api(&g, &api)?, &batch_id(&id), output_dir.as_deref()).await
        }
        Command::List { status, limit, api } => match api.client(&g.data_dir) {
            Some(api) => crate::api::list(&api, status, limit).await,
            None => crate::client::list(&g, status, limit).await,
        },
        Command::Watch { id, api, .. } => match api.client(&g.data_dir) {
            Some(api) => crate::api::watch(&api, &id).await,
            None => crate::client::watch(&g, &id).await.map(|_| ()),
        },
        Command::Dlq { command: DlqCommand::List { limit }, api } => match api.client(&g.data_dir) {
            Some(api) => crate::api::list(&api, Some(JobStatus::DeadLettered), limit).await,
            None => crate::client::list(&g, Some(JobStatus::DeadLettered), limit).await,
        },
        Command::Dlq { command: DlqCommand::Replay { id }, api } | Command::Retry { id, api } => {
            match api.client(&g.data_dir) {
                Some(api) => crate::api::retry(&api, &id).await,
                None => crate::client::replay(&g, &id).await,
            }
        }
        Command::Cancel { id, api } => match api.client(&g.data_dir) {
            Some(api) => crate::api::cancel(&api, &id).await,
            None => crate::client::cancel(&g, &id).await,
        },
        Command::Webhooks { command } => crate::webhooks::run(&g, command).await,
        Command::Keys { command } => crate::keys::run(&g, command).await,
        Command::Credits { command } => crate::credits::run(&g, command).await,
        Command::Usage { owners, since } => crate::credits::usage(&g, owners, since).await,
        Command::Schemas { write } => {
            stemq_core::schema::write_all(&write)?;
            stemq_ingress::schemas::write_all(&write)?;
            std::fs::write(write.join("asyncapi.json"), stemq_ingress::asyncapi::render())?;
            let n = stemq_core::schema::all().len() + stemq_ingress::schemas::all().len();
            println!("wrote {n} schemas and asyncapi.json to {}", write.display());
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
            let engine = crate::services::engine_in_process(&g, &a)?;
            tokio::task::spawn_blocking(move || stemq_worker::isolate::serve(engine)).await??;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn help_of(sub: &str) -> String {
        let mut cmd = Cli::command();
        cmd.build();
        cmd.find_subcommand_mut(sub).expect(sub).render_long_help().to_string()
    }

    /// Clap's own consistency checks (duplicate ids, conflicting flags): `stemq dev`
    /// flattens worker and relay options, which once both defined `--concurrency`.
    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
        let dev = Cli::try_parse_from(["stemq", "dev", "--concurrency", "8", "--webhook-concurrency", "3"]).unwrap();
        match dev.command {
            Command::Dev(a) => assert_eq!((a.worker.concurrency, a.relay.concurrency), (8, 3)),
            _ => unreachable!(),
        }
    }

    /// TLS needs a certificate and its key together; the audio URL allow-list is parsed
    /// (bad wildcards refused, an empty list is off) and read by ingress, worker and dev.
    #[test]
    fn tls_and_audio_url_flags_are_validated() {
        let parse = |args: &[&str]| Cli::try_parse_from([&["stemq"], args].concat());
        assert!(parse(&["ingress", "--tls-cert", "c.pem"]).is_err());
        assert!(parse(&["ingress", "--tls-key", "k.pem"]).is_err());
        assert!(parse(&["ingress", "--tls-client-ca", "ca.pem"]).is_err());
        let ok = parse(&["ingress", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"]);
        match ok.unwrap().command {
            Command::Ingress(a) => {
                let tls = a.tls.config().unwrap();
                assert_eq!((tls.cert.to_str(), tls.client_ca.is_some()), (Some("c.pem"), true));
                assert!(a.audio_urls.policy().is_none());
            }
            _ => unreachable!(),
        }
        assert!(parse(&["ingress", "--audio-url-allow", "songs*.example.com"]).is_err());
        match parse(&["worker", "--audio-url-allow", "*.songs.example.com,10.0.0.0/8"]).unwrap().command {
            Command::Worker(w) => assert!(w.audio_urls.worker().is_some()),
            _ => unreachable!(),
        }
        match parse(&["dev", "--audio-url-allow", "", "--tls-cert", "c", "--tls-key", "k"]).unwrap().command {
            Command::Dev(d) => assert!(d.audio_urls.policy().is_none() && d.tls.config().is_some()),
            _ => unreachable!(),
        }
    }

    /// Issue 17: server settings show only on the commands they apply to.
    #[test]
    fn server_settings_show_only_where_they_apply() {
        for sub in ["dev", "ingress", "worker", "projector", "relay"] {
            let help = help_of(sub);
            assert!(help.contains("--ack-wait-ms") && help.contains("--max-deliver"), "{sub}:\n{help}");
        }
        for sub in ["submit", "status", "list", "separate", "synth", "top"] {
            let help = help_of(sub);
            for flag in ["--ack-wait-ms", "--max-deliver", "--dedupe-window-ms", "--metrics"] {
                assert!(!help.contains(flag), "{sub} shows {flag}:\n{help}");
            }
        }
        assert!(!help_of("separate").contains("--store"));
        assert!(help_of("worker").contains("--metrics"));
    }

    /// Issue 17: engines, log formats, devices and clip modes are parsed, not carried
    /// as strings; an unknown value is an error.
    #[test]
    fn closed_choices_are_validated_by_the_parser() {
        assert!(Cli::try_parse_from(["stemq", "--log-format", "xml", "top"]).is_err());
        assert!(Cli::try_parse_from(["stemq", "worker", "--engine", "magic"]).is_err());
        assert!(Cli::try_parse_from(["stemq", "separate", "-d", "tpu", "a.wav"]).is_err());
        assert!(Cli::try_parse_from(["stemq", "submit", "--clip-mode", "soft", "a.wav"]).is_err());
        assert!(Cli::try_parse_from(["stemq", "list", "--status", "sleeping"]).is_err());
        let ok = Cli::try_parse_from(["stemq", "--log-format", "json", "worker", "--engine", "fake"]).unwrap();
        assert_eq!(ok.log_format(), LogFormat::Json);
        match ok.command {
            Command::Worker(w) => assert_eq!(w.opts.engine.engine, crate::services::EngineKind::Fake),
            _ => unreachable!(),
        }
    }

    /// `submit` takes `separate`'s (demucs's) spellings too.
    #[test]
    fn submit_takes_the_separate_spellings() {
        let demucs = ["stemq", "submit", "--name", "dsp", "--flac", "--int24", "--wait", "--out", "d", "x://a.wav"];
        let own = [
            "stemq",
            "submit",
            "--model",
            "dsp",
            "--format",
            "flac",
            "--encoding",
            "s24",
            "--wait",
            "-o",
            "d",
            "x://a.wav",
        ];
        let req = |args: &[&str]| match Cli::try_parse_from(args).unwrap().command {
            Command::Submit(a) => (a.request("x://a.wav"), a.output_dir),
            _ => unreachable!(),
        };
        assert_eq!(req(&demucs), req(&own));
        assert_eq!(req(&own).0["output_format"], "flac");
        assert!(Cli::try_parse_from(["stemq", "submit", "--flac", "--format", "wav", "a.wav"]).is_err());
        // MP3, in both spellings.
        let mp3 = ["stemq", "submit", "--mp3", "--mp3-bitrate", "192", "--mp3-preset", "3", "--wait", "x://a.wav"];
        let own =
            ["stemq", "submit", "--format", "mp3", "--mp3-bitrate", "192", "--mp3-preset", "3", "--wait", "x://a.wav"];
        assert_eq!(req(&mp3), req(&own));
        assert_eq!(req(&mp3).0["output_format"], "mp3");
        assert_eq!(
            (&req(&mp3).0["mp3_bitrate"], &req(&mp3).0["mp3_preset"]),
            (&serde_json::json!(192), &serde_json::json!(3))
        );
        assert!(Cli::try_parse_from(["stemq", "submit", "--mp3", "--flac", "a.wav"]).is_err());
        assert!(Cli::try_parse_from(["stemq", "submit", "--mp3", "--mp3-preset", "8", "a.wav"]).is_err());
    }

    /// Issue 12: `submit --priority` puts the lane in the request (absent: the key's
    /// default); `keys create --priority` sets a key's default lane; an unknown lane is
    /// refused by the parser.
    #[test]
    fn priority_flags_name_a_lane() {
        let submit = |args: &[&str]| match Cli::try_parse_from([&["stemq", "submit"], args, &["x://a.wav"]].concat()) {
            Ok(Cli { command: Command::Submit(a), .. }) => Ok(a.request("x://a.wav")),
            Ok(_) => unreachable!(),
            Err(e) => Err(e),
        };
        assert_eq!(submit(&["--priority", "batch"]).unwrap()["priority"], "batch");
        assert_eq!(submit(&["--priority", "interactive"]).unwrap()["priority"], "interactive");
        assert!(submit(&[]).unwrap().get("priority").is_none(), "no flag: the key's default applies");
        assert!(submit(&["--priority", "urgent"]).is_err());
        let create = |args: &[&str]| {
            Cli::try_parse_from([&["stemq", "keys", "create", "--owner", "acme"], args].concat()).map(|c| c.command)
        };
        match create(&["--priority", "batch"]).unwrap() {
            Command::Keys { command: crate::keys::KeysCommand::Create { priority, .. } } => {
                assert_eq!(priority.map(|p| p.priority()), Some(stemq_core::request::Priority::Batch))
            }
            _ => unreachable!(),
        }
        match create(&[]).unwrap() {
            Command::Keys { command: crate::keys::KeysCommand::Create { priority, .. } } => assert_eq!(priority, None),
            _ => unreachable!(),
        }
        assert!(create(&["--priority", "soon"]).is_err());
    }

    /// `batch DIR` takes the `submit` flags, a webhook, `--wait` and `-o`; its help
    /// names a folder and hides `--store` (batches go through the API); `status` and
    /// `watch` read a batch with `--batch`, and `watch -o` is for batches only.
    #[test]
    fn batch_takes_a_folder_and_the_submit_flags() {
        let cli = Cli::try_parse_from([
            "stemq",
            "batch",
            "songs/",
            "--flac",
            "--priority",
            "batch",
            "--webhook",
            "https://example.com/h",
            "--wait",
            "-o",
            "out",
        ])
        .unwrap();
        let Command::Batch(a) = cli.command else { unreachable!() };
        assert_eq!(a.job.input, "songs/");
        assert_eq!(a.webhook.as_deref(), Some("https://example.com/h"));
        let req = a.job.request("x://a.wav");
        assert_eq!((req["output_format"].as_str(), req["priority"].as_str()), (Some("flac"), Some("batch")));
        assert_eq!(a.job.output_dir.as_deref(), Some(std::path::Path::new("out")));
        assert!(Cli::try_parse_from(["stemq", "batch", "songs/", "-o", "out"]).is_err(), "-o needs --wait");
        let help = help_of("batch");
        assert!(help.contains("DIR") && help.contains("A folder of songs"), "{help}");
        assert!(!help.contains("--store"), "{help}");
        let id = "ab".repeat(32);
        match Cli::try_parse_from(["stemq", "watch", "--batch", &id, "-o", "d"]).unwrap().command {
            Command::Watch { batch, output_dir, .. } => assert!(batch && output_dir.is_some()),
            _ => unreachable!(),
        }
        assert!(Cli::try_parse_from(["stemq", "watch", &id, "-o", "d"]).is_err());
        match Cli::try_parse_from(["stemq", "status", "--batch", &id]).unwrap().command {
            Command::Status { id: parsed, batch: true, .. } => assert_eq!(batch_id(&parsed).as_str(), id),
            _ => unreachable!(),
        }
    }

    #[test]
    fn ids_are_parsed_once_at_the_edge() {
        let id = "0123456789abcdef".repeat(4);
        for sub in [&["status"][..], &["watch"], &["cancel"], &["retry"], &["dlq", "replay"], &["status", "--batch"]] {
            let args =
                |id: &str| -> Vec<String> { ["stemq"].iter().chain(sub).chain([&id]).map(|s| s.to_string()).collect() };
            let cli = Cli::try_parse_from(args(&id)).unwrap_or_else(|e| panic!("{sub:?}: {e}"));
            assert!(matches!(
                cli.command,
                Command::Status { .. }
                    | Command::Watch { .. }
                    | Command::Cancel { .. }
                    | Command::Retry { .. }
                    | Command::Dlq { command: DlqCommand::Replay { .. }, .. }
            ));
            for bad in ["abc", &id.to_uppercase(), &format!("{id}0"), "../../etc/passwd"] {
                let e = Cli::try_parse_from(args(bad)).expect_err(bad).to_string();
                assert!(e.contains(&format!("`{bad}` is not an id: expected 64 lowercase hex digits")), "{sub:?}: {e}");
            }
        }
        match Cli::try_parse_from(["stemq", "list", "--status", "dead_lettered"]).unwrap().command {
            Command::List { status, .. } => assert_eq!(status, Some(JobStatus::DeadLettered)),
            _ => unreachable!(),
        }
    }

    /// The engine host command line the worker writes is one this parser reads.
    #[test]
    fn the_engine_host_command_line_parses() {
        let cli = Cli::try_parse_from([
            "stemq",
            "--log-format",
            "text",
            "worker",
            "--engine",
            "fake",
            "--isolation",
            "shared",
            "--batch-across-jobs",
            "8",
            "--batch-linger-ms",
            "7",
            "--gpu-weights",
            "f16",
        ])
        .unwrap();
        let Command::Worker(w) = cli.command else { unreachable!() };
        assert_eq!(w.opts.isolation, crate::services::Isolation::Shared);
        let mut args = vec![std::ffi::OsString::from("stemq")];
        args.extend(crate::services::engine_host_args(&cli.global, &w.opts.engine));
        let host = Cli::try_parse_from(args).unwrap();
        assert_eq!(host.global.log_format, cli.global.log_format);
        match host.command {
            // The host runs the engine, so it gets the engine's batching.
            Command::EngineHost(e) => {
                assert_eq!(e.engine, crate::services::EngineKind::Fake);
                assert_eq!((e.batch_across_jobs, e.batch_linger_ms), (8, 7));
                assert_eq!(e.gpu_weights, crate::services::GpuWeights::F16);
            }
            _ => unreachable!(),
        }
    }
}
