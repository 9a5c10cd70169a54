//! `stemq dev`: the whole pipeline in one process, for a laptop.
//!
//! Starts a `nats-server` (from PATH) with its store in the data dir unless `NATS_URL`
//! is given, applies the definitions, and runs the ingress, one worker, the projector and
//! the webhook relay (printing where the admin API key of the owner `local` is,
//! `<data-dir>/admin.key`, created on first start, and where to read the owner's webhook
//! signing secret with it; never a secret itself, which a terminal or a log would keep)
//! until Ctrl-C or SIGTERM; then drains them and stops the server. Its `/readyz` answers
//! 200, and it prints its URL and sign-in link, only once every part serves: the
//! definitions applied, the worker's engine loaded and the worker announced with its
//! models, the projector and the relay consuming. The worker, the
//! projector and the relay run on a runtime of their own whose threads sit below the
//! API on the CPU (`--background-nice`, 10 by default): on one machine a backlog of
//! jobs takes what the API leaves.
//!
//! The ingress serves the page (`/`); `stemq dev` prints a one-time link to it that signs
//! the browser in with a session key of an operator of `local` (12 h, listed by `stemq
//! keys list`), so the page opens ready, with the operators' view. The link's token is
//! in its fragment and works once; after that, sign in with a key file
//! (`<data-dir>/operator.key` is an operator key of `local` for the command line).
//!
//! The server it starts runs with stemq's NATS users: their credentials are created once
//! in `<data-dir>/nats/creds/` (mode 0600 each), the definitions are applied as
//! `operator`, and every service connects as its own user (`ingress`, `worker`,
//! `projector`, `relay`), so the laptop stack has the permissions production has. The
//! client commands pick up `operator.nk` from the same data dir. With `NATS_URL` every
//! part connects as the global flags say (`--nats-creds`, `--nats-ca`, ...).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use stemq_devkit::nats_server::NatsServer;
use stemq_nats::users::{INGRESS, OPERATOR, PROJECTOR, RELAY, WORKER};
use stemq_nats::ConnectAuth;
use stemq_telemetry::readiness::Readiness;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::global::{shutdown_on_signals, Global, ServerSettings, StoreArg};
use crate::services::{
    AudioUrlArg, AuthArg, PublicArgs, RelayArgs, TlsArgs, WorkerOpts, PROJECTOR_READY, RELAY_READY, WORKER_READY,
};

/// `stemq dev`.
#[derive(Debug, Args, Clone)]
pub struct DevArgs {
    /// HTTP listen address.
    #[arg(long = "http", env = "STEMQ_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    #[command(flatten)]
    pub auth: AuthArg,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub public: PublicArgs,
    #[command(flatten)]
    pub worker: WorkerOpts,
    #[command(flatten)]
    pub audio_urls: AudioUrlArg,
    #[command(flatten)]
    pub relay: RelayArgs,
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub server: ServerSettings,
    /// How far below the API the stack's worker, projector and webhook relay run on the
    /// CPU (a nice increment, 0–19; 0: one priority for all). On one machine the jobs
    /// then take the CPU the API leaves, and a backlog does not slow the answers to
    /// callers (a status read that finds the view behind reads the job's log).
    #[arg(long, env = "STEMQ_DEV_BACKGROUND_NICE", default_value_t = 10, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub background_nice: i32,
}

/// The tokio runtime of the stack's background parts (worker, projector, relay): its
/// threads, blocking ones included (and so the engine hosts they start), run `nice`
/// steps below the API's, and the parts' NATS connections are made on it, so their
/// connection tasks are niced too. Shut down in the background when dropped (a runtime
/// cannot be dropped inside another's task).
struct Background(Option<tokio::runtime::Runtime>);

impl Background {
    fn new(nice: i32) -> std::io::Result<Background> {
        // Relative to the caller's (the API's) priority, set absolutely on each thread:
        // a thread started by an already lowered one (a blocking thread) gets the same.
        let target = priority().map(|p| (p + nice).min(19));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .thread_name("stemq-dev-bg")
            .enable_all()
            .on_thread_start(move || {
                if let Some(p) = target.filter(|_| nice > 0) {
                    set_priority(p)
                }
            })
            .build()?;
        Ok(Background(Some(rt)))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("held until dropped").handle()
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The calling thread's nice value (Linux keeps one per thread).
#[cfg(target_os = "linux")]
fn priority() -> Option<i32> {
    // SAFETY: a plain system call about the calling thread (`who` 0).
    Some(unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) })
}

/// Sets the calling thread's nice value. Best effort: where it cannot, the thread keeps
/// its priority.
#[cfg(target_os = "linux")]
fn set_priority(nice: i32) {
    // SAFETY: a plain system call on the calling thread (`who` 0), no memory passed.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, nice);
    }
}

