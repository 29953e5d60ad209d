//! Pass 4, `steps`: each step's keys, id (unique), kind, `needs` and typed settings, and the
//! source rule of `hf.download` (exactly one of `repo` and `path`).

use std::collections::BTreeMap;

use crate::model::{StepKind, StepSpec};
use crate::schema::{
    unknown_with_hint, with_fields, Field, FieldType, CACHE, HUB_ONLY_FIELDS, RESOURCES, RETRY, STEP_KEYS, TIMEOUT,
};
use crate::suggest::{did_you_mean, list};
use crate::yaml::{quote, Entry, Kind, Node, Span};

use super::names::{is_step_id, normalise_name};
use super::{join, Draft, Linter};

impl Linter<'_> {
    pub(super) fn steps(&mut self, entry: &Entry) -> Vec<Draft> {
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
                    "lost_leases" | "max_lost" | "lost_workers" | "preempted" | "preemptions" | "infra" => {
                        Some("did you mean `lost`? (lost leases: workers that died or were cut off)".to_string())
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
