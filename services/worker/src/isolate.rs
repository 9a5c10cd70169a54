//! Process isolation: each job loop's attempts run in an engine process of their own.
//!
//! This module owns the boundary that keeps a bad job from costing its neighbours. A
//! worker with `concurrency` N runs its jobs side by side; if one of them aborts, faults
//! or is killed for memory inside the worker process, every job beside it dies too and
//! loses a delivery. [`IsolatedEngine`] is an [`Engine`] that runs each attempt in a
//! long-lived child process ("engine host") instead: one host per job loop in use, each
//! keeping its own loaded model, each running one job at a time. When a host dies, only
//! the job it was running fails, with [`EngineError::Crashed`] naming how it died (signal
//! or exit status): the culprit is known exactly, it is retried and dead-lettered on its
//! own, and its neighbours never notice. The next job on that loop starts a fresh host.
//!
//! The host is the same executable started with a hidden subcommand (`stemq
//! engine-host …`) that builds the same engine and calls [`serve`]. They speak JSON
//! lines: the worker sends `job` and `cancel`; the host answers `hello` once (name,
//! devices), then `progress` and one `done` per job. The host's stdout is reserved for
//! the protocol (anything an engine prints goes to stderr, with its logs); a host whose
//! stdin closes exits at once, so hosts never outlive their worker, even after kill -9.
//!
//! Cancellation and the hard time limit reach a host as `cancel`; a host that has not
//! stopped `KILL_GRACE` (5 s) later is killed, so an attempt never outlives its limit and the
//! scratch folder is never written after the worker gave up on it.
//!
//! Cost: one process start and engine load per job loop (once, not per job), about 1 ms
//! and three small pipe messages per job (see `docs/reliability.md`).
//!
//! [`IsolatedEngine::start_shared`] (`--isolation shared`) runs every job loop's
//! attempts in one host instead, at the same time, so that the engine can share work
//! between jobs (the demucs engine's cross-job batching). Messages then carry the
//! attempt's `slot`; the host runs each attempt on a thread of its own, and a router
//! thread on the worker's side hands each attempt its messages. The price is the
//! blast radius: when the shared host dies, every attempt running in it fails as
//! crashed (each retried), and a cancelled attempt that does not stop in time takes
//! the host down with it. The worker process itself is never at stake.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use stemq_core::device::Device;
use stemq_core::engine::{Death, Engine, EngineContext, EngineError, EngineJob, StemFile};
use stemq_core::request::{JobId, Model, NormalizedRequest};
use tracing::{info, warn};

/// Failures starting the first engine host.
#[derive(Debug, thiserror::Error)]
pub enum IsolateError {
    /// The host process could not be started.
    #[error("cannot start the engine host {program}: {source}")]
    Spawn {
        /// The executable.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The host exited or went silent before saying hello (its stderr says why).
    #[error("the engine host did not start: {0}")]
    NoHello(String),
}

/// What the worker sends a host, one JSON object per line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ToHost {
    /// Run one attempt.
    Job(Box<WireJob>),
    /// Stop the attempt in `slot` at its next chunk boundary.
    Cancel {
        /// The attempt's slot (0 for a host of one job loop).
        #[serde(default, skip_serializing_if = "is_zero")]
        slot: u32,
    },
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// [`EngineJob`] with owned fields.
#[derive(Debug, Serialize, Deserialize)]
struct WireJob {
    /// Names the attempt in the messages about it: a shared host runs several at once.
    #[serde(default, skip_serializing_if = "is_zero")]
    slot: u32,
    job_id: JobId,
    request: NormalizedRequest,
    metadata: Option<Value>,
    attempt: u32,
    input: PathBuf,
    out_dir: PathBuf,
    device: Device,
    segment: Option<f64>,
}

/// What a host sends the worker, one JSON object per line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum FromHost {
    /// Once, when the engine is loaded.
    Hello(Hello),
    /// Progress of the attempt in `slot`.
    Progress {
        #[serde(default, skip_serializing_if = "is_zero")]
        slot: u32,
        fraction: f32,
        stage: String,
    },
    /// The result of the attempt in `slot`.
    Done {
        #[serde(default, skip_serializing_if = "is_zero")]
        slot: u32,
        result: Result<Vec<StemFile>, EngineError>,
    },
}

