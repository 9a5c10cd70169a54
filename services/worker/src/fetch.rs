//! External audio: fetching an input from an `https://` URL, where the operator allows it.
//!
//! This module owns the worker's only outbound request on a client's say-so. The ingress
//! checked the URL at submit; the check is repeated here, at connect time, because DNS
//! may answer differently now and a raw publisher bypasses the ingress:
//!
//! 1. the URL goes through [`stemq_core::netpolicy::check_url`] with the operator's
//!    [`HostPolicy`]: scheme, host admitted, every address public (or exempt);
//! 2. the request goes to the one address that was checked (the client's resolver is
//!    pinned to it, and environment proxies are off, which would connect by name);
//! 3. redirects are not followed by the client: each `Location` goes through step 1
//!    again, and gets a client pinned to its own checked address, at most
//!    [`AudioUrls::max_redirects`] times;
//! 4. the body is streamed to scratch, refused past [`AudioUrls::max_bytes`] (announced
//!    by `Content-Length` or counted), with a connect timeout and a timeout between
//!    reads (the attempt's time limit bounds the whole).
//!
//! [`FetchError`] says what went wrong; the job module turns it into a failure code and
//! class (permanent for a refused URL, a 4xx or a too-large input; transient for a 5xx,
//! 429, timeouts and connection errors).

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use stemq_core::netpolicy::{self, HostPolicy, UrlError};
use tokio::io::AsyncWriteExt;

/// Settings of external audio (`STEMQ_AUDIO_URL_ALLOW`).
#[derive(Debug, Clone)]
pub struct AudioUrls {
    /// The hosts an input URL may name (the same policy as the ingress's).
    pub allow: HostPolicy,
    /// Largest input accepted, in bytes: the upload limit.
    pub max_bytes: u64,
    /// Longest wait for a connection (TCP and TLS).
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes of an answer.
    pub read_timeout: Duration,
    /// Most redirects followed (each re-checked).
    pub max_redirects: usize,
}

impl AudioUrls {
    /// Defaults for `allow`: the upload limit, 10 s to connect, 30 s between reads, 5
    /// redirects.
    pub fn new(allow: HostPolicy) -> AudioUrls {
        AudioUrls {
            allow,
            max_bytes: stemq_core::uri::MAX_INPUT_BYTES,
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            max_redirects: 5,
        }
    }
}

/// Why an input URL could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The URL, or a redirect's target, is refused by the address policy (or its name
    /// does not resolve).
    #[error("{url} {source}")]
    Policy {
        /// The URL refused.
        url: String,
        /// Why.
        #[source]
        source: UrlError,
    },
    /// The server answered with an error status.
    #[error("{url} answered {status}")]
    Status {
        /// The URL.
        url: String,
        /// The status.
        status: reqwest::StatusCode,
    },
    /// A redirect without a usable `Location`.
    #[error("{url} redirected ({status}) without a valid Location")]
    BadRedirect {
        /// The URL.
        url: String,
        /// The status.
        status: reqwest::StatusCode,
    },
    /// More redirects than [`AudioUrls::max_redirects`].
    #[error("{url}: more than {max} redirects")]
    TooManyRedirects {
        /// The URL first asked for.
        url: String,
        /// The limit.
        max: usize,
    },
    /// The input is over the size limit.
    #[error("{url} is larger than the {limit}-byte input limit")]
    TooLarge {
        /// The URL.
        url: String,
        /// The limit.
        limit: u64,
    },
    /// Connecting, sending or reading failed (timeouts included).
    #[error("fetching {url}: {kind}")]
    Http {
        /// The URL.
        url: String,
        /// Which step failed.
        kind: HttpErrorKind,
        /// What reqwest said.
        #[source]
        source: reqwest::Error,
    },
    /// The local copy could not be written.
    #[error("writing {path}")]
    Write {
        /// The scratch file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// How an HTTP exchange failed ([`FetchError::Http`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpErrorKind {
    /// No answer, or no more bytes, in time.
    Timeout,
    /// The connection could not be made.
    Connect,
    /// Sending the request or reading the answer failed.
    Transfer,
}

impl std::fmt::Display for HttpErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HttpErrorKind::Timeout => "timed out",
            HttpErrorKind::Connect => "cannot connect",
            HttpErrorKind::Transfer => "transfer failed",
        })
    }
}

fn http_err(url: &str, source: reqwest::Error) -> FetchError {
    let kind = if source.is_timeout() {
        HttpErrorKind::Timeout
    } else if source.is_connect() {
        HttpErrorKind::Connect
    } else {
        HttpErrorKind::Transfer
    };
    FetchError::Http { url: url.to_string(), kind, source }
}

/// Fetches `url` into the file `path` under the settings' policy and limits; returns the
/// bytes written.
pub async fn fetch(settings: &AudioUrls, url: &str, path: &Path) -> Result<u64, FetchError> {
    let mut current = url.to_string();
    for _ in 0..=settings.max_redirects {
        let target = netpolicy::check_url(&current, &settings.allow)
            .await
            .map_err(|source| FetchError::Policy { url: current.clone(), source })?;
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .resolve(&target.host, target.addr)
            .connect_timeout(settings.connect_timeout)
            .read_timeout(settings.read_timeout)
            .user_agent("stemq-worker")
            .build()
            .map_err(|e| http_err(&current, e))?;
        let resp = client.get(target.url.clone()).send().await.map_err(|e| http_err(&current, e))?;
        let status = resp.status();
        if status.is_redirection() {
            let next = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|loc| target.url.join(loc).ok())
                .ok_or_else(|| FetchError::BadRedirect { url: current.clone(), status })?;
            current = next.to_string();
            continue;
        }
        if !status.is_success() {
            return Err(FetchError::Status { url: current, status });
        }
        return save(settings, &current, resp, path).await;
    }
    Err(FetchError::TooManyRedirects { url: url.to_string(), max: settings.max_redirects })
}

/// Streams the body of `resp` to `path`, counting against the limit.
async fn save(settings: &AudioUrls, url: &str, resp: reqwest::Response, path: &Path) -> Result<u64, FetchError> {
    let too_large = || FetchError::TooLarge { url: url.to_string(), limit: settings.max_bytes };
    if resp.content_length().is_some_and(|n| n > settings.max_bytes) {
        return Err(too_large());
    }
    let write_err = |source| FetchError::Write { path: path.display().to_string(), source };
    let mut file = tokio::fs::File::create(path).await.map_err(write_err)?;
    let mut body = resp.bytes_stream();
    let mut written = 0u64;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| http_err(url, e))?;
        written += chunk.len() as u64;
        if written > settings.max_bytes {
            return Err(too_large());
        }
        file.write_all(&chunk).await.map_err(write_err)?;
    }
    file.flush().await.map_err(write_err)?;
    Ok(written)
}
