//! Readers shared by the passes: missing and unknown keys, and string values (interpolated or
//! not), each reporting what is wrong where it is.

use crate::suggest::{did_you_mean, list};
use crate::template;
use crate::yaml::{self, Entry, Kind, Node, Resolved};

use super::{join, last_key, Linter};

impl Linter<'_> {
    pub(super) fn missing(&mut self, base: &str, key: &str, hint: String) {
        let path = join(base, key);
        let span = self.loc.missing(&path);
        let d = self.at(span, &path, "missing-key", format!("missing `{key}`"));
        self.push(d.with_hint(hint));
    }

    pub(super) fn check_keys(
        &mut self,
        entries: &[Entry],
        base: &str,
        known: &[&str],
        what: &str,
        extra_hint: impl Fn(&str) -> Option<String>,
    ) {
        for e in entries {
            if known.contains(&e.key.as_str()) {
                continue;
            }
            let path = join(base, &e.key);
            let mut d = self.at(e.key_span, &path, "unknown-key", format!("unknown {what} `{}`", e.key));
            let hint = if e.key == "<<" {
                Some("YAML merge keys (`<<`) are not supported; write the keys out".to_string())
            } else if let Some(s) = did_you_mean(&e.key, known.iter().copied()) {
                Some(format!("did you mean `{s}`?"))
            } else {
                extra_hint(&e.key)
            };
            if !known.is_empty() {
                d = d.with_note(format!("known keys: {}", list(known)));
            }
            self.push(d.with_opt_hint(hint));
        }
    }

    /// A string value (plain or quoted); `None` after reporting when it is not one.
    pub(super) fn string(&mut self, node: &Node, path: &str, allow_interpolation: bool) -> Option<String> {
        if node.is_null() {
            return None;
        }
        match &node.kind {
            Kind::Scalar(s) => match s.resolve() {
                Resolved::Str(v) => {
                    if !allow_interpolation && template::has_interpolation(v) {
                        let d = self.at(
                            node.span,
                            path,
                            "interpolation-not-allowed",
                            format!("interpolation is not allowed in `{path}`"),
                        );
                        self.push(d.with_hint(
                            "only the `with`, `resources`, `retry`, `timeout` and `cache` values of steps are interpolated",
                        ));
                        return None;
                    }
                    Some(v.to_string())
                }
                other => {
                    let d = self.at(
                        node.span,
                        path,
                        "wrong-type",
                        format!("`{}`: expected string, found {}", last_key(path), yaml::describe_scalar(&other)),
                    );
                    self.push(d);
                    None
                }
            },
            _ => {
                let d = self.at(
                    node.span,
                    path,
                    "wrong-type",
                    format!("`{}`: expected string, found {}", last_key(path), node.describe()),
                );
                self.push(d);
                None
            }
        }
    }

    /// A string that may not hold interpolations; null is reported as missing.
    pub(super) fn plain_string(&mut self, node: &Node, path: &str) -> Option<String> {
        if node.is_null() {
            let d =
                self.at(node.span, path, "wrong-type", format!("`{}`: expected string, found null", last_key(path)));
            self.push(d);
            return None;
        }
        self.string(node, path, false)
    }
}
