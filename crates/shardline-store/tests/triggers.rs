//! Triggers and firings, run against SQLite and PostgreSQL alike.

mod common;

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use common::*;
use serde_json::json;
use shardline_store::*;

shardline_testdb::on_both_databases!(
    register_keeps_state_of_unchanged_triggers,
    checks_count_errors_and_keep_the_last,
    a_firing_is_claimed_once,
    concurrent_claims_have_one_winner,
    a_stale_claim_is_taken_over,
);

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 3, 28, 12, 0, 0).single().expect("valid time")
}

fn watch(repo: &str) -> NewTrigger {
    NewTrigger {
        position: 0,
        kind: "watch".into(),
        spec: json!({"watch": {"repo": repo, "revision": "main", "every_secs": 600}}),
        summary: format!("{repo}@main every 10m"),
    }
}

fn schedule() -> NewTrigger {
    NewTrigger {
        position: 1,
        kind: "schedule".into(),
        spec: json!({"schedule": {"cron": "0 2 * * *", "timezone": "Europe/Paris", "missed": "run-once"}}),
        summary: "cron \"0 2 * * *\" Europe/Paris, missed: run-once".into(),
    }
}

async fn register_keeps_state_of_unchanged_triggers(db: &TestDb) {
    let store = db.store().await;
    let rows = store.register_triggers("nightly", &[watch("a/b"), schedule()]).await.expect("register");
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0].position, rows[0].kind.as_str()), (0, "watch"));
    assert_eq!((rows[1].position, rows[1].kind.as_str()), (1, "schedule"));
    assert_eq!(rows[1].summary, "cron \"0 2 * * *\" Europe/Paris, missed: run-once");
    assert_eq!(rows[0].state, TriggerState::default());
    assert_eq!(rows[0].next_at, None);
    let watch_id = rows[0].id;

    let check = TriggerCheck {
        checked_at: t0(),
        next_at: Some(t0() + chrono::Duration::minutes(10)),
        last_sha: Some("a".repeat(40)),
        state: Some(TriggerState { etag: Some("x".into()), ..TriggerState::default() }),
        error: None,
    };
    assert!(store.record_trigger_check(watch_id, &check).await.expect("check"));

    // Same spec again (another server, a restart): same row, state kept.
    let again = store.register_triggers("nightly", &[watch("a/b"), schedule()]).await.expect("register again");
    assert_eq!(again[0].id, watch_id);
    assert_eq!(again[0].last_sha.as_deref(), Some("a".repeat(40).as_str()));
    assert_eq!(again[0].state.etag.as_deref(), Some("x"));
    assert_eq!(again[0].next_at, Some(t0() + chrono::Duration::minutes(10)));
    assert_eq!(again[0].last_check_at, Some(t0()));

    // A changed spec at the position starts afresh; a removed position goes away.
    let changed = store.register_triggers("nightly", &[watch("a/c")]).await.expect("register changed");
    assert_eq!(changed.len(), 1);
    assert_eq!(changed[0].id, watch_id);
    assert_eq!(changed[0].last_sha, None);
    assert_eq!(changed[0].state, TriggerState::default());
    assert_eq!(changed[0].next_at, None);
    assert_eq!(changed[0].summary, "a/c@main every 10m");

    // Other pipelines are not touched; the listing is by pipeline then position.
    store.register_triggers("alpha", &[schedule()]).await.expect("register alpha");
    let all = store.list_triggers().await.expect("list");
    let names: Vec<(&str, u32)> = all.iter().map(|t| (t.pipeline.as_str(), t.position)).collect();
    assert_eq!(names, vec![("alpha", 1), ("nightly", 0)]);
    // The record serializes for the CLI and the API.
    let v = serde_json::to_value(&all[1]).expect("json");
    assert_eq!(v["pipeline"], "nightly");
    assert_eq!(v["kind"], "watch");

    let bad = NewTrigger { kind: "cron".into(), ..schedule() };
    assert!(matches!(store.register_triggers("x", &[bad]).await, Err(StoreError::InvalidArgument(_))));
}

async fn checks_count_errors_and_keep_the_last(db: &TestDb) {
    let store = db.store().await;
    let id = store.register_triggers("p", &[watch("a/b")]).await.expect("register")[0].id;
    let fail = |n: i64, msg: &str| TriggerCheck {
        checked_at: t0() + chrono::Duration::minutes(n),
        next_at: Some(t0() + chrono::Duration::minutes(n + 1)),
        last_sha: None,
        state: None,
        error: Some(msg.to_string()),
    };
    store.record_trigger_check(id, &fail(0, "HTTP 503")).await.expect("check");
    store.record_trigger_check(id, &fail(1, "HTTP 502")).await.expect("check");
    let t = store.trigger(id).await.expect("read").expect("exists");
    assert_eq!(t.errors, 2);
    assert_eq!(t.last_error.as_deref(), Some("HTTP 502"));
    assert_eq!(t.last_error_at, Some(t0() + chrono::Duration::minutes(1)));
    assert_eq!(t.last_sha, None);

    let ok = TriggerCheck {
        checked_at: t0() + chrono::Duration::minutes(5),
        next_at: Some(t0() + chrono::Duration::minutes(15)),
        last_sha: Some("b".repeat(40)),
        state: None,
        error: None,
    };
    store.record_trigger_check(id, &ok).await.expect("check");
    let t = store.trigger(id).await.expect("read").expect("exists");
    assert_eq!(t.errors, 0);
    assert_eq!(t.last_error.as_deref(), Some("HTTP 502"), "the last error stays visible");
    assert_eq!(t.last_sha.as_deref(), Some("b".repeat(40).as_str()));
    assert_eq!(t.next_at, Some(t0() + chrono::Duration::minutes(15)));
    assert!(!store.record_trigger_check(id + 1000, &ok).await.expect("check"), "unknown trigger");
}

