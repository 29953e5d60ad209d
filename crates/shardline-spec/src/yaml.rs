//! A YAML document as a tree of nodes that remember where they were written.
//!
//! Built from `saphyr-parser` events, whose spans give every key and value its line and column.
//! Untrusted input is bounded here, before anything else looks at it: the file size, the nesting
//! depth, the number of anchors and aliases and the number of nodes aliases expand to (so that a
//! "billion laughs" document cannot blow up), and one document per file.

use std::collections::HashMap;

use saphyr_parser::{Event, Parser, ScalarStyle, ScanError, Tag};

/// Largest accepted file, in bytes.
pub const MAX_FILE_BYTES: usize = 1 << 20;
/// Deepest accepted nesting of mappings and sequences.
pub const MAX_DEPTH: usize = 64;
/// Most anchors (`&name`) accepted in one file.
pub const MAX_ANCHORS: usize = 32;
/// Most aliases (`*name`) accepted in one file.
pub const MAX_ALIASES: usize = 32;
/// Most nodes that anchors and their aliases may copy, in total.
pub const MAX_ALIAS_NODES: usize = 10_000;

/// A region of the source: 1-based line and column (in characters) of its start, and its end
/// (exclusive).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Span {
    pub line: usize,
    pub col: usize,
    pub end_line: usize,
    pub end_col: usize,
}

impl Span {
    pub fn point(line: usize, col: usize) -> Span {
        Span { line, col, end_line: line, end_col: col + 1 }
    }

    fn from_parser(s: &saphyr_parser::Span) -> Span {
        Span { line: s.start.line(), col: s.start.col() + 1, end_line: s.end.line(), end_col: s.end.col() + 1 }
    }

    fn join(self, end: Span) -> Span {
        Span { end_line: end.end_line, end_col: end.end_col, ..self }
    }

    /// Characters to underline on the first line; 0 means "to the end of the line".
    pub fn underline_len(&self) -> usize {
        if self.end_line == self.line {
            self.end_col.saturating_sub(self.col).max(1)
        } else {
            0
        }
    }
}

/// The YAML core-schema tags we honour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoreTag {
    Str,
    Int,
    Bool,
    Null,
    Float,
    Map,
    Seq,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    pub text: String,
    /// Plain (unquoted, not a block scalar): only plain scalars resolve to ints, bools and nulls.
    pub plain: bool,
    pub tag: Option<CoreTag>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub key: String,
    pub key_span: Span,
    pub value: Node,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    Scalar(Scalar),
    Seq(Vec<Node>),
    Map(Vec<Entry>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub kind: Kind,
    pub span: Span,
}

/// What a scalar means under the YAML 1.2 core schema.
#[derive(Clone, Debug, PartialEq)]
pub enum Resolved<'a> {
    Null,
    Bool(bool),
    Int(i64),
    /// An integer literal outside `i64`.
    BigInt,
    Float(f64),
    Str(&'a str),
}

impl Scalar {
    pub fn resolve(&self) -> Resolved<'_> {
        match self.tag {
            Some(CoreTag::Str) => return Resolved::Str(&self.text),
            None if !self.plain => return Resolved::Str(&self.text),
            _ => {}
        }
        let t = self.text.as_str();
        match t {
            "" | "~" | "null" | "Null" | "NULL" => return Resolved::Null,
            "true" | "True" | "TRUE" => return Resolved::Bool(true),
            "false" | "False" | "FALSE" => return Resolved::Bool(false),
            ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => return Resolved::Float(f64::INFINITY),
            "-.inf" | "-.Inf" | "-.INF" => return Resolved::Float(f64::NEG_INFINITY),
            ".nan" | ".NaN" | ".NAN" => return Resolved::Float(f64::NAN),
            _ => {}
        }
        if let Some(int) = resolve_int(t) {
            return int;
        }
        if is_float(t) {
            if let Ok(f) = t.parse::<f64>() {
                return Resolved::Float(f);
            }
        }
        Resolved::Str(t)
    }
}

