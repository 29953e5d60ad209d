//! Notifications: enqueued once per finish and URL by whatever finishes a run, for the events
//! each target asked for; trigger errors once per error streak; delivery leases that two
//! claimers never share, fenced attempts, retries and give-ups.

mod common;

use std::time::Duration;

use chrono::Utc;
use common::*;
use serde_json::json;
use shardline_store::*;

shardline_testdb::on_both_databases!(
    finishing_enqueues_once_per_target_and_event,
    cancel_is_sent_only_when_asked,
    server_defaults_apply_and_share_urls_with_specs,
    servers_starting_together_replace_the_defaults_one_after_the_other,
    claims_lease_and_fence_deliveries,
    trigger_errors_notify_once_per_streak,
);

fn target(url: &str, events: &[NotifyEvent]) -> NotifyTarget {
    NotifyTarget { url: url.into(), events: events.to_vec(), format: NotifyFormat::Json }
}

const DEFAULT_EVENTS: &[NotifyEvent] = &[NotifyEvent::Failed, NotifyEvent::Succeeded];

async fn run_with(store: &Store, targets: Vec<NotifyTarget>, tasks: &[&str]) -> RunId {
    let p = pipeline(store).await;
    let (run, _) = store.create_run(NewRun { notify: targets, ..new_run(p, json!({})) }).await.expect("create_run");
    store.add_tasks(run, tasks.iter().map(|t| task(t, &[])).collect()).await.expect("add_tasks");
    run
}

async fn finishing_enqueues_once_per_target_and_event(db: &TestDb) {
    let store = db.store().await;
    let w = store.register_worker(cpu_worker("w")).await.expect("worker");
    let targets = vec![
        target("http://127.0.0.1:9/a?token=s3cret", DEFAULT_EVENTS),
        target("http://127.0.0.1:9/only-failures", &[NotifyEvent::Failed]),
    ];
    let run = run_with(&store, targets, &["a", "b"]).await;
    let a = claim_named(&store, w, "a").await;
    succeed(&store, &a).await;
    assert!(store.run_notifications(run).await.expect("list").is_empty(), "nothing before the run ends");
    let b = claim_named(&store, w, "b").await;
    succeed(&store, &b).await;
    // A repeated completion (a lost reply) changes nothing.
    store.complete(&b, Outcome::Succeeded { output: json!({}) }).await.expect("repeat");
    assert_eq!(run_state(&store, run).await, RunState::Succeeded);
    let n = store.run_notifications(run).await.expect("list");
    assert_eq!(n.len(), 1, "{n:?}");
    assert_eq!(n[0].event, NotifyEvent::Succeeded);
    assert_eq!(n[0].url, "http://127.0.0.1:9/a?token=s3cret");
    assert_eq!(n[0].state, DeliveryState::Pending);
    assert_eq!(n[0].attempts, 0);
    assert_eq!(n[0].run, Some(run));

    // A failure goes to both; a retried run that fails again is not told twice.
    let run = run_with(
        &store,
        vec![target("http://h/a", DEFAULT_EVENTS), target("http://h/f", &[NotifyEvent::Failed])],
        &["x"],
    )
    .await;
    let x = claim_named(&store, w, "x").await;
    store.complete(&x, Outcome::Failed { error: "boom".into(), retryable: false }).await.expect("fail");
    assert_eq!(run_state(&store, run).await, RunState::Failed);
    let n = store.run_notifications(run).await.expect("list");
    let urls: Vec<(&str, NotifyEvent)> = n.iter().map(|n| (n.url.as_str(), n.event)).collect();
    assert_eq!(urls, [("http://h/a", NotifyEvent::Failed), ("http://h/f", NotifyEvent::Failed)]);
    store.retry_run(run, None, "user:test").await.expect("retry");
    let x = claim_named(&store, w, "x").await;
    store.complete(&x, Outcome::Failed { error: "boom".into(), retryable: false }).await.expect("fail");
    assert_eq!(store.run_notifications(run).await.expect("list").len(), 2);
}

