//! One behaviour suite, run against SQLite and PostgreSQL alike.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use shardline_store::*;

shardline_testdb::on_both_databases!(
    connect_reports_backend,
    claim_respects_resources,
    dependencies_promote,
    fencing_refuses_stale_tokens,
    reaper_retries_then_fails,
    failures_back_off_then_fail_the_run,
    timeout_caps_the_lease,
    cancel_refuses_late_completion,
    retry_from_step_resets_downstream,
    retry_of_failed_run_gets_a_fresh_budget,
    create_run_is_idempotent_by_dedupe_key,
    logs_outlive_the_worker,
    events_are_ordered,
    dynamic_fan_out_redirects_successors,
    add_deps_blocks_and_refuses_cycles,
    invalid_batches_report_every_problem,
    reads_list_and_count,
    cache_round_trips,
    wait_for_work_wakes_on_new_tasks,
    complete_is_idempotent,
);

async fn connect_reports_backend(db: &TestDb) {
    let store = db.store().await;
    let expected = match db.kind {
        Kind::Sqlite => Backend::Sqlite,
        Kind::Postgres => Backend::Postgres,
    };
    assert_eq!(store.backend(), expected);
    // Connecting again finds the schema migrated.
    let again = db.store().await;
    assert_eq!(again.list_workers().await.expect("list_workers"), vec![]);
    // The same pipeline version gets the same id; another version another.
    let a = store.upsert_pipeline("p", "v1", "h1").await.expect("upsert");
    assert_eq!(store.upsert_pipeline("p", "v1", "h1").await.expect("upsert"), a);
    assert_ne!(store.upsert_pipeline("p", "v2", "h2").await.expect("upsert"), a);
    let err = store.create_run(new_run(9999, json!({}))).await.expect_err("unknown pipeline");
    assert!(matches!(err, StoreError::PipelineNotFound(9999)), "{err}");
}

async fn claim_respects_resources(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    let gpu_task =
        NewTask { resources: Resources { cpus: 4, memory: 8 << 30, gpus: 2, scratch: 0 }, ..task("gpu", &[]) };
    let fat_task =
        NewTask { resources: Resources { cpus: 2, memory: 64 << 30, gpus: 0, scratch: 0 }, ..task("fat", &[]) };
    let disk_task =
        NewTask { resources: Resources { cpus: 1, memory: 0, gpus: 0, scratch: 500 << 30 }, ..task("disk", &[]) };
    store.add_tasks(run, vec![gpu_task, fat_task, disk_task]).await.expect("add_tasks");

    let cpu = store.register_worker(cpu_worker("cpu")).await.expect("register");
    let small = Resources { cpus: 8, memory: 16 << 30, gpus: 0, scratch: 100 << 30 };
    assert!(store.claim(cpu, &small, TTL).await.expect("claim").is_none(), "nothing fits a small CPU-only worker");

    // More memory: only the memory-hungry task fits, never the GPU one.
    let roomy = Resources { cpus: 8, memory: 128 << 30, gpus: 0, scratch: 100 << 30 };
    let lease = store.claim(cpu, &roomy, TTL).await.expect("claim").expect("fat fits");
    assert_eq!(lease.task.name, "fat");
    assert!(store.claim(cpu, &roomy, TTL).await.expect("claim").is_none(), "the GPU task must not go to a CPU worker");

    let gpu_worker = store
        .register_worker(WorkerInfo { name: "gpu".into(), cpus: 16, memory: 64 << 30, gpus: vec![0, 1], scratch: 0 })
        .await
        .expect("register");
    let one_gpu = Resources { cpus: 16, memory: 64 << 30, gpus: 1, scratch: 0 };
    assert!(store.claim(gpu_worker, &one_gpu, TTL).await.expect("claim").is_none(), "needs two GPUs");
    let two = Resources { gpus: 2, ..one_gpu };
    let lease = store.claim(gpu_worker, &two, TTL).await.expect("claim").expect("gpu fits");
    assert_eq!(lease.task.name, "gpu");
    assert_eq!(lease.task.resources.gpus, 2);
    let disk = Resources { scratch: 1 << 40, ..roomy };
    assert_eq!(store.claim(cpu, &disk, TTL).await.expect("claim").expect("disk fits").task.name, "disk");

    let ghost = WorkerId(424242);
    let err = store.claim(ghost, &big(), TTL).await.expect_err("unknown worker");
    assert!(matches!(err, StoreError::WorkerNotFound(w) if w == ghost), "{err}");
}

