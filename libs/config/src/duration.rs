//! Durations as Go writes them (`time.ParseDuration`), because llm-d's sidecar flags and
//! manifests are Go durations: `200ms`, `1.5s`, `1m30s`, `2h45m`, `500us`. lunakv also takes a
//! bare number as seconds (`10`). Written here rather than taken from `humantime`, which refuses
//! fractions (`1.5s`) and bare numbers that existing lunakv flags accept.

use std::time::Duration;

/// A string that is not a duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not a duration: {why}; write it as Go does (200ms, 1.5s, 1m30s, 2h) or a number of seconds"
)]
pub struct DurationError {
    pub value: String,
    pub why: &'static str,
}

/// Parses a Go duration (`1m30s`, `250ms`, `1.5h`) or a bare, non-negative number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let err = |why| DurationError {
        value: s.to_string(),
        why,
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(err("it is empty"));
    }
    if t.starts_with('-') {
        return Err(err("it is negative"));
    }
    let t = t.strip_prefix('+').unwrap_or(t);
    if let Ok(secs) = t.parse::<f64>() {
        return seconds(secs).ok_or_else(|| err("it is out of range"));
    }
    let mut rest = t;
    let mut total = 0.0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return Err(err("a unit is not preceded by a number"));
        }
        let value: f64 = rest[..num_len]
            .parse()
            .map_err(|_| err("a number is malformed"))?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let per_second = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "" => return Err(err("a number has no unit (ns, us, ms, s, m, h)")),
            _ => return Err(err("a unit is not one of ns, us, ms, s, m, h")),
        };
        rest = &rest[unit_len..];
        total += value * per_second;
    }
    seconds(total).ok_or_else(|| err("it is out of range"))
}

fn seconds(v: f64) -> Option<Duration> {
    (v.is_finite() && v >= 0.0)
        .then(|| Duration::try_from_secs_f64(v).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_and_bare_seconds() {
        let ms = Duration::from_millis;
        for (s, want) in [
            ("200ms", ms(200)),
            ("1.5s", ms(1500)),
            ("1m30s", ms(90_000)),
            ("2h45m", ms((2 * 3600 + 45 * 60) * 1000)),
            ("500us", Duration::from_micros(500)),
            ("10", ms(10_000)),
            ("0", Duration::ZERO),
            (" 4s ", ms(4000)),
            ("1h0m0.5s", ms(3_600_500)),
        ] {
            assert_eq!(parse_duration(s), Ok(want), "{s}");
        }
    }

    #[test]
    fn bad_durations_say_why_and_how() {
        for (s, why) in [
            ("", "empty"),
            ("-1s", "negative"),
            ("1x", "not one of"),
            ("s", "not preceded"),
            ("1m30", "no unit"),
            ("1..5s", "malformed"),
        ] {
            let e = parse_duration(s).expect_err(s).to_string();
            assert!(e.contains(why) && e.contains("1m30s"), "{s}: {e}");
        }
    }
}
