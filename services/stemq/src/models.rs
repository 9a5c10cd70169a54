//! `stemq models pull|list`: the official Demucs checkpoints in a local model folder.
//!
//! This module owns getting weights onto a worker. The folder has the layout of
//! Demucs's `--repo` (what `stemq-demucs`'s `ModelRepo` reads): `<sig>-<checksum>.th`
//! checkpoints and `<name>.yaml` bags. `pull` downloads the files a released model needs
//! from the public root the `demucs` 4.1.0 package lists (`ROOT_URL` + the folder in its
//! `remote/files.txt`), streams each to a temporary file while hashing it, checks that the
//! SHA-256 starts with the checksum in the file name (as Demucs does), and only then
//! renames it into place: a failed or corrupt download leaves nothing behind.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

/// Where the `demucs` package downloads from.
pub const ROOT_URL: &str = "https://dl.fbaipublicfiles.com/demucs/";

/// A released model: its bag file and the checkpoints it needs (paths under the root).
pub struct Release {
    /// Model name (`-n`).
    pub name: &'static str,
    /// Content of `<name>.yaml`, as the demucs package ships it.
    pub yaml: &'static str,
    /// Checkpoint paths under [`ROOT_URL`].
    pub files: &'static [&'static str],
    /// The architecture of its checkpoints.
    pub family: Family,
    /// Approximate download size, MB (fp16 weights: 2 bytes per parameter, each
    /// distinct checkpoint once); `None` for the DiffQ-quantised ones, whose size depends
    /// on the bits each group learned.
    pub approx_mb: Option<u32>,
}

/// The architecture of a released model's checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Hybrid Transformer Demucs (v4, `demucs.htdemucs.HTDemucs`).
    HtDemucs,
    /// Hybrid Demucs (v3, `demucs.hdemucs.HDemucs`).
    HDemucs,
    /// Waveform Demucs (v2, `demucs.demucs.Demucs`).
    Demucs,
    /// Waveform Demucs and Hybrid Demucs in one bag.
    Mixed,
    /// As [`Family::HDemucs`] or [`Family::Mixed`], DiffQ-quantised (`_q`).
    Quantised,
}

impl Family {
    /// What the family is, in words.
    pub fn describe(self) -> &'static str {
        match self {
            Family::HtDemucs => "HTDemucs v4",
            Family::HDemucs => "Hybrid Demucs v3",
            Family::Demucs => "Demucs v2",
            Family::Mixed => "Demucs v2 + Hybrid Demucs v3",
            Family::Quantised => "DiffQ-quantised v2/v3",
        }
    }
}

