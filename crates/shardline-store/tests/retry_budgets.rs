//! Two retry budgets: lost leases (the worker died; its lease expired and was reaped) draw on
//! `max_lost`, a task's errors and timeouts on `max_attempts`; each attempt records which one it
//! drew on, and a failed run says which budget ran out.

mod common;

use std::time::Duration;

use common::*;
use shardline_store::*;

shardline_testdb::on_both_databases!(
    lost_leases_do_not_spend_attempts,
    errors_fail_the_task_with_lost_budget_left,
    the_lost_budget_runs_out_and_retry_renews_both,
    each_budget_backs_off_on_its_own_count,
);

/// A lease that nobody extends: claimed for `ttl`, left to expire, reaped.
async fn lose(store: &Store, w: WorkerId, name: &str) -> Lease {
    let lease = store.claim(w, &big(), Duration::from_millis(50)).await.expect("claim").expect("a ready task");
    assert_eq!(lease.task.name, name);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.reap_expired().await.expect("reap"), 1, "the lost lease of `{name}` was not reaped");
    lease
}

async fn fail(store: &Store, w: WorkerId, name: &str, error: &str) {
    let lease = claim_named(store, w, name).await;
    let failed = Outcome::Failed { error: error.into(), retryable: true };
    assert!(store.complete(&lease, failed).await.expect("complete"), "failure of `{name}` refused");
}

async fn task_row(store: &Store, run: RunId, name: &str) -> TaskRow {
    store
        .run_tasks(run)
        .await
        .expect("run_tasks")
        .into_iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no task `{name}`"))
}

/// (outcome, kind) of every attempt of a task, oldest first.
async fn kinds(store: &Store, task: TaskId) -> Vec<(Option<AttemptOutcome>, Option<AttemptKind>)> {
    store.task_attempts(task).await.expect("attempts").iter().map(|a| (a.outcome, a.kind)).collect()
}

const LOST: (Option<AttemptOutcome>, Option<AttemptKind>) = (Some(AttemptOutcome::Expired), Some(AttemptKind::Lost));
const ERROR: (Option<AttemptOutcome>, Option<AttemptKind>) = (Some(AttemptOutcome::Failed), Some(AttemptKind::Error));
const OK: (Option<AttemptOutcome>, Option<AttemptKind>) = (Some(AttemptOutcome::Succeeded), None);

/// attempts = 3: the worker is lost five times and the task errs twice, and it still completes.
async fn lost_leases_do_not_spend_attempts(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![NewTask { max_attempts: 3, ..task("x", &[]) }]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    for i in 1..=5 {
        let lease = lose(&store, w, "x").await;
        let t = task_row(&store, run, "x").await;
        assert_eq!((t.state, t.attempt, t.lost, t.attempts_used()), (TaskState::Ready, i, i, 0), "after loss {i}");
        assert_eq!(
            t.error.unwrap_or_default(),
            format!("worker lost: lease expired (attempt {i}, owner w; lost {i} of 10)")
        );
        assert!(!store.heartbeat(&lease, TTL, None).await.expect("hb"), "a reaped lease is refused");
    }
    fail(&store, w, "x", "oom 1").await;
    fail(&store, w, "x", "oom 2").await;
    let t = task_row(&store, run, "x").await;
    assert_eq!((t.state, t.attempt, t.lost, t.attempts_used()), (TaskState::Ready, 7, 5, 2));
    let last = claim_named(&store, w, "x").await;
    assert_eq!(last.task.attempts_used(), 3, "the last attempt of three runs");
    succeed(&store, &last).await;
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);
    assert_eq!(kinds(&store, last.task.id).await, [vec![LOST; 5], vec![ERROR; 2], vec![OK]].concat());
}

