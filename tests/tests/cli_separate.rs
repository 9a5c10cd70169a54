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
    // demucs takes --other-method without --two-stems and changes nothing: so do we.
    let out = stemq(&["separate", "-n", "dsp", "--other-method", "minus", "-o", "all", "song.wav"], dir.path());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for stem in ["drums", "bass", "other", "vocals"] {
        assert!(dir.path().join(format!("all/dsp/song/{stem}.wav")).exists(), "{stem}");
    }

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
    let hint = if cfg!(feature = "demucs") { "stemq models pull htdemucs" } else { "without" };
    assert!(err.contains(hint), "{err}");
}

/// The fixture model folder of the HTDemucs port: checkpoints `a0a0a0a0` and
/// `b1b1b1b1-<checksum>`, bags `tiny` and `tinybag` (random weights, 8 kHz).
fn fixture_repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../services/demucs/tests/fixtures/repo")
}

#[cfg(feature = "demucs")]
/// Issue 14: `-n` takes any model of `--repo`, a bag or a signature, as demucs does;
/// `-s SIG` too; `--list-models` lists them; `--no-split`, `-j`, `-v` work; the default
/// model is htdemucs.
#[test]
fn separate_runs_any_model_of_the_folder_like_demucs() {
    let dir = tempfile::tempdir().unwrap();
    let repo = fixture_repo();
    let repo = repo.to_str().unwrap();
    let ok = |out: &std::process::Output| {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    ok(&stemq(&["synth", "--seconds", "1", "-o", "one.wav"], dir.path()));
    ok(&stemq(&["synth", "--seconds", "3", "-o", "three.wav"], dir.path()));

    let listed = ok(&stemq(&["separate", "--list-models", "--repo", repo], dir.path()));
    for name in ["dsp", "tiny", "tinybag", "a0a0a0a0", "b1b1b1b1"] {
        assert!(listed.lines().any(|l| l.trim() == name), "--list-models lacks {name}:\n{listed}");
    }
    let bags = listed.find("Bag of models:").expect("bags heading");
    let singles = listed.find("Single models:").expect("singles heading");
    assert!(listed[bags..singles].contains("tinybag") && listed[singles..].contains("b1b1b1b1"), "{listed}");

    // A signature (its checksum checked), a bag, and -s: each into OUT/NAME/TRACK/.
    for args in [
        vec!["-n", "b1b1b1b1"],
        vec!["-n", "tinybag", "-j", "1", "--shifts", "0"],
        vec!["-s", "a0a0a0a0", "--two-stems", "vocals"],
    ] {
        let name = args[1];
        let mut all = vec!["separate", "--repo", repo, "-o", "sep"];
        all.extend(&args);
        all.push("three.wav");
        let printed = ok(&stemq(&all, dir.path()));
        let stems: &[&str] = if args.contains(&"--two-stems") {
            &["vocals", "no_vocals"]
        } else {
            &["drums", "bass", "other", "vocals"]
        };
        for stem in stems {
            let p = dir.path().join(format!("sep/{name}/three/{stem}.wav"));
            let wav = std::fs::read(&p).unwrap_or_else(|_| panic!("{args:?}: {} missing:\n{printed}", p.display()));
            // The model's own rate (8 kHz), about 3 s of 16-bit stereo.
            assert_eq!(u32::from_le_bytes(wav[24..28].try_into().unwrap()), 8000);
            assert!((90_000..100_000).contains(&wav.len()), "{args:?} {stem}: {} B", wav.len());
        }
    }

    // --no-split: one pass over the whole track; longer than the trained segment (1.5 s)
    // is refused, as demucs refuses it.
    let out = ok(&stemq(&["separate", "--repo", repo, "-n", "tiny", "--no-split", "-o", "ns", "one.wav"], dir.path()));
    assert!(dir.path().join("ns/tiny/one/vocals.wav").exists(), "{out}");
    let long = stemq(&["separate", "--repo", repo, "-n", "tiny", "--no-split", "three.wav"], dir.path());
    assert!(!long.status.success(), "a 3 s track without split on a 1.5 s model");

    // -v says what ran and how fast.
    let verbose =
        stemq(&["separate", "--repo", repo, "-n", "tiny", "-v", "-d", "cpu", "-o", "v", "one.wav"], dir.path());
    ok(&verbose);
    let err = String::from_utf8_lossy(&verbose.stderr);
    assert!(err.contains("model tiny") && err.contains("real time"), "{err}");

    // Unknown names say what the folder has; the default model is htdemucs.
    let out = stemq(&["separate", "--repo", repo, "-n", "nope", "one.wav"], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tinybag") && err.contains("--list-models"), "{err}");
    let out = stemq(&["separate", "--repo", repo, "one.wav"], dir.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("model `htdemucs`"), "{err}");
}

/// What `--two-stems STEM [--other-method M]` writes, as demucs 4.1.0 writes it.
fn two_stem_files(stem: &str, method: Option<&str>) -> Vec<String> {
    match method {
        None | Some("add") => vec![stem.to_string(), format!("no_{stem}")],
        Some("minus") => vec![stem.to_string(), format!("minus_{stem}")],
        Some("none") => vec![stem.to_string()],
        Some(m) => panic!("unknown method {m}"),
    }
}

/// Runs every `--two-stems`/`--other-method` combination with `model` (the arguments
/// that name it, its output folder) on `song` and checks the stems written, and only
/// those.
fn every_two_stem_method(dir: &std::path::Path, model: &[&str], folder: &str, song: &str) {
    for method in [None, Some("add"), Some("minus"), Some("none")] {
        let out_dir = format!("two-{}", method.unwrap_or("default"));
        let mut args = vec!["separate", "-o", &out_dir, "--two-stems", "vocals"];
        args.extend_from_slice(model);
        if let Some(m) = method {
            args.extend(["--other-method", m]);
        }
        args.push(song);
        let out = stemq(&args, dir);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let track = std::path::Path::new(song).file_stem().unwrap().to_str().unwrap();
        let written = dir.join(&out_dir).join(folder).join(track);
        let mut got: Vec<String> = std::fs::read_dir(&written)
            .unwrap_or_else(|e| panic!("{args:?}: {}: {e}", written.display()))
            .map(|e| e.unwrap().path().file_stem().unwrap().to_str().unwrap().to_string())
            .collect();
        got.sort();
        let mut want = two_stem_files("vocals", method);
        want.sort();
        assert_eq!(got, want, "{args:?}");
        std::fs::remove_dir_all(dir.join(&out_dir)).unwrap();
    }
}

/// Issue 35: `--two-stems` with every `--other-method` works for a model the request
/// names (`dsp`) as for any other; `--help` shows `--shifts`'s default.
#[test]
fn two_stems_and_other_method_work_with_every_model_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = stemq(&["synth", "--seconds", "1", "-o", "song.wav"], dir.path());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    every_two_stem_method(dir.path(), &["-n", "dsp"], "dsp", "song.wav");
    let help = String::from_utf8_lossy(&stemq(&["separate", "--help"], dir.path()).stdout).to_string();
    let shifts = help.lines().skip_while(|l| !l.contains("--shifts")).take(6).collect::<Vec<_>>().join(" ");
    assert!(shifts.contains("[default: 1]"), "{shifts}");
}

#[cfg(feature = "demucs")]
/// Issue 35: the same with the neural models: a pretrained name (a bag named `htdemucs`
/// in the model folder), a custom bag, a signature by `-n` and by `-s`. Before, a
/// signature or custom bag with `--other-method` was refused ("only applies with
/// `two_stems`").
#[test]
fn two_stems_and_other_method_work_with_pretrained_and_custom_models() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    std::fs::create_dir(&repo).unwrap();
    for f in std::fs::read_dir(fixture_repo()).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), repo.join(f.file_name())).unwrap();
    }
    std::fs::write(repo.join("htdemucs.yaml"), "models: ['a0a0a0a0']\n").unwrap();
    let repo = repo.to_str().unwrap();
    let out = stemq(&["synth", "--seconds", "1", "-o", "song.wav"], dir.path());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (model, folder) in [
        (vec!["--repo", repo, "-n", "htdemucs"], "htdemucs"),
        (vec!["--repo", repo, "-n", "tinybag"], "tinybag"),
        (vec!["--repo", repo, "-n", "b1b1b1b1"], "b1b1b1b1"),
        (vec!["--repo", repo, "-s", "a0a0a0a0"], "a0a0a0a0"),
    ] {
        every_two_stem_method(dir.path(), &model, folder, "song.wav");
    }
}

