//! The HTTP side of a download: where a file's bytes are (the CDN redirect), and streaming a
//! range with retries, `Range` resume, commit and `Content-Range` checks, and progress reports.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use reqwest::header::{HeaderMap, HeaderValue, CONTENT_RANGE, RANGE};
use reqwest::{Method, StatusCode, Url};

use crate::client::{check_status, invalid, network, Failure};
use crate::{HubError, RepoFile, Result};

use super::writer::PartWriter;
use super::{Job, REPORT_EVERY, REPORT_INTERVAL};

impl Job {
    /// Where the bytes of `f` are: the first redirect target on another origin (the CDN), found
    /// with `HEAD` like `huggingface_hub` does, without requesting it (signed URLs may be bound to
    /// `GET`). `None` if the Hub serves the file itself.
    pub(super) async fn locate(&self, f: &RepoFile, resolve_url: &Url) -> Result<Option<Url>> {
        let ctx = self.ctx(f);
        self.client
            .retrying(resolve_url, |attempt| async move {
                let mut url = resolve_url.clone();
                for _hop in 0..10 {
                    let sent = self.client.send_once(Method::HEAD, &url, &HeaderMap::new(), attempt).await?;
                    if let Some(c) = crate::client::header_str(sent.headers(), "x-repo-commit") {
                        if c != self.sha {
                            return Err(Failure::Fatal(invalid(
                                &url,
                                format!("X-Repo-Commit {c} differs from the requested commit {}", self.sha),
                            )));
                        }
                    }
                    let status = sent.status();
                    if status.is_redirection() {
                        let next = sent
                            .headers()
                            .get(reqwest::header::LOCATION)
                            .and_then(|l| l.to_str().ok())
                            .and_then(|l| url.join(l).ok())
                            .ok_or_else(|| {
                                Failure::Fatal(invalid(&url, "redirect without a usable Location".into()))
                            })?;
                        if !self.client.is_endpoint_origin(&next) {
                            return Ok(Some(next));
                        }
                        url = next;
                        continue;
                    }
                    check_status(sent, ctx, attempt).await?;
                    return Ok(None);
                }
                Err(Failure::Fatal(invalid(&url, "more than 10 redirects".into())))
            })
            .await
    }

