//! stemq-relay: tells clients what happened to their jobs, with signed webhooks.
//!
//! This crate owns webhook delivery. It is a service of its own with its own durable
//! consumers (`relay` over started/outcome/replay-request events, `relay-progress` over
//! the compacted progress stream; both in `nats/consumers/`), so a slow or dead receiver
//! delays no worker and no other service. For each event it:
//!
//! 1. folds the event into the job's status view (the KV view, brought up to date with
//!    the pure `apply`, so the payload never lags the event);
//! 2. skips jobs without a webhook or whose `events` filter excludes the event
//!    (`started`, `progress`, `completed` = any terminal status);
//! 3. checks the URL against the SSRF policy and pins the resolved address;
//! 4. POSTs `{"type", "timestamp", "data": <status view>}` signed with Standard Webhooks
//!    (`webhook-id` = the event id, stable across retries and replays; one `v1,`
//!    signature per active secret of the job's owner);
//! 5. retries on timeout, connection errors, 5xx and 429 (honouring `Retry-After`)
//!    along a bounded schedule with jitter; 410 disables the URL for the owner; 3xx and
//!    other 4xx are final failures;
//! 6. records every attempt as `delivery_attempted` on `stemq.jobs.<id>.delivery`, and
//!    acks the event only when the delivery is over (a crash re-runs it with the same
//!    `webhook-id`, so receivers de-duplicate).
//!
//! Deliveries run concurrently (bounded by `concurrency`), so one slow receiver holds
//! one slot, not the relay.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::PullConsumer, kv, AckKind};
use futures::StreamExt;
use serde_json::json;
use stemq_core::event::{DeliveryAttempted, DeliveryResult, EventBody};
use stemq_core::nats::{self as names, job_subject, SubjectKind};
use stemq_core::publish::publish;
use stemq_core::webhook::{self, Allowlist};
use stemq_core::{apply, Event, JobId, JobView, Position};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, info_span, warn, Instrument};

/// Relay failures at start.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A JetStream call failed.
    #[error("{what}: {message}")]
    JetStream {
        /// Which call.
        what: &'static str,
        /// Why.
        message: String,
    },
}

/// Relay configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Delay before each attempt (the first is normally zero); its length bounds the
    /// number of attempts. Jitter of up to +20 % is added to each non-zero delay.
    pub schedule: Vec<Duration>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Longest `Retry-After` honoured.
    pub max_retry_after: Duration,
    /// Hosts and networks allowed although not public (and over plain http).
    pub allow: Allowlist,
    /// Deliveries in flight at once.
    pub concurrency: usize,
    /// Source name in recorded events.
    pub name: String,
}

impl Default for Config {
    /// The Standard Webhooks example schedule: now, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h,
    /// 14 h, 20 h, 24 h; 15 s timeout.
    fn default() -> Self {
        let s = |secs: u64| Duration::from_secs(secs);
        Config {
            schedule: vec![s(0), s(5), s(300), s(1800), s(7200), s(18000), s(36000), s(50400), s(72000), s(86400)],
            timeout: s(15),
            max_retry_after: s(3600),
            allow: Allowlist::from_env(),
            concurrency: 256,
            name: "relay".into(),
        }
    }
}

struct Shared {
    js: jetstream::Context,
    jobs: kv::Store,
    webhooks: kv::Store,
    jobs_stream: jetstream::stream::Stream<()>,
    config: Config,
    /// Last progress percent delivered per job (progress is delivered on change only).
    last_progress: Mutex<HashMap<JobId, i32>>,
}

fn js_err(what: &'static str) -> impl Fn(&dyn std::fmt::Display) -> RelayError {
    move |e| RelayError::JetStream { what, message: e.to_string() }
}

