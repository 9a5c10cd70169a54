//! `POST /v1/uploads`: a song goes into the store, content-addressed.
//!
//! This module owns the upload path and the ingress's storage settings. The request
//! body is streamed (never held in memory) to a temporary object while it is hashed and
//! counted; past the size limit the upload stops with 413 and nothing is kept. A
//! complete upload is moved to `uploads/<owner>/<sha256>.<ext>`, so the same song
//! uploaded twice by one owner is one object and yields the same `audio_uri` (and so the
//! same job id), and a job can read only its own owner's uploads.
//!
//! The answer names the upload without saying where the store is: its `audio_uri` is
//! `upload:<sha256>.<ext>` ([`upload_uri`]), which a submit resolves to the caller's own
//! upload in the store ([`resolve`]) before the job id is derived, so submitting it or the
//! store URI it stands for is the same job. Server paths and bucket names stay inside.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::TryStreamExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stemq_accounts::auth::Caller;
use stemq_core::request::RequestError;
use stemq_storage::{StorageError, Store};
use tracing::{info, info_span, warn, Instrument};

use crate::rejection::Query;
use crate::{ApiError, AppState, ErrorCode};

/// Bytes of an upload kept to read its header.
const HEAD_BYTES: usize = 64 * 1024;

/// Default upload limit: 1 GiB.
pub const DEFAULT_MAX_UPLOAD_BYTES: u64 = 1 << 30;
/// Default lifetime of presigned stem URLs.
pub const DEFAULT_PRESIGN_TTL: Duration = Duration::from_secs(15 * 60);

/// Where the ingress keeps uploads and finds stems.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// The store (the same one the workers use).
    pub store: Store,
    /// Largest accepted upload, in bytes.
    pub max_upload_bytes: u64,
    /// Lifetime of presigned stem URLs (S3 stores).
    pub presign_ttl: Duration,
}

impl StorageConfig {
    /// Defaults for `store`: 1 GiB uploads, 15-minute presigned URLs.
    pub fn new(store: Store) -> StorageConfig {
        StorageConfig { store, max_upload_bytes: DEFAULT_MAX_UPLOAD_BYTES, presign_ttl: DEFAULT_PRESIGN_TTL }
    }
}

/// Answer of `POST /v1/uploads`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UploadResponse {
    /// Use this as the `audio_uri` of a separation request: `upload:<sha256>.<ext>`, the
    /// caller's own upload (another owner's submit of it names its own upload).
    pub audio_uri: String,
    /// Size of the upload.
    pub bytes: u64,
    /// Lowercase hex SHA-256 of the upload.
    pub sha256: String,
    /// How long it plays, in milliseconds, when its header says (WAV, FLAC): what
    /// credits a job of it costs is then known at submit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
}

/// The scheme of the `audio_uri` an upload answers with (see the module doc).
pub const UPLOAD_SCHEME: &str = "upload";

/// The `audio_uri` of the caller's upload stored under the file name `file`
/// (`<sha256>.<ext>`).
pub fn upload_uri(file: &str) -> String {
    format!("{UPLOAD_SCHEME}:{file}")
}

/// An `upload:` name resolved to one of the owner's uploads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upload {
    /// Its key in the store (`uploads/<owner>/<sha256>.<ext>`).
    pub key: String,
    /// Its URI in the store: what the job reads.
    pub uri: String,
}

/// Resolves an `upload:<sha256>.<ext>` `audio_uri` to `owner`'s upload of that name in
/// the store (the first of `stores`, the ingress's one); `Ok(None)` for any other URI,
/// which is checked as it is.
pub fn resolve(audio_uri: &str, owner: &str, stores: &[String]) -> Result<Option<Upload>, RequestError> {
    let Some((scheme, file)) = audio_uri.split_once(':') else {
        return Ok(None);
    };
    if !scheme.eq_ignore_ascii_case(UPLOAD_SCHEME) {
        return Ok(None);
    }
    let refuse = |message: String| RequestError { field: "audio_uri".into(), message };
    let (sha, ext) = file.split_once('.').unwrap_or((file, ""));
    let hex = |s: &str| s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let plain = |s: &str| (1..=8).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !hex(sha) || !plain(ext) {
        return Err(refuse(format!(
            "`{audio_uri}` is not an upload: use the audio_uri POST /v1/uploads answered (upload:<sha256>.<ext>)"
        )));
    }
    let Some(store) = stores.first() else {
        return Err(refuse("this ingress has no object store configured, so it has no uploads".into()));
    };
    let key = format!("{}{file}", stemq_core::uri::uploads_prefix(owner));
    Ok(Some(Upload { uri: format!("{}/{key}", store.trim_end_matches('/')), key }))
}

/// The query of `POST /v1/uploads`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct UploadQuery {
    /// The song's file name; its extension (at most 8 letters or digits) is kept, else the
    /// one of the `Content-Type` (`bin` for other types).
    #[schemars(regex(pattern = r"(^[^.]*|\.[A-Za-z0-9]{0,8})$"))]
    filename: Option<String>,
}

pub(crate) fn no_store() -> ApiError {
    ApiError { code: ErrorCode::NoStore, message: "this ingress has no object store configured".into(), field: None }
}

fn bad(code: ErrorCode, message: String) -> ApiError {
    ApiError::new(code, message)
}