async fn dependencies_promote(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    // a -> b -> d, c -> d (fan-in)
    store
        .add_tasks(run, vec![task("a", &[]), task("b", &["a"]), task("c", &[]), task("d", &["b", "c"])])
        .await
        .expect("add_tasks");
    assert_eq!(state_of(&store, run, "a").await, TaskState::Ready);
    assert_eq!(state_of(&store, run, "b").await, TaskState::Blocked);
    assert_eq!(state_of(&store, run, "c").await, TaskState::Ready);
    assert_eq!(state_of(&store, run, "d").await, TaskState::Blocked);
    assert_eq!(run_state(&store, run).await, RunState::Queued);

    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    assert_eq!(run_state(&store, run).await, RunState::Running);
    let c = claim_named(&store, w, "c").await;
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none());
    succeed(&store, &a).await;
    assert_eq!(state_of(&store, run, "b").await, TaskState::Ready);
    let b = claim_named(&store, w, "b").await;
    succeed(&store, &b).await;
    assert_eq!(state_of(&store, run, "d").await, TaskState::Blocked, "d still waits for c");
    succeed(&store, &c).await;
    let d = claim_named(&store, w, "d").await;
    assert_eq!(run_state(&store, run).await, RunState::Running);
    succeed(&store, &d).await;
    let r = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(r.state, RunState::Succeeded);
    assert_eq!(r.tasks.succeeded, 4);
    assert!(r.finished_at.is_some());
    let t = store.task(d.task.id).await.expect("task").expect("exists");
    assert_eq!(t.output, Some(json!({ "done": "d" })));
    let deps = store.run_deps(run).await.expect("run_deps");
    assert_eq!(deps.len(), 3);
}

async fn fencing_refuses_stale_tokens(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("t", &[])]).await.expect("add_tasks");
    let w1 = store.register_worker(cpu_worker("w1")).await.expect("register");
    let w2 = store.register_worker(cpu_worker("w2")).await.expect("register");

    let old = store.claim(w1, &big(), Duration::from_millis(200)).await.expect("claim").expect("lease");
    assert_eq!(old.task.attempt, 1);
    assert!(store.heartbeat(&old, Duration::from_millis(200), Some(json!({"pct": 10}))).await.expect("hb"));
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(store.reap_expired().await.expect("reap"), 1);
    let new = store.claim(w2, &big(), TTL).await.expect("claim").expect("re-lease");
    assert_eq!(new.task.id, old.task.id);
    assert!(new.token > old.token, "tokens must increase: {} then {}", old.token, new.token);
    assert_eq!(new.task.attempt, 2);

    assert!(!store.heartbeat(&old, TTL, None).await.expect("hb"), "stale heartbeat must be refused");
    assert!(
        !store.complete(&old, Outcome::Succeeded { output: json!("stale") }).await.expect("complete"),
        "stale completion must be refused"
    );
    assert!(
        !store.complete(&old, Outcome::Failed { error: "stale".into(), retryable: false }).await.expect("complete"),
        "stale failure must be refused"
    );
    assert!(store.heartbeat(&new, TTL, Some(json!({"pct": 50}))).await.expect("hb"));
    let t = store.task(new.task.id).await.expect("task").expect("exists");
    assert_eq!(t.progress, Some(json!({"pct": 50})));
    assert_eq!(t.lease_owner, Some(w2));
    succeed(&store, &new).await;
    let t = store.task(new.task.id).await.expect("task").expect("exists");
    assert_eq!(t.output, Some(json!({ "done": "t" })), "the stale worker's output never lands");
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);

    let attempts = store.task_attempts(new.task.id).await.expect("attempts");
    let outcomes: Vec<_> = attempts.iter().map(|a| (a.attempt, a.worker_name.as_str(), a.outcome)).collect();
    assert_eq!(outcomes, vec![(1, "w1", Some(AttemptOutcome::Expired)), (2, "w2", Some(AttemptOutcome::Succeeded))]);
}

