//! `shardline._native.Checkpoint`: a checkpoint opened for lazy reads. Opening reads `.metadata`
//! (or the safetensors headers) only; a read fills a new `bytearray` with one box of one tensor
//! from just the chunks that meet it (`shardline_formats::checkpoint::read_box`), the GIL released.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};
use shardline_formats::checkpoint::{
    open_checkpoint, read_box, resolve_checkpoint_dir, Checkpoint as Stored, CheckpointError, CheckpointFormat,
    SliceRead, StoredObject, StoredTensor,
};
use shardline_formats::torch_save::read_object_archive;
use shardline_layout::reshard::ChunkBox;

use crate::{objects, without_gil};

/// A DCP checkpoint (Shardline's, torch's, or a dialect Shardline knows: a Megatron-LM save
/// directory, a torchtitan folder, a NeMo Automodel save) or DCP-sharded safetensors, opened.
#[pyclass(frozen, module = "shardline._native")]
pub struct Checkpoint {
    stored: Stored,
    tensors: HashMap<String, usize>,
    objects: HashMap<String, usize>,
}

#[pymethods]
impl Checkpoint {
    #[new]
    fn open(py: Python<'_>, path: PathBuf) -> PyResult<Checkpoint> {
        let stored = without_gil(py, || resolve_checkpoint_dir(&path).and_then(|dir| open_checkpoint(&dir)))?;
        let tensors = stored.tensors.iter().enumerate().map(|(i, t)| (t.key.clone(), i)).collect();
        let objects = stored.objects.iter().enumerate().map(|(i, o)| (o.key.clone(), i)).collect();
        Ok(Checkpoint { stored, tensors, objects })
    }

    /// The directory the checkpoint's files are in (for a save directory, the one it names).
    #[getter]
    fn dir(&self) -> PathBuf {
        self.stored.dir.clone()
    }

    /// `"dcp"` or `"dcp-safetensors"`.
    #[getter]
    fn format(&self) -> &'static str {
        match self.stored.format {
            CheckpointFormat::Dcp => "dcp",
            CheckpointFormat::DcpSafetensors => "dcp-safetensors",
        }
    }

    /// The tensors' keys, sorted.
    fn tensor_keys(&self) -> Vec<String> {
        self.stored.tensors.iter().map(|t| t.key.clone()).collect()
    }

    /// The bytes items' keys (`args`, `iteration`, …), in `.metadata` order.
    fn object_keys(&self) -> Vec<String> {
        self.stored.objects.iter().map(|o| o.key.clone()).collect()
    }

    /// `(dtype, shape, chunks)` of a tensor: torch's dtype name, the global shape, and per
    /// chunk `(offsets, sizes, file, byte offset, byte length)`.
    #[allow(clippy::type_complexity)]
    fn tensor(&self, key: &str) -> PyResult<(&'static str, Vec<u64>, Vec<(Vec<u64>, Vec<u64>, String, u64, u64)>)> {
        let t = self.stored_tensor(key)?;
        let chunks = t
            .chunks
            .iter()
            .map(|c| (c.offsets.clone(), c.sizes.clone(), c.file.to_string(), c.data_offset, c.data_len))
            .collect();
        Ok((t.dtype.torch_name(), t.shape.clone(), chunks))
    }

    /// The box `offsets`/`sizes` of tensor `key`, row-major in a new `bytearray`, and what
    /// reading it cost: `{"chunks", "bytes_read", "reads"}`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
    ) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyDict>)> {
        let t = self.stored_tensor(key)?;
        let want = ChunkBox { offsets, sizes };
        let len = want
            .sizes
            .iter()
            .try_fold(t.dtype.size() as u64, |n, &d| n.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| PyValueError::new_err(format!("`{key}`: the box {want} is too large")))?;
        let dir = &self.stored.dir;
        let mut cost = SliceRead::default();
        let data = PyByteArray::new_with(py, len, |out| {
            cost = without_gil(py, || read_box(dir, t, &want, out))?;
            Ok(())
        })?;
        let stats = PyDict::new(py);
        stats.set_item("chunks", cost.chunks)?;
        stats.set_item("bytes_read", cost.bytes_read)?;
        stats.set_item("reads", cost.reads)?;
        Ok((data, stats))
    }

    /// A bytes item's stored bytes (a `torch.save` archive), not unpickled.
    fn object_bytes<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let o = self.stored_object(key)?;
        let path = self.stored.dir.join(&*o.file);
        let len = usize::try_from(o.length).map_err(|_| PyValueError::new_err(format!("`{key}` is too large")))?;
        PyBytes::new_with(py, len, |out| {
            without_gil(py, || {
                let file = File::open(&path).map_err(|error| CheckpointError::Io {
                    path: path.clone(),
                    action: "open",
                    error,
                })?;
                file.read_exact_at(out, o.offset).map_err(|error| CheckpointError::Io {
                    path: path.clone(),
                    action: "read",
                    error,
                })
            })
        })
    }

    /// A bytes item, unpickled by a reader that never imports or calls anything: plain Python
    /// values come back as themselves, an `argparse.Namespace` as one, and any other object as a
    /// `shardline.PickledObject` describing it.
    fn object<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyAny>> {
        let o = self.stored_object(key)?;
        let path = self.stored.dir.join(&*o.file);
        let value = without_gil(py, || {
            let file =
                File::open(&path).map_err(|error| CheckpointError::Io { path: path.clone(), action: "open", error })?;
            read_object_archive(&file, o.offset, o.length).map_err(|source| CheckpointError::Item {
                key: o.key.clone(),
                offsets: Vec::new(),
                file: o.file.to_string(),
                offset: o.offset,
                length: o.length,
                source,
            })
        })?;
        objects::to_python(py, &value)
    }
}

impl Checkpoint {
    fn stored_tensor(&self, key: &str) -> PyResult<&StoredTensor> {
        match self.tensors.get(key) {
            Some(&i) => Ok(&self.stored.tensors[i]),
            None if self.objects.contains_key(key) => {
                Err(PyKeyError::new_err(format!("`{key}` is a bytes item, not a tensor: read it with get_object")))
            }
            None => Err(PyKeyError::new_err(format!("`{key}`: no such tensor in {}", self.stored.dir.display()))),
        }
    }

    fn stored_object(&self, key: &str) -> PyResult<&StoredObject> {
        match self.objects.get(key) {
            Some(&i) => Ok(&self.stored.objects[i]),
            None if self.tensors.contains_key(key) => {
                Err(PyKeyError::new_err(format!("`{key}` is a tensor, not a bytes item: read it with get_tensor")))
            }
            None => Err(PyKeyError::new_err(format!("`{key}`: no such bytes item in {}", self.stored.dir.display()))),
        }
    }
}
