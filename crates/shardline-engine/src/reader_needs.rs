//! The scratch the tasks that read a checkpoint in an artifact store need, known once the
//! checkpoint is written (a commit, a reshard, or an object-store source listed in place): the
//! worker that wrote it lists its objects and raises the needs of the run's tasks that will read
//! it, so each is claimed only by a worker with that much disk free.
//!
//! - A validation part: `.metadata`, its files, and as many bytes again for the release ranges
//!   they are made from (a checkpoint stores every release byte at least as wide as the release).
//! - A reshard: the checkpoint, read whole, and the resharded one it writes, about as large; split
//!   by rank over a checkpoint read in place, a rank task its share of both, the commit
//!   `.metadata`.
//! - An export: the model's items it reads (not the optimizer's moments; summed from
//!   `.metadata`) and the release it writes from them, no larger.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use shardline_artifacts::{Artifacts, ListedObject};
use shardline_control::graph::{part_files, Payload, ReshardSource};
use shardline_control::TaskOutput;
use shardline_formats::checkpoint::{storage_ranges, tracked_dir, MEGATRON_TRACKER};
use shardline_store::{RunId, ScratchNeed, Store};

/// The needs of the tasks of `run` that read the checkpoint `task` recorded in `output` (itself,
/// or through a split that passes it on). Empty when none does or the store cannot be read (the
/// readers then claim with the scratch their step declares).
pub async fn checkpoint_reader_needs(
    store: &Store,
    run: RunId,
    task: &str,
    output: &TaskOutput,
    options: &[(String, String)],
    scratch_dir: &Path,
) -> Vec<ScratchNeed> {
    let Some(url) = &output.artifact else { return Vec::new() };
    let Ok(tasks) = store.run_tasks(run).await else { return Vec::new() };
    let payloads: Vec<(String, Payload)> =
        tasks.iter().filter_map(|t| Some((t.name.clone(), serde_json::from_value(t.payload.clone()).ok()?))).collect();
    let mut names = BTreeSet::from([task.to_string()]);
    for (name, p) in &payloads {
        if matches!(p, Payload::SplitPassThrough { checkpoint_task } if checkpoint_task == task) {
            names.insert(name.clone());
        }
    }
    let readers: Vec<(&String, &Payload)> = payloads
        .iter()
        .filter(|(_, p)| match p {
            Payload::ValidatePart { checkpoint_task, .. } => names.contains(checkpoint_task),
            Payload::Reshard { job } | Payload::ReshardRank { job, .. } => {
                matches!(&job.source, ReshardSource::Task { task } if names.contains(task))
            }
            Payload::Export { job } => names.contains(&job.checkpoint_task),
            _ => false,
        })
        .map(|(n, p)| (n, p))
        .collect();
    if readers.is_empty() {
        return Vec::new();
    }
    let Ok(artifacts) = Artifacts::open(url, options) else { return Vec::new() };
    // A Megatron-LM save directory: the checkpoint directory its tracker names is what is read.
    let tracked = match artifacts.read_small(MEGATRON_TRACKER, 1 << 10).await {
        Ok(Some(text)) => tracked_dir(&String::from_utf8_lossy(&text)),
        _ => None,
    };
    let save_dir = tracked.is_some();
    let artifacts = match tracked.map(|d| Artifacts::open(&format!("{}/{d}", url.trim_end_matches('/')), options)) {
        Some(Ok(a)) => a,
        Some(Err(_)) => return Vec::new(),
        None => artifacts,
    };
    let Ok(listing) = artifacts.list().await else { return Vec::new() };
    let checkpoint = Listed::new(&listing);
    // A reshard split by rank reads a Megatron-FSDP checkpoint (`.metadata` at the prefix) in
    // place, each rank task its share; any other is resharded whole by the commit task.
    let read_in_place = !save_dir && checkpoint.metadata > 0;
    let mut needs = Vec::new();
    for (name, payload) in readers {
        let bytes = match payload {
            Payload::ValidatePart { part, parts, .. } => {
                let files = part_files(&checkpoint.names, *part, *parts);
                checkpoint.metadata + 2 * files.iter().map(|f| checkpoint.size(f)).sum::<u64>()
            }
            // `.metadata` and the bytes items, and the `.metadata` it writes.
            Payload::Reshard { job } if job.split && read_in_place => 3 * checkpoint.metadata,
            Payload::Reshard { .. } => 2 * checkpoint.total,
            // Its sparse copy — the chunks its file is made from, under 2/world of the source
            // for the meshes Megatron uses, with what chunk boundaries add — and its file.
            Payload::ReshardRank { job, .. } if read_in_place => {
                checkpoint.metadata + 4 * checkpoint.total / (job.tp * job.cp * job.dp).max(1)
            }
            Payload::ReshardRank { .. } => checkpoint.metadata,
            Payload::Export { job } => match model_bytes(&artifacts, &job.prefix, save_dir, scratch_dir).await {
                Some(model) => checkpoint.metadata + 2 * model,
                None => continue,
            },
            _ => continue,
        };
        needs.push(ScratchNeed { task: name.clone(), bytes });
    }
    needs
}

/// A checkpoint's objects and their sizes.
struct Listed<'a> {
    sizes: BTreeMap<&'a str, u64>,
    names: Vec<String>,
    metadata: u64,
    total: u64,
}

impl<'a> Listed<'a> {
    fn new(listing: &'a [ListedObject]) -> Self {
        let sizes: BTreeMap<&str, u64> = listing.iter().map(|o| (o.name.as_str(), o.size)).collect();
        Listed {
            metadata: sizes.get(".metadata").copied().unwrap_or(0),
            total: sizes.values().sum(),
            names: listing.iter().map(|o| o.name.clone()).collect(),
            sizes,
        }
    }

    fn size(&self, name: &str) -> u64 {
        self.sizes.get(name).copied().unwrap_or(0)
    }
}

/// The bytes of the items of keys under `prefix` (a save directory's: every key but the
/// optimizer's) and of the bytes items: what an export fetches, from the checkpoint's `.metadata`
/// read into a temporary file under `scratch_dir`.
async fn model_bytes(artifacts: &Artifacts, prefix: &str, save_dir: bool, scratch_dir: &Path) -> Option<u64> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = scratch_dir.join(format!("needs-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&dir).ok()?;
    let path = dir.join(".metadata");
    let prefix = prefix.to_string();
    let ranges = match artifacts.fetch_whole(".metadata", None, &path).await {
        Ok(_) => tokio::task::spawn_blocking(move || {
            storage_ranges(&path, |k| if save_dir { !k.starts_with("optimizer.") } else { k.starts_with(&prefix) }).ok()
        })
        .await
        .ok()
        .flatten(),
        Err(_) => None,
    };
    let _ = std::fs::remove_dir_all(&dir);
    Some(ranges?.values().flatten().map(|(start, end)| end - start).sum())
}
