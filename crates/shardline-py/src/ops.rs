//! `convert`, `plan` and `validate`: the CLI's operations (`shardline_ops`), called with keyword
//! arguments named as its flags are, the GIL released while they run. A `progress` callable is
//! called with `(bytes done, bytes total)` about ten times a second from the calling thread; if
//! it raises, or Ctrl-C arrives, the operation is cancelled (a conversion then leaves nothing)
//! and that exception is raised.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use shardline_formats::error_message;
use shardline_formats::execute::{OutputFormat, Progress};
use shardline_formats::verify::VerifyReport;
use shardline_layout::{DType, Dialect, Mesh, Plan, TorchtitanTarget, TorchtitanVersion};
use shardline_ops::{ConvertRequest, OpsError, ValidateRequest};

use crate::ShardlineError;

/// How often a `progress` callable hears of the operation.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);
/// How soon the end of the work is noticed.
const FINISHED_POLL: Duration = Duration::from_millis(5);

/// Runs `work` on a thread of its own with the GIL released, reporting to `callback` (and
/// checking for signals) meanwhile; a callback's exception or a signal cancels the work.
pub(crate) fn run_reporting<T: Send>(
    py: Python<'_>,
    callback: Option<&Py<PyAny>>,
    progress: &Progress,
    work: impl FnOnce() -> Result<T, OpsError> + Send,
) -> PyResult<T> {
    let report = |py: Python<'_>| -> PyResult<()> {
        py.check_signals()?;
        if let Some(cb) = callback {
            let (done, total) =
                (progress.bytes_written.load(Ordering::Relaxed), progress.bytes_total.load(Ordering::Relaxed));
            cb.call1(py, (done, total))?;
        }
        Ok(())
    };
    let (result, interrupted) = py.detach(|| {
        std::thread::scope(|s| {
            let worker = s.spawn(work);
            let mut interrupted = None;
            // The first report as the work starts, then one a period until it ends (which is
            // noticed sooner: a small job should not wait out a period).
            let mut next_report = Instant::now();
            while !worker.is_finished() {
                if interrupted.is_none() && Instant::now() >= next_report {
                    if let Err(e) = Python::attach(report) {
                        progress.cancel.store(true, Ordering::Relaxed);
                        interrupted = Some(e);
                    }
                    next_report = Instant::now() + PROGRESS_EVERY;
                }
                std::thread::sleep(FINISHED_POLL);
            }
            let result = worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (result.map_err(|e| error_message(&e)), interrupted)
        })
    });
    if let Some(e) = interrupted {
        return Err(e);
    }
    let value = result.map_err(ShardlineError::new_err)?;
    report(py)?;
    Ok(value)
}

fn dialect(target: &str, torchtitan_version: Option<&str>, dtype: Option<&str>) -> PyResult<Dialect> {
    let titan = || -> PyResult<TorchtitanTarget> {
        let default = TorchtitanTarget::default();
        let version = match torchtitan_version {
            None => default.version,
            Some(v) => TorchtitanVersion::parse(v).ok_or_else(|| {
                let known: Vec<&str> = TorchtitanVersion::NAMES.iter().map(|(n, _)| *n).collect();
                PyValueError::new_err(format!("unknown torchtitan version `{v}` (known: {})", known.join(", ")))
            })?,
        };
        let dtype = match dtype {
            None => default.dtype,
            Some("float32" | "fp32") => DType::F32,
            Some("bfloat16" | "bf16") => DType::BF16,
            Some(d) => return Err(PyValueError::new_err(format!("`{d}`: the seed's dtype is float32 or bfloat16"))),
        };
        Ok(TorchtitanTarget { version, dtype })
    };
    match target {
        "torchtitan" => Ok(Dialect::Torchtitan(titan()?)),
        _ if torchtitan_version.is_some() || dtype.is_some() => {
            Err(PyValueError::new_err("dtype and torchtitan_version apply only to target=\"torchtitan\""))
        }
        "fsdp_dtensor" => Ok(Dialect::FsdpDtensor),
        "torch_dist" => Ok(Dialect::TorchDist),
        _ => Err(PyValueError::new_err(format!(
            "target `{target}`: one of \"fsdp_dtensor\", \"torch_dist\", \"torchtitan\""
        ))),
    }
}