fn resolve_int(t: &str) -> Option<Resolved<'static>> {
    let (digits, radix) = if let Some(h) = t.strip_prefix("0x") {
        (h, 16)
    } else if let Some(o) = t.strip_prefix("0o") {
        (o, 8)
    } else {
        (t, 10)
    };
    let body = if radix == 10 { digits.strip_prefix(['-', '+']).unwrap_or(digits) } else { digits };
    if body.is_empty() || !body.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let parsed = if radix == 10 { digits.parse::<i64>() } else { i64::from_str_radix(digits, radix) };
    Some(parsed.map(Resolved::Int).unwrap_or(Resolved::BigInt))
}

fn is_float(t: &str) -> bool {
    // [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?
    let b = t.strip_prefix(['-', '+']).unwrap_or(t).as_bytes();
    let mut i = 0;
    let int_digits = b.iter().take_while(|c| c.is_ascii_digit()).count();
    i += int_digits;
    let mut frac_digits = 0;
    if b.get(i) == Some(&b'.') {
        i += 1;
        frac_digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        i += frac_digits;
    }
    if int_digits == 0 && frac_digits == 0 {
        return false;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'-' | b'+')) {
            i += 1;
        }
        let exp = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        if exp == 0 {
            return false;
        }
        i += exp;
    }
    i == b.len()
}

impl Node {
    pub fn as_map(&self) -> Option<&[Entry]> {
        match &self.kind {
            Kind::Map(m) => Some(m),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(&self.kind, Kind::Scalar(s) if s.resolve() == Resolved::Null)
    }

    fn count(&self) -> usize {
        match &self.kind {
            Kind::Scalar(_) => 1,
            Kind::Seq(items) => 1 + items.iter().map(Node::count).sum::<usize>(),
            Kind::Map(entries) => 1 + entries.iter().map(|e| 1 + e.value.count()).sum::<usize>(),
        }
    }

    /// How the node reads in a message: `int 2`, `string "two"`, `a mapping`.
    pub fn describe(&self) -> String {
        match &self.kind {
            Kind::Seq(_) => "a sequence".to_string(),
            Kind::Map(_) => "a mapping".to_string(),
            Kind::Scalar(s) => describe_scalar(&s.resolve()),
        }
    }
}

pub fn describe_scalar(r: &Resolved<'_>) -> String {
    match r {
        Resolved::Null => "null".to_string(),
        Resolved::Bool(b) => format!("bool {b}"),
        Resolved::Int(i) => format!("int {i}"),
        Resolved::BigInt => "an integer too large for 64 bits".to_string(),
        Resolved::Float(f) => format!("float {f}"),
        Resolved::Str(s) => format!("string {}", quote(s)),
    }
}

/// `"text"`, shortened past 40 characters, escaped like a Rust string.
pub fn quote(s: &str) -> String {
    let mut short: String = s.chars().take(40).collect();
    if short.len() < s.len() {
        short.push('…');
    }
    format!("{short:?}")
}

/// A problem found while reading the document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub span: Span,
    pub code: &'static str,
    pub message: String,
    pub hint: Option<String>,
    /// Key path of the node the problem is about (`steps[1].with.tp`).
    pub path: String,
}

fn problem(span: Span, code: &'static str, message: String, hint: Option<String>) -> Problem {
    Problem { span, code, message, hint, path: String::new() }
}

fn join(base: &str, key: &str) -> String {
    if base.is_empty() {
        key.to_string()
    } else {
        format!("{base}.{key}")
    }
}

enum Frame {
    Seq {
        start: Span,
        anchor: usize,
        path: String,
        items: Vec<Node>,
    },
    Map {
        start: Span,
        anchor: usize,
        path: String,
        entries: Vec<Entry>,
        /// Line of each key's first occurrence.
        seen: HashMap<String, usize>,
        /// `None`: the next node is a key; `Some(None)`: the value of a refused key.
        key: Option<Option<(String, Span)>>,
    },
}

