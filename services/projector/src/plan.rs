//! The pure part of folding: which events are never folded, what a batch of one job's
//! events does to its view (apply, or refold from the log), and whether its write may
//! wait for the job's next event. Tested given/when/then.

use stemq_core::{apply, Event, JobView, Position};
use stemq_nats as names;

use crate::Pending;

/// Redeliveries can overtake: puts one job's log events back in log order, in the slots
/// log events held (progress events keep their places).
pub(crate) fn in_log_order(events: &mut Vec<Pending>) {
    let slots: Vec<usize> =
        events.iter().enumerate().filter(|(_, e)| matches!(e.0, Position::Log(_))).map(|(i, _)| i).collect();
    let mut order = slots.clone();
    order.sort_by_key(|&i| log_seq(&events[i].0));
    let mut taken: Vec<Option<Pending>> = events.drain(..).map(Some).collect();
    let mut out = Vec::with_capacity(taken.len());
    let mut next_log = order.into_iter();
    for i in 0..taken.len() {
        let from = if slots.binary_search(&i).is_ok() { next_log.next().expect("one per slot") } else { i };
        out.push(taken[from].take().expect("each taken once"));
    }
    *events = out;
}

/// True when a job's write may wait for its next event ([`LINGER`]): none of its
/// events so far ends it. A terminal event is written at once.
pub(crate) fn waits_for_more<T>(events: &[(Position, Event, T)]) -> bool {
    !events.iter().any(|(_, e, _)| e.body.is_terminal())
}

pub(crate) fn log_seq(p: &Position) -> Option<u64> {
    match p {
        Position::Log(s) => Some(*s),
        Position::Progress(_) => None,
    }
}

/// Why an event on `subject` is never folded, if it is not: an event whose job is not
/// its subject's (the subject's owner published it for another job); a request that
/// does not hash to its job's id, or names another owner than its subject's token (a
/// publisher may put anything on subjects of its own owner). The worker drops such a
/// request too; it stays in the log, and the job's real request is folded when it
/// comes. Returns the error kind (`stemq_projector_errors_total{kind}`) and a sentence.
/// The normal path and the refold leave out the same events, so both fold the same log.
pub(crate) fn refusal(subject: &str, event: &Event) -> Option<(&'static str, String)> {
    if let Some(id) = names::job_id_of_subject(subject).filter(|id| *id != event.subject) {
        return Some(("id_mismatch", format!("an event of job {} on the subject of job {id}", event.subject)));
    }
    let stemq_core::EventBody::Requested(r) = &event.body else { return None };
    if r.request.job_id() != event.subject || event.id != event.subject.as_str() {
        return Some(("id_mismatch", format!("the request hashes to {}, not {}", r.request.job_id(), event.subject)));
    }
    names::check_request_owner(subject, &r.request.owner).err().map(|e| ("owner_mismatch", e.to_string())).or_else(
        || {
            names::check_request_route(subject, r.request.model, r.lane())
                .err()
                .map(|e| ("route_mismatch", e.to_string()))
        },
    )
}

/// What to do with a batch of one job's events, given its view.
#[derive(Debug, PartialEq)]
pub(crate) enum Plan {
    /// The events change nothing.
    Unchanged,
    /// The view with the events applied, in order.
    Write(Box<JobView>),
    /// A log event at or below the view's position: refold the job's log up to this
    /// sequence (the crate docs).
    Refold {
        /// The newest log position known: the batch's or the view's.
        upto: u64,
    },
}

/// The pure part of a fold: apply the events to `view` unless one of them is behind it.
pub(crate) fn plan(view: Option<&JobView>, events: &[(Position, &Event)]) -> Plan {
    let last = view.map_or(0, |v| v.last_seq);
    let newest = events.iter().filter_map(|(p, _)| log_seq(p)).max();
    if view.is_some() && events.iter().filter_map(|(p, _)| log_seq(p)).any(|s| s <= last) {
        return Plan::Refold { upto: newest.unwrap_or(last).max(last) };
    }
    let mut next: Option<JobView> = None;
    for (pos, event) in events {
        if let Some(v) = apply(next.as_ref().or(view), *pos, event) {
            next = Some(v);
        }
    }
    next.map_or(Plan::Unchanged, |v| Plan::Write(Box::new(v)))
}

/// A view refolded from the log keeps the live progress of the stored one: progress
/// lives in another stream, and only the newest counts. The stored view's progress
/// position always; its progress and time too when both are running the same attempt
/// (progress of another attempt, or of an ended job, is not news).
pub(crate) fn keep_progress(refolded: &mut JobView, stored: &JobView) {
    refolded.progress_seq = refolded.progress_seq.max(stored.progress_seq);
    let same_run = refolded.status == stemq_core::JobStatus::Running
        && stored.status == stemq_core::JobStatus::Running
        && refolded.attempt == stored.attempt;
    if same_run && stored.progress.is_some() {
        refolded.progress = stored.progress.clone();
        refolded.updated_at = refolded.updated_at.max(stored.updated_at);
    }
}

#[cfg(test)]
mod tests {
    //! Given a stored view, when a batch of events arrives, then the plan.
    use super::*;
    use stemq_core::event::{EventBody, Progress, Started};
    use stemq_core::request::{JobRequest, ANONYMOUS};
    use stemq_core::{JobId, JobStatus};