    /// Streams `[start, end)` of `f` into `w`, retrying with `Range: bytes=pos-` from where the
    /// last attempt stopped. Returns false if cancelled. `single`: this is the file's only stream,
    /// so a 200 answer to a range request can be used by skipping what the file already has.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn stream(
        &self,
        f: &RepoFile,
        resolve_url: &Url,
        direct: Option<&Url>,
        start: u64,
        end: u64,
        w: &mut PartWriter,
        single: bool,
    ) -> Result<bool> {
        let mut pos = start;
        let mut attempt = 1u32;
        let policy = &self.client.inner.retry;
        let mut url = direct.unwrap_or(resolve_url);
        loop {
            if pos >= end {
                return Ok(true);
            }
            if self.cancelled() {
                return Ok(false);
            }
            let before = pos;
            let r = {
                let _permit = self.streams.acquire().await.expect("semaphore open");
                self.attempt(f, url, &mut pos, end, w, single, attempt).await
            };
            match r {
                Ok(()) => {}
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Retry { err, after }) => {
                    url = resolve_url;
                    if pos > before {
                        attempt = 1;
                    } else if attempt >= policy.max_attempts {
                        return Err(err);
                    } else {
                        attempt += 1;
                    }
                    // Everything received so far is on disk before the next range starts.
                    w.flush().await.map_err(|e| HubError::io(PathBuf::from(&f.path), e))?;
                    let delay = self.client.delay(attempt, after);
                    tracing::warn!(path = %f.path, pos, end, attempt, delay_ms = delay.as_millis() as u64, error = %err, "retrying download");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        f: &RepoFile,
        url: &Url,
        pos: &mut u64,
        end: u64,
        w: &mut PartWriter,
        single: bool,
        attempt: u32,
    ) -> std::result::Result<(), Failure> {
        let ctx = self.ctx(f);
        let whole = *pos == 0 && end == f.size;
        let mut headers = HeaderMap::new();
        if !whole {
            headers.insert(RANGE, HeaderValue::from_str(&format!("bytes={}-{}", *pos, end - 1)).expect("ascii"));
        }
        let sent = self.client.send(Method::GET, url, &headers, ctx, attempt).await?;
        if let Some(c) = &sent.repo_commit {
            if c != &self.sha {
                return Err(Failure::Fatal(invalid(
                    url,
                    format!("X-Repo-Commit {c} differs from the requested commit {}", self.sha),
                )));
            }
        }
        let final_url = sent.url.clone();
        if let (Some(linked), Some(want)) = (&sent.linked_etag, &f.lfs_sha256) {
            if linked != want {
                tracing::warn!(path = %f.path, linked = %linked, expected = %want, "X-Linked-Etag differs from the listed sha256; the sha256 check decides");
            }
        }
        // A CDN's 4xx (an expired signed URL) is retried through a fresh redirect; the Hub's own
        // 4xx answers are final.
        let from_cdn = !self.client.is_endpoint_origin(&final_url);
        let mut resp = match check_status(sent.response, ctx, attempt).await {
            Err(Failure::Fatal(e)) if from_cdn && !matches!(e, HubError::InvalidResponse { .. }) => {
                return Err(Failure::Retry { err: e, after: None });
            }
            r => r?,
        };
        // Bytes of the body to drop before `pos` (a server that answers a range with the whole file).
        let mut skip = 0u64;
        match resp.status() {
            StatusCode::PARTIAL_CONTENT => {
                let cr = resp.headers().get(CONTENT_RANGE).and_then(|v| v.to_str().ok()).unwrap_or("");
                let first =
                    cr.strip_prefix("bytes ").and_then(|r| r.split('-').next()).and_then(|s| s.parse::<u64>().ok());
                if first != Some(*pos) {
                    return Err(Failure::Fatal(invalid(
                        &final_url,
                        format!("asked for bytes from {}, got Content-Range `{cr}`", *pos),
                    )));
                }
            }
            StatusCode::OK if !whole => {
                if !single {
                    return Err(Failure::Fatal(invalid(
                        &final_url,
                        "the server ignored a Range request; download with concurrency 1".into(),
                    )));
                }
                tracing::warn!(path = %f.path, pos = *pos, "the server ignored the Range header; skipping what is already here");
                skip = *pos;
            }
            StatusCode::OK => {}
            s => return Err(Failure::Fatal(invalid(&final_url, format!("unexpected HTTP {}", s.as_u16())))),
        }
        let mut since_report = 0u64;
        let mut reported = Instant::now();
        loop {
            match resp.chunk().await {
                Ok(Some(mut b)) => {
                    self.bytes_downloaded.fetch_add(b.len() as u64, Ordering::Relaxed);
                    if skip > 0 {
                        let n = skip.min(b.len() as u64);
                        skip -= n;
                        b = b.slice(n as usize..);
                    }
                    let room = end - *pos;
                    if b.len() as u64 > room {
                        return Err(Failure::Fatal(HubError::SizeMismatch {
                            repo: self.repo.clone(),
                            path: f.path.clone(),
                            expected: f.size,
                            actual: *pos + b.len() as u64,
                        }));
                    }
                    let n = b.len() as u64;
                    w.write(b).await.map_err(|e| Failure::Fatal(HubError::io(PathBuf::from(&f.path), e)))?;
                    *pos += n;
                    since_report += n;
                    if since_report >= REPORT_EVERY || reported.elapsed() >= REPORT_INTERVAL {
                        since_report = 0;
                        reported = Instant::now();
                        self.report(&f.path);
                    }
                    if self.cancelled() {
                        return Ok(());
                    }
                }
                Ok(None) if *pos < end => {
                    return Err(Failure::Retry {
                        err: HubError::Network {
                            url: crate::client::redact(&final_url),
                            attempts: attempt,
                            message: format!("connection closed after byte {} of {}", *pos, f.size),
                        },
                        after: None,
                    })
                }
                Ok(None) => return Ok(()),
                Err(e) => return Err(Failure::Retry { err: network(&final_url, attempt, &e), after: None }),
            }
        }
    }
}
