//! Checking one stored item: read as torch reads it, its box recorded, its bytes compared with
//! the release's, streamed piece by piece.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::keys::{fits, BoxSet, KeyInfo, Want};
use super::{Finding, VerifyError};
use crate::execute::{stream_chunk, Progress, SourceMap};
use crate::torch_save::{read_object_archive, read_tensor_archive_with, ArchivedTensor, SpecCache};

/// Items up to this size are read whole with one read and parsed from memory.
const WHOLE_ITEM_MAX: u64 = 1 << 20;
/// Bytes compared per piece.
const PIECE: usize = 1 << 20;
/// Findings kept per worker (the count goes on).
const MAX_FINDINGS: usize = 1000;

/// Where an item's bytes are.
pub(super) enum Location {
    /// A `torch.save` archive at `[offset, offset + length)` of a DCP rank file.
    Archive { offset: u64, length: u64 },
    /// Raw tensor bytes of a DCP-safetensors file, of the given box sizes.
    Raw { data_offset: u64, sizes: Vec<u64> },
}

/// One `storage_data` item (or safetensors tensor) to check.
pub(super) struct Job {
    pub key: Arc<KeyInfo>,
    /// Chunk offsets; `None` for a bytes item.
    pub offsets: Option<Vec<u64>>,
    pub file: Arc<str>,
    pub location: Location,
}

/// A checking thread's state: open files, buffers, and what it found.
pub(super) struct Worker<'a> {
    dir: &'a Path,
    sources: &'a SourceMap,
    progress: &'a Progress,
    files: HashMap<Arc<str>, Arc<File>>,
    specs: SpecCache,
    item: Vec<u8>,
    expected: Vec<u8>,
    actual: Vec<u8>,
    /// The boxes found, by key index.
    pub found: Vec<BoxSet>,
    pub findings: Vec<Finding>,
    pub findings_dropped: u64,
    pub bytes: u64,
}

impl<'a> Worker<'a> {
    pub fn new(dir: &'a Path, sources: &'a SourceMap, progress: &'a Progress) -> Self {
        Worker {
            dir,
            sources,
            progress,
            files: HashMap::new(),
            specs: SpecCache::default(),
            item: Vec::new(),
            expected: vec![0; PIECE],
            actual: vec![0; PIECE],
            found: Vec::new(),
            findings: Vec::new(),
            findings_dropped: 0,
            bytes: 0,
        }
    }

    fn found_for(&mut self, index: u32) -> &mut BoxSet {
        let i = index as usize;
        if self.found.len() <= i {
            self.found.resize(i + 1, BoxSet::default());
        }
        &mut self.found[i]
    }

    fn find(&mut self, key: &str, message: String) {
        if self.findings.len() < MAX_FINDINGS {
            self.findings.push(Finding { key: key.to_string(), message });
        } else {
            self.findings_dropped += 1;
        }
    }

    fn file(&mut self, name: &Arc<str>) -> Result<Arc<File>, String> {
        if let Some(f) = self.files.get(name) {
            return Ok(f.clone());
        }
        let p = self.dir.join(&**name);
        let f = Arc::new(File::open(&p).map_err(|e| format!("cannot open {}: {e}", p.display()))?);
        self.files.insert(name.clone(), f.clone());
        Ok(f)
    }

    /// Checks `job`; problems become findings, only failures of the release stop validation.
    pub fn check(&mut self, job: Job) -> Result<(), VerifyError> {
        if let Err(message) = self.check_item(&job) {
            let what = match &job.offsets {
                Some(o) => format!("chunk offsets {o:?} in {}", job.file),
                None => format!("bytes item in {}", job.file),
            };
            self.find(&job.key.fqn, format!("{what}: {message}"));
        }
        Ok(())
    }

