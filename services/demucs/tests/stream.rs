//! Streaming separation equals the in-memory `separate` (and so PyTorch's
//! `apply_model`) for every case of the fixtures, whatever the block size.

mod common;

use common::{check, fixtures, load, B};
use stemq_demucs::apply::{ApplyOptions, BagOfModels, NoProgress};
use stemq_demucs::checkpoint::HostTensor;
use stemq_demucs::model::HTDemucs;
use stemq_demucs::repo::ModelRepo;
use stemq_demucs::stream::{separate_stream, StatsAccumulator};

fn run(bag: &BagOfModels<B>, track: &HostTensor, opts: &ApplyOptions, block: usize) -> HostTensor {
    let len = track.shape[1];
    let (l, r) = track.data.split_at(len);
    let mut acc = StatsAccumulator::default();
    acc.push(&[l, r]);
    let stats = acc.finish();
    let mut pos = 0;
    let mut next = || {
        if pos >= len {
            return Ok(None);
        }
        let end = (pos + block).min(len);
        let b = vec![l[pos..end].to_vec(), r[pos..end].to_vec()];
        pos = end;
        Ok(Some(b))
    };
    let nsrc = bag.sources().len();
    let mut rows: Vec<Vec<f32>> = vec![Vec::new(); nsrc * 2];
    let mut max_block = 0;
    let mut sink = |t: HostTensor| {
        let n = t.shape[2];
        max_block = max_block.max(n);
        for (r, row) in rows.iter_mut().enumerate() {
            row.extend_from_slice(&t.data[r * n..(r + 1) * n]);
        }
        Ok(())
    };
    separate_stream(bag, stats, &mut next, opts, &mut NoProgress, &mut sink).unwrap();
    HostTensor { shape: vec![nsrc, 2, len], data: rows.concat() }
}

fn opts(shifts: usize) -> ApplyOptions {
    ApplyOptions { shifts, ..ApplyOptions::default() }
}

#[test]
fn streaming_matches_the_reference() {
    let f = load("apply.safetensors");
    let model = HTDemucs::<B>::load_file(&fixtures().join("repo/a0a0a0a0.th"), &Default::default()).unwrap();
    let bag = BagOfModels::single(model);
    for block in [777, 5000] {
        let y = run(&bag, &f["track"], &opts(0), block);
        check(&format!("stream split (blocks {block})"), &f["out.split"], &y, 90.0);
    }
    let y = run(&bag, &f["track"], &ApplyOptions { segment: Some(1.0), ..opts(0) }, 1000);
    check("stream segment=1.0", &f["out.segment"], &y, 90.0);
    let y = run(&bag, &f["short_track"], &opts(0), 1000);
    check("stream short input", &f["out.short"], &y, 90.0);
    let text = std::fs::read_to_string(fixtures().join("meta.json")).unwrap();
    let at = text.find("\"shift_offsets\"").unwrap();
    let open = at + text[at..].find('[').unwrap();
    let close = open + text[open..].find(']').unwrap();
    let offsets: Vec<usize> = text[open + 1..close].split(',').map(|s| s.trim().parse().unwrap()).collect();
    let y = run(&bag, &f["track"], &ApplyOptions { shift_offsets: Some(offsets), ..opts(2) }, 1234);
    check("stream shifts=2", &f["out.shifts"], &y, 90.0);
    let repo = ModelRepo::open(fixtures().join("repo")).unwrap();
    let bag2 = repo.load::<B>("tinybag", &Default::default()).unwrap();
    let y = run(&bag2, &f["track"], &opts(0), 3000);
    check("stream bag", &f["out.bag"], &y, 90.0);
    // Concurrent forward passes and batches give the same samples.
    let y = run(&bag2, &f["track"], &ApplyOptions { jobs: 2, batch_size: 2, ..opts(0) }, 3000);
    check("stream bag, 2 jobs × batch 2", &f["out.bag"], &y, 90.0);
}
