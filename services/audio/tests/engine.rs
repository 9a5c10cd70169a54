//! `DspEngine` behind the worker's engine seam: stems in request order, formats,
//! two-stem mode, progress, cancellation, and every error class mapped to a stable
//! code with a message for people.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use common::*;
use serde_json::json;
use stemq_audio::{ClipMode, DspEngine, OutputFormat, StemEncoder, StereoChunk};
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob, StemFile};
use stemq_core::request::{JobRequest, NormalizedRequest, ANONYMOUS};

#[derive(Default)]
struct Ctx {
    progress: Mutex<Vec<(f32, String)>>,
    cancel_after: Option<usize>,
    calls: AtomicUsize,
    cancelled: AtomicBool,
}

impl EngineContext for Ctx {
    fn progress(&self, fraction: f32, stage: &str) {
        self.progress.lock().unwrap().push((fraction, stage.to_string()));
    }
    fn cancelled(&self) -> bool {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let c = self.cancel_after.is_some_and(|k| n >= k);
        if c {
            self.cancelled.store(true, Ordering::SeqCst);
        }
        c
    }
}

fn request(v: serde_json::Value) -> NormalizedRequest {
    JobRequest::from_value(v).unwrap().normalize(ANONYMOUS).unwrap()
}

fn write_song(path: &Path, seconds: f64) {
    let n = (44_100.0 * seconds) as usize;
    let mut noise = Noise(11);
    let l: Vec<f32> = sine(220.0, 0.3, 44_100, n).iter().map(|x| x + 0.05 * noise.next()).collect();
    let r: Vec<f32> = sine(330.0, 0.3, 44_100, n).iter().map(|x| x + 0.05 * noise.next()).collect();
    let mut enc = StemEncoder::create(path, OutputFormat::Wav16, ClipMode::Clamp, 44_100).unwrap();
    enc.write(&StereoChunk::from_planar(l, r)).unwrap();
    enc.finish().unwrap();
}

fn run(
    engine: &DspEngine,
    req: &NormalizedRequest,
    input: &Path,
    out: &Path,
    ctx: &Ctx,
) -> Result<Vec<StemFile>, EngineError> {
    let id = req.job_id();
    let job = EngineJob {
        job_id: &id,
        request: req,
        metadata: None,
        attempt: 1,
        input,
        out_dir: out,
        device: &stemq_core::device::Device::Cpu,
        segment: None,
    };
    engine.separate(&job, ctx)
}

#[test]
fn four_wav_stems_in_request_order_with_progress() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("song.wav");
    write_song(&input, 3.0);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let req = request(json!({"audio_uri": "file:///x/song.wav", "model": "dsp"}));
    let engine = DspEngine::default();
    assert_eq!(engine.devices(), ["cpu"]);
    let ctx = Ctx::default();
    let stems = run(&engine, &req, &input, &out, &ctx).unwrap();
    let names: Vec<_> = stems.iter().map(|s| s.stem.as_str()).collect();
    assert_eq!(names, ["drums", "bass", "other", "vocals"]);
    for s in &stems {
        assert_eq!(s.path, out.join(format!("{}.wav", s.stem)));
        let bytes = std::fs::read(&s.path).unwrap();
        assert_eq!(&bytes[..4], b"RIFF");
        // 16-bit PCM: bits per sample at offset 34.
        assert_eq!(u16::from_le_bytes([bytes[34], bytes[35]]), 16);
        let audio = s.audio.unwrap();
        assert_eq!(audio.sample_rate, 44_100);
        assert_eq!(audio.frames, 3 * 44_100);
    }
    let p = ctx.progress.lock().unwrap();
    assert!(p.iter().all(|(_, stage)| stage == "separate"));
    assert_eq!(p.last().unwrap().0, 1.0);
    assert!(p.windows(2).all(|w| w[0].0 <= w[1].0));
}

