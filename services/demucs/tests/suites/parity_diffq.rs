// The `parity_diffq` suite, included once per device by `tests/parity_diffq.rs` (which defines `B`,
// `BLOCK_DB` and `E2E_DB`).

use crate::common::{check, fixtures, load_path, skip};
use stemq_demucs::checkpoint::Checkpoint;
use stemq_demucs::model::HTDemucs;

#[test]
fn quantised_models_decode_and_match_diffqs_own_restore() {
    if skip::<B>() {
        return;
    }
    let f = load_path(&fixtures().join("diffq/forward.safetensors"));
    for sig in ["d4d4d4d4", "f6f6f6f6"] {
        let path = fixtures().join(format!("diffq/{sig}q.th"));
        let ckpt = Checkpoint::load(&path).unwrap();
        let q = ckpt.quantized.as_ref().expect("a quantised package");
        assert!(q.quantized.len() >= 10 && !q.others.is_empty(), "{sig}: {} / {}", q.quantized.len(), q.others.len());
        assert_eq!(q.group_size, 8);
        let m = HTDemucs::<B>::load_file(&path, &Default::default()).expect("decodes and loads strictly");
        let y = m.forward(&f[&format!("{sig}.in")]).unwrap();
        check(&format!("diffq {sig} (quantised) forward"), &f[&format!("{sig}.out")], &y, BLOCK_DB);
    }
}
