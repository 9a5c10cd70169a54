//! Storing an attempt's stems and its manifest in the object store.
//!
//! This module owns the layout of a job's outputs: each stem at `jobs/<id>/<stem>.<ext>`,
//! then `jobs/<id>/manifest.json` describing them, written last so that its presence
//! means every stem is there. A store error is a transient failure (`storage`): the
//! next attempt writes everything again. Stems come as files the engine wrote in the
//! attempt's scratch folder, or as bytes an engine kept in memory ([`Stems`]).

use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use stemq_core::device::Device;
use stemq_core::engine::{StemAudio, StemBytes, StemFile};
use stemq_core::event::{FailureCode, Output, Requested};
use stemq_core::request::Model;
use stemq_core::JobId;
use stemq_storage::{output_key, Store};

use crate::job::Failure;

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

/// How many of `stems` [`store_outputs`] should have in flight at once on `store`: all
/// of them on a remote store (on S3 each is a request of its own), one at a time on a
/// local one (there the writes are this machine's CPU and disk, and side by side they
/// only contend).
pub(crate) fn puts_in_flight(store: &Store, stems: &Stems) -> usize {
    if store.is_remote() {
        stems.len().max(1)
    } else {
        1
    }
}

/// Stores the stems, up to `in_flight` at once ([`puts_in_flight`]), then
/// `jobs/<id>/manifest.json` describing them (the manifest last, so its presence means
/// every stem is there).
pub(crate) async fn store_outputs(
    store: &Store,
    in_flight: usize,
    job_id: &JobId,
    requested: &Requested,
    stems: Stems,
    device: &Device,
    degraded: bool,
) -> Result<(Vec<Output>, String), Failure> {
    let ext = requested.request.output_format.extension();
    let first_audio = stems.first_audio();
    let stored_or = |e: stemq_storage::StorageError| Failure::transient(FailureCode::Storage, e.to_string());
    // In stem order; the first failure ends the attempt (the next one writes them all
    // again, over whatever was stored).
    let puts = stems.into_parts().into_iter().map(|(stem, audio, content)| async move {
        let file = format!("{stem}.{ext}");
        let key = output_key(job_id.as_str(), &file);
        let stored = match content {
            Content::File(path) => store.put_file(&key, &path).await,
            Content::Bytes(bytes) => store.put_bytes(&key, bytes).await,
        }
        .map_err(stored_or)?;
        Ok::<_, Failure>((Output { stem, uri: stored.uri, bytes: stored.bytes, sha256: stored.sha256 }, file, audio))
    });
    let stored: Vec<_> = futures::stream::iter(puts).buffered(in_flight).try_collect().await?;
    // Both or neither, as the request has them.
    let mp3 = requested.request.mp3_bitrate.zip(requested.request.mp3_preset);
    let manifest = Manifest {
        degraded,
        device: device.to_string(),
        duration_secs: first_audio.map(|a| a.secs()),
        format: ext,
        job_id,
        manifest_version: 1,
        model: &requested.request.model,
        mp3_bitrate: mp3.map(|m| m.0),
        mp3_preset: mp3.map(|m| m.1),
        sample_rate: first_audio.map(|a| a.sample_rate),
        stems: stored
            .iter()
            .map(|(o, file, audio)| Entry {
                bytes: o.bytes,
                duration_secs: audio.map(|a| a.secs()),
                file,
                frames: audio.map(|a| a.frames),
                sample_rate: audio.map(|a| a.sample_rate),
                sha256: &o.sha256,
                stem: &o.stem,
                uri: &o.uri,
            })
            .collect(),
    };
    let key = stemq_storage::manifest_key(job_id.as_str());
    let stored_manifest = store.put_bytes(&key, manifest.to_vec()).await.map_err(stored_or)?;
    Ok((stored.into_iter().map(|(o, _, _)| o).collect(), stored_manifest.uri))
}

/// `manifest.json`: its members in alphabetical order, pretty-printed (the bytes a
/// `serde_json` map of the same members gave before it was typed; the tests hold it to
/// them). `mp3_*` only for an MP3 job; the others are `null` when unknown.
#[derive(Serialize)]
struct Manifest<'a> {
    degraded: bool,
    device: String,
    duration_secs: Option<f64>,
    format: &'a str,
    job_id: &'a JobId,
    manifest_version: u32,
    model: &'a Model,
    #[serde(skip_serializing_if = "Option::is_none")]
    mp3_bitrate: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mp3_preset: Option<u32>,
    sample_rate: Option<u32>,
    stems: Vec<Entry<'a>>,
}

/// One stem of the manifest, members in alphabetical order; the audio's members only
/// when the engine said what the audio is.
#[derive(Serialize)]
struct Entry<'a> {
    bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_secs: Option<f64>,
    file: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    frames: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sample_rate: Option<u32>,
    sha256: &'a str,
    stem: &'a str,
    uri: &'a str,
}

impl Manifest<'_> {
    fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a manifest always serialises")
    }
}

#[cfg(test)]
mod tests {
    //! Given a job's stems, when stored one at a time or side by side, then the same
    //! objects and manifest, in stem order; and the manifest's bytes are those of the
    //! untyped map it was built as before (members sorted, pretty-printed), with audio
    //! facts and without, MP3 and not.

