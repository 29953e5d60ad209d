//! A resharded checkpoint written as Megatron-Core's `torch_dist`: what differs from writing
//! `fsdp_dtensor` is decided here — the checkpoint directory in the save root (`iter_%07d/` of
//! the source's iteration, `release/` for iteration 0), the common state `common.pt` built from
//! the source's bytes items, and the `.metadata` of placed keys. The rank files' bytes are the
//! plain ones (a placed chunk only gains leading axes and an offset).
//!
//! The common state: every carried bytes item at its path (`args`, `iteration`,
//! `opt_param_scheduler`, …); `args` with the target mesh, `ckpt_format` `torch_dist`,
//! `no_save_rng` unless RNG states are written (as `ShardedObject`s, see `rng`) and
//! `no_save_optim` unless optimizer state is;
//! `content_metadata` saying `fully_reshardable` when it is (on load it, not the job's flags,
//! decides the optimizer's layout, torch-dist.md §1.3); and the optimizer's `param_groups` —
//! the distinct settings of `param_to_group_meta`, without `params`, split into the dense and the
//! expert-parallel sub-optimizer when the target has both (EP > 1), as Megatron's
//! `ChainedOptimizer` saves them (§3.2: its `load_state_dict` matches groups by their settings,
//! not by order); at EP 1 experts are not expert-parallel and one optimizer holds every group.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use shardline_layout::reshard::{PathElem, ReshardPlan};

use super::{read_object, ItemData, TrainingCheckpoint, TrainingError};
use crate::dcp_metadata::{MetadataEncoder, StorageRef};
use crate::execute::{object_storage_entries, placed_entries, Planned};
use crate::pickle::{dumps, Value};
use crate::torch_save::{encode_pickle_archive, read_object_archive};

/// The common state of the target and the name of its checkpoint directory.
pub(super) struct CommonState {
    pub archive: Vec<u8>,
    pub dir_name: String,
}

fn refuse(key: &str, problem: impl Into<String>) -> TrainingError {
    TrainingError::Translate { key: key.to_string(), problem: problem.into() }
}

fn s(v: &str) -> Value {
    Value::Str(v.to_string())
}

/// The value of the bytes item `item` of `source`.
pub(super) fn item_value(source: &TrainingCheckpoint, item: usize) -> Result<Value, TrainingError> {
    let key = &source.items[item].key;
    match source.data[item] {
        ItemData::Object(i) => read_object(&source.checkpoint, i),
        ItemData::Inline(j) => {
            let bytes = &source.inline[j][..];
            read_object_archive(bytes, 0, bytes.len() as u64)
                .map_err(|e| TrainingError::Object { key: key.clone(), source: e })
        }
        ItemData::Tensor(_) => Err(refuse(key, "a tensor where a bytes item was planned")),
    }
}

/// The attribute dict of an `argparse.Namespace` (its `BUILD` state).
fn namespace_fields(v: &mut Value) -> Option<&mut Vec<(Value, Value)>> {
    match v {
        Value::Dict(items) => Some(items),
        Value::Object { state: Some(state), .. } | Value::Reduce { state: Some(state), .. } => namespace_fields(state),
        _ => None,
    }
}

fn set(fields: &mut Vec<(Value, Value)>, name: &str, value: Value) {
    match fields.iter_mut().rev().find(|(k, _)| k.as_str() == Some(name)) {
        Some((_, v)) => *v = value,
        None => fields.push((s(name), value)),
    }
}

/// `dict[key]`, inserted empty when absent.
fn entry(dict: &mut Vec<(Value, Value)>, key: Value) -> &mut Value {
    let at = match dict.iter().position(|(k, _)| *k == key) {
        Some(at) => at,
        None => {
            dict.push((key, Value::Dict(Vec::new())));
            dict.len() - 1
        }
    };
    &mut dict[at].1
}

/// Puts `value` at `path` in the nested dict `root`.
fn insert_at(root: &mut Vec<(Value, Value)>, path: &[PathElem], value: Value) -> Result<(), String> {
    let key = |e: &PathElem| match e {
        PathElem::Key(k) => s(k),
        PathElem::Index(i) => Value::Int(i128::from(*i)),
    };
    let (last, parents) = path.split_last().ok_or("an empty path")?;
    let mut dict = root;
    for p in parents {
        match entry(dict, key(p)) {
            Value::Dict(d) => dict = d,
            _ => return Err(format!("`{p}` holds a value and a nested item")),
        }
    }
    set_value(dict, key(last), value);
    Ok(())
}