/// Reads one YAML document. Returns the root node (absent when the document cannot be read at
/// all) and every problem found; problems that leave a root (duplicate keys, complex keys,
/// unsupported tags) are recoverable.
pub fn parse(text: &str) -> (Option<Node>, Vec<Problem>) {
    let mut problems = Vec::new();
    if text.len() > MAX_FILE_BYTES {
        problems.push(problem(
            Span::point(1, 1),
            "file-too-large",
            format!("file is {} bytes; pipeline files are limited to {} bytes (1 MiB)", text.len(), MAX_FILE_BYTES),
            Some("pipeline specs are a few kilobytes; check that this is the right file".to_string()),
        ));
        return (None, problems);
    }
    match Builder::default().run(text, &mut problems) {
        Ok(root) => (root, problems),
        Err(fatal) => {
            problems.push(fatal);
            (None, problems)
        }
    }
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    anchors: HashMap<usize, Node>,
    anchor_count: usize,
    alias_count: usize,
    copied_nodes: usize,
    root: Option<Node>,
    documents: usize,
}

impl Builder {
    fn run(mut self, text: &str, problems: &mut Vec<Problem>) -> Result<Option<Node>, Problem> {
        let mut parser = Parser::new_from_str(text);
        loop {
            let before = problems.len();
            let (event, span) = match parser.next_event() {
                None => break,
                Some(Ok((event, span))) => (event, Span::from_parser(&span)),
                Some(Err(e)) => return Err(Problem { path: self.child_path(), ..scan_error(text, &e) }),
            };
            // Problems found while handling an event are about the node it starts or ends.
            let here = match (&event, self.stack.last()) {
                (Event::SequenceEnd | Event::MappingEnd, Some(Frame::Seq { path, .. } | Frame::Map { path, .. })) => {
                    path.clone()
                }
                _ => self.child_path(),
            };
            let stop = self.event(event, span, problems).map_err(|p| {
                if p.path.is_empty() {
                    Problem { path: here.clone(), ..p }
                } else {
                    p
                }
            })?;
            for p in &mut problems[before..] {
                if p.path.is_empty() {
                    p.path.clone_from(&here);
                }
            }
            if stop {
                break;
            }
        }
        Ok(self.root)
    }

