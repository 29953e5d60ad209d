//! Writing safetensors files: the layout computed up front, then positional or sequential writes
//! under a temporary name, renamed into place once every byte is written.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use shardline_layout::DType;

use super::error::io_error;
use super::header::{byte_len_of, lookup_by_name, name_order};
use super::*;

/// The layout of a safetensors file to be written: its header bytes and every tensor's place.
///
/// Tensors are laid out contiguously in the order given; the JSON header is padded with spaces to
/// a multiple of 8 bytes, so the data section (and every tensor whose offset is a multiple of 8)
/// is 8-byte aligned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileLayout {
    /// The 8-byte length prefix followed by the padded JSON header.
    header: Vec<u8>,
    tensors: Vec<TensorInfo>,
    by_name: Vec<usize>,
    file_len: u64,
}

impl FileLayout {
    /// Lays out `tensors` (`(name, dtype, shape)`, in data order) with the given `__metadata__`
    /// (omitted from the header when empty).
    pub fn new<'a, I>(tensors: I, metadata: &BTreeMap<String, String>) -> Result<FileLayout, SafetensorsError>
    where
        I: IntoIterator<Item = (&'a str, DType, &'a [u64])>,
    {
        let mut json = Vec::new();
        json.push(b'{');
        let mut first = true;
        if !metadata.is_empty() {
            json.extend_from_slice(b"\"__metadata__\":");
            serde_json::to_writer(&mut json, metadata).map_err(|e| SafetensorsError::InvalidLayout {
                tensor: METADATA_KEY.to_string(),
                reason: e.to_string(),
            })?;
            first = false;
        }

        let mut names = HashSet::new();
        let mut placed: Vec<(String, DType, Vec<u64>, u64, u64)> = Vec::new();
        let mut offset = 0u64;
        for (name, dtype, shape) in tensors {
            let invalid = |reason: String| SafetensorsError::InvalidLayout { tensor: name.to_string(), reason };
            if name == METADATA_KEY {
                return Err(invalid("the name is reserved for the header's metadata".into()));
            }
            if !names.insert(name) {
                return Err(invalid("the name is listed more than once".into()));
            }
            let byte_len = byte_len_of(dtype, shape)
                .ok_or_else(|| invalid(format!("shape {shape:?} of {dtype} overflows a 64-bit byte count")))?;
            let end = offset
                .checked_add(byte_len)
                .ok_or_else(|| invalid(format!("data offset {offset} + {byte_len} overflows")))?;
            if !first {
                json.push(b',');
            }
            first = false;
            serde_json::to_writer(&mut json, name).map_err(|e| invalid(e.to_string()))?;
            json.extend_from_slice(b":{\"dtype\":\"");
            json.extend_from_slice(dtype.safetensors_name().as_bytes());
            json.extend_from_slice(b"\",\"shape\":");
            serde_json::to_writer(&mut json, shape).map_err(|e| invalid(e.to_string()))?;
            json.extend_from_slice(format!(",\"data_offsets\":[{offset},{end}]}}").as_bytes());
            placed.push((name.to_string(), dtype, shape.to_vec(), offset, byte_len));
            offset = end;
        }
        json.push(b'}');

        let padded = json.len().div_ceil(8) * 8;
        json.resize(padded, b' ');
        let header_len = json.len() as u64;
        if header_len > MAX_HEADER_LEN {
            return Err(SafetensorsError::LayoutHeaderTooLarge { header_len, limit: MAX_HEADER_LEN });
        }
        let data_start = LEN_PREFIX + header_len;
        let file_len = data_start.checked_add(offset).ok_or_else(|| SafetensorsError::InvalidLayout {
            tensor: placed.last().map(|p| p.0.clone()).unwrap_or_default(),
            reason: format!("file length {data_start} + {offset} overflows"),
        })?;

        let mut header = Vec::with_capacity(json.len() + LEN_PREFIX as usize);
        header.extend_from_slice(&header_len.to_le_bytes());
        header.extend_from_slice(&json);
        let tensors: Vec<TensorInfo> = placed
            .into_iter()
            .map(|(name, dtype, shape, begin, byte_len)| TensorInfo {
                name,
                dtype,
                shape,
                file_offset: data_start + begin,
                byte_len,
            })
            .collect();
        let by_name = name_order(&tensors);
        Ok(FileLayout { header, tensors, by_name, file_len })
    }

    /// The bytes that start the file: the 8-byte length and the padded JSON header.
    pub fn header_bytes(&self) -> &[u8] {
        &self.header
    }

    /// Absolute offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.header.len() as u64
    }

    /// Length of the complete file.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The tensors in data order, with their absolute offsets.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        lookup_by_name(&self.tensors, &self.by_name, name)
    }
}

