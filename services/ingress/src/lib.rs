//! stemq-ingress: the front door. Validates requests, queues jobs, answers status.
//!
//! This crate owns the public API. It never does heavy work: a submit is one publish
//! ([`submit`]), a status read is one KV get. Every route is one entry of the route
//! table ([`api::routes`]): its handler and its description, from which both the router
//! and `/openapi.json` ([`openapi`]) are made. Routes:
//!
//! - `POST /v1/separations` → 202 new job, 200 existing job (`cached: true`), 422 invalid;
//!   with `Prefer: wait=N` the job's view once it ended (200) or after N s (202)
//! - `GET /v1/separations/{id}` → the status view, 404 unknown; `Prefer: wait=N` waits
//!   up to N s for its end ([`prefer`])
//! - `GET /v1/separations?status=&limit=&cursor=` → newest first
//! - `POST /v1/batches` → up to 1 000 requests as one batch (its id is its content),
//!   `GET /v1/batches/{id}` → each item's job and status, counts ([`batches`])
//! - `POST /v1/uploads` → 201 `{audio_uri, bytes, sha256}`, 413 too large ([`uploads`]);
//!   the `audio_uri` is `upload:<sha256>.<ext>`, never a server path
//! - `GET /v1/separations/{id}/stems/{stem}` → the stem (Range), or 307 to S3 ([`stems`])
//! - `POST /v1/separations/{id}/cancel`, `POST /v1/separations/{id}/retry` ([`control`])
//! - `GET /v1/separations/{id}/events` → Server-Sent Events of the status ([`events`])
//! - `GET /v1/separations/{id}/deliveries`, `POST .../deliveries/{n}/replay`,
//!   `GET /v1/webhooks/secret`, `POST /v1/webhooks/secret/rotate`,
//!   `POST /v1/webhooks/enable` ([`webhooks`])
//! - `GET /v1/workers` → the live workers and what they serve, per pool, and
//!   `GET /v1/overview` → job counts, oldest job, throughput per minute (operators;
//!   [`workers`]); `GET /v1/models` → the models, their stems, and which are served now
//! - `GET /v1/account` → credits: balance, reserved, usage per model over a period;
//!   a submit the owner cannot pay is 402 ([`credits`])
//! - `GET /v1/me` → the caller's owner and role; `POST /v1/signin` → a one-time sign-in
//!   link's key (`stemq dev` only; [`session`])
//! - `GET /`, `GET /app/{file}` → the page for people ([`web`])
//! - `GET /healthz`, `GET /readyz`, `GET /metrics`, `GET /openapi.json`
//!
//! Every job the API answers with carries `urls`: absolute links to read, cancel and
//! follow it and, once it succeeded, to download each stem ([`links`]; under
//! [`Config::public_url`], else the request's host). Unknown routes, wrong methods,
//! bodies too large and unparsable paths or queries answer in the API's error shape like
//! every other error ([`errors`]). Browser pages of the origins in
//! [`Config::cors_origins`] may call the API ([`cors`]; off by default).
//!
//! A queued job's view says why it waits (`waiting`) when no live worker serves its
//! model (from the worker registry), where it is in its pool's lane (`queue_position`)
//! and when it should be done (`eta`, `eta_seconds`; from the list index and the
//! registry, see `stemq_core::read::queue`); with [`Config::refuse_unserved`] (`stemq dev`) such
//! a submit is refused instead. Every ingress also runs the [`router`], which moves
//! requests recorded without a route (earlier releases, old publishers) into their pools.
//!
//! Every route but `/healthz`, `/readyz` and `/openapi.json` needs an API key, and every
//! job is its owner's alone ([`access`]); submits are limited per key ([`limits`]).
//!
//! A submit waits out a leader election of the job stream (up to 10 s) and, once the
//! queue is known to take nothing (quorum lost), answers 503 within a second
//! ([`availability`]). Every 503 carries `Retry-After`.
//!
//! The same submit is served over NATS request-reply on `stemq.api.submit` ([`nats_api`]).
//! The listener speaks plain HTTP, or HTTPS (optionally with client certificates) when
//! [`Config::tls`] is set ([`tls`]); a client that is slow to send a request head or
//! body is cut off ([`serve`], [`Config::http_timeouts`]).

