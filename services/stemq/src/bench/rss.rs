//! `stemq bench rss`: the peak RSS of a `stemq worker` process separating songs of
//! several lengths.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use async_nats::jetstream;
use stemq_storage::Store;
use tokio_util::sync::CancellationToken;

use super::{own_server, BENCH_OWNER};

fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// Runs each song length through a fresh worker process and reports its peak RSS.
pub(super) async fn rss(settings: &stemq_nats::Settings, minutes: &[f64]) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let server = own_server(&tmp.path().join("nats")).await?;
    let client = server.connect_as(stemq_nats::users::OPERATOR, "stemq-bench").await?;
    let js = jetstream::new(client.clone());
    stemq_nats::apply(&js, settings).await?;
    let kv = js.get_key_value(stemq_nats::JOBS_BUCKET).await?;
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
            .env("STEMQ_NATS_CREDS", server.credentials(stemq_nats::users::WORKER))
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
            if let Some((v, _)) = stemq_nats::read::get_view(&kv, &resp.job_id).await? {
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