async fn reaper_retries_then_fails(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    // One attempt may fail, two leases may be lost: the lost leases draw on their own budget.
    let t = NewTask { max_attempts: 1, max_lost: 2, backoff: Duration::from_millis(100), ..task("flaky", &[]) };
    store.add_tasks(run, vec![t, task("other", &[])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("gpu-7")).await.expect("register");

    let first = claim_named(&store, w, "flaky").await;
    // Hold `other` under a long lease: the run's failure must cancel it.
    let other = claim_named(&store, w, "other").await;
    let flaky_id = first.task.id;
    // Expire the first lease by heartbeating it with a tiny ttl.
    assert!(store.heartbeat(&first, Duration::from_millis(50), None).await.expect("hb"));
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(store.reap_expired().await.expect("reap"), 1);
    assert_eq!(store.reap_expired().await.expect("reap"), 0, "reaped once only");
    let t = store.task(flaky_id).await.expect("task").expect("exists");
    assert_eq!(t.state, TaskState::Ready);
    assert_eq!(t.attempt, 1);
    assert_eq!(t.error.as_deref(), Some("worker lost: lease expired (attempt 1, owner gpu-7; lost 1 of 2)"));
    assert_eq!((t.lost, t.attempts_used()), (1, 0));
    let wait = t.ready_at.expect("ready_at") - chrono::Utc::now();
    assert!(wait.num_milliseconds() > 20, "backoff puts the retry in the future ({wait})");
    assert!(store
        .claim(w, &Resources { cpus: 1, memory: 1 << 20, gpus: 0, scratch: 0 }, TTL)
        .await
        .expect("claim")
        .is_none());
    tokio::time::sleep(Duration::from_millis(150)).await;

    let second = store.claim(w, &big(), Duration::from_millis(50)).await.expect("claim").expect("retry");
    assert_eq!(second.task.name, "flaky");
    assert_eq!(second.task.attempt, 2);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(store.reap_expired().await.expect("reap"), 1);
    let t = store.task(flaky_id).await.expect("task").expect("exists");
    assert_eq!(t.state, TaskState::Failed);
    assert_eq!(t.error.as_deref(), Some("worker lost 2 times: lease expired (last owner gpu-7)"));
    assert_eq!((t.lost, t.attempts_used()), (2, 0));
    let r = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(r.state, RunState::Failed);
    assert_eq!(r.error.as_deref(), Some("task `flaky` failed: worker lost 2 times: lease expired (last owner gpu-7)"));
    assert_eq!(state_of(&store, run, "other").await, TaskState::Cancelled);
    assert!(!store.heartbeat(&other, TTL, None).await.expect("hb"));
    let attempts = store.task_attempts(flaky_id).await.expect("attempts");
    assert_eq!(attempts.len(), 2);
    assert!(attempts.iter().all(|a| a.outcome == Some(AttemptOutcome::Expired)
        && a.kind == Some(AttemptKind::Lost)
        && a.ended_at.is_some()));
    let other_attempts = store.task_attempts(other.task.id).await.expect("attempts");
    assert_eq!(other_attempts[0].outcome, Some(AttemptOutcome::Cancelled));
}

async fn failures_back_off_then_fail_the_run(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    let t = NewTask { max_attempts: 3, backoff: Duration::from_millis(300), ..task("x", &[]) };
    store.add_tasks(run, vec![t, task("y", &["x"])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");

    let l = claim_named(&store, w, "x").await;
    let before = chrono::Utc::now();
    assert!(store.complete(&l, Outcome::Failed { error: "oom".into(), retryable: true }).await.expect("complete"));
    let row = store.task(l.task.id).await.expect("task").expect("exists");
    assert_eq!(row.state, TaskState::Ready);
    assert_eq!(row.error.as_deref(), Some("oom"));
    let delay = (row.ready_at.expect("ready_at") - before).num_milliseconds();
    assert!((200..=400).contains(&delay), "first retry after ~300 ms ± 20 %, got {delay} ms");
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none(), "not before the backoff");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let l2 = claim_named(&store, w, "x").await;
    assert_eq!(l2.task.attempt, 2);
    let before = chrono::Utc::now();
    assert!(store.complete(&l2, Outcome::Failed { error: "oom".into(), retryable: true }).await.expect("complete"));
    let row = store.task(l.task.id).await.expect("task").expect("exists");
    let delay = (row.ready_at.expect("ready_at") - before).num_milliseconds();
    assert!((450..=750).contains(&delay), "second retry after ~600 ms ± 20 %, got {delay} ms");
    tokio::time::sleep(Duration::from_millis(750)).await;
    let l3 = claim_named(&store, w, "x").await;
    assert_eq!(l3.task.attempt, 3);
    // A non-retryable failure ends it at once (it is also the last attempt here).
    assert!(store
        .complete(&l3, Outcome::Failed { error: "bad config".into(), retryable: false })
        .await
        .expect("complete"));
    let row = store.task(l.task.id).await.expect("task").expect("exists");
    assert_eq!(row.state, TaskState::Failed);
    let r = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(r.state, RunState::Failed);
    assert_eq!(r.error.as_deref(), Some("task `x` failed after 3 attempts: bad config"));
    assert_eq!(state_of(&store, run, "y").await, TaskState::Cancelled);

    // Non-retryable on the first attempt: no retry even with attempts left.
    let run2 = common::run(&store).await;
    store.add_tasks(run2, vec![NewTask { max_attempts: 5, ..task("z", &[]) }]).await.expect("add_tasks");
    let l = claim_named(&store, w, "z").await;
    assert!(store
        .complete(&l, Outcome::Failed { error: "fatal\0byte".into(), retryable: false })
        .await
        .expect("complete"));
    let r = store.get_run(run2).await.expect("get_run").expect("run");
    assert_eq!(r.state, RunState::Failed);
    assert_eq!(r.error.as_deref(), Some("task `z` failed after 1 attempt: fatal\u{FFFD}byte"));
}

async fn timeout_caps_the_lease(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    let t = NewTask { max_attempts: 1, timeout: Duration::from_millis(300), ..task("slow", &[]) };
    store.add_tasks(run, vec![t]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let l = store.claim(w, &big(), Duration::from_secs(60)).await.expect("claim").expect("lease");
    let cap = (l.expires_at - l.task.leased_at.expect("leased_at")).num_milliseconds();
    assert!(cap <= 300, "the lease never outlives the timeout ({cap} ms)");
    assert!(store.heartbeat(&l, Duration::from_secs(60), None).await.expect("hb"));
    let row = store.task(l.task.id).await.expect("task").expect("exists");
    assert!(
        row.lease_expires_at.expect("expiry")
            <= l.task.leased_at.expect("leased_at") + chrono::Duration::milliseconds(300)
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!store.heartbeat(&l, Duration::from_secs(60), None).await.expect("hb"), "past the timeout");
    assert_eq!(store.reap_expired().await.expect("reap"), 1);
    let row = store.task(l.task.id).await.expect("task").expect("exists");
    assert_eq!(row.state, TaskState::Failed);
    assert_eq!(row.error.as_deref(), Some("timed out after 300ms (attempt 1, owner w)"));
    assert_eq!(store.task_attempts(l.task.id).await.expect("attempts")[0].outcome, Some(AttemptOutcome::TimedOut));
    assert_eq!(run_state(&store, run).await, RunState::Failed);
}

async fn cancel_refuses_late_completion(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &["a"])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    assert!(store.cancel_run(run, "user:test").await.expect("cancel"));
    assert!(!store.cancel_run(run, "user:test").await.expect("cancel twice"), "already finished");
    assert!(!store.heartbeat(&a, TTL, None).await.expect("hb"), "a cancelled lease is lost");
    assert!(
        !store.complete(&a, Outcome::Succeeded { output: json!(1) }).await.expect("complete"),
        "late completion refused"
    );
    assert_eq!(state_of(&store, run, "a").await, TaskState::Cancelled);
    assert_eq!(state_of(&store, run, "b").await, TaskState::Cancelled);
    let r = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(r.state, RunState::Cancelled);
    assert_eq!(r.tasks.cancelled, 2);
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none());
    let err = store.add_tasks(run, vec![task("c", &[])]).await.expect_err("finished run");
    assert!(matches!(err, StoreError::RunState { state: RunState::Cancelled, .. }), "{err}");
    let err = store.cancel_run(RunId(987654), "user:test").await.expect_err("unknown run");
    assert!(matches!(err, StoreError::RunNotFound(_)), "{err}");
}

async fn retry_from_step_resets_downstream(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store
        .add_tasks(run, vec![task("fetch", &[]), task("shard", &["fetch"]), task("publish", &["shard"])])
        .await
        .expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    for name in ["fetch", "shard", "publish"] {
        let l = claim_named(&store, w, name).await;
        succeed(&store, &l).await;
    }
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);

    let err = store.retry_run(run, None, "user:test").await.expect_err("nothing failed");
    assert!(matches!(err, StoreError::RunState { .. }), "{err}");
    let err = store.retry_run(run, Some("nope"), "user:test").await.expect_err("unknown step");
    assert!(err.to_string().contains("known steps: fetch, publish, shard"), "{err}");

    store.retry_run(run, Some("shard"), "user:test").await.expect("retry_run");
    assert_eq!(run_state(&store, run).await, RunState::Running);
    assert_eq!(state_of(&store, run, "fetch").await, TaskState::Succeeded, "upstream kept");
    assert_eq!(state_of(&store, run, "shard").await, TaskState::Ready);
    assert_eq!(state_of(&store, run, "publish").await, TaskState::Blocked);
    let tasks = store.run_tasks(run).await.expect("tasks");
    assert!(tasks.iter().filter(|t| t.name != "fetch").all(|t| t.output.is_none()));
    let err = store.retry_run(run, None, "user:test").await.expect_err("running");
    assert!(matches!(err, StoreError::RunState { state: RunState::Running, .. }), "{err}");

    let l = claim_named(&store, w, "shard").await;
    assert_eq!(l.task.attempt, 2, "attempt numbers keep counting");
    succeed(&store, &l).await;
    let l = claim_named(&store, w, "publish").await;
    succeed(&store, &l).await;
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);
}