/// Every model the `demucs` 4.1.0 package names (`demucs/remote/*.yaml` and
/// `files.txt`; the checksum is the 8 hex digits after the signature).
pub const RELEASES: &[Release] = &[
    Release {
        name: "htdemucs",
        yaml: "models: ['955717e8']\n",
        files: &["hybrid_transformer/955717e8-8726e21a.th"],
        family: Family::HtDemucs,
        approx_mb: Some(84),
    },
    Release {
        name: "htdemucs_ft",
        yaml: "models: ['f7e0c4bc', 'd12395a8', '92cfc3b6', '04573f0d']\nweights: [\n  [1., 0., 0., 0.],\n  [0., 1., 0., 0.],\n  [0., 0., 1., 0.],\n  [0., 0., 0., 1.],\n]\n",
        files: &[
            "hybrid_transformer/f7e0c4bc-ba3fe64a.th",
            "hybrid_transformer/d12395a8-e57c48e6.th",
            "hybrid_transformer/92cfc3b6-ef3bcb9c.th",
            "hybrid_transformer/04573f0d-f3cf25b2.th",
        ],
        family: Family::HtDemucs,
        approx_mb: Some(336),
    },
    Release {
        name: "htdemucs_6s",
        yaml: "models: ['5c90dfd2']\n",
        files: &["hybrid_transformer/5c90dfd2-34c22ccb.th"],
        family: Family::HtDemucs,
        approx_mb: Some(55),
    },
    Release {
        name: "hdemucs_mmi",
        yaml: "models: ['75fc33f5']\nsegment: 44\n",
        files: &["hybrid_transformer/75fc33f5-1941ce65.th"],
        family: Family::HDemucs,
        approx_mb: Some(167),
    },
    Release {
        name: "mdx",
        yaml: "models: ['0d19c1c6', '7ecf8ec1', 'c511e2ab', '7d865c68']\nweights: [\n  [1., 1., 0., 0.],\n  [0., 1., 0., 0.],\n  [1., 0., 1., 1.],\n  [1., 0., 1., 1.],\n]\nsegment: 44\n",
        files: &[
            "mdx_final/0d19c1c6-0f06f20e.th",
            "mdx_final/7ecf8ec1-70f50cc9.th",
            "mdx_final/c511e2ab-fe698775.th",
            "mdx_final/7d865c68-3d5dd56b.th",
        ],
        family: Family::Mixed,
        approx_mb: Some(691),
    },
    Release {
        name: "mdx_extra",
        yaml: "models: ['e51eebcc', 'a1d90b5c', '5d2d6c55', 'cfa93e08']\nsegment: 44\n",
        files: &[
            "mdx_final/e51eebcc-c1b80bdd.th",
            "mdx_final/a1d90b5c-ae9d2452.th",
            "mdx_final/5d2d6c55-db83574e.th",
            "mdx_final/cfa93e08-61801ae1.th",
        ],
        family: Family::HDemucs,
        approx_mb: Some(669),
    },
    Release {
        name: "mdx_q",
        yaml: "models: ['6b9c2ca1', 'b72baf4e', '42e558d4', '305bc58f']\nweights: [\n  [1., 1., 0., 0.],\n  [0., 1., 0., 0.],\n  [1., 0., 1., 1.],\n  [1., 0., 1., 1.],\n]\nsegment: 44\n",
        files: &[
            "mdx_final/6b9c2ca1-3fd82607.th",
            "mdx_final/b72baf4e-8778635e.th",
            "mdx_final/42e558d4-196e0e1b.th",
            "mdx_final/305bc58f-18378783.th",
        ],
        family: Family::Quantised,
        approx_mb: None,
    },
    Release {
        name: "mdx_extra_q",
        yaml: "models: ['83fc094f', '464b36d7', '14fc6a69', '7fd6ef75']\nsegment: 44\n",
        files: &[
            "mdx_final/83fc094f-4a16d450.th",
            "mdx_final/464b36d7-e5a9386e.th",
            "mdx_final/14fc6a69-a89dd0ee.th",
            "mdx_final/7fd6ef75-a905dd85.th",
        ],
        family: Family::Quantised,
        approx_mb: None,
    },
    Release {
        name: "repro_mdx_a",
        yaml: "models: ['9a6b4851', '1ef250f1', 'fa0cb7f9', '902315c2']\nsegment: 44\n",
        files: &[
            "mdx_final/9a6b4851-03af0aa6.th",
            "mdx_final/1ef250f1-592467ce.th",
            "mdx_final/fa0cb7f9-100d8bf4.th",
            "mdx_final/902315c2-b39ce9c9.th",
        ],
        family: Family::Mixed,
        approx_mb: Some(870),
    },
    Release {
        name: "repro_mdx_a_hybrid_only",
        yaml: "models: ['fa0cb7f9', '902315c2', 'fa0cb7f9', '902315c2']\nsegment: 44\n",
        files: &["mdx_final/fa0cb7f9-100d8bf4.th", "mdx_final/902315c2-b39ce9c9.th"],
        family: Family::HDemucs,
        approx_mb: Some(335),
    },
    Release {
        name: "repro_mdx_a_time_only",
        yaml: "models: ['9a6b4851', '9a6b4851', '1ef250f1', '1ef250f1']\nsegment: 44\n",
        files: &["mdx_final/9a6b4851-03af0aa6.th", "mdx_final/1ef250f1-592467ce.th"],
        family: Family::Demucs,
        approx_mb: Some(535),
    },
];

