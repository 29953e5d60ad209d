//! The orchestrator's promises, in process, on SQLite and on PostgreSQL alike: the demo pipeline
//! runs to a bit-exact, published checkpoint; an unchanged pipeline is served from the step cache
//! (`no_cache` and a step's `cache: false` recompute); a cancelled run stops leasing and refuses late completions; a run
//! retried from a step re-runs that step only; a task's log lines survive a store that refuses
//! them for a while, stamped when they were written.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use serde_json::{json, Value};
use shardline_store::{AttemptOutcome, Outcome, Resources, RunState, TaskState, WorkerInfo};

shardline_testdb::on_both_backends!(
    demo_runs_validates_and_publishes,
    unchanged_pipeline_is_served_from_cache,
    step_with_cache_false_always_recomputes,
    cancel_stops_leasing_and_refuses_late_completions,
    retry_from_step_reruns_only_that_step,
    logs_survive_a_store_that_refuses_them,
);

const RUN_TIMEOUT: Duration = Duration::from_secs(180);
const LEASE: Duration = Duration::from_secs(3);

fn demo_source() -> (&'static str, String) {
    ("source", fixture("qwen3_next").display().to_string())
}

/// File name → modification time of every file in `dir`.
fn mtimes(dir: &Path) -> BTreeMap<String, SystemTime> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry"))
        .map(|e| {
            (e.file_name().to_string_lossy().into_owned(), e.metadata().and_then(|m| m.modified()).expect("mtime"))
        })
        .collect()
}

fn dir_of(v: &Value) -> PathBuf {
    PathBuf::from(v.get("dir").and_then(Value::as_str).unwrap_or_else(|| panic!("no `dir` in {v}")))
}

fn run_name(r: &shardline_store::RunRow) -> String {
    r.options.name.clone().expect("run name")
}

// ---------------------------------------------------------------------------------------------

async fn demo_runs_validates_and_publishes(kind: Kind) {
    let mut h = Harness::new(kind).await;
    h.start_workers(2, LEASE);
    let s = h.submit(&pipeline_text("demo.yaml"), &[demo_source()], false).await;
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);

    // tp2·dp4: a plan task, 8 rank tasks and a commit, all succeeded once.
    let tasks = h.tasks(s.run).await;
    for t in &tasks {
        assert_eq!(t.state, TaskState::Succeeded, "{}", t.name);
        assert_eq!(t.attempt, 1, "{} ran more than once", t.name);
    }
    let ranks: Vec<_> = tasks.iter().filter(|t| t.name.starts_with("shard/rank-")).collect();
    assert_eq!(ranks.len(), 8);
    let commit = h.task(s.run, "shard/commit").await;
    let dir = dir_of(output(&commit));
    let mut names: Vec<String> = mtimes(&dir).into_keys().collect();
    names.sort();
    let mut want: Vec<String> = (0..8).map(|r| format!("__{r}_0.distcp")).collect();
    want.push(".metadata".into());
    want.sort();
    assert_eq!(names, want, "the committed directory holds the rank files and .metadata only");
    assert!(!PathBuf::from(format!("{}.partial", dir.display())).exists(), "staging directory left behind");

    // The pipeline's validate step passed, and an independent check agrees.
    let validate = h.task(s.run, "validate").await;
    assert_eq!(output(&validate)["ok"], json!(true));
    let source = fixture("qwen3_next");
    assert_bit_exact(&dir, &source);

    // Published with a manifest (written last) listing every file, and the copy is bit-exact too.
    let published = h.base.path().join(".shardline/out").join(run_name(&r));
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(published.join(shardline_publish::MANIFEST)).expect("published manifest"),
    )
    .expect("manifest json");
    assert_eq!(manifest["files"].as_array().map(Vec::len), Some(9), "{manifest:#}");
    assert_bit_exact(&published, &source);
    h.finish().await;
}

