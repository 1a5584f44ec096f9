//! The running child: its output readers, the waits on what it printed, and its stop.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

use crate::{Launch, LaunchError};

/// Lines containing "listening" kept apart from the output buffer (a child prints one; log
/// lines may mention the word too).
const LISTENING_KEPT: usize = 16;
/// How long a child that exited gets for its readers to collect its last words.
const DRAIN: Duration = Duration::from_millis(500);
/// How often a wait looks at whether the child exited while its output stays open (a
/// grandchild may hold the pipe).
const EXIT_POLL: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Output {
    lines: VecDeque<String>,
    /// Lines dropped from the front of `lines` (the keep bound): the index of `lines[0]`.
    dropped: u64,
    listening: Vec<String>,
    /// Output streams still open.
    open: usize,
}

struct Shared {
    out: Mutex<Output>,
    changed: Condvar,
    keep: Option<usize>,
}

impl Shared {
    fn out(&self) -> MutexGuard<'_, Output> {
        // A reader that panicked leaves the lines as they were: still worth reading.
        self.out.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct ChildState {
    child: Child,
    exited: Option<ExitStatus>,
}

impl ChildState {
    fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }
}

/// A started child, its output captured (see the crate docs). Killed on drop.
pub struct Process {
    name: String,
    pid: u32,
    child: Mutex<ChildState>,
    shared: Arc<Shared>,
}

