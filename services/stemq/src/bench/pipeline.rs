//! `stemq bench pipeline`: end-to-end throughput and latency with the fake engine, and
//! where each job's latency went.
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
use futures::StreamExt;
use stemq_core::engine::FakeEngine;
use stemq_core::JobId;
use stemq_devkit::nats_cluster::NatsCluster;
use stemq_devkit::nats_server::NatsServer;
use stemq_storage::Store;
use tokio::sync::{Mutex, Semaphore};
use tokio_util::sync::CancellationToken;

use super::figures::{percentile, Counter, Figures, Messages};
use super::{own_server, Load, BENCH_OWNER};
use crate::global::{Global, ServerSettings};
use crate::services::Isolation;

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

pub(super) async fn pipeline(
    g: &Global,
    server: &ServerSettings,
    load: Load,
    store: String,
    isolation: Isolation,
    cluster: bool,
) -> Result<Figures> {
    let Load { jobs, rate, workers, in_flight } = load;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("nats");
    let own = if cluster {
        Own::Cluster(NatsCluster::start_async(dir, 3, Default::default()).await?)
    } else if g.nats_url.is_some() {
        Own::Nothing
    } else {
        Own::Server(Box::new(own_server(&dir).await?))
    };
    let url = match &own {
        Own::Server(s) => s.url(),
        Own::Cluster(c) => c.urls(),
        Own::Nothing => g.nats_url(),
    };
    // Each part as its own user on a server of our own; as the flags say otherwise.
    let auth = |user: &str| -> Result<stemq_nats::ConnectAuth> {
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
    use stemq_nats::users::{OPERATOR, PROJECTOR, WORKER};
    let client = stemq_nats::connect_with(&url, "stemq-bench", &auth(OPERATOR)?).await?;
    let js = jetstream::new(client.clone());
    stemq_nats::apply(&js, &settings).await?;

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
    let worker_client = stemq_nats::connect_with(&url, "stemq-bench-worker", &auth(WORKER)?).await?;
    let projector_client = stemq_nats::connect_with(&url, "stemq-bench-projector", &auth(PROJECTOR)?).await?;
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
    // The terminal views' watch on a connection of its own, so that what the pipeline
    // exchanges is counted apart from what the benchmark's watching costs.
    let watch_client = stemq_nats::connect_with(&url, "stemq-bench-watch", &auth(OPERATOR)?).await?;
    let watch_kv = jetstream::new(watch_client.clone()).get_key_value(stemq_nats::JOBS_BUCKET).await?;
    let counters = [
        Counter::start("submit", &client),
        Counter::start("worker", &worker_client),
        Counter::start("projector", &projector_client),
        Counter::start("watch", &watch_client),
    ];
    let w = tokio::spawn(stemq_worker::run(worker_client, engine, wc, stop.clone()));
    let p = tokio::spawn(stemq_projector::run(projector_client, Default::default(), stop.clone()));

    // Terminal times, from a watch on the whole bucket; with the view's own times, where
    // each job's latency went (stages).
    let done: Arc<Mutex<HashMap<JobId, Instant>>> = Default::default();
    let stamps: Arc<Mutex<HashMap<JobId, Stamps>>> = Default::default();
    let watcher = {
        let done = done.clone();
        let stamps = stamps.clone();
        let mut watch = watch_kv.watch_all().await?;
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
    let mut f = Figures::of("stemq pipeline", t0, &*submitted.lock().await, &*done.lock().await);
    let messages = Messages::of(&counters, f.done);
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
    // In + out of each part's connection; `watch` is this benchmark's own watch of the
    // views, the cost of a client following every job.
    println!("  messages a job  {}", messages.describe());
    f.messages = Some(messages);
    // What each job cost the server in stored messages: events in the log, and
    // revisions of the status view (how well the projector coalesced a job's events).
    let stored = |name: String| {
        let js = js.clone();
        async move { js.get_stream(name).await.ok().map(|s| s.cached_info().state.last_sequence) }
    };
    let (events, writes) =
        (stored(stemq_nats::JOBS_STREAM.to_string()).await, stored(format!("KV_{}", stemq_nats::JOBS_BUCKET)).await);
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
