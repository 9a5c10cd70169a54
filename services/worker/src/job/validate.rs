//! Step 1 of a delivery: whether the delivered request may run, and if not, whether it
//! is provably the job's own (recorded `rejected`) or not (dropped).

use stemq_core::event::{EventBody, FailureCode, Requested};
use stemq_core::{Event, JobId};

/// A delivered request that checks out: the request, when it was recorded, and the
/// trace context it carries.
#[derive(Debug)]
pub(super) struct Valid {
    pub(super) requested: Requested,
    pub(super) at: chrono::DateTime<chrono::Utc>,
    pub(super) traceparent: Option<String>,
}

/// Why a delivered request is never run: recorded as the job's `rejected` outcome with
/// [`Rejection::code`] and the message when the request is the job's own
/// ([`Rejection::proves_the_job`]), dropped otherwise.
#[derive(Debug, thiserror::Error)]
pub(super) enum Rejection {
    /// The payload is not a stemq CloudEvent.
    #[error("not a stemq CloudEvent: {0}")]
    NotAnEvent(#[source] serde_json::Error),
    /// A CloudEvent, but not a `requested` one.
    #[error("expected a requested event, got {0}")]
    NotARequest(&'static str),
    /// The request does not hash to the id its subject and event claim (forged).
    #[error("the request hashes to {computed}, but the event claims {claimed} (subject/id)")]
    IdMismatch { computed: JobId, claimed: JobId },
    /// The request names another owner than the owner token of its subject: published
    /// by someone allowed to publish for that token's owner only (a publisher).
    #[error(transparent)]
    OwnerMismatch(#[from] stemq_nats::OwnerMismatch),
    /// The request was routed into another pool or lane than its body names.
    #[error(transparent)]
    RouteMismatch(#[from] stemq_nats::RouteMismatch),
    /// The request is invalid, or valid but not as the ingress would have normalised it
    /// (a raw publisher bypassed the ingress).
    #[error("{0}")]
    Invalid(#[source] stemq_core::request::RequestError),
}

impl Rejection {
    /// True when the request is provably the job's own (it hashes to the job's id and
    /// its owner is its subject's): only then may the job be recorded `rejected`.
    /// Otherwise the request is dropped with no outcome, so a forged or garbled request
    /// on someone else's job subject cannot end their job in advance.
    pub(super) fn proves_the_job(&self) -> bool {
        matches!(self, Rejection::Invalid(_))
    }

    /// The `code` of the `rejected` outcome.
    pub(super) fn code(&self) -> FailureCode {
        match self {
            Rejection::NotAnEvent(_) | Rejection::NotARequest(_) => FailureCode::InvalidEvent,
            Rejection::IdMismatch { .. } => FailureCode::IdMismatch,
            Rejection::OwnerMismatch(_) => FailureCode::OwnerMismatch,
            Rejection::RouteMismatch(_) => FailureCode::RouteMismatch,
            Rejection::Invalid(_) => FailureCode::InvalidRequest,
        }
    }
}

/// Checks a delivered request: a `requested` event whose request hashes to its subject
/// and id, whose owner is the owner token of its subject (when the subject has one), and
/// which is a valid request in normalised form.
pub(super) fn validate(
    parsed: Result<Event, serde_json::Error>,
    subject: &str,
    job_id: &JobId,
) -> Result<Valid, Rejection> {
    let ev = parsed.map_err(Rejection::NotAnEvent)?;
    let EventBody::Requested(r) = ev.body else {
        return Err(Rejection::NotARequest(ev.body.kind()));
    };
    let computed = r.request.job_id();
    if &computed != job_id || &ev.subject != job_id || ev.id != job_id.as_str() {
        return Err(Rejection::IdMismatch { computed, claimed: job_id.clone() });
    }
    stemq_nats::check_request_owner(subject, &r.request.owner)?;
    stemq_nats::check_request_route(subject, r.request.model, r.lane())?;
    // Re-validate the request itself: a raw publisher bypasses the ingress.
    r.request.revalidate(r.webhook.as_ref(), r.metadata.as_ref(), r.max_runtime).map_err(Rejection::Invalid)?;
    Ok(Valid { requested: r, at: ev.time, traceparent: ev.traceparent })
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use stemq_core::event::Started;
    use stemq_core::request::{JobRequest, Model, Priority, ANONYMOUS};
    use stemq_nats::{job_subject, SubjectKind};

    use super::*;

    /// The routed subject of an interactive `htdemucs` request (what [`requested`] is).
    fn request_subject(id: &JobId, owner: &str) -> String {
        stemq_nats::request_subject(id, owner, Model::Htdemucs, Priority::Interactive)
    }

    fn requested() -> Event {
        let n = JobRequest::from_value(json!({"audio_uri": "file:///a.wav"})).unwrap().normalize(ANONYMOUS).unwrap();
        Event::requested(n, None, None, "/test")
    }

    #[test]
    fn validate_accepts_a_request_that_hashes_to_its_id() {
        let ev = requested();
        let id = ev.subject.clone();
        let valid = validate(Ok(ev.clone()), &request_subject(&id, ANONYMOUS), &id).expect("valid");
        assert_eq!(valid.requested.request.job_id(), id);
        // A request recorded before owner tokens is still run.
        assert!(validate(Ok(ev.clone()), &job_subject(&id, SubjectKind::Requested), &id).is_ok());
        // Routed into another pool or lane: refused (another pool's worker may not run it).
        for (model, lane) in [(Model::Dsp, Priority::Interactive), (Model::Htdemucs, Priority::Batch)] {
            let wrong = stemq_nats::request_subject(&id, ANONYMOUS, model, lane);
            let e = validate(Ok(ev.clone()), &wrong, &id).unwrap_err();
            assert_eq!(e.code(), FailureCode::RouteMismatch, "{e:?}");
        }
    }

    #[test]
    fn validate_rejects_a_request_for_another_owner_than_its_subjects() {
        let ev = requested();
        let id = ev.subject.clone();
        let e = validate(Ok(ev), &request_subject(&id, "acme"), &id).unwrap_err();
        assert!(matches!(e, Rejection::OwnerMismatch(_)), "{e:?}");
        assert_eq!(e.code(), FailureCode::OwnerMismatch);
        assert!(e.to_string().contains("`anonymous`") && e.to_string().contains("`acme`"), "{e}");
    }

    #[test]
    fn validate_rejects_with_a_code_per_reason() {
        let ev = requested();
        let other = JobId::parse(&"0".repeat(64)).unwrap();
        let e = validate(Ok(ev.clone()), &request_subject(&other, ANONYMOUS), &other).unwrap_err();
        assert!(matches!(e, Rejection::IdMismatch { .. }), "{e:?}");
        assert_eq!(e.code(), FailureCode::IdMismatch);

        // Hashes to its id, but is not a request the ingress would accept.
        let mut n = match &ev.body {
            EventBody::Requested(r) => r.request.clone(),
            _ => unreachable!(),
        };
        n.audio_uri = format!(" {} ", n.audio_uri);
        let unnormalised = Event::requested(n.clone(), None, None, "/test");
        let id = unnormalised.subject.clone();
        let e = validate(Ok(unnormalised), &request_subject(&id, ANONYMOUS), &id).unwrap_err();
        assert!(matches!(e, Rejection::Invalid(_)), "{e:?}");
        assert_eq!(e.code(), FailureCode::InvalidRequest);
        assert!(e.to_string().starts_with("invalid `audio_uri`: "), "{e}");

        // Valid, but a default written out where the ingress leaves it absent.
        n.audio_uri = n.audio_uri.trim().to_string();
        n.segment = n.model.max_segment();
        let spelled_out = Event::requested(n, None, None, "/test");
        let id = spelled_out.subject.clone();
        let e = validate(Ok(spelled_out), &request_subject(&id, ANONYMOUS), &id).unwrap_err();
        assert_eq!(e.code(), FailureCode::InvalidRequest);
        assert!(e.to_string().starts_with("invalid `request`: not in normalised form"), "{e}");

        let not_json = serde_json::from_slice::<Event>(b"{").map(|_| unreachable!());
        let e = validate(not_json, &request_subject(&ev.subject, ANONYMOUS), &ev.subject).unwrap_err();
        assert_eq!(e.code(), FailureCode::InvalidEvent);
        assert!(e.to_string().starts_with("not a stemq CloudEvent: "), "{e}");

        let started = Event::new(
            &ev.subject,
            "/test",
            EventBody::Started(Started { attempt: 1, worker: "w".into(), device: "cpu".into() }),
        );
        let e = validate(Ok(started), &request_subject(&ev.subject, ANONYMOUS), &ev.subject).unwrap_err();
        assert_eq!(e.code(), FailureCode::InvalidEvent);
        assert_eq!(e.to_string(), "expected a requested event, got started");
    }
}