async fn retry_of_failed_run_gets_a_fresh_budget(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store
        .add_tasks(run, vec![NewTask { max_attempts: 1, ..task("a", &[]) }, task("b", &["a"]), task("c", &[])])
        .await
        .expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let c = claim_named(&store, w, "a").await;
    let other = claim_named(&store, w, "c").await;
    succeed(&store, &other).await;
    assert!(store.complete(&c, Outcome::Failed { error: "boom".into(), retryable: true }).await.expect("complete"));
    assert_eq!(run_state(&store, run).await, RunState::Failed);
    store.retry_run(run, None, "user:test").await.expect("retry_run");
    assert_eq!(state_of(&store, run, "a").await, TaskState::Ready);
    assert_eq!(state_of(&store, run, "b").await, TaskState::Blocked);
    assert_eq!(state_of(&store, run, "c").await, TaskState::Succeeded);
    let a = claim_named(&store, w, "a").await;
    assert_eq!((a.task.attempt, a.task.attempt_base), (2, 1));
    // The stale lease of the failed attempt stays refused.
    assert!(!store.complete(&c, Outcome::Succeeded { output: json!(0) }).await.expect("complete"));
    succeed(&store, &a).await;
    let b = claim_named(&store, w, "b").await;
    succeed(&store, &b).await;
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);
}

