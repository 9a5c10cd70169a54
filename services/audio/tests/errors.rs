//! Every class of bad input gives its own `AudioError` variant with a
//! message a person understands.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use stemq_audio::{AudioError, ClipMode, DecodeOptions, Decoder, OutputFormat, StemEncoder, StereoChunk};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn decode_err(path: &Path, opts: DecodeOptions) -> AudioError {
    match decode_all(path, opts) {
        Ok(c) => panic!("{} decoded {} frames instead of failing", path.display(), c.len()),
        Err(e) => e,
    }
}

fn write_tone(path: &Path, format: OutputFormat, seconds: f64) {
    let n = (44_100.0 * seconds) as usize;
    let mut noise = Noise(3);
    let l: Vec<f32> = sine(440.0, 0.4, 44_100, n).iter().map(|x| x + 0.1 * noise.next()).collect();
    let chunk = StereoChunk::from_planar(l.clone(), l);
    let mut enc = StemEncoder::create(path, format, ClipMode::Clamp, 44_100).unwrap();
    enc.write(&chunk).unwrap();
    enc.finish().unwrap();
}

#[test]
fn random_bytes_are_not_audio() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("noise.mp3");
    let mut n = Noise(99);
    let bytes: Vec<u8> = (0..50_000).map(|_| (n.next() * 127.0) as i8 as u8).collect();
    std::fs::write(&path, bytes).unwrap();
    let e = decode_err(&path, DecodeOptions::default());
    assert!(matches!(e, AudioError::NotAudio { .. }), "{e:?}");
    assert!(e.to_string().starts_with("not a valid audio file"), "{e}");
    assert!(e.is_input_error());

    let text = dir.path().join("readme.txt");
    std::fs::write(&text, "hello, this is not a song").unwrap();
    assert!(matches!(decode_err(&text, DecodeOptions::default()), AudioError::NotAudio { .. }));

    let zero = dir.path().join("zero.wav");
    std::fs::write(&zero, b"").unwrap();
    assert!(matches!(decode_err(&zero, DecodeOptions::default()), AudioError::NotAudio { .. }));
}

#[test]
fn header_without_samples_is_empty() {
    let dir = tempfile::tempdir().unwrap();
    for fmt in [OutputFormat::Wav16, OutputFormat::WavF32, OutputFormat::Flac16] {
        let path = dir.path().join(format!("empty.{}", fmt.extension()));
        StemEncoder::create(&path, fmt, ClipMode::None, 44_100).unwrap().finish().unwrap();
        let e = decode_err(&path, DecodeOptions::default());
        assert!(matches!(e, AudioError::Empty), "{fmt:?}: {e:?}");
        assert_eq!(e.to_string(), "the audio file is empty: it contains no samples");
    }
}

#[test]
fn too_long_is_rejected_from_the_header_and_while_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.wav");
    write_tone(&path, OutputFormat::Wav16, 3.0);
    let opts = DecodeOptions { max_duration_secs: Some(1.0), ..Default::default() };
    // From the header: open fails before any decoding.
    match Decoder::open_path(&path, opts.clone()) {
        Err(AudioError::TooLong { duration, max }) => {
            assert_eq!(duration, "00:03");
            assert_eq!(max, "00:01");
        }
        other => panic!("{:?}", other.map(|d| d.info().clone())),
    }
    // Lossy fixtures (2 s) against a 1 s limit, whichever way the length is found.
    for name in ["sine_440_660.mp3", "sine_440_660.ogg"] {
        let e = decode_err(&fixture(name), opts.clone());
        assert!(matches!(e, AudioError::TooLong { .. }), "{name}: {e:?}");
        assert!(e.to_string().contains("too long"), "{e}");
    }
    // Within the limit: fine.
    let ok = DecodeOptions { max_duration_secs: Some(3.5), ..Default::default() };
    assert_eq!(decode_all(&path, ok).unwrap().len(), 3 * 44_100);
}

#[test]
fn truncated_flac_reports_where_it_breaks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.flac");
    write_tone(&path, OutputFormat::Flac16, 4.0);
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.flac");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = decode_err(&cut, DecodeOptions::default());
    match &e {
        AudioError::CorruptFrame { at, .. } => assert!(at == "00:01" || at == "00:02", "{at}"),
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().starts_with("corrupt audio frame at 00:0"), "{e}");
}

#[test]
fn corrupted_flac_reports_a_corrupt_frame() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.flac");
    write_tone(&path, OutputFormat::Flac16, 4.0);
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    let mut n = Noise(5);
    for b in &mut bytes[mid..mid + 2000] {
        *b = (n.next() * 127.0) as i8 as u8;
    }
    let bad = dir.path().join("bad.flac");
    std::fs::write(&bad, &bytes).unwrap();
    let e = decode_err(&bad, DecodeOptions::default());
    match &e {
        AudioError::CorruptFrame { at, .. } => assert!(at == "00:01" || at == "00:02", "{at}: {e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_mp3_gives_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(fixture("sine_440_660.mp3")).unwrap();
    let cut = dir.path().join("cut.mp3");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = decode_err(&cut, DecodeOptions::default());
    assert!(matches!(e, AudioError::CorruptFrame { .. }), "{e:?}");
    assert!(e.to_string().contains("at 00:00") || e.to_string().contains("at 00:01"), "{e}");
}

fn wav_with_tag(tag: u16) -> Vec<u8> {
    let data = vec![0u8; 4000];
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&((4 + 8 + 16 + 8 + data.len()) as u32).to_le_bytes());
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&16u32.to_le_bytes());
    v.extend_from_slice(&tag.to_le_bytes());
    v.extend_from_slice(&2u16.to_le_bytes());
    v.extend_from_slice(&44_100u32.to_le_bytes());
    v.extend_from_slice(&16_000u32.to_le_bytes());
    v.extend_from_slice(&1u16.to_le_bytes());
    v.extend_from_slice(&0u16.to_le_bytes());
    v.extend_from_slice(b"data");
    v.extend_from_slice(&(data.len() as u32).to_le_bytes());
    v.extend_from_slice(&data);
    v
}

#[test]
fn unsupported_codec_is_named() {
    let dir = tempfile::tempdir().unwrap();
    for (tag, name) in [(0x0055u16, "MP3 inside WAV"), (0x00FF, "AAC"), (0x1234, "0x1234")] {
        let path = dir.path().join(format!("tag{tag:04x}.wav"));
        std::fs::write(&path, wav_with_tag(tag)).unwrap();
        let e = decode_err(&path, DecodeOptions::default());
        match &e {
            AudioError::UnsupportedCodec { codec } => assert!(codec.contains(name), "{codec}"),
            other => panic!("tag {tag:#x}: {other:?}"),
        }
        assert!(e.to_string().starts_with("unsupported audio codec: "), "{e}");
        assert!(e.is_input_error());
    }
}

#[test]
fn io_errors_are_separate() {
    let e = Decoder::open_path("/nonexistent/dir/song.wav", DecodeOptions::default()).err().unwrap();
    assert!(matches!(e, AudioError::Io(_)), "{e:?}");
    assert!(!e.is_input_error());
}
