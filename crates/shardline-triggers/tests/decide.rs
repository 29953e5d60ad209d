//! The pure core: cron instants across DST in a named zone, the missed-run policy.

use chrono::{DateTime, TimeZone, Utc};
use shardline_spec::{MissedPolicy, Schedule};
use shardline_triggers::{schedule_key, watch_key, CompiledSchedule};

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, 0).single().expect("valid time")
}

fn paris(cron: &str, missed: MissedPolicy) -> CompiledSchedule {
    CompiledSchedule::new(&Schedule { cron: cron.into(), timezone: "Europe/Paris".into(), missed }).expect("valid")
}

#[test]
fn nightly_in_paris_across_spring_forward() {
    let s = paris("0 2 * * *", MissedPolicy::RunOnce);
    // 02:00 CET = 01:00 UTC before the change.
    assert_eq!(s.next_after(utc(2026, 3, 27, 12, 0)), Some(utc(2026, 3, 28, 1, 0)));
    // 2026-03-29: 02:00 local does not exist (02:00 CET → 03:00 CEST); it fires right after the
    // gap, 03:00 CEST = 01:00 UTC, once.
    assert_eq!(s.next_after(utc(2026, 3, 28, 1, 0)), Some(utc(2026, 3, 29, 1, 0)));
    // Then 02:00 CEST = 00:00 UTC.
    assert_eq!(s.next_after(utc(2026, 3, 29, 1, 0)), Some(utc(2026, 3, 30, 0, 0)));
}

#[test]
fn nightly_in_paris_across_fall_back() {
    let s = paris("0 2 * * *", MissedPolicy::RunOnce);
    // 2026-10-25: 02:00 happens twice (CEST, then CET); a fixed-time job fires at the first.
    assert_eq!(s.next_after(utc(2026, 10, 24, 12, 0)), Some(utc(2026, 10, 25, 0, 0)));
    assert_eq!(s.next_after(utc(2026, 10, 25, 0, 0)), Some(utc(2026, 10, 26, 1, 0)));
    // The same cron in UTC ignores Paris' changes.
    let u = CompiledSchedule::new(&Schedule {
        cron: "0 2 * * *".into(),
        timezone: "UTC".into(),
        missed: MissedPolicy::Skip,
    })
    .expect("valid");
    assert_eq!(u.next_after(utc(2026, 10, 24, 12, 0)), Some(utc(2026, 10, 25, 2, 0)));
}

#[test]
fn first_evaluation_owes_nothing() {
    let s = paris("0 2 * * *", MissedPolicy::RunOnce);
    let d = s.decide(None, utc(2026, 4, 1, 12, 0));
    assert_eq!(d.fire, None);
    assert_eq!(d.next_at, Some(utc(2026, 4, 2, 0, 0)));
    // Not yet due: nothing, same next.
    let d = s.decide(Some(utc(2026, 4, 2, 0, 0)), utc(2026, 4, 1, 23, 59));
    assert_eq!((d.fire, d.next_at), (None, Some(utc(2026, 4, 2, 0, 0))));
}

#[test]
fn on_time_fires_whatever_the_policy() {
    for policy in [MissedPolicy::RunOnce, MissedPolicy::Skip] {
        let s = paris("0 2 * * *", policy);
        let d = s.decide(Some(utc(2026, 4, 2, 0, 0)), utc(2026, 4, 2, 0, 4));
        assert_eq!(d.fire, Some(utc(2026, 4, 2, 0, 0)), "{policy:?}");
        assert!(!d.late);
        assert_eq!(d.skipped, 0);
        assert_eq!(d.next_at, Some(utc(2026, 4, 3, 0, 0)));
    }
}

#[test]
fn downtime_catches_up_once_or_skips() {
    // Due on Apr 2 02:00 Paris; the server comes back on Apr 5 at 12:00 Paris: the instants of
    // Apr 2, 3, 4 and 5 passed.
    let due = Some(utc(2026, 4, 2, 0, 0));
    let back = utc(2026, 4, 5, 10, 0);

    let once = paris("0 2 * * *", MissedPolicy::RunOnce).decide(due, back);
    assert_eq!(once.fire, Some(utc(2026, 4, 5, 0, 0)), "one run, for the latest missed instant");
    assert!(once.late);
    assert_eq!(once.skipped, 3);
    assert_eq!(once.next_at, Some(utc(2026, 4, 6, 0, 0)));

    let skip = paris("0 2 * * *", MissedPolicy::Skip).decide(due, back);
    assert_eq!(skip.fire, None);
    assert_eq!(skip.skipped, 4);
    assert_eq!(skip.next_at, Some(utc(2026, 4, 6, 0, 0)));

    // Back just after an instant: that one is on time, the older ones are skipped either way.
    let skip = paris("0 2 * * *", MissedPolicy::Skip).decide(due, utc(2026, 4, 5, 0, 3));
    assert_eq!(skip.fire, Some(utc(2026, 4, 5, 0, 0)));
    assert_eq!(skip.skipped, 3);
}

#[test]
fn dedupe_keys_name_pipeline_repo_sha_or_instant() {
    let sha = "0123456789abcdef0123456789abcdef01234567";
    assert_eq!(watch_key("nightly", "Qwen/Qwen3-0.6B", sha), format!("trigger/nightly/Qwen/Qwen3-0.6B@{sha}"));
    assert_eq!(schedule_key("nightly", utc(2026, 4, 2, 0, 0)), "trigger/nightly/schedule@2026-04-02T00:00:00Z");
}
