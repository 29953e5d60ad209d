//! Writing a checkpoint's model weights back as an HF release: every release tensor assembled
//! from the checkpoint rows the export plan names (read as runs of the chunks that hold them,
//! through one buffer per writer), converted to the release's dtype, written into safetensors
//! files of at most a given size in a staging directory; the index, `config.json` and tokenizer
//! files of the release next to them; the directory renamed into place last.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use shardline_layout::export::{ExportBlock, ExportTensor, Place};
use shardline_layout::recipe::{add_scalar, can_cast, cast_into, row_elems};
use shardline_layout::reshard::{check_tiling, runs, ChunkBox};

use super::TrainingError;
use crate::checkpoint::{read_box_from, Checkpoint, StoredTensor};
use crate::execute::{for_each_unit, ExecuteError, Progress};
use crate::out_dir;
use crate::safetensors::{FileLayout, SafetensorsWriter};

/// Bytes of checkpoint rows each writer reads at a time.
const BAND_BYTES: usize = 8 << 20;
/// Runs of unchanged bytes of at least this length are copied by the kernel (as `reshard` does).
const KERNEL_COPY_MIN: u64 = 64 << 10;

/// How the export is cut and written.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Largest safetensors file (HF's `max_shard_size`, 5 GB by default); a larger tensor gets a
    /// file of its own.
    pub max_file_bytes: u64,
    /// Instead, the release's own files: each tensor's 1-based file number
    /// (`model-0000i-of-0000N.safetensors`, N the largest), the tensors given in file order (as
    /// NeMo Automodel records them in `fqn_to_file_index_mapping.json`).
    pub file_numbers: Option<HashMap<String, u64>>,
    pub threads: usize,
    /// Replace an existing directory at the output path.
    pub overwrite: bool,
}

/// What was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportReport {
    pub files: Vec<String>,
    pub tensors: usize,
    pub bytes: u64,
    /// Files of the release copied next to the weights (`config.json`, tokenizer files, …).
    pub copied: Vec<String>,
}

fn io_err<'p>(path: &'p Path, action: &'static str) -> impl FnOnce(io::Error) -> TrainingError + 'p {
    move |error| TrainingError::Write(ExecuteError::Io { path: path.to_path_buf(), action, error })
}

/// The files of `tensors`, in order, each at most `max` bytes (HF's naming: `model.safetensors`
/// alone, else `model-00001-of-0000N.safetensors`).
fn cut_files(tensors: &[ExportTensor], max: u64) -> Vec<(String, std::ops::Range<usize>)> {
    let mut ranges = Vec::new();
    let (mut start, mut size) = (0usize, 0u64);
    for (i, t) in tensors.iter().enumerate() {
        let n = t.shape.iter().product::<u64>() * t.dtype.size() as u64;
        if i > start && size + n > max {
            ranges.push(start..i);
            (start, size) = (i, 0);
        }
        size += n;
    }
    if start < tensors.len() {
        ranges.push(start..tensors.len());
    }
    let count = ranges.len();
    ranges
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let name = if count == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{count:05}.safetensors", i + 1)
            };
            (name, r)
        })
        .collect()
}

/// The files the release's own numbering gives `tensors` (in file order): runs of one number.
fn numbered_files(
    tensors: &[ExportTensor],
    numbers: &HashMap<String, u64>,
) -> Result<Vec<(String, std::ops::Range<usize>)>, TrainingError> {
    let count = numbers.values().copied().max().unwrap_or(1);
    let mut files: Vec<(String, std::ops::Range<usize>)> = Vec::new();
    let mut previous = 0;
    for (i, t) in tensors.iter().enumerate() {
        let Some(&n) = numbers.get(&t.name).filter(|&&n| n >= 1) else {
            return Err(TrainingError::FileNumbers(format!("`{}` has no file number (numbers start at 1)", t.name)));
        };
        if n == previous {
            if let Some(last) = files.last_mut() {
                last.1.end = i + 1;
            }
            continue;
        }
        if n < previous {
            return Err(TrainingError::FileNumbers(format!("`{}`: tensors are not given in file order", t.name)));
        }
        files.push((format!("model-{n:05}-of-{count:05}.safetensors"), i..i + 1));
        previous = n;
    }
    Ok(files)
}

