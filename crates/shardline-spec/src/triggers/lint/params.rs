//! A trigger's `params`: declared params only, scalar values, and `${{ trigger.* }}` references
//! the trigger's kind defines.

use std::collections::BTreeMap;

use crate::suggest::{did_you_mean, list};
use crate::yaml::{Kind, Node, Resolved};

use super::TriggerLint;
use crate::triggers::syntax::references;
use crate::triggers::TRIGGER_VARS;

impl TriggerLint<'_, '_> {
    pub(super) fn params(&mut self, node: &Node, path: &str, is_watch: bool) -> Option<BTreeMap<String, String>> {
        let entries = self.mapping(node, path, "{revision: \"${{ trigger.sha }}\"}")?;
        let mut out = BTreeMap::new();
        let mut ok = true;
        for e in entries {
            let p = format!("{path}.{}", e.key);
            if !self.params.iter().any(|s| s.name == e.key) {
                let names: Vec<&str> = self.params.iter().map(|s| s.name.as_str()).collect();
                let hint = match did_you_mean(&e.key, names.iter().copied()) {
                    Some(s) => format!("did you mean `{s}`?"),
                    None if names.is_empty() => {
                        format!("declare it under `params:`, e.g. `{}: {{type: string}}`", e.key)
                    }
                    None => format!("declared params: {}", list(&names)),
                };
                self.at(
                    e.key_span,
                    &p,
                    "undefined-param",
                    format!("trigger sets undefined param `{}`", e.key),
                    Some(hint),
                );
                ok = false;
                continue;
            }
            let value = match &e.value.kind {
                Kind::Scalar(s) => match s.resolve() {
                    Resolved::Str(v) => Some(v.to_string()),
                    Resolved::Int(i) => Some(i.to_string()),
                    Resolved::Bool(b) => Some(b.to_string()),
                    _ => None,
                },
                _ => None,
            };
            let Some(value) = value else {
                self.at(
                    e.value.span,
                    &p,
                    "wrong-type",
                    format!("`{}`: expected a string, int or bool, found {}", e.key, e.value.describe()),
                    None,
                );
                ok = false;
                continue;
            };
            match references(&value) {
                Err(()) => {
                    self.at(
                        e.value.span,
                        &p,
                        "invalid-interpolation",
                        "unclosed `${{`".into(),
                        Some("write `${{ trigger.sha }}`".into()),
                    );
                    ok = false;
                }
                Ok(refs) => {
                    for r in refs {
                        let var = r.strip_prefix("trigger.");
                        let known = var.is_some_and(|v| TRIGGER_VARS.contains(&v));
                        let watch_only = var.is_some_and(|v| v != "time");
                        if !known {
                            let hint = var
                                .and_then(|v| did_you_mean(v, TRIGGER_VARS.iter().copied()))
                                .map(|s| format!("did you mean `${{{{ trigger.{s} }}}}`?"))
                                .unwrap_or_else(|| {
                                    "trigger params may use `${{ trigger.repo }}`, `${{ trigger.sha }}`, \
                                     `${{ trigger.revision }}` and `${{ trigger.time }}`"
                                        .into()
                                });
                            self.at(
                                e.value.span,
                                &p,
                                "undefined-reference",
                                format!("`{r}` is not defined in trigger params"),
                                Some(hint),
                            );
                            ok = false;
                        } else if watch_only && !is_watch {
                            self.at(
                                e.value.span,
                                &p,
                                "undefined-reference",
                                format!("`{r}` is only defined for `watch` triggers"),
                                Some("a schedule knows only `${{ trigger.time }}`".into()),
                            );
                            ok = false;
                        }
                    }
                }
            }
            out.insert(e.key.clone(), value);
        }
        ok.then_some(out)
    }
}
