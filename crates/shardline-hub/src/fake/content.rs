//! File bytes: `resolve` (served by the Hub, or a redirect to the CDN for LFS files) and the CDN
//! origin, with `Range`, and the body faults (a cut connection, a flipped byte, an ignored
//! `Range`), streamed from memory or from disk.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::response::Response;
use bytes::Bytes;

use super::faults::FaultKind;
use super::files::{Blob, Data};
use super::http::{error, status};
use super::requests::query_encode;
use super::state::{readable_commit, InFlight, Shared};

/// `GET /{repo}/resolve/{rev}/{path}`.
#[allow(clippy::too_many_arguments)]
pub(super) fn resolve(
    sh: &Arc<Shared>,
    method: &Method,
    repo: String,
    rev: String,
    path: String,
    headers: &HeaderMap,
    body_fault: Option<FaultKind>,
    guard: Option<InFlight>,
) -> Response {
    let (sha, blob) = {
        let st = sh.lock();
        let (_, sha, c) = match readable_commit(&st, &repo, &rev, headers) {
            Ok(found) => found,
            Err(answer) => return *answer,
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

/// `GET /cdn/{sha256}` on the CDN origin.
pub(super) fn cdn(
    sh: &Arc<Shared>,
    method: &Method,
    sha256: String,
    headers: &HeaderMap,
    body_fault: Option<FaultKind>,
    guard: Option<InFlight>,
) -> Response {
    let blob = sh.lock().blobs.get(&sha256).cloned();
    match blob {
        Some(b) => serve_bytes(method, &b, headers, &b.sha256.clone(), None, body_fault, guard),
        None => error(404, "NotFound", "no such object"),
    }
}

/// Parses a single `bytes=` range against `size`: `Ok(None)` for the whole file, `Err(())` if unsatisfiable.
pub(super) fn parse_range(h: Option<&str>, size: u64) -> Result<Option<(u64, u64)>, ()> {
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
