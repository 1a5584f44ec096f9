//! Progress on stderr while the benchmark runs: every row module reports through it.

use std::io::{IsTerminal, Write};

/// Progress on stderr: a live status line when stderr is a terminal, and in every case one
/// line per finished row, so CI logs and `kubectl logs` show where a long run is (stdout stays
/// the table, or valid JSON with --json).
pub struct Progress {
    enabled: bool,
}

impl Progress {
    pub(super) fn new() -> Progress {
        Progress {
            enabled: std::io::stderr().is_terminal(),
        }
    }

    pub fn show(&self, msg: &str) {
        if self.enabled {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r\x1b[2Kbench: {msg}");
            let _ = e.flush();
        }
    }

    /// A finished row: always printed, as a whole line.
    pub fn done(&self, msg: &str) {
        let mut e = std::io::stderr().lock();
        if self.enabled {
            let _ = write!(e, "\r\x1b[2K");
        }
        let _ = writeln!(e, "bench: done {msg}");
        let _ = e.flush();
    }

    pub(super) fn clear(&self) {
        if self.enabled {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r\x1b[2K");
            let _ = e.flush();
        }
    }
}
