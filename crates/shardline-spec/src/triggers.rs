//! `triggers:` — what starts runs of a pipeline without a `submit`: a cron `schedule` in a
//! named time zone, or a `watch` on Hub repositories (one repo, or an author's repos whose name
//! matches a glob) at a revision.
//!
//! ```yaml
//! triggers:
//!   - schedule: {cron: "0 2 * * *", timezone: Europe/Paris, missed: run-once}
//!   - watch: {repo: Qwen/Qwen3-0.6B, revision: main, every: 10m}
//!     params: {repo: "${{ trigger.repo }}", revision: "${{ trigger.sha }}"}
//!   - watch: {author: Qwen, name: "Qwen3-*", every: 30m}
//! ```
//!
//! | key | fields, with defaults |
//! |---|---|
//! | `schedule` | `cron` (required, five fields or `@daily`-style nicknames), `timezone` = `UTC` (an IANA name), `missed` = `run-once` \| `skip` |
//! | `watch` | `repo` (`org/name`) **or** `author` with `name` = `*` (a glob on the model name), `revision` = `main`, `every` = `10m` (at least `1m`) |
//! | `params` | param name → value, given to the triggered run as `--set NAME=VALUE` |
//!
//! `params` values may interpolate `${{ trigger.repo }}`, `${{ trigger.sha }}` and
//! `${{ trigger.revision }}` (watch triggers: the repository, the new commit and the revision
//! watched) and `${{ trigger.time }}` (the scheduled instant, or the time the commit was seen,
//! RFC 3339 UTC). A trigger sets nothing else: the spec decides what the run does with them.
//!
//! `missed` says what a schedule does with firings that passed while no server ran:
//! `run-once` (the default) starts one run for the latest missed instant, `skip` starts none
//! and waits for the next instant. A firing up to [`ON_TIME_GRACE`] late is on time, not missed.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::diagnostic::Diagnostic;
use crate::model::ParamSpec;
use crate::suggest::{did_you_mean, list};
use crate::yaml::{quote, Entry, Kind, Node, Resolved, Span};
use shardline_units::{format_duration, parse_duration};

/// Keys of one entry of `triggers`.
pub(crate) const TRIGGER_KEYS: &[&str] = &["schedule", "watch", "params"];
const SCHEDULE_KEYS: &[&str] = &["cron", "timezone", "missed"];
const WATCH_KEYS: &[&str] = &["repo", "author", "name", "revision", "every"];
const MISSED_NAMES: &[&str] = &["run-once", "skip"];
/// What `params` values of a trigger may interpolate.
pub const TRIGGER_VARS: &[&str] = &["repo", "sha", "revision", "time"];
/// The shortest `every` of a watch: polling the Hub more often is impolite.
pub const MIN_WATCH_INTERVAL: Duration = Duration::from_secs(60);
/// The default `every` of a watch.
pub const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_secs(600);
/// A scheduled instant fired at most this late counts as on time, whatever `missed` says.
pub const ON_TIME_GRACE: Duration = Duration::from_secs(300);

/// What a schedule does with instants that passed while no server ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MissedPolicy {
    /// One run for the latest missed instant (the default).
    #[default]
    RunOnce,
    /// No run; the next instant fires as usual.
    Skip,
}

impl MissedPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            MissedPolicy::RunOnce => "run-once",
            MissedPolicy::Skip => "skip",
        }
    }
}

impl FromStr for MissedPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<MissedPolicy, String> {
        match s {
            "run-once" => Ok(MissedPolicy::RunOnce),
            "skip" => Ok(MissedPolicy::Skip),
            _ => Err(format!("unknown missed-run policy `{s}` (known: {})", list(MISSED_NAMES))),
        }
    }
}

/// A cron schedule in a time zone.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Schedule {
    pub cron: String,
    /// An IANA zone name (`Europe/Paris`), `UTC` by default.
    pub timezone: String,
    pub missed: MissedPolicy,
}

