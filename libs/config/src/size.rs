//! Human sizes: `"80GB"`, `"4 GB"`, `"512MiB"`, `4294967296`.
//!
//! The rules follow vLLM's Mooncake size parser (and therefore every `mooncake_config.json` and
//! `--global_segment_size` flag in the wild): a plain integer is a byte count, and the units
//! `KB`/`MB`/`GB` are **powers of 1024**, so `"80GB"` is 80 GiB, not 80·10⁹. lunakv also accepts
//! the binary spellings `KiB`/`MiB`/`GiB`/`TiB` and `TB`, all with the same meaning. Units are
//! case-insensitive and may be separated from the number by spaces (`"4 GB"` is upstream
//! `mooncake_client`'s own default). A decimal number is allowed (`"1.5GB"`); like vLLM's
//! `int(float(x) * unit)`, a fractional byte is truncated, but the arithmetic here is exact.
//!
//! Rejected, with a message that names the value and shows valid sizes: empty strings, negative
//! numbers, unknown units (`"80XB"`, `"80G"`), values above `u64::MAX`.
//!
//! For serde, this module doubles as a `with` module: `#[serde(with = "lunakv_config::size")]` on a
//! `u64` field accepts a JSON/YAML number or a size string and serializes back as a number.

use std::fmt;

use serde::{Deserializer, Serializer, de};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Examples appended to every size error, so the fix is on the same line as the problem.
pub const SIZE_EXAMPLES: &str = "write a byte count or a number with a unit, e.g. 4294967296, \"80GB\" (= 80 GiB), \"4 GB\", \"512MiB\"";

/// Why a size was refused. `Display` names the value and gives valid examples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeError {
    /// The value as the user wrote it (a string as written, a number in JSON form).
    pub value: String,
    pub kind: SizeErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SizeErrorKind {
    Empty,
    Negative,
    /// The part before the unit is not a decimal number.
    BadNumber,
    /// The suffix is not one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    UnknownUnit(String),
    /// More than `u64::MAX` bytes.
    TooLarge,
    /// A JSON number with a fraction (`1.5`): bytes are whole.
    Fractional,
}

impl fmt::Display for SizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = &self.value;
        match &self.kind {
            SizeErrorKind::Empty => write!(f, "invalid size {value}: it is empty; ")?,
            SizeErrorKind::Negative => {
                write!(f, "invalid size {value}: sizes cannot be negative; ")?
            }
            SizeErrorKind::BadNumber => write!(f, "invalid size {value}: not a number; ")?,
            SizeErrorKind::UnknownUnit(unit) => write!(
                f,
                "invalid size {value}: unknown unit \"{unit}\" (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; all powers of 1024); "
            )?,
            SizeErrorKind::TooLarge => {
                write!(f, "invalid size {value}: larger than 2^64-1 bytes; ")?
            }
            SizeErrorKind::Fractional => write!(
                f,
                "invalid size {value}: a byte count must be a whole number; "
            )?,
        }
        f.write_str(SIZE_EXAMPLES)
    }
}

impl std::error::Error for SizeError {}

/// Parses a human size (see the module docs). `parse_size("80GB") == Ok(80 << 30)`.
///
/// Also usable directly as a clap `value_parser`.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = |kind| SizeError {
        value: format!("\"{input}\""),
        kind,
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err(SizeErrorKind::Empty));
    }
    if s.starts_with('-') {
        return Err(err(SizeErrorKind::Negative));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    let multiplier = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" | "kib" => KIB,
        "mb" | "mib" => MIB,
        "gb" | "gib" => GIB,
        "tb" | "tib" => TIB,
        _ if number.is_empty() => return Err(err(SizeErrorKind::BadNumber)),
        _ => return Err(err(SizeErrorKind::UnknownUnit(unit.to_string()))),
    };
    scale_decimal(number, multiplier).map_err(err)
}

