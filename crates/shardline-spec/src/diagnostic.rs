//! Diagnostics: data first (file, line, column, key path, message, hint), rendered on demand in
//! the style of a compiler. Rendering is deterministic and never colours its output; a terminal
//! front end may add colour on top.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::yaml::Span;

/// How bad a diagnostic is. Errors make [`crate::lint`] return no pipeline; warnings do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

/// One problem in a pipeline file, at a position.
///
/// `line` and `column` are 1-based (columns count characters); both are 0 when the problem has no
/// place in the file (e.g. a `--set` override naming no param). `length` is the number of
/// characters to underline on `line`, 0 meaning "to the end of the line".
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Diagnostic {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub length: usize,
    /// Key path of the offending node, e.g. `steps[1].with.tp` (empty for the whole file).
    pub path: String,
    /// Stable, kebab-case identifier of the kind of problem, e.g. `unknown-step-kind`.
    pub code: String,
    pub message: String,
    pub hint: Option<String>,
    /// Extra context lines, rendered before the hint.
    pub notes: Vec<String>,
    pub severity: Severity,
}

impl Diagnostic {
    /// An error at `line:column` (1-based), underlining one character.
    pub fn error(
        file: impl Into<String>,
        line: usize,
        column: usize,
        path: impl Into<String>,
        code: impl Into<String>,
        message: impl Into<String>,
    ) -> Diagnostic {
        Diagnostic {
            file: file.into(),
            line,
            column,
            length: 1,
            path: path.into(),
            code: code.into(),
            message: message.into(),
            hint: None,
            notes: Vec::new(),
            severity: Severity::Error,
        }
    }

    pub(crate) fn at(file: &str, span: Span, path: &str, code: &str, message: String) -> Diagnostic {
        Diagnostic { length: span.underline_len(), ..Diagnostic::error(file, span.line, span.col, path, code, message) }
    }

    /// The same diagnostic with a hint.
    pub fn with_hint(mut self, hint: impl Into<String>) -> Diagnostic {
        self.hint = Some(hint.into());
        self
    }

    pub(crate) fn with_opt_hint(mut self, hint: Option<String>) -> Diagnostic {
        self.hint = hint;
        self
    }

    /// The same diagnostic with one more note.
    pub fn with_note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }

    /// The same diagnostic as a warning.
    pub fn warning(mut self) -> Diagnostic {
        self.severity = Severity::Warning;
        self
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// Renders the diagnostic with an excerpt of `source_text` (the text that was linted):
    ///
    /// ```text
    /// error: unknown step kind `megatron.shrad`
    ///   --> pipelines/x.yaml:12:11 (steps[1].uses)
    ///    |
    /// 12 |     uses: megatron.shrad
    ///    |           ^^^^^^^^^^^^^^
    ///    = hint: did you mean `megatron.shard`?
    /// ```
    pub fn render(&self, source_text: &str) -> String {
        self.render_line(self.line.checked_sub(1).and_then(|_| source_line(source_text, self.line)))
    }

    /// Renders with the text of line `self.line` at hand.
    fn render_line(&self, line_text: Option<&str>) -> String {
        let mut out = format!("{}: {}\n", self.severity.as_str(), self.message);
        let path = if self.path.is_empty() { String::new() } else { format!(" ({})", self.path) };
        let gutter = if line_text.is_some() { self.line.to_string().len() } else { 1 };
        let pad = " ".repeat(gutter);
        if self.line == 0 {
            out.push_str(&format!("{pad}--> {}{path}\n", self.file));
        } else {
            out.push_str(&format!("{pad}--> {}:{}:{}{path}\n", self.file, self.line, self.column));
        }
        if let Some(text) = line_text {
            let (shown, start, width) = excerpt(text, self.column, self.length);
            out.push_str(&format!("{pad} |\n"));
            out.push_str(&format!("{} | {}\n", self.line, shown).replace(" | \n", " |\n"));
            out.push_str(&format!("{pad} | {}{}\n", " ".repeat(start), "^".repeat(width)));
        }
        for note in &self.notes {
            out.push_str(&format!("{pad} = note: {note}\n"));
        }
        if let Some(hint) = &self.hint {
            out.push_str(&format!("{pad} = hint: {hint}\n"));
        }
        out
    }
}

/// Byte offset of the start of every line (lines end as in YAML).
fn line_starts(text: &str) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut starts = vec![0];
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\r' if bytes.get(i + 1) == Some(&b'\n') => {
                starts.push(i + 2);
                i += 2;
            }
            b'\r' | b'\n' => {
                starts.push(i + 1);
                i += 1;
            }
            _ => i += 1,
        }
    }
    starts
}

/// Line `n` (1-based) of `text`, where lines end as YAML ends them: `\r\n`, `\r` or `\n`.
pub(crate) fn source_line(text: &str, n: usize) -> Option<&str> {
    let mut rest = text;
    let mut line = 1;
    loop {
        let end = rest.find(['\r', '\n']);
        if line == n {
            return Some(&rest[..end.unwrap_or(rest.len())]);
        }
        let end = end?;
        let skip = if rest[end..].starts_with("\r\n") { 2 } else { 1 };
        rest = &rest[end + skip..];
        line += 1;
    }
}

/// The part of a source line to show, the caret offset in it, and the caret width. Long lines are
/// cut to a window around the column; tabs become spaces so that carets line up.
fn excerpt(line: &str, column: usize, length: usize) -> (String, usize, usize) {
    const WIDTH: usize = 100;
    const BEFORE: usize = 40;
    let chars: Vec<char> = line.chars().map(|c| if c == '\t' { ' ' } else { c }).collect();
    let col = column.saturating_sub(1).min(chars.len());
    let end = if length == 0 { chars.len().max(col + 1) } else { col + length };
    let (from, prefix) = if chars.len() > WIDTH && col > BEFORE { (col - BEFORE, "…") } else { (0, "") };
    let to = chars.len().min(from + WIDTH);
    let suffix = if to < chars.len() { "…" } else { "" };
    let shown: String = prefix.chars().chain(chars[from..to].iter().copied()).chain(suffix.chars()).collect();
    let start = col - from + prefix.chars().count();
    let visible_end = end.min(to.max(col + 1));
    let width = visible_end.saturating_sub(col).max(1);
    (shown.trim_end().to_string(), start, width)
}