/// Writes one safetensors file under a temporary name in the destination directory, renaming it
/// into place only when [`finish`](SafetensorsWriter::finish) finds every data byte written.
///
/// The header is written and the file extended to its final length on creation. Tensor bytes go
/// in with positional writes in any order, from any number of threads
/// ([`write_all_at`](SafetensorsWriter::write_all_at), [`write_tensor_at`](SafetensorsWriter::write_tensor_at)),
/// or sequentially ([`write_next`](SafetensorsWriter::write_next)). The writer records which bytes
/// were written. Dropped without `finish` (or when `finish` fails), it removes its temporary file,
/// so an interrupted write never leaves a file under the final name.
#[derive(Debug)]
pub struct SafetensorsWriter {
    layout: FileLayout,
    path: PathBuf,
    temp_path: PathBuf,
    file: File,
    /// Written absolute byte ranges of the data section, sorted, disjoint and non-adjacent.
    written: Mutex<Vec<(u64, u64)>>,
    /// Next absolute offset for `write_next`.
    cursor: u64,
    finished: bool,
}

impl SafetensorsWriter {
    /// Starts writing the file `path` with `layout`: creates a temporary file next to it, writes
    /// the header and sizes the file.
    pub fn create(path: impl AsRef<Path>, layout: FileLayout) -> Result<SafetensorsWriter, SafetensorsError> {
        let path = path.as_ref().to_path_buf();
        let Some(file_name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            return Err(SafetensorsError::InvalidOutputPath { path });
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let (file, temp_path) = create_temp(&dir, &file_name)?;
        let writer = SafetensorsWriter {
            cursor: layout.data_start(),
            layout,
            path,
            temp_path,
            file,
            written: Mutex::new(Vec::new()),
            finished: false,
        };
        // From here on, Drop removes the temporary file if anything fails.
        writer.file.set_len(writer.layout.file_len()).map_err(io_error(&writer.temp_path, "size the output file"))?;
        writer
            .file
            .write_all_at(writer.layout.header_bytes(), 0)
            .map_err(io_error(&writer.temp_path, "write the header"))?;
        Ok(writer)
    }

    /// The layout being written.
    pub fn layout(&self) -> &FileLayout {
        &self.layout
    }

    /// The final path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The temporary path written to until `finish`.
    pub fn temp_path(&self) -> &Path {
        &self.temp_path
    }

    /// Writes `bytes` at the absolute file `offset`, which must lie within the data section
    /// (the header is written by the writer itself).
    pub fn write_all_at(&self, offset: u64, bytes: &[u8]) -> Result<(), SafetensorsError> {
        let len = bytes.len() as u64;
        let data_begin = self.layout.data_start();
        let data_end = self.layout.file_len();
        let end = offset.checked_add(len);
        if offset < data_begin || end.is_none_or(|e| e > data_end) {
            return Err(SafetensorsError::WriteOutOfBounds {
                path: self.path.clone(),
                offset,
                len,
                data_begin,
                data_end,
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        self.file.write_all_at(bytes, offset).map_err(io_error(&self.temp_path, "write tensor data"))?;
        let mut written = self.written.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        insert_range(&mut written, offset, offset + len);
        Ok(())
    }

    /// Writes `bytes` at `offset` within the tensor `name`.
    pub fn write_tensor_at(&self, name: &str, offset: u64, bytes: &[u8]) -> Result<(), SafetensorsError> {
        let start = self.tensor_place(name, offset, bytes.len() as u64)?;
        self.write_all_at(start, bytes)
    }

    /// The file offset of `[offset, offset + len)` within the tensor `name`, checked to lie in it.
    fn tensor_place(&self, name: &str, offset: u64, len: u64) -> Result<u64, SafetensorsError> {
        let Some(info) = self.layout.tensor(name) else {
            return Err(SafetensorsError::UnknownTensor { path: self.path.clone(), tensor: name.to_string() });
        };
        if offset.checked_add(len).is_none_or(|e| e > info.byte_len) {
            return Err(SafetensorsError::TensorWriteOutOfBounds {
                path: self.path.clone(),
                tensor: name.to_string(),
                offset,
                len,
                byte_len: info.byte_len,
            });
        }
        Ok(info.file_offset + offset)
    }

    /// Copies `len` bytes of `source` from `source_offset` to `offset` within the tensor `name`
    /// inside the kernel (`copy_file_range`); returns how many were copied — fewer (down to 0)
    /// when the kernel cannot copy between these files, the caller then writing the rest.
    pub fn copy_into_tensor(
        &self,
        name: &str,
        offset: u64,
        source: &File,
        source_offset: u64,
        len: u64,
    ) -> Result<u64, SafetensorsError> {
        let start = self.tensor_place(name, offset, len)?;
        let mut done = 0u64;
        while done < len {
            let (mut off_in, mut off_out) = (source_offset + done, start + done);
            let want = (len - done).min(1 << 30) as usize;
            match rustix::fs::copy_file_range(source, Some(&mut off_in), &self.file, Some(&mut off_out), want) {
                Ok(0) => break,
                Ok(n) => done += n as u64,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) if crate::execute::copy_unsupported(e) => break,
                Err(e) => return Err(io_error(&self.temp_path, "copy tensor data")(e.into())),
            }
        }
        if done > 0 {
            let mut written = self.written.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            insert_range(&mut written, start, start + done);
        }
        Ok(done)
    }

    /// Appends `bytes` to the data written so far by `write_next`, starting at the data section's
    /// start: streaming the tensors' bytes in layout order writes the file sequentially.
    pub fn write_next(&mut self, bytes: &[u8]) -> Result<(), SafetensorsError> {
        self.write_all_at(self.cursor, bytes)?;
        self.cursor += bytes.len() as u64;
        Ok(())
    }

    /// Checks that every data byte was written, flushes the file to disk and renames it to its
    /// final path. Returns that path.
    pub fn finish(mut self) -> Result<PathBuf, SafetensorsError> {
        if let Some((missing_begin, missing_end)) = self.first_gap() {
            let tensor = self
                .layout
                .tensors()
                .iter()
                .find(|t| t.file_end() > missing_begin && t.byte_len > 0)
                .map(|t| t.name.clone())
                .unwrap_or_default();
            return Err(SafetensorsError::Incomplete { path: self.path.clone(), tensor, missing_begin, missing_end });
        }
        self.file.sync_all().map_err(io_error(&self.temp_path, "flush the output file to disk"))?;
        fs::rename(&self.temp_path, &self.path).map_err(io_error(&self.path, "rename the finished file into place"))?;
        self.finished = true;
        // Make the rename itself durable.
        if let Some(dir) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_error(dir, "flush the output directory to disk"))?;
        }
        Ok(self.path.clone())
    }

    /// The first range of the data section never written, if any.
    fn first_gap(&self) -> Option<(u64, u64)> {
        let written = self.written.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (begin, end) = (self.layout.data_start(), self.layout.file_len());
        if begin == end {
            return None;
        }
        match written.first() {
            Some(&(b, e)) if b == begin && e == end => None,
            Some(&(b, e)) if b == begin => Some((e, written.get(1).map_or(end, |n| n.0))),
            Some(&(b, _)) => Some((begin, b)),
            None => Some((begin, end)),
        }
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = fs::remove_file(&self.temp_path);
        }
    }
}

