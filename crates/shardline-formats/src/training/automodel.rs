//! NeMo Automodel's training checkpoint `epoch_E_step_S/` resharded as a whole: `model/`
//! (HF-storage safetensors or DCP) and `optim/` (DCP) written from their plans, each per-rank
//! state file (`rng/rng_global_rank_<g>.pt`, `dataloader/dataloader_dp_rank_<d>.pt`, any tracked
//! state saved the same way) given to every rank of the new world, and everything else copied.
//! The output carries Automodel's own `.incomplete` marker until all of it is written, so neither
//! Automodel nor Shardline ever takes it half-done.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use shardline_layout::reshard::{per_rank_sources, ReshardPlan};

use super::write::io_err;
use super::{write_resharded, write_resharded_hf_storage, ReshardReport, TrainingCheckpoint, TrainingError};
use crate::checkpoint::{automodel_model_dir, CheckpointFormat, AUTOMODEL_INCOMPLETE};
use crate::execute::{ExecuteError, Progress};

/// The recipe's config, saved beside the checkpoint by Automodel's `save_config`.
pub const RECIPE_CONFIG: &str = "config.yaml";

/// How a per-rank state file is keyed: by global rank (`_global_rank_`) or by data-parallel rank
/// (`_dp_rank_`, written by TP/PP rank 0 of each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RankKey {
    Global,
    DataParallel,
}

impl RankKey {
    fn infix(self) -> &'static str {
        match self {
            RankKey::Global => "_global_rank_",
            RankKey::DataParallel => "_dp_rank_",
        }
    }
}

/// A tracked state saved one file per rank: `<name>/<name><infix><rank>.pt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerRankState {
    pub name: String,
    pub key: RankKey,
    /// The ranks that have a file, ascending.
    pub ranks: Vec<u64>,
}

impl PerRankState {
    fn file(&self, rank: u64) -> PathBuf {
        Path::new(&self.name).join(format!("{}{}{rank}.pt", self.name, self.key.infix()))
    }
}

/// Which source rank's file each rank of the new world takes, for one per-rank state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFileCopies {
    /// Index into [`AutomodelSave::per_rank`].
    pub state: usize,
    /// `(target rank, source rank)`.
    pub pairs: Vec<(u64, u64)>,
}

/// An Automodel save as the reshard reads it: its parts besides the tensors.
#[derive(Clone, Debug)]
pub struct AutomodelSave {
    pub dir: PathBuf,
    pub model_format: CheckpointFormat,
    /// `optim/`, when the save has optimizer state.
    pub has_optim: bool,
    pub per_rank: Vec<PerRankState>,
    /// Paths (relative to `dir`) copied as they are: the recipe config, losses, the step
    /// scheduler, `model/.hf_metadata/`, a consolidated copy.
    pub copied: Vec<PathBuf>,
}

impl AutomodelSave {
    /// `dir` as an Automodel save, or `None` when it is not one (no `model/` directory). A save
    /// still marked `.incomplete` is an error.
    pub fn open(dir: &Path) -> Result<Option<AutomodelSave>, TrainingError> {
        let Some(model) = automodel_model_dir(dir)? else { return Ok(None) };
        let model_format = match model.join(".metadata").is_file() {
            true => CheckpointFormat::Dcp,
            false => CheckpointFormat::DcpSafetensors,
        };
        let has_optim = dir.join("optim").join(".metadata").is_file();
        let mut per_rank = Vec::new();
        let mut copied = Vec::new();
        for entry in list(dir)? {
            let name = entry.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            match name.as_str() {
                "model" => copied.extend(
                    list(&entry)?
                        .into_iter()
                        .filter(|p| !is_checkpoint_data(p))
                        .map(|p| Path::new("model").join(p.file_name().unwrap_or_default())),
                ),
                "optim" | AUTOMODEL_INCOMPLETE => {}
                _ if entry.is_dir() => match per_rank_state(&name, &entry)? {
                    Some(state) => per_rank.push(state),
                    None => copied.push(PathBuf::from(&name)),
                },
                _ => copied.push(PathBuf::from(&name)),
            }
        }
        copied.sort();
        Ok(Some(AutomodelSave { dir: dir.to_path_buf(), model_format, has_optim, per_rank, copied }))
    }

