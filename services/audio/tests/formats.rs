//! Decoding of every supported input format, encoder round trips,
//! resampling, channel conversion, clip modes and file summaries.

mod common;

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use common::*;
use stemq_audio::{summarize_file, ClipMode, DecodeOptions, Decoder, OutputFormat, StemEncoder, StereoChunk};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A test signal: two sines plus a little noise, peak < 1.
fn test_signal(rate: u32, frames: usize) -> StereoChunk {
    let mut n = Noise(42);
    let l = sine(440.0, 0.5, rate, frames);
    let r = sine(660.0, 0.4, rate, frames);
    StereoChunk::from_planar(
        l.iter().map(|&x| x + 0.05 * n.next()).collect(),
        r.iter().map(|&x| x + 0.05 * n.next()).collect(),
    )
}

fn native(rate: u32) -> DecodeOptions {
    DecodeOptions { target_sample_rate: rate, max_duration_secs: None }
}

#[test]
fn round_trip_every_output_format() {
    let dir = tempfile::tempdir().unwrap();
    let rate = 44_100;
    let sig = test_signal(rate, 44_100 + 777);
    let cases = [
        (OutputFormat::Wav16, 1.0 / 32768.0, "pcm_s16le"),
        (OutputFormat::Wav24, 1.0 / 8_388_608.0, "pcm_s24le"),
        (OutputFormat::WavF32, 0.0, "pcm_f32le"),
        (OutputFormat::Flac16, 1.0 / 32768.0, "flac"),
        (OutputFormat::Flac24, 1.0 / 8_388_608.0, "flac"),
    ];
    for (fmt, q, codec) in cases {
        let path = dir.path().join(format!("rt_{fmt:?}.{}", fmt.extension()));
        write_stem(&path, &sig, fmt, ClipMode::None, rate);
        let d = Decoder::open_path(&path, native(rate)).unwrap();
        assert_eq!(d.info().codec, codec, "{fmt:?}");
        assert_eq!(d.info().frames, Some(sig.len() as u64), "{fmt:?}");
        let got = decode_all(&path, native(rate)).unwrap();
        let tol = q * 0.51 + 1e-7;
        assert!(max_abs_diff(&got.left, &sig.left) <= tol, "{fmt:?} left");
        assert!(max_abs_diff(&got.right, &sig.right) <= tol, "{fmt:?} right");
    }
}

#[test]
fn flac_is_lossless_against_wav_for_hard_content() {
    // Silence (constant subframes), full-scale noise (verbatim), identical
    // channels (side = 0), out-of-range values (clamped), a partial last block.
    let dir = tempfile::tempdir().unwrap();
    let rate = 48_000;
    let mut n = Noise(7);
    let mut l = vec![0.0f32; 5000];
    let mut r = vec![0.0f32; 5000];
    l.extend((0..9000).map(|_| n.next()));
    r.extend((0..9000).map(|_| n.next()));
    let s = sine(100.0, 1.3, rate, 6000);
    l.extend(&s);
    r.extend(&s);
    l.extend((0..123).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }));
    r.extend((0..123).map(|_| -1.0));
    let sig = StereoChunk::from_planar(l, r);
    for (wav, flac) in [(OutputFormat::Wav16, OutputFormat::Flac16), (OutputFormat::Wav24, OutputFormat::Flac24)] {
        let pw = dir.path().join(format!("{wav:?}.wav"));
        let pf = dir.path().join(format!("{flac:?}.flac"));
        write_stem(&pw, &sig, wav, ClipMode::None, rate);
        write_stem(&pf, &sig, flac, ClipMode::None, rate);
        let a = decode_all(&pw, native(rate)).unwrap();
        let b = decode_all(&pf, native(rate)).unwrap();
        assert_eq!(a, b, "{flac:?} differs from {wav:?}");
        assert_eq!(b.len(), sig.len());
        // The FLAC really compresses the silent part.
        let wav_len = std::fs::metadata(&pw).unwrap().len();
        let flac_len = std::fs::metadata(&pf).unwrap().len();
        assert!(flac_len < wav_len, "{flac:?}: {flac_len} >= {wav_len}");
    }
}

