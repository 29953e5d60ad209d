//! `notify:` — webhooks told when a run of the pipeline finishes or one of its triggers fails,
//! and the syntax of a webhook URL: its `${ENV_VAR}` references and its redacted form.
//!
//! ```yaml
//! notify:
//!   - url: https://hooks.slack.com/services/${SLACK_HOOK}
//!     on: [failed, trigger-error]
//!     format: slack
//!   - url: https://ops.example.com/shardline
//! ```
//!
//! | key | values, with defaults |
//! |---|---|
//! | `url` | `http://` or `https://` URL (required); `${NAME}` is replaced by the environment variable `NAME` of the server that delivers |
//! | `on` | any of `succeeded`, `failed`, `cancelled`, `trigger-error`; default `[failed, succeeded]` |
//! | `format` | `json` (default) or `slack` (`{"text": …}`) |
//!
//! A URL is kept as written (its `${NAME}` references unexpanded), so secrets held in the
//! environment never reach the store; a secret written into the URL itself is shown only in
//! [`redact_url`]'s form. Not part of the spec hash: notifications do not change what a run makes.

use serde::{Deserialize, Serialize};

use crate::diagnostic::Diagnostic;
use crate::suggest::{did_you_mean, list};
use crate::yaml::{Kind, Node, Resolved};

/// Keys of one entry of `notify`.
pub const NOTIFY_KEYS: &[&str] = &["url", "on", "format"];
/// The names `on` accepts.
pub const NOTIFY_EVENTS: &[&str] = &["succeeded", "failed", "cancelled", "trigger-error"];
const FORMATS: &[&str] = &["json", "slack"];
/// What `on` is when left out: cancelled runs are told only when asked.
pub const DEFAULT_EVENTS: &[NotifyEvent] = &[NotifyEvent::Failed, NotifyEvent::Succeeded];

/// An event a webhook can be told about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NotifyEvent {
    Succeeded,
    Failed,
    Cancelled,
    TriggerError,
}

impl NotifyEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            NotifyEvent::Succeeded => "succeeded",
            NotifyEvent::Failed => "failed",
            NotifyEvent::Cancelled => "cancelled",
            NotifyEvent::TriggerError => "trigger-error",
        }
    }

    pub fn parse(s: &str) -> Option<NotifyEvent> {
        [NotifyEvent::Succeeded, NotifyEvent::Failed, NotifyEvent::Cancelled, NotifyEvent::TriggerError]
            .into_iter()
            .find(|e| e.as_str() == s)
    }
}

/// How a webhook's body is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NotifyFormat {
    #[default]
    Json,
    Slack,
}

impl NotifyFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            NotifyFormat::Json => "json",
            NotifyFormat::Slack => "slack",
        }
    }

    pub fn parse(s: &str) -> Option<NotifyFormat> {
        match s {
            "json" => Some(NotifyFormat::Json),
            "slack" => Some(NotifyFormat::Slack),
            _ => None,
        }
    }
}

/// One entry of `notify`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyTarget {
    pub url: String,
    pub on: Vec<NotifyEvent>,
    pub format: NotifyFormat,
}

/// Why a webhook URL is refused (the URL itself is never in the message: it may hold a secret).
pub fn check_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| "a webhook URL starts with `https://` or `http://`".to_string())?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit('@').next().unwrap_or("");
    if host.is_empty() || host.starts_with(':') {
        return Err("the URL has no host".into());
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("a URL has no blanks or control characters".into());
    }
    if url.contains("${{") {
        return Err("`${{ … }}` is not interpolated in webhook URLs; use `${ENV_VAR}`".into());
    }
    env_refs(url).map(|_| ())
}

/// The `${NAME}` references of a URL, in order.
fn env_refs(url: &str) -> Result<Vec<(usize, usize)>, String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = url[from..].find("${") {
        let start = from + i;
        let Some(len) = url[start + 2..].find('}') else {
            return Err("`${` without its closing `}`".into());
        };
        let name = &url[start + 2..start + 2 + len];
        let ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(format!("`${{{name}}}` is not an environment variable name (letters, digits, `_`)"));
        }
        out.push((start, start + 3 + len));
        from = start + 3 + len;
    }
    Ok(out)
}

/// The URL with every `${NAME}` replaced by `lookup(NAME)`; the error names the first
/// variable that is not set.
pub fn expand_env(url: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let refs = env_refs(url)?;
    let mut out = String::with_capacity(url.len());
    let mut at = 0;
    for (start, end) in refs {
        out.push_str(&url[at..start]);
        let name = &url[start + 2..end - 1];
        out.push_str(&lookup(name).ok_or_else(|| format!("the environment variable `{name}` is not set"))?);
        at = end;
    }
    out.push_str(&url[at..]);
    Ok(out)
}

