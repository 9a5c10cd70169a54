//! Subjects, streams, consumers and buckets: the names of stemq inside NATS.
//!
//! This module owns every name and how a subject is built and read back (the job id,
//! the owner token and the route of a request subject), and checks that a request's
//! subject agrees with its body ([`check_request_owner`], [`check_request_route`]).
//!
//! Subjects:
//! - `stemq.jobs.<id>.requested.<owner token>.<model>.<lane>` — the request
//!   (Nats-Msg-Id = job id, expected last subject sequence 0 over every request subject
//!   of the job: one request per job, for as long as the log keeps it). The owner token
//!   is the request's owner as [`stemq_core::request::owner_token`] spells it, so a NATS
//!   user's subject permissions can bind it to one owner (a `publisher` user may publish
//!   only `stemq.jobs.*.requested.<its owner>.>`); the worker and the projector refuse a
//!   request whose body names another owner ([`check_request_owner`]). The model and the
//!   lane route it: each pool (model) has one durable consumer per lane,
//!   `workers-<model>-<lane>` ([`pool_consumer`]), filtered on its model and lane, so a
//!   worker pulls only what it can run. Requests recorded earlier, on
//!   `stemq.jobs.<id>.requested` (before owner tokens) and
//!   `stemq.jobs.<id>.requested.<owner token>` (before routing), stay readable: every
//!   reader of requests matches all three forms ([`REQUESTED_FILTERS`]), and the
//!   ingress's router moves the unrouted ones that were still waiting into their pools
//!   (the durable `workers` consumer holds them);
//! - `stemq.jobs.<id>.started`, `stemq.jobs.<id>.failed` — attempts;
//! - `stemq.jobs.<id>.outcome` — the terminal event; published with expected last
//!   subject sequence 0, so the first terminal event wins and there is exactly one;
//! - `stemq.jobs.<id>.cancel_requested` — a cancel request (workers also listen here
//!   with a plain subscription while they run the job);
//! - `stemq.jobs.<id>.delivery`, `stemq.jobs.<id>.delivery_replay` — webhook delivery
//!   attempts and replay requests (the relay's);
//! - `stemq.progress.<id>` — latest progress (compacted stream);
//! - `stemq.batches.<batch id>.submitted`, `.ended`, `.delivery` — a batch's submission
//!   rounds, its one end (expected last subject sequence 0) and its webhook attempts, and
//!   `stemq.batch_jobs.<job id>.<batch id>` — which batches hold a job (all in
//!   `STEMQ_BATCHES`, see [`crate::batch_log`]);
//! - `stemq.api.submit` — request-reply submit endpoint (queue group `ingress`).

use stemq_core::request::{owner_token, JobId, Model, Priority};

