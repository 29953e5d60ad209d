//! `command` tasks run as the worker runs them (on a blocking thread with a `StepContext`), with
//! real processes: environment, logs, exit codes, results, and the process group stopped on
//! cancel and timeout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardline_control::graph::{CommandInput, CommandJob};
use shardline_control::TaskOutput;
use shardline_engine::steps::{StepContext, StepError};
use shardline_engine::{HubSettings, ObjectSourceSettings};
use shardline_formats::execute::Progress;

struct Run {
    result: Result<TaskOutput, StepError>,
    stdout: Vec<String>,
    stderr: Vec<String>,
}

fn job(dir: &Path, run: &[&str], shell: bool) -> CommandJob {
    CommandJob {
        run: run.iter().map(|s| s.to_string()).collect(),
        shell,
        env: BTreeMap::new(),
        inherit: Vec::new(),
        workdir: dir.to_path_buf(),
        out: dir.join("step/out"),
        remote: None,
        inputs: Vec::new(),
    }
}

fn execute(
    job: &CommandJob,
    outputs: &BTreeMap<String, TaskOutput>,
    gpus: &[u32],
    cancel_after: Option<Duration>,
) -> Run {
    execute_with(job, outputs, gpus, cancel_after, Duration::ZERO)
}

fn execute_with(
    job: &CommandJob,
    outputs: &BTreeMap<String, TaskOutput>,
    gpus: &[u32],
    cancel_after: Option<Duration>,
    timeout: Duration,
) -> Run {
    let progress = Arc::new(Progress::default());
    let total = Arc::new(AtomicU64::new(0));
    let stdout = Mutex::new(Vec::new());
    let stderr = Mutex::new(Vec::new());
    let log = |l: String| stdout.lock().unwrap().push(l);
    let err = |l: String| stderr.lock().unwrap().push(l);
    let (hub, objects) = (HubSettings::default(), ObjectSourceSettings::default());
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let scratch = std::env::temp_dir();
    let ctx = StepContext {
        outputs,
        progress: &progress,
        bytes_total: &total,
        log: &log,
        hub: &hub,
        objects: &objects,
        cpus: 1,
        gpus,
        timeout,
        stderr: &err,
        runtime: runtime.handle(),
        ledger: None,
        scratch: &scratch,
        scratch_root: &scratch,
    };
    let result = std::thread::scope(|s| {
        if let Some(after) = cancel_after {
            let progress = progress.clone();
            s.spawn(move || {
                std::thread::sleep(after);
                progress.cancel.store(true, Ordering::Relaxed);
            });
        }
        shardline_engine::command::run(job, &ctx)
    });
    Run { result, stdout: stdout.into_inner().unwrap(), stderr: stderr.into_inner().unwrap() }
}

fn output(dir: Option<&str>, path: Option<&str>) -> TaskOutput {
    TaskOutput { dir: dir.map(PathBuf::from), path: path.map(PathBuf::from), ..TaskOutput::default() }
}

