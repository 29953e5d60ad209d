//! Resolution: written values + param values + run id → typed step configs. Shared by lint
//! (with the params' defaults) and [`Pipeline::instantiate`] (with `--set` overrides), so both
//! report a bad value the same way, at the same position.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use sha2::{Digest, Sha256};
use shardline_layout::{LayoutError, Mesh, ModelConfig};

use crate::diagnostic::{self, Diagnostic};
use crate::graph::Graph;
use crate::lint::{fitting_values, join, mesh_errors, mesh_field, sub_span, LintContext};
use crate::model::{
    CheckpointSource, DownloadSource, Locations, OutputFormatName, ParamType, ParamValue, Pipeline, ResolvedPipeline,
    ResolvedStep, Resources, Retry, RngPolicyName, SpecValue, StepConfig, StepKind, StepSpec, API_VERSION,
};
use crate::retention::Retention;
use crate::run_limits::RunLimits;
use crate::schema::{
    convert_literal, convert_param, convert_text, param_from_text, with_fields, Concrete, Field, FieldDefault, CACHE,
    RESOURCES, RETRY, TIMEOUT,
};
use crate::suggest::{did_you_mean, list};
use crate::template::Part;
use crate::yaml::quote;

/// The run id lint interpolates (real ones are only known at submission).
pub(crate) const LINT_RUN_ID: &str = "lint-run";
/// The run id the spec hash is computed with: left symbolic.
const HASH_RUN_ID: &str = "${{ run.id }}";

/// Params and run id to resolve with.
pub(crate) struct Env {
    /// Every declared param, with its type when the declaration is valid.
    pub types: BTreeMap<String, Option<ParamType>>,
    /// Known values (defaults, then overrides).
    pub values: BTreeMap<String, ParamValue>,
    /// Where each value comes from, for messages: "the default of param `tp`", "`--set tp=4`".
    pub origins: BTreeMap<String, String>,
    pub run_id: String,
}

struct Cx<'a> {
    loc: &'a Locations,
    file: &'a str,
    text: Option<&'a str>,
    env: &'a Env,
    diags: &'a mut Vec<Diagnostic>,
}

