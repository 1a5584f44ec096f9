//! # lunakv-launch
//!
//! Starting a lunakv binary and learning where it listens: the one way `lunakv up`,
//! `lunakv bench` and the test harness (also the P/D tests) run the services.
//!
//! - [`Launch`] says what to run: the binary, its arguments and environment, whether its output
//!   is echoed to our stderr as `[name] line`, how many lines are kept, and (for `lunakv up`)
//!   whether it gets its own process group and dies with its parent.
//! - [`Process`] is the running child. Two threads read its stdout and stderr line by line into
//!   a buffer, so a child never blocks on a full pipe and a failure can quote what it said.
//!   [`Process::wait_announce`] waits for its `listening` line (printed through
//!   `lunakv_telemetry::announce`) and parses it with `lunakv_telemetry::announce::fields`;
//!   ports given as 0 are read back from it without racing the bind.
//!   [`Process::wait_for_line`] waits for any other line.
//! - A child is killed when its [`Process`] drops, so an error path never leaves a service on
//!   its ports; [`Process::terminate`] is the graceful stop (SIGTERM, then SIGKILL).
//! - [`find_bin`] names the binary and the fix when it is not built.
//!
//! Every wait is bounded and ends early, with the child's last output, when the child exits
//! or closes its output.

mod process;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use lunakv_telemetry::announce::fields;
pub use process::Process;
pub use rustix::process::Signal;

/// What a failed start, wait or stop says: the binary, what was expected, and the child's last
/// output where it has any.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{name} not found at {}: {fix}", path.display())]
    NotFound {
        name: String,
        path: PathBuf,
        fix: String,
    },
    #[error("cannot start {}: {source}", path.display())]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{name} {how} before it printed {what}; its last output:\n{tail}")]
    Ended {
        name: String,
        /// "exited with `<status>`", or "closed its output".
        how: String,
        what: String,
        tail: String,
    },
    #[error("{name} did not print {what} within {timeout:?}; its last output:\n{tail}")]
    Timeout {
        name: String,
        what: String,
        timeout: Duration,
        tail: String,
    },
    #[error("{name} did not exit within {grace:?} of SIGTERM and was killed")]
    Killed { name: String, grace: Duration },
}

/// `dir/name`, or [`LaunchError::NotFound`] naming the path and `fix` (how to build it or
/// where to point).
pub fn find_bin(dir: &Path, name: &str, fix: &str) -> Result<PathBuf, LaunchError> {
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(LaunchError::NotFound {
            name: name.to_owned(),
            path,
            fix: fix.to_owned(),
        })
    }
}

/// What to run; [`Launch::spawn`] starts it.
#[derive(Debug, Clone)]
pub struct Launch {
    program: PathBuf,
    name: String,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    echo: bool,
    echo_tag: Option<String>,
    keep: Option<usize>,
    own_group: bool,
    die_with_parent: bool,
}

impl Launch {
    /// Runs `program`; its file name names it in echoed lines and errors.
    pub fn new(program: impl Into<PathBuf>) -> Launch {
        let program = program.into();
        let name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Launch {
            program,
            name,
            args: Vec::new(),
            env: Vec::new(),
            echo: false,
            echo_tag: None,
            keep: None,
            own_group: false,
            die_with_parent: false,
        }
    }

    /// The name in echoed lines (`[name] ...`) and errors.
    pub fn name(mut self, name: impl Into<String>) -> Launch {
        self.name = name.into();
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Launch
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets one variable in the child's environment (which otherwise is ours).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Launch {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Echoes every line the child prints to our stderr as `[name] line`.
    pub fn echo(mut self, on: bool) -> Launch {
        self.echo = on;
        self
    }

    /// Echoes every line as `[tag] line` (a short tag where the name is long).
    pub fn echo_as(mut self, tag: impl Into<String>) -> Launch {
        self.echo = true;
        self.echo_tag = Some(tag.into());
        self
    }

    /// Keeps only the last `n` lines (default: all). A long-running child (`lunakv up`) needs
    /// a bound; its listening line is kept apart, so a bound never hides it.
    pub fn keep_lines(mut self, n: usize) -> Launch {
        self.keep = Some(n.max(1));
        self
    }

    /// Puts the child in a process group of its own, so a terminal's Ctrl-C reaches only us
    /// and we stop the children in our order.
    pub fn own_process_group(mut self) -> Launch {
        self.own_group = true;
        self
    }

    /// SIGTERM to the child when we die (even by kill -9), instead of it lingering on its
    /// ports.
    pub fn die_with_parent(mut self) -> Launch {
        self.die_with_parent = true;
        self
    }

    /// Starts the child with stdin closed and its output captured.
    pub fn spawn(self) -> Result<Process, LaunchError> {
        Process::spawn(self)
    }
}

#[cfg(test)]
mod tests;