#[test]
fn environment_holds_the_needs_outputs_the_gpus_and_nothing_else() {
    let tmp = tempfile::tempdir().unwrap();
    let mut j = job(tmp.path(), &["sh", "-c", "env | sort"], false);
    j.env.insert("MODE".into(), "strict".into());
    j.inputs = vec![
        CommandInput { step: "load-check".into(), task: "load-check".into() },
        CommandInput { step: "shard".into(), task: "shard/commit".into() },
    ];
    let mut outputs = BTreeMap::new();
    let mut previous = output(Some("/runs/r/load-check/out"), None);
    previous.result = Some(serde_json::from_str(r#"{"ok": true}"#).unwrap());
    outputs.insert("load-check".to_string(), previous);
    outputs.insert("shard/commit".to_string(), output(Some("/runs/r/shard/checkpoint"), None));
    // Not inherited without `inherit`.
    std::env::set_var("SHARDLINE_TEST_SECRET", "hidden");
    let r = execute(&j, &outputs, &[1, 3], None);
    let out = r.result.expect("success");
    let env: BTreeMap<&str, &str> = r.stdout.iter().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(env.get("CUDA_VISIBLE_DEVICES"), Some(&"1,3"));
    assert_eq!(env.get("MODE"), Some(&"strict"));
    assert_eq!(env.get("SHARDLINE_STEP_SHARD_DIR"), Some(&"/runs/r/shard/checkpoint"));
    assert_eq!(env.get("SHARDLINE_STEP_LOAD_CHECK_DIR"), Some(&"/runs/r/load-check/out"));
    assert_eq!(env.get("SHARDLINE_STEP_LOAD_CHECK_RESULT"), Some(&r#"{"ok":true}"#));
    let out_dir = tmp.path().join("step/out");
    assert_eq!(env.get("SHARDLINE_OUTPUT_DIR").map(PathBuf::from), Some(out_dir.clone()));
    assert!(env.contains_key("PATH"));
    assert!(!env.contains_key("SHARDLINE_TEST_SECRET"), "{env:?}");
    assert_eq!((out.dir, out.exit_code, out.result), (Some(out_dir), Some(0), None));

    // Passed by name with `inherit`; no GPUs leased: an empty CUDA_VISIBLE_DEVICES.
    j.inherit = vec!["SHARDLINE_TEST_SECRET".into()];
    let r = execute(&j, &outputs, &[], None);
    assert!(r.result.is_ok());
    assert!(r.stdout.iter().any(|l| l == "SHARDLINE_TEST_SECRET=hidden"));
    assert!(r.stdout.iter().any(|l| l == "CUDA_VISIBLE_DEVICES="), "{:?}", r.stdout);
}

#[test]
fn exit_codes_results_and_stderr_decide_the_outcome() {
    let tmp = tempfile::tempdir().unwrap();
    let ok = job(
        tmp.path(),
        &["echo line one; echo oops >&2; printf '{\"loaded\": 3}' > \"$SHARDLINE_OUTPUT_DIR/result.json\""],
        true,
    );
    let r = execute(&ok, &BTreeMap::new(), &[], None);
    let out = r.result.expect("success");
    assert_eq!(out.result.and_then(|m| m.get("loaded").cloned()), Some(serde_json::json!(3)));
    assert!(r.stdout.iter().any(|l| l == "line one"), "{:?}", r.stdout);
    assert_eq!(r.stderr, ["oops"]);

    let failing = job(tmp.path(), &["for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo err $i >&2; done; exit 3"], true);
    let e = execute(&failing, &BTreeMap::new(), &[], None).result.expect_err("exit 3 fails");
    assert!(e.message.contains("exited with code 3"), "{}", e.message);
    assert!(e.message.contains("err 3\n") && e.message.ends_with("err 12"), "{}", e.message);
    assert!(!e.message.contains("err 2\n"), "only the last lines: {}", e.message);

    let killed = job(tmp.path(), &["kill -SEGV $$"], true);
    let e = execute(&killed, &BTreeMap::new(), &[], None).result.expect_err("killed");
    assert!(e.message.contains("killed by signal 11 (SIGSEGV)"), "{}", e.message);

    let missing = job(tmp.path(), &["./no-such-program"], false);
    let e = execute(&missing, &BTreeMap::new(), &[], None).result.expect_err("missing");
    assert!(e.message.contains("cannot start `./no-such-program`"), "{}", e.message);

    let bad_result = job(tmp.path(), &["echo '[1, 2]' > \"$SHARDLINE_OUTPUT_DIR/result.json\""], true);
    let e = execute(&bad_result, &BTreeMap::new(), &[], None).result.expect_err("not an object");
    assert!(e.message.contains("not a JSON object"), "{}", e.message);
}

fn pids(file: &Path) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let pids: Vec<u32> = text.split_whitespace().filter_map(|p| p.parse().ok()).collect();
        if pids.len() == 2 {
            return pids;
        }
        assert!(Instant::now() < deadline, "the command did not write its pids");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Alive: in /proc and not a zombie (a reaped-soon corpse runs nothing).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn cancel_and_timeout_stop_the_whole_process_group() {
    let tmp = tempfile::tempdir().unwrap();
    // The shell ignores SIGTERM, so only SIGKILL after the grace stops it; its child sleeps.
    let script = "trap '' TERM; sleep 1000 & echo $$ $! > \"$PIDS\"; wait; wait";
    for (cancel, timeout) in [(Some(Duration::from_millis(500)), Duration::ZERO), (None, Duration::from_millis(500))] {
        let pids_file = tmp.path().join(format!("pids-{}", timeout.as_millis()));
        let mut j = job(tmp.path(), &[script], true);
        j.env.insert("PIDS".into(), pids_file.display().to_string());
        let watcher = std::thread::spawn(move || {
            let pids = pids(&pids_file);
            assert!(pids.iter().all(|&p| alive(p)));
            pids
        });
        let started = Instant::now();
        let r = execute_with(&j, &BTreeMap::new(), &[], cancel, timeout);
        let stopped_after = started.elapsed();
        let pids = watcher.join().unwrap();
        let e = r.result.expect_err("stopped");
        let why = if cancel.is_some() { "cancelled or its lease lost" } else { "timeout passed" };
        assert!(e.message.contains(why), "{}", e.message);
        assert!(e.message.contains("SIGKILL"), "{}", e.message);
        // The decision came at 0.5 s; the group is gone within 2 s of it.
        assert!(stopped_after < Duration::from_millis(2500), "{stopped_after:?}");
        let deadline = Instant::now() + Duration::from_millis(200);
        while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(pids.iter().all(|&p| !alive(p)), "processes of the group outlived the stop: {pids:?}");
        assert!(r.stdout.iter().any(|l| l.contains("SIGTERM to its process group")), "{:?}", r.stdout);
    }
}