/// What a host says of its engine once it is loaded.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    name: String,
    devices: Vec<Device>,
    reads_input: bool,
    /// The engine's [`Engine::wants_metadata`]; absent (false) from a host built before
    /// it existed.
    #[serde(default)]
    wants_metadata: bool,
    /// The engine's [`Engine::models`].
    #[serde(default)]
    models: Vec<Model>,
}

/// A line read from a host, or the end of its output.
enum Line {
    Msg(FromHost),
    Eof,
}

/// One running engine host.
struct Host {
    child: Mutex<Child>,
    stdin: ChildStdin,
    lines: mpsc::Receiver<Line>,
}

/// Starts `program args…` with the protocol's pipes, and a thread that turns its
/// output into [`Line`]s.
fn spawn_parts(program: &Path, args: &[OsString]) -> std::io::Result<(Child, ChildStdin, mpsc::Receiver<Line>)> {
    {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new().name("engine-host-reader".into()).spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<FromHost>(&line) {
                    Ok(m) => {
                        if tx.send(Line::Msg(m)).is_err() {
                            return;
                        }
                    }
                    Err(e) => warn!(error = %e, line = %line.chars().take(200).collect::<String>(), "engine host said something unreadable"),
                }
            }
            let _ = tx.send(Line::Eof);
        })?;
        Ok((child, stdin, lines))
    }
}

/// Waits up to `timeout` for a host's hello (its engine loaded): `Err(None)` when its
/// output ended first (its death says why), `Err(Some(why))` otherwise.
fn await_hello(lines: &mpsc::Receiver<Line>, timeout: Duration) -> Result<Hello, Option<String>> {
    match lines.recv_timeout(timeout) {
        Ok(Line::Msg(FromHost::Hello(hello))) => Ok(hello),
        Ok(Line::Msg(other)) => Err(Some(format!("it said {other:?} first"))),
        Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => Err(None),
        Err(RecvTimeoutError::Timeout) => Err(Some(format!("no hello within {} s", timeout.as_secs()))),
    }
}

fn write_message(to: &mut ChildStdin, m: &ToHost) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(m).expect("protocol messages serialise");
    line.push(b'\n');
    to.write_all(&line)?;
    to.flush()
}

/// Waits for a host to end (after its output ended) and says how it ended. The lock is
/// taken per look, so the host can be killed meanwhile.
fn wait_death(child: &Mutex<Child>) -> Death {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut child = lock(child);
        match child.try_wait() {
            Ok(Some(status)) => return describe(status),
            Ok(None) if Instant::now() < deadline => {
                drop(child);
                std::thread::sleep(Duration::from_millis(10));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Death::Silenced;
            }
        }
    }
}

impl Host {
    fn spawn(program: &Path, args: &[OsString]) -> std::io::Result<Host> {
        let (child, stdin, lines) = spawn_parts(program, args)?;
        Ok(Host { child: Mutex::new(child), stdin, lines })
    }

    /// Waits up to `timeout` for the host's hello (its engine loaded); says why not.
    fn hello(self, timeout: Duration) -> Result<(Host, Hello), String> {
        match await_hello(&self.lines, timeout) {
            Ok(hello) => Ok((self, hello)),
            Err(None) => Err(self.death().to_string()),
            Err(Some(why)) => Err(why),
        }
    }

    fn send(&mut self, m: &ToHost) -> std::io::Result<()> {
        write_message(&mut self.stdin, m)
    }

    /// Waits for the host to end (after its output ended) and says how it ended.
    fn death(self) -> Death {
        wait_death(&self.child)
    }
}

/// One engine host running the attempts of every job loop at once
/// ([`IsolatedEngine::start_shared`]), so that an engine can share work between jobs
/// (the demucs engine's cross-job batching). A thread routes its messages to the
/// attempts by slot; when the host dies, every attempt in it learns how.
struct SharedHost {
    stdin: Mutex<ChildStdin>,
    /// Shared with the router, which reaps it once its output ends.
    child: Arc<Mutex<Child>>,
    routing: Arc<Routing>,
}

/// Where a shared host's messages go.
#[derive(Default)]
struct Routing {
    /// The running attempts' inboxes by slot.
    routes: Mutex<HashMap<u32, mpsc::Sender<Line>>>,
    /// How the host ended, once its output has.
    death: Mutex<Option<Death>>,
    next_slot: AtomicU32,
}

