//! Handler tests: each request goes through the whole router with `oneshot`, against a fresh
//! SQLite file, and for the `postgres::` variants a fresh PostgreSQL database
//! (`SHARDLINE_TEST_DATABASE_URL`, which `scripts/test` sets; they fail without it).

mod common;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use common::{app, Kind};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use shardline_store::*;
use shardline_web::auth::revoke_token;
use shardline_web::{AuthMode, Scope};
use tower::ServiceExt;

/// A run with three tasks (`a` succeeded with logs, `b` ready after a lost lease, `c` blocked
/// on `b`), a worker, and secrets in params and payload.
async fn seed(store: &Store) -> (RunId, Vec<TaskId>, WorkerId) {
    let p = store.upsert_pipeline("convert", "steps: []", "sha256:0").await.expect("pipeline");
    let (run, _) = store
        .create_run(NewRun {
            pipeline_id: p,
            dedupe_key: None,
            params: json!({"repo": "org/model", "hf_token": "hf_SECRETSECRETSECRETSECRETSECRET00", "tp": 2}),
            spec: json!({"name": "convert", "params": {"hf_token": "hf_SECRETSECRETSECRETSECRETSECRET00"}}),
            options: Default::default(),
            notify: Vec::new(),
            submitted_by: None,
        })
        .await
        .expect("create_run");
    let task = |name: &str, needs: &[&str]| NewTask {
        name: name.into(),
        step_id: name.into(),
        kind: "test".into(),
        needs: needs.iter().map(|s| s.to_string()).collect(),
        resources: Resources { cpus: 1, memory: 1 << 20, gpus: 0, scratch: 0 },
        payload: json!({"name": name, "aws_secret_access_key": "abc123"}),
        max_attempts: 2,
        max_lost: 10,
        backoff: Duration::ZERO,
        timeout: Duration::ZERO,
        cache_key: None,
    };
    let tasks = store.add_tasks(run, vec![task("a", &[]), task("b", &[]), task("c", &["b"])]).await.expect("add_tasks");
    let worker = store
        .register_worker(WorkerInfo { name: "cpu-1".into(), cpus: 8, memory: 32 << 30, gpus: vec![], scratch: 1 << 40 })
        .await
        .expect("register_worker");
    let free = Resources { cpus: 1, memory: 1 << 20, gpus: 0, scratch: 0 };
    let lease = store.claim(worker, &free, Duration::from_secs(60)).await.expect("claim").expect("a task to claim");
    assert_eq!(lease.task.name, "a");
    let now = chrono::Utc::now();
    let lines = [
        "loading weights",
        "wrote shard 0",
        "wrote shard 1",
        "done",
        "token hf_SECRETSECRETSECRETSECRETSECRET00 loaded",
    ]
    .iter()
    .map(|l| LogLine { ts: now, stream: LogStream::Stdout, line: l.to_string() })
    .collect::<Vec<_>>();
    store.append_logs(lease.task.id, lease.task.attempt, &lines).await.expect("append_logs");
    assert!(store
        .complete(&lease, Outcome::Succeeded { output: json!({"files": 2, "token": "x"}) })
        .await
        .expect("complete"));
    // `b` is leased by a worker that dies: the lease expires and is reaped.
    let lost = store.claim(worker, &free, Duration::from_millis(50)).await.expect("claim").expect("b to claim");
    assert_eq!(lost.task.name, "b");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.reap_expired().await.expect("reap"), 1);
    (run, tasks, worker)
}

