//! Concurrency limits, pools and priorities with the real binary on PostgreSQL: runs of a
//! `concurrency: 1` pipeline never overlap (from their attempts' times), a pool's slots bound
//! runs of two pipelines together, a high-priority run submitted last starts first when the
//! busy worker frees up, `skip` and `cancel-previous` at `submit`, and the API's "why waiting"
//! names the limit.

use std::io::{Read, Write};
use std::net::TcpStream;

use super::*;

/// A two-step pipeline (download and shard of a tiny release, never from the step cache) with
/// `head` (its `concurrency:`, `pool:`, `priority:`) at the top level.
fn limited_spec(name: &str, head: &str) -> String {
    spec_of(name, head, &fixture("llama"), 2)
}

/// As [`limited_spec`], converting `source` into `dp` rank files.
fn spec_of(name: &str, head: &str, source: &Path, dp: u64) -> String {
    format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: {name}\n{head}\nsteps:\n\
         \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}, cache: false}}\n\
         \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 1, dp: {dp}}}, cache: false}}\n",
        source.display()
    )
}

/// A run long enough (a 200 MB release into 16 rank files) to catch its worker busy with it.
fn long_spec(name: &str, head: &str) -> String {
    spec_of(name, head, &synth("qwen3_moe", "200MB"), 16)
}

impl Deployment {
    /// `shardline submit` with extra arguments: (exit code, stdout, stderr).
    fn submit_with(&self, spec: &str, extra: &[&str]) -> (Option<i32>, String, String) {
        let file = self.dir.path().join(format!("pipeline-{}.yaml", SEQ.fetch_add(1, Ordering::Relaxed)));
        std::fs::write(&file, spec).expect("write spec");
        let o = run(self.cmd(&["submit"]).arg(&file).args(extra));
        (o.status.code(), stdout(&o), stderr(&o))
    }

    /// From the first attempt's start to the last one's end, over every task of the run (in
    /// microseconds since the epoch, by the database's clock).
    fn window(&self, run: RunId) -> (i64, i64) {
        let tasks = self.q(|s| async move { s.run_tasks(run).await });
        let mut attempts = Vec::new();
        for t in tasks {
            let id = t.id;
            attempts.extend(self.q(|s| async move { s.task_attempts(id).await }));
        }
        let start = attempts.iter().map(|a| a.started_at.timestamp_micros()).min().expect("the run has attempts");
        let end = attempts
            .iter()
            .map(|a| a.ended_at.expect("every attempt ended").timestamp_micros())
            .max()
            .expect("attempts");
        (start, end)
    }

