//! Secrets never leave the server: values of fields named like secrets (`hf_token`, `api_key`,
//! `password`, `aws_secret_access_key`, `credentials`, …) and strings that look like access
//! tokens are replaced before params, specs, payloads and outputs are returned.

use serde_json::Value;

/// What a redacted value becomes.
pub const REDACTED: &str = "[redacted]";

const SECRET_WORDS: &[&str] = &[
    "token",
    "tokens",
    "secret",
    "secrets",
    "password",
    "passwd",
    "passphrase",
    "key",
    "keys",
    "apikey",
    "credential",
    "credentials",
    "auth",
    "authorization",
];

/// Keys that name a secret. Words are split at `_`, `-`, `.`, spaces and camelCase humps, so
/// `hf_token`, `HF_TOKEN`, `secretAccessKey` and `api-key` match while `tokenizer` does not.
pub fn is_secret_key(key: &str) -> bool {
    let mut words: Vec<String> = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for ch in key.chars() {
        if ch == '_' || ch == '-' || ch == '.' || ch == ' ' {
            if !cur.is_empty() {
                words.push(std::mem::take(&mut cur));
            }
            prev_lower = false;
            continue;
        }
        if ch.is_uppercase() && prev_lower && !cur.is_empty() {
            words.push(std::mem::take(&mut cur));
        }
        prev_lower = ch.is_lowercase() || ch.is_ascii_digit();
        cur.extend(ch.to_lowercase());
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    words.iter().any(|w| SECRET_WORDS.contains(&w.as_str()))
}

/// Strings that look like access tokens whatever their field: Hugging Face (`hf_…`), this
/// API's (`shl_…`), GitHub (`ghp_…`), AWS access key ids (`AKIA…`).
pub fn looks_like_token(s: &str) -> bool {
    let t = s.trim();
    let body_ok = |rest: &str, min: usize| rest.len() >= min && rest.chars().all(|c| c.is_ascii_alphanumeric());
    for (prefix, min) in [("hf_", 30), ("shl_", 32), ("ghp_", 30), ("github_pat_", 30)] {
        if let Some(rest) = t.strip_prefix(prefix) {
            if body_ok(&rest.replace('_', ""), min) {
                return true;
            }
        }
    }
    t.len() == 20 && t.starts_with("AKIA") && t.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
}

/// `value` with secrets replaced.
pub fn redact(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = if is_secret_key(k) && !matches!(v, Value::Null) && !is_container(v) {
                        Value::String(REDACTED.into())
                    } else if is_secret_key(k) && is_container(v) {
                        redact_all(v)
                    } else {
                        redact(v)
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(redact).collect()),
        Value::String(s) if looks_like_token(s) => Value::String(REDACTED.into()),
        other => other.clone(),
    }
}

fn is_container(v: &Value) -> bool {
    matches!(v, Value::Object(_) | Value::Array(_))
}

/// Every scalar under a secret-named key (e.g. `credentials: {user, pass}`).
fn redact_all(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), redact_all(v))).collect()),
        Value::Array(items) => Value::Array(items.iter().map(redact_all).collect()),
        Value::Null => Value::Null,
        _ => Value::String(REDACTED.into()),
    }
}

