//! End-to-end tests of the `shardline` binary on the tiny real HF checkpoints in
//! `tests/fixtures/hf-tiny/` (written by `transformers`).

mod architecture;
mod bad_input;
mod command_steps;
mod convert;
mod disk;
mod export;
mod gc;
mod hub_s3;
mod metrics;
mod multihost;
mod notify;
mod object_source;
mod orchestrator;
mod pipeline_steps;
mod policy;
mod procs;
mod reshard;
mod soak;
mod startup;
mod torch_dist;
mod triggers;
mod validate_parts;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The binary under test. Its workers keep nothing free of the disk (unless a test says so with
/// `--scratch-reserve`): what the suite needs of scratch is small, and a machine whose disk has
/// less than the default 1 GiB free must not stall every rank task.
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shardline"));
    c.env("SHARDLINE_SCRATCH_RESERVE", "0");
    c
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny").join(name)
}

/// name → (dtype, shape, bytes) of every tensor of an HF release directory.
pub fn release_tensors(dir: &Path) -> std::collections::BTreeMap<String, (shardline_layout::DType, Vec<u64>, Vec<u8>)> {
    use std::os::unix::fs::FileExt;
    let release =
        shardline_formats::safetensors::Release::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let files: Vec<std::fs::File> = release.file_paths().map(|p| std::fs::File::open(p).expect("open")).collect();
    release
        .tensors()
        .map(|t| {
            let mut bytes = vec![0u8; t.info.byte_len as usize];
            files[t.file_index].read_exact_at(&mut bytes, t.info.file_offset).expect("read");
            (t.info.name.clone(), (t.info.dtype, t.info.shape.clone(), bytes))
        })
        .collect()
}

/// Every file under `dir`, by its path relative to `dir`, with its bytes: two checkpoints or
/// releases compared file for file.
pub fn file_bytes(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read dir") {
            let path = e.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(dir).expect("under dir").to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&path).expect("read file"));
            }
        }
    }
    out
}

pub fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("run shardline")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Converts `fixture` at the mesh `(tp, cp, dp, ep)` into `out`, asserting success.
pub fn convert(fixture_dir: &Path, out: &Path, mesh: (u64, u64, u64, u64), extra: &[&str]) -> Output {
    let (tp, cp, dp, ep) = mesh;
    let o = run(bin()
        .args(["convert", "--from"])
        .arg(fixture_dir)
        .arg("--to")
        .arg(out)
        .args(["--tp", &tp.to_string(), "--cp", &cp.to_string(), "--dp", &dp.to_string(), "--ep", &ep.to_string()])
        .args(extra));
    assert!(o.status.success(), "convert {mesh:?} failed: {}", stderr(&o));
    o
}

/// `GET path` on `addr` over plain HTTP/1.1: (status line, body).
pub fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("request");
    let mut response = String::new();
    s.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (head.lines().next().unwrap_or("").to_string(), body.to_string())
}
