//! What the benchmarks measure and print alike: percentiles, one run's figures, the
//! median over rounds.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// The `p` quantile of `sorted` (nearest rank); NaN when it is empty.
pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN)
}

/// What one benchmark run measured.
pub(super) struct Figures {
    /// What ran (for the printout).
    pub(super) name: &'static str,
    /// Cycles (jobs) completed.
    pub(super) done: usize,
    /// Completed per second, first submit to last completion.
    pub(super) per_sec: f64,
    /// Latency percentiles, submit → completion, in ms.
    pub(super) p50: f64,
    pub(super) p99: f64,
    pub(super) max: f64,
    /// NATS messages a job, by part ([`Messages`]).
    pub(super) messages: Option<Messages>,
}

/// The NATS messages one part of a benchmark exchanged, counted by its own connection's
/// client: messages it published and messages delivered to it (requests and replies
/// included; the servers' replication among themselves is not in it).
pub(super) struct Counter {
    part: &'static str,
    stats: Arc<async_nats::Statistics>,
    at_start: u64,
}

impl Counter {
    /// Counts from now on what `client` exchanges, as `part`.
    pub(super) fn start(part: &'static str, client: &async_nats::Client) -> Counter {
        let stats = client.statistics();
        let at_start = Counter::total(&stats);
        Counter { part, stats, at_start }
    }

    fn total(stats: &async_nats::Statistics) -> u64 {
        stats.in_messages.load(Ordering::Relaxed) + stats.out_messages.load(Ordering::Relaxed)
    }

    fn since_start(&self) -> u64 {
        Counter::total(&self.stats) - self.at_start
    }
}

/// NATS messages a completed job cost, in all and by part (in + out of each part's
/// connection).
pub(super) struct Messages {
    pub(super) per_job: f64,
    pub(super) by_part: Vec<(&'static str, f64)>,
}

impl Messages {
    /// What `parts` exchanged since they started counting, over `jobs` completed jobs.
    pub(super) fn of(parts: &[Counter], jobs: usize) -> Messages {
        let per = |n: u64| n as f64 / jobs.max(1) as f64;
        let by_part: Vec<(&'static str, f64)> = parts.iter().map(|c| (c.part, per(c.since_start()))).collect();
        Messages { per_job: by_part.iter().map(|(_, n)| n).sum(), by_part }
    }

    /// `20.61 (submit 2.00, worker 9.10, ...)`.
    pub(super) fn describe(&self) -> String {
        let parts: Vec<String> = self.by_part.iter().map(|(p, n)| format!("{p} {n:.2}")).collect();
        format!("{:.2} ({})", self.per_job, parts.join(", "))
    }
}

impl Figures {
    /// From when each job was submitted and when it was done (latency: the one minus
    /// the other; rate: done jobs over first submit to last done).
    pub(super) fn of<K: std::hash::Hash + Eq>(
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
            messages: None,
        }
    }

    pub(super) fn print(&self) {
        println!("{}", self.name);
        println!("  completed       {}", self.done);
        println!("  end to end      {:.0} per s", self.per_sec);
        println!("  latency p50     {:.2} ms", self.p50);
        println!("  latency p99     {:.2} ms", self.p99);
        println!("  latency max     {:.2} ms", self.max);
        if let Some(m) = &self.messages {
            println!("  messages a job  {}", m.describe());
        }
    }
}

/// The median of each figure over the rounds, and of each round's ratio to raw
/// JetStream (the ratio of medians would pair figures from different moments).
pub(super) fn print_rounds(rounds: &[(Figures, Option<Figures>)]) {
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
    let messages = |f: &Figures| f.messages.as_ref().map_or(f64::NAN, |m| m.per_job);
    line("messages a job", rounds.iter().map(|(p, _)| messages(p)).collect(), 2, "");
    let raws: Vec<(&Figures, &Figures)> = rounds.iter().filter_map(|(p, b)| b.as_ref().map(|b| (p, b))).collect();
    if raws.is_empty() {
        return;
    }
    let ratio = |f: fn(&Figures) -> f64| raws.iter().map(|(p, b)| f(p) / f(b)).collect::<Vec<_>>();
    line("raw end to end", raws.iter().map(|(_, b)| b.per_sec).collect(), 0, " per s");
    line("raw p99", raws.iter().map(|(_, b)| b.p99).collect(), 2, " ms");
    line("raw messages", raws.iter().map(|(_, b)| messages(b)).collect(), 2, " a cycle");
    line("ratio e2e", ratio(|f| f.per_sec), 3, "×");
    line("ratio p99", ratio(|f| f.p99), 2, "×");
}