/// A log line with anything that looks like an access token replaced (tasks may print them).
pub fn redact_line(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if looks_like_token(word) {
            out.push_str(REDACTED);
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for ch in line.chars() {
        if ch.is_ascii_alphanumeric() || ch == '_' {
            word.push(ch);
        } else {
            flush(&mut word, &mut out);
            out.push(ch);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// YAML text (a submitted spec) with secrets replaced: token-like words anywhere, and the
/// scalar after a secret-named key (`hf_token: …`, `{api_key: …}`) up to the end of the line or
/// the next `,` / `}` of a flow mapping. Secret-named keys that open a block (`credentials:` with
/// nothing after it) have every scalar of their deeper-indented lines replaced.
pub fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    // Indentation of a secret-named block key whose nested lines are being redacted.
    let mut secret_block: Option<usize> = None;
    for line in text.split_inclusive('\n') {
        let body = line.trim_end_matches(['\n', '\r']);
        let ending = &line[body.len()..];
        let indent = body.len() - body.trim_start().len();
        if let Some(level) = secret_block {
            if body.trim().is_empty() || indent > level {
                out.push_str(&redact_values_after_keys(body, true));
                out.push_str(ending);
                continue;
            }
            secret_block = None;
        }
        let trimmed = body.trim_start().trim_start_matches("- ");
        if let Some(key) = trimmed.strip_suffix(':') {
            if is_secret_key(key.trim().trim_matches(['"', '\''])) {
                secret_block = Some(indent);
            }
        }
        out.push_str(&redact_values_after_keys(body, false));
        out.push_str(ending);
    }
    out
}

/// Replaces the values of secret-named keys on one line (every value when `all`). A secret key
/// whose value is a flow mapping has every value of that mapping replaced.
fn redact_values_after_keys(line: &str, all: bool) -> String {
    let line = redact_line(line);
    if line.trim_start().starts_with('#') {
        return line;
    }
    let chars: Vec<char> = line.chars().collect();
    let mut out: Vec<char> = Vec::with_capacity(chars.len());
    // Depth of `{` at which every value is secret (a secret key's flow mapping).
    let mut all_from: Option<usize> = if all { Some(0) } else { None };
    let mut depth = 0usize;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '#' && (i == 0 || chars[i - 1] == ' ') {
            out.extend(&chars[i..]);
            break;
        }
        if c == '{' {
            depth += 1;
        } else if c == '}' {
            depth = depth.saturating_sub(1);
            if all_from.is_some_and(|d| depth < d) {
                all_from = None;
            }
        }
        out.push(c);
        i += 1;
        if c != ':' || !(i == chars.len() || chars[i] == ' ') {
            continue;
        }
        let mut start = out.len() - 1;
        while start > 0 && (out[start - 1].is_alphanumeric() || "_-.\"'".contains(out[start - 1])) {
            start -= 1;
        }
        let key: String = out[start..out.len() - 1].iter().collect();
        let secret = all_from.is_some() || is_secret_key(key.trim_matches(['"', '\'']));
        if !secret {
            continue;
        }
        while i < chars.len() && chars[i] == ' ' {
            out.push(' ');
            i += 1;
        }
        if chars.get(i) == Some(&'{') {
            if all_from.is_none() {
                all_from = Some(depth + 1);
            }
            continue;
        }
        let mut end = i;
        while end < chars.len() && !matches!(chars[end], ',' | '}') && !(chars[end] == '#' && chars[end - 1] == ' ') {
            end += 1;
        }
        let value: String = chars[i..end].iter().collect();
        if !value.trim().is_empty() {
            out.extend(REDACTED.chars());
            if value.ends_with(' ') {
                out.push(' ');
            }
            i = end;
        }
    }
    out.into_iter().collect()
}

/// An optional value with secrets replaced.
pub fn redact_opt(value: &Option<Value>) -> Option<Value> {
    value.as_ref().map(redact)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn secret_keys() {
        for k in [
            "hf_token",
            "HF_TOKEN",
            "token",
            "api_key",
            "secretAccessKey",
            "password",
            "credentials",
            "aws-secret-access-key",
        ] {
            assert!(is_secret_key(k), "{k}");
        }
        for k in ["tokenizer", "repo", "revision", "monkey", "keystone", "tp", "dtype"] {
            assert!(!is_secret_key(k), "{k}");
        }
    }

    #[test]
    fn log_lines() {
        assert_eq!(
            redact_line("HF_TOKEN=hf_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef; got 3 files"),
            "HF_TOKEN=[redacted]; got 3 files"
        );
        assert_eq!(redact_line("wrote shard_0 of tokenizer"), "wrote shard_0 of tokenizer");
    }

    #[test]
    fn spec_text() {
        let yaml = "name: p\nparams:\n  hf_token: {type: string, default: abc123}\nenv:\n  API_KEY: s3cr3t # set by ops\n  tokenizer: fast\ncredentials:\n  user: u\n  pass: x\nsteps:\n  - id: d\n    with: {repo: org/m, token: t0k, revision: main}\n";
        let r = redact_text(yaml);
        assert_eq!(
            r,
            "name: p\nparams:\n  hf_token: {type: [redacted], default: [redacted]}\nenv:\n  API_KEY: [redacted] # set by ops\n  tokenizer: fast\ncredentials:\n  user: [redacted]\n  pass: [redacted]\nsteps:\n  - id: d\n    with: {repo: org/m, token: [redacted], revision: main}\n"
        );
    }

    #[test]
    fn nested_values() {
        let v = json!({
            "repo": "org/model",
            "hf_token": "hf_abc",
            "with": {"Password": "p", "list": [{"api_key": 3}], "note": "hf_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef"},
            "credentials": {"user": "u", "pass": "x"},
            "tokenizer": "fast",
            "token": null
        });
        let r = redact(&v);
        assert_eq!(
            r,
            json!({
                "repo": "org/model",
                "hf_token": REDACTED,
                "with": {"Password": REDACTED, "list": [{"api_key": REDACTED}], "note": REDACTED},
                "credentials": {"user": REDACTED, "pass": REDACTED},
                "tokenizer": "fast",
                "token": null
            })
        );
    }
}