impl SharedHost {
    /// Starts a host and waits up to `timeout` for its hello.
    fn start(program: &Path, args: &[OsString], timeout: Duration) -> Result<(Arc<SharedHost>, Hello), String> {
        let (child, stdin, lines) = spawn_parts(program, args).map_err(|e| format!("cannot start it: {e}"))?;
        let child = Arc::new(Mutex::new(child));
        let hello = match await_hello(&lines, timeout) {
            Ok(hello) => hello,
            Err(why) => {
                let _ = lock(&child).kill();
                let how = wait_death(&child);
                return Err(why.unwrap_or_else(|| how.to_string()));
            }
        };
        let routing = Arc::new(Routing { next_slot: AtomicU32::new(1), ..Routing::default() });
        let host = Arc::new(SharedHost { stdin: Mutex::new(stdin), child: child.clone(), routing: routing.clone() });
        std::thread::Builder::new()
            .name("engine-host-router".into())
            .spawn(move || {
                while let Ok(Line::Msg(m)) = lines.recv() {
                    let slot = match &m {
                        FromHost::Progress { slot, .. } | FromHost::Done { slot, .. } => *slot,
                        FromHost::Hello(_) => continue,
                    };
                    if let Some(tx) = lock(&routing.routes).get(&slot) {
                        let _ = tx.send(Line::Msg(m));
                    }
                }
                let how = wait_death(&child);
                *lock(&routing.death) = Some(how);
                for (_, tx) in lock(&routing.routes).drain() {
                    let _ = tx.send(Line::Eof);
                }
            })
            .map_err(|e| format!("cannot start its router: {e}"))?;
        Ok((host, hello))
    }

    /// How it ended, if it has.
    fn death(&self) -> Option<Death> {
        lock(&self.routing.death).clone()
    }

    /// A new slot and its inbox; `None` when the host has died.
    fn open(&self) -> Option<(u32, mpsc::Receiver<Line>)> {
        let mut routes = lock(&self.routing.routes);
        if self.death().is_some() {
            return None;
        }
        let slot = self.routing.next_slot.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        routes.insert(slot, tx);
        Some((slot, rx))
    }

    fn close(&self, slot: u32) {
        lock(&self.routing.routes).remove(&slot);
    }

    fn send(&self, m: &ToHost) -> std::io::Result<()> {
        write_message(&mut lock(&self.stdin), m)
    }

