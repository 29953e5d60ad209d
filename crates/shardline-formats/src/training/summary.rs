//! What `inspect` says about a training checkpoint: the job's mesh and iteration, its
//! parameters and optimizer moments, Adam's step, the RNG grid, and every bytes item's value.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use shardline_layout::reshard::{classify, classify_fsdp2, classify_torch_dist, Fsdp2Item, ItemKind};
use shardline_layout::DType;
use shardline_layout::Mesh;

use super::automodel::AutomodelSave;
use super::common_state::{common_entries, common_entry, is_torch_dist, read_common_pt};
use super::param_groups::saved_groups;
use super::{TrainingArgs, TrainingError};
use crate::checkpoint::CheckpointError;
use crate::dcp_metadata::{read_metadata_file, DcpMetadataError, EntryMeta, MetadataItem, PathElem};
use crate::pickle::Value;
use crate::torch_save::{read_object_archive, read_tensor_archive};

/// Characters of a bytes item's rendered value.
const REPR_CHARS: usize = 160;

/// A training checkpoint, summarised.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainingSummary {
    pub args: Option<TrainingArgs>,
    pub mesh: Option<Mesh>,
    /// `iteration`, rendered.
    pub iteration: Option<String>,
    pub checkpoint_version: Option<String>,
    /// Parameter tensors (`model.*`): count and bytes.
    pub params: (u64, u64),
    /// Optimizer moments by state name (`exp_avg`, …): count and bytes.
    pub moments: BTreeMap<String, (u64, u64)>,
    /// Adam's step as each parameter's group stores it: rendered value → parameters
    /// (`fsdp_dtensor`'s `param_to_group_meta`), or → parameter groups (`torch_dist`'s
    /// `param_groups`, which name no parameters).
    pub adam_steps: BTreeMap<String, u64>,
    /// Whether `adam_steps` counts parameter groups rather than parameters.
    pub adam_steps_by_group: bool,
    /// `(pp, tp)` ranks with RNG states.
    pub rng_ranks: Vec<(u64, u64)>,
    /// Every bytes item and its rendered value, in `.metadata` order.
    pub objects: Vec<(String, String)>,
    /// Items that are neither a Megatron training item nor understood.
    pub unknown: Vec<String>,
    /// `torch_dist`: the common state's entries (`common.pt` or the `common_state` item), rendered.
    pub common: Vec<(String, String)>,
    /// The FSDP2 framework that wrote it (`torchtitan`), when it is not Megatron.
    pub framework: Option<&'static str>,
    /// The data-parallel degree its dataloader state was saved for (torchtitan's
    /// `dataloader.world_size`), and the DP ranks with a dataloader state.
    pub data_parallel: Option<String>,
    pub dataloader_ranks: Vec<u64>,
    /// FSDP2 frameworks' per-parameter group settings, folded: `(setting, value)` → parameters.
    pub group_settings: BTreeMap<(String, String), u64>,
    /// Files beside the tensors (NeMo Automodel's per-rank states, recipe config, …): what each is.
    pub files: Vec<(String, String)>,
}

/// A key of `.metadata` as the summary keeps it: one record per key, never one per chunk.
struct Key {
    /// Bytes of the tensor; `None` for a bytes item.
    tensor_bytes: Option<u64>,
    path: Option<Vec<PathElem>>,
    /// Where a bytes item (or a 0-d tensor) is: `(file, offset, length)`.
    storage: Option<(String, u64, u64)>,
}