    fn check_item(&mut self, job: &Job) -> Result<(), String> {
        let key = &job.key;
        let file = self.file(&job.file)?;
        let Some(offsets) = &job.offsets else {
            if key.want.is_some() || !key.shape.is_empty() || key.dtype != shardline_layout::DType::U8 {
                return Err("a tensor key stored without chunk offsets".into());
            }
            let Location::Archive { offset, length } = job.location else { return Err("not an archive".into()) };
            read_object_archive(&*file, offset, length).map_err(|e| e.to_string())?;
            self.found_for(key.index).add(&[], &[]);
            return Ok(());
        };
        let (sizes, data_at, in_memory) = match &job.location {
            Location::Archive { offset, length } => {
                let at = self.read_archive(&file, *offset, *length)?;
                if at.dtype != key.dtype {
                    return Err(format!("item holds {} but .metadata declares {}", at.dtype, key.dtype));
                }
                (
                    at.shape,
                    at.data_offset_in_item + if *length <= WHOLE_ITEM_MAX { 0 } else { *offset },
                    *length <= WHOLE_ITEM_MAX,
                )
            }
            Location::Raw { data_offset, sizes } => (sizes.clone(), *data_offset, false),
        };
        self.found_for(key.index).add(offsets, &sizes);
        if !fits(offsets, &sizes, &key.shape) {
            return Err(format!("sizes {sizes:?} do not fit global shape {:?}", key.shape));
        }
        let Some(want) = &key.want else { return Ok(()) };
        self.compare(want, offsets, &sizes, &file, data_at, in_memory)
    }

    /// Reads a tensor archive, whole into `self.item` when it is small.
    fn read_archive(&mut self, file: &File, offset: u64, length: u64) -> Result<ArchivedTensor, String> {
        if length > WHOLE_ITEM_MAX {
            return read_tensor_archive_with(file, offset, length, &mut self.specs).map_err(|e| e.to_string());
        }
        self.item.resize(length as usize, 0);
        file.read_exact_at(&mut self.item, offset).map_err(|e| format!("cannot read the item: {e}"))?;
        read_tensor_archive_with(&self.item[..], 0, length, &mut self.specs).map_err(|e| e.to_string())
    }

    /// Compares the stored box with the release's mapping of it.
    fn compare(
        &mut self,
        want: &Want,
        offsets: &[u64],
        sizes: &[u64],
        file: &File,
        data_at: u64,
        in_memory: bool,
    ) -> Result<(), String> {
        let mut cursor = 0u64;
        let mut mismatch: Option<u64> = None;
        let mut io_error: Option<String> = None;
        let (item, actual, progress) = (&self.item, &mut self.actual, self.progress);
        let mut compare_piece = |piece: &[u8]| {
            let got: &[u8] = if in_memory {
                let start = (data_at + cursor) as usize;
                match item.get(start..start + piece.len()) {
                    Some(g) => g,
                    None => {
                        io_error.get_or_insert_with(|| "stored bytes run past the item".into());
                        return Ok(());
                    }
                }
            } else {
                let buf = &mut actual[..piece.len()];
                if let Err(e) = file.read_exact_at(buf, data_at + cursor) {
                    io_error.get_or_insert_with(|| format!("cannot read stored bytes: {e}"));
                    return Ok(());
                }
                buf
            };
            // Slice equality is a memcmp; the position is looked for only when they differ.
            if mismatch.is_none() && got != piece {
                let p = got.iter().zip(piece).position(|(a, b)| a != b).unwrap_or(0);
                mismatch = Some(cursor + p as u64);
            }
            cursor += piece.len() as u64;
            progress.bytes_written.fetch_add(piece.len() as u64, Ordering::Relaxed);
            Ok(())
        };
        // A placed key's box meets its parts one after the other in the order of its bytes.
        for (t, off, sz) in want.pieces(offsets, sizes) {
            stream_chunk(t.view(), &off, &sz, self.sources, &mut self.expected, &mut compare_piece)
                .map_err(|e| format!("reading the release: {e}"))?;
        }
        if let Some(e) = io_error {
            return Err(e);
        }
        self.bytes += cursor;
        if let Some(byte) = mismatch {
            let elem = byte / want.dtype.size() as u64;
            // Chunk-local element index → global coordinates.
            let mut rem = elem;
            let mut coord = vec![0u64; sizes.len()];
            for d in (0..sizes.len()).rev() {
                coord[d] = offsets[d] + rem % sizes[d].max(1);
                rem /= sizes[d].max(1);
            }
            return Err(format!(
                "bytes differ from the source mapping at global index {coord:?} (sizes {sizes:?}, byte {byte} of the chunk)"
            ));
        }
        Ok(())
    }
}
