//! Dialects whose keys are not the planned tensors' (`torch_dist`): `.metadata` lists each
//! on-disk key once, with the chunks of every planned tensor placed in it, and the dialect's
//! objects (`_extra_state`) go in a small file per rank that holds any. The rank files' bytes
//! are those of the plain layout: a placed chunk only gains leading axes and an offset.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

use shardline_layout::dialect::{DiskLayout, ObjectItem};
use shardline_layout::{Chunk, DType, PlanTable};

use crate::dcp_metadata::{EntryRef, MetadataEncoder, PathElem, StorageRef};
use crate::torch_save::{encode_object_archive, PyObject};

use super::dcp::DcpLayout;
use super::*;

/// `torch.save([None])`: the payload of an `_extra_state` object, which Transformer Engine
/// modules (`set_extra_state(None)` is a no-op) and Megatron's own linears accept alike.
pub fn extra_state_payload() -> Vec<u8> {
    encode_object_archive(&PyObject::List(vec![PyObject::None]))
}

/// The file of `rank`'s objects (a second writer file of that rank, as Megatron-Core's
/// two-thread writer names its files).
pub fn object_file(rank: u64) -> String {
    format!("__{rank}_1.distcp")
}

/// The objects by the rank whose file holds them.
fn objects_by_rank(objects: &[ObjectItem]) -> BTreeMap<u64, Vec<&ObjectItem>> {
    let mut by_rank: BTreeMap<u64, Vec<&ObjectItem>> = BTreeMap::new();
    for o in objects {
        by_rank.entry(o.rank).or_default().push(o);
    }
    by_rank
}

/// Where each object is stored: `(object, file, offset, length)`.
pub fn object_storage(objects: &[ObjectItem]) -> impl Iterator<Item = (&ObjectItem, String, u64, u64)> {
    let len = extra_state_payload().len() as u64;
    objects_by_rank(objects).into_iter().flat_map(move |(rank, items)| {
        let name = object_file(rank);
        items.into_iter().enumerate().map(move |(k, o)| (o, name.clone(), k as u64 * len, len))
    })
}

/// Writes and syncs the object files into `out`.
pub fn write_object_files(objects: &[ObjectItem], out: &Path) -> Result<(), ExecuteError> {
    let payload = extra_state_payload();
    for (rank, items) in objects_by_rank(objects) {
        let path = out.join(object_file(rank));
        let mut f = File::create(&path).map_err(io_err(&path, "create object file"))?;
        for _ in items {
            f.write_all(&payload).map_err(io_err(&path, "write object file"))?;
        }
        f.sync_all().map_err(io_err(&path, "sync object file"))?;
    }
    Ok(())
}

/// One on-disk key: its dtype, global shape, and the planned tensors placed in it.
struct DiskKey {
    dtype: DType,
    shape: Vec<u64>,
    tensors: Vec<usize>,
}

/// A planned tensor, as a placed `.metadata` names it.
pub struct Planned<'a> {
    pub key: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
}

/// The entries of a placed layout and their flat planner paths (Megatron-Core saves a flat dict
/// of its keys): each on-disk key once, with the placed written chunks of every planned tensor in
/// it (`chunks(i)`: tensor `i`'s, in its own coordinates), then the layout's objects and the
/// bytes items `more_objects` (a reshard's RNG states). The encoder is left at the storage data.
pub fn placed_entries<W: io::Write, C: Iterator<Item = Chunk>>(
    e: &mut MetadataEncoder<W>,
    disk: &DiskLayout,
    tensors: &[Planned<'_>],
    chunks: impl Fn(usize) -> C,
    more_objects: &[&str],
) -> io::Result<()> {
    let mut keys: BTreeMap<String, DiskKey> = BTreeMap::new();
    for (i, t) in tensors.iter().enumerate() {
        let place = disk.place(t.key, t.shape);
        let entry = keys.entry(place.key.into_owned()).or_insert_with(|| DiskKey {
            dtype: t.dtype,
            shape: place.shape.clone(),
            tensors: Vec::new(),
        });
        if entry.dtype != t.dtype || entry.shape != place.shape {
            return Err(io::Error::other(format!(
                "internal error: `{}` is placed in a key of another dtype or shape ({:?} {:?} vs {:?} {:?})",
                t.key, t.dtype, place.shape, entry.dtype, entry.shape
            )));
        }
        entry.tensors.push(i);
    }
    for (key, k) in &keys {
        let mut listed: Vec<(u64, Vec<u64>, Vec<u64>)> = Vec::new();
        for &i in &k.tensors {
            let place = disk.place(tensors[i].key, tensors[i].shape);
            for c in chunks(i).filter(|c| c.written && c.numel() > 0) {
                let (off, sz) = place.chunk(&c.offsets, &c.sizes);
                listed.push((c.rank, off, sz));
            }
        }
        listed.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let chunks = listed.iter().map(|(_, o, s)| (o.as_slice(), s.as_slice()));
        e.entry(key, EntryRef::Tensor { dtype: k.dtype, size: &k.shape, chunks })?;
    }
    let objects = || disk.objects().iter().map(|o| o.key.as_str()).chain(more_objects.iter().copied());
    for key in objects() {
        e.entry(key, EntryRef::<std::iter::Empty<(&[u64], &[u64])>>::Bytes)?;
    }
    e.begin_planner_data();
    for key in keys.keys().map(String::as_str).chain(objects()) {
        e.planner_path(key, &[PathElem::Key(key.to_string())])?;
    }
    e.begin_storage_data();
    Ok(())
}

/// The storage entries of a layout's objects, in their object files.
pub fn object_storage_entries<W: io::Write>(e: &mut MetadataEncoder<W>, objects: &[ObjectItem]) -> io::Result<()> {
    for (o, file, offset, length) in object_storage(objects) {
        e.storage(&StorageRef {
            fqn: &o.key,
            chunk_offset: None,
            relative_path: &file,
            offset,
            length,
            transform_descriptors: None,
        })?;
    }
    Ok(())
}

/// Streams the `.metadata` of a placed layout to `sink`.
pub(super) fn write_placed_metadata<W: io::Write>(layout: &DcpLayout, plan: &PlanTable, sink: W) -> io::Result<W> {
    let tensors: Vec<Planned<'_>> =
        plan.tensors().map(|t| Planned { key: t.key, dtype: t.dtype, shape: t.shape }).collect();
    let mut e = MetadataEncoder::new(sink);
    placed_entries(&mut e, &plan.disk, &tensors, |i| plan.tensor(i).chunks(&plan.mesh), &[])?;
    for rank in 0..layout.world() {
        let name = dcp_rank_file(rank as u64);
        for item in layout.rank(plan, rank) {
            let t = plan.tensor(item.tensor);
            let place = plan.disk.place(t.key, t.shape);
            let (off, _) = place.chunk(&item.chunk.offsets, &item.chunk.sizes);
            e.storage(&StorageRef {
                fqn: &place.key,
                chunk_offset: Some(&off),
                relative_path: &name,
                offset: item.offset,
                length: item.length,
                transform_descriptors: None,
            })?;
        }
    }
    object_storage_entries(&mut e, plan.disk.objects())?;
    e.finish(None)
}
