//! A local server speaking the Hub's HTTP API, for tests (feature `test-server`).
//!
//! It serves repositories held in memory or read from disk, each commit with a sha you assign or
//! one derived from its content; publishing a new commit moves `main` while the server runs, and
//! old commits stay downloadable. Endpoints, with the headers `huggingface_hub` reads:
//!
//! | request | answer |
//! |---|---|
//! | `GET /api/models/{repo}/revision/{rev}` | `{id, sha, siblings, …}`, `ETag: "{sha}"`, `If-None-Match` → 304 |
//! | `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=…` | `[{type, path, size, oid, lfs: {oid, size, pointerSize}}]`, paged with `Link: <…>; rel="next"` |
//! | `GET /api/models?author=…&search=…` | `[{id, sha, lastModified, private}]`, weak `ETag`, `If-None-Match` → 304 |
//! | `GET /{repo}/resolve/{rev}/{path}` | regular file: 200/206 with `ETag` (git blob id) and `X-Repo-Commit`; LFS file: 302 to the CDN origin (a second port) with `X-Linked-Etag`, `X-Linked-Size`, `X-Repo-Commit` |
//! | `GET /cdn/{sha256}` (CDN origin) | the bytes, `Range` → 206 + `Content-Range`, unsatisfiable → 416 |
//!
//! Faults are injected per file path, for API requests, or for any request, after `skip` matching
//! requests and for `times` of them: 404, 401, 429 with `Retry-After`, 500, any status, a delay,
//! a connection cut after N body bytes, bytes that do not match the published sha256, a `Range`
//! header ignored. Every request is logged ([`FakeHub::requests`]) with its `Range`, whether it
//! carried `Authorization` (never the value), and the status sent.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::Response;
use axum::Router;
use bytes::Bytes;
use serde_json::{json, Value};
use sha1::Sha1;
use sha2::{Digest, Sha256};

/// The running server. Dropping it stops accepting connections.
pub struct FakeHub {
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for FakeHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeHub").field("endpoint", &self.shared.endpoint).finish()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A file to publish.
#[derive(Clone, Debug)]
pub struct FakeFile {
    path: String,
    data: Data,
    lfs: Option<bool>,
}

#[derive(Clone, Debug)]
enum Data {
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

/// Which requests a fault applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultTarget {
    /// `resolve` and CDN requests for this repository path.
    File(String),
    /// `/api/...` requests.
    Api,
    /// Every request.
    Any,
}

/// What a fault does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// 404 (`X-Error-Code: EntryNotFound` for files, `RepoNotFound` otherwise).
    NotFound,
    /// 401 (`X-Error-Code: RepoNotFound`, as the Hub answers without a valid token).
    Unauthorized,
    /// 429 with `Retry-After: {secs}`.
    TooManyRequests {
        /// The `Retry-After` value.
        retry_after_secs: u64,
    },
    /// 500.
    ServerError,
    /// Any status, empty body.
    Status(u16),
    /// Waits, then answers normally.
    Delay(Duration),
    /// Sends this many body bytes, then drops the connection (byte-serving requests only).
    CutAfter(u64),
    /// Serves the right length with one byte flipped (byte-serving requests only).
    Corrupt,
    /// Answers a `Range` request with the whole file and 200 (byte-serving requests only).
    IgnoreRange,
}

impl FaultKind {
    fn is_body(&self) -> bool {
        matches!(self, FaultKind::CutAfter(_) | FaultKind::Corrupt | FaultKind::IgnoreRange)
    }
}

/// A fault: `kind` on requests matching `target`, after `skip` of them, for `times` of them
/// (`None`: all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Which requests.
    pub target: FaultTarget,
    /// What happens.
    pub kind: FaultKind,
    /// Matching requests let through first.
    pub skip: u32,
    /// How many matching requests get the fault; `None` for all.
    pub times: Option<u32>,
}

impl Fault {
    /// `kind` on every request matching `target`.
    pub fn new(target: FaultTarget, kind: FaultKind) -> Self {
        Fault { target, kind, skip: 0, times: None }
    }
    /// Only `n` times.
    pub fn times(mut self, n: u32) -> Self {
        self.times = Some(n);
        self
    }
    /// After letting `n` matching requests through.
    pub fn skip(mut self, n: u32) -> Self {
        self.skip = n;
        self
    }
}

