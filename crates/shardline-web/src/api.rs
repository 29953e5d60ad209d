//! The handlers of `/api/v1`.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{FromRequest, FromRequestParts, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use futures_util::stream::{self, Stream};
use serde_json::Value;
use shardline_store::{LogFilter, Page, RunFilter, RunId, RunState, TaskId};

use crate::auth::{authorize, Scope};
use crate::dto::*;
use crate::error::{ApiError, ErrorBody};
use crate::AppState;

/// `Json` whose rejections are JSON errors.
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct Json<T>(pub T);

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> axum::response::Response {
        axum::Json(self.0).into_response()
    }
}

/// `Query` whose rejections are JSON errors.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

/// `Path` whose rejections are JSON errors.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

type ApiResult<T> = Result<T, ApiError>;

async fn read_access(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    authorize(&state.store, state.auth, headers, Scope::Read).await.map(|_| ())
}

/// Who a mutation is recorded as: the token that authorized it (mutations always need one).
fn actor_of(token: Option<crate::auth::TokenInfo>) -> String {
    token.map_or_else(|| "anonymous".to_string(), |t| shardline_control::actor::token(&t.name))
}

async fn find_run(state: &AppState, id: i64) -> ApiResult<shardline_store::RunRow> {
    state
        .store
        .get_run(RunId(id))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("Run {id} does not exist; list runs with GET /api/v1/runs.")))
}

/// Pipelines with a stored spec, by name.
#[utoipa::path(get, path = "/api/v1/pipelines", tag = "pipelines",
    responses((status = 200, body = Vec<PipelineDto>), (status = 401, body = ErrorBody)))]
pub async fn list_pipelines(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Json<Vec<PipelineDto>>> {
    read_access(&state, &headers).await?;
    let rows = state.store.list_pipelines().await?;
    Ok(Json(
        rows.into_iter()
            .map(|p| PipelineDto {
                name: p.name,
                versions: p.versions,
                latest_id: p.latest_id,
                latest_spec_hash: p.latest_spec_hash,
            })
            .collect(),
    ))
}

/// A pipeline's newest spec text (secrets redacted).
#[utoipa::path(get, path = "/api/v1/pipelines/{name}", tag = "pipelines",
    params(("name" = String, Path, description = "Pipeline name")),
    responses((status = 200, body = PipelineDetailDto), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)))]
pub async fn get_pipeline(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult<Json<PipelineDetailDto>> {
    read_access(&state, &headers).await?;
    let p = state.store.latest_pipeline(&name).await?.ok_or_else(|| {
        ApiError::not_found(format!("There is no pipeline named `{name}`; list them with GET /api/v1/pipelines."))
    })?;
    let params = declared_params(&name, &p.spec_text, &state);
    Ok(Json(PipelineDetailDto {
        name,
        versions: p.versions,
        latest_id: p.id,
        latest_spec_hash: p.spec_hash,
        params,
        spec_text: crate::redact::redact_text(&p.spec_text),
    }))
}

/// The params a stored spec declares; none when it does not lint any more (a model config
/// that moved, say): the form then falls back to the text.
fn declared_params(name: &str, text: &str, state: &AppState) -> Vec<ParamDto> {
    let file = format!("{name}.yaml");
    let (pipeline, _) = shardline_spec::lint(&file, text, &shardline_control::lint_context(&state.base_dir));
    pipeline.map(|p| p.params.iter().map(ParamDto::from).collect()).unwrap_or_default()
}

/// Every pipeline's triggers with their last and next firing, by pipeline and position.
#[utoipa::path(get, path = "/api/v1/triggers", tag = "pipelines",
    responses((status = 200, body = Vec<TriggerDto>), (status = 401, body = ErrorBody)))]
pub async fn list_triggers(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Json<Vec<TriggerDto>>> {
    read_access(&state, &headers).await?;
    let triggers = state.store.list_triggers().await?;
    Ok(Json(triggers.iter().map(TriggerDto::from).collect()))
}

/// Runs, newest first, a page at a time (keyset paging on the run id).
#[utoipa::path(get, path = "/api/v1/runs", tag = "runs", params(RunsQuery),
    responses((status = 200, body = RunPageDto), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)))]
