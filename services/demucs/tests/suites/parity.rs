// The `parity` suite, included once per device by `tests/parity.rs` (which defines `B`,
// `BLOCK_DB` and `E2E_DB`).

use crate::common::{check, dev, fixtures, load, load_path, skip};
use stemq_demucs::apply::{apply_model, separate, two_stems, ApplyOptions, BagOfModels, NoProgress, OtherMethod};
use stemq_demucs::checkpoint::{Checkpoint, HostTensor};
use stemq_demucs::config::HTDemucsConfig;
use stemq_demucs::model::HTDemucs;
use stemq_demucs::nn::{to_host, WeightPrecision};
use stemq_demucs::repo::ModelRepo;
use stemq_demucs::stft::Spectrogram;
use stemq_demucs::DemucsError;

fn model() -> HTDemucs<B> {
    HTDemucs::load_file(&fixtures().join("repo/a0a0a0a0.th"), &Default::default()).expect("load model")
}

#[test]
fn checkpoint_is_read_without_python() {
    if skip::<B>() {
        return;
    }
    let ckpt = Checkpoint::load(&fixtures().join("repo/a0a0a0a0.th")).unwrap();
    assert_eq!(ckpt.class_name().as_deref(), Some("demucs.htdemucs.HTDemucs"));
    assert_eq!(ckpt.state.keys().count(), 533);
    let cfg = HTDemucsConfig::from_kwargs(&ckpt.kwargs).unwrap();
    assert_eq!(cfg.segment, (3, 2));
    assert_eq!(cfg.samplerate, 8000);
    assert_eq!(cfg.channels, 8);
    assert_eq!(cfg.bottom_channels, 32);
    assert_eq!(cfg.training_length(), 12000);
    // packed attention and the DConv Sequential indices are there, untouched.
    assert_eq!(ckpt.state.get("crosstransformer.layers.0.self_attn.in_proj_weight").unwrap().shape, vec![96, 32]);
    assert!(ckpt.state.get("encoder.0.dconv.layers.1.6.scale").is_some());
}

/// demucs builds a model as `klass(*args, **kwargs)`: a checkpoint whose `sources` come
/// first in `args` (not in `kwargs`) loads into the same model, and its output matches.
#[test]
fn sources_given_positionally_in_args_load_the_same_model() {
    if skip::<B>() {
        return;
    }
    use stemq_demucs::pickle::Value;
    let mut ckpt = Checkpoint::load(&fixtures().join("repo/a0a0a0a0.th")).unwrap();
    let by_name = HTDemucsConfig::from_args_kwargs(&ckpt.args, &ckpt.kwargs).unwrap();
    let Value::Dict(items) = &mut ckpt.kwargs else { panic!("kwargs is a dict") };
    let at = items.iter().position(|(k, _)| k.as_str() == Some("sources")).expect("sources in kwargs");
    let (_, sources) = items.remove(at);
    ckpt.args = Value::List(vec![sources.clone()]);
    assert!(HTDemucsConfig::from_kwargs(&ckpt.kwargs).is_err(), "without sources the kwargs alone are refused");
    let by_position = HTDemucsConfig::from_args_kwargs(&ckpt.args, &ckpt.kwargs).unwrap();
    assert_eq!(format!("{by_position:?}"), format!("{by_name:?}"));
    // Given both ways, Python refuses the call (`got multiple values`): so do we.
    let mut twice = ckpt.kwargs.clone();
    let Value::Dict(items) = &mut twice else { unreachable!() };
    items.push((Value::Str("sources".into()), sources));
    assert!(HTDemucsConfig::from_args_kwargs(&ckpt.args, &twice).unwrap_err().to_string().contains("both"));
    let m = HTDemucs::<B>::from_checkpoint(ckpt, &Default::default()).expect("positional sources load");
    let f = load("blocks.safetensors");
    check("forward (sources in args)", &f["forward.out"], &m.forward(&f["forward.in"]).unwrap(), E2E_DB);
}

#[test]
fn stft_and_istft() {
    if skip::<B>() {
        return;
    }
    let f = load("stft.safetensors");
    let m = model();
    let x = &f["x"];
    let len = x.shape[1];
    let spec_ref = &f["spec"]; // [2, F, T, 2]
    let mut spec = Vec::new();
    let mut back = Vec::new();
    for c in 0..2 {
        let s = m.stft().spec(&x.data[c * len..(c + 1) * len]).unwrap();
        for z in &s.data {
            spec.push(z.re as f32);
            spec.push(z.im as f32);
        }
        // iSTFT of the reference spectrogram.
        let (fq, t) = (spec_ref.shape[1], spec_ref.shape[2]);
        let base = c * fq * t * 2;
        let z = Spectrogram {
            freqs: fq,
            frames: t,
            data: (0..fq * t)
                .map(|i| {
                    realfft::num_complex::Complex::new(
                        spec_ref.data[base + 2 * i] as f64,
                        spec_ref.data[base + 2 * i + 1] as f64,
                    )
                })
                .collect(),
        };
        back.extend(m.stft().ispec(&z, len));
    }
    check("stft", spec_ref, &HostTensor { shape: spec_ref.shape.clone(), data: spec }, BLOCK_DB);
    check("istft", &f["ispec"], &HostTensor { shape: vec![2, len], data: back }, BLOCK_DB);
}

