//! Faults on demand: which requests they hit ([`FaultTarget`]), what they do ([`FaultKind`]),
//! how many they let through and hit ([`Fault`]), and applying them to a request.

use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::Response;

use super::http::{error, status};
use super::requests::RequestKind;
use super::state::HubState;

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
    pub(super) fn is_body(&self) -> bool {
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

pub(super) struct FaultState {
    pub(super) fault: Fault,
    pub(super) seen: u32,
    pub(super) fired: u32,
}

/// Takes the first fault that fires for this request.
pub(super) fn take_fault(
    st: &mut HubState,
    kind: RequestKind,
    file: Option<&str>,
    serves_bytes: bool,
) -> Option<FaultKind> {
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
pub(super) async fn status_fault(kind: &FaultKind, is_file: bool) -> Option<Response> {
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
