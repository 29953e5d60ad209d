//! Writing `.metadata`: [`MetadataEncoder`] streams the pickle section by section.

use shardline_layout::DType;

use super::{EntryMeta, Metadata, PathElem, FS_MODULE, MD_MODULE};
use crate::pickle::PickleWriter;

// Encoding

/// `GLOBAL cls; EMPTY_TUPLE; NEWOBJ`: a dataclass instance before its state.
pub(super) fn new_instance(w: &mut PickleWriter, module: &str, class: &str) {
    w.global(module, class).empty_tuple().newobj();
}

/// `torch.Size(dims)`: `GLOBAL torch Size; ((d0, d1, ...),); REDUCE`.
pub(super) fn write_size(w: &mut PickleWriter, dims: &[u64]) {
    w.global("torch", "Size").int_tuple(dims).tuple1().reduce();
}

pub(super) fn write_tensor_properties(w: &mut PickleWriter, dtype: DType) {
    new_instance(w, MD_MODULE, "TensorProperties");
    // (dtype, layout, requires_grad, memory_format, pin_memory): exactly 5 values, which every
    // torch from 2.5 on unpacks (2.15's 6th value, strides, breaks torch <= 2.11).
    w.mark()
        .global("torch", dtype.torch_name())
        .global("torch", "strided")
        .bool(false)
        .global(MD_MODULE, "_MEM_FORMAT_ENCODING")
        .int(0)
        .tuple1()
        .reduce()
        .bool(false)
        .tuple();
    w.build();
}

/// A `state_dict_metadata` entry, borrowed: what [`MetadataEncoder::entry`] writes.
pub enum EntryRef<'a, C> {
    /// `TensorStorageMetadata`; `chunks` yields `(offsets, sizes)` of each saved chunk.
    Tensor {
        dtype: DType,
        size: &'a [u64],
        chunks: C,
    },
    Bytes,
}

/// A `storage_data` item, borrowed: what [`MetadataEncoder::storage`] writes.
pub struct StorageRef<'a> {
    pub fqn: &'a str,
    /// Chunk offsets (`None` for a bytes item).
    pub chunk_offset: Option<&'a [u64]>,
    pub relative_path: &'a str,
    pub offset: u64,
    pub length: u64,
    pub transform_descriptors: Option<&'a [String]>,
}

/// Bytes the encoder gathers before handing them to its sink.
pub(super) const ENCODER_FLUSH_BYTES: usize = 256 << 10;

/// Writes a `.metadata` pickle (protocol 2, loadable by torch 2.5 through 2.15) to a sink
/// section by section, in the order the sections must appear: every [`entry`](Self::entry), then
/// [`begin_planner_data`](Self::begin_planner_data) and its paths, then
/// [`begin_storage_data`](Self::begin_storage_data) and its items, then [`finish`](Self::finish).
///
/// Memory stays bounded by one flush buffer however many chunks the checkpoint has: the caller
/// streams borrowed views of its own plan instead of building a [`Metadata`] first.
pub struct MetadataEncoder<W: std::io::Write> {
    w: PickleWriter,
    sink: W,
    /// Whether the open dict (or list) has items, i.e. whether its `MARK` was written.
    open_items: bool,
}

impl<W: std::io::Write> MetadataEncoder<W> {
    /// Starts the pickle and the `state_dict_metadata` dict.
    pub fn new(sink: W) -> Self {
        let mut w = PickleWriter::new();
        w.proto(2);
        new_instance(&mut w, MD_MODULE, "Metadata");
        w.empty_dict().mark();
        w.str("state_dict_metadata").empty_dict();
        MetadataEncoder { w, sink, open_items: false }
    }

    /// `MARK` before the first item of the open dict: an empty dict is a bare `EMPTY_DICT`.
    fn item(&mut self) {
        if !self.open_items {
            self.w.mark();
            self.open_items = true;
        }
    }

    /// Closes the open dict with `SETITEMS` if it has items.
    fn close_dict(&mut self) {
        if std::mem::take(&mut self.open_items) {
            self.w.setitems();
        }
    }

    fn flush_if_full(&mut self) -> std::io::Result<()> {
        if self.w.as_bytes().len() >= ENCODER_FLUSH_BYTES {
            // Each flush also ends the open `SETITEMS` batch (the next item opens another), as
            // CPython batches its dicts: a streaming reader then holds one batch, not the file.
            self.close_dict();
            self.w.drain_into(&mut self.sink)?;
        }
        Ok(())
    }

