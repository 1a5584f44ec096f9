//! # lunakv-tests
//!
//! Workspace-level end-to-end tests. They start the real binaries (`lunakv-master`,
//! `lunakv-store`, `lunakv`) on loopback with ephemeral ports, read the addresses each one
//! prints once bound, and drive them through the client library and the CLI. This crate's
//! library is the harness; the tests live in `tests/tests/e2e/`, one module per area in one binary.
//!
//! The binaries must be built first (`make test` does `cargo build --bins`); [`bin`] refuses
//! one older than a source it was built from, since `cargo test` does not rebuild them.
//! Processes start through `lunakv_launch`, as `lunakv up` and `lunakv bench` start them.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lunakv_client::{ClientOptions, StoreClient};
use lunakv_launch::{Launch, Process, Signal};

/// Directory holding the workspace's binaries (next to the test executable's `deps/`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .expect("deps dir")
        .parent()
        .expect("profile dir")
        .to_path_buf()
}

/// Root of the workspace this harness was compiled in: its sources are what the binaries it
/// starts must have been built from.
fn workspace_root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Path of one of the workspace's binaries; panics with the fix when it is not built, or when
/// a source file it was built from changed since: `cargo test` does not rebuild the binaries
/// these tests start, and a stale one would test old code. Each binary is judged once per
/// process.
pub fn bin(name: &str) -> PathBuf {
    const FIX: &str = "build the binaries first (`cargo build --bins`, or `make test`)";
    let path = lunakv_launch::find_bin(&bin_dir(), name, FIX).unwrap_or_else(|e| panic!("{e}"));
    assert_fresh(&path, FIX);
    path
}

/// Panics, naming the binary, the newer source and `fix`, when the binary at `path` (one this
/// workspace builds, in any target dir) is older than a source it was built from. Each path is
/// judged once per process.
pub fn assert_fresh(path: &Path, fix: &str) {
    static CHECKED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    if !checked.iter().any(|p| p == path) {
        if let Some(stale) = newer_source(path, workspace_root()) {
            panic!("{} is stale: {stale}; {fix}", path.display());
        }
        checked.push(path.to_path_buf());
    }
}

/// Why a binary is stale: a source newer than it, and which rule found it.
#[derive(Debug, PartialEq)]
struct Stale {
    source: PathBuf,
    /// False when the binary's dep-info was missing or listed another checkout, so every
    /// source of the workspace counted.
    from_dep_info: bool,
}

impl std::fmt::Display for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is newer than the binary", self.source.display())?;
        if !self.from_dep_info {
            write!(
                f,
                " (no dep-info of this checkout beside the binary, so the newest source of \
                 the workspace counts)"
            )?;
        }
        Ok(())
    }
}

/// A source file changed after `bin` was built, if any. The exact list is cargo's dep-info
/// for `bin` (`<bin>.d` beside it: `<bin>: <file> ...`, every local source and build-script
/// input it was built from), so editing a file that `bin` does not use never asks for a rebuild
/// that would not touch it. When that list is missing, or names another checkout (a target dir
/// copied from one), the rule falls back to every `*.rs`, `Cargo.toml` and `*.proto` under
/// `libs/`, `services/`, `tools/`, `proto/` and `Cargo.lock`: never a stale binary passes.
/// Manifests are left out of the exact list on purpose: cargo rebuilds nothing for most
/// manifest edits, and a binary that `cargo build` leaves alone must not fail forever.
fn newer_source(bin: &Path, workspace: &Path) -> Option<Stale> {
    let built = modified(bin)?;
    let newer = |f: &PathBuf| modified(f).is_some_and(|t| t > built);
    let found = |source, from_dep_info| Stale {
        source,
        from_dep_info,
    };
    match dep_info_sources(bin, workspace) {
        Some(files) => files.into_iter().find(newer).map(|f| found(f, true)),
        None => workspace_sources(workspace)
            .into_iter()
            .find(newer)
            .map(|f| found(f, false)),
    }
}

