//! What makes the files at a destination a checkpoint for readers that never read our manifest,
//! and so what a publish must write last and withdraw first.
//!
//! - **DCP** (`.metadata` + rank files): torch's `FileSystemReader` (and every DCP reader) opens
//!   `.metadata` and trusts it to name complete files, so `.metadata` is the commit: written
//!   only after every data file is complete and verified, deleted before anything else changes.
//! - **HF safetensors with an index** (`model.safetensors.index.json`, what `export` writes):
//!   `transformers` reads the index first and opens the files it names, so the index is the
//!   commit, with the same rule.
//! - **DCP-safetensors** (`*.safetensors` with `DCP_SHARDING_INFO`, no index): torch's
//!   `HuggingFaceStorageReader` lists the directory and reads every `*.safetensors` it finds,
//!   building global shapes from whichever chunks are there, so a subset loads silently wrong and
//!   no single file can commit. Each file is uploaded as a multipart upload that stays open
//!   (invisible: an upload is no object until completed) until every file's bytes are up; then
//!   all are completed together, so the completions are the commit. Before an overwrite every
//!   `*.safetensors` of the old checkpoint is withdrawn, so old and new never mix.
//! - **Both** (a NeMo Automodel save: `model/` as DCP-safetensors, `optim/.metadata`): the
//!   safetensors files are completed together, then the markers are written; Automodel loads
//!   both parts, so until the last marker a reader fails instead of loading a part.

use std::collections::BTreeSet;

use crate::{Destination, PublishError, MANIFEST};

/// DCP's commit marker.
pub const DCP_METADATA: &str = ".metadata";
/// Megatron-LM's commit marker: the tracker of a save directory, naming the checkpoint
/// directory (`release/`, `iter_NNNNNNN/`) it holds. Written after the checkpoint's
/// `.metadata`, withdrawn before it.
pub const MEGATRON_TRACKER: &str = "latest_checkpointed_iteration.txt";
/// The commit marker of an HF safetensors release.
pub const HF_INDEX: &str = "model.safetensors.index.json";
const SAFETENSORS: &str = ".safetensors";

/// How a checkpoint's files become visible to readers other than Shardline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommitRule {
    /// These files (in this order) commit it: written after every other file, withdrawn first.
    Markers(Vec<String>),
    /// Every `*.safetensors` file is read by the reader: they are completed together, last.
    AllSafetensors,
    /// DCP-safetensors files beside commit markers: the files are completed together, then the
    /// markers are written (in this order).
    SafetensorsThenMarkers(Vec<String>),
    /// No reader-visible commit (anything else): the manifest alone commits.
    ManifestOnly,
}

impl CommitRule {
    /// The rule for a checkpoint made of `names`.
    pub fn of(names: &[String]) -> CommitRule {
        let mut markers: Vec<&String> = names.iter().filter(|n| marker_order(n).is_some()).collect();
        markers.sort_by_key(|n| (marker_order(n), n.as_str()));
        let markers: Vec<String> = markers.into_iter().cloned().collect();
        let safetensors = names.iter().any(|n| n.ends_with(SAFETENSORS));
        // An index names the safetensors files it commits; without one, each is read as found.
        if !markers.is_empty() && safetensors && !markers.iter().any(|m| m == HF_INDEX) {
            CommitRule::SafetensorsThenMarkers(markers)
        } else if !markers.is_empty() {
            CommitRule::Markers(markers)
        } else if safetensors {
            CommitRule::AllSafetensors
        } else {
            CommitRule::ManifestOnly
        }
    }

    /// Whether `name` is written in the commit phase, after the data.
    pub fn is_marker(&self, name: &str) -> bool {
        matches!(self, CommitRule::Markers(m) | CommitRule::SafetensorsThenMarkers(m) if m.iter().any(|x| x == name))
    }

    /// Whether `name`'s upload stays open until every file's bytes are up.
    pub fn completes_together(&self, name: &str) -> bool {
        self.safetensors_commit() && name.ends_with(SAFETENSORS)
    }

    fn safetensors_commit(&self) -> bool {
        matches!(self, CommitRule::AllSafetensors | CommitRule::SafetensorsThenMarkers(_))
    }

    /// What must be deleted, before anything else is touched, so that no reader takes the
    /// destination for a checkpoint while it changes, in this order: our manifest, the commit
    /// markers this checkpoint or the old one has, and for DCP-safetensors every `*.safetensors`
    /// of either. `old` is what the destination's previous manifest (or an interrupted publish's
    /// record) listed.
    pub fn withdrawn<'a>(&self, new: &'a [String], old: impl Iterator<Item = &'a String>) -> Vec<String> {
        let old: Vec<&String> = old.collect();
        let either = || new.iter().chain(old.iter().copied());
        let mut ordered = vec![MANIFEST.to_string()];
        // Markers in the reverse of their commit order: a save directory's tracker before the
        // `.metadata` of the checkpoint it names.
        let mut markers: Vec<&String> = either().filter(|n| marker_order(n).is_some()).collect();
        markers.sort_by_key(|n| (std::cmp::Reverse(marker_order(n)), n.as_str()));
        markers.dedup();
        ordered.extend(markers.into_iter().cloned());
        if self.safetensors_commit() {
            let files: BTreeSet<&String> = either().filter(|n| n.ends_with(SAFETENSORS)).collect();
            ordered.extend(files.into_iter().cloned());
        }
        ordered
    }
}

