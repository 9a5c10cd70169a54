//! `POST /v1/uploads`: a song goes into the store, content-addressed.
//!
//! This module owns the upload path and the ingress's storage settings. The request
//! body is streamed (never held in memory) to a temporary object while it is hashed and
//! counted; past the size limit the upload stops with 413 and nothing is kept. A
//! complete upload is moved to `uploads/<owner>/<sha256>.<ext>`, so the same song
//! uploaded twice by one owner is one object and yields the same `audio_uri` (and so the
//! same job id), and a job can read only its own owner's uploads.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Extension, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::TryStreamExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use stemq_core::auth::Caller;
use stemq_core::storage::{StorageError, Store};
use tracing::{info, info_span, warn, Instrument};

use crate::{ApiError, AppState};

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
    /// Use this as the `audio_uri` of a separation request.
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

#[derive(Deserialize)]
pub(crate) struct UploadQuery {
    filename: Option<String>,
}

pub(crate) fn no_store() -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: "no_store",
        message: "this ingress has no object store configured".into(),
        field: None,
    }
}

fn bad(status: StatusCode, code: &'static str, message: String) -> ApiError {
    ApiError { status, code, message, field: None }
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
                status: StatusCode::UNPROCESSABLE_ENTITY,
                code: "invalid_request",
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
        "audio/ogg" | "audio/vorbis" => "ogg",
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
    let too_large = || bad(StatusCode::PAYLOAD_TOO_LARGE, "too_large", format!("uploads are limited to {limit} bytes"));
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
        let stream = body.into_data_stream().map_err(|e| e.to_string()).map_ok(move |chunk| {
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
                return Err(bad(
                    StatusCode::BAD_REQUEST,
                    "upload_interrupted",
                    format!("the upload did not complete: {m}"),
                ))
            }
            Err(e) => {
                warn!(error = %e, "upload not stored");
                return Err(bad(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the store is unavailable; retrying is safe".into(),
                ));
            }
        };
        if stored.bytes == 0 {
            let _ = storage.store.delete(&tmp).await;
            return Err(bad(StatusCode::UNPROCESSABLE_ENTITY, "empty_upload", "the upload is empty".into()));
        }
        let key = format!("{}{}.{ext}", stemq_core::uri::uploads_prefix(&caller.owner), stored.sha256);
        if let Err(e) = storage.store.rename(&tmp, &key).await {
            warn!(error = %e, "upload not moved to its final key");
            let _ = storage.store.delete(&tmp).await;
            return Err(bad(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the store is unavailable; retrying is safe".into(),
            ));
        }
        let duration_ms = crate::credits::header_duration_ms(&head.lock().expect("head lock"));
        let meta = serde_json::to_vec(&crate::credits::UploadMeta { duration_ms }).expect("json");
        if let Err(e) = storage.store.put_bytes(&crate::credits::meta_key(&key), meta).await {
            // Only the early 402 needs it; the worker measures the audio anyway.
            warn!(error = %e, "upload facts not stored");
        }
        let resp = UploadResponse {
            audio_uri: storage.store.uri(&key),
            bytes: stored.bytes,
            sha256: stored.sha256,
            duration_ms,
        };
        info!(event = "upload.stored", bytes = resp.bytes, sha256 = %resp.sha256, "upload stored");
        Ok((StatusCode::CREATED, Json(resp)).into_response())
    }
    .instrument(span)
    .await
}
