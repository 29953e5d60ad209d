//! Sizes (`4GiB`) and durations (`90s`, `1h30m`): parsing with precise errors, the canonical
//! spelling used when a value is printed, interpolated or hashed ([`format_size`],
//! [`format_duration`]), and a rounded spelling for messages ([`format_duration_human`]).
//!
//! **Owns:** the one grammar of sizes and durations in the workspace (specs, `--set` values,
//! CLI flags). **Must not depend on:** any workspace crate: specs, the store and the CLI use it.

use std::time::Duration;

use thiserror::Error;

/// Why a size or a duration does not parse. The message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum UnitError {
    #[error("empty value")]
    Empty,
    #[error("`{0}` has no number")]
    NoNumber(String),
    #[error("`{0}` is not a whole number")]
    Fractional(String),
    #[error("`{text}` has no unit")]
    NoUnit { text: String },
    #[error("unknown unit `{unit}` in `{text}`")]
    UnknownUnit { text: String, unit: String },
    #[error("`{0}` is too large")]
    Overflow(String),
    #[error("`{0}` is not a number")]
    NotANumber(String),
}

impl UnitError {
    /// A hint on how to write the value, for a size (`size = true`) or a duration.
    pub fn hint(&self, size: bool) -> String {
        match self {
            UnitError::UnknownUnit { unit, .. } if size => {
                let upper = unit.to_ascii_uppercase();
                let binary = match upper.trim_end_matches(['I', 'B']) {
                    "K" => Some("KiB"),
                    "M" => Some("MiB"),
                    "G" => Some("GiB"),
                    "T" => Some("TiB"),
                    "P" => Some("PiB"),
                    _ => None,
                };
                match binary {
                    Some(b) => format!(
                        "write `{b}` (powers of 1024) or `{}B` (powers of 1000); units are case-sensitive",
                        &b[..1]
                    ),
                    None => SIZE_FORMS.to_string(),
                }
            }
            UnitError::Fractional(_) if size => "use a smaller unit, e.g. `1536MiB` rather than `1.5GiB`".to_string(),
            UnitError::Fractional(_) => "use a smaller unit, e.g. `90m` rather than `1.5h`".to_string(),
            UnitError::NoUnit { .. } if !size => "add a unit: `ms`, `s`, `m`, `h` or `d`, e.g. `90s`".to_string(),
            _ if size => SIZE_FORMS.to_string(),
            _ => DURATION_FORMS.to_string(),
        }
    }
}

const SIZE_FORMS: &str = "sizes are a whole number and a unit: `B`, `KiB`, `MiB`, `GiB`, `TiB`, `PiB` \
                          (or `KB`…`PB` for powers of 1000), e.g. `4GiB`";
const DURATION_FORMS: &str =
    "durations are whole numbers with units `ms`, `s`, `m`, `h`, `d`, e.g. `90s`, `2h`, `1h30m`";

const SIZE_UNITS: &[(&str, u64)] = &[
    ("B", 1),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("PiB", 1 << 50),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("PB", 1_000_000_000_000_000),
];

const DURATION_UNITS: &[(&str, u64)] = &[("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)];

/// Splits `12.5GiB` into ("12.5", "GiB"), allowing one space between them.
fn split_number(text: &str) -> (&str, &str) {
    let end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (num, rest) = text.split_at(end);
    (num, rest.strip_prefix(' ').unwrap_or(rest))
}

/// Parses a size: `4GiB`, `512MiB`, `10GB`, `1024B`, or a bare byte count `0`.
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(UnitError::Empty);
    }
    let (num, unit) = split_number(t);
    if num.is_empty() {
        return Err(UnitError::NoNumber(t.to_string()));
    }
    if num.contains('.') {
        return Err(UnitError::Fractional(t.to_string()));
    }
    let n: u64 = num.parse().map_err(|_| UnitError::Overflow(t.to_string()))?;
    let factor = if unit.is_empty() {
        1
    } else {
        SIZE_UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .map(|(_, f)| *f)
            .ok_or_else(|| UnitError::UnknownUnit { text: t.to_string(), unit: unit.to_string() })?
    };
    n.checked_mul(factor).ok_or_else(|| UnitError::Overflow(t.to_string()))
}