/// Writes `tensors` of `checkpoint` into the HF directory `out`, with the release `like`'s other
/// files; nothing is at `out` until everything is written.
pub fn write_export(
    checkpoint: &Checkpoint,
    tensors: &[ExportTensor],
    like: &Path,
    out: &Path,
    options: &ExportOptions,
    progress: &Progress,
) -> Result<ExportReport, TrainingError> {
    if out.exists() && !options.overwrite {
        return Err(ExecuteError::Exists(out.to_path_buf(), "the directory").into());
    }
    let by_key = check_sources(checkpoint, tensors)?;
    let staging = staging_dir(out);
    let _ = fs::remove_dir_all(&staging);
    let parent = staging.parent().unwrap_or(Path::new("."));
    let created = out_dir::create(parent).map_err(io_err(parent, "create the output's parent directory"))?;
    if let Err(e) = fs::create_dir(&staging) {
        created.remove();
        return Err(io_err(&staging, "create staging directory")(e));
    }
    let result = file_list(tensors, options).and_then(|files| {
        write_weights(checkpoint, &by_key, tensors, &files, |_| true, &staging, options, progress)?;
        finish_staged(tensors, &files, like, &staging)
    });
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = fs::remove_dir_all(&staging);
            created.remove();
            return Err(e);
        }
    };
    // The old export (if any) is withdrawn whole, in one rename, before the new one takes its
    // place: a reader never sees an index naming files half removed.
    out_dir::replace_with(&staging, out).map_err(io_err(out, "put the export in place"))?;
    Ok(report)
}

/// Part `part` of `parts` of an export split over tasks: weight file `i` (in the order
/// [`write_export`] writes them) when `i mod parts == part`, into the staging directory of
/// `out`, each written under a temporary name and renamed when complete. Returns their names;
/// [`commit_export`] finishes the export once every part is written.
pub fn write_export_part(
    checkpoint: &Checkpoint,
    tensors: &[ExportTensor],
    out: &Path,
    options: &ExportOptions,
    (part, parts): (u64, u64),
    progress: &Progress,
) -> Result<Vec<String>, TrainingError> {
    let by_key = check_sources(checkpoint, tensors)?;
    let files = file_list(tensors, options)?;
    let staging = staging_dir(out);
    fs::create_dir_all(&staging).map_err(io_err(&staging, "create staging directory"))?;
    let mine = |i: usize| i as u64 % parts.max(1) == part;
    write_weights(checkpoint, &by_key, tensors, &files, mine, &staging, options, progress)?;
    Ok(files.into_iter().enumerate().filter(|(i, _)| mine(*i)).map(|(_, (name, _))| name).collect())
}

/// Finishes an export whose weight files [`write_export_part`] wrote: every one must be in the
/// staging directory at its planned length (else nothing is put in place and the error names the
/// first that is not); then the index and the release's other files, and the rename into place.
pub fn commit_export(
    tensors: &[ExportTensor],
    like: &Path,
    out: &Path,
    options: &ExportOptions,
) -> Result<ExportReport, TrainingError> {
    let files = file_list(tensors, options)?;
    let staging = staging_dir(out);
    let metadata = weights_metadata();
    for (name, range) in &files {
        let part = &tensors[range.clone()];
        let layout = FileLayout::new(part.iter().map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice())), &metadata)?;
        let path = staging.join(name);
        let found = fs::metadata(&path).map(|m| m.len());
        if found.as_ref().ok() != Some(&layout.file_len()) {
            let what = match found {
                Ok(len) => format!("it holds {len} bytes of the {} planned", layout.file_len()),
                Err(e) => e.to_string(),
            };
            let error = io::Error::other(format!("`{name}` is not complete ({what})"));
            return Err(TrainingError::Write(ExecuteError::Io { path, action: "commit the export", error }));
        }
    }
    let report = finish_staged(tensors, &files, like, &staging)?;
    out_dir::replace_with(&staging, out).map_err(io_err(out, "put the export in place"))?;
    Ok(report)
}

