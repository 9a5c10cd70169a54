//! Storing an attempt's stems and its manifest in the object store.
//!
//! This module owns the layout of a job's outputs: each stem at `jobs/<id>/<stem>.<ext>`,
//! then `jobs/<id>/manifest.json` describing them, written last so that its presence
//! means every stem is there. A store error is a transient failure (`storage`): the
//! next attempt writes everything again.

use serde_json::json;
use stemq_core::device::Device;
use stemq_core::engine::StemFile;
use stemq_core::event::{FailureCode, Output, Requested};
use stemq_core::storage::output_key;
use stemq_core::JobId;

use crate::job::Failure;
use crate::Shared;

/// Stores the stems, then `jobs/<id>/manifest.json` describing them (the manifest last,
/// so its presence means every stem is there).
pub(crate) async fn store_outputs(
    shared: &Shared,
    job_id: &JobId,
    requested: &Requested,
    stems: &[StemFile],
    device: &Device,
    degraded: bool,
) -> Result<(Vec<Output>, String), Failure> {
    let store = &shared.config.store;
    let ext = requested.request.output_format.extension();
    let mut outputs = Vec::with_capacity(stems.len());
    let mut entries = Vec::with_capacity(stems.len());
    for s in stems {
        let file = format!("{}.{ext}", s.stem);
        let key = output_key(job_id.as_str(), &file);
        let stored =
            store.put_file(&key, &s.path).await.map_err(|e| Failure::transient(FailureCode::Storage, e.to_string()))?;
        let mut entry = json!({
            "stem": s.stem, "file": file, "uri": stored.uri, "bytes": stored.bytes, "sha256": stored.sha256,
        });
        if let Some(a) = s.audio {
            entry["sample_rate"] = json!(a.sample_rate);
            entry["frames"] = json!(a.frames);
            entry["duration_secs"] = json!(a.frames as f64 / f64::from(a.sample_rate.max(1)));
        }
        entries.push(entry);
        outputs.push(Output { stem: s.stem.clone(), uri: stored.uri, bytes: stored.bytes, sha256: stored.sha256 });
    }
    let first_audio = stems.iter().find_map(|s| s.audio);
    let mut manifest = json!({
        "manifest_version": 1,
        "job_id": job_id,
        "model": requested.request.model,
        "format": ext,
        "sample_rate": first_audio.map(|a| a.sample_rate),
        "duration_secs": first_audio.map(|a| a.frames as f64 / f64::from(a.sample_rate.max(1))),
        "device": device.to_string(),
        "degraded": degraded,
        "stems": entries,
    });
    // How MP3 stems were encoded (only for MP3, so other manifests are as they were).
    if let (Some(bitrate), Some(preset)) = (requested.request.mp3_bitrate, requested.request.mp3_preset) {
        manifest["mp3_bitrate"] = json!(bitrate);
        manifest["mp3_preset"] = json!(preset);
    }
    let key = stemq_core::storage::manifest_key(job_id.as_str());
    let stored = store
        .put_bytes(&key, serde_json::to_vec_pretty(&manifest).expect("json"))
        .await
        .map_err(|e| Failure::transient(FailureCode::Storage, e.to_string()))?;
    Ok((outputs, stored.uri))
}
