//! A local model folder laid out like demucs's `--repo` (`demucs.repo.LocalRepo` +
//! `BagOnlyRepo`): `<sig>.th` or `<sig>-<checksum>.th` checkpoints (the checksum is the
//! first hex digits of the file's sha256, verified on load) and `<name>.yaml` bags:
//!
//! ```yaml
//! models: ['f7e0c4bc', 'd12395a8', '92cfc3b6', '04573f0d']
//! weights: [[1., 0., 0., 0.], [0., 1., 0., 0.], [0., 0., 1., 0.], [0., 0., 0., 1.]]
//! segment: 44
//! ```
//!
//! A name resolves to a bag when `<name>.yaml` exists, otherwise to the checkpoint
//! with that signature (a bag of one).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::apply::BagOfModels;
use crate::error::DemucsError;
use crate::model::HTDemucs;
use crate::nn::WeightPrecision;

/// The contents of a `<name>.yaml` bag file.
#[derive(Debug, Clone, Deserialize)]
pub struct BagFile {
    /// Signatures of the models.
    pub models: Vec<String>,
    /// Per-model, per-source weights.
    #[serde(default)]
    pub weights: Option<Vec<Vec<f32>>>,
    /// Segment override (seconds).
    #[serde(default)]
    pub segment: Option<f64>,
}

/// One checkpoint file found in the folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointFile {
    /// Path.
    pub path: PathBuf,
    /// Checksum prefix from the file name, when present.
    pub checksum: Option<String>,
}

/// A scanned model folder.
#[derive(Debug, Clone)]
pub struct ModelRepo {
    root: PathBuf,
    checkpoints: BTreeMap<String, CheckpointFile>,
    bags: BTreeMap<String, PathBuf>,
}

impl ModelRepo {
    /// Scans `root` (not recursive).
    pub fn open(root: impl AsRef<Path>) -> Result<Self, DemucsError> {
        let root = root.as_ref().to_path_buf();
        let mut checkpoints = BTreeMap::new();
        let mut bags = BTreeMap::new();
        let entries = std::fs::read_dir(&root).map_err(|e| DemucsError::io(&root, e))?;
        for entry in entries {
            let path = entry.map_err(|e| DemucsError::io(&root, e))?.path();
            let (Some(stem), Some(ext)) =
                (path.file_stem().and_then(|s| s.to_str()), path.extension().and_then(|s| s.to_str()))
            else {
                continue;
            };
            match ext {
                "th" => {
                    let (sig, checksum) = match stem.rsplit_once('-') {
                        Some((sig, sum)) => (sig.to_string(), Some(sum.to_string())),
                        None => (stem.to_string(), None),
                    };
                    if checkpoints.contains_key(&sig) {
                        return Err(DemucsError::Repo(format!("duplicate checkpoints for signature {sig}")));
                    }
                    checkpoints.insert(sig, CheckpointFile { path, checksum });
                }
                "yaml" => {
                    bags.insert(stem.to_string(), path);
                }
                _ => {}
            }
        }
        Ok(ModelRepo { root, checkpoints, bags })
    }

    /// The folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Names that can be loaded: bags, then signatures.
    pub fn names(&self) -> Vec<String> {
        self.bags.keys().chain(self.checkpoints.keys()).cloned().collect()
    }

    /// The bags (`NAME.yaml`), sorted.
    pub fn bag_names(&self) -> Vec<String> {
        self.bags.keys().cloned().collect()
    }

    /// The checkpoints' signatures, sorted.
    pub fn signatures(&self) -> Vec<String> {
        self.checkpoints.keys().cloned().collect()
    }

    /// Whether `name` resolves.
    pub fn has(&self, name: &str) -> bool {
        self.bags.contains_key(name) || self.checkpoints.contains_key(name)
    }

    /// Reads a bag file.
    pub fn bag_file(&self, name: &str) -> Result<Option<BagFile>, DemucsError> {
        let Some(path) = self.bags.get(name) else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|e| DemucsError::io(path, e))?;
        serde_yaml::from_str(&text).map(Some).map_err(|e| DemucsError::Repo(format!("{}: {e}", path.display())))
    }

    /// The checkpoint of a signature, with its checksum verified.
    pub fn checkpoint_path(&self, sig: &str) -> Result<PathBuf, DemucsError> {
        let f = self.checkpoints.get(sig).ok_or_else(|| {
            DemucsError::Repo(format!("no checkpoint with signature {sig} in {}", self.root.display()))
        })?;
        if let Some(expected) = &f.checksum {
            let actual = sha256_hex(&f.path)?;
            if !actual.starts_with(expected.as_str()) {
                return Err(DemucsError::Checksum {
                    path: f.path.clone(),
                    expected: expected.clone(),
                    actual: actual[..expected.len().min(actual.len())].to_string(),
                });
            }
        }
        Ok(f.path.clone())
    }

    /// Loads a bag or a single model onto `device`, weights in `f32`.
    pub fn load<B: Backend>(&self, name: &str, device: &B::Device) -> Result<BagOfModels<B>, DemucsError> {
        self.load_with(name, device, WeightPrecision::Full)
    }

    /// Loads a bag or a single model onto `device`, its weights kept in `precision`.
    pub fn load_with<B: Backend>(
        &self,
        name: &str,
        device: &B::Device,
        precision: WeightPrecision,
    ) -> Result<BagOfModels<B>, DemucsError> {
        let load = |sig: &str| HTDemucs::load_file_with(&self.checkpoint_path(sig)?, device, precision);
        match self.bag_file(name)? {
            Some(bag) => {
                let models = bag.models.iter().map(|sig| load(sig)).collect::<Result<Vec<_>, _>>()?;
                BagOfModels::new(models, bag.weights, bag.segment)
            }
            None if self.checkpoints.contains_key(name) => Ok(BagOfModels::single(load(name)?)),
            None => Err(DemucsError::Repo(format!(
                "no model `{name}` in {} (have: {})",
                self.root.display(),
                self.names().join(", ")
            ))),
        }
    }
}

fn sha256_hex(path: &Path) -> Result<String, DemucsError> {
    let mut f = std::fs::File::open(path).map_err(|e| DemucsError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).map_err(|e| DemucsError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}