impl Process {
    pub(crate) fn spawn(l: Launch) -> Result<Process, LaunchError> {
        let mut cmd = Command::new(&l.program);
        cmd.args(&l.args)
            .envs(l.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if l.own_group {
            cmd.process_group(0);
        }
        if l.die_with_parent {
            // SAFETY: the closure runs in the forked child before exec and only calls
            // prctl(2), which is async-signal-safe; it touches no memory of the parent.
            unsafe {
                cmd.pre_exec(|| {
                    rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?;
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            path: l.program.clone(),
            source,
        })?;
        let shared = Arc::new(Shared {
            out: Mutex::new(Output {
                open: 2,
                ..Output::default()
            }),
            changed: Condvar::new(),
            keep: l.keep,
        });
        let streams: [Option<Box<dyn Read + Send>>; 2] = [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ];
        for stream in streams {
            let shared = shared.clone();
            let tag = l
                .echo
                .then(|| l.echo_tag.clone().unwrap_or_else(|| l.name.clone()));
            match stream {
                Some(s) => {
                    std::thread::spawn(move || read_lines(s, tag.as_deref(), &shared));
                }
                None => {
                    shared.out().open -= 1;
                }
            }
        }
        Ok(Process {
            name: l.name,
            pid: child.id(),
            child: Mutex::new(ChildState {
                child,
                exited: None,
            }),
            shared,
        })
    }

    /// The name given at launch (the binary's file name by default).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the child's listening line carrying `key=` and returns its fields.
    pub fn wait_announce(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<HashMap<String, String>, LaunchError> {
        let what = format!("its listening line (with {key}=)");
        self.wait_for(&what, timeout, |out| {
            out.listening
                .iter()
                .map(|l| crate::fields(l))
                .find(|f| f.contains_key(key))
        })
    }

    /// Waits for a line containing `needle` (printed before or during the wait) and returns it.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> Result<String, LaunchError> {
        let what = format!("'{needle}'");
        let mut next = 0u64;
        self.wait_for(&what, timeout, |out| {
            let skip = next.saturating_sub(out.dropped) as usize;
            let found = out.lines.iter().skip(skip).find(|l| l.contains(needle));
            next = out.dropped + out.lines.len() as u64;
            found.cloned()
        })
    }

    fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut find: impl FnMut(&Output) -> Option<T>,
    ) -> Result<T, LaunchError> {
        let deadline = Instant::now() + timeout;
        let mut out = self.shared.out();
        loop {
            if let Some(v) = find(&out) {
                return Ok(v);
            }
            let exited = out.open > 0 && {
                drop(out);
                let st = self.try_exit();
                out = self.shared.out();
                st.is_some()
            };
            if out.open == 0 || exited {
                // Its last lines may still be in the pipes: read them before judging.
                out = self.drained(out);
                if let Some(v) = find(&out) {
                    return Ok(v);
                }
                drop(out);
                let how = match self.exit_within(DRAIN) {
                    Some(st) => format!("exited with {st}"),
                    None => "closed its output".to_owned(),
                };
                return Err(LaunchError::Ended {
                    name: self.name.clone(),
                    how,
                    what: what.to_owned(),
                    tail: self.tail(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                drop(out);
                return Err(LaunchError::Timeout {
                    name: self.name.clone(),
                    what: what.to_owned(),
                    timeout,
                    tail: self.tail(),
                });
            }
            out = self.wait_changed(out, deadline.min(now + EXIT_POLL));
        }
    }

    /// `out` once the readers collected what the exited child printed last (its pipes
    /// closed), or after [`DRAIN`] (a grandchild may hold them open).
    fn drained<'a>(&'a self, mut out: MutexGuard<'a, Output>) -> MutexGuard<'a, Output> {
        let until = Instant::now() + DRAIN;
        while out.open > 0 && Instant::now() < until {
            out = self.wait_changed(out, until);
        }
        out
    }

    fn wait_changed<'a>(
        &'a self,
        out: MutexGuard<'a, Output>,
        until: Instant,
    ) -> MutexGuard<'a, Output> {
        let left = until.saturating_duration_since(Instant::now());
        match self.shared.changed.wait_timeout(out, left) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        }
    }

    fn state(&self) -> MutexGuard<'_, ChildState> {
        self.child.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The exit status if the child has exited (reaping it).
    pub fn try_exit(&self) -> Option<ExitStatus> {
        self.state().try_exit()
    }

    /// Whether the child is still running.
    pub fn alive(&self) -> bool {
        self.try_exit().is_none()
    }

    /// Waits up to `timeout` for the child to exit on its own. Once it has, what it printed
    /// last is in [`Process::output`]: a caller that reads the output after the exit would
    /// otherwise race the reader threads for the child's last lines.
    pub fn exit_within(&self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_exit() {
                drop(self.drained(self.shared.out()));
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `sig` (e.g. STOP and CONT to pause a service) unless the child was reaped.
    pub fn signal(&self, sig: Signal) {
        let mut s = self.state();
        if s.try_exit().is_none()
            && let Some(pid) = Pid::from_raw(self.pid as i32)
        {
            let _ = rustix::process::kill_process(pid, sig);
        }
    }

    /// SIGKILL, and reap.
    pub fn kill(&self) -> Option<ExitStatus> {
        let mut s = self.state();
        if s.try_exit().is_none() {
            let _ = s.child.kill();
            s.exited = s.child.wait().ok();
        }
        s.exited
    }

    /// SIGTERM, up to `grace` for the child to exit, then SIGKILL ([`LaunchError::Killed`]).
    pub fn terminate(&self, grace: Duration) -> Result<ExitStatus, LaunchError> {
        if let Some(st) = self.try_exit() {
            return Ok(st);
        }
        self.signal(Signal::TERM);
        if let Some(st) = self.exit_within(grace) {
            return Ok(st);
        }
        self.kill();
        Err(LaunchError::Killed {
            name: self.name.clone(),
            grace,
        })
    }

    /// Every kept line, as printed.
    pub fn output(&self) -> String {
        let out = self.shared.out();
        out.lines
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The kept lines for an error report: indented, terminal colours removed.
    pub fn tail(&self) -> String {
        let out = self.shared.out();
        if out.lines.is_empty() {
            return "  (nothing)".to_owned();
        }
        out.lines
            .iter()
            .map(|l| format!("  {}", strip_ansi(l)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

fn read_lines(stream: Box<dyn Read + Send>, echo: Option<&str>, shared: &Shared) {
    for line in BufReader::new(stream).lines().map_while(Result::ok) {
        if let Some(tag) = echo {
            eprintln!("[{tag}] {line}");
        }
        let mut out = shared.out();
        if line.contains("listening") && out.listening.len() < LISTENING_KEPT {
            out.listening.push(line.clone());
        }
        if shared.keep.is_some_and(|k| out.lines.len() >= k) {
            out.lines.pop_front();
            out.dropped += 1;
        }
        out.lines.push_back(line);
        drop(out);
        shared.changed.notify_all();
    }
    shared.out().open -= 1;
    shared.changed.notify_all();
}

/// Drops ANSI CSI sequences (`ESC [ ... letter`), which tracing adds even on pipes.
pub(crate) fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' && chars.peek() == Some(&'[') {
            chars.next();
            for n in chars.by_ref() {
                if n.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