    /// Handles one event; `true` at the end of the stream.
    fn event(&mut self, event: Event<'_>, span: Span, problems: &mut Vec<Problem>) -> Result<bool, Problem> {
        {
            match event {
                Event::Nothing | Event::StreamStart | Event::DocumentEnd => {}
                Event::StreamEnd => return Ok(true),
                Event::DocumentStart(_) => {
                    self.documents += 1;
                    if self.documents > 1 {
                        return Err(problem(
                            span,
                            "multiple-documents",
                            "more than one YAML document in this file".to_string(),
                            Some(
                                "a pipeline file holds exactly one document: remove this `---` and what follows, \
                                 or move it to its own file"
                                    .to_string(),
                            ),
                        ));
                    }
                }
                Event::Alias(id) => {
                    self.alias_count += 1;
                    if self.alias_count > MAX_ALIASES {
                        return Err(problem(
                            span,
                            "alias-limit",
                            format!("more than {MAX_ALIASES} YAML aliases in one file"),
                            Some(alias_hint()),
                        ));
                    }
                    let Some(node) = self.anchors.get(&id) else {
                        return Err(problem(span, "yaml-syntax", "alias to an unknown anchor".to_string(), None));
                    };
                    self.copied_nodes += node.count();
                    if self.copied_nodes > MAX_ALIAS_NODES {
                        return Err(problem(
                            span,
                            "alias-expansion",
                            format!("YAML aliases expand to more than {MAX_ALIAS_NODES} nodes"),
                            Some(expansion_hint()),
                        ));
                    }
                    let mut node = node.clone();
                    // A copy is reported where the anchor's text is; its root at the alias.
                    node.span = span;
                    self.complete(node, 0, problems)?;
                }
                Event::Scalar(value, style, anchor, tag) => {
                    self.check_anchor(anchor, span)?;
                    let tag = self.core_tag(tag.as_deref(), span, problems);
                    let scalar = Scalar { text: value.into_owned(), plain: style == ScalarStyle::Plain, tag };
                    match tag {
                        Some(t @ (CoreTag::Map | CoreTag::Seq)) => problems.push(tag_mismatch(span, t, "a scalar")),
                        Some(t @ (CoreTag::Int | CoreTag::Bool | CoreTag::Null | CoreTag::Float)) => {
                            let ok = matches!(
                                (t, scalar.resolve()),
                                (CoreTag::Int, Resolved::Int(_) | Resolved::BigInt)
                                    | (CoreTag::Bool, Resolved::Bool(_))
                                    | (CoreTag::Null, Resolved::Null)
                                    | (CoreTag::Float, Resolved::Float(_) | Resolved::Int(_))
                            );
                            if !ok {
                                problems.push(tag_mismatch(span, t, &format!("the value {}", quote(&scalar.text))));
                            }
                        }
                        _ => {}
                    }
                    self.complete(Node { kind: Kind::Scalar(scalar), span }, anchor, problems)?;
                }
                Event::SequenceStart(anchor, tag) => {
                    self.check_anchor(anchor, span)?;
                    if let Some(t) = self.core_tag(tag.as_deref(), span, problems) {
                        if t != CoreTag::Seq {
                            problems.push(tag_mismatch(span, t, "a sequence"));
                        }
                    }
                    let path = self.child_path();
                    self.push(Frame::Seq { start: span, anchor, path, items: Vec::new() }, span)?;
                }
                Event::MappingStart(anchor, tag) => {
                    self.check_anchor(anchor, span)?;
                    if let Some(t) = self.core_tag(tag.as_deref(), span, problems) {
                        if t != CoreTag::Map {
                            problems.push(tag_mismatch(span, t, "a mapping"));
                        }
                    }
                    let path = self.child_path();
                    self.push(
                        Frame::Map { start: span, anchor, path, entries: Vec::new(), seen: HashMap::new(), key: None },
                        span,
                    )?;
                }
                Event::SequenceEnd | Event::MappingEnd => {
                    let (node, anchor) = match self.stack.pop() {
                        Some(Frame::Seq { start, anchor, items, .. }) => {
                            (Node { kind: Kind::Seq(items), span: start.join(span) }, anchor)
                        }
                        Some(Frame::Map { start, anchor, entries, .. }) => {
                            (Node { kind: Kind::Map(entries), span: start.join(span) }, anchor)
                        }
                        None => {
                            return Err(problem(span, "yaml-syntax", "unbalanced collection end".to_string(), None))
                        }
                    };
                    self.complete(node, anchor, problems)?;
                }
            }
        }
        Ok(false)
    }

    /// Key path of the node that starts next.
    fn child_path(&self) -> String {
        match self.stack.last() {
            None => String::new(),
            Some(Frame::Seq { path, items, .. }) => format!("{path}[{}]", items.len()),
            Some(Frame::Map { path, key: Some(Some((k, _))), .. }) => join(path, k),
            Some(Frame::Map { path, .. }) => path.clone(),
        }
    }

    fn push(&mut self, frame: Frame, span: Span) -> Result<(), Problem> {
        if self.stack.len() >= MAX_DEPTH {
            return Err(problem(
                span,
                "nesting-depth",
                format!("mappings and sequences nest deeper than {MAX_DEPTH} levels"),
                Some("pipeline specs are shallow; this looks like a generated or corrupted file".to_string()),
            ));
        }
        self.stack.push(frame);
        Ok(())
    }

    fn check_anchor(&mut self, anchor: usize, span: Span) -> Result<(), Problem> {
        if anchor != 0 {
            self.anchor_count += 1;
            if self.anchor_count > MAX_ANCHORS {
                return Err(problem(
                    span,
                    "alias-limit",
                    format!("more than {MAX_ANCHORS} YAML anchors in one file"),
                    Some(alias_hint()),
                ));
            }
        }
        Ok(())
    }

