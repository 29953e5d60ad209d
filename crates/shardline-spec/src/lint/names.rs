//! What pipeline names and step ids may be, and a suggestion for one that is not.

pub(super) fn is_pipeline_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 100 && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

pub(super) fn is_step_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 100
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}

/// A suggestion for a name: lowercase, other characters replaced by `sep`.
pub(super) fn normalise_name(s: &str, sep: char) -> String {
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
