//! Files to publish ([`FakeFile`], in memory or on disk) and the blobs they become: size,
//! sha256, git blob id, and whether the Hub would store them with LFS.

use std::fs::File;
use std::io::{self, Read};
use std::path::PathBuf;

use bytes::Bytes;
use sha1::Sha1;
use sha2::{Digest, Sha256};

/// A file to publish.
#[derive(Clone, Debug)]
pub struct FakeFile {
    pub(super) path: String,
    pub(super) data: Data,
    pub(super) lfs: Option<bool>,
}

#[derive(Clone, Debug)]
pub(super) enum Data {
    Memory(Bytes),
    Disk(PathBuf),
}

impl FakeFile {
    /// A file held in memory. It is stored with LFS (redirect to the CDN, sha256 published) if its
    /// extension is one `.gitattributes` sends to LFS on the Hub (`safetensors`, `bin`, `pt`, …) or it
    /// has 10 MiB or more; see [`FakeFile::lfs`].
    pub fn new(path: impl Into<String>, data: impl Into<Bytes>) -> Self {
        FakeFile { path: path.into(), data: Data::Memory(data.into()), lfs: None }
    }

    /// A file served from disk (read when published, to hash it, and on every download).
    pub fn from_disk(path: impl Into<String>, file: impl Into<PathBuf>) -> Self {
        FakeFile { path: path.into(), data: Data::Disk(file.into()), lfs: None }
    }

    /// Forces LFS on or off.
    pub fn lfs(mut self, yes: bool) -> Self {
        self.lfs = Some(yes);
        self
    }
}

pub(super) struct Blob {
    pub(super) size: u64,
    pub(super) sha256: String,
    pub(super) git_oid: String,
    pub(super) lfs: bool,
    pub(super) pointer_oid: String,
    pub(super) pointer_size: u64,
    pub(super) data: Data,
}

const LFS_EXTENSIONS: &[&str] = &[
    "7z",
    "arrow",
    "bin",
    "bz2",
    "ckpt",
    "ftz",
    "gguf",
    "gz",
    "h5",
    "joblib",
    "lz4",
    "mlmodel",
    "model",
    "msgpack",
    "npy",
    "npz",
    "onnx",
    "ot",
    "parquet",
    "pb",
    "pickle",
    "pkl",
    "pt",
    "pth",
    "rar",
    "safetensors",
    "tar",
    "tflite",
    "tgz",
    "wasm",
    "xz",
    "zip",
    "zst",
];

pub(super) fn make_blob(f: FakeFile) -> io::Result<Blob> {
    let size = match &f.data {
        Data::Memory(b) => b.len() as u64,
        Data::Disk(p) => std::fs::metadata(p)?.len(),
    };
    let ext = f.path.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase()).unwrap_or_default();
    let lfs = f.lfs.unwrap_or(LFS_EXTENSIONS.contains(&ext.as_str()) || size >= 10 << 20);
    let mut s256 = Sha256::new();
    let mut s1 = Sha1::new();
    s1.update(format!("blob {size}\0").as_bytes());
    let mut feed = |chunk: &[u8]| {
        s256.update(chunk);
        if !lfs {
            s1.update(chunk);
        }
    };
    match &f.data {
        Data::Memory(b) => feed(b),
        Data::Disk(p) => {
            let mut file = File::open(p)?;
            let mut buf = vec![0u8; 4 << 20];
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                feed(&buf[..n]);
            }
        }
    }
    let sha256 = hex::encode(s256.finalize());
    let pointer = format!("version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n");
    let mut p1 = Sha1::new();
    p1.update(format!("blob {}\0{pointer}", pointer.len()).as_bytes());
    let pointer_oid = hex::encode(p1.finalize());
    let git_oid = if lfs { pointer_oid.clone() } else { hex::encode(s1.finalize()) };
    Ok(Blob { size, sha256, git_oid, lfs, pointer_oid, pointer_size: pointer.len() as u64, data: f.data })
}
