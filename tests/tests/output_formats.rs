//! Compressed stems through the real pipeline (ingress, NATS, a `dsp` worker in process,
//! projector): a job with `output_format: "mp3"` yields MP3 stems that stemq's own
//! decoder plays back at the input's length (plus LAME's delay and padding) and level,
//! served as `audio/mpeg`, with the format and bit rate in the manifest; a two-stem job
//! with `other_method: "minus"` names its complement `minus_<stem>`, as demucs does; a
//! FLAC job's stems carry the MD5 of their samples.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use stemq_audio::{DecodeOptions, Decoder, StereoChunk};
use stemq_core::{JobId, JobStatus, JobView};
use stemq_tests::{job_id, upload_key, Stack, StackOptions};

const T: Duration = Duration::from_secs(120);
/// Length of the song, in frames at 44.1 kHz.
const FRAMES: usize = 2 * 44_100;
/// LAME's encoder delay plus the MP3 decoder's, in frames.
const MP3_DELAY: usize = 576 + 529;

async fn dsp_stack() -> Stack {
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.add_worker(Arc::new(stemq_audio::DspEngine::default())).await;
    stack
}

/// The two-second demo song, uploaded for the test owner; its `audio_uri`.
async fn song(stack: &Stack) -> String {
    let path = stack.dir.path().join("song.wav");
    stemq_audio::synth::write_demo_song(&path, FRAMES as f64 / 44_100.0, 44_100).expect("demo song");
    let key = upload_key("song.wav");
    stack.store.put_file(&key, &path).await.expect("upload");
    stack.store.uri(&key)
}

async fn run(stack: &Stack, body: Value) -> (JobId, JobView) {
    let (code, answer) = stack.submit(&body).await;
    assert_eq!(code, 202, "{answer}");
    let id = job_id(&answer);
    let view = stack.wait_terminal(&id, T).await;
    assert_eq!(view.status, JobStatus::Succeeded, "{view:#?}");
    (id, view)
}

/// Downloads a stem over HTTP into `dir`; its bytes and `Content-Type`.
async fn download(stack: &Stack, id: &JobId, stem: &str, dir: &Path, ext: &str) -> (std::path::PathBuf, String) {
    let r = stack.request(reqwest::Method::GET, &format!("/v1/separations/{id}/stems/{stem}")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "stem {stem}");
    let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
    let path = dir.join(format!("{stem}.{ext}"));
    std::fs::write(&path, r.bytes().await.unwrap()).unwrap();
    (path, content_type)
}

fn decode(path: &Path) -> (String, StereoChunk) {
    let mut d = Decoder::open_path(path, DecodeOptions::default()).expect("stemq decodes the stem");
    let codec = d.info().codec.clone();
    let mut all = StereoChunk::default();
    while let Some(c) = d.next_chunk().unwrap() {
        all.extend_from(&c);
    }
    (codec, all)
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len().max(1) as f64).sqrt()
}

async fn manifest(stack: &Stack, id: &JobId) -> Value {
    let bytes = stack.store.get_bytes(&stemq_storage::manifest_key(id.as_str())).await.expect("manifest");
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mp3_job_yields_playable_mp3_stems() {
    let stack = dsp_stack().await;
    let uri = song(&stack).await;
    let (id, view) =
        run(&stack, json!({"audio_uri": uri, "model": "dsp", "output_format": "mp3", "mp3_bitrate": 192})).await;
    let names: Vec<_> = view.outputs.iter().map(|o| o.stem.as_str()).collect();
    assert_eq!(names, ["drums", "bass", "other", "vocals"]);

    let m = manifest(&stack, &id).await;
    assert_eq!(
        (m["format"].as_str(), m["mp3_bitrate"].as_u64(), m["mp3_preset"].as_u64()),
        (Some("mp3"), Some(192), Some(2))
    );

    let input = decode(&stack.dir.path().join("song.wav")).1;
    let dir = tempfile::tempdir().unwrap();
    let mut sum = StereoChunk::from_planar(vec![0.0; FRAMES], vec![0.0; FRAMES]);
    for o in &view.outputs {
        assert!(o.uri.ends_with(&format!("/{}.mp3", o.stem)), "{}", o.uri);
        let (path, content_type) = download(&stack, &id, &o.stem, dir.path(), "mp3").await;
        assert_eq!(content_type, "audio/mpeg");
        let (codec, stem) = decode(&path);
        assert_eq!(codec, "mp3", "{}", o.stem);
        // The input's length, plus LAME's delay and under one frame of padding.
        assert!(
            stem.len() >= FRAMES + MP3_DELAY && stem.len() < FRAMES + MP3_DELAY + 1152,
            "{}: {}",
            o.stem,
            stem.len()
        );
        let entry = m["stems"].as_array().unwrap().iter().find(|e| e["stem"] == o.stem.as_str()).unwrap();
        assert_eq!(entry["frames"].as_u64(), Some(stem.len() as u64), "{}", o.stem);
        assert!(rms(&stem.left) > 1e-3, "{} is silent", o.stem);
        for i in 0..FRAMES {
            sum.left[i] += stem.left[MP3_DELAY + i];
            sum.right[i] += stem.right[MP3_DELAY + i];
        }
    }
    // The dsp stems sum to the mixture; through MP3 they still do, at its level.
    let level_db = 20.0 * (rms(&sum.left) / rms(&input.left)).log10();
    assert!(level_db.abs() < 0.5, "the stems sum {level_db:.2} dB off the mixture");
    let err: Vec<f32> = sum.left.iter().zip(&input.left).map(|(a, b)| a - b).collect();
    let snr = 20.0 * (rms(&input.left) / rms(&err)).log10();
    assert!(snr > 20.0, "the stems sum to the mixture at {snr:.1} dB SNR");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stems_minus_is_named_minus_and_flac_stems_carry_their_md5() {
    let stack = dsp_stack().await;
    let uri = song(&stack).await;
    let body = json!({"audio_uri": uri, "model": "dsp", "two_stems": "vocals", "other_method": "minus",
                      "output_format": "flac"});
    let (id, view) = run(&stack, body).await;
    let names: Vec<_> = view.outputs.iter().map(|o| o.stem.as_str()).collect();
    assert_eq!(names, ["vocals", "minus_vocals"]);
    let add = json!({"audio_uri": uri, "model": "dsp", "two_stems": "vocals", "output_format": "flac"});
    let (_, add_view) = run(&stack, add).await;
    assert_eq!(add_view.outputs.iter().map(|o| o.stem.as_str()).collect::<Vec<_>>(), ["vocals", "no_vocals"]);

    let dir = tempfile::tempdir().unwrap();
    for o in &view.outputs {
        let (path, content_type) = download(&stack, &id, &o.stem, dir.path(), "flac").await;
        assert_eq!(content_type, "audio/flac");
        let bytes = std::fs::read(&path).unwrap();
        let md5_in_file = &bytes[8 + 18..8 + 34];
        let (codec, stem) = decode(&path);
        assert_eq!((codec.as_str(), stem.len()), ("flac", FRAMES));
        // MD5 of the 16-bit samples, interleaved little-endian (what `flac -t` checks).
        use md5::{Digest, Md5};
        let mut h = Md5::new();
        for (l, r) in stem.left.iter().zip(&stem.right) {
            for x in [l, r] {
                h.update(((x * 32768.0).round() as i16).to_le_bytes());
            }
        }
        assert_eq!(h.finalize().as_slice(), md5_in_file, "{}", o.stem);
    }
    stack.shutdown().await;
}
