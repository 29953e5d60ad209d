//! Opening a DCP checkpoint (`.metadata` + rank files): `.metadata` is streamed item by item,
//! never held whole or decoded into a second copy, and each chunk is kept once as its box and
//! where its bytes are (file names shared, not copied per chunk). Then every kept chunk's
//! `torch.save` framing is read strictly from its rank file, through a few cached blocks.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use crate::dcp_metadata::{
    read_metadata_file, ChunkMeta, DcpMetadataError, EntryMeta, MetadataItem, PathElem, StorageInfo, StorageKey,
};
use crate::torch_save::{read_object_archive, read_tensor_archive_with, SpecCache};

use super::{io_err, safe_name, BlockReader, Checkpoint, CheckpointError, CheckpointFormat};
use super::{StoredChunk, StoredObject, StoredTensor};

/// Where a storage item says a chunk's (or a bytes item's) archive is.
#[derive(Clone, Copy)]
struct Located {
    file: u32,
    offset: u64,
    length: u64,
}

/// A kept tensor while `.metadata` streams: its chunks as declared, and their storage once found.
struct PendingTensor {
    key: String,
    dtype: shardline_layout::DType,
    shape: Vec<u64>,
    chunks: Vec<ChunkMeta>,
    located: Vec<Option<Located>>,
    /// Chunk indices sorted by offsets, built when the first storage item of the tensor arrives.
    by_offsets: Vec<u32>,
}

enum Slot {
    Tensor(usize),
    Object(usize),
    /// A key `keep` refused: its storage items are checked to name it, nothing more.
    Skipped,
}

#[derive(Default)]
struct Collector<'k> {
    keep: Option<&'k dyn Fn(&str) -> bool>,
    slots: HashMap<String, Slot>,
    tensors: Vec<PendingTensor>,
    objects: Vec<(String, Option<Located>)>,
    planner_data: BTreeMap<String, Vec<PathElem>>,
    /// Every file a storage item names, once; `Located::file` indexes it.
    files: Vec<Arc<str>>,
    file_index: HashMap<Arc<str>, u32>,
}

impl Collector<'_> {
    fn keeps(&self, key: &str) -> bool {
        self.keep.is_none_or(|k| k(key))
    }

    fn item(&mut self, item: MetadataItem) -> Result<(), CheckpointError> {
        match item {
            MetadataItem::Entry(key, entry) => {
                let slot = match entry {
                    _ if !self.keeps(&key) => Slot::Skipped,
                    EntryMeta::Bytes => {
                        self.objects.push((key.clone(), None));
                        Slot::Object(self.objects.len() - 1)
                    }
                    EntryMeta::Tensor { dtype, size, chunks } => {
                        let located = vec![None; chunks.len()];
                        let t = PendingTensor {
                            key: key.clone(),
                            dtype,
                            shape: size,
                            chunks,
                            located,
                            by_offsets: Vec::new(),
                        };
                        self.tensors.push(t);
                        Slot::Tensor(self.tensors.len() - 1)
                    }
                };
                self.slots.insert(key, slot);
            }
            MetadataItem::PlannerPath(key, path) => {
                if self.keeps(&key) {
                    self.planner_data.insert(key, path);
                }
            }
            // `storage_data` follows `state_dict_metadata` (the order of `Metadata`'s fields,
            // which its pickle keeps): a storage item's entry has been read.
            MetadataItem::Storage(key, info) => self.locate(key, info)?,
        }
        Ok(())
    }

    fn file(&mut self, name: String) -> Result<u32, CheckpointError> {
        if let Some(&i) = self.file_index.get(name.as_str()) {
            return Ok(i);
        }
        safe_name(&name)?;
        let name: Arc<str> = name.into();
        let i = u32::try_from(self.files.len()).unwrap_or(u32::MAX);
        self.files.push(name.clone());
        self.file_index.insert(name, i);
        Ok(i)
    }

    fn locate(&mut self, key: StorageKey, info: StorageInfo) -> Result<(), CheckpointError> {
        let inconsistent = |key: &StorageKey, message: String| CheckpointError::Inconsistent {
            key: key.fqn.clone(),
            offsets: key.offset.clone().unwrap_or_default(),
            message,
        };
        if info.transform_descriptors.as_ref().is_some_and(|t| !t.is_empty()) {
            let message =
                format!("stored with transforms {:?}, which this reader does not undo", info.transform_descriptors);
            return Err(inconsistent(&key, message));
        }
        let not_named = "storage_data has an item that no chunk of state_dict_metadata names";
        let slot = match self.slots.get(&key.fqn) {
            Some(Slot::Skipped) => return Ok(()),
            Some(Slot::Tensor(i)) => Slot::Tensor(*i),
            Some(Slot::Object(i)) => Slot::Object(*i),
            None => {
                return Err(inconsistent(
                    &key,
                    "storage_data names a key that state_dict_metadata does not have".into(),
                ))
            }
        };
        let here = Located { file: self.file(info.relative_path)?, offset: info.offset, length: info.length };
        let target = match (slot, &key.offset) {
            (Slot::Object(i), None) => &mut self.objects[i].1,
            (Slot::Tensor(i), Some(offsets)) => {
                let t = &mut self.tensors[i];
                if t.by_offsets.is_empty() {
                    t.by_offsets = (0..t.chunks.len() as u32).collect();
                    let chunks = &t.chunks;
                    t.by_offsets.sort_by(|a, b| chunks[*a as usize].offsets.cmp(&chunks[*b as usize].offsets));
                }
                let found =
                    t.by_offsets.binary_search_by(|c| t.chunks[*c as usize].offsets.as_slice().cmp(offsets.as_slice()));
                match found {
                    Ok(at) => &mut t.located[t.by_offsets[at] as usize],
                    Err(_) => return Err(inconsistent(&key, not_named.into())),
                }
            }
            _ => return Err(inconsistent(&key, not_named.into())),
        };
        if target.is_some() {
            return Err(inconsistent(&key, "storage_data names this item twice".into()));
        }
        *target = Some(here);
        Ok(())
    }
}