#[test]
fn encoders_write_to_any_write_seek() {
    let sig = test_signal(44_100, 5000);
    let cursor = std::io::Cursor::new(Vec::new());
    let mut enc = StemEncoder::new(cursor, OutputFormat::Flac16, ClipMode::Clamp, 44_100).unwrap();
    enc.write(&sig).unwrap();
    let bytes = enc.finish().unwrap().into_inner();
    let mut d = Decoder::open(std::io::Cursor::new(bytes), native(44_100)).unwrap();
    let mut n = 0;
    while let Some(c) = d.next_chunk().unwrap() {
        n += c.len();
    }
    assert_eq!(n, 5000);
}

#[test]
fn clip_modes_follow_demucs() {
    let dir = tempfile::tempdir().unwrap();
    let rate = 44_100;
    let mut sig = test_signal(rate, 20_000);
    sig.left[10_000] = 2.0; // peak 2.0 -> rescale divides by 2.02
    sig.right[15_000] = -1.5;
    for (clip, fmt) in [
        (ClipMode::Rescale, OutputFormat::WavF32),
        (ClipMode::Clamp, OutputFormat::WavF32),
        (ClipMode::None, OutputFormat::WavF32),
        (ClipMode::None, OutputFormat::Wav16),
    ] {
        let path = dir.path().join(format!("{clip:?}_{fmt:?}.wav"));
        write_stem(&path, &sig, fmt, clip, rate);
        let got = decode_all(&path, native(rate)).unwrap();
        match (clip, fmt) {
            (ClipMode::Rescale, _) => {
                let scale = 1.0 / (1.01f32 * 2.0);
                assert!((got.left[10_000] - 2.0 * scale).abs() < 1e-6);
                assert!((got.left[100] - sig.left[100] * scale).abs() < 1e-6);
                assert!(got.peak() < 1.0);
            }
            (ClipMode::Clamp, _) => {
                assert_eq!(got.left[10_000], 1.0);
                assert_eq!(got.right[15_000], -1.0);
                assert_eq!(got.left[100], sig.left[100]);
            }
            (ClipMode::None, OutputFormat::WavF32) => {
                assert_eq!(got.left[10_000], 2.0);
                assert_eq!(got.right[15_000], -1.5);
            }
            _ => {
                // Integer output clamps on conversion whatever the mode.
                assert!((got.left[10_000] - 32767.0 / 32768.0).abs() < 1e-6);
                assert_eq!(got.right[15_000], -1.0);
            }
        }
    }
    // Rescale leaves quiet stems untouched (divides by max(1.01*peak, 1) = 1).
    let quiet = test_signal(rate, 1000);
    let path = dir.path().join("quiet.wav");
    write_stem(&path, &quiet, OutputFormat::WavF32, ClipMode::Rescale, rate);
    assert_eq!(decode_all(&path, native(rate)).unwrap(), quiet);
}

fn check_sine_file(path: &Path, seconds: f64) {
    let d = Decoder::open_path(path, DecodeOptions::default()).unwrap();
    assert_eq!(d.info().sample_rate, 44_100);
    assert_eq!(d.info().channels, 2);
    let got = decode_all(path, DecodeOptions::default()).unwrap();
    let secs = got.len() as f64 / 44_100.0;
    assert!((secs - seconds).abs() < 0.1, "{}: {secs} s", path.display());
    let mid = got.len() / 4..3 * got.len() / 4;
    let fl = measure_freq(&got.left[mid.clone()], 44_100);
    let fr = measure_freq(&got.right[mid.clone()], 44_100);
    assert!((fl - 440.0).abs() < 1.0, "{}: left {fl} Hz", path.display());
    assert!((fr - 660.0).abs() < 1.0, "{}: right {fr} Hz", path.display());
    let al = measure_amp(&got.left[mid.clone()]);
    let ar = measure_amp(&got.right[mid]);
    assert!((al - 0.5).abs() < 0.05 && (ar - 0.5).abs() < 0.05, "{}: amps {al} {ar}", path.display());
}