async fn unchanged_pipeline_is_served_from_cache(kind: Kind) {
    let mut h = Harness::new(kind).await;
    h.start_workers(2, LEASE);
    let text = pipeline_text("demo.yaml");
    let first = h.submit(&text, &[demo_source()], false).await;
    let r1 = h.wait_finished(first.run, RUN_TIMEOUT).await;
    assert_eq!(r1.state, RunState::Succeeded, "{:?}", r1.error);
    let dir1 = dir_of(output(&h.task(first.run, "shard/commit").await));
    let before = mtimes(&dir1);
    assert_eq!(before.len(), 9);

    // The same pipeline again: the shard plan task is a cache hit, no rank file is written.
    let second = h.submit(&text, &[demo_source()], false).await;
    let r2 = h.wait_finished(second.run, RUN_TIMEOUT).await;
    assert_eq!(r2.state, RunState::Succeeded, "{:?}", r2.error);
    let plan = h.task(second.run, "shard").await;
    let cached = output(&plan).get("cached").unwrap_or_else(|| panic!("shard plan not cached: {}", output(&plan)));
    assert_eq!(dir_of(cached), dir1);
    for t in h.tasks(second.run).await.iter().filter(|t| t.name.starts_with("shard/rank-")) {
        assert_eq!(output(t), &json!({"cached": true}), "{}", t.name);
    }
    assert_eq!(dir_of(output(&h.task(second.run, "shard/commit").await)), dir1);
    assert_eq!(mtimes(&dir1), before, "a cached run rewrote rank files");
    let run2_shard = h.work_dir().join("runs").join(run_name(&r2)).join("shard");
    assert!(!run2_shard.exists(), "a cached run wrote under {}", run2_shard.display());
    assert!(h.base.path().join(".shardline/out").join(run_name(&r2)).join(shardline_publish::MANIFEST).is_file());
    assert_eq!(output(&h.task(second.run, "validate").await)["ok"], json!(true));

    // no_cache recomputes into the run's own directory; the first checkpoint stays untouched.
    let third = h.submit(&text, &[demo_source()], true).await;
    let r3 = h.wait_finished(third.run, RUN_TIMEOUT).await;
    assert_eq!(r3.state, RunState::Succeeded, "{:?}", r3.error);
    let plan = h.task(third.run, "shard").await;
    assert!(output(&plan).get("cached").is_none(), "no_cache run was served from cache: {}", output(&plan));
    for t in h.tasks(third.run).await.iter().filter(|t| t.name.starts_with("shard/rank-")) {
        assert!(output(t)["bytes"].as_u64().is_some_and(|b| b > 0), "{}: {}", t.name, output(t));
    }
    let dir3 = dir_of(output(&h.task(third.run, "shard/commit").await));
    assert_eq!(dir3, h.work_dir().join("runs").join(run_name(&r3)).join("shard/checkpoint"));
    assert_eq!(mtimes(&dir3).len(), 9);
    assert_eq!(mtimes(&dir1), before);
    assert_bit_exact(&dir3, &fixture("qwen3_next"));
    h.finish().await;
}

async fn step_with_cache_false_always_recomputes(kind: Kind) {
    let mut h = Harness::new(kind).await;
    h.start_workers(2, LEASE);
    let demo = pipeline_text("demo.yaml");
    let text = demo.replace("    timeout: 30m\n  - id: split", "    timeout: 30m\n    cache: false\n  - id: split");
    assert_ne!(text, demo, "the demo's shard step moved: update this test");
    let mut dirs = Vec::new();
    for _ in 0..2 {
        let s = h.submit(&text, &[demo_source()], false).await;
        let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
        assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
        let plan = h.task(s.run, "shard").await;
        assert!(output(&plan).get("cached").is_none(), "`cache: false` step served from cache: {}", output(&plan));
        for t in h.tasks(s.run).await.iter().filter(|t| t.name.starts_with("shard/rank-")) {
            assert!(output(t)["bytes"].as_u64().is_some_and(|b| b > 0), "{}: {}", t.name, output(t));
        }
        dirs.push(dir_of(output(&h.task(s.run, "shard/commit").await)));
    }
    assert_ne!(dirs[0], dirs[1], "both runs report the same checkpoint");
    h.finish().await;
}

