//! Helpers shared by the integration tests: a release to publish, clients with fast retries.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use shardline_hub::fake::{FakeFile, FakeHub, RequestKind, RequestRecord};
use shardline_hub::{DownloadOptions, HubClient, RetryPolicy, Secret};

pub const REPO: &str = "acme/tiny-moe";

/// Deterministic pseudo-random bytes.
pub fn data(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// The files of a small release: LFS shards, JSON, a nested regular file.
pub fn release() -> Vec<(String, Vec<u8>)> {
    vec![
        ("config.json".into(), br#"{"model_type": "qwen3_moe", "num_experts": 8}"#.to_vec()),
        ("model-00001-of-00002.safetensors".into(), data(300 * 1024 + 7, 1)),
        ("model-00002-of-00002.safetensors".into(), data(200 * 1024 + 3, 2)),
        ("model.safetensors.index.json".into(), br#"{"weight_map": {}}"#.to_vec()),
        ("tokenizer/tokenizer.json".into(), br#"{"version": "1.0"}"#.to_vec()),
        ("README.md".into(), b"# tiny\n".to_vec()),
    ]
}

pub fn fake_files(files: &[(String, Vec<u8>)]) -> Vec<FakeFile> {
    files.iter().map(|(p, d)| FakeFile::new(p.clone(), d.clone())).collect()
}

pub async fn hub_with_release() -> (FakeHub, String) {
    let hub = FakeHub::start().await.unwrap();
    let sha = hub.publish(REPO, fake_files(&release())).unwrap();
    (hub, sha)
}

pub fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 4,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(40),
        max_retry_after: Duration::from_secs(5),
    }
}

pub fn client(hub: &FakeHub) -> HubClient {
    HubClient::new(hub.endpoint(), None).unwrap().with_retry_policy(fast_retry())
}

pub fn client_with_token(hub: &FakeHub, token: &str) -> HubClient {
    HubClient::new(hub.endpoint(), Some(Secret::new(token))).unwrap().with_retry_policy(fast_retry())
}

pub fn opts(cache: &Path) -> DownloadOptions {
    DownloadOptions { cache_dir: Some(cache.to_owned()), ..Default::default() }
}

pub fn repo_dir(cache: &Path) -> PathBuf {
    cache.join("models--acme--tiny-moe")
}

/// Requests that fetched (or redirected) a file's bytes.
pub fn file_requests(hub: &FakeHub, path: &str) -> Vec<RequestRecord> {
    hub.requests().into_iter().filter(|r| r.file.as_deref() == Some(path)).collect()
}

pub fn cdn_requests(hub: &FakeHub, path: &str) -> Vec<RequestRecord> {
    file_requests(hub, path).into_iter().filter(|r| r.kind == RequestKind::Cdn).collect()
}

/// Every regular file or symlink under `dir`, relative, sorted.
pub fn tree(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd {
            let p = e.unwrap().path();
            let ft = std::fs::symlink_metadata(&p).unwrap().file_type();
            if ft.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}
