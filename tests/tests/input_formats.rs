//! The formats people have, through the real pipeline (ingress, NATS, a `dsp` worker in
//! process, projector) and through `stemq separate`: an M4A (AAC-LC), an HE-AAC M4A, an
//! Opus, a WebM and an AIFF made at test time (by Debian's ffmpeg; HE-AAC by
//! `oxideav-aac`'s encoder, since no encoder Debian ships makes SBR), each uploaded under
//! a name that says nothing of its format, separate into four stems of the song's length;
//! a WMA fails on its first attempt, permanently, naming what it is and what stemq reads.
//!
//! Needs `ffmpeg` (scripts/install-test-deps.sh): SKIPPED without it, a failure in CI.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use stemq_core::event::FailureClass;
use stemq_core::JobStatus;
use stemq_tests::{job_id, upload_key, Stack, StackOptions};

const T: Duration = Duration::from_secs(120);
const SECONDS: f64 = 2.0;

fn ffmpeg(args: &[&OsStr]) {
    let status = Command::new("ffmpeg")
        .args(["-hide_banner", "-loglevel", "error", "-y"])
        .args(args)
        .status()
        .expect("ffmpeg runs");
    assert!(status.success(), "ffmpeg {args:?}");
}

/// `wav` encoded by ffmpeg with `codec` into `dir/out`.
fn encode(wav: &Path, dir: &Path, codec: &[&str], out: &str) -> PathBuf {
    let path = dir.join(out);
    let mut args = vec![OsStr::new("-i"), wav.as_os_str()];
    args.extend(codec.iter().map(OsStr::new));
    args.push(path.as_os_str());
    ffmpeg(&args);
    path
}

/// `wav` as HE-AAC (SBR, 48 kbit/s stereo) in M4A: `oxideav-aac`'s encoder writes ADTS,
/// ffmpeg copies it into MP4.
fn he_aac_m4a(wav: &Path, dir: &Path, out: &str) -> PathBuf {
    use oxideav_aac::he_aac_encoder::{HeAacConfig, HeAacEncoder};
    let raw = encode(wav, dir, &["-f", "s16le", "-ac", "2", "-ar", "44100"], &format!("{out}.s16"));
    let pcm: Vec<i16> =
        std::fs::read(&raw).unwrap().chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])).collect();
    let mut enc = HeAacEncoder::new(HeAacConfig::new(44_100, 2, 48_000)).unwrap();
    let adts = dir.join(format!("{out}.aac"));
    std::fs::write(&adts, enc.encode_all(&pcm).unwrap()).unwrap();
    let path = dir.join(out);
    ffmpeg(&[OsStr::new("-i"), adts.as_os_str(), OsStr::new("-c"), OsStr::new("copy"), path.as_os_str()]);
    path
}

/// Each file, and how far its length may be from the song's: priming, pre-skip and
/// padding are trimmed where the container states them; the HE-AAC copied from ADTS has
/// no edit list, so it keeps its encoder's delay and last frame, as ffmpeg's decode does.
fn fixtures(wav: &Path, dir: &Path) -> Vec<(PathBuf, &'static str, f64)> {
    vec![
        (encode(wav, dir, &["-c:a", "aac", "-b:a", "192k"], "aac.m4a"), "aac", 0.025),
        (he_aac_m4a(wav, dir, "he-aac.m4a"), "he-aac", 0.15),
        (encode(wav, dir, &["-c:a", "libopus", "-b:a", "128k"], "opus.opus"), "opus", 0.025),
        (encode(wav, dir, &["-c:a", "libopus", "-b:a", "96k"], "webm.webm"), "webm", 0.002),
        (encode(wav, dir, &["-c:a", "pcm_s24be"], "aiff.aiff"), "aiff", 0.002),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_separates_and_a_foreign_one_fails_once_with_its_name() {
    if !stemq_tests::have_tool("ffmpeg", "-version", "the input formats through the pipeline") {
        return;
    }
    let mut stack = Stack::start(StackOptions { workers: 0, ..Default::default() }).await;
    stack.add_worker(Arc::new(stemq_audio::DspEngine::default())).await;
    let wav = stack.dir.path().join("song.wav");
    stemq_audio::synth::write_demo_song(&wav, SECONDS, 44_100).expect("demo song");
    let cases = fixtures(&wav, stack.dir.path());
    let mut ids = Vec::new();
    for (path, name, tol) in &cases {
        // Stored as `.bin`: the worker goes by the bytes.
        let key = upload_key(&format!("{name}.bin"));
        stack.store.put_file(&key, path).await.expect("upload");
        let (code, answer) = stack.submit(&json!({"audio_uri": stack.store.uri(&key), "model": "dsp"})).await;
        assert_eq!(code, 202, "{name}: {answer}");
        ids.push((name, tol, job_id(&answer)));
    }
    for (name, tol, id) in &ids {
        let view = stack.wait_terminal(id, T).await;
        assert_eq!(view.status, JobStatus::Succeeded, "{name}: {view:#?}");
        assert_eq!(view.outputs.len(), 4, "{name}");
        let manifest = stack.store.get_bytes(&stemq_storage::manifest_key(id.as_str())).await.expect("manifest");
        let manifest: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
        let secs = manifest["duration_secs"].as_f64().expect("duration");
        assert!((secs - SECONDS).abs() < **tol, "{name}: {secs} s");
    }

    let wma = encode(&wav, stack.dir.path(), &["-c:a", "wmav2"], "song.wma");
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

/// `stemq separate` reads the same files (several tracks in one call, as demucs takes
/// them), and names a WMA it refuses.
#[test]
fn every_format_separates_through_the_cli() {
    if !stemq_tests::have_tool("ffmpeg", "-version", "the input formats through stemq separate") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let wav = dir.path().join("song.wav");
    stemq_audio::synth::write_demo_song(&wav, SECONDS, 44_100).expect("demo song");
    let cases = fixtures(&wav, dir.path());
    let mut args = vec!["separate".to_string(), "-n".into(), "dsp".into(), "-o".into(), "sep".into()];
    args.extend(cases.iter().map(|(p, _, _)| p.file_name().unwrap().to_string_lossy().into_owned()));
    let out = Command::new(Stack::stemq_bin()).args(&args).current_dir(dir.path()).output().expect("run stemq");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (path, name, tol) in &cases {
        let track = path.file_stem().unwrap().to_string_lossy();
        for stem in ["drums", "bass", "other", "vocals"] {
            let p = dir.path().join(format!("sep/dsp/{track}/{stem}.wav"));
            let ms = stemq_audio::probe_duration_ms(&p).unwrap_or_else(|| panic!("{name}: {} missing", p.display()));
            let secs = ms as f64 / 1000.0;
            assert!((secs - SECONDS).abs() < tol + 0.001, "{name} {stem}: {secs} s");
        }
    }
    let wma = encode(&wav, dir.path(), &["-c:a", "wmav2"], "song.wma");
    let out = Command::new(Stack::stemq_bin())
        .args(["separate", "-n", "dsp", "-o", "sep", wma.to_str().unwrap()])
        .current_dir(dir.path())
        .output()
        .expect("run stemq");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("Windows Media Audio"), "{stderr}");
}
