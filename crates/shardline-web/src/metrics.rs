//! `GET /metrics`: the orchestrator's Prometheus metrics (see `shardline-metrics`), behind the
//! same read access as the API (a scraper sends `Authorization: Bearer shl_…` when reads need a
//! token).

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::auth::{authorize, Scope};
use crate::error::ApiError;
use crate::AppState;

/// The OpenMetrics text format, which `prometheus-client` writes and Prometheus reads.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorize(&state.store, state.auth, &headers, Scope::Read).await?;
    let Some(metrics) = &state.metrics else {
        return Err(ApiError::not_found("This server does not serve metrics."));
    };
    let text = metrics.render().await.map_err(|e| {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", format!("Metrics cannot be read now: {e}"))
    })?;
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response())
}
