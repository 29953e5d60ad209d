//! Safetensors files and the HuggingFace releases made of them.
//!
//! * [`read_header`] reads the 8-byte length and the JSON header of one file — never the tensor
//!   data — and checks every entry against the format and against the file's length on disk.
//! * [`Release::open`] opens a release directory (`config.json` plus a single `model.safetensors`
//!   or shards listed by `model.safetensors.index.json`) and cross-checks the index against the
//!   shard headers.
//! * [`FileLayout`] and [`SafetensorsWriter`] write safetensors files: the header is computed up
//!   front, so every tensor's absolute offset is known before a data byte is written, and tensor
//!   bytes can be written in any order (positional writes) or streamed sequentially. The file is
//!   written under a temporary name and renamed into place by [`SafetensorsWriter::finish`] only
//!   once every data byte has been written.
//!
//! # Why the header is parsed here rather than by the `safetensors` crate
//!
//! The reference crate (`safetensors`, a dev-dependency used by the interoperability tests below)
//! does not fit reading headers of files of hundreds of GB without loading them:
//!
//! * `SafeTensors::read_metadata` wants a buffer holding the *whole file* (it compares the
//!   header's end offset with the buffer length), so it needs the file in memory or memory-mapped,
//!   and mapping a file takes `unsafe`, which this workspace denies.
//! * Its `Metadata` deserializer goes through a `HashMap`, so a duplicated tensor name silently
//!   keeps one of the two entries; it also rejects with errors that name neither the numbers nor,
//!   for size mismatches, the tensor (`TensorInvalidInfo`), and accepts dtypes we cannot convert
//!   (`C64`, `F4`, …) that we must reject with our own message anyway.
//!
//! So the header is parsed with `serde_json` straight from the file, entry by entry, each entry
//! checked as it is read and kept once (duplicated names stay visible), and every rule of the
//! format is checked here with a precise error. The tests check that files written here are
//! accepted by the reference crate with identical tensors, and that files written by the
//! reference crate are read identically here.
//!
//! The module is cut by job: `error` ([`SafetensorsError`], what can be wrong, with the numbers),
//! `header` (one file's header), `release` (a release directory), `writer` (writing files).

mod error;
mod header;
mod release;
mod writer;

#[cfg(test)]
mod tests;

pub use error::SafetensorsError;
pub use header::{read_header, FileHeader, TensorInfo};
pub use release::{Release, ReleaseTensor, SourceLocations};
pub use writer::{write_file, FileLayout, SafetensorsWriter};

/// Largest JSON header accepted or written, in bytes (the 8-byte length prefix not included).
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;
/// Largest `model.safetensors.index.json` read, in bytes.
pub const MAX_INDEX_LEN: u64 = 256 * 1024 * 1024;
/// Largest `config.json` read, in bytes.
pub const MAX_CONFIG_LEN: u64 = 64 * 1024 * 1024;
/// Name of the index of a sharded release.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";
/// Name of the weights file of an unsharded release.
pub const SINGLE_FILE_NAME: &str = "model.safetensors";
/// Name of the model configuration of a release.
pub const CONFIG_FILE_NAME: &str = "config.json";

/// Size of the little-endian `u64` header length that starts every safetensors file.
const LEN_PREFIX: u64 = 8;
/// The header key holding free-form string metadata rather than a tensor.
const METADATA_KEY: &str = "__metadata__";
