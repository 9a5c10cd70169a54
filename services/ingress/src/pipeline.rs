//! A caller's submit, step by step: the rate of its key, validation, the cap on its jobs
//! in flight, the publish ([`crate::submit`]). HTTP, NATS and batches submit through it.

use stemq_accounts::auth::Caller;
use stemq_core::request::Priority;
use stemq_core::JobId;

use crate::submit::{self, SubmitError, SubmitResponse};
use crate::{credits, limits, workers, AppState};

/// A submit by `caller`, for HTTP and NATS alike: the rate, then validation, then the
/// cap on jobs in flight, then the publish (see [`limits`]). Nothing is published when a
/// limit refuses.
pub async fn submit_as(
    state: &AppState,
    caller: &Caller,
    body: &[u8],
    traceparent: Option<String>,
) -> Result<(SubmitResponse, u64), SubmitError> {
    let remaining = spend_rate(state, caller).await?;
    let event = prepare_as(state, caller, body, traceparent).await?;
    let resp = admit_and_queue(state, caller, event).await?;
    Ok((resp, remaining))
}

/// The rate limit of `caller`'s key: takes one token, and says how many are left
/// (`u64::MAX` when the key has no rate or keys are off).
pub(crate) async fn spend_rate(state: &AppState, caller: &Caller) -> Result<u64, SubmitError> {
    if state.keys.is_none() || caller.limits.rate <= 0.0 {
        return Ok(u64::MAX);
    }
    state.leases.spend(&state.limits, caller).await?.map_err(SubmitError::Limited)
}

/// Validates `body` for `caller` and builds its `requested` event: the request's own
/// checks ([`submit::prepare`]), the served models (with [`crate::Config::refuse_unserved`]),
/// what the owner can pay when the cost is known now ([`credits::check_affordable`]),
/// and the key's lane when the request names none. Nothing is published.
pub(crate) async fn prepare_as(
    state: &AppState,
    caller: &Caller,
    body: &[u8],
    traceparent: Option<String>,
) -> Result<stemq_core::Event, SubmitError> {
    let uploads = state.storage.as_ref().map(|s| &s.store);
    let mut event =
        submit::prepare(body, &caller.owner, traceparent, state.stores(), state.audio_urls(), uploads).await?;
    if let stemq_core::EventBody::Requested(r) = &event.body {
        if state.refuse_unserved {
            workers::check_served(&state.registry, r.request.model, state.unserved_grace_until).await?;
        }
        // A job whose cost is known now and cannot be paid is refused before it is queued.
        if state.index.status(&event.subject).is_none() {
            credits::check_affordable(state, &caller.owner, r.request.model, &r.request.audio_uri)
                .await
                .map_err(SubmitError::Refused)?;
        }
    }
    if let stemq_core::EventBody::Requested(r) = &mut event.body {
        // The key's lane, when the request names none (interactive stays implicit).
        if r.priority.is_none() && caller.priority != Priority::Interactive {
            r.priority = Some(caller.priority);
        }
    }
    Ok(event)
}

/// The cap on `caller`'s jobs in flight, then the publish of a prepared `event`.
pub(crate) async fn admit_and_queue(
    state: &AppState,
    caller: &Caller,
    event: stemq_core::Event,
) -> Result<SubmitResponse, SubmitError> {
    let enforce = state.keys.is_some();
    if enforce && caller.limits.max_in_flight > 0 && state.index.status(&event.subject).is_none() {
        let views = state.views.clone();
        let recorded = move |id: JobId| {
            let views = views.clone();
            async move {
                // Unreadable counts as recorded: a slot is freed only when surely unused.
                views.current(&id).await.map(|v| v.is_some_and(|v| !v.status.is_terminal())).unwrap_or(true)
            }
        };
        let known = |id: &JobId| limits::state_in(&state.index, id);
        let (key_id, cap) = (&caller.key_id, caller.limits.max_in_flight);
        let admitted = state.leases.admit(&state.limits, key_id, cap, &event.subject, known, recorded).await?;
        if let Err(refused) = admitted {
            // A job the log already holds (a resubmit landing on another replica before
            // the index has it) is answered, not counted again.
            if !matches!(state.views.current(&event.subject).await, Ok(Some(_))) {
                return Err(SubmitError::Limited(refused));
            }
        }
    }
    let (resp, _) = submit::queue_with(&state.js, event, &state.availability).await?;
    Ok(resp)
}