pub mod access;
pub mod api;
pub mod availability;
pub mod batches;
pub mod control;
pub mod cors;
pub mod credits;
pub mod errors;
pub mod events;
pub mod limits;
pub mod links;
pub mod metrics;
pub mod nats_api;
pub mod openapi;
pub mod prefer;
pub mod router;
pub mod serve;
pub mod session;
pub mod stems;
pub mod submit;
pub mod tls;
pub mod uploads;
pub mod web;
pub mod webhooks;
pub mod workers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::{self, kv};
use axum::extract::{DefaultBodyLimit, Extension, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stemq_core::auth::{Caller, KeyRing};
use stemq_core::error::JetStreamError;
use stemq_core::nats as names;
use stemq_core::netpolicy::HostPolicy;
use stemq_core::read::{Cursor, ListIndex, ViewError, Views};
use stemq_core::readiness::Readiness;
use stemq_core::registry::{self, Registry};
use stemq_core::request::Priority;
use stemq_core::{JobId, JobStatus, JobView};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use crate::errors::{Bytes, Path, Query};
use crate::links::{Job, Links};
use crate::metrics::Metrics;
use crate::submit::{SubmitError, SubmitResponse};

/// Ingress failures at start.
#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    /// Cannot listen.
    #[error("cannot listen on {0}")]
    Bind(SocketAddr, #[source] std::io::Error),
    /// A JetStream call failed.
    #[error(transparent)]
    JetStream(#[from] JetStreamError),
    /// Serving failed.
    #[error("http server")]
    Serve(#[source] std::io::Error),
    /// Authentication is off and the address is not loopback.
    #[error(
        "refusing to serve {0} without authentication: --insecure-no-auth is for loopback addresses only \
         (127.0.0.1, ::1); create keys with `stemq keys create` instead"
    )]
    NoAuthOnNetwork(SocketAddr),
    /// The TLS certificate, key or client CA cannot be used.
    #[error("TLS settings")]
    Tls(#[from] tls::TlsError),
}

/// Ingress configuration.
#[derive(Clone)]
pub struct Config {
    /// Where to listen.
    pub listen: SocketAddr,
    /// Serve the NATS request-reply submit endpoint too.
    pub nats_submit: bool,
    /// The object store: uploads and stem downloads are served from it, and an
    /// `audio_uri` must point into it. Without one every submit is refused.
    pub storage: Option<uploads::StorageConfig>,
    /// Require API keys (the default). Off only on loopback, for local experiments:
    /// every request is then the operator of the owner `local`.
    pub auth: bool,
    /// Serve HTTPS with this certificate and key (and client certificates signed by its
    /// client CA, if one is given) instead of plain HTTP.
    pub tls: Option<tls::TlsConfig>,
    /// External audio: hosts an `https://` (or, for exempt hosts, `http://`) `audio_uri`
    /// may name (`STEMQ_AUDIO_URL_ALLOW`). `None`: every http(s) `audio_uri` is refused.
    pub audio_urls: Option<HostPolicy>,
    /// Export the queue figures (`stemq_queue_*`, `stemq_projector_lag_events`) on
    /// `/metrics` (`--queue-metrics`). Exactly one process of a deployment should: see
    /// [`stemq_core::metrics::QueueFigures`].
    pub queue_metrics: bool,
    /// Refuse (422) a submit for a model no live worker serves, instead of queueing it
    /// to wait for one (`--refuse-unserved-models`; on in `stemq dev`, whose one worker is
    /// all there is).
    pub refuse_unserved: bool,
    /// A one-time sign-in link for the page (`stemq dev`; see [`session`]).
    pub signin: Option<Arc<session::SigninLink>>,
    /// The URL clients reach the API at (`--public-url`), under which answers link a
    /// job's resources; `None`: each request's `Host` with this listener's scheme.
    pub public_url: Option<links::PublicUrl>,
    /// Web page origins allowed to call the API from a browser (`--cors-origin`); empty:
    /// no CORS headers at all.
    pub cors_origins: Vec<cors::Origin>,
    /// What else this process waits for before `/readyz` answers 200 (`stemq dev`: its
    /// worker, projector and relay); the ingress itself is ready once it can publish and
    /// has read the worker registry.
    pub readiness: Readiness,
    /// How long a client may take to send a request head or body ([`serve`]).
    pub http_timeouts: serve::HttpTimeouts,
}

/// Shared handler state: one `Arc`, so the clone that every request's extractors and
/// middleware take is a reference count, not a copy of the NATS handles inside (that
/// copy was a fifth of the ingress's CPU under load; issue 18).
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
    js: jetstream::Context,
    views: Views,
    index: Arc<ListIndex>,
    metrics: Arc<Metrics>,
    storage: Option<Arc<uploads::StorageConfig>>,
    stores: Arc<Vec<String>>,
    /// `None` when authentication is off.
    keys: Option<Arc<KeyRing>>,
    limits: kv::Store,
    key_locks: Arc<limits::KeyLocks>,
    audio_urls: Option<Arc<HostPolicy>>,
    /// `/metrics` includes the queue figures.
    queue_metrics: bool,
    /// The live workers (`stemq_workers`).
    registry: Registry,
    /// See [`Config::refuse_unserved`].
    refuse_unserved: bool,
    /// Until then a submit for a model no worker serves waits for one to announce
    /// itself instead of being refused: the start-up window, while workers started with
    /// this ingress are still loading ([`UNSERVED_GRACE`]).
    unserved_grace_until: tokio::time::Instant,
    /// See [`Config::readiness`].
    readiness: Readiness,
    /// How long submits wait for the queue (shared by HTTP and NATS submits).
    availability: Arc<availability::Availability>,
    /// See [`Config::signin`].
    signin: Option<Arc<session::SigninLink>>,
    /// The price list (credits), read from the configuration bucket.
    prices: Arc<stemq_core::ledger::PriceCache>,
    /// The credits ledger, with the accounts this replica has folded.
    ledger: stemq_core::ledger::Ledger,
    /// Where answers' links point ([`links`]).
    links: Arc<links::LinkBase>,
    /// See [`Config::cors_origins`].
    cors_origins: Arc<Vec<cors::Origin>>,
    /// Cancelled when the ingress stops: requests waiting on a job answer at once.
    stopping: CancellationToken,
    /// The batch log (`STEMQ_BATCHES`).
    batches: stemq_core::batch_log::BatchLog,
    /// See [`Config::http_timeouts`] (the body limits are applied per request).
    http_timeouts: serve::HttpTimeouts,
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
        let registry = Registry::watch(open(names::WORKERS_BUCKET).await?);
        // An older deployment without the bucket has credits off.
        let prices = Arc::new(stemq_core::ledger::PriceCache::new(
            js.get_key_value(stemq_core::ledger::CONFIG_BUCKET).await.ok(),
        ));
        let batches = stemq_core::batch_log::BatchLog::open(&js).await?;
        let ledger = stemq_core::ledger::Ledger::new(js.clone());
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
    fn edit(&mut self) -> &mut AppShared {
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

    /// Refuses submits for models no live worker serves (see [`Config::refuse_unserved`]).
    pub fn with_refuse_unserved(mut self, on: bool) -> AppState {
        self.edit().refuse_unserved = on;
        self
    }

    /// Answers `/readyz` with 200 only once `readiness` holds too ([`Config::readiness`]).
    pub fn with_readiness(mut self, readiness: Readiness) -> AppState {
        self.edit().readiness = readiness;
        self
    }

    /// Until when a submit for an unserved model waits for a worker rather than being
    /// refused (see [`Config::refuse_unserved`]).
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
    pub fn ledger(&self) -> &stemq_core::ledger::Ledger {
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

/// Binds the listener (port 0 picks a free one).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, IngressError> {
    TcpListener::bind(addr).await.map_err(|e| IngressError::Bind(addr, e))
}

/// Runs the ingress on `listener` until `shutdown`.
pub async fn run(
    client: async_nats::Client,
    listener: TcpListener,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), IngressError> {
    let addr = listener.local_addr().map_err(IngressError::Serve)?;
    if !config.auth && !addr.ip().is_loopback() {
        return Err(IngressError::NoAuthOnNetwork(addr));
    }
    // Bad TLS files stop the ingress before it listens.
    let tls = config.tls.as_ref().map(tls::server_config).transpose()?;
    let mut state = AppState::new(client.clone(), shutdown.clone()).await?;
    if !config.auth {
        warn!(%addr, "authentication is OFF (--insecure-no-auth): every caller is an operator");
        state = state.without_auth();
    }
    if let Some(s) = config.storage {
        state = state.with_storage(s);
    }
    if let Some(p) = config.audio_urls {
        state = state.with_audio_urls(p);
    }
    state = state
        .with_queue_metrics(config.queue_metrics)
        .with_refuse_unserved(config.refuse_unserved)
        .with_signin(config.signin)
        .with_links(links::LinkBase::new(config.public_url, tls.is_some(), addr))
        .with_cors_origins(config.cors_origins)
        .with_readiness(config.readiness)
        .with_http_timeouts(config.http_timeouts);
    let router_task = {
        let (js, s) = (state.js.clone(), shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = router::run(js, s).await {
                warn!(error = %e, "the router of unrouted requests did not start");
            }
        })
    };
    let nats_task = if config.nats_submit {
        let (c, s, st) = (client.clone(), shutdown.clone(), state.clone());
        Some(tokio::spawn(async move { nats_api::serve(c, st, s).await }))
    } else {
        None
    };
    info!(%addr, tls = tls.is_some(), "ingress listening");
    let app = router(state);
    serve::serve(listener, app, tls, config.http_timeouts, shutdown.clone()).await.map_err(IngressError::Serve)?;
    if let Some(t) = nats_task {
        if let Ok(Err(e)) = t.await {
            warn!(error = %e, "NATS submit endpoint stopped with an error");
        }
    }
    let _ = router_task.await;
    info!("ingress stopped");
    Ok(())
}

/// The HTTP routes: every operation of [`api::routes`] (the same table `/openapi.json`
/// is generated from), then the framework's refusals in the API's shape.
pub fn router(state: AppState) -> Router {
    let cors = cors::layer(&state.cors_origins);
    let mut app = Router::new();
    for route in api::routes() {
        app = app.route(route.op.path, route.handler);
    }
    // After every route: the 405 fallback applies to the routes added before it.
    let app = app
        .fallback(errors::no_route)
        .method_not_allowed_fallback(errors::wrong_method)
        .layer(DefaultBodyLimit::max(errors::BODY_LIMIT))
        .layer(middleware::from_fn_with_state(state.clone(), access::authenticate))
        .layer(middleware::from_fn_with_state(state.clone(), nats_gate))
        // Before authentication: a body's time runs from its head, whoever sends it.
        .layer(middleware::from_fn_with_state(state.clone(), serve::limit_bodies))
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .with_state(state);
    // Outermost: a preflight is answered before authentication (it carries no key).
    let app = match cors {
        Some(cors) => app.layer(cors),
        None => app,
    };
    // Every request, a preflight too, keeps its connection from counting as idle.
    app.layer(middleware::from_fn(serve::hold_connection))
}

/// Routes that read or write NATS answer 503 at once while the connection is down,
/// instead of waiting out request timeouts or serving a stale, empty list as if it were
/// complete. Uploads (the object store only) and the operational routes stay up.
async fn nats_gate(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let needs_nats = path.starts_with("/v1/") && !path.starts_with("/v1/uploads");
    if needs_nats && !connected_within(&state.js.client(), RECONNECT_GRACE).await {
        return ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "unavailable",
            message: "the queue (NATS) is unreachable right now; retrying later is safe".into(),
            field: None,
        }
        .into_response();
    }
    next.run(req).await
}

/// True when `client` is connected, or reconnects within `grace`.
async fn connected_within(client: &async_nats::Client, grace: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        if client.connection_state() == async_nats::connection::State::Connected {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Longest an HTTP submit takes before answering 503: the publish's own budget (at
/// most 10 s, [`availability`]) and the checks before it. The submit is idempotent, so
/// the client's retry is safe even if the event got through.
/// How long after its start an ingress that refuses unserved models lets a submit for
/// one wait for a worker instead: workers started with it may still be loading their
/// models or announcing themselves. Shorter than a submit's own time limit, so a model
/// that nobody will serve is still refused (422), not timed out.
pub const UNSERVED_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

const SUBMIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(12);

/// How long a request that needs NATS waits for a lost connection to come back before
/// 503: when its node dies, the client reconnects to another node of a cluster within
/// milliseconds (a refused connection costs nothing; the next attempt follows 1 ms
/// later).
const RECONNECT_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "other".into());
    let method = req.method().to_string();
    let t0 = Instant::now();
    let resp = next.run(req).await;
    state.metrics.observe_http(&method, &route, resp.status().as_u16(), t0.elapsed());
    resp
}

/// An API error: its status and [`ErrorBody`]. A 503 also says when to try again
/// (`Retry-After: 2`).
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    field: Option<String>,
}

