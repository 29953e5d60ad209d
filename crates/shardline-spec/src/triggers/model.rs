//! The typed triggers a spec declares, and the `--set` overrides a firing gives its run.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shardline_units::format_duration;

use super::syntax::substitute;
use super::MISSED_NAMES;
use crate::suggest::list;

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