/// Runs the relay until `shutdown`; deliveries in flight are abandoned (not acked) and
/// resumed by the next relay.
pub async fn run(client: async_nats::Client, config: Config, shutdown: CancellationToken) -> Result<(), RelayError> {
    let js = jetstream::new(client);
    let jobs = js.get_key_value(names::JOBS_BUCKET).await.map_err(|e| js_err("open jobs bucket")(&e))?;
    let webhooks = js.get_key_value(names::WEBHOOKS_BUCKET).await.map_err(|e| js_err("open webhooks bucket")(&e))?;
    let jobs_stream = js.get_stream_no_info(names::JOBS_STREAM).await.map_err(|e| js_err("open job stream")(&e))?;
    let events: PullConsumer = js
        .get_consumer_from_stream(names::RELAY_CONSUMER, names::JOBS_STREAM)
        .await
        .map_err(|e| js_err("open relay consumer")(&e))?;
    let progress: PullConsumer = js
        .get_consumer_from_stream(names::RELAY_PROGRESS_CONSUMER, names::PROGRESS_STREAM)
        .await
        .map_err(|e| js_err("open relay-progress consumer")(&e))?;
    let slots = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let shared =
        Arc::new(Shared { js, jobs, webhooks, jobs_stream, config, last_progress: Mutex::new(HashMap::new()) });
    info!(concurrency = shared.config.concurrency, attempts = shared.config.schedule.len(), "relay running");
    let tracker = TaskTracker::new();
    for (consumer, is_progress) in [(events, false), (progress, true)] {
        let (shared, slots, stop, t) = (shared.clone(), slots.clone(), shutdown.clone(), tracker.clone());
        tracker.spawn(async move { pump(shared, consumer, is_progress, slots, stop, t).await });
    }
    shutdown.cancelled().await;
    tracker.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), tracker.wait()).await;
    info!("relay stopped");
    Ok(())
}

async fn pump(
    shared: Arc<Shared>,
    consumer: PullConsumer,
    is_progress: bool,
    slots: Arc<Semaphore>,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let mut messages = match consumer
            .stream()
            .max_messages_per_batch(100)
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
        {
            Ok(m) => m,
            Err(e) => {
                warn!(error = %e, "relay pull failed; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                }
            }
        };
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => return,
                m = messages.next() => m,
            };
            let msg = match msg {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    warn!(error = %e, "relay pull error");
                    continue;
                }
                None => break,
            };
            let permit = tokio::select! {
                _ = stop.cancelled() => return,
                p = slots.clone().acquire_owned() => p.expect("semaphore open"),
            };
            let (shared, stop) = (shared.clone(), stop.clone());
            tracker.spawn(async move {
                let _permit = permit;
                handle(&shared, msg, is_progress, &stop).await;
            });
        }
    }
}

/// The webhook event class of an event, if any.
fn class_of(body: &EventBody) -> Option<&'static str> {
    match body {
        EventBody::Started(_) => Some("started"),
        EventBody::Progress(_) => Some("progress"),
        b if b.is_terminal() => Some("completed"),
        _ => None,
    }
}

/// The job's view with `event` folded in (from the KV view, or the log if the projector
/// has not seen the job yet).
async fn current_view(shared: &Shared, id: &JobId, pos: Option<Position>, event: &Event) -> Option<JobView> {
    let mut view = stemq_projector::get_view(&shared.jobs, id).await.ok().flatten().map(|(v, _)| v);
    if view.as_ref().is_none_or(|v| v.request.is_none()) {
        if let Ok(m) = shared.jobs_stream.direct_get_last_for_subject(job_subject(id, SubjectKind::Requested)).await {
            if let Ok(req) = Event::from_slice(&m.payload) {
                if let Some(v) = apply(view.as_ref(), Position::Log(m.sequence), &req) {
                    view = Some(v);
                }
            }
        }
    }
    if let Some(pos) = pos {
        if let Some(v) = apply(view.as_ref(), pos, event) {
            view = Some(v);
        }
    }
    view
}

