//! Storing an attempt's stems and its manifest in the object store.
//!
//! This module owns the layout of a job's outputs: each stem at `jobs/<id>/<stem>.<ext>`,
//! then `jobs/<id>/manifest.json` describing them, written last so that its presence
//! means every stem is there. A store error is a transient failure (`storage`): the
//! next attempt writes everything again. Stems come as files the engine wrote in the
//! attempt's scratch folder, or as bytes an engine kept in memory ([`Stems`]).

use serde_json::json;
use stemq_core::device::Device;
use stemq_core::engine::{StemAudio, StemBytes, StemFile};
use stemq_core::event::{FailureCode, Output, Requested};
use stemq_core::storage::output_key;
use stemq_core::JobId;

use crate::job::Failure;
use crate::Shared;

/// What an attempt's engine produced.
pub(crate) enum Stems {
    /// Files in the attempt's output folder ([`stemq_core::engine::Engine::separate`]).
    Files(Vec<StemFile>),
    /// Bytes ([`stemq_core::engine::Engine::separate_in_memory`]).
    Memory(Vec<StemBytes>),
}

impl Stems {
    pub(crate) fn len(&self) -> usize {
        match self {
            Stems::Files(f) => f.len(),
            Stems::Memory(m) => m.len(),
        }
    }

    /// Each stem's name, audio facts and content.
    fn into_parts(self) -> Vec<(String, Option<StemAudio>, Content)> {
        match self {
            Stems::Files(f) => f.into_iter().map(|s| (s.stem, s.audio, Content::File(s.path))).collect(),
            Stems::Memory(m) => m.into_iter().map(|s| (s.stem, s.audio, Content::Bytes(s.bytes))).collect(),
        }
    }

    /// The audio facts of the first stem that has them.
    pub(crate) fn first_audio(&self) -> Option<StemAudio> {
        match self {
            Stems::Files(f) => f.iter().find_map(|s| s.audio),
            Stems::Memory(m) => m.iter().find_map(|s| s.audio),
        }
    }
}

/// Where one stem's content is.
enum Content {
    File(std::path::PathBuf),
    Bytes(Vec<u8>),
}

/// Stores the stems, then `jobs/<id>/manifest.json` describing them (the manifest last,
/// so its presence means every stem is there).
pub(crate) async fn store_outputs(
    shared: &Shared,
    job_id: &JobId,
    requested: &Requested,
    stems: Stems,
    device: &Device,
    degraded: bool,
) -> Result<(Vec<Output>, String), Failure> {
    let store = &shared.config.store;
    let ext = requested.request.output_format.extension();
    let first_audio = stems.first_audio();
    let mut outputs = Vec::with_capacity(stems.len());
    let mut entries = Vec::with_capacity(stems.len());
    let stored_or = |e: stemq_core::storage::StorageError| Failure::transient(FailureCode::Storage, e.to_string());
    for (stem, audio, content) in stems.into_parts() {
        let file = format!("{stem}.{ext}");
        let key = output_key(job_id.as_str(), &file);
        let stored = match content {
            Content::File(path) => store.put_file(&key, &path).await,
            Content::Bytes(bytes) => store.put_bytes(&key, bytes).await,
        }
        .map_err(stored_or)?;
        let mut entry = json!({
            "stem": stem, "file": file, "uri": stored.uri, "bytes": stored.bytes, "sha256": stored.sha256,
        });
        if let Some(a) = audio {
            entry["sample_rate"] = json!(a.sample_rate);
            entry["frames"] = json!(a.frames);
            entry["duration_secs"] = json!(a.frames as f64 / f64::from(a.sample_rate.max(1)));
        }
        entries.push(entry);
        outputs.push(Output { stem, uri: stored.uri, bytes: stored.bytes, sha256: stored.sha256 });
    }
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
    let stored = store.put_bytes(&key, serde_json::to_vec_pretty(&manifest).expect("json")).await.map_err(stored_or)?;
    Ok((outputs, stored.uri))
}
