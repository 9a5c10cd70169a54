//! Fuzz target: the Demucs checkpoint reader (`Checkpoint::from_reader`: the zip, the
//! pickle, the tensor rebuild) and the model configuration read from its `kwargs`, as
//! `stemq models` and the engine run them on a downloaded `.th` file.
//!
//! Properties: never panics, never hangs, never allocates what a damaged header
//! declares (the harness refuses any single allocation over 256 MiB; the seeds are a
//! few kilobytes). Corpus: `tests/corpus/checkpoint/` (made from the test fixture by
//! `tests/corpus/make_checkpoint_seeds.py`); knobs in
//! `services/core/tests/fuzz_harness/mod.rs`.

#[path = "../../core/tests/fuzz_harness/mod.rs"]
mod fuzz_harness;

use std::io::Cursor;
use std::path::Path;

use fuzz_harness::{fuzz, Target};
use stemq_demucs::checkpoint::Checkpoint;
use stemq_demucs::config::HTDemucsConfig;
use stemq_demucs::pickle::unpickle;

const DICTIONARY: &[&[u8]] = &[
    b"PK\x03\x04",
    b"PK\x01\x02",
    b"PK\x05\x06",
    b"PK\x06\x06",
    b"PK\x06\x07",
    b"data.pkl",
    b"archive/data/",
    b"\x80\x02",
    b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f",
    b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80",
    b"X\xff\xff\xff\xff",
    b"\x8d\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\x8e\xff\xff\xff\xff\xff\xff\xff\x7f",
    b"\x95\xff\xff\xff\xff\xff\xff\xff\xff",
    b"J\xff\xff\xff\x7f",
    b"J\x00\x00\x00\x80",
    b"ctorch._utils\n_rebuild_tensor_v2\n",
    b"ctorch\nHalfStorage\n",
    b"ctorch\nDoubleStorage\n",
    b"h\x00",
    b"(",
    b"t",
    b"R",
    b"Q",
    b".",
];

#[test]
fn the_seeds_are_checkpoints() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/checkpoint");
    let c = Checkpoint::from_reader(Cursor::new(std::fs::read(dir.join("tiny_3_tensors.th")).unwrap())).unwrap();
    assert_eq!(c.state.keys().count(), 3);
    HTDemucsConfig::from_kwargs(&c.kwargs).unwrap();
    // The limits the fuzzing brought (copies, nesting, tensor views) admit a whole model.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/repo");
    for name in ["a0a0a0a0.th", "b1b1b1b1-95478cf1.th"] {
        let c = Checkpoint::load(&repo.join(name)).unwrap();
        assert!(c.state.keys().count() > 100, "{name}");
    }
}

#[test]
fn fuzz_checkpoint() {
    let target = Target {
        name: "checkpoint",
        corpus: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/checkpoint"),
        dictionary: DICTIONARY,
        max_len: 64 * 1024,
    };
    let storages = storages(&target.corpus.join("tiny_3_tensors.th"));
    fuzz(target, move |input| {
        // A pickle (the `.pkl` seeds) goes into a fresh zip with the seed's storages: a
        // mutated pickle inside a zip would only fail the zip's CRC check.
        let archive = if input.first() == Some(&0x80) {
            let _ = unpickle(input);
            zip_with(input, &storages)
        } else {
            input.to_vec()
        };
        match Checkpoint::from_reader(Cursor::new(archive)) {
            Ok(c) => {
                let _ = c.class_name();
                let _ = HTDemucsConfig::from_kwargs(&c.kwargs);
                true
            }
            Err(_) => false,
        }
    });
}

/// The tensor storages (`archive/data/<key>`) of a seed checkpoint.
fn storages(path: &Path) -> Vec<(String, Vec<u8>)> {
    let mut z = zip::ZipArchive::new(Cursor::new(std::fs::read(path).unwrap())).unwrap();
    let names: Vec<String> = z.file_names().filter(|n| n.contains("/data/")).map(str::to_string).collect();
    names
        .into_iter()
        .map(|n| {
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut z.by_name(&n).unwrap(), &mut b).unwrap();
            (n, b)
        })
        .collect()
}

/// A `torch.save` zip holding `pickle` as `archive/data.pkl` and `storages`.
fn zip_with(pickle: &[u8], storages: &[(String, Vec<u8>)]) -> Vec<u8> {
    use std::io::Write;
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    w.start_file("archive/data.pkl", opts).unwrap();
    w.write_all(pickle).unwrap();
    for (name, bytes) in storages {
        w.start_file(name.as_str(), opts).unwrap();
        w.write_all(bytes).unwrap();
    }
    w.finish().unwrap().into_inner()
}