async fn cancel_is_sent_only_when_asked(db: &TestDb) {
    let store = db.store().await;
    let quiet = run_with(&store, vec![target("http://h/q", DEFAULT_EVENTS)], &["a"]).await;
    assert!(store.cancel_run(quiet, "user:test").await.expect("cancel"));
    assert!(store.run_notifications(quiet).await.expect("list").is_empty());
    let asked = run_with(&store, vec![target("http://h/c", &[NotifyEvent::Cancelled])], &["a"]).await;
    assert!(store.cancel_run(asked, "user:test").await.expect("cancel"));
    assert!(!store.cancel_run(asked, "user:test").await.expect("cancel again"));
    let n = store.run_notifications(asked).await.expect("list");
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].event, NotifyEvent::Cancelled);
}

async fn server_defaults_apply_and_share_urls_with_specs(db: &TestDb) {
    let store = db.store().await;
    store
        .set_default_notify_targets(&[
            target("http://h/shared", DEFAULT_EVENTS),
            target("http://h/ops", DEFAULT_EVENTS),
        ])
        .await
        .expect("defaults");
    // A restart with other defaults replaces them.
    store
        .set_default_notify_targets(&[
            target("http://h/shared", DEFAULT_EVENTS),
            NotifyTarget { format: NotifyFormat::Slack, ..target("http://h/slack", &[NotifyEvent::Cancelled]) },
        ])
        .await
        .expect("defaults");
    let run = run_with(&store, vec![target("http://h/shared", &[NotifyEvent::Cancelled])], &["a"]).await;
    store.cancel_run(run, "user:test").await.expect("cancel");
    let n = store.run_notifications(run).await.expect("list");
    let got: Vec<(&str, NotifyFormat)> = n.iter().map(|n| (n.url.as_str(), n.format)).collect();
    // One per URL: the spec's and the server's `http://h/shared` are one notification.
    assert_eq!(got, [("http://h/shared", NotifyFormat::Json), ("http://h/slack", NotifyFormat::Slack)]);
}

/// Field failure: two servers started against one database each replaced the defaults, and the
/// second failed on the first's rows (`notify_defaults_pkey`). Every replacement now succeeds and
/// the defaults are one server's whole list, never a mix.
async fn servers_starting_together_replace_the_defaults_one_after_the_other(db: &TestDb) {
    let cancelled = &[NotifyEvent::Cancelled];
    let a: Vec<NotifyTarget> = (0..3).map(|i| target(&format!("http://h/a{i}"), cancelled)).collect();
    let b = vec![target("http://h/b0", cancelled)];
    for _ in 0..12 {
        let mut servers = tokio::task::JoinSet::new();
        for i in 0..6 {
            let store = db.store().await;
            let targets = if i % 2 == 0 { a.clone() } else { b.clone() };
            servers.spawn(async move { store.set_default_notify_targets(&targets).await });
        }
        while let Some(result) = servers.join_next().await {
            result.expect("joined").expect("every server records its defaults");
        }
        let store = db.store().await;
        let run = run_with(&store, Vec::new(), &["a"]).await;
        store.cancel_run(run, "user:test").await.expect("cancel");
        let urls: Vec<String> = store.run_notifications(run).await.expect("list").into_iter().map(|n| n.url).collect();
        let whole = |t: &[NotifyTarget]| t.iter().map(|t| t.url.clone()).collect::<Vec<_>>();
        assert!(urls == whole(&a) || urls == whole(&b), "a mix of two servers' defaults: {urls:?}");
    }
}