/// The file extension: from `?filename=`, else from the content type, else `bin`.
fn extension(q: &UploadQuery, headers: &HeaderMap) -> Result<String, ApiError> {
    if let Some(name) = &q.filename {
        let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase()).unwrap_or_default();
        if ext.is_empty() {
            return Ok("bin".into());
        }
        if ext.len() > 8 || !ext.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(ApiError {
                code: ErrorCode::InvalidRequest,
                message: format!("the extension of `{name}` is not a plain extension"),
                field: Some("filename".into()),
            });
        }
        return Ok(ext);
    }
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let ct = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    Ok(match ct.as_str() {
        "audio/wav" | "audio/x-wav" | "audio/wave" | "audio/vnd.wave" => "wav",
        "audio/flac" | "audio/x-flac" => "flac",
        "audio/mpeg" | "audio/mp3" => "mp3",
        "audio/ogg" | "audio/vorbis" | "application/ogg" => "ogg",
        "audio/opus" => "opus",
        "audio/mp4" | "audio/m4a" | "audio/x-m4a" | "audio/aac" | "audio/aacp" => "m4a",
        "video/mp4" => "mp4",
        "audio/webm" | "video/webm" => "webm",
        "audio/x-matroska" | "video/x-matroska" => "mka",
        "audio/aiff" | "audio/x-aiff" => "aiff",
        "audio/x-caf" => "caf",
        _ => "bin",
    }
    .to_string())
}

pub(crate) async fn upload(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<UploadQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let storage = state.storage.clone().ok_or_else(no_store)?;
    let limit = storage.max_upload_bytes;
    let too_large = || bad(ErrorCode::TooLarge, format!("uploads are limited to {limit} bytes"));
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let ext = extension(&q, &headers)?;
    let tmp = format!("incoming/{}", uuid::Uuid::new_v4());
    let span = info_span!("upload", tmp = %tmp);
    async move {
        // The first bytes are kept: the header says how long the audio plays.
        let head = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let tee = head.clone();
        let stream = body.into_data_stream().map_ok(move |chunk| {
            let mut h = tee.lock().expect("head lock");
            if h.len() < HEAD_BYTES {
                let take = (HEAD_BYTES - h.len()).min(chunk.len());
                h.extend_from_slice(&chunk[..take]);
            }
            chunk
        });
        let stored = match storage.store.put_stream(&tmp, stream, limit).await {
            Ok(s) => s,
            Err(StorageError::TooLarge { .. }) => return Err(too_large()),
            Err(StorageError::Source(m)) => {
                return Err(bad(ErrorCode::UploadInterrupted, format!("the upload did not complete: {m}")))
            }
            Err(e) => {
                warn!(error = %e, "upload not stored");
                return Err(bad(ErrorCode::Unavailable, "the store is unavailable; retrying is safe".into()));
            }
        };
        if stored.bytes == 0 {
            let _ = storage.store.delete(&tmp).await;
            return Err(bad(ErrorCode::EmptyUpload, "the upload is empty".into()));
        }
        let key = format!("{}{}.{ext}", stemq_core::uri::uploads_prefix(&caller.owner), stored.sha256);
        if let Err(e) = storage.store.rename(&tmp, &key).await {
            warn!(error = %e, "upload not moved to its final key");
            let _ = storage.store.delete(&tmp).await;
            return Err(bad(ErrorCode::Unavailable, "the store is unavailable; retrying is safe".into()));
        }
        let duration_ms = crate::credits::header_duration_ms(&head.lock().expect("head lock"));
        let meta = serde_json::to_vec(&crate::credits::UploadMeta { duration_ms }).expect("json");
        if let Err(e) = storage.store.put_bytes(&crate::credits::meta_key(&key), meta).await {
            // Only the early 402 needs it; the worker measures the audio anyway.
            warn!(error = %e, "upload facts not stored");
        }
        let file = format!("{}.{ext}", stored.sha256);
        let resp =
            UploadResponse { audio_uri: upload_uri(&file), bytes: stored.bytes, sha256: stored.sha256, duration_ms };
        info!(event = "upload.stored", bytes = resp.bytes, sha256 = %resp.sha256, "upload stored");
        Ok((StatusCode::CREATED, Json(resp)).into_response())
    }
    .instrument(span)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn upload_uris_resolve_to_the_callers_own_upload() {
        let stores = ["file:///srv/store".to_string()];
        let uri = upload_uri(&format!("{SHA}.wav"));
        assert_eq!(uri, format!("upload:{SHA}.wav"));
        let up = resolve(&uri, "acme", &stores).unwrap().unwrap();
        assert_eq!(up.uri, format!("file:///srv/store/uploads/acme/{SHA}.wav"));
        assert_eq!(up.key, format!("uploads/acme/{SHA}.wav"));
        let up = resolve(&uri, "bob", &["s3://b/p/".to_string()]).unwrap().unwrap();
        assert_eq!(up.uri, format!("s3://b/p/uploads/bob/{SHA}.wav"));
        // Other URIs are left to the store checks.
        for other in ["file:///srv/store/uploads/acme/x.wav", "https://example.com/a.wav", "s3://b/k", "nonsense"] {
            assert_eq!(resolve(other, "acme", &stores).unwrap(), None, "{other}");
        }
    }

    #[test]
    fn only_upload_names_resolve() {
        let stores = ["file:///srv/store".to_string()];
        for bad in [
            "upload:".to_string(),
            format!("upload:{SHA}"),
            format!("upload:{}.wav", &SHA[1..]),
            format!("upload:{}.wav", SHA.to_uppercase()),
            format!("upload:{SHA}.wav/../../x"),
            format!("upload:../{SHA}.wav"),
            format!("upload:{SHA}.toolongext"),
            format!("upload:{SHA}.w%2e"),
        ] {
            assert_eq!(resolve(&bad, "acme", &stores).unwrap_err().field, "audio_uri", "{bad}");
        }
        let none = resolve(&upload_uri(&format!("{SHA}.wav")), "acme", &[]).unwrap_err();
        assert!(none.message.contains("no object store"), "{}", none.message);
    }
}
