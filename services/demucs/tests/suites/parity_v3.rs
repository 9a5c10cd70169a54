// The `parity_v3` suite, included once per device by `tests/parity_v3.rs` (which defines `B`,
// `BLOCK_DB` and `E2E_DB`).

use std::collections::HashMap;

use crate::common::{check, dev, fixtures, load_path, skip, stream_separate};
use stemq_demucs::apply::{separate, ApplyOptions, NoProgress};
use stemq_demucs::checkpoint::{Checkpoint, HostTensor};
use stemq_demucs::config::{Arch, HTDemucsConfig};
use stemq_demucs::model::HTDemucs;
use stemq_demucs::nn::to_host;
use stemq_demucs::repo::ModelRepo;

fn v3(name: &str) -> HashMap<String, HostTensor> {
    load_path(&fixtures().join("v3").join(name))
}

fn model(sig: &str) -> HTDemucs<B> {
    HTDemucs::load_file(&fixtures().join(format!("v3/repo/{sig}.th")), &Default::default()).expect("load model")
}

#[test]
fn an_hdemucs_checkpoint_reads_with_its_class_defaults() {
    if skip::<B>() {
        return;
    }
    let ckpt = Checkpoint::load(&fixtures().join("v3/repo/d4d4d4d4.th")).unwrap();
    assert_eq!(ckpt.class_name().as_deref(), Some("demucs.hdemucs.HDemucs"));
    let c = HTDemucsConfig::for_arch(Arch::HDemucs, &ckpt.args, &ckpt.kwargs).unwrap();
    assert_eq!((c.arch, c.depth, c.nfft, c.cac, c.hybrid_old), (Arch::HDemucs, 4, 256, false, true));
    assert_eq!((c.dconv_lstm, c.dconv_attn, c.norm_starts, c.use_train_segment), (2, 2, 2, false));
    assert_eq!(c.segment_seconds(), 2.0);
    // The BLSTM and LocalState weights sit at DConv indices 3 and 4.
    assert!(ckpt.state.get("encoder.3.dconv.layers.0.3.lstm.weight_ih_l1_reverse").is_some());
    assert!(ckpt.state.get("encoder.3.dconv.layers.1.4.query_decay.weight").is_some());
    assert!(ckpt.state.get("encoder.3.dconv.layers.1.8.scale").is_some());
    // Loading is strict: every tensor is used.
    model("d4d4d4d4");
}

#[test]
fn blstm_and_localstate() {
    if skip::<B>() {
        return;
    }
    let f = v3("blocks.safetensors");
    let m = model("c3c3c3c3");
    let d = m.encoder(3).dconv().expect("encoder 3 has a DConv");
    let y = to_host(d.lstm(0).expect("a BLSTM").forward(dev(&f["cac.blstm.in0"])));
    assert!(f["cac.blstm.in0"].shape[2] > 200, "the fixture runs the BLSTM's framing");
    check("v3 BLSTM (framed)", &f["cac.blstm.out0"], &y, BLOCK_DB);
    let y = to_host(d.attn(1).expect("a LocalState").forward(dev(&f["cac.localstate.in0"])));
    check("v3 LocalState", &f["cac.localstate.out0"], &y, BLOCK_DB);
}

#[test]
fn merge_layers() {
    if skip::<B>() {
        return;
    }
    let f = v3("blocks.safetensors");
    let m = model("c3c3c3c3");
    let y = to_host(m.tencoder(2).forward_time(dev(&f["cac.tenc2.in0"])));
    check("v3 tencoder[2] (empty)", &f["cac.tenc2.out0"], &y, BLOCK_DB);
    let y = to_host(m.encoder(2).forward_freq_inject(dev(&f["cac.enc2.in0"]), Some(dev(&f["cac.enc2.in1"]))));
    check("v3 encoder[2] (last freq, inject)", &f["cac.enc2.out0"], &y, BLOCK_DB);
    // encoder[3] gets the 4-D output of encoder[2] (one frequency row), viewed as time.
    let x = &f["cac.enc3.in0"];
    let x3 = HostTensor { shape: vec![x.shape[0], x.shape[1] * x.shape[2], x.shape[3]], data: x.data.clone() };
    let y = to_host(m.encoder(3).forward_time(dev(&x3)));
    check("v3 encoder[3] (time after the merge)", &f["cac.enc3.out0"], &y, BLOCK_DB);
    let length = f["cac.dec0.in2"].data[0] as usize;
    let (z, pre) = m.decoder(0).forward_time(dev(&f["cac.dec0.in0"]), dev(&f["cac.dec0.in1"]), length);
    check("v3 decoder[0] (time)", &f["cac.dec0.out0"], &to_host(z), BLOCK_DB);
    check("v3 decoder[0] pre", &f["cac.dec0.out1"], &to_host(pre), BLOCK_DB);
    // decoder[1] takes the 3-D output of decoder[0], viewed with one frequency row.
    let x = &f["cac.dec1.in0"];
    let x4 = HostTensor { shape: vec![x.shape[0], x.shape[1], 1, x.shape[2]], data: x.data.clone() };
    let (z, pre) = m.decoder(1).forward_freq(dev(&x4), dev(&f["cac.dec1.in1"]));
    check("v3 decoder[1] (last freq)", &f["cac.dec1.out0"], &to_host(z), BLOCK_DB);
    check("v3 decoder[1] pre", &f["cac.dec1.out1"], &to_host(pre), BLOCK_DB);
    let length = f["cac.tdec0.in2"].data[0] as usize;
    let (z, _) = m.tdecoder(0).forward_time_skip(dev(&f["cac.tdec0.in0"]), None, length);
    check("v3 tdecoder[0] (empty, fed pre)", &f["cac.tdec0.out0"], &to_host(z), BLOCK_DB);
}

