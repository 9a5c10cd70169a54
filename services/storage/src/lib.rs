//! Object storage for inputs and outputs, chosen by URL.
//!
//! This module owns where bytes live: `file:///abs/dir` (the default, under the data
//! dir) or `s3://bucket/prefix` (any S3-compatible service; credentials, region and
//! endpoint come from the usual `AWS_*` environment variables, e.g. `AWS_ENDPOINT_URL`,
//! `AWS_ALLOW_HTTP`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`). Outputs of a job go under
//! `jobs/<job_id>/` with deterministic names, so a re-run overwrites instead of
//! duplicating; uploads are streamed and hashed on the way, never held in memory.
//! A local store is this service's alone: its folder and every folder in it are mode
//! 0700, every object 0600, so no other user of the machine reads an owner's audio.
//! Which URIs may be *read* is [`stemq_core::uri`]'s business.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjPath;
use object_store::prefix::PrefixStore;
use object_store::signer::Signer;
use object_store::{GetOptions, GetRange, ObjectStore};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Files up to this size are uploaded in one piece; larger ones are streamed.
const SMALL_FILE: u64 = 4 << 20;

/// Storage failures.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The store URL is not usable.
    #[error("unsupported store URL `{0}`: expected file:///absolute/dir or s3://bucket[/prefix]")]
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
    /// A streamed upload went past its size limit (nothing was kept).
    #[error("larger than the limit of {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: u64,
    },
    /// The stream being stored failed (client went away...); nothing was kept.
    #[error("reading the upload: {0}")]
    Source(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl StorageError {
    /// True when the object does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, StorageError::Store(object_store::Error::NotFound { .. }))
    }
}

/// A configured store and the URL prefix of its objects.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    base: String,
    /// S3 only: the bucket store (for presigned URLs) and the key prefix in it.
    s3: Option<(Arc<AmazonS3>, String)>,
    /// Local stores only: the folder (see [`Store::restrict`]).
    root: Option<Arc<std::path::PathBuf>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("base", &self.base).finish_non_exhaustive()
    }
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

/// A byte stream read from the store.
pub type ByteStream = BoxStream<'static, Result<Bytes, StorageError>>;

impl Store {
    /// Opens the store at `url` (`file:///abs/dir` or `s3://bucket[/prefix]`).
    pub fn open(url: &str) -> Result<Store, StorageError> {
        let parsed = url::Url::parse(url).map_err(|_| StorageError::BadUrl(url.to_string()))?;
        match parsed.scheme() {
            "file" => {
                let dir = parsed.to_file_path().map_err(|_| StorageError::BadUrl(url.to_string()))?;
                let io = |source| StorageError::Io { path: dir.display().to_string(), source };
                std::fs::create_dir_all(&dir).map_err(io)?;
                private(&dir, true).map_err(io)?;
                let fs = LocalFileSystem::new_with_prefix(&dir)?;
                let base = url.trim_end_matches('/').to_string();
                Ok(Store { inner: Arc::new(fs), base, s3: None, root: Some(Arc::new(dir)) })
            }
            "s3" => {
                let bucket =
                    parsed.host_str().filter(|b| !b.is_empty()).ok_or_else(|| StorageError::BadUrl(url.into()))?;
                if parsed.query().is_some() || parsed.fragment().is_some() {
                    return Err(StorageError::BadUrl(url.to_string()));
                }
                let prefix = parsed.path().trim_matches('/').to_string();
                let s3 = Arc::new(AmazonS3Builder::from_env().with_bucket_name(bucket).build()?);
                let inner: Arc<dyn ObjectStore> = if prefix.is_empty() {
                    s3.clone()
                } else {
                    Arc::new(PrefixStore::new(s3.clone() as Arc<dyn ObjectStore>, prefix.as_str()))
                };
                let base = if prefix.is_empty() { format!("s3://{bucket}") } else { format!("s3://{bucket}/{prefix}") };
                Ok(Store { inner, base, s3: Some((s3, prefix)), root: None })
            }
            _ => Err(StorageError::BadUrl(url.to_string())),
        }
    }

    /// A local store in `dir` (created if needed).
    pub fn local(dir: &Path) -> Result<Store, StorageError> {
        std::fs::create_dir_all(dir).map_err(|source| StorageError::Io { path: dir.display().to_string(), source })?;
        let abs = dir.canonicalize().map_err(|source| StorageError::Io { path: dir.display().to_string(), source })?;
        let url = url::Url::from_directory_path(&abs).map_err(|_| StorageError::BadUrl(abs.display().to_string()))?;
        Store::open(url.as_str())
    }