    use serde_json::json;

    use super::*;

    /// The manifest as the untyped map gave it.
    fn as_map(m: &Manifest) -> Vec<u8> {
        let stems: Vec<_> = m
            .stems
            .iter()
            .map(|e| {
                let mut entry =
                    json!({"stem": e.stem, "file": e.file, "uri": e.uri, "bytes": e.bytes, "sha256": e.sha256});
                if let (Some(sr), Some(frames), Some(d)) = (e.sample_rate, e.frames, e.duration_secs) {
                    entry["sample_rate"] = json!(sr);
                    entry["frames"] = json!(frames);
                    entry["duration_secs"] = json!(d);
                }
                entry
            })
            .collect();
        let mut map = json!({
            "manifest_version": 1, "job_id": m.job_id, "model": m.model, "format": m.format,
            "sample_rate": m.sample_rate, "duration_secs": m.duration_secs, "device": m.device,
            "degraded": m.degraded, "stems": stems,
        });
        if let (Some(b), Some(p)) = (m.mp3_bitrate, m.mp3_preset) {
            map["mp3_bitrate"] = json!(b);
            map["mp3_preset"] = json!(p);
        }
        serde_json::to_vec_pretty(&map).unwrap()
    }

    #[tokio::test]
    async fn stems_stored_side_by_side_keep_their_order() {
        // Files, written on blocking threads (several at once when side by side).
        let dir = tempfile::tempdir().unwrap();
        let store = Store::local(dir.path()).unwrap();
        let base = format!("{}/", store.base_url());
        let request: stemq_core::request::JobRequest =
            serde_json::from_value(json!({"audio_uri": format!("{base}uploads/o/song.wav")})).unwrap();
        let requested = Requested {
            request: request.normalize("o").unwrap(),
            webhook: None,
            metadata: None,
            start_before: None,
            max_runtime: None,
            priority: None,
        };
        let job_id = JobId::parse(&"cd".repeat(32)).unwrap();
        // Of different sizes: each object must hold its own stem's bytes.
        let stems = || {
            let names = ["drums", "bass", "other", "vocals"];
            Stems::Memory(
                names
                    .iter()
                    .enumerate()
                    .map(|(i, n)| StemBytes {
                        stem: n.to_string(),
                        bytes: vec![i as u8; 4 << (20 - 4 * i)],
                        audio: None,
                    })
                    .collect(),
            )
        };
        let mut manifests = Vec::new();
        for in_flight in [1, 4] {
            let (outputs, manifest_uri) =
                store_outputs(&store, in_flight, &job_id, &requested, stems(), &Device::Cpu, false).await.unwrap();
            let names: Vec<&str> = outputs.iter().map(|o| o.stem.as_str()).collect();
            assert_eq!(names, ["drums", "bass", "other", "vocals"], "in flight {in_flight}");
            for (i, o) in outputs.iter().enumerate() {
                let key = o.uri.strip_prefix(&base).unwrap();
                assert_eq!(store.get_bytes(key).await.unwrap().to_vec(), vec![i as u8; 4 << (20 - 4 * i)]);
            }
            let key = manifest_uri.strip_prefix(&base).unwrap().to_string();
            manifests.push(store.get_bytes(&key).await.unwrap());
        }
        assert_eq!(manifests[0], manifests[1], "the manifest does not depend on how the stems were stored");
        let m: serde_json::Value = serde_json::from_slice(&manifests[1]).unwrap();
        let files: Vec<&str> = m["stems"].as_array().unwrap().iter().map(|e| e["file"].as_str().unwrap()).collect();
        assert_eq!(files, ["drums.wav", "bass.wav", "other.wav", "vocals.wav"]);
    }

    #[test]
    fn the_manifest_keeps_its_bytes() {
        let job_id = JobId::parse(&"ab".repeat(32)).unwrap();
        let model = Model::Htdemucs;
        let entry = |stem: &'static str, audio: bool| Entry {
            bytes: 1_234_567,
            duration_secs: audio.then_some(187.30793650793652),
            file: stem,
            frames: audio.then_some(8_260_280),
            sample_rate: audio.then_some(44_100),
            sha256: "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            stem,
            uri: "file:///srv/store/jobs/x/\"quoted\"/drums.wav",
        };
        for (audio, mp3) in [(true, None), (false, None), (true, Some((320, 2))), (false, Some((128, 7)))] {
            let m = Manifest {
                degraded: !audio,
                device: "cuda:0".into(),
                duration_secs: audio.then_some(187.30793650793652),
                format: if mp3.is_some() { "mp3" } else { "wav" },
                job_id: &job_id,
                manifest_version: 1,
                model: &model,
                mp3_bitrate: mp3.map(|m| m.0),
                mp3_preset: mp3.map(|m| m.1),
                sample_rate: audio.then_some(44_100),
                stems: vec![entry("drums", audio), entry("bass", audio), entry("other", false), entry("vocals", audio)],
            };
            let typed = m.to_vec();
            assert_eq!(
                String::from_utf8(typed).unwrap(),
                String::from_utf8(as_map(&m)).unwrap(),
                "audio {audio}, mp3 {mp3:?}"
            );
        }
    }
}