    /// One `state_dict_metadata` entry.
    pub fn entry<'c, C>(&mut self, fqn: &str, entry: EntryRef<'_, C>) -> std::io::Result<()>
    where
        C: IntoIterator<Item = (&'c [u64], &'c [u64])>,
    {
        self.item();
        let w = &mut self.w;
        w.str(fqn);
        match entry {
            EntryRef::Tensor { dtype, size, chunks } => {
                new_instance(w, MD_MODULE, "TensorStorageMetadata");
                w.empty_dict().mark();
                w.str("properties");
                write_tensor_properties(w, dtype);
                w.str("size");
                write_size(w, size);
                w.str("chunks").empty_list();
                let mut any = false;
                for (offsets, sizes) in chunks {
                    if !any {
                        w.mark();
                        any = true;
                    }
                    new_instance(w, MD_MODULE, "ChunkStorageMetadata");
                    w.empty_dict().mark().str("offsets");
                    write_size(w, offsets);
                    w.str("sizes");
                    write_size(w, sizes);
                    w.setitems().build();
                }
                if any {
                    w.appends();
                }
                w.setitems().build();
            }
            EntryRef::Bytes => new_instance(w, MD_MODULE, "BytesStorageMetadata"),
        }
        self.flush_if_full()
    }

    /// Ends `state_dict_metadata` and opens `planner_data`, which is always present: torch
    /// 2.5-2.7's dcp_to_torch_save and FSDP1's optimizer loading index it.
    pub fn begin_planner_data(&mut self) {
        self.close_dict();
        self.w.str("planner_data").empty_dict();
    }

    /// One `planner_data` item: `fqn` → its path in the nested state dict.
    pub fn planner_path(&mut self, fqn: &str, path: &[PathElem]) -> std::io::Result<()> {
        self.item();
        let w = &mut self.w;
        w.str(fqn).mark();
        for p in path {
            match p {
                PathElem::Key(k) => w.str(k),
                PathElem::Index(i) => w.int((*i).into()),
            };
        }
        w.tuple();
        self.flush_if_full()
    }

    /// Ends `planner_data` and opens `storage_data`.
    pub fn begin_storage_data(&mut self) {
        self.close_dict();
        self.w.str("storage_data").empty_dict();
    }

    /// One `storage_data` item: a `MetadataIndex` → `_StorageInfo`.
    pub fn storage(&mut self, item: &StorageRef<'_>) -> std::io::Result<()> {
        self.item();
        let w = &mut self.w;
        new_instance(w, MD_MODULE, "MetadataIndex");
        w.empty_dict().mark().str("fqn").str(item.fqn);
        if let Some(offset) = item.chunk_offset {
            w.str("offset");
            write_size(w, offset);
        }
        w.setitems().build();

        new_instance(w, FS_MODULE, "_StorageInfo");
        w.empty_dict().mark();
        w.str("relative_path").str(item.relative_path);
        w.str("offset").int(item.offset.into());
        w.str("length").int(item.length.into());
        if let Some(tds) = item.transform_descriptors {
            w.str("transform_descriptors").empty_list();
            if !tds.is_empty() {
                w.mark();
                for t in tds {
                    w.str(t);
                }
                w.appends();
            }
        }
        w.setitems().build();
        self.flush_if_full()
    }

    /// Ends `storage_data`, writes `version` if given, closes the pickle and returns the sink
    /// with every byte handed to it.
    pub fn finish(mut self, version: Option<&str>) -> std::io::Result<W> {
        self.close_dict();
        if let Some(v) = version {
            self.w.str("version").str(v);
        }
        self.w.setitems().build().stop();
        self.w.drain_into(&mut self.sink)?;
        Ok(self.sink)
    }
}

/// Streams `md` through `encoder`'s sections (the one encoder; [`encode_metadata`] is this into
/// a byte vector).
pub(super) fn write_metadata<W: std::io::Write>(md: &Metadata, mut e: MetadataEncoder<W>) -> std::io::Result<W> {
    for (fqn, entry) in &md.state_dict_metadata {
        let entry = match entry {
            EntryMeta::Tensor { dtype, size, chunks } => EntryRef::Tensor {
                dtype: *dtype,
                size,
                chunks: chunks.iter().map(|c| (c.offsets.as_slice(), c.sizes.as_slice())),
            },
            EntryMeta::Bytes => EntryRef::Bytes,
        };
        e.entry(fqn, entry)?;
    }
    e.begin_planner_data();
    for (fqn, path) in &md.planner_data {
        e.planner_path(fqn, path)?;
    }
    e.begin_storage_data();
    for (key, info) in &md.storage_data {
        e.storage(&StorageRef {
            fqn: &key.fqn,
            chunk_offset: key.offset.as_deref(),
            relative_path: &info.relative_path,
            offset: info.offset,
            length: info.length,
            transform_descriptors: info.transform_descriptors.as_deref(),
        })?;
    }
    e.finish(md.version.as_deref())
}

/// The `.metadata` pickle of `md` (protocol 2, loadable by torch 2.5 through 2.15).
pub fn encode_metadata(md: &Metadata) -> Vec<u8> {
    // Writing to a Vec cannot fail.
    write_metadata(md, MetadataEncoder::new(Vec::new())).unwrap_or_default()
}