async fn reads(kind: Kind) {
    let app = app(kind, AuthMode::Open).await;
    let (run, tasks, worker) = seed(&app.store).await;

    let (s, v) = app.get("/api/v1/pipelines").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v,
        json!([{"name": "convert", "versions": 1, "latest_id": v[0]["latest_id"], "latest_spec_hash": "sha256:0"}])
    );

    let (s, v) = app.get("/api/v1/runs").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["runs"].as_array().map(Vec::len), Some(1));
    assert_eq!(v["runs"][0]["id"], json!(run.0));
    assert_eq!(v["runs"][0]["pipeline"], "convert");
    assert_eq!(v["runs"][0]["state"], "running");
    assert_eq!(v["next"], Value::Null);

    let (s, v) = app.get(&format!("/api/v1/runs/{}", run.0)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["run"]["tasks"],
        json!({"blocked": 1, "ready": 1, "leased": 0, "succeeded": 1, "failed": 0, "cancelled": 0, "total": 3})
    );
    // Secrets redacted, the rest intact.
    assert_eq!(v["run"]["params"], json!({"repo": "org/model", "hf_token": "[redacted]", "tp": 2}));
    assert_eq!(v["spec"]["params"]["hf_token"], "[redacted]");
    assert!(!v.to_string().contains("SECRET"), "{v}");

    let (s, v) = app.get(&format!("/api/v1/runs/{}/tasks", run.0)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let names: Vec<&str> = v.as_array().expect("array").iter().map(|t| t["name"].as_str().unwrap_or("")).collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert_eq!(v[0]["state"], "succeeded");
    assert_eq!(v[0]["payload"], json!({"name": "a", "aws_secret_access_key": "[redacted]"}));
    assert_eq!(v[0]["output"], json!({"files": 2, "token": "[redacted]"}));
    assert_eq!(v[2]["state"], "blocked");

    let (s, v) = app.get(&format!("/api/v1/tasks/{}", tasks[0].0)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!((v["name"].as_str(), v["attempt"].as_i64(), v["run"].as_i64()), (Some("a"), Some(1), Some(run.0)));

    let (s, v) = app.get(&format!("/api/v1/tasks/{}/attempts", tasks[0].0)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v.as_array().map(Vec::len), Some(1));
    assert_eq!((v[0]["outcome"].as_str(), v[0]["worker_name"].as_str()), (Some("succeeded"), Some("cpu-1")));
    assert_eq!(v[0]["worker"], json!(worker.0));
    assert_eq!(v[0]["kind"], Value::Null, "a success drew on no retry budget");

    // Which budget each attempt drew on, and the task's budgets.
    let (s, v) = app.get(&format!("/api/v1/tasks/{}/attempts", tasks[1].0)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v.as_array().map(Vec::len), Some(1));
    assert_eq!((v[0]["outcome"].as_str(), v[0]["kind"].as_str()), (Some("expired"), Some("lost")), "{v}");
    let (_, v) = app.get(&format!("/api/v1/tasks/{}", tasks[1].0)).await;
    let budgets = ["state", "attempt", "attempts_used", "max_attempts", "lost", "max_lost"].map(|k| v[k].clone());
    assert_eq!(budgets, [json!("ready"), json!(1), json!(0), json!(2), json!(1), json!(10)], "{v}");

    let (s, v) = app.get("/api/v1/workers").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v[0]["name"].as_str(), v[0]["state"].as_str(), v[0]["resources"]["cpus"].as_i64()),
        (Some("cpu-1"), Some("active"), Some(8))
    );

    let (s, v) = app.get(&format!("/api/v1/runs/{}/logs", run.0)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let lines: Vec<&str> =
        v["lines"].as_array().expect("lines").iter().map(|l| l["line"].as_str().unwrap_or("")).collect();
    assert_eq!(lines, ["loading weights", "wrote shard 0", "wrote shard 1", "done", "token [redacted] loaded"]);
    assert_eq!(v["more"], false);
    let (_, q) = app.get(&format!("/api/v1/runs/{}/logs?q=SECRET", run.0)).await;
    assert_eq!(q["lines"], json!([]), "a secret in a log line can be probed for");
    // Paging, search and the task filter.
    let (_, p1) = app.get(&format!("/api/v1/runs/{}/logs?limit=2", run.0)).await;
    assert_eq!(p1["lines"].as_array().map(Vec::len), Some(2));
    assert_eq!(p1["more"], true);
    let (_, p2) = app.get(&format!("/api/v1/runs/{}/logs?limit=2&after={}", run.0, p1["next_after"])).await;
    assert_eq!(p2["lines"][0]["line"], "wrote shard 1");
    let (_, q) = app.get(&format!("/api/v1/runs/{}/logs?q=SHARD&task={}", run.0, tasks[0].0)).await;
    let found: Vec<&str> =
        q["lines"].as_array().expect("lines").iter().map(|l| l["line"].as_str().unwrap_or("")).collect();
    assert_eq!(found, ["wrote shard 0", "wrote shard 1"]);
    let (_, q) = app.get(&format!("/api/v1/runs/{}/logs?task={}", run.0, tasks[1].0)).await;
    assert_eq!(q["lines"], json!([]));

    // Unknowns are 404 with a JSON error.
    for uri in [
        "/api/v1/runs/999999",
        "/api/v1/runs/999999/tasks",
        "/api/v1/tasks/999999",
        "/api/v1/tasks/999999/attempts",
        "/api/v1/runs/999999/logs",
        "/api/v1/nope",
    ] {
        let (s, v) = app.get(uri).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{uri}: {v}");
        assert_eq!(v["error"]["code"], "not_found", "{uri}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.len() > 10), "{uri}: {v}");
    }
    let (s, v) = app.get("/api/v1/runs?state=bogus").await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad_request")));
    let (s, _) = app.get("/api/v1/runs/abc").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    app.db.cleanup().await;
}

fn spec(extra_param: &str) -> String {
    format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: tiny\nparams:\n  tp: {{type: int, default: 1}}\n{extra_param}steps:\n  - id: download\n    uses: hf.download\n    with: {{path: /data/models/llama}}\n"
    )
}

