//! The gc's decision table: every rule, each at its boundary, with the bytes it frees and keeps.

use super::*;
use chrono::TimeZone;

const DAY: Duration = Duration::from_secs(86_400);
const HOUR: Duration = Duration::from_secs(3600);

fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 28, 12, 0, 0).single().expect("time")
}

fn ago(d: Duration) -> DateTime<Utc> {
    now() - chrono::Duration::from_std(d).expect("duration")
}

fn w(p: &str) -> PathBuf {
    PathBuf::from("/w").join(p)
}

fn run_dir(name: &str, bytes: u64) -> DirInfo {
    DirInfo { path: w(&format!("runs/{name}")), bytes, modified: ago(DAY * 100), locked: false }
}

fn download(key: &str, bytes: u64, modified: DateTime<Utc>) -> DirInfo {
    DirInfo { path: w(&format!("cache/objects/{key}")), bytes, modified, locked: false }
}

fn ended(id: i64, name: &str, state: RunState, ended_ago: Duration, retention: Option<Duration>) -> RunRetention {
    RunRetention { id: RunId(id), name: name.into(), state, finished_at: Some(ago(ended_ago)), retention }
}

fn live(id: i64, state: RunState, name: Option<&str>, paths: &[PathBuf], tags: &[&str]) -> LiveRun {
    LiveRun {
        id: RunId(id),
        state,
        name: name.map(str::to_string),
        paths: paths.to_vec(),
        tags: tags.iter().map(|t| t.to_string()).collect(),
    }
}

fn row(key: &str, dir: PathBuf, uses: i64, used_ago: Duration, tags: &[&str]) -> CacheRow {
    CacheRow {
        key: key.into(),
        dir,
        uses,
        last_used: ago(used_ago),
        tags: tags.iter().map(|t| t.to_string()).collect(),
    }
}

fn policy(runs: Option<Duration>, max: Option<u64>) -> Policy {
    Policy { retain_runs: runs, cache_max: max }
}

fn find<'a>(items: &'a [Item], path: &Path) -> &'a Item {
    items.iter().find(|i| i.path == path).unwrap_or_else(|| panic!("no item for {}: {items:#?}", path.display()))
}

/// (action, bytes) of every item, by path.
fn table(items: &[Item]) -> Vec<(String, Action, u64)> {
    items.iter().map(|i| (i.path.display().to_string(), i.action, i.bytes)).collect()
}

#[test]
fn finished_runs_are_freed_beyond_the_shorter_retention_and_live_ones_never() {
    let inv = Inventory {
        runs: ["a", "b", "c", "d", "e", "f", "g", "h", "q"].iter().map(|n| run_dir(n, 100)).collect(),
        ..Inventory::default()
    };
    let facts = Facts {
        runs: vec![
            // Within the server's 30d.
            ended(1, "a", RunState::Succeeded, DAY * 29, None),
            // Exactly at it: freed.
            ended(2, "b", RunState::Succeeded, DAY * 30, None),
            // Failed and cancelled runs alike.
            ended(3, "c", RunState::Failed, DAY * 31, None),
            ended(4, "d", RunState::Cancelled, DAY * 31, None),
            // The pipeline's 7d is shorter than the server's: it applies.
            ended(5, "e", RunState::Succeeded, DAY * 8, Some(DAY * 7)),
            // The pipeline's 90d is longer: the server's 30d applies.
            ended(6, "f", RunState::Succeeded, DAY * 31, Some(DAY * 90)),
            // Running in the store though not in the live snapshot (it started since): kept.
            RunRetention {
                id: RunId(7),
                name: "g".into(),
                state: RunState::Running,
                finished_at: None,
                retention: None,
            },
            // "h" is not a run of this store; "q" is queued.
        ],
        live: vec![live(9, RunState::Queued, Some("q"), &[], &[])],
        cache: vec![],
    };
    let items = decide(&inv, &facts, &policy(Some(DAY * 30), None), now());
    assert_eq!(
        table(&items),
        [
            ("/w/runs/a".into(), Action::Keep, 100),
            ("/w/runs/b".into(), Action::Free, 100),
            ("/w/runs/c".into(), Action::Free, 100),
            ("/w/runs/d".into(), Action::Free, 100),
            ("/w/runs/e".into(), Action::Free, 100),
            ("/w/runs/f".into(), Action::Free, 100),
            ("/w/runs/g".into(), Action::Keep, 100),
            ("/w/runs/h".into(), Action::Keep, 100),
            ("/w/runs/q".into(), Action::Keep, 100),
        ]
    );
    assert_eq!(find(&items, &w("runs/a")).reason, Reason::Retained { ago: DAY * 29, retain: DAY * 30 });
    assert_eq!(find(&items, &w("runs/b")).reason, Reason::Expired { ago: DAY * 30, retain: DAY * 30 });
    assert_eq!(find(&items, &w("runs/e")).reason, Reason::Expired { ago: DAY * 8, retain: DAY * 7 });
    assert_eq!(find(&items, &w("runs/f")).reason, Reason::Expired { ago: DAY * 31, retain: DAY * 30 });
    assert_eq!(find(&items, &w("runs/g")).reason, Reason::Live { run: RunId(7), state: RunState::Running });
    assert_eq!(find(&items, &w("runs/h")).reason, Reason::NoRun);
    assert_eq!(find(&items, &w("runs/h")).kind, ItemKind::Run { run: None });
    assert_eq!(find(&items, &w("runs/q")).reason, Reason::Live { run: RunId(9), state: RunState::Queued });
}

