//! `/metrics` of a real `shardline server`, scraped while a run waits, runs and ends: the values
//! follow the run, and the bytes converted are the rank files' sizes on disk.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use shardline_control::TaskOutput;
use shardline_store::{RunId, Store};

use crate::procs::{cmd, spawn};
use crate::{fixture, http_get, run, stderr, stdout};

const WAIT: Duration = Duration::from_secs(90);

/// The raw exposition.
fn exposition(addr: &str) -> String {
    let (status, body) = http_get(addr, "/metrics");
    assert!(status.contains(" 200 "), "{status}\n{body}");
    body
}

/// One scrape: every sample by its series (`name{labels}`), checked to be OpenMetrics text.
fn scrape(addr: &str) -> BTreeMap<String, f64> {
    let body = exposition(addr);
    assert!(body.ends_with("# EOF\n"), "an OpenMetrics exposition ends with `# EOF`:\n{body}");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample: `{l}`"));
            (series.to_string(), value.parse().unwrap_or_else(|e| panic!("`{l}`: {e}")))
        })
        .collect()
}

fn value(m: &BTreeMap<String, f64>, series: &str) -> f64 {
    m.get(series).copied().unwrap_or(0.0)
}

#[test]
fn metrics_follow_a_run_from_queued_to_succeeded() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = spawn(dir.path(), "server", &["server", "--http", "127.0.0.1:0", "--public-reads"]);
    let addr = server.wait_for_address();

    let spec = format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: scraped\nsteps:\n\
         \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
         \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 2, dp: 2}}}}\n\
         \x20 - {{id: validate, uses: checkpoint.validate, needs: [shard]}}\n",
        fixture("qwen3_next").display()
    );
    std::fs::write(dir.path().join("scraped.yaml"), spec).expect("spec");
    let o = run(&mut cmd(dir.path(), &["submit", "scraped.yaml"]));
    assert!(o.status.success(), "submit: {}", stderr(&o));
    let run_id = RunId(stdout(&o).trim().parse().expect("run id"));

    // No worker yet: the run waits, its download is the queue.
    let before = scrape(&addr);
    assert_eq!(value(&before, "shardline_runs{state=\"queued\"}"), 1.0, "{before:?}");
    assert_eq!(value(&before, "shardline_queue_depth"), 1.0);
    assert_eq!(value(&before, "shardline_tasks{kind=\"hf.download\",state=\"ready\"}"), 1.0);
    assert_eq!(value(&before, "shardline_tasks{kind=\"megatron.shard.rank\",state=\"blocked\"}"), 4.0);
    assert!(!before.keys().any(|k| k.starts_with("shardline_attempts_total")), "nothing has run: {before:?}");
    std::thread::sleep(Duration::from_millis(300));
    let waited = scrape(&addr);
    assert!(
        value(&waited, "shardline_queue_oldest_ready_seconds") > value(&before, "shardline_queue_oldest_ready_seconds"),
        "the oldest ready task ages"
    );

    let _worker = spawn(dir.path(), "worker", &["worker", "--name", "w1", "--cpus", "2"]);
    // Counters lag the database clock by a couple of seconds: poll until the last step counts.
    let deadline = Instant::now() + WAIT;
    let after = loop {
        let m = scrape(&addr);
        if value(&m, "shardline_attempts_total{kind=\"checkpoint.validate\",outcome=\"succeeded\"}") == 1.0 {
            break m;
        }
        assert!(Instant::now() < deadline, "the run was not counted within {WAIT:?}: {m:?}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(value(&after, "shardline_runs{state=\"succeeded\"}"), 1.0);
    assert_eq!(value(&after, "shardline_runs{state=\"queued\"}"), 0.0);
    assert_eq!(value(&after, "shardline_queue_depth"), 0.0);
    for (kind, n) in [
        ("hf.download", 1.0),
        ("megatron.shard.plan", 1.0),
        ("megatron.shard.rank", 4.0),
        ("megatron.shard.commit", 1.0),
    ] {
        assert_eq!(
            value(&after, &format!("shardline_attempts_total{{kind=\"{kind}\",outcome=\"succeeded\"}}")),
            n,
            "{kind}"
        );
        assert_eq!(value(&after, &format!("shardline_task_pickup_seconds_count{{kind=\"{kind}\"}}")), n, "{kind}");
        let durations = format!("shardline_task_duration_seconds_count{{kind=\"{kind}\",outcome=\"succeeded\"}}");
        assert_eq!(value(&after, &durations), n, "{kind}");
    }
    assert_eq!(value(&after, "shardline_lease_expiries_total"), 0.0);
    // A local release is read, not downloaded.
    assert_eq!(value(&after, "shardline_downloaded_bytes_total"), 0.0);
    assert_eq!(value(&after, "shardline_workers{state=\"active\"}"), 1.0);
    assert_eq!(value(&after, "shardline_worker_resources{worker=\"w1\",resource=\"cpus\"}"), 2.0);

    // The bytes converted are the rank files the commit published.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let url = format!("sqlite://{}", dir.path().join("state/state.db").display());
    let store = rt.block_on(Store::connect(&url)).expect("store");
    let tasks = rt.block_on(store.run_tasks(run_id)).expect("tasks");
    let commit = tasks.iter().find(|t| t.name == "shard/commit").expect("commit task");
    let ckpt = TaskOutput::from_value(commit.output.as_ref().expect("commit output")).dir.expect("checkpoint dir");
    let on_disk: u64 = std::fs::read_dir(&ckpt)
        .expect("checkpoint")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "distcp"))
        .map(|p| std::fs::metadata(&p).expect("size").len())
        .sum();
    assert!(on_disk > 0);
    assert_eq!(value(&after, "shardline_converted_bytes_total"), on_disk as f64);
    rt.block_on(store.close());

    // Every metric the sample Grafana dashboard queries is one the server exports.
    let families: Vec<String> = exposition(&addr)
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let dashboard =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/grafana-dashboard.json"))
            .expect("docs/grafana-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let exprs: Vec<&str> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().expect("targets").iter())
        .map(|t| t["expr"].as_str().expect("expr"))
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");
    for expr in exprs {
        for (at, _) in expr.match_indices("shardline_") {
            let name: String = expr[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let family =
                ["_bucket", "_count", "_sum", "_total"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(&name);
            assert!(families.iter().any(|f| f == family), "the dashboard queries `{name}`, which is not exported");
        }
    }

    // Counted once: a later scrape shows the same totals.
    std::thread::sleep(Duration::from_millis(2500));
    let again = scrape(&addr);
    for series in [
        "shardline_converted_bytes_total",
        "shardline_attempts_total{kind=\"megatron.shard.rank\",outcome=\"succeeded\"}",
    ] {
        assert_eq!(value(&again, series), value(&after, series), "{series}");
    }
}