/// `number * multiplier` for a decimal `number` ("12", "1.5", ".5"), truncated to whole bytes,
/// computed exactly in integers.
fn scale_decimal(number: &str, multiplier: u64) -> Result<u64, SizeErrorKind> {
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    let all_digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if (int_part.is_empty() && frac_part.is_empty())
        || !all_digits(int_part)
        || !all_digits(frac_part)
    {
        return Err(SizeErrorKind::BadNumber);
    }
    let mut whole: u128 = 0;
    for b in int_part.bytes() {
        whole = whole * 10 + u128::from(b - b'0');
        if whole > u128::from(u64::MAX) {
            return Err(SizeErrorKind::TooLarge);
        }
    }
    let mut total = whole * u128::from(multiplier);
    // The fraction only matters up to 1/multiplier; 20 digits is below any unit's resolution.
    let frac = frac_part
        .get(..frac_part.len().min(20))
        .unwrap_or(frac_part);
    if !frac.is_empty() {
        let mut num: u128 = 0;
        let mut den: u128 = 1;
        for b in frac.bytes() {
            num = num * 10 + u128::from(b - b'0');
            den *= 10;
        }
        total += num * u128::from(multiplier) / den;
    }
    u64::try_from(total).map_err(|_| SizeErrorKind::TooLarge)
}

/// A size given as a JSON number: non-negative integers, or floats with no fraction (`4e9`).
pub fn size_from_json_number(n: &serde_json::Number) -> Result<u64, SizeError> {
    if let Some(v) = n.as_u64() {
        return Ok(v);
    }
    let err = |kind| SizeError {
        value: n.to_string(),
        kind,
    };
    if n.as_i64().is_some() {
        return Err(err(SizeErrorKind::Negative));
    }
    match n.as_f64() {
        Some(f) if f < 0.0 => Err(err(SizeErrorKind::Negative)),
        Some(f) if f.fract() != 0.0 => Err(err(SizeErrorKind::Fractional)),
        Some(f) if f < 18_446_744_073_709_551_616.0 => Ok(f as u64),
        _ => Err(err(SizeErrorKind::TooLarge)),
    }
}

/// Renders bytes for humans and logs: the largest binary unit that divides exactly
/// (`"4GiB"`, `"1536MiB"`, `"100B"`). The output parses back with [`parse_size`].
pub fn format_size(bytes: u64) -> String {
    // Every unit is a power of two, so `bytes & (m - 1) == 0` means "divides exactly".
    for (unit, m) in [("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)] {
        if bytes != 0 && bytes & (m - 1) == 0 {
            return format!("{}{unit}", bytes / m);
        }
    }
    format!("{bytes}B")
}

/// serde: accepts a number or a size string (`#[serde(with = "lunakv_config::size")]` or
/// `deserialize_with = "lunakv_config::size::deserialize"`).
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(SizeVisitor)
}

/// serde: writes the size as a plain byte count, which every reader accepts.
pub fn serialize<S: Serializer>(bytes: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(*bytes)
}

struct SizeVisitor;