/// Why the stream of `.metadata` items stopped: the file, or what an item says.
pub(super) enum Stop {
    Metadata(DcpMetadataError),
    Checkpoint(CheckpointError),
}

impl From<DcpMetadataError> for Stop {
    fn from(e: DcpMetadataError) -> Stop {
        Stop::Metadata(e)
    }
}

/// Opens the DCP checkpoint in `dir`, keeping the keys `keep` accepts (all, for `None`).
pub(super) fn open_dcp(dir: &Path, keep: Option<&dyn Fn(&str) -> bool>) -> Result<Checkpoint, CheckpointError> {
    open_dcp_as(dir, keep, true)
}

/// [`open_dcp`] where, unless `locate`, no tensor chunk's framing is read: each chunk's
/// `data_offset`/`data_len` stand for its whole storage item until [`locate_chunks`] finds its
/// bytes (a reader of a sparse local copy of a checkpoint holding only the items it needs).
pub(super) fn open_dcp_as(
    dir: &Path,
    keep: Option<&dyn Fn(&str) -> bool>,
    locate: bool,
) -> Result<Checkpoint, CheckpointError> {
    let md_path = dir.join(".metadata");
    let mut c = Collector { keep, ..Collector::default() };
    read_metadata_file(&md_path, |item| c.item(item).map_err(Stop::Checkpoint)).map_err(|e| match e {
        Stop::Metadata(source) => CheckpointError::Metadata { path: md_path.clone(), source },
        Stop::Checkpoint(e) => e,
    })?;

    let mut open_files = Vec::with_capacity(c.files.len());
    for name in &c.files {
        let p = dir.join(&**name);
        open_files.push(File::open(&p).map_err(io_err(&p, "open rank file"))?);
    }
    let mut file_sizes = Vec::with_capacity(open_files.len());
    for (f, name) in open_files.iter().zip(&c.files) {
        file_sizes.push(f.metadata().map_err(io_err(&dir.join(&**name), "stat rank file"))?.len());
    }
    // An item reaching past its file's end (a rank file cut short) is named as such, before its
    // archive's framing is read, in the words `scan_checkpoint` uses.
    let within = |key: &str, offsets: &[u64], at: &Located| -> Result<(), CheckpointError> {
        let size = file_sizes[at.file as usize];
        if at.offset.checked_add(at.length).is_none_or(|end| end > size) {
            return Err(CheckpointError::Inconsistent {
                key: key.to_string(),
                offsets: offsets.to_vec(),
                message: format!(
                    "stored at bytes {}..+{} of {}, which has {size} bytes",
                    at.offset, at.length, c.files[at.file as usize]
                ),
            });
        }
        Ok(())
    };
    let readers: Vec<BlockReader<'_>> = open_files.iter().map(BlockReader::new).collect();
    let mut objects = Vec::with_capacity(c.objects.len());
    for (key, at) in c.objects {
        let Some(at) = at else {
            return Err(CheckpointError::MissingStorage { key, offsets: Vec::new() });
        };
        within(&key, &[], &at)?;
        let file = c.files[at.file as usize].clone();
        // A bytes item must load too: its archive and pickle are read strictly.
        read_object_archive(&readers[at.file as usize], at.offset, at.length).map_err(|source| {
            CheckpointError::Item {
                key: key.clone(),
                offsets: Vec::new(),
                file: file.to_string(),
                offset: at.offset,
                length: at.length,
                source,
            }
        })?;
        objects.push(StoredObject { key, file, offset: at.offset, length: at.length });
    }
    let mut specs = SpecCache::default();
    let mut tensors = Vec::with_capacity(c.tensors.len());
    for t in c.tensors {
        let mut stored = Vec::with_capacity(t.chunks.len());
        for (chunk, at) in t.chunks.into_iter().zip(t.located) {
            let Some(at) = at else {
                return Err(CheckpointError::MissingStorage { key: t.key, offsets: chunk.offsets });
            };
            within(&t.key, &chunk.offsets, &at)?;
            let file = &c.files[at.file as usize];
            if !locate {
                let (data_offset, data_len) = (at.offset, at.length);
                stored.push(StoredChunk {
                    offsets: chunk.offsets,
                    sizes: chunk.sizes,
                    file: file.clone(),
                    data_offset,
                    data_len,
                });
                continue;
            }
            let archive = read_tensor_archive_with(&readers[at.file as usize], at.offset, at.length, &mut specs)
                .map_err(|source| CheckpointError::Item {
                    key: t.key.clone(),
                    offsets: chunk.offsets.clone(),
                    file: file.to_string(),
                    offset: at.offset,
                    length: at.length,
                    source,
                })?;
            if archive.dtype != t.dtype || archive.shape != chunk.sizes {
                return Err(CheckpointError::Inconsistent {
                    key: t.key,
                    offsets: chunk.offsets,
                    message: format!(
                        "item holds {} {:?} but .metadata declares {} {:?}",
                        archive.dtype, archive.shape, t.dtype, chunk.sizes
                    ),
                });
            }
            stored.push(StoredChunk {
                offsets: chunk.offsets,
                sizes: chunk.sizes,
                file: file.clone(),
                data_offset: at.offset + archive.data_offset_in_item,
                data_len: archive.data_len,
            });
        }
        tensors.push(StoredTensor { key: t.key, dtype: t.dtype, shape: t.shape, chunks: stored });
    }
    tensors.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        format: CheckpointFormat::Dcp,
        tensors,
        objects,
        planner_data: c.planner_data,
    })
}