    /// Kills the host (every attempt in it ends as crashed, this one as cancelled); a
    /// host already reaped is left alone.
    fn kill(&self) {
        let _ = lock(&self.child).kill();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Host {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Ok(None) = child.try_wait() {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

/// How a host process ended, from its exit status.
fn describe(status: ExitStatus) -> Death {
    match (status.code(), status.signal()) {
        (_, Some(sig)) => Death::Signal(sig),
        (Some(code), None) => Death::Exited(code),
        (None, None) => Death::Ended,
    }
}

/// An engine whose attempts run in child processes (see the module docs).
pub struct IsolatedEngine {
    program: PathBuf,
    args: Vec<OsString>,
    name: String,
    devices: Vec<Device>,
    reads_input: bool,
    /// The host engine's [`Engine::wants_metadata`], from its hello.
    wants_metadata: bool,
    /// The host engine's [`Engine::models`], from its hello.
    models: Vec<Model>,
    /// Hosts waiting for a job.
    idle: Mutex<Vec<Host>>,
    /// With [`IsolatedEngine::start_shared`]: the one host of every job loop (`None`
    /// inside once it died, until the next attempt starts another).
    shared: Option<Mutex<Option<Arc<SharedHost>>>>,
    /// An in-process engine that tells how long inputs last without reading them
    /// ([`Engine::audio_ms`]; the fake engine), when the hosted one needs that.
    lengths: Option<std::sync::Arc<dyn Engine>>,
}

/// How long a cancelled attempt may take to stop before its host is killed.
const KILL_GRACE: Duration = Duration::from_secs(5);

/// How long a host started for a job loop may take to load its engine.
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);

impl IsolatedEngine {
    /// Starts the first host (`program args…`, which must call [`serve`]) and waits up to
    /// `startup` for it to load its engine.
    pub fn start(program: PathBuf, args: Vec<OsString>, startup: Duration) -> Result<IsolatedEngine, IsolateError> {
        let host =
            Host::spawn(&program, &args).map_err(|source| IsolateError::Spawn { program: program.clone(), source })?;
        let (host, Hello { name, devices, reads_input, wants_metadata, models }) =
            host.hello(startup).map_err(IsolateError::NoHello)?;
        info!(engine = %name, pid = lock(&host.child).id(), ?models, "engine host ready");
        let hello = Hello { name, devices, reads_input, wants_metadata, models };
        Ok(IsolatedEngine::with_hosts(program, args, hello, vec![host], None))
    }

    fn with_hosts(
        program: PathBuf,
        args: Vec<OsString>,
        hello: Hello,
        idle: Vec<Host>,
        shared: Option<Arc<SharedHost>>,
    ) -> IsolatedEngine {
        let Hello { name, devices, reads_input, wants_metadata, models } = hello;
        IsolatedEngine {
            program,
            args,
            name,
            devices,
            reads_input,
            wants_metadata,
            models,
            idle: Mutex::new(idle),
            shared: shared.map(|h| Mutex::new(Some(h))),
            lengths: None,
        }
    }

    /// Like [`IsolatedEngine::start`], but every job loop's attempts run in one host,
    /// at the same time: the engine can share work between them (the demucs engine's
    /// cross-job batching). The price: when that host dies, every attempt running in it
    /// fails as crashed (each is retried), not only the culprit's.
    pub fn start_shared(
        program: PathBuf,
        args: Vec<OsString>,
        startup: Duration,
    ) -> Result<IsolatedEngine, IsolateError> {
        let (host, hello) = SharedHost::start(&program, &args, startup).map_err(IsolateError::NoHello)?;
        info!(engine = %hello.name, pid = lock(&host.child).id(), models = ?hello.models, "shared engine host ready");
        Ok(IsolatedEngine::with_hosts(program, args, hello, Vec::new(), Some(host)))
    }

    /// The shared host, or a new one when it died.
    fn shared_host(&self, slot: &Mutex<Option<Arc<SharedHost>>>) -> Result<Arc<SharedHost>, EngineError> {
        let mut current = lock(slot);
        if let Some(h) = current.as_ref().filter(|h| h.death().is_none()) {
            return Ok(h.clone());
        }
        *current = None;
        let (host, _) = SharedHost::start(&self.program, &self.args, LOAD_TIMEOUT)
            .map_err(|why| EngineError::transient_without_source(format!("a new shared engine host: {why}")))?;
        info!(pid = lock(&host.child).id(), "shared engine host started");
        *current = Some(host.clone());
        Ok(host)
    }

    /// One attempt in the shared host (see [`IsolatedEngine::start_shared`]).
    fn separate_shared(
        &self,
        slot: &Mutex<Option<Arc<SharedHost>>>,
        mut wire: WireJob,
        job: &EngineJob<'_>,
        ctx: &dyn EngineContext,
    ) -> Result<Vec<StemFile>, EngineError> {
        let mut host = self.shared_host(slot)?;
        let (n, inbox) = match host.open() {
            Some(opened) => opened,
            None => {
                // It died since the look above: once more, with a new one.
                host = self.shared_host(slot)?;
                host.open()
                    .ok_or_else(|| EngineError::transient_without_source("the shared engine host died at once"))?
            }
        };
        struct Close<'a>(&'a SharedHost, u32);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                self.0.close(self.1);
            }
        }
        let _close = Close(&host, n);
        wire.slot = n;
        // A failed write means the host is dying: its end reaches the inbox.
        let _ = host.send(&ToHost::Job(Box::new(wire)));
        match follow(&inbox, ctx, || {
            let _ = host.send(&ToHost::Cancel { slot: n });
        }) {
            Ended::Done(result) => result,
            Ended::Died { cancelled: true } => Err(EngineError::Cancelled),
            Ended::Died { cancelled: false } => {
                let how = host.death().unwrap_or(Death::Ended);
                warn!(job_id = %job.job_id, attempt = job.attempt, %how, "the shared engine host died while running this job");
                Err(EngineError::Crashed(how))
            }
            Ended::Overdue => {
                warn!(job_id = %job.job_id, grace_s = KILL_GRACE.as_secs_f64(),
                    "the engine did not stop when asked; killing the shared host (its other jobs are retried)");
                host.kill();
                Err(EngineError::Cancelled)
            }
        }
    }

