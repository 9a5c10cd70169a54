//! `stemq top`: a live terminal view of the system, fed by NATS alone.
//!
//! This module owns the operator's at-a-glance view: the live workers (from the worker
//! registry: what each serves, its devices, jobs running, heartbeat age, free memory),
//! per pool and lane the jobs waiting and running (the pool consumers), with a mark on
//! every pool whose jobs wait for a worker nobody runs, the total queue and the age of
//! the oldest unfinished request, projector lag, running jobs with their progress, recent
//! failures, and throughput (terminal jobs per second over the last refresh). No
//! Prometheus needed: consumer info, the registry and a watch on the KV status bucket
//! are enough (the same figures the queue exporter reads: `stemq_nats::queue_figures::read_queue`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use async_nats::jetstream;
use chrono::{DateTime, Utc};
use stemq_core::request::{Model, Priority};
use stemq_core::{JobStatus, JobView};
use stemq_nats as names;
use stemq_nats::queue_figures::QueueFigures;
use stemq_nats::read::ListIndex;
use stemq_nats::registry::{self, WorkerInfo};
use tokio_util::sync::CancellationToken;

use crate::global::Global;

/// One screen of figures.
struct Screen {
    queue: QueueFigures,
    running: Vec<JobView>,
    failures: Vec<JobView>,
    counts: Vec<(JobStatus, usize)>,
    per_sec: f64,
}

fn bar(pct: f32) -> String {
    let filled = ((pct / 100.0) * 20.0).round().clamp(0.0, 20.0) as usize;
    format!("[{}{}] {:>3.0}%", "#".repeat(filled), ".".repeat(20 - filled), pct)
}

/// Bytes as GiB with one decimal.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The workers and the pools: one line per live worker, then one line per model with
/// each lane's pending/running counts, marking a pool whose jobs wait for a worker.
fn render_fleet(q: &QueueFigures, now: DateTime<Utc>) -> String {
    let mut out = String::new();
    match &q.workers {
        None => out.push_str("workers: the worker registry is not readable\n"),
        Some(workers) => {
            out.push_str(&format!("workers ({}):\n", workers.len()));
            if !workers.is_empty() {
                out.push_str(&format!(
                    "  {:<24} {:<36} {:<16} {:>7}  {:>9}  {:>10}\n",
                    "NAME", "MODELS", "DEVICES", "RUNNING", "HEARTBEAT", "FREE MEM"
                ));
            }
            for w in workers {
                out.push_str(&worker_line(w, now));
            }
        }
    }
    out.push_str(&format!(
        "\npools:\n  {:<12} {:>7}  {:>20}  {:>20}\n",
        "MODEL", "WORKERS", "INTERACTIVE pend/run", "BATCH pend/run"
    ));
    for model in Model::ALL.iter().copied() {
        let lane = |l: Priority| {
            q.lanes
                .iter()
                .find(|f| f.model == model && f.lane == l)
                .map(|f| format!("{}/{}", f.queue.pending, f.queue.in_flight))
                .unwrap_or_else(|| "?".into())
        };
        let workers = q.serving(model).map(|n| n.to_string()).unwrap_or_else(|| "?".into());
        let waiting = match (q.pending(model), &q.workers) {
            (n, Some(live)) if n > 0 => registry::waiting_reason(live, model).map(|r| format!("  <- {r}")),
            _ => None,
        };
        out.push_str(&format!(
            "  {:<12} {:>7}  {:>20}  {:>20}{}\n",
            model.as_str(),
            workers,
            lane(Priority::Interactive),
            lane(Priority::Batch),
            waiting.unwrap_or_default()
        ));
    }
    if let Some(u) = q.unrouted.filter(|u| u.pending + u.in_flight > 0) {
        out.push_str(&format!(
            "  unrouted requests of earlier releases (consumer workers): {}/{} (the ingress's router moves them)\n",
            u.pending, u.in_flight
        ));
    }
    out
}