#[test]
fn encoder_layers() {
    if skip::<B>() {
        return;
    }
    let f = load("blocks.safetensors");
    let m = model();
    let y = to_host(m.encoder(0).forward_freq(dev(&f["enc0.in0"])));
    check("encoder[0] (freq)", &f["enc0.out0"], &y, BLOCK_DB);
    let y = to_host(m.encoder(3).forward_freq(dev(&f["enc3.in0"])));
    check("encoder[3] (freq)", &f["enc3.out0"], &y, BLOCK_DB);
    let y = to_host(m.tencoder(0).forward_time(dev(&f["tenc0.in0"])));
    check("tencoder[0] (time)", &f["tenc0.out0"], &y, BLOCK_DB);
}

#[test]
fn transformer_layers() {
    if skip::<B>() {
        return;
    }
    let f = load("blocks.safetensors");
    let m = model();
    let tr = m.crosstransformer().unwrap();
    let y = to_host(tr.layer(false, 0).forward(dev(&f["tlayer0.in0"]), None));
    check("transformer self layer", &f["tlayer0.out0"], &y, BLOCK_DB);
    let y = to_host(tr.layer(true, 1).forward(dev(&f["tlayer_t1.in0"]), Some(dev(&f["tlayer_t1.in1"]))));
    check("transformer cross layer", &f["tlayer_t1.out0"], &y, BLOCK_DB);
    let (x, xt) = tr.forward(dev(&f["transformer.in0"]), dev(&f["transformer.in1"]));
    check("transformer (freq out)", &f["transformer.out0"], &to_host(x), BLOCK_DB);
    check("transformer (time out)", &f["transformer.out1"], &to_host(xt), BLOCK_DB);
}

#[test]
fn decoder_layers() {
    if skip::<B>() {
        return;
    }
    let f = load("blocks.safetensors");
    let m = model();
    let (z, pre) = m.decoder(0).forward_freq(dev(&f["dec0.in0"]), dev(&f["dec0.in1"]));
    check("decoder[0] (freq)", &f["dec0.out0"], &to_host(z), BLOCK_DB);
    check("decoder[0] pre", &f["dec0.out1"], &to_host(pre), BLOCK_DB);
    let (z, _) = m.decoder(1).forward_freq(dev(&f["dec1.in0"]), dev(&f["dec1.in1"]));
    check("decoder[1] (freq)", &f["dec1.out0"], &to_host(z), BLOCK_DB);
    let length = f["tdec2.in2"].data[0] as usize;
    let (z, _) = m.tdecoder(2).forward_time(dev(&f["tdec2.in0"]), dev(&f["tdec2.in1"]), length);
    check("tdecoder[2] (time)", &f["tdec2.out0"], &to_host(z), BLOCK_DB);
}

#[test]
fn forward_one_segment() {
    if skip::<B>() {
        return;
    }
    let f = load("blocks.safetensors");
    let m = model();
    let y = m.forward(&f["forward.in"]).unwrap();
    check("forward (1 segment)", &f["forward.out"], &y, E2E_DB);
    let y = m.forward(&f["forward_short.in"]).unwrap();
    check("forward (shorter input)", &f["forward_short.out"], &y, E2E_DB);
}

fn opts(shifts: usize) -> ApplyOptions {
    ApplyOptions { shifts, ..ApplyOptions::default() }
}

#[test]
fn apply_model_split_overlap_segment_short() {
    if skip::<B>() {
        return;
    }
    let f = load("apply.safetensors");
    let bag = BagOfModels::single(model());
    let y = separate(&bag, &f["track"], &opts(0), &mut NoProgress).unwrap();
    check("apply split+overlap", &f["out.split"], &y, E2E_DB);
    let y2 = separate(&bag, &f["track"], &ApplyOptions { segment: Some(1.0), ..opts(0) }, &mut NoProgress).unwrap();
    check("apply segment=1.0", &f["out.segment"], &y2, E2E_DB);
    // Batching chunks (the GPU path) gives the same result.
    let y4 = separate(&bag, &f["track"], &ApplyOptions { batch_size: 2, jobs: 2, ..opts(0) }, &mut NoProgress).unwrap();
    check("apply split, 2 jobs × batch 2", &f["out.split"], &y4, E2E_DB);
    let y3 = separate(&bag, &f["short_track"], &opts(0), &mut NoProgress).unwrap();
    check("apply short input", &f["out.short"], &y3, E2E_DB);

    // two stems (vocals), both other-methods.
    let sources = bag.sources().to_vec();
    let add = two_stems(&sources, &y, &f["track"], "vocals", OtherMethod::Add).unwrap();
    assert_eq!(add[1].0, "no_vocals");
    check("two_stems add", &f["two_stems.no_vocals_add"], &add[1].1, E2E_DB);
    let minus = two_stems(&sources, &y, &f["track"], "vocals", OtherMethod::Minus).unwrap();
    assert_eq!(minus[1].0, "minus_vocals");
    check("two_stems minus", &f["two_stems.no_vocals_minus"], &minus[1].1, E2E_DB);
}