    /// Asks `engine` (in this process) how long inputs last ([`Engine::audio_ms`]): for
    /// a hosted engine that knows without reading the input (the fake engine).
    pub fn with_lengths(mut self, engine: std::sync::Arc<dyn Engine>) -> IsolatedEngine {
        self.lengths = Some(engine);
        self
    }

    /// An idle host, or a new one (whose hello is awaited).
    fn checkout(&self) -> Result<Host, EngineError> {
        if let Some(h) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(h);
        }
        let host = Host::spawn(&self.program, &self.args)
            .map_err(|e| EngineError::transient("cannot start an engine host", e))?;
        let (host, _) = host
            .hello(LOAD_TIMEOUT)
            .map_err(|why| EngineError::transient_without_source(format!("a new engine host: {why}")))?;
        Ok(host)
    }
}

impl Engine for IsolatedEngine {
    fn name(&self) -> &str {
        &self.name
    }

    fn devices(&self) -> Vec<Device> {
        self.devices.clone()
    }

    fn reads_input(&self) -> bool {
        self.reads_input
    }

    fn wants_metadata(&self) -> bool {
        self.wants_metadata
    }

    fn models(&self) -> Vec<Model> {
        self.models.clone()
    }

    fn audio_ms(&self, request: &stemq_core::NormalizedRequest, metadata: Option<&serde_json::Value>) -> Option<u64> {
        self.lengths.as_ref()?.audio_ms(request, metadata)
    }

    fn separate(&self, job: &EngineJob<'_>, ctx: &dyn EngineContext) -> Result<Vec<StemFile>, EngineError> {
        let wire = WireJob {
            slot: 0,
            job_id: job.job_id.clone(),
            request: job.request.clone(),
            metadata: job.metadata.cloned(),
            attempt: job.attempt,
            input: job.input.to_path_buf(),
            out_dir: job.out_dir.to_path_buf(),
            device: job.device.clone(),
            segment: job.segment,
        };
        if let Some(slot) = &self.shared {
            return self.separate_shared(slot, wire, job, ctx);
        }
        let wire = ToHost::Job(Box::new(wire));
        let mut host = self.checkout()?;
        if host.send(&wire).is_err() {
            // The idle host died since its last job (nothing of this job ran): use a new one.
            drop(host);
            host = self.checkout()?;
            host.send(&wire).map_err(|e| EngineError::transient("cannot reach the engine host", e))?;
        }
        let ended = follow(&host.lines, ctx, || {
            let _ = write_message(&mut host.stdin, &ToHost::Cancel { slot: 0 });
        });
        match ended {
            Ended::Done(result) => {
                if !matches!(result, Err(EngineError::Crashed(_))) {
                    self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(host);
                }
                result
            }
            Ended::Died { cancelled: true } => Err(EngineError::Cancelled),
            Ended::Died { cancelled: false } => {
                let how = host.death();
                warn!(job_id = %job.job_id, attempt = job.attempt, %how, "the engine host died while running this job");
                Err(EngineError::Crashed(how))
            }
            Ended::Overdue => {
                warn!(job_id = %job.job_id, grace_s = KILL_GRACE.as_secs_f64(),
                    "the engine did not stop when asked; killing its host");
                drop(host);
                Err(EngineError::Cancelled)
            }
        }
    }
}

/// How an attempt's messages ended ([`follow`]).
enum Ended {
    /// The host's result.
    Done(Result<Vec<StemFile>, EngineError>),
    /// The host's output ended first; `cancelled` when the attempt had been cancelled.
    Died { cancelled: bool },
    /// Cancelled, and not stopped `KILL_GRACE` later: its host is to be killed.
    Overdue,
}

/// Follows one attempt's messages from `inbox` until it ends: progress goes to `ctx`;
/// when `ctx` is cancelled, `cancel` tells the host, once.
fn follow(inbox: &mpsc::Receiver<Line>, ctx: &dyn EngineContext, mut cancel: impl FnMut()) -> Ended {
    let mut cancel_sent: Option<Instant> = None;
    loop {
        match inbox.recv_timeout(Duration::from_millis(50)) {
            Ok(Line::Msg(FromHost::Progress { fraction, stage, .. })) => ctx.progress(fraction, &stage),
            Ok(Line::Msg(FromHost::Done { result, .. })) => return Ended::Done(result),
            Ok(Line::Msg(FromHost::Hello(_))) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => {
                return Ended::Died { cancelled: cancel_sent.is_some() };
            }
        }
        if ctx.cancelled() {
            match cancel_sent {
                None => {
                    cancel();
                    cancel_sent = Some(Instant::now());
                }
                Some(t) if t.elapsed() > KILL_GRACE => return Ended::Overdue,
                Some(_) => {}
            }
        }
    }
}

