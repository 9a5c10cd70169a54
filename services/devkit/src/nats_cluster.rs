//! A three-node JetStream cluster of `nats-server` children on loopback, for the
//! cluster fault tests and `stemq bench pipeline --cluster`.
//!
//! This module owns standing a cluster up and taking it down node by node. Each node is
//! a [`NatsServer`] with a [`ClusterNode`]: its own store folder (`<dir>/n1`, ...),
//! client, route and monitoring ports reserved once and kept across restarts, and the
//! stable names `n1`, `n2`, `n3` (a node's name is its RAFT identity). All nodes share one
//! credentials folder (`<dir>/creds`), so every stemq user may connect to any node.
//! Clients get the whole list ([`NatsCluster::urls`]) and reconnect across nodes
//! ([`stemq_nats::connect_with`]).
//!
//! Faults: [`NatsCluster::kill`] (SIGKILL), [`NatsCluster::restart`] (same ports and
//! store), [`NatsCluster::rolling_restart`] (lame duck, restart, wait for `/healthz`, one
//! node at a time). [`NatsCluster::stream_leader`] names the node that leads a stream.
//! Waiting is polling with a deadline. The calls block: async callers run them on a
//! blocking thread.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_nats::jetstream;

use crate::nats_server::{free_ports, ClusterNode, NatsServer, ServerError, ServerOptions};
use stemq_nats::{ConnectAuth, NatsError};

/// The cluster's name in every node's `cluster` block.
pub const CLUSTER_NAME: &str = "stemq";

/// How long a node may take to answer `/healthz` 200 after a start.
pub const HEALTHY_WITHIN: Duration = Duration::from_secs(60);

/// How long a freshly started node's monitoring port may refuse connections before the
/// start is taken as a lost port and begun again elsewhere.
pub const MONITOR_WITHIN: Duration = Duration::from_secs(15);

/// A running cluster. Every node is killed on drop.
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
    dir: PathBuf,
}

impl NatsCluster {
    /// [`NatsCluster::start`] from async code: the start (which waits for every node to
    /// be healthy) runs off the runtime's worker threads.
    pub async fn start_async(dir: PathBuf, size: usize, options: ServerOptions) -> Result<NatsCluster, ServerError> {
        crate::off_runtime(move || NatsCluster::start(&dir, size, options)).await
    }

    /// Starts `size` nodes (3 for R3) under `dir` with stemq's users (unless
    /// `options.auth` is off; `options.tls` applies to every node; its `port`, `creds`
    /// and `cluster` are chosen here) and waits until every node's `/healthz` answers 200
    /// (a meta leader is elected).
    ///
    /// A node that exits during the start, or whose monitoring port never opens (one of
    /// its ports was taken between choosing it and binding it: another process's
    /// outgoing connection, or another test's server, say), makes the whole start begin
    /// again with other ports, up to three times.
    pub fn start(dir: &Path, size: usize, options: ServerOptions) -> Result<NatsCluster, ServerError> {
        let mut tries = 0;
        loop {
            tries += 1;
            match NatsCluster::start_once(dir, size, options.clone()) {
                Err(ServerError::NotReady(wait, _)) if wait.is_zero() && tries < 3 => {
                    for i in 0..size {
                        let _ = std::fs::remove_dir_all(dir.join(format!("n{}", i + 1)));
                    }
                }
                other => return other,
            }
        }
    }

    fn start_once(dir: &Path, size: usize, options: ServerOptions) -> Result<NatsCluster, ServerError> {
        let free = free_ports(3 * size)?;
        let ports: Vec<(u16, u16, u16)> = free.chunks(3).map(|p| (p[0], p[1], p[2])).collect();
        NatsCluster::start_on(dir, &ports, options)
    }

    /// One start on the given `(client, route, monitoring)` ports, one triple per node,
    /// without starting over: a node that exits, or whose monitoring port never opens,
    /// fails it at once with `NotReady(ZERO, log)`. [`NatsCluster::start`] is what to
    /// call; this is for tests of a start that loses a port.
    pub fn start_on(dir: &Path, ports: &[(u16, u16, u16)], options: ServerOptions) -> Result<NatsCluster, ServerError> {
        let size = ports.len();
        let routes: Vec<u16> = ports.iter().map(|p| p.1).collect();
        let creds = dir.join("creds");
        let mut nodes = Vec::with_capacity(size);
        for (i, &(client, route, http)) in ports.iter().enumerate() {
            let name = format!("n{}", i + 1);
            let node = ClusterNode {
                name: name.clone(),
                cluster: CLUSTER_NAME.to_string(),
                route_port: route,
                routes: routes.clone(),
                http_port: http,
            };
            let o = ServerOptions { port: client, creds: Some(creds.clone()), cluster: Some(node), ..options.clone() };
            nodes.push(NatsServer::start_with(&dir.join(&name), o)?);
        }
        let mut cluster = NatsCluster { nodes, dir: dir.to_path_buf() };
        cluster.wait_first_healthy()?;
        Ok(cluster)
    }

