// The `parity_v2` suite, included once per device by `tests/parity_v2.rs` (which defines `B`,
// `BLOCK_DB` and `E2E_DB`).

use std::collections::HashMap;

use crate::common::{check, fixtures, load_path, skip, stream_separate};
use stemq_demucs::apply::{separate, ApplyOptions, NoProgress};
use stemq_demucs::checkpoint::{Checkpoint, HostTensor};
use stemq_demucs::config::{Arch, HTDemucsConfig};
use stemq_demucs::model::HTDemucs;
use stemq_demucs::nn::WeightPrecision;
use stemq_demucs::repo::ModelRepo;
use stemq_demucs::wave::{resample_down2, resample_up2, valid_length};

fn v2(name: &str) -> HashMap<String, HostTensor> {
    load_path(&fixtures().join("v2").join(name))
}

fn model(sig: &str) -> HTDemucs<B> {
    HTDemucs::load_file(&fixtures().join(format!("v2/repo/{sig}.th")), &Default::default()).expect("load model")
}

#[test]
fn a_demucs_checkpoint_reads_with_its_class_defaults() {
    if skip::<B>() {
        return;
    }
    let ckpt = Checkpoint::load(&fixtures().join("v2/repo/f6f6f6f6.th")).unwrap();
    assert_eq!(ckpt.class_name().as_deref(), Some("demucs.demucs.Demucs"));
    let c = HTDemucsConfig::for_arch(Arch::Demucs, &ckpt.args, &ckpt.kwargs).unwrap();
    assert_eq!(
        (c.arch, c.depth, c.channels, c.rewrite, c.resample, c.normalize),
        (Arch::Demucs, 4, 8, false, true, true)
    );
    let f = v2("blocks.safetensors");
    let want: Vec<usize> = f["valid_length"].data.iter().map(|v| *v as usize).collect();
    let got: Vec<usize> = [1, 700, 4321, 26400].iter().map(|n| valid_length(&c, *n)).collect();
    assert_eq!(got, want, "valid_length");
    // Strict: every tensor of both layouts is used.
    model("f6f6f6f6");
    model("e5e5e5e5");
}

#[test]
fn julius_resampling() {
    if skip::<B>() {
        return;
    }
    let f = v2("blocks.safetensors");
    let x = &f["resample.in"];
    let n = x.shape[1];
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for c in 0..2 {
        let row: Vec<f64> = x.data[c * n..(c + 1) * n].iter().map(|v| *v as f64).collect();
        up.extend(resample_up2(&row).into_iter().map(|v| v as f32));
        down.extend(resample_down2(&row).into_iter().map(|v| v as f32));
    }
    check("v2 resample x2", &f["resample.up"], &HostTensor { shape: vec![2, 2 * n], data: up }, 120.0);
    check("v2 resample /2", &f["resample.down"], &HostTensor { shape: vec![2, n / 2], data: down }, 120.0);
}

#[test]
fn whole_models_at_any_length() {
    if skip::<B>() {
        return;
    }
    let f = v2("blocks.safetensors");
    let rewrite = model("e5e5e5e5");
    let plain = model("f6f6f6f6");
    for n in [26400, 4321, 700] {
        let x = &f[&format!("forward_{n}.in")];
        let y = rewrite.forward(x).unwrap();
        check(&format!("v2 forward (rewrite, {n} samples)"), &f[&format!("rewrite.forward_{n}.out")], &y, E2E_DB);
        if let Some(want) = f.get(&format!("plain.forward_{n}.out")) {
            check(&format!("v2 forward (no rewrite, {n} samples)"), want, &plain.forward(x).unwrap(), E2E_DB);
        }
    }
}

#[test]
fn apply_model_and_a_bag_of_both_families() {
    if skip::<B>() {
        return;
    }
    let f = v2("apply.safetensors");
    let opts = ApplyOptions { shifts: 0, ..ApplyOptions::default() };
    let repo = ModelRepo::open(fixtures().join("v2/repo")).unwrap();
    let plain = repo.load::<B>("f6f6f6f6", &Default::default()).unwrap();
    let y = separate(&plain, &f["track"], &opts, &mut NoProgress).unwrap();
    check("v2 apply (no rewrite)", &f["out.plain"], &y, E2E_DB);
    // The bag: waveform, hybrid, waveform; per-source weights; segment 1.5 s.
    let dir = tempfile::tempdir().unwrap();
    for (from, sig) in [("v2", "e5e5e5e5"), ("v3", "c3c3c3c3"), ("v2", "f6f6f6f6")] {
        std::fs::copy(fixtures().join(format!("{from}/repo/{sig}.th")), dir.path().join(format!("{sig}.th"))).unwrap();
    }
    std::fs::write(
        dir.path().join("mixed.yaml"),
        "models: ['e5e5e5e5', 'c3c3c3c3', 'f6f6f6f6']\nweights: [[1., 1., 0., 0.], [0., 1., 1., 1.], [1., 0., 1., 1.]]\nsegment: 1.5\n",
    )
    .unwrap();
    let bag = ModelRepo::open(dir.path()).unwrap().load::<B>("mixed", &Default::default()).unwrap();
    let y = separate(&bag, &f["track"], &opts, &mut NoProgress).unwrap();
    check("v2 apply (bag: waveform + hybrid)", &f["out.mixed"], &y, E2E_DB);
    // Weights kept in f16 on the device (`--gpu-weights f16`; these checkpoints are
    // stored in f16, like the official ones): the same stems bit for bit, LSTMs included.
    let half = ModelRepo::open(dir.path()).unwrap();
    let half = half.load_with::<B>("mixed", &Default::default(), WeightPrecision::Half).unwrap();
    assert!(separate(&half, &f["track"], &opts, &mut NoProgress).unwrap() == y, "f16 weights changed the stems");
    // The engine's streamed path: the same stems (each chunk padded with real audio
    // around it to its valid length, the shorter last one too), with passes in flight.
    check("v2 stream (bag)", &f["out.mixed"], &stream_separate(&bag, &f["track"], &opts, 2500), E2E_DB);
    let opts = ApplyOptions { shifts: 0, jobs: 2, batch_size: 2, ..opts };
    check("v2 stream, 2 jobs (bag)", &f["out.mixed"], &stream_separate(&bag, &f["track"], &opts, 2500), E2E_DB);
}