pub async fn list_runs(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<RunsQuery>,
) -> ApiResult<Json<RunPageDto>> {
    read_access(&state, &headers).await?;
    let run_state = match q.state.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(s.parse::<RunState>().map_err(|_| {
            ApiError::bad_request(format!(
                "Unknown run state `{s}`; use one of queued, running, succeeded, failed, cancelled."
            ))
        })?),
    };
    let limit = q.limit.unwrap_or(50);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request(format!("`limit` must be between 1 and 1000, not {limit}.")));
    }
    let filter = RunFilter { state: run_state, pipeline: q.pipeline.filter(|s| !s.is_empty()) };
    let page = state.store.list_runs(&filter, Page { limit, before: q.before.map(RunId) }).await?;
    Ok(Json(RunPageDto { runs: page.runs.iter().map(RunDto::from).collect(), next: page.next.map(|r| r.0) }))
}

/// A run with its task counts, resolved spec and plan (secrets redacted).
#[utoipa::path(get, path = "/api/v1/runs/{id}", tag = "runs", params(("id" = i64, Path, description = "Run id")),
    responses((status = 200, body = RunDetailDto), (status = 404, body = ErrorBody)))]
pub async fn get_run(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> ApiResult<Json<RunDetailDto>> {
    read_access(&state, &headers).await?;
    let run = find_run(&state, id).await?;
    let notifications = state.store.run_notifications(RunId(id)).await?;
    let mut detail = RunDetailDto::new(&run, &notifications);
    detail.disk_bytes = state.store.run_disk_bytes(RunId(id)).await?;
    Ok(Json(detail))
}

/// A run's tasks as the dashboard shows them: with progress, rate, ETA and why each waits.
async fn annotated_tasks(state: &AppState, run: RunId, full: bool) -> ApiResult<Vec<TaskDto>> {
    let tasks = state.store.run_tasks(run).await?;
    let deps = state.store.run_deps(run).await?;
    annotate(state, &tasks, &deps, full).await
}

async fn annotate(
    state: &AppState,
    tasks: &[shardline_store::TaskRow],
    deps: &[shardline_store::TaskDep],
    full: bool,
) -> ApiResult<Vec<TaskDto>> {
    let needs_workers = tasks.iter().any(|t| t.state == shardline_store::TaskState::Ready);
    let (workers, held) = if needs_workers {
        let held = state
            .store
            .leased_tasks()
            .await?
            .into_iter()
            .map(|l| crate::view::Held { worker: l.owner.0, resources: l.resources })
            .collect();
        (state.store.list_workers().await?, held)
    } else {
        (Vec::new(), Vec::new())
    };
    // A queued run whose ready tasks are not claimed may be held back by its pipeline's limit
    // or its pool: that is the reason to show, not the workers.
    let mut limits = HashMap::new();
    let runs: BTreeSet<RunId> =
        tasks.iter().filter(|t| t.state == shardline_store::TaskState::Ready).map(|t| t.run).collect();
    for run in runs {
        if let Some(h) = state.store.held_back(run).await? {
            limits.insert(run, h);
        }
    }
    let now = chrono::Utc::now();
    let mut reasons = crate::view::reasons(tasks, deps, &workers, &held, &limits, now);
    let outputs = crate::view::outputs_by_name(tasks);
    Ok(tasks
        .iter()
        .map(|t| {
            let mut dto = if full { TaskDto::from(t) } else { TaskDto::summary(t) };
            dto.progress_info = crate::view::progress_of(t, &outputs, now);
            dto.reason = reasons.remove(&t.id.0);
            dto
        })
        .collect())
}

/// The tasks of a run, by id, with progress (bytes, rate, ETA) and why each waits.
#[utoipa::path(get, path = "/api/v1/runs/{id}/tasks", tag = "runs",
    params(("id" = i64, Path, description = "Run id"), TasksQuery),
    responses((status = 200, body = Vec<TaskDto>), (status = 404, body = ErrorBody)))]
pub async fn run_tasks(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    Query(q): Query<TasksQuery>,
) -> ApiResult<Json<Vec<TaskDto>>> {
    read_access(&state, &headers).await?;
    find_run(&state, id).await?;
    Ok(Json(annotated_tasks(&state, RunId(id), !q.summary.unwrap_or(false)).await?))
}

