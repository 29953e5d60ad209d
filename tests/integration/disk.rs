//! Disk as a resource with the real binary: a worker whose disk is full (its reserve exceeds its
//! free space) takes the download and the plan, which need no scratch, but no rank task; the run
//! waits and its page says why (the rank files' size, the most any worker has free and which);
//! a worker with room then takes every rank task. Workers' disks are in `/metrics`.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::procs::{cmd, spawn};
use crate::{fixture, http_get, run, stderr, stdout};

const WAIT: Duration = Duration::from_secs(90);

/// `GET path` as JSON, asserting a 200.
fn get_json(addr: &str, path: &str) -> Value {
    let (status, body) = http_get(addr, path);
    assert!(status.contains(" 200 "), "GET {path}: {status}\n{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}\n{body}"))
}

/// The run's tasks by name, as the API shows them.
fn tasks(addr: &str, run: u64) -> Vec<Value> {
    get_json(addr, &format!("/api/v1/runs/{run}/tasks")).as_array().expect("tasks").clone()
}

fn named<'a>(tasks: &'a [Value], name: &str) -> &'a Value {
    tasks.iter().find(|t| t["name"] == name).unwrap_or_else(|| panic!("no task `{name}` in {tasks:?}"))
}

/// Polls the run's tasks until `cond` holds.
fn wait_tasks(addr: &str, run: u64, what: &str, cond: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + WAIT;
    loop {
        let t = tasks(addr, run);
        if cond(&t) {
            return t;
        }
        assert!(Instant::now() < deadline, "{what} did not happen within {WAIT:?}: {t:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The dashboard's spelling of a size in "why waiting" (`view::gib`).
fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", b >> 20)
    }
}

fn metric(addr: &str, series: &str) -> Option<f64> {
    let (_, body) = http_get(addr, "/metrics");
    body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `disk.yaml` in `dir`: the tiny Qwen3-Next release downloaded and sharded for tp2·dp2.
fn write_spec(dir: &std::path::Path) {
    let spec = format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: disk\nsteps:\n\
         \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
         \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 2, dp: 2}}}}\n",
        fixture("qwen3_next").display()
    );
    std::fs::write(dir.join("disk.yaml"), spec).expect("spec");
}

#[test]
fn a_full_disk_worker_takes_no_rank_task_and_the_run_says_why() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = spawn(dir.path(), "server", &["server", "--http", "127.0.0.1:0", "--public-reads"]);
    let addr = server.wait_for_address();
    write_spec(dir.path());
    let o = run(&mut cmd(dir.path(), &["submit", "disk.yaml"]));
    assert!(o.status.success(), "submit: {}", stderr(&o));
    let run_id: u64 = stdout(&o).trim().parse().expect("run id");
    let ranks: Vec<String> = (0..4).map(|r| format!("shard/rank-{r}")).collect();

    // Only the full worker: it downloads and plans (no scratch needed), then the ranks wait.
    let _small = spawn(dir.path(), "small", &["worker", "--name", "small", "--scratch-reserve", "1PiB"]);
    let after_plan =
        wait_tasks(&addr, run_id, "the plan", |t| t.iter().any(|t| t["name"] == "shard" && t["state"] == "succeeded"));
    for name in &ranks {
        let scratch = named(&after_plan, name)["resources"]["scratch"].as_u64().expect("scratch");
        assert!(scratch > 1 << 20, "`{name}` needs its rank file's size (plus headroom), not {scratch}");
    }
    // The small worker polls twice a second: give it time to (not) take a rank.
    std::thread::sleep(Duration::from_secs(2));
    let waiting = tasks(&addr, run_id);
    for name in &ranks {
        let t = named(&waiting, name);
        assert_eq!((t["state"].as_str(), t["attempt"].as_i64()), (Some("ready"), Some(0)), "{t:#}");
        let need = t["resources"]["scratch"].as_u64().expect("scratch");
        let why = format!("needs {} scratch; the most any live worker has free is 0 MiB (worker small)", gib(need));
        assert_eq!(t["reason"], why.as_str(), "{t:#}");
    }
    // The run page shows the same reason.
    let view = get_json(&addr, &format!("/api/v1/runs/{run_id}/view"));
    let shown = view["tasks"].as_array().expect("view tasks");
    let rank0 = shown.iter().find(|t| t["name"] == "shard/rank-0").expect("rank 0 on the run page");
    assert!(rank0["reason"].as_str().is_some_and(|r| r.ends_with("(worker small)")), "{rank0:#}");
    // Its disk is in the metrics: measured, offering nothing.
    let free = metric(&addr, "shardline_worker_disk_free_bytes{worker=\"small\"}").expect("small's free disk");
    let total = metric(&addr, "shardline_worker_disk_total_bytes{worker=\"small\"}").expect("small's disk size");
    assert!(free > 0.0 && free <= total, "free {free} of {total}");
    assert_eq!(metric(&addr, "shardline_worker_scratch_free_bytes{worker=\"small\"}"), Some(0.0));

    // A worker with room takes every rank; the full one still takes none.
    let _big = spawn(dir.path(), "big", &["worker", "--name", "big", "--scratch-reserve", "0"]);
    let done = wait_tasks(&addr, run_id, "the commit", |t| {
        t.iter().any(|t| t["name"] == "shard/commit" && t["state"] == "succeeded")
    });
    for name in &ranks {
        let t = named(&done, name);
        let attempts = get_json(&addr, &format!("/api/v1/tasks/{}/attempts", t["id"]));
        let by: Vec<&str> =
            attempts.as_array().expect("attempts").iter().filter_map(|a| a["worker_name"].as_str()).collect();
        assert_eq!(by, ["big"], "`{name}` ran on {by:?}");
        // The need covered the rank file the task wrote.
        let need = t["resources"]["scratch"].as_u64().expect("scratch");
        let written = t["output"]["bytes"].as_u64().expect("rank file bytes");
        assert!(written <= need, "`{name}` wrote {written} bytes but needed only {need}");
    }
    let plan = named(&done, "shard");
    let plan_attempts = get_json(&addr, &format!("/api/v1/tasks/{}/attempts", plan["id"]));
    assert_eq!(plan_attempts[0]["worker_name"], "small", "the full worker planned: it needs no scratch");
    let run = get_json(&addr, &format!("/api/v1/runs/{run_id}"));
    assert_eq!(run["run"]["state"], "succeeded", "{run:#}");
}

/// `shardline run` whose own workers' disks are below their reserve does not wait in silence: it
/// says which tasks wait and why, as the dashboard would.
#[test]
fn a_one_shot_run_says_why_its_ranks_wait() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_spec(dir.path());
    let run = spawn(dir.path(), "run", &["run", "disk.yaml", "--workers", "1", "--scratch-reserve", "1PiB"]);
    let deadline = Instant::now() + WAIT;
    let log = dir.path().join("run.log");
    let line = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains(" wait: ")) {
            break l.trim().to_string();
        }
        assert!(Instant::now() < deadline, "no reason printed within {WAIT:?}:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let (names, why) = line.split_once(" wait: ").expect("`… wait: why`");
    assert_eq!(names, "shard/rank-0 and 3 more", "{line}");
    assert!(
        why.starts_with("needs ") && why.contains(" scratch; the most any live worker has free is 0 MiB (worker "),
        "{line}"
    );
    drop(run);
}
