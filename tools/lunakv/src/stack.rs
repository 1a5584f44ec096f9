//! Starting a loopback master + store-client and learning where they listen. Used by `up`
//! (fixed ports, `make run`) and `bench` (ephemeral ports, temp data dir).
//!
//! Each service prints one stdout line containing `listening` and `key=value` tokens once its
//! sockets are bound (`rpc=.. admin=..` for the master, `transfer=.. admin=..` for the store);
//! reading that line is how we learn ephemeral ports without racing the bind. Everything else
//! the children print is forwarded to our stderr with a `[master]`/`[store]` prefix, and the
//! last lines are kept so a child that dies can be reported with what it said. Starting,
//! reading and stopping go through `lunakv_launch`, as in the test harness.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::{Context, bail};
use lunakv_launch::{Launch, Process};

/// How long a service may take to print its listening line.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a SIGTERMed service may take to exit (the store unmounts first) before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
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
    Ok(lunakv_launch::find_bin(
        dir,
        name,
        &format!(
            "lunakv starts the {MASTER_BIN} and {STORE_BIN} built next to it; \
             build them with `cargo build --release --bins` (or `make run` / `make bench`), \
             or point --bin-dir / LUNAKV_BIN_DIR at the directory holding them"
        ),
    )?)
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
    /// The master's admin port serves HTTPS (`LUNAKV_ADMIN_TLS`: `admin_tls=https` in its line).
    pub master_admin_https: bool,
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
        let master_admin_https = master.fields.contains_key("admin_tls");
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
            master_admin_https,
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
    proc: Process,
    pub fields: HashMap<String, String>,
}

impl Service {
    /// Spawns `bin args`, forwards its output as `[tag] line`, and waits for its listening
    /// line carrying `required_key`.
    fn spawn(
        tag: &'static str,
        bin: &Path,
        args: &[String],
        default_log: Option<&str>,
        required_key: &'static str,
    ) -> anyhow::Result<Service> {
        let mut launch = Launch::new(bin)
            .args(args)
            .echo_as(tag)
            .keep_lines(TAIL_LINES)
            // A terminal's Ctrl-C reaches only lunakv, which then stops the store before the
            // master (a master killed first would leave the unmount hanging).
            .own_process_group()
            // If lunakv itself dies (kill -9), its services follow instead of lingering on the
            // ports.
            .die_with_parent();
        if std::env::var_os("RUST_LOG").is_none()
            && let Some(level) = default_log
        {
            launch = launch.env("RUST_LOG", level);
        }
        let proc = launch.spawn()?;
        let bin_name = proc.name().to_owned();
        match proc.wait_announce(required_key, START_TIMEOUT) {
            Ok(fields) => Ok(Service {
                bin_name,
                proc,
                fields,
            }),
            Err(e) => {
                let _ = proc.terminate(STOP_GRACE);
                Err(e.into())
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
        self.proc.pid()
    }

    /// The exit status if the child has exited (reaping it).
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        self.proc.try_exit()
    }

    /// The last lines the child printed.
    pub fn tail(&self) -> String {
        self.proc.tail()
    }

    /// SIGTERM, wait up to [`STOP_GRACE`], then SIGKILL. Dropping a service kills it, so an
    /// error path never leaves one running on the ports.
    pub fn stop(&mut self) -> anyhow::Result<ExitStatus> {
        Ok(self.proc.terminate(STOP_GRACE)?)
    }
}

/// `key=value` tokens of a listening line (the one parser, shared with the servers' tests).
pub use lunakv_launch::fields as listening_fields;

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
