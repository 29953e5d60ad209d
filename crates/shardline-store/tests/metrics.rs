//! What the metrics read: state counts at a moment, and the attempts that ended in a window, in
//! end order, each once, with its pickup time, whether it was retried and (on success) its output.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use common::*;
use serde_json::json;
use shardline_store::*;

shardline_testdb::on_both_databases!(counts_follow_the_run, ended_attempts_are_read_once_in_end_order);

fn count_of(counts: &StateCounts, kind: &str, state: TaskState) -> i64 {
    counts.tasks.iter().find(|(k, s, _)| k == kind && *s == state).map_or(0, |(_, _, n)| *n)
}

fn runs_in(counts: &StateCounts, state: RunState) -> i64 {
    counts.runs.iter().find(|(s, _)| *s == state).map_or(0, |(_, n)| *n)
}

async fn counts_follow_the_run(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &["a"])]).await.expect("add_tasks");
    let c = store.state_counts().await.expect("counts");
    assert_eq!((runs_in(&c, RunState::Queued), runs_in(&c, RunState::Running)), (1, 0));
    assert_eq!((count_of(&c, "test", TaskState::Ready), count_of(&c, "test", TaskState::Blocked)), (1, 1));
    assert_eq!(c.claimable, 1);
    let oldest = c.oldest_claimable.expect("a claimable task has a ready time");
    assert!(oldest <= c.now, "ready at {oldest}, counted at {}", c.now);

    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    let c = store.state_counts().await.expect("counts");
    assert_eq!((runs_in(&c, RunState::Queued), runs_in(&c, RunState::Running)), (0, 1));
    assert_eq!((count_of(&c, "test", TaskState::Leased), c.claimable, c.oldest_claimable), (1, 0, None));
    succeed(&store, &a).await;
    let b = claim_named(&store, w, "b").await;
    succeed(&store, &b).await;
    let c = store.state_counts().await.expect("counts");
    assert_eq!((runs_in(&c, RunState::Succeeded), count_of(&c, "test", TaskState::Succeeded)), (1, 2));
    assert_eq!(c.runs.len(), 1, "only states that hold runs are listed: {:?}", c.runs);
}

/// Every ended attempt from `from`, read `limit` at a time.
async fn read_all(store: &Store, from: DateTime<Utc>, to: DateTime<Utc>, limit: i64) -> Vec<EndedAttempt> {
    let mut out = Vec::new();
    let mut after = None;
    loop {
        let page = store.ended_attempts(from, to, after, limit).await.expect("ended_attempts");
        assert!(page.attempts.len() as i64 <= limit);
        out.extend(page.attempts);
        match page.next {
            Some(next) => after = Some(next),
            None => return out,
        }
    }
}

async fn ended_attempts_are_read_once_in_end_order(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &["a"])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let first = claim_named(&store, w, "a").await;
    let failed = Outcome::Failed { error: "oom".into(), retryable: true };
    assert!(store.complete(&first, failed).await.expect("complete"));
    let second = claim_named(&store, w, "a").await;
    assert!(store.complete(&second, Outcome::Succeeded { output: json!({"bytes": 42}) }).await.expect("complete"));
    // `b` is lost: its lease expires and is reaped (and `b` waits for another attempt).
    let lost = store.claim(w, &big(), Duration::from_millis(50)).await.expect("claim").expect("b is ready");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.reap_expired().await.expect("reap"), 1);
    // And one attempt still runs: it has not ended, so it is not read.
    let running = claim_named(&store, w, "b").await;

    let to = store.metrics_horizon(Duration::ZERO).await.expect("horizon");
    let all = read_all(&store, DateTime::UNIX_EPOCH, to, 1000).await;
    let seen: Vec<(TaskId, i64, AttemptOutcome, bool)> =
        all.iter().map(|a| (a.task, a.token, a.outcome, a.retried)).collect();
    assert_eq!(
        seen,
        [
            (first.task.id, first.token, AttemptOutcome::Failed, true),
            (second.task.id, second.token, AttemptOutcome::Succeeded, false),
            (lost.task.id, lost.token, AttemptOutcome::Expired, true),
        ]
    );
    assert_eq!(all[1].output, Some(json!({"bytes": 42})), "a success carries its task's output");
    assert_eq!((all[0].output.as_ref(), all[2].output.as_ref()), (None, None));
    for a in &all {
        assert_eq!(a.step_kind, "test");
        let ready = a.ready_at.expect("the claim keeps when the task became claimable");
        assert!(ready <= a.started_at && a.started_at <= a.ended_at, "{a:?}");
    }
    // The retry of `a` was claimable only once the failure was reported (its pickup starts there,
    // not at the task's first readiness).
    assert!(all[1].ready_at.expect("ready") >= all[0].started_at);
    assert!(all[1].ready_at > all[0].ready_at);

    // One at a time gives the same rows; a window from the first end time leaves it out.
    assert_eq!(read_all(&store, DateTime::UNIX_EPOCH, to, 1).await, all);
    let later: Vec<EndedAttempt> = all.iter().filter(|a| a.ended_at > all[0].ended_at).cloned().collect();
    assert_eq!(read_all(&store, all[0].ended_at, to, 2).await, later);
    // A horizon in the past leaves out what ended after it.
    let past = store.metrics_horizon(Duration::from_secs(3600)).await.expect("horizon");
    assert!(read_all(&store, DateTime::UNIX_EPOCH, past, 10).await.is_empty());
    drop(running);
}
