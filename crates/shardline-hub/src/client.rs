//! The HTTP side: requests with the token, manual redirects, retries, and the JSON endpoints.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION, IF_NONE_MATCH, LOCATION, RETRY_AFTER};
use reqwest::{Method, Response, StatusCode, Url};
use serde::Deserialize;
use shardline_backoff::Backoff;

use crate::env::HubEnv;
use crate::repo::{check_revision, is_commit_sha, is_safe_repo_path};
use crate::{HubError, ModelSummary, RepoFile, RepoId, RepoRevision, Result, Secret};

/// How requests are retried on 429, 5xx and connection errors.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Attempts per request, the first included. A stream that made progress starts counting again.
    pub max_attempts: u32,
    /// Backoff before the second attempt; doubles each time, with jitter (50–100 %).
    pub base_delay: Duration,
    /// Ceiling of the exponential backoff.
    pub max_delay: Duration,
    /// Ceiling on a server's `Retry-After`.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 6,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        Backoff { base: self.base_delay, cap: self.max_delay, spread: (0.5, 1.0) }.jittered(attempt)
    }
}

/// The answer to [`HubClient::revision_if_changed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RevisionCheck {
    /// The `ETag` matched the one sent: the revision points where it did.
    Unchanged,
    /// The revision's commit (the same one as before when the `ETag` changed for another reason).
    Changed {
        /// The commit sha.
        sha: String,
        /// The answer's `ETag`, to send next time.
        etag: Option<String>,
    },
}

/// The answer to [`HubClient::list_models_if_changed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelListing {
    /// The listing's `ETag` matched the one sent: nothing changed.
    Unchanged,
    /// The listing changed (or nothing was sent to compare).
    Changed {
        /// Every model of the listing.
        models: Vec<ModelSummary>,
        /// The `ETag` to send next time, when the Hub sent one for a one-page listing.
        etag: Option<String>,
    },
}

/// A Hub client. Cheap to clone; clones share the connection pool.
#[derive(Clone)]
pub struct HubClient {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) endpoint: Url,
    pub(crate) endpoint_str: String,
    token: Option<Secret>,
    pub(crate) http: reqwest::Client,
    pub(crate) retry: RetryPolicy,
    pub(crate) cache_dir: Option<PathBuf>,
    pub(crate) offline: bool,
}

impl std::fmt::Debug for HubClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubClient")
            .field("endpoint", &self.inner.endpoint_str)
            .field("token", &self.inner.token.as_ref().map(|_| "<redacted>"))
            .field("cache_dir", &self.inner.cache_dir)
            .finish()
    }
}

/// What a failed attempt means for the retry loop.
pub(crate) enum Failure {
    Retry { err: HubError, after: Option<Duration> },
    Fatal(HubError),
}

/// The repository, revision and path a request is about, for error messages.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub(crate) repo: &'a str,
    pub(crate) revision: Option<&'a str>,
    pub(crate) path: Option<&'a str>,
    /// Whether the client has a token (changes the hint of a 401/403/404).
    pub(crate) has_token: bool,
}

impl HubClient {
    /// Endpoint, token and cache directory from the environment (see [`HubEnv`]).
    pub fn from_env() -> Result<Self> {
        let env = HubEnv::from_env()?;
        let mut c = Self::build(&env.endpoint, env.token, Some(env.cache_dir))?;
        Arc::get_mut(&mut c.inner).expect("fresh client").offline = env.offline;
        Ok(c)
    }

    /// A client for `endpoint` (e.g. `https://huggingface.co`) with an optional token. Downloads
    /// need [`crate::DownloadOptions::cache_dir`] unless [`HubClient::with_cache_dir`] sets one.
    pub fn new(endpoint: impl AsRef<str>, token: Option<Secret>) -> Result<Self> {
        Self::build(endpoint.as_ref(), token, None)
    }

