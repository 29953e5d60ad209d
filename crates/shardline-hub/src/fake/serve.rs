//! Answering one request: log it, take a fault that applies, and hand it to its endpoint.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::response::Response;

use super::faults::{status_fault, take_fault};
use super::http::{error, header_string};
use super::requests::{parse_query, parse_route, RequestKind, RequestRecord, Route};
use super::state::{resolve_rev, InFlight, Shared};
use super::{api, content};

pub(super) async fn handle(State(sh): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let headers = req.headers().clone();
    let uri = req.uri().clone();
    let (query, query_all) = parse_query(uri.query());
    let route = parse_route(uri.path(), &query);
    let mut rec = RequestRecord {
        method: method.to_string(),
        uri: uri.to_string(),
        kind: match route {
            Route::Revision { .. } => RequestKind::Revision,
            Route::Tree { .. } => RequestKind::Tree,
            Route::List => RequestKind::ListModels,
            Route::Resolve { .. } => RequestKind::Resolve,
            Route::Cdn { .. } => RequestKind::Cdn,
            Route::Unknown => RequestKind::Other,
        },
        file: match &route {
            Route::Resolve { path, .. } | Route::Cdn { path, .. } => Some(path.clone()),
            _ => None,
        },
        range: header_string(&headers, header::RANGE),
        if_none_match: header_string(&headers, header::IF_NONE_MATCH),
        authorization: headers.contains_key(header::AUTHORIZATION),
        status: 0,
        fault: None,
    };
    let resp = respond(&sh, &method, route, &headers, &query, &query_all, &mut rec).await;
    rec.status = resp.status().as_u16();
    sh.lock().log.push(rec);
    resp
}

#[allow(clippy::too_many_arguments)]
async fn respond(
    sh: &Arc<Shared>,
    method: &Method,
    route: Route,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
    query_all: &[(String, String)],
    rec: &mut RequestRecord,
) -> Response {
    let guard = matches!(route, Route::Resolve { .. } | Route::Cdn { .. }).then(|| InFlight::new(sh));
    // Faults first: find out whether the request would serve bytes, then take a fault.
    let serves_bytes = {
        let st = sh.lock();
        match &route {
            Route::Resolve { repo, rev, path } => st
                .repos
                .get(repo)
                .and_then(|r| resolve_rev(r, rev))
                .and_then(|(_, c)| c.files.get(path).map(|b| !b.lfs))
                .unwrap_or(false),
            Route::Cdn { .. } => true,
            _ => false,
        }
    };
    let fault = {
        let mut st = sh.lock();
        take_fault(&mut st, rec.kind, rec.file.as_deref(), serves_bytes)
    };
    rec.fault = fault.clone();
    let mut body_fault = None;
    if let Some(k) = &fault {
        if let Some(r) = status_fault(k, rec.file.is_some()).await {
            return r;
        }
        if k.is_body() {
            body_fault = Some(k.clone());
        }
    }

    match route {
        Route::Unknown => error(404, "NotFound", "no such endpoint"),
        Route::List => api::list_models(sh, headers, query),
        Route::Revision { repo, rev } => api::revision(sh, repo, rev, headers, query, query_all),
        Route::Tree { repo, rev, path } => api::tree(sh, repo, rev, path, headers, query),
        Route::Resolve { repo, rev, path } => content::resolve(sh, method, repo, rev, path, headers, body_fault, guard),
        Route::Cdn { sha256, .. } => content::cdn(sh, method, sha256, headers, body_fault, guard),
    }
}
