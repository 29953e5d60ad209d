//! The poller against the local Hub server and a real store (SQLite and PostgreSQL), with a
//! controllable clock: a new sha fires one run, an unchanged sha none, a restart none, two
//! servers one between them; schedules catch up per their policy; author watches pick up new
//! matching repositories only; Hub errors back off.

mod common;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use common::TestDb;
use shardline_hub::fake::{FakeFile, FakeHub, Fault, FaultKind, FaultTarget, RequestKind};
use shardline_hub::{HubClient, RetryPolicy};
use shardline_store::{Page, RunFilter, RunRow, Store};
use shardline_triggers::{ManualClock, PipelineSource, Poller, PollerOptions};

shardline_testdb::on_both_databases!(
    a_new_sha_fires_one_run_an_unchanged_sha_none,
    a_restarted_server_fires_nothing_again,
    two_servers_start_one_run_between_them,
    missed_nightly_runs_follow_the_policy,
    author_watch_picks_up_new_matching_repos_only,
    hub_errors_back_off_then_recover,
    a_firing_outside_the_path_policy_is_refused_at_its_line,
);

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 4, 1, 12, 0, 0).single().expect("valid time")
}

const MIN: Duration = Duration::from_secs(60);

fn spec(name: &str, trigger: &str) -> String {
    format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: {name}
params:
  repo: {{type: string, default: none}}
  sha: {{type: string, default: none}}
triggers:
{trigger}
steps:
  - id: download
    uses: hf.download
    with: {{path: "/models/${{{{ params.repo }}}}/${{{{ params.sha }}}}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: 1, dp: 1}}
"#
    )
}

const WATCH: &str = r#"  - watch: {repo: acme/tiny, every: 10m}
    params: {repo: "${{ trigger.repo }}", sha: "${{ trigger.sha }}"}"#;

fn source(name: &str, trigger: &str) -> PipelineSource {
    let text = spec(name, trigger);
    PipelineSource::parse(&format!("{name}.yaml"), &text, std::path::Path::new("/"))
        .unwrap_or_else(|e| panic!("spec does not lint: {e}"))
}

struct Env {
    hub: FakeHub,
    clock: ManualClock,
    work: tempfile::TempDir,
}

impl Env {
    async fn new() -> Env {
        Env {
            hub: FakeHub::start().await.expect("fake hub"),
            clock: ManualClock::new(t0()),
            work: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn poller(&self, store: Store, pipelines: Vec<PipelineSource>) -> Poller {
        self.poller_with(store, pipelines, None)
    }

    fn poller_with(
        &self,
        store: Store,
        pipelines: Vec<PipelineSource>,
        policy: Option<shardline_spec::policy::PathPolicy>,
    ) -> Poller {
        let client = HubClient::new(self.hub.endpoint(), None).expect("client").with_retry_policy(RetryPolicy {
            max_attempts: 1,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
            max_retry_after: Duration::from_millis(1),
        });
        Poller::new(
            store,
            client,
            Arc::new(self.clock.clone()),
            pipelines,
            PollerOptions { policy: policy.map(Arc::new), ..PollerOptions::new("/", self.work.path().join("work")) },
        )
    }

    fn publish(&self, repo: &str, content: &str) -> String {
        self.hub.publish(repo, vec![FakeFile::new("config.json", content.as_bytes().to_vec())]).expect("publish")
    }
}

async fn runs(store: &Store, pipeline: &str) -> Vec<RunRow> {
    let filter = RunFilter { pipeline: Some(pipeline.into()), ..RunFilter::default() };
    let mut runs = store.list_runs(&filter, Page { limit: 500, before: None }).await.expect("list runs").runs;
    runs.reverse();
    runs
}

async fn a_new_sha_fires_one_run_an_unchanged_sha_none(db: &TestDb) {
    let env = Env::new().await;
    let store = db.store().await;
    let sha1 = env.publish("acme/tiny", "{\"v\": 1}");
    let poller = env.poller(store.clone(), vec![source("watched", WATCH)]);

    // First sight of the repository: one run, told the repo and the sha.
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.errors, vec![]);
    assert_eq!(r.checked, 1);
    assert_eq!(r.fired.len(), 1);
    assert_eq!(r.fired[0].sha.as_deref(), Some(sha1.as_str()));
    assert_eq!(r.fired[0].dedupe_key, format!("trigger/watched/acme/tiny@{sha1}"));
    assert_eq!(r.next_due, Some(t0() + chrono::Duration::minutes(10)));
    let all = runs(&store, "watched").await;
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].params["repo"], "acme/tiny");
    assert_eq!(all[0].params["sha"], sha1.as_str());
    assert_eq!(all[0].dedupe_key.as_deref(), Some(format!("trigger/watched/acme/tiny@{sha1}").as_str()));
    assert!(store.run_tasks(all[0].id).await.expect("tasks").len() >= 2, "the run has its task graph");

    // Not due before `every`: no request at all.
    env.hub.clear_requests();
    env.clock.advance(5 * MIN);
    let r = poller.tick().await.expect("tick");
    assert_eq!((r.checked, r.fired.len()), (0, 0));
    assert!(env.hub.requests().is_empty());

    // Due, unchanged: a conditional request answered 304, no run.
    env.clock.advance(5 * MIN);
    let r = poller.tick().await.expect("tick");
    assert_eq!((r.checked, r.fired.len()), (1, 0));
    let reqs: Vec<_> = env.hub.requests().into_iter().filter(|q| q.kind == RequestKind::Revision).collect();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].if_none_match.as_deref(), Some(format!("\"{sha1}\"").as_str()));
    assert_eq!(reqs[0].status, 304);
    assert_eq!(runs(&store, "watched").await.len(), 1);

    // A new commit: exactly one more run, for it.
    let sha2 = env.publish("acme/tiny", "{\"v\": 2}");
    env.clock.advance(10 * MIN);
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.fired.len(), 1);
    assert_eq!(r.fired[0].sha.as_deref(), Some(sha2.as_str()));
    let all = runs(&store, "watched").await;
    assert_eq!(all.len(), 2);
    assert_eq!(all[1].params["sha"], sha2.as_str());

    // The listing shows it.
    let t = store.list_triggers().await.expect("list");
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].kind, "watch");
    assert_eq!(t[0].summary, "acme/tiny@main every 10m");
    assert_eq!(t[0].last_sha.as_deref(), Some(sha2.as_str()));
    assert_eq!(t[0].last_run, Some(all[1].id));
    assert_eq!(t[0].last_fired_at, Some(t0() + chrono::Duration::minutes(20)));
    assert_eq!(t[0].next_at, Some(t0() + chrono::Duration::minutes(30)));
    assert_eq!(t[0].errors, 0);
}

