//! Starting a loopback master + store-client and learning where they listen. Used by `up`
//! (fixed ports, `make run`) and `bench` (ephemeral ports, temp data dir).
//!
//! Each service prints one stdout line containing `listening` and `key=value` tokens once its
//! sockets are bound (`rpc=.. admin=..` for the master, `transfer=.. admin=..` for the store);
//! reading that line is how we learn ephemeral ports without racing the bind. Everything else
//! the children print is forwarded to our stderr with a `[master]`/`[store]` prefix, and the
//! last lines are kept so a child that dies can be reported with what it said.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rustix::process::{Pid, Signal};

/// How long a service may take to print its listening line.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a SIGTERMed service may take to exit (the store unmounts first) before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Lines of a child's output kept for error reports.
const TAIL_LINES: usize = 30;

pub const MASTER_BIN: &str = "lunakv-master";
pub const STORE_BIN: &str = "lunakv-store";

/// The directory holding the service binaries: `explicit` (--bin-dir / LUNAKV_BIN_DIR), else
/// the directory of the running `lunakv` (cargo puts every workspace binary side by side).
pub fn bin_dir(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(d) = explicit {
        return Ok(d.to_path_buf());
    }
    let exe = std::env::current_exe().context("cannot find the running lunakv executable")?;
    Ok(exe.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// `dir/name`, or an error that says how to get it there.
pub fn service_bin(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let p = dir.join(name);
    if !p.is_file() {
        bail!(
            "{name} not found at {}: lunakv starts the {MASTER_BIN} and {STORE_BIN} built next to it; \
             build them with `cargo build --release --bins` (or `make run` / `make bench`), \
             or point --bin-dir / LUNAKV_BIN_DIR at the directory holding them",
            p.display()
        );
    }
    Ok(p)
}

/// What to start. Ports may be 0 (ephemeral); the bound ones are read back.
#[derive(Debug, Clone)]
pub struct StackOptions {
    pub bin_dir: PathBuf,
    pub rpc_port: u16,
    pub master_metrics_port: u16,
    pub data_dir: PathBuf,
    pub store_port: u16,
    pub store_metrics_port: u16,
    /// Passed through to `--global_segment_size` ("1GB").
    pub segment_size: String,
    /// `RUST_LOG` for the children when the caller has none set (None = the services' default).
    pub default_log: Option<&'static str>,
}

/// A running master and store.
pub struct Stack {
    pub master: Service,
    pub store: Service,
    /// `host:port` of the master's gRPC endpoint.
    pub master_rpc: String,
    pub master_admin: Option<String>,
    pub store_transfer: String,
    pub store_admin: Option<String>,
}

impl Stack {
    pub fn start(o: &StackOptions) -> anyhow::Result<Stack> {
        let master_bin = service_bin(&o.bin_dir, MASTER_BIN)?;
        let store_bin = service_bin(&o.bin_dir, STORE_BIN)?;
        std::fs::create_dir_all(&o.data_dir).with_context(|| {
            format!(
                "cannot create the master's data dir {}",
                o.data_dir.display()
            )
        })?;
        let master = Service::spawn(
            "master",
            &master_bin,
            &[
                "--rpc_address=127.0.0.1".to_owned(),
                format!("--rpc_port={}", o.rpc_port),
                format!("--metrics_port={}", o.master_metrics_port),
                format!("--data_dir={}", o.data_dir.display()),
            ],
            o.default_log,
            "rpc",
        )?;
        let master_rpc = master.field("rpc")?.to_owned();
        let master_admin = master.fields.get("admin").cloned();
        let mut store = match Service::spawn(
            "store",
            &store_bin,
            &[
                format!("--master_server_address={master_rpc}"),
                "--host=127.0.0.1".to_owned(),
                format!("--port={}", o.store_port),
                format!("--global_segment_size={}", o.segment_size),
                format!("--metrics_port={}", o.store_metrics_port),
            ],
            o.default_log,
            "transfer",
        ) {
            Ok(s) => s,
            Err(e) => {
                let mut master = master;
                let _ = master.stop();
                return Err(e);
            }
        };
        let store_transfer = store.field("transfer")?.to_owned();
        let store_admin = store.fields.get("admin").cloned();
        // A store that printed its line but then failed to mount dies right after; catch that
        // here rather than on the first put.
        std::thread::sleep(Duration::from_millis(100));
        if let Some(st) = store.try_exit() {
            bail!(
                "{STORE_BIN} exited with {st} right after starting; its last output:\n{}",
                store.tail()
            );
        }
        Ok(Stack {
            master,
            store,
            master_rpc,
            master_admin,
            store_transfer,
            store_admin,
        })
    }

    /// The first service found dead, with its exit status and last output.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        for s in [&mut self.store, &mut self.master] {
            if let Some(st) = s.try_exit() {
                bail!(
                    "{} exited unexpectedly with {st}; its last output:\n{}",
                    s.bin_name,
                    s.tail()
                );
            }
        }
        Ok(())
    }

    /// Store first, with SIGTERM so it unmounts from a master that is still there; then the
    /// master. Returns an error if either did not exit cleanly.
    pub fn stop(mut self) -> anyhow::Result<()> {
        let store = self.store.stop();
        let master = self.master.stop();
        let mut problems = Vec::new();
        for (name, r) in [(STORE_BIN, store), (MASTER_BIN, master)] {
            match r {
                Ok(st) if st.success() => {}
                // A signal-terminated exit is what SIGTERM without a handler looks like.
                Ok(st) if st.code().is_none() => {}
                Ok(st) => problems.push(format!("{name} exited with {st}")),
                Err(e) => problems.push(format!("{name}: {e:#}")),
            }
        }
        if !problems.is_empty() {
            bail!("stopping: {}", problems.join("; "));
        }
        Ok(())
    }
}