#[test]
fn decodes_mp3_fixture() {
    check_sine_file(&fixture("sine_440_660.mp3"), 2.0);
}

#[test]
fn decodes_ogg_vorbis_fixture() {
    check_sine_file(&fixture("sine_440_660.ogg"), 2.0);
    let d = Decoder::open_path(fixture("sine_440_660.ogg"), DecodeOptions::default()).unwrap();
    assert_eq!(d.info().codec, "vorbis");
}

#[test]
fn decodes_from_any_read_seek_source() {
    let bytes = std::fs::read(fixture("sine_440_660.mp3")).unwrap();
    let mut d = Decoder::open(std::io::Cursor::new(bytes), DecodeOptions::default()).unwrap();
    assert_eq!(d.info().codec, "mp3");
    let mut n = 0;
    for c in &mut d {
        n += c.unwrap().len();
    }
    assert!(n > 80_000);
}

#[test]
fn resamples_48k_to_44k1_keeping_frequency_and_amplitude() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("48k.wav");
    let frames = 48_000 * 3;
    let sig = StereoChunk::from_planar(sine(1000.0, 0.5, 48_000, frames), sine(3000.0, 0.25, 48_000, frames));
    write_stem(&path, &sig, OutputFormat::WavF32, ClipMode::None, 48_000);
    let d = Decoder::open_path(&path, DecodeOptions::default()).unwrap();
    assert_eq!(d.info().sample_rate, 48_000);
    assert_eq!(d.output_sample_rate(), 44_100);
    let got = decode_all(&path, DecodeOptions::default()).unwrap();
    assert_eq!(got.len(), 44_100 * 3, "exact output length");
    let mid = 22_050..110_250;
    let f = measure_freq(&got.left[mid.clone()], 44_100);
    assert!((f - 1000.0).abs() < 0.05, "{f} Hz");
    let a = measure_amp(&got.left[mid.clone()]);
    assert!((a - 0.5).abs() < 0.005, "amp {a}");
    let f = measure_freq(&got.right[mid.clone()], 44_100);
    assert!((f - 3000.0).abs() < 0.1, "{f} Hz");
    // Time alignment: the output matches a 44.1 kHz sine of the same phase.
    let want = sine(1000.0, 0.5, 44_100, 44_100 * 3);
    let err = max_abs_diff(&got.left[mid.clone()], &want[mid]);
    assert!(err < 0.01, "misaligned by {err}");
}

#[test]
fn upsamples_22k05() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("22k.flac");
    let sig = StereoChunk::from_planar(sine(440.0, 0.5, 22_050, 22_050), sine(440.0, 0.5, 22_050, 22_050));
    write_stem(&path, &sig, OutputFormat::Flac16, ClipMode::None, 22_050);
    let got = decode_all(&path, DecodeOptions::default()).unwrap();
    assert_eq!(got.len(), 44_100);
    let f = measure_freq(&got.left[10_000..34_000], 44_100);
    assert!((f - 440.0).abs() < 0.05, "{f}");
    let want = sine(440.0, 0.5, 44_100, 44_100);
    let err = max_abs_diff(&got.left[10_000..34_000], &want[10_000..34_000]);
    assert!(err < 0.005, "misaligned by {err}");
}

fn hound_write(path: &Path, channels: u16, rate: u32, data: &[Vec<f32>]) {
    let spec =
        hound::WavSpec { channels, sample_rate: rate, bits_per_sample: 16, sample_format: hound::SampleFormat::Int };
    let mut w = hound::WavWriter::new(BufWriter::new(File::create(path).unwrap()), spec).unwrap();
    for i in 0..data[0].len() {
        for ch in data {
            w.write_sample((ch[i] * 32767.0).round() as i16).unwrap();
        }
    }
    w.finalize().unwrap();
}

