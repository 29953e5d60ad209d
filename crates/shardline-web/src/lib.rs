/*!
The HTTP API of the Shardline orchestrator, under `/api/v1`: pipelines, runs, tasks, attempts,
workers, logs and storage (retention and disk use) to read; submissions, cancels and retries; lint; a server-sent event stream of
run and task state changes; and its own OpenAPI document at `/api/v1/openapi.json`.

**Owns:** HTTP, API tokens' secrets and scopes, redaction, what the dashboard computes from
rows, and the dashboard's files. **Must not depend on:** the engine or the data plane (it
submits through `shardline-control` and reads typed payloads and outputs from there), and runs
no SQL of its own (every statement is in `shardline-store`).

Errors are JSON, `{"error": {"code": "…", "message": "…"}}`, with a fitting status (400 bad
input, 401 no/unknown/revoked token, 403 insufficient scope, 404 unknown run or task, 409 a
state conflict such as cancelling a finished run, 422 a spec that does not lint).

Authentication is by API token, see [`auth`]: mutations always need one (`submit` for
`POST /runs`, `admin` for cancel and retry); reads need one (`read`) only with
[`AuthMode::ReadRequiresToken`].

Parameters, specs, task payloads, outputs and progress are returned with secrets redacted
(see [`redact`]).

```no_run
# async fn demo() -> Result<(), Box<dyn std::error::Error>> {
let store = shardline_store::Store::connect("sqlite::memory:").await?;
let state = shardline_web::AppState::new(store);
let (_tx, rx) = tokio::sync::watch::channel(false);
shardline_web::serve("127.0.0.1:8080".parse()?, state, rx).await?;
# Ok(()) }
```
*/

pub mod api;
pub mod auth;
pub mod dto;
pub mod dto_page;
pub mod dto_storage;
pub mod error;
pub mod metrics;
pub mod outcome;
pub mod redact;
pub mod ui;
pub mod view;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use shardline_store::Store;
use tokio::sync::watch;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::OpenApi;

pub use auth::{AuthMode, Scope};

/// What the handlers share.
#[derive(Clone, Debug)]
pub struct AppState {
    pub store: Store,
    /// Whether reads need a token.
    pub auth: AuthMode,
    /// Directory relative paths of submitted specs resolve against.
    pub base_dir: PathBuf,
    /// Root of run work directories.
    pub work_dir: PathBuf,
    /// How often the event stream looks for new events.
    pub event_poll: Duration,
    /// Where submitted specs may read and write (the server's path policy); `None`: anywhere.
    pub policy: Option<Arc<shardline_spec::policy::PathPolicy>>,
    /// The object-store artifact store runs are submitted with (`None`: `work_dir`).
    pub artifacts: Option<String>,
    /// What `/metrics` serves (absent: it answers 404).
    pub metrics: Option<Arc<shardline_metrics::Metrics>>,
    /// Set by [`serve`]: event streams end when it turns true.
    stop: Option<watch::Receiver<bool>>,
}

impl AppState {
    /// Open reads, the current directory as base and `.shardline` as work directory, events
    /// polled every 250 ms.
    pub fn new(store: Store) -> AppState {
        AppState {
            store,
            auth: AuthMode::Open,
            base_dir: PathBuf::from("."),
            work_dir: PathBuf::from(".shardline"),
            event_poll: Duration::from_millis(250),
            metrics: None,
            artifacts: None,
            policy: None,
            stop: None,
        }
    }

    /// Whether the server is shutting down.
    pub(crate) fn stopping(&self) -> bool {
        self.stop.as_ref().is_some_and(|rx| *rx.borrow())
    }

    pub fn with_auth(mut self, auth: AuthMode) -> AppState {
        self.auth = auth;
        self
    }
}

struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
    }
}

/// The OpenAPI document of the API.
#[derive(OpenApi)]
#[openapi(
    info(title = "Shardline API", description = "Runs, tasks, workers, logs and events of the Shardline orchestrator."),
    paths(
        api::list_pipelines, api::get_pipeline, api::list_triggers, api::list_runs, api::get_run, api::run_tasks, api::run_graph, api::run_view,
        api::get_task, api::task_attempts,
        api::list_workers, api::storage, api::run_logs, api::submit_run, api::cancel_run, api::retry_run, api::lint, api::events,
        openapi_json
    ),
    modifiers(&BearerScheme),
    tags((name = "runs"), (name = "tasks"), (name = "pipelines"), (name = "workers"), (name = "storage"), (name = "events"))
)]
pub struct ApiDoc;

/// This document.
#[utoipa::path(get, path = "/api/v1/openapi.json", tag = "meta", responses((status = 200, description = "OpenAPI 3.1 document")))]
async fn openapi_json() -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json(ApiDoc::openapi())
}

/// Every route of the API.
pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/pipelines", get(api::list_pipelines))
        .route("/pipelines/{name}", get(api::get_pipeline))
        .route("/triggers", get(api::list_triggers))
        .route("/runs", get(api::list_runs).post(api::submit_run))
        .route("/runs/{id}", get(api::get_run))
        .route("/runs/{id}/tasks", get(api::run_tasks))
        .route("/runs/{id}/graph", get(api::run_graph))
        .route("/runs/{id}/view", get(api::run_view))
        .route("/runs/{id}/logs", get(api::run_logs))
        .route("/runs/{id}/cancel", post(api::cancel_run))
        .route("/runs/{id}/retry", post(api::retry_run))
        .route("/tasks/{id}", get(api::get_task))
        .route("/tasks/{id}/attempts", get(api::task_attempts))
        .route("/workers", get(api::list_workers))
        .route("/storage", get(api::storage))
        .route("/lint", post(api::lint))
        .route("/events", get(api::events))
        .route("/openapi.json", get(openapi_json));
    Router::new().nest("/api/v1", v1).route("/metrics", get(metrics::metrics)).fallback(ui::serve_ui).with_state(state)
}

/// Serves the API on `addr` until `shutdown` turns true (in-flight requests finish; event
/// streams end).
pub async fn serve(addr: SocketAddr, state: AppState, shutdown: watch::Receiver<bool>) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(listener, state, shutdown).await
}

/// Like [`serve`], on a bound listener (so a caller can bind port 0 and learn the port first).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    mut state: AppState,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    state.stop = Some(shutdown.clone());
    tracing::info!("HTTP API listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            while !*shutdown.borrow_and_update() {
                if shutdown.changed().await.is_err() {
                    break;
                }
            }
        })
        .await
}