async fn a_restarted_server_fires_nothing_again(db: &TestDb) {
    let env = Env::new().await;
    let sha = env.publish("acme/tiny", "{}");
    {
        let store = db.store().await;
        let first = env.poller(store.clone(), vec![source("watched", WATCH)]);
        assert_eq!(first.tick().await.expect("tick").fired.len(), 1);
        store.close().await;
    }
    // A new process: new connection, new poller, same store.
    let store = db.store().await;
    let second = env.poller(store.clone(), vec![source("watched", WATCH)]);
    env.clock.advance(10 * MIN);
    let r = second.tick().await.expect("tick");
    assert_eq!((r.checked, r.fired.len()), (1, 0));
    assert_eq!(runs(&store, "watched").await.len(), 1);

    // Even with its state lost (a changed spec starts the trigger afresh, so the sha looks
    // new), the firing's dedupe key keeps it from starting a second run for that sha.
    let changed = r#"  - watch: {repo: acme/tiny, every: 20m}
    params: {repo: "${{ trigger.repo }}", sha: "${{ trigger.sha }}"}"#;
    let third = env.poller(store.clone(), vec![source("watched", changed)]);
    third.register().await.expect("register");
    assert_eq!(store.list_triggers().await.expect("list")[0].last_sha, None, "state was reset");
    let r = third.tick().await.expect("tick");
    assert_eq!((r.checked, r.fired.len()), (1, 0));
    assert_eq!(runs(&store, "watched").await.len(), 1);
    let t = store.list_triggers().await.expect("list");
    assert_eq!(t[0].last_sha.as_deref(), Some(sha.as_str()), "the sha is known again");
}

async fn two_servers_start_one_run_between_them(db: &TestDb) {
    let env = Env::new().await;
    let a = Arc::new(env.poller(db.store().await, vec![source("watched", WATCH)]));
    let b = Arc::new(env.poller(db.store().await, vec![source("watched", WATCH)]));
    let store = db.store().await;
    for round in 1..=4 {
        let sha = env.publish("acme/tiny", &format!("{{\"round\": {round}}}"));
        // Both servers poll the same repository at the same moment.
        let (ra, rb) = tokio::join!(
            tokio::spawn({
                let a = a.clone();
                async move { a.tick().await }
            }),
            tokio::spawn({
                let b = b.clone();
                async move { b.tick().await }
            })
        );
        let (ra, rb) = (ra.expect("join").expect("tick a"), rb.expect("join").expect("tick b"));
        assert_eq!(ra.errors, vec![]);
        assert_eq!(rb.errors, vec![]);
        assert_eq!(ra.fired.len() + rb.fired.len(), 1, "round {round}: one run between the two servers");
        let all = runs(&store, "watched").await;
        assert_eq!(all.len(), round, "round {round}");
        assert_eq!(all[round - 1].params["sha"], sha.as_str());
        env.clock.advance(10 * MIN);
        // Polling again, unchanged: nothing from either.
        let (ra, rb) = tokio::join!(a.tick(), b.tick());
        assert_eq!(ra.expect("tick a").fired.len() + rb.expect("tick b").fired.len(), 0);
        env.clock.advance(10 * MIN);
    }
    assert_eq!(runs(&store, "watched").await.len(), 4);
}

