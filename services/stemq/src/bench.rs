//! `stemq bench pipeline`: end-to-end throughput and latency with the fake engine;
//! `stemq bench http`: submits offered to a running ingress at a fixed rate.
//!
//! Everything runs in one box: a nats-server of its own (unless `NATS_URL` is set; with
//! `--cluster`, three nodes on loopback with every stream, consumer and bucket at R3),
//! the projector and a worker in this process, and a submitter that publishes distinct
//! jobs.
//! A job counts as done when its KV view turns terminal, so the figures include the
//! projector. Two modes:
//! - throughput: `--jobs N` as fast as the pipeline takes them → jobs/s, p50/p99;
//! - steady rate: `--rate R` → latency at R jobs/s (submit → terminal in the view).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use async_nats::jetstream::{self, kv};
use clap::Subcommand;
use futures::StreamExt;
use stemq_core::engine::FakeEngine;
use stemq_core::nats_cluster::NatsCluster;
use stemq_core::nats_server::NatsServer;
use stemq_core::storage::Store;
use stemq_core::JobId;
use tokio::sync::{Mutex, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::global::{Global, ServerSettings};
use crate::services::Isolation;

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
        /// its own, and print the pipeline's figures as ratios of it.
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
            let Load { jobs, rate, workers, in_flight } = load;
            let mut rounds = Vec::new();
            for round in 1..=repeat {
                if repeat > 1 {
                    println!("round {round} of {repeat}");
                }
                let baseline = if raw { Some(raw_cycles(load).await?) } else { None };
                if let Some(b) = &baseline {
                    b.print();
                }
                let figures =
                    pipeline(g, &server, jobs, rate, workers, in_flight, store.clone(), isolation, cluster).await?;
                if let Some(b) = &baseline {
                    println!("pipeline / raw JetStream (same run, same load)");
                    println!("  end to end      {:.3}×", figures.per_sec / b.per_sec);
                    println!("  latency p50     {:.2}× ({:.2} vs {:.2} ms)", figures.p50 / b.p50, figures.p50, b.p50);
                    println!("  latency p99     {:.2}× ({:.2} vs {:.2} ms)", figures.p99 / b.p99, figures.p99, b.p99);
                }
                rounds.push((figures, baseline));
            }
            if repeat > 1 {
                print_rounds(&rounds);
            }
            Ok(())
        }
        BenchCommand::Raw { load } => {
            raw_cycles(load).await?.print();
            Ok(())
        }
        BenchCommand::Http(load) => http(g, load).await,
        BenchCommand::Rss { minutes, server } => rss(&server.settings(), &minutes).await,
    }
}

fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// Runs each song length through a fresh worker process and reports its peak RSS.
async fn rss(settings: &stemq_core::nats::Settings, minutes: &[f64]) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("nats");
    let server = tokio::task::spawn_blocking(move || NatsServer::start(&dir, 0)).await??;
    let client = server.connect_as(stemq_core::nats_users::OPERATOR, "stemq-bench").await?;
    let js = jetstream::new(client.clone());
    stemq_core::nats::apply(&js, settings).await?;
    let kv = js.get_key_value(stemq_core::nats::JOBS_BUCKET).await?;
    let store = Store::local(&tmp.path().join("store"))?;
    let stop = CancellationToken::new();
    let p = tokio::spawn(stemq_projector::run(client.clone(), Default::default(), stop.clone()));
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    for &m in minutes {
        let song = tmp.path().join(format!("song-{m}.wav"));
        let s2 = song.clone();
        tokio::task::spawn_blocking(move || stemq_audio::synth::write_demo_song(&s2, m * 60.0, 44_100)).await??;
        let key = format!("{}song-{m}.wav", stemq_core::uri::uploads_prefix(BENCH_OWNER));
        store.put_file(&key, &song).await?;
        std::fs::remove_file(&song)?;
        let mut child = std::process::Command::new(&exe)
            .arg("worker")
            .env("NATS_URL", server.url())
            .env("STEMQ_NATS_CREDS", server.credentials(stemq_core::nats_users::WORKER))
            .env("STEMQ_STORE", store.base_url())
            .env("STEMQ_DATA_DIR", tmp.path())
            .env("STEMQ_ENGINE", "dsp")
            // The engine in the worker process, so this one process's peak is the whole
            // cost (with isolation the engine's memory sits in its host process).
            .env("STEMQ_ISOLATION", "none")
            .env("STEMQ_LOG_FORMAT", "json")
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()?;
        let pid = child.id();
        let body = format!(r#"{{"audio_uri":"{}","model":"dsp"}}"#, store.uri(&key));
        let t0 = Instant::now();
        let stores = [store.base_url().to_string()];
        let (resp, _) = stemq_ingress::submit::submit(&js, body.as_bytes(), BENCH_OWNER, None, &stores, None)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let view = loop {
            if let Some((v, _)) = stemq_core::read::get_view(&kv, &resp.job_id).await? {
                if v.status.is_terminal() {
                    break v;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let secs = t0.elapsed().as_secs_f64();
        let hwm = vm_hwm_kib(pid).unwrap_or(0);
        let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        let _ = child.wait();
        if view.status != stemq_core::JobStatus::Succeeded {
            bail!("{m}-minute job ended {:?}: {:?}", view.status, view.error);
        }
        store.delete_prefix(&format!("jobs/{}", resp.job_id)).await?;
        println!(
            "{m:>5} min: worker peak RSS {:>7.1} MiB, {secs:>6.1} s end to end (real-time factor {:.3})",
            hwm as f64 / 1024.0,
            secs / (m * 60.0)
        );
        rows.push((m, hwm));
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        if rows.len() > 1 && first.1 > 0 {
            println!("ratio {} min / {} min: {:.3}", last.0, first.0, last.1 as f64 / first.1 as f64);
        }
    }
    stop.cancel();
    let _ = p.await;
    drop(server);
    Ok(())
}

/// The load of `bench http`.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpLoad {
    /// The ingress (`--api URL`, required) and the key (a `submit` key of `--owner`,
    /// or an operator's).
    #[command(flatten)]
    pub api: crate::api::ApiArgs,
    /// Requests offered per second, at evenly spaced times.
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// How long to offer them, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Connections, and so requests in flight at most; a request due while all are
    /// busy waits for one, and its wait counts.
    #[arg(long, default_value_t = 32)]
    pub connections: usize,
    /// The base URL of the ingress's store (each body names an upload under it).
    #[arg(long, env = "STEMQ_STORE_BASE")]
    pub store_base: String,
    /// The owner whose upload prefix the bodies name (the key's owner).
    #[arg(long, default_value = "local")]
    pub owner: String,
}

/// `bench http`: see [`BenchCommand::Http`].
async fn http(g: &Global, load: HttpLoad) -> Result<()> {
    let HttpLoad { api, rate, seconds, connections, store_base, owner } = load;
    if !(rate > 0.0 && rate.is_finite() && seconds > 0.0 && seconds.is_finite()) || connections == 0 {
        bail!("--rate and --seconds must be positive and --connections at least 1");
    }
    let Some(base_url) = &api.api else { bail!("bench http needs the ingress: pass --api URL (or set STEMQ_API)") };
    let key = crate::keys::client_key(api.api_key.as_deref(), &g.data_dir);
    let url = format!("{}/v1/separations", base_url.as_str().trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .http1_only()
        .pool_max_idle_per_host(connections)
        .timeout(Duration::from_secs(30))
        .build()?;
    let total = (rate * seconds).round().max(1.0) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let sem = Arc::new(Semaphore::new(connections));
    let run = uuid::Uuid::new_v4().simple().to_string();
    let prefix = format!("{}/{}", store_base.trim_end_matches('/'), stemq_core::uri::uploads_prefix(&owner));
    let t0 = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut handles = Vec::with_capacity(total);
    for i in 0..total {
        let due = t0 + interval.mul_f64(i as f64);
        tokio::time::sleep_until(due).await;
        let (client, url, key, sem) = (client.clone(), url.clone(), key.clone(), sem.clone());
        let body = format!(r#"{{"audio_uri":"{prefix}bench-{run}-{i}.wav","model":"dsp"}}"#);
        handles.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore");
            let sent = tokio::time::Instant::now();
            let mut req = client.post(&url).header("content-type", "application/json").body(body);
            if let Some(k) = &key {
                req = req.bearer_auth(k);
            }
            let status = match req.send().await {
                Ok(r) => {
                    let code = r.status().as_u16();
                    let _ = r.bytes().await;
                    Some(code)
                }
                Err(_) => None,
            };
            let done = tokio::time::Instant::now();
            (status, done.duration_since(due), done.duration_since(sent), done)
        }));
    }
    // Per HTTP status; `None`: no answer (a connection error or the timeout).
    let mut statuses: std::collections::BTreeMap<Option<u16>, usize> = Default::default();
    let (mut latency, mut service) = (Vec::with_capacity(total), Vec::with_capacity(total));
    let mut last = t0;
    for h in handles {
        let (status, lat, svc, done) = h.await?;
        *statuses.entry(status).or_default() += 1;
        latency.push(lat.as_secs_f64() * 1000.0);
        service.push(svc.as_secs_f64() * 1000.0);
        last = last.max(done);
    }
    for v in [&mut latency, &mut service] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    let ok = statuses.get(&Some(202)).copied().unwrap_or(0);
    println!("stemq bench http");
    println!("  offered         {total} requests at {rate:.0}/s over {seconds} s, {connections} connections");
    println!("  answered        {:.0} requests/s", total as f64 / last.duration_since(t0).as_secs_f64());
    let counts: Vec<String> =
        statuses.iter().map(|(k, v)| format!("{}: {v}", k.map_or("error".to_string(), |c| c.to_string()))).collect();
    println!("  statuses        {}", counts.join(", "));
    for (label, v) in [("latency", &latency), ("service time", &service)] {
        println!(
            "  {label:<15} p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2} ms",
            percentile(v, 0.50),
            percentile(v, 0.90),
            percentile(v, 0.99),
            v.last().copied().unwrap_or(f64::NAN)
        );
    }
    if ok < total {
        bail!("{} of {total} requests were not accepted (202)", total - ok);
    }
    Ok(())
}

/// The `p` quantile of `sorted` (nearest rank); NaN when it is empty.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN)
}

