//! Issue 11, items 3 and 4: input the decoder cannot handle fails once, as bad input
//! (`invalid_audio`, permanent), through the same `Engine::separate` entry the worker
//! calls; it never panics, and it never turns a few bytes into gigabytes of stems.

mod common;

use std::io::{Cursor, Read, Seek, SeekFrom};
use std::path::Path;

use common::Noise;
use serde_json::json;
use stemq_audio::decode::{MAX_EXPANSION, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE};
use stemq_audio::{AudioError, DecodeOptions, Decoder, DspEngine};
use stemq_core::engine::{Engine, EngineContext, EngineError, EngineJob};
use stemq_core::request::{JobRequest, ANONYMOUS};

struct NoCtx;

impl EngineContext for NoCtx {
    fn progress(&self, _: f32, _: &str) {}
    fn cancelled(&self) -> bool {
        false
    }
}

/// Runs the `dsp` engine on `bytes` (saved as `in.<ext>`); the error, and how many stem
/// bytes were left in the output folder.
fn separate(bytes: &[u8], ext: &str) -> (Result<(), EngineError>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join(format!("in.{ext}"));
    std::fs::write(&input, bytes).unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let req = JobRequest::from_value(json!({"audio_uri": "file:///x/in", "model": "dsp"}))
        .unwrap()
        .normalize(ANONYMOUS)
        .unwrap();
    let id = req.job_id();
    let job = EngineJob {
        job_id: &id,
        request: &req,
        metadata: None,
        attempt: 1,
        input: &input,
        out_dir: &out,
        device: &stemq_core::device::Device::Cpu,
        segment: None,
    };
    let r = DspEngine::default().separate(&job, &NoCtx).map(|_| ());
    (r, dir_bytes(&out))
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

/// `code` and `message` of a permanent input error, or a panic saying what came instead.
fn invalid(r: Result<(), EngineError>) -> (String, String) {
    match r {
        Err(EngineError::InvalidInput { code, message }) => (code.to_string(), message),
        other => panic!("expected a permanent input error, got {other:?}"),
    }
}

/// A canonical 44-byte-header PCM WAV with `data` as its samples.
fn wav(rate: u32, channels: u16, bits: u16, data: &[u8]) -> Vec<u8> {
    let block = channels * bits / 8;
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&16u32.to_le_bytes());
    v.extend_from_slice(&1u16.to_le_bytes());
    v.extend_from_slice(&channels.to_le_bytes());
    v.extend_from_slice(&rate.to_le_bytes());
    v.extend_from_slice(&rate.wrapping_mul(u32::from(block)).to_le_bytes());
    v.extend_from_slice(&block.to_le_bytes());
    v.extend_from_slice(&bits.to_le_bytes());
    v.extend_from_slice(b"data");
    v.extend_from_slice(&(data.len() as u32).to_le_bytes());
    v.extend_from_slice(data);
    v
}

fn noise_bytes(n: usize) -> Vec<u8> {
    let mut noise = Noise(7);
    (0..n).map(|_| (noise.next() * 100.0) as i8 as u8).collect()
}

#[test]
fn issue_11_a_zero_hz_wav_is_invalid_audio_not_a_panic() {
    let (code, message) = invalid(separate(&wav(0, 1, 16, &noise_bytes(200)), "wav").0);
    assert_eq!(code, "invalid_audio", "{message}");
    assert!(message.contains("0 Hz"), "{message}");
    assert!(!message.contains("panicked"), "{message}");
}

#[test]
fn issue_11_sample_rates_outside_8_to_384_khz_are_refused_with_the_rate() {
    // The issue's 244-byte 1 Hz WAV (unchecked, it "succeeds" with 70 MB of stems), a 4 GHz
    // header, and the first rates past each bound.
    for rate in [1, 4_000_000_000, MIN_SAMPLE_RATE - 1, MAX_SAMPLE_RATE + 1] {
        let bytes = wav(rate, 1, 16, &noise_bytes(200));
        assert_eq!(bytes.len(), 244);
        let (r, written) = separate(&bytes, "wav");
        let (code, message) = invalid(r);
        assert_eq!(code, "invalid_audio", "{rate} Hz: {message}");
        assert!(message.contains(&format!("{rate} Hz")), "{rate} Hz: {message}");
        assert_eq!(written, 0, "{rate} Hz left {written} bytes of stems");
    }
    // Both bounds are accepted.
    for rate in [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE] {
        let bytes = wav(rate, 2, 16, &noise_bytes(rate as usize / 10 * 4));
        let (r, written) = separate(&bytes, "wav");
        r.unwrap_or_else(|e| panic!("{rate} Hz: {e:?}"));
        assert!(written > 0);
    }
}

