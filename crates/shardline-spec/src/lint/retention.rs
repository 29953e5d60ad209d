//! The pipeline's `retention:` (`{runs: 7d}`), each problem at its value.

use shardline_units::parse_duration;

use crate::retention::Retention;
use crate::schema::RETENTION_KEYS;
use crate::yaml::{describe_scalar, quote, Kind, Node, Resolved};

use super::Linter;

const HINT: &str = "write `retention: {runs: 7d}`: how long the work directories of finished runs are kept";

impl Linter<'_> {
    pub(super) fn retention(&mut self, node: &Node) -> Retention {
        let Some(entries) = node.as_map() else {
            let found = match &node.kind {
                Kind::Scalar(s) => describe_scalar(&s.resolve()),
                _ => node.describe(),
            };
            let d = self.at(
                node.span,
                "retention",
                "wrong-type",
                format!("`retention`: expected a mapping, found {found}"),
            );
            self.push(d.with_hint(HINT));
            return Retention::default();
        };
        self.check_keys(entries, "retention", RETENTION_KEYS, "retention key", |_| None);
        match entries.iter().find(|e| e.key == "runs") {
            None => {
                self.missing("retention", "runs", HINT.to_string());
                Retention::default()
            }
            Some(e) => Retention { runs: self.retention_duration(&e.value, "retention.runs") },
        }
    }

    /// A duration literal (no interpolation: read when the run is submitted, before params).
    fn retention_duration(&mut self, node: &Node, path: &str) -> Option<std::time::Duration> {
        let text = match &node.kind {
            Kind::Scalar(s) => match s.resolve() {
                Resolved::Str(t) if crate::template::has_interpolation(t) => {
                    let d = self.at(
                        node.span,
                        path,
                        "interpolation-not-allowed",
                        format!("interpolation is not allowed in `{path}`"),
                    );
                    self.push(d.with_hint(format!("`{path}` is read when the run is submitted, before params")));
                    return None;
                }
                Resolved::Str(t) => t.to_string(),
                Resolved::Int(n) => n.to_string(),
                other => {
                    let found = describe_scalar(&other);
                    let d =
                        self.at(node.span, path, "wrong-type", format!("`runs`: expected a duration, found {found}"));
                    self.push(d.with_hint("a duration such as `7d`, `36h` or `30m`"));
                    return None;
                }
            },
            _ => {
                let d = self.at(
                    node.span,
                    path,
                    "wrong-type",
                    format!("`runs`: expected a duration, found {}", node.describe()),
                );
                self.push(d.with_hint("a duration such as `7d`, `36h` or `30m`"));
                return None;
            }
        };
        match parse_duration(&text) {
            Ok(d) => Some(d),
            Err(e) => {
                let d = self.at(node.span, path, "invalid-duration", format!("invalid duration {}: {e}", quote(&text)));
                self.push(d.with_hint(e.hint(false)));
                None
            }
        }
    }
}