impl Cx<'_> {
    fn diag(&self, path: &str, code: &str, message: String) -> Diagnostic {
        Diagnostic::at(self.file, self.loc.span(path), path, code, message)
    }

    fn diag_in(&self, path: &str, needle: &str, code: &str, message: String) -> Diagnostic {
        let span = match self.text {
            Some(text) => sub_span(text, self.loc.span(path), needle),
            None => self.loc.span(path),
        };
        Diagnostic::at(self.file, span, path, code, message)
    }

    /// The typed value of one field, or `None` (after reporting, unless the value depends on a
    /// param without a value).
    fn field(&mut self, f: &Field, v: &SpecValue, path: &str) -> Option<Concrete> {
        if let SpecValue::List(items) = v {
            let mut out = Vec::new();
            let mut ok = true;
            for (i, item) in items.iter().enumerate() {
                match self.field(f, item, &format!("{path}[{i}]")) {
                    Some(Concrete::List(v)) => out.extend(v),
                    Some(_) => {}
                    None => ok = false,
                }
            }
            return ok.then_some(Concrete::List(out));
        }
        if let SpecValue::Map(entries) = v {
            let value = Field { name: f.name, ty: crate::schema::FieldType::Text, default: FieldDefault::Optional };
            let mut out = BTreeMap::new();
            let mut ok = true;
            for (name, item) in entries {
                match self.field(&value, item, &join(path, name)) {
                    Some(Concrete::Str(s)) => {
                        out.insert(name.clone(), s);
                    }
                    _ => ok = false,
                }
            }
            return ok.then_some(Concrete::Map(out));
        }
        let SpecValue::Template(t) = v else {
            return match convert_literal(f.ty, v) {
                Ok(c) => Some(c),
                Err(m) => {
                    let d = self.diag(path, m.code, format!("`{}`: {}", f.name, m.message)).with_opt_hint(m.hint);
                    self.diags.push(d);
                    None
                }
            };
        };
        // Every param must be declared.
        let mut undefined = false;
        for name in t.params() {
            if !self.env.types.contains_key(name) {
                undefined = true;
                let mut d = self.diag_in(
                    path,
                    &format!("params.{name}"),
                    "undefined-param",
                    format!("undefined param `{name}` in `{}`", t.source().trim()),
                );
                let declared: Vec<&str> = self.env.types.keys().map(String::as_str).collect();
                d = match did_you_mean(name, declared.iter().copied()) {
                    Some(s) => d.with_hint(format!("did you mean `{s}`?")),
                    None => {
                        d.with_hint(format!("declare it under `params:`, e.g. `{name}: {{type: string, default: …}}`"))
                    }
                };
                if !declared.is_empty() {
                    d = d.with_note(format!("declared params: {}", list(&declared)));
                }
                self.diags.push(d);
            }
        }
        if undefined {
            return None;
        }
        match t.whole() {
            Some(Part::Param(name)) => {
                let ty = (*self.env.types.get(name)?)?;
                if !f.ty.accepts_param(ty) {
                    let d = self.diag(
                        path,
                        "param-type-mismatch",
                        format!("`{}` expects {}, but param `{name}` is a {ty}", f.name, f.ty.name()),
                    );
                    let hint = match f.ty {
                        crate::schema::FieldType::UInt { .. } => format!("declare `{name}` with `type: int`"),
                        crate::schema::FieldType::Bool => format!("declare `{name}` with `type: bool`"),
                        crate::schema::FieldType::Size { .. } => format!("declare `{name}` with `type: size`"),
                        crate::schema::FieldType::Duration { .. } => format!("declare `{name}` with `type: duration`"),
                        crate::schema::FieldType::RepoId
                        | crate::schema::FieldType::Revision
                        | crate::schema::FieldType::Url
                        | crate::schema::FieldType::Globs => format!("declare `{name}` with `type: string`"),
                        _ => format!("declare `{name}` with `type: string` or `type: path`"),
                    };
                    self.diags.push(d.with_hint(hint));
                    return None;
                }
                let value = self.env.values.get(name)?;
                match convert_param(f.ty, value) {
                    Ok(c) => Some(c),
                    Err(m) => {
                        let origin = self.env.origins.get(name).cloned().unwrap_or_else(|| format!("param `{name}`"));
                        let d = self
                            .diag(path, m.code, format!("`{}`: {}", f.name, m.message))
                            .with_note(format!("the value `{value}` comes from {origin}"))
                            .with_opt_hint(m.hint);
                        self.diags.push(d);
                        None
                    }
                }
            }
            Some(Part::RunId) => {
                if !f.ty.accepts_param(ParamType::String) {
                    let d = self.diag(
                        path,
                        "param-type-mismatch",
                        format!("`{}` expects {}, but `${{{{ run.id }}}}` is a string", f.name, f.ty.name()),
                    );
                    self.diags.push(d);
                    return None;
                }
                self.text_value(f, &self.env.run_id.clone(), path, "the run id")
            }
            _ => {
                if !f.ty.accepts_text() {
                    let d = self.diag(
                        path,
                        "param-type-mismatch",
                        format!(
                            "`{}`: expected {}, found text with interpolations {}",
                            f.name,
                            f.ty.name(),
                            quote(t.source().trim())
                        ),
                    );
                    let hint = match t.params().next() {
                        Some(p) => format!("make the interpolation the whole value: `\"${{{{ params.{p} }}}}\"`"),
                        None => "only string, path and URL fields mix text with interpolations".to_string(),
                    };
                    self.diags.push(d.with_hint(hint));
                    return None;
                }
                let mut text = String::new();
                for part in &t.parts {
                    match part {
                        Part::Text(s) => text.push_str(s),
                        Part::Param(n) => text.push_str(&self.env.values.get(n)?.to_string()),
                        Part::RunId => text.push_str(&self.env.run_id),
                    }
                }
                self.text_value(f, &text, path, "interpolation")
            }
        }
    }

    fn text_value(&mut self, f: &Field, text: &str, path: &str, origin: &str) -> Option<Concrete> {
        match convert_text(f.ty, text) {
            Ok(c) => Some(c),
            Err(m) => {
                let d = self
                    .diag(path, m.code, format!("`{}`: {}", f.name, m.message))
                    .with_note(format!("{origin} gives {}", quote(text)))
                    .with_opt_hint(m.hint);
                self.diags.push(d);
                None
            }
        }
    }

    /// Resolves a group of fields; `None` when one of them has no value.
    fn group(
        &mut self,
        fields: &[Field],
        written: &BTreeMap<String, SpecValue>,
        base: &str,
    ) -> Option<BTreeMap<&'static str, Concrete>> {
        let mut out = BTreeMap::new();
        let mut ok = true;
        for f in fields {
            match written.get(f.name) {
                Some(v) => match self.field(f, v, &join(base, f.name)) {
                    Some(c) => {
                        out.insert(f.name, c);
                    }
                    None => ok = false,
                },
                None => match f.default {
                    FieldDefault::Required => ok = false,
                    FieldDefault::SameAs(_) => {}
                    d => {
                        if let Some(c) = Concrete::from_default(d) {
                            out.insert(f.name, c);
                        }
                    }
                },
            }
        }
        for f in fields {
            if let (FieldDefault::SameAs(other), false) = (f.default, out.contains_key(f.name)) {
                if let Some(c) = out.get(other).cloned() {
                    out.insert(f.name, c);
                }
            }
        }
        ok.then_some(out)
    }

    fn single(&mut self, f: &Field, written: Option<&SpecValue>, path: &str) -> Option<Concrete> {
        match written {
            Some(v) => self.field(f, v, path),
            None => Concrete::from_default(f.default),
        }
    }
}