    fn build(endpoint: &str, token: Option<Secret>, cache_dir: Option<PathBuf>) -> Result<Self> {
        let endpoint_str = endpoint.trim_end_matches('/').to_owned();
        let endpoint = Url::parse(&format!("{endpoint_str}/"))
            .map_err(|e| HubError::Config(format!("invalid endpoint `{endpoint_str}`: {e}")))?;
        if !matches!(endpoint.scheme(), "http" | "https") {
            return Err(HubError::Config(format!("invalid endpoint `{endpoint_str}`: not http(s)")));
        }
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Err only means another thread installed one first.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(20))
            .read_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .user_agent(concat!("shardline-hub/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| HubError::Config(format!("cannot build the HTTP client: {e}")))?;
        Ok(HubClient {
            inner: Arc::new(Inner {
                endpoint,
                endpoint_str,
                token: token.filter(|t| !t.is_empty()),
                http,
                retry: RetryPolicy::default(),
                cache_dir,
                offline: false,
            }),
        })
    }

    /// Replaces the retry policy.
    pub fn with_retry_policy(mut self, retry: RetryPolicy) -> Self {
        self.inner_mut().retry = retry;
        self
    }

    /// Sets the default cache directory (the `hub` folder: `$HF_HOME/hub`).
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.inner_mut().cache_dir = Some(dir.into());
        self
    }

    /// Offline mode (`HF_HUB_OFFLINE`): downloads are served from the cache or fail; nothing is sent.
    pub fn with_offline(mut self, offline: bool) -> Self {
        self.inner_mut().offline = offline;
        self
    }

    fn inner_mut(&mut self) -> &mut Inner {
        if Arc::get_mut(&mut self.inner).is_none() {
            let i = &self.inner;
            self.inner = Arc::new(Inner {
                endpoint: i.endpoint.clone(),
                endpoint_str: i.endpoint_str.clone(),
                token: i.token.clone(),
                http: i.http.clone(),
                retry: i.retry.clone(),
                cache_dir: i.cache_dir.clone(),
                offline: i.offline,
            });
        }
        Arc::get_mut(&mut self.inner).expect("unique")
    }

