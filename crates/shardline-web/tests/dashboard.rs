//! Handler tests of what the dashboard reads beyond the plain rows (step graph with fan-out,
//! task progress with rate and ETA, why a task waits, worker leases, a pipeline's spec), and of
//! the dashboard's own files: on a fresh SQLite file and, for the `postgres::` variants, a fresh
//! PostgreSQL database (`SHARDLINE_TEST_DATABASE_URL`; they fail without it).

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use common::{app, Kind};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use shardline_control::graph::{Payload, ShardJob};
use shardline_store::*;
use shardline_web::auth::{create_token, revoke_token};
use shardline_web::{AuthMode, Scope};
use tower::ServiceExt;

const SPEC_TEXT: &str = "name: convert\nparams:\n  hf_token: {type: string, default: hf_SECRETSECRETSECRETSECRETSECRET00}\nsteps:\n  - id: download\n    uses: hf.download\n    with: {repo: org/model, revision: v1.0, token: abc123}\n";

fn task(name: &str, step: &str, needs: &[&str], payload: Value, gpus: u32) -> NewTask {
    NewTask {
        name: name.into(),
        step_id: step.into(),
        kind: "test".into(),
        needs: needs.iter().map(|s| s.to_string()).collect(),
        resources: Resources { cpus: 1, memory: 1 << 20, gpus, scratch: 0 },
        payload,
        max_attempts: 2,
        max_lost: 10,
        backoff: Duration::ZERO,
        timeout: Duration::ZERO,
        cache_key: None,
    }
}

/// A run of a Hub model: `download` succeeded, the shard plan succeeded (two ranks of 3000 and
/// 2000 bytes), rank 0 leased with 1000 bytes written, rank 1 ready, a 4-GPU step nobody can take.
async fn seed(store: &Store) -> (RunId, WorkerId) {
    let p = store.upsert_pipeline("convert", SPEC_TEXT, "sha256:abc").await.expect("pipeline");
    let spec = json!({"name": "convert", "steps": [
        {"id": "download", "kind": "hf.download", "needs": [],
         "config": {"kind": "hf.download", "repo": "org/model", "revision": "v1.0"}},
        {"id": "shard", "kind": "megatron.shard", "needs": ["download"], "config": {"kind": "megatron.shard", "tp": 2}},
        {"id": "gpu", "kind": "checkpoint.validate", "needs": [], "config": {"kind": "checkpoint.validate"}}]});
    let (run, _) = store
        .create_run(NewRun {
            pipeline_id: p,
            dedupe_key: None,
            params: json!({}),
            spec,
            options: Default::default(),
            notify: Vec::new(),
            submitted_by: None,
        })
        .await
        .expect("create_run");
    let job = ShardJob { tp: 2, source_task: "download".into(), ..ShardJob::default() };
    let rank = |rank: u64| {
        let payload = Payload::Rank { job: job.clone(), plan_task: "shard".into(), rank };
        serde_json::to_value(payload).expect("payload")
    };
    store
        .add_tasks(
            run,
            vec![
                task("download", "download", &[], json!({"role": "download"}), 0),
                task("shard", "shard", &["download"], json!({"role": "plan"}), 0),
                task("shard/rank-0", "shard", &["shard"], rank(0), 0),
                task("shard/rank-1", "shard", &["shard"], rank(1), 0),
                task("gpu", "gpu", &[], json!({"role": "validate"}), 4),
            ],
        )
        .await
        .expect("add_tasks");
    let worker = store
        .register_worker(WorkerInfo { name: "cpu-1".into(), cpus: 8, memory: 32 << 30, gpus: vec![], scratch: 1 << 40 })
        .await
        .expect("register_worker");
    let free = Resources { cpus: 1, memory: 1 << 20, gpus: 0, scratch: 0 };
    let ttl = Duration::from_secs(60);
    let lease = store.claim(worker, &free, ttl).await.expect("claim").expect("download");
    assert_eq!(lease.task.name, "download");
    assert!(store.complete(&lease, Outcome::Succeeded { output: json!({"bytes": 5000}) }).await.expect("complete"));
    let lease = store.claim(worker, &free, ttl).await.expect("claim").expect("plan");
    assert_eq!(lease.task.name, "shard");
    let plan = json!({"bytes_per_rank": [3000, 2000]});
    assert!(store.complete(&lease, Outcome::Succeeded { output: plan }).await.expect("complete"));
    let lease = store.claim(worker, &free, ttl).await.expect("claim").expect("rank 0");
    assert_eq!(lease.task.name, "shard/rank-0");
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(store.heartbeat(&lease, ttl, Some(json!({"bytes": 1000}))).await.expect("heartbeat"));
    (run, worker)
}