/// A FLAC file of `blocks` constant (silent) blocks of 65 535 mono samples at 8 kHz:
/// about 12 bytes a block, 2.9 MB a block once decoded to 44.1 kHz stereo `f32`. With
/// `declare_length` the STREAMINFO states the total, else it says "unknown".
fn constant_flac(blocks: u64, declare_length: bool) -> Vec<u8> {
    const N: u64 = 65_535;
    let mut v = b"fLaC".to_vec();
    v.extend_from_slice(&[0x80, 0, 0, 34]); // last block, STREAMINFO, 34 bytes
    v.extend_from_slice(&(N as u16).to_be_bytes()); // min block size
    v.extend_from_slice(&(N as u16).to_be_bytes()); // max block size
    v.extend_from_slice(&[0; 6]); // frame sizes unknown
    let total = if declare_length { blocks * N } else { 0 };
    // rate (20) | channels-1 (3) | bits-1 (5) | total samples (36)
    let packed = (8_000u64 << 44) | (15 << 36) | total;
    v.extend_from_slice(&packed.to_be_bytes());
    v.extend_from_slice(&[0; 16]); // MD5 unknown
    for i in 0..blocks {
        let mut f = vec![0xFF, 0xF8]; // sync, fixed block size
        f.push(0x70); // block size: 16 bits at the end of the header; rate: from STREAMINFO
        f.push(0x08); // mono, 16 bits
        assert!(i < 128);
        f.push(i as u8); // frame number (UTF-8 coded, < 128)
        f.extend_from_slice(&((N - 1) as u16).to_be_bytes());
        f.push(crc8(&f));
        f.push(0x00); // CONSTANT subframe
        f.extend_from_slice(&0i16.to_be_bytes());
        let c = crc16(&f);
        f.extend_from_slice(&c.to_be_bytes());
        v.extend_from_slice(&f);
    }
    v
}

fn crc8(data: &[u8]) -> u8 {
    let mut crc = 0u8;
    for &b in data {
        crc ^= b;
        for _ in 0..8 {
            crc = if crc & 0x80 != 0 { (crc << 1) ^ 0x07 } else { crc << 1 };
        }
    }
    crc
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x8005 } else { crc << 1 };
        }
    }
    crc
}

#[test]
fn issue_11_output_larger_than_max_expansion_times_the_input_is_refused() {
    // Forty constant blocks: over 100 000 times their size once decoded. Refused from
    // the header when it states the length, and while decoding when it does not,
    // before the stems are finished (and nothing is left of them).
    for declare in [true, false] {
        let bytes = constant_flac(40, declare);
        assert!(bytes.len() < 1000, "{}", bytes.len());
        assert!(40 * 361_261 * 8 > 100_000 * bytes.len());
        let (r, written) = separate(&bytes, "flac");
        let (code, message) = invalid(r);
        assert_eq!(code, "invalid_audio", "{message}");
        assert!(message.contains(&format!("more than {MAX_EXPANSION} times its size")), "{message}");
        assert_eq!(written, 0);
    }
    let e = Decoder::open(Cursor::new(constant_flac(40, true)), DecodeOptions::default()).err().unwrap();
    assert!(matches!(e, AudioError::TooLarge { .. }), "{e:?}");
    assert!(e.is_input_error());
}

/// A source that panics once `after` bytes have been read: a stand-in for any bug
/// inside the decoder that a crafted file can reach.
struct PanicsAfter {
    inner: Cursor<Vec<u8>>,
    after: u64,
}

impl Read for PanicsAfter {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.inner.position() >= self.after {
            panic!("index out of bounds: the len is 3 but the index is 7");
        }
        self.inner.read(buf)
    }
}

impl Seek for PanicsAfter {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.inner.seek(pos)
    }
}