    /// The endpoint, without a trailing slash.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint_str
    }

    /// Whether requests carry a token.
    pub fn has_token(&self) -> bool {
        self.inner.token.is_some()
    }

    /// The default cache directory, if any.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.inner.cache_dir.as_deref()
    }

    pub(crate) fn url(&self, path: &str) -> Result<Url> {
        Url::parse(&format!("{}{}", self.inner.endpoint_str, path))
            .map_err(|e| HubError::Config(format!("cannot build a URL for {path}: {e}")))
    }

    /// `GET /api/models/{repo}/revision/{revision}` → the commit sha.
    pub async fn resolve_revision(&self, repo: &str, revision: &str) -> Result<String> {
        let id = RepoId::parse(repo)?;
        check_revision(revision)?;
        self.offline_guard()?;
        let ctx = Ctx { repo, revision: Some(revision), path: None, has_token: self.has_token() };
        let url = self.url(&format!("/api/models/{}/revision/{}", id, encode_segment(revision)))?;
        let (info, _) = self.get_json::<ModelInfo>(&url, ctx).await?;
        check_sha(&url, info.sha)
    }

    /// Every file of a commit with sizes and LFS sha256: `GET /api/models/{repo}/tree/{sha}?recursive=true`,
    /// following `Link: <…>; rel="next"` pages.
    pub async fn list_files(&self, repo: &str, revision: &str) -> Result<Vec<RepoFile>> {
        let id = RepoId::parse(repo)?;
        check_revision(revision)?;
        self.offline_guard()?;
        let ctx = Ctx { repo, revision: Some(revision), path: None, has_token: self.has_token() };
        let mut url = self.url(&format!("/api/models/{}/tree/{}?recursive=true", id, encode_segment(revision)))?;
        let mut files = Vec::new();
        for _page in 0..100_000 {
            let (entries, headers) = self.get_json::<Vec<TreeEntry>>(&url, ctx).await?;
            for e in entries {
                if e.kind != "file" {
                    continue;
                }
                if !is_safe_repo_path(&e.path) {
                    return Err(HubError::InvalidResponse {
                        url: redact(&url),
                        message: format!("unsafe file path `{}` in the tree listing", e.path.escape_default()),
                    });
                }
                let lfs_sha256 = match e.lfs {
                    Some(l) if is_hex(&l.oid, 64) => Some(l.oid.to_ascii_lowercase()),
                    Some(l) => {
                        return Err(HubError::InvalidResponse {
                            url: redact(&url),
                            message: format!("`{}` has an invalid LFS oid `{}`", e.path, l.oid),
                        })
                    }
                    None => None,
                };
                if lfs_sha256.is_none() && e.xet_hash.is_some() {
                    // Xet files carry LFS metadata (their sha256 names the blob); without it there is
                    // nothing to verify the bytes against.
                    return Err(HubError::InvalidResponse {
                        url: redact(&url),
                        message: format!("`{}` is stored with Xet but has no LFS sha256 to verify it against", e.path),
                    });
                }
                if lfs_sha256.is_none() && !is_hex(&e.oid, 40) {
                    return Err(HubError::InvalidResponse {
                        url: redact(&url),
                        message: format!("`{}` has an invalid git oid `{}`", e.path, e.oid),
                    });
                }
                files.push(RepoFile { path: e.path, size: e.size, lfs_sha256, blob_id: e.oid.to_ascii_lowercase() });
            }
            match next_link(&headers, &url) {
                Some(next) => url = next,
                None => break,
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(files)
    }

    /// The commit a revision points to and its files.
    pub async fn resolve(&self, repo: &str, revision: &str) -> Result<RepoRevision> {
        let sha = self.resolve_revision(repo, revision).await?;
        let files = self.list_files(repo, &sha).await?;
        Ok(RepoRevision { repo: repo.to_owned(), revision: revision.to_owned(), sha, files })
    }

    /// A cheap check for watchers: the commit `revision` points to, or `None` when it has not
    /// changed. `etag` is the `ETag` or the commit sha seen last; it is sent as `If-None-Match`
    /// (a 304 answer means unchanged) and also compared with the sha in a 200 answer.
    pub async fn head_sha(&self, repo: &str, revision: &str, etag: Option<&str>) -> Result<Option<String>> {
        let sent =
            etag.map(|e| if e.starts_with('"') || e.starts_with("W/") { e.to_owned() } else { format!("\"{e}\"") });
        let known = etag.map(normalize_etag);
        Ok(match self.revision_if_changed(repo, revision, sent.as_deref()).await? {
            RevisionCheck::Unchanged => None,
            RevisionCheck::Changed { sha, .. } if known.as_deref() == Some(sha.as_str()) => None,
            RevisionCheck::Changed { sha, .. } => Some(sha),
        })
    }

    /// The commit `revision` points to, as a conditional request: `etag` (the `ETag` of an
    /// earlier answer, sent as `If-None-Match`) makes an unchanged revision a 304 and
    /// [`RevisionCheck::Unchanged`]; otherwise the commit and the answer's `ETag`, to send next
    /// time. `GET /api/models/{repo}/revision/{revision}?expand=sha`.
    pub async fn revision_if_changed(&self, repo: &str, revision: &str, etag: Option<&str>) -> Result<RevisionCheck> {
        let id = RepoId::parse(repo)?;
        check_revision(revision)?;
        self.offline_guard()?;
        let ctx = Ctx { repo, revision: Some(revision), path: None, has_token: self.has_token() };
        let url = self.url(&format!("/api/models/{}/revision/{}?expand=sha", id, encode_segment(revision)))?;
        let mut headers = HeaderMap::new();
        if let Some(v) = etag.and_then(|e| HeaderValue::from_str(e).ok()) {
            headers.insert(IF_NONE_MATCH, v);
        }
        let out = self
            .retrying(&url, |attempt| {
                let url = url.clone();
                let headers = headers.clone();
                async move {
                    let resp = self.send(Method::GET, &url, &headers, ctx, attempt).await?.response;
                    if resp.status() == StatusCode::NOT_MODIFIED {
                        return Ok(None);
                    }
                    let resp = check_status(resp, ctx, attempt).await?;
                    let etag = header_str(resp.headers(), "etag");
                    let body = resp.bytes().await.map_err(|e| retry_network(&url, attempt, &e))?;
                    let info: ModelInfo = serde_json::from_slice(&body)
                        .map_err(|e| Failure::Fatal(invalid(&url, format!("bad JSON: {e}"))))?;
                    Ok(Some((info.sha, etag)))
                }
            })
            .await?;
        match out {
            None => Ok(RevisionCheck::Unchanged),
            Some((sha, etag)) => Ok(RevisionCheck::Changed { sha: check_sha(&url, sha)?, etag }),
        }
    }

    /// Models by `author` whose id contains `search`: `GET /api/models?author=…&search=…`, with
    /// each model's head sha and last change when the Hub includes them.
    pub async fn list_models(&self, author: Option<&str>, search: Option<&str>) -> Result<Vec<ModelSummary>> {
        match self.list_models_if_changed(author, search, None).await? {
            ModelListing::Changed { models, .. } => Ok(models),
            ModelListing::Unchanged => Ok(Vec::new()),
        }
    }

    /// [`HubClient::list_models`] as a conditional request, for watchers: `etag` (from the
    /// previous answer) is sent as `If-None-Match`, and a 304 answer is
    /// [`ModelListing::Unchanged`]. An ETag is returned only for a listing of one page (a later
    /// page may change while the first does not).
    pub async fn list_models_if_changed(
        &self,
        author: Option<&str>,
        search: Option<&str>,
        etag: Option<&str>,
    ) -> Result<ModelListing> {
        self.offline_guard()?;
        let mut q = vec!["expand=sha".to_owned(), "expand=lastModified".to_owned(), "expand=private".to_owned()];
        if let Some(a) = author {
            q.push(format!("author={}", encode_segment(a)));
        }
        if let Some(s) = search {
            q.push(format!("search={}", encode_segment(s)));
        }
        let mut url = self.url(&format!("/api/models?{}", q.join("&")))?;
        let ctx = Ctx { repo: author.unwrap_or("*"), revision: None, path: None, has_token: self.has_token() };
        let mut conditional = HeaderMap::new();
        if let Some(v) = etag.and_then(|e| HeaderValue::from_str(e).ok()) {
            conditional.insert(IF_NONE_MATCH, v);
        }
        let first = self
            .retrying(&url, |attempt| {
                let url = url.clone();
                let headers = conditional.clone();
                async move {
                    let resp = self.send(Method::GET, &url, &headers, ctx, attempt).await?.response;
                    if resp.status() == StatusCode::NOT_MODIFIED {
                        return Ok(None);
                    }
                    let resp = check_status(resp, ctx, attempt).await?;
                    let headers = resp.headers().clone();
                    let body = resp.bytes().await.map_err(|e| retry_network(&url, attempt, &e))?;
                    let items: Vec<ModelListItem> = serde_json::from_slice(&body)
                        .map_err(|e| Failure::Fatal(invalid(&url, format!("bad JSON: {e}"))))?;
                    Ok(Some((items, headers)))
                }
            })
            .await?;
        let Some((mut items, mut headers)) = first else {
            return Ok(ModelListing::Unchanged);
        };
        let first_etag = header_str(&headers, "etag");
        let mut pages = 1;
        let mut out = Vec::new();
        loop {
            out.extend(items.drain(..).map(|m| ModelSummary {
                id: m.id,
                sha: m.sha.filter(|s| is_commit_sha(s)),
                last_modified: m.last_modified,
                private: m.private,
            }));
            match next_link(&headers, &url) {
                Some(next) if pages < 1000 => {
                    url = next;
                    (items, headers) = self.get_json::<Vec<ModelListItem>>(&url, ctx).await?;
                    pages += 1;
                }
                _ => break,
            }
        }
        Ok(ModelListing::Changed { models: out, etag: if pages == 1 { first_etag } else { None } })
    }

    pub(crate) fn offline_guard(&self) -> Result<()> {
        if self.inner.offline {
            Err(HubError::Config("offline mode (HF_HUB_OFFLINE) forbids requests to the Hub".into()))
        } else {
            Ok(())
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, url: &Url, ctx: Ctx<'_>) -> Result<(T, HeaderMap)> {
        self.retrying(url, |attempt| async move {
            let resp = self.send(Method::GET, url, &HeaderMap::new(), ctx, attempt).await?.response;
            let resp = check_status(resp, ctx, attempt).await?;
            let headers = resp.headers().clone();
            let body = resp.bytes().await.map_err(|e| retry_network(url, attempt, &e))?;
            let v =
                serde_json::from_slice(&body).map_err(|e| Failure::Fatal(invalid(url, format!("bad JSON: {e}"))))?;
            Ok((v, headers))
        })
        .await
    }

    /// Runs `op` until it succeeds, fails fatally, or runs out of attempts; sleeps `Retry-After`
    /// or an exponential backoff with jitter in between.
    pub(crate) async fn retrying<T, F, Fut>(&self, url: &Url, mut op: F) -> Result<T>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = std::result::Result<T, Failure>>,
    {
        let mut attempt = 1;
        loop {
            match op(attempt).await {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Retry { err, after }) => {
                    if attempt >= self.inner.retry.max_attempts {
                        return Err(err);
                    }
                    let delay = self.delay(attempt, after);
                    tracing::warn!(url = %redact(url), attempt, delay_ms = delay.as_millis() as u64, error = %err, "retrying");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
            }
        }
    }

    pub(crate) fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        match retry_after {
            Some(d) => d.min(self.inner.retry.max_retry_after),
            None => self.inner.retry.backoff(attempt),
        }
    }

    /// One request, no redirect followed; the token only to the endpoint's origin.
    pub(crate) async fn send_once(
        &self,
        method: Method,
        url: &Url,
        extra: &HeaderMap,
        attempt: u32,
    ) -> std::result::Result<Response, Failure> {
        let mut req = self.inner.http.request(method, url.clone()).headers(extra.clone());
        if let Some(auth) = self.auth_for(url) {
            req = req.header(AUTHORIZATION, auth);
        }
        req.send().await.map_err(|e| retry_network(url, attempt, &e))
    }

    /// One request, following up to 10 redirects by hand. The token goes only to the endpoint's
    /// origin (not to a CDN on another host). Returns the final response and, from the first hop,
    /// `X-Repo-Commit` and `X-Linked-Etag`.
    pub(crate) async fn send(
        &self,
        method: Method,
        url: &Url,
        extra: &HeaderMap,
        ctx: Ctx<'_>,
        attempt: u32,
    ) -> std::result::Result<Sent, Failure> {
        let mut url = url.clone();
        let mut first: Option<(Option<String>, Option<String>)> = None;
        for _hop in 0..10 {
            let mut req = self.inner.http.request(method.clone(), url.clone()).headers(extra.clone());
            if let Some(auth) = self.auth_for(&url) {
                req = req.header(AUTHORIZATION, auth);
            }
            let resp = req.send().await.map_err(|e| retry_network(&url, attempt, &e))?;
            if first.is_none() {
                first = Some((
                    header_str(resp.headers(), "x-repo-commit"),
                    header_str(resp.headers(), "x-linked-etag").map(|e| normalize_etag(&e)),
                ));
            }
            if resp.status().is_redirection() && resp.status() != StatusCode::NOT_MODIFIED {
                let loc = resp.headers().get(LOCATION).and_then(|l| l.to_str().ok()).ok_or_else(|| {
                    Failure::Fatal(invalid(&url, format!("HTTP {} without Location", resp.status().as_u16())))
                })?;
                let next = url.join(loc).map_err(|e| Failure::Fatal(invalid(&url, format!("bad Location: {e}"))))?;
                tracing::debug!(from = %redact(&url), to = %redact(&next), "redirect");
                url = next;
                continue;
            }
            let (repo_commit, linked_etag) = first.unwrap_or_default();
            return Ok(Sent { response: resp, url, repo_commit, linked_etag });
        }
        let _ = ctx;
        Err(Failure::Fatal(invalid(&url, "more than 10 redirects".into())))
    }

    /// True if `url` has the endpoint's origin (scheme, host, port).
    pub(crate) fn is_endpoint_origin(&self, url: &Url) -> bool {
        let e = &self.inner.endpoint;
        url.scheme() == e.scheme()
            && url.host_str() == e.host_str()
            && url.port_or_known_default() == e.port_or_known_default()
    }

    fn auth_for(&self, url: &Url) -> Option<HeaderValue> {
        let token = self.inner.token.as_ref()?;
        if !self.is_endpoint_origin(url) {
            return None;
        }
        let mut v = HeaderValue::from_str(&format!("Bearer {}", token.expose())).ok()?;
        v.set_sensitive(true);
        Some(v)
    }
}

/// The outcome of [`HubClient::send`].
pub(crate) struct Sent {
    pub(crate) response: Response,
    pub(crate) url: Url,
    pub(crate) repo_commit: Option<String>,
    pub(crate) linked_etag: Option<String>,
}

/// `Retry-After` as seconds or an HTTP date.
fn parse_retry_after(v: &str) -> Option<Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(v).ok()?;
    Some(when.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO))
}

