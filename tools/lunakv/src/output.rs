//! Printing results: one JSON object on stdout with `--json`, text otherwise; errors as one line
//! on stderr (plus the JSON object on stdout with `--json`).

use std::io::Write;
use std::process::ExitCode;

use serde::Serialize;

use crate::error::code_of;

/// Exit status of every failure (1 is reserved for `exists` answering "no").
pub const EXIT_ERROR: u8 = 2;

/// Prints `value` as one JSON line on stdout.
pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, value)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

/// Reports `e` and returns the error exit status.
pub fn fail(e: &anyhow::Error, json: bool) -> ExitCode {
    // `{:#}` prints the context chain on one line: "get k: object 'k' not found".
    let message = format!("{e:#}");
    eprintln!("lunakv: error: {message}");
    if json {
        let code = code_of(e);
        let _ = print_json(&serde_json::json!({
            "ok": false,
            "error": message,
            "code": code.as_i32(),
            "code_name": code.name(),
        }));
    }
    ExitCode::from(EXIT_ERROR)
}

/// Bytes for humans: "1.0 GiB", "64.0 KiB", "512 B".
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Standard base64 (RFC 4648, padded); used for binary values in `get --json`.
pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want, "{input}");
        }
        assert_eq!(base64(&[0xff, 0xfe]), "//4=");
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(64 << 10), "64.0 KiB");
        assert_eq!(human_bytes(1 << 30), "1.0 GiB");
        assert_eq!(human_bytes(1536 << 20), "1.5 GiB");
    }
}