async fn handle(shared: &Arc<Shared>, msg: jetstream::Message, is_progress: bool, stop: &CancellationToken) {
    let Ok(event) = Event::from_slice(&msg.payload) else {
        warn!(subject = %msg.subject, "unreadable event; skipping");
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    };
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
    let id = event.subject.clone();
    let span =
        info_span!("webhook.delivery", job_id = %id, event = event.body.kind(), trace_id = tracing::field::Empty);
    // The delivery joins the job's trace (the outcome event carries its traceparent).
    stemq_core::telemetry::set_parent(&span, event.traceparent.as_deref());
    async {
        let (webhook_id, event_type, replay, pos) = match &event.body {
            EventBody::DeliveryReplayRequested(r) => (r.webhook_id.clone(), r.event_type.clone(), true, None),
            body => {
                if class_of(body).is_none() {
                    let _ = msg.ack().await;
                    return;
                }
                let pos = if is_progress { Position::Progress(seq) } else { Position::Log(seq) };
                (format!("msg_{}", event.id), event.event_type(), false, Some(pos))
            }
        };
        let Some(view) = current_view(shared, &id, pos, &event).await else {
            let _ = msg.ack().await;
            return;
        };
        let Some(hook) = view.webhook.clone() else {
            let _ = msg.ack().await;
            return;
        };
        if !replay {
            let class = class_of(&event.body).unwrap_or("completed");
            if !hook.events.iter().any(|e| e == class) {
                let _ = msg.ack().await;
                return;
            }
            if let EventBody::Progress(p) = &event.body {
                // Heartbeats repeat the same progress: deliver changes only.
                let pct = p.percent.round() as i32;
                let unchanged = {
                    let mut last = shared.last_progress.lock().expect("lock");
                    last.insert(id.clone(), pct) == Some(pct)
                };
                if unchanged {
                    let _ = msg.ack().await;
                    return;
                }
            }
        }
        if view.status.is_terminal() {
            shared.last_progress.lock().expect("lock").remove(&id);
        }
        let delivery = Delivery {
            id: &id,
            webhook_id: &webhook_id,
            event_type: &event_type,
            url: &hook.url,
            owner: view.request.as_ref().map(|r| r.owner.clone()).unwrap_or_default(),
            view: &view,
            replay,
        };
        deliver(shared, &delivery, &msg, stop).await;
        let _ = msg.ack().await;
    }
    .instrument(span)
    .await
}

struct Delivery<'a> {
    id: &'a JobId,
    webhook_id: &'a str,
    event_type: &'a str,
    url: &'a str,
    owner: String,
    view: &'a JobView,
    replay: bool,
}

/// Outcome of one HTTP attempt.
struct Attempt {
    status: Option<u16>,
    error: Option<String>,
    retry_after: Option<Duration>,
    latency: Duration,
}

fn classify(a: &Attempt) -> DeliveryResult {
    match a.status {
        Some(s) if (200..300).contains(&s) => DeliveryResult::Delivered,
        Some(410) => DeliveryResult::Disabled,
        Some(429) | Some(500..=599) | None => DeliveryResult::Retrying,
        // 3xx (redirects are not followed) and other 4xx: the receiver said no.
        Some(_) => DeliveryResult::Failed,
    }
}

fn jitter(d: Duration) -> Duration {
    if d.is_zero() {
        return d;
    }
    d.mul_f64(1.0 + rand::random::<f64>() * 0.2)
}

