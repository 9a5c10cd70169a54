//! The state every handler shares: the NATS handles, the list index, the worker
//! registry, the limits and the settings of [`crate::Config`], behind one `Arc`.

use std::sync::Arc;

use async_nats::jetstream::{self, kv};
use stemq_accounts::auth::{Caller, KeyRing};
use stemq_core::netpolicy::HostPolicy;
use stemq_core::{JobId, JobStatus, JobView};
use stemq_nats as names;
use stemq_nats::error::JetStreamError;
use stemq_nats::read::{ListIndex, ViewError, Views};
use stemq_nats::registry::{self, Registry};
use stemq_telemetry::readiness::Readiness;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::{availability, cors, leases, limits, links, serve, session, uploads, IngressError};

/// Shared handler state: one `Arc`, so the clone that every request's extractors and
/// middleware take is a reference count, not a copy of the NATS handles inside (such a
/// copy per request costs a fifth of the ingress's CPU under load).
#[derive(Clone)]
pub struct AppState(Arc<AppShared>);

impl std::ops::Deref for AppState {
    type Target = AppShared;
    fn deref(&self) -> &AppShared {
        &self.0
    }
}

/// What [`AppState`] shares (read through it).
#[derive(Clone)]
pub struct AppShared {
    pub(crate) js: jetstream::Context,
    pub(crate) views: Views,
    pub(crate) index: Arc<ListIndex>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) storage: Option<Arc<uploads::StorageConfig>>,
    pub(crate) stores: Arc<Vec<String>>,
    /// `None` when authentication is off.
    pub(crate) keys: Option<Arc<KeyRing>>,
    pub(crate) limits: kv::Store,
    pub(crate) key_locks: Arc<limits::KeyLocks>,
    /// What this replica holds of each key's limits.
    pub(crate) leases: Arc<leases::Leases>,
    pub(crate) audio_urls: Option<Arc<HostPolicy>>,
    /// `/metrics` includes the queue figures.
    pub(crate) queue_metrics: bool,
    /// The live workers (`stemq_workers`).
    pub(crate) registry: Registry,
    /// See [`crate::Config::refuse_unserved`].
    pub(crate) refuse_unserved: bool,
    /// Until then a submit for a model no worker serves waits for one to announce
    /// itself instead of being refused: the start-up window, while workers started with
    /// this ingress are still loading ([`UNSERVED_GRACE`]).
    pub(crate) unserved_grace_until: tokio::time::Instant,
    /// See [`crate::Config::readiness`].
    pub(crate) readiness: Readiness,
    /// How long submits wait for the queue (shared by HTTP and NATS submits).
    pub(crate) availability: Arc<availability::Availability>,
    /// See [`crate::Config::signin`].
    pub(crate) signin: Option<Arc<session::SigninLink>>,
    /// The price list (credits), read from the configuration bucket.
    pub(crate) prices: Arc<stemq_accounts::ledger::PriceCache>,
    /// The credits ledger, with the accounts this replica has folded.
    pub(crate) ledger: stemq_accounts::ledger::Ledger,
    /// Where answers' links point ([`links`]).
    pub(crate) links: Arc<links::LinkBase>,
    /// See [`crate::Config::cors_origins`].
    pub(crate) cors_origins: Arc<Vec<cors::Origin>>,
    /// Cancelled when the ingress stops: requests waiting on a job answer at once.
    pub(crate) stopping: CancellationToken,
    /// The batch log (`STEMQ_BATCHES`).
    pub(crate) batches: stemq_nats::batch_log::BatchLog,
    /// See [`crate::Config::http_timeouts`] (the body limits are applied per request).
    pub(crate) http_timeouts: serve::HttpTimeouts,
}

