//! The one machine-readable line a lunakv server prints on stdout once its listeners are bound:
//! `<service> listening key=value key=value ...`. `lunakv up`, `lunakv bench`, the test harness
//! and the Python tests wait for it and read the addresses from it, so every server prints it
//! through [`announce`] and every reader parses it with [`fields`]. The text is a contract with
//! those readers (and with scripts under deploy/): keys are added, never renamed.
//!
//! It goes to stdout, never through tracing: log lines on stderr may mention "listening" too.

use std::collections::HashMap;
use std::fmt::Display;
use std::io::Write;

/// The line [`announce`] prints, without its newline.
pub fn listening_line(service: &str, fields: &[(&str, &dyn Display)]) -> String {
    let mut line = format!("{service} listening");
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v}"));
    }
    line
}

/// Prints `service`'s listening line on stdout and flushes it (a reader may be a pipe).
pub fn announce(service: &str, fields: &[(&str, &dyn Display)]) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (the reader went away) must not stop the server.
    let _ = writeln!(out, "{}", listening_line(service, fields));
    let _ = out.flush();
}

/// `key=value` tokens of a line; quotes and trailing commas around values are dropped, so a
/// tracing field (`transfer="127.0.0.1:1",`) reads the same as a plain one.
pub fn fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|t| t.split_once('='))
        .map(|(k, v)| {
            (
                k.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                    .to_owned(),
                v.trim_matches(|c| c == '"' || c == ',' || c == '\'')
                    .to_owned(),
            )
        })
        .filter(|(k, v)| !k.is_empty() && !v.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_reads_back() {
        let line = listening_line(
            "lunakv-master",
            &[("rpc", &"127.0.0.1:50051"), ("admin", &"127.0.0.1:9003")],
        );
        assert_eq!(
            line,
            "lunakv-master listening rpc=127.0.0.1:50051 admin=127.0.0.1:9003"
        );
        let f = fields(&line);
        assert_eq!(f["rpc"], "127.0.0.1:50051");
        assert_eq!(f["admin"], "127.0.0.1:9003");
        let f = fields("INFO store listening transfer=\"127.0.0.1:41234\", admin=127.0.0.1:0");
        assert_eq!(f["transfer"], "127.0.0.1:41234");
    }
}