/// `stemq separate -d vulkan` (a build with `--features vulkan`): the model runs on the
/// Vulkan device (`-v` names it), its stems within 80 dB of `-d cpu`'s; `-d vulkan:N`
/// for a device that is not here, or a device name nobody knows, is refused saying what
/// there is.
#[cfg(feature = "vulkan")]
#[test]
fn separate_runs_on_a_vulkan_device() {
    let Some(adapter) = stemq_demucs::vulkan::resolve(None, true) else {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "no Vulkan device (scripts/install-test-deps.sh)");
        eprintln!("SKIPPED: stemq separate -d vulkan: no Vulkan device");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let repo = fixture_repo();
    let repo = repo.to_str().unwrap();
    let run = |device: &str, out: &str| {
        let args = ["separate", "--repo", repo, "-n", "tiny", "--float32", "-v", "-d", device, "-o", out, "two.wav"];
        stemq(&args, dir.path())
    };
    assert!(stemq(&["synth", "--seconds", "2", "-o", "two.wav"], dir.path()).status.success());
    let on_device = run("vulkan", "gpu");
    let err = String::from_utf8_lossy(&on_device.stderr);
    assert!(on_device.status.success(), "{err}");
    assert!(err.contains(&format!("device vulkan:{}", adapter.index)), "{err}");
    assert!(run("cpu", "cpu").status.success());
    for stem in ["drums", "bass", "other", "vocals"] {
        let read = |out: &str| -> Vec<f32> {
            let wav = std::fs::read(dir.path().join(format!("{out}/tiny/two/{stem}.wav"))).unwrap();
            let data = wav.windows(4).position(|w| w == b"data").expect("a data chunk") + 8;
            wav[data..].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
        };
        let (want, got) = (read("cpu"), read("gpu"));
        assert_eq!(want.len(), got.len(), "{stem}");
        let sig: f64 = want.iter().map(|v| (*v as f64).powi(2)).sum();
        let noise: f64 = want.iter().zip(&got).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
        let db = 10.0 * (sig / noise.max(1e-300)).log10();
        assert!(db >= 80.0, "{stem}: {db:.1} dB between -d vulkan and -d cpu");
    }
    let missing = run("vulkan:99", "none");
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success() && err.contains("vulkan:99") && err.contains("available: cpu"), "{err}");
    let unknown = run("rocm", "none");
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("vulkan:N"), "a refusal naming the devices");
}

