//! `stemq top`: a live terminal view of the system, fed by NATS alone.
//!
//! This module owns the operator's at-a-glance view: queue depth and in-flight jobs of
//! the worker consumer, the age of the oldest unfinished request, projector lag, running
//! jobs with their progress, recent failures, and throughput (terminal jobs per second
//! over the last refresh). No Prometheus needed: consumer info and a watch on the KV
//! status bucket are enough.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use async_nats::jetstream;
use stemq_core::nats as names;
use stemq_core::read::ListIndex;
use stemq_core::{JobStatus, JobView};
use tokio_util::sync::CancellationToken;

use crate::global::Global;

/// One screen of figures.
struct Screen {
    pending: u64,
    in_flight: usize,
    oldest_s: f64,
    lag: u64,
    running: Vec<JobView>,
    failures: Vec<JobView>,
    counts: Vec<(JobStatus, usize)>,
    per_sec: f64,
}

fn bar(pct: f32) -> String {
    let filled = ((pct / 100.0) * 20.0).round().clamp(0.0, 20.0) as usize;
    format!("[{}{}] {:>3.0}%", "#".repeat(filled), ".".repeat(20 - filled), pct)
}

fn render(s: &Screen, url: &str) -> String {
    let mut out = String::new();
    out.push_str(&format!("stemq top — {url} — {}\n\n", chrono::Utc::now().format("%H:%M:%S")));
    out.push_str(&format!(
        "queue: {} pending, {} in flight, oldest {:.0} s   projector lag: {} events   throughput: {:.1} jobs/s\n",
        s.pending, s.in_flight, s.oldest_s, s.lag, s.per_sec
    ));
    let counts: Vec<String> = s.counts.iter().map(|(k, n)| format!("{} {n}", k.as_str())).collect();
    out.push_str(&format!("jobs:  {}\n\n", counts.join("  ")));
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
    let queue = stemq_core::metrics::read_queue(js).await;
    let workers = queue.workers.unwrap_or_default();
    let (pending, in_flight) = (workers.pending, workers.in_flight as usize);
    let oldest_s = queue.oldest_pending_age.as_secs_f64();
    let lag = queue.projector_lag.unwrap_or(0);
    let mut running = Vec::new();
    for (id, _) in index.page(Some(JobStatus::Running), 50, None) {
        if let Some((v, _)) = stemq_core::read::get_view(kv, &id).await? {
            running.push(v);
        }
    }
    let mut failures = Vec::new();
    for status in [JobStatus::Failed, JobStatus::DeadLettered] {
        for (id, _) in index.page(Some(status), 5, None) {
            if let Some((v, _)) = stemq_core::read::get_view(kv, &id).await? {
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
    Ok(Screen { pending, in_flight, oldest_s, lag, running, failures, counts, per_sec })
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