async fn create_run_is_idempotent_by_dedupe_key(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let new = |key: &str| NewRun {
        pipeline_id: p,
        dedupe_key: Some(key.into()),
        params: json!({"repo": "org/model", "sha": "abc"}),
        spec: json!({"steps": 1}),
        options: Default::default(),
        notify: Vec::new(),
        submitted_by: None,
    };
    let (r1, created) = store.create_run(new("org/model@abc")).await.expect("create");
    assert!(created);
    let (again, created) = store.create_run(new("org/model@abc")).await.expect("create");
    assert_eq!((again, created), (r1, false), "queued: same run");
    let (other, created) = store.create_run(new("org/model@def")).await.expect("create");
    assert!(created && other != r1);
    let (nokey1, c1) = store.create_run(NewRun { dedupe_key: None, ..new("") }).await.expect("create");
    let (nokey2, c2) = store.create_run(NewRun { dedupe_key: None, ..new("") }).await.expect("create");
    assert!(c1 && c2 && nokey1 != nokey2, "no key: always a new run");

    // Succeeded: still the same run.
    store.add_tasks(r1, vec![task("t", &[])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let l = claim_named(&store, w, "t").await;
    assert_eq!(store.create_run(new("org/model@abc")).await.expect("create"), (r1, false), "running");
    succeed(&store, &l).await;
    assert_eq!(store.create_run(new("org/model@abc")).await.expect("create"), (r1, false), "succeeded");

    // Cancelled: a new run may take the key; the old one then cannot be retried.
    assert!(store.cancel_run(other, "user:test").await.expect("cancel"));
    let (fresh, created) = store.create_run(new("org/model@def")).await.expect("create");
    assert!(created && fresh != other);
    let err = store.retry_run(other, None, "user:test").await.expect_err("key taken");
    match err {
        StoreError::DedupeConflict { run, holder, key } => {
            assert_eq!((run, holder, key.as_str()), (other, fresh, "org/model@def"));
        }
        e => panic!("expected DedupeConflict, got {e}"),
    }
    assert_eq!(run_state(&store, other).await, RunState::Cancelled, "unchanged");
    // Once the new holder is cancelled too, the old run can be retried.
    assert!(store.cancel_run(fresh, "user:test").await.expect("cancel"));
    store.retry_run(other, None, "user:test").await.expect("retry");
    assert_eq!(run_state(&store, other).await, RunState::Queued, "a run without tasks goes back to queued");
    let r = store.get_run(other).await.expect("get").expect("run");
    assert_eq!(r.params, json!({"repo": "org/model", "sha": "abc"}));
    assert_eq!(r.dedupe_key.as_deref(), Some("org/model@def"));
}

async fn logs_outlive_the_worker(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &[])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("doomed")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    let b = claim_named(&store, w, "b").await;
    let now = chrono::Utc::now();
    let line = |stream, text: &str| LogLine { ts: now, stream, line: text.to_string() };
    store
        .append_logs(a.task.id, 1, &[line(LogStream::Stdout, "downloading"), line(LogStream::Stderr, "warn: slow")])
        .await
        .expect("append");
    store.append_logs(b.task.id, 1, &[line(LogStream::System, "started")]).await.expect("append");
    let long = "x".repeat(MAX_LOG_LINE + 10);
    store
        .append_logs(a.task.id, 2, &[line(LogStream::Stdout, "nul\0here"), line(LogStream::Stdout, &long)])
        .await
        .expect("append");
    store.append_logs(a.task.id, 2, &[]).await.expect("empty append");
    let err = store.append_logs(TaskId(999_999), 1, &[line(LogStream::Stdout, "x")]).await.expect_err("unknown task");
    assert!(matches!(err, StoreError::TaskNotFound(_)), "{err}");

    assert!(store.remove_worker(w).await.expect("remove"));
    assert!(!store.remove_worker(w).await.expect("remove twice"));
    assert!(store.list_workers().await.expect("workers").is_empty());

    let logs = store.logs(LogFilter::Task(a.task.id), 0, 100).await.expect("logs");
    let lines: Vec<_> =
        logs.iter().map(|l| (l.attempt, l.stream, l.line.chars().take(20).collect::<String>())).collect();
    assert_eq!(
        lines,
        vec![
            (1, LogStream::Stdout, "downloading".to_string()),
            (1, LogStream::Stderr, "warn: slow".to_string()),
            (2, LogStream::Stdout, "nul\u{FFFD}here".to_string()),
            (2, LogStream::Stdout, "x".repeat(20)),
        ]
    );
    assert!(logs[3].line.ends_with("(line truncated)"));
    assert!(logs.windows(2).all(|p| p[0].id < p[1].id));
    assert_eq!((logs[0].ts - now).num_milliseconds().abs(), 0);
    let tail = store.logs(LogFilter::Task(a.task.id), logs[1].id, 100).await.expect("logs");
    assert_eq!(tail.len(), 2);
    assert_eq!(store.logs(LogFilter::Attempt(a.task.id, 2), 0, 1).await.expect("logs").len(), 1);
    let all = store.logs(LogFilter::Run(run), 0, 100).await.expect("logs");
    assert_eq!(all.len(), 5);
    // The attempt history keeps the worker's name.
    let attempts = store.task_attempts(a.task.id).await.expect("attempts");
    assert_eq!((attempts[0].worker, attempts[0].worker_name.as_str()), (Some(w), "doomed"));
    let attempts_after = store.task(a.task.id).await.expect("task").expect("exists");
    assert_eq!(attempts_after.lease_owner, None, "the lease owner column is cleared with the worker");
    // A lease of a removed worker still completes (the token decides, not the worker row).
    succeed(&store, &a).await;
}

async fn events_are_ordered(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &["a"])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    succeed(&store, &a).await;
    let b = claim_named(&store, w, "b").await;
    succeed(&store, &b).await;

    let events = store.events_after(0, 1000).await.expect("events");
    assert!(events.windows(2).all(|p| p[0].id < p[1].id), "strictly increasing ids");
    let run_states: Vec<RunState> = events
        .iter()
        .filter_map(|e| match e.change {
            Change::Run { state } => Some(state),
            _ => None,
        })
        .collect();
    assert_eq!(run_states, vec![RunState::Queued, RunState::Running, RunState::Succeeded]);
    let of = |id: TaskId| -> Vec<(TaskState, i32)> {
        events
            .iter()
            .filter_map(|e| match e.change {
                Change::Task { task, state, attempt } if task == id => Some((state, attempt)),
                _ => None,
            })
            .collect()
    };
    assert_eq!(of(a.task.id), vec![(TaskState::Ready, 0), (TaskState::Leased, 1), (TaskState::Succeeded, 1)]);
    assert_eq!(
        of(b.task.id),
        vec![(TaskState::Blocked, 0), (TaskState::Ready, 0), (TaskState::Leased, 1), (TaskState::Succeeded, 1)]
    );
    assert!(events.iter().all(|e| e.run == run));
    // Paging by the last id seen gives the same stream.
    let mut paged = Vec::new();
    let mut after = 0;
    loop {
        let page = store.events_after(after, 3).await.expect("events");
        if page.is_empty() {
            break;
        }
        after = page.last().map_or(after, |e| e.id);
        paged.extend(page);
    }
    assert_eq!(paged, events);
    // The succeeded run event comes after the last task's success.
    let last_task = events.iter().rposition(|e| matches!(e.change, Change::Task { .. })).unwrap_or(0);
    assert!(matches!(events.last().map(|e| e.change), Some(Change::Run { state: RunState::Succeeded })));
    assert!(last_task < events.len() - 1);
}

