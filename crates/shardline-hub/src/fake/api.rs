//! The JSON API: model listings, a revision's info (its commit, siblings or expanded fields),
//! and tree listings in pages, with the ETags and `If-None-Match` answers the Hub gives.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderMap};
use axum::response::Response;
use serde_json::{json, Value};
use sha1::Sha1;
use sha2::Digest;

use super::http::{iso8601, json_response, normalize, status};
use super::requests::query_encode;
use super::state::{authorized, readable_commit, Shared};

/// `GET /api/models?author=…&search=…`.
pub(super) fn list_models(sh: &Arc<Shared>, headers: &HeaderMap, query: &HashMap<String, String>) -> Response {
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

/// `GET /api/models/{repo}/revision/{rev}`.
pub(super) fn revision(
    sh: &Arc<Shared>,
    repo: String,
    rev: String,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
    query_all: &[(String, String)],
) -> Response {
    let st = sh.lock();
    let (r, sha, c) = match readable_commit(&st, &repo, &rev, headers) {
        Ok(found) => found,
        Err(answer) => return *answer,
    };
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

/// `GET /api/models/{repo}/tree/{rev}[/{path}]`.
pub(super) fn tree(
    sh: &Arc<Shared>,
    repo: String,
    rev: String,
    path: String,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
) -> Response {
    let st = sh.lock();
    let (_, sha, c) = match readable_commit(&st, &repo, &rev, headers) {
        Ok(found) => found,
        Err(answer) => return *answer,
    };
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