/// The options `python -m demucs.separate --help` lists: `(spellings, metavar)` per
/// option line, e.g. `(["-s", "--sig"], Some("SIG"))`.
fn reference_options(help: &str) -> Vec<(Vec<String>, Option<String>)> {
    let mut out = Vec::new();
    let mut in_options = false;
    for line in help.lines() {
        if line.starts_with("options:") || line.starts_with("optional arguments:") {
            in_options = true;
            continue;
        }
        let t = line.trim_start();
        if !in_options || !t.starts_with('-') || line.len() - t.len() != 2 {
            continue;
        }
        let head = t.split("  ").next().unwrap_or(t);
        let mut spellings = Vec::new();
        let mut metavar = None;
        for part in head.split(", ") {
            let mut words = part.split_whitespace();
            spellings.push(words.next().unwrap().to_string());
            metavar = words.next().map(String::from);
        }
        out.push((spellings, metavar));
    }
    out
}

/// A value `stemq separate` must take for an option of demucs's.
fn value_for(flag: &str, metavar: &str) -> String {
    if let Some(choices) = metavar.strip_prefix('{').and_then(|m| m.strip_suffix('}')) {
        return choices.split(',').next().unwrap().to_string();
    }
    match flag {
        "--sig" | "-s" => "a0a0a0a0",
        "--name" | "-n" => "tiny",
        "--device" | "-d" => "cpu",
        "--shifts" => "1",
        "--overlap" => "0.25",
        "--segment" => "1",
        "--two-stems" => "vocals",
        "--mp3-bitrate" => "320",
        "--jobs" | "-j" => "2",
        "--filename" => "{track}/{stem}.{ext}",
        _ => ".",
    }
    .to_string()
}

/// Issue 14: every option of the reference `demucs.separate --help` is accepted by
/// `stemq separate`, short and long. The reference is run live from the reference venv
/// (`.stemq/venv-ref`, services/demucs/README.md) when it is there, and must then match
/// the committed capture (`services/demucs/scripts/demucs_help.sh` rewrites it);
/// otherwise the capture is used.
#[test]
fn every_flag_of_the_reference_demucs_is_accepted() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let captured = std::fs::read_to_string(root.join("tests/fixtures/demucs-separate-help.txt")).unwrap();
    let venv = root.join(".stemq/venv-ref/bin/python");
    let help = match Command::new(&venv).args(["-m", "demucs.separate", "--help"]).env("COLUMNS", "80").output() {
        Ok(out) if out.status.success() => {
            let live = String::from_utf8(out.stdout).unwrap();
            assert_eq!(live, captured, "the capture is stale: run services/demucs/scripts/demucs_help.sh");
            println!("checked against the live reference ({})", venv.display());
            live
        }
        _ => {
            println!("no reference venv at {}: checked against the capture", venv.display());
            captured
        }
    };
    let options = reference_options(&help);
    assert!(options.len() >= 20, "parsed only {} options from:\n{help}", options.len());
    let dir = tempfile::tempdir().unwrap();
    let repo = fixture_repo();
    let mut refused = Vec::new();
    for (spellings, metavar) in &options {
        for flag in spellings.iter().filter(|f| *f != "-h" && *f != "--help") {
            // --list-models ends the command once the flags have parsed.
            let mut args = vec!["separate".to_string(), flag.clone()];
            match (flag.as_str(), metavar) {
                ("--repo", _) => args.push(repo.to_str().unwrap().into()),
                (_, Some(m)) => args.push(value_for(flag, m)),
                _ => {}
            }
            if flag != "--repo" {
                args.extend(["--repo".into(), repo.to_str().unwrap().into()]);
            }
            if flag != "--list-models" {
                args.push("--list-models".into());
            }
            let out = Command::new(Stack::stemq_bin()).args(&args).current_dir(dir.path()).output().unwrap();
            if !out.status.success() {
                refused.push(format!("{}: {}", args[1..].join(" "), String::from_utf8_lossy(&out.stderr).trim()));
            }
        }
    }
    assert!(refused.is_empty(), "stemq separate refuses flags of demucs.separate:\n{}", refused.join("\n"));
    // The check can fail: a flag demucs does not have is refused.
    let out = Command::new(Stack::stemq_bin()).args(["separate", "--no-such-flag", "--list-models"]).output().unwrap();
    assert!(!out.status.success());
}