/// Finds the bytes of chunks `wanted` (`(tensor, chunk)` indices) of a checkpoint opened with
/// [`open_dcp_as`] without locating them: each one's framing is read strictly from its storage
/// item, checked against what `.metadata` declares, and its `data_offset`/`data_len` set — all of
/// them or, on an error, none.
pub fn locate_chunks(checkpoint: &mut Checkpoint, wanted: &[(usize, usize)]) -> Result<(), CheckpointError> {
    let mut files: HashMap<Arc<str>, File> = HashMap::new();
    let mut specs = SpecCache::default();
    let mut found = Vec::with_capacity(wanted.len());
    for &(ti, ci) in wanted {
        let t = &checkpoint.tensors[ti];
        let chunk = &t.chunks[ci];
        let (offset, length) = (chunk.data_offset, chunk.data_len);
        if !files.contains_key(&chunk.file) {
            let p = checkpoint.dir.join(&*chunk.file);
            files.insert(chunk.file.clone(), File::open(&p).map_err(io_err(&p, "open rank file"))?);
        }
        let reader = BlockReader::new(&files[&chunk.file]);
        let archive =
            read_tensor_archive_with(&reader, offset, length, &mut specs).map_err(|source| CheckpointError::Item {
                key: t.key.clone(),
                offsets: chunk.offsets.clone(),
                file: chunk.file.to_string(),
                offset,
                length,
                source,
            })?;
        if archive.dtype != t.dtype || archive.shape != chunk.sizes {
            return Err(CheckpointError::Inconsistent {
                key: t.key.clone(),
                offsets: chunk.offsets.clone(),
                message: format!(
                    "item holds {} {:?} but .metadata declares {} {:?}",
                    archive.dtype, archive.shape, t.dtype, chunk.sizes
                ),
            });
        }
        found.push((offset + archive.data_offset_in_item, archive.data_len));
    }
    for (&(ti, ci), (data_offset, data_len)) in wanted.iter().zip(found) {
        let chunk = &mut checkpoint.tensors[ti].chunks[ci];
        (chunk.data_offset, chunk.data_len) = (data_offset, data_len);
    }
    Ok(())
}