fn modified(p: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The files `<bin>.d` lists, when it exists and every file in it lies in `workspace` or in
/// the target dir `bin` is in (generated code); `None` otherwise.
fn dep_info_sources(bin: &Path, workspace: &Path) -> Option<Vec<PathBuf>> {
    let deps = std::fs::read_to_string(bin.with_extension("d")).ok()?;
    let (_, files) = deps.split_once(": ")?;
    let canonical = |p: &Path| std::fs::canonicalize(p).ok();
    let roots = [canonical(workspace)?, canonical(bin.parent()?)?];
    let files: Vec<PathBuf> = files.split_whitespace().map(PathBuf::from).collect();
    let ours = |f: &PathBuf| canonical(f).is_some_and(|f| roots.iter().any(|r| f.starts_with(r)));
    (!files.is_empty() && files.iter().all(ours)).then_some(files)
}

/// Every file the binaries of `workspace` can be built from: `Cargo.lock`, and each `*.rs`,
/// `Cargo.toml` and `*.proto` under `libs/`, `services/`, `tools/` and `proto/`.
fn workspace_sources(workspace: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if !name.starts_with('.') && name != "target" {
                    walk(&path, out);
                }
            } else if name == "Cargo.toml" || name.ends_with(".rs") || name.ends_with(".proto") {
                out.push(path);
            }
        }
    }
    let mut out = vec![workspace.join("Cargo.lock")];
    for dir in ["libs", "services", "tools", "proto"] {
        walk(&workspace.join(dir), &mut out);
    }
    out
}

/// Runs the `lunakv` CLI against `master` with `args`, `env` added to its environment.
pub fn cli(master: &str, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = std::process::Command::new(bin("lunakv"));
    cmd.args(["--master", master]).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run lunakv")
}

/// The row `name` of `lunakv --json doctor` against `master`, `env` added to its environment.
pub fn doctor_row(master: &str, env: &[(&str, &str)], name: &str) -> serde_json::Value {
    let out = cli(master, &["--json", "doctor"], env);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    v["checks"]
        .as_array()
        .and_then(|rows| rows.iter().find(|c| c["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("doctor has no {name:?} row: {v}"))
}

thread_local! {
    /// Set by [`child_env`]: variables for every process this test thread spawns.
    static CHILD_ENV: RefCell<Vec<(String, String)>> = const { RefCell::new(Vec::new()) };
}

/// Adds `vars` to the environment of every process the calling test thread spawns (through
/// [`Proc::spawn`], so every harness constructor) until the guard drops; an inner guard adds
/// to and overrides an outer one. The process's own environment is never changed.
pub fn child_env(vars: &[(&str, &str)]) -> ChildEnv {
    let before = CHILD_ENV.with(|e| {
        let mut e = e.borrow_mut();
        let before = e.clone();
        e.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        before
    });
    ChildEnv { before }
}

/// Returned by [`child_env`]; restores the previous child environment on drop.
pub struct ChildEnv {
    before: Vec<(String, String)>,
}

impl Drop for ChildEnv {
    fn drop(&mut self) {
        let before = std::mem::take(&mut self.before);
        CHILD_ENV.with(|e| *e.borrow_mut() = before);
    }
}

/// A running child process whose output is captured line by line (a `lunakv_launch::Process`
/// whose waits panic with the process's output instead of returning an error).
pub struct Proc {
    pub name: String,
    p: Process,
}

impl Proc {
    /// Spawns `bin` with `args` and `env`; stdout and stderr are captured (and echoed to stderr
    /// with a prefix when `LUNAKV_TEST_ECHO` is set, to watch a test live).
    pub fn spawn(bin_name: &str, args: &[String], env: &[(&str, &str)]) -> Proc {
        Proc::spawn_path(&bin(bin_name), bin_name, args, env)
    }

    /// [`Proc::spawn`] of the binary at `path` (e.g. another build, for a comparison).
    pub fn spawn_path(path: &Path, bin_name: &str, args: &[String], env: &[(&str, &str)]) -> Proc {
        let mut launch = Launch::new(path)
            .name(bin_name)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .echo(std::env::var_os("LUNAKV_TEST_ECHO").is_some());
        launch = CHILD_ENV.with(|e| {
            e.borrow()
                .iter()
                .fold(launch, |l, (k, v)| l.env(k.as_str(), v.as_str()))
        });
        for (k, v) in env {
            launch = launch.env(k, v);
        }
        let p = launch
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {bin_name}: {e}"));
        Proc {
            name: bin_name.to_owned(),
            p,
        }
    }

    /// Waits for a line containing `needle` and returns it; panics with the output so far when
    /// the process ends or `timeout` passes first.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> String {
        self.p
            .wait_for_line(needle, timeout)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Everything the process printed so far.
    pub fn output(&self) -> String {
        self.p.output()
    }

    pub fn pid(&self) -> u32 {
        self.p.pid()
    }

    /// SIGKILL, and reap.
    pub fn kill9(&mut self) {
        self.p.kill();
    }

    /// SIGTERM, then wait up to `timeout` for a clean exit; returns the exit code (`None` when
    /// it had to be killed, or died of a signal).
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        self.p.terminate(timeout).ok()?.code()
    }

    /// Sends `sig` (e.g. `libc::SIGCONT`) to the process. To pause it, use [`Proc::pause`].
    pub fn signal(&self, sig: i32) {
        let sig = Signal::from_named_raw(sig).unwrap_or_else(|| panic!("signal {sig}"));
        self.p.signal(sig);
    }

    /// SIGSTOP, then waits until every thread of the process has stopped. `kill` returns once
    /// the signal is queued: the process stops only when one of its threads is scheduled and
    /// takes the signal, and its other threads keep running until then. On a loaded machine
    /// that is milliseconds, long enough for a request the test sends "to the paused process"
    /// to be answered before the pause (a paused HA leader then acknowledges a write with its
    /// lease still valid).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let pid = self.p.pid();
        let stopped = wait_until(Duration::from_secs(30), || {
            all_threads_stopped(pid).then_some(())
        });
        assert!(
            stopped.is_some(),
            "{} (pid {pid}) did not stop after SIGSTOP",
            self.name
        );
    }

    /// Waits up to `timeout` for the process to exit on its own; its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        self.p.exit_within(timeout)?.code()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.p.alive()
    }
}

