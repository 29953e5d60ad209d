//! Test databases, shared with the other crates' tests through `shardline-testdb`: a fresh
//! SQLite file or a fresh PostgreSQL database per test (`SHARDLINE_TEST_DATABASE_URL`, which
//! `scripts/test` sets; PostgreSQL tests fail, never skip, without it); and the router under test
//! on such a database, called request by request with `oneshot`.
#![allow(dead_code)]

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use shardline_store::Store;
use shardline_web::auth::create_token;
use shardline_web::{router, AppState, AuthMode, Scope};
use tower::ServiceExt;

#[allow(unused_imports)] // not every test binary uses both
pub use shardline_testdb::{Kind, TestDb};

/// The whole router on a fresh database and work directory.
pub struct App {
    pub db: TestDb,
    pub store: Store,
    pub router: Router,
    _work: tempfile::TempDir,
}

pub async fn app(kind: Kind, auth: AuthMode) -> App {
    let db = TestDb::new(kind).await;
    let store = db.store().await;
    let work = tempfile::tempdir().expect("temp dir");
    let mut state = AppState::new(store.clone()).with_auth(auth);
    state.work_dir = work.path().to_path_buf();
    state.base_dir = work.path().to_path_buf();
    state.event_poll = Duration::from_millis(20);
    state.metrics = Some(shardline_metrics::Metrics::with_lag(store.clone(), Duration::ZERO));
    App { db, store, router: router(state), _work: work }
}

impl App {
    /// One request, with a bearer token and a JSON body if given; the raw answer.
    pub async fn raw(
        &self,
        method: Method,
        uri: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, HeaderMap, Vec<u8>) {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = match body {
            Some(b) => req.header(header::CONTENT_TYPE, "application/json").body(Body::from(b.to_string())),
            None => req.body(Body::empty()),
        }
        .expect("request");
        let resp = self.router.clone().oneshot(req).await.expect("response");
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes().to_vec();
        (status, headers, bytes)
    }

    /// One request; the answer's JSON (`null` for an empty body).
    pub async fn call(
        &self,
        method: Method,
        uri: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let (status, _, bytes) = self.raw(method, uri, token, body).await;
        let value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("{uri}: not JSON ({e}): {}", String::from_utf8_lossy(&bytes)))
        };
        (status, value)
    }

    pub async fn get_as(&self, uri: &str, token: Option<&str>) -> (StatusCode, Value) {
        self.call(Method::GET, uri, token, None).await
    }

    pub async fn get(&self, uri: &str) -> (StatusCode, Value) {
        self.get_as(uri, None).await
    }

    /// A new token of `scope`.
    pub async fn token(&self, scope: Scope) -> String {
        create_token(&self.store, &format!("test-{scope}"), scope).await.expect("create_token").secret
    }
}