async fn views(kind: Kind) {
    let app = app(kind, AuthMode::Open).await;
    let (run, worker) = seed(&app.store).await;

    // The list shows model, revision and a duration.
    let (s, v) = app.get("/api/v1/runs").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let r = &v["runs"][0];
    assert_eq!((r["model"].as_str(), r["revision"].as_str()), (Some("org/model"), Some("v1.0")), "{r}");
    assert!(r["duration_ms"].as_i64().is_some_and(|d| d >= 0), "{r}");

    // The step graph: spec order, needs, fan-out counts, state, bytes.
    let (s, g) = app.get(&format!("/api/v1/runs/{}/graph", run.0)).await;
    assert_eq!(s, StatusCode::OK, "{g}");
    let steps = g["steps"].as_array().expect("steps");
    let ids: Vec<&str> = steps.iter().map(|s| s["id"].as_str().unwrap_or("")).collect();
    assert_eq!(ids, ["download", "shard", "gpu"]);
    assert_eq!((steps[0]["state"].as_str(), steps[0]["kind"].as_str()), (Some("succeeded"), Some("hf.download")));
    assert_eq!(steps[1]["needs"], json!(["download"]));
    assert_eq!(
        steps[1]["tasks"],
        json!({"blocked": 0, "ready": 1, "leased": 1, "succeeded": 1, "failed": 0, "cancelled": 0, "total": 3})
    );
    assert_eq!(steps[1]["state"], "running");
    assert_eq!((steps[1]["bytes"].as_u64(), steps[1]["total_bytes"].as_u64()), (Some(1000), Some(5000)));
    assert_eq!(steps[2]["state"], "ready");

    // Tasks: progress with total, rate and ETA; why the others wait.
    let (s, t) = app.get(&format!("/api/v1/runs/{}/tasks", run.0)).await;
    assert_eq!(s, StatusCode::OK, "{t}");
    let by_name = |n: &str| t.as_array().expect("tasks").iter().find(|x| x["name"] == n).cloned().expect(n);
    let r0 = by_name("shard/rank-0");
    let p = &r0["progress_info"];
    assert_eq!((p["bytes"].as_u64(), p["total_bytes"].as_u64()), (Some(1000), Some(3000)), "{r0}");
    assert!(p["fraction"].as_f64().is_some_and(|f| (f - 1.0 / 3.0).abs() < 1e-9), "{p}");
    let rate = p["bytes_per_sec"].as_f64().expect("a rate while leased");
    let eta = p["eta_seconds"].as_f64().expect("an ETA with a known total");
    assert!(rate > 0.0 && (eta - 2000.0 / rate).abs() < 1e-6, "{p}");
    assert_eq!(r0["reason"], Value::Null);
    assert_eq!(by_name("shard/rank-1")["reason"], "waiting for a worker to claim it (one has room)");
    assert_eq!(by_name("gpu")["reason"], "no worker has enough resources: needs 4 GPUs (most: 0)");
    assert_eq!(by_name("shard/rank-1")["progress_info"]["total_bytes"], 2000);
    // The summary listing: the same without payloads and outputs.
    let (s, sum) = app.get(&format!("/api/v1/runs/{}/tasks?summary=true", run.0)).await;
    assert_eq!(s, StatusCode::OK, "{sum}");
    assert_eq!(sum.as_array().map(Vec::len), t.as_array().map(Vec::len));
    assert!(sum.as_array().expect("tasks").iter().all(|x| x["payload"].is_null() && x["output"].is_null()), "{sum}");
    assert_eq!(sum[2]["progress_info"], t[2]["progress_info"]);
    assert_eq!(sum[4]["reason"], t[4]["reason"]);
    assert!(!t[2]["payload"].is_null());
    // The run page's one request: the same run, graph and summary tasks.
    let (s, view) = app.get(&format!("/api/v1/runs/{}/view", run.0)).await;
    assert_eq!(s, StatusCode::OK, "{view}");
    assert_eq!(view["steps"], g["steps"]);
    assert_eq!(view["run"]["id"], json!(run.0));
    assert_eq!(view["run"]["model"], "org/model");
    let strip = |v: &Value| {
        let mut v = v.clone();
        for t in v.as_array_mut().into_iter().flatten() {
            // Heartbeat-derived rates move with the clock between two requests.
            t["progress_info"]["bytes_per_sec"] = Value::Null;
            t["progress_info"]["eta_seconds"] = Value::Null;
        }
        v
    };
    assert_eq!(strip(&view["tasks"]), strip(&sum));
    let (s, _) = app.get("/api/v1/runs/999999/view").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // One task reads the same, with its payload.
    let (s, one) = app.get(&format!("/api/v1/tasks/{}", by_name("gpu")["id"])).await;
    assert_eq!((s, one["reason"].as_str()), (StatusCode::OK, by_name("gpu")["reason"].as_str()), "{one}");
    assert_eq!(one["payload"], json!({"role": "validate"}));

    // Workers: what they hold now.
    let (s, w) = app.get("/api/v1/workers").await;
    assert_eq!(s, StatusCode::OK, "{w}");
    assert_eq!(w[0]["id"], json!(worker.0));
    assert_eq!(w[0]["leases"], json!([{"task": r0["id"], "run": run.0, "name": "shard/rank-0", "step_id": "shard"}]));
    assert_eq!((w[0]["used"]["cpus"].as_u64(), w[0]["used"]["memory"].as_u64()), (Some(1), Some(1 << 20)));
    assert!(w[0]["heartbeat_age_s"].as_f64().is_some_and(|a| (0.0..60.0).contains(&a)), "{w}");
    // Its disk once it reports one.
    assert_eq!(w[0]["disk"], Value::Null);
    let disk = shardline_store::WorkerDisk { free: 5 << 30, total: 50 << 30, scratch_free: 4 << 30 };
    app.store.worker_heartbeat_with_disk(worker, &disk).await.expect("heartbeat");
    let (_, w) = app.get("/api/v1/workers").await;
    assert_eq!(w[0]["disk"], json!({"free": 5u64 << 30, "total": 50u64 << 30, "scratch_free": 4u64 << 30}));

    // A pipeline's spec, secrets redacted.
    let (s, p) = app.get("/api/v1/pipelines/convert").await;
    assert_eq!(s, StatusCode::OK, "{p}");
    assert_eq!((p["versions"].as_i64(), p["latest_spec_hash"].as_str()), (Some(1), Some("sha256:abc")));
    let text = p["spec_text"].as_str().expect("spec text");
    assert!(text.contains("with: {repo: org/model, revision: v1.0, token: [redacted]}"), "{text}");
    assert!(!text.contains("SECRET") && !text.contains("abc123"), "{text}");
    let (s, e) = app.get("/api/v1/pipelines/nope").await;
    assert_eq!((s, e["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    let (s, _) = app.get("/api/v1/runs/999999/graph").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    app.db.cleanup().await;
}

/// The new reads follow the server's read setting; a revoked or a malformed token is refused.
async fn auth(kind: Kind) {
    let app = app(kind, AuthMode::ReadRequiresToken).await;
    let (run, _) = seed(&app.store).await;
    let read = create_token(&app.store, "reader", Scope::Read).await.expect("token");
    let gone = create_token(&app.store, "gone", Scope::Admin).await.expect("token");
    assert!(revoke_token(&app.store, gone.id).await.expect("revoke"));
    for uri in [format!("/api/v1/runs/{}/graph", run.0), "/api/v1/pipelines/convert".into(), "/api/v1/workers".into()] {
        let (s, v) = app.get_as(&uri, None).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{uri}");
        let (s, _) = app.get_as(&uri, Some(&gone.secret)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{uri} with a revoked token");
        let (s, _) = app.get_as(&uri, Some("shl_0000")).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{uri} with an unknown token");
        let (s, v) = app.get_as(&uri, Some(&read.secret)).await;
        assert_eq!(s, StatusCode::OK, "{uri}: {v}");
    }
    // The dashboard's files are public (they hold no data); the data behind them is not.
    let (s, _, body) = app.raw(Method::GET, "/runs", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(String::from_utf8_lossy(&body).contains("<main id=\"view\""));
    app.db.cleanup().await;
}

/// `/` and the client routes get index.html, files get their type, everything a strict CSP;
/// unknown `/api/` paths stay JSON 404s.
#[tokio::test]
async fn dashboard_files() {
    let app = app(Kind::Sqlite, AuthMode::Open).await;
    let index = String::from_utf8(shardline_web::ui::asset("index.html").expect("index").body.to_vec()).expect("utf-8");
    for page in ["/", "/runs", "/runs/12", "/runs/12?task=3", "/workers", "/pipelines", "/submit", "/token"] {
        let (s, h, body) = app.raw(Method::GET, page, None, None).await;
        assert_eq!(s, StatusCode::OK, "{page}");
        assert_eq!(h[header::CONTENT_TYPE], "text/html; charset=utf-8", "{page}");
        assert_eq!(String::from_utf8_lossy(&body), index, "{page}");
        let csp = h[header::CONTENT_SECURITY_POLICY].to_str().expect("csp");
        assert!(csp.contains("script-src 'self'") && csp.contains("default-src 'none'"), "{csp}");
        assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    }
    let (s, h, body) = app.raw(Method::GET, "/js/app.js", None, None).await;
    assert_eq!((s, h[header::CONTENT_TYPE].to_str().ok()), (StatusCode::OK, Some("text/javascript; charset=utf-8")));
    assert!(String::from_utf8_lossy(&body).contains("import"), "not the app module");
    let (s, h, _) = app.raw(Method::GET, "/style.css", None, None).await;
    assert_eq!((s, h[header::CONTENT_TYPE].to_str().ok()), (StatusCode::OK, Some("text/css; charset=utf-8")));
    let (s, h, body) = app.raw(Method::HEAD, "/js/app.js", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(body.is_empty());
    assert!(h[header::CONTENT_LENGTH].to_str().ok().and_then(|l| l.parse::<usize>().ok()).is_some_and(|l| l > 100));
    for missing in ["/nope.txt", "/js/nope.js", "/etc/passwd", "/../Cargo.toml"] {
        let (s, _, _) = app.raw(Method::GET, missing, None, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{missing}");
    }
    let (s, v) = app.get("/api/v2/runs").await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    let (s, _, _) = app.raw(Method::POST, "/runs", None, None).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    // No page or script sets markup from a string: data only ever becomes text.
    for a in shardline_web::ui::ASSETS.iter().filter(|a| a.path.ends_with(".js")) {
        let js = String::from_utf8_lossy(a.body);
        for banned in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"] {
            assert!(!js.contains(banned), "{} uses {banned}", a.path);
        }
    }
    app.db.cleanup().await;
}

/// Triggers with their last and next firing; secrets in a trigger's settings are redacted.
async fn triggers(kind: Kind) {
    let app = app(kind, AuthMode::ReadRequiresToken).await;
    let read = create_token(&app.store, "reader", Scope::Read).await.expect("token");
    let (s, v) = app.get_as("/api/v1/triggers", None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    let (s, v) = app.get_as("/api/v1/triggers", Some(&read.secret)).await;
    assert_eq!((s, v), (StatusCode::OK, json!([])));
    let registered = app
        .store
        .register_triggers(
            "nightly",
            &[
                NewTrigger {
                    position: 0,
                    kind: "schedule".into(),
                    spec: json!({"cron": "0 2 * * *", "timezone": "Europe/Paris"}),
                    summary: "cron \"0 2 * * *\" Europe/Paris, missed: run-once".into(),
                },
                NewTrigger {
                    position: 1,
                    kind: "watch".into(),
                    spec: json!({"repo": "org/model", "hf_token": "hf_SECRETSECRETSECRETSECRETSECRET00"}),
                    summary: "org/model@main every 10m".into(),
                },
            ],
        )
        .await
        .expect("register_triggers");
    let next = chrono::Utc::now() + chrono::Duration::hours(3);
    let check = TriggerCheck {
        checked_at: chrono::Utc::now(),
        next_at: Some(next),
        last_sha: None,
        state: None,
        error: Some("the Hub answered 503".into()),
    };
    assert!(app.store.record_trigger_check(registered[1].id, &check).await.expect("check"));
    let (s, v) = app.get_as("/api/v1/triggers", Some(&read.secret)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v.as_array().map(Vec::len), Some(2), "{v}");
    assert_eq!((v[0]["pipeline"].as_str(), v[0]["kind"].as_str()), (Some("nightly"), Some("schedule")));
    assert_eq!(v[0]["summary"], "cron \"0 2 * * *\" Europe/Paris, missed: run-once");
    assert_eq!(v[1]["spec"], json!({"repo": "org/model", "hf_token": "[redacted]"}));
    assert_eq!((v[1]["errors"].as_u64(), v[1]["last_error"].as_str()), (Some(1), Some("the Hub answered 503")));
    let at: chrono::DateTime<chrono::Utc> = v[1]["next_at"].as_str().expect("next_at").parse().expect("a time");
    assert!((at - next).num_milliseconds().abs() < 1000, "{at} vs {next}");
    assert!(!v.to_string().contains("SECRET"), "{v}");
    app.db.cleanup().await;
}

/// Every documented endpoint against every kind of token, with reads behind a token: none (401),
/// a revoked admin token (401), one scope too low (403), the scope it needs (neither).
async fn scopes(kind: Kind) {
    let app = app(kind, AuthMode::ReadRequiresToken).await;
    let (run, _) = seed(&app.store).await;
    let token = |scope: Scope, name: &'static str| {
        let store = app.store.clone();
        async move { create_token(&store, name, scope).await.expect("token").secret }
    };
    let read = token(Scope::Read, "r").await;
    let submit = token(Scope::Submit, "s").await;
    let admin = token(Scope::Admin, "a").await;
    let revoked = create_token(&app.store, "revoked", Scope::Admin).await.expect("token");
    assert!(revoke_token(&app.store, revoked.id).await.expect("revoke"));
    let listed = shardline_web::auth::list_tokens(&app.store).await.expect("list_tokens");
    assert_eq!(listed.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["r", "s", "a", "revoked"]);
    assert!(listed[3].revoked_at.is_some() && listed[0].revoked_at.is_none());
    assert_eq!(listed[2].scope, "admin");

    let r = run.0;
    let (_, tasks) = app.get_as(&format!("/api/v1/runs/{r}/tasks"), Some(&read)).await;
    let t = tasks[0]["id"].as_i64().expect("task id");
    let spec = "apiVersion: shardline/v1\nkind: Pipeline\nname: tiny\nsteps:\n  - id: download\n    uses: hf.download\n    with: {path: /data/models/llama}\n";
    // (method, path as documented, concrete uri, scope needed)
    let endpoints: Vec<(Method, &str, String, Scope)> = vec![
        (Method::GET, "/api/v1/pipelines", "/api/v1/pipelines".into(), Scope::Read),
        (Method::GET, "/api/v1/pipelines/{name}", "/api/v1/pipelines/convert".into(), Scope::Read),
        (Method::GET, "/api/v1/triggers", "/api/v1/triggers".into(), Scope::Read),
        (Method::GET, "/api/v1/runs", "/api/v1/runs".into(), Scope::Read),
        (Method::POST, "/api/v1/runs", "/api/v1/runs".into(), Scope::Submit),
        (Method::GET, "/api/v1/runs/{id}", format!("/api/v1/runs/{r}"), Scope::Read),
        (Method::GET, "/api/v1/runs/{id}/tasks", format!("/api/v1/runs/{r}/tasks"), Scope::Read),
        (Method::GET, "/api/v1/runs/{id}/graph", format!("/api/v1/runs/{r}/graph"), Scope::Read),
        (Method::GET, "/api/v1/runs/{id}/view", format!("/api/v1/runs/{r}/view"), Scope::Read),
        (Method::GET, "/api/v1/runs/{id}/logs", format!("/api/v1/runs/{r}/logs"), Scope::Read),
        (Method::POST, "/api/v1/runs/{id}/retry", format!("/api/v1/runs/{r}/retry"), Scope::Admin),
        (Method::POST, "/api/v1/runs/{id}/cancel", format!("/api/v1/runs/{r}/cancel"), Scope::Admin),
        (Method::GET, "/api/v1/tasks/{id}", format!("/api/v1/tasks/{t}"), Scope::Read),
        (Method::GET, "/api/v1/tasks/{id}/attempts", format!("/api/v1/tasks/{t}/attempts"), Scope::Read),
        (Method::GET, "/api/v1/workers", "/api/v1/workers".into(), Scope::Read),
        (Method::GET, "/api/v1/storage", "/api/v1/storage".into(), Scope::Read),
        (Method::POST, "/api/v1/lint", "/api/v1/lint".into(), Scope::Read),
        (Method::GET, "/api/v1/events", "/api/v1/events?after=0".into(), Scope::Read),
    ];
    // The list is the documented API, no more and no less (the OpenAPI document is public).
    let (_, doc) = app.get_as("/api/v1/openapi.json", None).await;
    let mut documented: Vec<String> = doc["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .flat_map(|(p, ops)| {
            ops.as_object().into_iter().flatten().map(move |(m, _)| format!("{} {p}", m.to_uppercase()))
        })
        .filter(|e| e != "GET /api/v1/openapi.json")
        .collect();
    documented.sort();
    let mut tested: Vec<String> = endpoints.iter().map(|(m, p, _, _)| format!("{m} {p}")).collect();
    tested.sort();
    assert_eq!(tested, documented);

    let body_of = |uri: &str| -> Option<Value> {
        if uri.ends_with("/lint") || uri == "/api/v1/runs" {
            Some(json!({"spec": spec}))
        } else {
            None
        }
    };
    for (method, path, uri, needed) in &endpoints {
        let call = |tok: Option<String>| {
            let (method, uri) = (method.clone(), uri.clone());
            let body = if method == Method::POST { body_of(&uri) } else { None };
            let router = app.router.clone();
            async move {
                let mut req = Request::builder().method(method).uri(&uri);
                if let Some(t) = tok {
                    req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
                }
                let req = match body {
                    Some(b) => req.header(header::CONTENT_TYPE, "application/json").body(Body::from(b.to_string())),
                    None => req.body(Body::empty()),
                }
                .expect("request");
                let resp = router.oneshot(req).await.expect("response");
                let status = resp.status();
                // Event streams do not end: the status is all that is needed.
                if !uri.contains("/events") {
                    let _ = resp.into_body().collect().await;
                }
                status
            }
        };
        assert_eq!(call(None).await, StatusCode::UNAUTHORIZED, "{method} {path} without a token");
        assert_eq!(call(Some(revoked.secret.clone())).await, StatusCode::UNAUTHORIZED, "{method} {path} revoked");
        let below = match needed {
            Scope::Read => None,
            Scope::Submit => Some(&read),
            Scope::Admin => Some(&submit),
        };
        if let Some(low) = below {
            assert_eq!(call(Some(low.clone())).await, StatusCode::FORBIDDEN, "{method} {path} with a lower scope");
        }
        let right = match needed {
            Scope::Read => &read,
            Scope::Submit => &submit,
            Scope::Admin => &admin,
        };
        let s = call(Some(right.clone())).await;
        assert!(s != StatusCode::UNAUTHORIZED && s != StatusCode::FORBIDDEN, "{method} {path} with its scope: {s}");
        if *method == Method::GET {
            assert_eq!(s, StatusCode::OK, "{method} {path}");
        }
    }
    app.db.cleanup().await;
}

/// Errors (of runs, tasks, attempts, events) are shown with token-like words redacted.
#[tokio::test]
async fn errors_are_redacted() {
    let app = app(Kind::Sqlite, AuthMode::Open).await;
    let p = app.store.upsert_pipeline("leaky", "steps: []", "sha256:1").await.expect("pipeline");
    let (run, _) = app
        .store
        .create_run(NewRun {
            pipeline_id: p,
            dedupe_key: None,
            params: json!({}),
            spec: json!({}),
            options: Default::default(),
            notify: Vec::new(),
            submitted_by: None,
        })
        .await
        .expect("create_run");
    let mut t = task("fetch", "fetch", &[], json!({}), 0);
    t.max_attempts = 1;
    app.store.add_tasks(run, vec![t]).await.expect("add_tasks");
    let worker = app
        .store
        .register_worker(WorkerInfo { name: "w".into(), cpus: 1, memory: 1 << 30, gpus: vec![], scratch: 0 })
        .await
        .expect("register_worker");
    let free = Resources { cpus: 1, memory: 1 << 30, gpus: 0, scratch: 0 };
    let lease = app.store.claim(worker, &free, Duration::from_secs(60)).await.expect("claim").expect("a task");
    let error = "GET https://hub/api?token=hf_SECRETSECRETSECRETSECRETSECRET00 answered 401".to_string();
    assert!(app.store.complete(&lease, Outcome::Failed { error, retryable: false }).await.expect("complete"));
    let id = lease.task.id.0;
    for uri in [
        format!("/api/v1/runs/{}", run.0),
        format!("/api/v1/runs/{}/tasks", run.0),
        format!("/api/v1/runs/{}/view", run.0),
        format!("/api/v1/tasks/{id}"),
        format!("/api/v1/tasks/{id}/attempts"),
        "/api/v1/runs".to_string(),
    ] {
        let (s, v) = app.get(&uri).await;
        assert_eq!(s, StatusCode::OK, "{uri}: {v}");
        let text = v.to_string();
        assert!(!text.contains("SECRET"), "{uri}: {v}");
        assert!(text.contains("token=[redacted] answered 401"), "{uri}: the error is gone: {v}");
    }
    app.db.cleanup().await;
}

shardline_testdb::on_both_backends!(views, auth, triggers, scopes,);
