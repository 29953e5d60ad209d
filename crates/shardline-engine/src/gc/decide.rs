//! The gc's decisions, pure: from what a work directory holds (measured), what the store says
//! (runs, live runs, step cache rows), the policy and the time, to one decision per directory —
//! free it or keep it, with the reason and the bytes. No I/O: the shell measures and deletes.
//!
//! The rules, in the order they apply:
//! 1. Whatever a queued or running run reads is kept: its own work directory, every directory
//!    its tasks' payloads and outputs name (a download's directory, a checkpoint served from the
//!    cache), and every step cache entry one of its tasks may hit before it knows the key — an
//!    entry tagged with the step hash, object-store URL or Hub repository of one of its tasks.
//!    An object-store download whose lock is held (a download in progress) is kept.
//! 2. A finished run's work directory is freed once it ended longer ago than its retention: the
//!    shorter of the server's `--retain-runs` and the run's own `retention.runs` (neither: kept
//!    for ever). Step cache entries inside it and directories a live run reads are cut out of it
//!    and judged on their own. A directory no run of the store is named after is kept.
//! 3. Step cache entries and object-store downloads are one cache per work directory, bounded
//!    by `--cache-max`: beyond it, the least recently used unprotected ones are freed (last hit
//!    or write for an entry, modification time for a download without a row) until the rest fit.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, Utc};
use shardline_store::{RunId, RunRetention, RunState};
use shardline_units::{format_duration, format_duration_human, format_size};

/// What the server keeps (see `shardline_store::RetentionPolicy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    pub retain_runs: Option<Duration>,
    pub cache_max: Option<u64>,
}

/// A directory as measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirInfo {
    pub path: PathBuf,
    /// Apparent bytes of its regular files.
    pub bytes: u64,
    pub modified: DateTime<Utc>,
    /// An object-store download whose lock another process holds (downloading it now).
    pub locked: bool,
}

/// What a work directory holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    /// `<work>/runs/*`.
    pub runs: Vec<DirInfo>,
    /// `<work>/cache/objects/*`: complete downloads (`<key>`) and partial ones (`<key>.partial`).
    pub downloads: Vec<DirInfo>,
    /// Bytes of the other directories that exist and matter: step cache entries' directories
    /// and directories live runs read.
    pub sizes: BTreeMap<PathBuf, u64>,
}

/// A queued or running run: its name (its work directory), the directories it reads and the
/// tags of the cache entries it may hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRun {
    pub id: RunId,
    pub state: RunState,
    pub name: Option<String>,
    pub paths: Vec<PathBuf>,
    pub tags: BTreeSet<String>,
}

/// A step cache row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheRow {
    pub key: String,
    pub dir: PathBuf,
    pub uses: i64,
    pub last_used: DateTime<Utc>,
    pub tags: Vec<String>,
}

/// What the store says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// The runs the work directory has directories of, by name.
    pub runs: Vec<RunRetention>,
    pub live: Vec<LiveRun>,
    pub cache: Vec<CacheRow>,
}

/// What an item is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemKind {
    /// A run's work directory (`None`: no run of the store has its name).
    Run { run: Option<RunId> },
    /// A step cache entry's directory, with each row naming it and the uses the gc saw;
    /// `download`: an object-store download's directory (deleted under its lock).
    Cache { keys: Vec<(String, i64)>, download: bool },
    /// An object-store download no row names.
    Download { partial: bool },
    /// A directory inside a freed run's directory that a live run reads: cut out, kept.
    Part,
}

