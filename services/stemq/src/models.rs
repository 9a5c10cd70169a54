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
}

/// The released HTDemucs models (from `demucs/remote/*.yaml` and `files.txt`, 4.1.0).
pub const RELEASES: &[Release] = &[
    Release {
        name: "htdemucs",
        yaml: "models: ['955717e8']\n",
        files: &["hybrid_transformer/955717e8-8726e21a.th"],
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
    },
    Release {
        name: "htdemucs_6s",
        yaml: "models: ['5c90dfd2']\n",
        files: &["hybrid_transformer/5c90dfd2-34c22ccb.th"],
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
    for r in RELEASES {
        let complete = dir.join(format!("{}.yaml", r.name)).is_file()
            && r.files.iter().all(|f| dir.join(f.rsplit('/').next().unwrap_or(f)).is_file());
        println!("{:<14} {}", r.name, if complete { "installed" } else { "not installed (stemq models pull NAME)" });
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