fn worker_line(w: &WorkerInfo, now: DateTime<Utc>) -> String {
    let models: Vec<&str> = w.models.iter().map(|m| m.as_str()).collect();
    let age = now.signed_duration_since(w.heartbeat_at).num_milliseconds().max(0) as f64 / 1000.0;
    format!(
        "  {:<24} {:<36} {:<16} {:>7}  {:>7.0} s  {:>10}\n",
        w.name,
        models.join(","),
        w.devices.join(","),
        format!("{}/{}", w.running, w.concurrency),
        age,
        w.free_memory_bytes.map(gib).unwrap_or_else(|| "?".into())
    )
}

fn render(s: &Screen, url: &str) -> String {
    let mut out = String::new();
    let now = Utc::now();
    out.push_str(&format!("stemq top — {url} — {}\n\n", now.format("%H:%M:%S")));
    let q = &s.queue;
    let pending = q.lanes.iter().map(|l| l.queue.pending).sum::<u64>() + q.unrouted.map_or(0, |u| u.pending);
    let in_flight = q.lanes.iter().map(|l| l.queue.in_flight).sum::<u64>() + q.unrouted.map_or(0, |u| u.in_flight);
    out.push_str(&format!(
        "queue: {pending} pending, {in_flight} in flight, oldest {:.0} s   projector lag: {} events   throughput: {:.1} jobs/s\n",
        q.oldest_pending_age.as_secs_f64(),
        q.projector_lag.unwrap_or(0),
        s.per_sec
    ));
    let counts: Vec<String> = s.counts.iter().map(|(k, n)| format!("{} {n}", k.as_str())).collect();
    out.push_str(&format!("jobs:  {}\n\n", counts.join("  ")));
    out.push_str(&render_fleet(q, now));
    out.push('\n');
    out.push_str(&format!("running ({}):\n", s.running.len()));
    for v in s.running.iter().take(15) {
        let p = v.progress.as_ref().map(|p| p.percent).unwrap_or(0.0);
        let stage = v.progress.as_ref().map(|p| p.stage.as_str()).unwrap_or("");
        out.push_str(&format!(
            "  {}  {}  attempt {}  {:<10} {}  on {}\n",
            &v.job_id.as_str()[..12],
            bar(p),
            v.attempt,
            stage,
            v.device.as_deref().unwrap_or("?"),
            v.worker.as_deref().unwrap_or("?")
        ));
    }
    out.push_str("\nrecent failures:\n");
    for v in &s.failures {
        let e = v.error.as_ref().map(|e| format!("{}: {}", e.code, e.message)).unwrap_or_default();
        let e: String = e.chars().take(90).collect();
        out.push_str(&format!("  {}  {:<13} {e}\n", &v.job_id.as_str()[..12], v.status.as_str()));
    }
    out
}

async fn snapshot(
    js: &jetstream::Context,
    kv: &jetstream::kv::Store,
    index: &ListIndex,
    last: &mut Option<(Instant, usize)>,
) -> Result<Screen> {
    let queue = stemq_nats::queue_figures::read_queue(js).await;
    let mut running = Vec::new();
    for (id, _) in index.page(Some(JobStatus::Running), 50, None) {
        if let Some((v, _)) = stemq_nats::read::get_view(kv, &id).await? {
            running.push(v);
        }
    }
    let mut failures = Vec::new();
    for status in [JobStatus::Failed, JobStatus::DeadLettered] {
        for (id, _) in index.page(Some(status), 5, None) {
            if let Some((v, _)) = stemq_nats::read::get_view(kv, &id).await? {
                failures.push(v);
            }
        }
    }
    failures.sort_by_key(|f| std::cmp::Reverse(f.updated_at));
    failures.truncate(5);
    let counts_map = index.counts();
    let mut counts: Vec<(JobStatus, usize)> = counts_map.iter().map(|(k, v)| (*k, *v)).collect();
    counts.sort_by_key(|(k, _)| k.as_str());
    let terminal: usize = counts.iter().filter(|(k, _)| k.is_terminal()).map(|(_, v)| *v).sum();
    let now = Instant::now();
    let per_sec = match last {
        Some((t, n)) => (terminal.saturating_sub(*n)) as f64 / now.duration_since(*t).as_secs_f64().max(1e-3),
        None => 0.0,
    };
    *last = Some((now, terminal));
    Ok(Screen { queue, running, failures, counts, per_sec })
}

