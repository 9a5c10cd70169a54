//! `stemq separate`: the Demucs command line, drop-in (no NATS involved).

use std::process::Command;

use stemq_tests::Stack;

fn stemq(args: &[&str], dir: &std::path::Path) -> std::process::Output {
    Command::new(Stack::stemq_bin()).args(args).current_dir(dir).output().expect("run stemq")
}

#[test]
fn separate_writes_out_name_track_stem_like_demucs() {
    let dir = tempfile::tempdir().unwrap();
    let out = stemq(&["synth", "--seconds", "3", "-o", "song.wav"], dir.path());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Default layout: OUT/NAME/TRACK/STEM.EXT, four stems, 16-bit WAV.
    let out = stemq(&["separate", "-n", "dsp", "-o", "sep", "song.wav"], dir.path());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for stem in ["drums", "bass", "other", "vocals"] {
        let p = dir.path().join(format!("sep/dsp/song/{stem}.wav"));
        let bytes = std::fs::read(&p).unwrap_or_else(|_| panic!("{} missing", p.display()));
        assert_eq!(&bytes[..4], b"RIFF");
        assert_eq!(u16::from_le_bytes([bytes[34], bytes[35]]), 16);
    }

    // --two-stems, --int24, --filename, --flac.
    let out = stemq(
        &[
            "separate",
            "-n",
            "dsp",
            "--two-stems",
            "vocals",
            "--int24",
            "--flac",
            "--filename",
            "{track}-{stem}.{ext}",
            "-o",
            "two",
            "song.wav",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for stem in ["vocals", "no_vocals"] {
        let bytes = std::fs::read(dir.path().join(format!("two/dsp/song-{stem}.flac"))).unwrap();
        assert_eq!(&bytes[..4], b"fLaC");
    }

    // --other-method none: only the stem.
    let out = stemq(
        &["separate", "-n", "dsp", "--two-stems", "drums", "--other-method", "none", "-o", "none", "song.wav"],
        dir.path(),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(dir.path().join("none/dsp/song/drums.wav").exists());
    assert!(!dir.path().join("none/dsp/song/no_drums.wav").exists());
    let out = stemq(&["separate", "-n", "dsp", "--other-method", "minus", "song.wav"], dir.path());
    assert!(!out.status.success(), "--other-method needs --two-stems");

    // --other-method minus names the complement `minus_STEM`, as demucs 4.1.0 does;
    // --mp3 with demucs's bit rate and preset flags (and --int24, which demucs ignores
    // for MP3).
    let out = stemq(
        &[
            "separate",
            "-n",
            "dsp",
            "--two-stems",
            "bass",
            "--other-method",
            "minus",
            "--mp3",
            "--mp3-bitrate",
            "128",
            "--mp3-preset",
            "7",
            "--int24",
            "-o",
            "mp3",
            "song.wav",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!dir.path().join("mp3/dsp/song/no_bass.mp3").exists());
    for stem in ["bass", "minus_bass"] {
        let p = dir.path().join(format!("mp3/dsp/song/{stem}.mp3"));
        let bytes = std::fs::read(&p).unwrap_or_else(|_| panic!("{} missing", p.display()));
        assert_eq!((bytes[0], bytes[1] & 0xFE), (0xFF, 0xFA), "{stem}: MPEG-1 Layer III");
        // 128 kbit/s, constant: 3 s of song plus LAME's delay and padding.
        assert!((48_000..52_000).contains(&bytes.len()), "{stem}: {} B", bytes.len());
    }

    // Refusals say why: a request the pipeline would refuse, and an absent engine.
    let out = stemq(&["separate", "-n", "dsp", "--overlap", "1.5", "song.wav"], dir.path());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("overlap"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = stemq(&["separate", "-n", "htdemucs", "--repo", "models", "song.wav"], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("demucs"), "{err}");
}