/// Whether `name` is a commit marker, and its place in the commit (first written first):
/// `.metadata` (also a save directory's checkpoint's, `release/.metadata`) and an HF index, then
/// a Megatron tracker.
pub fn marker_order(name: &str) -> Option<u8> {
    if name == DCP_METADATA || name == HF_INDEX || name.ends_with("/.metadata") {
        Some(0)
    } else if name == MEGATRON_TRACKER {
        Some(1)
    } else {
        None
    }
}

/// Deletes `names` at `dest` in order (missing ones are fine); stops at the first failure.
pub(crate) async fn withdraw(dest: &Destination, names: &[String]) -> Result<(), PublishError> {
    for name in names {
        crate::engine::delete_if_present(dest, name, "withdraw the old commit").await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_save_directory_commits_with_its_tracker_after_its_checkpoint() {
        let save = names(&["latest_checkpointed_iteration.txt", "release/.metadata", "release/__0_0.distcp"]);
        let rule = CommitRule::of(&save);
        assert_eq!(rule, CommitRule::Markers(names(&["release/.metadata", "latest_checkpointed_iteration.txt"])));
        assert!(!rule.is_marker("release/__0_0.distcp"));
        let w = rule.withdrawn(&save, [].iter());
        assert_eq!(w, names(&[MANIFEST, "latest_checkpointed_iteration.txt", "release/.metadata"]));
    }

    #[test]
    fn rules_by_format() {
        let dcp = names(&["__0_0.distcp", "__1_0.distcp", ".metadata"]);
        assert_eq!(CommitRule::of(&dcp), CommitRule::Markers(names(&[".metadata"])));
        assert!(CommitRule::of(&dcp).is_marker(".metadata"));
        assert!(!CommitRule::of(&dcp).is_marker("__0_0.distcp"));
        let hf = names(&["model-00001-of-00002.safetensors", "config.json", "model.safetensors.index.json"]);
        let rule = CommitRule::of(&hf);
        assert_eq!(rule, CommitRule::Markers(names(&["model.safetensors.index.json"])));
        assert!(!rule.completes_together("model-00001-of-00002.safetensors"));
        let st =
            names(&["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]);
        let rule = CommitRule::of(&st);
        assert_eq!(rule, CommitRule::AllSafetensors);
        assert!(rule.completes_together(&st[0]));
        assert_eq!(CommitRule::of(&names(&["notes.txt"])), CommitRule::ManifestOnly);
        // An Automodel save: model/ as DCP-safetensors, optim/ as DCP.
        let save =
            names(&["model/shard-00001-model-00001-of-00001.safetensors", "optim/.metadata", "optim/__0_0.distcp"]);
        let rule = CommitRule::of(&save);
        assert_eq!(rule, CommitRule::SafetensorsThenMarkers(names(&["optim/.metadata"])));
        assert!(rule.completes_together(&save[0]) && rule.is_marker(&save[1]) && !rule.is_marker(&save[2]));
        let w = rule.withdrawn(&save, [].iter());
        assert_eq!(w, names(&[MANIFEST, "optim/.metadata", "model/shard-00001-model-00001-of-00001.safetensors"]));
    }

    #[test]
    fn withdrawal_puts_the_commit_first_and_takes_every_old_safetensors_file() {
        let dcp = names(&["__0_0.distcp", ".metadata"]);
        let w = CommitRule::of(&dcp).withdrawn(&dcp, [].iter());
        assert_eq!(w, names(&[MANIFEST, ".metadata"]));
        // An HF export published over a DCP checkpoint withdraws the old `.metadata` too.
        let hf = names(&["model.safetensors", HF_INDEX]);
        let w = CommitRule::of(&hf).withdrawn(&hf, dcp.iter());
        assert_eq!(w, names(&[MANIFEST, ".metadata", HF_INDEX]));
        let st = names(&["shard-00001-model-00001-of-00001.safetensors"]);
        let old = names(&["shard-00002-model-00001-of-00001.safetensors", "x.bin"]);
        let w = CommitRule::AllSafetensors.withdrawn(&st, old.iter());
        assert_eq!(w[0], MANIFEST);
        assert!(w.contains(&st[0]) && w.contains(&old[0]) && !w.contains(&old[1]), "{w:?}");
    }
}
