//! `GET /v1/separations/{id}/stems/{stem}`: one stem of a finished job.
//!
//! This module owns stem downloads. On stores that can sign (S3) the answer is a 307
//! redirect to a short-lived presigned URL, so the bytes never go through the
//! ingress. Otherwise the stem is streamed from the store with single-range HTTP Range
//! support (`206` with `Content-Range`, `416` when unsatisfiable). Unknown jobs and stems
//! are 404; a job that has not succeeded is 409.

use std::ops::Range;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use stemq_accounts::auth::Caller;
use stemq_core::{JobId, JobStatus};
use tracing::{info_span, warn, Instrument};

use crate::error::internal;
use crate::rejection::Path;
use crate::uploads::no_store;
use crate::{ApiError, AppState, ErrorCode};

/// What a `Range` header asks of an object of `size` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangeRequest {
    /// No (usable) range: the whole object.
    Full,
    /// One satisfiable range.
    Partial(Range<u64>),
    /// A syntactically valid range that does not overlap the object.
    Unsatisfiable,
}

/// Parses a `Range` header value (`bytes=a-b`, `bytes=a-`, `bytes=-n`). Several ranges
/// or a malformed value are served as the whole object, as RFC 9110 allows.
pub fn parse_range(value: Option<&str>, size: u64) -> RangeRequest {
    let Some(spec) = value.and_then(|v| v.trim().strip_prefix("bytes=")) else {
        return RangeRequest::Full;
    };
    if spec.contains(',') {
        return RangeRequest::Full;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeRequest::Full;
    };
    let (a, b) = (a.trim(), b.trim());
    let num = |s: &str| s.parse::<u64>().ok();
    match (a.is_empty(), b.is_empty()) {
        (true, true) => RangeRequest::Full,
        // Suffix: the last n bytes.
        (true, false) => match num(b) {
            Some(0) => RangeRequest::Unsatisfiable,
            Some(_) if size == 0 => RangeRequest::Unsatisfiable,
            Some(n) => RangeRequest::Partial(size.saturating_sub(n)..size),
            None => RangeRequest::Full,
        },
        (false, _) => {
            let Some(start) = num(a) else {
                return RangeRequest::Full;
            };
            let end = if b.is_empty() {
                size
            } else {
                match num(b) {
                    Some(e) if e >= start => (e + 1).min(size),
                    _ => return RangeRequest::Full,
                }
            };
            if start >= size {
                RangeRequest::Unsatisfiable
            } else {
                RangeRequest::Partial(start..end)
            }
        }
    }
}

/// The path of `GET /v1/separations/{id}/stems/{stem}`.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub struct StemPath {
    /// The job id.
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub id: String,
    /// The stem's name (`vocals`, `no_vocals` with `other_method` `add`, `minus_vocals`
    /// with `minus`, ...), as `outputs[].stem` of the job names it.
    #[schemars(length(min = 1))]
    pub stem: String,
}

fn not_found(message: String) -> ApiError {
    ApiError { code: ErrorCode::NotFound, message, field: None }
}

pub(crate) async fn download(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(StemPath { id, stem }): Path<StemPath>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let storage = state.storage.clone().ok_or_else(no_store)?;
    let Some(job_id) = JobId::parse(&id) else {
        return Err(not_found(format!("no job {id}")));
    };
    let span = info_span!("stem.download", job_id = %job_id, stem = %stem);
    async move {
        let view = state.view_for(&caller, &job_id).await?.ok_or_else(|| not_found(format!("no job {job_id}")))?;
        if view.status != JobStatus::Succeeded {
            return Err(ApiError {
                code: ErrorCode::NotReady,
                message: format!("job {job_id} is {}; stems exist once it has succeeded", view.status.as_str()),
                field: None,
            });
        }
        let Some(output) = view.outputs.iter().find(|o| o.stem == stem) else {
            let names: Vec<_> = view.outputs.iter().map(|o| o.stem.as_str()).collect();
            return Err(not_found(format!("job {job_id} has no stem `{stem}`; it has {}", names.join(", "))));
        };
        let store = &storage.store;
        let key = match stemq_core::uri::store_key(&output.uri, &[store.base_url().to_string()]) {
            Ok((_, key)) => key.to_string(),
            Err(e) => {
                warn!(uri = %output.uri, error = %e, "stem is not in this ingress's store");
                return Err(not_found(format!("stem `{stem}` of job {job_id} is not in this store")));
            }
        };
        if store.can_presign() {
            let url = store.presigned_get(&key, storage.presign_ttl).await.map_err(internal)?;
            if let Some(url) = url {
                return Ok((StatusCode::TEMPORARY_REDIRECT, [(header::LOCATION, url.to_string())]).into_response());
            }
        }
        let Some(size) = store.size(&key).await.map_err(internal)? else {
            return Err(not_found(format!("stem `{stem}` of job {job_id} is no longer stored")));
        };
        let ext = key.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
        let content_type = match ext {
            "wav" => "audio/wav",
            "flac" => "audio/flac",
            "mp3" => "audio/mpeg",
            _ => "application/octet-stream",
        };
        let mut out = HeaderMap::new();
        out.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        out.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        if let Ok(v) = HeaderValue::from_str(&format!("\"{}\"", output.sha256)) {
            out.insert(header::ETAG, v);
        }
        if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{stem}.{ext}\"")) {
            out.insert(header::CONTENT_DISPOSITION, v);
        }
        let range = parse_range(headers.get(header::RANGE).and_then(|v| v.to_str().ok()), size);
        let (status, range) = match range {
            RangeRequest::Full => (StatusCode::OK, None),
            RangeRequest::Partial(r) => (StatusCode::PARTIAL_CONTENT, Some(r)),
            RangeRequest::Unsatisfiable => {
                out.insert(header::CONTENT_RANGE, HeaderValue::from_str(&format!("bytes */{size}")).expect("ascii"));
                return Ok((StatusCode::RANGE_NOT_SATISFIABLE, out).into_response());
            }
        };
        let len = range.as_ref().map(|r| r.end - r.start).unwrap_or(size);
        if let Some(r) = &range {
            let v = format!("bytes {}-{}/{size}", r.start, r.end - 1);
            out.insert(header::CONTENT_RANGE, HeaderValue::from_str(&v).expect("ascii"));
        }
        out.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        let body = if len == 0 {
            Body::empty()
        } else {
            Body::from_stream(store.get_stream(&key, range).await.map_err(internal)?)
        };
        Ok((status, out, body).into_response())
    }
    .instrument(span)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        use RangeRequest::*;
        assert_eq!(parse_range(None, 100), Full);
        assert_eq!(parse_range(Some("bytes=0-9"), 100), Partial(0..10));
        assert_eq!(parse_range(Some("bytes=90-"), 100), Partial(90..100));
        assert_eq!(parse_range(Some("bytes=90-500"), 100), Partial(90..100));
        assert_eq!(parse_range(Some("bytes=-10"), 100), Partial(90..100));
        assert_eq!(parse_range(Some("bytes=-500"), 100), Partial(0..100));
        assert_eq!(parse_range(Some("bytes=100-"), 100), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-0"), 100), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=5-1"), 100), Full);
        assert_eq!(parse_range(Some("bytes=0-1,5-6"), 100), Full);
        assert_eq!(parse_range(Some("items=0-1"), 100), Full);
        assert_eq!(parse_range(Some("bytes=x-1"), 100), Full);
    }
}
