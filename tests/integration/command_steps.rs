//! `command` steps in a shared deployment on PostgreSQL, with the real binary: a command reads
//! the checkpoint of the step it needs from its environment and records a result; its output
//! lines reach the task log; a non-zero exit fails the task with its stderr; GPUs reach it as
//! `CUDA_VISIBLE_DEVICES` from the worker's leasing; and its process group (a shell that ignores
//! SIGTERM and a child `sleep`) is gone within 2 s of a cancel and of the worker finding its lease
//! lost.

use std::path::Path;
use std::time::{Duration, Instant};

use shardline_store::{AttemptOutcome, RunState, TaskState};

use crate::orchestrator::{spec, Deployment};
use crate::{fixture, stderr, stdout};

#[test]
fn command_steps_read_their_needs_record_results_and_fail_on_exit_codes() {
    let mut d = Deployment::new(false);
    d.server("server");
    d.worker("cpu", &["--cpus", "2", "--lease-seconds", "2"]);
    d.worker("gpu", &["--cpus", "1", "--gpus", "0,1", "--lease-seconds", "2"]);
    let tail = r#"  - id: check
    uses: command
    needs: [validate, shard]
    with:
      run:
        - sh
        - -c
        - |
          ls -A "$SHARDLINE_STEP_SHARD_DIR"
          echo "$GREETING" >&2
          n=$(ls -A "$SHARDLINE_STEP_SHARD_DIR" | wc -l)
          printf '{"files": %d, "devices": "%s", "validated": "%s"}' "$n" "$CUDA_VISIBLE_DEVICES" \
            "$SHARDLINE_STEP_VALIDATE_DIR" > "$SHARDLINE_OUTPUT_DIR/result.json"
      env: {GREETING: "hello from ${{ run.id }}"}
    retry: {attempts: 1}
  - id: gpu-check
    uses: command
    needs: [check]
    with:
      run: 'printf "{\"devices\": \"%s\", \"files\": %s}" "$CUDA_VISIBLE_DEVICES" "$(echo "$SHARDLINE_STEP_CHECK_RESULT" | sed "s/.*\"files\":\([0-9]*\).*/\1/")" > "$SHARDLINE_OUTPUT_DIR/result.json"'
      shell: true
    resources: {gpus: 2}
    retry: {attempts: 1}
"#;
    let run = d.submit(&spec("command-steps", &fixture("qwen3_next"), 2, 2, tail));
    let r = d.wait_run(run);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);

    let checkpoint = d.run_dir(run).join("shard/checkpoint");
    let files = std::fs::read_dir(&checkpoint).expect("checkpoint").count();
    assert_eq!(files, 5, ".metadata and four rank files");
    let check = d.task(run, "check");
    let out = check.output.expect("check output");
    assert_eq!(out["dir"], serde_json::json!(d.run_dir(run).join("check/out")));
    assert_eq!(out["exit_code"], 0);
    assert_eq!(out["result"]["files"], files);
    // A CPU task is given no GPU, whichever worker runs it.
    assert_eq!(out["result"]["devices"], "");
    assert_eq!(out["result"]["validated"], serde_json::json!(checkpoint));
    let log = d.task_log(run, "check");
    for want in [".metadata", "__0_0.distcp", &format!("hello from {}", d.run_name(run)), "exited with code 0"] {
        assert!(log.contains(want), "`{want}` is missing from the command's log:\n{log}");
    }
    // The GPU step ran on the worker with GPUs, given the devices it leased, and read the
    // result of the step it needs.
    let gpu = d.task(run, "gpu-check");
    let attempts = d.attempts(run, "gpu-check");
    assert_eq!(attempts[0].worker_name, "gpu");
    let out = gpu.output.expect("gpu-check output");
    assert_eq!((out["result"]["devices"].as_str(), out["result"]["files"].as_u64()), (Some("0,1"), Some(5)));
    assert!(d.task_log(run, "gpu-check").contains("CUDA_VISIBLE_DEVICES=\"0,1\""));

    // Exit code 3 fails the task (and the run) with the code and the last lines of stderr.
    let failing = d.submit(
        "apiVersion: shardline/v1
kind: Pipeline
name: exit-three
steps:
  - id: fail
    uses: command
    with: {run: [sh, -c, 'echo working; echo \"bad input: no such key\" >&2; exit 3']}
    retry: {attempts: 1}
",
    );
    let r = d.wait_run(failing);
    assert_eq!(r.state, RunState::Failed);
    let t = d.task(failing, "fail");
    assert_eq!(t.state, TaskState::Failed);
    let error = t.error.expect("error");
    assert!(error.contains("exited with code 3") && error.contains("bad input: no such key"), "{error}");
    let log = d.task_log(failing, "fail");
    assert!(log.contains("working") && log.contains("bad input: no such key"), "{log}");
}