/// Turns a non-success status into the right failure; passes 2xx through.
pub(crate) async fn check_status(resp: Response, ctx: Ctx<'_>, attempt: u32) -> std::result::Result<Response, Failure> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let url = redact(resp.url());
    let code = header_str(resp.headers(), "x-error-code");
    let retry_after = resp.headers().get(RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(parse_retry_after);
    let message = header_str(resp.headers(), "x-error-message");
    let s = status.as_u16();
    let repo = ctx.repo.to_owned();
    let gated_hint = |has_token: bool| {
        if has_token {
            "the token in use has no access to it (check the name, or accept the model's terms on its page)"
        } else {
            "check the name; if it is private or gated, set HF_TOKEN to a token with access"
        }
    };
    let has_auth = ctx.has_token;
    match s {
        401 | 403 => Err(Failure::Fatal(HubError::RepoNotFoundOrGated { repo, status: s, hint: gated_hint(has_auth) })),
        404 => {
            let e = match (code.as_deref(), ctx.path, ctx.revision) {
                (Some("RevisionNotFound"), _, Some(rev)) => {
                    HubError::RevisionNotFound { repo, revision: rev.to_owned() }
                }
                (Some("EntryNotFound"), Some(p), rev) | (None, Some(p), rev) => {
                    HubError::EntryNotFound { repo, revision: rev.unwrap_or("?").to_owned(), path: p.to_owned() }
                }
                _ => HubError::RepoNotFoundOrGated { repo, status: s, hint: gated_hint(has_auth) },
            };
            Err(Failure::Fatal(e))
        }
        408 | 429 | 500..=599 => {
            let body = snippet(resp).await;
            let detail = join_detail(message, body);
            Err(Failure::Retry {
                err: HubError::Http { status: s, url, attempts: attempt, detail },
                after: retry_after,
            })
        }
        _ => {
            let body = snippet(resp).await;
            Err(Failure::Fatal(HubError::Http {
                status: s,
                url,
                attempts: attempt,
                detail: join_detail(message, body),
            }))
        }
    }
}

async fn snippet(resp: Response) -> Option<String> {
    let b = resp.bytes().await.ok()?;
    let s = String::from_utf8_lossy(&b[..b.len().min(300)]).trim().to_owned();
    (!s.is_empty()).then_some(s)
}

fn join_detail(message: Option<String>, body: Option<String>) -> String {
    match (message, body) {
        (Some(m), _) => format!(": {m}"),
        (None, Some(b)) => format!(": {b}"),
        (None, None) => String::new(),
    }
}

pub(crate) fn retry_network(url: &Url, attempt: u32, e: &reqwest::Error) -> Failure {
    Failure::Retry { err: network(url, attempt, e), after: None }
}

pub(crate) fn network(url: &Url, attempt: u32, e: &reqwest::Error) -> HubError {
    // `without_url` keeps the signed query string out; the chain of causes says what happened.
    let mut message = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        message.push_str(": ");
        message.push_str(&s.to_string());
        src = s.source();
    }
    if let Some(u) = e.url() {
        message = message.replace(u.as_str(), &redact(u));
    }
    HubError::Network { url: redact(url), attempts: attempt, message }
}

