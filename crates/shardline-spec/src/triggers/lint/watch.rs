//! A trigger's `watch`: one repository or an author's models matching a name glob, the revision
//! followed, and how often the Hub is polled.

use shardline_units::{format_duration, parse_duration};

use crate::yaml::{quote, Kind, Node, Resolved};

use super::TriggerLint;
use crate::triggers::syntax::{is_name_part, is_repo_id};
use crate::triggers::{Watch, WatchTarget, DEFAULT_WATCH_INTERVAL, MIN_WATCH_INTERVAL, WATCH_KEYS};

impl TriggerLint<'_, '_> {
    pub(super) fn watch(&mut self, node: &Node, path: &str) -> Option<Watch> {
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
}