/// What a request was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `/api/models/{repo}/revision/{rev}`.
    Revision,
    /// `/api/models/{repo}/tree/{rev}`.
    Tree,
    /// `/api/models`.
    ListModels,
    /// `/{repo}/resolve/{rev}/{path}`.
    Resolve,
    /// `/cdn/{sha256}`.
    Cdn,
    /// Anything else (404).
    Other,
}

/// One logged request.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    /// `GET`, `HEAD`, …
    pub method: String,
    /// Path and query as sent.
    pub uri: String,
    /// What it was for.
    pub kind: RequestKind,
    /// The repository path, for `Resolve` and `Cdn`.
    pub file: Option<String>,
    /// The `Range` header.
    pub range: Option<String>,
    /// The `If-None-Match` header.
    pub if_none_match: Option<String>,
    /// Whether an `Authorization` header was present (its value is never recorded).
    pub authorization: bool,
    /// The status sent.
    pub status: u16,
    /// The fault applied, if any.
    pub fault: Option<FaultKind>,
}

struct Shared {
    endpoint: String,
    cdn_endpoint: String,
    state: Mutex<HubState>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

struct HubState {
    repos: BTreeMap<String, FakeRepo>,
    blobs: HashMap<String, Arc<Blob>>,
    faults: Vec<FaultState>,
    log: Vec<RequestRecord>,
    tree_page_size: usize,
    clock: u64,
}

struct FaultState {
    fault: Fault,
    seen: u32,
    fired: u32,
}

#[derive(Default)]
struct FakeRepo {
    commits: HashMap<String, Arc<Commit>>,
    refs: BTreeMap<String, String>,
    token: Option<String>,
    last_modified: u64,
}

struct Commit {
    files: BTreeMap<String, Arc<Blob>>,
}

struct Blob {
    size: u64,
    sha256: String,
    git_oid: String,
    lfs: bool,
    pointer_oid: String,
    pointer_size: u64,
    data: Data,
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

impl FakeHub {
    /// Binds two free ports on 127.0.0.1, the Hub and its CDN (another origin, as on the real
    /// Hub: clients must not send the token there), and serves on the current tokio runtime.
    pub async fn start() -> io::Result<FakeHub> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let cdn_listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            endpoint: format!("http://{addr}"),
            cdn_endpoint: format!("http://{}", cdn_listener.local_addr()?),
            state: Mutex::new(HubState {
                repos: BTreeMap::new(),
                blobs: HashMap::new(),
                faults: Vec::new(),
                log: Vec::new(),
                tree_page_size: 1000,
                clock: 1_790_000_000,
            }),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let tasks = [listener, cdn_listener]
            .into_iter()
            .map(|l| {
                let app = app.clone();
                tokio::spawn(async move {
                    let _ = axum::serve(l, app).await;
                })
            })
            .collect();
        Ok(FakeHub { shared, tasks })
    }

    /// `http://127.0.0.1:{port}`.
    pub fn endpoint(&self) -> String {
        self.shared.endpoint.clone()
    }

    /// The CDN origin LFS files redirect to.
    pub fn cdn_endpoint(&self) -> String {
        self.shared.cdn_endpoint.clone()
    }

    fn state(&self) -> MutexGuard<'_, HubState> {
        self.shared.lock()
    }

    /// Publishes a commit of `files` on `main` (creating the repository) and returns its sha,
    /// derived from the parent and the content. Disk files are read here to hash them.
    pub fn publish(&self, repo: &str, files: Vec<FakeFile>) -> io::Result<String> {
        let blobs =
            files.into_iter().map(|f| Ok((f.path.clone(), Arc::new(make_blob(f)?)))).collect::<io::Result<Vec<_>>>()?;
        let parent = self.state().repos.get(repo).and_then(|r| r.refs.get("main").cloned()).unwrap_or_default();
        let mut h = Sha1::new();
        h.update(format!("{repo}\0{parent}\0{}\0", self.state().clock).as_bytes());
        for (p, b) in &blobs {
            h.update(format!("{p}\0{}\0", b.sha256).as_bytes());
        }
        let sha = hex::encode(h.finalize());
        self.insert(repo, &sha, blobs);
        Ok(sha)
    }

