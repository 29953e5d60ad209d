//! RNG states between the two Megatron dialects. Megatron-LM saves `rng_state_list` (one dict
//! per rank: `random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state`,
//! `rng_tracker_states`; training-checkpoints.md §2, torch-dist.md §1.3) in two forms:
//! - `fsdp_dtensor`: under `rng_state.(pp, tp)`, flattened by DCP into an item per leaf — the
//!   tensors as plain `uint8` tensor items, everything else as bytes items;
//! - `torch_dist`: one `ShardedObject` per (pp, tp) rank, a bytes item whose `torch.save`
//!   archive holds the whole list, tensors as storages inside it — wrapped in a one-element
//!   list, as Megatron-Core's torch strategy saves every `ShardedObject`'s data.
//!
//! Reading a `ShardedObject` gives its leaves with the tensors located in place (no byte is
//! copied); writing one builds its archive from the leaves' values and bytes.

use std::fs::File;
use std::os::unix::fs::FileExt;

use shardline_layout::reshard::{flat_key, PathElem, RngObject};
use shardline_layout::DType;

use super::{ItemData, TrainingCheckpoint, TrainingError};
use crate::checkpoint::{StoredChunk, StoredObject, StoredTensor};
use crate::pickle::{dumps, Value};
use crate::torch_save::{encode_archive_with_storages, is_tensor_value, locate_object_tensor};

fn refuse(key: &str, problem: impl Into<String>) -> TrainingError {
    TrainingError::Translate { key: key.to_string(), problem: problem.into() }
}

/// A leaf of an RNG `ShardedObject`, at its DCP path under `rng_state.(pp, tp)`.
pub(super) enum RngLeaf<'v> {
    /// A tensor, located in the rank file.
    Tensor(StoredTensor),
    /// Any other value, to be pickled as a bytes item of its own.
    Value(&'v Value),
}

/// Whether DCP's flattening descends into `v` (torch's `traverse_state_dict`: a dict always; a
/// list when it holds a tensor or something it descends into); otherwise `v` is one item.
fn descends(v: &Value) -> bool {
    match v {
        Value::Dict(_) => true,
        Value::List(items) => items.iter().any(|x| is_tensor_value(x) || descends(x)),
        _ => false,
    }
}

/// The leaves of `v` under `path`, as DCP flattens a state dict.
fn flatten<'v>(path: Vec<PathElem>, v: &'v Value, out: &mut Vec<(Vec<PathElem>, &'v Value)>) -> Result<(), String> {
    match v {
        Value::Dict(items) if descends(v) => {
            for (k, child) in items {
                let k = k.as_str().ok_or_else(|| format!("a dict key {} that is not a str", k.describe()))?;
                let mut p = path.clone();
                p.push(PathElem::Key(k.to_string()));
                flatten(p, child, out)?;
            }
        }
        Value::List(items) if descends(v) => {
            for (i, child) in items.iter().enumerate() {
                let mut p = path.clone();
                p.push(PathElem::Index(i as u64));
                flatten(p, child, out)?;
            }
        }
        _ => out.push((path, v)),
    }
    Ok(())
}

/// The leaves of the RNG `ShardedObject` `object` (its archive unpickled as `value`), under
/// `rng_state.(pp, tp)`: tensors located in `object`'s file, other values as they are.
pub(super) fn read_rng_object<'v>(
    object: &StoredObject,
    file: &File,
    value: &'v Value,
    rank_part: &str,
) -> Result<Vec<(Vec<PathElem>, RngLeaf<'v>)>, TrainingError> {
    // Megatron-Core's torch strategy saves a `ShardedObject` as `torch.save([data])`.
    let list = match value {
        Value::List(wrapped) => match &wrapped[..] {
            [inner @ Value::List(_)] => Some(inner),
            _ => None,
        },
        _ => None,
    };
    let Some(list) = list else {
        return Err(refuse(
            &object.key,
            format!("an RNG state that is {}, not Megatron's `[rng_state_list]`", value.describe()),
        ));
    };
    let root = vec![PathElem::Key("rng_state".into()), PathElem::Key(rank_part.to_string())];
    let mut leaves = Vec::new();
    flatten(root, list, &mut leaves).map_err(|p| refuse(&object.key, p))?;
    leaves
        .into_iter()
        .map(|(path, v)| {
            if !is_tensor_value(v) {
                return Ok((path, RngLeaf::Value(v)));
            }
            let t = locate_object_tensor(file, object.offset, object.length, v)
                .map_err(|source| TrainingError::Object { key: object.key.clone(), source })?;
            let chunk = StoredChunk {
                offsets: vec![0; t.shape.len()],
                sizes: t.shape.clone(),
                file: object.file.clone(),
                data_offset: object.offset + t.data_offset_in_item,
                data_len: t.data_len,
            };
            let key = flat_key(&path);
            Ok((path, RngLeaf::Tensor(StoredTensor { key, dtype: t.dtype, shape: t.shape, chunks: vec![chunk] })))
        })
        .collect()
}