/// Parses `key=value` tokens of a "listening" line (the servers' own parser).
pub use lunakv_launch::fields;

fn addr(line: &str, key: &str) -> SocketAddr {
    let f = fields(line);
    f.get(key)
        .unwrap_or_else(|| panic!("no {key}= in '{line}'"))
        .parse()
        .unwrap_or_else(|e| panic!("bad {key} in '{line}': {e}"))
}

/// A `lunakv-master` on loopback with ephemeral ports and its own data dir.
pub struct Master {
    pub proc: Proc,
    pub rpc: SocketAddr,
    pub admin: SocketAddr,
    pub data_dir: PathBuf,
    extra: Vec<String>,
}

impl Master {
    pub fn start(data_dir: &Path, extra: &[&str]) -> Master {
        Self::start_with(data_dir, extra.iter().map(|s| s.to_string()).collect(), 0)
    }

    fn start_with(data_dir: &Path, extra: Vec<String>, rpc_port: u16) -> Master {
        let mut args = vec![
            "--rpc_address=127.0.0.1".to_owned(),
            format!("--rpc_port={rpc_port}"),
            "--metrics_port=0".to_owned(),
            format!("--data_dir={}", data_dir.display()),
        ];
        args.extend(extra.iter().cloned());
        let proc = Proc::spawn("lunakv-master", &args, &[]);
        let line = proc.wait_for_line("listening", Duration::from_secs(20));
        Master {
            rpc: addr(&line, "rpc"),
            admin: addr(&line, "admin"),
            proc,
            data_dir: data_dir.to_path_buf(),
            extra,
        }
    }

    /// A master on a given rpc port (e.g. one a store-client was already told to use).
    pub fn start_on(data_dir: &Path, extra: &[&str], rpc_port: u16) -> Master {
        Self::start_with(
            data_dir,
            extra.iter().map(|s| s.to_string()).collect(),
            rpc_port,
        )
    }