/// A command whose shell ignores SIGTERM and whose child sleeps; it writes both pids.
fn stubborn(name: &str, pids: &Path, retry: &str) -> String {
    format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: {name}
steps:
  - id: stubborn
    uses: command
    with:
      run: 'trap "" TERM; sleep 1000 & echo $$ $! > "$PIDS"; wait; wait'
      shell: true
      env: {{PIDS: "{}"}}
    retry: {retry}
"#,
        pids.display()
    )
}

fn wait_pids(file: &Path) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let pids: Vec<u32> = text.split_whitespace().filter_map(|p| p.parse().ok()).collect();
        if pids.len() == 2 {
            return pids;
        }
        assert!(Instant::now() < deadline, "the command did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Running (a zombie waiting for its reaper runs nothing).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// How long until none of `pids` runs (at most 10 s).
fn gone_after(pids: &[u32], since: Instant) -> Duration {
    while pids.iter().any(|&p| alive(p)) {
        assert!(since.elapsed() < Duration::from_secs(10), "{pids:?} still run 10 s later");
        std::thread::sleep(Duration::from_millis(5));
    }
    since.elapsed()
}

#[test]
fn a_cancelled_command_group_is_gone_within_2s() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let pids_file = tmp.path().join("pids");
    let mut d = Deployment::new(false);
    d.server("server");
    // A long lease: the cancel is noticed by reading the lease back, not by a heartbeat.
    d.worker("w1", &["--cpus", "1", "--lease-seconds", "30"]);
    let run = d.submit(&stubborn("cancel-command", &pids_file, "{attempts: 1}"));
    let pids = wait_pids(&pids_file);
    std::thread::sleep(Duration::from_millis(300));
    assert!(pids.iter().all(|&p| alive(p)), "the command ended by itself");

    let o = crate::run(&mut d.cmd(&["cancel", &run.0.to_string()]));
    let cancelled = Instant::now();
    assert!(o.status.success(), "cancel: {}", stderr(&o));
    let took = gone_after(&pids, cancelled);
    assert!(took < Duration::from_secs(2), "the command's group outlived the cancel by {took:?}");
    eprintln!("the cancelled command's group was gone {took:?} after the cancel");
    assert_eq!(d.wait_run(run).state, RunState::Cancelled);
    let needles = ["SIGTERM to its process group", "SIGKILL"];
    let log = d.task_log_holding(run, "stubborn", &needles);
    assert!(needles.iter().all(|n| log.contains(n)), "{log}");
    assert!(d.alive("w1"));
}

/// The worker is frozen (SIGSTOP) past its lease, so the reaper takes the lease back and the
/// task fails (`lost: 1`); the command, in a process group of its own, runs on meanwhile. Woken
/// (SIGCONT), the worker finds its lease lost at its next lease read and stops the group: it is
/// gone within 2 s of the wake-up, which bounds the time from finding out.
#[test]
fn a_command_whose_lease_is_lost_is_stopped_within_2s() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let pids_file = tmp.path().join("pids");
    let mut d = Deployment::new(false);
    d.server("server");
    d.worker("w1", &["--cpus", "1", "--lease-seconds", "2"]);
    let run = d.submit(&stubborn("lost-command", &pids_file, "{attempts: 1, lost: 1}"));
    let pids = wait_pids(&pids_file);

    d.signal("w1", "STOP");
    let r = d.wait_run(run);
    assert_eq!(r.state, RunState::Failed, "{:?}", r.error);
    let attempts = d.attempts(run, "stubborn");
    assert_eq!(attempts[0].outcome, Some(AttemptOutcome::Expired));
    assert!(pids.iter().all(|&p| alive(p)), "the command stopped while its worker was frozen");

    d.signal("w1", "CONT");
    let woken = Instant::now();
    let took = gone_after(&pids, woken);
    assert!(took < Duration::from_secs(2), "the command's group outlived the lost lease by {took:?}");
    eprintln!("the command's group was gone {took:?} after its worker woke to a lost lease");
    let log = d.task_log_holding(run, "stubborn", &["lease lost"]);
    assert!(log.contains("lease lost"), "{log}");
    assert!(d.alive("w1"));
}

