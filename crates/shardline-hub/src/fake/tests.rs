//! Unit tests of the server's parsers and formats.

use super::content::parse_range;
use super::http::iso8601;
use super::requests::percent_decode;

#[test]
fn ranges() {
    assert_eq!(parse_range(None, 10), Ok(None));
    assert_eq!(parse_range(Some("bytes=0-"), 10), Ok(Some((0, 10))));
    assert_eq!(parse_range(Some("bytes=3-5"), 10), Ok(Some((3, 6))));
    assert_eq!(parse_range(Some("bytes=3-50"), 10), Ok(Some((3, 10))));
    assert_eq!(parse_range(Some("bytes=-4"), 10), Ok(Some((6, 10))));
    assert_eq!(parse_range(Some("bytes=10-"), 10), Err(()));
    assert_eq!(parse_range(Some("bytes=x-"), 10), Err(()));
}

#[test]
fn dates_and_decoding() {
    assert_eq!(iso8601(0), "1970-01-01T00:00:00.000Z");
    assert_eq!(iso8601(1_790_000_000), "2026-09-21T14:13:20.000Z");
    assert_eq!(percent_decode("refs%2Fpr%2F1"), "refs/pr/1");
    assert_eq!(percent_decode("a%2"), "a%2");
}
