//! Errors as JSON: `{"error": {"code": "...", "message": "..."}}` with a fitting status.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use shardline_store::StoreError;
use utoipa::ToSchema;

use crate::dto::DiagnosticDto;

/// The body of every error response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong, and what to do about it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable, snake_case identifier: `not_found`, `conflict`, `lint_failed`, `unauthorized`, …
    pub code: String,
    /// A sentence a person can act on.
    pub message: String,
    /// Lint diagnostics of a refused spec (`lint_failed` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnostics: Option<Vec<DiagnosticDto>>,
}

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub diagnostics: Option<Vec<DiagnosticDto>>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), diagnostics: None }
    }
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
    pub fn internal(what: &str, detail: impl std::fmt::Display) -> ApiError {
        tracing::error!("{what}: {detail}");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("The server could not {what}; try again, and check the server log if it persists."),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail { code: self.code.to_string(), message: self.message, diagnostics: self.diagnostics },
        };
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match &e {
            StoreError::RunNotFound(run) => {
                ApiError::not_found(format!("Run {run} does not exist; list runs with GET /api/v1/runs."))
            }
            StoreError::TaskNotFound(task) => ApiError::not_found(format!("Task {task} does not exist.")),
            StoreError::PipelineNotFound(p) => ApiError::not_found(format!("Pipeline {p} does not exist.")),
            StoreError::RunState { .. } | StoreError::TaskState { .. } | StoreError::DedupeConflict { .. } => {
                ApiError::new(StatusCode::CONFLICT, "conflict", capitalize(&e.to_string()))
            }
            StoreError::UnknownStep { .. } | StoreError::InvalidTasks { .. } | StoreError::InvalidArgument(_) => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid", capitalize(&e.to_string()))
            }
            _ => ApiError::internal("reach the job store", &e),
        }
    }
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect::<String>() + if s.ends_with('.') { "" } else { "." },
        None => String::new(),
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        let status = r.status();
        let code = if status == StatusCode::UNSUPPORTED_MEDIA_TYPE { "unsupported_media_type" } else { "bad_request" };
        ApiError::new(status, code, format!("The request body is not valid JSON for this endpoint: {}.", r.body_text()))
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> ApiError {
        ApiError::bad_request(format!("Invalid query parameters: {}.", r.body_text()))
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> ApiError {
        ApiError::bad_request(format!("Invalid path: {} (ids are integers).", r.body_text()))
    }
}