async fn missed_nightly_runs_follow_the_policy(db: &TestDb) {
    let env = Env::new().await;
    let store = db.store().await;
    let once = source("nightly-once", r#"  - schedule: {cron: "0 2 * * *", timezone: Europe/Paris, missed: run-once}"#);
    let skip = source("nightly-skip", r#"  - schedule: {cron: "0 2 * * *", timezone: Europe/Paris, missed: skip}"#);
    let poller = env.poller(store.clone(), vec![once, skip]);

    // Registered at noon: the first instant is Apr 2, 02:00 Paris (00:00 UTC); nothing owed.
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.fired.len(), 0);
    let t = store.list_triggers().await.expect("list");
    assert!(t.iter().all(|t| t.next_at == Some(Utc.with_ymd_and_hms(2026, 4, 2, 0, 0, 0).unwrap())));

    // On time: both fire once.
    env.clock.set(Utc.with_ymd_and_hms(2026, 4, 2, 0, 1, 0).unwrap());
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.fired.len(), 2);
    assert!(r.fired.iter().all(|f| !f.late && f.instant == Some(Utc.with_ymd_and_hms(2026, 4, 2, 0, 0, 0).unwrap())));

    // Down until Apr 5, 12:00 Paris: Apr 3, 4 and 5 were missed. run-once: one catch-up run
    // (for Apr 5); skip: none.
    env.clock.set(Utc.with_ymd_and_hms(2026, 4, 5, 10, 0, 0).unwrap());
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.fired.len(), 1);
    assert_eq!(r.fired[0].pipeline, "nightly-once");
    assert!(r.fired[0].late);
    assert_eq!(r.fired[0].instant, Some(Utc.with_ymd_and_hms(2026, 4, 5, 0, 0, 0).unwrap()));
    assert_eq!(r.fired[0].dedupe_key, "trigger/nightly-once/schedule@2026-04-05T00:00:00Z");
    // Nothing more until the next instant.
    assert_eq!(poller.tick().await.expect("tick").fired.len(), 0);
    env.clock.set(Utc.with_ymd_and_hms(2026, 4, 6, 0, 2, 0).unwrap());
    assert_eq!(poller.tick().await.expect("tick").fired.len(), 2);

    assert_eq!(runs(&store, "nightly-once").await.len(), 3);
    assert_eq!(runs(&store, "nightly-skip").await.len(), 2);
    let t = store.list_triggers().await.expect("list");
    assert_eq!(t[0].next_at, Some(Utc.with_ymd_and_hms(2026, 4, 7, 0, 0, 0).unwrap()));
    assert_eq!(t[0].last_fired_at, Some(Utc.with_ymd_and_hms(2026, 4, 6, 0, 2, 0).unwrap()));
}

async fn author_watch_picks_up_new_matching_repos_only(db: &TestDb) {
    let env = Env::new().await;
    let store = db.store().await;
    env.publish("Qwen/Qwen3-A", "a1");
    env.publish("Qwen/Qwen2-B", "b1");
    let trigger = r#"  - watch: {author: Qwen, name: "Qwen3-*", every: 30m}
    params: {repo: "${{ trigger.repo }}", sha: "${{ trigger.sha }}"}"#;
    let poller = env.poller(store.clone(), vec![source("family", trigger)]);

    // The first listing is a baseline.
    let r = poller.tick().await.expect("tick");
    assert_eq!((r.checked, r.fired.len()), (1, 0));
    assert!(env.hub.requests().iter().any(|q| q.kind == RequestKind::ListModels && q.uri.contains("author=Qwen")));

    // A new matching repository fires; a new non-matching one, and another author's, do not.
    let c = env.publish("Qwen/Qwen3-C", "c1");
    env.publish("Qwen/Qwen2-D", "d1");
    env.publish("other/Qwen3-E", "e1");
    env.clock.advance(30 * MIN);
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.errors, vec![]);
    let fired: Vec<(Option<String>, Option<String>)> =
        r.fired.iter().map(|f| (f.repo.clone(), f.sha.clone())).collect();
    assert_eq!(fired, vec![(Some("Qwen/Qwen3-C".to_string()), Some(c.clone()))]);

    // A new commit in a matching repository fires; one in a non-matching repository does not.
    let a2 = env.publish("Qwen/Qwen3-A", "a2");
    env.publish("Qwen/Qwen2-B", "b2");
    env.clock.advance(30 * MIN);
    let r = poller.tick().await.expect("tick");
    let fired: Vec<Option<String>> = r.fired.iter().map(|f| f.repo.clone()).collect();
    assert_eq!(fired, vec![Some("Qwen/Qwen3-A".to_string())]);
    assert_eq!(r.fired[0].sha.as_deref(), Some(a2.as_str()));

    // Unchanged: a conditional listing answered 304, nothing fired.
    env.hub.clear_requests();
    env.clock.advance(30 * MIN);
    let r = poller.tick().await.expect("tick");
    assert_eq!((r.checked, r.fired.len()), (1, 0));
    let lists: Vec<_> = env.hub.requests().into_iter().filter(|q| q.kind == RequestKind::ListModels).collect();
    assert_eq!(lists.len(), 1);
    assert!(lists[0].if_none_match.is_some());
    assert_eq!(lists[0].status, 304);
    let all = runs(&store, "family").await;
    let repos: Vec<&str> = all.iter().map(|r| r.params["repo"].as_str().unwrap_or("")).collect();
    assert_eq!(repos, vec!["Qwen/Qwen3-C", "Qwen/Qwen3-A"]);
}