/// The body of every error the API answers (the `Error` schema of `/openapi.json`).
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "Error")]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// What went wrong, for programs (`code`) and for people (`message`).
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorDetail {
    /// Stable and matchable: `invalid_request`, `not_found`, `unauthorized`, ... (every
    /// code and its status are listed in docs/api.md).
    #[schemars(regex(pattern = r"^[a-z][a-z_]*$"))]
    pub code: &'static str,
    /// A sentence for people; never parse it.
    pub message: String,
    /// The offending request field or parameter, where there is one (422).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: ErrorDetail { code: self.code, message: self.message, field: self.field } };
        let mut resp = (self.status, Json(body)).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("2"));
        }
        resp
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Invalid(r) => ApiError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                code: "invalid_request",
                message: r.to_string(),
                field: Some(r.field),
            },
            SubmitError::Refused(e) => e,
            SubmitError::Unserved { .. } => ApiError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                code: "model_not_served",
                message: e.to_string(),
                field: Some("model".into()),
            },
            SubmitError::Limited(l) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                code: if l.limit == "rate" { "rate_limited" } else { "too_many_in_flight" },
                message: l.message,
                field: None,
            },
            SubmitError::Unavailable(m) => {
                warn!(error = %m, "submit failed");
                ApiError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    code: "unavailable",
                    message: "the job could not be queued right now; retrying is safe".into(),
                    field: None,
                }
            }
        }
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    warn!(error = %e, "internal error");
    store_unavailable()
}