fn set_value(dict: &mut Vec<(Value, Value)>, key: Value, value: Value) {
    match dict.iter_mut().find(|(k, _)| *k == key) {
        Some((_, v)) => *v = value,
        None => dict.push((key, value)),
    }
}

/// The optimizer's non-sharded state: `param_groups` from the parameters' group settings.
fn optimizer_state(source: &TrainingCheckpoint, plan: &ReshardPlan) -> Result<Value, TrainingError> {
    // Each parameter's settings, field by field in path order.
    let mut per_param: BTreeMap<String, Vec<(Value, Value)>> = BTreeMap::new();
    for &i in &plan.group_meta {
        let item = &source.items[i];
        let (Some(PathElem::Key(param)), Some(PathElem::Key(field)), 4) =
            (item.path.get(2), item.path.get(3), item.path.len())
        else {
            return Err(refuse(
                &item.key,
                "a parameter-group setting not at optimizer.param_to_group_meta.<param>.<field>",
            ));
        };
        per_param.entry(param.clone()).or_default().push((s(field), item_value(source, i)?));
    }
    let mut dense: Vec<Value> = Vec::new();
    let mut expert: Vec<Value> = Vec::new();
    // Experts are expert-parallel, with an optimizer of their own, only when EP > 1 (Megatron
    // marks expert parameters so by `allreduce = not EP>1`); at EP 1 one optimizer holds all.
    let expert_parallel = plan.mesh.ep > 1;
    for mut fields in per_param.into_values() {
        // One group's members list the same settings, not necessarily in the same order.
        fields.sort_by(|a, b| a.0.as_str().cmp(&b.0.as_str()));
        let flag = fields.iter_mut().find(|(k, _)| k.as_str() == Some("is_expert_parallel")).map(|(_, v)| v);
        let is_expert = match flag {
            Some(v) if *v == Value::Bool(true) && !expert_parallel => {
                *v = Value::Bool(false);
                false
            }
            Some(v) => *v == Value::Bool(true),
            None => false,
        };
        let group = Value::Dict(fields);
        let groups = if is_expert { &mut expert } else { &mut dense };
        if !groups.contains(&group) {
            groups.push(group);
        }
    }
    let sub = |groups: Vec<Value>| {
        Value::Dict(vec![
            (s("optimizer"), Value::Dict(vec![(s("param_groups"), Value::List(groups))])),
            (s("param_state_sharding_type"), s("fully_reshardable")),
        ])
    };
    Ok(match (dense.is_empty(), expert.is_empty()) {
        (false, false) => Value::Dict(vec![(Value::Int(0), sub(dense)), (Value::Int(1), sub(expert))]),
        (true, false) => sub(expert),
        _ => sub(dense),
    })
}

/// The common state of `plan`'s target, pickled as `common.pt`.
pub(super) fn common_state(source: &TrainingCheckpoint, plan: &ReshardPlan) -> Result<CommonState, TrainingError> {
    let with_optimizer = !plan.group_meta.is_empty();
    let mut root: Vec<(Value, Value)> = Vec::new();
    for o in &plan.objects {
        let mut value = item_value(source, o.source)?;
        if o.is_args {
            let fields = namespace_fields(&mut value).ok_or_else(|| refuse(&o.key, "`args` is not a namespace"))?;
            for (name, v) in plan.args_updates() {
                set(fields, name, Value::Int(v));
            }
            set(fields, "ckpt_format", s("torch_dist"));
            set(fields, "no_save_rng", Value::Bool(plan.rng_objects.is_empty()));
            set(fields, "no_save_optim", Value::Bool(!with_optimizer));
            if with_optimizer {
                set(fields, "dist_ckpt_optim_fully_reshardable", Value::Bool(true));
            }
        }
        insert_at(&mut root, &o.path, value).map_err(|p| refuse(&o.key, p))?;
    }
    if !root.iter().any(|(k, _)| k.as_str() == Some("checkpoint_version")) {
        root.push((s("checkpoint_version"), Value::Float(3.0)));
    }
    let mut content =
        vec![(s("singleton_local_shards"), Value::Bool(false)), (s("chained_optim_avoid_prefix"), Value::Bool(true))];
    if with_optimizer {
        content.push((s("distrib_optim_sharding_type"), s("fully_reshardable")));
        content.push((s("distrib_optim_fully_reshardable_mem_efficient"), Value::Bool(false)));
        set_value(&mut root, s("optimizer"), optimizer_state(source, plan)?);
    }
    set_value(&mut root, s("content_metadata"), Value::Dict(content));
    let iteration = root.iter().find(|(k, _)| k.as_str() == Some("iteration")).and_then(|(_, v)| v.as_int());
    let dir_name = match iteration {
        Some(i) if i > 0 => format!("iter_{i:07}"),
        _ => super::save_dir::RELEASE_DIR.to_string(),
    };
    let pkl = dumps(&Value::Dict(root)).map_err(|p| refuse("common state", p))?;
    Ok(CommonState { archive: encode_pickle_archive(&pkl), dir_name })
}