    /// Waits until some task of `run` is leased, then stops `worker` (SIGSTOP): it is busy.
    fn stop_while_busy(&mut self, run: RunId, worker: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let tasks = self.q(|s| async move { s.run_tasks(run).await });
            if tasks.iter().any(|t| t.state == TaskState::Leased) {
                self.signal(worker, "STOP");
                return;
            }
            let r = self.run_row(run);
            assert!(
                !r.state.is_terminal() && Instant::now() < deadline,
                "run {run} is {} with nothing leased",
                r.state
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the server's log shows its HTTP address.
    fn http_addr(&mut self, name: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let log = self.log(name);
            let addr = log
                .lines()
                .find_map(|l| l.strip_prefix("server: dashboard and API on http://"))
                .and_then(|rest| rest.split('/').next());
            if let Some(addr) = addr {
                return addr.to_string();
            }
            assert!(Instant::now() < deadline, "`{name}` printed no HTTP address: {log}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Asserts that no two of the runs' windows overlap.
fn assert_one_at_a_time(d: &Deployment, runs: &[RunId]) {
    let mut windows: Vec<(i64, i64, RunId)> = runs
        .iter()
        .map(|r| {
            let (s, e) = d.window(*r);
            (s, e, *r)
        })
        .collect();
    windows.sort();
    for pair in windows.windows(2) {
        let (_, end, before) = pair[0];
        let (start, _, after) = pair[1];
        assert!(start >= end, "run {after} started at {start} before run {before} ended at {end}: {windows:?}");
    }
}

#[test]
fn runs_of_a_limit_one_pipeline_never_overlap() {
    let mut d = Deployment::new(false);
    d.server("server");
    for i in 0..3 {
        d.worker(&format!("w{i}"), &[]);
    }
    let spec = limited_spec("nightly", "concurrency: 1");
    let runs: Vec<RunId> = (0..5).map(|_| d.submit(&spec)).collect();
    for r in &runs {
        let row = d.wait_run(*r);
        assert_eq!(row.state, RunState::Succeeded, "run {r}: {:?}", row.error);
    }
    assert_one_at_a_time(&d, &runs);
}

#[test]
fn a_pool_bounds_runs_of_two_pipelines() {
    let mut d = Deployment::new(false);
    d.spawn("server", &["server", "--pool", "gpu-big=1"]);
    d.worker("w0", &[]);
    d.worker("w1", &[]);
    let a = limited_spec("convert-a", "pool: gpu-big");
    let b = limited_spec("convert-b", "pool: gpu-big");
    // The server defines the pool as it starts: wait for it before submitting.
    let deadline = Instant::now() + WAIT;
    while d.q(|s| async move { s.list_pools().await }).is_empty() {
        assert!(Instant::now() < deadline, "the server defined no pool");
        std::thread::sleep(Duration::from_millis(20));
    }
    let runs = vec![d.submit(&a), d.submit(&b), d.submit(&a), d.submit(&b)];
    for r in &runs {
        let row = d.wait_run(*r);
        assert_eq!(row.state, RunState::Succeeded, "run {r}: {:?}", row.error);
    }
    assert_one_at_a_time(&d, &runs);
}

#[test]
fn a_high_priority_run_submitted_last_starts_first() {
    let mut d = Deployment::new(false);
    d.server("server");
    // One task at a time.
    d.worker("w0", &["--cpus", "1"]);
    // The worker is busy with a first run; while it is stopped two more are submitted.
    let first = d.submit(&long_spec("first", ""));
    d.stop_while_busy(first, "w0");
    let low = d.submit(&limited_spec("low", ""));
    let (code, out, err) = d.submit_with(&limited_spec("high", ""), &["--priority", "10"]);
    assert_eq!(code, Some(0), "submit --priority: {err}");
    let high = RunId(out.trim().parse().expect("run id"));
    d.signal("w0", "CONT");
    for r in [first, low, high] {
        let row = d.wait_run(r);
        assert_eq!(row.state, RunState::Succeeded, "run {r}: {:?}", row.error);
    }
    assert_eq!(d.task(high, "download").priority, 10);
    let (high_start, high_end) = d.window(high);
    let (low_start, _) = d.window(low);
    assert!(high_start < low_start, "high started at {high_start}, low at {low_start}");
    assert!(high_end <= low_start, "the single worker ran the whole high-priority run first");
}

#[test]
fn skip_and_cancel_previous_at_submit() {
    let d = Deployment::new(false);
    // No worker: runs stay queued, which is live.
    let skip = limited_spec("nightly-skip", "concurrency: {limit: 1, overflow: skip}");
    let first = d.submit(&skip);
    let (code, out, err) = d.submit_with(&skip, &[]);
    assert_eq!(code, Some(3), "a skipped submission exits 3: {err}");
    assert!(out.trim().is_empty(), "no run id is printed: {out}");
    assert!(err.contains(&format!("skipped: pipeline nightly-skip at its limit 1 (live: run {first})")), "{err}");
    let replace = limited_spec("nightly-replace", "concurrency: {limit: 1, overflow: cancel-previous}");
    let old = d.submit(&replace);
    let (code, out, err) = d.submit_with(&replace, &[]);
    assert_eq!(code, Some(0), "{err}");
    let new = RunId(out.trim().parse().expect("run id"));
    assert!(err.contains(&format!("cancelled run {old}")), "{err}");
    let old_row = d.run_row(old);
    assert_eq!(old_row.state, RunState::Cancelled);
    assert!(old_row.error.as_deref().is_some_and(|e| e.contains("cancel-previous")), "{:?}", old_row.error);
    assert_eq!(d.run_row(new).state, RunState::Queued);
    assert_eq!(d.run_row(first).state, RunState::Queued, "another pipeline's runs are left alone");
}

#[test]
fn why_waiting_names_the_limit() {
    let mut d = Deployment::new(false);
    d.spawn("server", &["server", "--http", "127.0.0.1:0", "--public-reads", "--pool", "gpu-big=1"]);
    let addr = d.http_addr("server");
    d.worker("w0", &[]);
    let spec = long_spec("nightly", "concurrency: 1");
    let running = d.submit(&spec);
    // Hold the first run running while the API explains the second.
    d.stop_while_busy(running, "w0");
    assert_eq!(d.run_row(running).state, RunState::Running);
    let waiting = d.submit(&spec);
    let undefined = d.submit(&limited_spec("tpu-job", "pool: tpu"));
    let reason = |run: RunId| {
        let (status, body) = http_get(&addr, &format!("/api/v1/runs/{run}/tasks"));
        assert!(status.contains("200"), "{status}: {body}");
        let tasks: Vec<serde_json::Value> = serde_json::from_str(&body).expect("tasks JSON");
        let download = tasks.iter().find(|t| t["name"] == "download").expect("download task");
        download["reason"].as_str().unwrap_or_default().to_string()
    };
    assert_eq!(reason(waiting), "pipeline nightly: 1 of 1 running");
    assert!(reason(undefined).starts_with("pool tpu is not defined on the server"), "{}", reason(undefined));
    d.signal("w0", "CONT");
    for r in [running, waiting] {
        let row = d.wait_run(r);
        assert_eq!(row.state, RunState::Succeeded, "run {r}: {:?}", row.error);
    }
    assert_one_at_a_time(&d, &[running, waiting]);
}

/// `GET path` on `addr` over plain HTTP/1.1: (status line, body).
fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("request");
    let mut response = String::new();
    s.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (head.lines().next().unwrap_or("").to_string(), body.to_string())
}