    /// Publishes a commit with the sha given (40 lowercase hex) on `main`.
    pub fn publish_with_sha(&self, repo: &str, sha: &str, files: Vec<FakeFile>) -> io::Result<()> {
        assert!(crate::is_commit_sha(sha), "a commit sha is 40 lowercase hex digits");
        let blobs =
            files.into_iter().map(|f| Ok((f.path.clone(), Arc::new(make_blob(f)?)))).collect::<io::Result<Vec<_>>>()?;
        self.insert(repo, sha, blobs);
        Ok(())
    }

    /// Publishes every file under `dir` (served from disk) as one commit on `main`.
    pub fn publish_dir(&self, repo: &str, dir: &Path) -> io::Result<String> {
        let mut files = Vec::new();
        let mut stack = vec![dir.to_owned()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d)? {
                let p = e?.path();
                if p.is_dir() {
                    if p.file_name().is_some_and(|n| n != ".git") {
                        stack.push(p);
                    }
                } else {
                    let rel = p.strip_prefix(dir).expect("under dir").to_string_lossy().into_owned();
                    files.push(FakeFile::from_disk(rel, p));
                }
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        self.publish(repo, files)
    }

    fn insert(&self, repo: &str, sha: &str, blobs: Vec<(String, Arc<Blob>)>) {
        let mut st = self.state();
        st.clock += 60;
        let now = st.clock;
        for (_, b) in &blobs {
            st.blobs.insert(b.sha256.clone(), b.clone());
        }
        let r = st.repos.entry(repo.to_owned()).or_default();
        r.commits.insert(sha.to_owned(), Arc::new(Commit { files: blobs.into_iter().collect() }));
        r.refs.insert("main".into(), sha.to_owned());
        r.last_modified = now;
    }

    /// Points a branch or tag at an existing commit.
    pub fn set_ref(&self, repo: &str, name: &str, sha: &str) {
        let mut st = self.state();
        let r = st.repos.get_mut(repo).expect("unknown repository");
        assert!(r.commits.contains_key(sha), "unknown commit");
        r.refs.insert(name.to_owned(), sha.to_owned());
    }

    /// From now on the repository answers 401 unless `Authorization: Bearer {token}` is sent.
    pub fn require_token(&self, repo: &str, token: &str) {
        self.state().repos.get_mut(repo).expect("unknown repository").token = Some(token.to_owned());
    }

    /// Adds a fault.
    pub fn inject(&self, fault: Fault) {
        self.state().faults.push(FaultState { fault, seen: 0, fired: 0 });
    }

    /// Removes every fault.
    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// Tree listings return at most `n` entries a page.
    pub fn set_tree_page_size(&self, n: usize) {
        self.state().tree_page_size = n.max(1);
    }

    /// The requests so far, in order of completion.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.state().log.clone()
    }

    /// Forgets the logged requests.
    pub fn clear_requests(&self) {
        self.state().log.clear();
    }

    /// The most `resolve`/CDN requests that were being answered at once.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn make_blob(f: FakeFile) -> io::Result<Blob> {
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

enum Route {
    Revision { repo: String, rev: String },
    Tree { repo: String, rev: String, path: String },
    List,
    Resolve { repo: String, rev: String, path: String },
    Cdn { sha256: String, path: String },
    Unknown,
}

fn parse_route(path: &str, query: &HashMap<String, String>) -> Route {
    let raw: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let segs: Vec<String> = raw.iter().map(|s| percent_decode(s)).collect();
    let s: Vec<&str> = segs.iter().map(String::as_str).collect();
    if s.len() >= 2 && s[0] == "api" && s[1] == "models" {
        if s.len() == 2 {
            return Route::List;
        }
        let rest = &s[2..];
        for repo_len in [2, 1] {
            if rest.len() > repo_len + 1 && (rest[repo_len] == "revision" || rest[repo_len] == "tree") {
                let repo = rest[..repo_len].join("/");
                if rest[repo_len] == "revision" {
                    return Route::Revision { repo, rev: rest[repo_len + 1..].join("/") };
                }
                return Route::Tree { repo, rev: rest[repo_len + 1].to_owned(), path: rest[repo_len + 2..].join("/") };
            }
        }
        return Route::Unknown;
    }
    if s.len() == 2 && s[0] == "cdn" {
        return Route::Cdn { sha256: s[1].to_owned(), path: query.get("path").cloned().unwrap_or_default() };
    }
    for i in [1, 2] {
        if s.len() > i + 2 && s[i] == "resolve" {
            return Route::Resolve { repo: s[..i].join("/"), rev: s[i + 1].to_owned(), path: s[i + 2..].join("/") };
        }
    }
    Route::Unknown
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: Option<&str>) -> (HashMap<String, String>, Vec<(String, String)>) {
    let mut map = HashMap::new();
    let mut all = Vec::new();
    for kv in q.unwrap_or("").split('&').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let (k, v) = (percent_decode(&k.replace('+', " ")), percent_decode(&v.replace('+', " ")));
        map.insert(k.clone(), v.clone());
        all.push((k, v));
    }
    (map, all)
}