fn uint(values: &BTreeMap<&str, Concrete>, k: &str) -> u64 {
    match values.get(k) {
        Some(Concrete::UInt(n) | Concrete::Size(n)) => *n,
        _ => 0,
    }
}

fn boolean(values: &BTreeMap<&str, Concrete>, k: &str) -> bool {
    matches!(values.get(k), Some(Concrete::Bool(true)))
}

fn globs(values: &BTreeMap<&str, Concrete>, k: &str) -> Vec<String> {
    match values.get(k) {
        Some(Concrete::List(v)) => v.clone(),
        _ => Vec::new(),
    }
}

fn string(values: &BTreeMap<&str, Concrete>, k: &str) -> String {
    match values.get(k) {
        Some(Concrete::Str(s)) => s.clone(),
        _ => String::new(),
    }
}

/// Resolves one step. Reports every bad value; `None` when any value is bad or unknown.
pub(crate) fn resolve_step(
    step: &StepSpec,
    index: usize,
    loc: &Locations,
    file: &str,
    text: Option<&str>,
    env: &Env,
    diags: &mut Vec<Diagnostic>,
) -> Option<ResolvedStep> {
    let mut cx = Cx { loc, file, text, env, diags };
    let base = format!("steps[{index}]");
    let with = cx.group(with_fields(step.kind), &step.with, &join(&base, "with"));
    let resources = cx.group(RESOURCES, &step.resources, &join(&base, "resources"));
    let retry = cx.group(RETRY, &step.retry, &join(&base, "retry"));
    let timeout = cx.single(&TIMEOUT, step.timeout.as_ref(), &join(&base, "timeout"));
    let cache = cx.single(&CACHE, step.cache.as_ref(), &join(&base, "cache"));
    let (w, r, rt, Some(Concrete::Duration(timeout)), Some(Concrete::Bool(cache))) =
        (with?, resources?, retry?, timeout, cache)
    else {
        return None;
    };
    let config = match step.kind {
        StepKind::HfDownload => StepConfig::HfDownload {
            source: match w.get("repo") {
                Some(Concrete::Str(repo)) => DownloadSource::Hub {
                    repo: repo.clone(),
                    revision: string(&w, "revision"),
                    allow: globs(&w, "allow"),
                    ignore: globs(&w, "ignore"),
                    endpoint: w.get("endpoint").map(|_| string(&w, "endpoint")),
                },
                _ => {
                    let path = string(&w, "path");
                    if crate::checks::is_object_store_source(&path) {
                        DownloadSource::ObjectStore { url: path }
                    } else {
                        DownloadSource::Local { path: PathBuf::from(path) }
                    }
                }
            },
        },
        StepKind::MegatronShard => StepConfig::MegatronShard {
            tp: uint(&w, "tp"),
            cp: uint(&w, "cp"),
            dp: uint(&w, "dp"),
            ep: uint(&w, "ep"),
            etp: uint(&w, "etp"),
            format: string(&w, "format").parse().unwrap_or(OutputFormatName::Dcp),
            target: string(&w, "target"),
            torchtitan_version: w
                .get("torchtitan_version")
                .map(|_| string(&w, "torchtitan_version"))
                .unwrap_or_default(),
            prefix: match w.get("prefix") {
                Some(_) => string(&w, "prefix"),
                None if matches!(string(&w, "target").as_str(), "torch_dist" | "torchtitan") => String::new(),
                None => "model.module.".to_string(),
            },
            optimizer_state: boolean(&w, "optimizer_state"),
            vocab_divisible_by: uint(&w, "vocab_divisible_by"),
            keep: boolean(&w, "keep"),
        },
        StepKind::MegatronSplitFused => StepConfig::MegatronSplitFused { keep: boolean(&w, "keep") },
        StepKind::CheckpointValidate => StepConfig::CheckpointValidate {},
        StepKind::CheckpointReshard => StepConfig::CheckpointReshard {
            source: w.get("path").map(|_| {
                let path = string(&w, "path");
                if crate::checks::is_object_store_source(&path) {
                    CheckpointSource::ObjectStore { url: path }
                } else {
                    CheckpointSource::Local { path: PathBuf::from(path) }
                }
            }),
            tp: uint(&w, "tp"),
            cp: uint(&w, "cp"),
            dp: uint(&w, "dp"),
            ep: uint(&w, "ep"),
            etp: uint(&w, "etp"),
            rng: if string(&w, "rng") == "drop" { RngPolicyName::Drop } else { RngPolicyName::FromRank0 },
            vocab_size: w.get("vocab_size").map(|_| uint(&w, "vocab_size")),
            from_mesh: w.get("from_mesh").map(|_| string(&w, "from_mesh")),
            target: w.get("target").map(|_| string(&w, "target")),
        },
        StepKind::CheckpointExport => StepConfig::CheckpointExport {
            like: w.get("like").map(|_| PathBuf::from(string(&w, "like"))),
            etp: w.get("etp").map(|_| uint(&w, "etp")),
            max_file_size: uint(&w, "max_file_size"),
            parts: uint(&w, "parts"),
        },
        StepKind::StoreUpload => StepConfig::StoreUpload { to: string(&w, "to") },
        StepKind::Command => command(&mut cx, step, &base, &w)?,
    };
    let backoff = match rt.get("backoff") {
        Some(Concrete::Duration(d)) => *d,
        _ => Duration::ZERO,
    };
    Some(ResolvedStep {
        id: step.id.clone(),
        kind: step.kind,
        needs: step.needs.clone(),
        config,
        resources: Resources {
            cpus: u32::try_from(uint(&r, "cpus")).unwrap_or(u32::MAX),
            memory_bytes: uint(&r, "memory"),
            gpus: u32::try_from(uint(&r, "gpus")).unwrap_or(u32::MAX),
            scratch_bytes: uint(&r, "scratch"),
        },
        retry: Retry {
            attempts: u32::try_from(uint(&rt, "attempts")).unwrap_or(u32::MAX),
            lost: u32::try_from(uint(&rt, "lost")).unwrap_or(u32::MAX),
            backoff,
        },
        timeout,
        cache,
    })
}