    /// For each per-rank state, `(target rank, source rank)` of every rank of a world of `world`
    /// ranks and `dp` data-parallel ranks, and what the user should know of it.
    pub fn rank_files(&self, world: u64, dp: u64) -> (Vec<RankFileCopies>, Vec<String>) {
        let mut notes = Vec::new();
        let plans = self
            .per_rank
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = match s.key {
                    RankKey::Global => world,
                    RankKey::DataParallel => dp,
                };
                let pairs = per_rank_sources(&s.ranks, n);
                let copied = pairs.iter().filter(|(t, from)| t != from).count();
                if copied > 0 {
                    notes.push(format!(
                        "`{}/`: {copied} of {n} ranks start from rank {}'s state (no file of their own in the \
                         source); ranks past {n} are left out",
                        s.name, s.ranks[0]
                    ));
                }
                RankFileCopies { state: i, pairs }
            })
            .collect();
        (plans, notes)
    }
}

/// The resharded save's parts, planned.
pub struct AutomodelPlans<'a> {
    pub model: (&'a TrainingCheckpoint, &'a ReshardPlan),
    pub optim: Option<(&'a TrainingCheckpoint, &'a ReshardPlan)>,
    /// From [`AutomodelSave::rank_files`].
    pub rank_files: &'a [RankFileCopies],
    /// The recipe config's `distributed:` sizes for the new mesh (`dp_size`, `ep_size`).
    pub config_sizes: &'a [(&'a str, u64)],
}

/// The recipe config `config.yaml` (as Automodel's `yaml.dump` writes it: block style, keys in
/// order) with the integer sizes of its top-level `distributed:` mapping set to `sizes`, every
/// other byte kept; and the keys it set. A size written as `none` (inferred from the world size
/// at start-up) is left alone. A config in another shape is left as it is (nothing set): tools
/// that rebuild the training topology from it (Automodel's `export_llm_dcp_to_hf.py`) would
/// otherwise meet the old mesh's sizes beside the new mesh's files.
pub fn edit_recipe_config(text: &str, sizes: &[(&str, u64)]) -> (String, Vec<String>) {
    let mut out = String::with_capacity(text.len() + 16);
    let mut set = Vec::new();
    let mut in_distributed = false;
    for line in text.split_inclusive('\n') {
        let body = line.trim_end_matches(['\n', '\r']);
        if !body.starts_with([' ', '\t']) && !body.is_empty() {
            in_distributed = body.trim_end() == "distributed:";
        }
        // A size of `distributed:` itself: two spaces in, an integer value.
        let size = in_distributed
            .then_some(body)
            .and_then(|b| b.strip_prefix("  "))
            .filter(|rest| !rest.starts_with(' '))
            .and_then(|rest| rest.split_once(": "))
            .filter(|(_, value)| value.trim().parse::<u64>().is_ok())
            .and_then(|(key, _)| sizes.iter().find(|(k, _)| *k == key));
        match size {
            Some((key, size)) => {
                set.push(key.to_string());
                out.push_str(&format!("  {key}: {size}{}", &line[body.len()..]));
            }
            None => out.push_str(line),
        }
    }
    (out, set)
}

/// Writes the resharded save into `out` (a new `epoch_E_step_S/`): `.incomplete` first, then
/// `model/`, `optim/`, the per-rank files and the copied ones, the marker removed last. On an
/// error a directory it created is removed; one that was there keeps the marker.
pub fn write_automodel(
    save: &AutomodelSave,
    plans: &AutomodelPlans<'_>,
    out: &Path,
    threads: usize,
    overwrite: bool,
    progress: &Progress,
) -> Result<ReshardReport, TrainingError> {
    if out.join("model").exists() && !overwrite {
        return Err(ExecuteError::Exists(out.to_path_buf(), "model/").into());
    }
    let created = crate::out_dir::create(out).map_err(io_err(out, "create output directory"))?;
    let result = write_parts(save, plans, out, threads, progress);
    match result {
        Ok(report) => Ok(report),
        Err(e) => {
            // A directory this call made holds only what it wrote.
            if created.made_it() {
                let _ = fs::remove_dir_all(out);
            }
            created.remove();
            Err(e)
        }
    }
}

