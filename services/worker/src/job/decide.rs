//! What an attempt comes to, as pure functions tested given/when/then: [`decide_start`]
//! before the engine runs (cancelled, expired), [`decide`] after (the event to record
//! and how to answer the delivery).

use std::time::Duration;

use stemq_core::event::{Cancelled, DeadLettered, EventBody, Expired, Failed, FailureClass, FailureCode, Succeeded};

use super::{Done, Failure};

/// What the decision about an attempt's result knows besides the result itself: plain
/// values, read by the caller (the clock and the backoff's jitter included).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Given {
    /// This delivery, from 1.
    pub(super) attempt: u32,
    /// The queue's `max_deliver`: the delivery after which a transient failure
    /// dead-letters the job instead of retrying.
    pub(super) max_deliver: u32,
    /// How long to wait before the next delivery after a transient failure.
    pub(super) backoff: Duration,
    /// True when a user's cancel request came in while the attempt ran.
    pub(super) user_cancel: bool,
    /// Wall time of the attempt so far.
    pub(super) elapsed: Duration,
    /// Stream sequence of the request (for the dead letter's replay).
    pub(super) request_seq: u64,
}

/// What to record about an attempt, and how to answer its delivery.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Decision {
    /// Record this terminal event on the job's outcome subject (first one wins), then
    /// ack. With `discard_outputs`, delete what the attempt stored first.
    Outcome { body: EventBody, discard_outputs: bool },
    /// Record this transient failure, then nak the delivery with `delay`.
    Retry { failed: Failed, delay: Duration },
}

/// How a [`Decision`] answers the delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AckAction {
    /// Ack once the outcome is stored (if it is not, nak and let the delivery come back).
    AckAfterOutcome,
    /// Nak with this delay once the failure is recorded.
    NakAfter(Duration),
}

impl Decision {
    pub(super) fn ack(&self) -> AckAction {
        match self {
            Decision::Outcome { .. } => AckAction::AckAfterOutcome,
            Decision::Retry { delay, .. } => AckAction::NakAfter(*delay),
        }
    }

    /// The `outcome` label of `stemq_jobs_total`.
    pub(super) fn outcome_label(&self) -> &'static str {
        match self {
            Decision::Outcome { body: EventBody::Succeeded(s), .. } if s.degraded => "degraded",
            Decision::Outcome { body: EventBody::Failed(_), .. } => "failed_permanent",
            Decision::Outcome { body, .. } => body.kind(),
            Decision::Retry { .. } => "failed_transient",
        }
    }
}

