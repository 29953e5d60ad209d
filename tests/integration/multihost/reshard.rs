//! A training checkpoint resharded across three hosts that share no disk, only the artifact
//! store: a task per target rank file, each reading only the source chunks its file is made
//! from; a host killed in the middle of one costs that one rank file.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use shardline_store::{AttemptOutcome, LogFilter, RunState, TaskState};

use super::{Hosts, ARTIFACTS};
use crate::{bin, run, stderr};
use shardline_publish::moto::Moto;

#[test]
fn a_reshard_across_three_hosts_reads_its_share_and_a_killed_host_costs_one_rank_file() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let release = tmp.path().join("release");
    let o = run(bin().args(["synth", "--arch", "llama", "--size", "12MB"]).arg(&release));
    assert!(o.status.success(), "synth: {}", stderr(&o));
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    let hosts = Hosts::started(&moto, None, &["host-a", "host-b", "host-c"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while hosts.rt.block_on(hosts.store.list_workers()).expect("workers").len() < 3 {
        assert!(Instant::now() < deadline, "three workers did not register");
        std::thread::sleep(Duration::from_millis(100));
    }
    // With optimizer state (fp32 masters and both moments), dp2 → dp6: six rank tasks, one at a
    // time per host (each takes both of its CPUs), each reading about a sixth of the source.
    let spec = tmp.path().join("reshard.yaml");
    let steps = format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: spread\nsteps:\n\
         \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
         \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 1, dp: 2, optimizer_state: true}}}}\n\
         \x20 - {{id: split, uses: megatron.split_fused, needs: [shard]}}\n\
         \x20 - {{id: reshard, uses: checkpoint.reshard, needs: [split], with: {{tp: 1, dp: 6, rng: drop}}, \
                  resources: {{cpus: 2}}, retry: {{attempts: 1, lost: 2}}}}\n\
         \x20 - {{id: validate, uses: checkpoint.validate, needs: [reshard]}}\n",
        release.display()
    );
    std::fs::write(&spec, steps).expect("spec");
    let run_id = hosts.submit(&spec, &[]);

    // The first host seen holding a reshard rank task is killed (-9) in the middle of it.
    let deadline = Instant::now() + Duration::from_secs(300);
    let (killed, lost_task) = loop {
        let tasks = hosts.rt.block_on(hosts.store.run_tasks(run_id)).expect("tasks");
        let held = tasks.iter().find(|t| t.kind == "checkpoint.reshard.rank" && t.state == TaskState::Leased);
        if let Some(t) = held {
            let attempts = hosts.rt.block_on(hosts.store.task_attempts(t.id)).expect("attempts");
            if let Some(a) = attempts.iter().rev().find(|a| a.outcome.is_none()) {
                hosts.kill9(&a.worker_name);
                break (a.worker_name.clone(), t.name.clone());
            }
        }
        assert!(Instant::now() < deadline, "no reshard rank task was leased: {tasks:?}");
        std::thread::sleep(Duration::from_millis(5));
    };
    let row = hosts.wait_run(run_id);
    assert_eq!(row.state, RunState::Succeeded, "{:?}", row.error);
    let tasks = hosts.rt.block_on(hosts.store.run_tasks(run_id)).expect("tasks");
    let validate = tasks.iter().find(|t| t.name == "validate").expect("validate");
    assert_eq!(validate.output.as_ref().expect("output")["ok"], true, "the resharded checkpoint validates");

    // The killed host's rank task ran twice (its lease expired, then another host wrote the
    // file); every other rank task once.
    let mut ran_on = BTreeSet::new();
    for rank in 0..6 {
        let name = format!("reshard/rank-{rank}");
        let task = tasks.iter().find(|t| t.name == name).expect("rank task");
        let attempts = hosts.rt.block_on(hosts.store.task_attempts(task.id)).expect("attempts");
        let outcomes: Vec<_> = attempts.iter().map(|a| (a.worker_name.clone(), a.outcome)).collect();
        if name == lost_task {
            assert_eq!(outcomes.len(), 2, "{name}: {outcomes:?}");
            assert_eq!(outcomes[0], (killed.clone(), Some(AttemptOutcome::Expired)), "{name}");
            assert_eq!(outcomes[1].1, Some(AttemptOutcome::Succeeded), "{name}");
            assert_ne!(outcomes[1].0, killed, "{name}");
        } else {
            assert_eq!(outcomes.len(), 1, "{name}: {outcomes:?}");
            assert_eq!(outcomes[0].1, Some(AttemptOutcome::Succeeded), "{name}");
        }
        ran_on.extend(attempts.iter().map(|a| a.worker_name.clone()));
    }
    assert_eq!(ran_on.len(), 3, "every host ran rank tasks: {ran_on:?}");

    // Each rank task read less than 2/world of the source's rank files.
    let logs = hosts.rt.block_on(hosts.store.logs(LogFilter::Run(run_id), 0, 100_000)).expect("logs");
    let mut reads = Vec::new();
    let lines: Vec<&str> = logs.iter().map(|l| l.line.as_str()).filter(|l| l.starts_with("rank ")).collect();
    for l in &logs {
        let Some((_, rest)) = l.line.strip_prefix("rank ").and_then(|r| r.split_once(": read ")) else { continue };
        let Some((fetched, rest)) = rest.split_once(" of the ") else { continue };
        let total: u64 = rest.split_once(' ').and_then(|(t, _)| t.parse().ok()).expect("total");
        reads.push((fetched.parse::<u64>().expect("fetched"), total));
    }
    assert!(reads.len() >= 6, "{reads:?}");
    for (fetched, total) in &reads {
        assert!(
            *fetched > 0 && fetched * 6 < 2 * total,
            "a rank task read {fetched} of the source's {total} bytes:\n{}",
            lines.join("\n")
        );
    }
    eprintln!("killed {killed} during {lost_task}; rank tasks read {reads:?}");
}
