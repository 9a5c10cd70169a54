//! GPU memory in use, sampled for the `stemq_gpu_memory_used_bytes` gauge.
//!
//! This module owns the one GPU figure a worker exports. It asks the driver's own tool
//! (`nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits`, present
//! wherever the NVIDIA driver is) every few seconds, so the figure covers every process
//! on the device (engine hosts included), not only what this process allocated. A worker
//! without a CUDA device does not sample; a probe that fails is logged once and the
//! sampling stops (the gauge then simply has no series).

use std::path::PathBuf;
use std::time::Duration;

use crate::metrics::{metrics, DeviceLabels};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Parses the probe's CSV (`index, MiB` per line) into `(cuda:<index>, bytes)`.
pub fn parse(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|line| {
            let (index, mib) = line.split_once(',')?;
            let index: u32 = index.trim().parse().ok()?;
            let mib: u64 = mib.trim().parse().ok()?;
            Some((format!("cuda:{index}"), mib * 1024 * 1024))
        })
        .collect()
}

/// Runs the probe once and sets the gauge; returns what it read.
pub async fn sample(probe: &PathBuf) -> std::io::Result<Vec<(String, u64)>> {
    let out = tokio::process::Command::new(probe)
        .args(["--query-gpu=index,memory.used", "--format=csv,noheader,nounits"])
        .kill_on_drop(true)
        .output()
        .await?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!("{} exited with {}", probe.display(), out.status)));
    }
    let read = parse(&String::from_utf8_lossy(&out.stdout));
    for (device, bytes) in &read {
        metrics().gpu_memory.get_or_create(&DeviceLabels { device: device.clone() }).set(*bytes as i64);
    }
    Ok(read)
}

/// Free memory of each device now (`memory.free`), for the worker registry; `None` when
/// the probe cannot say.
pub async fn free(probe: &PathBuf) -> Option<Vec<(String, u64)>> {
    let out = tokio::process::Command::new(probe)
        .args(["--query-gpu=index,memory.free", "--format=csv,noheader,nounits"])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(10), out).await.ok()?.ok()?;
    out.status.success().then(|| parse(&String::from_utf8_lossy(&out.stdout)))
}

/// Samples every `every` until `stop`, or until the probe fails.
pub async fn run(probe: PathBuf, every: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match tokio::time::timeout(Duration::from_secs(10), sample(&probe)).await {
            Ok(Ok(read)) => debug!(devices = read.len(), "GPU memory sampled"),
            Ok(Err(e)) => {
                warn!(probe = %probe.display(), error = %e, "cannot read GPU memory; not sampling it");
                return;
            }
            Err(_) => warn!(probe = %probe.display(), "GPU memory probe timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_probe_output() {
        assert_eq!(
            parse("0, 1024\n1, 0\nnot a line\n"),
            vec![("cuda:0".to_string(), 1 << 30), ("cuda:1".to_string(), 0)]
        );
    }

    #[tokio::test]
    async fn a_probe_sets_the_gauge() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let probe = dir.path().join("nvidia-smi");
        std::fs::write(&probe, "#!/bin/sh\necho '0, 2048'\necho '3, 512'\n").unwrap();
        std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let read = sample(&probe).await.unwrap();
        assert_eq!(read, vec![("cuda:0".to_string(), 2048 << 20), ("cuda:3".to_string(), 512 << 20)]);
        let text = stemq_telemetry::metrics::metrics().render();
        assert!(text.contains(r#"stemq_gpu_memory_used_bytes{device="cuda:3"} 536870912"#), "{text}");
        let missing = dir.path().join("absent");
        assert!(sample(&missing).await.is_err());
        assert_eq!(free(&probe).await.unwrap()[0], ("cuda:0".to_string(), 2048 << 20));
        assert_eq!(free(&missing).await, None);
    }
}
