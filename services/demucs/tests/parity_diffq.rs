//! DiffQ-quantised checkpoints (the `_q` models) decoded without Python: two reduced
//! models quantised by diffq 0.2.4 as demucs exports them (`scripts/make_fixtures_diffq.py`,
//! random bit widths 2 to 14), loaded, and run against the models diffq itself restores
//! (references in f64). Run with `--nocapture` for the figures.

mod common;

use common::{check, fixtures, load_path, B};
use stemq_demucs::checkpoint::Checkpoint;
use stemq_demucs::model::HTDemucs;

#[test]
fn quantised_models_decode_and_match_diffqs_own_restore() {
    let f = load_path(&fixtures().join("diffq/forward.safetensors"));
    for sig in ["d4d4d4d4", "f6f6f6f6"] {
        let path = fixtures().join(format!("diffq/{sig}q.th"));
        let ckpt = Checkpoint::load(&path).unwrap();
        let q = ckpt.quantized.as_ref().expect("a quantised package");
        assert!(q.quantized.len() >= 10 && !q.others.is_empty(), "{sig}: {} / {}", q.quantized.len(), q.others.len());
        assert_eq!(q.group_size, 8);
        let m = HTDemucs::<B>::load_file(&path, &Default::default()).expect("decodes and loads strictly");
        let y = m.forward(&f[&format!("{sig}.in")]).unwrap();
        check(&format!("diffq {sig} (quantised) forward"), &f[&format!("{sig}.out")], &y, 100.0);
    }
}