async fn dynamic_fan_out_redirects_successors(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("plan", &[]), task("validate", &["plan"])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let plan = claim_named(&store, w, "plan").await;
    // While `plan` runs it adds the ranks and a commit, and `validate` must wait for them.
    let ranks: Vec<NewTask> = (0..4).map(|r| task(&format!("shard.rank{r}"), &["plan"])).collect();
    let mut batch = ranks;
    batch.push(task("commit", &["shard.rank0", "shard.rank1", "shard.rank2", "shard.rank3"]));
    let ids = store.add_tasks_and_redirect(run, batch, plan.task.id).await.expect("redirect");
    assert_eq!(ids.len(), 5);
    assert!(ids.windows(2).all(|p| p[0] < p[1]), "ids in batch order");
    let deps = store.run_deps(run).await.expect("deps");
    let validate =
        store.run_tasks(run).await.expect("tasks").into_iter().find(|t| t.name == "validate").expect("validate");
    let validate_needs: Vec<TaskId> = deps.iter().filter(|d| d.task == validate.id).map(|d| d.needs).collect();
    assert_eq!(validate_needs.len(), 6, "plan + 4 ranks + commit");
    assert_eq!(state_of(&store, run, "shard.rank0").await, TaskState::Blocked);
    succeed(&store, &plan).await;
    for _ in 0..5 {
        let l = store.claim(w, &big(), TTL).await.expect("claim").expect("a fan-out task");
        assert_ne!(l.task.name, "validate", "validate must wait for the fan-out");
        succeed(&store, &l).await;
    }
    assert_eq!(run_state(&store, run).await, RunState::Running);
    // `commit` succeeded last; now validate.
    let l = claim_named(&store, w, "validate").await;
    succeed(&store, &l).await;
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);

    let err = store.add_tasks_and_redirect(run, vec![task("late", &[])], plan.task.id).await.expect_err("finished");
    assert!(matches!(err, StoreError::RunState { .. }), "{err}");
}

