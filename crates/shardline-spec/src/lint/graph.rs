//! Pass 5, the step graph: unknown and repeated `needs`, dependency cycles (printed as the
//! chain), and the order rules between step kinds.

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::graph::{Graph, MAX_DOWNLOADS};
use crate::model::StepKind;
use crate::suggest::{did_you_mean, list};

use super::{join, Draft, LintContext, Linter};
use crate::model::SpecValue;

/// Whether the checkpoint an export of step `v` reads may describe its own release: a NeMo
/// Automodel save (its `model/.hf_metadata/`) that an upstream `checkpoint.reshard` reads from
/// a local `with.path` holding that description, or from a templated path the run resolves
/// (and then checks, naming what is missing).
fn may_describe_its_release(graph: &Graph<'_>, named: &[&Draft], v: usize, ctx: &LintContext) -> bool {
    let mut seen = vec![false; graph.len()];
    let mut queue: VecDeque<usize> = graph.needs[v].iter().copied().collect();
    while let Some(w) = queue.pop_front() {
        if std::mem::replace(&mut seen[w], true) {
            continue;
        }
        queue.extend(graph.needs[w].iter().copied());
        if graph.kinds[w] != Some(StepKind::CheckpointReshard) {
            continue;
        }
        let path = named[w].spec.as_ref().and_then(|s| s.with.get("path"));
        let described = match path {
            Some(SpecValue::String(p)) => ctx
                .source_path(std::path::Path::new(p))
                .join("model/.hf_metadata/fqn_to_file_index_mapping.json")
                .is_file(),
            Some(SpecValue::Template(_)) => true,
            _ => false,
        };
        if described {
            return true;
        }
    }
    false
}

impl Linter<'_> {
    pub(super) fn graph(&mut self, drafts: &[Draft], ctx: &LintContext) {
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
                StepKind::CheckpointValidate | StepKind::CheckpointExport | StepKind::StoreUpload
                    if !(up.has_checkpoint || (kind == StepKind::StoreUpload && up.has_export)) =>
                {
                    let what = match kind {
                        StepKind::CheckpointValidate => "there is no checkpoint to validate",
                        StepKind::CheckpointExport => "there is no checkpoint to export",
                        _ => "there is nothing to upload",
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
                StepKind::CheckpointValidate if up.downloads.is_empty() => {
                    let diag = self.at(
                        needs_span,
                        &needs_path,
                        "missing-upstream",
                        format!(
                            "`checkpoint.validate` step `{id}` has no upstream `hf.download` step: there is no release \
                             to compare the checkpoint with"
                        ),
                    );
                    self.push(diag.with_hint(
                        "validate a checkpoint sharded from a release the pipeline downloads (a `checkpoint.reshard` \
                         of a `path` has none)",
                    ));
                }
                StepKind::CheckpointReshard if !up.has_checkpoint && !self.written(&base, "path") => {
                    let diag = self.at(
                        needs_span,
                        &needs_path,
                        "missing-source",
                        format!(
                            "`checkpoint.reshard` step `{id}` has no source: no `with.path`, and no upstream step \
                             writes a checkpoint"
                        ),
                    );
                    let hint = match first_of(StepKind::MegatronSplitFused).or(first_of(StepKind::MegatronShard)) {
                        Some(s) => format!("set `needs: [{s}]` to reshard its checkpoint, or `with.path` to a checkpoint directory or object-store prefix"),
                        None => "set `with.path` to a checkpoint directory or an object-store prefix (`s3://bucket/prefix`), \
                                 or need a `megatron.shard` step"
                            .to_string(),
                    };
                    self.push(diag.with_hint(hint));
                }
                StepKind::CheckpointExport
                    if up.downloads.is_empty()
                        && !self.written(&base, "like")
                        && !may_describe_its_release(&graph, &named, v, ctx) =>
                {
                    let diag = self.at(
                        needs_span,
                        &needs_path,
                        "missing-source",
                        format!(
                            "`checkpoint.export` step `{id}` has no release to write the checkpoint as: no `with.like` \
                             and no upstream `hf.download` step"
                        ),
                    );
                    self.push(diag.with_hint(
                        "set `with.like` to the local HF release the checkpoint came from (its config.json, tokenizer \
                         files and safetensors headers are read); a NeMo Automodel save resharded from `with.path` \
                         describes its own (`model/.hf_metadata/`)",
                    ));
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

    /// Whether `with.KEY` of the step at `base` is written (even with a refused value).
    fn written(&self, base: &str, key: &str) -> bool {
        self.loc.values.contains_key(&join(&join(base, "with"), key))
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
