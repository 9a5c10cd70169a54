//! Links in answers: the absolute URLs of a job's resources (`urls` on every job the
//! HTTP API returns).
//!
//! This module owns how the ingress names itself to its callers. The base of every link
//! is the configured public URL ([`PublicUrl`]: `--public-url`, `STEMQ_PUBLIC_URL`; the
//! address clients reach, with a path prefix if a proxy adds one) or, without one, the
//! request's own `Host` (HTTP/2 `:authority`) with the scheme this listener serves
//! (`https` with TLS). Forwarding headers (`Forwarded`, `X-Forwarded-*`) are not read:
//! behind a proxy, set the public URL.
//!
//! The links are added when a view is read, per request ([`Links::job`] makes a [`Job`]
//! of a [`JobView`]), never stored: the view in KV is shared by every reader (NATS
//! services, the relay, ingresses reached under other names), so it holds no URL of
//! ours.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::str::FromStr;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, uri::Authority};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stemq_core::{JobId, JobStatus, JobView};

use crate::AppState;

/// The URL clients reach the API at (`https://stemq.example.com`, or with a path prefix
/// `https://example.com/stemq`): http or https, a host, no query, fragment or user info.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicUrl(url::Url);

/// Why a public URL was refused.
#[derive(Debug, thiserror::Error)]
pub enum PublicUrlError {
    /// Not a URL at all.
    #[error("not an absolute URL")]
    Parse(#[source] url::ParseError),
    /// Another scheme than http or https.
    #[error("scheme `{0}`: the public URL is http:// or https://")]
    Scheme(String),
    /// No host.
    #[error("the public URL has no host")]
    NoHost,
    /// A query string, a fragment or user info, which links cannot carry.
    #[error("the public URL must not have a query string, a fragment or user info")]
    Extra,
}

impl FromStr for PublicUrl {
    type Err = PublicUrlError;

    fn from_str(s: &str) -> Result<PublicUrl, PublicUrlError> {
        let url = url::Url::parse(s.trim()).map_err(PublicUrlError::Parse)?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(PublicUrlError::Scheme(url.scheme().to_string()));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(PublicUrlError::NoHost);
        }
        if url.query().is_some() || url.fragment().is_some() || !url.username().is_empty() || url.password().is_some() {
            return Err(PublicUrlError::Extra);
        }
        Ok(PublicUrl(url))
    }
}

impl std::fmt::Display for PublicUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.as_str().trim_end_matches('/'))
    }
}

/// Where links of this ingress point: the public URL, else each request's host with this
/// listener's scheme.
#[derive(Debug, Clone)]
pub struct LinkBase {
    public: Option<PublicUrl>,
    /// `https` when the listener serves TLS.
    scheme: &'static str,
    /// The answer for a request without a usable `Host` (HTTP/1.0).
    listen: SocketAddr,
}

impl Default for LinkBase {
    fn default() -> LinkBase {
        LinkBase { public: None, scheme: "http", listen: SocketAddr::from(([127, 0, 0, 1], 0)) }
    }
}

impl LinkBase {
    /// Links under `public` if given, else under each request's host, `https` when `tls`.
    pub fn new(public: Option<PublicUrl>, tls: bool, listen: SocketAddr) -> LinkBase {
        LinkBase { public, scheme: if tls { "https" } else { "http" }, listen }
    }

    /// The links of one request.
    pub fn for_request(&self, parts: &Parts) -> Links {
        if let Some(p) = &self.public {
            return Links { base: p.0.clone() };
        }
        let host = parts.uri.authority().map(|a| a.as_str().to_string()).or_else(|| {
            let h = parts.headers.get(header::HOST)?.to_str().ok()?;
            // A host and an optional port, nothing else (no user info, no path).
            let a = Authority::from_str(h).ok()?;
            (!a.as_str().contains('@')).then(|| a.as_str().to_string())
        });
        let parse = |host: &str| url::Url::parse(&format!("{}://{host}/", self.scheme)).ok();
        let base = host
            .as_deref()
            .and_then(parse)
            .or_else(|| parse(&self.listen.to_string()))
            .expect("a socket address makes a URL");
        Links { base }
    }
}

/// The links of one request: a base URL and the paths of a job's resources under it.
#[derive(Debug, Clone)]
pub struct Links {
    base: url::Url,
}

impl FromRequestParts<AppState> for Links {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Links, Infallible> {
        Ok(state.links.for_request(parts))
    }
}

impl Links {
    /// The links of every request under `base` (the documentation's examples).
    pub fn under(base: &PublicUrl) -> Links {
        Links { base: base.0.clone() }
    }

    /// The absolute URL of `segments` under the base (each segment percent-encoded).
    fn url(&self, segments: &[&str]) -> String {
        let mut u = self.base.clone();
        u.path_segments_mut().expect("http(s) URLs have a path").pop_if_empty().extend(segments);
        u.into()
    }

    /// The URLs of job `id` that exist whatever its status.
    pub fn of(&self, id: &JobId) -> JobUrls {
        let id = id.as_str();
        JobUrls {
            get: self.url(&["v1", "separations", id]),
            cancel: self.url(&["v1", "separations", id, "cancel"]),
            events: self.url(&["v1", "separations", id, "events"]),
            stems: BTreeMap::new(),
        }
    }

    /// The URLs of the job `view` shows: with its stems once it has succeeded.
    pub fn urls(&self, view: &JobView) -> JobUrls {
        let mut urls = self.of(&view.job_id);
        if view.status == JobStatus::Succeeded {
            let id = view.job_id.as_str();
            urls.stems = view
                .outputs
                .iter()
                .map(|o| (o.stem.clone(), self.url(&["v1", "separations", id, "stems", &o.stem])))
                .collect();
        }
        urls
    }