/// One stored item of a rank file, for `.metadata`: its key, chunk offsets (`None` for a bytes
/// item), where it is and its length.
pub(super) struct Stored<'a> {
    pub fqn: std::borrow::Cow<'a, str>,
    pub offsets: Option<Vec<u64>>,
    pub offset: u64,
    pub length: u64,
}

/// The RNG `ShardedObject`s of `plan`, built from `source` (see `rng`), each with the rank
/// whose file holds it.
pub(super) fn rng_objects(source: &TrainingCheckpoint, plan: &ReshardPlan) -> Result<Vec<RngArchive>, TrainingError> {
    plan.rng_objects
        .iter()
        .map(|o| Ok(RngArchive { key: o.key.clone(), rank: o.rank, archive: super::rng::rng_archive(source, o)? }))
        .collect()
}

/// An RNG `ShardedObject`, ready to write.
pub(super) struct RngArchive {
    pub key: String,
    pub rank: u64,
    pub archive: Vec<u8>,
}

/// The file of `rank`'s RNG objects (beside its `_extra_state` objects' file).
pub(super) fn rng_file(rank: u64) -> String {
    format!("__{rank}_2.distcp")
}

/// Where each RNG object is stored: `(object, file, offset)`.
fn rng_storage(rng: &[RngArchive]) -> impl Iterator<Item = (&RngArchive, String, u64)> {
    let mut at: BTreeMap<u64, u64> = BTreeMap::new();
    rng.iter().map(move |o| {
        let offset = at.entry(o.rank).or_default();
        let here = *offset;
        *offset += o.archive.len() as u64;
        (o, rng_file(o.rank), here)
    })
}

/// Writes and syncs the RNG objects' files into `dir`.
pub(super) fn write_rng_files(rng: &[RngArchive], dir: &Path) -> Result<(), TrainingError> {
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (o, file, _) in rng_storage(rng) {
        files.entry(file).or_default().extend_from_slice(&o.archive);
    }
    for (name, bytes) in files {
        let path = dir.join(name);
        let write = || -> io::Result<()> {
            let mut f = std::fs::File::create(&path)?;
            io::Write::write_all(&mut f, &bytes)?;
            f.sync_all()
        };
        write().map_err(super::write::io_err(&path, "write RNG objects"))?;
    }
    Ok(())
}

/// `.metadata` of a placed layout (see `execute::placed_entries`), the rank files' items as
/// `stored(rank)` lists them, then the `_extra_state` objects and the RNG objects `rng`.
pub(super) fn write_placed_metadata<'a, W: io::Write, I: Iterator<Item = Stored<'a>>>(
    plan: &'a ReshardPlan,
    rng: &[RngArchive],
    stored: impl Fn(u64) -> I,
    sink: W,
) -> io::Result<W> {
    let tensors: Vec<Planned<'_>> =
        plan.tensors.iter().map(|t| Planned { key: &t.out.key, dtype: t.out.dtype, shape: &t.out.shape }).collect();
    let mut e = MetadataEncoder::new(sink);
    let rng_keys: Vec<&str> = rng.iter().map(|o| o.key.as_str()).collect();
    placed_entries(&mut e, &plan.disk, &tensors, |i| plan.written_chunks(i), &rng_keys)?;
    for rank in 0..plan.mesh.world() {
        let name = crate::execute::dcp_rank_file(rank);
        for item in stored(rank) {
            e.storage(&StorageRef {
                fqn: &item.fqn,
                chunk_offset: item.offsets.as_deref(),
                relative_path: &name,
                offset: item.offset,
                length: item.length,
                transform_descriptors: None,
            })?;
        }
    }
    object_storage_entries(&mut e, plan.disk.objects())?;
    for (o, file, offset) in rng_storage(rng) {
        e.storage(&StorageRef {
            fqn: &o.key,
            chunk_offset: None,
            relative_path: &file,
            offset,
            length: o.archive.len() as u64,
            transform_descriptors: None,
        })?;
    }
    e.finish(None)
}

/// The checkpoint directory of a save root.
pub(super) fn checkpoint_dir(root: &Path, common: &CommonState) -> PathBuf {
    root.join(&common.dir_name)
}