/// The checkpoint tensors of `checkpoint` by key, once every tensor an export reads tiles its
/// shape and converts to the release's dtype.
fn check_sources<'c>(
    checkpoint: &'c Checkpoint,
    tensors: &[ExportTensor],
) -> Result<HashMap<&'c str, &'c StoredTensor>, TrainingError> {
    let by_key: HashMap<&str, &StoredTensor> = checkpoint.tensors.iter().map(|t| (t.key.as_str(), t)).collect();
    for t in tensors {
        for b in &t.blocks {
            let stored = by_key[b.key.as_str()];
            let boxes: Vec<ChunkBox> =
                stored.chunks.iter().map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() }).collect();
            check_tiling(&stored.shape, &boxes)
                .map_err(|problem| TrainingError::Tiling { key: stored.key.clone(), problem: problem.to_string() })?;
            if stored.dtype != t.dtype && !can_cast(stored.dtype, t.dtype) {
                return Err(TrainingError::Write(ExecuteError::SourceMismatch {
                    name: stored.key.clone(),
                    planned: t.dtype.to_string(),
                    actual: stored.dtype.to_string(),
                }));
            }
        }
    }
    Ok(by_key)
}

/// The weight files and the tensors (a range of `tensors`) each holds.
fn file_list(
    tensors: &[ExportTensor],
    options: &ExportOptions,
) -> Result<Vec<(String, std::ops::Range<usize>)>, TrainingError> {
    match &options.file_numbers {
        Some(numbers) => numbered_files(tensors, numbers),
        None => Ok(cut_files(tensors, options.max_file_bytes.max(1))),
    }
}

fn weights_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([("format".to_string(), "pt".to_string())])
}

/// Writes the weight files `which` accepts (by index in `files`) into `staging`.
#[allow(clippy::too_many_arguments)]
fn write_weights(
    checkpoint: &Checkpoint,
    by_key: &HashMap<&str, &StoredTensor>,
    tensors: &[ExportTensor],
    files: &[(String, std::ops::Range<usize>)],
    which: impl Fn(usize) -> bool,
    staging: &Path,
    options: &ExportOptions,
    progress: &Progress,
) -> Result<(), TrainingError> {
    let mut inputs: HashMap<&str, File> = HashMap::new();
    for t in &checkpoint.tensors {
        for c in &t.chunks {
            if !inputs.contains_key(&*c.file) {
                let p = checkpoint.dir.join(&*c.file);
                inputs.insert(&*c.file, File::open(&p).map_err(io_err(&p, "open rank file"))?);
            }
        }
    }
    let metadata = weights_metadata();
    for (file_name, range) in files.iter().enumerate().filter(|(i, _)| which(*i)).map(|(_, f)| f) {
        let part = &tensors[range.clone()];
        let layout = FileLayout::new(part.iter().map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice())), &metadata)?;
        let writer = SafetensorsWriter::create(staging.join(file_name), layout)?;
        let reader = RowReader { checkpoint, by_key, inputs: &inputs };
        for_each_unit(part.len(), options.threads, progress, |i| reader.write_tensor(&part[i], &writer, progress))?;
        writer.finish()?;
    }
    Ok(())
}

/// What makes the weight files in `staging` a release: the index (whenever the weights are not
/// one `model.safetensors`: transformers finds `model-00001-of-00001.safetensors` only through
/// it) and the release's other files.
fn finish_staged(
    tensors: &[ExportTensor],
    files: &[(String, std::ops::Range<usize>)],
    like: &Path,
    staging: &Path,
) -> Result<ExportReport, TrainingError> {
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (file_name, range) in files {
        for t in &tensors[range.clone()] {
            weight_map.insert(t.name.clone(), file_name.clone());
            total += t.shape.iter().product::<u64>() * t.dtype.size() as u64;
        }
    }
    if files.len() > 1 || files.first().is_some_and(|(name, _)| name != "model.safetensors") {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = staging.join("model.safetensors.index.json");
        fs::write(&p, serde_json::to_vec_pretty(&index).unwrap_or_default()).map_err(io_err(&p, "write index"))?;
    }
    let copied = copy_release_files(like, staging)?;
    Ok(ExportReport {
        files: files.iter().map(|(n, _)| n.clone()).collect(),
        tensors: tensors.len(),
        bytes: total,
        copied,
    })
}