impl fmt::Display for Diagnostic {
    /// One line: `file:line:column: error: message (path) (hint: …)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}: {}", self.file, self.severity.as_str(), self.message)?;
        } else {
            write!(f, "{}:{}:{}: {}: {}", self.file, self.line, self.column, self.severity.as_str(), self.message)?;
        }
        if !self.path.is_empty() {
            write!(f, " ({})", self.path)?;
        }
        if let Some(hint) = &self.hint {
            write!(f, " (hint: {hint})")?;
        }
        Ok(())
    }
}

/// Renders every diagnostic followed by a summary line, e.g. ``error: `x.yaml`: 2 errors, 1 warning``.
/// Empty when there is nothing to report.
pub fn render_all(diagnostics: &[Diagnostic], source_text: &str) -> String {
    if diagnostics.is_empty() {
        return String::new();
    }
    let lines = line_starts(source_text);
    let mut out = String::new();
    for d in diagnostics {
        let text = d.line.checked_sub(1).and_then(|i| {
            let start = *lines.get(i)?;
            let rest = &source_text[start..];
            Some(&rest[..rest.find(['\r', '\n']).unwrap_or(rest.len())])
        });
        out.push_str(&d.render_line(text));
        out.push('\n');
    }
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    let warnings = diagnostics.len() - errors;
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let file = &diagnostics[0].file;
    if errors > 0 {
        out.push_str(&format!("error: `{file}`: {}", plural(errors, "error")));
        if warnings > 0 {
            out.push_str(&format!(", {}", plural(warnings, "warning")));
        }
    } else {
        out.push_str(&format!("warning: `{file}`: {}", plural(warnings, "warning")));
    }
    out.push('\n');
    out
}

/// Most diagnostics one call reports; past it, the first ones and a count of the rest.
pub const MAX_DIAGNOSTICS: usize = 200;

/// Sorts by position (then severity and message), removes exact duplicates, and keeps at most
/// [`MAX_DIAGNOSTICS`] (then a last one says how many more there were).
pub(crate) fn sort(diagnostics: &mut Vec<Diagnostic>) {
    diagnostics.sort_by(|a, b| {
        (a.line, a.column, a.severity, &a.message, &a.path).cmp(&(b.line, b.column, b.severity, &b.message, &b.path))
    });
    diagnostics.dedup();
    if diagnostics.len() > MAX_DIAGNOSTICS {
        let more = diagnostics.len() - MAX_DIAGNOSTICS;
        let any_error = diagnostics.iter().any(Diagnostic::is_error);
        diagnostics.truncate(MAX_DIAGNOSTICS);
        let file = diagnostics[0].file.clone();
        let mut d = Diagnostic::error(
            file,
            0,
            0,
            "",
            "too-many-diagnostics",
            format!("{more} more problems not shown (only the first {MAX_DIAGNOSTICS} are reported)"),
        );
        if !any_error {
            d = d.warning();
        }
        diagnostics.push(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_end_as_in_yaml() {
        let text = "a\r\nb\rc\nd";
        let lines: Vec<Option<&str>> = (1..=5).map(|n| source_line(text, n)).collect();
        assert_eq!(lines, [Some("a"), Some("b"), Some("c"), Some("d"), None]);
        assert_eq!(source_line("x\n", 2), Some(""));
    }

    #[test]
    fn renders_like_a_compiler() {
        let src = "a\nb\nc\nd\ne\nf\ng\nh\ni\nj\nk\n    uses: megatron.shrad\n";
        let d = Diagnostic {
            length: 14,
            ..Diagnostic::error(
                "pipelines/x.yaml",
                12,
                11,
                "steps[1].uses",
                "unknown-step-kind",
                "unknown step kind `megatron.shrad`",
            )
        }
        .with_hint("did you mean `megatron.shard`?");
        assert_eq!(
            d.render(src),
            "error: unknown step kind `megatron.shrad`\n  --> pipelines/x.yaml:12:11 (steps[1].uses)\n   |\n12 |     uses: megatron.shrad\n   |           ^^^^^^^^^^^^^^\n   = hint: did you mean `megatron.shard`?\n"
        );
        assert_eq!(
            d.to_string(),
            "pipelines/x.yaml:12:11: error: unknown step kind `megatron.shrad` (steps[1].uses) (hint: did you mean `megatron.shard`?)"
        );
    }

    #[test]
    fn long_lines_are_windowed_and_positions_past_the_end_are_safe() {
        let line = format!("{}XYZ{}", "a".repeat(300), "b".repeat(300));
        let d = Diagnostic { length: 3, ..Diagnostic::error("f", 1, 301, "", "c", "m") };
        let out = d.render(&line);
        let lines: Vec<&str> = out.lines().collect();
        let caret = lines[4].chars().position(|c| c == '^').unwrap();
        let shown: String = lines[3].chars().skip(caret).take(3).collect();
        assert_eq!(shown, "XYZ");
        assert!(lines[3].chars().count() < 120);
        let d = Diagnostic::error("f", 9, 99, "", "c", "m");
        assert!(d.render("short").contains("--> f:9:99"));
        let d = Diagnostic::error("f", 1, 99, "", "c", "m");
        assert!(d.render("short").contains('^'));
    }
}
