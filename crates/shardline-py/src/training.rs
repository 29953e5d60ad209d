//! `reshard` and `export`: the CLI's training-checkpoint operations (`shardline_ops`), with
//! keyword arguments named as its flags are, run as `ops.rs` runs the others.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use shardline_formats::execute::Progress;
use shardline_layout::reshard::RngPolicy;
use shardline_layout::{Dialect, Mesh};
use shardline_ops::{ExportRequest, ReshardRequest};

use crate::ops::{mesh, run_reporting};

fn default_threads(threads: Option<usize>) -> usize {
    threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()).max(2)).max(1)
}

/// Reshards the training checkpoint `ckpt` (parameters, optimizer state, bytes items) for the
/// mesh `tp`·`cp`·`dp` (`ep`, `etp`) into `out`; `target` "fsdp_dtensor" or "torch_dist"
/// translates it (default: the source's dialect). With `dry_run`, plans and checks it and writes
/// nothing. Returns what it did: `{"from", "to", "out", "tensors", "optimizer_states", "objects",
/// "files", "tensor_bytes", "file_bytes", "chunks", "args_updated", "notes", "left_out",
/// "seconds"}` (the CLI's `reshard --json`).
#[pyfunction]
#[pyo3(signature = (ckpt, out=None, *, tp=1, cp=1, dp=1, ep=1, etp=None, target=None, from_mesh=None,
    rng="from-rank0", vocab_size=None, vocab_divisible_by=None, overwrite=false, threads=None, dry_run=false,
    progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn reshard<'py>(
    py: Python<'py>,
    ckpt: PathBuf,
    out: Option<PathBuf>,
    tp: u64,
    cp: u64,
    dp: u64,
    ep: u64,
    etp: Option<u64>,
    target: Option<&str>,
    from_mesh: Option<&str>,
    rng: &str,
    vocab_size: Option<u64>,
    vocab_divisible_by: Option<u64>,
    overwrite: bool,
    threads: Option<usize>,
    dry_run: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let target = match target {
        None => None,
        Some("fsdp_dtensor") => Some(Dialect::FsdpDtensor),
        Some("torch_dist") => Some(Dialect::TorchDist),
        Some(t) => return Err(PyValueError::new_err(format!("target `{t}`: \"fsdp_dtensor\" or \"torch_dist\""))),
    };
    let from_mesh = from_mesh
        .map(|m| Mesh::parse_assignments(m).map_err(|e| PyValueError::new_err(format!("from_mesh: {e}"))))
        .transpose()?;
    let rng = match rng {
        "from-rank0" | "from_rank0" => RngPolicy::FromRank0,
        "drop" => RngPolicy::Drop,
        r => return Err(PyValueError::new_err(format!("rng `{r}`: \"from-rank0\" or \"drop\""))),
    };
    if out.is_none() && !dry_run {
        return Err(PyValueError::new_err("out is required unless dry_run"));
    }
    let request = ReshardRequest {
        ckpt,
        mesh: mesh(tp, cp, dp, ep, etp)?,
        target,
        from_mesh,
        rng,
        vocab_size,
        vocab_divisible_by,
    };
    let counters = Progress::default();
    let threads = default_threads(threads);
    let (planned, written) = run_reporting(py, progress.as_ref(), &counters, || {
        let planned = shardline_ops::plan_reshard_of(&request)?;
        let written = match (&out, dry_run) {
            (Some(to), false) => Some(planned.write(to, threads, overwrite, &counters)?),
            _ => None,
        };
        Ok((planned, written))
    })?;
    let d = PyDict::new(py);
    d.set_item("from", planned.source_mesh_said())?;
    d.set_item("to", planned.options.mesh.to_string())?;
    d.set_item("tensors", planned.tensor_count())?;
    d.set_item("optimizer_states", planned.optimizer_states())?;
    d.set_item("objects", planned.plan.objects.len())?;
    d.set_item("notes", &planned.plan.notes)?;
    d.set_item("left_out", &planned.source.notes)?;
    if let Some(w) = written {
        d.set_item("out", out)?;
        d.set_item("files", w.files)?;
        d.set_item("tensor_bytes", w.tensor_bytes)?;
        d.set_item("file_bytes", w.file_bytes)?;
        d.set_item("chunks", w.chunks)?;
        d.set_item("args_updated", w.args_set)?;
    }
    Ok(d)
}

/// Writes the model weights of the checkpoint `ckpt` back as the HF release `like` into `out`:
/// the release's names, dtypes, shapes and files (the CLI's `export`). Without `like`, a NeMo
/// Automodel save exports as the release its `model/.hf_metadata/` describes. Returns `{"out", "like",
/// "files", "tensors", "bytes", "copied", "etp", "seconds"}`.
#[pyfunction]
#[pyo3(signature = (ckpt, out, *, like=None, prefix="model.module.", etp=None, max_file_size=5_000_000_000,
    overwrite=false, threads=None, progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn export<'py>(
    py: Python<'py>,
    ckpt: PathBuf,
    out: PathBuf,
    like: Option<PathBuf>,
    prefix: &str,
    etp: Option<u64>,
    max_file_size: u64,
    overwrite: bool,
    threads: Option<usize>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    if max_file_size == 0 {
        return Err(PyValueError::new_err("max_file_size is at least 1 byte"));
    }
    let request = ExportRequest {
        ckpt,
        to: out,
        like,
        prefix: prefix.to_string(),
        etp,
        max_file_bytes: max_file_size,
        overwrite,
        threads: default_threads(threads),
    };
    let counters = Progress::default();
    let done = run_reporting(py, progress.as_ref(), &counters, || shardline_ops::export(&request, &counters))?;
    let d = PyDict::new(py);
    d.set_item("out", &request.to)?;
    d.set_item("like", &done.like)?;
    d.set_item("files", &done.written.files)?;
    d.set_item("tensors", done.written.tensors)?;
    d.set_item("bytes", done.written.bytes)?;
    d.set_item("copied", &done.written.copied)?;
    d.set_item("etp", done.etp)?;
    d.set_item("seconds", done.seconds)?;
    Ok(d)
}