/// The host side: serves `engine` over stdin/stdout until stdin closes. Call it from the
/// hidden subcommand that [`IsolatedEngine::start`] runs, after logging is set up on
/// stderr. Never returns normally: the process exits when the worker goes away.
pub fn serve(engine: Arc<dyn Engine>) -> std::io::Result<()> {
    let out = Arc::new(Mutex::new(protocol_stdout()?));
    let send = {
        let out = out.clone();
        move |m: &FromHost| -> std::io::Result<()> {
            let mut line = serde_json::to_vec(m).expect("protocol messages serialise");
            line.push(b'\n');
            let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
            o.write_all(&line)?;
            o.flush()
        }
    };
    send(&FromHost::Hello(Hello {
        name: engine.name().to_string(),
        devices: engine.devices(),
        reads_input: engine.reads_input(),
        wants_metadata: engine.wants_metadata(),
        models: engine.models(),
    }))?;
    // Each attempt's cancel flag, by slot.
    let cancels: Arc<Mutex<HashMap<u32, Arc<AtomicBool>>>> = Arc::default();
    let (jobs_tx, jobs) = mpsc::channel::<(WireJob, Arc<AtomicBool>)>();
    {
        let cancels = cancels.clone();
        std::thread::Builder::new().name("engine-host-stdin".into()).spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<ToHost>(&line) {
                    Ok(ToHost::Job(j)) => {
                        let flag = Arc::new(AtomicBool::new(false));
                        lock(&cancels).insert(j.slot, flag.clone());
                        let _ = jobs_tx.send((*j, flag));
                    }
                    Ok(ToHost::Cancel { slot }) => {
                        if let Some(flag) = lock(&cancels).get(&slot) {
                            flag.store(true, Ordering::SeqCst);
                        }
                    }
                    Err(e) => eprintln!("engine host: unreadable message from the worker: {e}"),
                }
            }
            // The worker is gone (or closed us): nothing to finish for anyone.
            std::process::exit(0);
        })?;
    }
    struct HostCtx<'a, F: Fn(&FromHost) -> std::io::Result<()>> {
        send: &'a F,
        slot: u32,
        cancel: &'a AtomicBool,
        last: Mutex<(f32, String, Option<Instant>)>,
    }
    impl<F: Fn(&FromHost) -> std::io::Result<()> + Sync> EngineContext for HostCtx<'_, F> {
        fn progress(&self, fraction: f32, stage: &str) {
            // The worker rate-limits what it publishes; here only pipe chatter is saved.
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            let due = last.2.is_none_or(|t| t.elapsed() >= Duration::from_millis(20));
            if !(due || last.1 != stage || (fraction >= 1.0 && last.0 < 1.0)) {
                return;
            }
            *last = (fraction, stage.to_string(), Some(Instant::now()));
            let _ = (self.send)(&FromHost::Progress { slot: self.slot, fraction, stage: stage.to_string() });
        }
        fn cancelled(&self) -> bool {
            self.cancel.load(Ordering::Relaxed)
        }
    }
    // Each attempt on a thread of its own: a host of one job loop gets one at a time, a
    // shared host one per job loop, at once.
    std::thread::scope(|scope| {
        while let Ok((j, cancel)) = jobs.recv() {
            let (send, engine, cancels) = (&send, &engine, &cancels);
            scope.spawn(move || {
                let ctx =
                    HostCtx { send, slot: j.slot, cancel: &cancel, last: Mutex::new((-1.0, String::new(), None)) };
                let job = EngineJob {
                    job_id: &j.job_id,
                    request: &j.request,
                    metadata: stemq_core::engine::metadata_for(engine.as_ref(), j.metadata.as_ref()),
                    attempt: j.attempt,
                    input: &j.input,
                    out_dir: &j.out_dir,
                    device: &j.device,
                    segment: j.segment,
                };
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.separate(&job, &ctx)));
                {
                    let mut cancels = lock(cancels);
                    if cancels.get(&j.slot).is_some_and(|f| Arc::ptr_eq(f, &cancel)) {
                        cancels.remove(&j.slot);
                    }
                }
                match result {
                    Ok(result) => {
                        if send(&FromHost::Done { slot: j.slot, result }).is_err() {
                            // The worker is gone.
                            std::process::exit(0);
                        }
                    }
                    Err(panic) => {
                        let what =
                            stemq_core::engine::panic_message(panic.as_ref()).unwrap_or_else(|| "a panic".into());
                        // State inside the engine may be poisoned: report, then make way
                        // for a fresh host.
                        let crashed = EngineError::Crashed(Death::Panicked(what));
                        let _ = send(&FromHost::Done { slot: j.slot, result: Err(crashed) });
                        std::process::exit(101);
                    }
                }
            });
        }
    });
    Ok(())
}