/// The checksum part of `<sig>-<checksum>.th`, if the name has one.
fn checksum_of(file_name: &str) -> Option<&str> {
    let stem = file_name.strip_suffix(".th")?;
    let (_, sum) = stem.split_once('-')?;
    (!sum.is_empty() && sum.bytes().all(|b| b.is_ascii_hexdigit())).then_some(sum)
}

/// True when `path` exists and its SHA-256 starts with the checksum in its name.
fn verified(path: &Path) -> bool {
    let Some(sum) = path.file_name().and_then(|n| n.to_str()).and_then(checksum_of) else { return false };
    let Ok(mut f) = std::fs::File::open(path) else { return false };
    let mut h = Sha256::new();
    if std::io::copy(&mut f, &mut h).is_err() {
        return false;
    }
    hex::encode(h.finalize()).starts_with(sum)
}

/// Downloads `files` (paths under `root`) into `dir`, verifying each; returns the local
/// paths. Files already present and intact are not downloaded again.
pub async fn pull_files(root: &str, files: &[&str], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let client = reqwest::Client::builder().build()?;
    let mut out = Vec::new();
    for rel in files {
        let name = rel.rsplit('/').next().unwrap_or(rel);
        let Some(sum) = checksum_of(name) else { bail!("{rel}: no checksum in the file name") };
        let dest = dir.join(name);
        if verified(&dest) {
            eprintln!("{name}: already here");
            out.push(dest);
            continue;
        }
        let url = format!("{}/{}", root.trim_end_matches('/'), rel);
        let resp = client.get(&url).send().await.with_context(|| format!("downloading {url}"))?;
        if !resp.status().is_success() {
            bail!("downloading {url}: HTTP {}", resp.status());
        }
        let total = resp.content_length();
        let part = dir.join(format!(".{name}.part"));
        let result: Result<()> = async {
            let mut f = tokio::fs::File::create(&part).await?;
            let mut h = Sha256::new();
            let mut got = 0u64;
            let mut body = resp.bytes_stream();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.with_context(|| format!("downloading {url}"))?;
                h.update(&chunk);
                got += chunk.len() as u64;
                f.write_all(&chunk).await?;
            }
            f.flush().await?;
            let digest = hex::encode(h.finalize());
            if !digest.starts_with(sum) {
                bail!("{name}: checksum mismatch (sha256 {}…, expected {sum}…); not installed", &digest[..sum.len()]);
            }
            if let Some(t) = total {
                if t != got {
                    bail!("{name}: got {got} of {t} bytes");
                }
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            let _ = std::fs::remove_file(&part);
            return Err(e);
        }
        std::fs::rename(&part, &dest)?;
        eprintln!("{name}: downloaded and verified");
        out.push(dest);
    }
    Ok(out)
}

/// Installs a released model into `dir` from `root`.
pub async fn pull(name: &str, dir: &Path, root: &str) -> Result<()> {
    let Some(r) = RELEASES.iter().find(|r| r.name == name) else {
        let names: Vec<_> = RELEASES.iter().map(|r| r.name).collect();
        bail!("unknown model `{name}`; released models: {}", names.join(", "));
    };
    pull_files(root, r.files, dir).await?;
    std::fs::write(dir.join(format!("{name}.yaml")), r.yaml)?;
    println!("{name} installed in {}", dir.display());
    Ok(())
}

