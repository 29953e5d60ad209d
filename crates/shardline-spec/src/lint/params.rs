//! Pass 3, `params`: each declaration's name, type, default and `enum`, the values checked
//! against the type.

use std::collections::BTreeMap;

use crate::model::{ParamSpec, ParamType, ParamValue};
use crate::schema::{param_from_node, PARAM_KEYS};
use crate::suggest::{did_you_mean, list};
use crate::template;
use crate::yaml::{quote, Entry, Kind, Node, Resolved};

use super::names::normalise_name;
use super::{join, Linter};

impl Linter<'_> {
    #[allow(clippy::type_complexity)]
    pub(super) fn params(&mut self, node: &Node) -> (Vec<ParamSpec>, BTreeMap<String, Option<ParamType>>) {
        let mut params = Vec::new();
        let mut types = BTreeMap::new();
        if node.is_null() {
            return (params, types);
        }
        let Some(entries) = node.as_map() else {
            let d = self.at(
                node.span,
                "params",
                "wrong-type",
                format!("`params`: expected a mapping, found {}", node.describe()),
            );
            self.push(d.with_hint("e.g. `params: {tp: {type: int, default: 2}}`"));
            return (params, types);
        };
        for e in entries {
            let path = format!("params.{}", e.key);
            if !template::is_param_name(&e.key) {
                let d = self.at(e.key_span, &path, "invalid-name", format!("invalid param name `{}`", e.key));
                let fixed = normalise_name(&e.key, '_');
                self.push(d.with_hint(format!(
                    "param names start with a lowercase letter, then lowercase letters, digits and `_`, e.g. `{fixed}`"
                )));
            }
            let ty = self.param(e, &path, &mut params);
            types.insert(e.key.clone(), ty);
        }
        (params, types)
    }

    /// Checks one param declaration; returns its type when that is valid.
    fn param(&mut self, e: &Entry, path: &str, out: &mut Vec<ParamSpec>) -> Option<ParamType> {
        let Some(fields) = e.value.as_map() else {
            let d = self.at(
                e.value.span,
                path,
                "wrong-type",
                format!(
                    "param `{}`: expected a mapping with `type` and `default`, found {}",
                    e.key,
                    e.value.describe()
                ),
            );
            let example = match &e.value.kind {
                Kind::Scalar(s) => match s.resolve() {
                    Resolved::Int(i) => format!("{{type: int, default: {i}}}"),
                    Resolved::Bool(b) => format!("{{type: bool, default: {b}}}"),
                    Resolved::Str(v) => format!("{{type: string, default: {}}}", quote(v)),
                    _ => "{type: string}".to_string(),
                },
                _ => "{type: string}".to_string(),
            };
            self.push(d.with_hint(format!("declare it as `{}: {example}`", e.key)));
            return None;
        };
        self.check_keys(fields, path, PARAM_KEYS, "param key", |_| None);
        let get = |k: &str| fields.iter().find(|f| f.key == k);
        let type_path = join(path, "type");
        let ty = match get("type") {
            None => {
                self.missing(path, "type", format!("add one of {}", list(&param_type_names())));
                None
            }
            Some(t) => self.plain_string(&t.value, &type_path).and_then(|name| match name.parse::<ParamType>() {
                Ok(ty) => Some(ty),
                Err(_) => {
                    let d =
                        self.at(t.value.span, &type_path, "unknown-param-type", format!("unknown param type `{name}`"));
                    let hint = match did_you_mean(&name, param_type_names()).or(match name.as_str() {
                        "integer" | "number" | "uint" | "u64" => Some("int"),
                        "str" | "text" => Some("string"),
                        "boolean" => Some("bool"),
                        "bytes" => Some("size"),
                        "time" => Some("duration"),
                        _ => None,
                    }) {
                        Some(s) => format!("did you mean `{s}`?"),
                        None => format!("use one of {}", list(&param_type_names())),
                    };
                    self.push(d.with_hint(hint).with_note(format!("param types: {}", list(&param_type_names()))));
                    None
                }
            }),
        };
        let description = get("description").and_then(|d| self.string(&d.value, &join(path, "description"), true));
        let ty = ty?;

        let mut ok = true;
        let mut choices = Vec::new();
        if let Some(en) = get("enum") {
            let enum_path = join(path, "enum");
            match &en.value.kind {
                Kind::Seq(items) if !items.is_empty() => {
                    for (i, item) in items.iter().enumerate() {
                        let item_path = format!("{enum_path}[{i}]");
                        match self.param_value(ty, item, &item_path) {
                            Some(v) if choices.contains(&v) => {
                                let d =
                                    self.at(item.span, &item_path, "duplicate-value", format!("`{v}` is listed twice"));
                                self.push(d);
                            }
                            Some(v) => choices.push(v),
                            None => ok = false,
                        }
                    }
                }
                Kind::Seq(_) => {
                    let d = self.at(en.value.span, &enum_path, "invalid-value", "`enum` is empty".to_string());
                    self.push(d.with_hint("list the allowed values, or remove `enum`"));
                    ok = false;
                }
                _ => {
                    let d = self.at(
                        en.value.span,
                        &enum_path,
                        "wrong-type",
                        format!("`enum`: expected a sequence, found {}", en.value.describe()),
                    );
                    self.push(d.with_hint("e.g. `enum: [dcp, dcp-safetensors]`"));
                    ok = false;
                }
            }
        }
        let mut default = None;
        if let Some(d) = get("default") {
            let default_path = join(path, "default");
            if let Some(v) = self.param_value(ty, &d.value, &default_path) {
                if ok && !choices.is_empty() && !choices.contains(&v) {
                    let shown: Vec<String> = choices.iter().map(ToString::to_string).collect();
                    let shown: Vec<&str> = shown.iter().map(String::as_str).collect();
                    let diag = self.at(
                        d.value.span,
                        &default_path,
                        "invalid-value",
                        format!("default `{v}` of param `{}` is not one of its `enum` values", e.key),
                    );
                    let hint = match did_you_mean(&v.to_string(), shown.iter().copied()) {
                        Some(s) => format!("did you mean `{s}`?"),
                        None => format!("use one of {}", list(&shown)),
                    };
                    self.push(diag.with_hint(hint));
                } else {
                    default = Some(v);
                }
            }
        }
        out.push(ParamSpec { name: e.key.clone(), ty, default, choices, description });
        Some(ty)
    }

    fn param_value(&mut self, ty: ParamType, node: &Node, path: &str) -> Option<ParamValue> {
        if let Kind::Scalar(s) = &node.kind {
            if matches!(s.resolve(), Resolved::Str(t) if template::has_interpolation(t)) {
                let d = self.at(
                    node.span,
                    path,
                    "interpolation-not-allowed",
                    format!("interpolation is not allowed in `{path}`"),
                );
                self.push(d.with_hint("param values are literals; only step values are interpolated"));
                return None;
            }
        }
        match param_from_node(ty, node) {
            Ok(v) => Some(v),
            Err(m) => {
                let what = match path.split('.').nth(1) {
                    Some(name) if path.ends_with(".default") => format!("default of param `{name}`"),
                    Some(name) => format!("`enum` value of param `{name}`"),
                    None => format!("`{path}`"),
                };
                let d = self.at(node.span, path, m.code, format!("{what}: {}", m.message));
                self.push(d.with_opt_hint(m.hint));
                None
            }
        }
    }
}

fn param_type_names() -> Vec<&'static str> {
    ParamType::ALL.iter().map(|t| t.as_str()).collect()
}