/// Everything a run's page shows, from one read of its tasks: the run, its step graph and its
/// tasks in summary form (as `GET /runs/{id}/graph` and `GET /runs/{id}/tasks?summary=true`),
/// where its result went, a timeline of its steps and tasks, and every attempt.
#[utoipa::path(get, path = "/api/v1/runs/{id}/view", tag = "runs", params(("id" = i64, Path, description = "Run id")),
    responses((status = 200, body = RunViewDto), (status = 404, body = ErrorBody)))]
pub async fn run_view(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> ApiResult<Json<RunViewDto>> {
    read_access(&state, &headers).await?;
    let run = find_run(&state, id).await?;
    let tasks = state.store.run_tasks(RunId(id)).await?;
    let deps = state.store.run_deps(RunId(id)).await?;
    let attempts = state.store.run_attempts(RunId(id)).await?;
    let steps = graph_steps(&run, &tasks, &deps);
    let result = crate::outcome::result_of(&tasks);
    let spans = crate::outcome::timeline(&tasks, &attempts);
    let (start, end) = crate::outcome::bounds(&spans, chrono::Utc::now()).unzip();
    let timeline = TimelineDto { start, end, steps: spans };
    let tasks = annotate(&state, &tasks, &deps, false).await?;
    let notifications = state.store.run_notifications(RunId(id)).await?.iter().map(NotificationDto::from).collect();
    let attempts = attempts.iter().map(AttemptDto::from).collect();
    let disk_bytes = state.store.run_disk_bytes(RunId(id)).await?;
    Ok(Json(RunViewDto {
        run: RunDto::from(&run),
        steps,
        tasks,
        notifications,
        result,
        timeline,
        attempts,
        disk_bytes,
    }))
}

fn graph_steps(
    run: &shardline_store::RunRow,
    tasks: &[shardline_store::TaskRow],
    deps: &[shardline_store::TaskDep],
) -> Vec<StepDto> {
    crate::view::steps(&run.spec, tasks, deps)
        .into_iter()
        .map(|mut s| {
            s.id = crate::redact::redact_line(&s.id);
            s
        })
        .collect()
}

/// The step graph of a run: each step's needs, state, fan-out and task counts, bytes.
#[utoipa::path(get, path = "/api/v1/runs/{id}/graph", tag = "runs", params(("id" = i64, Path, description = "Run id")),
    responses((status = 200, body = GraphDto), (status = 404, body = ErrorBody)))]
pub async fn run_graph(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> ApiResult<Json<GraphDto>> {
    read_access(&state, &headers).await?;
    let run = find_run(&state, id).await?;
    let tasks = state.store.run_tasks(RunId(id)).await?;
    let deps = state.store.run_deps(RunId(id)).await?;
    Ok(Json(GraphDto { run: id, steps: graph_steps(&run, &tasks, &deps) }))
}

/// One task, with progress and why it waits.
#[utoipa::path(get, path = "/api/v1/tasks/{id}", tag = "tasks", params(("id" = i64, Path, description = "Task id")),
    responses((status = 200, body = TaskDto), (status = 404, body = ErrorBody)))]
pub async fn get_task(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> ApiResult<Json<TaskDto>> {
    read_access(&state, &headers).await?;
    let task =
        state.store.task(TaskId(id)).await?.ok_or_else(|| ApiError::not_found(format!("Task {id} does not exist.")))?;
    let full = TaskDto::from(&task);
    let annotated = annotated_tasks(&state, task.run, false).await?.into_iter().find(|t| t.id == id);
    Ok(Json(match annotated {
        Some(a) => TaskDto { progress_info: a.progress_info, reason: a.reason, ..full },
        None => full,
    }))
}

/// The attempts (leases) of a task, oldest first.
#[utoipa::path(get, path = "/api/v1/tasks/{id}/attempts", tag = "tasks", params(("id" = i64, Path, description = "Task id")),
    responses((status = 200, body = Vec<AttemptDto>), (status = 404, body = ErrorBody)))]
