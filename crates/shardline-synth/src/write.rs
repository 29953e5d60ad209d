//! Writing a release: shards assigned, written by parallel threads, renamed into place; the index
//! and `config.json` last.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Map};

use shardline_formats::safetensors::{
    FileLayout, SafetensorsWriter, CONFIG_FILE_NAME, INDEX_FILE_NAME, SINGLE_FILE_NAME,
};

use crate::*;
use crate::{arch::*, data::*, model::*};

fn io_error(path: &Path, action: &'static str) -> impl FnOnce(io::Error) -> SynthError {
    let path = path.to_path_buf();
    move |source| SynthError::Io { path, action, source }
}

/// How [`synth`] writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthOptions {
    /// Largest shard in tensor bytes; a tensor larger than this gets a shard of its own.
    /// By default, [`DEFAULT_MAX_SHARD_BYTES`] (2 GiB).
    pub max_shard_bytes: u64,
    /// Threads writing shards; 0 means one per available core. By default, 0.
    pub threads: usize,
    /// Size of the pieces tensors are generated and written in (rounded up to a multiple of 8).
    /// By default, [`DEFAULT_PIECE_BYTES`] (4 MiB).
    pub piece_bytes: usize,
    /// Replace a complete release already in the output directory (its `config.json`, index and
    /// `model*.safetensors` files are removed first; other files stay). By default, false: such a
    /// directory is an error. The files of an interrupted run (no `config.json`) are always
    /// replaced.
    pub overwrite: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            threads: 0,
            piece_bytes: DEFAULT_PIECE_BYTES,
            overwrite: false,
        }
    }
}

/// What [`synth`] wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    pub arch: Arch,
    pub dims: ModelDims,
    pub format: WeightFormat,
    pub dir: PathBuf,
    /// The safetensors files, in shard order.
    pub files: Vec<PathBuf>,
    /// The index, when the release is sharded.
    pub index: Option<PathBuf>,
    pub num_tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub total_bytes: u64,
    pub total_parameters: u64,
    /// Bytes of the safetensors files, headers included.
    pub file_bytes: u64,
    pub threads: usize,
    pub elapsed: Duration,
}

