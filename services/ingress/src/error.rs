//! [`ApiError`]: the one shape of every error the API answers, and how the failures of
//! a submit and of a view read become one.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::JsonSchema;
use serde::Serialize;
use stemq_core::read::ViewError;
use tracing::warn;

use crate::submit::SubmitError;

/// An API error: its status and [`ErrorBody`]. A 503 also says when to try again
/// (`Retry-After: 2`).
#[derive(Debug)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) field: Option<String>,
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
    /// Stable and matchable: `invalid_request`, `not_found`, `unauthorized`, ... (every
    /// code and its status are listed in docs/api.md).
    #[schemars(regex(pattern = r"^[a-z][a-z_]*$"))]
    pub code: &'static str,
    /// A sentence for people; never parse it.
    pub message: String,
    /// The offending request field or parameter, where there is one (422).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: ErrorDetail { code: self.code, message: self.message, field: self.field } };
        let mut resp = (self.status, Json(body)).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("2"));
        }
        resp
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Invalid(r) => ApiError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                code: "invalid_request",
                message: r.to_string(),
                field: Some(r.field),
            },
            SubmitError::Refused(e) => e,
            SubmitError::Unserved { .. } => ApiError {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                code: "model_not_served",
                message: e.to_string(),
                field: Some("model".into()),
            },
            SubmitError::Limited(l) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                code: if l.limit == "rate" { "rate_limited" } else { "too_many_in_flight" },
                message: l.message,
                field: None,
            },
            e @ SubmitError::Unavailable { .. } => {
                warn!(error = %stemq_core::error::report(&e), "submit failed");
                ApiError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    code: "unavailable",
                    message: "the job could not be queued right now; retrying is safe".into(),
                    field: None,
                }
            }
        }
    }
}

pub(crate) fn internal(e: impl std::fmt::Display) -> ApiError {
    warn!(error = %e, "internal error");
    store_unavailable()
}

/// 503 without internals: the cause is logged where it happened.
pub(crate) fn store_unavailable() -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: "unavailable",
        message: "status store unavailable; try again".into(),
        field: None,
    }
}

/// A view that cannot be read (the bucket or the log is unreachable, or the stored view
/// does not parse) is 503, whatever the cause; the cause goes to the log only.
impl From<ViewError> for ApiError {
    fn from(e: ViewError) -> ApiError {
        warn!(job_id = %e.job_id(), error = %stemq_core::error::report(&e), "cannot read a job's view");
        store_unavailable()
    }
}
