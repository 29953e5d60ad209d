//! Retention of a work directory (`<state-dir>/work`): the work directories of finished runs
//! beyond their retention, and the step caches and object-store downloads beyond
//! `--cache-max`, least recently used first; never what a queued or running run still needs.
//!
//! Each state directory is its own: workers on other hosts keep theirs, so every worker runs a
//! pass on its own between its tasks ([`gc_loop`]) and `shardline gc` runs one by hand. The
//! policy comes from the store, where the server recorded it.
//!
//! A pass: read the store (step cache rows first, then the runs, then the live runs: an entry
//! hit after the rows were read has a new use count and is not forgotten), measure
//! ([`measure`]), decide ([`decide`], pure), delete ([`apply`]), and report what is left to the
//! store for the dashboard. Only paths inside the work directory are ever deleted.

pub mod apply;
pub mod artifacts;
pub mod decide;
pub mod measure;
pub mod tags;

use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::Utc;
use shardline_control::TaskOutput;
use shardline_store::{DiskEntry, DiskKind, RetentionPolicy, Store, StoreError};
use thiserror::Error;
use tokio::sync::watch;

pub use apply::Outcome;
pub use decide::{Action, Item, ItemKind, Policy, Reason};

/// Why a pass could not run.
#[derive(Debug, Error)]
pub enum GcError {
    #[error("reading the job store: {0}")]
    Store(#[from] StoreError),
    #[error("measuring {path}: {message}")]
    Measure { path: PathBuf, message: String },
}

/// What a pass does.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// The work directory (`<state-dir>/work`).
    pub work: PathBuf,
    /// Decide and print, delete nothing.
    pub dry_run: bool,
    /// The policy instead of the store's.
    pub policy: Option<Policy>,
    /// Record what the work directory holds afterwards, as [`reporter`] names it.
    pub report: bool,
}

/// A pass's decisions and what became of them.
#[derive(Debug, Clone)]
pub struct GcReport {
    pub policy: Policy,
    pub items: Vec<(Item, Outcome)>,
}

impl GcReport {
    /// Bytes and items freed (or, in a dry run, to be freed), and kept.
    pub fn totals(&self) -> (u64, usize, u64, usize) {
        let (mut freed, mut nf, mut kept, mut nk) = (0, 0, 0, 0);
        for (item, outcome) in &self.items {
            if matches!(outcome, Outcome::Freed | Outcome::WouldFree) {
                freed += item.bytes;
                nf += 1;
            } else {
                kept += item.bytes;
                nk += 1;
            }
        }
        (freed, nf, kept, nk)
    }
}

impl From<RetentionPolicy> for Policy {
    fn from(p: RetentionPolicy) -> Policy {
        Policy { retain_runs: p.retain_runs, cache_max: p.cache_max }
    }
}

/// The reporter name of a work directory on this host: `<host>:<work>`.
pub fn reporter(work: &Path) -> String {
    let host =
        std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into());
    format!("{host}:{}", work.display())
}

/// One pass over `opts.work`.
pub async fn run_pass(store: &Store, opts: &GcOptions) -> Result<GcReport, GcError> {
    let work = absolute(&opts.work)?;
    let policy = match opts.policy {
        Some(p) => p,
        None => store.retention_policy().await?.into(),
    };
    // Rows before runs: see the module's doc.
    let rows = store.cache_entries().await?;
    let names = {
        let work = work.clone();
        blocking(move || measure::run_names(&work)).await?
    };
    let runs = store.runs_named(&names).await?;
    let live = store.live_runs().await?;
    // Paths as the file system resolves them: the store has them as the submitter spelt them.
    let (inventory, cache, live) = {
        let work = work.clone();
        blocking(move || {
            let cache: Vec<decide::CacheRow> = rows
                .into_iter()
                .filter_map(|e| {
                    let o = TaskOutput::from_value(&e.output);
                    let dir = measure::resolved(&o.dir.or(o.path)?);
                    dir.starts_with(&work).then_some(decide::CacheRow {
                        key: e.key,
                        dir,
                        uses: e.uses,
                        last_used: e.last_used_at,
                        tags: e.tags,
                    })
                })
                .collect();
            let live: Vec<decide::LiveRun> = live
                .into_iter()
                .map(|r| {
                    let (paths, tags) = tags::of_tasks(&r.tasks);
                    let paths = paths.iter().map(|p| measure::resolved(p)).collect();
                    decide::LiveRun { id: r.id, state: r.state, name: r.name, paths, tags }
                })
                .collect();
            let wanted: Vec<PathBuf> =
                cache.iter().map(|c| c.dir.clone()).chain(live.iter().flat_map(|r| r.paths.iter().cloned())).collect();
            (measure::inventory(&work, &wanted), cache, live)
        })
        .await?
    };
    let facts = decide::Facts { runs, live, cache };
    let items = decide::decide(&inventory, &facts, &policy, Utc::now());
    let outcomes = apply::apply(store, &items, opts.dry_run).await;
    let report = GcReport { policy, items: items.into_iter().zip(outcomes).collect() };
    if opts.report {
        store.report_disk_usage(&reporter(&work), &disk_entries(&report, &inventory)).await?;
    }
    Ok(report)
}

/// What the work directory holds after the pass, for the dashboard: every run directory not
/// freed (its whole size, the cache entries inside it included), every cache entry and download.
fn disk_entries(report: &GcReport, inventory: &decide::Inventory) -> Vec<DiskEntry> {
    let whole = |p: &Path| inventory.runs.iter().find(|d| d.path == p).map_or(0, |d| d.bytes);
    report
        .items
        .iter()
        .filter(|(_, o)| !matches!(o, Outcome::Freed))
        .filter_map(|(item, _)| {
            let (kind, run, cache_key, bytes) = match &item.kind {
                ItemKind::Run { run } => (DiskKind::Run, *run, None, whole(&item.path)),
                ItemKind::Cache { keys, .. } => {
                    (DiskKind::Cache, None, keys.first().map(|(k, _)| k.clone()), item.bytes)
                }
                ItemKind::Download { .. } => (DiskKind::Download, None, None, item.bytes),
                ItemKind::Part => return None,
            };
            Some(DiskEntry {
                path: item.path.display().to_string(),
                kind,
                run,
                cache_key,
                bytes,
                last_used_at: item.last_used,
            })
        })
        .collect()
}

fn absolute(p: &Path) -> Result<PathBuf, GcError> {
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .map_err(|e| GcError::Measure { path: p.to_path_buf(), message: e.to_string() })?
    };
    Ok(measure::resolved(&p))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, GcError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| GcError::Measure { path: PathBuf::new(), message: e.to_string() })
}

/// A worker's gc: a pass over `work` every `every` (the first one shortly after it starts),
/// until `shutdown`. A failed pass is logged and tried again at the next.
pub async fn gc_loop(store: Store, work: PathBuf, every: Duration, mut shutdown: watch::Receiver<bool>) {
    let opts = GcOptions { work, dry_run: false, policy: None, report: true };
    let mut wait = every.min(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() { return; }
                continue;
            }
        }
        wait = every;
        match run_pass(&store, &opts).await {
            Ok(report) => {
                let (freed, n, _, _) = report.totals();
                if n > 0 {
                    tracing::info!("gc of {}: freed {n} item(s), {freed} bytes", opts.work.display());
                }
            }
            Err(e) => tracing::warn!("gc of {} failed (will retry): {e}", opts.work.display()),
        }
    }
}
