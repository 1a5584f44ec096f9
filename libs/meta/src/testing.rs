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
//! [`EtcdServer::start_tls`] serves clients over TLS (optionally requiring client
//! certificates) and [`EtcdServer::enable_auth`] turns on etcd's users with Debian's `etcdctl`
//! (package etcd-client), as an operator would. Health is always asked on a separate plain-http
//! metrics listener, so it works whatever the client listener requires.
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
    #[error(
        "`etcdctl` was not found on PATH: install Debian's etcd-client \
         (`apt-get install -y etcd-client`; CI's .ci/run does)"
    )]
    NoEtcdctl,
    #[error("etcdctl {args} failed: {output}")]
    Etcdctl { args: String, output: String },
    #[error("etcd did not become healthy on {endpoint} within {waited:?}; its log:\n{log}")]
    NotHealthy {
        endpoint: String,
        waited: Duration,
        log: String,
    },
}

/// TLS for a test etcd's client listener (PEM files).
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    /// The CA that signed `cert` and, with client-cert auth, the clients' certificates.
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// `Some((cert, key))`: etcd runs with `--client-cert-auth`, and the harness's own etcdctl
    /// calls present this certificate.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// A running etcd; killed (SIGKILL) and its data dir removed on drop.
pub struct EtcdServer {
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    dir: tempfile::TempDir,
    etcd: PathBuf,
    tls: Option<EtcdTlsFiles>,
    extra: Vec<String>,
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

/// A port on 127.0.0.1 that nothing listens on, for a process that must be told its port
/// before it starts (or a peer's, before the peer exists). Probed and released: another process
/// could take it in between, rare enough on a test machine; where a process can bind port 0
/// and report the port, prefer that. The one probe of the workspace's tests (lunakv-tests
/// re-exports it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.0.0.1")
        .port()
}

impl EtcdServer {
    /// Starts a single-member cluster on free loopback ports and waits until it is healthy.
    pub fn start() -> Result<EtcdServer, EtcdHarnessError> {
        EtcdServer::start_inner(None, &[])
    }

    /// [`EtcdServer::start`] with extra etcd flags (e.g. `--auth-token-ttl=1`).
    pub fn start_with_args(args: &[&str]) -> Result<EtcdServer, EtcdHarnessError> {
        EtcdServer::start_inner(None, args)
    }

    /// [`EtcdServer::start`] with a TLS client listener (`https://127.0.0.1:PORT`).
    pub fn start_tls(tls: EtcdTlsFiles) -> Result<EtcdServer, EtcdHarnessError> {
        EtcdServer::start_inner(Some(tls), &[])
    }

    fn start_inner(
        tls: Option<EtcdTlsFiles>,
        extra: &[&str],
    ) -> Result<EtcdServer, EtcdHarnessError> {
        let etcd = etcd_binary().ok_or(EtcdHarnessError::NotInstalled)?;
        let mut last = None;
        // Free ports are probed then released, so another process can take one in between:
        // retry with fresh ports a few times.
        for _ in 0..3 {
            let dir = tempfile::Builder::new().prefix("lunakv-etcd-").tempdir()?;
            let mut s = EtcdServer {
                child: None,
                client_port: free_port(),
                peer_port: free_port(),
                metrics_port: free_port(),
                dir,
                etcd: etcd.clone(),
                tls: tls.clone(),
                extra: extra.iter().map(|s| s.to_string()).collect(),
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
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut tls_args = Vec::new();
        if let Some(t) = &self.tls {
            tls_args.push(format!("--cert-file={}", t.cert.display()));
            tls_args.push(format!("--key-file={}", t.key.display()));
            if t.client.is_some() {
                tls_args.push("--client-cert-auth".to_string());
                tls_args.push(format!("--trusted-ca-file={}", t.ca.display()));
            }
        }
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
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{}",
                self.metrics_port
            ))
            .args(&tls_args)
            .args(&self.extra)
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

    /// Runs `etcdctl` against this etcd (with the harness's TLS files and `user`, if given).
    pub fn etcdctl(&self, user: Option<&str>, args: &[&str]) -> Result<String, EtcdHarnessError> {
        let etcdctl = self
            .etcd
            .with_file_name("etcdctl")
            .is_file()
            .then(|| self.etcd.with_file_name("etcdctl"))
            .or_else(|| {
                let path = std::env::var_os("PATH").unwrap_or_default();
                std::env::split_paths(&path)
                    .map(|d| d.join("etcdctl"))
                    .find(|p| p.is_file())
            })
            .ok_or(EtcdHarnessError::NoEtcdctl)?;
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut cmd = Command::new(etcdctl);
        cmd.env("ETCDCTL_API", "3").arg(format!(
            "--endpoints={scheme}://127.0.0.1:{}",
            self.client_port
        ));
        if let Some(t) = &self.tls {
            cmd.arg(format!("--cacert={}", t.ca.display()));
            if let Some((c, k)) = &t.client {
                cmd.arg(format!("--cert={}", c.display()));
                cmd.arg(format!("--key={}", k.display()));
            }
        }
        if let Some(u) = user {
            cmd.arg(format!("--user={u}"));
        }
        let out = cmd.args(args).stdin(Stdio::null()).output()?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            return Err(EtcdHarnessError::Etcdctl {
                args: args.join(" "),
                output: text,
            });
        }
        Ok(text)
    }

    /// Turns on etcd's authentication as an operator does: a `root` user (password
    /// `root_password`), then `user` (password `password`) whose role may read and write keys
    /// under `prefix` only.
    pub fn enable_auth(
        &self,
        root_password: &str,
        user: &str,
        password: &str,
        prefix: &str,
    ) -> Result<(), EtcdHarnessError> {
        let root = format!("root:{root_password}");
        self.etcdctl(None, &["user", "add", &root])?;
        // etcd 3.4 wants the root role granted before `auth enable`; newer etcds create it.
        let _ = self.etcdctl(None, &["role", "add", "root"]);
        self.etcdctl(None, &["user", "grant-role", "root", "root"])?;
        self.etcdctl(None, &["auth", "enable"])?;
        let r = Some(root.as_str());
        let role = format!("{user}-rw");
        self.etcdctl(r, &["role", "add", &role])?;
        self.etcdctl(
            r,
            &[
                "role",
                "grant-permission",
                &role,
                "--prefix=true",
                "readwrite",
                prefix,
            ],
        )?;
        self.etcdctl(r, &["user", "add", &format!("{user}:{password}")])?;
        self.etcdctl(r, &["user", "grant-role", user, &role])?;
        Ok(())
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

    /// `GET /health` (on the metrics listener) answers `"health":"true"`.
    pub fn healthy(&self) -> bool {
        let url = format!("http://127.0.0.1:{}/health", self.metrics_port);
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