async fn hub_errors_back_off_then_recover(db: &TestDb) {
    let env = Env::new().await;
    let store = db.store().await;
    let sha = env.publish("acme/tiny", "{}");
    let poller = env.poller(store.clone(), vec![source("watched", WATCH)]);
    env.hub.inject(Fault::new(FaultTarget::Api, FaultKind::ServerError));

    let r = poller.tick().await.expect("tick");
    assert_eq!(r.fired.len(), 0);
    assert_eq!(r.errors.len(), 1);
    assert!(r.errors[0].1.contains("HTTP 500"), "{:?}", r.errors);
    let t = &store.list_triggers().await.expect("list")[0];
    assert_eq!(t.errors, 1);
    assert!(t.last_error.as_deref().is_some_and(|e| e.contains("HTTP 500")));
    // First retry after 15–30 s (30 s with jitter), well before `every`.
    let next = t.next_at.expect("next");
    assert!(next >= t0() + chrono::Duration::seconds(15) && next <= t0() + chrono::Duration::seconds(30), "{next}");

    // Failing again: the wait doubles.
    env.clock.set(next);
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.errors.len(), 1);
    let t = &store.list_triggers().await.expect("list")[0];
    assert_eq!(t.errors, 2);
    let wait = t.next_at.expect("next") - next;
    assert!(wait >= chrono::Duration::seconds(30) && wait <= chrono::Duration::seconds(60), "{wait}");

    // Not due in between: no request.
    env.hub.clear_faults();
    env.hub.clear_requests();
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.checked, 0);
    assert!(env.hub.requests().is_empty());

    // Recovered: fires, and the error count resets (the last error stays visible).
    env.clock.set(t.next_at.expect("next"));
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.fired.len(), 1);
    assert_eq!(r.fired[0].sha.as_deref(), Some(sha.as_str()));
    let t = &store.list_triggers().await.expect("list")[0];
    assert_eq!(t.errors, 0);
    assert!(t.last_error.is_some());
}

/// A server's path policy holds for what its triggers fire: a spec whose resolved source is
/// outside the roots gets no run, and the check's error names the line; one inside gets its run.
async fn a_firing_outside_the_path_policy_is_refused_at_its_line(db: &TestDb) {
    let env = Env::new().await;
    let store = db.store().await;
    env.publish("acme/tiny", "{}");
    let policy = shardline_control::policy::policy_from_flags(&["/models/acme".into()], &[], false).expect("policy");
    let escaping =
        spec("escaping", WATCH).replace("/models/${{ params.repo }}", "/models/${{ params.repo }}/../../etc");
    let escaping = PipelineSource::parse("escaping.yaml", &escaping, std::path::Path::new("/")).expect("lints");
    let poller = env.poller_with(store.clone(), vec![source("watched", WATCH), escaping], Some(policy));
    let r = poller.tick().await.expect("tick");
    assert_eq!(r.fired.iter().map(|f| f.pipeline.as_str()).collect::<Vec<_>>(), ["watched"]);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    let (_, error) = &r.errors[0];
    assert!(error.contains("escaping.yaml:13:18"), "the error names the spec's line: {error}");
    assert!(error.contains("`..` is not allowed in a path"), "{error}");
    assert!(runs(&store, "escaping").await.is_empty());
    assert_eq!(runs(&store, "watched").await.len(), 1);
}