async fn add_deps_blocks_and_refuses_cycles(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &["a"]), task("c", &[])]).await.expect("add_tasks");
    assert_eq!(state_of(&store, run, "c").await, TaskState::Ready);
    store.add_deps(run, "c", vec!["b".into()]).await.expect("add_deps");
    assert_eq!(state_of(&store, run, "c").await, TaskState::Blocked, "ready task gains an unfinished need");
    let err = store.add_deps(run, "a", vec!["c".into()]).await.expect_err("cycle");
    assert!(err.to_string().contains("dependency cycle"), "{err}");
    let err = store.add_deps(run, "a", vec!["zzz".into()]).await.expect_err("unknown");
    assert!(err.to_string().contains("cannot need `zzz`"), "{err}");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    let err = store.add_deps(run, "a", vec!["c".into()]).await.expect_err("leased");
    assert!(matches!(err, StoreError::TaskState { state: TaskState::Leased, .. }), "{err}");
    succeed(&store, &a).await;
    let b = claim_named(&store, w, "b").await;
    succeed(&store, &b).await;
    let c = claim_named(&store, w, "c").await;
    succeed(&store, &c).await;
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);
}

async fn invalid_batches_report_every_problem(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[])]).await.expect("add_tasks");
    let err = store
        .add_tasks(run, vec![task("a", &[]), task("b", &["ghost"]), task("c", &["d"]), task("d", &["c"])])
        .await
        .expect_err("invalid");
    let StoreError::InvalidTasks { problems, .. } = &err else { panic!("expected InvalidTasks, got {err}") };
    let text = problems.join("\n");
    assert!(text.contains("dependency cycle: c -> d -> c"), "{text}");
    // The cycle is found before the database is asked; the rest after.
    let err = store.add_tasks(run, vec![task("a", &[]), task("b", &["ghost"])]).await.expect_err("invalid");
    let text = err.to_string();
    assert!(text.contains("task `a` already exists"), "{text}");
    assert!(text.contains("task `b` needs `ghost`"), "{text}");
    assert_eq!(store.run_tasks(run).await.expect("tasks").len(), 1, "nothing of a bad batch is added");
    let huge = NewTask { resources: Resources { memory: u64::MAX, ..Resources::default() }, ..task("huge", &[]) };
    assert!(store.add_tasks(run, vec![huge]).await.is_err());
    let err = store.add_tasks(RunId(777_777), vec![task("x", &[])]).await.expect_err("no run");
    assert!(matches!(err, StoreError::RunNotFound(_)), "{err}");
    assert_eq!(store.add_tasks(run, vec![]).await.expect("empty"), vec![]);
}

async fn reads_list_and_count(db: &TestDb) {
    let store = db.store().await;
    let p1 = store.upsert_pipeline("alpha", "a", "1").await.expect("upsert");
    let p2 = store.upsert_pipeline("beta", "b", "1").await.expect("upsert");
    let mut runs = Vec::new();
    for i in 0..5 {
        let p = if i % 2 == 0 { p1 } else { p2 };
        let (r, _) = store.create_run(new_run(p, json!({ "i": i }))).await.expect("create");
        runs.push(r);
    }
    store.add_tasks(runs[4], vec![task("a", &[]), task("b", &["a"])]).await.expect("add_tasks");
    store.set_run_plan(runs[4], json!({"ranks": 8})).await.expect("plan");
    assert!(matches!(store.set_run_plan(RunId(55_555), json!(1)).await, Err(StoreError::RunNotFound(_))));
    store.cancel_run(runs[0], "user:test").await.expect("cancel");

    let page = store.list_runs(&RunFilter::default(), Page { limit: 2, before: None }).await.expect("list");
    assert_eq!(page.runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![runs[4], runs[3]]);
    let top = &page.runs[0];
    assert_eq!((top.tasks.ready, top.tasks.blocked, top.tasks.total()), (1, 1, 2));
    assert_eq!(top.plan, Some(json!({"ranks": 8})));
    assert_eq!(top.pipeline_name, "alpha");
    let page2 = store.list_runs(&RunFilter::default(), Page { limit: 2, before: page.next }).await.expect("list");
    assert_eq!(page2.runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![runs[2], runs[1]]);
    let page3 = store.list_runs(&RunFilter::default(), Page { limit: 2, before: page2.next }).await.expect("list");
    assert_eq!(page3.runs.len(), 1);
    assert_eq!(page3.next, None);
    let alpha = store
        .list_runs(&RunFilter { pipeline: Some("alpha".into()), state: None }, Page::default())
        .await
        .expect("list");
    assert_eq!(alpha.runs.len(), 3);
    let cancelled = store
        .list_runs(&RunFilter { state: Some(RunState::Cancelled), pipeline: None }, Page::default())
        .await
        .expect("list");
    assert_eq!(cancelled.runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![runs[0]]);
    assert!(store.get_run(RunId(31_337)).await.expect("get").is_none());
    assert!(store.task(TaskId(31_337)).await.expect("task").is_none());

    let w = store
        .register_worker(WorkerInfo { name: "g".into(), cpus: 4, memory: 8, gpus: vec![2, 3], scratch: 9 })
        .await
        .expect("register");
    store.worker_heartbeat(w).await.expect("hb");
    store.stop_worker(w).await.expect("stop");
    let workers = store.list_workers().await.expect("workers");
    assert_eq!(workers.len(), 1);
    assert_eq!(workers[0].gpus, vec![2, 3]);
    assert_eq!(workers[0].resources, Resources { cpus: 4, memory: 8, gpus: 2, scratch: 9 });
    assert_eq!(workers[0].state, WorkerState::Stopped);
    assert!(matches!(store.worker_heartbeat(WorkerId(8888)).await, Err(StoreError::WorkerNotFound(_))));
    let counts: HashMap<RunState, usize> = store
        .list_runs(&RunFilter::default(), Page { limit: 100, before: None })
        .await
        .expect("list")
        .runs
        .iter()
        .fold(HashMap::new(), |mut m, r| {
            *m.entry(r.state).or_default() += 1;
            m
        });
    assert_eq!(counts.get(&RunState::Queued), Some(&4));
}

