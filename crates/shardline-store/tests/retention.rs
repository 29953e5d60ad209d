//! Retention: the server's policy, the step cache's use counting and fenced forgetting, the runs
//! a gc judges directories by, and the disk usage reports the dashboard reads.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use shardline_store::*;

shardline_testdb::on_both_databases!(
    policy_round_trips,
    cache_use_is_counted_and_forgetting_is_fenced,
    runs_by_name_carry_their_retention_and_live_runs_their_tasks,
    disk_usage_is_replaced_per_reporter_and_summed_per_run,
);

async fn policy_round_trips(db: &TestDb) {
    let store = db.store().await;
    assert_eq!(store.retention_policy().await.expect("policy"), RetentionPolicy::default(), "none set: keep all");
    let p = RetentionPolicy { retain_runs: Some(Duration::from_secs(30 * 86_400)), cache_max: Some(500 << 30) };
    store.set_retention_policy(&p).await.expect("set");
    assert_eq!(store.retention_policy().await.expect("policy"), p);
    // The last server started sets it, limits removed included.
    let q = RetentionPolicy { retain_runs: None, cache_max: Some(1) };
    store.set_retention_policy(&q).await.expect("set again");
    assert_eq!(db.store().await.retention_policy().await.expect("policy"), q);
}

async fn cache_use_is_counted_and_forgetting_is_fenced(db: &TestDb) {
    let store = db.store().await;
    let tags = vec!["step:abc".to_string(), "url:s3://b/m".to_string()];
    store.cache_put_tagged("k", &json!({"dir": "/w/runs/a/shard/checkpoint"}), &tags).await.expect("put");
    store.cache_put("plain", &json!({"path": "/w/cache/objects/x"})).await.expect("put");
    let entries = store.cache_entries().await.expect("entries");
    let keys: Vec<(&str, i64, &[String])> =
        entries.iter().map(|e| (e.key.as_str(), e.uses, e.tags.as_slice())).collect();
    assert_eq!(keys, vec![("k", 1, tags.as_slice()), ("plain", 1, &[][..])]);
    let written = entries[0].last_used_at;
    assert_eq!(entries[0].output, json!({"dir": "/w/runs/a/shard/checkpoint"}));

    // A preview does not count as a use; a hit does, and moves the use time.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(store.cache_peek("k").await.expect("peek").is_some());
    assert_eq!(store.cache_entries().await.expect("entries")[0].uses, 1);
    assert_eq!(store.cache_get("k").await.expect("get"), Some(json!({"dir": "/w/runs/a/shard/checkpoint"})));
    let used = store.cache_entries().await.expect("entries").remove(0);
    assert_eq!(used.uses, 2);
    assert!(used.last_used_at > written, "{} after {}", used.last_used_at, written);
    assert_eq!(store.cache_get("missing").await.expect("get"), None);

    // A gc that saw one use does not forget an entry used since; one that saw the latest does.
    assert!(!store.cache_forget("k", 1).await.expect("forget"));
    assert!(store.cache_peek("k").await.expect("peek").is_some());
    assert!(store.cache_forget("k", 2).await.expect("forget"));
    assert_eq!(store.cache_get("k").await.expect("get"), None);
    assert!(!store.cache_forget("k", 2).await.expect("forget"), "already gone");

    // A rewrite is a use too, and replaces the tags.
    store.cache_put_tagged("plain", &json!({"path": "/elsewhere"}), &["hub:org/m".to_string()]).await.expect("put");
    let e = store.cache_entries().await.expect("entries").remove(0);
    assert_eq!((e.key.as_str(), e.uses, e.tags.as_slice()), ("plain", 2, &["hub:org/m".to_string()][..]));
    assert!(!store.cache_forget("plain", 1).await.expect("forget"));
}

