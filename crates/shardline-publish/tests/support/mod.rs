//! Test support: an S3-compatible server (moto, from the repository's `.venv`, through
//! `shardline_publish::moto`), a store wrapper
//! that fails on cue and records what was written, and checkpoint fixtures.
#![allow(dead_code)]

use std::fmt;
use std::fs;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures_util::stream::{BoxStream, StreamExt};
pub use shardline_publish::moto::Moto;
use shardline_publish::object_store::path::Path as ObjPath;
use shardline_publish::object_store::{
    self, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, ObjectStoreExt,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, UploadPart,
};
use shardline_publish::{Destination, PublishOptions};

pub const BUCKET: &str = "checkpoints";
pub const PREFIX: &str = "runs/llama-tp2";

/// A source checkpoint: three small rank files, one of `big` bytes, and `.metadata`.
pub fn make_src(dir: &Path, big: usize) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("__0_0.distcp"), b"rank zero shard").unwrap();
    fs::write(dir.join("__1_0.distcp"), b"rank one shard!").unwrap();
    fs::write(dir.join("__2_0.distcp"), vec![7u8; 100_000]).unwrap();
    let data: Vec<u8> = (0..big as u64).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    fs::write(dir.join("__3_0.distcp"), data).unwrap();
    fs::write(dir.join(".metadata"), b"{\"planner\": \"shardline\"}").unwrap();
}

pub const FILES: [&str; 5] = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", ".metadata"];
pub const BIG: &str = "__3_0.distcp";

/// When the wrapper fails.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Fail every multipart part after this many have been sent (over all uploads).
    pub parts_before_failure: Option<usize>,
    /// Fail the single PUT of an object whose path ends with this.
    pub fail_put_of: Option<String>,
    /// Hang every multipart part after this many have been sent, printing `STALLED` once (a
    /// parent process then kills this one mid-upload).
    pub stall_after_parts: Option<usize>,
}

