//! The formats people have, made at test time by Debian's ffmpeg from one test signal,
//! decoded by stemq and compared with ffmpeg's own decode of the same file; files stemq
//! does not decode are refused naming what they are; truncated and damaged files of each
//! format are permanent input errors.
//!
//! Tolerances, per codec, against ffmpeg's decode at the file's own rate (no resampling),
//! both as `f32`:
//! * PCM (WAV 8/16/24/32-bit, float, double; AIFF, AIFF-C, CAF), ALAC, IMA ADPCM: the
//!   same samples, within 1e-6 (one rounding of the integer to `f32`);
//! * Opus: an SNR of at least 70 dB against ffmpeg with libopus (`-c:a libopus`, the
//!   reference decoder; measured ~78 dB in SILK and CELT modes). ffmpeg's own Opus
//!   decoder resamples SILK differently (18 dB from libopus on speech), so it is no
//!   reference there;
//! * AAC (LC, Main, LTP; HE-AAC and HE-AAC v2 in [`he_aac_decodes_like_ffmpeg`]): at
//!   least 100 dB against ffmpeg's AAC decoder (measured 120–136 dB);
//! * Vorbis: at least 60 dB.
//!
//! Lengths match exactly for PCM, ALAC, Opus (pre-skip and end trimmed: the Ogg granule,
//! Matroska's `DiscardPadding`) and HE-AAC, and within one AAC frame for AAC-LC in MP4
//! (stemq ends where the edit list ends, ffmpeg at the last whole frame).
//!
//! Needs `ffmpeg` (Debian's, installed by `scripts/install-test-deps.sh`); without it the
//! tests print `SKIPPED`, and fail in CI (`CI=true`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use stemq_audio::engine::engine_error;
use stemq_audio::{AudioError, ClipMode, DecodeOptions, Decoder, OutputFormat, StereoChunk, SUPPORTED};
use stemq_core::engine::EngineError;

/// Whether ffmpeg runs here (the skip rule: `common::have_tool`).
fn have_ffmpeg() -> bool {
    have_tool("ffmpeg", "-version", "the input format tests against ffmpeg")
}

