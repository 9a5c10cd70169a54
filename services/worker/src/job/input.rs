//! The input of an attempt, fetched into its scratch folder, and what a failed fetch
//! means for the job.

use std::path::{Path, PathBuf};
use std::time::Instant;

use stemq_core::event::FailureCode;
use tracing::info;

use super::Failure;
use crate::fetch::FetchError;
use crate::Shared;

/// Streams the input to local scratch, chunk by chunk. Only the owner's own uploads in
/// the configured store are read (the same policy as the ingress: no traversal, no other
/// store, no other owner's objects; a raw publisher bypasses the ingress), and http(s)
/// URLs where the operator allows external audio (`fetch`, under the address policy
/// again).
pub(super) async fn fetch_input(shared: &Shared, uri: &str, owner: &str, dir: &Path) -> Result<PathBuf, Failure> {
    let path = dir.join("input");
    let t0 = Instant::now();
    if let Some(urls) = shared.config.audio_urls.as_ref().filter(|_| stemq_core::uri::is_web_url(uri)) {
        let bytes = crate::fetch::fetch(urls, uri, &path).await.map_err(Failure::from)?;
        info!(event = "input.fetched", bytes, ms = t0.elapsed().as_millis() as u64, from = "url", "input fetched");
        return Ok(path);
    }
    let store = &shared.config.store;
    let (_, key) = stemq_core::uri::store_key(uri, &[store.base_url().to_string()])
        .and_then(|(i, key)| stemq_core::uri::check_owned(key, owner).map(|_| (i, key)))
        .map_err(|e| Failure::permanent(FailureCode::InputNotAllowed, e.message))?;
    let bytes = store.get_to_file(key, &path).await.map_err(|e| match e {
        e if e.is_not_found() => Failure::permanent(FailureCode::InputNotFound, format!("{uri} does not exist")),
        e @ stemq_storage::StorageError::Io { .. } => Failure::transient(FailureCode::Scratch, e.to_string()),
        e => Failure::transient(FailureCode::Storage, e.to_string()),
    })?;
    info!(event = "input.fetched", bytes, ms = t0.elapsed().as_millis() as u64, "input fetched");
    Ok(path)
}

/// What a failed fetch of an input URL means: refused URLs, 4xx answers and too-large
/// inputs are permanent; 5xx, 408, 429, timeouts, connection and DNS errors transient.
impl From<FetchError> for Failure {
    fn from(e: FetchError) -> Failure {
        let message = stemq_nats::error::report(&e);
        let status_transient = |s: &reqwest::StatusCode| s.is_server_error() || s.as_u16() == 408 || s.as_u16() == 429;
        match &e {
            FetchError::Policy { source, .. } if source.is_transient() => {
                Failure::transient(FailureCode::InputFetch, message)
            }
            FetchError::Policy { .. } => Failure::permanent(FailureCode::InputNotAllowed, message),
            FetchError::Status { status, .. } if matches!(status.as_u16(), 404 | 410) => {
                Failure::permanent(FailureCode::InputNotFound, message)
            }
            FetchError::Status { status, .. } if status_transient(status) => {
                Failure::transient(FailureCode::InputFetch, message)
            }
            FetchError::Status { .. } | FetchError::BadRedirect { .. } | FetchError::TooManyRedirects { .. } => {
                Failure::permanent(FailureCode::InputFetch, message)
            }
            FetchError::TooLarge { .. } => Failure::permanent(FailureCode::InputTooLarge, message),
            FetchError::Http { .. } => Failure::transient(FailureCode::InputFetch, message),
            FetchError::Write { .. } => Failure::transient(FailureCode::Scratch, message),
        }
    }
}

#[cfg(test)]
mod tests {
    use stemq_core::event::FailureClass;

    use super::*;

    #[test]
    fn fetch_errors_are_classified_with_their_codes() {
        use reqwest::StatusCode;
        use stemq_core::netpolicy::UrlError;
        let url = || "https://a.example/x.wav".to_string();
        let status = |s: u16| FetchError::Status { url: url(), status: StatusCode::from_u16(s).unwrap() };
        let cases: Vec<(FetchError, FailureClass, FailureCode)> = vec![
            (
                FetchError::Policy { url: url(), source: UrlError::HostNotAllowed("a.example".into()) },
                FailureClass::Permanent,
                FailureCode::InputNotAllowed,
            ),
            (
                FetchError::Policy {
                    url: url(),
                    source: UrlError::Resolve {
                        host: "a.example".into(),
                        source: stemq_core::netpolicy::ResolveError::new(std::io::Error::other("no")),
                    },
                },
                FailureClass::Transient,
                FailureCode::InputFetch,
            ),
            (status(404), FailureClass::Permanent, FailureCode::InputNotFound),
            (status(410), FailureClass::Permanent, FailureCode::InputNotFound),
            (status(403), FailureClass::Permanent, FailureCode::InputFetch),
            (status(429), FailureClass::Transient, FailureCode::InputFetch),
            (status(503), FailureClass::Transient, FailureCode::InputFetch),
            (FetchError::TooManyRedirects { url: url(), max: 5 }, FailureClass::Permanent, FailureCode::InputFetch),
            (FetchError::TooLarge { url: url(), limit: 10 }, FailureClass::Permanent, FailureCode::InputTooLarge),
            (
                FetchError::Http {
                    url: url(),
                    kind: crate::fetch::HttpErrorKind::Timeout,
                    source: reqwest::Client::new().get("http://a.example:99999/").build().unwrap_err(),
                },
                FailureClass::Transient,
                FailureCode::InputFetch,
            ),
        ];
        for (e, class, code) in cases {
            let text = e.to_string();
            let f = Failure::from(e);
            assert_eq!((f.class, &f.code), (class, &code), "{text}");
            assert!(f.message.contains("a.example"), "{}", f.message);
        }
    }
}