/// A command step's config; `run` is checked against `shell` once both are concrete.
fn command(cx: &mut Cx<'_>, step: &StepSpec, base: &str, w: &BTreeMap<&str, Concrete>) -> Option<StepConfig> {
    let run = globs(w, "run");
    let shell = boolean(w, "shell");
    let path = join(&join(base, "with"), "run");
    let problem = if run.is_empty() {
        Some((
            "empty-command",
            "`run` is empty: there is no program to run".to_string(),
            "e.g. `run: [python3, scripts/check.py]`, or `run: \"make check\"` with `shell: true`",
        ))
    } else if shell && run.len() > 1 {
        Some((
            "shell-script",
            format!("with `shell: true`, `run` is one script for `/bin/sh -c`, but it has {} items", run.len()),
            "write the script as one string, or set `shell: false` to run the list as an argv",
        ))
    } else if run[0].trim().is_empty() {
        Some(("empty-command", "the program to run (`run`'s first item) is empty".to_string(), "name a program"))
    } else if !shell && !matches!(step.with.get("run"), Some(SpecValue::List(_))) && run[0].contains(' ') {
        Some((
            "shell-script",
            format!("`run` is one string, {}, run as a program name (no shell unless asked)", quote(&run[0])),
            "split it into a list of arguments, e.g. `run: [python3, check.py]`, or set `shell: true`",
        ))
    } else {
        None
    };
    if let Some((code, message, hint)) = problem {
        let d = cx.diag(&path, code, message).with_hint(hint);
        cx.diags.push(d);
        return None;
    }
    let env = match w.get("env") {
        Some(Concrete::Map(m)) => m.clone(),
        _ => BTreeMap::new(),
    };
    let workdir = w.get("workdir").map(|_| PathBuf::from(string(w, "workdir")));
    Some(StepConfig::Command { run, shell, env, inherit: globs(w, "inherit"), workdir })
}

