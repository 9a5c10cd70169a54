//! The crate's error type: one variant per failing step, the source kept.

use std::path::PathBuf;

/// Everything that can go wrong loading or running a Demucs model.
#[derive(Debug, thiserror::Error)]
pub enum DemucsError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint is not a torch zip archive as this engine reads one.
    #[error("checkpoint archive: {0}")]
    Archive(String),
    /// The zip reader refused the checkpoint or one of its entries.
    #[error("checkpoint archive: {}{source}", entry.as_ref().map(|e| format!("{e}: ")).unwrap_or_default())]
    Zip {
        /// The entry read; none when the archive itself was refused.
        entry: Option<String>,
        /// The cause.
        #[source]
        source: zip::result::ZipError,
    },
    /// An entry of the checkpoint could not be read to its end.
    #[error("checkpoint archive: {entry}: {source}")]
    EntryRead {
        /// The entry.
        entry: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The pickle inside the checkpoint could not be decoded.
    #[error("checkpoint pickle: {0}")]
    Pickle(String),
    /// The checkpoint decoded but does not hold what an HTDemucs package holds.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A tensor the model needs is not in the state dict.
    #[error("missing tensor `{0}` in the checkpoint state")]
    MissingTensor(String),
    /// The state dict holds tensors the model does not use (strict loading).
    #[error("unexpected tensors in the checkpoint state: {0:?}")]
    UnexpectedTensors(Vec<String>),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// What the model expects.
        expected: Vec<usize>,
        /// What the checkpoint holds.
        found: Vec<usize>,
    },
    /// A model option this port does not implement (wiener filtering, sparse attention,
    /// quantised packages, ...).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A bad argument (segment longer than the trained one, unknown stem, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The model folder has no such model, or a bag refers to a missing checkpoint.
    #[error("model repository: {0}")]
    Repo(String),
    /// A checkpoint's sha256 does not match the checksum in its file name.
    #[error("checksum mismatch for {path}: expected {expected}, got {actual}")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// From the file name.
        expected: String,
        /// Computed.
        actual: String,
    },
    /// Decoding or encoding audio failed.
    #[error(transparent)]
    Audio(#[from] stemq_audio::AudioError),
    /// A forward pass shared with other jobs ([`crate::batch`]) failed; the message is
    /// the error of the job that ran it.
    #[error("a forward pass shared with other jobs failed: {0}")]
    SharedPass(String),
    /// The device asked for is not on this machine, or did not open.
    #[error("device unavailable: {0}")]
    DeviceUnavailable(String),
    /// An allocation failed on the device while the run was using it
    /// ([`crate::device_fault`]): its results are void.
    #[error("out of memory on {device}: {message}")]
    DeviceOutOfMemory {
        /// The device the run was on.
        device: String,
        /// The device thread's panic.
        message: String,
    },
    /// A task failed on the device's thread while the run was using it
    /// ([`crate::device_fault`]): its results are void.
    #[error("the device {device} failed a task: {message}")]
    DeviceFault {
        /// The device the run was on.
        device: String,
        /// The device thread's panic.
        message: String,
    },
    /// Stopped at a chunk boundary because the caller asked.
    #[error("cancelled")]
    Cancelled,
}

impl DemucsError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DemucsError::Io { path: path.into(), source }
    }
}
