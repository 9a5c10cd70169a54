//! [`ApiError`]: the one shape of every error the API answers, and how the failures of
//! a submit, a limit and a view read become one, for HTTP and NATS alike.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{json, Value};
use stemq_nats::read::ViewError;
use tracing::warn;

use crate::error_code::ErrorCode;
use crate::limits::Limited;
use crate::submit::SubmitError;

/// An API error: its code (which fixes its status) and [`ErrorBody`]. A 503 also says
/// when to try again (`Retry-After: 2`).
#[derive(Debug)]
pub struct ApiError {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    pub(crate) field: Option<String>,
}

impl ApiError {
    /// `code` with `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into(), field: None }
    }

    /// The HTTP status ([`ErrorCode::status`]).
    pub fn status(&self) -> StatusCode {
        self.code.status()
    }

    /// The body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody { error: ErrorDetail { code: self.code, message: self.message.clone(), field: self.field.clone() } }
    }

    /// The reply of the NATS submit endpoint: the body, with the status as
    /// `http_status` (and `retry_after`, seconds, when the refusal says).
    pub fn nats_reply(&self, retry_after: Option<u64>) -> Value {
        let mut v = serde_json::to_value(self.body()).expect("an error body serialises");
        v["http_status"] = json!(self.status().as_u16());
        if let Some(s) = retry_after {
            v["retry_after"] = json!(s);
        }
        v
    }
}

/// The body of every error the API answers (the `Error` schema of `/openapi.json`).
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "Error")]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// What went wrong, for programs (`code`) and for people (`message`).
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorDetail {
    /// Stable and matchable; every code and its status are listed in docs/api.md.
    pub code: ErrorCode,
    /// A sentence for people; never parse it.
    pub message: String,
    /// The offending request field or parameter, where there is one (422).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut resp = (status, Json(self.body())).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert("retry-after", HeaderValue::from_static("2"));
        }
        resp
    }
}

/// A limit's refusal: 429, `rate_limited` for a token bucket (submits, replays),
/// `too_many_in_flight` for the cap on jobs in flight.
impl From<&Limited> for ApiError {
    fn from(l: &Limited) -> ApiError {
        ApiError::new(l.limit.code(), l.message.clone())
    }
}

/// The failures of a submit, as HTTP answers them and the NATS endpoint replies them.
impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Invalid(r) => {
                ApiError { code: ErrorCode::InvalidRequest, message: r.to_string(), field: Some(r.field) }
            }
            SubmitError::Refused(e) => e,
            SubmitError::Unserved { .. } => {
                ApiError { code: ErrorCode::ModelNotServed, message: e.to_string(), field: Some("model".into()) }
            }
            SubmitError::Limited(l) => ApiError::from(&l),
            e @ SubmitError::Unavailable { .. } => {
                warn!(error = %stemq_nats::error::report(&e), "submit failed");
                ApiError {
                    code: ErrorCode::Unavailable,
                    message: "the job could not be queued right now; retrying is safe".into(),
                    field: None,
                }
            }
        }
    }
}

pub(crate) fn internal(e: impl std::error::Error) -> ApiError {
    warn!(error = %stemq_nats::error::report(&e), "internal error");
    store_unavailable()
}

/// 503 without internals: the cause is logged where it happened.
pub(crate) fn store_unavailable() -> ApiError {
    ApiError { code: ErrorCode::Unavailable, message: "status store unavailable; try again".into(), field: None }
}

/// A view that cannot be read (the bucket or the log is unreachable, or the stored view
/// does not parse) is 503, whatever the cause; the cause goes to the log only.
impl From<ViewError> for ApiError {
    fn from(e: ViewError) -> ApiError {
        warn!(job_id = %e.job_id(), error = %stemq_nats::error::report(&e), "cannot read a job's view");
        store_unavailable()
    }
}
