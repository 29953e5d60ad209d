//! Retention of an object-store artifact store: the prefixes `<artifacts>/runs/<run>` of finished
//! runs past their retention are deleted, judged by the same pure [`decide`](super::decide) as a
//! work directory's run directories (a prefix is the run's directory; queued and running runs'
//! are never touched). Release copies under `releases/` are kept: runs of any age share them.
//! The server runs a pass every `--gc-every`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use chrono::{DateTime, Utc};
use shardline_artifacts::Artifacts;
use shardline_control::TaskOutput;
use shardline_store::Store;

use super::decide::{self, Action, DirInfo, Inventory, Item, ItemKind, Policy};
use super::{tags, GcError};

/// What a pass decided, and whether each freed item was deleted.
pub struct ArtifactReport {
    pub items: Vec<(Item, bool)>,
}

/// One pass over `<artifacts>/runs`.
pub async fn artifacts_pass(
    store: &Store,
    artifacts: &Artifacts,
    policy: Option<Policy>,
    dry_run: bool,
) -> Result<ArtifactReport, GcError> {
    let policy = match policy {
        Some(p) => p,
        None => store.retention_policy().await?.into(),
    };
    let runs_root = artifacts.child("runs");
    let listed = runs_root.list().await.map_err(|e| store_err(&runs_root, e))?;
    let mut prefixes: BTreeMap<String, (u64, DateTime<Utc>)> = BTreeMap::new();
    for o in listed {
        let Some((run, _)) = o.name.split_once('/') else { continue };
        let e = prefixes.entry(run.to_string()).or_insert((0, o.modified));
        e.0 += o.size;
        e.1 = e.1.max(o.modified);
    }
    let names: Vec<String> = prefixes.keys().cloned().collect();
    let runs = store.runs_named(&names).await?;
    let live = store.live_runs().await?;
    // A live run keeps the run prefixes its tasks' outputs name (its own, and another run's
    // checkpoint the step cache served it).
    let runs_url = format!("{}/", runs_root.url());
    let live = live
        .into_iter()
        .map(|r| {
            let (_, tags) = tags::of_tasks(&r.tasks);
            let paths = r
                .tasks
                .iter()
                .flat_map(|(_, output)| tags::artifacts(output.as_ref().map(TaskOutput::from_value).as_ref()))
                .filter_map(|url| Some(PathBuf::from("/runs").join(url.strip_prefix(&runs_url)?)))
                .collect();
            decide::LiveRun { id: r.id, state: r.state, name: r.name, paths, tags }
        })
        .collect();
    let inventory = Inventory {
        runs: prefixes
            .iter()
            .map(|(name, (bytes, modified))| DirInfo {
                path: PathBuf::from("/runs").join(name),
                bytes: *bytes,
                modified: *modified,
                locked: false,
            })
            .collect(),
        ..Inventory::default()
    };
    let facts = decide::Facts { runs, live, cache: Vec::new() };
    let items = decide::decide(&inventory, &facts, &policy, Utc::now());
    let read: BTreeMap<PathBuf, decide::Reason> =
        items.iter().filter(|i| i.kind == ItemKind::Part).map(|i| (i.path.clone(), i.reason.clone())).collect();
    let mut out = Vec::new();
    for mut item in items {
        // A prefix is deleted whole: one a live run reads some of is kept whole.
        if let Some(reason) = item.except.first().and_then(|p| read.get(p)).filter(|_| item.action == Action::Free) {
            item.action = Action::Keep;
            item.reason = reason.clone();
        }
        let freed = if item.action == Action::Free && matches!(item.kind, ItemKind::Run { .. }) && !dry_run {
            let name = item.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let prefix = runs_root.child(&name);
            prefix.delete_all().await.map_err(|e| store_err(&prefix, e))?;
            true
        } else {
            false
        };
        out.push((item, freed));
    }
    Ok(ArtifactReport { items: out })
}

fn store_err(a: &Artifacts, e: impl std::fmt::Display) -> GcError {
    GcError::Measure { path: PathBuf::from(a.url()), message: e.to_string() }
}