async fn mutations(kind: Kind) {
    let app = app(kind, AuthMode::Open).await;
    let submit = app.token(Scope::Submit).await;
    let admin = app.token(Scope::Admin).await;
    let read = app.token(Scope::Read).await;

    // Lint: diagnostics with positions.
    let bad = "apiVersion: shardline/v1\nkind: Pipeline\nname: tiny\nsteps:\n  - id: download\n    uses: hf.downlaod\n";
    let (s, v) = app.call(Method::POST, "/api/v1/lint", None, Some(json!({"spec": bad, "file": "tiny.yaml"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["valid"], false);
    assert_eq!(
        (v["diagnostics"][0]["line"].as_u64(), v["diagnostics"][0]["file"].as_str()),
        (Some(6), Some("tiny.yaml"))
    );
    let (s, v) = app.call(Method::POST, "/api/v1/lint", None, Some(json!({"spec": spec("")}))).await;
    assert_eq!((s, v["valid"].as_bool()), (StatusCode::OK, Some(true)), "{v}");

    // Submit: a spec that does not lint is 422 with each diagnostic's position.
    let (s, v) =
        app.call(Method::POST, "/api/v1/runs", Some(&submit), Some(json!({"spec": bad, "file": "tiny.yaml"}))).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_eq!(v["error"]["code"], "lint_failed");
    let d = &v["error"]["diagnostics"][0];
    assert_eq!(
        (d["line"].as_u64(), d["column"].as_u64(), d["path"].as_str()),
        (Some(6), Some(11), Some("steps[0].uses")),
        "{d}"
    );
    assert!(d["message"].as_str().is_some_and(|m| m.contains("hf.downlaod")), "{d}");
    assert!(d["hint"].as_str().is_some_and(|h| h.contains("hf.download")), "{d}");

    // Submit a good one, with a secret override and a dedupe key.
    let body = json!({
        "spec": spec("  hf_token: {type: string, default: \"\"}\n"),
        "file": "tiny.yaml",
        "set": {"tp": 1, "hf_token": "hf_TOPSECRETTOPSECRETTOPSECRETTOPSECRET"},
        "dedupe_key": "tiny@1"
    });
    let (s, v) = app.call(Method::POST, "/api/v1/runs", Some(&submit), Some(body.clone())).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["created"], true);
    let run = v["run"].as_i64().expect("run id");
    let (s, v) = app.call(Method::POST, "/api/v1/runs", Some(&submit), Some(body)).await;
    assert_eq!((s, v["run"].as_i64(), v["created"].as_bool()), (StatusCode::OK, Some(run), Some(false)), "{v}");
    let (_, v) = app.get(&format!("/api/v1/runs/{run}")).await;
    assert_eq!(v["run"]["state"], "queued");
    assert_eq!(v["run"]["pipeline"], "tiny");
    assert_eq!(v["run"]["params"]["hf_token"], "[redacted]");
    assert!(!v.to_string().contains("TOPSECRET"), "{v}");
    let (_, t) = app.get(&format!("/api/v1/runs/{run}/tasks")).await;
    assert!(!t.as_array().expect("tasks").is_empty(), "{t}");
    assert!(!t.to_string().contains("TOPSECRET"), "{t}");

    // Cancel and retry need admin.
    let cancel = format!("/api/v1/runs/{run}/cancel");
    let (s, v) = app.call(Method::POST, &cancel, Some(&submit), None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("forbidden")), "{v}");
    let (s, v) = app.call(Method::POST, &cancel, Some(&admin), None).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("cancelled")), "{v}");
    let (s, v) = app.call(Method::POST, &cancel, Some(&admin), None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("conflict")), "{v}");
    let (s, _) = app.call(Method::POST, "/api/v1/runs/999999/cancel", Some(&admin), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let retry = format!("/api/v1/runs/{run}/retry");
    let (s, v) = app.call(Method::POST, &retry, Some(&admin), Some(json!({"from_step": "nope"}))).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    let (s, v) = app.call(Method::POST, &retry, Some(&admin), Some(json!({"from_step": "download"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(matches!(v["state"].as_str(), Some("queued" | "running")), "{v}");
    let (s, v) = app.call(Method::POST, &retry, Some(&admin), None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("conflict")), "{v}");

    // Audit: the submitting token, then each cancel and retry with the token that did it, in
    // the run's detail and in the listing; a refused action leaves no trace.
    let (_, v) = app.get(&format!("/api/v1/runs/{run}")).await;
    assert_eq!(v["run"]["submitted_by"], "token:test-submit", "{v}");
    let actions: Vec<(&str, &str)> = v["run"]["actions"]
        .as_array()
        .expect("actions")
        .iter()
        .map(|a| (a["action"].as_str().unwrap_or(""), a["actor"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(actions, [("cancel", "token:test-admin"), ("retry", "token:test-admin")], "{v}");
    assert!(v["run"]["actions"][0]["at"].is_string(), "{v}");
    let (_, page) = app.get("/api/v1/runs").await;
    let listed = page["runs"].as_array().expect("runs").iter().find(|r| r["id"] == run).cloned().expect("listed");
    assert_eq!(
        (listed["submitted_by"].clone(), listed["actions"].clone()),
        (v["run"]["submitted_by"].clone(), v["run"]["actions"].clone())
    );

    // Read scope cannot submit.
    let (s, _) = app.call(Method::POST, "/api/v1/runs", Some(&read), Some(json!({"spec": spec("")}))).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    app.db.cleanup().await;
}

async fn auth(kind: Kind) {
    // Reads open: no token is fine; mutations still need one.
    let open = app(kind, AuthMode::Open).await;
    assert_eq!(open.get("/api/v1/runs").await.0, StatusCode::OK);
    let (s, v) = open.call(Method::POST, "/api/v1/runs", None, Some(json!({"spec": spec("")}))).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{v}");
    for uri in ["/api/v1/runs/1/cancel", "/api/v1/runs/1/retry"] {
        assert_eq!(open.call(Method::POST, uri, None, None).await.0, StatusCode::UNAUTHORIZED, "{uri}");
    }
    // A token that is presented is checked even where none is needed.
    assert_eq!(open.call(Method::GET, "/api/v1/runs", Some("shl_nope"), None).await.0, StatusCode::UNAUTHORIZED);
    open.db.cleanup().await;

    let closed = app(kind, AuthMode::ReadRequiresToken).await;
    let read = closed.token(Scope::Read).await;
    let submit = closed.token(Scope::Submit).await;
    for uri in ["/api/v1/runs", "/api/v1/pipelines", "/api/v1/workers", "/api/v1/events"] {
        let (s, v) = closed.get(uri).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{uri}: {v}");
    }
    assert_eq!(
        closed.call(Method::POST, "/api/v1/lint", None, Some(json!({"spec": spec("")}))).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(closed.call(Method::GET, "/api/v1/runs", Some(&read), None).await.0, StatusCode::OK);
    // The metrics are a read like any other: a scraper presents a read token.
    assert_eq!(closed.raw(Method::GET, "/metrics", None, None).await.0, StatusCode::UNAUTHORIZED);
    let (s, headers, body) = closed.raw(Method::GET, "/metrics", Some(&read), None).await;
    let body = String::from_utf8(body).expect("text");
    assert_eq!(s, StatusCode::OK, "{body}");
    assert!(headers[header::CONTENT_TYPE].to_str().expect("type").starts_with("application/openmetrics-text"));
    assert!(body.contains("\nshardline_queue_depth 0\n") && body.ends_with("# EOF\n"), "{body}");
    assert_eq!(closed.call(Method::GET, "/api/v1/runs", Some("garbage"), None).await.0, StatusCode::UNAUTHORIZED);
    let (s, v) = closed.call(Method::POST, "/api/v1/runs", Some(&read), Some(json!({"spec": spec("")}))).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("forbidden")), "{v}");
    assert!(!v.to_string().contains(&read), "the token leaked into an error: {v}");
    let (s, _) = closed.call(Method::POST, "/api/v1/runs/1/cancel", Some(&submit), None).await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // Revoked tokens fail; only hashes are stored.
    let id = {
        let hash = shardline_web::auth::hash_token(&read);
        assert_eq!(hash.len(), 64);
        closed.store.token_by_hash(&hash).await.expect("token row").expect("stored by its hash").id
    };
    assert!(read.starts_with("shl_") && read.len() == 4 + 64);
    assert!(revoke_token(&closed.store, id).await.expect("revoke"));
    assert!(!revoke_token(&closed.store, id).await.expect("revoke again"));
    let (s, v) = closed.call(Method::GET, "/api/v1/runs", Some(&read), None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{v}");
    closed.db.cleanup().await;
}

async fn paging(kind: Kind) {
    let app = app(kind, AuthMode::Open).await;
    let p = app.store.upsert_pipeline("bulk", "steps: []", "sha256:1").await.expect("pipeline");
    let other = app.store.upsert_pipeline("other", "steps: []", "sha256:2").await.expect("pipeline");
    // 10,000 runs in one statement: a third failed, the rest succeeded; every tenth of `other`.
    let n = 10_000;
    let bulk = match kind {
        Kind::Sqlite => format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n}) \
             INSERT INTO runs (pipeline_id, state, params, spec) \
             SELECT CASE WHEN i % 10 = 0 THEN {other} ELSE {p} END, \
                    CASE WHEN i % 3 = 0 THEN 'failed' ELSE 'succeeded' END, '{{}}', '{{}}' FROM n"
        ),
        Kind::Postgres => format!(
            "INSERT INTO runs (pipeline_id, state, params, spec) \
             SELECT CASE WHEN i % 10 = 0 THEN {other} ELSE {p} END, \
                    CASE WHEN i % 3 = 0 THEN 'failed' ELSE 'succeeded' END, '{{}}'::jsonb, '{{}}'::jsonb \
             FROM generate_series(1, {n}::bigint) AS i"
        ),
    };
    app.db.execute(&[&bulk]).await;

    let mut seen = 0;
    let mut before: Option<i64> = None;
    let mut last_id = i64::MAX;
    let mut slowest = Duration::ZERO;
    loop {
        let uri = match before {
            None => "/api/v1/runs?limit=500".to_string(),
            Some(b) => format!("/api/v1/runs?limit=500&before={b}"),
        };
        let t = Instant::now();
        let (s, v) = app.get(&uri).await;
        slowest = slowest.max(t.elapsed());
        assert_eq!(s, StatusCode::OK, "{v}");
        for r in v["runs"].as_array().expect("runs") {
            let id = r["id"].as_i64().expect("id");
            assert!(id < last_id, "not newest first");
            last_id = id;
            seen += 1;
        }
        match v["next"].as_i64() {
            Some(next) => before = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, n);
    // Pages deep into the listing cost what the first does (keyset, not offset).
    assert!(slowest < Duration::from_millis(1000), "slowest page of 500 took {slowest:?}");

    // Best of three, so one scheduling hiccup on a loaded machine does not fail the test.
    let mut deep_time = Duration::MAX;
    let mut deep = Value::Null;
    for _ in 0..3 {
        let t = Instant::now();
        deep = app.get("/api/v1/runs?limit=50&before=100").await.1;
        deep_time = deep_time.min(t.elapsed());
    }
    assert_eq!(deep["runs"].as_array().map(Vec::len), Some(50));
    assert_eq!(deep["runs"][0]["id"].as_i64(), Some(99));
    assert!(deep_time < Duration::from_millis(50), "a page of 50 took {deep_time:?}");

    // Filters combine with paging.
    let (_, v) = app.get("/api/v1/runs?state=failed&pipeline=other&limit=1000").await;
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 333, "ids divisible by 30");
    assert!(runs.iter().all(|r| r["state"] == "failed" && r["pipeline"] == "other"));
    assert_eq!(v["next"], Value::Null);
    let (s, _) = app.get("/api/v1/runs?limit=0").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    app.db.cleanup().await;
}

/// Reads SSE frames until one contains `needle` (or the deadline passes).
async fn read_until(body: &mut Body, needle: &str, deadline: Duration) -> String {
    let mut text = String::new();
    let end = Instant::now() + deadline;
    while !text.contains(needle) {
        let left = end.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    text.push_str(&String::from_utf8_lossy(data));
                }
            }
            Ok(other) => panic!("stream ended ({:?}) before `{needle}`; got: {text}", other.map(|r| r.is_ok())),
            Err(_) => panic!("no `{needle}` within {deadline:?}; got: {text}"),
        }
    }
    text
}