/// The job event stream.
pub const JOBS_STREAM: &str = "STEMQ_JOBS";
/// Each job's one outcome (`read::outcome`); the job stream sources a copy.
pub const OUTCOMES_STREAM: &str = "STEMQ_OUTCOMES";
/// The compacted progress stream.
pub const PROGRESS_STREAM: &str = "STEMQ_PROGRESS";
/// Captured advisories.
pub const ADVISORY_STREAM: &str = "STEMQ_ADVISORIES";
/// The batch log.
pub const BATCHES_STREAM: &str = "STEMQ_BATCHES";
/// The workers' durable consumer.
pub const WORKERS_CONSUMER: &str = "workers";
/// The projector's durable consumer over job events.
pub const PROJECTOR_CONSUMER: &str = "projector";
/// The projector's durable consumer over progress.
pub const PROJECTOR_PROGRESS_CONSUMER: &str = "projector-progress";
/// The dead-letter handler's durable consumer over advisories.
pub const DEADLETTER_CONSUMER: &str = "deadletter";
/// The webhook relay's durable consumer over job events.
pub const RELAY_CONSUMER: &str = "relay";
/// The webhook relay's durable consumer over progress.
pub const RELAY_PROGRESS_CONSUMER: &str = "relay-progress";
/// The webhook relay's durable consumer over batch rounds and ends (`STEMQ_BATCHES`).
pub const RELAY_BATCHES_CONSUMER: &str = "relay-batches";
/// The webhook relay's durable consumer over job outcomes, for the batches that hold them.
pub const RELAY_BATCH_OUTCOMES_CONSUMER: &str = "relay-batch-outcomes";
/// The status view bucket, keyed by [`view_key`].
pub const JOBS_BUCKET: &str = "stemq_jobs";
/// Per-owner webhook signing secrets (and endpoints disabled by a 410).
pub const WEBHOOKS_BUCKET: &str = "stemq_webhooks";
/// API key records (owner, role, limits, secret hash).
pub const KEYS_BUCKET: &str = "stemq_keys";
/// Per-key rate-limit state shared by ingress replicas.
pub const LIMITS_BUCKET: &str = "stemq_limits";
/// The worker registry bucket (`crate::registry`).
pub const WORKERS_BUCKET: &str = "stemq_workers";
/// Webhook delivery claims: which relay makes which attempt (key = `<job id>.<event id>`).
pub const DELIVERY_CLAIMS_BUCKET: &str = "stemq_delivery_claims";
/// Request-reply submit subject.
pub const SUBMIT_SUBJECT: &str = "stemq.api.submit";
/// Prefix of every job subject.
pub const JOBS_PREFIX: &str = "stemq.jobs";
/// Prefix of every batch subject (`stemq.batches.<batch id>.<kind>`).
pub const BATCHES_PREFIX: &str = "stemq.batches";
/// Prefix of the batch memberships (`stemq.batch_jobs.<job id>.<batch id>`).
pub const BATCH_JOBS_PREFIX: &str = "stemq.batch_jobs";

/// Subject of one kind of event of one job. For [`SubjectKind::Requested`] this is the
/// form before owner tokens (`stemq.jobs.<id>.requested`), which is still read but no
/// longer written: a new request goes to [`request_subject`].
pub fn job_subject(id: &JobId, kind: SubjectKind) -> String {
    match kind {
        SubjectKind::Progress => format!("stemq.progress.{id}"),
        k => format!("{JOBS_PREFIX}.{id}.{}", k.token()),
    }
}

/// Where a new request of `owner` for job `id` is published:
/// `stemq.jobs.<id>.requested.<owner token>.<model>.<lane>`.
pub fn request_subject(id: &JobId, owner: &str, model: Model, lane: Priority) -> String {
    format!("{JOBS_PREFIX}.{id}.requested.{}.{model}.{lane}", owner_token(owner))
}

/// The request subject of the form before routing, `stemq.jobs.<id>.requested.<owner
/// token>`: stemq does not write it, and accepts it from publishers (the ingress's
/// router moves such a request into its pool).
pub fn unrouted_request_subject(id: &JobId, owner: &str) -> String {
    format!("{JOBS_PREFIX}.{id}.requested.{}", owner_token(owner))
}

/// The filters that match every request, in all three forms: the oldest
/// `stemq.jobs.*.requested`, the unrouted `stemq.jobs.*.requested.*` and the routed
/// `stemq.jobs.*.requested.*.*.*`.
pub const REQUESTED_FILTERS: [&str; 3] =
    ["stemq.jobs.*.requested", "stemq.jobs.*.requested.*", "stemq.jobs.*.requested.*.*.*"];

/// The filters of requests without a route (before routing): what the durable
/// `workers` consumer holds for the ingress's router.
pub const UNROUTED_FILTERS: [&str; 2] = ["stemq.jobs.*.requested", "stemq.jobs.*.requested.*"];

/// The filter of one job's requests with owner tokens, routed or not
/// (`stemq.jobs.<id>.requested.>`); the oldest form is `job_subject(id, Requested)`.
pub fn request_filter(id: &JobId) -> String {
    format!("{JOBS_PREFIX}.{id}.requested.>")
}

/// The filter of every event of one job in the log, its requests in any form
/// included (`stemq.jobs.<id>.>`).
pub fn job_filter(id: &JobId) -> String {
    format!("{JOBS_PREFIX}.{id}.>")
}

/// The filter of one job's events whose kind is one token (`stemq.jobs.<id>.*`:
/// started, failed, outcome, cancel requests, ...), which leaves its requests out. A
/// direct get of the last message on it answers "nothing recorded yet" or "ended" in
/// one round trip.
pub fn job_events_filter(id: &JobId) -> String {
    format!("{JOBS_PREFIX}.{id}.*")
}

