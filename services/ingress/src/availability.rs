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
//!   Retry-After. The first publish that succeeds again ends that state (and a submit
//!   that gives up after the queue took another one meanwhile does not start it).
//!
//! Each publish attempt is cut after [`ATTEMPT`] (3 s) and made again with the same
//! message id, so one attempt stuck on a dying node (its ack never comes) does not use
//! up the budget. So a submit never hangs longer than the election budget, fails only
//! while the queue has been unable to take anything for that long, and fails fast once
//! that is known.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Longest one publish attempt of a submit may take before it is made again.
pub const ATTEMPT: Duration = Duration::from_secs(3);

/// The queue's state as the submits have seen it. Shared by every request of the
/// process (HTTP and NATS).
#[derive(Debug)]
pub struct Availability {
    /// How long a submit keeps trying while the queue is believed available: longer
    /// than a leader election.
    pub election: Duration,
    /// How long a submit tries once the queue is known to be unavailable.
    pub unavailable: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Since when no submit could be queued (after one waited `election` in vain).
    down_since: Option<Instant>,
    /// When a publish last succeeded.
    last_success: Option<Instant>,
}

impl Default for Availability {
    fn default() -> Self {
        Availability::new(Duration::from_secs(10), Duration::from_secs(1))
    }
}

impl Availability {
    /// With these budgets.
    pub fn new(election: Duration, unavailable: Duration) -> Availability {
        Availability { election, unavailable, state: Mutex::default() }
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
        let was = {
            let mut state = self.state.lock().expect("availability");
            state.last_success = Some(Instant::now());
            state.down_since.take()
        };
        if let Some(since) = was {
            tracing::info!(down_ms = since.elapsed().as_millis() as u64, "the queue takes submits again");
        }
    }

    /// A submit that began at `started` could not publish, for a transient reason. If it
    /// waited a whole election budget and no other publish succeeded meanwhile, the
    /// queue counts as unavailable.
    pub fn failed(&self, started: Instant) {
        let waited = started.elapsed();
        if waited < self.election {
            return;
        }
        let mut state = self.state.lock().expect("availability");
        if state.last_success.is_some_and(|t| t >= started) || state.down_since.is_some() {
            return;
        }
        tracing::warn!(waited_ms = waited.as_millis() as u64, "the queue takes no submits: answering 503 at once");
        state.down_since = Some(Instant::now());
    }

    /// True while the queue is known to take no submits.
    pub fn is_down(&self) -> bool {
        self.state.lock().expect("availability").down_since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: Duration = Duration::from_secs(10);
    const U: Duration = Duration::from_secs(1);

    /// A submit that began `ago` before now.
    fn began(ago: Duration) -> Instant {
        Instant::now() - ago
    }

    #[test]
    fn a_submit_waits_out_an_election() {
        let a = Availability::new(E, U);
        assert_eq!(a.budget(), E);
        // A submit that failed early (a permission error, a cut-short wait) says
        // nothing about the cluster.
        a.failed(began(Duration::from_secs(3)));
        assert!(!a.is_down());
        assert_eq!(a.budget(), E);
    }

    #[test]
    fn after_a_whole_budget_in_vain_submits_fail_fast_until_one_gets_through() {
        let a = Availability::new(E, U);
        a.failed(began(E));
        assert!(a.is_down());
        assert_eq!(a.budget(), U);
        // Short waits while down keep it down.
        a.failed(began(U));
        assert_eq!(a.budget(), U);
        a.succeeded();
        assert!(!a.is_down());
        assert_eq!(a.budget(), E);
    }

    #[test]
    fn a_late_give_up_after_the_queue_came_back_changes_nothing() {
        let a = Availability::new(E, U);
        // Began 11 s ago, gave up now; another submit got through 1 s ago.
        let started = began(E + Duration::from_secs(1));
        a.succeeded();
        a.failed(started);
        assert!(!a.is_down(), "the queue took a submit after this one began");
    }
}