    fn core_tag(&self, tag: Option<&Tag>, span: Span, problems: &mut Vec<Problem>) -> Option<CoreTag> {
        let tag = tag?;
        let known = if tag.is_yaml_core_schema() {
            match tag.suffix.as_str() {
                "str" => Some(CoreTag::Str),
                "int" => Some(CoreTag::Int),
                "bool" => Some(CoreTag::Bool),
                "null" => Some(CoreTag::Null),
                "float" => Some(CoreTag::Float),
                "map" => Some(CoreTag::Map),
                "seq" => Some(CoreTag::Seq),
                _ => None,
            }
        } else {
            None
        };
        if known.is_none() {
            let shown = if tag.is_yaml_core_schema() {
                format!("!!{}", tag.suffix)
            } else {
                format!("{}{}", tag.handle, tag.suffix)
            };
            problems.push(problem(
                span,
                "unsupported-tag",
                format!("unsupported YAML tag `{shown}`"),
                Some("only the core tags `!!str`, `!!int`, `!!bool`, `!!null`, `!!float`, `!!map` and `!!seq` are understood".to_string()),
            ));
        }
        known
    }

    fn complete(&mut self, node: Node, anchor: usize, problems: &mut Vec<Problem>) -> Result<(), Problem> {
        if anchor != 0 {
            self.copied_nodes += node.count();
            if self.copied_nodes > MAX_ALIAS_NODES {
                return Err(problem(
                    node.span,
                    "alias-expansion",
                    format!("YAML anchors and aliases expand to more than {MAX_ALIAS_NODES} nodes"),
                    Some(expansion_hint()),
                ));
            }
            self.anchors.insert(anchor, node.clone());
        }
        match self.stack.last_mut() {
            None => self.root = Some(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map { entries, key, seen, path, .. }) => match key.take() {
                None => {
                    // This node is a key.
                    *key = Some(match node.kind {
                        Kind::Scalar(s) => Some((s.text, node.span)),
                        _ => {
                            let mut p = problem(
                                node.span,
                                "complex-key",
                                format!("mapping keys must be plain names, found {}", node.describe()),
                                None,
                            );
                            p.path = path.clone();
                            problems.push(p);
                            None
                        }
                    });
                }
                Some(None) => {} // the value of a rejected key
                Some(Some((name, key_span))) => {
                    if let Some(first_line) = seen.get(&name) {
                        let mut p = problem(
                            key_span,
                            "duplicate-key",
                            format!("duplicate key `{name}`"),
                            Some(format!(
                                "`{name}` is already set on line {first_line}; YAML would silently keep only one of them"
                            )),
                        );
                        p.path = join(path, &name);
                        problems.push(p);
                    } else {
                        seen.insert(name.clone(), key_span.line);
                        entries.push(Entry { key: name, key_span, value: node });
                    }
                }
            },
        }
        Ok(())
    }
}

fn tag_mismatch(span: Span, tag: CoreTag, what: &str) -> Problem {
    problem(span, "unsupported-tag", format!("tag `!!{}` on {what}", format!("{tag:?}").to_lowercase()), None)
}

fn alias_hint() -> String {
    format!(
        "anchors (`&name`) and aliases (`*name`) are limited to {MAX_ANCHORS} each so that a small file cannot \
         expand into a huge one; write the repeated values out"
    )
}

fn expansion_hint() -> String {
    format!(
        "anchors and aliases may copy at most {MAX_ALIAS_NODES} nodes in all, so that a small file cannot \
         expand into a huge one (a \"billion laughs\" document); write the repeated values out"
    )
}

