//! What a request is for: its route, parsed from the path and query, and the record the log
//! keeps of it ([`RequestRecord`]).

use std::collections::HashMap;

use super::faults::FaultKind;

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

pub(super) enum Route {
    Revision { repo: String, rev: String },
    Tree { repo: String, rev: String, path: String },
    List,
    Resolve { repo: String, rev: String, path: String },
    Cdn { sha256: String, path: String },
    Unknown,
}

pub(super) fn parse_route(path: &str, query: &HashMap<String, String>) -> Route {
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

pub(super) fn percent_decode(s: &str) -> String {
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

pub(super) fn parse_query(q: Option<&str>) -> (HashMap<String, String>, Vec<(String, String)>) {
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

pub(super) fn query_encode(s: &str) -> String {
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
