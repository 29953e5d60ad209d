//! `lint`: YAML text → a [`Pipeline`] and every diagnostic at once.
//!
//! Passes, in order (each reports everything it finds and lets the later ones run on what is
//! usable):
//! 1. document: size, YAML syntax, aliases, nesting, one document, duplicate keys;
//! 2. shape: top-level keys, `apiVersion`, `kind`, `name`;
//! 3. params: types, defaults, `enum`s;
//! 4. steps: keys, ids, kinds, `needs`, typed `with`/`resources`/`retry`/`timeout`/`cache`;
//! 5. graph: unknown and duplicate `needs`, cycles (printed as the chain), order rules
//!    (`split_fused` right after `shard`, a shard upstream of `validate` and `upload`, one
//!    download upstream of `shard`);
//! 6. values: every field resolved with the params' defaults (interpolations, types, ranges);
//! 7. mesh: `Mesh::check` and, when the context can read the source's `config.json`,
//!    `check_mesh_for_model`, each violation at its `with.tp`/`with.ep`/… position;
//! 8. warnings: params that nothing uses.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};

use shardline_layout::{check_mesh_for_model, LayoutError, Mesh, ModelConfig};

use crate::diagnostic::{self, Diagnostic};
use crate::graph::{Graph, MAX_DOWNLOADS};
use crate::model::{
    Locations, ParamSpec, ParamType, ParamValue, Pipeline, SpecValue, StepKind, StepSpec, API_VERSION, KIND,
};
use crate::resolve::{check_meshes, resolve_step, Env};
use crate::schema::{
    param_from_node, spec_value, unknown_with_hint, with_fields, Field, FieldType, CACHE, HUB_ONLY_FIELDS, PARAM_KEYS,
    RESOURCES, RETRY, STEP_KEYS, TIMEOUT, TOP_KEYS,
};
use crate::suggest::{did_you_mean, list};
use crate::template::{self, TemplateError};
use crate::yaml::{self, quote, Entry, Kind, Node, Resolved, Span};

type ModelLookup = dyn Fn(&Path) -> Result<Option<ModelConfig>, String> + Send + Sync;

/// What lint may know beyond the text: how to read a source release's model config, and the
/// directory relative `hf.download` paths are relative to. The crate itself reads no files; the
/// CLI passes a closure that reads `config.json`.
pub struct LintContext {
    base_dir: Option<PathBuf>,
    model_config: Option<Box<ModelLookup>>,
}

impl Default for LintContext {
    fn default() -> LintContext {
        LintContext::new()
    }
}

impl std::fmt::Debug for LintContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LintContext")
            .field("base_dir", &self.base_dir)
            .field("model_config", &self.model_config.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

impl LintContext {
    /// No model configs, relative paths left as written: only checks that need no release.
    pub fn new() -> LintContext {
        LintContext { base_dir: None, model_config: None }
    }

    /// Relative `hf.download` paths are joined to `dir` before they are looked up.
    pub fn with_base_dir(mut self, dir: impl Into<PathBuf>) -> LintContext {
        self.base_dir = Some(dir.into());
        self
    }

    /// `lookup(source_dir)` gives the model config of a release, or `None` when it is not
    /// available (then only the model-independent mesh checks run).
    pub fn with_model_config<F>(self, lookup: F) -> LintContext
    where
        F: Fn(&Path) -> Option<ModelConfig> + Send + Sync + 'static,
    {
        self.with_model_config_result(move |p| Ok(lookup(p)))
    }

    /// As [`LintContext::with_model_config`], with an error to report (at the download step's
    /// `with.path`) when a config exists but cannot be read.
    pub fn with_model_config_result<F>(mut self, lookup: F) -> LintContext
    where
        F: Fn(&Path) -> Result<Option<ModelConfig>, String> + Send + Sync + 'static,
    {
        self.model_config = Some(Box::new(lookup));
        self
    }

    pub fn base_dir(&self) -> Option<&Path> {
        self.base_dir.as_deref()
    }

    /// A source path as the lookup sees it: joined to the base dir when relative.
    pub fn source_path(&self, path: &Path) -> PathBuf {
        match &self.base_dir {
            Some(base) if path.is_relative() => base.join(path),
            _ => path.to_path_buf(),
        }
    }

    pub(crate) fn lookup(&self, path: &Path) -> Result<Option<ModelConfig>, String> {
        match &self.model_config {
            Some(f) => f(&self.source_path(path)),
            None => Ok(None),
        }
    }
}

/// Lints a pipeline file. Returns the pipeline when there is no error (warnings allowed) and
/// every diagnostic, sorted by position. Never panics, whatever the text.
pub fn lint(file: &str, text: &str, ctx: &LintContext) -> (Option<Pipeline>, Vec<Diagnostic>) {
    let (root, problems) = yaml::parse(text);
    let mut l = Linter { file, text, diags: Vec::new(), loc: Locations::default() };
    if let Some(root) = &root {
        l.record(root, "");
    }
    for p in problems {
        l.diags.push(Diagnostic::at(file, p.span, &p.path, p.code, p.message).with_opt_hint(p.hint));
    }
    let pipeline = match &root {
        Some(root) => l.pipeline(root, ctx),
        None => {
            if l.diags.is_empty() {
                l.diags.push(
                    Diagnostic::at(file, Span::point(1, 1), "", "empty-file", "the file holds no pipeline".to_string())
                        .with_hint(format!(
                            "a pipeline starts with `apiVersion: {API_VERSION}`, `kind: {KIND}`, `name:` and `steps:`"
                        )),
                );
            }
            None
        }
    };
    diagnostic::sort(&mut l.diags);
    let ok = !l.diags.iter().any(Diagnostic::is_error);
    (pipeline.filter(|_| ok), l.diags)
}

pub(crate) fn join(base: &str, key: &str) -> String {
    if base.is_empty() {
        key.to_string()
    } else {
        format!("{base}.{key}")
    }
}

struct Linter<'a> {
    file: &'a str,
    text: &'a str,
    diags: Vec<Diagnostic>,
    loc: Locations,
}

