//! HTTP helpers of every endpoint: response builders, the Hub's error headers, entity tags,
//! and the dates the API prints.

use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::json;

pub(super) fn header_string(h: &HeaderMap, name: header::HeaderName) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

pub(super) fn status(code: u16) -> axum::http::response::Builder {
    Response::builder().status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
}

pub(super) fn error(code: u16, error_code: &str, message: &str) -> Response {
    status(code)
        .header("x-error-code", error_code)
        .header("x-error-message", message)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({ "error": message }).to_string()))
        .expect("response")
}

pub(super) fn json_response() -> axum::http::response::Builder {
    status(200).header(header::CONTENT_TYPE, "application/json")
}

/// An entity tag without `W/` and quotes.
pub(super) fn normalize(tag: &str) -> &str {
    tag.trim().trim_start_matches("W/").trim_matches('"')
}

/// `2026-09-14T12:00:00.000Z` from Unix seconds.
pub(super) fn iso8601(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.000Z", rem / 3600, rem % 3600 / 60, rem % 60)
}