#[test]
fn without_a_server_policy_only_a_pipeline_retention_frees_runs() {
    let inv = Inventory { runs: vec![run_dir("a", 10), run_dir("b", 20)], ..Inventory::default() };
    let facts = Facts {
        runs: vec![
            ended(1, "a", RunState::Succeeded, DAY * 365, None),
            ended(2, "b", RunState::Succeeded, HOUR * 2, Some(HOUR)),
        ],
        ..Facts::default()
    };
    let items = decide(&inv, &facts, &Policy::default(), now());
    assert_eq!(find(&items, &w("runs/a")).reason, Reason::NoRetention);
    assert_eq!(find(&items, &w("runs/a")).action, Action::Keep);
    assert_eq!(find(&items, &w("runs/b")).reason, Reason::Expired { ago: HOUR * 2, retain: HOUR });
}

#[test]
fn a_run_without_an_end_time_is_judged_by_its_directory() {
    let inv = Inventory { runs: vec![run_dir("a", 10)], ..Inventory::default() };
    let facts = Facts {
        runs: vec![RunRetention {
            id: RunId(1),
            name: "a".into(),
            state: RunState::Cancelled,
            finished_at: None,
            retention: None,
        }],
        ..Facts::default()
    };
    let items = decide(&inv, &facts, &policy(Some(DAY), None), now());
    assert_eq!(find(&items, &w("runs/a")).reason, Reason::Expired { ago: DAY * 100, retain: DAY });
}

#[test]
fn cache_entries_and_live_reads_are_cut_out_of_a_freed_run() {
    let ckpt = w("runs/old/shard/checkpoint");
    let read = w("runs/old/export/hf");
    let inner = w("runs/old/export/hf/part");
    let inv = Inventory {
        runs: vec![run_dir("old", 1000), run_dir("kept", 500)],
        downloads: vec![],
        sizes: [(ckpt.clone(), 300), (read.clone(), 200), (inner.clone(), 50), (w("runs/kept/shard/checkpoint"), 400)]
            .into_iter()
            .collect(),
    };
    let facts = Facts {
        runs: vec![
            ended(1, "old", RunState::Succeeded, DAY * 40, None),
            ended(2, "kept", RunState::Succeeded, DAY, None),
        ],
        // A running run reads the export (and something inside it) of the old run.
        live: vec![live(5, RunState::Running, Some("new"), &[read.clone(), inner.clone()], &[])],
        cache: vec![
            row("k-old", ckpt.clone(), 3, DAY * 40, &["step:aaa"]),
            row("k-kept", w("runs/kept/shard/checkpoint"), 1, DAY, &["step:bbb"]),
        ],
    };
    let items = decide(&inv, &facts, &policy(Some(DAY * 30), None), now());
    let old = find(&items, &w("runs/old"));
    assert_eq!((old.action, old.bytes), (Action::Free, 500), "1000 minus the checkpoint (300) and the export (200)");
    assert_eq!(old.except, [read.clone(), ckpt.clone()]);
    let part = find(&items, &read);
    assert_eq!((part.action, part.bytes, &part.kind), (Action::Keep, 200, &ItemKind::Part));
    assert_eq!(part.reason, Reason::Reads { run: RunId(5), state: RunState::Running });
    assert!(items.iter().all(|i| i.path != inner), "a part inside another is not an item of its own");
    let cache = find(&items, &ckpt);
    assert_eq!((cache.action, cache.bytes, cache.reason.clone()), (Action::Keep, 300, Reason::NoCacheMax));
    // A kept run's own bytes leave out the cache entry inside it; no part is cut out of it.
    let kept = find(&items, &w("runs/kept"));
    assert_eq!(
        (kept.action, kept.bytes, kept.except.clone()),
        (Action::Keep, 100, vec![w("runs/kept/shard/checkpoint")])
    );
    let freed: u64 = items.iter().filter(|i| i.action == Action::Free).map(|i| i.bytes).sum();
    let kept: u64 = items.iter().filter(|i| i.action == Action::Keep).map(|i| i.bytes).sum();
    assert_eq!((freed, kept), (500, 200 + 300 + 100 + 400), "every byte counted once");
}