fn write_parts(
    save: &AutomodelSave,
    plans: &AutomodelPlans<'_>,
    out: &Path,
    threads: usize,
    progress: &Progress,
) -> Result<ReshardReport, TrainingError> {
    let marker = out.join(AUTOMODEL_INCOMPLETE);
    fs::write(&marker, b"").map_err(io_err(&marker, "mark the save incomplete"))?;
    let (source, plan) = plans.model;
    let model = out.join("model");
    let mut report = match save.model_format {
        CheckpointFormat::Dcp => write_resharded(source, plan, &model, threads, true, progress)?,
        CheckpointFormat::DcpSafetensors => write_resharded_hf_storage(source, plan, &model, threads, true, progress)?,
    };
    if let Some((source, plan)) = plans.optim {
        let r = write_resharded(source, plan, &out.join("optim"), threads, true, progress)?;
        report.files += r.files;
        report.tensor_bytes += r.tensor_bytes;
        report.file_bytes += r.file_bytes;
        report.chunks += r.chunks;
    }
    for copies in plans.rank_files {
        let state = &save.per_rank[copies.state];
        let dir = out.join(&state.name);
        fs::create_dir_all(&dir).map_err(io_err(&dir, "create directory"))?;
        for (target, from) in &copies.pairs {
            copy(&save.dir.join(state.file(*from)), &out.join(state.file(*target)))?;
        }
    }
    for rel in &save.copied {
        let (from, to) = (save.dir.join(rel), out.join(rel));
        if rel.as_os_str() == RECIPE_CONFIG && from.is_file() {
            let text = fs::read_to_string(&from).map_err(io_err(&from, "read the recipe config"))?;
            let (edited, _) = edit_recipe_config(&text, plans.config_sizes);
            fs::write(&to, edited).map_err(io_err(&to, "write the recipe config"))?;
            continue;
        }
        copy_tree(&from, &to)?;
    }
    sync_dir(out)?;
    fs::remove_file(&marker).map_err(io_err(&marker, "remove the incomplete marker"))?;
    sync_dir(out)?;
    Ok(report)
}

/// The per-rank files of a tracked state directory `dir` named `name`, or `None` when it is not
/// one (its files are then copied whole).
fn per_rank_state(name: &str, dir: &Path) -> Result<Option<PerRankState>, TrainingError> {
    let mut by_key: BTreeMap<RankKey, Vec<u64>> = BTreeMap::new();
    for file in list(dir)? {
        let file_name = file.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let rank = [RankKey::Global, RankKey::DataParallel].into_iter().find_map(|key| {
            let rest = file_name.strip_prefix(name)?.strip_prefix(key.infix())?.strip_suffix(".pt")?;
            rest.parse::<u64>().ok().map(|r| (key, r))
        });
        match rank {
            Some((key, r)) => by_key.entry(key).or_default().push(r),
            None => return Ok(None),
        }
    }
    // Automodel reads `_global_rank_` files first and falls back to legacy `_dp_rank_` ones.
    Ok(by_key.into_iter().next().map(|(key, mut ranks)| {
        ranks.sort_unstable();
        PerRankState { name: name.to_string(), key, ranks }
    }))
}

/// `model/` and `optim/` files that are checkpoint data (rewritten, not copied).
fn is_checkpoint_data(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    name == ".metadata" || name.ends_with(".distcp") || name.ends_with(".safetensors")
}

fn list(dir: &Path) -> Result<Vec<PathBuf>, TrainingError> {
    let entries = fs::read_dir(dir).map_err(io_err(dir, "list the save"))?;
    let mut out = Vec::new();
    for e in entries {
        out.push(e.map_err(io_err(dir, "list the save"))?.path());
    }
    out.sort();
    Ok(out)
}

fn copy(from: &Path, to: &Path) -> Result<(), TrainingError> {
    fs::copy(from, to).map_err(io_err(to, "copy"))?;
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> Result<(), TrainingError> {
    if from.is_dir() {
        fs::create_dir_all(to).map_err(io_err(to, "create directory"))?;
        for entry in list(from)? {
            copy_tree(&entry, &to.join(entry.file_name().unwrap_or_default()))?;
        }
        Ok(())
    } else {
        copy(from, to)
    }
}

fn sync_dir(dir: &Path) -> Result<(), TrainingError> {
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "sync directory"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipe_config_gets_the_new_mesh_sizes_and_keeps_the_rest() {
        let text = "step_scheduler:\n  global_batch_size: 32\n  dp_size: 7\ndistributed:\n  _target_: \
                    nemo_automodel.components.distributed.config.FSDP2Config\n  dp_size: 4\n  tp_size: 1\n  \
                    ep_size: 2\n  cp_size: 1\n  nested:\n    dp_size: 9\nmodel:\n  ep_size: 3\n";
        let (out, set) = edit_recipe_config(text, &[("dp_size", 3), ("ep_size", 1)]);
        assert_eq!(set, vec!["dp_size", "ep_size"]);
        // Only the two sizes of `distributed:` change: not a same-named key elsewhere, nor a
        // nested one.
        let want = text.replace("  dp_size: 4\n", "  dp_size: 3\n").replace("  ep_size: 2\n", "  ep_size: 1\n");
        assert_eq!(out, want);
    }

    #[test]
    fn an_inferred_size_is_left_alone() {
        let text = "distributed:\n  dp_size: none\n  ep_size: 4\n";
        let (out, set) = edit_recipe_config(text, &[("dp_size", 2), ("ep_size", 2)]);
        assert_eq!(out, "distributed:\n  dp_size: none\n  ep_size: 2\n");
        assert_eq!(set, vec!["ep_size"]);
    }
}
