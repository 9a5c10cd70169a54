//! The formats people have, through the real pipeline (ingress, NATS, a `dsp` worker in
//! process, projector): an M4A (AAC), an Opus, a WebM and an AIFF made by Debian's ffmpeg
//! at test time, each uploaded under a name that says nothing of its format, separate
//! into four stems of the song's length; a WMA fails on its first attempt, permanently,
//! naming what it is and what stemq reads.
//!
//! Needs `ffmpeg` (scripts/install-test-deps.sh): SKIPPED without it, a failure in CI.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use stemq_core::event::FailureClass;
use stemq_core::JobStatus;
use stemq_tests::{job_id, upload_key, Stack, StackOptions};

const T: Duration = Duration::from_secs(120);
const SECONDS: f64 = 2.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_separates_and_a_foreign_one_fails_once_with_its_name() {
    if !stemq_tests::have_tool("ffmpeg", "-version", "the input formats through the pipeline") {
        return;
    }
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.add_worker(Arc::new(stemq_audio::DspEngine::default())).await;
    let wav = stack.dir.path().join("song.wav");
    stemq_audio::synth::write_demo_song(&wav, SECONDS, 44_100).expect("demo song");
    let encode = |codec: &[&str], out: &str| {
        let path = stack.dir.path().join(out);
        let status = Command::new("ffmpeg")
            .args(["-hide_banner", "-loglevel", "error", "-y", "-i", wav.to_str().unwrap()])
            .args(codec)
            .arg(&path)
            .status()
            .expect("ffmpeg runs");
        assert!(status.success(), "ffmpeg {codec:?} {out}");
        path
    };
    let cases = [
        (encode(&["-c:a", "aac", "-b:a", "192k"], "song.m4a"), "aac"),
        (encode(&["-c:a", "libopus", "-b:a", "128k"], "song.opus"), "opus"),
        (encode(&["-c:a", "libopus", "-b:a", "96k"], "song.webm"), "webm"),
        (encode(&["-c:a", "pcm_s24be"], "song.aiff"), "aiff"),
    ];
    let mut ids = Vec::new();
    for (path, name) in &cases {
        // Stored as `.bin`: the worker goes by the bytes.
        let key = upload_key(&format!("{name}.bin"));
        stack.store.put_file(&key, path).await.expect("upload");
        let (code, answer) = stack.submit(&json!({"audio_uri": stack.store.uri(&key), "model": "dsp"})).await;
        assert_eq!(code, 202, "{name}: {answer}");
        ids.push((name, job_id(&answer)));
    }
    for (name, id) in &ids {
        let view = stack.wait_terminal(id, T).await;
        assert_eq!(view.status, JobStatus::Succeeded, "{name}: {view:#?}");
        assert_eq!(view.outputs.len(), 4, "{name}");
        let manifest = stack.store.get_bytes(&stemq_core::storage::manifest_key(id.as_str())).await.expect("manifest");
        let manifest: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
        // Priming, pre-skip and padding trimmed: the song's own length (WebM keeps up to
        // one Opus frame of end padding).
        let secs = manifest["duration_secs"].as_f64().expect("duration");
        assert!((secs - SECONDS).abs() < 0.025, "{name}: {secs} s");
    }

    let wma = encode(&["-c:a", "wmav2"], "song.wma");
    let key = upload_key("song.mp3");
    stack.store.put_file(&key, &wma).await.expect("upload");
    let (code, answer) = stack.submit(&json!({"audio_uri": stack.store.uri(&key), "model": "dsp"})).await;
    assert_eq!(code, 202, "{answer}");
    let id = job_id(&answer);
    let view = stack.wait_terminal(&id, T).await;
    assert_eq!((view.status, view.attempt), (JobStatus::Failed, 1), "{view:#?}");
    let error = view.error.as_ref().expect("error");
    assert_eq!((error.class, error.code.as_str()), (FailureClass::Permanent, "unsupported_codec"));
    assert!(error.message.contains("Windows Media Audio"), "{}", error.message);
    assert!(error.message.ends_with(stemq_audio::SUPPORTED), "{}", error.message);
    assert!(!error.message.contains("MPEG"), "names a codec the file does not have: {}", error.message);
    stack.shutdown().await;
}