    /// An HA master (`--enable_ha`) campaigning in the etcd at `etcd_endpoints`.
    pub fn start_ha(data_dir: &Path, etcd_endpoints: &str, extra: &[&str]) -> Master {
        let mut args = vec![
            "--enable_ha=true".to_owned(),
            format!("--etcd_endpoints={etcd_endpoints}"),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start_with(data_dir, args, 0)
    }

    /// `leader` or `follower` (GET /role); `None` when the admin port does not answer (the
    /// process is dead or paused).
    pub fn role(&self) -> Option<String> {
        try_http_get(self.admin, "/role").map(|(_, b)| b.trim().to_owned())
    }

    /// kill -9 and start again on the same rpc port and data dir.
    pub fn restart(&mut self) {
        self.proc.kill9();
        let port = self.rpc.port();
        // The port can linger briefly; retry the bind a few times.
        let next = Self::start_with(&self.data_dir, self.extra.clone(), port);
        *self = next;
    }

    pub fn addr(&self) -> String {
        self.rpc.to_string()
    }

    /// GET on the admin port; returns (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path)
    }

    /// The value of an unlabelled metric from /metrics.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.http_get("/metrics");
        body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
            let (n, v) = l.split_once(' ')?;
            (n == name).then(|| v.trim().parse().ok())?
        })
    }
}

/// A `lunakv-store` owning a DRAM segment.
pub struct Store {
    pub proc: Proc,
    pub transfer: SocketAddr,
    pub admin: Option<SocketAddr>,
}

impl Store {
    pub fn start(master: &str, size: &str, extra: &[&str]) -> Store {
        Store::spawn_until(master, size, extra, "listening")
    }

    /// Spawns a store without waiting for its mount: returns once its ports are bound (the
    /// `lunakv-store bound` line), with the admin port already answering, so a test can watch
    /// it wait for a master that is not up yet. `listening` follows once mounted.
    pub fn spawn_unmounted(master: &str, size: &str, extra: &[&str]) -> Store {
        Store::spawn_until(master, size, extra, "lunakv-store bound")
    }

    /// Spawns a store and reads its addresses from the first line containing `line_word`.
    fn spawn_until(master: &str, size: &str, extra: &[&str], line_word: &str) -> Store {
        let mut args = vec![
            format!("--master_server_address={master}"),
            "--host=127.0.0.1".to_owned(),
            "--port=0".to_owned(),
            "--metrics_port=0".to_owned(),
            format!("--global_segment_size={size}"),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let proc = Proc::spawn("lunakv-store", &args, &[]);
        let line = proc.wait_for_line(line_word, Duration::from_secs(20));
        let f = fields(&line);
        Store {
            transfer: addr(&line, "transfer"),
            admin: f.get("admin").and_then(|a| a.parse().ok()),
            proc,
        }
    }

    /// The segment name the master knows this store by.
    pub fn segment_name(&self) -> String {
        self.transfer.to_string()
    }
}

/// A requester (standalone-store mode) talking to `master`.
pub fn requester(master: &str) -> StoreClient {
    StoreClient::connect(ClientOptions {
        master_server_address: master.to_owned(),
        ..ClientOptions::default()
    })
    .expect("connect requester")
}

/// Same, with shared memory off so bytes move over tcp.
pub fn tcp_requester(master: &str) -> StoreClient {
    StoreClient::connect(ClientOptions {
        master_server_address: master.to_owned(),
        enable_shm: false,
        ..ClientOptions::default()
    })
    .expect("connect requester")
}

/// An embedded-mode client contributing `size` bytes.
pub fn embedded(master: &str, size: u64) -> StoreClient {
    StoreClient::connect(ClientOptions {
        master_server_address: master.to_owned(),
        global_segment_size: size,
        ..ClientOptions::default()
    })
    .expect("connect embedded client")
}

/// Deterministic pseudo-random bytes for `seed`, so every test compares real content.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// GET through lunakv's HTTP client (lunakv-http), for the admin endpoints.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_within(addr, path, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("GET http://{addr}{path} failed"))
}

/// Like [`http_get`], `None` instead of a panic when the listener does not answer within 1 s
/// (a paused or dead process).
pub fn try_http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    get_within(addr, path, Duration::from_secs(1))
}

fn get_within(addr: SocketAddr, path: &str, timeout: Duration) -> Option<(u16, String)> {
    let r = lunakv_http::get_blocking(&format!("http://{addr}{path}"), timeout).ok()?;
    Some((r.status.as_u16(), r.text()))
}