pub(crate) fn invalid(url: &Url, message: String) -> HubError {
    HubError::InvalidResponse { url: redact(url), message }
}

/// A URL without its query string and fragment (signed URLs carry credentials there).
pub(crate) fn redact(url: &Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.set_fragment(None);
    let _ = u.set_password(None);
    let _ = u.set_username("");
    u.to_string()
}

pub(crate) fn header_str(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(HeaderName::from_bytes(name.as_bytes()).ok()?)?.to_str().ok().map(str::to_owned)
}

/// `W/"abc"` and `"abc"` → `abc`, as `huggingface_hub` normalises ETags.
pub fn normalize_etag(e: &str) -> String {
    e.trim().trim_start_matches("W/").trim_matches('"').to_owned()
}

fn check_sha(url: &Url, sha: String) -> Result<String> {
    if is_commit_sha(&sha) {
        Ok(sha)
    } else {
        Err(invalid(url, format!("`{sha}` is not a commit sha")))
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The `rel="next"` target of a `Link` header, resolved against `base`.
fn next_link(h: &HeaderMap, base: &Url) -> Option<Url> {
    for v in h.get_all("link") {
        for part in v.to_str().ok()?.split(',') {
            let mut bits = part.split(';');
            let target = bits.next()?.trim();
            if bits.any(|p| matches!(p.trim().replace(' ', "").as_str(), "rel=\"next\"" | "rel=next")) {
                let t = target.strip_prefix('<')?.strip_suffix('>')?;
                return base.join(t).ok();
            }
        }
    }
    None
}

/// Percent-encodes one path segment (everything but RFC 3986 unreserved characters).
pub(crate) fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encodes a repository path, keeping `/`.
pub(crate) fn encode_path(p: &str) -> String {
    p.split('/').map(encode_segment).collect::<Vec<_>>().join("/")
}

#[derive(Deserialize)]
struct ModelInfo {
    sha: String,
}

#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    oid: String,
    #[serde(default)]
    lfs: Option<TreeLfs>,
    #[serde(default, rename = "xetHash")]
    xet_hash: Option<String>,
}

#[derive(Deserialize)]
struct TreeLfs {
    oid: String,
}

#[derive(Deserialize)]
struct ModelListItem {
    id: String,
    #[serde(default)]
    sha: Option<String>,
    #[serde(default, rename = "lastModified")]
    last_modified: Option<String>,
    #[serde(default)]
    private: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_header_and_encoding() {
        let base = Url::parse("http://h/api/models/o/n/tree/x?recursive=true").unwrap();
        let mut h = HeaderMap::new();
        h.insert("link", HeaderValue::from_static("<http://h/api/models/o/n/tree/x?cursor=2>; rel=\"next\""));
        assert_eq!(next_link(&h, &base).unwrap().as_str(), "http://h/api/models/o/n/tree/x?cursor=2");
        assert!(next_link(&HeaderMap::new(), &base).is_none());
        assert_eq!(encode_segment("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode_path("a b/c+d.json"), "a%20b/c%2Bd.json");
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
        assert_eq!(parse_retry_after(" 7 "), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(100));
        assert!(parse_retry_after(&later).unwrap() > Duration::from_secs(90));
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(350),
            max_retry_after: Duration::from_secs(1),
        };
        let d1 = p.backoff(1);
        assert!(d1 >= Duration::from_millis(50) && d1 <= Duration::from_millis(100), "{d1:?}");
        let d3 = p.backoff(3);
        assert!(d3 >= Duration::from_millis(175) && d3 <= Duration::from_millis(350), "{d3:?}");
        assert!(p.backoff(30) <= Duration::from_millis(350));
    }

    #[test]
    fn redacts_queries() {
        let u = Url::parse("https://user:pw@cdn.example/x/y?X-Amz-Signature=abc#f").unwrap();
        assert_eq!(redact(&u), "https://cdn.example/x/y");
    }
}
