//! # lunakv-tests
//!
//! Workspace-level end-to-end tests. They start the real binaries (`lunakv-master`,
//! `lunakv-store`, `lunakv`) on loopback with ephemeral ports, read the addresses each one
//! prints once bound, and drive them through the client library and the CLI. This crate's
//! library is the harness; the tests live in `tests/tests/e2e/`, one module per area in one binary.
//!
//! The binaries must be built first (`make test` does `cargo build --bins`).
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

/// Path of one of the workspace's binaries; panics with the fix when it is not built, or when
/// a source file it was built from changed since: `cargo test` does not rebuild the binaries
/// these tests start, and a stale one would test old code.
pub fn bin(name: &str) -> PathBuf {
    const FIX: &str = "build the binaries first (`cargo build --bins`, or `make test`)";
    let path = lunakv_launch::find_bin(&bin_dir(), name, FIX).unwrap_or_else(|e| panic!("{e}"));
    static CHECKED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    let mut checked = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    if !checked.contains(&path) {
        if let Some(source) = newer_source(&path) {
            panic!(
                "{} is older than {}, one of its sources: {FIX}",
                path.display(),
                source.display()
            );
        }
        checked.push(path.clone());
    }
    path
}

/// A source file that cargo's dep-info for `bin` (`<bin>.d` beside it: `<bin>: <file> ...`)
/// lists and that changed after `bin` was built; `None` when there is none or no dep-info.
fn newer_source(bin: &Path) -> Option<PathBuf> {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let built = modified(bin)?;
    let deps = std::fs::read_to_string(bin.with_extension("d")).ok()?;
    let (_, files) = deps.split_once(": ")?;
    files
        .split_whitespace()
        .map(PathBuf::from)
        .find(|f| modified(f).is_some_and(|t| t > built))
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

    /// Sends `sig` (e.g. `libc::SIGSTOP`, `libc::SIGCONT`) to the process.
    pub fn signal(&self, sig: i32) {
        let sig = Signal::from_named_raw(sig).unwrap_or_else(|| panic!("signal {sig}"));
        self.p.signal(sig);
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

/// A port on 127.0.0.1 that nothing listens on (probed and released: another process could
/// take it in between, rare enough on a test machine).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Lines of `output` logged at WARN level (the fmt layer writes the level as ` WARN `, with or
/// without colour codes around it).
pub fn warn_lines(output: &str) -> Vec<&str> {
    output.lines().filter(|l| l.contains("WARN")).collect()
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

/// Serialises the heaviest tests of one test binary (three masters, two stores and etcd on two
/// cores): they assert on failover behaviour, which CPU starvation from a sibling test distorts.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod stale_binary_tests {
    use super::*;
    use std::time::SystemTime;

    fn touch(path: &Path, at: SystemTime) {
        std::fs::File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_modified(at))
            .expect("set mtime");
    }

    #[test]
    fn a_binary_older_than_one_of_its_sources_is_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (bin, src, other) = (
            dir.path().join("svc"),
            dir.path().join("lib.rs"),
            dir.path().join("main.rs"),
        );
        for p in [&bin, &src, &other] {
            std::fs::write(p, b"x").expect("write");
        }
        std::fs::write(
            bin.with_extension("d"),
            format!("{}: {} {}\n", bin.display(), other.display(), src.display()),
        )
        .expect("dep-info");
        let t0 = SystemTime::now() - Duration::from_secs(60);
        touch(&other, t0);
        touch(&src, t0);
        touch(&bin, t0 + Duration::from_secs(10));
        assert_eq!(newer_source(&bin), None, "built after every source");
        touch(&src, t0 + Duration::from_secs(20));
        assert_eq!(
            newer_source(&bin),
            Some(src),
            "a source changed after the build"
        );
        std::fs::remove_file(bin.with_extension("d")).expect("rm");
        assert_eq!(newer_source(&bin), None, "no dep-info: nothing to judge");
    }
}
