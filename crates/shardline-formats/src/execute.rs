//! Executes a plan: streams every written chunk from the release into its rank file, with
//! bounded memory, each source byte read once and each output byte written once.
//!
//! Rank files are independent (the plan says everything), so they are written in parallel by a
//! small pool of threads, each holding one fixed-size buffer. A DCP checkpoint becomes visible
//! only when `.metadata` is renamed into place, after every rank file is complete and synced.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use shardline_layout::recipe::{apply_transform, segments, Segment};
use shardline_layout::{OutputTensor, Plan};
use thiserror::Error;

use crate::dcp_metadata::{self, ChunkMeta, EntryMeta, Metadata, PathElem, StorageInfo, StorageKey};
use crate::safetensors::{FileLayout, Release, SafetensorsError, SafetensorsWriter};
use crate::torch_save::TensorArchive;

/// The checkpoint layouts Shardline writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// `.metadata` + `__<rank>_0.distcp` (torch.save items): what Megatron `fsdp_dtensor` loads.
    Dcp,
    /// One safetensors file per rank with `DCP_SHARDING_INFO` (torch ≥ 2.9 `HuggingFaceStorageReader`).
    DcpSafetensors,
}

/// Knobs of the executor.
#[derive(Clone, Debug)]
pub struct ExecuteOptions {
    pub format: OutputFormat,
    /// Writer threads (rank files in flight at once).
    pub threads: usize,
    /// Bytes of the per-thread copy buffer.
    pub buffer_bytes: usize,
    /// Replace an existing checkpoint in the output directory.
    pub overwrite: bool,
}

impl Default for ExecuteOptions {
    fn default() -> Self {
        ExecuteOptions {
            format: OutputFormat::Dcp,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).max(2),
            buffer_bytes: 8 << 20,
            overwrite: false,
        }
    }
}

/// Why writing a checkpoint failed. Nothing that looks complete is left behind.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ExecuteError {
    #[error("{path}: {action}: {error}")]
    Io { path: PathBuf, action: &'static str, error: io::Error },
    #[error("{0} already holds a checkpoint (`{1}` exists); pass --overwrite to replace it")]
    Exists(PathBuf, &'static str),
    #[error("release tensor `{0}` named by the plan is not in the release")]
    MissingSource(String),
    #[error("release tensor `{name}` is {actual} in the release but {planned} in the plan")]
    SourceMismatch { name: String, planned: String, actual: String },
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error("cancelled")]
    Cancelled,
}

fn io_err<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> ExecuteError + 'a {
    move |error| ExecuteError::Io { path: path.to_path_buf(), action, error }
}

/// Counters a caller can watch while the executor runs (progress bars, task progress).
#[derive(Debug, Default)]
pub struct Progress {
    pub bytes_written: AtomicU64,
    pub chunks_written: AtomicU64,
    pub files_done: AtomicU64,
    /// Set to stop early (the partial output is removed).
    pub cancel: AtomicBool,
}

/// What was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteReport {
    pub files: Vec<PathBuf>,
    pub tensor_bytes: u64,
    pub file_bytes: u64,
    pub chunks: u64,
}

/// Where each plan source lives: `(file index, absolute data offset, byte length)`.
pub(crate) struct SourceMap {
    files: Vec<(PathBuf, File)>,
    locs: Vec<(usize, u64, u64)>,
}

impl SourceMap {
    pub(crate) fn new(plan: &Plan, release: &Release) -> Result<SourceMap, ExecuteError> {
        let mut files = Vec::new();
        for p in release.file_paths() {
            let f = File::open(p).map_err(io_err(p, "open release file"))?;
            files.push((p.to_path_buf(), f));
        }
        let mut locs = Vec::with_capacity(plan.sources.len());
        for s in &plan.sources {
            let t = release.tensor(&s.name).ok_or_else(|| ExecuteError::MissingSource(s.name.clone()))?;
            if t.info.dtype != s.dtype || t.info.shape != s.shape {
                return Err(ExecuteError::SourceMismatch {
                    name: s.name.clone(),
                    planned: format!("{} {:?}", s.dtype, s.shape),
                    actual: format!("{} {:?}", t.info.dtype, t.info.shape),
                });
            }
            locs.push((t.file_index, t.info.file_offset, t.info.byte_len));
        }
        Ok(SourceMap { files, locs })
    }

    /// Reads `buf.len()` bytes of source `id` at byte `offset` within the tensor.
    fn read(&self, id: usize, offset: u64, buf: &mut [u8]) -> Result<(), ExecuteError> {
        let (fi, start, len) = self.locs[id];
        debug_assert!(offset + buf.len() as u64 <= len);
        let (path, file) = &self.files[fi];
        file.read_exact_at(buf, start + offset).map_err(io_err(path, "read release tensor"))
    }
}

