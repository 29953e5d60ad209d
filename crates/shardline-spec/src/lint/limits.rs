//! The pipeline's `concurrency:`, `pool:` and `priority:`, each problem at its value.

use crate::run_limits::{is_pool_name, ConcurrencyLimit, OverflowPolicy, RunLimits, MAX_CONCURRENCY, PRIORITY_RANGE};
use crate::schema::CONCURRENCY_KEYS;
use crate::suggest::{did_you_mean, list};
use crate::yaml::{describe_scalar, quote, Entry, Kind, Node, Resolved};

use super::Linter;

impl Linter<'_> {
    pub(super) fn run_limits(&mut self, entries: &[Entry]) -> RunLimits {
        let get = |k: &str| entries.iter().find(|e| e.key == k);
        RunLimits {
            concurrency: get("concurrency").and_then(|e| self.concurrency(&e.value)),
            pool: get("pool").and_then(|e| self.pool(&e.value)),
            priority: get("priority")
                .and_then(|e| self.integer(&e.value, "priority", -PRIORITY_RANGE, PRIORITY_RANGE))
                .unwrap_or(0),
        }
    }

    fn concurrency(&mut self, node: &Node) -> Option<ConcurrencyLimit> {
        let hint = "write `concurrency: 1`, or `concurrency: {limit: 1, overflow: skip}`";
        if let Kind::Scalar(_) = node.kind {
            if node.is_null() {
                let d = self.at(
                    node.span,
                    "concurrency",
                    "wrong-type",
                    "`concurrency`: expected an integer or a mapping, found null".into(),
                );
                self.push(d.with_hint(hint));
                return None;
            }
            let limit = self.integer(node, "concurrency", 1, i64::from(MAX_CONCURRENCY))?;
            return Some(ConcurrencyLimit { limit: u32::try_from(limit).ok()?, overflow: OverflowPolicy::Queue });
        }
        let Some(entries) = node.as_map() else {
            let d = self.at(
                node.span,
                "concurrency",
                "wrong-type",
                format!("`concurrency`: expected an integer or a mapping, found {}", node.describe()),
            );
            self.push(d.with_hint(hint));
            return None;
        };
        self.check_keys(entries, "concurrency", CONCURRENCY_KEYS, "concurrency key", |_| None);
        let get = |k: &str| entries.iter().find(|e| e.key == k);
        let limit = match get("limit") {
            None => {
                self.missing("concurrency", "limit", "add `limit: N`: how many runs may run at once".into());
                None
            }
            Some(e) => self.integer(&e.value, "concurrency.limit", 1, i64::from(MAX_CONCURRENCY)),
        };
        let overflow = match get("overflow") {
            None => Some(OverflowPolicy::Queue),
            Some(e) => self.overflow(&e.value),
        };
        Some(ConcurrencyLimit { limit: u32::try_from(limit?).ok()?, overflow: overflow? })
    }

    fn overflow(&mut self, node: &Node) -> Option<OverflowPolicy> {
        let path = "concurrency.overflow";
        let v = self.plain_string(node, path)?;
        if let Some(p) = OverflowPolicy::from_name(&v) {
            return Some(p);
        }
        let d = self.at(
            node.span,
            path,
            "invalid-value",
            format!("`overflow`: {} is not one of {}", quote(&v), list(OverflowPolicy::NAMES)),
        );
        let hint = match did_you_mean(&v, OverflowPolicy::NAMES.iter().copied()) {
            Some(s) => format!("did you mean `{s}`?"),
            None => "`queue` waits for a running run to end, `skip` starts nothing, \
                     `cancel-previous` cancels the runs in progress"
                .to_string(),
        };
        self.push(d.with_hint(hint));
        None
    }

    fn pool(&mut self, node: &Node) -> Option<String> {
        let v = self.plain_string(node, "pool")?;
        if is_pool_name(&v) {
            return Some(v);
        }
        let d = self.at(node.span, "pool", "invalid-name", format!("invalid pool name {}", quote(&v)));
        self.push(d.with_hint("pool names use lowercase letters, digits, `-` and `_`, e.g. `gpu-big`"));
        None
    }

    /// An integer literal in `min..=max` (no interpolation: these are read before any param).
    fn integer(&mut self, node: &Node, path: &str, min: i64, max: i64) -> Option<i64> {
        let key = path.rsplit('.').next().unwrap_or(path);
        let found = match &node.kind {
            Kind::Scalar(s) => match s.resolve() {
                Resolved::Int(n) if (min..=max).contains(&n) => return Some(n),
                Resolved::Int(n) => {
                    let d = self.at(
                        node.span,
                        path,
                        "out-of-range",
                        format!("`{key}`: {n} is out of range ({min} to {max})"),
                    );
                    self.push(d);
                    return None;
                }
                Resolved::Str(t) if crate::template::has_interpolation(t) => {
                    let d = self.at(
                        node.span,
                        path,
                        "interpolation-not-allowed",
                        format!("interpolation is not allowed in `{path}`"),
                    );
                    self.push(d.with_hint(format!(
                        "`{path}` is read when the run is submitted, before params; use `submit --priority` \
                         for a run's own priority"
                    )));
                    return None;
                }
                other => describe_scalar(&other),
            },
            _ => node.describe(),
        };
        let d = self.at(node.span, path, "wrong-type", format!("`{key}`: expected an integer, found {found}"));
        self.push(d);
        None
    }
}