impl SynthReport {
    /// Tensor bytes written per second.
    pub fn bytes_per_second(&self) -> f64 {
        self.total_bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Writes a synthetic bf16 `arch` release of about `target_bytes` bytes of tensors into
/// `out_dir` (created if needed), with data drawn from `seed`. See the module documentation.
pub fn synth(
    arch: &str,
    target_bytes: u64,
    out_dir: &Path,
    seed: u64,
    options: &SynthOptions,
) -> Result<SynthReport, SynthError> {
    synth_with_progress(arch, target_bytes, out_dir, seed, options, &|_| {})
}

/// [`synth`], calling `progress` (from the writing threads) with the number of tensor bytes
/// written since the previous call.
pub fn synth_with_progress(
    arch: &str,
    target_bytes: u64,
    out_dir: &Path,
    seed: u64,
    options: &SynthOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<SynthReport, SynthError> {
    synth_as(arch, WeightFormat::Bf16, target_bytes, out_dir, seed, options, progress)
}

/// [`synth_with_progress`] with the weights in `format`: the model is the one fitted to
/// `target_bytes` in bf16 (see [`SynthModel::for_target_as`]), so an FP8 release has about half
/// of `target_bytes` and converts to the same checkpoint as the bf16 one.
pub fn synth_as(
    arch: &str,
    format: WeightFormat,
    target_bytes: u64,
    out_dir: &Path,
    seed: u64,
    options: &SynthOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<SynthReport, SynthError> {
    let arch: Arch = arch.parse()?;
    let model = SynthModel::for_target_as(arch, format, target_bytes)?;
    write_release(&model, out_dir, seed, options, progress)
}

/// One safetensors file to write: its name and its tensors (indices into the model's, in file
/// order, i.e. sorted by name as the safetensors serializer orders them).
struct Shard {
    pub(crate) file_name: String,
    pub(crate) tensors: Vec<usize>,
}

/// Cuts the tensors, in model order, into shards of at most `max_bytes` as `save_pretrained`
/// does: a tensor that does not fit in the current shard starts the next one.
fn assign_shards(model: &SynthModel, max_bytes: u64) -> Vec<Shard> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_bytes = 0u64;
    for (i, t) in model.tensors.iter().enumerate() {
        let bytes = t.byte_len();
        if !current.is_empty() && current_bytes.saturating_add(bytes) > max_bytes {
            groups.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(i);
        current_bytes = current_bytes.saturating_add(bytes);
    }
    if !current.is_empty() {
        groups.push(current);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(k, mut tensors)| {
            tensors.sort_by(|&a, &b| {
                let name = |i: usize| model.tensors.get(i).map(|t| t.name.as_str());
                name(a).cmp(&name(b))
            });
            let file_name =
                if n == 1 { SINGLE_FILE_NAME.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
            Shard { file_name, tensors }
        })
        .collect()
}

/// Whether `name` is one of the files a release written here consists of.
pub(crate) fn is_release_file(name: &str) -> bool {
    name == CONFIG_FILE_NAME
        || name == INDEX_FILE_NAME
        || name == SINGLE_FILE_NAME
        || (name.starts_with("model-") && name.ends_with(".safetensors") && name.contains("-of-"))
}

/// Whether `name` is a temporary file an interrupted run of [`synth`] may have left behind
/// (`.<release file>.<pid>[-<n>].partial`).
fn is_leftover_temp(name: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|n| n.strip_suffix(".partial"))
        .and_then(|n| n.rsplit_once('.'))
        .is_some_and(|(file, _)| is_release_file(file))
}

/// Prepares `dir`: refuses a complete release (one with `config.json`) unless `overwrite`, and
/// removes the files of a previous release or of an interrupted run (`config.json` first, so a
/// half-cleared directory never looks complete). Other files are left alone.
fn prepare_output(dir: &Path, overwrite: bool) -> Result<(), SynthError> {
    fs::create_dir_all(dir).map_err(io_error(dir, "create the output directory"))?;
    let mut found: Vec<String> = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_error(dir, "list the output directory"))? {
        let entry = entry.map_err(io_error(dir, "list the output directory"))?;
        if let Some(name) = entry.file_name().to_str() {
            if is_release_file(name) || is_leftover_temp(name) {
                found.push(name.to_string());
            }
        }
    }
    if !overwrite && found.iter().any(|n| n == CONFIG_FILE_NAME) {
        return Err(SynthError::OutputNotEmpty { dir: dir.to_path_buf(), file: CONFIG_FILE_NAME.to_string() });
    }
    let rank = |n: &str| match n {
        CONFIG_FILE_NAME => 0,
        INDEX_FILE_NAME => 1,
        _ => 2,
    };
    found.sort_by_key(|n| rank(n));
    for name in found {
        let path = dir.join(&name);
        fs::remove_file(&path).map_err(io_error(&path, "remove the previous release's file"))?;
    }
    Ok(())
}

/// Writes `bytes` to `dir/name` through a temporary file renamed into place.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, SynthError> {
    let path = dir.join(name);
    let temp = dir.join(format!(".{name}.{}.partial", std::process::id()));
    let result = (|| {
        let mut file = File::create(&temp).map_err(io_error(&temp, "create"))?;
        file.write_all(bytes).map_err(io_error(&temp, "write"))?;
        file.sync_all().map_err(io_error(&temp, "flush to disk"))?;
        fs::rename(&temp, &path).map_err(io_error(&path, "rename into place"))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result.map(|()| path)
}

/// What every shard-writing thread shares.
struct ShardJob<'a> {
    pub(crate) model: &'a SynthModel,
    pub(crate) dir: &'a Path,
    pub(crate) seed: u64,
    pub(crate) tables: &'a Tables,
    /// Set when any thread fails: the others stop at their next piece.
    stop: &'a AtomicBool,
    progress: &'a (dyn Fn(u64) + Sync),
}

impl ShardJob<'_> {
    /// Writes one shard, streaming each tensor in pieces through `buf`. Returns the file's path
    /// and length, or `None` when stopped because another thread failed.
    pub(crate) fn write(&self, shard: &Shard, buf: &mut [u8]) -> Result<Option<(PathBuf, u64)>, SynthError> {
        let specs: Vec<&TensorSpec> = shard.tensors.iter().filter_map(|&i| self.model.tensors.get(i)).collect();
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let layout = FileLayout::new(specs.iter().map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice())), &metadata)?;
        let file_len = layout.file_len();
        let mut writer = SafetensorsWriter::create(self.dir.join(&shard.file_name), layout)?;
        for t in specs {
            let sampler = self.tables.sampler(t.dtype, t.init);
            let mut stream = TensorStream::new(self.seed, &t.name);
            let mut remaining = t.byte_len();
            while remaining > 0 {
                if self.stop.load(Ordering::Relaxed) {
                    return Ok(None); // dropping the writer removes its temporary file
                }
                let n = usize::try_from(remaining).map_or(buf.len(), |r| r.min(buf.len()));
                let piece = buf.get_mut(..n).unwrap_or_default();
                stream.fill(sampler, piece);
                writer.write_next(piece)?;
                (self.progress)(n as u64);
                remaining -= n as u64;
            }
        }
        Ok(Some((writer.finish()?, file_len)))
    }
}