/// Mesh checks of every resolved shard and reshard step: `Mesh::check`, and
/// `check_mesh_for_model` when `ctx` can read the source's model config (a reshard of a `path`
/// has none: its source is a checkpoint). Each violation is reported at the `with` field it
/// is about (or where that field would be written).
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_meshes(
    steps: &[(usize, &StepSpec)],
    resolved: &BTreeMap<String, ResolvedStep>,
    env: &Env,
    ctx: &LintContext,
    loc: &Locations,
    file: &str,
    diags: &mut Vec<Diagnostic>,
) {
    crate::targets::check_targets(steps, resolved, loc, file, diags);
    let graph = Graph::new(
        steps
            .iter()
            .map(|(_, s)| (s.id.as_str(), Some(s.kind), s.needs.iter().map(String::as_str).collect()))
            .collect(),
    );
    let upstream = graph.upstream(&graph.components());
    for (v, (index, spec)) in steps.iter().enumerate() {
        if !matches!(spec.kind, StepKind::MegatronShard | StepKind::CheckpointReshard) || spec.id.is_empty() {
            continue;
        }
        let Some(config) = resolved.get(&spec.id).map(|r| &r.config) else { continue };
        let Some(mesh) = config.mesh() else { continue };
        let own_source = matches!(config, StepConfig::CheckpointReshard { source: Some(_), .. });
        let mut model: Option<(ModelConfig, PathBuf)> = None;
        let download = match upstream.get(v).map(|u| &u.downloads) {
            Some(d) if d.len() == 1 && !own_source => d.first().map(|&w| (w, graph.ids[w])),
            _ => None,
        };
        if let Some((w, dl_id)) = download {
            // A Hub source's config is not read at lint time (no network): model-independent checks only.
            if let Some(StepConfig::HfDownload { source: DownloadSource::Local { path } }) =
                resolved.get(dl_id).map(|r| &r.config)
            {
                match ctx.lookup(path) {
                    Ok(Some(cfg)) => model = Some((cfg, path.clone())),
                    Ok(None) => {}
                    // Reported once, for the shard step that reads the release.
                    Err(_) if spec.kind != StepKind::MegatronShard => {}
                    Err(msg) => {
                        let p = format!("steps[{}].with.path", steps[w].0);
                        diags.push(
                            Diagnostic::at(
                                file,
                                loc.span(&p),
                                &p,
                                "model-config",
                                format!("cannot read the model config of `{}`: {msg}", path.display()),
                            )
                            .with_hint("the source must be an HF-layout directory with a readable `config.json`"),
                        );
                    }
                }
            }
        }
        let base = format!("steps[{index}].with");
        let written: BTreeSet<&str> =
            ["tp", "cp", "dp", "ep", "etp"].into_iter().filter(|f| loc.values.contains_key(&join(&base, f))).collect();
        for e in mesh_errors(&mesh, model.as_ref().map(|(c, _)| c)) {
            let msg = match &e {
                LayoutError::Mesh(m) => m.clone(),
                other => other.to_string(),
            };
            let mut field = mesh_field(&msg, &written);
            let mut notes = Vec::new();
            if !written.contains(field) {
                if field == "etp" && written.contains("tp") {
                    notes.push(format!("`etp` is not set and defaults to `tp` ({})", mesh.tp));
                    field = "tp";
                } else {
                    notes.push(format!("`{field}` is not set and defaults to {}", mesh_value(&mesh, field)));
                }
            }
            if let Some(SpecValue::Template(t)) = spec.with.get(field) {
                if let Some(p) = t.params().next() {
                    let origin = env.origins.get(p).cloned().unwrap_or_else(|| format!("param `{p}`"));
                    notes.push(format!("`{field}` = {} comes from {origin}", mesh_value(&mesh, field)));
                }
            }
            notes.push(match &model {
                Some((cfg, path)) => format!("mesh {mesh}, model `{}` at `{}`", cfg.model_type, path.display()),
                None => format!("mesh {mesh}"),
            });
            let path = join(&base, field);
            let mut d = Diagnostic::at(file, loc.span(&path), &path, "mesh", msg);
            d.notes = notes;
            let fits = fitting_values(&mesh, field, !written.contains("etp"), model.as_ref().map(|(c, _)| c));
            if !fits.is_empty() {
                let what = if model.is_some() { "this model and the rest of the mesh" } else { "the rest of the mesh" };
                let shown: Vec<String> = fits.iter().map(u64::to_string).collect();
                d = d.with_hint(format!("`{field}` values that fit {what}: {}", shown.join(", ")));
            }
            diags.push(d);
        }
    }
}