pub async fn task_attempts(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> ApiResult<Json<Vec<AttemptDto>>> {
    read_access(&state, &headers).await?;
    if state.store.task(TaskId(id)).await?.is_none() {
        return Err(ApiError::not_found(format!("Task {id} does not exist.")));
    }
    let attempts = state.store.task_attempts(TaskId(id)).await?;
    Ok(Json(attempts.iter().map(AttemptDto::from).collect()))
}

/// The retention policy and what each state directory's gc last measured: its totals and the
/// largest step cache entries and downloads.
#[utoipa::path(get, path = "/api/v1/storage", tag = "storage",
    responses((status = 200, body = StorageDto), (status = 401, body = ErrorBody)))]
pub async fn storage(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Json<StorageDto>> {
    read_access(&state, &headers).await?;
    let retention = state.store.retention_policy().await?.into();
    let reporters = state.store.disk_reporters().await?;
    let kinds = [shardline_store::DiskKind::Cache, shardline_store::DiskKind::Download];
    let caches = state.store.disk_usage(&kinds, 500).await?;
    Ok(Json(StorageDto {
        retention,
        reporters: reporters.iter().map(DiskReporterDto::from).collect(),
        caches: caches.iter().map(CacheUsageDto::from).collect(),
    }))
}

/// Registered workers with the tasks they hold and what those use.
#[utoipa::path(get, path = "/api/v1/workers", tag = "workers",
    responses((status = 200, body = Vec<WorkerDto>), (status = 401, body = ErrorBody)))]
pub async fn list_workers(State(state): State<AppState>, headers: HeaderMap) -> ApiResult<Json<Vec<WorkerDto>>> {
    read_access(&state, &headers).await?;
    let workers = state.store.list_workers().await?;
    let leased = state.store.leased_tasks().await?;
    Ok(Json(
        workers
            .iter()
            .map(|w| {
                let mut dto = WorkerDto::from(w);
                for l in leased.iter().filter(|l| l.owner == w.id) {
                    dto.used.cpus += l.resources.cpus;
                    dto.used.memory += l.resources.memory;
                    dto.used.gpus += l.resources.gpus;
                    dto.used.scratch += l.resources.scratch;
                    dto.leases.push(LeaseDto {
                        task: l.id.0,
                        run: l.run.0,
                        name: l.name.clone(),
                        step_id: l.step_id.clone(),
                    });
                }
                dto
            })
            .collect(),
    ))
}

/// Log lines of a run (or of one of its tasks), in order, a page at a time.
#[utoipa::path(get, path = "/api/v1/runs/{id}/logs", tag = "runs", params(("id" = i64, Path, description = "Run id"), LogsQuery),
    responses((status = 200, body = LogPageDto), (status = 404, body = ErrorBody)))]
pub async fn run_logs(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    Query(q): Query<LogsQuery>,
) -> ApiResult<Json<LogPageDto>> {
    read_access(&state, &headers).await?;
    find_run(&state, id).await?;
    let filter = match q.task {
        None => LogFilter::Run(RunId(id)),
        Some(t) => {
            match state.store.task(TaskId(t)).await? {
                Some(task) if task.run.0 == id => {}
                _ => return Err(ApiError::not_found(format!("Run {id} has no task {t}."))),
            }
            LogFilter::Task(TaskId(t))
        }
    };
    let after = q.after.unwrap_or(0);
    let limit = q.limit.unwrap_or(1000);
    if !(1..=shardline_store::MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "`limit` must be between 1 and {}, not {limit}.",
            shardline_store::MAX_PAGE
        )));
    }
    let rows = state.store.logs(filter, after, limit).await?;
    let next_after = rows.last().map_or(after, |r| r.id);
    let more = rows.len() as i64 >= limit;
    let needle = q.q.filter(|s| !s.is_empty()).map(|s| s.to_lowercase());
    // Search what is shown, so a secret cannot be probed for through `q`.
    let lines = rows
        .iter()
        .map(LogLineDto::from)
        .filter(|l| needle.as_ref().is_none_or(|n| l.line.to_lowercase().contains(n.as_str())))
        .collect();
    Ok(Json(LogPageDto { lines, next_after, more }))
}