/// The protocol's own copy of stdout; fd 1 itself is pointed at stderr, so whatever an
/// engine or a library prints cannot corrupt the protocol.
fn protocol_stdout() -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    std::io::stdout().flush()?;
    // SAFETY: dup and dup2 on the process's own standard descriptors; the duplicate is a
    // fresh descriptor that nothing else owns, so handing it to a File is sound.
    unsafe {
        let fd = libc::dup(1);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::dup2(2, 1) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(std::fs::File::from_raw_fd(fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_round_trips() {
        let done = FromHost::Done { slot: 0, result: Err(EngineError::Crashed(Death::Signal(6))) };
        let text = serde_json::to_string(&done).unwrap();
        match serde_json::from_str::<FromHost>(&text).unwrap() {
            FromHost::Done { result: Err(EngineError::Crashed(how)), .. } => assert_eq!(how, Death::Signal(6)),
            other => panic!("{other:?}"),
        }
        let oom = FromHost::Done { slot: 2, result: Err(EngineError::OutOfMemory { device: "cuda:0".into() }) };
        let back: FromHost = serde_json::from_str(&serde_json::to_string(&oom).unwrap()).unwrap();
        assert!(matches!(back, FromHost::Done { slot: 2, result: Err(EngineError::OutOfMemory { .. }) }));
        // Slot 0 (a host of one job loop) is left out, as hosts and workers from
        // before shared hosts wrote it; other slots are named.
        assert_eq!(serde_json::to_string(&ToHost::Cancel { slot: 0 }).unwrap(), r#"{"type":"cancel"}"#);
        assert!(matches!(serde_json::from_str(r#"{"type":"cancel"}"#).unwrap(), ToHost::Cancel { slot: 0 }));
        assert_eq!(serde_json::to_string(&ToHost::Cancel { slot: 7 }).unwrap(), r#"{"type":"cancel","slot":7}"#);
        let progress = r#"{"type":"progress","slot":3,"fraction":0.5,"stage":"separating"}"#;
        let back: FromHost = serde_json::from_str(progress).unwrap();
        assert!(matches!(back, FromHost::Progress { slot: 3, .. }), "{back:?}");
        let old_done = r#"{"type":"done","result":{"Ok":[]}}"#;
        assert!(matches!(serde_json::from_str(old_done).unwrap(), FromHost::Done { slot: 0, result: Ok(_) }));
    }

    #[test]
    fn the_hello_says_whether_the_engine_wants_metadata() {
        let hello = FromHost::Hello(Hello {
            name: "fake".into(),
            devices: vec![Device::Cpu],
            reads_input: false,
            wants_metadata: true,
            models: vec![Model::Htdemucs6s],
        });
        let back: FromHost = serde_json::from_str(&serde_json::to_string(&hello).unwrap()).unwrap();
        assert!(
            matches!(back, FromHost::Hello(Hello { wants_metadata: true, ref models, .. }) if models == &[Model::Htdemucs6s]),
            "{back:?}"
        );
        // A host from before the field: its engine gets no metadata.
        let old = r#"{"type":"hello","name":"dsp","devices":["cpu"],"reads_input":true}"#;
        let back: FromHost = serde_json::from_str(old).unwrap();
        assert!(matches!(back, FromHost::Hello(Hello { wants_metadata: false, .. })), "{back:?}");
    }

    #[test]
    fn deaths_are_described() {
        assert_eq!(describe(ExitStatus::from_raw(6)), Death::Signal(6));
        assert_eq!(describe(ExitStatus::from_raw(101 << 8)), Death::Exited(101));
    }
}