async fn runs_by_name_carry_their_retention_and_live_runs_their_tasks(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let named = |name: &str, retention: Option<Duration>| {
        let mut r = new_run(p, json!({}));
        r.options = RunOptions { name: Some(name.into()), retention, ..RunOptions::default() };
        r
    };
    let (done, _) = store.create_run(named("convert-1", Some(Duration::from_secs(7 * 86_400)))).await.expect("run");
    store.add_tasks(done, vec![task("only", &[])]).await.expect("tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("worker");
    let lease = claim_named(&store, w, "only").await;
    succeed(&store, &lease).await;
    let (cancelled, _) = store.create_run(named("convert-2", None)).await.expect("run");
    store.add_tasks(cancelled, vec![task("a", &[])]).await.expect("tasks");
    assert!(store.cancel_run(cancelled, "user:t@h").await.expect("cancel"));
    let (queued, _) = store.create_run(named("convert-3", None)).await.expect("run");
    let mut a = task("download", &[]);
    a.payload = json!({"role": "object_download", "url": "s3://b/m"});
    store.add_tasks(queued, vec![a, task("shard", &["download"])]).await.expect("tasks");

    let names: Vec<String> = ["convert-1", "convert-2", "convert-3", "nobody"].map(String::from).to_vec();
    let runs = store.runs_named(&names).await.expect("runs_named");
    let seen: Vec<(RunId, &str, RunState, bool, Option<Duration>)> =
        runs.iter().map(|r| (r.id, r.name.as_str(), r.state, r.finished_at.is_some(), r.retention)).collect();
    assert_eq!(
        seen,
        vec![
            (done, "convert-1", RunState::Succeeded, true, Some(Duration::from_secs(7 * 86_400))),
            (cancelled, "convert-2", RunState::Cancelled, true, None),
            (queued, "convert-3", RunState::Queued, false, None),
        ]
    );
    assert!(store.runs_named(&[]).await.expect("none").is_empty());
    assert_eq!(
        store.get_run(done).await.expect("get").expect("run").options.retention,
        Some(Duration::from_secs(7 * 86_400))
    );

    let live = store.live_runs().await.expect("live_runs");
    assert_eq!(live.len(), 1, "only the queued run is live: {live:?}");
    assert_eq!((live[0].id, live[0].name.as_deref(), live[0].state), (queued, Some("convert-3"), RunState::Queued));
    assert_eq!(
        live[0].tasks,
        vec![(json!({"role": "object_download", "url": "s3://b/m"}), None), (json!({"name": "shard"}), None)]
    );
}

async fn disk_usage_is_replaced_per_reporter_and_summed_per_run(db: &TestDb) {
    let store = db.store().await;
    let run = run(&store).await;
    let other = common::run(&store).await;
    let entry = |path: &str, kind: DiskKind, run: Option<RunId>, bytes: u64| DiskEntry {
        path: path.into(),
        kind,
        run,
        cache_key: (kind == DiskKind::Cache).then(|| format!("key-{bytes}")),
        bytes,
        last_used_at: None,
    };
    assert_eq!(store.run_disk_bytes(run).await.expect("bytes"), None, "nobody reported it");
    store
        .report_disk_usage(
            "host-a:/w",
            &[
                entry("/w/runs/r1", DiskKind::Run, Some(run), 1000),
                entry("/w/runs/r1/shard/checkpoint", DiskKind::Cache, None, 600),
                entry("/w/cache/objects/x", DiskKind::Download, None, 70),
            ],
        )
        .await
        .expect("report a");
    store.report_disk_usage("host-b:/w", &[entry("/w/runs/r1", DiskKind::Run, Some(run), 24)]).await.expect("report b");
    assert_eq!(store.run_disk_bytes(run).await.expect("bytes"), Some(1024), "summed over the hosts");
    assert_eq!(store.run_disk_bytes(other).await.expect("bytes"), None);

    let caches = store.disk_usage(&[DiskKind::Cache, DiskKind::Download], 100).await.expect("usage");
    let seen: Vec<(&str, &str, DiskKind, Option<&str>, u64)> = caches
        .iter()
        .map(|r| {
            (r.reporter.as_str(), r.entry.path.as_str(), r.entry.kind, r.entry.cache_key.as_deref(), r.entry.bytes)
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            ("host-a:/w", "/w/runs/r1/shard/checkpoint", DiskKind::Cache, Some("key-600"), 600),
            ("host-a:/w", "/w/cache/objects/x", DiskKind::Download, None, 70),
        ]
    );
    let reporters = store.disk_reporters().await.expect("reporters");
    let totals: Vec<(&str, u64, u64, u64, u64)> = reporters
        .iter()
        .map(|r| (r.reporter.as_str(), r.run_bytes, r.cache_bytes, r.download_bytes, r.entries))
        .collect();
    assert!(totals.contains(&("host-a:/w", 1000, 600, 70, 3)), "{totals:?}");
    assert!(totals.contains(&("host-b:/w", 24, 0, 0, 1)), "{totals:?}");

    // A new report replaces the reporter's rows: a freed run is no longer counted.
    store
        .report_disk_usage("host-a:/w", &[entry("/w/cache/objects/x", DiskKind::Download, None, 70)])
        .await
        .expect("again");
    assert_eq!(store.run_disk_bytes(run).await.expect("bytes"), Some(24));
    assert_eq!(store.disk_usage(&[DiskKind::Cache], 100).await.expect("usage"), vec![]);
    store.report_disk_usage("host-b:/w", &[]).await.expect("empty");
    assert_eq!(store.run_disk_bytes(run).await.expect("bytes"), None);
    assert_eq!(store.disk_reporters().await.expect("reporters").len(), 1);
}