/// What a delivery comes to before it starts, if it must not run: cancelled (a cancel
/// request is in the log) or expired (`start_before` is before `now`).
pub(super) fn decide_start(
    attempt: u32,
    cancel_requested: bool,
    start_before: Option<chrono::DateTime<chrono::Utc>>,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<EventBody> {
    if cancel_requested {
        return Some(EventBody::Cancelled(Cancelled { attempt, interrupted: false }));
    }
    match start_before {
        Some(deadline) if now > deadline => Some(EventBody::Expired(Expired { start_before: deadline })),
        _ => None,
    }
}

/// What an attempt's result means: the one decision of this module, a pure function.
///
/// - a user's cancel wins over any result: `cancelled` (interrupted), outputs discarded;
/// - success: `succeeded` (`degraded` when the memory ladder stepped down);
/// - a permanent failure: `failed` (permanent), final at once;
/// - a transient failure on the last delivery: `dead_lettered` (`max_deliveries`, with
///   the failure as `last_error`);
/// - any other transient failure: `failed` (transient, with `retry_in_ms`), then a nak
///   with the backoff delay.
pub(super) fn decide(given: &Given, result: Result<Done, Failure>) -> Decision {
    let attempt = given.attempt;
    if given.user_cancel {
        return Decision::Outcome {
            body: EventBody::Cancelled(Cancelled { attempt, interrupted: true }),
            discard_outputs: true,
        };
    }
    let body = match result {
        Ok(done) => EventBody::Succeeded(Succeeded {
            attempt,
            outputs: done.outputs,
            manifest_uri: Some(done.manifest_uri),
            degraded: done.degraded,
            device: done.device,
            segment: done.segment,
            duration_ms: given.elapsed.as_millis() as u64,
            audio_ms: done.audio_secs.map(|s| (s * 1000.0).round() as u64),
        }),
        Err(f) if f.class == FailureClass::Permanent => EventBody::Failed(Failed {
            attempt,
            class: FailureClass::Permanent,
            code: f.code,
            message: f.message,
            retry_in_ms: None,
        }),
        Err(f) if attempt >= given.max_deliver => EventBody::DeadLettered(DeadLettered {
            deliveries: attempt,
            reason: FailureCode::MaxDeliveries,
            last_error: Some(format!("{}: {}", f.code, f.message)),
            request_seq: given.request_seq,
        }),
        Err(f) => {
            return Decision::Retry {
                failed: Failed {
                    attempt,
                    class: FailureClass::Transient,
                    code: f.code,
                    message: f.message,
                    retry_in_ms: Some(given.backoff.as_millis() as u64),
                },
                delay: given.backoff,
            }
        }
    };
    Decision::Outcome { body, discard_outputs: false }
}

#[cfg(test)]
mod tests {
    use stemq_core::device::Device;
    use stemq_core::event::Output;

    use super::*;

    // The decision, given / when / then.

    /// Given: delivery `attempt` of a queue that delivers at most 3 times, 4 s backoff.
    fn given(attempt: u32) -> Given {
        Given {
            attempt,
            max_deliver: 3,
            backoff: Duration::from_secs(4),
            user_cancel: false,
            elapsed: Duration::from_millis(1500),
            request_seq: 42,
        }
    }

    fn done(degraded: bool) -> Done {
        Done {
            audio_secs: Some(10.0),
            outputs: vec![Output {
                stem: "vocals".into(),
                uri: "file:///o/v.wav".into(),
                bytes: 3,
                sha256: "ab".into(),
            }],
            manifest_uri: "file:///o/manifest.json".into(),
            degraded,
            device: if degraded { Device::Cpu } else { Device::Cuda(Some(0)) },
            segment: if degraded { Some(3.9) } else { None },
        }
    }

    fn transient() -> Failure {
        Failure::transient(FailureCode::Storage, "the store is down".into())
    }

    fn outcome(d: &Decision) -> &EventBody {
        match d {
            Decision::Outcome { body, .. } => body,
            Decision::Retry { .. } => panic!("expected an outcome, got {d:?}"),
        }
    }

    #[test]
    fn given_success_when_decided_then_succeeded_and_ack() {
        let d = decide(&given(1), Ok(done(false)));
        assert_eq!(d.ack(), AckAction::AckAfterOutcome);
        assert_eq!(d.outcome_label(), "succeeded");
        let EventBody::Succeeded(s) = outcome(&d) else { panic!("{d:?}") };
        assert_eq!(s.attempt, 1);
        assert_eq!((s.device.to_string().as_str(), s.degraded, s.segment), ("cuda:0", false, None));
        assert_eq!(s.duration_ms, 1500);
        assert_eq!(s.manifest_uri.as_deref(), Some("file:///o/manifest.json"));
        assert_eq!(s.outputs.len(), 1);
        assert!(matches!(d, Decision::Outcome { discard_outputs: false, .. }));
    }

    #[test]
    fn given_success_down_the_ladder_when_decided_then_succeeded_degraded() {
        let d = decide(&given(2), Ok(done(true)));
        assert_eq!(d.outcome_label(), "degraded");
        let EventBody::Succeeded(s) = outcome(&d) else { panic!("{d:?}") };
        assert_eq!((s.attempt, &s.device, s.degraded, s.segment), (2, &Device::Cpu, true, Some(3.9)));
    }

    #[test]
    fn given_a_user_cancel_when_the_engine_succeeded_anyway_then_cancelled_and_outputs_discarded() {
        let g = Given { user_cancel: true, ..given(2) };
        let d = decide(&g, Ok(done(false)));
        assert_eq!(
            d,
            Decision::Outcome {
                body: EventBody::Cancelled(Cancelled { attempt: 2, interrupted: true }),
                discard_outputs: true
            }
        );
        assert_eq!(d.ack(), AckAction::AckAfterOutcome);
        assert_eq!(d.outcome_label(), "cancelled");
    }

    #[test]
    fn given_a_user_cancel_when_the_engine_failed_then_cancelled_not_failed() {
        let g = Given { user_cancel: true, ..given(3) };
        for failure in [transient(), Failure::permanent(FailureCode::Cancelled, "stopped".into())] {
            let d = decide(&g, Err(failure));
            assert!(matches!(outcome(&d), EventBody::Cancelled(Cancelled { attempt: 3, interrupted: true })), "{d:?}");
        }
    }

    #[test]
    fn given_a_permanent_failure_when_decided_then_failed_permanent_and_ack() {
        let d = decide(&given(1), Err(Failure::permanent(FailureCode::InvalidAudio, "not audio".into())));
        assert_eq!(
            d,
            Decision::Outcome {
                body: EventBody::Failed(Failed {
                    attempt: 1,
                    class: FailureClass::Permanent,
                    code: FailureCode::InvalidAudio,
                    message: "not audio".into(),
                    retry_in_ms: None,
                }),
                discard_outputs: false
            }
        );
        assert_eq!(d.ack(), AckAction::AckAfterOutcome);
        assert_eq!(d.outcome_label(), "failed_permanent");
    }

    #[test]
    fn given_a_permanent_failure_on_the_last_delivery_then_failed_not_dead_lettered() {
        let d = decide(&given(3), Err(Failure::permanent(FailureCode::TimeLimit, "too slow".into())));
        assert!(matches!(outcome(&d), EventBody::Failed(f) if f.code == FailureCode::TimeLimit), "{d:?}");
    }

    #[test]
    fn given_a_transient_failure_before_the_last_delivery_then_failed_transient_and_nak_with_backoff() {
        let d = decide(&given(2), Err(transient()));
        assert_eq!(
            d,
            Decision::Retry {
                failed: Failed {
                    attempt: 2,
                    class: FailureClass::Transient,
                    code: FailureCode::Storage,
                    message: "the store is down".into(),
                    retry_in_ms: Some(4000),
                },
                delay: Duration::from_secs(4),
            }
        );
        assert_eq!(d.ack(), AckAction::NakAfter(Duration::from_secs(4)));
        assert_eq!(d.outcome_label(), "failed_transient");
    }

    #[test]
    fn given_a_transient_failure_on_the_last_delivery_then_dead_lettered_max_deliveries_with_last_error() {
        for attempt in [3, 4] {
            let d = decide(&given(attempt), Err(transient()));
            assert_eq!(
                d,
                Decision::Outcome {
                    body: EventBody::DeadLettered(DeadLettered {
                        deliveries: attempt,
                        reason: FailureCode::MaxDeliveries,
                        last_error: Some("storage: the store is down".into()),
                        request_seq: 42,
                    }),
                    discard_outputs: false
                }
            );
            assert_eq!(d.ack(), AckAction::AckAfterOutcome);
            assert_eq!(d.outcome_label(), "dead_lettered");
        }
    }

    #[test]
    fn given_an_unbounded_queue_when_transient_failures_repeat_then_it_always_retries() {
        let g = Given { max_deliver: u32::MAX, ..given(1000) };
        assert!(matches!(decide(&g, Err(transient())), Decision::Retry { .. }));
    }

    #[test]
    fn given_a_cancel_request_in_the_log_when_a_delivery_arrives_then_cancelled_without_running() {
        let now = chrono::Utc::now();
        assert_eq!(
            decide_start(1, true, Some(now - chrono::Duration::seconds(5)), now),
            Some(EventBody::Cancelled(Cancelled { attempt: 1, interrupted: false }))
        );
    }

    #[test]
    fn given_a_start_deadline_when_a_delivery_arrives_then_expired_only_past_it() {
        let now = chrono::Utc::now();
        let past = now - chrono::Duration::seconds(1);
        assert_eq!(decide_start(1, false, Some(past), now), Some(EventBody::Expired(Expired { start_before: past })));
        assert_eq!(decide_start(1, false, Some(now), now), None);
        assert_eq!(decide_start(1, false, Some(now + chrono::Duration::seconds(1)), now), None);
        assert_eq!(decide_start(2, false, None, now), None);
    }
}