#[test]
fn two_stems_as_flac() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("song.wav");
    write_song(&input, 1.0);
    let req = request(
        json!({"audio_uri": "file:///x/song.wav", "model": "dsp", "two_stems": "vocals", "output_format": "flac"}),
    );
    let stems = run(&DspEngine::default(), &req, &input, dir.path(), &Ctx::default()).unwrap();
    let names: Vec<_> = stems.iter().map(|s| s.stem.as_str()).collect();
    assert_eq!(names, ["vocals", "no_vocals"]);
    for s in &stems {
        assert_eq!(s.path.extension().unwrap(), "flac");
        assert_eq!(&std::fs::read(&s.path).unwrap()[..4], b"fLaC");
    }
    // --other-method none: only the stem.
    let req = request(json!({"audio_uri": "file:///x/song.wav", "model": "dsp", "two_stems": "vocals",
                             "other_method": "none"}));
    let out = dir.path().join("none");
    std::fs::create_dir(&out).unwrap();
    let stems = run(&DspEngine::default(), &req, &input, &out, &Ctx::default()).unwrap();
    assert_eq!(stems.iter().map(|s| s.stem.as_str()).collect::<Vec<_>>(), ["vocals"]);
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1, "no complement is written either");
    // --other-method minus: `minus_<stem>`, as demucs names it; the same samples as
    // `add`'s `no_<stem>` (the dsp stems sum to the mixture exactly).
    let req = request(json!({"audio_uri": "file:///x/song.wav", "model": "dsp", "two_stems": "vocals",
                             "other_method": "minus"}));
    let out = dir.path().join("minus");
    std::fs::create_dir(&out).unwrap();
    let stems = run(&DspEngine::default(), &req, &input, &out, &Ctx::default()).unwrap();
    assert_eq!(stems.iter().map(|s| s.stem.as_str()).collect::<Vec<_>>(), ["vocals", "minus_vocals"]);
    let add_out = dir.path().join("add");
    std::fs::create_dir(&add_out).unwrap();
    let add = request(json!({"audio_uri": "file:///x/song.wav", "model": "dsp", "two_stems": "vocals"}));
    let add_stems = run(&DspEngine::default(), &add, &input, &add_out, &Ctx::default()).unwrap();
    assert_eq!(add_stems[1].stem, "no_vocals");
    assert_eq!(std::fs::read(&stems[1].path).unwrap(), std::fs::read(&add_stems[1].path).unwrap());
}

#[cfg(feature = "mp3")]
#[test]
fn mp3_follows_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("song.wav");
    write_song(&input, 1.0);
    let req = request(json!({"audio_uri": "file:///x/song.wav", "model": "dsp", "output_format": "mp3",
                             "mp3_bitrate": 96, "mp3_preset": 7}));
    let stems = run(&DspEngine::default(), &req, &input, dir.path(), &Ctx::default()).unwrap();
    assert_eq!(stems.len(), 4);
    for s in &stems {
        assert_eq!(s.path.extension().unwrap(), "mp3");
        let bytes = std::fs::read(&s.path).unwrap();
        assert_eq!((bytes[0], bytes[1] & 0xFE), (0xFF, 0xFA), "{}: MPEG-1 Layer III", s.stem);
        // 96 kbit/s, constant: 1 s of audio, LAME's delay and padding, the Info frame.
        assert!((12_000..14_500).contains(&bytes.len()), "{}: {} B", s.stem, bytes.len());
        let audio = s.audio.unwrap();
        assert_eq!(audio.sample_rate, 44_100);
        assert!((44_100 + 1105..44_100 + 1105 + 1152).contains(&audio.frames), "{}", audio.frames);
    }
}

#[test]
fn encodings_and_clip_modes_follow_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("song.wav");
    write_song(&input, 1.0);
    // (request fields, container magic, bits per sample or FLAC, expected by the decoder)
    for (fields, ext, bits) in [
        (json!({"encoding": "s24"}), "wav", 24u16),
        (json!({"encoding": "f32"}), "wav", 32),
        (json!({"encoding": "s24", "output_format": "flac"}), "flac", 24),
        (json!({"clip_mode": "clamp"}), "wav", 16),
        (json!({"clip_mode": "none"}), "wav", 16),
    ] {
        let mut v = json!({"audio_uri": "file:///x/song.wav", "model": "dsp", "two_stems": "vocals"});
        for (k, x) in fields.as_object().unwrap() {
            v[k] = x.clone();
        }
        let out = dir.path().join(format!("out-{}", fields.to_string().len()));
        std::fs::create_dir_all(&out).unwrap();
        let stems = run(&DspEngine::default(), &request(v), &input, &out, &Ctx::default()).unwrap();
        for s in &stems {
            assert_eq!(s.path.extension().unwrap(), ext, "{fields}");
            let bytes = std::fs::read(&s.path).unwrap();
            if ext == "wav" {
                assert_eq!(u16::from_le_bytes([bytes[34], bytes[35]]), bits, "{fields}");
                // Over 16 bits the header is WAVE_FORMAT_EXTENSIBLE (as hound and ffmpeg
                // write it): the format is then the first two bytes of the sub-format.
                let mut format_tag = u16::from_le_bytes([bytes[20], bytes[21]]);
                assert_eq!(format_tag == 0xFFFE, bits > 16, "{fields}: tag {format_tag}");
                if format_tag == 0xFFFE {
                    format_tag = u16::from_le_bytes([bytes[44], bytes[45]]);
                }
                assert_eq!(format_tag == 3, bits == 32, "{fields}: format {format_tag}");
                assert_eq!(format_tag == 1, bits < 32, "{fields}: format {format_tag}");
            } else {
                assert_eq!(&bytes[..4], b"fLaC");
                // STREAMINFO: bits per sample − 1 spans bytes 20..22 of the block body.
                let bps = (((bytes[8 + 12] as u16 & 0x01) << 4) | (bytes[8 + 13] as u16 >> 4)) + 1;
                assert_eq!(bps, bits, "{fields}");
            }
        }
    }
}