/// What a redacted part becomes.
const HIDDEN: &str = "***";

/// A webhook URL fit to show: user info hidden, query values hidden, the fragment dropped, and
/// every path segment from the first one that may be a secret on (a segment with a digit or an
/// uppercase letter, or longer than 24 characters, and everything after `services`, `hooks`
/// or `webhooks`, as Slack, Discord and most services put the secret there). `${NAME}`
/// references are kept: they name a secret, they are not one.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => return HIDDEN.to_string(),
    };
    let rest = rest.split('#').next().unwrap_or("");
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match before_query.find('/') {
        Some(i) => (&before_query[..i], &before_query[i + 1..]),
        None => (before_query, ""),
    };
    let host = match authority.rfind('@') {
        Some(at) => format!("{HIDDEN}@{}", &authority[at + 1..]),
        None => authority.to_string(),
    };
    let mut out = format!("{scheme}{host}");
    let mut hiding = false;
    for segment in path.split('/') {
        if !before_query.contains('/') {
            break;
        }
        out.push('/');
        let is_ref = segment.starts_with("${") && segment.ends_with('}') && env_refs(segment).is_ok();
        let risky = segment.len() > 24 || segment.chars().any(|c| c.is_ascii_digit() || c.is_uppercase() || c == '%');
        if is_ref {
            out.push_str(segment);
        } else if hiding || risky {
            out.push_str(HIDDEN);
            hiding = true;
        } else {
            out.push_str(segment);
        }
        if matches!(segment, "services" | "hooks" | "webhooks") {
            hiding = true;
        }
    }
    if let Some(q) = query {
        out.push('?');
        let parts: Vec<String> = q
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) if v.starts_with("${") && env_refs(v).is_ok() => format!("{k}={v}"),
                Some((k, _)) => format!("{k}={HIDDEN}"),
                None => HIDDEN.to_string(),
            })
            .collect();
        out.push_str(&parts.join("&"));
    }
    out
}

/// Lints `notify`; returns the entries that are valid.
pub(crate) fn lint_notify(file: &str, node: &Node, diags: &mut Vec<Diagnostic>) -> Vec<NotifyTarget> {
    if node.is_null() {
        return Vec::new();
    }
    let Kind::Seq(items) = &node.kind else {
        diags.push(
            Diagnostic::at(
                file,
                node.span,
                "notify",
                "wrong-type",
                format!("`notify`: expected a list, found {}", node.describe()),
            )
            .with_hint("e.g. `notify: [{url: \"https://hooks.example.com/${HOOK}\", on: [failed]}]`"),
        );
        return Vec::new();
    };
    items.iter().enumerate().filter_map(|(i, item)| one(file, i, item, diags)).collect()
}

fn one(file: &str, index: usize, node: &Node, diags: &mut Vec<Diagnostic>) -> Option<NotifyTarget> {
    let base = format!("notify[{index}]");
    let Some(entries) = node.as_map() else {
        diags.push(
            Diagnostic::at(
                file,
                node.span,
                &base,
                "wrong-type",
                format!("notify: expected a mapping with `url`, found {}", node.describe()),
            )
            .with_hint("e.g. `- {url: \"https://hooks.example.com/${HOOK}\", on: [failed, succeeded]}`"),
        );
        return None;
    };
    for e in entries.iter().filter(|e| !NOTIFY_KEYS.contains(&e.key.as_str())) {
        let hint = did_you_mean(&e.key, NOTIFY_KEYS.iter().copied()).map(|s| format!("did you mean `{s}`?"));
        diags.push(
            Diagnostic::at(
                file,
                e.key_span,
                &format!("{base}.{}", e.key),
                "unknown-key",
                format!("unknown notify key `{}`", e.key),
            )
            .with_note(format!("known keys: {}", list(NOTIFY_KEYS)))
            .with_opt_hint(hint),
        );
    }
    let get = |k: &str| entries.iter().find(|e| e.key == k);
    let url = match get("url") {
        None => {
            diags.push(
                Diagnostic::at(file, node.span, &format!("{base}.url"), "missing-key", "missing `url`".into())
                    .with_hint("add `url: https://…`"),
            );
            None
        }
        Some(e) => {
            let path = format!("{base}.url");
            string(file, &e.value, &path, diags).and_then(|u| match check_url(&u) {
                Ok(()) => Some(u),
                Err(why) => {
                    diags.push(
                        Diagnostic::at(file, e.value.span, &path, "invalid-url", format!("invalid webhook URL: {why}"))
                            .with_hint("e.g. `url: https://hooks.slack.com/services/${SLACK_HOOK}`"),
                    );
                    None
                }
            })
        }
    };
    let on = match get("on") {
        None => Some(DEFAULT_EVENTS.to_vec()),
        Some(e) => events(file, &e.value, &format!("{base}.on"), diags),
    };
    let format = match get("format") {
        None => Some(NotifyFormat::Json),
        Some(e) => {
            let path = format!("{base}.format");
            string(file, &e.value, &path, diags).and_then(|f| {
                NotifyFormat::parse(&f).or_else(|| {
                    let hint = did_you_mean(&f, FORMATS.iter().copied()).map(|s| format!("did you mean `{s}`?"));
                    diags.push(
                        Diagnostic::at(
                            file,
                            e.value.span,
                            &path,
                            "unknown-format",
                            format!("unknown notify format `{f}`"),
                        )
                        .with_note(format!("known formats: {}", list(FORMATS)))
                        .with_opt_hint(hint),
                    );
                    None
                })
            })
        }
    };
    Some(NotifyTarget { url: url?, on: on?, format: format? })
}