/// Streams the bytes of one chunk through `sink`, in bounded pieces.
pub(crate) fn stream_chunk(
    t: &OutputTensor,
    offsets: &[u64],
    sizes: &[u64],
    sources: &SourceMap,
    buf: &mut [u8],
    mut sink: impl FnMut(&[u8]) -> Result<(), ExecuteError>,
) -> Result<(), ExecuteError> {
    let item = t.dtype.size();
    // Keep pieces element-aligned so transforms see whole elements.
    let piece = (buf.len() / item).max(1) * item;
    for Segment { source, len, transform } in segments(&t.shape, t.dtype, &t.recipe, offsets, sizes) {
        let mut done = 0u64;
        while done < len {
            let n = ((len - done) as usize).min(piece);
            let b = &mut buf[..n];
            match source {
                Some((id, off)) => {
                    sources.read(id, off + done, b)?;
                    apply_transform(transform, t.dtype, b);
                }
                None => b.fill(0),
            }
            sink(b)?;
            done += n as u64;
        }
    }
    Ok(())
}

/// A sequential file writer with its own buffer that can patch bytes it already wrote.
struct RankFile {
    path: PathBuf,
    file: File,
    buf: Vec<u8>,
    flushed: u64,
}

impl RankFile {
    fn create(path: PathBuf, capacity: usize) -> Result<RankFile, ExecuteError> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io_err(&path, "create rank file"))?;
        Ok(RankFile { path, file, buf: Vec::with_capacity(capacity), flushed: 0 })
    }

    fn pos(&self) -> u64 {
        self.flushed + self.buf.len() as u64
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), ExecuteError> {
        if self.buf.len() + bytes.len() > self.buf.capacity() {
            self.flush()?;
        }
        if bytes.len() >= self.buf.capacity() {
            self.file.write_all_at(bytes, self.flushed).map_err(io_err(&self.path, "write rank file"))?;
            self.flushed += bytes.len() as u64;
        } else {
            self.buf.extend_from_slice(bytes);
        }
        Ok(())
    }

    /// Overwrites bytes at absolute `offset` (before the current position).
    fn patch(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ExecuteError> {
        if offset >= self.flushed {
            let at = (offset - self.flushed) as usize;
            self.buf[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(())
        } else {
            self.file.write_all_at(bytes, offset).map_err(io_err(&self.path, "patch rank file"))
        }
    }

    fn flush(&mut self) -> Result<(), ExecuteError> {
        if !self.buf.is_empty() {
            self.file.write_all_at(&self.buf, self.flushed).map_err(io_err(&self.path, "write rank file"))?;
            self.flushed += self.buf.len() as u64;
            self.buf.clear();
        }
        Ok(())
    }

    fn finish(mut self) -> Result<u64, ExecuteError> {
        self.flush()?;
        self.file.sync_all().map_err(io_err(&self.path, "sync rank file"))?;
        Ok(self.flushed)
    }
}

/// The DCP file name of a rank.
pub fn dcp_rank_file(rank: u64) -> String {
    format!("__{rank}_0.distcp")
}

/// The DCP-safetensors file name of a rank (torch's `HuggingFaceStorageWriter` naming).
pub fn dcp_safetensors_rank_file(rank: u64, world: u64) -> String {
    let _ = world;
    format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1)
}

/// `planner_data` path of a key: the top-level dict, then the rest (Megatron nests model keys as
/// `{"model": {"module.decoder…": t}}` and optimizer states as `{"optimizer": {"state": {param: {state: t}}}}`).
pub fn planner_path(key: &str) -> Vec<PathElem> {
    if let Some(rest) = key.strip_prefix("optimizer.state.") {
        if let Some((param, state)) = rest.rsplit_once('.') {
            return vec![
                PathElem::Key("optimizer".into()),
                PathElem::Key("state".into()),
                PathElem::Key(param.into()),
                PathElem::Key(state.into()),
            ];
        }
    }
    match key.split_once('.') {
        Some((top, rest)) => vec![PathElem::Key(top.into()), PathElem::Key(rest.into())],
        None => vec![PathElem::Key(key.into())],
    }
}

