//! What the server holds behind one lock (repositories, their commits and refs, blobs, faults,
//! the request log), the count of byte-serving requests in flight, and the lookups every
//! endpoint makes: a repository's token check and a revision's commit.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::http::{header, HeaderMap};

use super::faults::FaultState;
use super::files::Blob;
use super::requests::RequestRecord;

pub(super) struct Shared {
    pub(super) endpoint: String,
    pub(super) cdn_endpoint: String,
    pub(super) state: Mutex<HubState>,
    pub(super) in_flight: AtomicUsize,
    pub(super) max_in_flight: AtomicUsize,
}

pub(super) struct HubState {
    pub(super) repos: BTreeMap<String, FakeRepo>,
    pub(super) blobs: HashMap<String, Arc<Blob>>,
    pub(super) faults: Vec<FaultState>,
    pub(super) log: Vec<RequestRecord>,
    pub(super) tree_page_size: usize,
    pub(super) clock: u64,
}

#[derive(Default)]
pub(super) struct FakeRepo {
    pub(super) commits: HashMap<String, Arc<Commit>>,
    pub(super) refs: BTreeMap<String, String>,
    pub(super) token: Option<String>,
    pub(super) last_modified: u64,
}

pub(super) struct Commit {
    pub(super) files: BTreeMap<String, Arc<Blob>>,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub(super) struct InFlight(Arc<Shared>);

impl InFlight {
    pub(super) fn new(sh: &Arc<Shared>) -> Self {
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

pub(super) fn authorized(repo: &FakeRepo, headers: &HeaderMap) -> bool {
    match &repo.token {
        None => true,
        Some(t) => {
            headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(format!("Bearer {t}").as_str())
        }
    }
}

/// The repository `repo` at `rev` for a request with `headers`: its commit sha and files, or the
/// Hub's answer when the repository is unknown, the credentials do not open it, or the revision
/// does not exist.
pub(super) fn readable_commit<'a>(
    st: &'a HubState,
    repo: &str,
    rev: &str,
    headers: &HeaderMap,
) -> Result<(&'a FakeRepo, String, &'a Arc<Commit>), Box<axum::response::Response>> {
    let error = |code, error_code, message| Box::new(super::http::error(code, error_code, message));
    let Some(r) = st.repos.get(repo) else { return Err(error(401, "RepoNotFound", "Repository not found")) };
    if !authorized(r, headers) {
        return Err(error(401, "RepoNotFound", "Invalid credentials in Authorization header"));
    }
    let Some((sha, c)) = resolve_rev(r, rev) else { return Err(error(404, "RevisionNotFound", "Invalid rev id")) };
    Ok((r, sha, c))
}

pub(super) fn resolve_rev<'a>(repo: &'a FakeRepo, rev: &str) -> Option<(String, &'a Arc<Commit>)> {
    let sha = if repo.commits.contains_key(rev) { rev.to_owned() } else { repo.refs.get(rev)?.clone() };
    let c = repo.commits.get(&sha)?;
    Some((sha, c))
}
