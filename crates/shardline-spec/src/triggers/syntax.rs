//! The small grammars of triggers: cron expressions, IANA time zones, Hub repository ids and
//! author names, and `${{ trigger.* }}` references in params.

use std::str::FromStr;

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
pub(super) fn is_repo_id(s: &str) -> bool {
    match s.split_once('/') {
        Some((a, n)) => is_name_part(a) && is_name_part(n),
        None => false,
    }
}

pub(super) fn is_name_part(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && s != "."
        && s != ".."
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Replaces each `${{ trigger.VAR }}` with `value(VAR)`; other text is kept as written.
pub(super) fn substitute(text: &str, value: impl Fn(&str) -> String) -> String {
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
pub(super) fn references(text: &str) -> Result<Vec<&str>, ()> {
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