#[test]
fn whole_models_at_any_length() {
    if skip::<B>() {
        return;
    }
    let f = v3("blocks.safetensors");
    let cac = model("c3c3c3c3");
    check("v3 forward (cac, 3.3 s)", &f["cac.forward.out"], &cac.forward(&f["cac.forward.in"]).unwrap(), E2E_DB);
    let mag = model("d4d4d4d4");
    for n in [4321, 700, 1] {
        let key = |p: &str, io: &str| format!("{p}.forward_{n}.{io}");
        for (p, m) in [("cac", &cac), ("mag", &mag)] {
            let y = m.forward(&f[&key(p, "in")]).unwrap();
            check(&format!("v3 forward ({p}, {n} samples)"), &f[&key(p, "out")], &y, E2E_DB);
        }
    }
}

#[test]
fn apply_model_and_a_bag_of_both() {
    if skip::<B>() {
        return;
    }
    let f = v3("apply.safetensors");
    let opts = ApplyOptions { shifts: 0, ..ApplyOptions::default() };
    let repo = ModelRepo::open(fixtures().join("v3/repo")).unwrap();
    // The model's own 2 s segments; the last chunk is shorter and goes in as is.
    let single = repo.load::<B>("c3c3c3c3", &Default::default()).unwrap();
    let y = separate(&single, &f["track"], &opts, &mut NoProgress).unwrap();
    check("v3 apply (cac)", &f["out.cac"], &y, E2E_DB);
    // Both models, the bag's 1.5 s segment, equal weights.
    let bag = repo.load::<B>("hybrid", &Default::default()).unwrap();
    let y = separate(&bag, &f["track"], &opts, &mut NoProgress).unwrap();
    check("v3 apply (bag: cac + magnitude/hybrid_old)", &f["out.bag"], &y, E2E_DB);
}

/// The engine's path: the track streamed in blocks through `separate_stream` (the
/// worker's memory stays flat) gives the same stems as `apply_model` on the whole track,
/// the short last chunk included; and a `segment` asked for applies to Hybrid Demucs as
/// chunk length (no padding to it), with several passes in flight.
#[test]
fn streaming_matches_apply_model() {
    if skip::<B>() {
        return;
    }
    let f = v3("apply.safetensors");
    let repo = ModelRepo::open(fixtures().join("v3/repo")).unwrap();
    let bag = repo.load::<B>("hybrid", &Default::default()).unwrap();
    let track = &f["track"];
    let opts = ApplyOptions { shifts: 0, ..ApplyOptions::default() };
    check("v3 stream (bag)", &f["out.bag"], &stream_separate(&bag, track, &opts, 3000), E2E_DB);
    let opts = ApplyOptions { shifts: 0, segment: Some(1.1), jobs: 2, batch_size: 2, ..ApplyOptions::default() };
    let whole = separate(&bag, track, &opts, &mut NoProgress).unwrap();
    check("v3 stream = apply at a 1.1 s segment", &whole, &stream_separate(&bag, track, &opts, 3000), 120.0);
}

/// MultiWrap (`multi_freqs`, as in the `mdx` member 7d865c68): the two outer layers of
/// `g7g7g7g7` each run as three band copies, encoders and decoders; whole model too.
#[test]
fn multiwrap_bands() {
    if skip::<B>() {
        return;
    }
    let f = v3("multi.safetensors");
    let m = model("g7g7g7g7");
    for i in [0, 1] {
        let y = to_host(m.encoder(i).forward_freq(dev(&f[&format!("enc{i}.in0")])));
        check(&format!("v3 MultiWrap encoder[{i}]"), &f[&format!("enc{i}.out0")], &y, BLOCK_DB);
    }
    for i in [2, 3] {
        let (z, _) = m.decoder(i).forward_freq(dev(&f[&format!("dec{i}.in0")]), dev(&f[&format!("dec{i}.in1")]));
        let what = if i == 3 { "MultiWrap decoder[3]" } else { "decoder[2] (under it)" };
        check(&format!("v3 {what}"), &f[&format!("dec{i}.out0")], &to_host(z), BLOCK_DB);
    }
    check("v3 forward (MultiWrap)", &f["forward.out"], &m.forward(&f["forward.in"]).unwrap(), E2E_DB);
}