async fn cancel_stops_leasing_and_refuses_late_completions(kind: Kind) {
    // Validating a synthetic release sharded for 32 ranks takes seconds (validate's time grows
    // with the items it reads): the run is cancelled while it runs.
    let release = synth_release("qwen3_moe", "200MB");
    let mut h = Harness::new(kind).await;
    h.start_workers(2, LEASE);
    let text = format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: cancel-me
steps:
  - id: download
    uses: hf.download
    with: {{path: "{}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: 1, dp: 32}}
  - id: validate
    uses: checkpoint.validate
    needs: [shard]
  - id: upload
    uses: store.upload
    needs: [validate]
    with: {{to: "file://out/${{{{ run.id }}}}"}}
"#,
        release.display()
    );
    let s = h.submit(&text, &[], false).await;
    let leased = h.wait_task(s.run, "validate", RUN_TIMEOUT, |t| t.state == TaskState::Leased).await;
    assert!(h.store.cancel_run(s.run, "user:test").await.expect("cancel_run"), "the run was already finished");

    let r = h.run(s.run).await;
    assert_eq!(r.state, RunState::Cancelled);
    for t in h.tasks(s.run).await {
        let want =
            if t.step_id == "download" || t.step_id == "shard" { TaskState::Succeeded } else { TaskState::Cancelled };
        assert_eq!(t.state, want, "{}", t.name);
    }
    let attempts = h.attempts(s.run, "validate").await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].outcome, Some(AttemptOutcome::Cancelled));

    // The running attempt's lease is fenced off: no heartbeat, no completion.
    let lease = lease_of(&leased);
    assert!(!h.store.heartbeat(&lease, LEASE, None).await.expect("heartbeat"), "heartbeat accepted after cancel");
    let late = Outcome::Succeeded { output: json!({"ok": true}) };
    assert!(!h.store.complete(&lease, late).await.expect("complete"), "late completion accepted after cancel");

    // The worker notices at its next heartbeat and stops; its own completion is refused too.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let logs = h.logs(s.run, "validate").await;
        let stopped = logs.iter().any(|l| l.contains("lease lost; stopping"));
        let ended = logs.iter().any(|l| l.starts_with("succeeded in") || l.starts_with("error:"));
        if stopped && ended {
            break;
        }
        assert!(Instant::now() < deadline, "the worker did not report the lost lease: {logs:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Give its completion call time to land, then check nothing changed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = h.task(s.run, "validate").await;
    assert_eq!(t.state, TaskState::Cancelled);
    assert_eq!(t.output, None, "a late completion stored an output");
    assert_eq!(h.attempts(s.run, "validate").await[0].outcome, Some(AttemptOutcome::Cancelled));
    assert_eq!(h.run(s.run).await.state, RunState::Cancelled);

    // No more leases: the idle workers take nothing, and nothing of the run can be claimed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(h.attempts(s.run, "upload").await.is_empty(), "upload was leased after cancel");
    assert_eq!(h.attempts(s.run, "validate").await.len(), 1);
    let w = h
        .store
        .register_worker(WorkerInfo {
            name: "probe".into(),
            cpus: 64,
            memory: 1 << 40,
            gpus: vec![0],
            scratch: 1 << 44,
        })
        .await
        .expect("register");
    let all = Resources { cpus: 64, memory: 1 << 40, gpus: 1, scratch: 1 << 44 };
    assert!(h.store.claim(w, &all, LEASE).await.expect("claim").is_none(), "a task of a cancelled run was claimable");
    h.finish().await;
}