/// Creates a new, unique temporary file for `file_name` in `dir`. Its name starts with a dot and
/// ends in `.partial`, so it is never mistaken for a finished file.
fn create_temp(dir: &Path, file_name: &str) -> Result<(File, PathBuf), SafetensorsError> {
    let pid = std::process::id();
    let mut attempt = 0u32;
    loop {
        let temp = dir.join(format!(".{file_name}.{pid}-{attempt}.partial"));
        match OpenOptions::new().read(true).write(true).create_new(true).open(&temp) {
            Ok(file) => return Ok((file, temp)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 10_000 => attempt += 1,
            Err(e) => return Err(io_error(&temp, "create the temporary output file")(e)),
        }
    }
}

/// Adds `[begin, end)` to a sorted list of disjoint, non-adjacent ranges.
pub(super) fn insert_range(ranges: &mut Vec<(u64, u64)>, begin: u64, end: u64) {
    // First range that ends at or after `begin` (it may touch or overlap the new one).
    let first = ranges.partition_point(|&(_, e)| e < begin);
    // First range that starts after `end` (it stays separate).
    let last = ranges.partition_point(|&(b, _)| b <= end);
    let (mut b, mut e) = (begin, end);
    if first < last {
        if let (Some(lo), Some(hi)) = (ranges.get(first), ranges.get(last - 1)) {
            b = b.min(lo.0);
            e = e.max(hi.1);
        }
    }
    ranges.splice(first..last.max(first), [(b, e)]);
}

/// Writes a complete safetensors file in one go (for small files and tests): lays out `tensors`
/// in the order given, checks each data length, and writes through [`SafetensorsWriter`].
pub fn write_file(
    path: impl AsRef<Path>,
    tensors: &[(&str, DType, &[u64], &[u8])],
    metadata: &BTreeMap<String, String>,
) -> Result<(), SafetensorsError> {
    let path = path.as_ref();
    let layout = FileLayout::new(tensors.iter().map(|&(n, d, s, _)| (n, d, s)), metadata)?;
    for (&(name, _, _, data), info) in tensors.iter().zip(layout.tensors()) {
        if data.len() as u64 != info.byte_len {
            return Err(SafetensorsError::DataSizeMismatch {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                expected: info.byte_len,
                actual: data.len() as u64,
            });
        }
    }
    let mut writer = SafetensorsWriter::create(path, layout)?;
    for &(_, _, _, data) in tensors {
        writer.write_next(data)?;
    }
    writer.finish()?;
    Ok(())
}
