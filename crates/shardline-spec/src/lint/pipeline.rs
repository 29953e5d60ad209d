//! The whole pipeline: its top-level shape (`apiVersion`, `kind`, `name`, `description`), the
//! passes run in order on the parts that are usable (`triggers` and `notify` linted by their own
//! modules), and the warning for params nothing uses.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{ParamValue, Pipeline, StepSpec, API_VERSION, KIND};
use crate::resolve::{check_meshes, resolve_step, Env};
use crate::schema::TOP_KEYS;
use crate::suggest::did_you_mean;
use crate::template;
use crate::yaml::{quote, Node};

use super::names::{is_pipeline_name, normalise_name};
use super::{LintContext, Linter};

impl Linter<'_> {
    pub(super) fn pipeline(&mut self, root: &Node, ctx: &LintContext) -> Option<Pipeline> {
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
        let limits = self.run_limits(entries);
        let retention = get("retention").map(|e| self.retention(&e.value)).unwrap_or_default();

        // params.
        let (params, types) = match get("params") {
            Some(e) => self.params(&e.value),
            None => (Vec::new(), BTreeMap::new()),
        };

        // triggers (their params must be declared ones).
        let triggers = get("triggers")
            .map(|e| crate::triggers::lint_triggers(self.file, &e.value, &params, &mut self.diags))
            .unwrap_or_default();

        // notify (webhooks; not part of the spec hash).
        let notify =
            get("notify").map(|e| crate::notify::lint_notify(self.file, &e.value, &mut self.diags)).unwrap_or_default();

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
        self.graph(&drafts, ctx);

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
            notify,
            limits,
            retention,
            file: self.file.to_string(),
            locations: std::mem::take(&mut self.loc),
            step_index,
        })
    }
}
