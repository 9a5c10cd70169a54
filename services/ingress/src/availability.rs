//! How long a submit waits for the queue to take its job, and when it stops waiting.
//!
//! This module owns the ingress's answer to a degraded JetStream cluster. A submit's
//! publish can meet:
//!
//! - a leader election of the job stream (a node died or restarted): every publish is
//!   answered "no responders" for 4–9 s, then works again. Nothing is wrong for the
//!   client, so the submit keeps retrying (same `Nats-Msg-Id`, inside the 120 s dedupe
//!   window) for up to [`Availability::election`] (10 s), which outlasts an election:
//!   the client gets its 202, only later;
//! - a lost quorum (two of three nodes down): nothing can be stored until a node comes
//!   back. The ingress cannot tell this from an election by one publish (the cluster
//!   itself cannot, at first), so it learns it: once a submit has waited the whole
//!   election budget in vain, the queue counts as *unavailable*, and every submit from
//!   then on waits only [`Availability::unavailable`] (1 s) before answering 503 with
//!   Retry-After. The first publish that succeeds again ends that state.
//!
//! So a submit never hangs longer than the election budget, fails only while the queue
//! has been unable to take anything for that long, and fails fast once that is known.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The queue's state as the submits have seen it. Shared by every request of the
/// process (HTTP and NATS).
#[derive(Debug)]
pub struct Availability {
    /// How long a submit keeps trying while the queue is believed available: longer
    /// than a leader election.
    pub election: Duration,
    /// How long a submit tries once the queue is known to be unavailable.
    pub unavailable: Duration,
    /// Since when no submit could be queued (after one waited `election` in vain).
    down_since: Mutex<Option<Instant>>,
}

impl Default for Availability {
    fn default() -> Self {
        Availability::new(Duration::from_secs(10), Duration::from_secs(1))
    }
}

impl Availability {
    /// With these budgets.
    pub fn new(election: Duration, unavailable: Duration) -> Availability {
        Availability { election, unavailable, down_since: Mutex::new(None) }
    }

    /// How long the next submit may wait for its publish.
    pub fn budget(&self) -> Duration {
        if self.is_down() {
            self.unavailable
        } else {
            self.election
        }
    }

    /// A publish was stored (or found already there): the queue takes submits.
    pub fn succeeded(&self) {
        let was = self.down_since.lock().expect("availability").take();
        if let Some(since) = was {
            tracing::info!(down_ms = since.elapsed().as_millis() as u64, "the queue takes submits again");
        }
    }

    /// A submit waited `waited` and could not publish for a transient reason. After a
    /// whole election budget the queue counts as unavailable.
    pub fn failed(&self, waited: Duration) {
        if waited < self.election {
            return;
        }
        let mut down = self.down_since.lock().expect("availability");
        if down.is_none() {
            tracing::warn!(waited_ms = waited.as_millis() as u64, "the queue takes no submits: answering 503 at once");
            *down = Some(Instant::now());
        }
    }

    /// True while the queue is known to take no submits.
    pub fn is_down(&self) -> bool {
        self.down_since.lock().expect("availability").is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: Duration = Duration::from_secs(10);
    const U: Duration = Duration::from_secs(1);

    #[test]
    fn a_submit_waits_out_an_election() {
        let a = Availability::new(E, U);
        assert_eq!(a.budget(), E);
        // A submit that failed early (a permission error, a cut-short wait) says
        // nothing about the cluster.
        a.failed(Duration::from_secs(3));
        assert!(!a.is_down());
        assert_eq!(a.budget(), E);
    }

    #[test]
    fn after_a_whole_budget_in_vain_submits_fail_fast_until_one_gets_through() {
        let a = Availability::new(E, U);
        a.failed(E);
        assert!(a.is_down());
        assert_eq!(a.budget(), U);
        // Short waits while down keep it down.
        a.failed(U);
        assert_eq!(a.budget(), U);
        a.succeeded();
        assert!(!a.is_down());
        assert_eq!(a.budget(), E);
    }
}
