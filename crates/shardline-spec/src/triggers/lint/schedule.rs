//! A trigger's `schedule`: a cron expression that matches some date, an IANA time zone, and the
//! missed-run policy.

use crate::suggest::did_you_mean;
use crate::yaml::{quote, Node};

use super::TriggerLint;
use crate::triggers::syntax::{parse_cron, parse_timezone};
use crate::triggers::{MissedPolicy, Schedule, MISSED_NAMES, SCHEDULE_KEYS};

impl TriggerLint<'_, '_> {
    pub(super) fn schedule(&mut self, node: &Node, path: &str) -> Option<Schedule> {
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
}
