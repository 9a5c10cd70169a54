//! The compressed output formats: FLAC (the MD5 in STREAMINFO is the MD5 of the decoded
//! samples, as `flac -t` checks; symphonia decodes it bit-exactly; its size against
//! libFLAC's default level) and MP3 (symphonia decodes it to the input's length plus
//! LAME's delay and padding, at the input's level; the bit rate and preset are honoured).
//!
//! The FLAC tests also run `flac -t` on our files and compare sizes with `flac -5`
//! (Debian package `flac`, installed by `scripts/install-test-deps.sh`); without it
//! those parts print `SKIPPED` and the rest still runs, and in CI (`CI=true`) they fail.

mod common;

use std::fs::File;
use std::path::Path;
use std::process::Command;

use common::*;
use md5::{Digest, Md5};
use stemq_audio::{ClipMode, DecodeOptions, OutputFormat, StemEncoder, StereoChunk};
use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::DecoderOptions;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// What symphonia reads from a file, straight (no stemq conversion): the interleaved
/// samples as `i32` at full scale, and the track's parameters.
#[cfg_attr(not(feature = "mp3"), allow(dead_code))]
struct Raw {
    samples: Vec<i32>,
    n_frames: Option<u64>,
    delay: Option<u32>,
    padding: Option<u32>,
    sample_rate: u32,
}

fn symphonia_decode(path: &Path) -> Raw {
    let mss = MediaSourceStream::new(Box::new(File::open(path).unwrap()), Default::default());
    let mut hint = Hint::new();
    hint.with_extension(path.extension().unwrap().to_str().unwrap());
    let probed = symphonia::default::get_probe()
        .format(&hint, mss, &FormatOptions::default(), &MetadataOptions::default())
        .unwrap();
    let mut format = probed.format;
    let track = format.default_track().unwrap().clone();
    let params = &track.codec_params;
    let mut dec = symphonia::default::get_codecs().make(params, &DecoderOptions { verify: true }).unwrap();
    let mut samples = Vec::new();
    while let Ok(packet) = format.next_packet() {
        let buf = dec.decode(&packet).unwrap();
        let mut sb = SampleBuffer::<i32>::new(buf.capacity() as u64, *buf.spec());
        sb.copy_interleaved_ref(buf);
        samples.extend_from_slice(sb.samples());
    }
    Raw {
        samples,
        n_frames: params.n_frames,
        delay: params.delay,
        padding: params.padding,
        sample_rate: params.sample_rate.unwrap(),
    }
}

/// The integers stemq writes for a float sample (round, clamp), as `wav::float_to_int`.
fn to_int(x: f32, bits: u32) -> i32 {
    let scale = (1u32 << (bits - 1)) as f32;
    let max = (1i32 << (bits - 1)) - 1;
    ((x * scale).round() as i64).clamp(-(max as i64) - 1, max as i64) as i32
}

/// Whether the `flac` command line runs (the skip rule: `common::have_tool`).
fn have_flac(what: &str) -> bool {
    have_tool("flac", "--version", what)
}

/// A test signal: two sines plus a little noise, with a partial last block.
fn tones_with_noise(frames: usize) -> StereoChunk {
    let mut n = Noise(42);
    let l = sine(440.0, 0.5, 44_100, frames);
    let r = sine(660.0, 0.4, 44_100, frames);
    StereoChunk::from_planar(
        l.iter().map(|&x| x + 0.05 * n.next()).collect(),
        r.iter().map(|&x| x + 0.05 * n.next()).collect(),
    )
}

