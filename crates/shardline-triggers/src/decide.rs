//! The pure decision core: given a trigger's settings, what it remembers and "now", what fires
//! and when it is due next. No I/O, no clock of its own, no randomness (jitter is a parameter).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use chrono_tz::Tz;
use shardline_backoff::Backoff;
use shardline_spec::{MissedPolicy, Schedule, ON_TIME_GRACE};

use crate::TriggerError;

/// A schedule ready to evaluate: the parsed cron expression in its zone.
#[derive(Clone, Debug)]
pub struct CompiledSchedule {
    cron: croner::Cron,
    tz: Tz,
    missed: MissedPolicy,
}

/// What a due schedule does now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleDecision {
    /// The instant to fire a run for (its dedupe key), if any.
    pub fire: Option<DateTime<Utc>>,
    /// Whether `fire` is a catch-up of a missed instant (more than the grace late).
    pub late: bool,
    /// Instants that passed and get no run of their own.
    pub skipped: u64,
    /// The next instant after now.
    pub next_at: Option<DateTime<Utc>>,
}

/// At most this many passed instants are counted (a minutely cron after a long downtime).
const MAX_COUNTED: u64 = 100_000;

impl CompiledSchedule {
    pub fn new(s: &Schedule) -> Result<CompiledSchedule, TriggerError> {
        let cron = shardline_spec::parse_cron(&s.cron)
            .map_err(|e| TriggerError::Invalid(format!("cron {:?}: {e}", s.cron)))?;
        let tz = shardline_spec::parse_timezone(&s.timezone)
            .map_err(|e| TriggerError::Invalid(format!("time zone {:?}: {e}", s.timezone)))?;
        Ok(CompiledSchedule { cron, tz, missed: s.missed })
    }

    /// The first instant strictly after `t`, as the wall clock of the zone says (a time that
    /// a spring-forward skips fires right after the gap; one a fall-back repeats fires once).
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local = t.with_timezone(&self.tz);
        self.cron.find_next_occurrence(&local, false).ok().map(|d| d.with_timezone(&Utc))
    }

    /// The last instant at or before `t`.
    pub fn last_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local = t.with_timezone(&self.tz);
        self.cron.find_previous_occurrence(&local, true).ok().map(|d| d.with_timezone(&Utc))
    }

    /// What to do at `now`, given the instant the schedule was due (`None`: never evaluated,
    /// so nothing is owed and the next instant after now is due).
    ///
    /// Of the instants in `[due, now]` at most one run fires: the latest instant, when it is at
    /// most [`ON_TIME_GRACE`] old (on time) or when the policy is `run-once` (a catch-up);
    /// with `skip`, a late instant fires nothing. Every other passed instant is skipped.
    pub fn decide(&self, due: Option<DateTime<Utc>>, now: DateTime<Utc>) -> ScheduleDecision {
        let next_at = self.next_after(now);
        let Some(due) = due else {
            return ScheduleDecision { fire: None, late: false, skipped: 0, next_at };
        };
        if now < due {
            return ScheduleDecision { fire: None, late: false, skipped: 0, next_at: Some(due) };
        }
        let latest = self.last_at_or_before(now).filter(|l| *l >= due).unwrap_or(due);
        let mut passed = 1u64;
        let mut t = due;
        while passed < MAX_COUNTED {
            match self.next_after(t) {
                Some(n) if n <= latest => {
                    passed += 1;
                    t = n;
                }
                _ => break,
            }
        }
        let on_time = (now - latest).to_std().is_ok_and(|late| late <= ON_TIME_GRACE);
        let fire = on_time || self.missed == MissedPolicy::RunOnce;
        ScheduleDecision {
            fire: fire.then_some(latest),
            late: fire && !on_time,
            skipped: passed - u64::from(fire),
            next_at,
        }
    }
}

/// Whether a check is due: never checked, or its time has come.
pub fn is_due(next_at: Option<DateTime<Utc>>, now: DateTime<Utc>) -> bool {
    next_at.is_none_or(|t| now >= t)
}