/// Runs `work(rank)` for every rank on `threads` threads; the first error wins and stops the rest.
fn for_each_rank<T: Send>(
    world: usize,
    threads: usize,
    progress: &Progress,
    work: impl Fn(usize) -> Result<T, ExecuteError> + Sync,
) -> Result<Vec<T>, ExecuteError> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..world).map(|_| None).collect());
    let first_error: Mutex<Option<ExecuteError>> = Mutex::new(None);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, world.max(1)) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) || progress.cancel.load(Ordering::Relaxed) {
                    return;
                }
                let rank = next.fetch_add(1, Ordering::Relaxed);
                if rank >= world {
                    return;
                }
                match work(rank) {
                    Ok(r) => {
                        if let Ok(mut g) = results.lock() {
                            g[rank] = Some(r);
                        }
                        progress.files_done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        failed.store(true, Ordering::Relaxed);
                        if let Ok(mut g) = first_error.lock() {
                            g.get_or_insert(e);
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(e);
    }
    if progress.cancel.load(Ordering::Relaxed) {
        return Err(ExecuteError::Cancelled);
    }
    Ok(results.into_inner().unwrap_or_default().into_iter().flatten().collect())
}

/// Prepares the output directory: refuses to clobber a checkpoint unless asked, and removes the
/// commit marker first so a half-replaced checkpoint never looks complete.
fn prepare_dir(out: &Path, format: OutputFormat, overwrite: bool) -> Result<(), ExecuteError> {
    fs::create_dir_all(out).map_err(io_err(out, "create output directory"))?;
    let marker = out.join(".metadata");
    let existing: Vec<PathBuf> = fs::read_dir(out)
        .map_err(io_err(out, "list output directory"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name == ".metadata" || name.ends_with(".distcp") || name.ends_with(".safetensors")
        })
        .collect();
    if !existing.is_empty() {
        if !overwrite {
            let what = if marker.exists() { ".metadata" } else { "rank files" };
            return Err(ExecuteError::Exists(out.to_path_buf(), what));
        }
        if marker.exists() {
            fs::remove_file(&marker).map_err(io_err(&marker, "remove old .metadata"))?;
        }
        for p in existing {
            if p != marker {
                fs::remove_file(&p).map_err(io_err(&p, "remove old rank file"))?;
            }
        }
    }
    let _ = format;
    Ok(())
}

/// Writes the checkpoint of `plan` from `release` into `out`.
pub fn write_checkpoint(
    plan: &Plan,
    release: &Release,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let sources = SourceMap::new(plan, release)?;
    prepare_dir(out, options.format, options.overwrite)?;
    let result = match options.format {
        OutputFormat::Dcp => write_dcp(plan, &sources, out, options, progress),
        OutputFormat::DcpSafetensors => write_dcp_safetensors(plan, &sources, out, options, progress),
    };
    if result.is_err() {
        // Leave nothing that could be mistaken for output: no marker was written; drop rank files.
        if let Ok(entries) = fs::read_dir(out) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".distcp") || name.ends_with(".safetensors") || name.starts_with(".metadata") {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }
    result
}

fn write_dcp(
    plan: &Plan,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let items = plan.rank_items();
    let world = plan.world() as usize;
    // Per rank: (tensor, chunk, offset, length) of every item written.
    let per_rank = for_each_rank(world, options.threads, progress, |rank| {
        let name = dcp_rank_file(rank as u64);
        let mut file = RankFile::create(out.join(&name), options.buffer_bytes)?;
        let mut buf = vec![0u8; options.buffer_bytes];
        let mut records = Vec::with_capacity(items[rank].len());
        for &(ti, ci) in &items[rank] {
            if progress.cancel.load(Ordering::Relaxed) {
                return Err(ExecuteError::Cancelled);
            }
            let t = &plan.tensors[ti];
            let c = &t.chunks[ci];
            let start = file.pos();
            let archive = TensorArchive::new(t.dtype, &c.sizes);
            file.write(archive.prefix())?;
            let mut crc = crc32fast::Hasher::new();
            stream_chunk(t, &c.offsets, &c.sizes, sources, &mut buf, |b| {
                crc.update(b);
                progress.bytes_written.fetch_add(b.len() as u64, Ordering::Relaxed);
                file.write(b)
            })?;
            let crc = crc.finalize();
            file.patch(start + archive.crc_offset(), &crc.to_le_bytes())?;
            file.write(&archive.suffix(crc))?;
            let length = file.pos() - start;
            debug_assert_eq!(length, archive.total_len());
            records.push((ti, ci, start, length));
            progress.chunks_written.fetch_add(1, Ordering::Relaxed);
        }
        let len = file.finish()?;
        Ok((name, records, len))
    })?;

    let mut storage_data = Vec::new();
    let mut chunk_lists: Vec<Vec<ChunkMeta>> = vec![Vec::new(); plan.tensors.len()];
    let mut report = WriteReport { files: Vec::new(), tensor_bytes: 0, file_bytes: 0, chunks: 0 };
    // Chunks are listed in rank order, as torch does.
    for (name, records, len) in &per_rank {
        report.files.push(out.join(name));
        report.file_bytes += len;
        for &(ti, ci, offset, length) in records {
            let t = &plan.tensors[ti];
            let c = &t.chunks[ci];
            chunk_lists[ti].push(ChunkMeta { offsets: c.offsets.clone(), sizes: c.sizes.clone() });
            storage_data.push((
                StorageKey { fqn: t.key.clone(), offset: Some(c.offsets.clone()) },
                StorageInfo { relative_path: name.clone(), offset, length, transform_descriptors: None },
            ));
            report.tensor_bytes += c.numel() * t.dtype.size() as u64;
            report.chunks += 1;
        }
    }
    let mut state_dict_metadata = Vec::new();
    let mut planner_data = Vec::new();
    for (t, chunks) in plan.tensors.iter().zip(chunk_lists) {
        planner_data.push((t.key.clone(), planner_path(&t.key)));
        state_dict_metadata.push((t.key.clone(), EntryMeta::Tensor { dtype: t.dtype, size: t.shape.clone(), chunks }));
    }
    let md = Metadata { state_dict_metadata, storage_data, planner_data, version: None };
    commit_metadata(out, &dcp_metadata::encode_metadata(&md))?;
    report.file_bytes += 0;
    Ok(report)
}

/// Writes `.metadata` through a temporary name, syncs, renames: the checkpoint's commit point.
fn commit_metadata(out: &Path, bytes: &[u8]) -> Result<(), ExecuteError> {
    let tmp = out.join(".metadata.tmp");
    let fin = out.join(".metadata");
    {
        let f = File::create(&tmp).map_err(io_err(&tmp, "create .metadata.tmp"))?;
        f.write_all_at(bytes, 0).map_err(io_err(&tmp, "write .metadata.tmp"))?;
        f.sync_all().map_err(io_err(&tmp, "sync .metadata.tmp"))?;
    }
    fs::rename(&tmp, &fin).map_err(io_err(&fin, "rename .metadata.tmp into place"))?;
    File::open(out).and_then(|d| d.sync_all()).map_err(io_err(out, "sync output directory"))?;
    Ok(())
}

fn write_dcp_safetensors(
    plan: &Plan,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let items = plan.rank_items();
    let world = plan.world() as usize;
    let per_rank = for_each_rank(world, options.threads, progress, |rank| {
        let name = dcp_safetensors_rank_file(rank as u64, world as u64);
        let sharding: serde_json::Map<String, serde_json::Value> = items[rank]
            .iter()
            .map(|&(ti, ci)| {
                let c = &plan.tensors[ti].chunks[ci];
                (plan.tensors[ti].key.clone(), serde_json::json!({ "saved_offsets": c.offsets }))
            })
            .collect();
        let metadata = [
            ("DCP_SHARDING_INFO".to_string(), serde_json::Value::Object(sharding).to_string()),
            ("DCP_VERSION".to_string(), "1.0".to_string()),
            ("format".to_string(), "pt".to_string()),
        ]
        .into_iter()
        .collect();
        let layout = FileLayout::new(
            items[rank].iter().map(|&(ti, ci)| {
                let t = &plan.tensors[ti];
                (t.key.as_str(), t.dtype, t.chunks[ci].sizes.as_slice())
            }),
            &metadata,
        )?;
        let mut writer = SafetensorsWriter::create(out.join(&name), layout)?;
        let mut buf = vec![0u8; options.buffer_bytes];
        let mut pending: Vec<u8> = Vec::with_capacity(options.buffer_bytes);
        for &(ti, ci) in &items[rank] {
            let t = &plan.tensors[ti];
            let c = &t.chunks[ci];
            stream_chunk(t, &c.offsets, &c.sizes, sources, &mut buf, |b| {
                progress.bytes_written.fetch_add(b.len() as u64, Ordering::Relaxed);
                if pending.len() + b.len() > pending.capacity() {
                    writer.write_next(&pending)?;
                    pending.clear();
                }
                if b.len() >= pending.capacity() {
                    writer.write_next(b)?;
                } else {
                    pending.extend_from_slice(b);
                }
                Ok(())
            })?;
            progress.chunks_written.fetch_add(1, Ordering::Relaxed);
        }
        writer.write_next(&pending)?;
        let path = writer.finish()?;
        let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        Ok((path, len, items[rank].len() as u64))
    })?;
    let mut report = WriteReport { files: Vec::new(), tensor_bytes: 0, file_bytes: 0, chunks: 0 };
    for (path, len, n) in per_rank {
        report.files.push(path);
        report.file_bytes += len;
        report.chunks += n;
    }
    report.tensor_bytes = plan.bytes_per_rank().iter().sum();
    Ok(report)
}