    /// `view` as the API shows it, with its links.
    pub fn job(&self, view: JobView) -> Job {
        Job { urls: self.urls(&view), view }
    }
}

/// Absolute URLs of a job's resources, built per request (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct JobUrls {
    /// The job's view (`GET`; with `Prefer: wait=N` to wait for its end).
    pub get: String,
    /// Cancels it (`POST`).
    pub cancel: String,
    /// Its live status as Server-Sent Events (`GET`).
    pub events: String,
    /// Once it has succeeded: each stem's download (`GET`), by stem name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stems: BTreeMap<String, String>,
}

/// A job as the HTTP API shows it: its status view and the URLs of its resources.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Job {
    /// The status view (the same document NATS readers get from the `stemq_jobs` bucket).
    #[serde(flatten)]
    pub view: JobView,
    /// Where to read, cancel and follow the job, and once it has succeeded its stems.
    pub urls: JobUrls,
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;

    fn parts(host: Option<&str>, uri: &str) -> Parts {
        let mut b = Request::builder().uri(uri);
        if let Some(h) = host {
            b = b.header("host", h);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn id() -> JobId {
        JobId::parse(&"ab".repeat(32)).unwrap()
    }

    #[test]
    fn public_urls_are_checked() {
        for ok in ["https://stemq.example.com", "http://10.0.0.1:8080/", "https://example.com/stemq/"] {
            assert!(ok.parse::<PublicUrl>().is_ok(), "{ok}");
        }
        assert!(matches!("example.com".parse::<PublicUrl>(), Err(PublicUrlError::Parse(_))));
        assert!(matches!("ftp://example.com".parse::<PublicUrl>(), Err(PublicUrlError::Scheme(_))));
        for extra in ["https://x.example/?a=1", "https://x.example/#f", "https://u:p@x.example/"] {
            assert!(matches!(extra.parse::<PublicUrl>(), Err(PublicUrlError::Extra)), "{extra}");
        }
        assert_eq!("https://example.com/stemq/".parse::<PublicUrl>().unwrap().to_string(), "https://example.com/stemq");
    }

    #[test]
    fn links_use_the_public_url_with_its_prefix() {
        for public in ["https://example.com/stemq", "https://example.com/stemq/"] {
            let base = LinkBase::new(Some(public.parse().unwrap()), false, "127.0.0.1:8080".parse().unwrap());
            let urls = base.for_request(&parts(Some("evil.example"), "/v1/separations")).of(&id());
            assert_eq!(urls.get, format!("https://example.com/stemq/v1/separations/{}", id()));
            assert_eq!(urls.cancel, format!("https://example.com/stemq/v1/separations/{}/cancel", id()));
            assert_eq!(urls.events, format!("https://example.com/stemq/v1/separations/{}/events", id()));
        }
    }

    #[test]
    fn links_follow_the_host_header_and_the_listeners_scheme() {
        let listen = "127.0.0.1:8080".parse().unwrap();
        let plain = LinkBase::new(None, false, listen);
        let urls = plain.for_request(&parts(Some("api.example:9000"), "/v1/separations")).of(&id());
        assert_eq!(urls.get, format!("http://api.example:9000/v1/separations/{}", id()));
        let tls = LinkBase::new(None, true, listen);
        let urls = tls.for_request(&parts(Some("[::1]:8443"), "/x")).of(&id());
        assert_eq!(urls.get, format!("https://[::1]:8443/v1/separations/{}", id()));
        // An absolute-form request target (HTTP/2 :authority) wins over Host.
        let urls = plain.for_request(&parts(Some("other"), "http://h2.example/x")).of(&id());
        assert!(urls.get.starts_with("http://h2.example/v1/"), "{}", urls.get);
        // No Host, or one that is not a host: the listen address.
        for host in [None, Some("user@evil.example"), Some("a b"), Some("x/y")] {
            let urls = plain.for_request(&parts(host, "/x")).of(&id());
            assert!(urls.get.starts_with("http://127.0.0.1:8080/v1/"), "{host:?}: {}", urls.get);
        }
    }

    #[test]
    fn stems_are_linked_once_the_job_succeeded() {
        let links = LinkBase::new(None, false, "127.0.0.1:1".parse().unwrap()).for_request(&parts(Some("h"), "/"));
        let mut view: JobView = serde_json::from_value(serde_json::json!({
            "job_id": id(), "status": "running", "updated_at": "2026-01-01T00:00:00Z", "attempt": 1, "retries": 0,
            "degraded": false, "last_seq": 3, "progress_seq": 0,
            "outputs": [{"stem": "vocals", "uri": "file:///s/jobs/x/vocals.wav", "bytes": 1, "sha256": "00"},
                        {"stem": "no vocals", "uri": "file:///s/jobs/x/nv.wav", "bytes": 1, "sha256": "00"}]
        }))
        .expect("a view");
        assert!(links.urls(&view).stems.is_empty());
        view.status = JobStatus::Succeeded;
        let job = serde_json::to_value(links.job(view)).unwrap();
        assert_eq!(job["urls"]["stems"]["vocals"], format!("http://h/v1/separations/{}/stems/vocals", id()));
        assert_eq!(job["urls"]["stems"]["no vocals"], format!("http://h/v1/separations/{}/stems/no%20vocals", id()));
        assert_eq!(job["status"], "succeeded", "the view's fields stay at the top level");
    }
}