    /// An in-memory store (benchmarks and tests of code that only needs *a* store).
    pub fn memory() -> Store {
        Store {
            inner: Arc::new(object_store::memory::InMemory::new()),
            base: "memory://mem".to_string(),
            s3: None,
            root: None,
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

    /// True for stores reached over the network (S3): each object is a request whose
    /// time is mostly waiting, so several are worth having in flight at once. A local
    /// store's writes are this machine's CPU and disk, better done one at a time.
    pub fn is_remote(&self) -> bool {
        self.s3.is_some()
    }

    /// True for stores that can hand out presigned URLs (S3).
    pub fn can_presign(&self) -> bool {
        self.s3.is_some()
    }

    /// A streaming writer with bounded memory: 8 MiB parts (S3's minimum is 5 MiB), at
    /// most two in flight — so memory does not grow with the length of a stem.
    fn writer(&self, path: ObjPath) -> object_store::buffered::BufWriter {
        object_store::buffered::BufWriter::with_capacity(self.inner.clone(), path, 8 << 20).with_max_concurrency(2)
    }

    /// Streams a local file to `key`, hashing it on the way.
    pub async fn put_file(&self, key: &str, file: &Path) -> Result<Stored, StorageError> {
        let io = |source| StorageError::Io { path: file.display().to_string(), source };
        let len = tokio::fs::metadata(file).await.map_err(io)?.len();
        if len <= SMALL_FILE {
            // One blocking read instead of a thread hand-off per chunk.
            let bytes = tokio::fs::read(file).await.map_err(io)?;
            return self.put_bytes(key, bytes).await;
        }
        let mut f = tokio::fs::File::open(file).await.map_err(io)?;
        let mut w = self.writer(ObjPath::from(key));
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
            w.write_all(&buf[..n]).await.map_err(|source| StorageError::Io { path: key.to_string(), source })?;
        }
        w.shutdown().await.map_err(|source| StorageError::Io { path: key.to_string(), source })?;
        self.restrict(key)?;
        Ok(Stored { uri: self.uri(key), bytes: total, sha256: hex::encode(hasher.finalize()) })
    }

    /// Streams `body` to `key`, hashing and counting on the way; past `limit` bytes it
    /// stops, removes what was written and returns [`StorageError::TooLarge`]. A failing
    /// body also leaves nothing behind.
    pub async fn put_stream<S, E>(&self, key: &str, body: S, limit: u64) -> Result<Stored, StorageError>
    where
        S: Stream<Item = Result<Bytes, E>> + Unpin,
        E: std::error::Error + Send + Sync + 'static,
    {
        let path = ObjPath::from(key);
        let mut w = self.writer(path.clone());
        let result = async {
            let mut body = body;
            let mut hasher = Sha256::new();
            let mut total = 0u64;
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| StorageError::Source(Box::new(e)))?;
                total += chunk.len() as u64;
                if total > limit {
                    return Err(StorageError::TooLarge { limit });
                }
                hasher.update(&chunk);
                w.put(chunk).await?;
            }
            Ok((total, hex::encode(hasher.finalize())))
        }
        .await;
        match result {
            Ok((bytes, sha256)) => {
                w.shutdown().await.map_err(|source| StorageError::Io { path: key.to_string(), source })?;
                self.restrict(key)?;
                Ok(Stored { uri: self.uri(key), bytes, sha256 })
            }
            Err(e) => {
                let _ = w.abort().await;
                let _ = self.inner.delete(&path).await;
                Err(e)
            }
        }
    }

    /// Moves `from` to `to` inside the store (overwriting `to`).
    pub async fn rename(&self, from: &str, to: &str) -> Result<(), StorageError> {
        self.inner.rename(&ObjPath::from(from), &ObjPath::from(to)).await?;
        self.restrict(to)
    }

    /// Stores a small object.
    pub async fn put_bytes(&self, key: &str, bytes: Vec<u8>) -> Result<Stored, StorageError> {
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let n = bytes.len() as u64;
        self.inner.put(&ObjPath::from(key), bytes.into()).await?;
        self.restrict(key)?;
        Ok(Stored { uri: self.uri(key), bytes: n, sha256 })
    }

    /// Local stores: makes the object `key` mode 0600 and every folder from it up to the
    /// store's own 0700 (the object store creates them with the process's umask).
    /// Nothing to do elsewhere.
    fn restrict(&self, key: &str) -> Result<(), StorageError> {
        let Some(root) = self.root.as_deref() else {
            return Ok(());
        };
        let file = root.join(key);
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| StorageError::Io { path, source }
        };
        private(&file, false).map_err(io(&file))?;
        let mut dir = file.parent();
        while let Some(d) = dir.filter(|d| d.starts_with(root) && *d != root) {
            private(d, true).map_err(io(d))?;
            dir = d.parent();
        }
        Ok(())
    }

    /// Reads a whole object (small objects only: manifests, tests).
    pub async fn get_bytes(&self, key: &str) -> Result<Bytes, StorageError> {
        Ok(self.inner.get(&ObjPath::from(key)).await?.bytes().await?)
    }

    /// Size of an object, `None` when it does not exist.
    pub async fn size(&self, key: &str) -> Result<Option<u64>, StorageError> {
        match self.inner.head(&ObjPath::from(key)).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Streams an object (or the byte `range` of it).
    pub async fn get_stream(&self, key: &str, range: Option<Range<u64>>) -> Result<ByteStream, StorageError> {
        let opts = GetOptions { range: range.map(GetRange::Bounded), ..GetOptions::default() };
        let res = self.inner.get_opts(&ObjPath::from(key), opts).await?;
        Ok(res.into_stream().map_err(StorageError::from).boxed())
    }

    /// Streams an object to a local file chunk by chunk; returns its size. A partial
    /// file is removed on error.
    pub async fn get_to_file(&self, key: &str, file: &Path) -> Result<u64, StorageError> {
        let io = |source| StorageError::Io { path: file.display().to_string(), source };
        let mut stream = self.get_stream(key, None).await?;
        let result = async {
            let mut f = tokio::fs::File::create(file).await.map_err(io)?;
            let mut total = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk?;
                total += chunk.len() as u64;
                f.write_all(&chunk).await.map_err(io)?;
            }
            f.flush().await.map_err(io)?;
            f.sync_all().await.map_err(io)?;
            Ok(total)
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(file).await;
        }
        result
    }

    /// A presigned GET URL for `key`, valid for `expires_in`; `None` for stores that
    /// cannot sign (local files).
    pub async fn presigned_get(&self, key: &str, expires_in: Duration) -> Result<Option<url::Url>, StorageError> {
        let Some((s3, prefix)) = &self.s3 else {
            return Ok(None);
        };
        let full = if prefix.is_empty() { key.to_string() } else { format!("{prefix}/{key}") };
        Ok(Some(s3.signed_url(http::Method::GET, &ObjPath::from(full), expires_in).await?))
    }

    /// Lists keys under `prefix`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError> {
        let metas: Vec<_> = self.inner.list(Some(&ObjPath::from(prefix))).try_collect().await?;
        Ok(metas.into_iter().map(|m| m.location.to_string()).collect())
    }

    /// Deletes one object (absent is fine).
    pub async fn delete(&self, key: &str) -> Result<(), StorageError> {
        match self.inner.delete(&ObjPath::from(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes every object under `prefix` (so that no partial outputs are left).
    pub async fn delete_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        for key in self.list(prefix).await? {
            self.inner.delete(&ObjPath::from(key.as_str())).await?;
        }
        Ok(())
    }
}

/// Makes `path` readable by this user only: 0700 for a folder, 0600 for a file.
#[cfg(unix)]
fn private(path: &Path, folder: bool) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(if folder { 0o700 } else { 0o600 }))
}