impl ItemKind {
    pub fn label(&self) -> &'static str {
        match self {
            ItemKind::Run { .. } => "run",
            ItemKind::Cache { .. } => "cache",
            ItemKind::Download { partial: false } => "download",
            ItemKind::Download { partial: true } => "partial",
            ItemKind::Part => "part",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Free,
    Keep,
}

/// Why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// The run of this work directory is queued or running.
    Live { run: RunId, state: RunState },
    /// A live run's task reads it (its payload or output names it).
    Reads { run: RunId, state: RunState },
    /// A live run's task may hit it (same step hash, URL or repository).
    MayHit { run: RunId, state: RunState, tag: String },
    /// Its object-store download is in progress (the lock is held).
    Downloading,
    /// No run of this store is named after it.
    NoRun,
    /// No retention applies (no `--retain-runs`, no `retention.runs`).
    NoRetention,
    /// Ended `ago`, kept for `retain`.
    Retained { ago: Duration, retain: Duration },
    /// Ended `ago`, beyond its `retain`.
    Expired { ago: Duration, retain: Duration },
    /// No `--cache-max`.
    NoCacheMax,
    /// The cache fits `max` with it.
    WithinBudget { max: u64 },
    /// Least recently used (`ago`) while the cache is over `max`.
    OverBudget { max: u64, ago: Duration },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let human = |d: &Duration| age(*d);
        match self {
            Reason::Live { run, state } => write!(f, "run {run} is {state}"),
            Reason::Reads { run, state } => write!(f, "{state} run {run} reads it"),
            Reason::MayHit { run, state, tag } => write!(f, "{state} run {run} may hit it ({})", short_tag(tag)),
            Reason::Downloading => write!(f, "a download is filling it"),
            Reason::NoRun => write!(f, "no run of this store has this name"),
            Reason::NoRetention => write!(f, "no retention (--retain-runs or retention.runs) applies"),
            Reason::Retained { ago, retain } => {
                write!(f, "ended {} ago, kept for {}", human(ago), format_duration(*retain))
            }
            Reason::Expired { ago, retain } => {
                write!(f, "ended {} ago, beyond its {} retention", human(ago), format_duration(*retain))
            }
            Reason::NoCacheMax => write!(f, "no --cache-max"),
            Reason::WithinBudget { max } => write!(f, "the cache fits {} with it", format_size(*max)),
            Reason::OverBudget { max, ago } => {
                write!(f, "least recently used ({} ago), cache over {}", human(ago), format_size(*max))
            }
        }
    }
}

/// A duration rounded for a reason: days and hours beyond a day (`31d 4h`), else as messages
/// spell it (`2h 5m`).
fn age(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 86_400 {
        format!("{}d {}h", secs / 86_400, (secs % 86_400) / 3600)
    } else {
        format_duration_human(d)
    }
}

/// A tag, with a step hash cut short.
fn short_tag(tag: &str) -> String {
    match tag.strip_prefix("step:") {
        Some(hash) => format!("step {}", hash.chars().take(12).collect::<String>()),
        None => tag.replacen(':', " ", 1),
    }
}

/// One decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub path: PathBuf,
    pub kind: ItemKind,
    /// Its own bytes: a run's directory without the items cut out of it (`except`).
    pub bytes: u64,
    pub action: Action,
    pub reason: Reason,
    /// Directories inside it that are items of their own (cache entries, parts a live run reads):
    /// never deleted with it.
    pub except: Vec<PathBuf>,
    /// When it was last used (a cache entry or download).
    pub last_used: Option<DateTime<Utc>>,
}

/// `a` is `b` or inside it.
fn within(a: &Path, b: &Path) -> bool {
    a.starts_with(b)
}

fn since(now: DateTime<Utc>, then: DateTime<Utc>) -> Duration {
    (now - then).to_std().unwrap_or_default()
}

/// The live runs' protections, looked up by path and by tag.
struct Protection<'a> {
    by_name: BTreeMap<&'a str, &'a LiveRun>,
    paths: Vec<(&'a Path, &'a LiveRun)>,
    tags: BTreeMap<&'a str, &'a LiveRun>,
}