fn diagnostics_of(file: &str, text: &str, state: &AppState) -> (bool, Vec<DiagnosticDto>) {
    let (pipeline, diagnostics) = shardline_spec::lint(file, text, &shardline_control::lint_context(&state.base_dir));
    let valid = pipeline.is_some() && diagnostics.iter().all(|d| d.severity != shardline_spec::Severity::Error);
    (valid, diagnostics.iter().map(DiagnosticDto::from).collect())
}

/// Submits a run of a spec (scope `submit`). Lint errors are refused with 422 and the diagnostics.
#[utoipa::path(post, path = "/api/v1/runs", tag = "runs", request_body = SubmitRequest,
    responses((status = 201, body = SubmittedDto, description = "A new run"),
        (status = 200, body = SubmittedDto, description = "The existing run of the dedupe key"),
        (status = 409, body = ErrorBody, description = "Skipped: the pipeline is at its concurrency limit and its overflow is `skip`"),
        (status = 422, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn submit_run(
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(req): Json<SubmitRequest>,
) -> ApiResult<(StatusCode, Json<SubmittedDto>)> {
    let actor = actor_of(authorize(&state.store, state.auth, &headers, Scope::Submit).await?);
    let mut req = req;
    if let Some(name) = req.pipeline.clone().filter(|_| req.spec.trim().is_empty()) {
        let stored = state.store.latest_pipeline(&name).await?.ok_or_else(|| {
            ApiError::not_found(format!("There is no pipeline named `{name}`; list them with GET /api/v1/pipelines."))
        })?;
        req.spec = stored.spec_text;
        req.file = req.file.or(Some(format!("{name}.yaml")));
    }
    let file = req.file.clone().unwrap_or_else(|| "pipeline.yaml".into());
    let (valid, diagnostics) = diagnostics_of(&file, &req.spec, &state);
    if !valid {
        let errors = diagnostics.iter().filter(|d| d.severity == "error").count();
        let first = diagnostics.iter().find(|d| d.severity == "error");
        let mut e = ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "lint_failed",
            match first {
                Some(d) => format!(
                    "The spec has {errors} error(s), the first at {}:{}:{}: {}; fix them and submit again.",
                    d.file, d.line, d.column, d.message
                ),
                None => "The spec could not be read; fix it and submit again.".to_string(),
            },
        );
        e.diagnostics = Some(diagnostics);
        return Err(e);
    }
    let overrides: Vec<(String, String)> = req
        .set
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                Value::String(s) => s,
                other => other.to_string(),
            };
            (k, v)
        })
        .collect();
    let submitted = shardline_control::submit(
        &state.store,
        shardline_control::Submission {
            file: &file,
            text: &req.spec,
            overrides: &overrides,
            base_dir: &state.base_dir,
            work_dir: &state.work_dir,
            dedupe_key: req.dedupe_key,
            no_cache: req.no_cache,
            policy: state.policy.as_deref(),
            priority: req.priority,
            submitted_by: Some(actor),
            artifacts: state.artifacts.as_deref(),
        },
    )
    .await
    .map_err(|e| match e {
        shardline_control::SubmitError::Store(s) => ApiError::from(s),
        shardline_control::SubmitError::Skipped(s) => ApiError::new(
            StatusCode::CONFLICT,
            "skipped",
            format!("No run was created ({s}); the pipeline's `concurrency.overflow` is `skip`."),
        ),
        other => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_submission",
            format!("The run could not be created: {other}"),
        ),
    })?;
    let status = if submitted.created { StatusCode::CREATED } else { StatusCode::OK };
    let cancelled = submitted.cancelled.iter().map(|r| r.0).collect();
    Ok((
        status,
        Json(SubmittedDto { run: submitted.run.0, name: submitted.name, created: submitted.created, cancelled }),
    ))
}

/// Cancels a queued or running run (scope `admin`); 409 when it has finished.
#[utoipa::path(post, path = "/api/v1/runs/{id}/cancel", tag = "runs", params(("id" = i64, Path, description = "Run id")),
    responses((status = 200, body = ActionDto), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn cancel_run(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> ApiResult<Json<ActionDto>> {
    let actor = actor_of(authorize(&state.store, state.auth, &headers, Scope::Admin).await?);
    if !state.store.cancel_run(RunId(id), &actor).await? {
        let run = find_run(&state, id).await?;
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("Run {id} has already finished ({}); only queued or running runs can be cancelled.", run.state),
        ));
    }
    let run = find_run(&state, id).await?;
    Ok(Json(ActionDto { run: id, state: run.state.as_str().into() }))
}