/// What [`parse_size_lenient`] accepts, for messages.
pub const LENIENT_SIZE_FORMS: &str = "expected a number with an optional unit, e.g. `1MB`, `512MiB`, `4GB`, \
                                      `1.5TiB`; B, KB, MB, GB, TB, PB are powers of 1000, KiB … PiB and K, M, \
                                      G, T, P are powers of 1024";

/// Parses a size as command-line flags take it (`shardline synth --size`, `bench --size`): every
/// spelling [`parse_size`] accepts with the same value, and also units in any case (`4gb`), the
/// one-letter binary units of `dd` (`K`, `M`, `G`, `T`, `P`), any blanks between number and unit,
/// and a fractional number (`1.5TiB`, `.25MiB`), rounded down to whole bytes. Specs keep the
/// strict grammar of [`parse_size`].
pub fn parse_size_lenient(text: &str) -> Result<u64, UnitError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(UnitError::Empty);
    }
    let end = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(end);
    let unit = unit.trim();
    if number.is_empty() {
        return Err(UnitError::NoNumber(t.to_string()));
    }
    let multiplier = match unit.to_ascii_uppercase().as_str() {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        "P" => 1 << 50,
        upper => SIZE_UNITS
            .iter()
            .find(|(u, _)| u.to_ascii_uppercase() == upper)
            .map(|(_, f)| *f)
            .ok_or_else(|| UnitError::UnknownUnit { text: t.to_string(), unit: unit.to_string() })?,
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if fraction.contains('.') || (whole.is_empty() && fraction.is_empty()) {
        return Err(UnitError::NotANumber(t.to_string()));
    }
    let too_large = || UnitError::Overflow(t.to_string());
    let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
    let bytes = whole.checked_mul(multiplier).ok_or_else(too_large)?;
    // fraction · multiplier / 10^digits, exactly; digits beyond 10^-20 are below one byte.
    let mut numerator: u128 = 0;
    let mut denominator: u128 = 1;
    for digit in fraction.bytes().take(20) {
        denominator *= 10;
        numerator = numerator * 10 + u128::from(digit - b'0');
    }
    let extra = u64::try_from(numerator * u128::from(multiplier) / denominator).map_err(|_| too_large())?;
    bytes.checked_add(extra).ok_or_else(too_large)
}

/// The canonical spelling of a size: the largest binary unit that divides it (`4GiB`), else bytes.
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace's rust-version
pub fn format_size(bytes: u64) -> String {
    for (unit, factor) in SIZE_UNITS[1..6].iter().rev() {
        if bytes != 0 && bytes % factor == 0 {
            return format!("{}{unit}", bytes / factor);
        }
    }
    format!("{bytes}B")
}

/// Parses a duration: one or more whole numbers with units `ms`, `s`, `m`, `h`, `d`
/// (`90s`, `2h`, `1h30m`, `500ms`).
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(UnitError::Empty);
    }
    let mut rest = t;
    let mut total_ms: u64 = 0;
    while !rest.is_empty() {
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let num = &rest[..end];
        if num.is_empty() {
            return Err(UnitError::NoNumber(t.to_string()));
        }
        if num.contains('.') {
            return Err(UnitError::Fractional(t.to_string()));
        }
        let after = rest[end..].strip_prefix(' ').unwrap_or(&rest[end..]);
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c == ' ').unwrap_or(after.len());
        let unit = &after[..unit_len];
        if unit.is_empty() {
            return Err(UnitError::NoUnit { text: t.to_string() });
        }
        let factor = DURATION_UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .map(|(_, f)| *f)
            .ok_or_else(|| UnitError::UnknownUnit { text: t.to_string(), unit: unit.to_string() })?;
        let n: u64 = num.parse().map_err(|_| UnitError::Overflow(t.to_string()))?;
        total_ms = n
            .checked_mul(factor)
            .and_then(|ms| total_ms.checked_add(ms))
            .ok_or_else(|| UnitError::Overflow(t.to_string()))?;
        rest = after[unit_len..].trim_start();
    }
    Ok(Duration::from_millis(total_ms))
}