/// One job's times, wall clock (one machine, one clock): for where its latency went.
#[derive(Default)]
struct Stamps {
    /// The submit began.
    submitted: Option<chrono::DateTime<chrono::Utc>>,
    /// The submit was answered (the `requested` event stored).
    answered: Option<chrono::DateTime<chrono::Utc>>,
    /// The view's `started_at` (the worker's `started` event).
    started: Option<chrono::DateTime<chrono::Utc>>,
    /// The view's `finished_at` (the worker's outcome event, made after the stems were stored).
    finished: Option<chrono::DateTime<chrono::Utc>>,
    /// The terminal view reached the benchmark's watch.
    seen: Option<chrono::DateTime<chrono::Utc>>,
}

/// Where the latency went, by stage: p50 and p99 of each over all jobs, and the median
/// of each over the slowest 1 % of jobs (what makes the p99).
fn print_stages(stamps: &HashMap<JobId, Stamps>) {
    const STAGES: [&str; 4] = [
        "submit answered (requested stored)",
        "queued until started (dispatch, checks, started event)",
        "started until outcome (engine, stems stored)",
        "outcome until view seen (publish, projector, KV, watch)",
    ];
    let ms = |a: chrono::DateTime<chrono::Utc>, b: chrono::DateTime<chrono::Utc>| {
        (b - a).num_microseconds().unwrap_or(0) as f64 / 1000.0
    };
    let rows: Vec<[f64; 5]> = stamps
        .values()
        .filter_map(|s| {
            let (sub, ans, st, fin, seen) = (s.submitted?, s.answered?, s.started?, s.finished?, s.seen?);
            Some([ms(sub, ans), ms(sub, st), ms(st, fin), ms(fin, seen), ms(sub, seen)])
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    let pct = |mut v: Vec<f64>, p: f64| {
        v.sort_by(|a, b| a.total_cmp(b));
        percentile(&v, p)
    };
    let mut slow: Vec<&[f64; 5]> = rows.iter().collect();
    slow.sort_by(|a, b| b[4].total_cmp(&a[4]));
    slow.truncate((rows.len() / 100).max(1));
    println!("  stages (ms)     p50 / p99 over all jobs; median of the slowest 1 %");
    for (i, name) in STAGES.iter().enumerate() {
        let all: Vec<f64> = rows.iter().map(|r| r[i]).collect();
        let tail: Vec<f64> = slow.iter().map(|r| r[i]).collect();
        println!("    {:<56} {:>7.2} / {:>7.2}; {:>7.2}", name, pct(all.clone(), 0.5), pct(all, 0.99), pct(tail, 0.5));
    }
}

/// The NATS the pipeline benchmark runs on, when it is its own.
enum Own {
    /// `NATS_URL`'s.
    Nothing,
    /// One server.
    Server(Box<NatsServer>),
    /// Three nodes at R3.
    Cluster(NatsCluster),
}

/// What one benchmark run measured.
struct Figures {
    /// What ran (for the printout).
    name: &'static str,
    /// Cycles (jobs) completed.
    done: usize,
    /// Completed per second, first submit to last completion.
    per_sec: f64,
    /// Latency percentiles, submit → completion, in ms.
    p50: f64,
    p99: f64,
    max: f64,
}

impl Figures {
    /// From when each job was submitted and when it was done (latency: the one minus
    /// the other; rate: done jobs over first submit to last done).
    fn of<K: std::hash::Hash + Eq>(
        name: &'static str,
        t0: Instant,
        submitted: &HashMap<K, Instant>,
        done: &HashMap<K, Instant>,
    ) -> Figures {
        let mut lat: Vec<f64> = submitted
            .iter()
            .filter_map(|(id, s)| done.get(id).map(|d| d.duration_since(*s).as_secs_f64() * 1000.0))
            .collect();
        lat.sort_by(|a, b| a.total_cmp(b));
        let pct = |p: f64| percentile(&lat, p);
        let last = done.values().max().copied().unwrap_or(t0);
        let e2e = last.duration_since(t0).as_secs_f64();
        Figures {
            name,
            done: lat.len(),
            per_sec: lat.len() as f64 / e2e,
            p50: pct(0.50),
            p99: pct(0.99),
            max: lat.last().copied().unwrap_or(f64::NAN),
        }
    }

    fn print(&self) {
        println!("{}", self.name);
        println!("  completed       {}", self.done);
        println!("  end to end      {:.0} per s", self.per_sec);
        println!("  latency p50     {:.2} ms", self.p50);
        println!("  latency p99     {:.2} ms", self.p99);
        println!("  latency max     {:.2} ms", self.max);
    }
}

/// The median of each figure over the rounds, and of each round's ratio to raw
/// JetStream (the ratio of medians would pair figures from different moments).
fn print_rounds(rounds: &[(Figures, Option<Figures>)]) {
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    };
    let list = |v: &[f64], digits: usize| v.iter().map(|x| format!("{x:.digits$}")).collect::<Vec<_>>().join(", ");
    let line = |label: &str, v: Vec<f64>, digits: usize, unit: &str| {
        println!("  {label:<15} {:.digits$}{unit} (rounds: {})", median(v.clone()), list(&v, digits));
    };
    println!("over {} rounds (median)", rounds.len());
    let pick = |f: fn(&Figures) -> f64| rounds.iter().map(|(p, _)| f(p)).collect::<Vec<_>>();
    line("end to end", pick(|f| f.per_sec), 0, " jobs/s");
    line("latency p50", pick(|f| f.p50), 2, " ms");
    line("latency p99", pick(|f| f.p99), 2, " ms");
    let raws: Vec<(&Figures, &Figures)> = rounds.iter().filter_map(|(p, b)| b.as_ref().map(|b| (p, b))).collect();
    if raws.is_empty() {
        return;
    }
    let ratio = |f: fn(&Figures) -> f64| raws.iter().map(|(p, b)| f(p) / f(b)).collect::<Vec<_>>();
    line("raw end to end", raws.iter().map(|(_, b)| b.per_sec).collect(), 0, " per s");
    line("raw p99", raws.iter().map(|(_, b)| b.p99).collect(), 2, " ms");
    line("ratio e2e", ratio(|f| f.per_sec), 3, "×");
    line("ratio p99", ratio(|f| f.p99), 2, "×");
}

/// Raw JetStream cycles on a server of its own (see the module doc).
async fn raw_cycles(Load { jobs, rate, workers, in_flight }: Load) -> Result<Figures> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("nats");
    let server = tokio::task::spawn_blocking(move || NatsServer::start(&dir, 0)).await??;
    let client = server.connect_as(stemq_core::nats_users::OPERATOR, "stemq-bench-raw").await?;
    let js = jetstream::new(client.clone());
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: "RAW_BENCH".into(),
            subjects: vec!["rawbench.req.*".into(), "rawbench.out.*".into()],
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await?;
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("raw".into()),
            filter_subject: "rawbench.req.*".into(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: workers as i64,
            ..Default::default()
        })
        .await?;
    // Completions: the outcomes, seen on a plain subscription.
    let done: Arc<Mutex<HashMap<u64, Instant>>> = Default::default();
    let mut outs = client.subscribe("rawbench.out.*").await?;
    let watcher = {
        let done = done.clone();
        tokio::spawn(async move {
            while let Some(m) = outs.next().await {
                if let Some(n) = m.subject.rsplit('.').next().and_then(|n| n.parse::<u64>().ok()) {
                    done.lock().await.entry(n).or_insert_with(Instant::now);
                }
            }
        })
    };
    // The consumer loops: pull, publish the outcome (acked), ack the request.
    let cycler = {
        let js = js.clone();
        let mut messages = consumer.messages().await?;
        let slots = Arc::new(Semaphore::new(workers));
        tokio::spawn(async move {
            while let Some(Ok(m)) = messages.next().await {
                let Ok(permit) = slots.clone().acquire_owned().await else { break };
                let js = js.clone();
                tokio::spawn(async move {
                    let n = m.subject.rsplit('.').next().unwrap_or("0").to_string();
                    if let Ok(ack) = js.publish(format!("rawbench.out.{n}"), "done".into()).await {
                        let _ = ack.await;
                    }
                    let _ = m.ack().await;
                    drop(permit);
                });
            }
        })
    };
    let submitted: Arc<Mutex<HashMap<u64, Instant>>> = Default::default();
    let sem = Arc::new(Semaphore::new(in_flight));
    let t0 = Instant::now();
    let interval = rate.map(|r| Duration::from_secs_f64(1.0 / r));
    let mut handles = Vec::with_capacity(jobs);
    for i in 0..jobs as u64 {
        if let Some(iv) = interval {
            tokio::time::sleep_until((t0 + iv.mul_f64(i as f64)).into()).await;
        }
        let permit = sem.clone().acquire_owned().await?;
        let (js, submitted) = (js.clone(), submitted.clone());
        handles.push(tokio::spawn(async move {
            let start = Instant::now();
            let body = format!(r#"{{"audio_uri":"bench/{i}.wav","model":"dsp"}}"#);
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Msg-Id", format!("raw-{i}").as_str());
            let ok = match js.publish_with_headers(format!("rawbench.req.{i}"), h, body.into()).await {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            };
            drop(permit);
            if ok {
                submitted.lock().await.insert(i, start);
            }
        }));
    }
    for h in handles {
        h.await?;
    }
    let deadline = Instant::now() + Duration::from_secs(60 + jobs as u64 / 100);
    while done.lock().await.len() < submitted.lock().await.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let figures = Figures::of(
        "raw JetStream cycles (publish, pull, publish outcome, ack)",
        t0,
        &*submitted.lock().await,
        &*done.lock().await,
    );
    cycler.abort();
    watcher.abort();
    drop(server);
    Ok(figures)
}