async fn events(kind: Kind) {
    let app = app(kind, AuthMode::Open).await;
    let (run, _, _) = seed(&app.store).await;

    // A live stream starts with the next change.
    let req = Request::get("/api/v1/events").body(Body::empty()).expect("request");
    let resp = app.router.clone().oneshot(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/event-stream");
    let mut body = resp.into_body();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(app.store.cancel_run(run, "user:test").await.expect("cancel"));
    let text = read_until(&mut body, "\"kind\":\"run\"", Duration::from_secs(10)).await;
    let run_event =
        text.split("\n\n").find(|e| e.contains("event: run")).unwrap_or_else(|| panic!("no run event in {text}"));
    let data = run_event.lines().find_map(|l| l.strip_prefix("data: ")).expect("data line");
    let data: Value = serde_json::from_str(data).expect("event JSON");
    assert_eq!(
        (data["run"].as_i64(), data["kind"].as_str(), data["state"].as_str()),
        (Some(run.0), Some("run"), Some("cancelled"))
    );
    let id: i64 = run_event.lines().find_map(|l| l.strip_prefix("id: ")).and_then(|s| s.parse().ok()).expect("id line");
    assert!(!text.contains("\"succeeded\""), "events from before the connection were replayed: {text}");

    // Last-Event-ID resumes after that event; `after=0` replays all (the seeded task success).
    let req = Request::get("/api/v1/events?after=0").body(Body::empty()).expect("request");
    let mut body = app.router.clone().oneshot(req).await.expect("response").into_body();
    read_until(&mut body, "\"succeeded\"", Duration::from_secs(10)).await;
    let req = Request::get(format!("/api/v1/events?run={}", run.0))
        .header("Last-Event-ID", (id - 1).to_string())
        .body(Body::empty())
        .expect("request");
    let mut body = app.router.clone().oneshot(req).await.expect("response").into_body();
    let text = read_until(&mut body, &format!("id: {id}"), Duration::from_secs(10)).await;
    assert!(!text.contains(&format!("id: {}\n", id - 2)), "{text}");
    app.db.cleanup().await;
}

#[tokio::test]
async fn openapi_lists_every_route() {
    let app = app(Kind::Sqlite, AuthMode::Open).await;
    let (s, v) = app.get("/api/v1/openapi.json").await;
    assert_eq!(s, StatusCode::OK);
    assert!(v["openapi"].as_str().is_some_and(|o| o.starts_with("3.")), "{v}");
    let paths = v["paths"].as_object().expect("paths");
    let want = [
        ("/api/v1/pipelines", "get"),
        ("/api/v1/pipelines/{name}", "get"),
        ("/api/v1/triggers", "get"),
        ("/api/v1/runs", "get"),
        ("/api/v1/runs", "post"),
        ("/api/v1/runs/{id}", "get"),
        ("/api/v1/runs/{id}/tasks", "get"),
        ("/api/v1/runs/{id}/graph", "get"),
        ("/api/v1/runs/{id}/view", "get"),
        ("/api/v1/runs/{id}/logs", "get"),
        ("/api/v1/runs/{id}/cancel", "post"),
        ("/api/v1/runs/{id}/retry", "post"),
        ("/api/v1/tasks/{id}", "get"),
        ("/api/v1/tasks/{id}/attempts", "get"),
        ("/api/v1/workers", "get"),
        ("/api/v1/storage", "get"),
        ("/api/v1/lint", "post"),
        ("/api/v1/events", "get"),
        ("/api/v1/openapi.json", "get"),
    ];
    for (path, method) in want {
        assert!(paths.get(path).and_then(|p| p.get(method)).is_some(), "{method} {path} missing from the document");
    }
    let listed: usize = paths.values().map(|p| p.as_object().map_or(0, |m| m.len())).sum();
    assert_eq!(listed, want.len(), "routes in the document: {:?}", paths.keys().collect::<Vec<_>>());
    for schema in [
        "RunDto",
        "RunDetailDto",
        "TaskDto",
        "ErrorBody",
        "DiagnosticDto",
        "EventDto",
        "GraphDto",
        "StepDto",
        "ProgressDto",
        "PipelineDetailDto",
        "LeaseDto",
        "TriggerDto",
        "RunViewDto",
        "StorageDto",
    ] {
        assert!(v["components"]["schemas"].get(schema).is_some(), "schema {schema} missing");
    }
    assert!(v["components"]["securitySchemes"]["bearer"].is_object());
    app.db.cleanup().await;
}

shardline_testdb::on_both_backends!(reads, mutations, auth, paging, events,);