/// Which Hub repositories a watch follows.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchTarget {
    /// One repository, `org/name`.
    Repo(String),
    /// The author's models whose name (the part after `author/`) matches the glob `name`.
    Author { author: String, name: String },
}

/// A watch on Hub repositories at a revision.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Watch {
    pub target: WatchTarget,
    pub revision: String,
    /// Seconds between two polls.
    pub every_secs: u64,
}

impl Watch {
    pub fn every(&self) -> Duration {
        Duration::from_secs(self.every_secs)
    }
}

/// The kind of a trigger and its settings.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerKind {
    Schedule(Schedule),
    Watch(Watch),
}

/// One entry of `triggers`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Trigger {
    /// Index in the file's `triggers` list.
    pub index: usize,
    pub kind: TriggerKind,
    /// Param name → value template (may hold `${{ trigger.* }}`).
    pub params: BTreeMap<String, String>,
}

/// What a firing knows, for `${{ trigger.* }}`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TriggerContext {
    pub repo: Option<String>,
    pub sha: Option<String>,
    pub revision: Option<String>,
    /// RFC 3339, UTC.
    pub time: String,
}

impl Trigger {
    /// `schedule` or `watch`.
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            TriggerKind::Schedule(_) => "schedule",
            TriggerKind::Watch(_) => "watch",
        }
    }

    /// The `--set` overrides a firing gives its run: `params` with `${{ trigger.* }}` replaced.
    /// A variable the context does not have becomes the empty string (lint refuses `repo`,
    /// `sha` and `revision` in schedules, so that does not happen with a linted spec).
    pub fn overrides(&self, ctx: &TriggerContext) -> Vec<(String, String)> {
        self.params
            .iter()
            .map(|(k, v)| {
                let rendered = substitute(v, |var| match var {
                    "repo" => ctx.repo.clone().unwrap_or_default(),
                    "sha" => ctx.sha.clone().unwrap_or_default(),
                    "revision" => ctx.revision.clone().unwrap_or_default(),
                    "time" => ctx.time.clone(),
                    _ => String::new(),
                });
                (k.clone(), rendered)
            })
            .collect()
    }
}

impl fmt::Display for Trigger {
    /// `cron "0 2 * * *" Europe/Paris, missed: run-once` or `Qwen/Qwen3-0.6B@main every 10m`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            TriggerKind::Schedule(s) => {
                write!(f, "cron {:?} {}, missed: {}", s.cron, s.timezone, s.missed.as_str())
            }
            TriggerKind::Watch(w) => {
                match &w.target {
                    WatchTarget::Repo(r) => write!(f, "{r}")?,
                    WatchTarget::Author { author, name } => write!(f, "{author}/{name}")?,
                }
                write!(f, "@{} every {}", w.revision, format_duration(w.every()))
            }
        }
    }
}

/// Parses a cron expression as schedules use it: five fields (minute hour day-of-month month
/// day-of-week) or a nickname (`@daily`, `@hourly`, …). One that matches no date (`0 0 31 2 *`)
/// is refused.
pub fn parse_cron(expr: &str) -> Result<croner::Cron, String> {
    let cron = croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Disallowed)
        .year(croner::parser::Year::Disallowed)
        .build()
        .parse(expr)
        .map_err(|e| e.to_string())?;
    // Any date that exists matches within 8 years (February 29 included).
    let start = chrono::NaiveDate::from_ymd_opt(2001, 1, 1).and_then(|d| d.and_hms_opt(0, 0, 0));
    let end = chrono::NaiveDate::from_ymd_opt(2009, 1, 1).and_then(|d| d.and_hms_opt(0, 0, 0));
    if let (Some(start), Some(end)) = (start, end) {
        match cron.find_next_occurrence(&start, false) {
            Ok(t) if t < end => {}
            _ => return Err("it matches no date (check day-of-month against month)".to_string()),
        }
    }
    Ok(cron)
}

