//! Retry spacing for transient failures: exponential, capped, with jitter.
//!
//! This module owns how long a job waits before its next attempt. Delay of attempt `n`
//! (from 1) is `min(base · 2^(n-1), cap)`, then scaled by a random factor in
//! `[1 - jitter, 1 + jitter]` so a burst of failures does not retry in lockstep.

use std::time::Duration;

use rand::Rng;

/// Backoff parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub base: Duration,
    /// Largest delay.
    pub cap: Duration,
    /// Relative jitter in [0, 1].
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { base: Duration::from_secs(2), cap: Duration::from_secs(300), jitter: 0.2 }
    }
}

impl Backoff {
    /// The delay before retrying after failed attempt `attempt` (from 1), without jitter.
    pub fn nominal(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(30);
        self.base.saturating_mul(1u32 << exp).min(self.cap)
    }

    /// The delay with jitter applied.
    pub fn delay(&self, attempt: u32) -> Duration {
        let d = self.nominal(attempt).as_secs_f64();
        let j = self.jitter.clamp(0.0, 1.0);
        let factor = if j > 0.0 { rand::rng().random_range(1.0 - j..=1.0 + j) } else { 1.0 };
        Duration::from_secs_f64(d * factor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_exponentially_and_caps() {
        let b = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(1), jitter: 0.0 };
        let got: Vec<_> = (1..=6).map(|n| b.nominal(n).as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.delay(3), Duration::from_millis(400));
        assert_eq!(b.nominal(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_in_bounds_and_varies() {
        let b = Backoff { base: Duration::from_millis(1000), cap: Duration::from_secs(10), jitter: 0.2 };
        let ds: Vec<_> = (0..200).map(|_| b.delay(1).as_millis()).collect();
        assert!(ds.iter().all(|&d| (800..=1200).contains(&d)), "{ds:?}");
        assert!(ds.iter().any(|&d| d != ds[0]), "jitter must vary");
    }
}