/// 503 without internals: the cause is logged where it happened.
fn store_unavailable() -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: "unavailable",
        message: "status store unavailable; try again".into(),
        field: None,
    }
}

/// A view that cannot be read (the bucket or the log is unreachable, or the stored view
/// does not parse) is 503, whatever the cause; the cause goes to the log only.
impl From<ViewError> for ApiError {
    fn from(e: ViewError) -> ApiError {
        warn!(job_id = %e.job_id(), error = %stemq_core::error::report(&e), "cannot read a job's view");
        store_unavailable()
    }
}

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
    let _turn = state.key_locks.lock(&caller.key_id).await;
    limits::rate(&state.limits, caller).await.map_err(limits_unavailable)?.map_err(SubmitError::Limited)
}

fn limits_unavailable(e: limits::LimitsError) -> SubmitError {
    SubmitError::Unavailable(e.to_string())
}

/// Validates `body` for `caller` and builds its `requested` event: the request's own
/// checks ([`submit::prepare`]), the served models (with [`Config::refuse_unserved`]),
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
        let index = state.index.clone();
        let known = move |id: &JobId| limits::state_in(&index, id);
        let _turn = state.key_locks.lock(&caller.key_id).await;
        limits::admit(&state.limits, caller, &event.subject, known, recorded)
            .await
            .map_err(limits_unavailable)?
            .map_err(SubmitError::Limited)?;
    }
    let (resp, _) = submit::queue_with(&state.js, event, &state.availability).await?;
    Ok(resp)
}