async fn claims_lease_and_fence_deliveries(db: &TestDb) {
    let store = db.store().await;
    let run = run_with(
        &store,
        vec![target("http://h/1", &[NotifyEvent::Cancelled]), target("http://h/2", &[NotifyEvent::Cancelled])],
        &["a"],
    )
    .await;
    store.cancel_run(run, "user:test").await.expect("cancel");
    let other = db.store().await;
    // Two claimers at once: every row goes to exactly one of them.
    let (a, b) = tokio::join!(
        store.claim_notifications(10, Duration::from_secs(60)),
        other.claim_notifications(10, Duration::from_secs(60))
    );
    let (a, b) = (a.expect("claim a"), b.expect("claim b"));
    let mut ids: Vec<i64> = a.iter().chain(&b).map(|l| l.notification.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(a.len() + b.len(), 2);
    assert_eq!(ids.len(), 2, "a row was leased twice");
    assert!(
        store.claim_notifications(10, Duration::from_secs(60)).await.expect("claim").is_empty(),
        "leased rows wait"
    );

    let mut leases: Vec<NotificationLease> = a.into_iter().chain(b).collect();
    leases.sort_by_key(|l| l.notification.id);
    let first = leases.remove(0);
    let second = leases.remove(0);
    // A failed attempt with a retry goes back to pending, due after the delay.
    let failed = DeliveryOutcome::Failed {
        status: Some(500),
        error: "the receiver answered 500".into(),
        retry_in: Some(Duration::ZERO),
    };
    assert!(store.record_delivery(&first, &failed).await.expect("record"));
    // The same lease cannot record twice (a repeat after a lost reply counts once).
    assert!(!store.record_delivery(&first, &failed).await.expect("record again"));
    let again = store.claim_notifications(10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].notification.id, first.notification.id);
    assert_eq!(again[0].notification.attempts, 1);
    assert_eq!(again[0].notification.last_status, Some(500));
    assert!(again[0].token > first.token);
    // The old lease is fenced off.
    assert!(!store.record_delivery(&first, &DeliveryOutcome::Delivered { status: 200 }).await.expect("stale"));
    assert!(store.record_delivery(&again[0], &DeliveryOutcome::Delivered { status: 204 }).await.expect("record"));
    // Given up: no retry.
    let give_up =
        DeliveryOutcome::Failed { status: Some(404), error: "the receiver answered 404".into(), retry_in: None };
    assert!(store.record_delivery(&second, &give_up).await.expect("record"));

    let n = store.run_notifications(run).await.expect("list");
    assert_eq!(n[0].state, DeliveryState::Delivered);
    assert_eq!(n[0].attempts, 2);
    assert_eq!(n[0].last_status, Some(204));
    assert!(n[0].delivered_at.is_some() && n[0].last_attempt_at.is_some());
    assert_eq!(n[1].state, DeliveryState::Failed);
    assert_eq!(n[1].attempts, 1);
    assert_eq!(n[1].last_error.as_deref(), Some("the receiver answered 404"));
    assert!(store.claim_notifications(10, Duration::from_secs(60)).await.expect("claim").is_empty());

    // An expired lease is claimed again (its server died mid-request).
    let run = run_with(&store, vec![target("http://h/3", &[NotifyEvent::Cancelled])], &["a"]).await;
    store.cancel_run(run, "user:test").await.expect("cancel");
    let short = store.claim_notifications(10, Duration::from_millis(50)).await.expect("claim");
    assert_eq!(short.len(), 1);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let taken = store.claim_notifications(10, Duration::from_secs(60)).await.expect("claim");
    assert_eq!(taken.len(), 1);
    assert!(!store.record_delivery(&short[0], &DeliveryOutcome::Delivered { status: 200 }).await.expect("stale"));
    assert!(store.record_delivery(&taken[0], &DeliveryOutcome::Delivered { status: 200 }).await.expect("record"));
}

async fn trigger_errors_notify_once_per_streak(db: &TestDb) {
    let store = db.store().await;
    let t = NewTrigger { position: 0, kind: "schedule".into(), spec: json!({}), summary: "cron @hourly".into() };
    let row = store.register_triggers("nightly", &[t]).await.expect("register").remove(0);
    store
        .set_pipeline_notify_targets(
            "nightly",
            &[target("http://h/t", &[NotifyEvent::TriggerError]), target("http://h/runs", DEFAULT_EVENTS)],
        )
        .await
        .expect("targets");
    let check = |error: Option<&str>, secs: i64| TriggerCheck {
        checked_at: Utc::now() + chrono::Duration::seconds(secs),
        next_at: None,
        last_sha: None,
        state: None,
        error: error.map(str::to_string),
    };
    for (i, e) in [Some("hub down"), Some("hub down"), None, Some("bad token"), Some("bad token")].iter().enumerate() {
        store.record_trigger_check(row.id, &check(*e, i as i64)).await.expect("check");
    }
    let n = store.trigger_notifications(row.id).await.expect("list");
    assert_eq!(n.len(), 2, "one per error streak: {n:?}");
    assert!(n.iter().all(|n| n.event == NotifyEvent::TriggerError && n.url == "http://h/t" && n.run.is_none()));
    assert_eq!(n[0].detail.as_deref(), Some("nightly"));
}