impl AppState {
    /// Opens the bucket and stream, and starts the list index.
    pub async fn new(client: async_nats::Client, shutdown: CancellationToken) -> Result<AppState, IngressError> {
        let js = jetstream::new(client);
        let views = Views::open(&js).await?;
        let index = ListIndex::follow(views.bucket().clone(), shutdown.clone()).await;
        let metrics = Arc::new(Metrics::new(js.clone()));
        let open = |name: &'static str| {
            let js = js.clone();
            async move { js.get_key_value(name).await.map_err(JetStreamError::open(name)) }
        };
        let keys = Some(Arc::new(KeyRing::new(open(names::KEYS_BUCKET).await?)));
        let limits = open(names::LIMITS_BUCKET).await?;
        let leases: Arc<leases::Leases> = Arc::default();
        let known = {
            let index = index.clone();
            move |id: &JobId| limits::state_in(&index, id)
        };
        tokio::spawn(leases.clone().run(limits.clone(), known, shutdown.clone()));
        let registry = Registry::watch(open(names::WORKERS_BUCKET).await?);
        // An older deployment without the bucket has credits off.
        let prices = Arc::new(stemq_accounts::ledger::PriceCache::new(
            js.get_key_value(stemq_accounts::ledger::CONFIG_BUCKET).await.ok(),
        ));
        let batches = stemq_nats::batch_log::BatchLog::open(&js).await?;
        let ledger = stemq_accounts::ledger::Ledger::new(js.clone());
        Ok(AppState(Arc::new(AppShared {
            ledger,
            js,
            views,
            index,
            metrics,
            storage: None,
            stores: Arc::new(Vec::new()),
            keys,
            limits,
            key_locks: Arc::default(),
            leases,
            audio_urls: None,
            queue_metrics: false,
            registry,
            refuse_unserved: false,
            unserved_grace_until: tokio::time::Instant::now() + UNSERVED_GRACE,
            readiness: Readiness::new(),
            availability: Arc::default(),
            signin: None,
            prices,
            links: Arc::default(),
            cors_origins: Arc::default(),
            stopping: shutdown,
            batches,
            http_timeouts: serve::HttpTimeouts::default(),
        })))
    }

    /// The state to set up (a builder's; copied only if already shared).
    pub(crate) fn edit(&mut self) -> &mut AppShared {
        Arc::make_mut(&mut self.0)
    }

    /// Accepts `link`'s token once on `POST /v1/signin`.
    pub fn with_signin(mut self, link: Option<Arc<session::SigninLink>>) -> AppState {
        self.edit().signin = link;
        self
    }

    /// The list index (every job, newest first, per status and owner).
    pub fn index(&self) -> &ListIndex {
        &self.index
    }

    /// Links answers under `base` ([`links`]).
    pub fn with_links(mut self, base: links::LinkBase) -> AppState {
        self.edit().links = Arc::new(base);
        self
    }

    /// Times request bodies out as `timeouts` say ([`serve`]).
    pub fn with_http_timeouts(mut self, timeouts: serve::HttpTimeouts) -> AppState {
        self.edit().http_timeouts = timeouts;
        self
    }

    /// Lets browser pages of `origins` call the API ([`cors`]).
    pub fn with_cors_origins(mut self, origins: Vec<cors::Origin>) -> AppState {
        self.edit().cors_origins = Arc::new(origins);
        self
    }

    /// Refuses submits for models no live worker serves (see [`crate::Config::refuse_unserved`]).
    pub fn with_refuse_unserved(mut self, on: bool) -> AppState {
        self.edit().refuse_unserved = on;
        self
    }

    /// Answers `/readyz` with 200 only once `readiness` holds too ([`crate::Config::readiness`]).
    pub fn with_readiness(mut self, readiness: Readiness) -> AppState {
        self.edit().readiness = readiness;
        self
    }

    /// Until when a submit for an unserved model waits for a worker rather than being
    /// refused (see [`crate::Config::refuse_unserved`]).
    pub fn unserved_grace_until(&self) -> tokio::time::Instant {
        self.unserved_grace_until
    }

    /// The live workers.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Serves every request as the operator of the owner `local`, without keys.
    pub fn without_auth(mut self) -> AppState {
        self.edit().keys = None;
        self
    }

    /// The view of `id` if `caller` may see it: another owner's job is as absent as a job
    /// that does not exist.
    /// The view carries the read-time fields ([`AppState::annotate`]).
    pub async fn view_for(&self, caller: &Caller, id: &JobId) -> Result<Option<JobView>, ViewError> {
        Ok(self.view(id).await?.filter(|v| caller.sees(v.owner())).map(|v| self.annotate(v)))
    }

    /// `view` with what only a reader knows, as every answer carries it: why a queued job
    /// waits ([`AppState::with_waiting`]) and where the job stands now
    /// ([`AppState::with_place`]).
    pub fn annotate(&self, view: JobView) -> JobView {
        self.with_place(self.with_waiting(view), chrono::Utc::now())
    }

    /// `view` with its `queue_position`, `eta` and `eta_seconds` as of `now`, from the
    /// list index (the queue and recent run times) and the live workers
    /// ([`ListIndex::place`]).
    pub fn with_place(&self, mut view: JobView, now: chrono::DateTime<chrono::Utc>) -> JobView {
        if !view.status.is_terminal() {
            self.index.place(&view, &self.registry.live(), now).write_into(&mut view, now);
        }
        view
    }

    /// `view` with `waiting` set when it is queued for a model no live worker serves.
    pub fn with_waiting(&self, mut view: JobView) -> JobView {
        if view.status == JobStatus::Queued && self.registry.is_ready() {
            if let Some(r) = &view.request {
                view.waiting = registry::waiting_reason(&self.registry.live(), r.model);
            }
        }
        view
    }

    /// Serves uploads and stems from this store.
    pub fn with_storage(mut self, storage: uploads::StorageConfig) -> AppState {
        let shared = self.edit();
        shared.stores = Arc::new(vec![storage.store.base_url().to_string()]);
        shared.storage = Some(Arc::new(storage));
        self
    }

    /// Accepts external `audio_uri` URLs whose host `policy` admits.
    pub fn with_audio_urls(mut self, policy: HostPolicy) -> AppState {
        self.edit().audio_urls = Some(Arc::new(policy));
        self
    }

    /// Exports the queue figures on `/metrics` (this ingress is the queue exporter).
    pub fn with_queue_metrics(mut self, on: bool) -> AppState {
        self.edit().queue_metrics = on;
        self
    }

    /// Base URLs of the stores an `audio_uri` may point into.
    pub fn stores(&self) -> &[String] {
        &self.stores
    }

    /// The hosts an external `audio_uri` may name, when external audio is on.
    pub fn audio_urls(&self) -> Option<&HostPolicy> {
        self.audio_urls.as_deref()
    }

    /// The JetStream context.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The credits ledger.
    pub fn ledger(&self) -> &stemq_accounts::ledger::Ledger {
        &self.ledger
    }

    /// Reads a job's view ([`Views::current`]): the KV view, else the request from the
    /// log when the projector has not caught up (right after a submit), so a job that
    /// exists is never a 404. An error answers 503 (`From<ViewError> for ApiError`).
    pub async fn view(&self, id: &JobId) -> Result<Option<JobView>, ViewError> {
        self.views.current(id).await
    }

    /// The status bucket (the SSE route watches it).
    pub(crate) fn bucket(&self) -> &kv::Store {
        self.views.bucket()
    }
}

/// How long after its start an ingress that refuses unserved models lets a submit for
/// one wait for a worker instead: workers started with it may still be loading their
/// models or announcing themselves. Shorter than a submit's own time limit, so a model
/// that nobody will serve is still refused (422), not timed out.
pub const UNSERVED_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
