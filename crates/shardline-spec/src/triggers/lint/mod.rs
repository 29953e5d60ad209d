//! The lint of `triggers:`: each entry is a `schedule` or a `watch`, with `params` for the run;
//! every problem is reported at its position, and only valid triggers are returned.

mod params;
mod schedule;
mod watch;

use std::collections::BTreeMap;

use crate::diagnostic::Diagnostic;
use crate::model::ParamSpec;
use crate::suggest::{did_you_mean, list};
use crate::yaml::{Entry, Kind, Node, Resolved, Span};

use super::{Trigger, TriggerKind, TRIGGER_KEYS};

/// Lints `triggers`; returns the triggers that are valid.
pub(crate) fn lint_triggers(
    file: &str,
    node: &Node,
    params: &[ParamSpec],
    diags: &mut Vec<Diagnostic>,
) -> Vec<Trigger> {
    let mut l = TriggerLint { file, diags, params };
    l.all(node)
}

struct TriggerLint<'a, 'd> {
    file: &'a str,
    diags: &'d mut Vec<Diagnostic>,
    params: &'a [ParamSpec],
}

impl TriggerLint<'_, '_> {
    fn at(&mut self, span: Span, path: &str, code: &str, message: String, hint: Option<String>) {
        self.diags.push(Diagnostic::at(self.file, span, path, code, message).with_opt_hint(hint));
    }

    fn all(&mut self, node: &Node) -> Vec<Trigger> {
        if node.is_null() {
            return Vec::new();
        }
        let Kind::Seq(items) = &node.kind else {
            let message = format!("`triggers`: expected a list, found {}", node.describe());
            self.at(
                node.span,
                "triggers",
                "wrong-type",
                message,
                Some("e.g. `triggers: [{schedule: {cron: \"0 2 * * *\", timezone: Europe/Paris}}]`".into()),
            );
            return Vec::new();
        };
        items.iter().enumerate().filter_map(|(i, item)| self.one(i, item)).collect()
    }

    fn unknown_keys(&mut self, entries: &[Entry], base: &str, known: &[&str], what: &str) {
        for e in entries {
            if known.contains(&e.key.as_str()) {
                continue;
            }
            let path = format!("{base}.{}", e.key);
            let hint = did_you_mean(&e.key, known.iter().copied()).map(|s| format!("did you mean `{s}`?"));
            self.diags.push(
                Diagnostic::at(self.file, e.key_span, &path, "unknown-key", format!("unknown {what} `{}`", e.key))
                    .with_note(format!("known keys: {}", list(known)))
                    .with_opt_hint(hint),
            );
        }
    }

    fn one(&mut self, index: usize, node: &Node) -> Option<Trigger> {
        let base = format!("triggers[{index}]");
        let Some(entries) = node.as_map() else {
            let message = format!("trigger: expected a mapping with `schedule` or `watch`, found {}", node.describe());
            self.at(
                node.span,
                &base,
                "wrong-type",
                message,
                Some("e.g. `- watch: {repo: Qwen/Qwen3-0.6B, every: 10m}`".into()),
            );
            return None;
        };
        self.unknown_keys(entries, &base, TRIGGER_KEYS, "trigger key");
        let get = |k: &str| entries.iter().find(|e| e.key == k);
        let kind = match (get("schedule"), get("watch")) {
            (Some(s), None) => self.schedule(&s.value, &format!("{base}.schedule")).map(TriggerKind::Schedule),
            (None, Some(w)) => self.watch(&w.value, &format!("{base}.watch")).map(TriggerKind::Watch),
            (Some(_), Some(w)) => {
                self.at(
                    w.key_span,
                    &format!("{base}.watch"),
                    "conflicting-keys",
                    "a trigger is either a `schedule` or a `watch`, not both".into(),
                    Some("write them as two entries of `triggers`".into()),
                );
                None
            }
            (None, None) => {
                self.at(
                    node.span,
                    &base,
                    "missing-key",
                    "missing `schedule` or `watch`".into(),
                    Some("add `schedule: {cron: \"0 2 * * *\"}` or `watch: {repo: org/name}`".into()),
                );
                None
            }
        };
        let is_watch = matches!(kind, Some(TriggerKind::Watch(_))) || get("watch").is_some();
        let params = match get("params") {
            Some(p) => self.params(&p.value, &format!("{base}.params"), is_watch),
            None => Some(BTreeMap::new()),
        };
        Some(Trigger { index, kind: kind?, params: params? })
    }

    /// A string scalar; reports and returns `None` otherwise.
    fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match &node.kind {
            Kind::Scalar(s) => match s.resolve() {
                Resolved::Str(v) => Some(v.to_string()),
                other => {
                    let key = path.rsplit('.').next().unwrap_or(path);
                    let message = format!("`{key}`: expected string, found {}", crate::yaml::describe_scalar(&other));
                    self.at(node.span, path, "wrong-type", message, None);
                    None
                }
            },
            _ => {
                let key = path.rsplit('.').next().unwrap_or(path);
                let message = format!("`{key}`: expected string, found {}", node.describe());
                self.at(node.span, path, "wrong-type", message, None);
                None
            }
        }
    }

    fn mapping<'n>(&mut self, node: &'n Node, path: &str, example: &str) -> Option<&'n [Entry]> {
        match node.as_map() {
            Some(m) => Some(m),
            None => {
                let key = path.rsplit('.').next().unwrap_or(path);
                let message = format!("`{key}`: expected a mapping, found {}", node.describe());
                self.at(node.span, path, "wrong-type", message, Some(format!("e.g. `{key}: {example}`")));
                None
            }
        }
    }
}