fn ffmpeg(args: &[&str]) {
    let out = Command::new("ffmpeg")
        .args(["-hide_banner", "-loglevel", "error", "-y"])
        .args(args)
        .output()
        .expect("ffmpeg runs");
    assert!(out.status.success(), "ffmpeg {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// ffmpeg's encoding of `src` into `out` with these codec arguments.
fn encode(src: &Path, codec_args: &[&str], out: &Path) {
    let mut args = vec!["-i", src.to_str().unwrap()];
    args.extend_from_slice(codec_args);
    args.push(out.to_str().unwrap());
    ffmpeg(&args);
}

/// The test signal: 3 s of stereo at 44.1 kHz, two tones with vibrato and noise, written
/// as 32-bit float WAV (every encoder below reads it).
fn source(dir: &Path) -> PathBuf {
    let rate = 44_100;
    let n = 3 * rate as usize;
    let mut noise = Noise(7);
    let left: Vec<f32> = (0..n)
        .map(|i| {
            let t = i as f64 / f64::from(rate);
            (0.4 * (2.0 * std::f64::consts::PI * 220.0 * t + 2.0 * (5.0 * t).sin()).sin()) as f32 + 0.05 * noise.next()
        })
        .collect();
    let right: Vec<f32> = (0..n)
        .map(|i| {
            let t = i as f64 / f64::from(rate);
            (0.3 * (2.0 * std::f64::consts::PI * 330.0 * t).sin()
                + 0.1 * (2.0 * std::f64::consts::PI * 2500.0 * t).sin()) as f32
                + 0.05 * noise.next()
        })
        .collect();
    let path = dir.join("source.wav");
    write_stem(&path, &StereoChunk::from_planar(left, right), OutputFormat::WavF32, ClipMode::None, rate);
    path
}

/// ffmpeg's decode of `file`: interleaved `f32` at its own rate and channel count.
fn ffmpeg_decode(file: &Path, decoder: Option<&str>, channels: usize) -> Vec<Vec<f32>> {
    let raw = file.with_extension("ffmpeg.f32");
    let mut args = match decoder {
        Some(d) => vec!["-c:a", d],
        None => vec![],
    };
    args.extend(["-i", file.to_str().unwrap(), "-f", "f32le", "-c:a", "pcm_f32le", raw.to_str().unwrap()]);
    ffmpeg(&args);
    let bytes = std::fs::read(&raw).unwrap();
    let samples: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    (0..channels).map(|c| samples.iter().skip(c).step_by(channels).copied().collect()).collect()
}

enum Tol {
    /// Largest difference of any sample.
    Exact(f32),
    /// Smallest signal-to-difference ratio (dB) and largest length difference (frames).
    Snr(f64, usize),
}

struct Case {
    file: &'static str,
    /// ffmpeg's decoder to compare with (`None`: its default for the codec).
    decoder: Option<&'static str>,
    args: &'static [&'static str],
    codec: &'static str,
    channels: usize,
    tol: Tol,
}

const CASES: &[Case] = &[
    Case {
        decoder: None,
        file: "aac.m4a",
        args: &["-c:a", "aac", "-b:a", "192k"],
        codec: "aac",
        channels: 2,
        tol: Tol::Snr(100.0, 1024),
    },
    Case {
        decoder: None,
        file: "aac_main.m4a",
        args: &["-c:a", "aac", "-profile:a", "aac_main", "-b:a", "160k"],
        codec: "aac",
        channels: 2,
        tol: Tol::Snr(100.0, 1024),
    },
    Case {
        decoder: None,
        file: "aac_ltp.m4a",
        args: &["-c:a", "aac", "-profile:a", "aac_ltp", "-strict", "-2", "-b:a", "160k"],
        codec: "aac",
        channels: 2,
        tol: Tol::Snr(100.0, 1024),
    },
    Case {
        decoder: None,
        file: "aac_faststart.mp4",
        args: &["-c:a", "aac", "-b:a", "128k", "-ac", "1", "-movflags", "+faststart"],
        codec: "aac",
        channels: 1,
        tol: Tol::Snr(100.0, 1024),
    },
    Case {
        decoder: None,
        file: "alac.m4a",
        args: &["-c:a", "alac"],
        codec: "alac",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: Some("libopus"),
        file: "opus.opus",
        args: &["-c:a", "libopus", "-b:a", "128k"],
        codec: "opus",
        channels: 2,
        tol: Tol::Snr(70.0, 0),
    },
    Case {
        decoder: Some("libopus"),
        file: "opus_mono_voice.ogg",
        args: &["-c:a", "libopus", "-b:a", "24k", "-ac", "1", "-application", "voip"],
        codec: "opus",
        channels: 1,
        tol: Tol::Snr(70.0, 0),
    },
    Case {
        decoder: Some("libopus"),
        file: "opus.webm",
        args: &["-c:a", "libopus", "-b:a", "96k"],
        codec: "opus",
        channels: 2,
        tol: Tol::Snr(70.0, 0),
    },
    Case {
        decoder: Some("libopus"),
        file: "opus_mono.mka",
        args: &["-c:a", "libopus", "-b:a", "48k", "-ac", "1", "-ar", "24000"],
        codec: "opus",
        channels: 1,
        tol: Tol::Snr(70.0, 0),
    },
    Case {
        decoder: None,
        file: "vorbis.webm",
        args: &["-c:a", "libvorbis", "-q:a", "5"],
        codec: "vorbis",
        channels: 2,
        tol: Tol::Snr(60.0, 2048),
    },
    Case {
        decoder: None,
        file: "s16be.aiff",
        args: &["-c:a", "pcm_s16be"],
        codec: "pcm_s16be",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: None,
        file: "f32be.aifc",
        args: &["-c:a", "pcm_f32be"],
        codec: "pcm_f32be",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: None,
        file: "s24le.caf",
        args: &["-c:a", "pcm_s24le"],
        codec: "pcm_s24le",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: None,
        file: "u8_mono_22k.wav",
        args: &["-c:a", "pcm_u8", "-ac", "1", "-ar", "22050"],
        codec: "pcm_u8",
        channels: 1,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: None,
        file: "s32.wav",
        args: &["-c:a", "pcm_s32le"],
        codec: "pcm_s32le",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: None,
        file: "f64.wav",
        args: &["-c:a", "pcm_f64le"],
        codec: "pcm_f64le",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: None,
        file: "s24_extensible_48k.wav",
        args: &["-c:a", "pcm_s24le", "-ar", "48000", "-rf64", "never", "-write_bext", "0"],
        codec: "pcm_s24le",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
    Case {
        decoder: None,
        file: "ima_adpcm.wav",
        args: &["-c:a", "adpcm_ima_wav"],
        codec: "adpcm_ima_wav",
        channels: 2,
        tol: Tol::Exact(1e-6),
    },
];

/// stemq's decode of `file` at its own rate, as planes (mono stays one plane).
fn stemq_decode(file: &Path, channels: usize) -> (String, Vec<Vec<f32>>) {
    let probe =
        Decoder::open_path(file, DecodeOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let codec = probe.info().codec.clone();
    let rate = probe.info().sample_rate;
    let all = decode_all(file, DecodeOptions { target_sample_rate: rate, max_duration_secs: None })
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let planes = if channels == 1 { vec![all.left] } else { vec![all.left, all.right] };
    (codec, planes)
}

fn snr_db(reference: &[f32], got: &[f32]) -> f64 {
    let (mut s, mut e) = (0f64, 0f64);
    for (&r, &g) in reference.iter().zip(got) {
        s += f64::from(r) * f64::from(r);
        e += f64::from(r - g) * f64::from(r - g);
    }
    10.0 * (s / e.max(1e-30)).log10()
}

#[test]
fn every_format_decodes_like_ffmpeg() {
    if !have_ffmpeg() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    for case in CASES {
        let file = dir.path().join(case.file);
        encode(&src, case.args, &file);
        let reference = ffmpeg_decode(&file, case.decoder, case.channels);
        let (codec, got) = stemq_decode(&file, case.channels);
        assert_eq!(codec, case.codec, "{}", case.file);
        for (c, (r, g)) in reference.iter().zip(&got).enumerate() {
            match case.tol {
                Tol::Exact(tol) => {
                    assert_eq!(g.len(), r.len(), "{} channel {c}: length", case.file);
                    let d = max_abs_diff(r, g);
                    assert!(d <= tol, "{} channel {c}: max difference {d}", case.file);
                }
                Tol::Snr(min_db, max_len_diff) => {
                    let diff = g.len().abs_diff(r.len());
                    assert!(diff <= max_len_diff, "{} channel {c}: {} frames, ffmpeg {}", case.file, g.len(), r.len());
                    let n = g.len().min(r.len());
                    let db = snr_db(&r[..n], &g[..n]);
                    assert!(db >= min_db, "{} channel {c}: SNR {db:.1} dB against ffmpeg (< {min_db})", case.file);
                    eprintln!("{} channel {c}: SNR {db:.1} dB, {} frames (ffmpeg {})", case.file, g.len(), r.len());
                }
            }
        }
    }
}

/// 5.1 is folded to stereo the way demucs gets it from ffmpeg (`-ac 2` to float): front
/// at 1, centre and surrounds at −3 dB, LFE dropped, not normalised.
#[test]
fn surround_folds_to_stereo_like_ffmpeg() {
    if !have_ffmpeg() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    for (file, codec_args, decoder, min_db) in [
        ("six.wav", &["-c:a", "pcm_f32le"][..], "pcm_f32le", 100.0),
        ("six.opus", &["-c:a", "libopus", "-b:a", "256k"][..], "libopus", 60.0),
        ("six.m4a", &["-c:a", "aac", "-b:a", "384k"][..], "aac", 100.0),
    ] {
        let six = dir.path().join(file);
        let mut args = vec![
            "-filter_complex",
            "[0]channelsplit[l][r];[l][r]amerge,pan=5.1|FL=c0|FR=c1|FC=0.5*c0+0.5*c1|LFE=0.2*c0|BL=0.3*c1|BR=0.3*c0",
        ];
        args.extend_from_slice(codec_args);
        encode(&src, &args, &six);
        let folded = dir.path().join(format!("{file}.stereo.wav"));
        ffmpeg(&[
            "-c:a",
            decoder,
            "-i",
            six.to_str().unwrap(),
            "-ac",
            "2",
            "-c:a",
            "pcm_f32le",
            folded.to_str().unwrap(),
        ]);
        let reference = ffmpeg_decode(&folded, None, 2);
        let (_, got) = stemq_decode(&six, 2);
        for c in 0..2 {
            let n = got[c].len().min(reference[c].len());
            assert!(got[c].len().abs_diff(reference[c].len()) <= 960, "{file}");
            let db = snr_db(&reference[c][..n], &got[c][..n]);
            assert!(db >= min_db, "{file} channel {c}: SNR {db:.1} dB against ffmpeg -ac 2");
            eprintln!("{file} channel {c}: SNR {db:.1} dB against ffmpeg -ac 2");
        }
    }
}

fn refusal(file: &Path) -> AudioError {
    match decode_all(file, DecodeOptions::default()) {
        Ok(c) => panic!("{} decoded {} frames instead of being refused", file.display(), c.len()),
        Err(e) => e,
    }
}

#[test]
fn unsupported_files_are_named_with_what_is_supported() {
    if !have_ffmpeg() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    // (file, encoder arguments, what the refusal must name)
    let cases: &[(&str, &[&str], &str)] = &[
        ("song.wma", &["-c:a", "wmav2"], "Windows Media Audio"),
        ("ac3.m4a", &["-c:a", "ac3"], "AC-3 (Dolby Digital) in MP4/M4A"),
        ("eac3.mkv", &["-c:a", "eac3"], "E-AC-3 (Dolby Digital Plus) in Matroska"),
        ("mp2.mka", &["-c:a", "mp2"], "MPEG-1 Layer II in Matroska"),
        ("song.ac3", &["-c:a", "ac3"], "AC-3 (Dolby Digital)"),
    ];
    for (name, codec_args, named) in cases {
        let file = dir.path().join(name);
        encode(&src, codec_args, &file);
        let e = refusal(&file);
        assert!(e.is_input_error(), "{name}: {e:?}");
        let shown = e.to_string();
        assert!(shown.contains(named), "{name}: `{shown}` does not name {named}");
        for wrong in ["MPEG-1 Layer I ", "MP3"] {
            assert!(!shown.contains(wrong), "{name}: `{shown}` names a codec it is not");
        }
        match engine_error(e) {
            EngineError::InvalidInput { message, .. } => {
                assert!(message.ends_with(SUPPORTED), "{name}: {message}");
                assert!(message.contains(named), "{name}: {message}");
            }
            other => panic!("{name}: {other:?} is not a permanent input error"),
        }
    }
}

/// Truncating any format is a permanent input error (never a transient one, never a
/// panic); damaging the middle of one decodes or is such an error.
#[test]
fn truncated_and_damaged_files_are_input_errors() {
    if !have_ffmpeg() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    for case in CASES {
        let file = dir.path().join(case.file);
        encode(&src, case.args, &file);
        let bytes = std::fs::read(&file).unwrap();
        let cut = dir.path().join(format!("cut_{}", case.file));
        std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
        let e = refusal(&cut);
        assert!(e.is_input_error(), "truncated {}: {e:?}", case.file);
        assert!(matches!(engine_error(e), EngineError::InvalidInput { .. }), "truncated {}", case.file);

        let mut damaged = bytes.clone();
        let mut noise = Noise(11);
        let (mid, span) = (damaged.len() / 2, 1500.min(damaged.len() / 4));
        for b in &mut damaged[mid..mid + span] {
            *b = (noise.next() * 127.0) as i8 as u8;
        }
        let bad = dir.path().join(format!("bad_{}", case.file));
        std::fs::write(&bad, &damaged).unwrap();
        if let Err(e) = decode_all(&bad, DecodeOptions::default()) {
            assert!(e.is_input_error(), "damaged {}: {e:?}", case.file);
        }
    }
}

/// `file` (an MP4 written by ffmpeg, its `moov` after `mdat`) with the AudioSpecificConfig
/// of its `mp4a` sample entry replaced by `asc`: the boxes around it are rebuilt with
/// their new sizes (no chunk offset moves, `mdat` comes first).
fn with_asc(file: &[u8], asc: &[u8]) -> Vec<u8> {
    fn rebuild(data: &[u8], asc: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos + 8 <= data.len() {
            let size = u32::from_be_bytes(data[pos..pos + 4].try_into().unwrap()) as usize;
            assert!(size >= 8 && pos + size <= data.len(), "a box ffmpeg wrote with a 32-bit size");
            let kind = &data[pos + 4..pos + 8];
            let body = &data[pos + 8..pos + size];
            let nested = |skip: usize| [&body[..skip], &rebuild(&body[skip..], asc)[..]].concat();
            let body = match kind {
                b"moov" | b"trak" | b"mdia" | b"minf" | b"stbl" => nested(0),
                b"stsd" => nested(8),
                b"mp4a" => nested(28),
                b"esds" => esds(asc),
                _ => body.to_vec(),
            };
            out.extend_from_slice(&((body.len() + 8) as u32).to_be_bytes());
            out.extend_from_slice(kind);
            out.extend_from_slice(&body);
            pos += size;
        }
        out
    }
    /// An `esds` body: ES_Descriptor { DecoderConfigDescriptor { AAC, `asc` }, SL }.
    fn esds(asc: &[u8]) -> Vec<u8> {
        let descr = |tag: u8, body: &[u8]| [&[tag, body.len() as u8][..], body].concat();
        let mut dcd = vec![0x40, 0x15, 0, 0x18, 0, 0, 1, 0xF4, 0, 0, 0, 0xBB, 0x80];
        dcd.extend_from_slice(&descr(5, asc));
        let mut es = vec![0, 1, 0];
        es.extend_from_slice(&descr(4, &dcd));
        es.extend_from_slice(&descr(6, &[2]));
        [&[0, 0, 0, 0][..], &descr(3, &es)].concat()
    }
    rebuild(file, asc)
}

/// HE-AAC (SBR) is decoded like ffmpeg decodes it, in ADTS (SBR found in the stream) and
/// in M4A (SBR in the configuration, as iTunes and fdk-aac write it, and found in the
/// stream, as a copy from ADTS has it). The fixtures come from `oxideav-aac`'s HE-AAC
/// encoder: no encoder Debian ships makes SBR (ffmpeg's `aac` is LC only; fdkaac and faac
/// are not in Debian main). Tolerance: an SNR of at least 100 dB against ffmpeg's own AAC
/// decoder (measured 119–134 dB), and the same length.
#[test]
fn he_aac_decodes_like_ffmpeg() {
    use oxideav_aac::he_aac_encoder::{HeAacConfig, HeAacEncoder};
    if !have_ffmpeg() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path());
    let pcm: Vec<i16> = hound::WavReader::open(&src)
        .unwrap()
        .samples::<f32>()
        .map(|x| (x.unwrap() * 32767.0).round().clamp(-32768.0, 32767.0) as i16)
        .collect();
    let mut enc = HeAacEncoder::new(HeAacConfig::new(44_100, 2, 48_000)).unwrap();
    let adts = dir.path().join("he.aac");
    std::fs::write(&adts, enc.encode_all(&pcm).unwrap()).unwrap();
    let implicit = dir.path().join("he_implicit.m4a");
    ffmpeg(&["-i", adts.to_str().unwrap(), "-c", "copy", implicit.to_str().unwrap()]);
    let explicit = dir.path().join("he.m4a");
    std::fs::write(&explicit, with_asc(&std::fs::read(&implicit).unwrap(), &enc.audio_specific_config(true))).unwrap();
    // HE-AAC v2 as its configuration signals it (object type 29): a mono core whose
    // parametric stereo makes two channels. The encoder writes no PS parameters, so both
    // decoders run PS at its defaults (both channels alike): the v2 signalling and the PS
    // synthesis are compared, not the decoding of PS parameters.
    let mut mono = HeAacEncoder::new(HeAacConfig::new(44_100, 1, 32_000)).unwrap();
    let left: Vec<i16> = pcm.iter().step_by(2).copied().collect();
    let mono_adts = dir.path().join("he_mono.aac");
    std::fs::write(&mono_adts, mono.encode_all(&left).unwrap()).unwrap();
    let mono_m4a = dir.path().join("he_mono.m4a");
    ffmpeg(&["-i", mono_adts.to_str().unwrap(), "-c", "copy", mono_m4a.to_str().unwrap()]);
    let mut asc = mono.audio_specific_config(true);
    asc[0] = (29 << 3) | (asc[0] & 0x07);
    let v2 = dir.path().join("he_v2.m4a");
    std::fs::write(&v2, with_asc(&std::fs::read(&mono_m4a).unwrap(), &asc)).unwrap();
    for file in [&adts, &implicit, &explicit, &v2] {
        let name = file.file_name().unwrap().to_string_lossy();
        let reference = ffmpeg_decode(file, None, 2);
        let (codec, got) = stemq_decode(file, 2);
        assert_eq!(codec, "aac", "{name}");
        let rate = Decoder::open_path(file, DecodeOptions::default()).unwrap().info().sample_rate;
        assert_eq!(rate, 44_100, "{name}: decoded at the SBR rate");
        for c in 0..2 {
            assert_eq!(got[c].len(), reference[c].len(), "{name} channel {c}: length");
            let db = snr_db(&reference[c], &got[c]);
            eprintln!("{name} channel {c}: SNR {db:.1} dB, {} frames", got[c].len());
            assert!(db >= 100.0, "{name} channel {c}: SNR {db:.1} dB against ffmpeg (< 100)");
        }
    }
    // Cut off, the M4A (its `moov` last) is a permanent input error.
    let bytes = std::fs::read(&explicit).unwrap();
    let cut = dir.path().join("cut_he.m4a");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let e = refusal(&cut);
    assert!(matches!(engine_error(e), EngineError::InvalidInput { .. }), "truncated HE-AAC");
}