/// The answer of `POST /v1/separations`: the submit answer, or with `Prefer: wait` the
/// job itself.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum Submitted {
    /// Without `Prefer: wait`: the job's id, status and links.
    Queued(SubmitResponse),
    /// With `Prefer: wait=N`: the job (its view with its `urls`), ended or after N s.
    Job(Box<Job>),
}

/// `POST /v1/separations`.
async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let incoming = headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string);
    let span = tracing::info_span!("http.submit", trace_id = tracing::field::Empty, owner = %caller.owner);
    stemq_core::telemetry::set_parent(&span, incoming.as_deref());
    let result = {
        // The job's trace continues from this span (or from the caller's, when tracing
        // is off here).
        let traceparent = span.in_scope(stemq_core::telemetry::current_traceparent).or(incoming);
        let work = submit_as(&state, &caller, &body, traceparent).instrument(span);
        match tokio::time::timeout(SUBMIT_TIMEOUT, work).await {
            Ok(r) => r,
            Err(_) => Err(SubmitError::Unavailable(format!("no answer from NATS within {SUBMIT_TIMEOUT:?}"))),
        }
    };
    state.metrics.observe_submit(&result);
    let (mut resp, _remaining) = match result {
        Err(SubmitError::Limited(l)) => return Ok(l.into_response()),
        r => r?,
    };
    let urls = links.of(&resp.job_id);
    let location = urls.get.clone();
    if let Some(secs) = prefer::wait(&headers) {
        // The job's view instead of the submit answer: the caller's own job, read as any
        // read is (right after the publish it comes from the log if the view lags).
        if let Some(view) = state.view_for(&caller, &resp.job_id).await? {
            let waited = prefer::until_ended(&state, &caller, view, secs).await?;
            let code = if waited.view.status.is_terminal() { StatusCode::OK } else { StatusCode::ACCEPTED };
            let job = Submitted::Job(Box::new(links.job(waited.view)));
            let mut out = (code, [(header::LOCATION, location)], Json(job)).into_response();
            prefer::mark(&mut out, waited.honoured.then_some(secs));
            return Ok(out);
        }
    }
    resp.urls = Some(urls);
    let mut out = if resp.cached {
        if let Ok(Some(v)) = state.view(&resp.job_id).await {
            resp.status = v.status;
        }
        (StatusCode::OK, [(header::LOCATION, location)], Json(Submitted::Queued(resp))).into_response()
    } else {
        (StatusCode::ACCEPTED, [(header::LOCATION, location)], Json(Submitted::Queued(resp))).into_response()
    };
    prefer::mark(&mut out, None);
    Ok(out)
}

