//! Object storage for inputs and outputs, chosen by URL.
//!
//! This module owns where bytes live: `file:///abs/dir` (the default, under the data
//! dir) or, later, `s3://bucket/prefix`. Outputs of a job go under `jobs/<job_id>/` with
//! deterministic names, so a re-run overwrites instead of duplicating; uploads are
//! streamed and hashed on the way.

use std::path::Path;
use std::sync::Arc;

use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjPath;
use object_store::ObjectStore;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Files up to this size are uploaded in one piece; larger ones are streamed.
const SMALL_FILE: u64 = 4 << 20;

/// Storage failures.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The store URL is not usable.
    #[error("unsupported store URL `{0}`: expected file:///absolute/dir")]
    BadUrl(String),
    /// The object store failed.
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    /// Local file trouble.
    #[error("local file {path}: {source}")]
    Io {
        /// Which file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A configured store and the URL prefix of its objects.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    base: String,
}

/// What was stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Full URI of the object.
    pub uri: String,
    /// Size.
    pub bytes: u64,
    /// Lowercase hex SHA-256.
    pub sha256: String,
}

impl Store {
    /// Opens the store at `url`.
    pub fn open(url: &str) -> Result<Store, StorageError> {
        let parsed = url::Url::parse(url).map_err(|_| StorageError::BadUrl(url.to_string()))?;
        match parsed.scheme() {
            "file" => {
                let dir = parsed
                    .to_file_path()
                    .map_err(|_| StorageError::BadUrl(url.to_string()))?;
                std::fs::create_dir_all(&dir).map_err(|source| StorageError::Io {
                    path: dir.display().to_string(),
                    source,
                })?;
                let fs = LocalFileSystem::new_with_prefix(&dir)?;
                Ok(Store {
                    inner: Arc::new(fs),
                    base: url.trim_end_matches('/').to_string(),
                })
            }
            _ => Err(StorageError::BadUrl(url.to_string())),
        }
    }

    /// A local store in `dir` (created if needed).
    pub fn local(dir: &Path) -> Result<Store, StorageError> {
        std::fs::create_dir_all(dir).map_err(|source| StorageError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let abs = dir.canonicalize().map_err(|source| StorageError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let url = url::Url::from_directory_path(&abs).map_err(|_| StorageError::BadUrl(abs.display().to_string()))?;
        Store::open(url.as_str())
    }

    /// An in-memory store (benchmarks and tests of code that only needs *a* store).
    pub fn memory() -> Store {
        Store {
            inner: Arc::new(object_store::memory::InMemory::new()),
            base: "memory://".to_string(),
        }
    }

    /// The store's URL prefix.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// URI of `key` in this store.
    pub fn uri(&self, key: &str) -> String {
        format!("{}/{}", self.base, key)
    }

    /// Streams a local file to `key`, hashing it on the way.
    pub async fn put_file(&self, key: &str, file: &Path) -> Result<Stored, StorageError> {
        let io = |source| StorageError::Io {
            path: file.display().to_string(),
            source,
        };
        let len = tokio::fs::metadata(file).await.map_err(io)?.len();
        if len <= SMALL_FILE {
            // One blocking read instead of a thread hand-off per chunk.
            let bytes = tokio::fs::read(file).await.map_err(io)?;
            return self.put_bytes(key, bytes).await;
        }
        let mut f = tokio::fs::File::open(file).await.map_err(io)?;
        let mut w = object_store::buffered::BufWriter::new(self.inner.clone(), ObjPath::from(key));
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = f.read(&mut buf).await.map_err(io)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            total += n as u64;
            w.write_all(&buf[..n]).await.map_err(|source| StorageError::Io {
                path: key.to_string(),
                source,
            })?;
        }
        w.shutdown().await.map_err(|source| StorageError::Io {
            path: key.to_string(),
            source,
        })?;
        Ok(Stored {
            uri: self.uri(key),
            bytes: total,
            sha256: hex::encode(hasher.finalize()),
        })
    }

    /// Stores a small object.
    pub async fn put_bytes(&self, key: &str, bytes: Vec<u8>) -> Result<Stored, StorageError> {
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let n = bytes.len() as u64;
        self.inner.put(&ObjPath::from(key), bytes.into()).await?;
        Ok(Stored {
            uri: self.uri(key),
            bytes: n,
            sha256,
        })
    }

    /// Reads a whole object.
    pub async fn get_bytes(&self, key: &str) -> Result<bytes::Bytes, StorageError> {
        Ok(self.inner.get(&ObjPath::from(key)).await?.bytes().await?)
    }

    /// Lists keys under `prefix`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError> {
        use futures::TryStreamExt;
        let metas: Vec<_> = self.inner.list(Some(&ObjPath::from(prefix))).try_collect().await?;
        Ok(metas.into_iter().map(|m| m.location.to_string()).collect())
    }

    /// Deletes every object under `prefix` (used to leave no partial outputs).
    pub async fn delete_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        for key in self.list(prefix).await? {
            self.inner.delete(&ObjPath::from(key.as_str())).await?;
        }
        Ok(())
    }
}

/// Key of a job's output file.
pub fn output_key(job_id: &str, file_name: &str) -> String {
    format!("jobs/{job_id}/{file_name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn local_store_streams_and_hashes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::local(&dir.path().join("store")).unwrap();
        let src = dir.path().join("in.bin");
        let data: Vec<u8> = (0..5_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&src, &data).unwrap();
        let s = store.put_file("jobs/x/a.wav", &src).await.unwrap();
        assert_eq!(s.bytes, data.len() as u64);
        assert_eq!(s.sha256, hex::encode(Sha256::digest(&data)));
        assert!(s.uri.starts_with("file:///") && s.uri.ends_with("/jobs/x/a.wav"));
        assert_eq!(store.get_bytes("jobs/x/a.wav").await.unwrap().len(), data.len());
        store.put_bytes("jobs/x/manifest.json", b"{}".to_vec()).await.unwrap();
        assert_eq!(store.list("jobs/x").await.unwrap().len(), 2);
        store.delete_prefix("jobs/x").await.unwrap();
        assert!(store.list("jobs/x").await.unwrap().is_empty());
    }
}
