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
//!
//! Modules: the typed triggers and the overrides a firing renders (`model`), cron, time zone,
//! repository-id and `${{ trigger.* }}` syntax (`syntax`), and the lint of `triggers:` (`lint`).

mod lint;
mod model;
mod syntax;

use std::time::Duration;

pub(crate) use lint::lint_triggers;
pub use model::{MissedPolicy, Schedule, Trigger, TriggerContext, TriggerKind, Watch, WatchTarget};
pub use syntax::{parse_cron, parse_timezone};

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