/// A store that forwards to another, fails as told and records every write ("put X",
/// "complete X", "abort X", "delete X"; X relative to the publish prefix when under it).
#[derive(Debug)]
pub struct FaultyStore {
    pub inner: Arc<dyn ObjectStore>,
    pub faults: Faults,
    pub parts_sent: Arc<AtomicUsize>,
    pub log: Arc<Mutex<Vec<String>>>,
    pub prefix: String,
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn ObjectStore>, prefix: &ObjPath, faults: Faults) -> FaultyStore {
        FaultyStore { inner, faults, parts_sent: Arc::default(), log: Arc::default(), prefix: format!("{prefix}/") }
    }

    pub fn writes(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

fn record(log: &Mutex<Vec<String>>, prefix: &str, what: &str, path: &ObjPath) {
    let p = path.as_ref();
    log.lock().unwrap().push(format!("{what} {}", p.strip_prefix(prefix).unwrap_or(p)));
}

fn injected(what: &str) -> object_store::Error {
    object_store::Error::Generic { store: "faulty", source: format!("injected failure: {what}").into() }
}

impl fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Faulty({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for FaultyStore {
    async fn put_opts(
        &self,
        location: &ObjPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if let Some(name) = &self.faults.fail_put_of {
            if location.as_ref().ends_with(name.as_str()) {
                return Err(injected(&format!("put {location}")));
            }
        }
        let r = self.inner.put_opts(location, payload, opts).await?;
        record(&self.log, &self.prefix, "put", location);
        Ok(r)
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(FaultyUpload {
            inner,
            location: location.clone(),
            limit: self.faults.parts_before_failure,
            stall: self.faults.stall_after_parts,
            sent: self.parts_sent.clone(),
            log: self.log.clone(),
            prefix: self.prefix.clone(),
        }))
    }

    async fn get_opts(&self, location: &ObjPath, options: GetOptions) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &ObjPath, ranges: &[Range<u64>]) -> object_store::Result<Vec<bytes::Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjPath>> {
        let log = self.log.clone();
        let prefix = self.prefix.clone();
        let locations = locations
            .map(move |l| {
                if let Ok(p) = &l {
                    record(&log, &prefix, "delete", p);
                }
                l
            })
            .boxed();
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&ObjPath>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&ObjPath>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjPath,
        to: &ObjPath,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[derive(Debug)]
struct FaultyUpload {
    inner: Box<dyn MultipartUpload>,
    location: ObjPath,
    limit: Option<usize>,
    stall: Option<usize>,
    sent: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<String>>>,
    prefix: String,
}

#[async_trait]
impl MultipartUpload for FaultyUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        let n = self.sent.fetch_add(1, Ordering::SeqCst);
        if self.limit.is_some_and(|limit| n >= limit) {
            let what = format!("part {} of {}", n + 1, self.location);
            return Box::pin(async move { Err(injected(&what)) });
        }
        if self.stall.is_some_and(|limit| n >= limit) {
            if self.stall == Some(n) {
                println!("STALLED");
                std::io::stdout().flush().unwrap();
            }
            return Box::pin(std::future::pending());
        }
        self.inner.put_part(data)
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        let r = self.inner.complete().await?;
        record(&self.log, &self.prefix, "complete", &self.location);
        Ok(r)
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        record(&self.log, &self.prefix, "abort", &self.location);
        self.inner.abort().await
    }
}

/// Where a test publishes: a local directory or a bucket on a fresh moto server.
pub struct Fixture {
    pub tmp: tempfile::TempDir,
    pub src: PathBuf,
    /// The destination URL.
    pub to: String,
    pub dest: Destination,
    pub options: PublishOptions,
    pub moto: Option<Moto>,
    /// Whether objects keep metadata.
    pub metadata: bool,
}

/// Small enough parts that the big file is uploaded in three (S3's 5 MiB minimum part size).
pub const PART: usize = 5 << 20;
pub const BIG_SIZE: usize = 11 << 20;

impl Fixture {
    pub fn local() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        make_src(&src, BIG_SIZE);
        let to = format!("file://{}", tmp.path().join("published").display());
        let options = PublishOptions { part_size: PART, ..Default::default() };
        let dest = Destination::open(&to, &options.store_options).unwrap();
        Fixture { tmp, src, to, dest, options, moto: None, metadata: false }
    }

    pub fn s3() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        make_src(&src, BIG_SIZE);
        let moto = Moto::start(tmp.path());
        moto.create_bucket(BUCKET);
        let to = format!("s3://{BUCKET}/{PREFIX}");
        let options = PublishOptions { part_size: PART, store_options: moto.store_options(), ..Default::default() };
        let dest = Destination::open(&to, &options.store_options).unwrap();
        Fixture { tmp, src, to, dest, options, moto: Some(moto), metadata: true }
    }

    /// The destination seen through a [`FaultyStore`].
    pub fn faulty(&self, faults: Faults) -> (Arc<FaultyStore>, Destination) {
        let store = Arc::new(FaultyStore::new(self.dest.store().clone(), self.dest.prefix(), faults));
        let dest = Destination::from_store(store.clone(), self.dest.prefix().as_ref(), self.metadata);
        (store, dest)
    }

    /// The bytes of a published object, read through the store.
    pub async fn object(&self, name: &str) -> Option<Vec<u8>> {
        match self.dest.store().get(&self.dest.object(name)).await {
            Ok(r) => Some(r.bytes().await.unwrap().to_vec()),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => panic!("read {name}: {e}"),
        }
    }

    /// Overwrites a published object through the store (the S3 API for S3).
    pub async fn tamper(&self, name: &str, bytes: Vec<u8>) {
        self.dest.store().put(&self.dest.object(name), PutPayload::from(bytes)).await.unwrap();
    }

    pub fn requests_so_far(&self) -> usize {
        self.moto.as_ref().map(|m| m.requests().len()).unwrap_or(0)
    }
}