/// Writes `model` as a release into `out_dir`. See the module documentation.
pub fn write_release(
    model: &SynthModel,
    out_dir: &Path,
    seed: u64,
    options: &SynthOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<SynthReport, SynthError> {
    if options.max_shard_bytes == 0 {
        return Err(SynthError::InvalidOption("max_shard_bytes must be positive".into()));
    }
    if options.piece_bytes == 0 {
        return Err(SynthError::InvalidOption("piece_bytes must be positive".into()));
    }
    let start = Instant::now();
    prepare_output(out_dir, options.overwrite)?;
    let shards = assign_shards(model, options.max_shard_bytes);
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = match options.threads {
        0 => available,
        n => n,
    }
    .clamp(1, shards.len().max(1));
    let piece = options.piece_bytes.div_ceil(8).saturating_mul(8);

    let tables = Tables::new();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let job = ShardJob { model, dir: out_dir, seed, tables: &tables, stop: &stop, progress };
    let first_error: Mutex<Option<SynthError>> = Mutex::new(None);
    let finished: Mutex<Vec<(usize, PathBuf, u64)>> = Mutex::new(Vec::new());
    let fail = |e: SynthError| {
        stop.store(true, Ordering::Relaxed);
        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    };

    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut buf = vec![0u8; piece];
                    loop {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(shard) = shards.get(k) else {
                            return;
                        };
                        match job.write(shard, &mut buf) {
                            Ok(Some((path, len))) => {
                                finished.lock().unwrap_or_else(|p| p.into_inner()).push((k, path, len))
                            }
                            Ok(None) => return,
                            Err(e) => {
                                fail(e);
                                return;
                            }
                        }
                    }
                })
            })
            .collect();
        for handle in handles {
            if handle.join().is_err() {
                fail(SynthError::WorkerPanicked);
            }
        }
    });

    let mut finished = finished.into_inner().unwrap_or_else(|p| p.into_inner());
    let error = first_error.into_inner().unwrap_or_else(|p| p.into_inner());
    let remove_finished = |finished: &[(usize, PathBuf, u64)]| {
        for (_, path, _) in finished {
            let _ = fs::remove_file(path);
        }
    };
    if let Some(e) = error {
        remove_finished(&finished);
        return Err(e);
    }
    finished.sort_by_key(|(k, _, _)| *k);

    let result = (|| {
        let index = if shards.len() > 1 {
            let mut weight_map = Map::new();
            for shard in &shards {
                for t in shard.tensors.iter().filter_map(|&i| model.tensors.get(i)) {
                    weight_map.insert(t.name.clone(), json!(shard.file_name));
                }
            }
            let index = json!({
                "metadata": {
                    "total_parameters": model.total_parameters(),
                    "total_size": model.total_bytes(),
                },
                "weight_map": weight_map,
            });
            let mut text = serde_json::to_string_pretty(&index).map_err(|e| SynthError::Io {
                path: out_dir.join(INDEX_FILE_NAME),
                action: "serialize the index",
                source: io::Error::other(e),
            })?;
            text.push('\n');
            Some(write_atomically(out_dir, INDEX_FILE_NAME, text.as_bytes())?)
        } else {
            None
        };
        // Last: its presence is what makes the directory a release.
        write_atomically(out_dir, CONFIG_FILE_NAME, model.config_json().as_bytes())?;
        File::open(out_dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error(out_dir, "flush the output directory to disk"))?;
        Ok(index)
    })();
    let index = match result {
        Ok(index) => index,
        Err(e) => {
            let _ = fs::remove_file(out_dir.join(CONFIG_FILE_NAME));
            let _ = fs::remove_file(out_dir.join(INDEX_FILE_NAME));
            remove_finished(&finished);
            return Err(e);
        }
    };

    Ok(SynthReport {
        arch: model.arch,
        dims: model.dims.clone(),
        format: model.format,
        dir: out_dir.to_path_buf(),
        file_bytes: finished.iter().map(|(_, _, len)| len).sum(),
        files: finished.into_iter().map(|(_, path, _)| path).collect(),
        index,
        num_tensors: model.tensors.len(),
        total_bytes: model.total_bytes,
        total_parameters: model.total_parameters(),
        threads,
        elapsed: start.elapsed(),
    })
}