    fn events() -> (Event, Event, Event) {
        let request = JobRequest::from_value(serde_json::json!({"audio_uri": "file:///a.wav"}))
            .unwrap()
            .normalize(ANONYMOUS)
            .unwrap();
        let id = request.job_id();
        let started = |attempt| {
            Event::new(&id, "/test", EventBody::Started(Started { attempt, worker: "w".into(), device: "cpu".into() }))
        };
        (Event::requested(request, None, None, "/test"), started(1), started(2))
    }

    fn folded(events: &[(u64, &Event)]) -> JobView {
        let mut view = None;
        for (s, e) in events {
            view = apply(view.as_ref(), Position::Log(*s), e).or(view);
        }
        view.unwrap()
    }

    #[test]
    fn events_after_the_view_are_applied_in_order() {
        let (requested, first, second) = events();
        let view = folded(&[(10, &requested)]);
        match plan(Some(&view), &[(Position::Log(11), &first), (Position::Log(14), &second)]) {
            Plan::Write(v) => assert_eq!(*v, folded(&[(10, &requested), (11, &first), (14, &second)])),
            other => panic!("{other:?}"),
        }
        assert_eq!(plan(None, &[(Position::Log(10), &requested)]), Plan::Write(Box::new(view)));
    }

    #[test]
    fn an_event_behind_the_view_refolds_up_to_the_newest_position_known() {
        let (requested, first, second) = events();
        // Another projector applied 12 before this one got 11: 11 is not "already applied".
        let view = folded(&[(10, &requested), (12, &second)]);
        assert_eq!(plan(Some(&view), &[(Position::Log(11), &first)]), Plan::Refold { upto: 12 });
        assert_eq!(
            plan(Some(&view), &[(Position::Log(11), &first), (Position::Log(15), &second)]),
            Plan::Refold { upto: 15 }
        );
        // A plain redelivery looks the same, and is refolded too (to no change).
        assert_eq!(plan(Some(&view), &[(Position::Log(12), &second)]), Plan::Refold { upto: 12 });
    }

    #[test]
    fn only_unfinished_jobs_wait_for_their_next_event() {
        let (requested, first, _) = events();
        let ended = Event::new(
            &requested.subject,
            "/test",
            EventBody::Cancelled(stemq_core::event::Cancelled { attempt: 1, interrupted: false }),
        );
        let batch = |events: &[&Event]| -> Vec<(Position, Event, ())> {
            events.iter().zip(10..).map(|(e, s)| (Position::Log(s), (*e).clone(), ())).collect()
        };
        assert!(waits_for_more(&batch(&[&requested])), "queued");
        assert!(waits_for_more(&batch(&[&requested, &first])), "running");
        assert!(!waits_for_more(&batch(&[&requested, &first, &ended])), "ended: written at once");
        assert!(!waits_for_more(&batch(&[&ended])));
    }

    #[test]
    fn stale_progress_is_no_anomaly() {
        let (requested, first, _) = events();
        let id = requested.subject.clone();
        let progress = |percent| {
            Event::new(
                &id,
                "/test",
                EventBody::Progress(Progress { attempt: 1, percent, stage: "separate".into(), message: None }),
            )
        };
        let (p1, p2) = (progress(10.0), progress(20.0));
        let view = folded(&[(10, &requested), (11, &first)]);
        let Plan::Write(with_p2) = plan(Some(&view), &[(Position::Progress(7), &p2)]) else { panic!() };
        assert_eq!(plan(Some(&with_p2), &[(Position::Progress(5), &p1)]), Plan::Unchanged);
    }

    #[test]
    fn the_normal_path_and_the_refold_refuse_the_same_events() {
        let (requested, first, _) = events();
        let id = requested.subject.clone();
        let own = names::job_subject(&id, names::SubjectKind::Started);
        assert_eq!(refusal(&own, &first), None);
        let routed = |owner: &str| {
            let EventBody::Requested(r) = &requested.body else { unreachable!() };
            names::request_subject(&id, owner, r.request.model, r.lane())
        };
        assert_eq!(refusal(&routed(ANONYMOUS), &requested), None);
        assert_eq!(refusal(&names::unrouted_request_subject(&id, ANONYMOUS), &requested), None);
        let other = JobId::parse(&"cd".repeat(32)).unwrap();
        let elsewhere = names::job_subject(&other, names::SubjectKind::Started);
        assert_eq!(refusal(&elsewhere, &first).map(|r| r.0), Some("id_mismatch"));
        assert_eq!(refusal(&routed("someone-else"), &requested).map(|r| r.0), Some("owner_mismatch"));
    }

    #[test]
    fn a_refolded_view_keeps_the_live_progress_of_the_same_run_only() {
        let (requested, first, second) = events();
        let id = requested.subject.clone();
        let p = Event::new(
            &id,
            "/test",
            EventBody::Progress(Progress { attempt: 1, percent: 40.0, stage: "separate".into(), message: None }),
        );
        let running = folded(&[(10, &requested), (11, &first)]);
        let stored = apply(Some(&running), Position::Progress(3), &p).unwrap();
        let mut refolded = running.clone();
        keep_progress(&mut refolded, &stored);
        assert_eq!(refolded, stored, "same attempt, still running: the progress stays");

        let mut next_attempt = folded(&[(10, &requested), (11, &first), (12, &second)]);
        keep_progress(&mut next_attempt, &stored);
        assert_eq!(next_attempt.progress, None, "progress of attempt 1 is not attempt 2's");
        assert_eq!(next_attempt.progress_seq, 3, "but its position is kept: older progress stays stale");
        assert_eq!(next_attempt.status, JobStatus::Running);
    }
}