/// The canonical spelling of a duration: the largest unit that divides it (`90s`, `2h`, `1500ms`).
#[allow(clippy::manual_is_multiple_of)]
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, factor) in DURATION_UNITS {
        let f = u128::from(*factor);
        if ms != 0 && ms % f == 0 {
            return format!("{}{unit}", ms / f);
        }
    }
    "0s".to_string()
}

/// A duration rounded for a message: `300ms`, `1.5s`, `2m 5s`, `3h 0m`.
pub fn format_duration_human(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", d.as_secs_f64())
    } else if ms < 3_600_000 {
        format!("{}m {}s", ms / 60_000, (ms / 1000) % 60)
    } else {
        format!("{}h {}m", ms / 3_600_000, (ms / 60_000) % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("4 GiB"), Ok(4 << 30));
        assert_eq!(parse_size("10GB"), Ok(10_000_000_000));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("123B"), Ok(123));
        assert!(matches!(parse_size("4G"), Err(UnitError::UnknownUnit { .. })));
        assert!(parse_size("4G").unwrap_err().hint(true).contains("`GiB`"));
        assert!(parse_size("4gib").unwrap_err().hint(true).contains("`GiB`"));
        assert!(matches!(parse_size("1.5GiB"), Err(UnitError::Fractional(_))));
        assert!(matches!(parse_size("lots"), Err(UnitError::NoNumber(_))));
        assert!(matches!(parse_size("99999999PiB"), Err(UnitError::Overflow(_))));
        assert_eq!(format_size(4 << 30), "4GiB");
        assert_eq!(format_size(1536 << 20), "1536MiB");
        assert_eq!(format_size(0), "0B");
        assert_eq!(format_size(1000), "1000B");
    }

    /// The spellings `shardline synth --size` took before it used this crate, with their values.
    #[test]
    fn lenient_sizes() {
        for (input, bytes) in [
            ("1MB", 1_000_000),
            ("1mb", 1_000_000),
            ("512MiB", 512 << 20),
            ("4GB", 4_000_000_000),
            ("4 GiB", 4 << 30),
            ("4gib", 4 << 30),
            ("8GiB", 8 << 30),
            ("  8GB ", 8_000_000_000),
            ("4  GB", 4_000_000_000),
            ("1024", 1024),
            ("10B", 10),
            ("10b", 10),
            ("3KB", 3000),
            ("3KiB", 3072),
            ("2G", 2 << 30),
            ("2g", 2 << 30),
            ("1T", 1 << 40),
            ("2TB", 2_000_000_000_000),
            ("1PB", 1_000_000_000_000_000),
            ("1.5GB", 1_500_000_000),
            ("0.5KiB", 512),
            (".25MiB", 256 << 10),
            ("1.", 1),
            ("1.0000000000000000000000001GB", 1_000_000_000),
            ("0", 0),
        ] {
            assert_eq!(parse_size_lenient(input), Ok(bytes), "{input}");
        }
        for input in
            ["", "GB", "-1GB", "1.2.3GB", "1XB", "1 G B", "99999999999999999999", "20000PB", "16384PiB", ".", "1e9"]
        {
            assert!(parse_size_lenient(input).is_err(), "{input}");
        }
        // Every strict spelling reads the same.
        for input in ["4GiB", "4 GiB", "10GB", "0", "123B", "1KB", "7PiB", "1TB"] {
            assert_eq!(parse_size_lenient(input), parse_size(input), "{input}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(matches!(parse_duration("10"), Err(UnitError::NoUnit { .. })));
        assert!(matches!(parse_duration("2 hours"), Err(UnitError::UnknownUnit { .. })));
        assert!(matches!(parse_duration("1.5h"), Err(UnitError::Fractional(_))));
        assert_eq!(format_duration(Duration::from_secs(5400)), "90m");
        assert_eq!(format_duration(Duration::from_secs(90)), "90s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::ZERO), "0s");
        assert_eq!(format_duration(Duration::from_secs(86_400)), "1d");
    }

    #[test]
    fn human_durations() {
        assert_eq!(format_duration_human(Duration::from_millis(300)), "300ms");
        assert_eq!(format_duration_human(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration_human(Duration::from_secs(125)), "2m 5s");
        assert_eq!(format_duration_human(Duration::from_secs(3 * 3600 + 59)), "3h 0m");
    }
}