async fn retry_from_step_reruns_only_that_step(kind: Kind) {
    let mut h = Harness::new(kind).await;
    h.start_workers(2, LEASE);
    // The destination's parent is a file: publishing fails until it is removed.
    let blocked = h.base.path().join("blocked");
    std::fs::write(&blocked, b"not a directory").expect("blocking file");
    let text = format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: retry-me
steps:
  - id: download
    uses: hf.download
    with: {{path: "{}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: 2, dp: 2}}
  - id: validate
    uses: checkpoint.validate
    needs: [shard]
  - id: upload
    uses: store.upload
    needs: [validate]
    with: {{to: "file://{}/out"}}
    retry: {{attempts: 2, backoff: 0s}}
"#,
        fixture("qwen3_next").display(),
        blocked.display()
    );
    let s = h.submit(&text, &[], false).await;
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Failed);
    let error = r.error.clone().unwrap_or_default();
    assert!(
        error.contains("`upload`") && error.contains("2 attempts") && error.contains(&blocked.display().to_string()),
        "the run's error should name the step, the attempts and the blocked path: {error}"
    );
    let upload = h.task(s.run, "upload").await;
    assert_eq!((upload.state, upload.attempt), (TaskState::Failed, 2));
    let before: BTreeMap<String, i32> = h.tasks(s.run).await.into_iter().map(|t| (t.name, t.attempt)).collect();

    std::fs::remove_file(&blocked).expect("unblock");
    h.store.retry_run(s.run, Some("upload"), "user:test").await.expect("retry_run");
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    for t in h.tasks(s.run).await {
        assert_eq!(t.state, TaskState::Succeeded, "{}", t.name);
        if t.name == "upload" {
            assert_eq!(t.attempt, 3, "upload: two failed attempts, then one more");
        } else {
            assert_eq!(t.attempt, before[&t.name], "{} ran again", t.name);
        }
    }
    assert!(blocked.join("out").join(shardline_publish::MANIFEST).is_file());
    h.finish().await;
}

async fn logs_survive_a_store_that_refuses_them(kind: Kind) {
    let release = synth_release("qwen3_moe", "200MB");
    let mut h = Harness::new(kind).await;
    h.start_workers(1, LEASE);
    let text = format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: logs
steps:
  - id: download
    uses: hf.download
    with: {{path: "{}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: 1, dp: 2}}
  - id: split
    uses: megatron.split_fused
    needs: [shard]
  - id: validate
    uses: checkpoint.validate
    needs: [split]
"#,
        release.display()
    );
    let s = h.submit(&text, &[], false).await;
    h.wait_task(s.run, "validate", RUN_TIMEOUT, |t| t.state == TaskState::Leased).await;
    // For a while (longer than a log flush period), every log insert fails.
    let refuse: &[&str] = match kind {
        Kind::Sqlite => &["CREATE TRIGGER refuse_logs BEFORE INSERT ON logs BEGIN SELECT RAISE(ABORT, 'logs refused'); END"],
        Kind::Postgres => &[
            "CREATE FUNCTION refuse_logs() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'logs refused'; END $$",
            "CREATE TRIGGER refuse_logs BEFORE INSERT ON logs FOR EACH ROW EXECUTE FUNCTION refuse_logs()",
        ],
    };
    h.db.execute(refuse).await;
    let refused_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stored_while_refused = h.logs(s.run, "validate").await;
    let accept: &[&str] = match kind {
        Kind::Sqlite => &["DROP TRIGGER refuse_logs"],
        Kind::Postgres => &["DROP TRIGGER refuse_logs ON logs"],
    };
    h.db.execute(accept).await;
    let refused_for = refused_at.elapsed();
    assert!(
        stored_while_refused.iter().all(|l| !l.contains("bit-exactly")),
        "validate finished while logs were refused: nothing was tested"
    );

    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    // A task that finished while its lines were refused stores them on a later retry of its
    // worker: wait for the last line rather than read once.
    let waited = Instant::now();
    let mut rows = h.log_rows(s.run, "validate").await;
    while !rows.iter().any(|l| l.line.contains("succeeded in")) && waited.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        rows = h.log_rows(s.run, "validate").await;
    }
    let lines: Vec<&str> = rows.iter().map(|l| l.line.as_str()).collect();
    for want in ["attempt 1 of `validate`", "reconstructed bit-exactly", "succeeded in"] {
        let n = lines.iter().filter(|l| l.contains(want)).count();
        assert_eq!(n, 1, "`{want}` appears {n} times in validate's log: {lines:#?}");
    }
    // Lines carry the time they were written, not the time the store took them.
    let attempt = &h.attempts(s.run, "validate").await[0];
    let first = rows.iter().find(|l| l.line.starts_with("attempt 1 of")).expect("first line");
    let late = (first.ts - attempt.started_at).num_milliseconds();
    assert!(
        late < 500,
        "the attempt's first line is stamped {late} ms after the attempt started (it was held back {refused_for:?})"
    );
    assert!(rows.windows(2).all(|w| w[0].ts <= w[1].ts), "log lines out of order: {rows:#?}");
    h.finish().await;
}