#[test]
fn flac_md5_is_the_md5_of_the_decoded_samples_and_symphonia_decodes_it_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    // Full-scale clips, a loud partial last block (4096 does not divide the length) and
    // silence, so every subframe type appears.
    let mut sig = tones_with_noise(3 * 44_100 + 1234);
    sig.left.extend((0..5000).map(|i| if i % 3 == 0 { 1.2 } else { -0.9 }));
    sig.right.extend(std::iter::repeat_n(0.0, 5000));
    for (format, bits) in [(OutputFormat::Flac16, 16u32), (OutputFormat::Flac24, 24)] {
        let path = dir.path().join(format!("md5_{bits}.flac"));
        write_stem(&path, &sig, format, ClipMode::None, 44_100);
        let bytes = std::fs::read(&path).unwrap();
        let md5_in_file = &bytes[8 + 18..8 + 34];
        assert_ne!(md5_in_file, [0u8; 16], "MD5 left unset");

        let raw = symphonia_decode(&path);
        assert_eq!(raw.n_frames, Some(sig.len() as u64));
        // symphonia's i32 samples are the file's, shifted to full scale.
        let decoded: Vec<i32> = raw.samples.iter().map(|&s| s >> (32 - bits)).collect();
        let want: Vec<i32> =
            sig.left.iter().zip(&sig.right).flat_map(|(&l, &r)| [to_int(l, bits), to_int(r, bits)]).collect();
        assert!(decoded == want, "{bits}-bit FLAC does not decode to the samples written");

        let mut md5 = Md5::new();
        for s in &decoded {
            md5.update(&s.to_le_bytes()[..bits as usize / 8]);
        }
        assert_eq!(md5.finalize().as_slice(), md5_in_file, "{bits}-bit: STREAMINFO MD5");

        if have_flac("`flac -t` on our FLAC") {
            let out = Command::new("flac").args(["-t", "-s"]).arg(&path).output().unwrap();
            assert!(out.status.success(), "flac -t: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

#[test]
fn flac_compresses_close_to_libflac_default_level() {
    let dir = tempfile::tempdir().unwrap();
    let wav = dir.path().join("demo.wav");
    stemq_audio::synth::write_demo_song(&wav, 20.0, 44_100).unwrap();
    let song = decode_all(&wav, DecodeOptions::default()).unwrap();
    let ours = dir.path().join("ours.flac");
    write_stem(&ours, &song, OutputFormat::Flac16, ClipMode::None, 44_100);
    let wav_bytes = std::fs::metadata(&wav).unwrap().len();
    let our_bytes = std::fs::metadata(&ours).unwrap().len();
    eprintln!(
        "demo song, 20 s: WAV {wav_bytes} B, stemq FLAC {our_bytes} B ({:.1} % of WAV)",
        100.0 * our_bytes as f64 / wav_bytes as f64
    );
    // Measured (docs/benchmarks.md): libFLAC -5 makes these 20 s 32.5 % of the WAV and
    // stemq 32.1 %.
    assert!((our_bytes as f64) < 0.335 * wav_bytes as f64, "{our_bytes} of {wav_bytes}");
    if have_flac("the size comparison with `flac -5`") {
        let theirs = dir.path().join("libflac.flac");
        let out = Command::new("flac").args(["-5", "-s", "-f", "-o"]).arg(&theirs).arg(&wav).output().unwrap();
        assert!(out.status.success(), "flac -5: {}", String::from_utf8_lossy(&out.stderr));
        let their_bytes = std::fs::metadata(&theirs).unwrap().len();
        let ratio = our_bytes as f64 / their_bytes as f64;
        eprintln!("libFLAC -5: {their_bytes} B; stemq / libFLAC = {ratio:.4}");
        assert!(ratio < 1.03, "stemq's FLAC is {:.1} % larger than libFLAC -5", 100.0 * (ratio - 1.0));
    }
}

/// A build without the `mp3` feature refuses MP3 with an error that says why.
#[cfg(not(feature = "mp3"))]
#[test]
fn mp3_is_refused_without_the_feature() {
    let dir = tempfile::tempdir().unwrap();
    let format = OutputFormat::Mp3(stemq_audio::Mp3Settings::default());
    let e = StemEncoder::create(dir.path().join("x.mp3"), format, ClipMode::Clamp, 44_100).err().unwrap();
    assert!(matches!(e, stemq_audio::AudioError::FormatUnavailable { .. }), "{e}");
    assert!(e.to_string().contains("`mp3` feature"), "{e}");
}

#[cfg(feature = "mp3")]
mod mp3 {
    use stemq_audio::{summarize_file, Mp3Settings};

    use super::*;

    fn mp3(bitrate_kbps: u16, quality: u8) -> OutputFormat {
        OutputFormat::Mp3(Mp3Settings { bitrate_kbps, quality })
    }

    fn rms(x: impl Iterator<Item = f64>) -> f64 {
        let (sum, n) = x.fold((0.0, 0usize), |(s, n), v| (s + v * v, n + 1));
        (sum / n as f64).sqrt()
    }

    #[test]
    fn mp3_decodes_to_the_input_length_and_level() {
        let dir = tempfile::tempdir().unwrap();
        let frames = 3 * 44_100 + 777;
        let sig = StereoChunk::from_planar(sine(440.0, 0.5, 44_100, frames), sine(660.0, 0.3, 44_100, frames));
        let path = dir.path().join("tones.mp3");
        write_stem(&path, &sig, OutputFormat::Mp3(Mp3Settings::default()), ClipMode::Rescale, 44_100);
        let bytes = std::fs::read(&path).unwrap();
        // MPEG-1 Layer III frame sync, then LAME's Info frame (CBR) with its tag.
        assert_eq!((bytes[0], bytes[1] & 0xFE), (0xFF, 0xFA), "not an MPEG-1 Layer III frame");
        assert!(bytes.windows(4).take(64).any(|w| w == b"Info"), "no Info frame");

        let raw = symphonia_decode(&path);
        assert_eq!(raw.sample_rate, 44_100);
        let (delay, padding) = (raw.delay.expect("LAME tag: delay") as usize, raw.padding.unwrap() as usize);
        let decoded = raw.samples.len() / 2;
        // The Info frame was written back: it counts every frame of the file, and its
        // delay and padding account exactly for what is not the input.
        assert_eq!(raw.n_frames, Some(decoded as u64));
        assert_eq!(decoded, delay + frames + padding, "delay {delay}, padding {padding}");
        // Longer than the input by LAME's delay (576 + the decoder's 529) and less than
        // one frame (1152) of padding beyond the decoder's delay.
        assert_eq!(delay, 1105);
        assert!(decoded >= frames && decoded < frames + delay + 1152, "{decoded} for {frames}");

        // stemq's own decoder reads the same length.
        let ours = decode_all(&path, DecodeOptions::default()).unwrap();
        assert_eq!(ours.len(), decoded);
        let summary = summarize_file(&path).unwrap();
        assert!((summary.duration_secs - decoded as f64 / 44_100.0).abs() < 1e-9);

        // Level and waveform: aligned by the delay, away from the edges.
        let (a, b) = (2048, frames - 2048);
        let got_l = || ours.left[delay + a..delay + b].iter().map(|&x| x as f64);
        let want_l = || sig.left[a..b].iter().map(|&x| x as f64);
        let level_db = 20.0 * (rms(got_l()) / rms(want_l())).log10();
        assert!(level_db.abs() < 0.2, "left level off by {level_db:.2} dB");
        let noise = rms(got_l().zip(want_l()).map(|(g, w)| g - w));
        let snr = 20.0 * (rms(want_l()) / noise).log10();
        assert!(snr > 30.0, "left SNR {snr:.1} dB");
        let got_r = ours.right[delay + a..delay + b].iter().map(|&x| x as f64);
        let level_db = 20.0 * (rms(got_r) / rms(sig.right[a..b].iter().map(|&x| x as f64))).log10();
        assert!(level_db.abs() < 0.2, "right level off by {level_db:.2} dB");
        eprintln!("MP3 320 kbps preset 2: {} B for {frames} frames; left SNR {snr:.1} dB", bytes.len());
    }

    #[test]
    fn mp3_bit_rate_and_preset_are_honoured() {
        let dir = tempfile::tempdir().unwrap();
        let frames = 4 * 44_100;
        let sig = tones_with_noise(frames);
        for (kbps, quality) in [(320u16, 2u8), (128, 2), (56, 7), (32, 7)] {
            let path = dir.path().join(format!("{kbps}_{quality}.mp3"));
            write_stem(&path, &sig, mp3(kbps, quality), ClipMode::Clamp, 44_100);
            let bytes = std::fs::metadata(&path).unwrap().len() as f64;
            let raw = symphonia_decode(&path);
            assert_eq!(raw.sample_rate, 44_100, "{kbps} kbps keeps the stems' rate");
            let secs = raw.n_frames.unwrap() as f64 / 44_100.0;
            let expected = kbps as f64 * 1000.0 / 8.0 * secs;
            // CBR: every frame has the same size (± the padding byte).
            assert!((bytes / expected - 1.0).abs() < 0.02, "{kbps} kbps: {bytes} B, expected {expected:.0}");
        }
    }

    #[test]
    fn mp3_refuses_bit_rates_mpeg1_does_not_have() {
        let dir = tempfile::tempdir().unwrap();
        for kbps in [0u16, 8, 300, 384] {
            let e = StemEncoder::create(dir.path().join("x.mp3"), mp3(kbps, 2), ClipMode::Clamp, 44_100)
                .err()
                .unwrap_or_else(|| panic!("{kbps} kbps accepted"));
            assert!(matches!(e, stemq_audio::AudioError::InvalidArgument(_)), "{e}");
        }
        let e = StemEncoder::create(dir.path().join("x.mp3"), mp3(320, 10), ClipMode::Clamp, 44_100).err().unwrap();
        assert!(matches!(e, stemq_audio::AudioError::InvalidArgument(_)), "{e}");
    }

    #[test]
    fn mp3_writes_to_any_write_seek() {
        let sig = tones_with_noise(10_000);
        let cursor = std::io::Cursor::new(Vec::new());
        let mut enc =
            StemEncoder::new(cursor, OutputFormat::Mp3(Mp3Settings::default()), ClipMode::Clamp, 44_100).unwrap();
        enc.write(&sig).unwrap();
        let bytes = enc.finish().unwrap().into_inner();
        let mut d = stemq_audio::Decoder::open(std::io::Cursor::new(bytes), DecodeOptions::default()).unwrap();
        assert_eq!(d.info().codec, "mp3");
        let mut n = 0;
        while let Some(c) = d.next_chunk().unwrap() {
            n += c.len();
        }
        assert!((10_000..10_000 + 1105 + 1152).contains(&n), "{n}");
    }
}
