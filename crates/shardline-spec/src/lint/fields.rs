//! Typed settings of a step (`with`, `resources`, `retry`, `timeout`, `cache`): literals of the
//! field's type, or well-formed `${{ … }}` interpolations.

use std::collections::BTreeMap;

use crate::checks::env_name;
use crate::model::SpecValue;
use crate::schema::{spec_value, Field, FieldDefault, FieldType};
use crate::suggest::list;
use crate::template::{self, TemplateError};
use crate::yaml::{quote, Kind, Node};

use super::{join, last_key, Linter};

impl Linter<'_> {
    /// Reads a mapping of typed fields (`with`, `resources`, `retry`).
    pub(super) fn field_map(
        &mut self,
        node: &Node,
        path: &str,
        fields: &[Field],
        unknown: impl Fn(&str) -> String,
        hint: impl Fn(&str) -> Option<String>,
    ) -> BTreeMap<String, SpecValue> {
        let mut out = BTreeMap::new();
        if node.is_null() {
            return out;
        }
        let Some(entries) = node.as_map() else {
            let d = self.at(
                node.span,
                path,
                "wrong-type",
                format!("`{}`: expected a mapping, found {}", last_key(path), node.describe()),
            );
            self.push(d);
            return out;
        };
        for e in entries {
            let p = join(path, &e.key);
            match fields.iter().find(|f| f.name == e.key) {
                Some(f) => {
                    if let Some(v) = self.field_value(&e.value, &p, f) {
                        out.insert(e.key.clone(), v);
                    }
                }
                None => {
                    let mut d = self.at(e.key_span, &p, "unknown-key", unknown(&e.key));
                    if !fields.is_empty() {
                        let names: Vec<&str> = fields.iter().map(|f| f.name).collect();
                        d = d.with_note(format!("known fields: {}", list(&names)));
                    }
                    let h = if e.key == "<<" {
                        Some("YAML merge keys (`<<`) are not supported; write the keys out".to_string())
                    } else {
                        hint(&e.key)
                    };
                    self.push(d.with_opt_hint(h));
                }
            }
        }
        out
    }

    /// Reads one field's value: a typed literal or a well-formed interpolation; for a list field,
    /// a sequence of them (or a single one).
    pub(super) fn field_value(&mut self, node: &Node, path: &str, f: &Field) -> Option<SpecValue> {
        if f.ty == FieldType::EnvMap {
            return self.env_map(node, path, f);
        }
        if let (FieldType::Globs | FieldType::Argv | FieldType::EnvNames, Kind::Seq(items)) = (f.ty, &node.kind) {
            let mut out = Vec::new();
            let mut ok = true;
            for (i, item) in items.iter().enumerate() {
                match self.scalar_value(item, &format!("{path}[{i}]"), f) {
                    Some(v) => out.push(v),
                    None => ok = false,
                }
            }
            return ok.then_some(SpecValue::List(out));
        }
        self.scalar_value(node, path, f)
    }

    /// A command's `env`: each name checked at its key, each value a string or an interpolation.
    fn env_map(&mut self, node: &Node, path: &str, f: &Field) -> Option<SpecValue> {
        if node.is_null() {
            return Some(SpecValue::Map(Vec::new()));
        }
        let Some(entries) = node.as_map() else {
            let d = self.at(
                node.span,
                path,
                "wrong-type",
                format!("`{}`: expected a mapping of environment variables, found {}", f.name, node.describe()),
            );
            self.push(d.with_hint("e.g. `env: {OMP_NUM_THREADS: \"4\", MODEL: \"${{ params.model }}\"}`"));
            return None;
        };
        let value = Field { name: f.name, ty: FieldType::Text, default: FieldDefault::Optional };
        let mut out = Vec::new();
        let mut ok = true;
        for e in entries {
            let p = join(path, &e.key);
            if let Err(m) = env_name(&e.key) {
                let d = self.at(e.key_span, &p, m.code, format!("`{}`: {}", f.name, m.message));
                self.push(d.with_opt_hint(m.hint));
                // The other entries are still resolved, so that their problems show too.
                continue;
            }
            match self.scalar_value(&e.value, &p, &value) {
                Some(v) => out.push((e.key.clone(), v)),
                None => ok = false,
            }
        }
        ok.then_some(SpecValue::Map(out))
    }

    fn scalar_value(&mut self, node: &Node, path: &str, f: &Field) -> Option<SpecValue> {
        let v = match spec_value(f.ty, node) {
            Ok(v) => v,
            Err(m) => {
                let d = self.at(node.span, path, m.code, format!("`{}`: {}", f.name, m.message));
                self.push(d.with_opt_hint(m.hint));
                return None;
            }
        };
        let SpecValue::String(s) = &v else { return Some(v) };
        match template::parse(s) {
            Ok(None) => Some(v),
            Ok(Some(t)) => Some(SpecValue::Template(t)),
            Err(errors) => {
                for e in errors {
                    let (text, message, hint) = match e {
                        TemplateError::Unterminated { text } => (
                            text.clone(),
                            format!("unterminated interpolation {}", quote(&text)),
                            "close it with `}}`, e.g. `${{ params.tp }}`".to_string(),
                        ),
                        TemplateError::Expression { text, expr } => {
                            let hint = if let Some(name) =
                                expr.strip_prefix("param.").or_else(|| expr.strip_prefix("parameters."))
                            {
                                format!("did you mean `params.{name}`?")
                            } else if let Some(name) = expr.strip_prefix("params.") {
                                format!("param names start with a lowercase letter, then lowercase letters, digits and `_` (found `{name}`)")
                            } else if expr.starts_with("run.") || expr == "run_id" || expr == "run" {
                                "did you mean `run.id`?".to_string()
                            } else {
                                "interpolations are `${{ params.NAME }}` and `${{ run.id }}`".to_string()
                            };
                            (text, format!("unsupported expression `{expr}`"), hint)
                        }
                    };
                    let span = self.sub_span(node.span, &text);
                    let d = self.at(span, path, "bad-interpolation", message);
                    self.push(d.with_hint(hint));
                }
                None
            }
        }
    }
}
