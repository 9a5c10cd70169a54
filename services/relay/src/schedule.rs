//! The retry schedule as pure functions: where a delivery stands, from the attempts the
//! log holds for it, and how long to wait after an attempt that asks for a retry.
//!
//! Nothing here keeps time or state: the relay asks [`next_step`] on every (re)delivery
//! of an event, so any relay, fresh or restarted, continues a delivery where the log
//! says it is.

use std::time::Duration;

use chrono::{DateTime, Utc};
use stemq_core::event::{DeliveryAttempted, DeliveryResult};

/// Redeliveries this close to their due time are attempted at once (the queue may hand
/// a message back a little early; bouncing it for milliseconds helps nobody).
pub(crate) const SLACK: Duration = Duration::from_millis(50);

/// What to do with an event delivered to the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Make attempt `n` (from 1) now.
    Attempt(u32),
    /// Not due yet: hand the event back to the queue for this long.
    Wait(Duration),
    /// The delivery already ended (delivered, failed, disabled): only ack.
    Over,
}

/// Where a delivery stands. `recorded` holds its attempts in log order, each with the
/// time it was recorded; `first_due` is when attempt 1 is due (the event's time plus the
/// schedule's first delay).
pub(crate) fn next_step(
    recorded: &[(DateTime<Utc>, &DeliveryAttempted)],
    first_due: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Step {
    let Some((at, last)) = recorded.last() else {
        return wait_or(first_due, now, None, Step::Attempt(1));
    };
    if last.result != DeliveryResult::Retrying {
        return Step::Over;
    }
    let retry_in = Duration::from_millis(last.retry_in_ms.unwrap_or(0));
    let due = *at + chrono::Duration::from_std(retry_in).unwrap_or_default();
    wait_or(due, now, Some(retry_in), Step::Attempt(last.attempt + 1))
}

/// `Wait` until `due` (never longer than `cap`: a clock ahead of the recorder's must not
/// stretch the schedule), or `then` when it is due.
fn wait_or(due: DateTime<Utc>, now: DateTime<Utc>, cap: Option<Duration>, then: Step) -> Step {
    match (due - now).to_std() {
        Ok(left) if left > SLACK => Step::Wait(cap.map_or(left, |c| left.min(c))),
        _ => then,
    }
}

/// The delay before the attempt after attempt `n` (from 1) that asked for a retry:
/// the schedule's next delay with jitter, or the receiver's `Retry-After` (capped at
/// `max_retry_after`) when longer. `None` when the schedule has no further attempt.
pub(crate) fn retry_delay(
    schedule: &[Duration],
    n: u32,
    retry_after: Option<Duration>,
    max_retry_after: Duration,
) -> Option<Duration> {
    let planned = jitter(*schedule.get(n as usize)?);
    Some(match retry_after {
        Some(ra) => planned.max(ra.min(max_retry_after)),
        None => planned,
    })
}

/// Up to +20 % on a non-zero delay, so retries after an outage do not arrive together.
pub(crate) fn jitter(d: Duration) -> Duration {
    if d.is_zero() {
        return d;
    }
    d.mul_f64(1.0 + rand::random::<f64>() * 0.2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(n: u32, result: DeliveryResult, retry_in_ms: Option<u64>) -> DeliveryAttempted {
        DeliveryAttempted {
            webhook_id: "msg_x".into(),
            event_type: "io.stemq.job.succeeded.v1".into(),
            url: "https://example.com/h".into(),
            attempt: n,
            status_code: Some(500),
            latency_ms: 3,
            result,
            error: None,
            retry_in_ms,
            replay: false,
        }
    }

    fn t(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_700_000_000_000 + ms).unwrap()
    }

    #[test]
    fn a_fresh_delivery_is_attempt_one_when_due() {
        assert_eq!(next_step(&[], t(0), t(0)), Step::Attempt(1));
        assert_eq!(next_step(&[], t(0), t(10_000)), Step::Attempt(1));
        assert_eq!(next_step(&[], t(5_000), t(0)), Step::Wait(Duration::from_secs(5)));
    }

    #[test]
    fn a_retry_continues_from_the_last_recorded_attempt() {
        let a1 = attempt(1, DeliveryResult::Retrying, Some(5_000));
        let a2 = attempt(2, DeliveryResult::Retrying, Some(300_000));
        // given two attempts recorded, when redelivered after the second's delay: attempt 3
        assert_eq!(next_step(&[(t(0), &a1), (t(5_000), &a2)], t(0), t(305_000)), Step::Attempt(3));
        // when redelivered early (a restart, an ack timeout): wait for the rest
        assert_eq!(next_step(&[(t(0), &a1), (t(5_000), &a2)], t(0), t(6_000)), Step::Wait(Duration::from_secs(299)));
        // within the slack: at once
        assert_eq!(next_step(&[(t(0), &a1)], t(0), t(4_980)), Step::Attempt(2));
        // a clock far behind the recorder's waits at most the recorded delay
        assert_eq!(next_step(&[(t(0), &a1)], t(0), t(-60_000)), Step::Wait(Duration::from_secs(5)));
    }

    #[test]
    fn an_ended_delivery_is_over() {
        for r in [DeliveryResult::Delivered, DeliveryResult::Failed, DeliveryResult::Disabled] {
            let a = attempt(3, r, None);
            assert_eq!(next_step(&[(t(0), &a)], t(0), t(1)), Step::Over, "{r:?}");
        }
    }

    #[test]
    fn delays_follow_the_schedule_and_a_longer_retry_after() {
        let s: Vec<Duration> = [0, 5, 300].map(Duration::from_secs).to_vec();
        let max = Duration::from_secs(3600);
        let d = retry_delay(&s, 1, None, max).unwrap();
        assert!(d >= Duration::from_secs(5) && d <= Duration::from_secs(6), "{d:?}");
        let d = retry_delay(&s, 1, Some(Duration::from_secs(60)), max).unwrap();
        assert_eq!(d, Duration::from_secs(60));
        let d = retry_delay(&s, 1, Some(Duration::from_secs(86_400)), max).unwrap();
        assert_eq!(d, max, "Retry-After is capped");
        let d = retry_delay(&s, 2, Some(Duration::from_secs(1)), max).unwrap();
        assert!(d >= Duration::from_secs(300), "a shorter Retry-After does not hurry the schedule");
        assert_eq!(retry_delay(&s, 3, None, max), None, "after the last attempt, nothing");
    }

    #[test]
    fn jitter_is_bounded() {
        for _ in 0..100 {
            let j = jitter(Duration::from_secs(10));
            assert!(j >= Duration::from_secs(10) && j <= Duration::from_secs(12));
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }
}