/// Copies the release's files that are not weights (`config.json`, `generation_config.json`,
/// tokenizer files, chat template, …).
fn copy_release_files(like: &Path, staging: &Path) -> Result<Vec<String>, TrainingError> {
    let mut copied = Vec::new();
    let entries = fs::read_dir(like).map_err(io_err(like, "list the release"))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let weights = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
        // NeMo Automodel's own records in `.hf_metadata/`, not part of a release.
        let records = name == "fqn_to_file_index_mapping.json" || name == "fqn_to_dtype_mapping.json";
        // Regular files and links to them (an HF cache snapshot links its files).
        if weights || records || name.starts_with('.') || !e.path().is_file() {
            continue;
        }
        let to = staging.join(&name);
        fs::copy(e.path(), &to).map_err(io_err(&to, "copy a release file"))?;
        copied.push(name);
    }
    copied.sort();
    Ok(copied)
}

/// A writer's buffers: checkpoint rows as read, and converted to the release's dtype.
#[derive(Default)]
struct Band {
    raw: Vec<u8>,
    converted: Vec<u8>,
}

/// Reads checkpoint rows and writes them as release tensors.
struct RowReader<'a> {
    checkpoint: &'a Checkpoint,
    by_key: &'a HashMap<&'a str, &'a StoredTensor>,
    inputs: &'a HashMap<&'a str, File>,
}

