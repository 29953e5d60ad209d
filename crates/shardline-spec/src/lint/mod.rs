//! `lint`: YAML text → a [`Pipeline`] and every diagnostic at once.
//!
//! Passes, in order (each reports everything it finds and lets the later ones run on what is
//! usable):
//! 1. document: size, YAML syntax, aliases, nesting, one document, duplicate keys;
//! 2. shape: top-level keys, `apiVersion`, `kind`, `name`, and how runs share the workers
//!    (`concurrency`, `pool`, `priority`: `limits`) and how long its runs' directories are kept
//!    (`retention`);
//! 3. params: types, defaults, `enum`s;
//! 4. steps: keys, ids, kinds, `needs`, typed `with`/`resources`/`retry`/`timeout`/`cache`;
//! 5. graph: unknown and duplicate `needs`, cycles (printed as the chain), order rules
//!    (`split_fused` right after `shard`, a checkpoint upstream of `validate`, `export` and
//!    `upload`, one download upstream of `shard`, a source for `reshard` and `export`);
//! 6. values: every field resolved with the params' defaults (interpolations, types, ranges);
//! 7. mesh (of `shard` and `reshard` steps): `Mesh::check` and, when the context can read the source's `config.json`,
//!    `check_mesh_for_model`, each violation at its `with.tp`/`with.ep`/… position;
//! 8. warnings: params that nothing uses.
//!
//! One module a job: [`LintContext`] (`context`), the passes' order and the top-level shape
//! (`pipeline`), shared readers of keys and strings (`read`), `params`, `steps` and their typed
//! settings (`fields`), the step `graph`, the rules for `names`, and the `mesh` checks value
//! resolution shares.

mod context;
mod fields;
mod graph;
mod limits;
mod mesh;
mod names;
mod params;
mod pipeline;
mod read;
mod retention;
mod steps;

use crate::diagnostic::{self, Diagnostic};
use crate::model::{Locations, Pipeline, StepKind, StepSpec, API_VERSION, KIND};
use crate::yaml::{self, Kind, Node, Span};

pub use context::LintContext;
pub(crate) use mesh::{fitting_values, mesh_errors, mesh_field};

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
}

/// The last key of a key path, without its index (`needs` of `steps[0].needs[1]`).
fn last_key(path: &str) -> &str {
    let tail = path.rsplit('.').next().unwrap_or(path);
    tail.split('[').next().unwrap_or(tail)
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