/// The wait before the next check after `errors` failed checks in a row (`errors` ≥ 1):
/// 30 s doubling each time, capped at the larger of `every` and an hour, scaled by
/// `0.5 + 0.5·jitter` (`jitter` in [0, 1)) so servers that failed together do not retry together.
pub fn backoff(every: Duration, errors: u32, jitter: f64) -> Duration {
    let cap = every.max(Duration::from_secs(3600));
    Backoff { base: Duration::from_secs(30), cap, spread: (0.5, 1.0) }.delay(errors, jitter)
}

/// The dedupe key of a watch firing: one run per pipeline, repository and commit.
pub fn watch_key(pipeline: &str, repo: &str, sha: &str) -> String {
    format!("trigger/{pipeline}/{repo}@{sha}")
}

/// The dedupe key of a schedule firing: one run per pipeline and scheduled instant.
pub fn schedule_key(pipeline: &str, instant: DateTime<Utc>) -> String {
    format!("trigger/{pipeline}/schedule@{}", instant.to_rfc3339_opts(SecondsFormat::Secs, true))
}

/// An author watch's name filter: `author/NAME` with NAME matching the glob.
#[derive(Clone, Debug)]
pub struct NameFilter {
    author: String,
    glob: globset::GlobMatcher,
}

impl NameFilter {
    pub fn new(author: &str, pattern: &str) -> Result<NameFilter, TriggerError> {
        let glob = globset::GlobBuilder::new(pattern)
            .literal_separator(true)
            .build()
            .map_err(|e| TriggerError::Invalid(format!("name pattern {pattern:?}: {e}")))?
            .compile_matcher();
        Ok(NameFilter { author: author.to_string(), glob })
    }

    /// Whether the model id `org/name` is the author's and its name matches.
    pub fn matches(&self, id: &str) -> bool {
        match id.split_once('/') {
            Some((a, name)) => a == self.author && !name.contains('/') && self.glob.is_match(name),
            None => false,
        }
    }
}

/// The repositories an author watch fires for: those whose head differs from what was seen
/// before. The first listing (`seen` = `None`) is a baseline and fires nothing.
pub fn author_changes(
    seen: Option<&BTreeMap<String, String>>,
    current: &BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let Some(seen) = seen else {
        return Vec::new();
    };
    current.iter().filter(|(repo, sha)| seen.get(*repo) != Some(*sha)).map(|(r, s)| (r.clone(), s.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let every = Duration::from_secs(600);
        assert_eq!(backoff(every, 1, 1.0), Duration::from_secs(30));
        assert_eq!(backoff(every, 2, 1.0), Duration::from_secs(60));
        assert_eq!(backoff(every, 3, 1.0), Duration::from_secs(120));
        assert_eq!(backoff(every, 30, 1.0), Duration::from_secs(3600));
        assert_eq!(backoff(every, 1, 0.0), Duration::from_secs(15));
        assert_eq!(backoff(Duration::from_secs(7200), 30, 1.0), Duration::from_secs(7200));
    }

    #[test]
    fn names_match_their_author_only() {
        let f = NameFilter::new("Qwen", "Qwen3-*").expect("glob");
        assert!(f.matches("Qwen/Qwen3-0.6B"));
        assert!(!f.matches("Qwen/Qwen2.5-7B"));
        assert!(!f.matches("other/Qwen3-0.6B"));
        assert!(!f.matches("Qwen3-0.6B"));
    }

    #[test]
    fn author_baseline_fires_nothing() {
        let cur: BTreeMap<String, String> = [("a/x".to_string(), "1".to_string())].into();
        assert!(author_changes(None, &cur).is_empty());
        let seen: BTreeMap<String, String> = [("a/x".to_string(), "0".to_string())].into();
        assert_eq!(author_changes(Some(&seen), &cur), vec![("a/x".to_string(), "1".to_string())]);
        assert!(author_changes(Some(&cur), &cur).is_empty());
    }
}