impl RowReader<'_> {
    fn write_tensor(
        &self,
        t: &ExportTensor,
        writer: &SafetensorsWriter,
        progress: &Progress,
    ) -> Result<(), ExecuteError> {
        if t.blocks.iter().any(|b| matches!(b.place, Place::Columns { .. })) {
            return self.write_matrices(t, writer, progress);
        }
        let mut band = Band::default();
        for b in &t.blocks {
            let Place::Rows { row, stride } = b.place else { continue };
            let out_row = b.width * t.dtype.size() as u64;
            let stored = self.by_key[b.key.as_str()];
            // Unchanged bytes from chunks holding whole rows: long runs, copied file to file.
            // Chunks split along a later dimension (FSDP2's `Shard(1)`) give a short run per row
            // and chunk; those go through a band, read a span per chunk and written once.
            let whole_rows = stored.chunks.iter().all(|c| c.sizes.get(1..) == stored.shape.get(1..));
            if stride == 1 && !b.add_one && stored.dtype == t.dtype && whole_rows {
                self.copy_rows(b, row * out_row, stored, t, writer, &mut band.raw)?;
                progress.bytes_written.fetch_add(b.rows * out_row, Ordering::Relaxed);
                continue;
            }
            let mut k = 0;
            while k < b.rows {
                if progress.cancel.load(Ordering::Relaxed) {
                    return Err(ExecuteError::Cancelled);
                }
                let (n, bytes) = self.read_band(b, k, t, &mut band)?;
                if stride == 1 {
                    writer.write_tensor_at(&t.name, (row + k) * out_row, bytes)?;
                } else {
                    for (j, r) in bytes.chunks(out_row as usize).enumerate() {
                        writer.write_tensor_at(&t.name, (row + (k + j as u64) * u64::from(stride)) * out_row, r)?;
                    }
                }
                progress.bytes_written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                k += n;
            }
        }
        Ok(())
    }

    /// A tensor of row-major matrices (experts `[E, in, out]`) whose columns the checkpoint holds
    /// as rows: each matrix is assembled in memory from its blocks' rows and written whole, so
    /// memory holds one matrix, never the tensor.
    fn write_matrices(
        &self,
        t: &ExportTensor,
        writer: &SafetensorsWriter,
        progress: &Progress,
    ) -> Result<(), ExecuteError> {
        let size = t.dtype.size();
        let matrix = t.shape.iter().rev().take(2).product::<u64>().max(1);
        let mut buf = Vec::new();
        let mut band = Band::default();
        let mut blocks = t.blocks.iter().peekable();
        while let Some(first) = blocks.peek() {
            let m = first.start() / matrix;
            buf.clear();
            buf.resize(matrix as usize * size, 0);
            while let Some(b) = blocks.next_if(|b| b.start() / matrix == m) {
                let Place::Columns { first, src_cols, col_stride } = b.place else { continue };
                let column = first - m * matrix;
                let width = row_elems(&self.by_key[b.key.as_str()].shape) as usize;
                let mut k = 0;
                while k < b.rows {
                    if progress.cancel.load(Ordering::Relaxed) {
                        return Err(ExecuteError::Cancelled);
                    }
                    let (n, bytes) = self.read_band(b, k, t, &mut band)?;
                    for (j, row) in bytes.chunks(width * size).take(n as usize).enumerate() {
                        let c = column + (k + j as u64) * col_stride;
                        for (e, v) in row.chunks(size).enumerate() {
                            let at = (e as u64 * src_cols + c) as usize * size;
                            buf[at..at + size].copy_from_slice(v);
                        }
                    }
                    k += n;
                }
            }
            writer.write_tensor_at(&t.name, m * matrix * size as u64, &buf)?;
            progress.bytes_written.fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The rows of `b`, unchanged bytes, to `at` in `t`: each run of the chunks that hold them
    /// copied by the kernel when large, through `buf` when small.
    fn copy_rows(
        &self,
        b: &ExportBlock,
        at: u64,
        stored: &StoredTensor,
        t: &ExportTensor,
        writer: &SafetensorsWriter,
        buf: &mut Vec<u8>,
    ) -> Result<(), ExecuteError> {
        let size = stored.dtype.size() as u64;
        let target = row_box(stored, b.ckpt_row, b.rows);
        for c in &stored.chunks {
            let source = ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() };
            let file = &self.inputs[&*c.file];
            for r in runs(&target, &source) {
                let (from, to, len) = (c.data_offset + r.source * size, at + r.target * size, r.len * size);
                let done =
                    if len >= KERNEL_COPY_MIN { writer.copy_into_tensor(&t.name, to, file, from, len)? } else { 0 };
                if done < len {
                    buf.resize((len - done) as usize, 0);
                    file.read_exact_at(buf, from + done).map_err(|error| ExecuteError::Io {
                        path: self.checkpoint.dir.join(&*c.file),
                        action: "read chunk",
                        error,
                    })?;
                    writer.write_tensor_at(&t.name, to + done, buf)?;
                }
            }
        }
        Ok(())
    }

    /// Rows `k..` of block `b` (as many as fit a band), read, with one added back if the block
    /// says so, in `t`'s dtype: `(rows, bytes)`.
    fn read_band<'b>(
        &self,
        b: &ExportBlock,
        k: u64,
        t: &ExportTensor,
        band: &'b mut Band,
    ) -> Result<(u64, &'b [u8]), ExecuteError> {
        let stored = self.by_key[b.key.as_str()];
        let width = row_elems(&stored.shape);
        let in_row = width * stored.dtype.size() as u64;
        let n = (BAND_BYTES as u64 / in_row.max(1)).max(1).min(b.rows - k);
        band.raw.resize((n * in_row) as usize, 0);
        self.read_rows(stored, b.ckpt_row + k, n, &mut band.raw)?;
        if b.add_one {
            add_scalar(stored.dtype, &mut band.raw, 1.0);
        }
        if stored.dtype == t.dtype {
            return Ok((n, &band.raw));
        }
        band.converted.resize((n * width) as usize * t.dtype.size(), 0);
        cast_into(stored.dtype, t.dtype, &band.raw, &mut band.converted);
        Ok((n, &band.converted))
    }

    /// Global rows `[row, row + rows)` of `stored`, whole, into `buf`: per chunk, the runs close
    /// together in its file read with one `pread` (a band of a column-split chunk is one span);
    /// on this thread, as tensors are written one per thread already.
    fn read_rows(&self, stored: &StoredTensor, row: u64, rows: u64, buf: &mut [u8]) -> Result<(), ExecuteError> {
        read_box_from(self.inputs, stored, &row_box(stored, row, rows), buf, 1).map_err(|e| ExecuteError::Io {
            path: self.checkpoint.dir.join(&*e.file),
            action: "read chunk",
            error: e.error,
        })?;
        Ok(())
    }
}

/// Global rows `[row, row + rows)` of `stored`, whole, as a box (a 0-d tensor: its one element).
fn row_box(stored: &StoredTensor, row: u64, rows: u64) -> ChunkBox {
    if stored.shape.is_empty() {
        return ChunkBox { offsets: Vec::new(), sizes: Vec::new() };
    }
    let mut offsets = vec![0u64; stored.shape.len()];
    offsets[0] = row;
    let mut sizes = stored.shape.clone();
    sizes[0] = rows;
    ChunkBox { offsets, sizes }
}

/// The staging sibling of the HF directory `out`: `.<name>.partial`, renamed to `out` when complete.
fn staging_dir(out: &Path) -> PathBuf {
    let name = out.file_name().map_or_else(|| "export".into(), |n| n.to_string_lossy().into_owned());
    out.with_file_name(format!(".{name}.partial"))
}