async fn deliver(shared: &Shared, d: &Delivery<'_>, msg: &jetstream::Message, stop: &CancellationToken) {
    let schedule = &shared.config.schedule;
    let mut wait = Duration::ZERO;
    for (i, planned) in schedule.iter().enumerate() {
        let attempt = i as u32 + 1;
        let delay = jitter(*planned).max(wait);
        if !delay.is_zero() {
            // Keep the event ours while we wait.
            let deadline = Instant::now() + delay;
            while Instant::now() < deadline {
                let step = (deadline - Instant::now()).min(Duration::from_secs(20));
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(step) => {}
                }
                let _ = msg.ack_with(AckKind::Progress).await;
            }
        }
        let (owner_cfg, _) = match webhook::owner_webhooks(&shared.webhooks, &d.owner).await {
            Ok(o) => o,
            Err(e) => {
                warn!(error = %e, "cannot read the signing secret; retrying later");
                wait = Duration::from_secs(1);
                continue;
            }
        };
        let t0 = Instant::now();
        let (result, a) = if owner_cfg.disabled.iter().any(|u| u == d.url) {
            let a = Attempt {
                status: None,
                error: Some("endpoint disabled after a 410 Gone".into()),
                retry_after: None,
                latency: Duration::ZERO,
            };
            (DeliveryResult::Disabled, a)
        } else {
            match webhook::check_url(d.url, &shared.config.allow).await {
                Err(e) => {
                    let a = Attempt { status: None, error: Some(e), retry_after: None, latency: t0.elapsed() };
                    (DeliveryResult::Failed, a)
                }
                Ok(target) => {
                    let a = post(shared, d, &owner_cfg, &target).await;
                    let mut r = classify(&a);
                    if r == DeliveryResult::Retrying && i + 1 == schedule.len() {
                        r = DeliveryResult::Failed;
                    }
                    if r == DeliveryResult::Disabled {
                        if let Err(e) = webhook::disable(&shared.webhooks, &d.owner, d.url).await {
                            warn!(error = %e, "could not record the disabled endpoint");
                        }
                    }
                    (r, a)
                }
            }
        };
        let next = (result == DeliveryResult::Retrying).then(|| {
            let planned = schedule.get(i + 1).copied().unwrap_or_default();
            match a.retry_after {
                Some(ra) => ra.min(shared.config.max_retry_after).max(planned),
                None => planned,
            }
        });
        info!(
            event = "webhook.attempt",
            attempt,
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
        stemq_core::metrics::metrics().webhook(outcome, a.latency);
        record(shared, d, attempt, &a, result, next).await;
        match next {
            Some(n) => wait = n,
            None => return,
        }
    }
}

async fn post(shared: &Shared, d: &Delivery<'_>, owner: &webhook::OwnerWebhooks, target: &webhook::Target) -> Attempt {
    let now = chrono::Utc::now();
    let body = serde_json::to_vec(&json!({
        "type": d.event_type,
        "timestamp": now.to_rfc3339(),
        "data": d.view,
    }))
    .expect("payload serialises");
    let ts = now.timestamp();
    let signature = webhook::signature_header(&owner.signing_secrets(now), d.webhook_id, ts, &body);
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(shared.config.timeout)
        // Connect to the address that was checked, whatever DNS says now.
        .resolve(&target.host, target.addr)
        .build();
    let t0 = Instant::now();
    let client = match client {
        Ok(c) => c,
        Err(e) => {
            return Attempt { status: None, error: Some(e.to_string()), retry_after: None, latency: t0.elapsed() }
        }
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
            Attempt { status: Some(r.status().as_u16()), error: None, retry_after, latency }
        }
        Err(e) => Attempt {
            status: None,
            error: Some(if e.is_timeout() { "timeout".to_string() } else { e.to_string() }),
            retry_after: None,
            latency,
        },
    }
}

/// `Retry-After` as seconds or an HTTP date.
fn parse_retry_after(v: &str) -> Option<Duration> {
    if let Ok(s) = v.trim().parse::<u64>() {
        return Some(Duration::from_secs(s));
    }
    let t = chrono::DateTime::parse_from_rfc2822(v.trim()).ok()?;
    (t.with_timezone(&chrono::Utc) - chrono::Utc::now()).to_std().ok()
}

async fn record(
    shared: &Shared,
    d: &Delivery<'_>,
    attempt: u32,
    a: &Attempt,
    result: DeliveryResult,
    next: Option<Duration>,
) {
    let ev = Event::new(
        d.id,
        &format!("/stemq/{}", shared.config.name),
        EventBody::DeliveryAttempted(DeliveryAttempted {
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
        }),
    );
    if let Err(e) = publish(&shared.js, &job_subject(d.id, SubjectKind::Delivery), &ev, None).await {
        warn!(error = %e, "delivery attempt not recorded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(status: Option<u16>) -> Attempt {
        Attempt { status, error: None, retry_after: None, latency: Duration::ZERO }
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

    #[test]
    fn jitter_is_bounded() {
        for _ in 0..100 {
            let j = jitter(Duration::from_secs(10));
            assert!(j >= Duration::from_secs(10) && j <= Duration::from_secs(12));
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }
}