/// Runs the view until Ctrl-C (or prints one screen with `once`).
pub async fn run(g: &Global, interval: Duration, once: bool) -> Result<()> {
    let client = g.connect("stemq-top").await?;
    let js = jetstream::new(client);
    let kv = js.get_key_value(names::JOBS_BUCKET).await.context("the status bucket is missing")?;
    let stop = CancellationToken::new();
    let index = ListIndex::follow(kv.clone(), stop.clone()).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !index.caught_up() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut last = None;
    let shutdown = crate::global::shutdown_on_signals();
    loop {
        let screen = snapshot(&js, &kv, &index, &mut last).await?;
        let text = render(&screen, &g.nats_url());
        if once {
            print!("{text}");
            break;
        }
        // Clear the screen and draw from the top-left corner.
        print!("\x1b[2J\x1b[H{text}");
        use std::io::Write;
        std::io::stdout().flush().ok();
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(interval) => {}
        }
    }
    stop.cancel();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stemq_nats::queue_figures::{ConsumerFigures, LaneFigures};

    fn worker(name: &str, models: &[Model], age_s: i64, now: DateTime<Utc>) -> WorkerInfo {
        WorkerInfo {
            name: name.into(),
            models: models.to_vec(),
            devices: vec!["cuda:0".into(), "cpu".into()],
            engine: "demucs".into(),
            version: "0.1.0".into(),
            concurrency: 2,
            running: 1,
            free_memory_bytes: Some(3 << 30),
            gpu_free_memory_bytes: Default::default(),
            started_at: now,
            heartbeat_at: now - chrono::Duration::seconds(age_s),
        }
    }

    /// Issue 12: `stemq top` lists each worker with what it serves and, per pool and
    /// lane, pending/running, and marks the pool whose jobs wait for a worker nobody runs.
    #[test]
    fn the_fleet_shows_workers_and_marks_pools_nobody_serves() {
        let now = Utc::now();
        let lane = |model, lane, pending, in_flight| LaneFigures {
            model,
            lane,
            queue: ConsumerFigures { pending, in_flight },
        };
        let q = QueueFigures {
            lanes: Model::ALL
                .iter()
                .flat_map(|m| Priority::ALL.iter().map(move |l| (*m, *l)))
                .map(|(m, l)| match (m, l) {
                    (Model::Htdemucs, Priority::Interactive) => lane(m, l, 4, 1),
                    (Model::Htdemucs6s, Priority::Batch) => lane(m, l, 2, 0),
                    _ => lane(m, l, 0, 0),
                })
                .collect(),
            workers: Some(vec![
                worker("gpu-7-1234", &[Model::Htdemucs, Model::HtdemucsFt], 3, now),
                // A worker on a Vulkan GPU (an AMD card, say), in the same pool.
                WorkerInfo {
                    devices: vec!["vulkan:1".into(), "cpu".into()],
                    ..worker("amd-3-99", &[Model::Htdemucs], 1, now)
                },
            ]),
            ..Default::default()
        };
        let text = render_fleet(&q, now);
        let line = |prefix: &str| text.lines().find(|l| l.trim_start().starts_with(prefix)).unwrap_or("").to_string();
        let w = line("gpu-7-1234");
        for part in ["htdemucs,htdemucs_ft", "cuda:0,cpu", "1/2", "3 s", "3.0 GiB"] {
            assert!(w.contains(part), "{part} missing in {w:?}\n{text}");
        }
        assert!(line("amd-3-99").contains("vulkan:1,cpu"), "{text}");
        let served = line("htdemucs ");
        assert!(served.contains("4/1") && !served.contains("waiting"), "{served:?}\n{text}");
        let unserved = line("htdemucs_6s");
        assert!(unserved.contains("2/0"), "{unserved:?}");
        assert!(unserved.contains("waiting for a worker that serves htdemucs_6s"), "{unserved:?}");
        // Nothing waits for dsp: no mark, though nobody serves it.
        assert!(!line("dsp").contains("waiting"), "{text}");
        // Without the registry top says so rather than guessing.
        let blind = render_fleet(&QueueFigures { workers: None, ..q }, now);
        assert!(blind.contains("not readable") && !blind.contains("waiting for a worker"), "{blind}");
    }
}
