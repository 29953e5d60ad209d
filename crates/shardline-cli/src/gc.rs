//! Retention at the command line: `shardline gc`, the server's `--retain-runs` / `--cache-max`
//! (recorded in the store for every gc) and the worker's periodic gc (`--gc-every`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use shardline_engine::gc::{self, GcOptions, GcReport, Item, ItemKind, Outcome, Policy};
use shardline_spec::{format_duration, format_size, parse_duration, parse_size};
use shardline_store::{RetentionPolicy, Store};
use tokio::sync::watch;

use crate::orchestrate::{runtime, StateArgs};
use crate::report::bytes;

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| format!("{e}; {}", e.hint(false)))
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| format!("{e}; {}", e.hint(true)))
}

/// The server's retention policy, recorded in the store at its start.
#[derive(Args, Clone, Debug)]
pub struct RetentionArgs {
    /// Keep the work directories of finished runs this long (e.g. `30d`); a pipeline's
    /// `retention.runs` may shorten it. Default: for ever.
    #[arg(long, env = "SHARDLINE_RETAIN_RUNS", value_parser = duration)]
    pub retain_runs: Option<Duration>,
    /// Keep step caches and object-store downloads of each state directory within this size
    /// (e.g. `500GiB`), freeing the least recently used. Default: no limit.
    #[arg(long, env = "SHARDLINE_CACHE_MAX", value_parser = size)]
    pub cache_max: Option<u64>,
}

impl RetentionArgs {
    fn policy(&self) -> RetentionPolicy {
        RetentionPolicy { retain_runs: self.retain_runs, cache_max: self.cache_max }
    }
}

/// What a policy says, in one line.
fn describe(p: &Policy) -> String {
    let runs = p
        .retain_runs
        .map_or("finished runs kept for ever".to_string(), |d| format!("finished runs kept {}", format_duration(d)));
    let cache = p.cache_max.map_or("caches without limit".to_string(), |b| format!("caches up to {}", format_size(b)));
    format!("{runs}, {cache}")
}

/// Records the server's policy (the last server started sets it) and says what it is.
pub async fn record_policy(store: &Store, args: &RetentionArgs) -> Result<()> {
    let policy = args.policy();
    store.set_retention_policy(&policy).await.context("recording the retention policy")?;
    eprintln!("server: retention: {} (applied by each worker's gc and `shardline gc`)", describe(&policy.into()));
    Ok(())
}

/// A worker's gc of its state directory.
#[derive(Args, Clone, Debug)]
pub struct WorkerGcArgs {
    /// How often the worker frees what the retention policy no longer keeps in its state
    /// directory (beside its tasks; never what a queued or running run needs).
    #[arg(long, default_value = "10m", value_parser = duration)]
    pub gc_every: Duration,
    /// Never free anything from this worker's state directory.
    #[arg(long)]
    pub no_gc: bool,
}

impl WorkerGcArgs {
    /// The engine's setting for a worker on `state`.
    pub fn setting(&self, state: &StateArgs) -> Option<(PathBuf, Duration)> {
        (!self.no_gc && !self.gc_every.is_zero()).then(|| (absolute(state.work_dir()), self.gc_every))
    }
}

fn absolute(p: PathBuf) -> PathBuf {
    if p.is_absolute() {
        p
    } else {
        std::env::current_dir().map(|d| d.join(&p)).unwrap_or(p)
    }
}

#[derive(Args, Debug)]
pub struct GcArgs {
    /// Print what would be freed and kept; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the decisions as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// This retention instead of the server's, for this pass.
    #[arg(long, value_parser = duration)]
    pub retain_runs: Option<Duration>,
    /// This cache limit instead of the server's, for this pass.
    #[arg(long, value_parser = size)]
    pub cache_max: Option<u64>,
    #[command(flatten)]
    pub state: StateArgs,
}

/// `shardline gc`: one pass over `<state-dir>/work`. Exit code 1 when something to free was
/// kept after all (used meanwhile, or not deletable).
pub fn run_gc(args: GcArgs) -> Result<ExitCode> {
    let work = absolute(args.state.work_dir());
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        let policy = match (args.retain_runs, args.cache_max) {
            (None, None) => None,
            (runs, max) => {
                let stored: Policy = store.retention_policy().await?.into();
                Some(Policy { retain_runs: runs.or(stored.retain_runs), cache_max: max.or(stored.cache_max) })
            }
        };
        let opts = GcOptions { work: work.clone(), dry_run: args.dry_run, policy, report: true };
        let report = gc::run_pass(&store, &opts).await.context("gc")?;
        // With an object-store artifact store, the run prefixes there too.
        let remote = match args.state.artifact_store() {
            Some(url) => {
                let artifacts = shardline_artifacts::Artifacts::open(url, &[]).context("the artifact store")?;
                let r = gc::artifacts::artifacts_pass(&store, &artifacts, policy, args.dry_run)
                    .await
                    .context("gc of the artifact store")?;
                Some((url.to_string(), r))
            }
            None => None,
        };
        if args.json {
            let mut v = as_json(&report, &work, args.dry_run);
            if let Some((url, r)) = &remote {
                v["artifacts"] = json!({"url": url, "items": r.items.iter().map(|(item, freed)| json!({
                    "path": item.path, "bytes": item.bytes, "freed": *freed || (args.dry_run && item.action == gc::Action::Free),
                    "reason": item.reason.to_string(),
                })).collect::<Vec<_>>()});
            }
            println!("{v}");
        } else {
            print_report(&report, &work, args.dry_run);
            if let Some((url, r)) = &remote {
                println!("gc of {url}/runs");
                for (item, freed) in &r.items {
                    let word = match (item.action, freed, args.dry_run) {
                        (_, true, _) => "freed",
                        (gc::Action::Free, false, true) => "free",
                        _ => "keep",
                    };
                    println!("  {word:<5} run {:>12} ({} bytes)  {}  — {}", bytes(item.bytes), item.bytes, item.path.display(), item.reason);
                }
            }
        }
        let spared = report.items.iter().any(|(_, o)| matches!(o, Outcome::Spared(_)));
        Ok(if spared { ExitCode::from(1) } else { ExitCode::SUCCESS })
    })
}