/// Summarises the DCP checkpoint in `dir`, streaming its `.metadata` (memory follows its keys,
/// not its chunks); `None` when it holds no training state (no optimizer moments and no bytes
/// items: a converted checkpoint of weights only).
pub fn summarize_training(dir: &Path) -> Result<Option<TrainingSummary>, TrainingError> {
    let keys = read_keys(dir)?;
    // torchtitan keeps its model keys at the top level, beside `optimizer`, `lr_scheduler`, …
    let torchtitan =
        keys.iter().any(|(k, key)| k == "tok_embeddings.weight" && key.path.as_ref().is_some_and(|p| p.len() == 1));
    if torchtitan {
        return summarize_fsdp2(dir, &keys, "torchtitan").map(Some);
    }
    let mut s = TrainingSummary::default();
    let mut training = false;
    // Megatron-Core's `torch_dist` names items by their own keys and records no planner paths.
    let torch_dist = is_torch_dist(dir);
    let mut common_item = None;
    for (key, k) in &keys {
        let kind =
            if torch_dist { classify_torch_dist(key) } else { k.path.as_deref().map_or(ItemKind::Unknown, classify) };
        match k.tensor_bytes {
            Some(nbytes) => match kind {
                ItemKind::Model { .. } => {
                    s.params.0 += 1;
                    s.params.1 += nbytes;
                }
                ItemKind::OptimizerState { state, .. } => {
                    training = true;
                    let m = s.moments.entry(state).or_default();
                    m.0 += 1;
                    m.1 += nbytes;
                }
                ItemKind::Rng { pp, tp } => s.rng_ranks.push((pp, tp)),
                ItemKind::Unknown => s.unknown.push(key.clone()),
                _ => {}
            },
            None => {
                training = true;
                let (file, offset, length) = k
                    .storage
                    .clone()
                    .ok_or_else(|| CheckpointError::MissingStorage { key: key.clone(), offsets: Vec::new() })?;
                let path = dir.join(&file);
                let f =
                    File::open(&path).map_err(|error| CheckpointError::Io { path, action: "open rank file", error })?;
                let value = read_object_archive(&f, offset, length)
                    .map_err(|source| TrainingError::Object { key: key.clone(), source })?;
                let shown = value.repr(REPR_CHARS);
                let last = k.path.as_ref().and_then(|p| p.last()).map(|e| e.to_string());
                match &kind {
                    ItemKind::Args => {
                        let a = TrainingArgs::from_value(&value);
                        s.mesh = a.mesh();
                        s.args = Some(a);
                    }
                    ItemKind::Carried if key == "iteration" => s.iteration = Some(shown.clone()),
                    ItemKind::Carried if key == "checkpoint_version" => s.checkpoint_version = Some(shown.clone()),
                    ItemKind::GroupMeta if last.as_deref() == Some("step") => {
                        *s.adam_steps.entry(shown.clone()).or_default() += 1;
                    }
                    ItemKind::Rng { pp, tp } => s.rng_ranks.push((*pp, *tp)),
                    ItemKind::Unknown => s.unknown.push(key.clone()),
                    ItemKind::Carried if torch_dist && key.starts_with("common_state/") => {
                        common_item = Some(value.clone());
                    }
                    _ => {}
                }
                s.objects.push((key.clone(), shown));
            }
        }
    }
    if torch_dist {
        // A loader prefers `common.pt` (megatron-core ≤ 0.18) to the `common_state` item.
        if let Some(common) = read_common_pt(dir)?.or(common_item) {
            training = true;
            apply_common(&mut s, &common);
        }
    }
    s.rng_ranks.sort_unstable();
    s.rng_ranks.dedup();
    Ok(training.then_some(s))
}

/// Every key of `dir`'s `.metadata`, streamed: one record per key, never one per chunk.
fn read_keys(dir: &Path) -> Result<Vec<(String, Key)>, TrainingError> {
    let md_path = dir.join(".metadata");
    let mut keys: Vec<(String, Key)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    read_metadata_file(&md_path, |item| -> Result<(), DcpMetadataError> {
        match item {
            MetadataItem::Entry(key, entry) => {
                let tensor_bytes = match entry {
                    EntryMeta::Tensor { dtype, size, .. } => Some(size.iter().product::<u64>() * dtype.size() as u64),
                    EntryMeta::Bytes => None,
                };
                index.insert(key.clone(), keys.len());
                keys.push((key, Key { tensor_bytes, path: None, storage: None }));
            }
            MetadataItem::PlannerPath(key, path) => {
                if let Some(&i) = index.get(&key) {
                    keys[i].1.path = Some(path);
                }
            }
            MetadataItem::Storage(k, info) if k.offset.as_ref().is_none_or(Vec::is_empty) => {
                if let Some(&i) = index.get(&k.fqn) {
                    keys[i].1.storage = Some((info.relative_path, info.offset, info.length));
                }
            }
            MetadataItem::Storage(..) => {}
        }
        Ok(())
    })
    .map_err(|source| CheckpointError::Metadata { path: md_path.clone(), source })?;
    Ok(keys)
}

