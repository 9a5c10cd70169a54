//! `stemq bench http`: submits offered at a fixed rate to a running ingress.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use tokio::sync::Semaphore;

use super::figures::percentile;
use crate::global::Global;

/// The load of `bench http`.
#[derive(Debug, Clone, clap::Args)]
pub struct HttpLoad {
    /// The ingress (`--api URL`, required) and the key (a `submit` key of `--owner`,
    /// or an operator's).
    #[command(flatten)]
    pub api: crate::global::ApiArgs,
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
    /// The HTTP statuses that count as answers as expected, separated by commas: any
    /// other fails the run. `202,429` measures a key whose limits refuse part of the load.
    #[arg(long, value_delimiter = ',', default_value = "202")]
    pub accept: Vec<u16>,
}

/// `bench http`: see [`BenchCommand::Http`].
pub(super) async fn http(g: &Global, load: HttpLoad) -> Result<()> {
    let HttpLoad { api, rate, seconds, connections, store_base, owner, accept } = load;
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
    let ok: usize = accept.iter().map(|c| statuses.get(&Some(*c)).copied().unwrap_or(0)).sum();
    println!("stemq bench http");
    println!("  offered         {total} requests at {rate:.0}/s over {seconds} s, {connections} connections");
    let elapsed = last.duration_since(t0).as_secs_f64();
    println!("  answered        {:.0} requests/s ({elapsed:.2} s)", total as f64 / elapsed);
    let accepted = statuses.get(&Some(202)).copied().unwrap_or(0);
    println!("  accepted (202)  {:.0} requests/s", accepted as f64 / elapsed);
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
        let expected: Vec<String> = accept.iter().map(u16::to_string).collect();
        bail!("{} of {total} requests were not accepted (answered with none of {})", total - ok, expected.join(", "));
    }
    Ok(())
}
