//! [`FakeHub`]: starting the server, publishing commits and refs, requiring tokens, injecting
//! faults, and reading the request log.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use sha1::Sha1;
use sha2::Digest;

use super::faults::{Fault, FaultState};
use super::files::{make_blob, Blob, FakeFile};
use super::requests::RequestRecord;
use super::serve::handle;
use super::state::{Commit, HubState, Shared};

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