/// An FSDP2 framework's checkpoint (`framework`): parameters and moments by `classify_fsdp2`,
/// Adam's per-parameter `step` tensors read, the parameter groups' settings folded, the
/// dataloader's degree and ranks, and the train state's step as the iteration.
fn summarize_fsdp2(
    dir: &Path,
    keys: &[(String, Key)],
    framework: &'static str,
) -> Result<TrainingSummary, TrainingError> {
    let mut s = TrainingSummary { framework: Some(framework), ..TrainingSummary::default() };
    for (key, k) in keys {
        let kind = k.path.as_deref().map_or(Fsdp2Item::Other, classify_fsdp2);
        let value = match k.storage.clone() {
            Some((file, offset, length)) => {
                let path = dir.join(&file);
                let f =
                    File::open(&path).map_err(|error| CheckpointError::Io { path, action: "open rank file", error })?;
                let object = || -> Result<String, TrainingError> {
                    let v = read_object_archive(&f, offset, length)
                        .map_err(|source| TrainingError::Object { key: key.clone(), source })?;
                    Ok(v.repr(REPR_CHARS))
                };
                match k.tensor_bytes {
                    Some(_) => Some(scalar(&f, &dir.join(&file), offset, length, key)?),
                    None => Some(object()?),
                }
            }
            None => None,
        };
        match (kind, k.tensor_bytes) {
            (Fsdp2Item::Param { .. }, Some(nbytes)) => {
                s.params.0 += 1;
                s.params.1 += nbytes;
            }
            (Fsdp2Item::State { state, .. }, Some(nbytes)) => {
                if state == "step" {
                    *s.adam_steps.entry(value.unwrap_or_default()).or_default() += 1;
                } else {
                    let m = s.moments.entry(state).or_default();
                    m.0 += 1;
                    m.1 += nbytes;
                }
            }
            (Fsdp2Item::DataloaderRank(d), _) => s.dataloader_ranks.push(d),
            (_, Some(_)) => s.unknown.push(key.clone()),
            (_, None) => {
                let shown = value.unwrap_or_default();
                let setting = key.strip_prefix("optimizer.param_groups.").or(key.strip_prefix("optim.param_groups."));
                match setting.and_then(|r| r.rsplit_once('.')) {
                    Some((_, name)) => *s.group_settings.entry((name.to_string(), shown)).or_default() += 1,
                    None => {
                        match key.as_str() {
                            "train_state.step" => s.iteration = Some(shown.clone()),
                            "dataloader.world_size" => s.data_parallel = Some(shown.clone()),
                            _ => {}
                        }
                        s.objects.push((key.clone(), shown));
                    }
                }
            }
        }
    }
    s.dataloader_ranks.sort_unstable();
    Ok(s)
}