fn mesh_value(mesh: &Mesh, field: &str) -> u64 {
    match field {
        "cp" => mesh.cp,
        "dp" => mesh.dp,
        "ep" => mesh.ep,
        "etp" => mesh.etp,
        _ => mesh.tp,
    }
}

/// Run ids are interpolated into paths: one path segment of letters, digits, `.`, `_`, `-`,
/// not starting with `.`, at most 128 characters.
fn check_run_id(run_id: &str) -> Result<(), String> {
    if run_id.is_empty() {
        return Err("the run id is empty".to_string());
    }
    if run_id.len() > 128 {
        return Err(format!("the run id is {} characters long (at most 128)", run_id.len()));
    }
    if run_id.starts_with('.') || !run_id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
        return Err(format!("invalid run id {}", quote(run_id)));
    }
    Ok(())
}

/// Parses a `--set NAME=VALUE` argument into its two halves.
pub fn parse_override(arg: &str) -> Result<(String, String), OverrideSyntaxError> {
    match arg.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(OverrideSyntaxError { arg: arg.to_string() }),
    }
}

/// A `--set` argument without `NAME=`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid override {arg:?}: expected NAME=VALUE, e.g. `--set tp=4`")]
pub struct OverrideSyntaxError {
    pub arg: String,
}

#[derive(Serialize)]
struct Canonical<'a> {
    api_version: &'a str,
    name: &'a str,
    params: &'a BTreeMap<String, serde_json::Value>,
    steps: Vec<ResolvedStep>,
    /// Left out at its default, so specs written before limits existed keep their hashes.
    #[serde(skip_serializing_if = "RunLimits::is_default")]
    limits: &'a RunLimits,
    /// Likewise: specs written before retention existed keep their hashes.
    #[serde(skip_serializing_if = "Retention::is_default")]
    retention: &'a Retention,
}