/// The key of a job's view in [`JOBS_BUCKET`]: `<owner token>.<job id>`, so that NATS
/// permissions can bind a reader to one owner (`$KV.stemq_jobs.<owner token>.>`). A
/// view whose owner is unknown (no readable request) is keyed by the job id alone, the
/// form every view had before keys carried owners; readers find a view under either
/// ([`crate::read::stored_view`]) and the projector writes a view where it already is.
pub fn view_key(owner: Option<&str>, id: &JobId) -> String {
    match owner {
        Some(o) => format!("{}.{id}", owner_token(o)),
        None => id.to_string(),
    }
}

/// The job whose view a key of [`JOBS_BUCKET`] holds (either form of [`view_key`]).
pub fn job_of_view_key(key: &str) -> Option<JobId> {
    JobId::parse(key.rsplit('.').next().unwrap_or(key))
}

/// The durable consumer of one pool's lane: `workers-<model>-<lane>`.
pub fn pool_consumer(model: Model, lane: Priority) -> String {
    format!("{WORKERS_CONSUMER}-{model}-{lane}")
}

/// What the consumer of a pool's lane takes: `stemq.jobs.*.requested.*.<model>.<lane>`.
pub fn pool_filter(model: Model, lane: Priority) -> String {
    format!("{JOBS_PREFIX}.*.requested.*.{model}.{lane}")
}

/// Every pool consumer name, models in [`Model::ALL`] order, lanes in [`Priority::ALL`]
/// order.
pub fn pool_consumers() -> Vec<String> {
    Model::ALL.iter().flat_map(|m| Priority::ALL.iter().map(|l| pool_consumer(*m, *l))).collect()
}

/// The model and lane a pool consumer serves (`None` for any other name).
pub fn pool_of_consumer(name: &str) -> Option<(Model, Priority)> {
    Model::ALL
        .iter()
        .flat_map(|m| Priority::ALL.iter().map(move |l| (*m, *l)))
        .find(|(m, l)| pool_consumer(*m, *l) == name)
}

fn request_tokens(subject: &str) -> Option<Vec<&str>> {
    let t: Vec<&str> = subject.split('.').collect();
    match t.as_slice() {
        ["stemq", "jobs", _, "requested"] | ["stemq", "jobs", _, "requested", _] => Some(t),
        ["stemq", "jobs", _, "requested", _, _, _] => Some(t),
        _ => None,
    }
}

/// True for a request subject of any form.
pub fn is_request_subject(subject: &str) -> bool {
    request_tokens(subject).is_some()
}

/// The owner token of a request subject with one (unrouted or routed); `None` for the
/// oldest form and for any other subject.
pub fn request_owner_token(subject: &str) -> Option<&str> {
    let mut t = subject.split('.');
    match (t.next(), t.next(), t.next(), t.next(), t.next()) {
        (Some("stemq"), Some("jobs"), Some(_), Some("requested"), Some(token)) if is_request_subject(subject) => {
            Some(token)
        }
        _ => None,
    }
}

/// The model and lane of a routed request subject; `None` for the earlier forms (and
/// for a model or lane stemq does not know).
pub fn request_route(subject: &str) -> Option<(Model, Priority)> {
    match request_tokens(subject)?.as_slice() {
        [.., "requested", _, model, lane] => Some((Model::parse(model)?, Priority::parse(lane)?)),
        _ => None,
    }
}

/// A request whose body names another owner than its subject's token: recorded by
/// someone allowed to publish for the subject's owner only (a `publisher`), so it is
/// refused, never run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the request names owner `{owner}` (token `{owner_token}`), but it was published on {subject}, \
     which only a publisher for owner token `{subject_token}` may use"
)]
pub struct OwnerMismatch {
    /// The subject it was published on.
    pub subject: String,
    /// The owner token in the subject.
    pub subject_token: String,
    /// The owner in the request.
    pub owner: String,
    /// That owner's token.
    pub owner_token: String,
}

