//! The Hub client against the local Hub server: resolution, the cache layout, reuse, patterns,
//! every fault (retried, resumed, or a clear error), parallel ranges, watchers, listings.

mod common;

use std::fs;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use shardline_hub::fake::{FakeFile, FakeHub, Fault, FaultKind, FaultTarget, RequestKind};
use shardline_hub::{DownloadOptions, HubEnv, HubError, RepoCache, RepoId};

const SHARD1: &str = "model-00001-of-00002.safetensors";
const SHARD2: &str = "model-00002-of-00002.safetensors";

fn git_blob_sha1(b: &[u8]) -> String {
    use sha1::{Digest, Sha1};
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", b.len()).as_bytes());
    h.update(b);
    hex::encode(h.finalize())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_lists_files_with_sizes_and_lfs_sha256_across_pages() {
    let (hub, sha) = hub_with_release().await;
    hub.set_tree_page_size(2);
    let rev = client(&hub).resolve(REPO, "main").await.unwrap();
    assert_eq!(rev.sha, sha);
    assert_eq!(rev.total_size(), release().iter().map(|(_, d)| d.len() as u64).sum::<u64>());
    let want = release();
    assert_eq!(rev.files.len(), want.len(), "directories are not files; every page was read");
    for (path, bytes) in &want {
        let f = rev.files.iter().find(|f| &f.path == path).unwrap_or_else(|| panic!("{path} missing"));
        assert_eq!(f.size, bytes.len() as u64, "{path}");
        if path.ends_with(".safetensors") {
            assert_eq!(f.lfs_sha256.as_deref(), Some(sha256_hex(bytes).as_str()), "{path}");
        } else {
            assert_eq!(f.lfs_sha256, None, "{path}");
            assert_eq!(f.blob_id, git_blob_sha1(bytes), "{path}: the git blob id names regular blobs");
        }
    }
    let tree_pages = hub.requests().iter().filter(|r| r.kind == RequestKind::Tree).count();
    assert!(tree_pages >= 4, "{tree_pages} tree pages");

    let c = client(&hub);
    assert_eq!(c.resolve_revision(REPO, &sha).await.unwrap(), sha);
    hub.set_ref(REPO, "refs/pr/1", &sha);
    assert_eq!(c.resolve_revision(REPO, "refs/pr/1").await.unwrap(), sha, "revisions are percent-encoded");
    let e = c.resolve_revision(REPO, "nope").await.unwrap_err();
    assert!(matches!(e, HubError::RevisionNotFound { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_writes_the_hf_cache_layout() {
    let (hub, sha) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    let total: u64 = release().iter().map(|(_, d)| d.len() as u64).sum();
    assert_eq!(snap.sha, sha);
    assert_eq!(snap.bytes_downloaded, total);
    assert_eq!(snap.bytes_reused, 0);
    let repo = repo_dir(cache.path());
    assert_eq!(snap.dir, repo.join("snapshots").join(&sha));
    assert_eq!(fs::read_to_string(repo.join("refs/main")).unwrap(), sha, "refs/main holds the sha, no newline");
    for (path, bytes) in release() {
        let link = snap.path(&path);
        assert_eq!(fs::read(&link).unwrap(), bytes, "{path}");
        let target = fs::read_link(&link).unwrap();
        let blob = if path.ends_with(".safetensors") { sha256_hex(&bytes) } else { git_blob_sha1(&bytes) };
        let ups = "../".repeat(2 + path.matches('/').count());
        assert_eq!(target.to_string_lossy(), format!("{ups}blobs/{blob}"), "{path}: relative link to the blob");
    }
    let blobs = tree(&repo.join("blobs"));
    assert_eq!(blobs.len(), release().len());
    assert!(blobs.iter().all(|b| !b.contains("incomplete")), "{blobs:?}");
    assert!(cache.path().join(".locks/models--acme--tiny-moe").is_dir(), "huggingface_hub's lock folder");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_download_reuses_the_cache() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let c = client(&hub);
    c.download(REPO, "main", &opts(cache.path())).await.unwrap();
    hub.clear_requests();
    let snap = c.download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(snap.bytes_downloaded, 0);
    assert_eq!(snap.bytes_reused, release().iter().map(|(_, d)| d.len() as u64).sum::<u64>());
    let fetched: Vec<_> =
        hub.requests().into_iter().filter(|r| matches!(r.kind, RequestKind::Resolve | RequestKind::Cdn)).collect();
    assert!(fetched.is_empty(), "{fetched:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blobs_another_client_put_in_the_cache_are_reused() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let blobs = repo_dir(cache.path()).join("blobs");
    fs::create_dir_all(&blobs).unwrap();
    let files = release();
    let shard1 = &files.iter().find(|(p, _)| p == SHARD1).unwrap().1;
    fs::write(blobs.join(sha256_hex(shard1)), shard1).unwrap();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(snap.bytes_reused, shard1.len() as u64);
    assert!(file_requests(&hub, SHARD1).is_empty());
    assert_eq!(&fs::read(snap.path(SHARD1)).unwrap(), shard1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_and_ignore_patterns_select_files() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let o = DownloadOptions {
        allow: vec!["*.safetensors".into(), "*.json".into()],
        ignore: vec!["tokenizer/".into()],
        ..opts(cache.path())
    };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    let got: Vec<_> = snap.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(got, ["config.json", SHARD1, SHARD2, "model.safetensors.index.json"]);
    assert_eq!(tree(&snap.dir), got);
    let bad = DownloadOptions { allow: vec!["[".into()], ..opts(cache.path()) };
    assert!(matches!(client(&hub).download(REPO, "main", &bad).await, Err(HubError::InvalidPattern { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_repository_is_an_immediate_clear_error() {
    let hub = FakeHub::start().await.unwrap();
    let cache = tempfile::tempdir().unwrap();
    let e = client(&hub).download("acme/nope", "main", &opts(cache.path())).await.unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, HubError::RepoNotFoundOrGated { .. }), "{msg}");
    assert!(msg.contains("not found or gated") && msg.contains("HF_TOKEN"), "{msg}");
    assert_eq!(hub.requests().len(), 1, "not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gated_repository_needs_the_token() {
    let (hub, _) = hub_with_release().await;
    hub.require_token(REPO, "hf_right");
    let cache = tempfile::tempdir().unwrap();

    let e = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap_err();
    assert!(e.to_string().contains("set HF_TOKEN"), "{e}");
    let e = client_with_token(&hub, "hf_wrong").download(REPO, "main", &opts(cache.path())).await.unwrap_err();
    assert!(e.to_string().contains("token in use has no access"), "{e}");
    assert_eq!(hub.requests().len(), 2, "401 is not retried");

    let snap = client_with_token(&hub, "hf_right").download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(snap.files.len(), release().len());
    let (cdn, hub_side): (Vec<_>, Vec<_>) =
        hub.requests()[2..].iter().cloned().partition(|r| r.kind == RequestKind::Cdn);
    assert!(hub_side.iter().all(|r| r.authorization), "the token goes with every request to the endpoint");
    assert!(!cdn.is_empty() && cdn.iter().all(|r| !r.authorization), "and never to the CDN, another origin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_answering_404_fails_at_once_naming_it() {
    let (hub, _) = hub_with_release().await;
    hub.inject(Fault::new(FaultTarget::File("config.json".into()), FaultKind::NotFound));
    let cache = tempfile::tempdir().unwrap();
    let e = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap_err();
    assert!(matches!(&e, HubError::EntryNotFound { path, .. } if path == "config.json"), "{e}");
    assert_eq!(file_requests(&hub, "config.json").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_retried_after_retry_after() {
    let (hub, _) = hub_with_release().await;
    hub.inject(
        Fault::new(FaultTarget::File(SHARD1.into()), FaultKind::TooManyRequests { retry_after_secs: 1 }).times(1),
    );
    let cache = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert!(t.elapsed() >= Duration::from_secs(1), "Retry-After honoured: {:?}", t.elapsed());
    let statuses: Vec<u16> = file_requests(&hub, SHARD1).iter().map(|r| r.status).collect();
    assert_eq!(statuses, [429, 302, 200]);
    assert_eq!(fs::read(snap.path(SHARD1)).unwrap(), release()[1].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_then_reported() {
    let (hub, _) = hub_with_release().await;
    hub.inject(Fault::new(FaultTarget::File(SHARD2.into()), FaultKind::ServerError).times(2));
    let cache = tempfile::tempdir().unwrap();
    client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    let statuses: Vec<u16> = file_requests(&hub, SHARD2).iter().map(|r| r.status).collect();
    assert_eq!(statuses, [500, 500, 302, 200]);

    hub.inject(Fault::new(FaultTarget::Api, FaultKind::Status(503)));
    hub.clear_requests();
    let e = client(&hub).resolve(REPO, "main").await.unwrap_err();
    assert!(matches!(e, HubError::Http { status: 503, attempts: 4, .. }), "{e}");
    assert!(e.to_string().contains("HTTP 503") && e.to_string().contains("4 attempt"), "{e}");
    assert_eq!(hub.requests().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_resumes_with_range() {
    let (hub, _) = hub_with_release().await;
    hub.inject(Fault::new(FaultTarget::File(SHARD1.into()), FaultKind::CutAfter(100_000)).times(1));
    let cache = tempfile::tempdir().unwrap();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(fs::read(snap.path(SHARD1)).unwrap(), release()[1].1);
    let cdn = cdn_requests(&hub, SHARD1);
    assert_eq!(cdn.len(), 2, "{cdn:?}");
    assert_eq!(cdn[0].range, None);
    let range = cdn[1].range.clone().expect("the retry asks for a range");
    let from: u64 = range.strip_prefix("bytes=").unwrap().split('-').next().unwrap().parse().unwrap();
    assert!(from > 0 && from <= 100_000, "resumed from {from}");
    assert_eq!(
        snap.bytes_downloaded,
        release().iter().map(|(_, d)| d.len() as u64).sum::<u64>(),
        "no byte fetched twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_file_from_an_interrupted_run_is_resumed() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let bytes = release()[1].1.clone();
    let blobs = repo_dir(cache.path()).join("blobs");
    fs::create_dir_all(&blobs).unwrap();
    fs::write(blobs.join(format!("{}.incomplete", sha256_hex(&bytes))), &bytes[..123_456]).unwrap();
    let o = DownloadOptions { allow: vec![SHARD1.into()], ..opts(cache.path()) };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    let cdn = cdn_requests(&hub, SHARD1);
    assert_eq!(cdn.len(), 1);
    assert_eq!(cdn[0].range.as_deref(), Some(format!("bytes=123456-{}", bytes.len() - 1).as_str()));
    assert_eq!(cdn[0].status, 206);
    assert_eq!(snap.bytes_downloaded, bytes.len() as u64 - 123_456);
    assert_eq!(fs::read(snap.path(SHARD1)).unwrap(), bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_partial_file_is_caught_and_downloaded_again() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let bytes = release()[1].1.clone();
    let blobs = repo_dir(cache.path()).join("blobs");
    fs::create_dir_all(&blobs).unwrap();
    let mut junk = bytes[..50_000].to_vec();
    junk[10] ^= 1;
    fs::write(blobs.join(format!("{}.incomplete", sha256_hex(&bytes))), &junk).unwrap();
    let o = DownloadOptions { allow: vec![SHARD1.into()], ..opts(cache.path()) };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    let ranges: Vec<_> = cdn_requests(&hub, SHARD1).iter().map(|r| r.range.clone()).collect();
    assert_eq!(ranges, [Some(format!("bytes=50000-{}", bytes.len() - 1)), None], "resumed, mismatched, fetched whole");
    assert_eq!(fs::read(snap.path(SHARD1)).unwrap(), bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_blob_is_deleted_and_downloaded_again() {
    let (hub, _) = hub_with_release().await;
    hub.inject(Fault::new(FaultTarget::File(SHARD2.into()), FaultKind::Corrupt).times(1));
    let cache = tempfile::tempdir().unwrap();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(cdn_requests(&hub, SHARD2).len(), 2);
    assert_eq!(fs::read(snap.path(SHARD2)).unwrap(), release()[2].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistently_corrupt_blob_fails_and_never_reaches_the_snapshot() {
    let (hub, sha) = hub_with_release().await;
    hub.inject(Fault::new(FaultTarget::File(SHARD2.into()), FaultKind::Corrupt));
    let cache = tempfile::tempdir().unwrap();
    let e = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap_err();
    let expected = sha256_hex(&release()[2].1);
    match &e {
        HubError::ChecksumMismatch { path, algorithm, expected: exp, actual, .. } => {
            assert_eq!(path, SHARD2);
            assert_eq!(*algorithm, "sha256");
            assert_eq!(exp, &expected);
            assert_ne!(actual, &expected);
            let msg = e.to_string();
            assert!(msg.contains(SHARD2) && msg.contains(&expected) && msg.contains(actual.as_str()), "{msg}");
        }
        other => panic!("{other}"),
    }
    let repo = repo_dir(cache.path());
    assert!(!repo.join("snapshots").join(&sha).join(SHARD2).exists(), "never linked");
    let blobs = tree(&repo.join("blobs"));
    assert!(blobs.iter().all(|b| !b.starts_with(&expected)), "corrupt bytes deleted: {blobs:?}");
    assert!(!repo.join("refs/main").exists(), "a failed download records no ref");

    // A regular (git) file is checked by its blob sha1 the same way.
    hub.clear_faults();
    hub.inject(Fault::new(FaultTarget::File("config.json".into()), FaultKind::Corrupt));
    let fresh = tempfile::tempdir().unwrap();
    let e = client(&hub).download(REPO, "main", &opts(fresh.path())).await.unwrap_err();
    assert!(
        matches!(&e, HubError::ChecksumMismatch { algorithm: "git-sha1", path, .. } if path == "config.json"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_blob_already_in_the_cache_is_replaced() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let c = client(&hub);
    let snap = c.download(REPO, "main", &opts(cache.path())).await.unwrap();
    let good = release()[1].1.clone();
    let blob = repo_dir(cache.path()).join("blobs").join(sha256_hex(&good));
    let mut bad = good.clone();
    bad[1000] ^= 0x40; // same size, wrong bytes: what a bad Xet reconstruction leaves behind
    fs::write(&blob, &bad).unwrap();
    hub.clear_requests();
    let again = c.download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(again.bytes_downloaded, good.len() as u64);
    assert_eq!(fs::read(snap.path(SHARD1)).unwrap(), good);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_files_download_as_parallel_ranges() {
    let hub = FakeHub::start().await.unwrap();
    let big = data((1 << 20) + 17, 9);
    hub.publish(REPO, vec![FakeFile::new("big.safetensors", big.clone())]).unwrap();
    hub.inject(Fault::new(FaultTarget::Any, FaultKind::Delay(Duration::from_millis(50))));
    let cache = tempfile::tempdir().unwrap();
    let o = DownloadOptions { concurrency: 4, split_threshold: 256 << 10, part_size: 64 << 10, ..opts(cache.path()) };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    assert_eq!(fs::read(snap.path("big.safetensors")).unwrap(), big);
    let cdn = cdn_requests(&hub, "big.safetensors");
    assert_eq!(cdn.len(), 17, "ceil(1 MiB + 17 B / 64 KiB) ranges");
    assert!(cdn.iter().all(|r| r.status == 206 && r.range.is_some()));
    let hub_side: Vec<_> =
        file_requests(&hub, "big.safetensors").into_iter().filter(|r| r.kind == RequestKind::Resolve).collect();
    assert_eq!(hub_side.len(), 1, "one redirect for all the ranges");
    assert_eq!((hub_side[0].method.as_str(), hub_side[0].status), ("HEAD", 302));
    assert!(hub.max_in_flight() <= 4 && hub.max_in_flight() >= 2, "bounded parallelism: {}", hub.max_in_flight());
    assert!(tree(&repo_dir(cache.path()).join("blobs")).iter().all(|b| !b.contains("incomplete")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_range_is_resumed_inside_its_part() {
    let hub = FakeHub::start().await.unwrap();
    let big = data(1 << 20, 10);
    hub.publish(REPO, vec![FakeFile::new("big.safetensors", big.clone())]).unwrap();
    hub.inject(Fault::new(FaultTarget::File("big.safetensors".into()), FaultKind::CutAfter(10_000)).skip(3).times(1));
    let cache = tempfile::tempdir().unwrap();
    let o = DownloadOptions { concurrency: 4, split_threshold: 256 << 10, part_size: 64 << 10, ..opts(cache.path()) };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    assert_eq!(fs::read(snap.path("big.safetensors")).unwrap(), big);
    let cdn = cdn_requests(&hub, "big.safetensors");
    assert_eq!(cdn.len(), 17, "16 parts + 1 resumed");
    let mid_part = cdn.iter().filter_map(|r| r.range.as_deref()).any(|r| {
        let from: u64 = r["bytes=".len()..].split('-').next().unwrap().parse().unwrap();
        !from.is_multiple_of(64 << 10)
    });
    assert!(mid_part, "the cut part resumed where it stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_download_with_bounded_concurrency() {
    let hub = FakeHub::start().await.unwrap();
    let files: Vec<FakeFile> =
        (0..10).map(|i| FakeFile::new(format!("shard-{i}.safetensors"), data(20_000, i))).collect();
    hub.publish(REPO, files).unwrap();
    hub.inject(Fault::new(FaultTarget::Any, FaultKind::Delay(Duration::from_millis(100))));
    let cache = tempfile::tempdir().unwrap();
    let o = DownloadOptions { concurrency: 3, ..opts(cache.path()) };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    assert_eq!(snap.files.len(), 10);
    // Every request takes 100 ms, so streams overlap: as many as allowed, never more.
    assert_eq!(hub.max_in_flight(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ignores_range_gets_a_restart() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let bytes = release()[1].1.clone();
    let blobs = repo_dir(cache.path()).join("blobs");
    fs::create_dir_all(&blobs).unwrap();
    fs::write(blobs.join(format!("{}.incomplete", sha256_hex(&bytes))), &bytes[..1000]).unwrap();
    hub.inject(Fault::new(FaultTarget::File(SHARD1.into()), FaultKind::IgnoreRange));
    let o = DownloadOptions { allow: vec![SHARD1.into()], ..opts(cache.path()) };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    assert_eq!(cdn_requests(&hub, SHARD1)[0].status, 200);
    assert_eq!(fs::read(snap.path(SHARD1)).unwrap(), bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_sha_is_a_cheap_conditional_check() {
    let (hub, sha1) = hub_with_release().await;
    let c = client(&hub);
    assert_eq!(c.head_sha(REPO, "main", None).await.unwrap(), Some(sha1.clone()));
    hub.clear_requests();
    assert_eq!(c.head_sha(REPO, "main", Some(&sha1)).await.unwrap(), None);
    let r = &hub.requests()[0];
    assert_eq!((r.status, r.if_none_match.as_deref()), (304, Some(format!("\"{sha1}\"").as_str())));
    let sha2 = hub.publish(REPO, vec![FakeFile::new("config.json", "{}")]).unwrap();
    assert_eq!(c.head_sha(REPO, "main", Some(&sha1)).await.unwrap(), Some(sha2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repository_updated_while_serving() {
    let (hub, sha1) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let c = client(&hub);
    c.download(REPO, "main", &opts(cache.path())).await.unwrap();
    let mut files = release();
    files[0].1 = br#"{"model_type": "qwen3_moe", "num_experts": 16}"#.to_vec();
    let sha2 = hub.publish(REPO, fake_files(&files)).unwrap();
    let snap = c.download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(snap.sha, sha2);
    assert_eq!(snap.bytes_downloaded, files[0].1.len() as u64, "only the changed file");
    let repo = RepoCache::new(cache.path(), &RepoId::parse(REPO).unwrap());
    assert_eq!(repo.read_ref("main").as_deref(), Some(sha2.as_str()));
    assert!(repo.snapshot_dir(&sha1).is_dir() && repo.snapshot_dir(&sha2).is_dir());
    let old = c.download(REPO, &sha1, &opts(cache.path())).await.unwrap();
    assert_eq!((old.sha.as_str(), old.bytes_downloaded), (sha1.as_str(), 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_models_by_author_and_search() {
    let hub = FakeHub::start().await.unwrap();
    let a = hub.publish("acme/a-moe", vec![FakeFile::new("config.json", "{}")]).unwrap();
    hub.publish("acme/b-dense", vec![FakeFile::new("config.json", "{}")]).unwrap();
    hub.publish("other/c-moe", vec![FakeFile::new("config.json", "{}")]).unwrap();
    let got = client(&hub).list_models(Some("acme"), Some("MoE")).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].id.as_str(), got[0].sha.as_deref()), ("acme/a-moe", Some(a.as_str())));
    assert!(got[0].last_modified.is_some());
    assert_eq!(client(&hub).list_models(None, Some("moe")).await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_mode_serves_the_verified_cache() {
    let (hub, sha) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    hub.clear_requests();
    let off = client(&hub).with_offline(true);
    let snap = off.download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(snap.sha, sha);
    assert_eq!(snap.files.len(), release().len());
    assert_eq!(snap.files.iter().find(|f| f.path == SHARD1).unwrap().lfs_sha256, Some(sha256_hex(&release()[1].1)));
    assert!(hub.requests().is_empty());
    assert!(off.download(REPO, "v2", &opts(cache.path())).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_is_reported() {
    let (hub, _) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let last = Arc::new(AtomicU64::new(0));
    let (c2, l2) = (calls.clone(), last.clone());
    let o = DownloadOptions {
        progress: Some(Arc::new(move |p: &shardline_hub::DownloadProgress| {
            c2.fetch_add(1, Ordering::SeqCst);
            l2.fetch_max(p.bytes_downloaded, Ordering::SeqCst);
            assert!(p.files_done <= p.files_total);
        })),
        ..opts(cache.path())
    };
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    assert!(calls.load(Ordering::SeqCst) >= release().len());
    assert_eq!(last.load(Ordering::SeqCst), snap.bytes_downloaded);
}

#[test]
fn environment_is_read_like_huggingface_hub() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path().to_string_lossy().into_owned();
    let lookup =
        |pairs: Vec<(&'static str, String)>| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());

    let e = HubEnv::from_lookup(lookup(vec![("HOME", h.clone())])).unwrap();
    assert_eq!(e.endpoint, "https://huggingface.co");
    assert_eq!(e.cache_dir, home.path().join(".cache/huggingface/hub"));
    assert!(e.token.is_none());

    fs::create_dir_all(home.path().join("hf")).unwrap();
    fs::write(home.path().join("hf/token"), "hf_fromfile\n").unwrap();
    let e = HubEnv::from_lookup(lookup(vec![
        ("HOME", h.clone()),
        ("HF_HOME", format!("{h}/hf")),
        ("HF_ENDPOINT", "http://x:1/".into()),
    ]))
    .unwrap();
    assert_eq!(e.endpoint, "http://x:1");
    assert_eq!(e.cache_dir, home.path().join("hf/hub"));
    assert_eq!(e.token.unwrap().expose(), "hf_fromfile");

    fs::write(home.path().join("tok"), "hf_path").unwrap();
    let e = HubEnv::from_lookup(lookup(vec![
        ("HOME", h.clone()),
        ("HF_TOKEN_PATH", format!("{h}/tok")),
        ("HF_HUB_CACHE", "~/c".into()),
        ("HF_HUB_OFFLINE", "1".into()),
    ]))
    .unwrap();
    assert_eq!(e.token.unwrap().expose(), "hf_path");
    assert_eq!(e.cache_dir, home.path().join("c"));
    assert!(e.offline);

    let e = HubEnv::from_lookup(lookup(vec![
        ("HOME", h.clone()),
        ("HF_TOKEN", "hf_env".into()),
        ("HF_HOME", format!("{h}/hf")),
    ]))
    .unwrap();
    assert_eq!(e.token.unwrap().expose(), "hf_env", "HF_TOKEN wins over the token file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_parallel_download_keeps_a_resumable_prefix() {
    let hub = FakeHub::start().await.unwrap();
    let big = data(1 << 20, 11);
    let sha256 = sha256_hex(&big);
    hub.publish(REPO, vec![FakeFile::new("big.safetensors", big.clone())]).unwrap();
    // After the first parts, every request for the file gets a 403 (not retried).
    hub.inject(Fault::new(FaultTarget::File("big.safetensors".into()), FaultKind::Status(403)).skip(5));
    let cache = tempfile::tempdir().unwrap();
    let o = DownloadOptions { concurrency: 2, split_threshold: 256 << 10, part_size: 64 << 10, ..opts(cache.path()) };
    let e = client(&hub).download(REPO, "main", &o).await.unwrap_err();
    assert!(matches!(e, HubError::RepoNotFoundOrGated { status: 403, .. }), "{e}");
    let blobs = repo_dir(cache.path()).join("blobs");
    assert_eq!(tree(&blobs), [format!("{sha256}.incomplete")], "parts out of order never stay behind");
    let partial = fs::read(blobs.join(format!("{sha256}.incomplete"))).unwrap();
    assert!(partial.len() < big.len());
    assert!(
        partial == big[..partial.len()],
        "the kept file ({} bytes) is a prefix any client can resume",
        partial.len()
    );

    hub.clear_faults();
    hub.clear_requests();
    let snap = client(&hub).download(REPO, "main", &o).await.unwrap();
    assert_eq!(snap.bytes_downloaded, (big.len() - partial.len()) as u64);
    let first = cdn_requests(&hub, "big.safetensors")
        .iter()
        .map(|r| {
            r.range.as_deref().map_or(0, |r| r["bytes=".len()..].split('-').next().unwrap().parse::<usize>().unwrap())
        })
        .min();
    assert_eq!(first, Some(partial.len()), "resumed where the prefix ends");
    assert_eq!(fs::read(snap.path("big.safetensors")).unwrap(), big);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cdn_refusal_is_retried_through_a_fresh_redirect() {
    let (hub, _) = hub_with_release().await;
    // The Hub's redirect passes; the CDN then refuses once (an expired signed URL).
    hub.inject(Fault::new(FaultTarget::File(SHARD1.into()), FaultKind::Status(403)).skip(1).times(1));
    let cache = tempfile::tempdir().unwrap();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    let seen: Vec<(RequestKind, u16)> = file_requests(&hub, SHARD1).iter().map(|r| (r.kind, r.status)).collect();
    assert_eq!(
        seen,
        [(RequestKind::Resolve, 302), (RequestKind::Cdn, 403), (RequestKind::Resolve, 302), (RequestKind::Cdn, 200)]
    );
    assert_eq!(fs::read(snap.path(SHARD1)).unwrap(), release()[1].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_downloads_into_one_cache_fetch_each_blob_once() {
    let (hub, _) = hub_with_release().await;
    hub.inject(Fault::new(FaultTarget::Any, FaultKind::Delay(Duration::from_millis(30))));
    let cache = tempfile::tempdir().unwrap();
    let (a, b) = (client(&hub), client(&hub));
    let (o1, o2) = (opts(cache.path()), opts(cache.path()));
    let (r1, r2) = tokio::join!(a.download(REPO, "main", &o1), b.download(REPO, "main", &o2));
    let (s1, s2) = (r1.unwrap(), r2.unwrap());
    let total: u64 = release().iter().map(|(_, d)| d.len() as u64).sum();
    assert_eq!(s1.bytes_downloaded + s2.bytes_downloaded, total, "the blob lock lets one of them fetch each file");
    for (path, bytes) in release() {
        let fetches = file_requests(&hub, &path).iter().filter(|r| r.status == 200).count();
        assert_eq!(fetches, 1, "{path}");
        assert_eq!(fs::read(s2.path(&path)).unwrap(), bytes);
    }
}