#[test]
fn the_least_recently_used_unprotected_entries_go_until_the_cache_fits() {
    let inv = Inventory {
        runs: vec![],
        downloads: vec![
            download("k-url", 400, ago(DAY)),
            download("orphan", 100, ago(DAY * 9)),
            download("fresh.partial", 50, ago(HOUR)),
        ],
        sizes: [
            (w("runs/r1/shard/checkpoint"), 300),
            (w("runs/r2/shard/checkpoint"), 200),
            (w("runs/r3/s/checkpoint"), 250),
        ]
        .into_iter()
        .collect(),
    };
    let facts = Facts {
        runs: vec![],
        live: vec![
            // A queued run will hit the URL's downloads and step bbb's entries.
            live(8, RunState::Queued, Some("q"), &[], &["url:s3://b/m", "step:bbb"]),
        ],
        cache: vec![
            row("k1", w("runs/r1/shard/checkpoint"), 1, DAY * 10, &["step:aaa"]),
            row("k2", w("runs/r2/shard/checkpoint"), 4, DAY * 20, &["step:bbb"]),
            row("k3", w("runs/r3/s/checkpoint"), 2, DAY * 5, &["step:ccc"]),
            row("k-url", w("cache/objects/k-url"), 1, DAY * 30, &["url:s3://b/m"]),
            // Its directory is not here (another host's): no item, its row untouched.
            row("k-gone", w("runs/gone/shard/checkpoint"), 1, DAY * 50, &[]),
        ],
    };
    // 1300 bytes in all; 700 allowed. Protected: k2 (200) and k-url (400). Oldest first among
    // the rest: k1 (10d, 300) → 1000 left, still over; orphan (9d, 100) → 900, over; k3 (5d,
    // 250) → 650, which fits: the fresh partial (1h) is kept.
    let items = decide(&inv, &facts, &policy(None, Some(700)), now());
    assert_eq!(
        table(&items),
        [
            ("/w/cache/objects/fresh.partial".into(), Action::Keep, 50),
            ("/w/cache/objects/k-url".into(), Action::Keep, 400),
            ("/w/cache/objects/orphan".into(), Action::Free, 100),
            ("/w/runs/r1/shard/checkpoint".into(), Action::Free, 300),
            ("/w/runs/r2/shard/checkpoint".into(), Action::Keep, 200),
            ("/w/runs/r3/s/checkpoint".into(), Action::Free, 250),
        ]
    );
    let url = find(&items, &w("cache/objects/k-url"));
    assert_eq!(url.reason, Reason::MayHit { run: RunId(8), state: RunState::Queued, tag: "url:s3://b/m".into() });
    assert_eq!(url.kind, ItemKind::Cache { keys: vec![("k-url".into(), 1)], download: true });
    assert_eq!(find(&items, &w("runs/r1/shard/checkpoint")).reason, Reason::OverBudget { max: 700, ago: DAY * 10 });
    assert_eq!(find(&items, &w("cache/objects/orphan")).kind, ItemKind::Download { partial: false });
    let fresh = find(&items, &w("cache/objects/fresh.partial"));
    assert_eq!(
        (fresh.kind.clone(), fresh.reason.clone()),
        (ItemKind::Download { partial: true }, Reason::WithinBudget { max: 700 })
    );
}

#[test]
fn a_cache_exactly_at_its_limit_keeps_everything() {
    let inv = Inventory {
        downloads: vec![download("a", 300, ago(DAY)), download("b", 200, ago(DAY * 2))],
        ..Inventory::default()
    };
    let items = decide(&inv, &Facts::default(), &policy(None, Some(500)), now());
    assert!(items.iter().all(|i| i.action == Action::Keep && i.reason == Reason::WithinBudget { max: 500 }));
    let items = decide(&inv, &Facts::default(), &policy(None, Some(499)), now());
    assert_eq!(
        table(&items),
        [("/w/cache/objects/a".into(), Action::Keep, 300), ("/w/cache/objects/b".into(), Action::Free, 200)]
    );
    let items = decide(&inv, &Facts::default(), &policy(None, Some(0)), now());
    assert!(items.iter().all(|i| i.action == Action::Free), "a zero limit frees every unprotected entry");
}