fn query_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(sh: &Arc<Shared>) -> Self {
        let now = sh.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        sh.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(sh.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(State(sh): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let headers = req.headers().clone();
    let uri = req.uri().clone();
    let (query, query_all) = parse_query(uri.query());
    let route = parse_route(uri.path(), &query);
    let mut rec = RequestRecord {
        method: method.to_string(),
        uri: uri.to_string(),
        kind: match route {
            Route::Revision { .. } => RequestKind::Revision,
            Route::Tree { .. } => RequestKind::Tree,
            Route::List => RequestKind::ListModels,
            Route::Resolve { .. } => RequestKind::Resolve,
            Route::Cdn { .. } => RequestKind::Cdn,
            Route::Unknown => RequestKind::Other,
        },
        file: match &route {
            Route::Resolve { path, .. } | Route::Cdn { path, .. } => Some(path.clone()),
            _ => None,
        },
        range: header_string(&headers, header::RANGE),
        if_none_match: header_string(&headers, header::IF_NONE_MATCH),
        authorization: headers.contains_key(header::AUTHORIZATION),
        status: 0,
        fault: None,
    };
    let resp = respond(&sh, &method, route, &headers, &query, &query_all, &mut rec).await;
    rec.status = resp.status().as_u16();
    sh.lock().log.push(rec);
    resp
}

fn header_string(h: &HeaderMap, name: header::HeaderName) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

fn status(code: u16) -> axum::http::response::Builder {
    Response::builder().status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
}

fn error(code: u16, error_code: &str, message: &str) -> Response {
    status(code)
        .header("x-error-code", error_code)
        .header("x-error-message", message)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({ "error": message }).to_string()))
        .expect("response")
}

fn json_response() -> axum::http::response::Builder {
    status(200).header(header::CONTENT_TYPE, "application/json")
}

/// An entity tag without `W/` and quotes.
fn normalize(tag: &str) -> &str {
    tag.trim().trim_start_matches("W/").trim_matches('"')
}

fn authorized(repo: &FakeRepo, headers: &HeaderMap) -> bool {
    match &repo.token {
        None => true,
        Some(t) => {
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(format!("Bearer {t}").as_str())
        }
    }
}

fn resolve_rev<'a>(repo: &'a FakeRepo, rev: &str) -> Option<(String, &'a Arc<Commit>)> {
    let sha = if repo.commits.contains_key(rev) { rev.to_owned() } else { repo.refs.get(rev)?.clone() };
    let c = repo.commits.get(&sha)?;
    Some((sha, c))
}

/// Takes the first fault that fires for this request.
fn take_fault(st: &mut HubState, kind: RequestKind, file: Option<&str>, serves_bytes: bool) -> Option<FaultKind> {
    for fs in &mut st.faults {
        let target = match &fs.fault.target {
            FaultTarget::File(p) => matches!(kind, RequestKind::Resolve | RequestKind::Cdn) && file == Some(p.as_str()),
            FaultTarget::Api => matches!(kind, RequestKind::Revision | RequestKind::Tree | RequestKind::ListModels),
            FaultTarget::Any => true,
        };
        if !target || (fs.fault.kind.is_body() && !serves_bytes) {
            continue;
        }
        fs.seen += 1;
        if fs.seen > fs.fault.skip && fs.fault.times.is_none_or(|t| fs.fired < t) {
            fs.fired += 1;
            return Some(fs.fault.kind.clone());
        }
    }
    None
}