async fn a_firing_is_claimed_once(db: &TestDb) {
    let store = db.store().await;
    let id = store.register_triggers("p", &[watch("a/b")]).await.expect("register")[0].id;
    let key = format!("trigger:p:a/b:{}", "c".repeat(40));
    let detail = json!({"repo": "a/b", "sha": "c".repeat(40)});
    let stale = Duration::from_secs(600);
    assert_eq!(store.claim_firing(id, &key, &detail, t0(), stale).await.expect("claim"), FiringClaim::Claimed);
    assert_eq!(
        store.claim_firing(id, &key, &detail, t0(), stale).await.expect("claim"),
        FiringClaim::Taken { run: None }
    );
    let r = run(&store).await;
    store.complete_firing(id, &key, r, t0() + chrono::Duration::seconds(1)).await.expect("complete");
    // Long after, and after the claim would be stale: still taken, by that run.
    let later = t0() + chrono::Duration::days(2);
    assert_eq!(
        store.claim_firing(id, &key, &detail, later, stale).await.expect("claim"),
        FiringClaim::Taken { run: Some(r) }
    );
    let f = store.firing(&key).await.expect("firing").expect("exists");
    assert_eq!(f.run, Some(r));
    assert_eq!(f.detail, detail);
    assert_eq!(f.claimed_at, t0());
    assert_eq!(f.fired_at, Some(t0() + chrono::Duration::seconds(1)));
    let t = store.trigger(id).await.expect("read").expect("exists");
    assert_eq!(t.last_run, Some(r));
    assert_eq!(t.last_fired_at, Some(t0() + chrono::Duration::seconds(1)));
    assert_eq!(store.trigger_firings(id).await.expect("firings").len(), 1);
}

async fn concurrent_claims_have_one_winner(db: &TestDb) {
    let store = db.store_with(8).await;
    let id = store.register_triggers("p", &[watch("a/b")]).await.expect("register")[0].id;
    for round in 0..5 {
        let key = format!("trigger:p:a/b:{round}");
        let mut handles = Vec::new();
        for _ in 0..8 {
            let store = store.clone();
            let key = key.clone();
            handles.push(tokio::spawn(async move {
                store.claim_firing(id, &key, &json!({}), t0(), Duration::from_secs(600)).await
            }));
        }
        let mut claimed = 0;
        for h in handles {
            if h.await.expect("join").expect("claim") == FiringClaim::Claimed {
                claimed += 1;
            }
        }
        assert_eq!(claimed, 1, "round {round}: exactly one claim wins");
    }
}

async fn a_stale_claim_is_taken_over(db: &TestDb) {
    let store = db.store().await;
    let id = store.register_triggers("p", &[watch("a/b")]).await.expect("register")[0].id;
    let stale = Duration::from_secs(600);
    assert_eq!(store.claim_firing(id, "k", &json!({}), t0(), stale).await.expect("claim"), FiringClaim::Claimed);
    // Within the stale time: taken. After it, with no run recorded: taken over, once.
    let soon = t0() + chrono::Duration::seconds(599);
    assert_eq!(
        store.claim_firing(id, "k", &json!({}), soon, stale).await.expect("claim"),
        FiringClaim::Taken { run: None }
    );
    let late = t0() + chrono::Duration::seconds(601);
    assert_eq!(store.claim_firing(id, "k", &json!({}), late, stale).await.expect("claim"), FiringClaim::Claimed);
    assert_eq!(
        store.claim_firing(id, "k", &json!({}), late, stale).await.expect("claim"),
        FiringClaim::Taken { run: None }
    );
    assert_eq!(store.firing("k").await.expect("firing").expect("exists").claimed_at, late);
    // A released claim (its submission failed) is free at once; a completed one is not released.
    store.release_firing("k").await.expect("release");
    assert_eq!(store.firing("k").await.expect("firing"), None);
    assert_eq!(store.claim_firing(id, "k", &json!({}), late, stale).await.expect("claim"), FiringClaim::Claimed);
    let r = run(&store).await;
    store.complete_firing(id, "k", r, late).await.expect("complete");
    store.release_firing("k").await.expect("release");
    assert_eq!(store.firing("k").await.expect("firing").expect("kept").run, Some(r));
}