/// attempts = 3 fails the task at its third error, whatever lost budget is left.
async fn errors_fail_the_task_with_lost_budget_left(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store
        .add_tasks(run, vec![NewTask { max_attempts: 3, ..task("x", &[]) }, task("y", &["x"])])
        .await
        .expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    lose(&store, w, "x").await;
    fail(&store, w, "x", "boom 1").await;
    lose(&store, w, "x").await;
    fail(&store, w, "x", "boom 2").await;
    assert_eq!(task_row(&store, run, "x").await.state, TaskState::Ready);
    fail(&store, w, "x", "boom 3").await;

    let t = task_row(&store, run, "x").await;
    assert_eq!((t.state, t.attempt, t.lost, t.max_lost, t.attempts_used()), (TaskState::Failed, 5, 2, 10, 3));
    let r = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(r.state, RunState::Failed);
    assert_eq!(r.error.as_deref(), Some("task `x` failed after 3 attempts: boom 3"));
    assert_eq!(state_of(&store, run, "y").await, TaskState::Cancelled);
    assert_eq!(kinds(&store, t.id).await, vec![LOST, ERROR, LOST, ERROR, ERROR]);
}

/// max_lost = 3 fails the task at its third lost lease, with attempts left; a retried run gets
/// both budgets back.
async fn the_lost_budget_runs_out_and_retry_renews_both(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![NewTask { max_attempts: 3, max_lost: 3, ..task("x", &[]) }]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("gpu-7")).await.expect("register");
    fail(&store, w, "x", "flaky").await;
    for _ in 0..3 {
        lose(&store, w, "x").await;
    }
    let t = task_row(&store, run, "x").await;
    assert_eq!((t.state, t.attempt, t.lost, t.attempts_used()), (TaskState::Failed, 4, 3, 1));
    assert_eq!(t.error.as_deref(), Some("worker lost 3 times: lease expired (last owner gpu-7)"));
    let r = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(r.error.as_deref(), Some("task `x` failed: worker lost 3 times: lease expired (last owner gpu-7)"));
    assert_eq!(kinds(&store, t.id).await, vec![ERROR, LOST, LOST, LOST]);

    store.retry_run(run, None, "user:test").await.expect("retry_run");
    let t = task_row(&store, run, "x").await;
    assert_eq!((t.state, t.attempt_base, t.lost, t.attempts_used()), (TaskState::Ready, 4, 0, 0));
    // Two more losses and two more errors fit the renewed budgets (3 each).
    lose(&store, w, "x").await;
    lose(&store, w, "x").await;
    fail(&store, w, "x", "again 1").await;
    fail(&store, w, "x", "again 2").await;
    let l = claim_named(&store, w, "x").await;
    succeed(&store, &l).await;
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);
    let t = task_row(&store, run, "x").await;
    assert_eq!((t.attempt, t.lost, t.attempts_used()), (9, 2, 3));
}

/// Retry delays double with each budget's own count: an error after two lost leases waits the
/// first step of the backoff, not the third.
async fn each_budget_backs_off_on_its_own_count(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    let backoff = Duration::from_millis(400);
    store.add_tasks(run, vec![NewTask { max_attempts: 3, backoff, ..task("x", &[]) }]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let mut delays = Vec::new();
    for step in ["lost", "lost", "error"] {
        // Wait out the previous backoff, then claim.
        let lease = loop {
            if let Some(l) = store.claim(w, &big(), Duration::from_millis(50)).await.expect("claim") {
                break l;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if step == "lost" {
            tokio::time::sleep(Duration::from_millis(120)).await;
            assert_eq!(store.reap_expired().await.expect("reap"), 1);
        } else {
            let failed = Outcome::Failed { error: "boom".into(), retryable: true };
            assert!(store.complete(&lease, failed).await.expect("complete"));
        }
        let t = store.task(lease.task.id).await.expect("task").expect("exists");
        let ended = store.task_attempts(t.id).await.expect("attempts").last().and_then(|a| a.ended_at).expect("ended");
        delays.push((t.ready_at.expect("ready_at") - ended).num_milliseconds());
    }
    // 400 ms, 800 ms (second loss), 400 ms (first error), each ± 20 % (and a few ms of clock).
    let within = |d: i64, base: i64| d >= base * 8 / 10 - 5 && d <= base * 12 / 10 + 5;
    assert!(within(delays[0], 400) && within(delays[1], 800) && within(delays[2], 400), "delays {delays:?} ms");
}