/// A status fault's response; `None` for delays (already slept) and body faults.
async fn status_fault(kind: &FaultKind, is_file: bool) -> Option<Response> {
    match kind {
        FaultKind::NotFound if is_file => Some(error(404, "EntryNotFound", "fault: entry not found")),
        FaultKind::NotFound => Some(error(404, "RepoNotFound", "fault: repository not found")),
        FaultKind::Unauthorized => Some(error(401, "RepoNotFound", "fault: invalid credentials")),
        FaultKind::TooManyRequests { retry_after_secs } => Some(
            status(429)
                .header(header::RETRY_AFTER, retry_after_secs.to_string())
                .body(Body::from("fault: rate limited"))
                .expect("response"),
        ),
        FaultKind::ServerError => Some(status(500).body(Body::from("fault: internal error")).expect("response")),
        FaultKind::Status(s) => Some(status(*s).body(Body::empty()).expect("response")),
        FaultKind::Delay(d) => {
            tokio::time::sleep(*d).await;
            None
        }
        _ => None,
    }
}

#[allow(clippy::too_many_arguments)]
async fn respond(
    sh: &Arc<Shared>,
    method: &Method,
    route: Route,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
    query_all: &[(String, String)],
    rec: &mut RequestRecord,
) -> Response {
    let guard = matches!(route, Route::Resolve { .. } | Route::Cdn { .. }).then(|| InFlight::new(sh));
    // Faults first: find out whether the request would serve bytes, then take a fault.
    let serves_bytes = {
        let st = sh.lock();
        match &route {
            Route::Resolve { repo, rev, path } => st
                .repos
                .get(repo)
                .and_then(|r| resolve_rev(r, rev))
                .and_then(|(_, c)| c.files.get(path).map(|b| !b.lfs))
                .unwrap_or(false),
            Route::Cdn { .. } => true,
            _ => false,
        }
    };
    let fault = {
        let mut st = sh.lock();
        take_fault(&mut st, rec.kind, rec.file.as_deref(), serves_bytes)
    };
    rec.fault = fault.clone();
    let mut body_fault = None;
    if let Some(k) = &fault {
        if let Some(r) = status_fault(k, rec.file.is_some()).await {
            return r;
        }
        if k.is_body() {
            body_fault = Some(k.clone());
        }
    }

    match route {
        Route::Unknown => error(404, "NotFound", "no such endpoint"),
        Route::List => {
            let st = sh.lock();
            let author = query.get("author");
            let search = query.get("search").map(|s| s.to_lowercase());
            let items: Vec<Value> = st
                .repos
                .iter()
                .filter(|(id, r)| {
                    author.is_none_or(|a| id.split_once('/').is_some_and(|(o, _)| o == a))
                        && search.as_ref().is_none_or(|s| id.to_lowercase().contains(s))
                        && authorized(r, headers)
                })
                .map(|(id, r)| {
                    json!({
                        "_id": hex::encode(&Sha1::digest(id.as_bytes())[..12]),
                        "id": id,
                        "modelId": id,
                        "sha": r.refs.get("main"),
                        "lastModified": iso8601(r.last_modified),
                        "private": r.token.is_some(),
                    })
                })
                .collect();
            // A weak ETag of the body, as the Hub sends one; `If-None-Match` with it is a 304.
            let body = Value::Array(items).to_string();
            let etag = format!("W/\"{}\"", hex::encode(&Sha1::digest(body.as_bytes())[..10]));
            if let Some(inm) = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) {
                if inm.split(',').any(|t| t.trim() == "*" || normalize(t) == normalize(&etag)) {
                    return status(304).header(header::ETAG, &etag).body(Body::empty()).expect("response");
                }
            }
            json_response().header(header::ETAG, &etag).body(Body::from(body)).expect("response")
        }
        Route::Revision { repo, rev } => {
            let st = sh.lock();
            let Some(r) = st.repos.get(&repo) else { return error(401, "RepoNotFound", "Repository not found") };
            if !authorized(r, headers) {
                return error(401, "RepoNotFound", "Invalid credentials in Authorization header");
            }
            let Some((sha, c)) = resolve_rev(r, &rev) else { return error(404, "RevisionNotFound", "Invalid rev id") };
            let etag = format!("\"{sha}\"");
            if let Some(inm) = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) {
                if inm.split(',').any(|t| {
                    let t = t.trim();
                    t == "*" || t.trim_start_matches("W/") == etag
                }) {
                    return status(304).header(header::ETAG, &etag).body(Body::empty()).expect("response");
                }
            }
            let expand: Vec<&str> =
                query_all.iter().filter(|(k, _)| k == "expand" || k == "expand[]").map(|(_, v)| v.as_str()).collect();
            let blobs = query.get("blobs").is_some_and(|v| v == "true" || v == "1");
            let v = if !expand.is_empty() {
                let mut m = serde_json::Map::new();
                m.insert("_id".into(), json!(hex::encode(&Sha1::digest(repo.as_bytes())[..12])));
                m.insert("id".into(), json!(repo));
                for e in expand {
                    match e {
                        "sha" => m.insert("sha".into(), json!(sha)),
                        "lastModified" => m.insert("lastModified".into(), json!(iso8601(r.last_modified))),
                        "private" => m.insert("private".into(), json!(r.token.is_some())),
                        _ => None,
                    };
                }
                Value::Object(m)
            } else {
                let siblings: Vec<Value> = c
                    .files
                    .iter()
                    .map(|(p, b)| {
                        if blobs {
                            let mut s = json!({ "rfilename": p, "size": b.size, "blobId": b.git_oid });
                            if b.lfs {
                                s["lfs"] = json!({ "sha256": b.sha256, "size": b.size, "pointerSize": b.pointer_size });
                            }
                            s
                        } else {
                            json!({ "rfilename": p })
                        }
                    })
                    .collect();
                json!({
                    "_id": hex::encode(&Sha1::digest(repo.as_bytes())[..12]),
                    "id": repo,
                    "modelId": repo,
                    "author": repo.split_once('/').map(|(a, _)| a),
                    "sha": sha,
                    "lastModified": iso8601(r.last_modified),
                    "private": r.token.is_some(),
                    "gated": false,
                    "disabled": false,
                    "tags": [],
                    "siblings": siblings,
                })
            };
            json_response().header(header::ETAG, etag).body(Body::from(v.to_string())).expect("response")
        }
        Route::Tree { repo, rev, path } => {
            let st = sh.lock();
            let Some(r) = st.repos.get(&repo) else { return error(401, "RepoNotFound", "Repository not found") };
            if !authorized(r, headers) {
                return error(401, "RepoNotFound", "Invalid credentials in Authorization header");
            }
            let Some((sha, c)) = resolve_rev(r, &rev) else { return error(404, "RevisionNotFound", "Invalid rev id") };
            let recursive = query.get("recursive").is_some_and(|v| v == "true" || v == "1");
            let prefix = if path.is_empty() { String::new() } else { format!("{}/", path.trim_end_matches('/')) };
            let mut dirs = BTreeSet::new();
            let mut entries: Vec<(String, Value)> = Vec::new();
            for (p, b) in &c.files {
                let Some(rel) = p.strip_prefix(&prefix) else { continue };
                let parts: Vec<&str> = rel.split('/').collect();
                for i in 1..parts.len() {
                    if recursive || i == 1 {
                        dirs.insert(format!("{prefix}{}", parts[..i].join("/")));
                    }
                }
                if !recursive && parts.len() > 1 {
                    continue;
                }
                let mut e = json!({ "type": "file", "oid": b.git_oid, "size": b.size, "path": p });
                if b.lfs {
                    e["lfs"] = json!({ "oid": b.sha256, "size": b.size, "pointerSize": b.pointer_size });
                }
                entries.push((p.clone(), e));
            }
            for d in dirs {
                let oid = hex::encode(Sha1::digest(format!("tree {sha} {d}").as_bytes()));
                entries.push((d.clone(), json!({ "type": "directory", "oid": oid, "size": 0, "path": d })));
            }
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            let cursor: usize = query.get("cursor").and_then(|c| c.parse().ok()).unwrap_or(0);
            let page = st.tree_page_size;
            let slice: Vec<Value> = entries.iter().skip(cursor).take(page).map(|(_, v)| v.clone()).collect();
            let v = Value::Array(slice);
            let mut b = json_response();
            if cursor + page < entries.len() {
                let sub = if path.is_empty() { String::new() } else { format!("/{}", query_encode(&path)) };
                let next = format!(
                    "<{}/api/models/{}/tree/{}{}?recursive={}&cursor={}>; rel=\"next\"",
                    sh.endpoint,
                    repo,
                    query_encode(&rev).replace('/', "%2F"),
                    sub,
                    recursive,
                    cursor + page
                );
                b = b.header(header::LINK, next);
            }
            b.body(Body::from(v.to_string())).expect("response")
        }
        Route::Resolve { repo, rev, path } => {
            let (sha, blob) = {
                let st = sh.lock();
                let Some(r) = st.repos.get(&repo) else { return error(401, "RepoNotFound", "Repository not found") };
                if !authorized(r, headers) {
                    return error(401, "RepoNotFound", "Invalid credentials in Authorization header");
                }
                let Some((sha, c)) = resolve_rev(r, &rev) else {
                    return error(404, "RevisionNotFound", "Invalid rev id");
                };
                match c.files.get(&path) {
                    Some(b) => (sha, b.clone()),
                    None => {
                        let mut resp = error(404, "EntryNotFound", "Entry not found");
                        resp.headers_mut().insert("x-repo-commit", HeaderValue::from_str(&sha).expect("hex"));
                        return resp;
                    }
                }
            };
            if blob.lfs {
                let location = format!(
                    "{}/cdn/{}?repo={}&path={}",
                    sh.cdn_endpoint,
                    blob.sha256,
                    query_encode(&repo),
                    query_encode(&path)
                );
                return status(302)
                    .header(header::LOCATION, location)
                    .header("x-repo-commit", &sha)
                    .header("x-linked-etag", format!("\"{}\"", blob.sha256))
                    .header("x-linked-size", blob.size.to_string())
                    .header(header::ETAG, format!("\"{}\"", blob.pointer_oid))
                    .header(header::CONTENT_LENGTH, "0")
                    .body(Body::empty())
                    .expect("response");
            }
            serve_bytes(method, &blob, headers, &blob.git_oid, Some(&sha), body_fault, guard)
        }
        Route::Cdn { sha256, .. } => {
            let blob = sh.lock().blobs.get(&sha256).cloned();
            match blob {
                Some(b) => serve_bytes(method, &b, headers, &b.sha256.clone(), None, body_fault, guard),
                None => error(404, "NotFound", "no such object"),
            }
        }
    }
}