/// `torch.save`'s pickle of a contiguous CPU tensor of `dtype` and `shape` in storage `key`.
fn tensor_value(dtype: DType, shape: &[u64], key: &str) -> Result<Value, String> {
    let g = |module: &str, name: &str| Value::Global { module: module.into(), name: name.into() };
    let class = dtype.torch_storage_class().ok_or_else(|| format!("no torch storage holds {dtype:?}"))?;
    let numel: u64 = shape.iter().product();
    let mut strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let ints = |v: &[u64]| Value::Tuple(v.iter().map(|&x| Value::Int(i128::from(x))).collect());
    let storage = Value::PersistentId(Box::new(Value::Tuple(vec![
        Value::Str("storage".into()),
        g("torch", class),
        Value::Str(key.to_string()),
        Value::Str("cpu".into()),
        Value::Int(i128::from(numel)),
    ])));
    let call = |callable: Value, args: Vec<Value>| Value::Reduce {
        callable: Box::new(callable),
        args: Box::new(Value::Tuple(args)),
        state: None,
        list_items: Vec::new(),
        dict_items: Vec::new(),
    };
    let hooks = call(g("collections", "OrderedDict"), Vec::new());
    Ok(call(
        g("torch._utils", "_rebuild_tensor_v2"),
        vec![storage, Value::Int(0), ints(shape), ints(&strides), Value::Bool(false), hooks],
    ))
}

/// Puts `value` at `path` (dict keys and list indices, as DCP flattened them) in `root`.
fn insert(root: &mut Value, path: &[PathElem], value: Value) -> Result<(), String> {
    let Some((first, rest)) = path.split_first() else {
        *root = value;
        return Ok(());
    };
    let child = match (first, root) {
        (PathElem::Index(i), Value::List(items)) => {
            let i = *i as usize;
            if items.len() < i + 1 {
                items.resize(i + 1, Value::None);
            }
            &mut items[i]
        }
        (PathElem::Key(k), Value::Dict(pairs)) => {
            let at = match pairs.iter().position(|(key, _)| key.as_str() == Some(k)) {
                Some(at) => at,
                None => {
                    pairs.push((Value::Str(k.clone()), Value::None));
                    pairs.len() - 1
                }
            };
            &mut pairs[at].1
        }
        (p, v) => return Err(format!("`{p}` under {}", v.describe())),
    };
    if matches!(child, Value::None) && !rest.is_empty() {
        *child = match rest[0] {
            PathElem::Index(_) => Value::List(Vec::new()),
            PathElem::Key(_) => Value::Dict(Vec::new()),
        };
    }
    insert(child, rest, value)
}

/// The `torch.save` archive of `object`'s payload: Megatron's `rng_state_list`, rebuilt from
/// its leaves in `source` (bytes items unpickled, tensors' bytes read whole).
pub(super) fn rng_archive(source: &TrainingCheckpoint, object: &RngObject) -> Result<Vec<u8>, TrainingError> {
    let mut root = Value::List(Vec::new());
    let mut storages: Vec<(String, Vec<u8>)> = Vec::new();
    for (path, item) in &object.leaves {
        let key = &source.items[*item].key;
        let value = match (&source.data[*item], &source.items[*item].tensor) {
            (ItemData::Tensor(_), Some(meta)) => {
                let bytes = whole_tensor_bytes(source, *item, meta.dtype, &meta.shape)?;
                let storage = storages.len().to_string();
                let v = tensor_value(meta.dtype, &meta.shape, &storage).map_err(|p| refuse(key, p))?;
                storages.push((storage, bytes));
                v
            }
            _ => super::torch_dist_save::item_value(source, *item)?,
        };
        insert(&mut root, path, value).map_err(|p| refuse(key, p))?;
    }
    // Wrapped as Megatron-Core's torch strategy saves a `ShardedObject`'s data.
    let pkl = dumps(&Value::List(vec![root])).map_err(|p| refuse(&object.key, p))?;
    Ok(encode_archive_with_storages(&pkl, &storages))
}