/// The `{id}` of a job's routes.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct JobPath {
    /// The job id: 64 lowercase hex digits (the SHA-256 of the canonical request). Any
    /// other value is no job (404).
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub id: String,
}

/// `GET /v1/separations/{id}`.
async fn status(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    Path(JobPath { id }): Path<JobPath>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let view = control::view_or_404(&state, &caller, &id).await?;
    let (view, applied) = match prefer::wait(&headers) {
        Some(secs) => {
            let waited = prefer::until_ended(&state, &caller, view, secs).await?;
            (waited.view, waited.honoured.then_some(secs))
        }
        None => (view, None),
    };
    let mut resp = Json(links.job(view)).into_response();
    prefer::mark(&mut resp, applied);
    Ok(resp)
}

/// The list's query. Each value is read as a string, so a bad one is a 422 naming its
/// parameter; the schema says what each takes.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ListQuery {
    /// Only the jobs in this status.
    #[schemars(with = "Option<JobStatus>")]
    status: Option<String>,
    /// Jobs per page, 1 to 1000; default 50.
    #[schemars(with = "Option<u16>", range(min = 1, max = 1000))]
    limit: Option<String>,
    /// Where the page starts: the `next_cursor` of the previous page.
    #[schemars(regex(pattern = r"^-?(1[0-9]{18}|[0-9]{1,18})\.[0-9a-f]{64}$"))]
    cursor: Option<String>,
}