    /// Waits for every node of a fresh start to answer `/healthz` 200.
    ///
    /// Fails fast with `NotReady(ZERO, log)`, which [`NatsCluster::start`] answers by
    /// starting over on other ports, when a node has exited (it lost one of its ports
    /// after it opened its client port), or when its monitoring port still refuses
    /// connections [`MONITOR_WITHIN`] after the start (the port is someone else's, or
    /// nobody's). Otherwise it waits up to [`HEALTHY_WITHIN`] for the election.
    fn wait_first_healthy(&mut self) -> Result<(), ServerError> {
        let t0 = Instant::now();
        // Each node's last answer; `None` once it has answered 200.
        let mut last: Vec<Option<String>> = vec![Some(String::new()); self.nodes.len()];
        while last.iter().any(Option::is_some) {
            for (node, last) in self.nodes.iter_mut().zip(&mut last) {
                if last.is_none() {
                    continue;
                }
                if !node.is_running() {
                    return Err(ServerError::NotReady(Duration::ZERO, node.log_file()));
                }
                match node.healthz("/healthz") {
                    Ok((200, _)) => *last = None,
                    Ok((code, body)) => *last = Some(format!("{code} {}", body.trim())),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && t0.elapsed() > MONITOR_WITHIN => {
                        return Err(ServerError::NotReady(Duration::ZERO, node.log_file()));
                    }
                    Err(e) => *last = Some(e.to_string()),
                }
            }
            if t0.elapsed() > HEALTHY_WITHIN {
                if let Some((node, Some(answer))) = self.nodes.iter().zip(last).find(|(_, l)| l.is_some()) {
                    return Err(node.unhealthy(HEALTHY_WITHIN, answer));
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The client URLs of every node, comma-separated: what `--nats-url` takes.
    pub fn urls(&self) -> String {
        self.nodes.iter().map(NatsServer::url).collect::<Vec<_>>().join(",")
    }

    /// The folder holding the nodes' stores and the shared credentials.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True for a cluster of no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i` (0-based; its name is `n{i+1}`).
    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    /// The index of the node called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name() == Some(name))
    }

    /// The credentials file of `user` (shared by every node).
    pub fn credentials(&self, user: &str) -> PathBuf {
        self.nodes[0].credentials(user)
    }

    /// How `user` connects (its credentials; the CA when the nodes serve TLS).
    pub fn connect_auth(&self, user: &str) -> Result<ConnectAuth, ServerError> {
        self.nodes[0].connect_auth(user)
    }

    /// Connects as `user` to the whole cluster (any node; reconnects across them).
    pub async fn connect_as(&self, user: &str, name: &str) -> Result<async_nats::Client, NatsError> {
        let auth = self.connect_auth(user).map_err(|e| NatsError::Tls(e.to_string()))?;
        stemq_nats::connect_with(&self.urls(), name, &auth).await
    }

    /// SIGKILL node `i`: no goodbye, no lame duck.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again on its ports and store and waits for its `/healthz`;
    /// returns how long that took after the process was listening.
    pub fn restart(&mut self, i: usize) -> Result<Duration, ServerError> {
        self.nodes[i].restart()?;
        self.nodes[i].wait_healthy(HEALTHY_WITHIN)
    }

    /// Waits until every running node's `/healthz` answers 200.
    pub fn wait_healthy(&mut self, wait: Duration) -> Result<(), ServerError> {
        for n in &mut self.nodes {
            if n.is_running() {
                n.wait_healthy(wait)?;
            }
        }
        Ok(())
    }

    /// Restarts every node, one at a time: lame duck (SIGUSR2: leaderships move away,
    /// clients reconnect elsewhere), start again on the same ports and store, wait for
    /// `/healthz` 200 before the next. `each` is called after each node is back, with its
    /// index and the time it was gone.
    pub fn rolling_restart(&mut self, mut each: impl FnMut(usize, Duration)) -> Result<(), ServerError> {
        for i in 0..self.nodes.len() {
            let t0 = Instant::now();
            self.nodes[i].lame_duck();
            self.restart(i)?;
            each(i, t0.elapsed());
        }
        Ok(())
    }
}

/// The name of the node that leads `stream` (`None` while an election runs or without
/// quorum, or when the cluster does not answer).
pub async fn stream_leader(js: &jetstream::Context, stream: &str) -> Option<String> {
    let mut s = js.get_stream(stream).await.ok()?;
    let info = s.info().await.ok()?;
    info.cluster.as_ref()?.leader.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_block_names_every_route() {
        let n = ClusterNode {
            name: "n2".into(),
            cluster: CLUSTER_NAME.into(),
            route_port: 6223,
            routes: vec![6222, 6223, 6224],
            http_port: 8223,
        };
        let conf = n.conf();
        assert!(conf.contains("server_name: n2\n"), "{conf}");
        assert!(conf.contains("http: 127.0.0.1:8223\n"), "{conf}");
        assert!(conf.contains("listen: 127.0.0.1:6223\n"), "{conf}");
        assert!(
            conf.contains(
                "routes: [ nats-route://127.0.0.1:6222, nats-route://127.0.0.1:6223, nats-route://127.0.0.1:6224 ]"
            ),
            "{conf}"
        );
        // nats-server refuses a lame duck duration under 30 s.
        assert!(conf.contains("lame_duck_duration: 30s\n"), "{conf}");
    }
}