/// Checks that a request's `owner` agrees with the owner token of the subject it was
/// published on. A request on the old subject (no token) passes: only the operator may
/// publish there now.
pub fn check_request_owner(subject: &str, owner: &str) -> Result<(), OwnerMismatch> {
    match request_owner_token(subject) {
        Some(token) if token != owner_token(owner) => Err(OwnerMismatch {
            subject: subject.to_string(),
            subject_token: token.to_string(),
            owner: owner.to_string(),
            owner_token: owner_token(owner),
        }),
        _ => Ok(()),
    }
}

/// A routed request whose subject names another model or lane than its body: it would
/// wait in a pool that does not run it. Refused like an owner mismatch (never run, never
/// folded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the request is for {model} ({lane}), but it was published on {subject}, the route of another pool or lane")]
pub struct RouteMismatch {
    /// The subject it was published on.
    pub subject: String,
    /// The request's model.
    pub model: Model,
    /// The request's lane.
    pub lane: Priority,
}

/// Checks that a routed request's subject names the model and lane of its body. The
/// unrouted forms carry no route and are accepted.
pub fn check_request_route(subject: &str, model: Model, lane: Priority) -> Result<(), RouteMismatch> {
    let routed = request_tokens(subject).map(|t| t.len() == 7).unwrap_or(false);
    if routed && request_route(subject) != Some((model, lane)) {
        return Err(RouteMismatch { subject: subject.to_string(), model, lane });
    }
    Ok(())
}

/// The subject families of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubjectKind {
    /// `stemq.jobs.<id>.requested` (the old form: new requests carry the owner token,
    /// see [`request_subject`])
    Requested,
    /// `stemq.jobs.<id>.started`
    Started,
    /// `stemq.jobs.<id>.failed` (transient)
    Failed,
    /// `stemq.jobs.<id>.outcome` (terminal)
    Outcome,
    /// `stemq.jobs.<id>.retried` (link to the re-run)
    Retried,
    /// `stemq.jobs.<id>.cancel_requested`
    CancelRequested,
    /// `stemq.jobs.<id>.delivery` (webhook attempts)
    Delivery,
    /// `stemq.jobs.<id>.delivery_replay`
    DeliveryReplay,
    /// `stemq.progress.<id>`
    Progress,
}

impl SubjectKind {
    fn token(self) -> &'static str {
        match self {
            SubjectKind::Requested => "requested",
            SubjectKind::Started => "started",
            SubjectKind::Failed => "failed",
            SubjectKind::Outcome => "outcome",
            SubjectKind::Retried => "retried",
            SubjectKind::CancelRequested => "cancel_requested",
            SubjectKind::Delivery => "delivery",
            SubjectKind::DeliveryReplay => "delivery_replay",
            SubjectKind::Progress => "progress",
        }
    }
}