/// Parses a single `bytes=` range against `size`: `Ok(None)` for the whole file, `Err(())` if unsatisfiable.
fn parse_range(h: Option<&str>, size: u64) -> Result<Option<(u64, u64)>, ()> {
    let Some(spec) = h.and_then(|h| h.trim().strip_prefix("bytes=")) else { return Ok(None) };
    if spec.contains(',') {
        return Ok(None);
    }
    let (a, b) = spec.split_once('-').ok_or(())?;
    let (a, b) = (a.trim(), b.trim());
    let (start, end) = if a.is_empty() {
        let n: u64 = b.parse().map_err(|_| ())?;
        (size.saturating_sub(n), size)
    } else {
        let start: u64 = a.parse().map_err(|_| ())?;
        let end = if b.is_empty() { size } else { (b.parse::<u64>().map_err(|_| ())? + 1).min(size) };
        (start, end)
    };
    if start >= size || start >= end {
        return Err(());
    }
    Ok(Some((start, end)))
}

fn serve_bytes(
    method: &Method,
    blob: &Arc<Blob>,
    headers: &HeaderMap,
    etag: &str,
    commit: Option<&str>,
    fault: Option<FaultKind>,
    guard: Option<InFlight>,
) -> Response {
    let size = blob.size;
    let range_header = if fault == Some(FaultKind::IgnoreRange) {
        None
    } else {
        headers.get(header::RANGE).and_then(|v| v.to_str().ok())
    };
    let range = match parse_range(range_header, size) {
        Ok(r) => r,
        Err(()) => {
            return status(416)
                .header(header::CONTENT_RANGE, format!("bytes */{size}"))
                .body(Body::empty())
                .expect("response");
        }
    };
    let (start, end) = range.unwrap_or((0, size));
    let mut b = status(if range.is_some() { 206 } else { 200 })
        .header(header::CONTENT_LENGTH, (end - start).to_string())
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::ETAG, format!("\"{etag}\""))
        .header(header::CONTENT_TYPE, "application/octet-stream");
    if range.is_some() {
        b = b.header(header::CONTENT_RANGE, format!("bytes {start}-{}/{size}", end - 1));
    }
    if let Some(c) = commit {
        b = b.header("x-repo-commit", c);
    }
    if method == Method::HEAD {
        return b.body(Body::empty()).expect("response");
    }
    let st = BodyState {
        blob: blob.clone(),
        file: None,
        pos: start,
        end,
        sent: 0,
        cut: match fault {
            Some(FaultKind::CutAfter(n)) => Some(n),
            _ => None,
        },
        corrupt_at: (fault == Some(FaultKind::Corrupt) && size > 0).then_some(size / 2),
        _guard: guard,
        done: false,
    };
    let stream = futures_util::stream::unfold(st, next_chunk);
    b.body(Body::from_stream(stream)).expect("response")
}