/// Prints the released models and whether each is installed in `dir`, plus any other
/// bag in the folder.
pub fn list(dir: &Path) -> Result<()> {
    println!("{:<24} {:<30} {:>8}  {:<40} state", "name", "family", "size", "checkpoints (signature-sha256 prefix)");
    for r in RELEASES {
        let complete = dir.join(format!("{}.yaml", r.name)).is_file()
            && r.files.iter().all(|f| dir.join(f.rsplit('/').next().unwrap_or(f)).is_file());
        let state = if complete { "installed" } else { "not installed (stemq models pull NAME)" };
        let size = r.approx_mb.map_or("?".to_string(), |mb| format!("~{mb} MB"));
        let files: Vec<&str> =
            r.files.iter().map(|f| f.rsplit('/').next().unwrap_or(f).trim_end_matches(".th")).collect();
        println!("{:<24} {:<30} {:>8}  {:<40} {state}", r.name, r.family.describe(), size, files.join(" "));
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if let Some(model) = n.strip_suffix(".yaml") {
                if !RELEASES.iter().any(|r| r.name == model) {
                    println!("{model:<14} local bag");
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_come_from_the_file_name() {
        assert_eq!(checksum_of("955717e8-8726e21a.th"), Some("8726e21a"));
        assert_eq!(checksum_of("955717e8.th"), None);
        assert_eq!(checksum_of("x-zz.th"), None);
        for r in RELEASES {
            for f in r.files {
                assert!(checksum_of(f.rsplit('/').next().unwrap()).is_some(), "{f}");
            }
        }
    }

    /// Issue 14: every pretrained name of demucs 4.1.0 is known, and each bag's files are
    /// exactly the signatures its yaml names (once each).
    #[test]
    fn every_official_name_is_known_with_its_files() {
        let names: Vec<&str> = RELEASES.iter().map(|r| r.name).collect();
        for name in [
            "htdemucs",
            "htdemucs_ft",
            "htdemucs_6s",
            "hdemucs_mmi",
            "mdx",
            "mdx_extra",
            "mdx_q",
            "mdx_extra_q",
            "repro_mdx_a",
            "repro_mdx_a_hybrid_only",
            "repro_mdx_a_time_only",
        ] {
            assert!(names.contains(&name), "{name} missing");
        }
        for r in RELEASES {
            let bag: serde_yaml::Value = serde_yaml::from_str(r.yaml).unwrap_or_else(|e| panic!("{}: {e}", r.name));
            let mut sigs: Vec<&str> =
                bag["models"].as_sequence().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
            sigs.sort();
            sigs.dedup();
            let mut have: Vec<&str> =
                r.files.iter().map(|f| f.rsplit('/').next().unwrap().split('-').next().unwrap()).collect();
            have.sort();
            assert_eq!(sigs, have, "{}", r.name);
        }
    }

    /// Against a local HTTP server serving a checkpoint the test makes: a good file is
    /// installed, a corrupt one is refused and leaves nothing, a second pull is a no-op.
    #[tokio::test]
    async fn pull_verifies_and_installs_atomically() {
        let good: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let sum = hex::encode(Sha256::digest(&good))[..8].to_string();
        let good_name = format!("abcd1234-{sum}.th");
        let bad_name = "ffff0000-00000000.th".to_string();
        let (g2, gn, bn) = (good.clone(), good_name.clone(), bad_name.clone());
        let app = axum::Router::new().route(
            "/hybrid_transformer/{file}",
            axum::routing::get(move |axum::extract::Path(file): axum::extract::Path<String>| {
                let (g, gn, bn) = (g2.clone(), gn.clone(), bn.clone());
                async move {
                    if file == gn {
                        Ok(g)
                    } else if file == bn {
                        Ok(b"not the expected bytes".to_vec())
                    } else {
                        Err(axum::http::StatusCode::NOT_FOUND)
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let root = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let dir = tempfile::tempdir().unwrap();

        let rel = format!("hybrid_transformer/{good_name}");
        let got = pull_files(&root, &[rel.as_str()], dir.path()).await.unwrap();
        assert_eq!(std::fs::read(&got[0]).unwrap(), good);
        assert!(verified(&got[0]));
        // Again: already there, nothing fetched (the server would still answer).
        pull_files(&root, &[rel.as_str()], dir.path()).await.unwrap();

        let bad = format!("hybrid_transformer/{bad_name}");
        let err = pull_files(&root, &[bad.as_str()], dir.path()).await.unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from(&good_name)], "nothing partial left");

        let missing = "hybrid_transformer/00000000-11111111.th";
        assert!(pull_files(&root, &[missing], dir.path()).await.unwrap_err().to_string().contains("404"));
    }
}