#[test]
fn what_a_live_run_reads_or_downloads_is_never_freed_even_over_the_limit() {
    let ckpt = w("runs/a/shard/checkpoint");
    let inv = Inventory {
        downloads: vec![
            DirInfo { locked: true, ..download("busy.partial", 70, ago(DAY * 90)) },
            download("read-by-running", 30, ago(DAY * 90)),
        ],
        sizes: [(ckpt.clone(), 500)].into_iter().collect(),
        ..Inventory::default()
    };
    let facts = Facts {
        live: vec![
            // Served from the cache: its plan's output names the checkpoint.
            live(
                3,
                RunState::Running,
                Some("r"),
                &[ckpt.join("__0_0.distcp"), w("cache/objects/read-by-running")],
                &[],
            ),
        ],
        cache: vec![row("k", ckpt.clone(), 1, DAY * 90, &["step:old"])],
        ..Facts::default()
    };
    let items = decide(&inv, &facts, &policy(None, Some(0)), now());
    assert!(items.iter().all(|i| i.action == Action::Keep), "{items:#?}");
    assert_eq!(find(&items, &ckpt).reason, Reason::Reads { run: RunId(3), state: RunState::Running });
    assert_eq!(find(&items, &w("cache/objects/busy.partial")).reason, Reason::Downloading);
    assert_eq!(
        find(&items, &w("cache/objects/read-by-running")).reason,
        Reason::Reads { run: RunId(3), state: RunState::Running }
    );
}

#[test]
fn tags_of_finished_runs_protect_nothing_and_the_oldest_live_run_is_named() {
    let inv = Inventory { sizes: [(w("runs/a/s/checkpoint"), 10)].into_iter().collect(), ..Inventory::default() };
    let facts = Facts {
        live: vec![
            live(12, RunState::Running, None, &[], &["step:x"]),
            live(4, RunState::Queued, None, &[], &["step:x"]),
        ],
        cache: vec![row("k", w("runs/a/s/checkpoint"), 1, DAY, &["step:x"])],
        ..Facts::default()
    };
    let items = decide(&inv, &facts, &policy(None, Some(0)), now());
    assert_eq!(items[0].reason, Reason::MayHit { run: RunId(4), state: RunState::Queued, tag: "step:x".into() });
    let facts = Facts { live: vec![], ..facts };
    let items = decide(&inv, &facts, &policy(None, Some(0)), now());
    assert_eq!(items[0].action, Action::Free);
}

#[test]
fn rows_naming_one_directory_are_one_item_used_when_the_latest_was() {
    let dir = w("cache/objects/k");
    let inv = Inventory {
        downloads: vec![download("k", 80, ago(DAY * 3)), download("j", 80, ago(DAY * 2))],
        ..Inventory::default()
    };
    let facts = Facts {
        cache: vec![row("a", dir.clone(), 2, DAY * 9, &[]), row("b", dir.clone(), 5, HOUR, &[])],
        ..Facts::default()
    };
    let items = decide(&inv, &facts, &policy(None, Some(100)), now());
    let k = find(&items, &dir);
    assert_eq!(k.kind, ItemKind::Cache { keys: vec![("a".into(), 2), ("b".into(), 5)], download: true });
    assert_eq!(k.last_used, Some(ago(HOUR)));
    assert_eq!(k.action, Action::Keep, "used an hour ago: the download without a row (2 days) goes first");
    assert_eq!(find(&items, &w("cache/objects/j")).action, Action::Free);
}

#[test]
fn equally_old_entries_go_in_path_order_and_reasons_read_well() {
    let inv =
        Inventory { downloads: vec![download("b", 10, ago(DAY)), download("a", 10, ago(DAY))], ..Inventory::default() };
    let items = decide(&inv, &Facts::default(), &policy(None, Some(10)), now());
    assert_eq!(
        table(&items),
        [("/w/cache/objects/a".into(), Action::Free, 10), ("/w/cache/objects/b".into(), Action::Keep, 10)]
    );
    assert_eq!(items[0].reason.to_string(), "least recently used (1d 0h ago), cache over 10B");
    assert_eq!(
        Reason::Expired { ago: DAY * 31, retain: DAY * 30 }.to_string(),
        "ended 31d 0h ago, beyond its 30d retention"
    );
    let hit = Reason::MayHit { run: RunId(7), state: RunState::Queued, tag: format!("step:{}", "f".repeat(64)) };
    assert_eq!(hit.to_string(), "queued run 7 may hit it (step ffffffffffff)");
}
