//! Disk as a resource in the store: a worker's measured disk travels with its heartbeat; a
//! claim offering no scratch (a full disk) takes no task that needs some; a plan's completion
//! sets its rank tasks' scratch needs in its own fenced transaction, never below the spec's.

mod common;

use common::*;
use shardline_store::*;

const GIB: u64 = 1 << 30;

shardline_testdb::on_both_databases!(
    a_worker_reports_its_disk_with_its_heartbeat,
    a_full_disk_takes_no_task_that_needs_scratch,
    a_plan_sets_its_rank_tasks_scratch_when_it_succeeds,
);

fn with_scratch(name: &str, needs: &[&str], scratch: u64) -> NewTask {
    let mut t = task(name, needs);
    t.resources.scratch = scratch;
    t
}

fn need(task: &str, bytes: u64) -> ScratchNeed {
    ScratchNeed { task: task.into(), bytes }
}

async fn scratch_of(store: &Store, run: RunId) -> Vec<(String, u64)> {
    let mut tasks: Vec<(String, u64)> =
        store.run_tasks(run).await.expect("run_tasks").into_iter().map(|t| (t.name, t.resources.scratch)).collect();
    tasks.sort();
    tasks
}

async fn a_worker_reports_its_disk_with_its_heartbeat(db: &TestDb) {
    let store = db.store().await;
    let w = store.register_worker(cpu_worker("cpu-1")).await.expect("register");
    let listed = |store: Store| async move { store.list_workers().await.expect("list_workers").remove(0) };
    assert_eq!(listed(store.clone()).await.disk, None, "no disk until the worker reports one");

    let disk = WorkerDisk { free: 40 * GIB, total: 100 * GIB, scratch_free: 39 * GIB };
    store.worker_heartbeat_with_disk(w, &disk).await.expect("heartbeat");
    let row = listed(store.clone()).await;
    assert_eq!(row.disk, Some(disk));

    // A later beat replaces it, and like any heartbeat makes a stopped worker active again.
    store.stop_worker(w).await.expect("stop");
    assert_eq!(listed(store.clone()).await.state, WorkerState::Stopped);
    let fuller = WorkerDisk { free: 3 * GIB, total: 100 * GIB, scratch_free: 2 * GIB };
    store.worker_heartbeat_with_disk(w, &fuller).await.expect("heartbeat");
    let row = listed(store.clone()).await;
    assert_eq!((row.disk, row.state), (Some(fuller), WorkerState::Active));
    // A plain heartbeat keeps the last disk; sizes beyond i64 are kept at the largest.
    store.worker_heartbeat(w).await.expect("heartbeat");
    assert_eq!(listed(store.clone()).await.disk, Some(fuller));
    let huge = WorkerDisk { free: u64::MAX, total: u64::MAX, scratch_free: u64::MAX };
    store.worker_heartbeat_with_disk(w, &huge).await.expect("heartbeat");
    let max = i64::MAX as u64;
    assert_eq!(listed(store.clone()).await.disk, Some(WorkerDisk { free: max, total: max, scratch_free: max }));

    let gone = WorkerId(w.0 + 1000);
    assert!(
        matches!(store.worker_heartbeat_with_disk(gone, &disk).await, Err(StoreError::WorkerNotFound(id)) if id == gone)
    );
    store.close().await;
}

async fn a_full_disk_takes_no_task_that_needs_scratch(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    store
        .add_tasks(run, vec![with_scratch("big", &[], 5 * GIB), with_scratch("small", &[], 0)])
        .await
        .expect("add_tasks");
    let w = store.register_worker(cpu_worker("full")).await.expect("register");
    // A full disk offers no scratch: only the task that needs none is leased, though it is
    // second in order.
    let full = Resources { scratch: 0, ..big() };
    let lease = store.claim(w, &full, TTL).await.expect("claim").expect("a task that needs no scratch");
    assert_eq!(lease.task.name, "small");
    assert!(store.claim(w, &full, TTL).await.expect("claim").is_none(), "the full disk took `big`");
    let almost = Resources { scratch: 5 * GIB - 1, ..big() };
    assert!(store.claim(w, &almost, TTL).await.expect("claim").is_none(), "one byte short took `big`");
    let roomy = Resources { scratch: 5 * GIB, ..big() };
    let lease = store.claim(w, &roomy, TTL).await.expect("claim").expect("`big` fits now");
    assert_eq!((lease.task.name.as_str(), lease.task.resources.scratch), ("big", 5 * GIB));
    store.close().await;
}