fn events(file: &str, node: &Node, path: &str, diags: &mut Vec<Diagnostic>) -> Option<Vec<NotifyEvent>> {
    let Kind::Seq(items) = &node.kind else {
        diags.push(
            Diagnostic::at(
                file,
                node.span,
                path,
                "wrong-type",
                format!("`on`: expected a list, found {}", node.describe()),
            )
            .with_hint("e.g. `on: [failed, succeeded]`"),
        );
        return None;
    };
    if items.is_empty() {
        diags.push(Diagnostic::at(file, node.span, path, "empty-list", "`on` names no event".into()).with_hint(
            format!("name one or more of {}, or leave `on` out for failed and succeeded", list(NOTIFY_EVENTS)),
        ));
        return None;
    }
    let mut out = Vec::new();
    let mut ok = true;
    for (i, item) in items.iter().enumerate() {
        let item_path = format!("{path}[{i}]");
        let Some(name) = string(file, item, &item_path, diags) else {
            ok = false;
            continue;
        };
        match NotifyEvent::parse(&name) {
            Some(e) if !out.contains(&e) => out.push(e),
            Some(_) => {}
            None => {
                ok = false;
                let hint = did_you_mean(&name, NOTIFY_EVENTS.iter().copied()).map(|s| format!("did you mean `{s}`?"));
                diags.push(
                    Diagnostic::at(
                        file,
                        item.span,
                        &item_path,
                        "unknown-event",
                        format!("unknown notify event `{name}`"),
                    )
                    .with_note(format!("known events: {}", list(NOTIFY_EVENTS)))
                    .with_opt_hint(hint),
                );
            }
        }
    }
    ok.then_some(out)
}

fn string(file: &str, node: &Node, path: &str, diags: &mut Vec<Diagnostic>) -> Option<String> {
    let key = path.rsplit('.').next().unwrap_or(path);
    let found = match &node.kind {
        Kind::Scalar(s) => match s.resolve() {
            Resolved::Str(v) => return Some(v.to_string()),
            other => crate::yaml::describe_scalar(&other),
        },
        _ => node.describe(),
    };
    diags.push(Diagnostic::at(file, node.span, path, "wrong-type", format!("`{key}`: expected string, found {found}")));
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("https://hooks.slack.com/services/T000/B000/XXXXsecret"),
            "https://hooks.slack.com/services/***/***/***"
        );
        assert_eq!(
            redact_url("https://hooks.slack.com/services/${SLACK}"),
            "https://hooks.slack.com/services/${SLACK}"
        );
        assert_eq!(
            redact_url("http://user:pw@127.0.0.1:9000/hook?token=abc&x=1#frag"),
            "http://***@127.0.0.1:9000/hook?token=***&x=***"
        );
        assert_eq!(
            redact_url("https://ops.example.com/api/notify/a1b2c3/more"),
            "https://ops.example.com/api/notify/***/***"
        );
        assert_eq!(redact_url("https://ops.example.com"), "https://ops.example.com");
        assert_eq!(redact_url("not a url with secret"), "***");
    }

    #[test]
    fn env_references_expand() {
        let env = |n: &str| (n == "HOOK").then(|| "T1/B2/s3".to_string());
        assert_eq!(expand_env("https://h/services/${HOOK}", env).as_deref(), Ok("https://h/services/T1/B2/s3"));
        assert!(expand_env("https://h/${MISSING}", env).is_err_and(|e| e.contains("MISSING")));
        assert!(check_url("https://h/${bad-name}").is_err());
        assert!(check_url("ftp://h/x").is_err());
        assert!(check_url("https:///x").is_err());
        assert!(check_url("https://h/${{ params.x }}").is_err());
        assert!(check_url("http://127.0.0.1:8080/hook?k=${KEY}").is_ok());
    }
}