fn outcome_word(o: &Outcome) -> &'static str {
    match o {
        Outcome::Freed => "freed",
        Outcome::WouldFree => "free",
        Outcome::Kept => "keep",
        Outcome::Spared(_) => "kept",
    }
}

fn detail(item: &Item, outcome: &Outcome) -> String {
    let mut s = item.reason.to_string();
    if !item.except.is_empty() && matches!(item.kind, ItemKind::Run { .. }) {
        let n = item.except.len();
        s.push_str(&format!("; {n} director{} inside listed apart", if n == 1 { "y" } else { "ies" }));
    }
    if let Outcome::Spared(why) = outcome {
        s.push_str(&format!("; not freed: {why}"));
    }
    s
}

fn print_report(report: &GcReport, work: &std::path::Path, dry_run: bool) {
    let dry = if dry_run { " — dry run, nothing deleted" } else { "" };
    println!("gc of {} ({}){dry}", work.display(), describe(&report.policy));
    for (item, outcome) in &report.items {
        println!(
            "  {:<5} {:<8} {:>12} ({} bytes)  {}  — {}",
            outcome_word(outcome),
            item.kind.label(),
            bytes(item.bytes),
            item.bytes,
            item.path.display(),
            detail(item, outcome)
        );
    }
    let (freed, nf, kept, nk) = report.totals();
    let verb = if dry_run { "would free" } else { "freed" };
    println!(
        "{verb} {nf} item(s), {} ({freed} bytes); kept {nk} item(s), {} ({kept} bytes)",
        bytes(freed),
        bytes(kept)
    );
}

fn as_json(report: &GcReport, work: &std::path::Path, dry_run: bool) -> serde_json::Value {
    let (freed, nf, kept, nk) = report.totals();
    let items: Vec<serde_json::Value> = report
        .items
        .iter()
        .map(|(item, outcome)| {
            json!({
                "path": item.path,
                "kind": item.kind.label(),
                "run": match &item.kind { ItemKind::Run { run } => run.map(|r| r.0), _ => None },
                "cache_keys": match &item.kind {
                    ItemKind::Cache { keys, .. } => keys.iter().map(|(k, _)| k.clone()).collect(),
                    _ => Vec::new(),
                },
                "bytes": item.bytes,
                "action": outcome_word(outcome),
                "freed": matches!(outcome, Outcome::Freed | Outcome::WouldFree),
                "reason": detail(item, outcome),
                "except": item.except,
                "last_used": item.last_used,
            })
        })
        .collect();
    json!({
        "work": work,
        "dry_run": dry_run,
        "policy": {
            "retain_runs": report.policy.retain_runs.map(format_duration),
            "cache_max": report.policy.cache_max,
        },
        "items": items,
        "freed": {"items": nf, "bytes": freed},
        "kept": {"items": nk, "bytes": kept},
    })
}

/// How often the server applies the retention policy to the artifact store's run prefixes.
const ARTIFACT_GC_EVERY: Duration = Duration::from_secs(600);

/// The server's gc of the artifact store: uploads no task recorded (aborted), and finished runs'
/// prefixes past their retention, every
/// [`ARTIFACT_GC_EVERY`] (the first pass a few seconds after start), until `shutdown`.
pub async fn artifact_gc(store: Store, url: String, mut shutdown: watch::Receiver<bool>) {
    let mut wait = Duration::from_secs(5);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => if *shutdown.borrow() { return },
        }
        wait = ARTIFACT_GC_EVERY;
        let pass = async {
            let artifacts = shardline_artifacts::Artifacts::open(&url, &[]).map_err(|e| e.to_string())?;
            let age = shardline_engine::UNRECORDED_UPLOAD_AGE;
            match shardline_engine::abort_unrecorded_uploads(&store, &artifacts.child("runs"), age).await {
                Ok(0) => {}
                Ok(n) => eprintln!("server: aborted {n} upload(s) no task recorded under {url}/runs"),
                Err(e) => eprintln!("server: sweeping unrecorded uploads of {url} failed (will retry): {e}"),
            }
            shardline_engine::gc::artifacts::artifacts_pass(&store, &artifacts, None, false)
                .await
                .map_err(|e| e.to_string())
        };
        match pass.await {
            Ok(r) => {
                for (item, _) in r.items.iter().filter(|(_, freed)| *freed) {
                    eprintln!(
                        "server: gc freed {} ({} bytes) from {url}: {}",
                        item.path.display(),
                        item.bytes,
                        item.reason
                    );
                }
            }
            Err(e) => eprintln!("server: gc of {url} failed (will retry): {e}"),
        }
    }
}