impl<'a> Protection<'a> {
    fn new(live: &'a [LiveRun]) -> Protection<'a> {
        let mut p = Protection { by_name: BTreeMap::new(), paths: Vec::new(), tags: BTreeMap::new() };
        // Lowest run id first, so that the reason names the oldest live run.
        let mut runs: Vec<&LiveRun> = live.iter().collect();
        runs.sort_by_key(|r| r.id);
        for r in runs {
            if let Some(n) = &r.name {
                p.by_name.entry(n.as_str()).or_insert(r);
            }
            p.paths.extend(r.paths.iter().map(|path| (path.as_path(), r)));
            for t in &r.tags {
                p.tags.entry(t.as_str()).or_insert(r);
            }
        }
        p
    }

    /// A live run reads `dir`, something inside it, or a directory it is inside of.
    fn reader(&self, dir: &Path) -> Option<Reason> {
        self.paths
            .iter()
            .find(|(p, _)| within(p, dir) || within(dir, p))
            .map(|(_, r)| Reason::Reads { run: r.id, state: r.state })
    }

    fn hitter(&self, tags: &BTreeSet<&str>) -> Option<Reason> {
        tags.iter().find_map(|t| self.tags.get(t).map(|r| (t, r))).map(|(t, r)| Reason::MayHit {
            run: r.id,
            state: r.state,
            tag: (*t).to_string(),
        })
    }
}

/// A cache or download item before the budget is applied.
struct Cached {
    item: Item,
    protected: bool,
}

/// Decides every directory of the inventory. Items come out sorted by path.
pub fn decide(inv: &Inventory, facts: &Facts, policy: &Policy, now: DateTime<Utc>) -> Vec<Item> {
    let guard = Protection::new(&facts.live);
    let mut cached = cache_items(inv, facts, &guard);
    apply_budget(&mut cached, policy, now);
    let cache_dirs: Vec<PathBuf> = cached.iter().map(|c| c.item.path.clone()).collect();
    let mut items: Vec<Item> = cached.into_iter().map(|c| c.item).collect();
    let by_name: BTreeMap<&str, &RunRetention> = facts.runs.iter().map(|r| (r.name.as_str(), r)).collect();
    for dir in &inv.runs {
        items.extend(run_items(dir, &by_name, &guard, &cache_dirs, inv, policy, now));
    }
    items.sort_by(|a, b| a.path.cmp(&b.path));
    items
}

/// The step cache entries (grouped by directory) and downloads that exist, each protected or not.
fn cache_items(inv: &Inventory, facts: &Facts, guard: &Protection) -> Vec<Cached> {
    let downloads: BTreeMap<&Path, &DirInfo> = inv.downloads.iter().map(|d| (d.path.as_path(), d)).collect();
    let mut rows: BTreeMap<&Path, Vec<&CacheRow>> = BTreeMap::new();
    for row in &facts.cache {
        rows.entry(row.dir.as_path()).or_default().push(row);
    }
    let mut out = Vec::new();
    for (dir, rows) in &rows {
        let download = downloads.get(dir);
        // A row whose directory is not here may be another host's: its row is not ours to touch.
        let Some(bytes) = download.map(|d| d.bytes).or_else(|| inv.sizes.get(*dir).copied()) else { continue };
        let tags: BTreeSet<&str> = rows.iter().flat_map(|r| r.tags.iter().map(String::as_str)).collect();
        let last_used = rows.iter().map(|r| r.last_used).max();
        let keep = if download.is_some_and(|d| d.locked) { Some(Reason::Downloading) } else { None };
        let keep = keep.or_else(|| guard.reader(dir)).or_else(|| guard.hitter(&tags));
        out.push(Cached {
            protected: keep.is_some(),
            item: Item {
                path: dir.to_path_buf(),
                kind: ItemKind::Cache {
                    keys: rows.iter().map(|r| (r.key.clone(), r.uses)).collect(),
                    download: download.is_some(),
                },
                bytes,
                action: Action::Keep,
                reason: keep.unwrap_or(Reason::NoCacheMax),
                except: Vec::new(),
                last_used,
            },
        });
    }
    for d in &inv.downloads {
        if rows.contains_key(d.path.as_path()) {
            continue;
        }
        let partial = d.path.extension().is_some_and(|e| e == "partial");
        let keep = if d.locked { Some(Reason::Downloading) } else { guard.reader(&d.path) };
        out.push(Cached {
            protected: keep.is_some(),
            item: Item {
                path: d.path.clone(),
                kind: ItemKind::Download { partial },
                bytes: d.bytes,
                action: Action::Keep,
                reason: keep.unwrap_or(Reason::NoCacheMax),
                except: Vec::new(),
                last_used: Some(d.modified),
            },
        });
    }
    out
}

/// Frees the least recently used unprotected entries while the cache is over `--cache-max`.
fn apply_budget(cached: &mut [Cached], policy: &Policy, now: DateTime<Utc>) {
    let Some(max) = policy.cache_max else { return };
    let mut total: u64 = cached.iter().map(|c| c.item.bytes).sum();
    let mut order: Vec<usize> = (0..cached.len()).filter(|&i| !cached[i].protected).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&cached[a].item, &cached[b].item);
        a.last_used.cmp(&b.last_used).then_with(|| a.path.cmp(&b.path))
    });
    for i in order {
        let item = &mut cached[i].item;
        if total > max {
            total -= item.bytes;
            item.action = Action::Free;
            let ago = item.last_used.map(|t| since(now, t)).unwrap_or_default();
            item.reason = Reason::OverBudget { max, ago };
        } else {
            item.reason = Reason::WithinBudget { max };
        }
    }
}

