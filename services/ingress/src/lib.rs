//! stemq-ingress: the front door. Validates requests, queues jobs, answers status.
//!
//! This crate owns the public API, over HTTP and over NATS request-reply
//! (`stemq.api.submit`, [`nats_api`]). It never does heavy work: a submit is one publish
//! ([`submit`]), a status read is one KV get. Every route is one entry of the route
//! table ([`api::routes`]), from which both the router and `/openapi.json` ([`openapi`])
//! are made; docs/api.md lists them.
//!
//! | modules | own |
//! |---|---|
//! | [`state`] | what every handler shares ([`AppState`]) |
//! | [`error`], [`rejection`] | the one error shape ([`ApiError`]), and the framework's refusals in it |
//! | [`access`], [`middleware`], [`metrics`] | around every route: API keys; the NATS gate; HTTP metrics |
//! | [`serve`], [`tls`], [`cors`] | the listener: slow clients cut off, HTTPS, browser origins |
//! | [`pipeline`], [`submit`], [`limits`], [`availability`] | a caller's submit: rate, validation, cap, publish |
//! | [`separations`], [`control`], [`events`], [`prefer`], [`links`] | the job routes |
//! | [`batches`], [`uploads`], [`stems`], [`webhooks`] | batches, audio in and out, webhooks |
//! | [`workers`], [`credits`], [`session`], [`web`], [`ops`] | fleet and models, credits, sign-in, the page, probes |
//! | [`mod@router`] | moves requests recorded without a route into their pools |
//!
//! What holds for every route: all but `/healthz`, `/readyz`, `/openapi.json` and `/asyncapi.json` need an
//! API key, and a job is its owner's alone ([`access`]); every error, the framework's
//! too, answers in the [`ErrorBody`] shape; every 503 carries `Retry-After`; a job that
//! exists is never a 404 ([`AppState::view`]). Why it is built so: docs/architecture.md,
//! "The ingress".

pub mod access;
pub mod api;
pub mod asyncapi;
pub mod availability;
pub mod batches;
pub mod control;
pub mod cors;
pub mod credits;
pub mod error;
pub mod error_code;
pub mod events;
pub mod leases;
pub mod limits;
pub mod links;
pub mod metrics;
pub mod middleware;
pub mod nats_api;
pub mod openapi;
pub mod ops;
pub mod pipeline;
pub mod prefer;
pub mod rejection;
pub mod router;
pub mod schemas;
pub mod separations;
pub mod serve;
pub mod session;
pub mod state;
pub mod stems;
pub mod submit;
pub mod tls;
pub mod uploads;
pub mod web;
pub mod webhooks;
pub mod workers;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::Router;
use stemq_core::netpolicy::HostPolicy;
use stemq_nats::error::JetStreamError;
use stemq_telemetry::readiness::Readiness;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use crate::error::{ApiError, ErrorBody, ErrorDetail};
pub use crate::error_code::ErrorCode;
pub use crate::state::{AppShared, AppState, UNSERVED_GRACE};

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
    /// [`stemq_nats::queue_figures::QueueFigures`].
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
        .fallback(rejection::no_route)
        .method_not_allowed_fallback(rejection::wrong_method)
        .layer(DefaultBodyLimit::max(rejection::BODY_LIMIT))
        .layer(from_fn_with_state(state.clone(), access::authenticate))
        .layer(from_fn_with_state(state.clone(), crate::middleware::nats_gate))
        // Before authentication: a body's time runs from its head, whoever sends it.
        .layer(from_fn_with_state(state.clone(), serve::limit_bodies))
        .layer(from_fn_with_state(state.clone(), crate::middleware::track))
        .with_state(state);
    // Outermost: a preflight is answered before authentication (it carries no key).
    let app = match cors {
        Some(cors) => app.layer(cors),
        None => app,
    };
    // Every request, a preflight too, keeps its connection from counting as idle.
    app.layer(from_fn(serve::hold_connection))
}