#[cfg(not(unix))]
fn private(_: &Path, _: bool) -> std::io::Result<()> {
    Ok(())
}

/// Key of a job's output file.
pub fn output_key(job_id: &str, file_name: &str) -> String {
    format!("jobs/{job_id}/{file_name}")
}

/// Key of a job's manifest.
pub fn manifest_key(job_id: &str) -> String {
    output_key(job_id, "manifest.json")
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
        assert_eq!(store.size("jobs/x/a.wav").await.unwrap(), Some(data.len() as u64));
        assert_eq!(store.size("jobs/x/nope").await.unwrap(), None);

        let back = dir.path().join("back.bin");
        assert_eq!(store.get_to_file("jobs/x/a.wav", &back).await.unwrap(), data.len() as u64);
        assert_eq!(std::fs::read(&back).unwrap(), data);
        let part: Vec<Bytes> =
            store.get_stream("jobs/x/a.wav", Some(10..20)).await.unwrap().try_collect().await.unwrap();
        assert_eq!(part.concat(), data[10..20]);
        assert!(store.get_to_file("jobs/x/nope", &dir.path().join("n")).await.unwrap_err().is_not_found());
        assert!(!dir.path().join("n").exists());
        assert!(store.presigned_get("jobs/x/a.wav", Duration::from_secs(60)).await.unwrap().is_none());

        store.delete_prefix("jobs/x").await.unwrap();
        assert!(store.list("jobs/x").await.unwrap().is_empty());
    }

    /// Mode bits of `path` (permissions only).
    #[cfg(unix)]
    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// Another user of the machine reads nothing of a local store: whatever the umask
    /// (here the usual 022), its folders are 0700 and its objects 0600, however written.
    #[cfg(unix)]
    #[tokio::test]
    async fn a_local_store_is_readable_by_its_user_only() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let store = Store::local(&root).unwrap();
        assert_eq!(mode(&root), 0o700);
        let big = dir.path().join("big.bin");
        std::fs::write(&big, vec![7u8; (SMALL_FILE + 1) as usize]).unwrap();
        store.put_file("jobs/j1/vocals.wav", &big).await.unwrap();
        store.put_bytes("jobs/j1/manifest.json", b"{}".to_vec()).await.unwrap();
        let chunks = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"RIFF"))]);
        store.put_stream("uploads/alice/.tmp/u1", chunks, 100).await.unwrap();
        store.rename("uploads/alice/.tmp/u1", "uploads/alice/abc.wav").await.unwrap();
        for folder in ["jobs", "jobs/j1", "uploads", "uploads/alice"] {
            assert_eq!(mode(&root.join(folder)), 0o700, "{folder}");
        }
        for file in ["jobs/j1/vocals.wav", "jobs/j1/manifest.json", "uploads/alice/abc.wav"] {
            assert_eq!(mode(&root.join(file)), 0o600, "{file}");
        }
    }

    #[tokio::test]
    async fn put_stream_hashes_limits_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::local(&dir.path().join("store")).unwrap();
        let chunks = || futures::stream::iter((0..10u8).map(|i| Ok::<_, std::io::Error>(Bytes::from(vec![i; 1000]))));
        let s = store.put_stream("uploads/tmp/a", chunks(), 10_000).await.unwrap();
        assert_eq!(s.bytes, 10_000);
        let all: Vec<u8> = (0..10u8).flat_map(|i| vec![i; 1000]).collect();
        assert_eq!(s.sha256, hex::encode(Sha256::digest(&all)));
        store.rename("uploads/tmp/a", "uploads/b").await.unwrap();
        assert_eq!(store.get_bytes("uploads/b").await.unwrap(), all);

        let e = store.put_stream("uploads/tmp/c", chunks(), 9_999).await.unwrap_err();
        assert!(matches!(e, StorageError::TooLarge { limit: 9_999 }), "{e}");
        assert_eq!(store.size("uploads/tmp/c").await.unwrap(), None);

        let failing =
            futures::stream::iter(vec![Ok(Bytes::from_static(b"abc")), Err(std::io::Error::other("client went away"))]);
        let e = store.put_stream("uploads/tmp/d", failing, 100).await.unwrap_err();
        assert!(e.to_string().contains("client went away"), "{e}");
        assert_eq!(store.size("uploads/tmp/d").await.unwrap(), None);
    }

    #[test]
    fn s3_urls_parse() {
        std::env::set_var("AWS_REGION", "us-east-1");
        let s = Store::open("s3://songs/prod/").unwrap();
        assert_eq!(s.base_url(), "s3://songs/prod");
        assert!(s.can_presign());
        assert_eq!(Store::open("s3://songs").unwrap().base_url(), "s3://songs");
        assert!(matches!(Store::open("gs://songs"), Err(StorageError::BadUrl(_))));
        assert!(matches!(Store::open("s3:///nobucket"), Err(StorageError::BadUrl(_))));
    }
}