#[test]
fn issue_11_a_panic_inside_decoding_is_bad_input() {
    let bytes = wav(44_100, 2, 16, &noise_bytes(400_000));
    // While probing, and halfway through the samples.
    for after in [20, 200_000] {
        let src = PanicsAfter { inner: Cursor::new(bytes.clone()), after };
        let e = Decoder::open(src, DecodeOptions::default())
            .and_then(|mut d| {
                while d.next_chunk()?.is_some() {}
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(e, AudioError::Undecodable { .. }), "{after}: {e:?}");
        assert!(e.is_input_error());
        match stemq_audio::engine::engine_error(e) {
            EngineError::InvalidInput { code, message } => {
                assert_eq!(code, "invalid_audio");
                assert!(message.contains("the decoder failed on it: index out of bounds"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A 16-bit stereo WAVE_FORMAT_EXTENSIBLE file with the given channel mask.
fn wavex(mask: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&(60 + data.len() as u32).to_le_bytes());
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&40u32.to_le_bytes());
    v.extend_from_slice(&0xFFFEu16.to_le_bytes());
    v.extend_from_slice(&2u16.to_le_bytes());
    v.extend_from_slice(&44_100u32.to_le_bytes());
    v.extend_from_slice(&(44_100u32 * 4).to_le_bytes());
    v.extend_from_slice(&4u16.to_le_bytes());
    v.extend_from_slice(&16u16.to_le_bytes());
    v.extend_from_slice(&22u16.to_le_bytes()); // extension size
    v.extend_from_slice(&16u16.to_le_bytes()); // valid bits
    v.extend_from_slice(&mask.to_le_bytes());
    v.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0x10, 0, 0x80, 0, 0, 0xAA, 0, 0x38, 0x9B, 0x71]); // PCM
    v.extend_from_slice(b"data");
    v.extend_from_slice(&(data.len() as u32).to_le_bytes());
    v.extend_from_slice(data);
    v
}

/// Found by `tests/fuzz.rs`: a channel mask with only its top bit set for two channels
/// makes symphonia's WAV reader shift a `u32` by 32 bits while fixing the mask, which
/// panics where overflow checks are on (test builds; release builds wrap instead).
#[test]
#[cfg(debug_assertions)]
fn issue_11_a_panic_inside_symphonia_is_invalid_audio() {
    let (code, message) = invalid(separate(&wavex(0x8000_0000, &noise_bytes(4000)), "wav").0);
    assert_eq!(code, "invalid_audio", "{message}");
    assert!(message.contains("the decoder failed on it: attempt to shift left with overflow"), "{message}");
    // The same file with an ordinary mask decodes.
    let (r, written) = separate(&wavex(0x3, &noise_bytes(4000)), "wav");
    r.unwrap();
    assert!(written > 0);
}

/// Found by `tests/fuzz.rs` (CI, 2026-12-01): a FLAC stream after a few bytes of junk,
/// whose PICTURE block claims 2 GB of picture data. symphonia's probe skips the junk to
/// the `fLaC` marker and then allocated the claimed length (an abort, not a panic: the
/// process died). The length check must look where symphonia looks.
#[test]
fn a_hostile_flac_picture_after_junk_is_refused_not_an_abort() {
    let mut flac = constant_flac(1, true);
    flac[4] = 0x00; // STREAMINFO not flagged as the last block
    let mut picture = Vec::new();
    picture.extend_from_slice(&3u32.to_be_bytes()); // front cover
    picture.extend_from_slice(&9u32.to_be_bytes());
    picture.extend_from_slice(b"image/png");
    picture.extend_from_slice(&0u32.to_be_bytes()); // no description
    picture.extend_from_slice(&[0; 16]); // width, height, depth, colours
    picture.extend_from_slice(&0x7990_0000u32.to_be_bytes()); // 2 GB of data, none there
    let mut block = vec![0x86]; // last block, PICTURE
    block.extend_from_slice(&(picture.len() as u32).to_be_bytes()[1..]);
    block.extend_from_slice(&picture);
    let at = 4 + 4 + 34;
    flac.splice(at..at, block);
    for prefix in [&b""[..], b"junk", &[0u8; 3000]] {
        let mut bytes = prefix.to_vec();
        bytes.extend_from_slice(&flac);
        let (r, _) = separate(&bytes, "flac");
        let (code, message) = invalid(r);
        assert_eq!(code, "invalid_audio", "{} bytes of junk: {message}", prefix.len());
        assert!(message.contains("FLAC picture"), "{message}");
    }
}
