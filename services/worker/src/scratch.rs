//! Local scratch space, and the leftovers of workers that died.
//!
//! This module owns the worker's folders on local disk. Each worker process works in
//! `<scratch>/w-<uuid>/`, which it holds locked (an advisory file lock on `.lock`) for its
//! whole life; each attempt gets `<job_id>-<attempt>/` inside it, removed when the
//! attempt ends however it ends. A process killed mid-job (kill -9, out-of-memory kill,
//! power loss) cannot clean up, and its lock dies with it: [`Scratch::sweep`] removes
//! every process folder whose lock nobody holds. It runs when a worker starts and when a
//! redelivered job arrives (the sign that some attempt ended uncleanly), so leftovers
//! never pile up, and it never touches the folder of a live worker, even one sharing the
//! same scratch root on the same machine.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

const LOCK: &str = ".lock";

/// This process's scratch folder, locked while it lives.
pub struct Scratch {
    root: PathBuf,
    dir: PathBuf,
    /// Holds the lock; released when the process ends, however it ends.
    _lock: File,
}

impl Scratch {
    /// Creates and locks a fresh process folder under `root`, then sweeps leftovers.
    pub fn open(root: &Path) -> std::io::Result<Scratch> {
        std::fs::create_dir_all(root)?;
        let dir = root.join(format!("w-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        let lock = File::create(dir.join(LOCK))?;
        lock.try_lock().map_err(|e| match e {
            TryLockError::Error(e) => e,
            TryLockError::WouldBlock => std::io::Error::other("fresh scratch folder already locked"),
        })?;
        let s = Scratch { root: root.to_path_buf(), dir, _lock: lock };
        s.sweep();
        Ok(s)
    }

    /// The folder of one attempt (not created).
    pub fn attempt_dir(&self, job_id: &str, attempt: u32) -> PathBuf {
        self.dir.join(format!("{job_id}-{attempt}"))
    }

    /// This process's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Removes the folders of dead workers (lock not held), and attempt folders left
    /// directly under the root by versions before per-process folders. Returns how many
    /// folders it removed.
    pub fn sweep(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.root) else { return 0 };
        let mut removed = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            if path == self.dir || !path.is_dir() {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let stale = if name.starts_with("w-") {
                match File::open(path.join(LOCK)) {
                    // Held by a live worker: not ours to touch.
                    Ok(f) => match f.try_lock() {
                        Ok(()) => true,
                        Err(TryLockError::WouldBlock) => false,
                        Err(TryLockError::Error(_)) => false,
                    },
                    // A folder whose lock file was never written: its creator died at once.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
                    Err(_) => false,
                }
            } else {
                is_legacy_attempt_dir(&name)
            };
            if stale {
                match std::fs::remove_dir_all(&path) {
                    Ok(()) => {
                        removed += 1;
                        info!(event = "scratch.swept", folder = %path.display(), "removed a dead worker's scratch");
                    }
                    Err(e) => warn!(folder = %path.display(), error = %e, "cannot remove stale scratch"),
                }
            }
        }
        removed
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `<64 hex>-<attempt>`: the attempt folders of earlier versions.
fn is_legacy_attempt_dir(name: &str) -> bool {
    match name.split_once('-') {
        Some((id, n)) => {
            id.len() == 64
                && id.bytes().all(|b| b.is_ascii_hexdigit())
                && !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_dead_workers_and_spares_live_ones() {
        let root = tempfile::tempdir().unwrap();
        // A worker that died: its folder and lock file are there, the lock is free.
        let dead = root.path().join("w-dead");
        std::fs::create_dir_all(dead.join(format!("{}-1", "a".repeat(64)))).unwrap();
        std::fs::write(dead.join(LOCK), b"").unwrap();
        // An attempt folder of an earlier version.
        let legacy = root.path().join(format!("{}-3", "b".repeat(64)));
        std::fs::create_dir_all(&legacy).unwrap();
        // Something that is not ours.
        let other = root.path().join("notes");
        std::fs::create_dir_all(&other).unwrap();

        let live = Scratch::open(root.path()).unwrap();
        assert!(!dead.exists() && !legacy.exists(), "leftovers were swept at start");
        assert!(other.exists());
        std::fs::create_dir_all(live.attempt_dir(&"c".repeat(64), 1)).unwrap();

        // A second worker on the same root leaves the first one's folder alone.
        let second = Scratch::open(root.path()).unwrap();
        assert_eq!(second.sweep(), 0);
        assert!(live.attempt_dir(&"c".repeat(64), 1).exists());
        drop(live);
        drop(second);
    }
}
