//! A real etcd for tests: Debian's `etcd-server` (binary `etcd`) started on an ephemeral client
//! and peer port pair with a temporary data directory, killed on drop. Blocking API, so both
//! async unit tests and the synchronous end-to-end tests can use it.
//!
//! ```no_run
//! let Some(etcd) = lunakv_meta::testing::etcd_or_skip() else { return };
//! let endpoint = etcd.endpoint(); // "127.0.0.1:PORT"
//! ```
//! When etcd is not installed the test fails with the fix (CI installs it). Setting
//! `LUNAKV_SKIP_ETCD=1` explicitly skips etcd tests instead.
//!
//! [`missing_tool`] is the one policy for every external tool a test needs (etcd, kubectl): a
//! missing tool fails the test with what to install, unless `LUNAKV_ALLOW_SKIP=1` is set, when
//! the test prints `SKIPPED` and passes (docs/ARCHITECTURE.md, testing).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why the harness could not start etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdHarnessError {
    #[error(
        "the `etcd` binary was not found on PATH: install Debian's etcd-server \
         (`apt-get install -y etcd-server`; CI's .ci/run does), or set LUNAKV_SKIP_ETCD=1 to skip \
         the etcd tests explicitly"
    )]
    NotInstalled,
    #[error("cannot prepare etcd's data dir or ports: {0}")]
    Io(#[from] std::io::Error),
    #[error("etcd did not become healthy on {endpoint} within {waited:?}; its log:\n{log}")]
    NotHealthy {
        endpoint: String,
        waited: Duration,
        log: String,
    },
}

/// A running etcd; killed (SIGKILL) and its data dir removed on drop.
pub struct EtcdServer {
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    etcd: PathBuf,
}

/// Whether `LUNAKV_ALLOW_SKIP=1` lets a test whose tool is missing pass as skipped.
pub fn skip_allowed() -> bool {
    std::env::var("LUNAKV_ALLOW_SKIP").is_ok_and(|v| v == "1")
}

/// A test found `tool` missing: panics with `install` (how to get it) so the run fails, as in
/// CI, unless [`skip_allowed`], when it prints a `SKIPPED` line and returns so the test can
/// return early.
pub fn missing_tool(test: &str, tool: &str, install: &str) {
    if skip_allowed() {
        println!("SKIPPED {test}: {tool} not found (LUNAKV_ALLOW_SKIP=1); {install}");
        return;
    }
    panic!("{test}: {tool} not found; {install}, or set LUNAKV_ALLOW_SKIP=1 to skip");
}

/// Whether `LUNAKV_SKIP_ETCD=1` asks to skip etcd tests.
pub fn skip_requested() -> bool {
    std::env::var("LUNAKV_SKIP_ETCD").is_ok_and(|v| v == "1")
}

/// Finds `etcd` on PATH (or in /usr/bin, where Debian puts it).
pub fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

/// Starts etcd for a test, `None` when `LUNAKV_SKIP_ETCD=1`. Panics with the fix when etcd is
/// not installed: a missing dependency must fail the suite, not pass it silently (unless
/// `LUNAKV_ALLOW_SKIP=1`: [`missing_tool`]).
pub fn etcd_or_skip() -> Option<EtcdServer> {
    if skip_requested() {
        eprintln!("LUNAKV_SKIP_ETCD=1: skipping this etcd test");
        return None;
    }
    match EtcdServer::start() {
        Ok(e) => Some(e),
        Err(e @ EtcdHarnessError::NotInstalled) => {
            missing_tool("this etcd test", "etcd", &e.to_string());
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    /// Starts a single-member cluster on free loopback ports and waits until it is healthy.
    pub fn start() -> Result<EtcdServer, EtcdHarnessError> {
        let etcd = etcd_binary().ok_or(EtcdHarnessError::NotInstalled)?;
        let mut last = None;
        // Free ports are probed then released, so another process can take one in between:
        // retry with fresh ports a few times.
        for _ in 0..3 {
            let dir = tempfile::Builder::new().prefix("lunakv-etcd-").tempdir()?;
            let mut s = EtcdServer {
                child: None,
                client_port: free_port()?,
                peer_port: free_port()?,
                dir,
                etcd: etcd.clone(),
            };
            match s.launch() {
                Ok(()) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(EtcdHarnessError::NotInstalled))
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn launch(&mut self) -> Result<(), EtcdHarnessError> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(&self.etcd)
            .arg("--name=default")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=default={peer}"))
            .arg("--initial-cluster-state=new")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        let waited = Duration::from_secs(20);
        let deadline = Instant::now() + waited;
        while Instant::now() < deadline {
            if self.healthy() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(_)) = c.try_wait()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        self.kill();
        Err(EtcdHarnessError::NotHealthy {
            endpoint: self.endpoint(),
            waited,
            log: tail(&log, 40),
        })
    }

    /// `127.0.0.1:PORT`, the client endpoint.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// `etcd://127.0.0.1:PORT`, the master address form clients use.
    pub fn etcd_url(&self) -> String {
        format!("etcd://{}", self.endpoint())
    }

    pub fn data_path(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `GET /health` answers `"health":"true"`.
    pub fn healthy(&self) -> bool {
        let url = format!("http://127.0.0.1:{}/health", self.client_port);
        lunakv_http::get_blocking(&url, Duration::from_secs(2))
            .is_ok_and(|r| r.text().contains("\"health\":\"true\""))
    }

    /// SIGKILL and reap; the data dir stays for [`EtcdServer::restart`].
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports and data dir (after [`EtcdServer::kill`]).
    pub fn restart(&mut self) -> Result<(), EtcdHarnessError> {
        self.kill();
        // Flags for an existing member: the data dir already holds the cluster.
        self.launch()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
