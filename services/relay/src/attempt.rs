//! One HTTP attempt of a delivery: the owner's secrets and disabled URLs, the SSRF
//! check with the address pinned, the signed POST, what the answer means, and the
//! `delivery_attempted` record of it. It never waits for a retry: it says how long the
//! queue should wait ([`After`]).

use std::time::{Duration, Instant};

use stemq_core::batch::BatchId;
use stemq_core::event::{DeliveryAttempted, DeliveryResult, EventBody};
use stemq_core::{Event, JobId};
use stemq_nats::publish::publish_within;
use stemq_nats::{job_subject, SubjectKind};
use stemq_webhook as webhook;
use tracing::{debug, info, warn};

use crate::claim::Claimed;
use crate::schedule::retry_delay;
use crate::Shared;

/// Whose delivery it is: where its attempts are recorded.
#[derive(Clone, Copy)]
pub(crate) enum Of<'a> {
    /// A job's (`stemq.jobs.<id>.delivery`).
    Job(&'a JobId),
    /// A batch's end (`stemq.batches.<id>.delivery`).
    Batch(&'a BatchId),
}

/// One delivery: an event (or a replay request) for one receiver.
pub(crate) struct Delivery<'a> {
    pub of: Of<'a>,
    /// The delivery's key among the claims (`claim::key`), also the root of its records'
    /// message ids.
    pub key: String,
    pub webhook_id: &'a str,
    pub event_type: &'a str,
    pub url: &'a str,
    pub owner: String,
    /// The payload's `data`: the job's status view, or the batch's view.
    pub data: serde_json::Value,
    pub replay: bool,
}

/// What follows an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// The delivery ended (delivered, failed, disabled): ack.
    Over,
    /// The receiver asked for a retry: hand the event back for this long.
    Retry(Duration),
    /// Nothing was sent (the owner's settings or the claim could not be read): try again
    /// in this long.
    NotAttempted(Duration),
    /// Another relay holds this attempt (or a later one): it acks or hands the event
    /// back when its attempt is over, so leave the event alone.
    Taken,
}

/// Outcome of one HTTP attempt.
pub(crate) struct Answer {
    pub status: Option<u16>,
    pub error: Option<String>,
    pub retry_after: Option<Duration>,
    pub latency: Duration,
}

pub(crate) fn classify(a: &Answer) -> DeliveryResult {
    match a.status {
        Some(s) if (200..300).contains(&s) => DeliveryResult::Delivered,
        Some(410) => DeliveryResult::Disabled,
        Some(429) | Some(500..=599) | None => DeliveryResult::Retrying,
        // 3xx (redirects are not followed) and other 4xx: the receiver said no.
        Some(_) => DeliveryResult::Failed,
    }
}

/// Makes attempt `n` (from 1) of `d` and records it, if this relay wins the attempt's
/// claim (`claim`): nothing is sent or recorded for an attempt another relay holds.
pub(crate) async fn attempt(shared: &Shared, d: &Delivery<'_>, n: u32) -> After {
    let schedule = &shared.config.schedule;
    let (owner_cfg, _) = match webhook::owner_webhooks(&shared.webhooks, &d.owner).await {
        Ok(o) => o,
        Err(e) => {
            warn!(error = %e, "cannot read the signing secret; retrying later");
            return After::NotAttempted(Duration::from_secs(1));
        }
    };
    match shared.claims.claim(&d.key, n).await {
        Ok(Claimed::Mine) => {}
        Ok(Claimed::Taken { by, attempt }) => {
            debug!(attempt = n, claimed = attempt, by, "another relay holds this attempt; leaving the event to it");
            return After::Taken;
        }
        Err(e) => {
            warn!(error = %stemq_nats::error::report(&e), "cannot claim the attempt; retrying later");
            return After::NotAttempted(Duration::from_secs(1));
        }
    }
    let t0 = Instant::now();
    let (result, a) = if owner_cfg.disabled.iter().any(|u| u == d.url) {
        let a = Answer {
            status: None,
            error: Some("endpoint disabled after a 410 Gone".into()),
            retry_after: None,
            latency: Duration::ZERO,
        };
        (DeliveryResult::Disabled, a)
    } else {
        match webhook::check_url(d.url, &shared.config.allow).await {
            Err(e) => {
                let a = Answer { status: None, error: Some(e.to_string()), retry_after: None, latency: t0.elapsed() };
                (DeliveryResult::Failed, a)
            }
            Ok(target) => {
                let a = post(shared, d, &owner_cfg, &target).await;
                let r = classify(&a);
                if r == DeliveryResult::Disabled {
                    if let Err(e) = webhook::disable(&shared.webhooks, &d.owner, d.url).await {
                        warn!(error = %e, "could not record the disabled endpoint");
                    }
                }
                (r, a)
            }
        }
    };
    let next = match result {
        DeliveryResult::Retrying => retry_delay(schedule, n, a.retry_after, shared.config.max_retry_after),
        _ => None,
    };
    // A retry the schedule has no room for is a failure.
    let result = if result == DeliveryResult::Retrying && next.is_none() { DeliveryResult::Failed } else { result };
    info!(
        event = "webhook.attempt",
        attempt = n,
        status = a.status,
        latency_ms = a.latency.as_millis() as u64,
        result = ?result,
        "webhook attempt"
    );
    let outcome = match result {
        DeliveryResult::Delivered => "delivered",
        DeliveryResult::Retrying => "retrying",
        DeliveryResult::Failed => "failed",
        DeliveryResult::Disabled => "disabled",
    };
    crate::metrics::metrics().webhook(outcome, a.latency);
    record(shared, d, n, &a, result, next).await;
    next.map_or(After::Over, After::Retry)
}

