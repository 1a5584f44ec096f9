//! Control characters out of log lines.
//!
//! Keys, client ids, segment names and error texts reach the logs from peers. In the text
//! format a value with CR or LF would end the line and let the peer write lines of its own
//! ("... INFO segment mounted" forged after a key), and ESC would drive the reader's terminal.
//! tracing-subscriber escapes some of that in the message only, not in fields such as
//! `key = %key`. So the text format's fields go through [`EscapedFields`]: every control
//! character of every field (message included) is written escaped (`\n`, `\r`, `\t`, `\x1b`,
//! `\u{85}`), whatever the call site wrote, so no call site can forget it. A log line is then
//! always one line. The JSON format needs nothing: JSON strings escape control characters.

use std::fmt::{self, Write};

use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};

/// `c` as it is written into a log line: itself, or an escape when it is a control character.
fn escape_char(out: &mut impl Write, c: char) -> fmt::Result {
    match c {
        '\n' => out.write_str("\\n"),
        '\r' => out.write_str("\\r"),
        '\t' => out.write_str("\\t"),
        c if (c as u32) < 0x20 || c as u32 == 0x7f => write!(out, "\\x{:02x}", c as u32),
        // C1 controls (NEL among them, a line break to some readers).
        c if c.is_control() => write!(out, "\\u{{{:x}}}", c as u32),
        c => out.write_char(c),
    }
}

/// A [`Write`] that passes text on with its control characters escaped.
struct EscapingWriter<'a, W: Write> {
    inner: &'a mut W,
}

impl<W: Write> Write for EscapingWriter<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // Runs without control characters go through in one call.
        let mut rest = s;
        while let Some(i) = rest.find(|c: char| c.is_control()) {
            self.inner.write_str(&rest[..i])?;
            let c = rest[i..].chars().next().unwrap_or_default();
            escape_char(self.inner, c)?;
            rest = &rest[i + c.len_utf8()..];
        }
        self.inner.write_str(rest)
    }
}

/// A peer-supplied string (a key, a client id, a segment name) for a log line or a message,
/// its control characters escaped; for text that does not go through [`EscapedFields`] (a
/// `println!`, an error message that quotes the value).
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        EscapingWriter { inner: f }.write_str(self.0)
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `str`'s Debug escapes control characters already.
        fmt::Debug::fmt(self.0, f)
    }
}

/// The text format's field formatter: tracing-subscriber's own layout (`message key=value
/// ...`), every control character escaped. Field names lose their terminal styling: the
/// formatter writes them without ANSI codes, so any control character left in its output came
/// from a value.
#[derive(Debug, Default, Clone, Copy)]
pub struct EscapedFields;

impl<'writer> FormatFields<'writer> for EscapedFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        let mut escaping = EscapingWriter { inner: &mut writer };
        DefaultFields::new().format_fields(Writer::new(&mut escaping), fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        let s = Escaped("k\nINFO forged\r\x1b[31mred\x1b[0m\t\u{85}é").to_string();
        assert_eq!(s, "k\\nINFO forged\\r\\x1b[31mred\\x1b[0m\\t\\u{85}é");
        assert!(!s.chars().any(char::is_control), "{s}");
        assert_eq!(Escaped("plain key-1").to_string(), "plain key-1");
    }

    #[test]
    fn a_field_with_a_newline_stays_on_its_line() {
        use std::sync::{Arc, Mutex};

        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || out.clone())
            .with_ansi(false)
            .fmt_fields(EscapedFields)
            .finish();
        let key = "evil\n2030-01-01T00:00:00Z ERROR forged\x1b[2J";
        tracing::subscriber::with_default(sub, || {
            let span = tracing::info_span!("put", client = %key);
            let _g = span.enter();
            tracing::info!(key = %key, other = ?key, "message {key}");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.contains('\x1b') && !text.contains('\r'), "{text}");
        assert!(text.contains("key=evil\\n2030"), "{text}");
    }
}