fn output_format(format: &str) -> PyResult<OutputFormat> {
    match format {
        "dcp" => Ok(OutputFormat::Dcp),
        "dcp-safetensors" | "dcp_safetensors" => Ok(OutputFormat::DcpSafetensors),
        _ => Err(PyValueError::new_err(format!("format `{format}`: \"dcp\" or \"dcp-safetensors\""))),
    }
}

#[allow(clippy::too_many_arguments)]
fn request(
    release: PathBuf,
    out: PathBuf,
    mesh: Mesh,
    target: &str,
    format: &str,
    prefix: Option<String>,
    vocab_divisible_by: u64,
    optimizer_state: bool,
    torchtitan_version: Option<&str>,
    dtype: Option<&str>,
) -> PyResult<ConvertRequest> {
    Ok(ConvertRequest {
        dialect: dialect(target, torchtitan_version, dtype)?,
        format: output_format(format)?,
        prefix,
        vocab_divisible_by,
        optimizer_state,
        ..ConvertRequest::new(release, out, mesh)
    })
}

pub(crate) fn mesh(tp: u64, cp: u64, dp: u64, ep: u64, etp: Option<u64>) -> PyResult<Mesh> {
    if [tp, cp, dp, ep].contains(&0) || etp == Some(0) {
        return Err(PyValueError::new_err("tp, cp, dp, ep and etp are at least 1"));
    }
    Ok(Mesh { tp, cp, dp, ep, etp: etp.unwrap_or(tp) })
}

/// Converts the HF release in `release` into a checkpoint in `out` for the mesh `tp`·`cp`·`dp`
/// (`ep`, `etp` for experts), in the dialect `target` ("fsdp_dtensor", "torch_dist",
/// "torchtitan"); the arguments are the CLI's `convert` flags. Returns what was written:
/// `{"model_type", "mesh", "world", "out", "files", "chunks", "tensor_bytes", "file_bytes",
/// "source_bytes", "unconverted", "seconds"}`.
#[pyfunction]
#[pyo3(signature = (release, out, *, tp=1, cp=1, dp=1, ep=1, etp=None, target="fsdp_dtensor", format="dcp",
    prefix=None, vocab_divisible_by=128, optimizer_state=false, overwrite=false, threads=None,
    torchtitan_version=None, dtype=None, zip_crc32=false, progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn convert<'py>(
    py: Python<'py>,
    release: PathBuf,
    out: PathBuf,
    tp: u64,
    cp: u64,
    dp: u64,
    ep: u64,
    etp: Option<u64>,
    target: &str,
    format: &str,
    prefix: Option<String>,
    vocab_divisible_by: u64,
    optimizer_state: bool,
    overwrite: bool,
    threads: Option<usize>,
    torchtitan_version: Option<&str>,
    dtype: Option<&str>,
    zip_crc32: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let mesh = mesh(tp, cp, dp, ep, etp)?;
    let mut req = request(
        release,
        out,
        mesh,
        target,
        format,
        prefix,
        vocab_divisible_by,
        optimizer_state,
        torchtitan_version,
        dtype,
    )?;
    req.overwrite = overwrite;
    req.zip_crc32 = zip_crc32;
    if let Some(t) = threads {
        req.threads = t.max(1);
    }
    let counters = Progress::default();
    let report = run_reporting(py, progress.as_ref(), &counters, || shardline_ops::convert(&req, &counters, &|| {}))?;
    let d = PyDict::new(py);
    d.set_item("model_type", &report.model_type)?;
    d.set_item("mesh", report.mesh.to_string())?;
    d.set_item("world", report.world)?;
    d.set_item("out", &report.out)?;
    d.set_item("files", report.written.files.len())?;
    d.set_item("chunks", report.written.chunks)?;
    d.set_item("tensor_bytes", report.written.tensor_bytes)?;
    d.set_item("file_bytes", report.written.file_bytes)?;
    d.set_item("source_bytes", report.source_bytes)?;
    d.set_item("unconverted", &report.unconverted)?;
    d.set_item("seconds", report.seconds)?;
    Ok(d)
}