#[allow(clippy::too_many_arguments)]
async fn pipeline(
    g: &Global,
    server: &ServerSettings,
    jobs: usize,
    rate: Option<f64>,
    workers: usize,
    in_flight: usize,
    store: String,
    isolation: Isolation,
    cluster: bool,
) -> Result<Figures> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("nats");
    let own = if cluster {
        let c = tokio::task::spawn_blocking(move || NatsCluster::start(&dir, 3, Default::default())).await??;
        Own::Cluster(c)
    } else if g.nats_url.is_some() {
        Own::Nothing
    } else {
        Own::Server(Box::new(tokio::task::spawn_blocking(move || NatsServer::start(&dir, 0)).await??))
    };
    let url = match &own {
        Own::Server(s) => s.url(),
        Own::Cluster(c) => c.urls(),
        Own::Nothing => g.nats_url(),
    };
    // Each part as its own user on a server of our own; as the flags say otherwise.
    let auth = |user: &str| -> Result<stemq_core::nats::ConnectAuth> {
        match &own {
            Own::Server(s) => Ok(s.connect_auth(user)?),
            Own::Cluster(c) => Ok(c.connect_auth(user)?),
            Own::Nothing => g.nats_auth(),
        }
    };
    let mut settings = server.settings();
    if cluster {
        settings.replicas = 3;
    }
    use stemq_core::nats_users::{OPERATOR, PROJECTOR, WORKER};
    let client = stemq_core::nats::connect_with(&url, "stemq-bench", &auth(OPERATOR)?).await?;
    let js = jetstream::new(client.clone());
    stemq_core::nats::apply(&js, &settings).await?;
    let kv = js.get_key_value(stemq_core::nats::JOBS_BUCKET).await?;

    let store = match store.as_str() {
        "memory" => Store::memory(),
        "local" => Store::local(&tmp.path().join("store"))?,
        url => Store::open(url).map_err(|e| anyhow::anyhow!("store `{url}`: {e}"))?,
    };
    let stop = CancellationToken::new();
    // Scratch on tmpfs when there is one: the fake engine's stem files otherwise cost
    // more in ext4 inode churn than everything else together.
    let shm = std::path::Path::new("/dev/shm");
    let scratch_root = if shm.is_dir() { tempfile::tempdir_in(shm)? } else { tempfile::tempdir()? };
    let mut wc = stemq_worker::Config::new(store.clone(), scratch_root.path().join("scratch"));
    wc.concurrency = workers;
    wc.deadletter = false;
    let worker_client = stemq_core::nats::connect_with(&url, "stemq-bench-worker", &auth(WORKER)?).await?;
    let projector_client = stemq_core::nats::connect_with(&url, "stemq-bench-projector", &auth(PROJECTOR)?).await?;
    let engine: Arc<dyn stemq_core::engine::Engine> = match isolation {
        Isolation::None => Arc::new(FakeEngine::default()),
        Isolation::Process | Isolation::Shared => {
            let args = ["engine-host", "--engine", "fake"].map(std::ffi::OsString::from).to_vec();
            Arc::new(crate::services::start_isolated(
                isolation,
                std::env::current_exe()?,
                args,
                Duration::from_secs(60),
            )?)
        }
    };
    let w = tokio::spawn(stemq_worker::run(worker_client, engine, wc, stop.clone()));
    let p = tokio::spawn(stemq_projector::run(projector_client, Default::default(), stop.clone()));

    // Terminal times, from a watch on the whole bucket; with the view's own times, where
    // each job's latency went (stages).
    let done: Arc<Mutex<HashMap<JobId, Instant>>> = Default::default();
    let stamps: Arc<Mutex<HashMap<JobId, Stamps>>> = Default::default();
    let watcher = {
        let done = done.clone();
        let stamps = stamps.clone();
        let mut watch = kv.watch_all().await?;
        tokio::spawn(async move {
            while let Some(Ok(e)) = watch.next().await {
                if e.operation != kv::Operation::Put {
                    continue;
                }
                // Only the two fields we need: the measuring must not cost the system much.
                #[derive(serde::Deserialize)]
                struct Slim {
                    job_id: JobId,
                    status: stemq_core::JobStatus,
                    started_at: Option<chrono::DateTime<chrono::Utc>>,
                    finished_at: Option<chrono::DateTime<chrono::Utc>>,
                }
                if let Ok(v) = serde_json::from_slice::<Slim>(&e.value) {
                    if v.status.is_terminal() {
                        let seen = chrono::Utc::now();
                        if let std::collections::hash_map::Entry::Vacant(slot) =
                            done.lock().await.entry(v.job_id.clone())
                        {
                            slot.insert(Instant::now());
                            let mut st = stamps.lock().await;
                            let s = st.entry(v.job_id).or_default();
                            (s.started, s.finished, s.seen) = (v.started_at, v.finished_at, Some(seen));
                        }
                    }
                }
            }
        })
    };

    let run_id = uuid::Uuid::new_v4();
    let submitted: Arc<Mutex<HashMap<JobId, Instant>>> = Default::default();
    let sem = Arc::new(Semaphore::new(in_flight));
    let t0 = Instant::now();
    let mut handles = Vec::with_capacity(jobs);
    let stores = vec![store.base_url().to_string()];
    let interval = rate.map(|r| Duration::from_secs_f64(1.0 / r));
    for i in 0..jobs {
        if let Some(iv) = interval {
            let due = t0 + iv.mul_f64(i as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        let permit = sem.clone().acquire_owned().await?;
        let js = js.clone();
        let submitted = submitted.clone();
        let (store, stores) = (store.clone(), stores.clone());
        let stamps = stamps.clone();
        handles.push(tokio::spawn(async move {
            let uri = store.uri(&format!("{}{run_id}/{i}.wav", stemq_core::uri::uploads_prefix(BENCH_OWNER)));
            let body = format!(r#"{{"audio_uri":"{uri}","model":"dsp"}}"#);
            let start = Instant::now();
            let wall = chrono::Utc::now();
            let r = stemq_ingress::submit::submit(&js, body.as_bytes(), BENCH_OWNER, None, &stores, None).await;
            let answered = chrono::Utc::now();
            drop(permit);
            if let Ok((resp, _)) = r {
                let mut st = stamps.lock().await;
                let s = st.entry(resp.job_id.clone()).or_default();
                (s.submitted, s.answered) = (Some(wall), Some(answered));
                drop(st);
                submitted.lock().await.insert(resp.job_id, start);
                true
            } else {
                false
            }
        }));
    }
    let mut failed_submits = 0;
    for h in handles {
        if !h.await? {
            failed_submits += 1;
        }
    }
    let submit_secs = t0.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(120 + jobs as u64 / 100);
    loop {
        let n = done.lock().await.len();
        if n >= jobs - failed_submits || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let total = t0.elapsed().as_secs_f64();
    let f = Figures::of("stemq pipeline", t0, &*submitted.lock().await, &*done.lock().await);
    println!("stemq bench pipeline");
    println!("  jobs            {jobs} ({} completed, {failed_submits} failed submits)", f.done);
    match rate {
        Some(r) => println!("  mode            steady {r} jobs/s"),
        None => println!("  mode            throughput, {in_flight} submits in flight"),
    }
    println!("  worker loops    {workers}");
    match &own {
        Own::Cluster(_) => println!("  nats            3-node cluster, R{}", settings.replicas),
        Own::Server(_) => println!("  nats            1 server, R{}", settings.replicas),
        Own::Nothing => println!("  nats            {url}, R{}", settings.replicas),
    }
    println!("  submit rate     {:.0} jobs/s", jobs as f64 / submit_secs);
    println!("  end to end      {:.0} jobs/s ({:.2} s)", f.per_sec, f.done as f64 / f.per_sec);
    println!("  latency p50     {:.2} ms", f.p50);
    println!("  latency p99     {:.2} ms", f.p99);
    println!("  latency max     {:.2} ms", f.max);
    // What each job cost the server in stored messages: events in the log, and
    // revisions of the status view (how well the projector coalesced a job's events).
    let stored = |name: String| {
        let js = js.clone();
        async move { js.get_stream(name).await.ok().map(|s| s.cached_info().state.last_sequence) }
    };
    let (events, writes) = (
        stored(stemq_core::nats::JOBS_STREAM.to_string()).await,
        stored(format!("KV_{}", stemq_core::nats::JOBS_BUCKET)).await,
    );
    if let (Some(events), Some(writes)) = (events, writes) {
        let per_job = |n: u64| n as f64 / f.done.max(1) as f64;
        println!("  per job         {:.2} log events, {:.2} view writes", per_job(events), per_job(writes));
    }
    print_stages(&*stamps.lock().await);
    let _ = total;
    stop.cancel();
    watcher.abort();
    let _ = w.await;
    let _ = p.await;
    if f.done < jobs - failed_submits {
        bail!("only {} of {} jobs finished", f.done, jobs);
    }
    Ok(f)
}