async fn post(shared: &Shared, d: &Delivery<'_>, owner: &webhook::OwnerWebhooks, target: &webhook::Target) -> Answer {
    let now = chrono::Utc::now();
    let body = serde_json::to_vec(&stemq_core::event::WebhookBody {
        event_type: d.event_type.to_string(),
        timestamp: now.to_rfc3339(),
        data: &d.data,
    })
    .expect("payload serialises");
    let ts = now.timestamp();
    let signature = webhook::signature_header(&owner.signing_secrets(now), d.webhook_id, ts, &body);
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        // A proxy from the environment would connect to the name, not the checked address.
        .no_proxy()
        .timeout(shared.config.timeout)
        // Connect to the address that was checked, whatever DNS says now.
        .resolve(&target.host, target.addr)
        .build();
    let t0 = Instant::now();
    let client = match client {
        Ok(c) => c,
        Err(e) => return Answer { status: None, error: Some(e.to_string()), retry_after: None, latency: t0.elapsed() },
    };
    let res = client
        .post(target.url.clone())
        .header("content-type", "application/json")
        .header("user-agent", "stemq-relay")
        .header("webhook-id", d.webhook_id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", signature)
        .body(body)
        .send()
        .await;
    let latency = t0.elapsed();
    match res {
        Ok(r) => {
            let retry_after = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(parse_retry_after);
            Answer { status: Some(r.status().as_u16()), error: None, retry_after, latency }
        }
        Err(e) => Answer {
            status: None,
            error: Some(if e.is_timeout() { "timeout".to_string() } else { e.to_string() }),
            retry_after: None,
            latency,
        },
    }
}

/// `Retry-After` as seconds or an HTTP date.
pub(crate) fn parse_retry_after(v: &str) -> Option<Duration> {
    if let Ok(s) = v.trim().parse::<u64>() {
        return Some(Duration::from_secs(s));
    }
    let t = chrono::DateTime::parse_from_rfc2822(v.trim()).ok()?;
    (t.with_timezone(&chrono::Utc) - chrono::Utc::now()).to_std().ok()
}

/// How long recording an attempt keeps retrying while NATS cannot store it.
const RECORD_PATIENCE: Duration = Duration::from_secs(60);

/// Records the attempt on `stemq.jobs.<id>.delivery` (a batch's on
/// `stemq.batches.<id>.delivery`): the record later attempts are
/// numbered and timed from. Its message id (`<delivery key>.<attempt>`) makes the
/// publish's retries, and a taken-over attempt recorded within the dedupe window, one
/// record.
async fn record(
    shared: &Shared,
    d: &Delivery<'_>,
    attempt: u32,
    a: &Answer,
    result: DeliveryResult,
    next: Option<Duration>,
) {
    let attempted = DeliveryAttempted {
        webhook_id: d.webhook_id.to_string(),
        event_type: d.event_type.to_string(),
        url: d.url.to_string(),
        attempt,
        status_code: a.status,
        latency_ms: a.latency.as_millis() as u64,
        result,
        error: a.error.clone(),
        retry_in_ms: next.map(|n| n.as_millis() as u64),
        replay: d.replay,
    };
    let source = format!("/stemq/{}", shared.config.name);
    // The record is the delivery's memory (a redelivery reads it to know the attempt is
    // made): it waits out a leader election or a quorum loss rather than being dropped.
    let msg_id = format!("{}.{attempt}", d.key);
    let recorded = match d.of {
        Of::Job(id) => {
            let ev = Event::new(id, &source, EventBody::DeliveryAttempted(attempted));
            let subject = job_subject(id, SubjectKind::Delivery);
            publish_within(&shared.js, &subject, &ev, Some(&msg_id), RECORD_PATIENCE).await.map(drop)
        }
        Of::Batch(id) => {
            stemq_nats::batch_log::record_attempt(&shared.js, id, attempted, &msg_id, &source, RECORD_PATIENCE)
                .await
                .map(drop)
        }
    };
    if let Err(e) = recorded {
        warn!(error = %e, "delivery attempt not recorded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(status: Option<u16>) -> Answer {
        Answer { status, error: None, retry_after: None, latency: Duration::ZERO }
    }

    #[test]
    fn status_codes_map_to_results() {
        assert_eq!(classify(&at(Some(204))), DeliveryResult::Delivered);
        assert_eq!(classify(&at(Some(410))), DeliveryResult::Disabled);
        for s in [Some(429), Some(500), Some(503), None] {
            assert_eq!(classify(&at(s)), DeliveryResult::Retrying);
        }
        for s in [301, 302, 307, 400, 404] {
            assert_eq!(classify(&at(Some(s))), DeliveryResult::Failed);
        }
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        assert_eq!(parse_retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after("soon"), None);
        let later = (chrono::Utc::now() + chrono::Duration::seconds(30)).to_rfc2822();
        let d = parse_retry_after(&later).unwrap();
        assert!(d > Duration::from_secs(25) && d <= Duration::from_secs(30));
    }
}
