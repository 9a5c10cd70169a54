//! Readiness: what a process must have done before it serves, as named conditions.
//!
//! A process registers every condition it waits for before it answers its first probe
//! ([`Readiness::require`]), hands each [`Condition`] to the part that meets it, and
//! answers `/readyz` from [`Readiness::pending`]: 200 when nothing is pending, 503
//! naming what is. A condition, once met, stays met: readiness here is about start-up
//! (liveness and a lost connection are checked by the probe itself).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// The conditions of one process. Clones share them.
#[derive(Debug, Clone)]
pub struct Readiness {
    pending: Arc<watch::Sender<BTreeSet<&'static str>>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness::new()
    }
}

impl Readiness {
    /// Nothing pending: ready until a condition is required.
    pub fn new() -> Readiness {
        Readiness { pending: Arc::new(watch::Sender::new(BTreeSet::new())) }
    }

    /// Adds condition `what` (a short phrase: "worker announced"); the process is not
    /// ready until the returned handle is met.
    pub fn require(&self, what: &'static str) -> Condition {
        self.pending.send_modify(|p| {
            p.insert(what);
        });
        Condition { readiness: self.clone(), what }
    }

    /// The conditions not met yet, in name order.
    pub fn pending(&self) -> Vec<&'static str> {
        self.pending.borrow().iter().copied().collect()
    }

    /// True when every condition is met.
    pub fn is_ready(&self) -> bool {
        self.pending.borrow().is_empty()
    }

    /// Waits until every condition is met, at most `within`; says whether they are.
    pub async fn wait(&self, within: Duration) -> bool {
        let mut rx = self.pending.subscribe();
        tokio::time::timeout(within, rx.wait_for(|p| p.is_empty())).await.is_ok_and(|r| r.is_ok())
    }
}

/// The answer of a `/readyz` probe given what the process still waits for: 200
/// `ready`, or 503 `not ready: waiting for …` naming each.
pub fn probe_answer(waiting: &[&str]) -> (u16, String) {
    if waiting.is_empty() {
        (200, "ready".into())
    } else {
        (503, format!("not ready: waiting for {}", waiting.join(", ")))
    }
}

/// One condition of a [`Readiness`], met by the part that owns it.
#[derive(Debug, Clone)]
pub struct Condition {
    readiness: Readiness,
    what: &'static str,
}

impl Condition {
    /// The condition holds from now on.
    pub fn met(&self) {
        self.readiness.pending.send_if_modified(|p| p.remove(self.what));
    }

    /// Its name.
    pub fn what(&self) -> &'static str {
        self.what
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ready_once_every_condition_is_met() {
        let r = Readiness::new();
        assert!(r.is_ready());
        let worker = r.require("worker announced");
        let projector = r.require("projector consuming");
        assert!(!r.is_ready());
        assert_eq!(r.pending(), ["projector consuming", "worker announced"]);
        assert!(!r.wait(Duration::from_millis(10)).await);
        worker.met();
        worker.met();
        assert_eq!(r.pending(), ["projector consuming"]);
        let waiter = tokio::spawn({
            let r = r.clone();
            async move { r.wait(Duration::from_secs(10)).await }
        });
        projector.met();
        assert!(waiter.await.unwrap());
        assert!(r.is_ready());
    }

    #[test]
    fn the_probe_names_what_it_waits_for() {
        assert_eq!(probe_answer(&[]), (200, "ready".into()));
        assert_eq!(
            probe_answer(&["NATS", "worker announced"]),
            (503, "not ready: waiting for NATS, worker announced".into())
        );
    }
}