/// A child service with its listening fields.
pub struct Service {
    pub bin_name: String,
    child: Child,
    exited: Option<ExitStatus>,
    pub fields: HashMap<String, String>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

enum Event {
    Listening(HashMap<String, String>),
    Closed,
}

impl Service {
    /// Spawns `bin args`, forwards its output, and waits for its listening line carrying
    /// `required_key`.
    fn spawn(
        tag: &'static str,
        bin: &Path,
        args: &[String],
        default_log: Option<&str>,
        required_key: &'static str,
    ) -> anyhow::Result<Service> {
        let bin_name = bin
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: a terminal's Ctrl-C reaches only lunakv, which then stops the
            // store before the master (a master killed first would leave the unmount hanging).
            .process_group(0);
        if std::env::var_os("RUST_LOG").is_none()
            && let Some(level) = default_log
        {
            cmd.env("RUST_LOG", level);
        }
        // SAFETY: the closure runs in the forked child before exec and only calls prctl(2),
        // which is async-signal-safe; it touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                // If lunakv itself dies (kill -9), its services follow instead of lingering on
                // the ports.
                rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?;
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let (tx, rx) = mpsc::channel();
        let streams: [(Box<dyn Read + Send>, bool); 2] = [
            (Box::new(child.stdout.take().context("child stdout")?), true),
            (
                Box::new(child.stderr.take().context("child stderr")?),
                false,
            ),
        ];
        for (stream, is_stdout) in streams {
            let tail = tail.clone();
            let tx = tx.clone();
            std::thread::spawn(move || forward(stream, tag, required_key, is_stdout, &tail, &tx));
        }
        drop(tx);

        let mut svc = Service {
            bin_name,
            child,
            exited: None,
            fields: HashMap::new(),
            tail,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        let mut open_streams = 2;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Event::Listening(f)) => {
                    svc.fields = f;
                    return Ok(svc);
                }
                Ok(Event::Closed) => open_streams -= 1,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => open_streams = 0,
            }
            if let Some(st) = svc.try_exit() {
                // Give the readers a moment to collect the last words.
                std::thread::sleep(Duration::from_millis(50));
                bail!(
                    "{} exited with {st} before it was listening; its last output:\n{}",
                    svc.bin_name,
                    svc.tail()
                );
            }
            if open_streams == 0 || Instant::now() > deadline {
                let _ = svc.stop();
                bail!(
                    "{} did not print its listening line (with {required_key}=) within {START_TIMEOUT:?}; its last output:\n{}",
                    svc.bin_name,
                    svc.tail()
                );
            }
        }
    }

    /// A field of the listening line, or an error naming the line's keys.
    pub fn field(&self, key: &str) -> anyhow::Result<&str> {
        match self.fields.get(key) {
            Some(v) => Ok(v),
            None => bail!(
                "{} printed no {key}= in its listening line (keys: {:?})",
                self.bin_name,
                self.fields.keys().collect::<Vec<_>>()
            ),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the child has exited (reaping it).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// The last lines the child printed.
    pub fn tail(&self) -> String {
        let t = self
            .tail
            .lock()
            .map(|t| t.iter().cloned().collect::<Vec<_>>())
            .unwrap_or_default();
        if t.is_empty() {
            "  (nothing)".to_owned()
        } else {
            t.iter()
                .map(|l| format!("  {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
    }

    /// SIGTERM, wait up to [`STOP_GRACE`], then SIGKILL.
    pub fn stop(&mut self) -> anyhow::Result<ExitStatus> {
        if let Some(st) = self.try_exit() {
            return Ok(st);
        }
        if let Some(pid) = Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, Signal::TERM);
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Some(st) = self.try_exit() {
                return Ok(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let st = self.child.wait().context("waiting for a killed child")?;
        self.exited = Some(st);
        bail!(
            "{} did not exit within {STOP_GRACE:?} of SIGTERM and was killed",
            self.bin_name
        )
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // Error paths drop services without stop(): never leave one running on the ports.
        if self.try_exit().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn forward(
    stream: Box<dyn Read + Send>,
    tag: &str,
    required_key: &str,
    is_stdout: bool,
    tail: &Mutex<VecDeque<String>>,
    tx: &mpsc::Sender<Event>,
) {
    let mut announced = false;
    for line in BufReader::new(stream).lines().map_while(Result::ok) {
        if !announced && line.contains("listening") {
            let f = listening_fields(&line);
            // Log lines on stderr may mention "listening" too; the announcement is the stdout
            // line, or any line carrying the key we wait for.
            if is_stdout || f.contains_key(required_key) {
                announced = f.contains_key(required_key);
                if announced {
                    let _ = tx.send(Event::Listening(f));
                }
            }
        }
        eprintln!("[{tag}] {line}");
        if let Ok(mut t) = tail.lock() {
            if t.len() == TAIL_LINES {
                t.pop_front();
            }
            // Error reports are read as plain text; the colours were for a terminal.
            t.push_back(strip_ansi(&line));
        }
    }
    let _ = tx.send(Event::Closed);
}

/// Drops ANSI CSI sequences (`ESC [ ... letter`), which tracing adds even on pipes.
fn strip_ansi(line: &str) -> String {
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

/// `key=value` tokens of a listening line (the one parser, shared with the servers' tests).
pub use lunakv_telemetry::announce::fields as listening_fields;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_listening_lines() {
        let f =
            listening_fields("lunakv-master listening rpc=127.0.0.1:50051 admin=127.0.0.1:9003");
        assert_eq!(f["rpc"], "127.0.0.1:50051");
        assert_eq!(f["admin"], "127.0.0.1:9003");
        let f = listening_fields(
            "INFO store listening transfer=\"127.0.0.1:41234\", admin=127.0.0.1:0",
        );
        assert_eq!(f["transfer"], "127.0.0.1:41234");
        assert!(listening_fields("listening").is_empty());
    }

    #[test]
    fn strips_colours_from_kept_lines() {
        assert_eq!(
            strip_ansi("\x1b[2mts\x1b[0m \x1b[32m INFO\x1b[0m up"),
            "ts  INFO up"
        );
        assert_eq!(strip_ansi("plain"), "plain");
    }

    #[test]
    fn missing_binaries_name_the_path_and_the_fix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = service_bin(dir.path(), MASTER_BIN).expect_err("missing");
        let msg = err.to_string();
        assert!(
            msg.contains(&dir.path().join(MASTER_BIN).display().to_string()),
            "{msg}"
        );
        assert!(msg.contains("cargo build"), "{msg}");
    }
}