fn scan_error(text: &str, e: &ScanError) -> Problem {
    let m = e.marker();
    let span = Span::point(m.line().max(1), m.col() + 1);
    let line = crate::diagnostic::source_line(text, span.line).unwrap_or("");
    let prev = if span.line >= 2 { crate::diagnostic::source_line(text, span.line - 1).unwrap_or("") } else { "" };
    let hint = if line.contains("${{") || prev.contains("${{") {
        Some(
            "quote interpolations: `\"${{ params.name }}\"` (unquoted `{`/`}` start flow mappings in YAML)".to_string(),
        )
    } else if line.contains('\t') {
        Some("YAML indentation must use spaces, not tabs".to_string())
    } else {
        None
    };
    problem(span, "yaml-syntax", format!("invalid YAML: {}", e.info()), hint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(text: &str) -> Node {
        let (root, problems) = parse(text);
        assert!(problems.is_empty(), "{problems:?}");
        root.unwrap()
    }

    #[test]
    fn spans_are_one_based_and_cover_the_token() {
        let r = root("a: 1\nbb:\n  - \"x y\"\n");
        let m = r.as_map().unwrap();
        assert_eq!(m[0].key_span, Span { line: 1, col: 1, end_line: 1, end_col: 2 });
        assert_eq!(m[1].key_span.line, 2);
        let Kind::Seq(items) = &m[1].value.kind else { panic!() };
        assert_eq!(items[0].span.line, 3);
        assert_eq!(items[0].span.col, 5);
        assert_eq!(items[0].span.underline_len(), 5, "the quotes are part of the token");
    }

    #[test]
    fn core_schema_resolution() {
        let r = root(
            "a: 12\nb: '12'\nc: true\nd: ~\ne: 2.5\nf: two\ng: !!str 3\nh: 0x10\ni: 1e3\nj: 99999999999999999999\n",
        );
        let m = r.as_map().unwrap();
        let res: Vec<Resolved<'_>> = m
            .iter()
            .map(|e| match &e.value.kind {
                Kind::Scalar(s) => s.resolve(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(
            res,
            vec![
                Resolved::Int(12),
                Resolved::Str("12"),
                Resolved::Bool(true),
                Resolved::Null,
                Resolved::Float(2.5),
                Resolved::Str("two"),
                Resolved::Str("3"),
                Resolved::Int(16),
                Resolved::Float(1000.0),
                Resolved::BigInt,
            ]
        );
    }

    #[test]
    fn duplicate_keys_are_reported_and_the_first_is_kept() {
        let (root, problems) = parse("a: 1\nb: 2\na: 3\n");
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].code, "duplicate-key");
        assert_eq!(problems[0].span.line, 3);
        assert_eq!(root.unwrap().as_map().unwrap().len(), 2);
    }

    #[test]
    fn a_few_aliases_expand() {
        let r = root("x: &r {cpus: 2}\ny: *r\n");
        let m = r.as_map().unwrap();
        assert_eq!(m[0].value.kind, m[1].value.kind);
        assert_eq!(m[1].value.span.line, 2);
    }

    #[test]
    fn billion_laughs_is_refused() {
        let mut doc = String::from("a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
        for (prev, name) in
            ["a", "b", "c", "d", "e", "f", "g", "h"].iter().zip(["b", "c", "d", "e", "f", "g", "h", "i"])
        {
            let refs = vec![format!("*{prev}"); 9].join(", ");
            doc.push_str(&format!("{name}: &{name} [{refs}]\n"));
        }
        let (root, problems) = parse(&doc);
        assert!(root.is_none());
        assert!(matches!(problems[0].code, "alias-limit" | "alias-expansion"), "{problems:?}");
    }

    #[test]
    fn doubling_chain_within_the_alias_count_is_refused_by_size() {
        let mut doc = String::from("a0: &a0 [x, x, x, x, x, x, x, x]\n");
        for i in 1..15 {
            doc.push_str(&format!("a{i}: &a{i} [*a{p}, *a{p}]\n", p = i - 1));
        }
        let (root, problems) = parse(&doc);
        assert!(root.is_none());
        assert_eq!(problems[0].code, "alias-expansion", "{problems:?}");
    }

    #[test]
    fn deep_nesting_is_refused_without_recursion() {
        let mut doc = String::new();
        for i in 0..200 {
            doc.push_str(&" ".repeat(i));
            doc.push_str("k:\n");
        }
        let (root, problems) = parse(&doc);
        assert!(root.is_none());
        assert_eq!(problems[0].code, "nesting-depth");
        let (root, problems) = parse(&"[".repeat(100_000));
        assert!(root.is_none());
        assert!(!problems.is_empty());
    }

    #[test]
    fn second_document_is_refused() {
        let (root, problems) = parse("a: 1\n---\nb: 2\n");
        assert!(root.is_none());
        assert_eq!(problems[0].code, "multiple-documents");
        assert_eq!(problems[0].span.line, 2);
        // A single document may start with `---`.
        assert!(parse("---\na: 1\n").1.is_empty());
    }
}