/// A page of `GET /v1/separations`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct JobList {
    /// The jobs, newest first.
    pub jobs: Vec<Job>,
    /// The `cursor` of the next page; null on the last one.
    pub next_cursor: Option<String>,
    /// False while the ingress is still reading the status view at start (the list may
    /// miss jobs then).
    pub complete: bool,
}

/// `GET /v1/separations`.
async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    links: Links,
    Query(q): Query<ListQuery>,
) -> Result<Json<JobList>, ApiError> {
    let bad = |field: &str, message: String| ApiError {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        code: "invalid_request",
        message,
        field: Some(field.into()),
    };
    let status = match q.status.as_deref() {
        None => None,
        Some(s) => Some(JobStatus::parse(s).ok_or_else(|| bad("status", format!("unknown status `{s}`")))?),
    };
    let limit = match q.limit.as_deref() {
        None => 50,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| bad("limit", format!("`{l}` is not a number between 1 and 1000")))?,
    };
    let cursor = match q.cursor.as_deref() {
        None => None,
        Some(c) => Some(Cursor::decode(c).ok_or_else(|| bad("cursor", "malformed cursor".into()))?),
    };
    // An operator sees every owner's jobs; anyone else only their own.
    let owner = (!caller.role.allows(stemq_core::auth::Permission::Operate)).then_some(caller.owner.as_str());
    let page = state.index.page_of(owner, status, limit, cursor.as_ref());
    let views = futures::future::join_all(page.iter().map(|(id, _)| state.view_for(&caller, id))).await;
    let jobs: Vec<Job> = views.into_iter().filter_map(|v| v.ok().flatten()).map(|v| links.job(v)).collect();
    let next_cursor = (page.len() == limit)
        .then(|| page.last().map(|(id, ms)| Cursor { created_ns: *ms, id: id.clone() }.encode()))
        .flatten();
    Ok(Json(JobList { jobs, next_cursor, complete: state.index.caught_up() }))
}

/// `GET /healthz`.
async fn healthz() -> &'static str {
    "ok"
}

/// `GET /readyz`: 200 once this ingress can publish (NATS connected, the job stream
/// there), has read the worker registry, and what the process waits for besides
/// ([`Config::readiness`]) holds; else 503 naming what it waits for.
async fn ready(State(state): State<AppState>) -> Response {
    let connected = state.js.client().connection_state() == async_nats::connection::State::Connected;
    let mut waiting = Vec::new();
    if !(connected && names::ready(&state.js).await) {
        waiting.push("NATS (connected, with the job stream)");
    }
    if !state.registry.is_ready() {
        waiting.push("the worker registry read");
    }
    waiting.extend(state.readiness.pending());
    let (code, text) = stemq_core::readiness::probe_answer(&waiting);
    (StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE), text).into_response()
}

/// `/metrics`: OpenMetrics when the scraper asks for it, classic text 0.0.4 otherwise.
async fn metrics_text(State(state): State<AppState>, headers: axum::http::HeaderMap) -> Response {
    let accept = headers.get_all(axum::http::header::ACCEPT).iter().filter_map(|v| v.to_str().ok());
    let format = stemq_core::metrics::Format::negotiate(accept);
    let body = state.metrics.render(format, state.queue_metrics).await;
    ([(axum::http::header::CONTENT_TYPE, format.content_type())], body).into_response()
}
