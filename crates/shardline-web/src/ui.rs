//! The dashboard: static files from the repository's `web/` directory, embedded in the binary
//! at build time and served at `/`. Paths of the dashboard's own pages (`/runs`, `/runs/12`,
//! `/workers`, `/storage`, …) get `index.html`, whose scripts route on the client; unknown `/api/` paths get
//! the API's JSON 404.
//!
//! Every response carries a Content-Security-Policy that allows only the dashboard's own scripts
//! and styles and connections to its own origin, so text from specs, logs or models can never
//! run as script even if a page were to insert it as markup (the pages set text, not markup).

use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

/// One embedded file of `web/`.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    /// Path under `web/`, `/`-separated.
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static [u8],
}

macro_rules! assets {
    ($($path:literal => $ct:expr),* $(,)?) => {
        &[$(Asset {
            path: $path,
            content_type: $ct,
            body: include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../web/", $path)),
        }),*]
    };
}

const JS: &str = "text/javascript; charset=utf-8";

/// Every file of `web/` (a test checks that none is missing).
pub static ASSETS: &[Asset] = assets! {
    "index.html" => "text/html; charset=utf-8",
    "style.css" => "text/css; charset=utf-8",
    "favicon.svg" => "image/svg+xml",
    "js/app.js" => JS,
    "js/api.js" => JS,
    "js/dom.js" => JS,
    "js/live.js" => JS,
    "js/format.js" => JS,
    "js/views/runs.js" => JS,
    "js/views/run.js" => JS,
    "js/views/run-outcome.js" => JS,
    "js/views/task.js" => JS,
    "js/views/workers.js" => JS,
    "js/views/storage.js" => JS,
    "js/views/pipelines.js" => JS,
    "js/views/submit.js" => JS,
    "js/views/params-form.js" => JS,
    "js/views/token.js" => JS,
};

/// The client-side routes: their first path segment.
pub const PAGES: &[&str] = &["runs", "workers", "storage", "pipelines", "submit", "token"];

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The embedded file at `path` (relative to `web/`).
pub fn asset(path: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.path == path)
}

fn respond(a: &Asset, head: bool) -> Response {
    let mut resp = if head { ().into_response() } else { a.body.into_response() };
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(a.content_type));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(a.body.len()));
    // Embedded files change only with the binary: revalidate, they are small.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    secure(resp)
}

/// Headers every dashboard response carries.
fn secure(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    resp
}

/// Serves an embedded file, `index.html` for the dashboard's pages, or a 404.
pub async fn serve_ui(method: Method, uri: Uri) -> Response {
    let path = uri.path();
    if path == "/api" || path.starts_with("/api/") {
        return crate::api::not_found(uri).await.into_response();
    }
    if method != Method::GET && method != Method::HEAD {
        return secure((StatusCode::METHOD_NOT_ALLOWED, "The dashboard serves GET requests only.\n").into_response());
    }
    let head = method == Method::HEAD;
    let rel = path.trim_start_matches('/');
    if let Some(a) = asset(rel).filter(|a| a.path != "index.html") {
        return respond(a, head);
    }
    let first = rel.split('/').next().unwrap_or("");
    if rel.is_empty() || rel == "index.html" || PAGES.contains(&first) {
        if let Some(index) = asset("index.html") {
            return respond(index, head);
        }
    }
    secure((StatusCode::NOT_FOUND, "Not found.\n").into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file under `web/` is embedded, and nothing embedded is missing from it.
    #[test]
    fn every_web_file_is_embedded() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../web");
        let mut found = Vec::new();
        let mut stack = vec![root.clone()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).expect("web/ is readable") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    stack.push(path);
                } else {
                    let rel = path.strip_prefix(&root).expect("under web/");
                    found.push(rel.to_string_lossy().replace('\\', "/"));
                }
            }
        }
        found.sort();
        let mut embedded: Vec<String> = ASSETS.iter().map(|a| a.path.to_string()).collect();
        embedded.sort();
        assert_eq!(found, embedded, "web/ and the embedded list differ: update ASSETS in ui.rs");
    }
}
