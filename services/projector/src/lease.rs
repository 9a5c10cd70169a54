//! Which projector pulls the job log: one at a time, by a lease in the view bucket.
//!
//! The job log's consumer acks cumulatively: a projector acks only a prefix of the log
//! it has folded itself (the `acks` module), so projectors pulling side by side lose
//! nothing but hold each other's acks back. The lease keeps one puller. Its holder
//! renews [`LEASE_KEY`] every [`RENEW_EVERY`] with compare-and-set; another projector
//! takes it over once it has seen no renewal for [`TAKEOVER_AFTER`]; a holder that could
//! not renew for [`STEP_DOWN_AFTER`] stops pulling before anyone can take over; a
//! projector that stops gives the lease back, so its successor pulls at once.
//!
//! The key is no view's: a view's key ends in a job id ([`stemq_nats::view_key`]), and
//! readers skip keys that do not.

use std::time::Duration;

use async_nats::jetstream::kv::{self, UpdateErrorKind};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The lease's key in the `stemq_jobs` bucket; its value is the holder's id.
pub const LEASE_KEY: &str = "projector.lease";

/// How often the holder renews, and a follower looks.
pub const RENEW_EVERY: Duration = Duration::from_secs(1);

/// A holder that has not renewed for this long stops pulling.
pub const STEP_DOWN_AFTER: Duration = Duration::from_secs(3);

/// A follower that has seen the same revision for this long takes the lease over.
pub const TAKEOVER_AFTER: Duration = Duration::from_secs(5);

/// Longest one bucket operation may take.
const OP_TIMEOUT: Duration = Duration::from_secs(2);

/// Holds the lease for `me` when it can, until `shutdown`; the receiver says whether
/// this process holds it now. On shutdown the lease is given back, and then the task
/// ends.
pub(crate) fn hold(
    kv: kv::Store,
    me: String,
    shutdown: CancellationToken,
) -> (watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut lease = Lease { kv, me, held: None, renewed: Instant::now(), seen: None };
        loop {
            let holds = lease.step().await;
            tx.send_if_modified(|h| std::mem::replace(h, holds) != holds);
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(RENEW_EVERY) => {}
            }
        }
        let _ = tx.send(false);
        if let Some(revision) = lease.held {
            let _ = tokio::time::timeout(OP_TIMEOUT, lease.kv.delete_expect_revision(LEASE_KEY, Some(revision))).await;
            info!("projector lease given back");
        }
    });
    (rx, task)
}

struct Lease {
    kv: kv::Store,
    me: String,
    /// The revision of our lease, while we hold it.
    held: Option<u64>,
    /// When we last renewed it.
    renewed: Instant,
    /// Another's lease as we first saw it at this revision.
    seen: Option<(u64, Instant)>,
}

impl Lease {
    /// One renewal or one look; whether we hold the lease after it.
    async fn step(&mut self) -> bool {
        match self.held {
            Some(revision) => self.renew(revision).await,
            None => self.look().await,
        }
        self.held.is_some()
    }

    async fn renew(&mut self, revision: u64) {
        match tokio::time::timeout(OP_TIMEOUT, self.kv.update(LEASE_KEY, self.me.clone().into(), revision)).await {
            Ok(Ok(r)) => {
                self.held = Some(r);
                self.renewed = Instant::now();
            }
            Ok(Err(e)) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                // Taken over, or the bucket was recreated (a rebuild); the look that
                // follows re-adopts a lease still ours.
                warn!("projector lease lost; pulling stops");
                self.held = None;
            }
            other => {
                let error = match other {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".to_string(),
                };
                if self.renewed.elapsed() >= STEP_DOWN_AFTER {
                    warn!(%error, "projector lease not renewed in time; pulling stops");
                    self.held = None;
                } else {
                    warn!(%error, "projector lease renewal failed; retrying");
                }
            }
        }
    }

    async fn look(&mut self) {
        let entry = match tokio::time::timeout(OP_TIMEOUT, self.kv.entry(LEASE_KEY)).await {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => {
                warn!(error = %e, "cannot read the projector lease; retrying");
                return;
            }
            Err(_) => return,
        };
        let taken = match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                if e.value.as_ref() == self.me.as_bytes() {
                    // Ours: a renewal whose answer was lost.
                    self.adopt(e.revision);
                    return;
                }
                match self.seen {
                    Some((revision, since)) if revision == e.revision => {
                        if since.elapsed() < TAKEOVER_AFTER {
                            return;
                        }
                        let take = self.kv.update(LEASE_KEY, self.me.clone().into(), e.revision);
                        tokio::time::timeout(OP_TIMEOUT, take).await.ok().and_then(Result::ok)
                    }
                    _ => {
                        self.seen = Some((e.revision, Instant::now()));
                        return;
                    }
                }
            }
            // Never held, given back, or the bucket is new.
            _ => {
                let take = self.kv.create(LEASE_KEY, self.me.clone().into());
                tokio::time::timeout(OP_TIMEOUT, take).await.ok().and_then(Result::ok)
            }
        };
        if let Some(revision) = taken {
            self.adopt(revision);
        }
    }

    fn adopt(&mut self, revision: u64) {
        info!("projector lease taken: this projector pulls the job log");
        self.held = Some(revision);
        self.renewed = Instant::now();
        self.seen = None;
    }
}
