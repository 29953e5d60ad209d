//! Steps split over tasks and run by worker processes: a `checkpoint.reshard` as a task per
//! target rank file, a `checkpoint.export` with `parts` as a task per part, each then
//! committed by the step's own task; what they write together is what the CLI writes whole.

use std::path::PathBuf;

use shardline_store::{AttemptOutcome, RunState, TaskState};

use super::Deployment;
use crate::{bin, convert, fixture, run, stderr, stdout};

/// `spec` run to success by a server and two one-CPU workers.
fn succeeded_on_two_workers(spec: &str) -> (Deployment, shardline_store::RunId) {
    let mut d = Deployment::new(false);
    d.server("server");
    d.worker("w1", &["--cpus", "1", "--lease-seconds", "5"]);
    d.worker("w2", &["--cpus", "1", "--lease-seconds", "5"]);
    let run_id = d.submit(spec);
    let r = d.wait_run(run_id);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    (d, run_id)
}

#[test]
fn a_reshard_step_writes_each_rank_file_in_a_task_of_its_own() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = tmp.path().join("src");
    convert(&fixture("qwen3_moe"), &src, (1, 1, 4, 2), &["--optimizer-state", "--etp", "1"]);
    let whole = tmp.path().join("whole");
    let mesh = ["--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1"];
    let o = run(bin().arg("reshard").arg(&src).arg("--to").arg(&whole).args(mesh));
    assert!(o.status.success(), "reshard: {}{}", stdout(&o), stderr(&o));

    let spec = format!(
        "apiVersion: shardline/v1
kind: Pipeline
name: reshard-split
steps:
  - id: reshard
    uses: checkpoint.reshard
    with: {{path: {}, tp: 2, dp: 2, ep: 2, etp: 1}}
    resources: {{cpus: 1}}
",
        src.display()
    );
    let (d, run_id) = succeeded_on_two_workers(&spec);

    let mut workers = Vec::new();
    for rank in 0..4 {
        let name = format!("reshard/rank-{rank}");
        let task = d.task(run_id, &name);
        assert_eq!((task.kind.as_str(), task.state), ("checkpoint.reshard.rank", TaskState::Succeeded), "{name}");
        let attempts = d.attempts(run_id, &name);
        assert_eq!(attempts.len(), 1, "{name} ran {} times", attempts.len());
        assert_eq!(attempts[0].outcome, Some(AttemptOutcome::Succeeded));
        workers.push(attempts[0].worker_name.clone());
        let log = d.task_log(run_id, &name);
        assert!(log.contains(&format!("wrote rank {rank}'s file of 4")), "{log}");
    }
    let commit = d.task(run_id, "reshard");
    let log = d.task_log(run_id, "reshard");
    assert!(log.contains("committed 4 rank files written by the rank tasks"), "{log}");
    let out: PathBuf = commit
        .output
        .as_ref()
        .and_then(|o| o["dir"].as_str())
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("the reshard reports no directory: {:?}", commit.output));
    let (want, got) = (crate::file_bytes(&whole), crate::file_bytes(&out));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (file, bytes) in &want {
        assert!(&got[file] == bytes, "`{file}` differs from what `shardline reshard` writes");
    }
    eprintln!("rank tasks ran on {workers:?}");
}