/// Puts a finished run back to work (scope `admin`); 409 while it is queued or running.
#[utoipa::path(post, path = "/api/v1/runs/{id}/retry", tag = "runs", params(("id" = i64, Path, description = "Run id")),
    request_body(content = RetryRequest, description = "Optional; `{}` or no body retries failed and cancelled tasks"),
    responses((status = 200, body = ActionDto), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 422, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn retry_run(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    body: axum::body::Bytes,
) -> ApiResult<Json<ActionDto>> {
    let actor = actor_of(authorize(&state.store, state.auth, &headers, Scope::Admin).await?);
    let req: RetryRequest = if body.iter().all(u8::is_ascii_whitespace) {
        RetryRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad_request(format!("The request body must be `{{\"from_step\": \"…\"}}` or empty: {e}."))
        })?
    };
    state.store.retry_run(RunId(id), req.from_step.as_deref(), &actor).await?;
    let run = find_run(&state, id).await?;
    Ok(Json(ActionDto { run: id, state: run.state.as_str().into() }))
}

/// Lints a spec: its diagnostics, with positions and hints.
#[utoipa::path(post, path = "/api/v1/lint", tag = "pipelines", request_body = LintRequest,
    responses((status = 200, body = LintResponse), (status = 401, body = ErrorBody)))]
pub async fn lint(
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(req): Json<LintRequest>,
) -> ApiResult<Json<LintResponse>> {
    read_access(&state, &headers).await?;
    let file = req.file.unwrap_or_else(|| "pipeline.yaml".into());
    let (valid, diagnostics) = diagnostics_of(&file, &req.spec, &state);
    Ok(Json(LintResponse { valid, diagnostics }))
}

/// Server-sent events of run and task state changes. Each event's `id` is its event id
/// (reconnects with `Last-Event-ID` resume after it), its `event` is `run` or `task`, its data
/// an [`EventDto`].
#[utoipa::path(get, path = "/api/v1/events", tag = "events", params(EventsQuery),
    responses((status = 200, content_type = "text/event-stream", body = EventDto,
        description = "A stream of `run` and `task` events"), (status = 401, body = ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    read_access(&state, &headers).await?;
    let last_event_id =
        headers.get("last-event-id").and_then(|v| v.to_str().ok()).and_then(|s| s.trim().parse::<i64>().ok());
    let start = match last_event_id.or(q.after) {
        Some(id) => id.max(0),
        None => state.store.latest_event_id().await?,
    };
    let run_filter = q.run;
    struct Cursor {
        state: AppState,
        last: i64,
        buffer: VecDeque<Event>,
        first: bool,
    }
    let cursor = Cursor { state, last: start, buffer: VecDeque::new(), first: true };
    let stream = stream::unfold(cursor, move |mut c| async move {
        loop {
            if let Some(event) = c.buffer.pop_front() {
                return Some((Ok(event), c));
            }
            if c.state.stopping() {
                return None;
            }
            if !c.first {
                tokio::time::sleep(c.state.event_poll).await;
            }
            c.first = false;
            match c.state.store.events_after(c.last, 500).await {
                Ok(rows) => {
                    for row in &rows {
                        c.last = c.last.max(row.id);
                        if run_filter.is_some_and(|r| r != row.run.0) {
                            continue;
                        }
                        let dto = EventDto::from(row);
                        let event = Event::default()
                            .id(row.id.to_string())
                            .event(dto.kind.clone())
                            .json_data(&dto)
                            .unwrap_or_else(|_| Event::default().comment("unencodable event"));
                        c.buffer.push_back(event);
                    }
                    if rows.len() >= 500 {
                        c.first = true; // more are waiting: read on without pausing
                    }
                }
                Err(e) => {
                    tracing::warn!("event stream: {e}");
                    return Some((
                        Ok(Event::default().event("error").data("the job store is unavailable; retrying")),
                        c,
                    ));
                }
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// Any other path.
pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("There is no endpoint at {}; see /api/v1/openapi.json for the API.", uri.path()))
}