struct BodyState {
    blob: Arc<Blob>,
    file: Option<Arc<File>>,
    pos: u64,
    end: u64,
    sent: u64,
    cut: Option<u64>,
    corrupt_at: Option<u64>,
    _guard: Option<InFlight>,
    done: bool,
}

async fn next_chunk(mut st: BodyState) -> Option<(io::Result<Bytes>, BodyState)> {
    if st.done || st.pos >= st.end {
        return None;
    }
    if st.cut.is_some_and(|c| st.sent >= c) {
        st.done = true;
        // Let what was sent reach the client before the connection drops.
        tokio::time::sleep(Duration::from_millis(50)).await;
        return Some((Err(io::Error::other("fault: connection cut")), st));
    }
    let mut n = (st.end - st.pos).min(1 << 20);
    if let Some(c) = st.cut {
        n = n.min(c - st.sent);
    }
    let chunk = match &st.blob.data {
        Data::Memory(b) => Ok(b.slice(st.pos as usize..(st.pos + n) as usize)),
        Data::Disk(p) => {
            if st.file.is_none() {
                match File::open(p) {
                    Ok(f) => st.file = Some(Arc::new(f)),
                    Err(e) => return Some((Err(e), st)),
                }
            }
            let (f, pos) = (st.file.clone().expect("opened"), st.pos);
            tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; n as usize];
                f.read_exact_at(&mut buf, pos).map(|()| Bytes::from(buf))
            })
            .await
            .unwrap_or_else(|e| Err(io::Error::other(e)))
        }
    };
    let chunk = match chunk {
        Ok(c) => c,
        Err(e) => {
            st.done = true;
            return Some((Err(e), st));
        }
    };
    let chunk = match st.corrupt_at {
        Some(at) if at >= st.pos && at < st.pos + n => {
            let mut v = chunk.to_vec();
            v[(at - st.pos) as usize] ^= 0xff;
            Bytes::from(v)
        }
        _ => chunk,
    };
    st.pos += n;
    st.sent += n;
    Some((Ok(chunk), st))
}

/// `2026-09-14T12:00:00.000Z` from Unix seconds.
fn iso8601(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.000Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range(None, 10), Ok(None));
        assert_eq!(parse_range(Some("bytes=0-"), 10), Ok(Some((0, 10))));
        assert_eq!(parse_range(Some("bytes=3-5"), 10), Ok(Some((3, 6))));
        assert_eq!(parse_range(Some("bytes=3-50"), 10), Ok(Some((3, 10))));
        assert_eq!(parse_range(Some("bytes=-4"), 10), Ok(Some((6, 10))));
        assert_eq!(parse_range(Some("bytes=10-"), 10), Err(()));
        assert_eq!(parse_range(Some("bytes=x-"), 10), Err(()));
    }

    #[test]
    fn dates_and_decoding() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso8601(1_790_000_000), "2026-09-21T14:13:20.000Z");
        assert_eq!(percent_decode("refs%2Fpr%2F1"), "refs/pr/1");
        assert_eq!(percent_decode("a%2"), "a%2");
    }
}