/// The bytes of the whole tensor `item` (an RNG state: one chunk, a few KiB).
fn whole_tensor_bytes(
    source: &TrainingCheckpoint,
    item: usize,
    dtype: DType,
    shape: &[u64],
) -> Result<Vec<u8>, TrainingError> {
    let key = &source.items[item].key;
    let len = shape.iter().product::<u64>() * dtype.size() as u64;
    let chunk = match source.chunks_of(item) {
        [c] if c.sizes == shape && c.data_len == len => c,
        _ => return Err(refuse(key, "an RNG state stored in pieces; it is read whole")),
    };
    let path = source.checkpoint.dir.join(&*chunk.file);
    let f = File::open(&path).map_err(|error| {
        TrainingError::Checkpoint(crate::checkpoint::CheckpointError::Io { path: path.clone(), action: "open", error })
    })?;
    let mut bytes = vec![0u8; len as usize];
    f.read_exact_at(&mut bytes, chunk.data_offset).map_err(|error| {
        TrainingError::Checkpoint(crate::checkpoint::CheckpointError::Io { path, action: "read RNG state", error })
    })?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pickle::loads;

    #[test]
    fn a_tensor_pickles_as_torch_save_writes_it_and_reads_back() {
        let v = tensor_value(DType::U8, &[5056], "0").unwrap();
        assert!(is_tensor_value(&v));
        let back = loads(&dumps(&v).unwrap()).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn leaves_are_put_back_where_dcp_flattened_them() {
        let mut root = Value::List(Vec::new());
        let p = |parts: &[&str]| -> Vec<PathElem> {
            parts.iter().map(|s| s.parse::<u64>().map_or(PathElem::Key(s.to_string()), PathElem::Index)).collect()
        };
        insert(&mut root, &p(&["0", "random_rng_state"]), Value::Int(1)).unwrap();
        insert(&mut root, &p(&["0", "rng_tracker_states", "model-parallel-rng"]), Value::Int(2)).unwrap();
        insert(&mut root, &p(&["0", "np_rng_state"]), Value::Int(3)).unwrap();
        let s = |x: &str| Value::Str(x.to_string());
        let want = Value::List(vec![Value::Dict(vec![
            (s("random_rng_state"), Value::Int(1)),
            (s("rng_tracker_states"), Value::Dict(vec![(s("model-parallel-rng"), Value::Int(2))])),
            (s("np_rng_state"), Value::Int(3)),
        ])]);
        assert_eq!(root, want);
        let mut leaves = Vec::new();
        flatten(Vec::new(), &want, &mut leaves).unwrap();
        let keys: Vec<String> = leaves.iter().map(|(p, _)| flat_key(p)).collect();
        // A list of plain values is one leaf; a list of dicts is descended into.
        assert_eq!(keys, ["0.random_rng_state", "0.rng_tracker_states.model-parallel-rng", "0.np_rng_state"]);
        let ints = Value::List(vec![Value::Int(1)]);
        let mut plain = Vec::new();
        flatten(Vec::new(), &ints, &mut plain).unwrap();
        assert_eq!(plain.len(), 1);
        assert!(plain[0].0.is_empty());
    }

    #[test]
    fn a_non_list_rng_state_is_refused() {
        let o = StoredObject { key: "rng_state/shard_0.0_1.1".into(), file: "f".into(), offset: 0, length: 0 };
        let f = File::open("/dev/null").unwrap();
        let err = read_rng_object(&o, &f, &Value::Int(1), "(0, 0)").err().unwrap();
        assert!(err.to_string().contains("not Megatron's `[rng_state_list]`"), "{err}");
    }
}