/// `pipelines/load-check.yaml` as written, run by `shardline run` from the repository root:
/// the published checkpoint is loaded by PyTorch (the `.venv` of `scripts/setup-python`) in a
/// command step, whose recorded result says what torch found.
#[test]
fn the_load_check_example_loads_the_published_checkpoint_with_torch() {
    let root = shardline_publish::moto::repo_root();
    let python = shardline_publish::moto::venv_python();
    assert!(python.is_file(), "{} is missing: run scripts/setup-python", python.display());
    let tmp = tempfile::tempdir().expect("temp dir");
    let state = tmp.path().join("state");
    let out = tmp.path().join("out");
    let o = crate::run(
        crate::bin()
            .args(["run", "pipelines/load-check.yaml", "--state-dir"])
            .arg(&state)
            .arg("--set")
            .arg(format!("python={}", python.display()))
            .arg("--set")
            .arg(format!("out={}", out.display()))
            .current_dir(&root)
            .env_remove("SHARDLINE_DATABASE_URL"),
    );
    assert_eq!(o.status.code(), Some(0), "{}\n{}", stdout(&o), stderr(&o));

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let url = format!("sqlite://{}", state.join("state.db").display());
    let (result, published) = rt.block_on(async {
        let store = shardline_store::Store::connect(&url).await.expect("store");
        let page =
            store.list_runs(&Default::default(), shardline_store::Page { limit: 1, before: None }).await.expect("runs");
        let run = page.runs.first().expect("a run").id;
        let tasks = store.run_tasks(run).await.expect("tasks");
        let output = |name: &str| {
            let t = tasks.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no task `{name}`"));
            shardline_control::TaskOutput::from_value(t.output.as_ref().expect("output"))
        };
        let (check, upload) = (output("load-check"), output("upload"));
        store.close().await;
        (serde_json::Value::Object(check.result.expect("a recorded result")), upload.dest.expect("upload URL"))
    });
    let published = published.strip_prefix("file://").expect("a file:// URL").to_string();
    assert!(published.starts_with(&out.display().to_string()), "{published}");
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(Path::new(&published).join("shardline-manifest.json")).expect("manifest"),
    )
    .expect("manifest JSON");
    assert_eq!(result["ok"], true, "{result:#?}");
    assert_eq!(result["checkpoint"], published.as_str());
    assert!(result["torch"].as_str().is_some_and(|v| v.starts_with("2.")), "{result:#?}");
    assert_eq!(result["files_checked"], manifest["files"].as_array().expect("files").len());
    assert_eq!(result["unfilled"], 0);
    assert!(result["problems"].as_array().is_some_and(Vec::is_empty));
    // The checkpoint's own account of itself (what `inspect` reads from `.metadata`).
    let o = crate::run(crate::bin().args(["inspect", "--json", "--summary"]).arg(&published));
    assert!(o.status.success(), "inspect: {}", stderr(&o));
    let summary: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("inspect JSON");
    eprintln!("load check: {result}\ninspect: {summary}");
    let tensors = result["tensors"].as_u64().expect("tensors");
    assert_eq!(Some(tensors), summary["tensor_count"].as_u64(), "torch loaded every tensor `.metadata` declares");
    assert!(result["parameters"].as_u64() > Some(0) && result["bytes"].as_u64() > Some(0));
    let dtypes: u64 = result["dtypes"].as_object().expect("dtypes").values().filter_map(|v| v.as_u64()).sum();
    assert_eq!(dtypes, tensors);
}
