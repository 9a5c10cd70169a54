//! Cross-origin calls from browser pages (CORS): off unless origins are configured.
//!
//! This module owns which web pages of other origins may call the API from a browser.
//! With no origin configured (the default) the ingress sends no CORS header at all, so
//! browsers keep other origins' pages out. With `--cors-origin ORIGIN` (repeatable or
//! comma-separated; `STEMQ_CORS_ORIGINS`) tower-http's `CorsLayer` answers preflights
//! and marks answers for exactly those origins (`AllowOrigin::list`: an origin not on the
//! list gets no `Access-Control-Allow-Origin`, never someone else's). It allows the
//! methods and request headers the API uses ([`ALLOWED_HEADERS`]) and lets pages read
//! the response headers they need ([`EXPOSED_HEADERS`]: rate limits, `Retry-After`,
//! `Preference-Applied`, `Location`, the stem download's range headers). Keys travel in
//! `Authorization`, never in cookies, so credentials mode stays off.
//!
//! The layer sits outside authentication: a preflight carries no key and gets its answer
//! here; every other request still needs its key.

use std::str::FromStr;
use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

/// Request headers pages may send.
pub const ALLOWED_HEADERS: [HeaderName; 8] = [
    header::AUTHORIZATION,
    header::CONTENT_TYPE,
    HeaderName::from_static("prefer"),
    HeaderName::from_static("last-event-id"),
    header::RANGE,
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
    header::IF_NONE_MATCH,
];

/// Response headers pages may read (beyond the CORS-safelisted ones).
pub const EXPOSED_HEADERS: [HeaderName; 10] = [
    HeaderName::from_static("ratelimit"),
    HeaderName::from_static("ratelimit-policy"),
    header::RETRY_AFTER,
    HeaderName::from_static("preference-applied"),
    header::LOCATION,
    header::WWW_AUTHENTICATE,
    header::CONTENT_RANGE,
    header::ACCEPT_RANGES,
    header::ETAG,
    header::CONTENT_DISPOSITION,
];

/// How long a browser may reuse a preflight's answer.
pub const MAX_AGE: Duration = Duration::from_secs(600);

/// One allowed origin, as browsers send it in `Origin`: `scheme://host[:port]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin(HeaderValue);

/// Why an origin was refused.
#[derive(Debug, thiserror::Error)]
pub enum OriginError {
    /// `*` (or `null`): the list names exact origins.
    #[error("`{0}` is not an origin: list each web page origin exactly (https://app.example.com)")]
    NotExact(String),
    /// Not a URL.
    #[error("`{0}` is not an origin (scheme://host[:port])")]
    Parse(String, #[source] url::ParseError),
    /// Another scheme than http or https.
    #[error("`{0}`: an origin is http:// or https://")]
    Scheme(String),
    /// A path, query, fragment or user info: an origin has none.
    #[error("`{0}` has more than scheme://host[:port]; an origin has no path, query or user info")]
    NotOrigin(String),
}

impl FromStr for Origin {
    type Err = OriginError;

    fn from_str(s: &str) -> Result<Origin, OriginError> {
        let s = s.trim();
        if s == "*" || s.eq_ignore_ascii_case("null") {
            return Err(OriginError::NotExact(s.to_string()));
        }
        let url = url::Url::parse(s).map_err(|e| OriginError::Parse(s.to_string(), e))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(OriginError::Scheme(s.to_string()));
        }
        if url.path() != "/"
            || url.query().is_some()
            || url.fragment().is_some()
            || !url.username().is_empty()
            || url.password().is_some()
        {
            return Err(OriginError::NotOrigin(s.to_string()));
        }
        // The browser's own spelling: lowercase host, no default port, no slash.
        let serialized = url.origin().ascii_serialization();
        Ok(Origin(HeaderValue::from_str(&serialized).map_err(|_| OriginError::NotOrigin(s.to_string()))?))
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.to_str().unwrap_or_default())
    }
}

/// The CORS layer for `origins`; `None` (no CORS headers at all) when there are none.
pub fn layer(origins: &[Origin]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins.iter().map(|o| o.0.clone())))
            .allow_methods([Method::GET, Method::HEAD, Method::POST])
            .allow_headers(ALLOWED_HEADERS)
            .expose_headers(EXPOSED_HEADERS)
            .max_age(MAX_AGE),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_read_as_browsers_send_them() {
        let o = |s: &str| s.parse::<Origin>().map(|o| o.to_string());
        assert_eq!(o("https://app.example.com").unwrap(), "https://app.example.com");
        assert_eq!(o(" HTTPS://App.Example.com/ ").unwrap(), "https://app.example.com");
        assert_eq!(o("https://app.example.com:443").unwrap(), "https://app.example.com");
        assert_eq!(o("http://localhost:5173").unwrap(), "http://localhost:5173");
    }

    #[test]
    fn anything_but_an_exact_origin_is_refused() {
        let e = |s: &str| s.parse::<Origin>().unwrap_err();
        assert!(matches!(e("*"), OriginError::NotExact(_)));
        assert!(matches!(e("null"), OriginError::NotExact(_)));
        assert!(matches!(e("app.example.com"), OriginError::Parse(..)));
        assert!(matches!(e("ftp://app.example.com"), OriginError::Scheme(_)));
        for s in
            ["https://app.example.com/page", "https://a.example/?x=1", "https://u@a.example", "https://a.example/#x"]
        {
            assert!(matches!(e(s), OriginError::NotOrigin(_)), "{s}");
        }
    }

    #[test]
    fn no_origins_no_layer() {
        assert!(layer(&[]).is_none());
        assert!(layer(&["https://a.example".parse().unwrap()]).is_some());
    }
}