async fn a_plan_sets_its_rank_tasks_scratch_when_it_succeeds(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    // The spec asks 2 MiB of every task of the step: a floor.
    let floor = 2 << 20;
    store
        .add_tasks(
            run,
            vec![
                with_scratch("shard", &[], floor),
                with_scratch("shard/rank-0", &["shard"], floor),
                with_scratch("shard/rank-1", &["shard"], floor),
                with_scratch("shard/commit", &["shard/rank-0", "shard/rank-1"], floor),
            ],
        )
        .await
        .expect("add_tasks");
    // Another run with a task of the same name is not touched.
    let other = common::run(&store).await;
    store.add_tasks(other, vec![with_scratch("shard/rank-1", &[], 0)]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("cpu-1")).await.expect("register");
    let plan = claim_named(&store, w, "shard").await;
    let needs = vec![
        need("shard/rank-0", 1 << 20),
        need("shard/rank-1", 7 * GIB),
        need("shard/rank-1", GIB),
        need("no-such", 1),
    ];

    // A stale lease (a newer one exists) is refused, and sets nothing.
    let stale = Lease { token: plan.token - 1, ..plan.clone() };
    let output = serde_json::json!({"plan_digest": "d"});
    let refused =
        store.complete_with(&stale, Outcome::Succeeded { output: output.clone() }, &needs).await.expect("complete");
    assert!(!refused, "a stale lease's completion was accepted");
    assert_eq!(
        scratch_of(&store, run).await,
        [
            ("shard".into(), floor),
            ("shard/commit".into(), floor),
            ("shard/rank-0".into(), floor),
            ("shard/rank-1".into(), floor)
        ]
    );

    let accepted =
        store.complete_with(&plan, Outcome::Succeeded { output: output.clone() }, &needs).await.expect("complete");
    assert!(accepted);
    // Rank 0 keeps the spec's larger floor; rank 1 gets the largest need given for it; the
    // commit and the plan itself keep theirs.
    let expected: Vec<(String, u64)> = vec![
        ("shard".into(), floor),
        ("shard/commit".into(), floor),
        ("shard/rank-0".into(), floor),
        ("shard/rank-1".into(), 7 * GIB),
    ];
    assert_eq!(scratch_of(&store, run).await, expected);
    assert_eq!(scratch_of(&store, other).await, [("shard/rank-1".to_string(), 0)]);
    // Repeating the completion (a lost reply) is recognised and changes nothing.
    assert!(store.complete_with(&plan, Outcome::Succeeded { output }, &needs).await.expect("complete again"));
    assert_eq!(scratch_of(&store, run).await, expected);

    // The ranks are ready with their needs: claims with 1 GiB of scratch take rank 0 and the
    // other run's task, never rank 1.
    let some = Resources { scratch: GIB, ..big() };
    let mut taken = Vec::new();
    while let Some(l) = store.claim(w, &some, TTL).await.expect("claim") {
        taken.push((l.task.run, l.task.name));
    }
    taken.sort();
    assert_eq!(taken, [(run, "shard/rank-0".to_string()), (other, "shard/rank-1".to_string())]);
    let r1 = store.claim(w, &Resources { scratch: 7 * GIB, ..big() }, TTL).await.expect("claim").expect("rank 1");
    assert_eq!((r1.task.name.as_str(), r1.task.resources.scratch), ("shard/rank-1", 7 * GIB));
    store.close().await;
}
