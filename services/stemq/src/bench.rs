//! `stemq bench`: four benchmarks, one module each, over the same load shapes.
//!
//! | module | command | measures |
//! |---|---|---|
//! | [`pipeline`] | `stemq bench pipeline` | submitted → terminal in the KV view, with the fake engine |
//! | [`raw`] | `stemq bench raw` | raw JetStream cycles of the same load: the ceiling |
//! | [`http`] | `stemq bench http` | submits offered to a running ingress at a fixed rate |
//! | [`rss`] | `stemq bench rss` | the peak RSS of a worker separating songs of several lengths |
//!
//! [`figures`] holds what they measure and print alike.

mod figures;
mod http;
mod pipeline;
mod raw;
mod rss;

use std::path::Path;

use anyhow::Result;
use clap::Subcommand;
use stemq_devkit::nats_server::NatsServer;

use crate::global::{Global, ServerSettings};
use crate::services::Isolation;

pub use self::http::HttpLoad;

/// The owner of the benchmark's jobs (it publishes as an operator, past the ingress).
const BENCH_OWNER: &str = "bench";

/// The load of `bench pipeline` and `bench raw`.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct Load {
    /// Jobs (cycles) to run.
    #[arg(long, default_value_t = 1000)]
    pub jobs: usize,
    /// Submit at this steady rate (per second) instead of as fast as possible.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Worker job loops (consumer loops of the raw cycles).
    #[arg(long, default_value_t = 64)]
    pub workers: usize,
    /// Submits in flight at once (throughput mode).
    #[arg(long, default_value_t = 256)]
    pub in_flight: usize,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Submitted → terminal in the KV view, with the fake engine.
    Pipeline {
        #[command(flatten)]
        load: Load,
        /// Where outputs go: `memory`, `local` (files under a temp dir), or a store URL
        /// (`s3://bucket[/prefix]`, configured by the `AWS_*` variables as for `stemq`).
        #[arg(long, default_value = "memory")]
        store: String,
        /// Where the fake engine runs: `none` (in the worker; measures the pipeline) or
        /// `process` (engine host processes, as `stemq worker` runs by default; measures
        /// what isolation costs).
        #[arg(long, value_enum, default_value_t = Isolation::None)]
        isolation: Isolation,
        /// Run on a three-node JetStream cluster of its own (loopback, R3: every
        /// stream, consumer and bucket on three nodes) instead of one server. The
        /// processes connect with the three URLs. Implies `--replicas 3`; `NATS_URL` is
        /// not used.
        #[arg(long)]
        cluster: bool,
        /// Measure raw JetStream cycles first with the same load, on a fresh server of
        /// its own (with `--cluster`, three fresh nodes and the stream at R3), and print
        /// the pipeline's figures as ratios of it.
        #[arg(long)]
        raw: bool,
        /// Rounds to run (each on fresh servers; with `--raw`, raw JetStream then the
        /// pipeline in every round), then the median of each figure and of each round's
        /// ratio: on a shared machine, one round's ratio is one sample of the noise.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
        repeat: u32,
        #[command(flatten)]
        server: ServerSettings,
    },
    /// Raw JetStream with the pipeline's load shape: publish a request, pull it, publish
    /// an outcome, ack; no stemq logic. The ceiling `bench pipeline` is compared with.
    Raw {
        #[command(flatten)]
        load: Load,
    },
    /// HTTP submits offered at a fixed rate (open loop) to a running ingress: each
    /// request has its own job (a distinct body), is due at a fixed time, and its
    /// latency counts from that time, so a stall delays every request due during it
    /// (no coordinated omission). wrk measures at saturation; this measures at a rate.
    Http(HttpLoad),
    /// Peak RSS of a `stemq worker` process (dsp engine) separating songs of several
    /// lengths through the whole pipeline, side by side.
    Rss {
        /// Song lengths in minutes.
        #[arg(long, num_args = 1.., default_values_t = [5.0, 60.0])]
        minutes: Vec<f64>,
        #[command(flatten)]
        server: ServerSettings,
    },
}

pub async fn run(g: &Global, cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Pipeline { load, store, isolation, cluster, raw, repeat, server } => {
            let mut rounds = Vec::new();
            for round in 1..=repeat {
                if repeat > 1 {
                    println!("round {round} of {repeat}");
                }
                let baseline = if raw { Some(raw::raw_cycles(load, cluster).await?) } else { None };
                if let Some(b) = &baseline {
                    b.print();
                }
                let figures = pipeline::pipeline(g, &server, load, store.clone(), isolation, cluster).await?;
                if let Some(b) = &baseline {
                    println!("pipeline / raw JetStream (same run, same load)");
                    println!("  end to end      {:.3}×", figures.per_sec / b.per_sec);
                    println!("  latency p50     {:.2}× ({:.2} vs {:.2} ms)", figures.p50 / b.p50, figures.p50, b.p50);
                    println!("  latency p99     {:.2}× ({:.2} vs {:.2} ms)", figures.p99 / b.p99, figures.p99, b.p99);
                }
                rounds.push((figures, baseline));
            }
            if repeat > 1 {
                figures::print_rounds(&rounds);
            }
            Ok(())
        }
        BenchCommand::Raw { load } => {
            raw::raw_cycles(load, false).await?.print();
            Ok(())
        }
        BenchCommand::Http(load) => http::http(g, load).await,
        BenchCommand::Rss { minutes, server } => rss::rss(&server.settings(), &minutes).await,
    }
}

/// A nats-server of the benchmark's own, storing under `dir`, on a free port.
async fn own_server(dir: &Path) -> Result<NatsServer> {
    Ok(NatsServer::start_async(dir.to_path_buf(), 0).await?)
}
