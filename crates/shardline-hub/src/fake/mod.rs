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
//!
//! Modules: the server and what tests do with it (`hub`), published files and their blobs
//! (`files`), what it holds (`state`), faults (`faults`), requests and their log (`requests`),
//! answering one (`serve`), the JSON API (`api`), file bytes (`content`), and HTTP helpers
//! (`http`).

mod api;
mod content;
mod faults;
mod files;
mod http;
mod hub;
mod requests;
mod serve;
mod state;
#[cfg(test)]
mod tests;

pub use faults::{Fault, FaultKind, FaultTarget};
pub use files::FakeFile;
pub use hub::FakeHub;
pub use requests::{RequestKind, RequestRecord};