fn spec_hash(
    name: &str,
    params: &BTreeMap<String, serde_json::Value>,
    steps: &[ResolvedStep],
    limits: &RunLimits,
    retention: &Retention,
) -> String {
    let mut steps: Vec<ResolvedStep> = steps.to_vec();
    for s in &mut steps {
        s.needs.sort();
        s.needs.dedup();
    }
    steps.sort_by(|a, b| a.id.cmp(&b.id));
    let canonical = Canonical { api_version: API_VERSION, name, params, steps, limits, retention };
    let bytes = serde_json::to_vec(&canonical).unwrap_or_default();
    hex::encode(Sha256::digest(&bytes))
}

impl Pipeline {
    /// Instantiates the pipeline for one run: applies `--set` overrides (typed: `tp=two` is an
    /// error naming the param and its type), substitutes params and the run id, fills defaults,
    /// and checks every value and mesh again. Every problem is reported at once.
    pub fn instantiate(
        &self,
        overrides: &[(String, String)],
        run_id: &str,
    ) -> Result<ResolvedPipeline, Vec<Diagnostic>> {
        self.instantiate_with(overrides, run_id, &LintContext::new())
    }

    /// As [`Pipeline::instantiate`], with model configs for the mesh checks (an override such
    /// as `--set tp=8` is checked against the model as lint checks the defaults).
    pub fn instantiate_with(
        &self,
        overrides: &[(String, String)],
        run_id: &str,
        ctx: &LintContext,
    ) -> Result<ResolvedPipeline, Vec<Diagnostic>> {
        let mut diags = Vec::new();
        if let Err(msg) = check_run_id(run_id) {
            diags.push(
                Diagnostic::error(&self.file, 0, 0, "run.id", "invalid-run-id", msg)
                    .with_hint("run ids are one path segment: letters, digits, `.`, `_` and `-`"),
            );
        }
        let mut values: BTreeMap<String, ParamValue> = BTreeMap::new();
        let mut origins: BTreeMap<String, String> = BTreeMap::new();
        for p in &self.params {
            if let Some(d) = &p.default {
                values.insert(p.name.clone(), d.clone());
                origins.insert(p.name.clone(), format!("the default of param `{}`", p.name));
            }
        }
        for (name, text) in overrides {
            let arg = format!("--set {name}={text}");
            let Some(p) = self.param(name) else {
                let names: Vec<&str> = self.params.iter().map(|p| p.name.as_str()).collect();
                let mut d = Diagnostic::error(
                    &self.file,
                    0,
                    0,
                    format!("params.{name}"),
                    "unknown-param",
                    format!("`{arg}`: the pipeline has no param `{name}`"),
                );
                d = match did_you_mean(name, names.iter().copied()) {
                    Some(s) => d.with_hint(format!("did you mean `{s}`?")),
                    None if names.is_empty() => d.with_hint("this pipeline declares no params"),
                    None => d.with_hint(format!("params: {}", list(&names))),
                };
                diags.push(d);
                continue;
            };
            let path = format!("params.{name}");
            let at = |code: &str, message: String| {
                Diagnostic::at(&self.file, self.locations.key(&path), &path, code, message)
            };
            match param_from_text(p.ty, text) {
                Err(m) => diags.push(
                    at(m.code, format!("`{arg}`: {}", m.message))
                        .with_note(format!("param `{name}` is declared here as `{}`", p.ty))
                        .with_opt_hint(m.hint),
                ),
                Ok(v) if !p.choices.is_empty() && !p.choices.contains(&v) => {
                    let shown: Vec<String> = p.choices.iter().map(ToString::to_string).collect();
                    let shown: Vec<&str> = shown.iter().map(String::as_str).collect();
                    let d = at("invalid-value", format!("`{arg}`: `{v}` is not one of {}", list(&shown)));
                    diags.push(match did_you_mean(&v.to_string(), shown.iter().copied()) {
                        Some(s) => d.with_hint(format!("did you mean `{s}`?")),
                        None => d.with_hint(format!("param `{name}` allows {}", list(&shown))),
                    });
                }
                Ok(v) => {
                    values.insert(name.clone(), v);
                    origins.insert(name.clone(), format!("`{arg}`"));
                }
            }
        }
        for p in &self.params {
            if !values.contains_key(&p.name) && !overrides.iter().any(|(n, _)| *n == p.name) {
                let path = format!("params.{}", p.name);
                diags.push(
                    Diagnostic::at(
                        &self.file,
                        self.locations.key(&path),
                        &path,
                        "missing-param",
                        format!("param `{}` has no default and is not set", p.name),
                    )
                    .with_hint(format!("pass `--set {}=<{}>`", p.name, p.ty)),
                );
            }
        }

        let types = self.params.iter().map(|p| (p.name.clone(), Some(p.ty))).collect();
        let mut env = Env { types, values, origins, run_id: run_id.to_string() };
        let indexed: Vec<(usize, &StepSpec)> = self.step_index.iter().copied().zip(&self.steps).collect();
        let mut resolved = Vec::new();
        for (index, spec) in &indexed {
            if let Some(r) = resolve_step(spec, *index, &self.locations, &self.file, None, &env, &mut diags) {
                resolved.push(r);
            }
        }
        let by_id: BTreeMap<String, ResolvedStep> = resolved.iter().map(|r| (r.id.clone(), r.clone())).collect();
        check_meshes(&indexed, &by_id, &env, ctx, &self.locations, &self.file, &mut diags);
        if diags.iter().any(Diagnostic::is_error) || resolved.len() != self.steps.len() {
            diagnostic::sort(&mut diags);
            return Err(diags);
        }

        let params: BTreeMap<String, serde_json::Value> =
            env.values.iter().map(|(k, v)| (k.clone(), v.to_json())).collect();
        // The hash leaves the run id symbolic so that two submissions of one spec agree.
        env.run_id = HASH_RUN_ID.to_string();
        let mut scratch = Vec::new();
        let symbolic: Vec<ResolvedStep> = indexed
            .iter()
            .filter_map(|(i, s)| resolve_step(s, *i, &self.locations, &self.file, None, &env, &mut scratch))
            .collect();
        let hashed = if symbolic.len() == resolved.len() { &symbolic } else { &resolved };
        let spec_hash = spec_hash(&self.name, &params, hashed, &self.limits, &self.retention);
        Ok(ResolvedPipeline {
            name: self.name.clone(),
            spec_hash,
            params,
            steps: resolved,
            limits: self.limits.clone(),
            retention: self.retention,
        })
    }
}
