//! Interpolations: `${{ params.NAME }}` and `${{ run.id }}` inside string values.

use serde::{Deserialize, Serialize};

/// A piece of an interpolated string.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    Text(String),
    /// `${{ params.NAME }}`
    Param(String),
    /// `${{ run.id }}`
    RunId,
}

/// A string value containing at least one interpolation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Template {
    pub parts: Vec<Part>,
}

/// A malformed interpolation, with its text (as written, `${{` to `}}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TemplateError {
    Unterminated { text: String },
    Expression { text: String, expr: String },
}

impl Template {
    /// The single interpolation when it is the whole value (surrounding blanks aside).
    pub fn whole(&self) -> Option<&Part> {
        let mut exprs = self.parts.iter().filter(|p| !matches!(p, Part::Text(_)));
        let first = exprs.next()?;
        let only_blank_text = self.parts.iter().all(|p| match p {
            Part::Text(t) => t.trim().is_empty(),
            _ => true,
        });
        (exprs.next().is_none() && only_blank_text).then_some(first)
    }

    /// The names of the params it refers to, in order.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Param(n) => Some(n.as_str()),
            _ => None,
        })
    }

    /// The template as it would be written.
    pub fn source(&self) -> String {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.clone(),
                Part::Param(n) => format!("${{{{ params.{n} }}}}"),
                Part::RunId => "${{ run.id }}".to_string(),
            })
            .collect()
    }
}

/// Whether the text contains an interpolation opener at all.
pub(crate) fn has_interpolation(s: &str) -> bool {
    s.contains("${{")
}

/// Parses the interpolations of `s`. `Ok(None)` when there are none.
pub(crate) fn parse(s: &str) -> Result<Option<Template>, Vec<TemplateError>> {
    if !has_interpolation(s) {
        return Ok(None);
    }
    let mut parts = Vec::new();
    let mut errors = Vec::new();
    let mut rest = s;
    while let Some(open) = rest.find("${{") {
        if open > 0 {
            parts.push(Part::Text(rest[..open].to_string()));
        }
        let after = &rest[open + 3..];
        let Some(close) = after.find("}}") else {
            errors.push(TemplateError::Unterminated { text: rest[open..].to_string() });
            rest = "";
            break;
        };
        let expr = after[..close].trim();
        let text = rest[open..open + 3 + close + 2].to_string();
        match expr.split_once('.') {
            Some(("params", name)) if is_param_name(name) => parts.push(Part::Param(name.to_string())),
            _ if expr == "run.id" => parts.push(Part::RunId),
            _ => errors.push(TemplateError::Expression { text, expr: expr.to_string() }),
        }
        rest = &after[close + 2..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_string()));
    }
    if errors.is_empty() {
        Ok(Some(Template { parts }))
    } else {
        Err(errors)
    }
}

/// Param names: a lowercase letter, then lowercase letters, digits and `_`.
pub(crate) fn is_param_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_parts() {
        assert_eq!(parse("plain"), Ok(None));
        let t = parse("file:///out/${{ run.id }}/${{params.fmt}}").unwrap().unwrap();
        assert_eq!(
            t.parts,
            vec![Part::Text("file:///out/".into()), Part::RunId, Part::Text("/".into()), Part::Param("fmt".into())]
        );
        assert_eq!(t.whole(), None);
        assert_eq!(t.source(), "file:///out/${{ run.id }}/${{ params.fmt }}");
        let t = parse(" ${{ params.tp }} ").unwrap().unwrap();
        assert_eq!(t.whole(), Some(&Part::Param("tp".into())));
    }

    #[test]
    fn reports_bad_expressions() {
        assert_eq!(
            parse("${{ param.tp }} and ${{ params.ok }} ${{ env.HOME"),
            Err(vec![
                TemplateError::Expression { text: "${{ param.tp }}".into(), expr: "param.tp".into() },
                TemplateError::Unterminated { text: "${{ env.HOME".into() },
            ])
        );
        assert!(parse("${{ params.Bad }}").is_err());
        assert!(parse("${{ }}").is_err());
    }
}