fn plan_dict<'py>(py: Python<'py>, plan: &Plan) -> PyResult<Bound<'py, PyDict>> {
    let tensors = PyList::empty(py);
    for t in &plan.tensors {
        let chunks = PyList::empty(py);
        for c in t.chunks(&plan.mesh).filter(|c| c.written && c.numel() > 0) {
            let chunk = PyDict::new(py);
            chunk.set_item("rank", c.rank)?;
            chunk.set_item("offsets", &c.offsets)?;
            chunk.set_item("sizes", &c.sizes)?;
            chunks.append(chunk)?;
        }
        let tensor = PyDict::new(py);
        tensor.set_item("key", &t.key)?;
        tensor.set_item("dtype", t.dtype.torch_name())?;
        tensor.set_item("shape", &t.shape)?;
        tensor.set_item("chunks", chunks)?;
        tensors.append(tensor)?;
    }
    let d = PyDict::new(py);
    d.set_item("model_type", &plan.model_type)?;
    d.set_item("mesh", plan.mesh.to_string())?;
    d.set_item("world", plan.world())?;
    d.set_item("bytes_per_rank", plan.bytes_per_rank())?;
    d.set_item("tensors", tensors)?;
    d.set_item("unconverted", &plan.unconverted)?;
    Ok(d)
}

/// What `convert` would write, without writing: `{"model_type", "mesh", "world",
/// "bytes_per_rank", "tensors": [{"key", "dtype", "shape", "chunks": [{"rank", "offsets",
/// "sizes"}]}], "unconverted"}` (the CLI's `convert --dry-run --json`).
#[pyfunction]
#[pyo3(signature = (release, *, tp=1, cp=1, dp=1, ep=1, etp=None, target="fsdp_dtensor", prefix=None,
    vocab_divisible_by=128, optimizer_state=false, torchtitan_version=None, dtype=None))]
#[allow(clippy::too_many_arguments)]
pub fn plan<'py>(
    py: Python<'py>,
    release: PathBuf,
    tp: u64,
    cp: u64,
    dp: u64,
    ep: u64,
    etp: Option<u64>,
    target: &str,
    prefix: Option<String>,
    vocab_divisible_by: u64,
    optimizer_state: bool,
    torchtitan_version: Option<&str>,
    dtype: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let mesh = mesh(tp, cp, dp, ep, etp)?;
    let req = request(
        release.clone(),
        PathBuf::new(),
        mesh,
        target,
        "dcp",
        prefix,
        vocab_divisible_by,
        optimizer_state,
        torchtitan_version,
        dtype,
    )?;
    let plan = crate::without_gil(py, || {
        let options = req.plan_options()?;
        shardline_ops::plan_release(&release, mesh, &options).map(|(_, plan)| plan)
    })?;
    plan_dict(py, &plan)
}

/// The outcome of `validate`: true when every tensor was reconstructed bit-exactly.
#[pyclass(frozen, get_all, module = "shardline")]
pub struct ValidationReport {
    /// No finding: every expected key is there, every byte equals the release's.
    ok: bool,
    tensors: u64,
    items: u64,
    bytes_checked: u64,
    /// `(key, message)` per difference found (the first ones; `findings_not_listed` more).
    findings: Vec<(String, String)>,
    findings_not_listed: u64,
}

#[pymethods]
impl ValidationReport {
    fn __bool__(&self) -> bool {
        self.ok
    }

    fn __repr__(&self) -> String {
        format!(
            "ValidationReport(ok={}, tensors={}, items={}, bytes_checked={}, findings={})",
            if self.ok { "True" } else { "False" },
            self.tensors,
            self.items,
            self.bytes_checked,
            self.findings.len() as u64 + self.findings_not_listed
        )
    }
}

impl From<VerifyReport> for ValidationReport {
    fn from(r: VerifyReport) -> Self {
        ValidationReport {
            ok: r.ok(),
            tensors: r.tensors,
            items: r.items,
            bytes_checked: r.bytes_checked,
            findings: r.findings.into_iter().map(|f| (f.key, f.message)).collect(),
            findings_not_listed: r.findings_dropped,
        }
    }
}

/// Checks the checkpoint `ckpt` against the HF release `against` it was converted from: every
/// invariant, every tensor reconstructed bit-exactly. Differences are findings in the report;
/// an exception means the checkpoint could not be read.
#[pyfunction]
#[pyo3(signature = (ckpt, against, *, prefix=None, etp=1, progress=None))]
pub fn validate(
    py: Python<'_>,
    ckpt: PathBuf,
    against: PathBuf,
    prefix: Option<String>,
    etp: u64,
    progress: Option<Py<PyAny>>,
) -> PyResult<ValidationReport> {
    let req = ValidateRequest { ckpt, against, prefix, etp };
    let counters = Progress::default();
    let (report, _) = run_reporting(py, progress.as_ref(), &counters, || shardline_ops::validate(&req, &counters))?;
    Ok(report.into())
}