/// The job id in a job or progress subject.
pub fn job_id_of_subject(subject: &str) -> Option<JobId> {
    let mut parts = subject.split('.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("stemq"), Some("jobs" | "progress"), Some(id)) => JobId::parse(id),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_keys_carry_the_owner_token_and_name_their_job() {
        let id = JobId::parse(&"b".repeat(64)).unwrap();
        assert_eq!(view_key(Some("acme"), &id), format!("acme.{id}"));
        assert_eq!(view_key(Some("acme.eu"), &id), format!("{}.{id}", owner_token("acme.eu")));
        assert_eq!(view_key(None, &id), id.to_string());
        for key in [view_key(Some("acme"), &id), view_key(Some("a b"), &id), view_key(None, &id)] {
            assert_eq!(job_of_view_key(&key), Some(id.clone()), "{key}");
        }
        assert_eq!(job_of_view_key("acme.nothex"), None);
    }

    #[test]
    fn subjects_round_trip() {
        let id = JobId::parse(&"a".repeat(64)).unwrap();
        assert_eq!(job_subject(&id, SubjectKind::Outcome), format!("stemq.jobs.{id}.outcome"));
        assert_eq!(job_id_of_subject(&job_subject(&id, SubjectKind::Requested)), Some(id.clone()));
        assert_eq!(job_id_of_subject(&job_subject(&id, SubjectKind::Progress)), Some(id.clone()));
        assert_eq!(job_id_of_subject("stemq.jobs.nothex.requested"), None);
        let unrouted = unrouted_request_subject(&id, "acme");
        assert_eq!(unrouted, format!("stemq.jobs.{id}.requested.acme"));
        let new = request_subject(&id, "acme", Model::Htdemucs6s, Priority::Batch);
        assert_eq!(new, format!("stemq.jobs.{id}.requested.acme.htdemucs_6s.batch"));
        for s in [&new, &unrouted, &job_subject(&id, SubjectKind::Requested)] {
            assert_eq!(job_id_of_subject(s), Some(id.clone()));
            assert!(is_request_subject(s), "{s}");
        }
        assert!(!is_request_subject(&job_subject(&id, SubjectKind::Outcome)));
        assert!(!is_request_subject(&format!("{unrouted}.x")));
        assert!(!is_request_subject(&format!("{new}.x")));
        assert_eq!(request_owner_token(&new), Some("acme"));
        assert_eq!(request_owner_token(&unrouted), Some("acme"));
        assert_eq!(request_owner_token(&format!("{unrouted}.x")), None);
        assert_eq!(request_owner_token(&job_subject(&id, SubjectKind::Requested)), None);
        assert_eq!(unrouted_request_subject(&id, "a b"), format!("stemq.jobs.{id}.requested.{}", owner_token("a b")));
        assert_eq!(request_route(&new), Some((Model::Htdemucs6s, Priority::Batch)));
        assert_eq!(request_route(&unrouted), None);
        assert_eq!(request_route(&format!("stemq.jobs.{id}.requested.acme.spleeter.batch")), None);
        // The pool's filter takes its own routed requests and nothing else.
        let matches = |filter: &str, subject: &str| {
            let (f, s): (Vec<_>, Vec<_>) = (filter.split('.').collect(), subject.split('.').collect());
            f.len() == s.len() && f.iter().zip(&s).all(|(a, b)| *a == "*" || a == b)
        };
        assert!(matches(&pool_filter(Model::Htdemucs6s, Priority::Batch), &new));
        assert!(!matches(&pool_filter(Model::Htdemucs, Priority::Batch), &new));
        assert!(!matches(&pool_filter(Model::Htdemucs6s, Priority::Interactive), &new));
    }

    #[test]
    fn a_request_must_name_the_owner_of_its_subject() {
        let id = JobId::parse(&"b".repeat(64)).unwrap();
        let routed = |owner| request_subject(&id, owner, Model::Dsp, Priority::Interactive);
        assert!(check_request_owner(&routed("acme"), "acme").is_ok());
        assert!(check_request_owner(&routed("a.b"), "a.b").is_ok());
        assert!(check_request_owner(&unrouted_request_subject(&id, "a.b"), "a.b").is_ok());
        assert!(check_request_owner(&routed("acme"), "globex").is_err());
        // The old form carries no owner: only the operator may still publish there.
        assert!(check_request_owner(&job_subject(&id, SubjectKind::Requested), "anyone").is_ok());
        let e = check_request_owner(&unrouted_request_subject(&id, "acme"), "globex").unwrap_err();
        assert_eq!((e.subject_token.as_str(), e.owner.as_str()), ("acme", "globex"));
        assert!(e.to_string().contains("`globex`") && e.to_string().contains("`acme`"), "{e}");
    }

    #[test]
    fn a_routed_request_must_name_the_pool_of_its_body() {
        let id = JobId::parse(&"c".repeat(64)).unwrap();
        let routed = request_subject(&id, "acme", Model::Dsp, Priority::Batch);
        assert!(check_request_route(&routed, Model::Dsp, Priority::Batch).is_ok());
        assert!(check_request_route(&routed, Model::Htdemucs, Priority::Batch).is_err());
        assert!(check_request_route(&routed, Model::Dsp, Priority::Interactive).is_err());
        let bogus = format!("stemq.jobs.{id}.requested.acme.spleeter.batch");
        assert!(check_request_route(&bogus, Model::Dsp, Priority::Batch).is_err());
        for unrouted in [unrouted_request_subject(&id, "acme"), job_subject(&id, SubjectKind::Requested)] {
            assert!(check_request_route(&unrouted, Model::Htdemucs, Priority::Batch).is_ok());
        }
    }
}