#[test]
fn neural_models_are_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["htdemucs", "htdemucs_ft", "htdemucs_6s"] {
        let req = request(json!({"audio_uri": "file:///x/song.wav", "model": model}));
        let e = run(&DspEngine::default(), &req, &dir.path().join("missing"), dir.path(), &Ctx::default()).unwrap_err();
        match e {
            EngineError::Unsupported { code, message } => {
                assert_eq!(code, "model_unavailable");
                assert!(message.contains(model), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn cancellation_stops_between_chunks_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("song.wav");
    write_song(&input, 20.0);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let req = request(json!({"audio_uri": "file:///x/song.wav", "model": "dsp"}));
    let ctx = Ctx { cancel_after: Some(1), ..Ctx::default() };
    assert_eq!(run(&DspEngine::default(), &req, &input, &out, &ctx).unwrap_err(), EngineError::Cancelled);
    assert!(ctx.cancelled.load(Ordering::SeqCst));
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
}

fn input_error(bytes: &[u8], engine: &DspEngine) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    std::fs::write(&input, bytes).unwrap();
    let req = request(json!({"audio_uri": "file:///x/in", "model": "dsp"}));
    match run(engine, &req, &input, dir.path(), &Ctx::default()).unwrap_err() {
        EngineError::InvalidInput { code, message } => (code.to_string(), message),
        other => panic!("{other:?}"),
    }
}

fn wav_header(tag: u16, data_len: usize) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&((36 + data_len) as u32).to_le_bytes());
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&16u32.to_le_bytes());
    v.extend_from_slice(&tag.to_le_bytes());
    v.extend_from_slice(&2u16.to_le_bytes());
    v.extend_from_slice(&44_100u32.to_le_bytes());
    v.extend_from_slice(&(44_100u32 * 4).to_le_bytes());
    v.extend_from_slice(&4u16.to_le_bytes());
    v.extend_from_slice(&16u16.to_le_bytes());
    v.extend_from_slice(b"data");
    v.extend_from_slice(&(data_len as u32).to_le_bytes());
    v.extend(std::iter::repeat_n(0u8, data_len));
    v
}

#[test]
fn input_errors_have_stable_codes_and_readable_messages() {
    let engine = DspEngine::default();
    let (code, msg) = input_error(b"this is not audio at all, just text that goes on and on", &engine);
    assert_eq!(code, "invalid_audio", "{msg}");
    assert!(msg.contains("not an audio file"), "{msg}");

    let (code, msg) = input_error(&wav_header(0x00FF, 4000), &engine);
    assert_eq!(code, "unsupported_codec", "{msg}");
    assert!(msg.contains("AAC"), "{msg}");

    let (code, msg) = input_error(&wav_header(1, 0), &engine);
    assert_eq!(code, "empty_audio", "{msg}");

    let (code, msg) = input_error(&wav_header(1, 44_100 * 4 * 3), &DspEngine::with_max_duration(2.0));
    assert_eq!(code, "too_long", "{msg}");
    assert!(msg.contains("00:03") && msg.contains("00:02"), "{msg}");

    // A FLAC cut in half: the message says where.
    let dir = tempfile::tempdir().unwrap();
    let flac = dir.path().join("t.flac");
    let n = 44_100 * 4;
    let mut noise = Noise(3);
    let l: Vec<f32> = sine(440.0, 0.4, 44_100, n).iter().map(|x| x + 0.1 * noise.next()).collect();
    let mut enc = StemEncoder::create(&flac, OutputFormat::Flac16, ClipMode::Clamp, 44_100).unwrap();
    enc.write(&StereoChunk::from_planar(l.clone(), l)).unwrap();
    enc.finish().unwrap();
    let bytes = std::fs::read(&flac).unwrap();
    let (code, msg) = input_error(&bytes[..bytes.len() / 2], &engine);
    assert_eq!(code, "corrupt_audio", "{msg}");
    assert!(msg.contains("corrupt frame at 00:0"), "{msg}");
}

#[test]
fn a_missing_input_is_transient() {
    let dir = tempfile::tempdir().unwrap();
    let req = request(json!({"audio_uri": "file:///x/in", "model": "dsp"}));
    let e = run(&DspEngine::default(), &req, &dir.path().join("nope.wav"), dir.path(), &Ctx::default()).unwrap_err();
    assert!(matches!(e, EngineError::Transient { .. }), "{e:?}");
}