#[test]
fn apply_model_shifts_replayed() {
    if skip::<B>() {
        return;
    }
    let f = load("apply.safetensors");
    let meta: serde_json_like::Meta = serde_json_like::read();
    let bag = BagOfModels::single(model());
    let y = separate(
        &bag,
        &f["track"],
        &ApplyOptions { shift_offsets: Some(meta.shift_offsets), ..opts(2) },
        &mut NoProgress,
    )
    .unwrap();
    check("apply shifts=2", &f["out.shifts"], &y, E2E_DB);
}

#[test]
fn apply_bag_from_repo() {
    if skip::<B>() {
        return;
    }
    let f = load("apply.safetensors");
    let repo = ModelRepo::open(fixtures().join("repo")).unwrap();
    assert_eq!(repo.names(), vec!["tiny", "tinybag", "a0a0a0a0", "b1b1b1b1"]);
    let bag = repo.load::<B>("tinybag", &Default::default()).unwrap();
    assert_eq!(bag.models().len(), 2);
    assert!((bag.max_allowed_segment() - 1.2).abs() < 1e-12);
    let y = separate(&bag, &f["track"], &opts(0), &mut NoProgress).unwrap();
    check("apply bag (2 models)", &f["out.bag"], &y, E2E_DB);
}

/// Weights kept in f16 on the device (`--gpu-weights f16`) take half the memory and, for
/// checkpoints stored in f16 as the official ones are, give the same stems bit for bit
/// (every use widens them back to f32).
#[test]
fn half_weights_take_half_the_memory_and_give_the_same_stems() {
    if skip::<B>() {
        return;
    }
    let f = load("apply.safetensors");
    let repo = ModelRepo::open(fixtures().join("repo")).unwrap();
    let full = repo.load_with::<B>("tinybag", &Default::default(), WeightPrecision::Full).unwrap();
    let half = repo.load_with::<B>("tinybag", &Default::default(), WeightPrecision::Half).unwrap();
    for (f, h) in full.models().iter().zip(half.models()) {
        // Not exactly half: the summed LSTM biases and the scaled frequency embedding
        // are derived, and stay f32.
        let ratio = h.weight_bytes() as f64 / f.weight_bytes() as f64;
        assert!(
            f.weight_bytes() > 0 && (0.49..0.52).contains(&ratio),
            "{} / {} bytes",
            h.weight_bytes(),
            f.weight_bytes()
        );
    }
    let a = separate(&full, &f["track"], &opts(0), &mut NoProgress).unwrap();
    let b = separate(&half, &f["track"], &opts(0), &mut NoProgress).unwrap();
    assert!(a == b, "f16 weights changed the stems");
    check("apply bag, f16 weights", &f["out.bag"], &b, E2E_DB);
}

#[test]
fn segment_above_trained_is_refused() {
    if skip::<B>() {
        return;
    }
    let f = load("apply.safetensors");
    let bag = BagOfModels::single(model());
    let err =
        apply_model(&bag, &f["track"], &ApplyOptions { segment: Some(1.6), ..opts(0) }, &mut NoProgress).unwrap_err();
    assert!(matches!(err, DemucsError::InvalidArgument(_)), "{err}");
}

#[test]
fn checksum_mismatch_is_refused() {
    if skip::<B>() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures().join("repo/a0a0a0a0.th"), dir.path().join("a0a0a0a0-deadbeef.th")).unwrap();
    let repo = ModelRepo::open(dir.path()).unwrap();
    let err = repo.load::<B>("a0a0a0a0", &Default::default()).unwrap_err();
    assert!(matches!(err, DemucsError::Checksum { .. }), "{err}");
}

/// `meta.json` holds the shift offsets Python drew; parsed by hand to keep the test
/// dependencies small.
mod serde_json_like {
    pub struct Meta {
        pub shift_offsets: Vec<usize>,
    }
    pub fn read() -> Meta {
        let text = std::fs::read_to_string(super::fixtures().join("meta.json")).unwrap();
        let at = text.find("\"shift_offsets\"").expect("shift_offsets in meta.json");
        let open = at + text[at..].find('[').unwrap();
        let close = open + text[open..].find(']').unwrap();
        let shift_offsets = text[open + 1..close].split(',').map(|s| s.trim().parse().unwrap()).collect();
        Meta { shift_offsets }
    }
}

/// The full-size check: needs `make_fixtures.py --full` (target/demucs-full/).
/// `cargo test -p stemq-demucs --release --test parity -- --ignored`
#[test]
#[ignore]
fn full_size_parity() {
    if skip::<B>() {
        return;
    }
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/demucs-full");
    let f = load_path(&dir.join("apply_full.safetensors"));
    let bag = ModelRepo::open(dir.join("repo")).unwrap().load::<B>("f0f0f0f0", &Default::default()).unwrap();
    let y = separate(&bag, &f["track"], &opts(0), &mut NoProgress).unwrap();
    check("full-size apply (10 s)", &f["out.split"], &y, E2E_DB);
}