/// A NeMo Automodel save `epoch_E_step_S/`: its `optim/` as an FSDP2 checkpoint's training
/// state, the step from the directory's name, the data-parallel degree from `model/`'s rank
/// files, and the files beside them.
pub fn summarize_automodel(save: &AutomodelSave) -> Result<TrainingSummary, TrainingError> {
    let optim = save.dir.join("optim");
    let mut s = match save.has_optim {
        true => summarize_fsdp2(&optim, &read_keys(&optim)?, "NeMo Automodel")?,
        false => TrainingSummary { framework: Some("NeMo Automodel"), ..TrainingSummary::default() },
    };
    let name = save.dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    s.iteration =
        name.strip_prefix("epoch_").and_then(|r| r.split_once("_step_")).map(|(e, st)| format!("{st} (epoch {e})"));
    let model = save.dir.join("model");
    let ranks = std::fs::read_dir(&model)
        .map_err(|error| CheckpointError::Io { path: model.clone(), action: "list", error })?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.ends_with(".safetensors") || n.ends_with(".distcp")))
        .count();
    s.data_parallel = Some(format!("{ranks} (model/'s rank files)"));
    for state in &save.per_rank {
        let key = match state.key {
            super::automodel::RankKey::Global => "global rank",
            super::automodel::RankKey::DataParallel => "DP rank",
        };
        let (first, last) = (state.ranks.first().copied().unwrap_or(0), state.ranks.last().copied().unwrap_or(0));
        s.files
            .push((format!("{}/", state.name), format!("{} files, one per {key} ({first}–{last})", state.ranks.len())));
        if state.name == "dataloader" {
            s.dataloader_ranks = state.ranks.clone();
        }
    }
    for rel in &save.copied {
        s.files.push((rel.display().to_string(), "copied as it is by reshard".into()));
    }
    Ok(s)
}

/// The value of a 0-d tensor item (Adam's `step`), as Python prints it.
fn scalar(f: &File, path: &Path, offset: u64, length: u64, key: &str) -> Result<String, TrainingError> {
    let t = read_tensor_archive(f, offset, length)
        .map_err(|source| TrainingError::Object { key: key.to_string(), source })?;
    let mut bytes = vec![0u8; t.data_len.min(8) as usize];
    f.read_exact_at(&mut bytes, offset + t.data_offset_in_item).map_err(|error| CheckpointError::Io {
        path: path.to_path_buf(),
        action: "read a scalar",
        error,
    })?;
    Ok(match (t.dtype, bytes.as_slice()) {
        (DType::F32, &[a, b, c, d]) => format!("{:?}", f32::from_le_bytes([a, b, c, d])),
        (DType::F64, b) if b.len() == 8 => format!("{:?}", f64::from_le_bytes(b.try_into().unwrap_or_default())),
        (DType::I64, b) if b.len() == 8 => format!("{}", i64::from_le_bytes(b.try_into().unwrap_or_default())),
        (dtype, _) => format!("a {} scalar", dtype.safetensors_name()),
    })
}

/// What the `torch_dist` common state says: the job's `args` (and so its mesh), `iteration`,
/// `checkpoint_version`; every entry is listed.
fn apply_common(s: &mut TrainingSummary, common: &Value) {
    let Some(entries) = common_entries(common) else {
        s.common.push(("(common state)".into(), common.repr(REPR_CHARS)));
        return;
    };
    if let Some(args) = common_entry(entries, "args") {
        let a = TrainingArgs::from_value(args);
        s.mesh = a.mesh();
        s.args = Some(a);
    }
    s.iteration = common_entry(entries, "iteration").map(|v| v.repr(REPR_CHARS)).or(s.iteration.take());
    s.checkpoint_version =
        common_entry(entries, "checkpoint_version").map(|v| v.repr(REPR_CHARS)).or(s.checkpoint_version.take());
    if let Some(groups) = common_entry(entries, "optimizer").and_then(|o| saved_groups(o).ok()) {
        for g in groups {
            if let Some((_, step)) = g.iter().find(|(k, _)| k.as_str() == Some("step")) {
                *s.adam_steps.entry(step.repr(REPR_CHARS)).or_default() += 1;
                s.adam_steps_by_group = true;
            }
        }
    }
    for (k, v) in entries {
        let name = k.as_str().map_or_else(|| k.repr(40), str::to_string);
        s.common.push((name, v.repr(REPR_CHARS)));
    }
}
