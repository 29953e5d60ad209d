//! The HTTP API's tables and listings: tokens by hash, pipelines by name, the leases held now,
//! the newest event.

mod common;

use common::*;
use shardline_store::*;

shardline_testdb::on_both_databases!(tokens_are_found_by_hash_and_revoked, listings_for_the_api);

async fn tokens_are_found_by_hash_and_revoked(db: &TestDb) {
    let store = db.store().await;
    let a = store.insert_token("ci", &"a".repeat(64), "submit").await.expect("insert");
    let b = store.insert_token("me", &"b".repeat(64), "admin").await.expect("insert");
    let found = store.token_by_hash(&"a".repeat(64)).await.expect("find").expect("token a");
    assert_eq!((found.id, found.name.as_str(), found.scope.as_str()), (a, "ci", "submit"));
    assert!(store.token_by_hash(&"c".repeat(64)).await.expect("find").is_none());
    assert!(store.insert_token("again", &"a".repeat(64), "read").await.is_err(), "a hash is stored once");
    assert!(store.revoke_token(a).await.expect("revoke"));
    assert!(!store.revoke_token(a).await.expect("revoke again"));
    assert!(store.token_by_hash(&"a".repeat(64)).await.expect("find").is_none(), "revoked");
    let listed = store.list_tokens().await.expect("list");
    assert_eq!(listed.iter().map(|t| t.id).collect::<Vec<_>>(), [a, b]);
    assert!(listed[0].revoked_at.is_some_and(|r| r >= listed[0].created_at) && listed[1].revoked_at.is_none());
}

async fn listings_for_the_api(db: &TestDb) {
    let store = db.store().await;
    assert_eq!(store.latest_event_id().await.expect("latest event"), 0);
    let first = store.upsert_pipeline("convert", "v1", "h1").await.expect("upsert");
    let newest = store.upsert_pipeline("convert", "v2", "h2").await.expect("upsert");
    store.upsert_pipeline("nightly", "n1", "n").await.expect("upsert");
    let listed = store.list_pipelines().await.expect("list");
    let names: Vec<(&str, i64, i64)> = listed.iter().map(|p| (p.name.as_str(), p.versions, p.latest_id)).collect();
    assert_eq!(names[0], ("convert", 2, newest));
    assert_eq!((names.len(), names[1].0), (2, "nightly"));
    let latest = store.latest_pipeline("convert").await.expect("latest").expect("convert");
    assert_eq!((latest.id, latest.spec_text.as_str(), latest.versions), (newest, "v2", 2));
    assert_ne!(first, newest);
    assert!(store.latest_pipeline("missing").await.expect("latest").is_none());

    let run = run(&store).await;
    store.add_tasks(run, vec![task("a", &[]), task("b", &[])]).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let lease = claim_named(&store, w, "a").await;
    let leased = store.leased_tasks().await.expect("leased");
    assert_eq!(leased.len(), 1);
    assert_eq!((leased[0].id, leased[0].run, leased[0].owner), (lease.task.id, run, w));
    assert_eq!(leased[0].resources, lease.task.resources);
    let newest_event = store.events_after(0, MAX_PAGE).await.expect("events").last().map(|e| e.id);
    assert_eq!(Some(store.latest_event_id().await.expect("latest event")), newest_event);
}