impl de::Visitor<'_> for SizeVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a size in bytes ({SIZE_EXAMPLES})")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| {
            E::custom(SizeError {
                value: v.to_string(),
                kind: SizeErrorKind::Negative,
            })
        })
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
        match serde_json::Number::from_f64(v) {
            Some(n) => size_from_json_number(&n).map_err(E::custom),
            None => Err(E::custom(SizeError {
                value: v.to_string(),
                kind: SizeErrorKind::BadNumber,
            })),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        parse_size(v).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_table() {
        let table: &[(&str, u64)] = &[
            ("0", 0),
            ("4294967296", 4 << 30),
            ("80GB", 80 << 30),
            ("80gb", 80 << 30),
            ("80Gb", 80 << 30),
            ("4 GB", 4 << 30),
            ("  4 GB  ", 4 << 30),
            ("40GB", 40 << 30),
            ("80GiB", 80 << 30),
            ("80gib", 80 << 30),
            ("512MB", 512 << 20),
            ("512MiB", 512 << 20),
            ("512 mib", 512 << 20),
            ("1KB", 1024),
            ("1KiB", 1024),
            ("1kb", 1024),
            ("100B", 100),
            ("100 b", 100),
            ("2TB", 2 << 40),
            ("2TiB", 2 << 40),
            ("1.5GB", 3 << 29),
            ("0.5KB", 512),
            (".5KB", 512),
            ("1.KB", 1024),
            ("1.1B", 1),
            ("1.3KB", 1331),
            ("18446744073709551615", u64::MAX),
            ("18446744073709551615B", u64::MAX),
        ];
        for (input, want) in table {
            assert_eq!(parse_size(input), Ok(*want), "parse_size({input:?})");
        }
    }

    #[test]
    fn rejects_with_reasons() {
        let table: &[(&str, SizeErrorKind)] = &[
            ("", SizeErrorKind::Empty),
            ("   ", SizeErrorKind::Empty),
            ("-1", SizeErrorKind::Negative),
            ("-4GB", SizeErrorKind::Negative),
            ("GB", SizeErrorKind::BadNumber),
            ("abc", SizeErrorKind::BadNumber),
            (".", SizeErrorKind::BadNumber),
            ("1.2.3GB", SizeErrorKind::BadNumber),
            ("80XB", SizeErrorKind::UnknownUnit("XB".into())),
            ("80G", SizeErrorKind::UnknownUnit("G".into())),
            ("80 GB extra", SizeErrorKind::UnknownUnit("GB extra".into())),
            ("4e9", SizeErrorKind::UnknownUnit("e9".into())),
            ("18446744073709551616", SizeErrorKind::TooLarge),
            ("16777216TB", SizeErrorKind::TooLarge),
            (
                "99999999999999999999999999999999999999999",
                SizeErrorKind::TooLarge,
            ),
        ];
        for (input, kind) in table {
            let err = parse_size(input).expect_err(input);
            assert_eq!(&err.kind, kind, "parse_size({input:?})");
            assert_eq!(err.value, format!("\"{input}\""));
        }
    }

    #[test]
    fn messages_name_the_value_and_show_examples() {
        assert_eq!(
            parse_size("80XB").unwrap_err().to_string(),
            "invalid size \"80XB\": unknown unit \"XB\" (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; all powers of 1024); \
             write a byte count or a number with a unit, e.g. 4294967296, \"80GB\" (= 80 GiB), \"4 GB\", \"512MiB\""
        );
        assert_eq!(
            parse_size("-1").unwrap_err().to_string(),
            format!("invalid size \"-1\": sizes cannot be negative; {SIZE_EXAMPLES}")
        );
        assert_eq!(
            parse_size("").unwrap_err().to_string(),
            format!("invalid size \"\": it is empty; {SIZE_EXAMPLES}")
        );
    }

    #[test]
    fn json_numbers() {
        let n = |s: &str| serde_json::from_str::<serde_json::Number>(s).unwrap();
        assert_eq!(size_from_json_number(&n("4294967296")), Ok(4 << 30));
        assert_eq!(size_from_json_number(&n("4e9")), Ok(4_000_000_000));
        assert_eq!(
            size_from_json_number(&n("-1")).unwrap_err().kind,
            SizeErrorKind::Negative
        );
        assert_eq!(
            size_from_json_number(&n("-1.5")).unwrap_err().kind,
            SizeErrorKind::Negative
        );
        assert_eq!(
            size_from_json_number(&n("1.5")).unwrap_err().kind,
            SizeErrorKind::Fractional
        );
        assert_eq!(
            size_from_json_number(&n("1e30")).unwrap_err().kind,
            SizeErrorKind::TooLarge
        );
    }

    #[derive(Debug, serde::Deserialize, serde::Serialize, PartialEq)]
    struct Holder {
        #[serde(with = "crate::size")]
        size: u64,
    }

    #[test]
    fn serde_accepts_numbers_and_strings() {
        let get = |json: &str| serde_json::from_str::<Holder>(json).map(|h| h.size);
        assert_eq!(get(r#"{"size": 1024}"#).unwrap(), 1024);
        assert_eq!(get(r#"{"size": "80GB"}"#).unwrap(), 80 << 30);
        assert_eq!(get(r#"{"size": "4 GB"}"#).unwrap(), 4 << 30);
        assert_eq!(get(r#"{"size": 4e9}"#).unwrap(), 4_000_000_000);
        let e = get(r#"{"size": "80XB"}"#).unwrap_err().to_string();
        assert!(e.contains("invalid size \"80XB\": unknown unit"), "{e}");
        let e = get(r#"{"size": -5}"#).unwrap_err().to_string();
        assert!(
            e.contains("invalid size -5: sizes cannot be negative"),
            "{e}"
        );
        let e = get(r#"{"size": true}"#).unwrap_err().to_string();
        assert!(e.contains("expected a size in bytes"), "{e}");
        // Through YAML too (the master's config file).
        let y: Holder = serde_norway::from_str("size: 40GB").unwrap();
        assert_eq!(y.size, 40 << 30);
        assert_eq!(
            serde_json::to_string(&Holder { size: 5 }).unwrap(),
            r#"{"size":5}"#
        );
    }

    #[test]
    fn format_round_trips() {
        for (bytes, text) in [
            (4u64 << 30, "4GiB"),
            (1536 << 20, "1536MiB"),
            (100, "100B"),
            (0, "0B"),
            (2 << 40, "2TiB"),
        ] {
            assert_eq!(format_size(bytes), text);
            assert_eq!(parse_size(text), Ok(bytes));
        }
    }
}