async fn cache_round_trips(db: &TestDb) {
    let store = db.store().await;
    assert_eq!(store.cache_get("k").await.expect("get"), None);
    store.cache_put("k", &json!({"files": ["a", "b"]})).await.expect("put");
    assert_eq!(store.cache_get("k").await.expect("get"), Some(json!({"files": ["a", "b"]})));
    store.cache_put("k", &json!(2)).await.expect("put");
    assert_eq!(store.cache_get("k").await.expect("get"), Some(json!(2)));
}

async fn wait_for_work_wakes_on_new_tasks(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let waiter = store.clone();
    let handle = tokio::spawn(async move {
        let mut wakeups = 0;
        loop {
            if let Some(lease) = waiter.claim(w, &big(), TTL).await.expect("claim") {
                return (Instant::now(), lease.task.name, wakeups);
            }
            waiter.wait_for_work(Duration::from_secs(20)).await;
            wakeups += 1;
        }
    });
    // Let the waiter start listening (the first wait opens the LISTEN connection).
    tokio::time::sleep(Duration::from_millis(700)).await;
    let added = Instant::now();
    store.add_tasks(run, vec![task("wake", &[])]).await.expect("add_tasks");
    let (claimed_at, name, wakeups) = handle.await.expect("join");
    let latency = claimed_at.duration_since(added);
    assert!(latency < Duration::from_secs(3), "woken by the new task, not the 20 s poll ({latency:?})");
    assert_eq!(name, "wake");
    assert!(wakeups <= 3, "{wakeups} wake-ups");
    if db.kind == Kind::Postgres {
        assert!(store.listener_connects() >= 1);
    }
    // A separate store (another server) is woken too on PostgreSQL; on SQLite it polls.
    let other = db.store().await;
    let start = Instant::now();
    let poll = Duration::from_millis(300);
    other.wait_for_work(poll).await;
    assert!(start.elapsed() <= poll + Duration::from_millis(200));
}

async fn complete_is_idempotent(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store
        .add_tasks(run, vec![task("a", &[]), NewTask { backoff: Duration::from_secs(60), ..task("b", &[]) }])
        .await
        .expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    succeed(&store, &a).await;
    // A retry after a lost reply: accepted again, nothing changes.
    succeed(&store, &a).await;
    assert!(!store.complete(&a, Outcome::Failed { error: "x".into(), retryable: true }).await.expect("complete"));
    let b = claim_named(&store, w, "b").await;
    let fail = Outcome::Failed { error: "transient".into(), retryable: true };
    assert!(store.complete(&b, fail.clone()).await.expect("complete"));
    assert!(store.complete(&b, fail).await.expect("complete again"));
    let t = store.task(b.task.id).await.expect("task").expect("exists");
    assert_eq!((t.state, t.attempt), (TaskState::Ready, 1));
    assert_eq!(store.task_attempts(b.task.id).await.expect("attempts").len(), 1);
}

/// The in-memory database lives on one connection: no call may need a second one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_in_memory_runs_a_whole_lifecycle() {
    let store = Store::connect("sqlite::memory:").await.expect("connect");
    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &["a"])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let a = claim_named(&store, w, "a").await;
    succeed(&store, &a).await;
    succeed(&store, &a).await;
    let b = claim_named(&store, w, "b").await;
    assert!(store.complete(&b, Outcome::Failed { error: "x".into(), retryable: true }).await.expect("fail"));
    assert!(store.complete(&b, Outcome::Failed { error: "x".into(), retryable: true }).await.expect("fail again"));
    let b = claim_named(&store, w, "b").await;
    succeed(&store, &b).await;
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);
    assert_eq!(store.reap_expired().await.expect("reap"), 0);
    assert!(!store.events_after(0, 100).await.expect("events").is_empty());
}

#[tokio::test]
async fn unsupported_urls_are_refused() {
    let err = Store::connect("mysql://x").await.expect_err("unsupported");
    assert!(matches!(err, StoreError::UnsupportedUrl(_)), "{err}");
    let err = Store::connect("postgres://postgres:secret@127.0.0.1:1/none").await.expect_err("unreachable");
    assert!(err.to_string().contains("postgres:***@"), "password redacted: {err}");
    assert!(err.is_transient());
}