/// Parses an IANA time zone name.
pub fn parse_timezone(name: &str) -> Result<chrono_tz::Tz, String> {
    chrono_tz::Tz::from_str(name).map_err(|e| e.to_string())
}

/// `org/name` of letters, digits, `-`, `_` and `.`.
fn is_repo_id(s: &str) -> bool {
    match s.split_once('/') {
        Some((a, n)) => is_name_part(a) && is_name_part(n),
        None => false,
    }
}

fn is_name_part(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && s != "."
        && s != ".."
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Replaces each `${{ trigger.VAR }}` with `value(VAR)`; other text is kept as written.
fn substitute(text: &str, value: impl Fn(&str) -> String) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 3..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        let expr = after[..end].trim();
        match expr.strip_prefix("trigger.") {
            Some(var) => out.push_str(&value(var)),
            None => out.push_str(&rest[start..start + 3 + end + 2]),
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Every `${{ … }}` expression of a text, trimmed; `Err` on an unclosed one.
fn references(text: &str) -> Result<Vec<&str>, ()> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("${{") {
        let after = &rest[start + 3..];
        let end = after.find("}}").ok_or(())?;
        out.push(after[..end].trim());
        rest = &after[end + 2..];
    }
    Ok(out)
}

/// Lints `triggers`; returns the triggers that are valid.
pub(crate) fn lint_triggers(
    file: &str,
    node: &Node,
    params: &[ParamSpec],
    diags: &mut Vec<Diagnostic>,
) -> Vec<Trigger> {
    let mut l = TriggerLint { file, diags, params };
    l.all(node)
}

struct TriggerLint<'a, 'd> {
    file: &'a str,
    diags: &'d mut Vec<Diagnostic>,
    params: &'a [ParamSpec],
}

impl TriggerLint<'_, '_> {
    fn at(&mut self, span: Span, path: &str, code: &str, message: String, hint: Option<String>) {
        self.diags.push(Diagnostic::at(self.file, span, path, code, message).with_opt_hint(hint));
    }

    fn all(&mut self, node: &Node) -> Vec<Trigger> {
        if node.is_null() {
            return Vec::new();
        }
        let Kind::Seq(items) = &node.kind else {
            let message = format!("`triggers`: expected a list, found {}", node.describe());
            self.at(
                node.span,
                "triggers",
                "wrong-type",
                message,
                Some("e.g. `triggers: [{schedule: {cron: \"0 2 * * *\", timezone: Europe/Paris}}]`".into()),
            );
            return Vec::new();
        };
        items.iter().enumerate().filter_map(|(i, item)| self.one(i, item)).collect()
    }

    fn unknown_keys(&mut self, entries: &[Entry], base: &str, known: &[&str], what: &str) {
        for e in entries {
            if known.contains(&e.key.as_str()) {
                continue;
            }
            let path = format!("{base}.{}", e.key);
            let hint = did_you_mean(&e.key, known.iter().copied()).map(|s| format!("did you mean `{s}`?"));
            self.diags.push(
                Diagnostic::at(self.file, e.key_span, &path, "unknown-key", format!("unknown {what} `{}`", e.key))
                    .with_note(format!("known keys: {}", list(known)))
                    .with_opt_hint(hint),
            );
        }
    }

    fn one(&mut self, index: usize, node: &Node) -> Option<Trigger> {
        let base = format!("triggers[{index}]");
        let Some(entries) = node.as_map() else {
            let message = format!("trigger: expected a mapping with `schedule` or `watch`, found {}", node.describe());
            self.at(
                node.span,
                &base,
                "wrong-type",
                message,
                Some("e.g. `- watch: {repo: Qwen/Qwen3-0.6B, every: 10m}`".into()),
            );
            return None;
        };
        self.unknown_keys(entries, &base, TRIGGER_KEYS, "trigger key");
        let get = |k: &str| entries.iter().find(|e| e.key == k);
        let kind = match (get("schedule"), get("watch")) {
            (Some(s), None) => self.schedule(&s.value, &format!("{base}.schedule")).map(TriggerKind::Schedule),
            (None, Some(w)) => self.watch(&w.value, &format!("{base}.watch")).map(TriggerKind::Watch),
            (Some(_), Some(w)) => {
                self.at(
                    w.key_span,
                    &format!("{base}.watch"),
                    "conflicting-keys",
                    "a trigger is either a `schedule` or a `watch`, not both".into(),
                    Some("write them as two entries of `triggers`".into()),
                );
                None
            }
            (None, None) => {
                self.at(
                    node.span,
                    &base,
                    "missing-key",
                    "missing `schedule` or `watch`".into(),
                    Some("add `schedule: {cron: \"0 2 * * *\"}` or `watch: {repo: org/name}`".into()),
                );
                None
            }
        };
        let is_watch = matches!(kind, Some(TriggerKind::Watch(_))) || get("watch").is_some();
        let params = match get("params") {
            Some(p) => self.params(&p.value, &format!("{base}.params"), is_watch),
            None => Some(BTreeMap::new()),
        };
        Some(Trigger { index, kind: kind?, params: params? })
    }

    /// A string scalar; reports and returns `None` otherwise.
    fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match &node.kind {
            Kind::Scalar(s) => match s.resolve() {
                Resolved::Str(v) => Some(v.to_string()),
                other => {
                    let key = path.rsplit('.').next().unwrap_or(path);
                    let message = format!("`{key}`: expected string, found {}", crate::yaml::describe_scalar(&other));
                    self.at(node.span, path, "wrong-type", message, None);
                    None
                }
            },
            _ => {
                let key = path.rsplit('.').next().unwrap_or(path);
                let message = format!("`{key}`: expected string, found {}", node.describe());
                self.at(node.span, path, "wrong-type", message, None);
                None
            }
        }
    }

    fn mapping<'n>(&mut self, node: &'n Node, path: &str, example: &str) -> Option<&'n [Entry]> {
        match node.as_map() {
            Some(m) => Some(m),
            None => {
                let key = path.rsplit('.').next().unwrap_or(path);
                let message = format!("`{key}`: expected a mapping, found {}", node.describe());
                self.at(node.span, path, "wrong-type", message, Some(format!("e.g. `{key}: {example}`")));
                None
            }
        }
    }

    fn schedule(&mut self, node: &Node, path: &str) -> Option<Schedule> {
        let entries = self.mapping(node, path, "{cron: \"0 2 * * *\", timezone: Europe/Paris}")?;
        self.unknown_keys(entries, path, SCHEDULE_KEYS, "schedule key");
        let get = |k: &str| entries.iter().find(|e| e.key == k);
        let mut ok = true;
        let cron = match get("cron") {
            None => {
                self.at(
                    node.span,
                    &format!("{path}.cron"),
                    "missing-key",
                    "missing `cron`".into(),
                    Some("add `cron: \"0 2 * * *\"` (minute hour day-of-month month day-of-week)".into()),
                );
                None
            }
            Some(e) => {
                let p = format!("{path}.cron");
                self.string(&e.value, &p).and_then(|c| match parse_cron(&c) {
                    Ok(_) => Some(c),
                    Err(err) => {
                        self.at(
                            e.value.span,
                            &p,
                            "invalid-cron",
                            format!("invalid cron expression {}: {err}", quote(&c)),
                            Some(
                                "five fields: minute hour day-of-month month day-of-week, e.g. `0 2 * * *` \
                                 (02:00 every day), or `@daily`, `@hourly`"
                                    .into(),
                            ),
                        );
                        None
                    }
                })
            }
        };
        let timezone = match get("timezone") {
            None => Some("UTC".to_string()),
            Some(e) => {
                let p = format!("{path}.timezone");
                self.string(&e.value, &p).and_then(|z| match parse_timezone(&z) {
                    Ok(_) => Some(z),
                    Err(_) => {
                        let names = chrono_tz::TZ_VARIANTS.iter().map(|t| t.name());
                        let hint = match did_you_mean(&z, names) {
                            Some(s) => format!("did you mean `{s}`?"),
                            None => "an IANA time zone name, e.g. `Europe/Paris`, `America/New_York`, `UTC`".into(),
                        };
                        self.at(
                            e.value.span,
                            &p,
                            "unknown-timezone",
                            format!("unknown time zone {}", quote(&z)),
                            Some(hint),
                        );
                        None
                    }
                })
            }
        };
        let missed = match get("missed") {
            None => Some(MissedPolicy::default()),
            Some(e) => {
                let p = format!("{path}.missed");
                self.string(&e.value, &p).and_then(|m| match m.parse::<MissedPolicy>() {
                    Ok(v) => Some(v),
                    Err(msg) => {
                        let hint = did_you_mean(&m, MISSED_NAMES.iter().copied())
                            .map(|s| format!("did you mean `{s}`?"))
                            .unwrap_or_else(|| {
                                "`run-once` starts one run for the latest missed instant, `skip` starts none".into()
                            });
                        self.at(e.value.span, &p, "invalid-value", msg, Some(hint));
                        None
                    }
                })
            }
        };
        ok &= cron.is_some() && timezone.is_some() && missed.is_some();
        if !ok {
            return None;
        }
        Some(Schedule { cron: cron?, timezone: timezone?, missed: missed? })
    }

    fn watch(&mut self, node: &Node, path: &str) -> Option<Watch> {
        let entries = self.mapping(node, path, "{repo: Qwen/Qwen3-0.6B, every: 10m}")?;
        self.unknown_keys(entries, path, WATCH_KEYS, "watch key");
        let get = |k: &str| entries.iter().find(|e| e.key == k);
        let target = match (get("repo"), get("author")) {
            (Some(r), None) => {
                let p = format!("{path}.repo");
                if let Some(n) = get("name") {
                    self.at(
                        n.key_span,
                        &format!("{path}.name"),
                        "conflicting-keys",
                        "`name` goes with `author`, not with `repo`".into(),
                        Some(
                            "watch one repository with `repo: org/name`, or an author's with `author:` and `name:`"
                                .into(),
                        ),
                    );
                }
                self.string(&r.value, &p).and_then(|repo| {
                    if is_repo_id(&repo) {
                        Some(WatchTarget::Repo(repo))
                    } else {
                        self.at(
                            r.value.span,
                            &p,
                            "invalid-repo",
                            format!("invalid repository id {}", quote(&repo)),
                            Some("a Hub model id `org/name` of letters, digits, `-`, `_` and `.`".into()),
                        );
                        None
                    }
                })
            }
            (None, Some(a)) => {
                let p = format!("{path}.author");
                let author = self.string(&a.value, &p).and_then(|author| {
                    if is_name_part(&author) {
                        Some(author)
                    } else {
                        self.at(
                            a.value.span,
                            &p,
                            "invalid-author",
                            format!("invalid author {}", quote(&author)),
                            Some("a Hub user or organisation name, e.g. `Qwen`".into()),
                        );
                        None
                    }
                });
                let name = match get("name") {
                    None => Some("*".to_string()),
                    Some(n) => {
                        let p = format!("{path}.name");
                        self.string(&n.value, &p).and_then(|name| {
                            match globset::GlobBuilder::new(&name).literal_separator(true).build() {
                                Ok(_) if !name.is_empty() && !name.contains('/') => Some(name),
                                Ok(_) => {
                                    self.at(
                                        n.value.span,
                                        &p,
                                        "invalid-pattern",
                                        format!(
                                            "invalid name pattern {}: it matches the name after `author/`",
                                            quote(&name)
                                        ),
                                        Some("e.g. `Qwen3-*`; leave out the author and `/`".into()),
                                    );
                                    None
                                }
                                Err(e) => {
                                    self.at(
                                        n.value.span,
                                        &p,
                                        "invalid-pattern",
                                        format!("invalid name pattern {}: {}", quote(&name), e.kind()),
                                        Some(
                                            "a glob: `*` any characters, `?` one, `[abc]` a set, `{a,b}` either".into(),
                                        ),
                                    );
                                    None
                                }
                            }
                        })
                    }
                };
                match (author, name) {
                    (Some(author), Some(name)) => Some(WatchTarget::Author { author, name }),
                    _ => None,
                }
            }
            (Some(_), Some(a)) => {
                self.at(
                    a.key_span,
                    &format!("{path}.author"),
                    "conflicting-keys",
                    "a watch has either `repo` or `author`, not both".into(),
                    Some(
                        "watch one repository with `repo: org/name`, or an author's with `author:` and `name:`".into(),
                    ),
                );
                None
            }
            (None, None) => {
                self.at(
                    node.span,
                    &format!("{path}.repo"),
                    "missing-key",
                    "missing `repo` or `author`".into(),
                    Some("add `repo: org/name`, or `author: org` with `name: \"pattern-*\"`".into()),
                );
                None
            }
        };
        let revision = match get("revision") {
            None => Some("main".to_string()),
            Some(e) => {
                let p = format!("{path}.revision");
                self.string(&e.value, &p).and_then(|r| {
                    if !r.is_empty() && !r.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
                        Some(r)
                    } else {
                        self.at(
                            e.value.span,
                            &p,
                            "invalid-revision",
                            format!("invalid revision {}", quote(&r)),
                            Some("a branch, tag or commit sha, e.g. `main`".into()),
                        );
                        None
                    }
                })
            }
        };
        let every = match get("every") {
            None => Some(DEFAULT_WATCH_INTERVAL),
            Some(e) => {
                let p = format!("{path}.every");
                let text = match &e.value.kind {
                    Kind::Scalar(s) => match s.resolve() {
                        Resolved::Str(v) => Some(v.to_string()),
                        Resolved::Int(i) => Some(i.to_string()),
                        _ => None,
                    },
                    _ => None,
                };
                match text.as_deref().map(parse_duration) {
                    Some(Ok(d)) if d >= MIN_WATCH_INTERVAL => Some(d),
                    Some(Ok(d)) => {
                        self.at(
                            e.value.span,
                            &p,
                            "invalid-interval",
                            format!(
                                "watch interval {} is shorter than {}",
                                format_duration(d),
                                format_duration(MIN_WATCH_INTERVAL)
                            ),
                            Some("poll the Hub at most once a minute, e.g. `every: 10m`".into()),
                        );
                        None
                    }
                    Some(Err(err)) => {
                        self.at(
                            e.value.span,
                            &p,
                            "invalid-interval",
                            format!("invalid interval {}: {err}", quote(text.as_deref().unwrap_or(""))),
                            Some("a duration such as `10m`, `1h` or `1h30m` (at least `1m`)".into()),
                        );
                        None
                    }
                    None => {
                        self.at(
                            e.value.span,
                            &p,
                            "invalid-interval",
                            format!("`every`: expected a duration, found {}", e.value.describe()),
                            Some("a duration such as `10m`, `1h` or `1h30m` (at least `1m`)".into()),
                        );
                        None
                    }
                }
            }
        };
        Some(Watch { target: target?, revision: revision?, every_secs: every?.as_secs() })
    }

    fn params(&mut self, node: &Node, path: &str, is_watch: bool) -> Option<BTreeMap<String, String>> {
        let entries = self.mapping(node, path, "{revision: \"${{ trigger.sha }}\"}")?;
        let mut out = BTreeMap::new();
        let mut ok = true;
        for e in entries {
            let p = format!("{path}.{}", e.key);
            if !self.params.iter().any(|s| s.name == e.key) {
                let names: Vec<&str> = self.params.iter().map(|s| s.name.as_str()).collect();
                let hint = match did_you_mean(&e.key, names.iter().copied()) {
                    Some(s) => format!("did you mean `{s}`?"),
                    None if names.is_empty() => {
                        format!("declare it under `params:`, e.g. `{}: {{type: string}}`", e.key)
                    }
                    None => format!("declared params: {}", list(&names)),
                };
                self.at(
                    e.key_span,
                    &p,
                    "undefined-param",
                    format!("trigger sets undefined param `{}`", e.key),
                    Some(hint),
                );
                ok = false;
                continue;
            }
            let value = match &e.value.kind {
                Kind::Scalar(s) => match s.resolve() {
                    Resolved::Str(v) => Some(v.to_string()),
                    Resolved::Int(i) => Some(i.to_string()),
                    Resolved::Bool(b) => Some(b.to_string()),
                    _ => None,
                },
                _ => None,
            };
            let Some(value) = value else {
                self.at(
                    e.value.span,
                    &p,
                    "wrong-type",
                    format!("`{}`: expected a string, int or bool, found {}", e.key, e.value.describe()),
                    None,
                );
                ok = false;
                continue;
            };
            match references(&value) {
                Err(()) => {
                    self.at(
                        e.value.span,
                        &p,
                        "invalid-interpolation",
                        "unclosed `${{`".into(),
                        Some("write `${{ trigger.sha }}`".into()),
                    );
                    ok = false;
                }
                Ok(refs) => {
                    for r in refs {
                        let var = r.strip_prefix("trigger.");
                        let known = var.is_some_and(|v| TRIGGER_VARS.contains(&v));
                        let watch_only = var.is_some_and(|v| v != "time");
                        if !known {
                            let hint = var
                                .and_then(|v| did_you_mean(v, TRIGGER_VARS.iter().copied()))
                                .map(|s| format!("did you mean `${{{{ trigger.{s} }}}}`?"))
                                .unwrap_or_else(|| {
                                    "trigger params may use `${{ trigger.repo }}`, `${{ trigger.sha }}`, \
                                     `${{ trigger.revision }}` and `${{ trigger.time }}`"
                                        .into()
                                });
                            self.at(
                                e.value.span,
                                &p,
                                "undefined-reference",
                                format!("`{r}` is not defined in trigger params"),
                                Some(hint),
                            );
                            ok = false;
                        } else if watch_only && !is_watch {
                            self.at(
                                e.value.span,
                                &p,
                                "undefined-reference",
                                format!("`{r}` is only defined for `watch` triggers"),
                                Some("a schedule knows only `${{ trigger.time }}`".into()),
                            );
                            ok = false;
                        }
                    }
                }
            }
            out.insert(e.key.clone(), value);
        }
        ok.then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn substitutes_trigger_variables_only() {
        let v = substitute("${{ trigger.repo }}@${{trigger.sha}} ${{ params.x }}", |var| format!("<{var}>"));
        assert_eq!(v, "<repo>@<sha> ${{ params.x }}");
        assert_eq!(references("a ${{ trigger.sha }} b ${{x}}"), Ok(vec!["trigger.sha", "x"]));
        assert_eq!(references("a ${{ trigger.sha"), Err(()));
    }

    #[test]
    fn cron_and_zones() {
        assert!(parse_cron("0 2 * * *").is_ok());
        assert!(parse_cron("@daily").is_ok());
        assert!(parse_cron("0 25 * * *").is_err());
        assert!(parse_cron("0 0 2 * * *").is_err(), "six fields (seconds) are refused");
        assert!(parse_cron("0 0 31 2 *").is_err(), "February 31 never comes");
        assert!(parse_cron("0 0 29 2 *").is_ok(), "February 29 comes every four years");
        assert!(parse_timezone("Europe/Paris").is_ok());
        assert!(parse_timezone("Europe/Pariss").is_err());
        assert!(is_repo_id("Qwen/Qwen3-0.6B"));
        assert!(!is_repo_id("Qwen3-0.6B"));
        assert!(!is_repo_id("a/b/c"));
    }
}