#[test]
fn mono_becomes_stereo() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mono.wav");
    let m = sine(300.0, 0.6, 44_100, 10_000);
    hound_write(&path, 1, 44_100, std::slice::from_ref(&m));
    let got = decode_all(&path, DecodeOptions::default()).unwrap();
    assert_eq!(got.left, got.right);
    assert!(max_abs_diff(&got.left, &m) < 2.0 / 32768.0);
}

#[test]
fn six_channels_downmix_to_stereo() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("51.wav");
    let n = 8000;
    let fl = sine(200.0, 0.5, 44_100, n);
    let fc = sine(500.0, 0.5, 44_100, n);
    let lfe = sine(50.0, 0.9, 44_100, n);
    let zero = vec![0.0f32; n];
    // hound writes WAVEFORMATEXTENSIBLE with mask 0x3F: FL FR FC LFE BL BR.
    hound_write(&path, 6, 44_100, &[fl.clone(), zero.clone(), fc.clone(), lfe, zero.clone(), zero]);
    let d = Decoder::open_path(&path, DecodeOptions::default()).unwrap();
    assert_eq!(d.info().channels, 6);
    let got = decode_all(&path, DecodeOptions::default()).unwrap();
    // ffmpeg's `-ac 2` fold to float (what demucs reads): not normalised.
    let h = std::f32::consts::FRAC_1_SQRT_2;
    let want_l: Vec<f32> = fl.iter().zip(&fc).map(|(a, c)| a + h * c).collect();
    let want_r: Vec<f32> = fc.iter().map(|c| h * c).collect();
    assert!(max_abs_diff(&got.left, &want_l) < 1e-3, "left");
    assert!(max_abs_diff(&got.right, &want_r) < 1e-3, "right (LFE must be dropped)");
}

#[test]
fn summary_gives_hash_and_duration() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.flac");
    let sig = test_signal(44_100, 66_150);
    write_stem(&path, &sig, OutputFormat::Flac16, ClipMode::Clamp, 44_100);
    let s = summarize_file(&path).unwrap();
    assert_eq!(s.sha256.len(), 64);
    assert!((s.duration_secs - 1.5).abs() < 1e-9);
    assert_eq!(s.bytes, std::fs::metadata(&path).unwrap().len());
    assert_eq!(s.sample_rate, 44_100);
    // Stable: same content, same hash.
    let path2 = dir.path().join("s2.flac");
    write_stem(&path2, &sig, OutputFormat::Flac16, ClipMode::Clamp, 44_100);
    assert_eq!(summarize_file(&path2).unwrap().sha256, s.sha256);
    let s = summarize_file(fixture("sine_440_660.ogg")).unwrap();
    assert!((s.duration_secs - 2.0).abs() < 0.1, "{}", s.duration_secs);
}

#[test]
fn decodes_wav_written_by_another_encoder_24_and_32_bit_int() {
    // hound is an independent writer: checks the decoder, not just our own writer.
    let dir = tempfile::tempdir().unwrap();
    let l = sine(440.0, 0.5, 44_100, 5000);
    let r = sine(660.0, 0.25, 44_100, 5000);
    for bits in [16u16, 24, 32] {
        let path = dir.path().join(format!("int{bits}.wav"));
        let spec = hound::WavSpec {
            channels: 2,
            sample_rate: 44_100,
            bits_per_sample: bits,
            sample_format: hound::SampleFormat::Int,
        };
        let scale = (1i64 << (bits - 1)) as f64;
        let mut w = hound::WavWriter::create(&path, spec).unwrap();
        for i in 0..l.len() {
            w.write_sample((l[i] as f64 * scale).round() as i32).unwrap();
            w.write_sample((r[i] as f64 * scale).round() as i32).unwrap();
        }
        w.finalize().unwrap();
        let got = decode_all(&path, DecodeOptions::default()).unwrap();
        let tol = (1.0 / scale) as f32 + 1e-7;
        assert!(max_abs_diff(&got.left, &l) <= tol, "{bits}-bit left");
        assert!(max_abs_diff(&got.right, &r) <= tol, "{bits}-bit right");
    }
}
