//! Fuzz target: the audio decoders (WAV, AIFF, CAF, FLAC, MP3, Ogg Vorbis and Opus,
//! MP4/M4A with AAC-LC, HE-AAC and ALAC, raw AAC (ADTS), WebM/Matroska with Opus and
//! Vorbis) through
//! [`Decoder::open`] and [`Decoder::next_chunk`], the entry both engines decode
//! through, with the engines' options; errors are mapped with the engine seam's
//! `engine_error`, as the worker sees them.
//!
//! Properties: never panics out of the decoder, never hangs; every failure on these
//! in-memory bytes is a permanent input error (`InvalidInput`, never transient, never
//! an engine fault); the decoded stream never exceeds [`MAX_EXPANSION`] times the input.
//! Each input decodes at most half a second, so memory per input stays small.
//! Corpus: `tests/corpus/audio/` (how each seed is made: `tests/corpus/README.md`); knobs in
//! `services/core/tests/fuzz_harness/mod.rs`.

#[path = "../../core/tests/fuzz_harness/mod.rs"]
mod fuzz_harness;

use std::io::Cursor;
use std::path::Path;

use fuzz_harness::{fuzz, Target};
use stemq_audio::decode::MAX_EXPANSION;
use stemq_audio::engine::engine_error;
use stemq_audio::{AudioError, DecodeOptions, Decoder, ENGINE_SAMPLE_RATE};
use stemq_core::engine::EngineError;

const DICTIONARY: &[&[u8]] = &[
    b"RIFF",
    b"WAVE",
    b"fmt ",
    b"data",
    b"LIST",
    b"fact",
    b"fLaC",
    b"\xff\xf8",
    b"\xff\xf9",
    b"OggS",
    b"\x01vorbis",
    b"\x05vorbis",
    b"\xff\xfb",
    b"\xff\xe3",
    b"ID3\x04\x00",
    b"Xing",
    b"Info",
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\x01\x00\x02\x00\x44\xac\x00\x00",
    b"\xfe\xff",
    b"OpusHead",
    b"OpusTags",
    b"ftyp",
    b"M4A ",
    b"moov",
    b"mdat",
    b"trak",
    b"mdia",
    b"hdlr",
    b"soun",
    b"minf",
    b"stbl",
    b"stsd",
    b"stts",
    b"stsz",
    b"stco",
    b"mp4a",
    b"esds",
    b"alac",
    b"elst",
    b"\x1a\x45\xdf\xa3",
    b"webm",
    b"\x18\x53\x80\x67",
    b"\x16\x54\xae\x6b",
    b"\x1f\x43\xb6\x75",
    b"A_OPUS",
    b"A_VORBIS",
    b"\xa0",
    b"\x75\xa2",
    b"\xff\xf1",
    b"FORM",
    b"AIFF",
    b"AIFC",
    b"COMM",
    b"SSND",
    b"caff",
    b"desc",
    b"pakt",
];

/// Output frames decoded per input at most (half a second at 44.1 kHz).
const MAX_FRAMES: u64 = 22_050;

fn check_error(e: AudioError, input: &[u8]) {
    let shown = e.to_string();
    match engine_error(e) {
        EngineError::InvalidInput { .. } => {}
        other => panic!("{} bytes: `{shown}` became {other:?}, not a permanent input error", input.len()),
    }
}

#[test]
fn fuzz_audio_decoders() {
    let target = Target {
        name: "audio",
        corpus: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/audio"),
        dictionary: DICTIONARY,
        max_len: 16 * 1024,
    };
    fuzz(target, |input| {
        let opts = DecodeOptions { target_sample_rate: ENGINE_SAMPLE_RATE, max_duration_secs: Some(3.0 * 3600.0) };
        let mut d = match Decoder::open(Cursor::new(input.to_vec()), opts) {
            Ok(d) => d,
            Err(e) => {
                check_error(e, input);
                return false;
            }
        };
        let mut frames = 0u64;
        loop {
            match d.next_chunk() {
                Ok(Some(c)) => {
                    assert_eq!(c.left.len(), c.right.len());
                    frames += c.len() as u64;
                    assert!(
                        frames * 8 <= MAX_EXPANSION * input.len() as u64,
                        "{frames} frames decoded from {} bytes",
                        input.len()
                    );
                    if frames >= MAX_FRAMES {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    check_error(e, input);
                    return false;
                }
            }
        }
        true
    });
}