/// Elsewhere the worker keeps the stack's priority.
#[cfg(not(target_os = "linux"))]
fn priority() -> Option<i32> {
    None
}

#[cfg(not(target_os = "linux"))]
fn set_priority(_: i32) {}

/// Runs the stack until Ctrl-C or SIGTERM.
pub async fn run(g: &Global, a: DevArgs) -> Result<()> {
    a.worker.check()?;
    let mut g = g.clone();
    let mut server = None;
    if g.nats_url.is_none() {
        let store = g.data_dir.join("nats");
        // The usual port when free, any port otherwise (also when another server took
        // it between the look and the start).
        let s = tokio::task::spawn_blocking(move || match NatsServer::start(&store, 4222) {
            Ok(s) => Ok(s),
            Err(e) => {
                tracing::debug!(error = %e, "no nats-server on port 4222; trying any port");
                NatsServer::start(&store, 0)
            }
        })
        .await??;
        info!(url = %s.url(), "nats-server started");
        g.nats_url = Some(s.url());
        server = Some(s);
    }
    // Each part as its own user on our server; as the flags say on another one.
    let auth = |user: &str| -> Result<ConnectAuth> {
        match &server {
            Some(s) => Ok(s.connect_auth(user)?),
            None => g.nats_auth(),
        }
    };
    let url = g.nats_url();
    let client = match &server {
        Some(_) => {
            let c = stemq_nats::connect_with(&url, "stemq-dev", &auth(OPERATOR)?).await?;
            stemq_nats::ensure(&async_nats::jetstream::new(c.clone()), &a.server.settings()).await?;
            c
        }
        None => crate::services::connect(&g, &a.server, "stemq-dev").await?,
    };
    let connect = |name: &'static str, user: &'static str| {
        let (url, auth) = (url.clone(), auth(user));
        async move { anyhow::Ok(stemq_nats::connect_with(&url, name, &auth?).await?) }
    };
    let ingress_client = connect("stemq-ingress", INGRESS).await?;
    // The worker, the projector and the relay on a runtime of their own, below the API
    // (`--background-nice`).
    let bg = Background::new(a.background_nice)?;
    let projector_client = bg.handle().spawn(connect("stemq-projector", PROJECTOR)).await??;
    let worker_client = bg.handle().spawn(connect("stemq-worker", WORKER)).await??;
    let relay_client = bg.handle().spawn(connect("stemq-relay", RELAY)).await??;
    std::fs::create_dir_all(&g.data_dir)?;
    let _ = std::fs::remove_file(g.data_dir.join("nats.url"));
    let shutdown = shutdown_on_signals();

    let listener = stemq_ingress::bind(a.http).await.with_context(|| format!("is something else on {}?", a.http))?;
    let addr = listener.local_addr()?;
    let mut wconfig = crate::services::worker_config(&g, &a.store, &a.worker)?;
    wconfig.audio_urls = a.audio_urls.worker();
    let scheme = if a.tls.config().is_some() { "https" } else { "http" };
    let store = wconfig.store.base_url().to_string();

    // The page's one-time sign-in link mints a session key of an operator of `local`
    // (with keys on), through this process's operator connection: the ingress's own
    // NATS user cannot create keys.
    let keys = crate::keys::bucket(client.clone()).await?;
    let (signin, signin_token) = if a.auth.insecure_no_auth {
        (None, None)
    } else {
        crate::keys::ensure_operator_key(&keys, &g.data_dir).await?;
        let grant = stemq_ingress::session::SessionGrant {
            owner: stemq_ingress::access::LOCAL_OWNER.into(),
            role: stemq_accounts::auth::Role::Operator,
            limits: crate::keys::LOCAL_LIMITS,
            lifetime: stemq_accounts::auth::SESSION_LIFETIME,
        };
        let (link, token) = stemq_ingress::session::SigninLink::new(keys.clone(), grant);
        (Some(std::sync::Arc::new(link)), Some(token))
    };
    let key_path = crate::keys::ensure_admin_key(&keys, &g.data_dir).await?;

    // Ready means every part serves: `/readyz` answers 503 naming the parts still
    // starting (the worker is ready once its engine is loaded and it announced itself
    // with its models), and this stack says it is up only then.
    let readiness = Readiness::new();
    wconfig.ready = Some(readiness.require(WORKER_READY));
    let projector_config =
        stemq_projector::Config { ready: Some(readiness.require(PROJECTOR_READY)), ..Default::default() };
    let relay_config = stemq_relay::Config { ready: Some(readiness.require(RELAY_READY)), ..a.relay.config() };

    let children = CancellationToken::new();
    let mut ingress = tokio::spawn(stemq_ingress::run(
        ingress_client.clone(),
        listener,
        stemq_ingress::Config {
            listen: addr,
            nats_submit: true,
            storage: Some(stemq_ingress::uploads::StorageConfig::new(wconfig.store.clone())),
            auth: !a.auth.insecure_no_auth,
            tls: a.tls.config(),
            audio_urls: a.audio_urls.policy(),
            // One process: it is the queue exporter.
            queue_metrics: true,
            // Its one worker is all there is: a model it does not serve would wait for
            // ever, so it is refused at submit with what to do instead.
            refuse_unserved: true,
            signin,
            public_url: a.public.public_url.clone(),
            cors_origins: a.public.cors_origins.clone(),
            readiness: readiness.clone(),
            http_timeouts: a.public.http_timeouts(),
        },
        children.clone(),
    ));
    let mut projector =
        bg.handle().spawn(stemq_projector::run(projector_client.clone(), projector_config, children.clone()));
    let mut relay = bg.handle().spawn(stemq_relay::run(relay_client.clone(), relay_config, children.clone()));
    // The engine loads below the API too (its hosts inherit the priority), while the
    // probes already answer.
    let engine = {
        let (g, opts) = (g.clone(), a.worker.clone());
        bg.handle().spawn_blocking(move || crate::services::engine(&g, &opts)).await??
    };
    let models: Vec<&str> = engine.models().iter().map(|m| m.as_str()).collect();
    let models = models.join(", ");
    let mut worker = bg.handle().spawn(stemq_worker::run(worker_client.clone(), engine, wconfig, shutdown.clone()));
    // Up when every part is; a part that stops while starting is the error to report.
    while !readiness.wait(Duration::from_millis(100)).await {
        if shutdown.is_cancelled() {
            break;
        }
        if ingress.is_finished() {
            (&mut ingress).await??;
            bail!("the ingress stopped while starting");
        }
        if projector.is_finished() {
            (&mut projector).await??;
            bail!("the projector stopped while starting");
        }
        if relay.is_finished() {
            (&mut relay).await??;
            bail!("the webhook relay stopped while starting");
        }
        if worker.is_finished() {
            (&mut worker).await??;
            bail!("the worker stopped while starting");
        }
    }
    let js = async_nats::jetstream::new(client.clone());
    let secrets = js.get_key_value(stemq_nats::WEBHOOKS_BUCKET).await?;
    let local = stemq_ingress::access::LOCAL_OWNER;
    // The owner's webhook settings (and signing secret) exist before the first job.
    stemq_webhook::owner_webhooks(&secrets, local).await?;
    // For scripts and other terminals: where this stack's NATS is, written once the
    // stack is up.
    std::fs::write(g.data_dir.join("nats.url"), g.nats_url())?;

    eprintln!();
    eprintln!("stemq dev is up");
    match &signin_token {
        Some(token) => eprintln!("  page    {scheme}://{addr}/#signin={token}   (signs this browser in once)"),
        None => eprintln!("  page    {scheme}://{addr}/"),
    }
    eprintln!("  HTTP    {scheme}://{addr}   (POST /v1/separations, GET /v1/separations/{{id}}, /openapi.json)");
    if let Some(u) = &a.public.public_url {
        eprintln!("  links   {u}   (--public-url)");
    }
    if !a.public.cors_origins.is_empty() {
        let origins: Vec<String> = a.public.cors_origins.iter().map(|o| o.to_string()).collect();
        eprintln!("  CORS    {}   (--cors-origin)", origins.join(", "));
    }
    eprintln!("  NATS    {}", g.nats_url());
    if let Some(s) = &server {
        eprintln!(
            "  users   {}   (one credentials file per user; the CLI uses operator.nk)",
            s.credentials(OPERATOR).parent().map(|p| p.display().to_string()).unwrap_or_default()
        );
    }
    eprintln!("  store   {store}");
    eprintln!(
        "  models  {models}   (more: put weights into {} and restart)",
        a.worker.engine.models.clone().unwrap_or_else(|| g.data_dir.join("models")).display()
    );
    eprintln!("  webhook secret  GET {scheme}://{addr}/v1/webhooks/secret with the API key below");
    if a.auth.insecure_no_auth {
        eprintln!("  API keys        OFF (--insecure-no-auth): every caller is an operator of `{local}`");
    } else {
        eprintln!(
            "  API key         {} (admin of owner `{local}`; send `Authorization: Bearer $(cat {})`; \
             the stemq client commands read it)",
            key_path.display(),
            key_path.display()
        );
    }
    eprintln!("  Ctrl-C to stop");
    eprintln!();

    shutdown.cancelled().await;
    // Workers first (they finish their jobs), then the rest once the outcomes are in.
    worker.await??;
    children.cancel();
    ingress.await??;
    projector.await??;
    relay.await??;
    for c in [client, ingress_client, projector_client, worker_client, relay_client] {
        c.flush().await.ok();
    }
    if let Some(mut s) = server {
        tokio::task::spawn_blocking(move || s.stop()).await?;
    }
    eprintln!("stemq dev stopped");
    Ok(())
}