/// What pass 4 learns about a step.
struct Draft {
    index: usize,
    id: Option<String>,
    kind: Option<StepKind>,
    /// Each need with the key path of its entry.
    needs: Vec<(String, String)>,
    /// `needs` may be incomplete (a misspelt `needs` key): order rules are not checked.
    needs_unsure: bool,
    spec: Option<StepSpec>,
}

impl<'a> Linter<'a> {
    fn at(&self, span: Span, path: &str, code: &str, message: String) -> Diagnostic {
        Diagnostic::at(self.file, span, path, code, message)
    }

    fn push(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    /// Records the key and value span of every path of the tree.
    fn record(&mut self, node: &Node, path: &str) {
        self.loc.values.insert(path.to_string(), node.span);
        match &node.kind {
            Kind::Scalar(_) => {}
            Kind::Seq(items) => {
                for (i, item) in items.iter().enumerate() {
                    self.record(item, &format!("{path}[{i}]"));
                }
            }
            Kind::Map(entries) => {
                for e in entries {
                    let p = join(path, &e.key);
                    self.loc.keys.insert(p.clone(), e.key_span);
                    self.record(&e.value, &p);
                }
            }
        }
    }

    /// Where `${{ … }}` text sits inside a value, when the value is on one line.
    fn sub_span(&self, span: Span, needle: &str) -> Span {
        sub_span(self.text, span, needle)
    }

    fn pipeline(&mut self, root: &Node, ctx: &LintContext) -> Option<Pipeline> {
        let Some(entries) = root.as_map() else {
            let d = self.at(
                root.span,
                "",
                "wrong-type",
                format!("expected a mapping of pipeline keys, found {}", root.describe()),
            );
            self.push(d.with_hint(format!(
                "a pipeline starts with `apiVersion: {API_VERSION}`, `kind: {KIND}`, `name:` and `steps:`"
            )));
            return None;
        };
        self.check_keys(entries, "", TOP_KEYS, "top-level key", |_| None);
        let get = |k: &str| entries.iter().find(|e| e.key == k);

        // apiVersion and kind.
        match get("apiVersion") {
            None => self.missing("", "apiVersion", format!("add `apiVersion: {API_VERSION}`")),
            Some(e) => {
                if let Some(v) = self.plain_string(&e.value, "apiVersion") {
                    if v != API_VERSION {
                        let d =
                            self.at(e.value.span, "apiVersion", "api-version", format!("unsupported apiVersion `{v}`"));
                        self.push(d.with_hint(format!("this version of shardline reads `apiVersion: {API_VERSION}`")));
                    }
                }
            }
        }
        match get("kind") {
            None => self.missing("", "kind", format!("add `kind: {KIND}`")),
            Some(e) => {
                if let Some(v) = self.plain_string(&e.value, "kind") {
                    if v != KIND {
                        let d = self.at(e.value.span, "kind", "kind", format!("unsupported kind `{v}`"));
                        let hint = if v.eq_ignore_ascii_case(KIND) {
                            format!("kinds are case-sensitive: `kind: {KIND}`")
                        } else {
                            format!("a pipeline file has `kind: {KIND}`")
                        };
                        self.push(d.with_hint(hint));
                    }
                }
            }
        }

        // name and description.
        let name = match get("name") {
            None => {
                self.missing(
                    "",
                    "name",
                    "add a name of lowercase letters, digits and `-`, e.g. `name: qwen3-nightly`".into(),
                );
                None
            }
            Some(e) => self.plain_string(&e.value, "name").and_then(|v| {
                if is_pipeline_name(&v) {
                    Some(v)
                } else {
                    let d =
                        self.at(e.value.span, "name", "invalid-name", format!("invalid pipeline name {}", quote(&v)));
                    let fixed = normalise_name(&v, '-');
                    let hint = if is_pipeline_name(&fixed) {
                        format!("names use lowercase letters, digits and `-`, e.g. `{fixed}`")
                    } else {
                        "names use lowercase letters, digits and `-`".to_string()
                    };
                    self.push(d.with_hint(hint));
                    None
                }
            }),
        };
        let description = get("description").and_then(|e| self.string(&e.value, "description", true));

        // params.
        let (params, types) = match get("params") {
            Some(e) => self.params(&e.value),
            None => (Vec::new(), BTreeMap::new()),
        };

        // triggers (their params must be declared ones).
        let triggers = get("triggers")
            .map(|e| crate::triggers::lint_triggers(self.file, &e.value, &params, &mut self.diags))
            .unwrap_or_default();

        // steps.
        let drafts = match get("steps") {
            None => {
                self.missing(
                    "",
                    "steps",
                    "add `steps:` with at least one step, e.g. `- {id: download, uses: hf.download, with: {path: …}}`"
                        .into(),
                );
                Vec::new()
            }
            Some(e) => self.steps(e),
        };

        // Graph and order rules.
        self.graph(&drafts);

        // Values with the params' defaults, then meshes.
        let defaults: BTreeMap<String, ParamValue> =
            params.iter().filter_map(|p| p.default.clone().map(|d| (p.name.clone(), d))).collect();
        let origins = defaults.keys().map(|k| (k.clone(), format!("the default of param `{k}`"))).collect();
        let env =
            Env { types: types.clone(), values: defaults, origins, run_id: crate::resolve::LINT_RUN_ID.to_string() };
        let specs: Vec<(usize, &StepSpec)> =
            drafts.iter().filter(|d| d.id.is_some()).filter_map(|d| d.spec.as_ref().map(|s| (d.index, s))).collect();
        let mut resolved = BTreeMap::new();
        for (index, spec) in &specs {
            if let Some(r) = resolve_step(spec, *index, &self.loc, self.file, Some(self.text), &env, &mut self.diags) {
                resolved.insert(spec.id.clone(), r);
            }
        }
        check_meshes(&specs, &resolved, &env, ctx, &self.loc, self.file, &mut self.diags);

        // Unused params.
        let mut used = BTreeSet::new();
        for (_, s) in &specs {
            for v in
                s.with.values().chain(s.resources.values()).chain(s.retry.values()).chain(&s.timeout).chain(&s.cache)
            {
                for t in v.templates() {
                    used.extend(t.params().map(str::to_string));
                }
            }
        }
        // A misspelt reference (`params.sourse`) is reported as undefined; its target is not unused.
        let misspelt: Vec<&String> = used.iter().filter(|u| !types.contains_key(*u)).collect();
        for p in &params {
            let meant = misspelt.iter().any(|u| did_you_mean(u, [p.name.as_str()]).is_some());
            if !used.contains(&p.name) && !meant && template::is_param_name(&p.name) {
                let path = format!("params.{}", p.name);
                let d =
                    self.at(self.loc.key(&path), &path, "unused-param", format!("param `{}` is never used", p.name));
                self.push(d.warning().with_hint(format!("use it as `${{{{ params.{} }}}}` or remove it", p.name)));
            }
        }

        let steps: Vec<StepSpec> = drafts.iter().filter_map(|d| d.spec.clone()).collect();
        let step_index = drafts.iter().filter(|d| d.spec.is_some()).map(|d| d.index).collect();
        let name = name?;
        if steps.is_empty() {
            return None;
        }
        Some(Pipeline {
            name,
            description,
            params,
            steps,
            triggers,
            file: self.file.to_string(),
            locations: std::mem::take(&mut self.loc),
            step_index,
        })
    }

    fn missing(&mut self, base: &str, key: &str, hint: String) {
        let path = join(base, key);
        let span = self.loc.missing(&path);
        let d = self.at(span, &path, "missing-key", format!("missing `{key}`"));
        self.push(d.with_hint(hint));
    }

    fn check_keys(
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
    fn string(&mut self, node: &Node, path: &str, allow_interpolation: bool) -> Option<String> {
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
    fn plain_string(&mut self, node: &Node, path: &str) -> Option<String> {
        if node.is_null() {
            let d =
                self.at(node.span, path, "wrong-type", format!("`{}`: expected string, found null", last_key(path)));
            self.push(d);
            return None;
        }
        self.string(node, path, false)
    }

    // ---------------------------------------------------------------- params

    #[allow(clippy::type_complexity)]
    fn params(&mut self, node: &Node) -> (Vec<ParamSpec>, BTreeMap<String, Option<ParamType>>) {
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

    // ---------------------------------------------------------------- steps

    fn steps(&mut self, entry: &Entry) -> Vec<Draft> {
        let node = &entry.value;
        let items = match &node.kind {
            Kind::Seq(items) => items.as_slice(),
            _ if node.is_null() => &[],
            _ => {
                let d = self.at(
                    node.span,
                    "steps",
                    "wrong-type",
                    format!("`steps`: expected a sequence, found {}", node.describe()),
                );
                self.push(d.with_hint("steps are a list of mappings, each item starting with `- id: …`"));
                return Vec::new();
            }
        };
        if items.is_empty() {
            let span = if node.is_null() { entry.key_span } else { node.span };
            let d = self.at(span, "steps", "no-steps", "the pipeline has no steps".to_string());
            self.push(d.with_hint(format!("add at least one step; step kinds are {}", list(&StepKind::names()))));
            return Vec::new();
        }
        let mut drafts = Vec::new();
        let mut first_of: BTreeMap<String, Span> = BTreeMap::new();
        for (index, item) in items.iter().enumerate() {
            let mut draft = self.step(index, item);
            if let Some(id) = &draft.id {
                let path = format!("steps[{index}].id");
                let span = self.loc.span(&path);
                if let Some(first) = first_of.get(id) {
                    let d = self.at(span, &path, "duplicate-step", format!("duplicate step id `{id}`"));
                    self.push(d.with_hint(format!(
                        "`{id}` is already the id of the step on line {}; ids must be unique",
                        first.line
                    )));
                    draft.id = None;
                    draft.spec = None;
                } else {
                    first_of.insert(id.clone(), span);
                }
            }
            drafts.push(draft);
        }
        drafts
    }

    fn step(&mut self, index: usize, node: &Node) -> Draft {
        let base = format!("steps[{index}]");
        let mut draft = Draft { index, id: None, kind: None, needs: Vec::new(), needs_unsure: false, spec: None };
        let Some(entries) = node.as_map() else {
            let d =
                self.at(node.span, &base, "wrong-type", format!("step: expected a mapping, found {}", node.describe()));
            self.push(d.with_hint("a step is a mapping with `id`, `uses` and, for most kinds, `needs` and `with`"));
            return draft;
        };
        self.check_keys(entries, &base, STEP_KEYS, "step key", |k| match k {
            "name" => Some("steps are named by `id`".to_string()),
            "depends_on" | "dependencies" | "after" | "requires" => Some("did you mean `needs`?".to_string()),
            "kind" | "type" | "run" => Some("did you mean `uses`?".to_string()),
            "params" | "args" | "config" | "inputs" => Some("did you mean `with`?".to_string()),
            _ => None,
        });
        draft.needs_unsure = entries.iter().any(|e| {
            !STEP_KEYS.contains(&e.key.as_str())
                && (did_you_mean(&e.key, ["needs"]).is_some()
                    || matches!(e.key.as_str(), "depends_on" | "dependencies" | "after" | "requires"))
        });
        let get = |k: &str| entries.iter().find(|e| e.key == k);

        // id
        match get("id") {
            None => self.missing(
                &base,
                "id",
                "add `id:` of lowercase letters, digits, `_` and `-`, unique in the pipeline".into(),
            ),
            Some(e) => {
                let path = join(&base, "id");
                if let Some(id) = self.plain_string(&e.value, &path) {
                    if is_step_id(&id) {
                        draft.id = Some(id);
                    } else {
                        let d = self.at(e.value.span, &path, "invalid-id", format!("invalid step id {}", quote(&id)));
                        let fixed = normalise_name(&id, '-');
                        self.push(
                            d.with_hint(format!("step ids use lowercase letters, digits, `_` and `-`, e.g. `{fixed}`")),
                        );
                    }
                }
            }
        }
        let who = draft.id.clone().map(|id| format!("step `{id}`")).unwrap_or_else(|| format!("step {}", index + 1));

        // uses
        match get("uses") {
            None => self.missing(&base, "uses", format!("add `uses:` with one of {}", list(&StepKind::names()))),
            Some(e) => {
                let path = join(&base, "uses");
                if let Some(name) = self.plain_string(&e.value, &path) {
                    match name.parse::<StepKind>() {
                        Ok(k) => draft.kind = Some(k),
                        Err(_) => {
                            let d = self.at(
                                e.value.span,
                                &path,
                                "unknown-step-kind",
                                format!("unknown step kind `{name}`"),
                            );
                            let d = match did_you_mean(&name, StepKind::names()) {
                                Some(s) => d
                                    .with_note(format!("known step kinds: {}", list(&StepKind::names())))
                                    .with_hint(format!("did you mean `{s}`?")),
                                None => d.with_hint(format!("use one of {}", list(&StepKind::names()))),
                            };
                            self.push(d);
                        }
                    }
                }
            }
        }

        // needs
        if let Some(e) = get("needs") {
            let path = join(&base, "needs");
            match &e.value.kind {
                Kind::Seq(items) => {
                    for (i, item) in items.iter().enumerate() {
                        let item_path = format!("{path}[{i}]");
                        if let Some(n) = self.plain_string(item, &item_path) {
                            draft.needs.push((n, item_path));
                        }
                    }
                }
                Kind::Scalar(_) if e.value.is_null() => {}
                Kind::Scalar(_) => {
                    if let Some(n) = self.plain_string(&e.value, &path) {
                        draft.needs.push((n, path));
                    }
                }
                Kind::Map(_) => {
                    let d = self.at(
                        e.value.span,
                        &path,
                        "wrong-type",
                        "`needs`: expected a sequence of step ids, found a mapping".to_string(),
                    );
                    self.push(d.with_hint("e.g. `needs: [download]`"));
                }
            }
        }

        // with, resources, retry, timeout, cache
        let mut spec = StepSpec {
            id: draft.id.clone().unwrap_or_default(),
            kind: draft.kind.unwrap_or(StepKind::HfDownload),
            needs: draft.needs.iter().map(|(n, _)| n.clone()).collect(),
            with: BTreeMap::new(),
            resources: BTreeMap::new(),
            retry: BTreeMap::new(),
            timeout: None,
            cache: None,
        };
        if let Some(kind) = draft.kind {
            let with_path = join(&base, "with");
            let fields = with_fields(kind);
            if let Some(e) = get("with") {
                spec.with = self.field_map(
                    &e.value,
                    &with_path,
                    fields,
                    |k| format!("unknown field `{k}` for `{kind}`"),
                    |k| Some(unknown_with_hint(kind, k)),
                );
            }
            for f in fields {
                if matches!(f.default, crate::schema::FieldDefault::Required) && !spec.with.contains_key(f.name) {
                    // Only report when the field is truly absent, not when its value was refused.
                    if !self.loc.values.contains_key(&join(&with_path, f.name)) {
                        let span = if self.loc.values.contains_key(&with_path) {
                            self.loc.missing(&join(&with_path, f.name))
                        } else {
                            self.loc.span(&join(&base, "uses"))
                        };
                        let d = self.at(
                            span,
                            &join(&with_path, f.name),
                            "missing-field",
                            format!("{who} (`{kind}`) is missing the required field `with.{}`", f.name),
                        );
                        self.push(d.with_hint(required_hint(kind, f)));
                    }
                }
            }
            if kind == StepKind::HfDownload {
                self.download_source(&base, &who);
            }
        } else if let Some(e) = get("with") {
            // Unknown kind: still check the shape so later errors do not hide.
            if !e.value.is_null() && e.value.as_map().is_none() {
                let d = self.at(
                    e.value.span,
                    &join(&base, "with"),
                    "wrong-type",
                    format!("`with`: expected a mapping, found {}", e.value.describe()),
                );
                self.push(d);
            }
        }
        if let Some(e) = get("resources") {
            spec.resources = self.field_map(
                &e.value,
                &join(&base, "resources"),
                RESOURCES,
                |k| format!("unknown resource `{k}`"),
                |k| match k {
                    "cpu" => Some("did you mean `cpus`?".to_string()),
                    "gpu" => Some("did you mean `gpus`?".to_string()),
                    "mem" | "ram" => Some("did you mean `memory`?".to_string()),
                    "disk" | "storage" => Some("did you mean `scratch`?".to_string()),
                    _ => None,
                },
            );
        }
        if let Some(e) = get("retry") {
            spec.retry = self.field_map(
                &e.value,
                &join(&base, "retry"),
                RETRY,
                |k| format!("unknown retry setting `{k}`"),
                |k| match k {
                    "max_attempts" | "retries" | "limit" => {
                        Some("did you mean `attempts`? (it counts the first try)".to_string())
                    }
                    "delay" | "wait" => Some("did you mean `backoff`?".to_string()),
                    _ => None,
                },
            );
        }
        if let Some(e) = get("timeout") {
            spec.timeout = self.field_value(&e.value, &join(&base, "timeout"), &TIMEOUT);
        }
        if let Some(e) = get("cache") {
            spec.cache = self.field_value(&e.value, &join(&base, "cache"), &CACHE);
        }
        if draft.kind.is_some() {
            draft.spec = Some(spec);
        }
        draft
    }

    /// Reads a mapping of typed fields (`with`, `resources`, `retry`).
    fn field_map(
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

    /// `hf.download` reads exactly one source: `repo` (with `revision`, `allow`, `ignore`,
    /// `endpoint`) or `path`.
    fn download_source(&mut self, base: &str, who: &str) {
        let with_path = join(base, "with");
        let written = |l: &Self, k: &str| l.loc.values.contains_key(&join(&with_path, k));
        let (repo, path) = (written(self, "repo"), written(self, "path"));
        if repo && path {
            let (first, second) = {
                let r = self.loc.key(&join(&with_path, "repo"));
                let p = self.loc.key(&join(&with_path, "path"));
                if (r.line, r.col) <= (p.line, p.col) {
                    ("repo", "path")
                } else {
                    ("path", "repo")
                }
            };
            let at = join(&with_path, second);
            let d = self.at(
                self.loc.key(&at),
                &at,
                "conflicting-fields",
                format!("{who} (`hf.download`) has both `with.repo` and `with.path`; a download reads one source"),
            );
            self.push(d.with_note(format!("`with.{first}` is set too")).with_hint(
                "keep `repo` to download from the Hub into the HF cache, or `path` to read a local directory or an \
                 object-store prefix",
            ));
        } else if !repo && !path {
            let span = if self.loc.values.contains_key(&with_path) {
                self.loc.missing(&join(&with_path, "repo"))
            } else {
                self.loc.span(&join(base, "uses"))
            };
            let d = self.at(
                span,
                &join(&with_path, "repo"),
                "missing-field",
                format!("{who} (`hf.download`) has no source: set `with.repo` or `with.path`"),
            );
            self.push(d.with_hint(
                "e.g. `with: {repo: Qwen/Qwen3-0.6B}` for a Hub repository, `with: {path: /data/models/llama}` \
                 for a local HF-layout directory, or `with: {path: s3://bucket/models/llama}` for an object store",
            ));
        } else if path {
            for k in HUB_ONLY_FIELDS {
                if written(self, k) {
                    let at = join(&with_path, k);
                    let d = self.at(
                        self.loc.key(&at),
                        &at,
                        "hub-only-field",
                        format!("`with.{k}` applies to Hub downloads (`with.repo`), but {who} reads a `path`"),
                    );
                    self.push(d.with_hint(format!("remove `{k}`, or replace `path` with `repo: org/name`")));
                }
            }
        }
    }

    /// Reads one field's value: a typed literal or a well-formed interpolation; for a list field,
    /// a sequence of them (or a single one).
    fn field_value(&mut self, node: &Node, path: &str, f: &Field) -> Option<SpecValue> {
        if let (FieldType::Globs, Kind::Seq(items)) = (f.ty, &node.kind) {
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

    // ---------------------------------------------------------------- graph

    fn graph(&mut self, drafts: &[Draft]) {
        let named: Vec<&Draft> = drafts.iter().filter(|d| d.id.is_some()).collect();
        let graph = Graph::new(
            named
                .iter()
                .map(|d| {
                    (d.id.as_deref().unwrap_or_default(), d.kind, d.needs.iter().map(|(n, _)| n.as_str()).collect())
                })
                .collect(),
        );
        let mut unsure = vec![false; named.len()];
        // Unknown and repeated needs.
        for (v, d) in named.iter().enumerate() {
            let id = graph.ids[v];
            let mut seen: BTreeSet<&str> = BTreeSet::new();
            for (need, path) in &d.needs {
                let span = self.loc.span(path);
                if !seen.insert(need.as_str()) {
                    let diag = self.at(span, path, "duplicate-need", format!("step `{id}` needs `{need}` twice"));
                    self.push(diag.with_hint("remove the repeated entry"));
                } else if !graph.index.contains_key(need.as_str()) {
                    unsure[v] = true;
                    let diag = self.at(span, path, "unknown-need", format!("step `{id}` needs unknown step `{need}`"));
                    let others = || graph.ids.iter().copied().filter(|i| *i != id);
                    let diag = match did_you_mean(need, others()) {
                        Some(s) => diag.with_hint(format!("did you mean `{s}`?")),
                        None if graph.len() == 1 => diag.with_hint("this is the only step"),
                        None if graph.len() <= 12 => {
                            diag.with_hint(format!("steps are {}", list(&others().collect::<Vec<_>>())))
                        }
                        None => diag,
                    };
                    self.push(diag);
                }
            }
        }

        let components = graph.components();
        self.cycles(&graph, &named, &components);
        let upstream = graph.upstream(&components);

        // Order rules.
        let first_of = |kind: StepKind| graph.kinds.iter().position(|k| *k == Some(kind)).map(|i| graph.ids[i]);
        let shards: Vec<&str> = (0..graph.len())
            .filter(|&i| graph.kinds[i] == Some(StepKind::MegatronShard))
            .map(|i| graph.ids[i])
            .take(4)
            .collect();
        for (v, d) in named.iter().enumerate() {
            let (id, Some(kind)) = (graph.ids[v], d.kind) else { continue };
            if d.needs_unsure || unsure[v] {
                continue;
            }
            let base = format!("steps[{}]", d.index);
            let uses = self.loc.span(&join(&base, "uses"));
            let (needs_span, needs_path) = if d.needs.is_empty() {
                (uses, join(&base, "uses"))
            } else {
                (self.loc.span(&join(&base, "needs")), join(&base, "needs"))
            };
            let up = &upstream[v];
            match kind {
                StepKind::MegatronSplitFused => {
                    let direct = &graph.needs[v];
                    let is_shard = |w: &usize| graph.kinds[*w] == Some(StepKind::MegatronShard);
                    if direct.len() != 1 || !direct.iter().all(is_shard) {
                        let found = if direct.is_empty() {
                            "it needs no step".to_string()
                        } else {
                            let shown: Vec<String> = direct
                                .iter()
                                .map(|&w| match graph.kinds[w] {
                                    Some(k) => format!("`{}` (`{k}`)", graph.ids[w]),
                                    None => format!("`{}`", graph.ids[w]),
                                })
                                .collect();
                            format!("it needs {}", shown.join(", "))
                        };
                        let diag = self.at(
                            needs_span,
                            &needs_path,
                            "step-order",
                            format!("`megatron.split_fused` step `{id}` must directly follow a `megatron.shard` step, but {found}"),
                        );
                        let hint = match shards.as_slice() {
                            [one] => format!("set `needs: [{one}]`: it splits the fused output of that shard step"),
                            [] => "add a `megatron.shard` step and set `needs: [<its id>]`".to_string(),
                            many => format!("set `needs:` to exactly one shard step, e.g. `needs: [{}]`", many[0]),
                        };
                        self.push(diag.with_hint(hint));
                    }
                }
                StepKind::CheckpointValidate | StepKind::StoreUpload if !up.has_shard => {
                    let what = if kind == StepKind::CheckpointValidate {
                        "there is no checkpoint to validate"
                    } else {
                        "there is nothing to upload"
                    };
                    let diag = self.at(
                        needs_span,
                        &needs_path,
                        "missing-upstream",
                        format!("`{kind}` step `{id}` has no upstream `megatron.shard` step: {what}"),
                    );
                    let hint = match first_of(StepKind::MegatronSplitFused).or(first_of(StepKind::MegatronShard)) {
                        Some(s) => format!("add the step that writes the checkpoint to `needs`, e.g. `needs: [{s}]`"),
                        None => "add a `megatron.shard` step and list it (or the step after it) in `needs`".to_string(),
                    };
                    self.push(diag.with_hint(hint));
                }
                StepKind::MegatronShard if up.downloads.is_empty() => {
                    let diag = self.at(
                        needs_span,
                        &needs_path,
                        "missing-upstream",
                        format!(
                            "`megatron.shard` step `{id}` has no upstream `hf.download` step: it has no source release"
                        ),
                    );
                    let hint = match first_of(StepKind::HfDownload) {
                        Some(s) => format!("add `needs: [{s}]`"),
                        None => "add an `hf.download` step and list it in `needs`".to_string(),
                    };
                    self.push(diag.with_hint(hint));
                }
                StepKind::MegatronShard if up.downloads.len() > 1 => {
                    let names: Vec<&str> = up.downloads.iter().take(MAX_DOWNLOADS).map(|&w| graph.ids[w]).collect();
                    let count = if up.downloads.len() > MAX_DOWNLOADS {
                        format!("more than {MAX_DOWNLOADS}")
                    } else {
                        up.downloads.len().to_string()
                    };
                    let diag = self.at(
                        needs_span,
                        &needs_path,
                        "ambiguous-source",
                        format!(
                            "`megatron.shard` step `{id}` has {count} upstream `hf.download` steps ({}); its source must be unique",
                            list(&names)
                        ),
                    );
                    self.push(diag.with_hint("keep one download upstream of each shard step"));
                }
                _ => {}
            }
        }
    }

    /// Reports each dependency cycle once, as the chain in execution order, at the `needs`
    /// entry that closes it.
    fn cycles(&mut self, graph: &Graph<'_>, named: &[&Draft], components: &[Vec<usize>]) {
        let mut needed_by: Vec<Vec<usize>> = vec![Vec::new(); graph.len()];
        for (v, needs) in graph.needs.iter().enumerate() {
            for &w in needs {
                needed_by[w].push(v);
            }
        }
        let mut cycles: Vec<&Vec<usize>> = components.iter().filter(|c| graph.is_cycle(c)).collect();
        cycles.sort_by_key(|c| c[0]);
        for component in cycles {
            let start = component[0];
            // Shortest path start → … → start along "is needed by" edges, inside the component.
            let mut prev: HashMap<usize, usize> = HashMap::new();
            let mut queue = VecDeque::from([start]);
            let mut last = None;
            'bfs: while let Some(n) = queue.pop_front() {
                for &m in &needed_by[n] {
                    if component.binary_search(&m).is_err() {
                        continue;
                    }
                    if m == start {
                        last = Some(n);
                        break 'bfs;
                    }
                    if let std::collections::hash_map::Entry::Vacant(e) = prev.entry(m) {
                        e.insert(n);
                        queue.push_back(m);
                    }
                }
            }
            let Some(last) = last else { continue };
            let mut chain = vec![last];
            while let Some(&p) = prev.get(&chain[chain.len() - 1]) {
                chain.push(p);
            }
            if chain.last() != Some(&start) {
                chain.push(start);
            }
            chain.reverse(); // start … last
            chain.push(start);
            const SHOWN: usize = 12;
            let mut names: Vec<&str> = chain.iter().map(|&v| graph.ids[v]).collect();
            if names.len() > SHOWN {
                let tail = names.split_off(names.len() - 2);
                names.truncate(SHOWN - 3);
                names.push("…");
                names.extend(tail);
            }
            let shown = names.join(" -> ");
            let (start_id, last_id) = (graph.ids[start], graph.ids[last]);
            // `start` needs `last`: that entry closes the cycle.
            let path =
                named[start].needs.iter().find(|(n, _)| n == last_id).map(|(_, p)| p.clone()).unwrap_or_default();
            let d = self.at(self.loc.span(&path), &path, "cycle", format!("dependency cycle: `{shown}`"));
            let hint = if chain.len() == 2 {
                format!("step `{start_id}` needs itself; remove `{start_id}` from its `needs`")
            } else {
                format!(
                    "a step runs after the steps it needs, so no step of a cycle can start; remove one `needs` \
                     entry of the chain (here: `{start_id}` needs `{last_id}`)"
                )
            };
            self.push(d.with_hint(hint));
        }
    }
}

/// Errors of a mesh, with the model's checks when the model is known.
pub(crate) fn mesh_errors(mesh: &Mesh, model: Option<&ModelConfig>) -> Vec<LayoutError> {
    match model {
        Some(cfg) => check_mesh_for_model(cfg, mesh),
        None => mesh.check(),
    }
}

/// The `with` field a layout message is about.
pub(crate) fn mesh_field(msg: &str, written: &BTreeSet<&str>) -> &'static str {
    if msg.starts_with("world size") {
        return if written.contains("ep") {
            "ep"
        } else if written.contains("etp") {
            "etp"
        } else {
            "dp"
        };
    }
    for f in ["tp", "cp", "dp", "ep", "etp"] {
        if msg.starts_with(&format!("`{f}` must")) {
            return f;
        }
    }
    if msg.contains("etp (") {
        "etp"
    } else if msg.contains("ep (") {
        "ep"
    } else if msg.contains("cp (") {
        "cp"
    } else {
        "tp"
    }
}

/// Values of `field` (1..=64) for which the mesh passes every check, the other fields kept
/// (`etp` follows `tp` when it is not set). At most 8.
pub(crate) fn fitting_values(mesh: &Mesh, field: &str, etp_follows_tp: bool, model: Option<&ModelConfig>) -> Vec<u64> {
    (1..=64u64)
        .filter(|&v| {
            let mut m = *mesh;
            match field {
                "tp" => {
                    m.tp = v;
                    if etp_follows_tp {
                        m.etp = v;
                    }
                }
                "cp" => m.cp = v,
                "dp" => m.dp = v,
                "ep" => m.ep = v,
                _ => m.etp = v,
            }
            let written: BTreeSet<&str> = ["tp", "cp", "dp", "ep", "etp"].into_iter().collect();
            !mesh_errors(&m, model).iter().any(|e| {
                let msg = match e {
                    LayoutError::Mesh(m) => m.clone(),
                    other => other.to_string(),
                };
                let f = mesh_field(&msg, &written);
                f == field || (field == "tp" && etp_follows_tp && f == "etp")
            })
        })
        .take(8)
        .collect()
}

fn required_hint(kind: StepKind, f: &Field) -> String {
    match (kind, f.name) {
        (StepKind::StoreUpload, "to") => "set `with.to` to a `file://` URL or an absolute path".to_string(),
        (_, name) => match f.ty {
            FieldType::UInt { .. } => format!("set `with.{name}`, e.g. `{name}: 2`"),
            _ => format!("set `with.{name}`"),
        },
    }
}

fn param_type_names() -> Vec<&'static str> {
    ParamType::ALL.iter().map(|t| t.as_str()).collect()
}

fn last_key(path: &str) -> &str {
    let tail = path.rsplit('.').next().unwrap_or(path);
    tail.split('[').next().unwrap_or(tail)
}

fn is_pipeline_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 100 && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

fn is_step_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 100
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

/// A suggestion for a name: lowercase, other characters replaced by `sep`.
fn normalise_name(s: &str, sep: char) -> String {
    let mut out = String::new();
    for c in s.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() || c == sep {
            out.push(c);
        } else if !out.ends_with(sep) && !out.is_empty() {
            out.push(sep);
        }
    }
    let out = out.trim_matches(sep).to_string();
    if sep == '_' && out.starts_with(|c: char| c.is_ascii_digit()) {
        format!("p{out}")
    } else {
        out
    }
}

/// Where `needle` sits inside a single-line value; the value itself otherwise.
pub(crate) fn sub_span(text: &str, span: Span, needle: &str) -> Span {
    if span.line != span.end_line || needle.is_empty() {
        return span;
    }
    let Some(line) = crate::diagnostic::source_line(text, span.line) else { return span };
    let chars: Vec<char> = line.chars().collect();
    let from = span.col.saturating_sub(1).min(chars.len());
    let to = span.end_col.saturating_sub(1).min(chars.len()).max(from);
    let hay: String = chars[from..to].iter().collect();
    match hay.find(needle) {
        Some(byte) => {
            let col = span.col + hay[..byte].chars().count();
            Span { line: span.line, col, end_line: span.line, end_col: col + needle.chars().count() }
        }
        None => span,
    }
}