pub use lunakv_meta::testing::free_port;

/// Lines of `output` logged at WARN level (the fmt layer writes the level as ` WARN `, with or
/// without colour codes around it).
pub fn warn_lines(output: &str) -> Vec<&str> {
    output.lines().filter(|l| l.contains("WARN")).collect()
}

/// Whether every thread of process `pid` is in the stopped state (`T` in its
/// `/proc/<pid>/task/<tid>/stat`); false when the process is gone.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            // A thread that exited meanwhile.
            continue;
        };
        // `tid (comm) S ...`: comm may hold spaces and parentheses, the state follows the last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        if state != Some('T') {
            return false;
        }
        any = true;
    }
    any
}

/// Polls `f` until it returns Some or `timeout` passes.
pub fn wait_until<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub mod otlp;
pub mod pd;
pub mod tls;

#[cfg(test)]
mod stale_binary_tests {
    use super::*;
    use std::time::SystemTime;

    fn write_at(path: &Path, at: SystemTime) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, b"x").expect("write");
        std::fs::File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_modified(at))
            .expect("set mtime");
    }

    /// A workspace with one crate, a binary built at `t0 + 10 s` from its sources written at
    /// `t0`, and the binary's path.
    fn workspace(ws: &Path, t0: SystemTime) -> PathBuf {
        for f in [
            "Cargo.lock",
            "libs/a/Cargo.toml",
            "libs/a/src/lib.rs",
            "tools/b/src/main.rs",
        ] {
            write_at(&ws.join(f), t0);
        }
        let bin = ws.join("target/debug/svc");
        write_at(&bin, t0 + Duration::from_secs(10));
        bin
    }

    fn dep_info(bin: &Path, files: &[PathBuf]) {
        let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        let line = format!("{}: {}\n", bin.display(), files.join(" "));
        std::fs::write(bin.with_extension("d"), line).expect("dep-info");
    }

    fn stale(source: PathBuf, from_dep_info: bool) -> Option<Stale> {
        Some(Stale {
            source,
            from_dep_info,
        })
    }

    #[test]
    fn dep_info_names_exactly_the_sources_that_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = dir.path();
        let t0 = SystemTime::now() - Duration::from_secs(60);
        let bin = workspace(ws, t0);
        let (lib, main) = (ws.join("libs/a/src/lib.rs"), ws.join("tools/b/src/main.rs"));
        dep_info(&bin, std::slice::from_ref(&lib));
        assert_eq!(newer_source(&bin, ws), None, "built after every source");
        write_at(&main, t0 + Duration::from_secs(20));
        assert_eq!(
            newer_source(&bin, ws),
            None,
            "a file the binary is not built from"
        );
        write_at(&lib, t0 + Duration::from_secs(20));
        assert_eq!(
            newer_source(&bin, ws),
            stale(lib, true),
            "a source changed after the build"
        );
    }

    #[test]
    fn without_dep_info_of_this_checkout_every_workspace_source_counts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = dir.path();
        let t0 = SystemTime::now() - Duration::from_secs(60);
        let bin = workspace(ws, t0);
        write_at(&ws.join("libs/a/README.md"), t0 + Duration::from_secs(20));
        write_at(&ws.join("tests/src/lib.rs"), t0 + Duration::from_secs(20));
        assert_eq!(newer_source(&bin, ws), None, "no source changed");
        let lock = ws.join("Cargo.lock");
        write_at(&lock, t0 + Duration::from_secs(20));
        assert_eq!(
            newer_source(&bin, ws),
            stale(lock.clone(), false),
            "no dep-info"
        );
        write_at(&lock, t0);

        let elsewhere = tempfile::tempdir().expect("another checkout");
        let theirs = elsewhere.path().join("libs/a/src/lib.rs");
        write_at(&theirs, t0);
        dep_info(&bin, &[theirs]);
        let proto = ws.join("proto/x.proto");
        write_at(&proto, t0 + Duration::from_secs(20));
        assert_eq!(
            newer_source(&bin, ws),
            stale(proto, false),
            "dep-info of another checkout"
        );
    }
}