/// A run's work directory, and the parts of it a live run reads when it is freed.
fn run_items(
    dir: &DirInfo,
    runs: &BTreeMap<&str, &RunRetention>,
    guard: &Protection,
    cache_dirs: &[PathBuf],
    inv: &Inventory,
    policy: &Policy,
    now: DateTime<Utc>,
) -> Vec<Item> {
    let name = dir.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let run = runs.get(name.as_str());
    let (action, reason) = judge_run(&name, run.copied(), dir, guard, policy, now);
    // Cut out: cache entries inside it (items of their own), and when it is freed, the
    // directories inside it a live run reads.
    let inside = |p: &Path| within(p, &dir.path) && p != dir.path.as_path();
    let parts: Vec<(PathBuf, Reason)> = if action == Action::Free {
        guard
            .paths
            .iter()
            .filter(|(p, _)| inside(p) && !cache_dirs.iter().any(|c| within(p, c)))
            .map(|(p, r)| (p.to_path_buf(), Reason::Reads { run: r.id, state: r.state }))
            .collect()
    } else {
        Vec::new()
    };
    let mut except: Vec<PathBuf> =
        cache_dirs.iter().filter(|c| inside(c)).cloned().chain(parts.iter().map(|(p, _)| p.clone())).collect();
    except.sort();
    except.dedup();
    // Only the outermost: a part inside another counts once.
    let outer: Vec<PathBuf> =
        except.iter().filter(|p| !except.iter().any(|q| q != *p && within(p, q))).cloned().collect();
    let cut: u64 = outer.iter().filter_map(|p| inv.sizes.get(p)).sum();
    let own = dir.bytes.saturating_sub(cut);
    let mut items = vec![Item {
        path: dir.path.clone(),
        kind: ItemKind::Run { run: run.map(|r| r.id) },
        bytes: own,
        action,
        reason,
        except: outer.clone(),
        last_used: None,
    }];
    {
        let mut seen = BTreeSet::new();
        for (p, reason) in parts {
            if outer.contains(&p) && seen.insert(p.clone()) {
                let bytes = inv.sizes.get(&p).copied().unwrap_or(0);
                items.push(Item {
                    path: p,
                    kind: ItemKind::Part,
                    bytes,
                    action: Action::Keep,
                    reason,
                    except: Vec::new(),
                    last_used: None,
                });
            }
        }
    }
    items
}

fn judge_run(
    name: &str,
    run: Option<&RunRetention>,
    dir: &DirInfo,
    guard: &Protection,
    policy: &Policy,
    now: DateTime<Utc>,
) -> (Action, Reason) {
    if let Some(live) = guard.by_name.get(name) {
        return (Action::Keep, Reason::Live { run: live.id, state: live.state });
    }
    let Some(run) = run else { return (Action::Keep, Reason::NoRun) };
    if !run.state.is_terminal() {
        // Live since the live runs were read.
        return (Action::Keep, Reason::Live { run: run.id, state: run.state });
    }
    let retain = match (policy.retain_runs, run.retention) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => match a.or(b) {
            Some(r) => r,
            None => return (Action::Keep, Reason::NoRetention),
        },
    };
    let ago = since(now, run.finished_at.unwrap_or(dir.modified));
    if ago >= retain {
        (Action::Free, Reason::Expired { ago, retain })
    } else {
        (Action::Keep, Reason::Retained { ago, retain })
    }
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
