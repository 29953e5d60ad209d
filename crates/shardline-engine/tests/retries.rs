//! Retries that tell infrastructure from failure, with real workers, a real reaper and a real
//! pipeline, on SQLite and on PostgreSQL: a step whose worker is lost five times with
//! `attempts: 3` still completes; a step that errs three times fails even with lost-lease budget
//! left, and the run says which budget ran out; every attempt records which kind it was.
//!
//! The lost worker is a "ghost": it registers and leases the step's task, then goes silent like
//! a killed process — no heartbeat, no completion — until the reaper takes the lease back. The
//! step asks for more CPUs than the in-process workers have until the test starts a big one, so
//! only the ghost can lease it meanwhile.

mod common;

use std::time::{Duration, Instant};

use common::*;
use shardline_store::{AttemptKind, AttemptOutcome, Resources, RunId, RunState, TaskState, WorkerInfo};

shardline_testdb::on_both_backends!(
    a_step_lost_five_times_with_three_attempts_completes,
    a_step_failing_three_times_fails_with_lost_budget_left
);

const RUN_TIMEOUT: Duration = Duration::from_secs(180);
const LEASE: Duration = Duration::from_secs(3);

fn spec(upload_to: &str) -> String {
    format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: lost-workers
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
    with: {{to: "file://{upload_to}"}}
    resources: {{cpus: 4}}
    retry: {{attempts: 3, backoff: 0s}}
"#,
        fixture("qwen3_next").display()
    )
}

/// Leases `upload` `times` times as a worker that then vanishes, each time waiting until the
/// reaper has taken the lease back.
async fn lose_upload(h: &Harness, run: RunId, times: i32) {
    let ghost = h
        .store
        .register_worker(WorkerInfo { name: "ghost".into(), cpus: 8, memory: 16 << 30, gpus: vec![], scratch: 1 << 40 })
        .await
        .expect("register the ghost");
    let free = Resources { cpus: 8, memory: 16 << 30, gpus: 0, scratch: 1 << 40 };
    for i in 1..=times {
        h.wait_task(run, "upload", RUN_TIMEOUT, |t| t.state == TaskState::Ready).await;
        let deadline = Instant::now() + RUN_TIMEOUT;
        let lease = loop {
            if let Some(l) = h.store.claim(ghost, &free, Duration::from_millis(100)).await.expect("claim") {
                break l;
            }
            assert!(Instant::now() < deadline, "the ghost could not lease `upload`");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(lease.task.name, "upload", "only `upload` is left for a big worker");
        // Silence: the harness's reaper finds the lease expired and returns the task.
        let t = h.wait_task(run, "upload", RUN_TIMEOUT, |t| t.state == TaskState::Ready && t.lost == i).await;
        assert_eq!((t.attempt, t.attempts_used()), (i, 0), "loss {i} spent an attempt");
    }
}

fn start_big_worker(h: &mut Harness) {
    h.start_workers_configured(1, LEASE, |c| {
        c.info.name = "big".into();
        c.info.cpus = 8;
    });
}

async fn a_step_lost_five_times_with_three_attempts_completes(kind: Kind) {
    let mut h = Harness::new(kind).await;
    h.start_workers(2, LEASE);
    let out = h.base.path().join("published");
    let s = h.submit(&spec(&out.display().to_string()), &[], false).await;
    lose_upload(&h, s.run, 5).await;
    start_big_worker(&mut h);
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    assert!(out.join(shardline_publish::MANIFEST).is_file(), "nothing was published");

    let upload = h.task(s.run, "upload").await;
    assert_eq!((upload.attempt, upload.lost, upload.max_lost, upload.attempts_used()), (6, 5, 10, 1));
    let attempts = h.attempts(s.run, "upload").await;
    let seen: Vec<(&str, Option<AttemptOutcome>, Option<AttemptKind>)> =
        attempts.iter().map(|a| (a.worker_name.as_str(), a.outcome, a.kind)).collect();
    let lost = ("ghost", Some(AttemptOutcome::Expired), Some(AttemptKind::Lost));
    assert_eq!(seen, [vec![lost; 5], vec![("big", Some(AttemptOutcome::Succeeded), None)]].concat());
    h.finish().await;
}

async fn a_step_failing_three_times_fails_with_lost_budget_left(kind: Kind) {
    let mut h = Harness::new(kind).await;
    h.start_workers(2, LEASE);
    // The destination's parent is a file: every upload attempt fails (retryably).
    let blocked = h.base.path().join("blocked");
    std::fs::write(&blocked, b"not a directory").expect("blocking file");
    let s = h.submit(&spec(&format!("{}/out", blocked.display())), &[], false).await;
    lose_upload(&h, s.run, 2).await;
    start_big_worker(&mut h);
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Failed);
    let error = r.error.unwrap_or_default();
    assert!(
        error.starts_with("task `upload` failed after 3 attempts: ") && error.contains(&blocked.display().to_string()),
        "the run's error should say the attempts ran out: {error}"
    );

    let upload = h.task(s.run, "upload").await;
    assert_eq!(
        (upload.state, upload.attempt, upload.lost, upload.attempts_used()),
        (TaskState::Failed, 5, 2, 3),
        "8 lost leases were left"
    );
    let kinds: Vec<(Option<AttemptOutcome>, Option<AttemptKind>)> =
        h.attempts(s.run, "upload").await.iter().map(|a| (a.outcome, a.kind)).collect();
    let lost = (Some(AttemptOutcome::Expired), Some(AttemptKind::Lost));
    let error = (Some(AttemptOutcome::Failed), Some(AttemptKind::Error));
    assert_eq!(kinds, vec![lost, lost, error, error, error]);
    h.finish().await;
}
