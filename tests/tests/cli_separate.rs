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

    // Refusals say why: a request the pipeline would refuse, and an absent engine.
    let out = stemq(&["separate", "-n", "dsp", "--overlap", "1.5", "song.wav"], dir.path());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("overlap"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = stemq(&["separate", "-n", "htdemucs", "--repo", "models", "song.wav"], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("demucs"), "{err}");
}