/// A worker frozen (SIGSTOP) while it holds a rank task loses its lease; that one rank file is
/// written again by the other worker — every other rank task ran once — and what the step wrote
/// is still what `shardline reshard` writes. The frozen worker's half-written file, under its
/// temporary name, is never taken for the rank file.
#[test]
fn a_worker_lost_mid_rank_file_costs_that_file_only() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let release = tmp.path().join("release");
    let o = run(bin().args(["synth", "--arch", "llama", "--size", "48MB"]).arg(&release));
    assert!(o.status.success(), "synth: {}", stderr(&o));
    let src = tmp.path().join("src");
    convert(&release, &src, (1, 1, 2, 1), &["--optimizer-state"]);
    let whole = tmp.path().join("whole");
    let o = run(bin().arg("reshard").arg(&src).arg("--to").arg(&whole).args(["--tp", "2", "--dp", "2"]));
    assert!(o.status.success(), "reshard: {}{}", stdout(&o), stderr(&o));

    let mut d = Deployment::new(false);
    d.server("server");
    // One worker first: whichever rank task is leased is its.
    d.worker("w1", &["--cpus", "1", "--lease-seconds", "2"]);
    let spec = format!(
        "apiVersion: shardline/v1
kind: Pipeline
name: reshard-lost
steps:
  - id: reshard
    uses: checkpoint.reshard
    with: {{path: {}, tp: 2, dp: 2}}
    resources: {{cpus: 1}}
    retry: {{attempts: 1, lost: 2}}
",
        src.display()
    );
    let run_id = d.submit(&spec);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    let frozen = loop {
        let tasks = d.q(|s| async move { s.run_tasks(run_id).await });
        let held = tasks.iter().find(|t| t.kind == "checkpoint.reshard.rank" && t.state == TaskState::Leased);
        if let Some(t) = held {
            d.signal("w1", "STOP");
            break t.name.clone();
        }
        assert!(std::time::Instant::now() < deadline, "no rank task was leased: {tasks:?}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    d.worker("w2", &["--cpus", "1", "--lease-seconds", "2"]);
    let r = d.wait_run(run_id);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);

    for rank in 0..4 {
        let name = format!("reshard/rank-{rank}");
        let attempts = d.attempts(run_id, &name);
        let outcomes: Vec<_> = attempts.iter().map(|a| (a.worker_name.as_str(), a.outcome)).collect();
        if name == frozen {
            assert_eq!(
                outcomes,
                [("w1", Some(AttemptOutcome::Expired)), ("w2", Some(AttemptOutcome::Succeeded))],
                "{name}"
            );
        } else {
            assert_eq!(attempts.len(), 1, "{name}: {outcomes:?}");
            assert_eq!(attempts[0].outcome, Some(AttemptOutcome::Succeeded), "{name}");
        }
    }
    let commit = d.task(run_id, "reshard");
    let out = commit.output.as_ref().and_then(|o| o["dir"].as_str()).map(PathBuf::from).expect("reshard dir");
    let (want, got) = (crate::file_bytes(&whole), crate::file_bytes(&out));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (file, bytes) in &want {
        assert!(&got[file] == bytes, "`{file}` differs from what `shardline reshard` writes");
    }
    d.signal("w1", "KILL");
}

/// An export step with `parts: 3` after a reshard: each part writes its weight files (two
/// workers), the commit adds the index and the release's files; the result is, file for file,
/// what `shardline export` writes whole from the source checkpoint (the same release tensors).
#[test]
fn an_export_step_in_parts_writes_what_export_writes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let release = tmp.path().join("release");
    let o = run(bin().args(["synth", "--arch", "llama", "--size", "24MB"]).arg(&release));
    assert!(o.status.success(), "synth: {}", stderr(&o));
    let src = tmp.path().join("src");
    convert(&release, &src, (1, 1, 2, 1), &["--optimizer-state"]);
    let whole = tmp.path().join("whole");
    let o = run(bin()
        .arg("export")
        .arg(&src)
        .arg("--to")
        .arg(&whole)
        .arg("--like")
        .arg(&release)
        .args(["--max-file-size", "6MB"]));
    assert!(o.status.success(), "export: {}{}", stdout(&o), stderr(&o));

    let spec = format!(
        "apiVersion: shardline/v1
kind: Pipeline
name: export-parts
steps:
  - id: reshard
    uses: checkpoint.reshard
    with: {{path: {}, tp: 2, dp: 1}}
  - id: export
    uses: checkpoint.export
    needs: [reshard]
    with: {{like: {}, max_file_size: 6MB, parts: 3}}
",
        src.display(),
        release.display()
    );
    let (d, run_id) = succeeded_on_two_workers(&spec);
    let mut written = Vec::new();
    for part in 0..3 {
        let name = format!("export/part-{part}");
        let task = d.task(run_id, &name);
        assert_eq!((task.kind.as_str(), task.state), ("checkpoint.export.part", TaskState::Succeeded), "{name}");
        assert_eq!(d.attempts(run_id, &name).len(), 1, "{name}");
        let weights = task.output.as_ref().map(|o| o["weights"].clone()).expect("output");
        written.extend(weights.as_array().expect("weights").iter().map(|w| w.as_str().expect("name").to_string()));
    }
    let log = d.task_log(run_id, "export");
    assert!(log.contains("weight files written by 3 part tasks"), "{log}");
    let out = d.task(run_id, "export").output.as_ref().and_then(|o| o["dir"].as_str()).map(PathBuf::from).expect("dir");
    let want = crate::file_bytes(&whole);
    let mut weights: Vec<&String> = want.keys().filter(|n| n.ends_with(".safetensors")).collect();
    weights.sort();
    written.sort();
    assert!(weights.len() >= 4, "{weights:?}");
    assert_eq!(written.iter().collect::<Vec<_>>(), weights, "each weight file written by exactly one part");
    let got = crate::file_bytes(&out);
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (file, bytes) in &want {
        assert!(&got[file] == bytes, "`{file}` differs from what `shardline export` writes");
    }
}
