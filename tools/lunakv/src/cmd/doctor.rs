//! `lunakv doctor`: proves that the pool works end to end, not just that every pod is Ready
//! (upstream llm-d warns an all-Ready cluster does not prove the Store works).
//!
//! One row per check, `pass` / `fail` / `skip`; every failure carries its fix. A check whose
//! input was not given (`--bootstrap`, `--sidecar-args` with `--kv-transfer-config`, ...) is
//! `skip` with the reason. Exit status: 0 when nothing failed, 1 when a check failed, 2 when
//! doctor itself could not run (bad arguments). docs/DOCTOR.md explains each check.

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use lunakv_client::{ClientError, ReplicateConfig, StoreClient};
use lunakv_client::{ClusterStatus, NamespaceStats, SegmentStatus};
use lunakv_config::MooncakeConfig;
use serde::Serialize;

use crate::args::DoctorArgs;
use crate::output::{human_bytes, print_json};
use crate::target::Target;

/// The message of the cross-instance rule (the master's, word for word).
pub const UNSHARED_MESSAGE: &str = lunakv_config::messages::UNSHARED_NAMESPACE;

/// Exit status when at least one check failed.
pub const EXIT_CHECK_FAILED: u8 = 1;

/// Size of the SSD probe object.
const PROBE_BYTES: usize = 256 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Fail,
    Skip,
    /// Works, but not as configured (e.g. rdma asked, tcp served); does not fail the run.
    Warn,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail => "fail",
            Outcome::Skip => "skip",
            Outcome::Warn => "warn",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Stable id (`master`, `store_clients`, ...), for scripts reading `--json`.
    pub name: &'static str,
    pub status: Outcome,
    /// What was seen (pass), what is wrong (fail), or why the check did not run (skip).
    pub detail: String,
    /// How to fix a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn pass(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Outcome::Pass,
            detail: detail.into(),
            fix: None,
        }
    }

    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Outcome::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Outcome::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    fn skip(name: &'static str, why: impl Into<String>) -> Check {
        Check {
            name,
            status: Outcome::Skip,
            detail: why.into(),
            fix: None,
        }
    }
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    ok: bool,
    master: &'a str,
    checks: &'a [Check],
}

/// Runs every check and prints the table (or one JSON object).
pub fn run(
    a: &DoctorArgs,
    master_flag: &Option<String>,
    config: &Option<PathBuf>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut checks = Vec::new();
    // The engine config is an input to check, not a reason to stop: a bad file is a failed row.
    let loaded = match config {
        None => None,
        Some(p) => match MooncakeConfig::load(p, &|_: &str| None::<String>) {
            Ok(l) => Some(l),
            Err(e) => {
                checks.push(Check::fail(
                    "engine_config",
                    format!("{}: {e}", p.display()),
                    "fix the engine's mooncake_config.json (the file MOONCAKE_CONFIG_PATH names) \
                     as the message says",
                ));
                None
            }
        },
    };
    match (&loaded, config) {
        (Some(l), Some(p)) => {
            let e = &l.config;
            let seen = format!(
                "{}: valid, mode {}, enable_offload={}",
                p.display(),
                e.mode.as_str(),
                e.enable_offload
            );
            // The other commands keep quiet about how the engine's pool is set up (they only
            // make requests); this is where its connector's warnings belong.
            checks.push(if l.warnings.is_empty() {
                Check::pass("engine_config", seen)
            } else {
                let ws: Vec<String> = l.warnings.iter().map(ToString::to_string).collect();
                Check::warn(
                    "engine_config",
                    format!("{seen}; {}", ws.join("; ")),
                    "change mooncake_config.json as each warning says (the engine's connector \
                     logs the same at startup), or keep it if that is the setup you want",
                )
            })
        }
        (None, None) => checks.push(Check::skip(
            "engine_config",
            "no --config (the engine's mooncake_config.json) given",
        )),
        _ => {}
    }
    let engine = loaded.map(|l| l.config);
    let usable_config = if engine.is_some() {
        config.clone()
    } else {
        None
    };
    let target = crate::target::resolve_cli(master_flag, &usable_config)?;

    let (client, status) = match crate::cmd::kv::connect(&target) {
        Ok(c) => {
            let s = c.cluster_status().map_err(MasterError::Status);
            (Some(c), s)
        }
        Err(e) => (None, Err(MasterError::Connect(e))),
    };

    let purpose = Purpose::of(a);
    checks.push(check_master(&target, &status, &purpose));
    let (client, status) = match (client, status) {
        (Some(c), Ok(s)) => (Some(c), Some(s)),
        _ => (None, None),
    };
    checks.push(check_store_clients(a, status.as_ref()));
    checks.push(check_protocol(status.as_ref()));
    checks.push(check_offload_write(a, client.as_ref(), status.as_ref()));
    checks.push(check_offload_config(
        engine.as_ref(),
        config,
        status.as_ref(),
    ));
    checks.push(check_bootstrap(a));
    checks.push(check_connectors(a));
    checks.push(check_vllm_stats(a));
    checks.push(check_key_consistency(client.as_ref()));
    let anonymous = client.as_ref().map(|c| {
        c.master_refuses_anonymous()
            .map_err(|e| Unanswered(e.to_string()))
    });
    // What the master's RPC port requires, asked in plaintext: also when this doctor could not
    // connect (a master with mTLS refuses a doctor without a certificate).
    let rpc_addr = client
        .as_ref()
        .map(|c| c.master_addr())
        .or_else(|| (!target.master.trim().starts_with("etcd://")).then(|| target.master.clone()));
    let tls = rpc_addr.map(|a| {
        lunakv_master_client::probe_master_tls(&a, std::time::Duration::from_secs(5))
            .map_err(|e| Unanswered(e.to_string()))
    });
    checks.push(check_security(
        &target.master,
        &lunakv_config::process_env,
        anonymous.as_ref(),
        tls.as_ref(),
    ));

    let failed = checks.iter().any(|c| c.status == Outcome::Fail);
    if json {
        print_json(&Report {
            ok: !failed,
            master: &target.master,
            checks: &checks,
        })?;
    } else {
        print!("{}", render(&target.master, &checks));
    }
    Ok(if failed {
        ExitCode::from(EXIT_CHECK_FAILED)
    } else {
        ExitCode::SUCCESS
    })
}

fn render(master: &str, checks: &[Check]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "lunakv doctor: master {master}\n");
    let w = checks
        .iter()
        .map(|c| c.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(o, "{:<w$}  RESULT  DETAIL", "CHECK");
    for c in checks {
        let _ = writeln!(o, "{:<w$}  {:<6}  {}", c.name, c.status.as_str(), c.detail);
        if let Some(f) = &c.fix {
            let _ = writeln!(o, "{:<w$}          fix: {f}", "");
        }
    }
    let failed = checks.iter().filter(|c| c.status == Outcome::Fail).count();
    let _ = writeln!(
        o,
        "\n{}",
        if failed == 0 {
            match checks.iter().filter(|c| c.status == Outcome::Warn).count() {
                0 => "all checks passed (or were skipped)".to_string(),
                n => format!("all checks passed (or were skipped), {n} warning(s)"),
            }
        } else {
            format!("{failed} check(s) failed")
        }
    );
    o
}

// === the checks ===

/// Why the master gave doctor no cluster status.
#[derive(Debug, thiserror::Error)]
enum MasterError {
    #[error("{0:#}")]
    Connect(anyhow::Error),
    #[error(transparent)]
    Status(lunakv_client::ClientError),
}

/// What the engines use lunakv for, as their `--kv-transfer-config` says. The master and its
/// pool serve MooncakeStoreConnector; the P/D connectors move KV straight between engines
/// (MooncakeConnector through the bootstrap), so a P/D-only stack is healthy with no master and
/// no store-client, and the master row must not fail it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Purpose {
    /// A pool with memory is expected: the engines run MooncakeStoreConnector or another
    /// connector that may use the store (LMCache, ...), or doctor was not told what they run.
    Store,
    /// The engines run only these P/D connectors (the ones a routing sidecar drives).
    PdOnly(Vec<String>),
}

impl Purpose {
    /// From the engine's command line (`--vllm-args`), else `--kv-transfer-config`. Input that
    /// does not parse leaves the default, [`Purpose::Store`]: the `connectors` and `vllm_stats`
    /// rows report it, and a store stack must keep failing when its store is missing.
    fn of(a: &DoctorArgs) -> Purpose {
        use lunakv_config::connectors::{engine_connectors, parse_vllm_args, sidecar_connector};
        let kv = a
            .vllm_args
            .as_deref()
            .and_then(|v| parse_vllm_args(v).ok())
            .and_then(|v| v.kv_transfer_config)
            .or_else(|| {
                a.kv_transfer_config
                    .as_deref()
                    .and_then(|k| serde_json::from_str(k).ok())
            });
        let Some(kv) = kv else {
            return Purpose::Store;
        };
        let pd: Vec<&str> = ["mooncake", "nixlv2", "shared-storage"]
            .into_iter()
            .filter_map(sidecar_connector)
            .collect();
        // MultiConnector only wraps the others; what it wraps decides.
        let runs: Vec<String> = engine_connectors(&kv)
            .into_iter()
            .filter(|c| c != "MultiConnector")
            .collect();
        if !runs.is_empty() && runs.iter().all(|c| pd.contains(&c.as_str())) {
            Purpose::PdOnly(runs)
        } else {
            Purpose::Store
        }
    }
}

/// Said when a store stack's master row fails, since a P/D-only stack that doctor was not told
/// about fails the same way.
const PD_ONLY_HINT: &str = "; on a P/D-only stack (MooncakeConnector, no MooncakeStoreConnector) \
                            pass the engine's --kv-transfer-config or --vllm-args and the master \
                            is not required";

fn check_master(
    t: &Target,
    status: &Result<ClusterStatus, MasterError>,
    purpose: &Purpose,
) -> Check {
    const NAME: &str = "master";
    if let Purpose::PdOnly(runs) = purpose {
        let why = format!(
            "the engines run only {} (P/D transfer, no MooncakeStoreConnector), which needs no \
             master or store-client",
            runs.join(", ")
        );
        match status {
            Err(e) => {
                return Check::skip(
                    NAME,
                    format!(
                        "the master at {} ({}) was not reached ({e}); {why}",
                        t.master, t.origin
                    ),
                );
            }
            Ok(s) if s.total_capacity_bytes == 0 => {
                return Check::pass(
                    NAME,
                    format!(
                        "master {} (version {}) answers with no segment registered; {why}",
                        t.master, s.master_version
                    ),
                );
            }
            Ok(_) => {}
        }
    }
    match status {
        Err(e) => Check::fail(
            NAME,
            format!(
                "cannot reach the master at {} ({}): {e}",
                t.master, t.origin
            ),
            format!(
                "start lunakv-master, or point --master / MOONCAKE_MASTER / master_server_address \
                 at its gRPC address (host:port, or etcd://... with HA){PD_ONLY_HINT}"
            ),
        ),
        Ok(s) if s.total_capacity_bytes == 0 => Check::fail(
            NAME,
            format!(
                "master {} answers but the pool has no capacity: no segment is registered",
                t.master
            ),
            format!(
                "start a store-client: lunakv-store --master_server_address={} \
                 --global_segment_size=40GB (or an embedded-mode engine with \
                 global_segment_size > 0){PD_ONLY_HINT}",
                t.master
            ),
        ),
        Ok(s) => Check::pass(
            NAME,
            format!(
                "master {} (version {}): {} segment(s), capacity {}, used {}, {} keys",
                t.master,
                s.master_version,
                s.segments.len(),
                human_bytes(s.total_capacity_bytes),
                human_bytes(s.allocated_bytes),
                s.key_count
            ),
        ),
    }
}

fn check_store_clients(a: &DoctorArgs, status: Option<&ClusterStatus>) -> Check {
    const NAME: &str = "store_clients";
    let segments = status.map(|s| s.segments.as_slice()).unwrap_or_default();
    if segments.is_empty() && a.store.is_empty() {
        return Check::skip(
            NAME,
            if status.is_none() {
                "the master is unreachable and no --store was given"
            } else {
                "no segment is mounted and no --store was given"
            },
        );
    }
    let mut dead = Vec::new();
    let mut alive = Vec::new();
    for g in segments {
        let name = g
            .segment
            .as_ref()
            .map(|d| d.name.clone())
            .unwrap_or_default();
        if g.last_ping_ms_ago > a.stale_ping_ms {
            dead.push(format!(
                "{name} (client {}) last pinged the master {:.1} s ago",
                g.client_id,
                g.last_ping_ms_ago as f64 / 1000.0
            ));
        } else {
            alive.push(name);
        }
    }
    for s in &a.store {
        match http_get(s, "/health") {
            Ok((200, _)) => alive.push(format!("{s} /health")),
            Ok((code, body)) => dead.push(format!(
                "store-client admin {s} answered /health with HTTP {code}: {}",
                body.trim()
            )),
            Err(e) => dead.push(format!("store-client admin {s} does not answer: {e}")),
        }
    }
    if dead.is_empty() {
        Check::pass(NAME, format!("alive: {}", alive.join(", ")))
    } else {
        Check::fail(
            NAME,
            dead.join("; "),
            "restart the dead lunakv-store (its pod or unit) and check its log; the master \
             drops its segment and objects after client_ttl",
        )
    }
}

/// Every segment serves the protocol it was configured with. llm-d's manifests say rdma; a
/// pod without a device serves tcp (one line in its log), and this row makes that visible.
fn check_protocol(status: Option<&ClusterStatus>) -> Check {
    const NAME: &str = "protocol";
    let Some(status) = status else {
        return Check::skip(NAME, "the master is unreachable");
    };
    if status.segments.is_empty() {
        return Check::skip(NAME, "no segment is mounted");
    }
    let mut served = Vec::new();
    let mut fell_back = Vec::new();
    for g in &status.segments {
        let Some(d) = &g.segment else { continue };
        let p = crate::cmd::status::segment_protocol(d);
        if p.fell_back() {
            fell_back.push(format!("{}: {p}", d.name));
        } else {
            served.push(format!("{} {}", d.name, p.effective));
        }
    }
    if fell_back.is_empty() {
        Check::pass(NAME, served.join(", "))
    } else {
        Check::warn(
            NAME,
            fell_back.join("; "),
            "bytes move over tcp there (same-host peers still use shared memory); for RDMA run a \
             build with the `rdma` feature on a node with an RDMA device (docs/RDMA.md), or set \
             \"protocol\": \"tcp\" / --protocol=tcp to state what is served",
        )
    }
}

fn check_offload_write(
    a: &DoctorArgs,
    client: Option<&StoreClient>,
    status: Option<&ClusterStatus>,
) -> Check {
    const NAME: &str = "offload_write";
    let (Some(client), Some(status)) = (client, status) else {
        return Check::skip(NAME, "the master is unreachable");
    };
    let offloading: Vec<&SegmentStatus> = status
        .segments
        .iter()
        .filter(|g| g.segment.as_ref().is_some_and(|d| d.enable_offload))
        .collect();
    if !status.enable_offload && offloading.is_empty() && a.offload_dir.is_none() {
        return Check::skip(
            NAME,
            "offload is not enabled (master --enable_offload=false, no store-client offloads)",
        );
    }
    if !status.enable_offload {
        return Check::fail(
            NAME,
            "the master runs without --enable_offload, so nothing ever reaches the SSD tier",
            "start lunakv-master with --enable_offload=true",
        );
    }
    let Some(seg) = offloading
        .iter()
        .find(|g| g.disk_capacity_bytes >= PROBE_BYTES as u64)
    else {
        return Check::fail(
            NAME,
            "no mounted store-client offers a usable disk tier",
            "start lunakv-store with --enable_offload=true and a writable \
             MOONCAKE_OFFLOAD_FILE_STORAGE_PATH (see its lunakv_store_offload_open_errors)",
        );
    };
    let seg_name = seg
        .segment
        .as_ref()
        .map(|d| d.name.clone())
        .unwrap_or_default();
    match probe_offload(a, client, &seg_name) {
        Ok(detail) => Check::pass(NAME, detail),
        Err((detail, fix)) => Check::fail(NAME, detail, fix),
    }
}

/// Disk bytes the master indexes on `segment`.
fn segment_disk_used(client: &StoreClient, segment: &str) -> Result<u64, ClientError> {
    let s = client.cluster_status()?;
    Ok(s.segments
        .iter()
        .find(|g| g.segment.as_ref().is_some_and(|d| d.name == segment))
        .map_or(0, |g| g.disk_used_bytes))
}

/// The probe's failure when the master stops answering mid-probe: (detail, fix).
fn master_down(e: ClientError) -> (String, String) {
    (
        format!("GetClusterStatus failed: {e}"),
        "check that the master is up and try again".to_string(),
    )
}

/// Bytes the given store-clients wrote to disk so far (their counter), summed.
fn stores_disk_written(a: &DoctorArgs) -> Option<u64> {
    let mut total = None;
    for s in &a.store {
        if let Some(v) = store_metric(s, "lunakv_store_disk_written_bytes_total") {
            *total.get_or_insert(0) += v;
        }
    }
    total
}

fn store_metric(admin: &str, name: &str) -> Option<u64> {
    let (code, body) = http_get(admin, "/metrics").ok()?;
    if code != 200 {
        return None;
    }
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse::<f64>().ok().map(|f| f as u64))?
    })
}

type ProbeError = (String, String);

/// Puts a probe object on `segment`, asks the master to move it to disk, and checks that the
/// disk tier grew where it can be seen: the master's index, the store-clients' counters
/// (`--store`), the directory (`--offload-dir`). The probe is removed afterwards.
fn probe_offload(
    a: &DoctorArgs,
    client: &StoreClient,
    segment: &str,
) -> Result<String, ProbeError> {
    let key = format!(
        "lunakv-doctor/offload-probe/{}/{}",
        std::process::id(),
        client.client_id()
    );
    let master_before = segment_disk_used(client, segment).map_err(master_down)?;
    let store_before = stores_disk_written(a);
    let dir_before = a.offload_dir.as_deref().map(dir_bytes);
    let data = vec![0x5au8; PROBE_BYTES];
    let cfg = ReplicateConfig {
        replica_num: 1,
        preferred_segment: Some(segment.to_string()),
        ..ReplicateConfig::default()
    };
    client.put_parts(&key, &[&data], &cfg).map_err(|e| {
        (
            format!(
                "the probe put of {} failed: {e}",
                human_bytes(PROBE_BYTES as u64)
            ),
            "free DRAM in the pool or check the store-client's log".to_string(),
        )
    })?;
    let result = (|| {
        client.offload_key(&key).map_err(|e| {
            (
                format!("the master could not move the probe to {segment}'s disk: {e}"),
                "check the store-client's log and lunakv_store_disk_write_errors_total; the \
                 offload directory must be writable with free space"
                    .to_string(),
            )
        })?;
        let master_after = segment_disk_used(client, segment).map_err(master_down)?;
        let mut seen = vec![format!(
            "master disk index on {segment} {} -> {}",
            human_bytes(master_before),
            human_bytes(master_after)
        )];
        if master_after <= master_before {
            return Err((
                format!(
                    "the probe went to disk but the master's disk bytes for {segment} did not \
                     grow ({master_before} -> {master_after})"
                ),
                "check that the store-client reports its disk tier (enable_offload at mount)"
                    .to_string(),
            ));
        }
        if let Some(before) = store_before {
            let after = stores_disk_written(a).unwrap_or(0);
            if after <= before {
                return Err((
                    format!(
                        "the store-clients' lunakv_store_disk_written_bytes_total did not grow \
                         ({before} -> {after})"
                    ),
                    "check that --store names the admin endpoint of the store-client that \
                     offloads"
                        .to_string(),
                ));
            }
            seen.push(format!(
                "store disk written +{}",
                human_bytes(after - before)
            ));
        }
        if let (Some(dir), Some(before)) = (a.offload_dir.as_deref(), dir_before) {
            let after = dir_bytes(dir);
            if after <= before {
                return Err((
                    format!(
                        "the offload directory {} did not grow ({before} -> {after} bytes)",
                        dir.display()
                    ),
                    "point --offload-dir at the store-client's \
                     MOONCAKE_OFFLOAD_FILE_STORAGE_PATH on this host"
                        .to_string(),
                ));
            }
            seen.push(format!(
                "{} grew +{}",
                dir.display(),
                human_bytes(after - before)
            ));
        }
        Ok(format!(
            "{} probe reached the SSD tier: {}",
            human_bytes(PROBE_BYTES as u64),
            seen.join(", ")
        ))
    })();
    // Clean up whatever happened; a failed remove is not the check's verdict.
    let _ = client.remove(&key, true);
    result
}

/// Bytes of the regular files under `dir` (recursively); 0 when it cannot be read.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn check_offload_config(
    engine: Option<&MooncakeConfig>,
    config: &Option<PathBuf>,
    status: Option<&ClusterStatus>,
) -> Check {
    const NAME: &str = "offload_config";
    let Some(status) = status else {
        return Check::skip(NAME, "the master is unreachable");
    };
    let mut bad = Vec::new();
    let mut seen = vec![format!("master enable_offload={}", status.enable_offload)];
    for g in &status.segments {
        let Some(d) = &g.segment else { continue };
        if d.enable_offload != status.enable_offload {
            bad.push(format!(
                "store-client {} has enable_offload={} but the master {}",
                d.name, d.enable_offload, status.enable_offload
            ));
        }
    }
    seen.push(format!("{} store-client(s)", status.segments.len()));
    if let (Some(e), Some(path)) = (engine, config) {
        let p = path.display();
        seen.push(format!(
            "engine {p}: mode {} enable_offload={}",
            e.mode.as_str(),
            e.enable_offload
        ));
        if e.enable_offload != status.enable_offload {
            bad.push(format!(
                "engine config {p} has \"enable_offload\": {} but the master {}",
                e.enable_offload, status.enable_offload
            ));
        }
        if e.enable_offload
            && !status.segments.iter().any(|g| {
                g.segment
                    .as_ref()
                    .is_some_and(|d| d.enable_offload && g.disk_capacity_bytes > 0)
            })
        {
            bad.push(format!(
                "engine config {p} enables offload but no store-client offers a disk tier"
            ));
        }
        if !e.is_embedded() && status.total_capacity_bytes == 0 {
            bad.push(format!(
                "engine config {p} is mode standalone-store (the engine contributes no memory) \
                 but no store-client is mounted"
            ));
        }
    } else {
        seen.push("no engine config (--config) to compare".to_string());
    }
    if bad.is_empty() {
        Check::pass(NAME, seen.join(", "))
    } else {
        Check::fail(
            NAME,
            bad.join("; "),
            "use one enable_offload value everywhere: the engine's mooncake_config.json \
             (\"enable_offload\": true, with \"mode\": \"standalone-store\"), lunakv-master \
             --enable_offload=true and every lunakv-store --enable_offload=true (or false in all \
             three)",
        )
    }
}

fn check_bootstrap(a: &DoctorArgs) -> Check {
    const NAME: &str = "bootstrap";
    let Some(b) = &a.bootstrap else {
        return Check::skip(NAME, "no --bootstrap HOST:PORT given");
    };
    let addr = b
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let (code, body) = match http_get(&addr, "/query") {
        Ok(r) => r,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("bootstrap {addr} does not answer GET /query: {e}"),
                "start lunakv-bootstrap (or the prefill's MooncakeConnector bootstrap) on \
                 VLLM_MOONCAKE_BOOTSTRAP_PORT (default 8998), and check --bootstrap",
            );
        }
    };
    if code != 200 {
        return Check::fail(
            NAME,
            format!(
                "bootstrap {addr} answered GET /query with HTTP {code}: {}",
                body.trim()
            ),
            "point --bootstrap at a vLLM-compatible bootstrap (lunakv-bootstrap's HTTP port)",
        );
    }
    let engines = match serde_json::from_str::<serde_json::Value>(&body) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => {
            return Check::fail(
                NAME,
                format!(
                    "bootstrap {addr} answered GET /query with something other than a JSON object: {}",
                    body.trim()
                ),
                "point --bootstrap at a vLLM-compatible bootstrap (lunakv-bootstrap's HTTP port)",
            );
        }
    };
    if engines.is_empty() {
        return Check::fail(
            NAME,
            format!("bootstrap {addr} is up but lists no engine"),
            "start the prefill engines with MooncakeConnector (kv_role kv_producer) registering \
             with this bootstrap, and check that their leases are renewed",
        );
    }
    let ids: Vec<String> = engines
        .iter()
        .map(|(dp, v)| {
            let id = v
                .get("engine_id")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("?");
            format!("dp {dp}: {id}")
        })
        .collect();
    Check::pass(
        NAME,
        format!(
            "bootstrap {addr} lists {} engine(s): {}",
            ids.len(),
            ids.join(", ")
        ),
    )
}

fn check_connectors(a: &DoctorArgs) -> Check {
    const NAME: &str = "connectors";
    let (sidecar, kv) = match (&a.sidecar_args, &a.kv_transfer_config) {
        (Some(s), Some(k)) => (s, k),
        (None, None) => {
            return Check::skip(NAME, "no --sidecar-args and --kv-transfer-config given");
        }
        (Some(_), None) => {
            return Check::skip(NAME, "--sidecar-args given without --kv-transfer-config");
        }
        (None, Some(_)) => {
            return Check::skip(NAME, "--kv-transfer-config given without --sidecar-args");
        }
    };
    let kv: serde_json::Value = match serde_json::from_str(kv) {
        Ok(v) => v,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("--kv-transfer-config is not JSON ({e}): {kv}"),
                "pass the engine's --kv-transfer-config value exactly, e.g. \
                 '{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_consumer\"}'",
            );
        }
    };
    let args: Vec<String> = sidecar
        .split_whitespace()
        .map(|t| t.trim_matches(|c| c == '"' || c == '\'').to_string())
        .collect();
    let sc = lunakv_config::connectors::sidecar_kv_connector(&args);
    match lunakv_config::connectors::connector_matches(&sc, &kv) {
        Ok(()) => Check::pass(
            NAME,
            format!(
                "sidecar --kv-connector={sc} matches the engine's {:?}",
                lunakv_config::connectors::engine_connectors(&kv)
            ),
        ),
        Err(e) => Check::fail(
            NAME,
            format!("sidecar --kv-connector={sc} does not match the engine's kv-transfer-config"),
            e.to_string(),
        ),
    }
}

/// vLLM #43828: a MultiConnector running MooncakeConnector kills the API server at its first
/// successful transfer unless vLLM's stats are off. The rule is `lunakv_config::connectors`'s,
/// shared with the Kubernetes overlay test.
fn check_vllm_stats(a: &DoctorArgs) -> Check {
    use lunakv_config::connectors::{
        StatsRisk, VLLM_STATS_FIX, VLLM_STATS_ISSUE, VllmVersion, parse_vllm_args, vllm_stats_risk,
    };
    const NAME: &str = "vllm_stats";
    let input_fix = "pass the engine's `vllm serve` arguments as one string, e.g. \
                     --vllm-args \"$(ps -o args= -p <vllm pid>)\"";
    let args = match a.vllm_args.as_deref().map(parse_vllm_args) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => return Check::fail(NAME, format!("--vllm-args: {e}"), input_fix),
    };
    let version = match a.vllm_version.as_deref().map(str::parse::<VllmVersion>) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => {
            return Check::fail(
                NAME,
                format!("--vllm-version: {e}"),
                "pass what `vllm --version` prints",
            );
        }
    };
    // The engine's connectors: from its command line, else from --kv-transfer-config (whose
    // JSON errors the connectors row reports).
    let kv = args
        .as_ref()
        .and_then(|a| a.kv_transfer_config.clone())
        .or_else(|| {
            a.kv_transfer_config
                .as_deref()
                .and_then(|k| serde_json::from_str(k).ok())
        });
    let Some(kv) = kv else {
        return Check::skip(
            NAME,
            "no --vllm-args with a --kv-transfer-config, and no valid --kv-transfer-config given",
        );
    };
    let on = version.map_or_else(
        || "vLLM (version not given: --vllm-version)".to_string(),
        |v| format!("vLLM {v}"),
    );
    match vllm_stats_risk(&kv, args.as_ref().map(|a| a.stats_disabled), version) {
        StatsRisk::NotAffected => Check::pass(
            NAME,
            format!(
                "the engine runs no MooncakeConnector inside a MultiConnector: {VLLM_STATS_ISSUE} \
                 does not apply"
            ),
        ),
        StatsRisk::Avoided => Check::pass(
            NAME,
            format!(
                "MultiConnector with MooncakeConnector on {on}, stats off (--disable-log-stats): \
                 {VLLM_STATS_ISSUE} is avoided"
            ),
        ),
        StatsRisk::Fixed(v) => Check::pass(
            NAME,
            format!("vLLM {v} contains {VLLM_STATS_FIX}: {VLLM_STATS_ISSUE} is fixed"),
        ),
        StatsRisk::Crashes { .. } => Check::warn(
            NAME,
            format!(
                "MultiConnector runs MooncakeConnector with stats on (no --disable-log-stats) \
                 on {on}: the API server dies after its first successful KV transfer \
                 ({VLLM_STATS_ISSUE}: \"AssertionError: MooncakeConnector is not contained in \
                 the list of registered connectors with Prometheus metrics support\")"
            ),
            format!(
                "add --disable-log-stats to the prefill and decode `vllm serve` arguments (the \
                 pd-mooncake overlay does), or run the vLLM release that contains \
                 {VLLM_STATS_FIX}"
            ),
        ),
        StatsRisk::Unknown => Check::skip(
            NAME,
            format!(
                "the engine runs MooncakeConnector inside a MultiConnector, which \
                 {VLLM_STATS_ISSUE} crashes unless --disable-log-stats is given: pass \
                 --vllm-args to check"
            ),
        ),
    }
}

fn check_key_consistency(client: Option<&StoreClient>) -> Check {
    const NAME: &str = "key_consistency";
    let Some(client) = client else {
        return Check::skip(NAME, "the master is unreachable");
    };
    let r = match client.namespace_stats() {
        Ok(r) => r,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("GetNamespaceStats failed: {e}"),
                "upgrade lunakv-master to a version with GetNamespaceStats",
            );
        }
    };
    let flagged: Vec<&NamespaceStats> = r.namespaces.iter().filter(|n| n.unshared).collect();
    if !flagged.is_empty() {
        let which: Vec<String> = flagged
            .iter()
            .map(|n| {
                format!(
                    "{} ({} instances, {} keys put, 0 shared)",
                    n.namespace, n.active_clients, n.keys_put
                )
            })
            .collect();
        return Check::fail(
            NAME,
            format!("{UNSHARED_MESSAGE}: {}", which.join("; ")),
            "give every vLLM instance the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0 in the pod \
             spec) and the same --prefix-caching-hash-algo, then restart them",
        );
    }
    let compared: Vec<&NamespaceStats> = r
        .namespaces
        .iter()
        .filter(|n| n.active_clients >= 2)
        .collect();
    if compared.is_empty() {
        return Check::skip(
            NAME,
            format!(
                "no namespace has two instances with {} keys put yet ({} namespace(s) seen)",
                r.min_keys,
                r.namespaces.len()
            ),
        );
    }
    let shared: u64 = compared.iter().map(|n| n.shared_keys).sum();
    Check::pass(
        NAME,
        format!(
            "{} namespace(s) with 2+ instances share keys ({shared} shared lookups/puts)",
            compared.len()
        ),
    )
}

// === the admin endpoints, through lunakv's HTTP client ===

/// A probe of the master that got no answer, with what stopped it (the probe's own error,
/// whichever call it came from, as the security row quotes it).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Unanswered(String);

/// What protects the pool (docs/SECURITY.md), as far as this client can tell:
/// - an `etcd://` master: etcd must be reached over TLS and know who lunakv is (a client
///   certificate or a user), or anyone who reaches etcd can redirect every client;
/// - the master itself: `refuses_anonymous` is one status call without credentials
///   ([`lunakv_client::StoreClient::master_refuses_anonymous`]). A master that turns it away
///   requires the pool token of every caller, and its owners require its capabilities on their
///   transfer ports; one that answers is open to whoever reaches it, unless that is only
///   loopback. A master doctor did not reach is vouched for by nothing (the row is `skip`, or
///   `warn` for what else it found), whatever address it would listen on.
/// - mTLS: `tls` is what the master's RPC port requires ([`lunakv_master_client::probe_master_tls`]).
///   With mTLS every caller shows a certificate from the pool's CA, whose identity owns its
///   mounts and puts; this doctor's own `LUNAKV_TLS_*` must agree with the master's, and its
///   certificate must be valid.
fn check_security(
    master: &str,
    env: &dyn Fn(&str) -> Option<String>,
    refuses_anonymous: Option<&Result<bool, Unanswered>>,
    tls: Option<&Result<lunakv_master_client::MasterTls, Unanswered>>,
) -> Check {
    use lunakv_master_client::MasterTls;
    const NAME: &str = "security";
    const DOC: &str = "docs/SECURITY.md";
    let tokens = match lunakv_config::auth::PoolTokens::from_env(env) {
        Ok(t) => t,
        Err(e) => return Check::fail(NAME, e.to_string(), "fix the variable it names"),
    };
    let mine = match lunakv_config::tls::TlsPaths::client_from_env(env)
        .map_err(|e| e.to_string())
        .and_then(|p| lunakv_tls::ClientTls::from_paths(&p).map_err(|e| e.to_string()))
    {
        Ok(t) => t,
        Err(e) => return Check::fail(NAME, e, "fix the variable or file it names"),
    };
    let mut warns: Vec<(String, String)> = Vec::new();
    let mut passes: Vec<String> = Vec::new();
    let tls_fix = format!(
        "set LUNAKV_TLS_CERT, LUNAKV_TLS_KEY and LUNAKV_TLS_CACERT on the master, the stores, the \
         engines (or tls_cert, tls_key, tls_cacert in mooncake_config.json) and the CLI \
         (components/mtls does it in Kubernetes) ({DOC})"
    );
    let mtls = matches!(tls, Some(Ok(MasterTls::Mutual)));
    match tls {
        Some(Ok(MasterTls::Mutual)) => {
            let file = mine
                .as_ref()
                .and_then(|t| t.paths().cert.as_ref())
                .map(ToString::to_string);
            match (mine.as_ref().and_then(|t| t.certificate()), file) {
                (Some(c), Some(f)) if c.expired || c.not_yet_valid => warns.push((
                    format!(
                        "the master requires mTLS and this client's certificate {f} is not \
                         valid now ({c})"
                    ),
                    "renew it (cert-manager renews before expiry; the files are reread when \
                     they change)"
                        .into(),
                )),
                (Some(c), _) => passes.push(format!(
                    "mTLS: the master requires a client certificate from its CA of every \
                     caller, whose identity owns its mounts and puts; this client is {:?} ({c})",
                    c.identity.as_deref().unwrap_or("(no CN or SAN)")
                )),
                (None, _) => warns.push((
                    "the master requires mTLS (a client certificate from its CA) and this \
                     client presents none"
                        .into(),
                    tls_fix.clone(),
                )),
            }
        }
        Some(Ok(MasterTls::On)) => warns.push((
            "the master serves TLS but asks no client certificate: callers are not \
             identified, so any of them may act on the others' mounts and puts"
                .into(),
            format!(
                "set LUNAKV_TLS_CACERT on the master to the CA of the clients' certificates \
                 ({DOC})"
            ),
        )),
        Some(Ok(MasterTls::Off)) if mine.is_some() => warns.push((
            "this client has TLS settings (LUNAKV_TLS_*) but the master serves plaintext".into(),
            format!(
                "start the master with LUNAKV_TLS_CERT, LUNAKV_TLS_KEY and LUNAKV_TLS_CACERT, or \
                 unset them here ({DOC})"
            ),
        )),
        _ => {}
    }
    if master.trim().starts_with("etcd://") {
        let creds = match lunakv_config::EtcdCredentials::from_env(env) {
            Ok(c) => c,
            Err(e) => {
                return Check::fail(
                    NAME,
                    e.to_string(),
                    "fix the LUNAKV_ETCD_* variable it names",
                );
            }
        };
        match (&creds.ca, &creds.identity, &creds.user) {
            (None, _, _) => warns.push((
                "etcd is reached over plain http: whoever reaches etcd can rewrite master_view \
                 and send every client to a master of their own"
                    .into(),
                format!(
                    "serve etcd over TLS with --client-cert-auth and set LUNAKV_ETCD_CACERT, \
                     LUNAKV_ETCD_CERT, LUNAKV_ETCD_KEY (the ha overlay's components/etcd-tls \
                     does; {DOC})"
                ),
            )),
            (Some(_), None, None) => warns.push((
                "etcd is reached over TLS but lunakv presents no identity (no client \
                 certificate, no etcd user), so etcd cannot tell lunakv from anyone else"
                    .into(),
                format!(
                    "run etcd with --client-cert-auth and set LUNAKV_ETCD_CERT/KEY, or turn on \
                     etcd users and set LUNAKV_ETCD_USER ({DOC})"
                ),
            )),
            (Some((ca, _)), id, user) => passes.push(format!(
                "etcd over TLS (CA {}) as {}",
                ca.display(),
                match (id, user) {
                    (_, Some((u, _))) => format!("etcd user {u}"),
                    _ => "the client certificate's CN".to_string(),
                }
            )),
        }
    }
    let host = master
        .rsplit_once(':')
        .map_or(master, |(h, _)| h)
        .trim_matches(|c| c == '[' || c == ']');
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let token_fix = format!(
        "set LUNAKV_AUTH_TOKEN (or LUNAKV_AUTH_TOKEN_FILE) on the master, every store and every \
         engine (the overlays' optional Secret lunakv-auth), or turn on mTLS (LUNAKV_TLS_*, \
         components/mtls), and keep lunakv's ports closed to strangers with the NetworkPolicies \
         (components/network-policy) ({DOC})"
    );
    match refuses_anonymous {
        // Callers are authenticated by their certificates (said above); owners then require
        // capabilities too.
        _ if mtls => {}
        Some(Ok(true)) => passes.push(
            "the master refuses callers without the pool token, and its owners require its \
             capabilities on their transfer ports"
                .into(),
        ),
        Some(Ok(false)) if loopback => passes.push(format!(
            "the master listens on loopback ({master}) and asks no token"
        )),
        Some(Ok(false)) => warns.push((
            format!(
                "the master at {master} answers callers that present no pool token{}: anyone \
                 who reaches it and the stores can read, overwrite and remove objects",
                if tokens.presented().is_some() {
                    " although this doctor has one (LUNAKV_AUTH_TOKEN): the master was started \
                     without it"
                } else {
                    ""
                }
            ),
            token_fix,
        )),
        Some(Err(e)) => warns.push((
            format!("cannot tell whether the master requires a pool token: {e}"),
            token_fix,
        )),
        // Not reached: where it listens says nothing about what it asks, and a master that is
        // not running guards nothing; the row must not pass on it.
        None => {}
    }
    let unchecked = (refuses_anonymous.is_none() && !mtls).then(|| match tls {
        // The plaintext probe got an answer, so what the port serves is known (said above).
        Some(Ok(_)) => format!(
            "this doctor could not open a session with the master at {master}, so whether it \
             requires a pool token could not be checked"
        ),
        _ => format!(
            "the master at {master} was not reached, so whether it requires a pool token or \
             mTLS could not be checked"
        ),
    });
    if !warns.is_empty() {
        let (mut details, fixes): (Vec<String>, Vec<String>) = warns.into_iter().unzip();
        details.extend(unchecked);
        Check::warn(NAME, details.join("; "), fixes.join("; "))
    } else if let Some(u) = unchecked {
        passes.push(u);
        Check::skip(NAME, passes.join("; "))
    } else {
        Check::pass(NAME, passes.join("; "))
    }
}

/// Why an HTTP probe of a service got no answer. The check's line already names the service
/// and the URL's path, so transport failures say only the cause.
#[derive(Debug, thiserror::Error)]
enum GetError {
    #[error("bad address {addr:?} ({source}); give host:port")]
    BadAddress {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0:?} resolves to no address")]
    NoAddress(String),
    #[error("{}", cause_of(.0))]
    Http(lunakv_http::HttpError),
}

fn cause_of(e: &lunakv_http::HttpError) -> String {
    match e {
        lunakv_http::HttpError::Transport { msg, .. } => msg.clone(),
        lunakv_http::HttpError::Timeout { after, .. } => format!("no answer within {after:?}"),
        other => other.to_string(),
    }
}

/// GET `http://addr{path}` with a short timeout; (status, body).
fn http_get(addr: &str, path: &str) -> Result<(u16, String), GetError> {
    let timeout = Duration::from_secs(3);
    // Checked first so that a typo reads as one, not as a connection error.
    addr.to_socket_addrs()
        .map_err(|source| GetError::BadAddress {
            addr: addr.to_string(),
            source,
        })?
        .next()
        .ok_or_else(|| GetError::NoAddress(addr.to_string()))?;
    let r = lunakv_http::get_blocking(&format!("http://{addr}{path}"), timeout)
        .map_err(GetError::Http)?;
    Ok((r.status.as_u16(), r.text()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_shows_each_failure_with_its_fix() {
        let checks = vec![
            Check::pass("master", "ok"),
            Check::fail("bootstrap", "down", "start it"),
            Check::skip("connectors", "no input"),
        ];
        let t = render("m:1", &checks);
        let line = |name: &str| {
            t.lines()
                .find(|l| l.starts_with(name))
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .unwrap_or_default()
        };
        assert_eq!(line("bootstrap"), "bootstrap fail down", "{t}");
        assert_eq!(line("connectors"), "connectors skip no input", "{t}");
        // The fix sits on the line after its failure.
        let after = t.lines().skip_while(|l| !l.starts_with("bootstrap")).nth(1);
        assert_eq!(after.map(str::trim), Some("fix: start it"), "{t}");
        assert!(t.contains("1 check(s) failed"), "{t}");
    }

    fn doctor_args(vllm_args: Option<&str>, kv: Option<&str>, version: Option<&str>) -> DoctorArgs {
        DoctorArgs {
            store: vec![],
            offload_dir: None,
            bootstrap: None,
            sidecar_args: None,
            kv_transfer_config: kv.map(str::to_string),
            vllm_args: vllm_args.map(str::to_string),
            vllm_version: version.map(str::to_string),
            stale_ping_ms: 5000,
        }
    }

    #[test]
    fn vllm_stats_warns_on_multiconnector_with_mooncake_and_stats_on() {
        let multi = r#"{"kv_connector":"MultiConnector","kv_role":"kv_producer","kv_connector_extra_config":{"connectors":[{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"},{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}]}}"#;
        let serve = format!("vllm serve Qwen/Qwen3-0.6B --port=8000 --kv-transfer-config={multi}");
        // Stats on, vLLM 0.32.0: a warning naming the issue, with the flag as the fix.
        let c = check_vllm_stats(&doctor_args(Some(&serve), None, Some("0.32.0")));
        assert_eq!(c.status, Outcome::Warn, "{c:?}");
        assert!(
            c.detail.contains("vLLM issue #43828") && c.detail.contains("0.32.0"),
            "{c:?}"
        );
        assert!(
            c.fix
                .as_deref()
                .unwrap_or_default()
                .contains("--disable-log-stats")
        );
        // The flag avoids it.
        let c = check_vllm_stats(&doctor_args(
            Some(&format!("{serve} --disable-log-stats")),
            None,
            None,
        ));
        assert_eq!(c.status, Outcome::Pass, "{c:?}");
        // Only the JSON: cannot tell whether stats are on.
        let c = check_vllm_stats(&doctor_args(None, Some(multi), None));
        assert_eq!(c.status, Outcome::Skip, "{c:?}");
        assert!(c.detail.contains("--vllm-args"), "{c:?}");
        // Not the affected composition.
        let store_only = r#"{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}"#;
        let c = check_vllm_stats(&doctor_args(
            Some(&format!("--kv-transfer-config={store_only}")),
            None,
            Some("0.32.0"),
        ));
        assert_eq!(c.status, Outcome::Pass, "{c:?}");
        // No input at all, and bad input.
        assert_eq!(
            check_vllm_stats(&doctor_args(None, None, None)).status,
            Outcome::Skip
        );
        assert_eq!(
            check_vllm_stats(&doctor_args(Some(&serve), None, Some("latest"))).status,
            Outcome::Fail
        );
    }

    #[test]
    fn security_row_names_what_protects_the_control_plane() {
        let none = |_: &str| None::<String>;
        let (open, guarded) = (Ok(false), Ok(true));
        assert_eq!(
            check_security("127.0.0.1:50051", &none, Some(&open), None).status,
            Outcome::Pass
        );
        let stranger = check_security("lunakv-master.lunakv.svc:50051", &none, Some(&open), None);
        assert_eq!(stranger.status, Outcome::Warn);
        let fix = stranger.fix.as_deref().unwrap_or("");
        assert!(
            fix.contains("NetworkPolicies") && fix.contains("LUNAKV_AUTH_TOKEN"),
            "{fix}"
        );
        let ok = check_security(
            "lunakv-master.lunakv.svc:50051",
            &none,
            Some(&guarded),
            None,
        );
        assert_eq!(ok.status, Outcome::Pass, "{}", ok.detail);
        assert!(ok.detail.contains("capabilities"), "{}", ok.detail);
        // This doctor has the token but the master does not ask for it: started without it.
        let with_token =
            |k: &str| (k == "LUNAKV_AUTH_TOKEN").then(|| "doctor-token-0123456789".to_string());
        let mismatch = check_security("10.0.0.7:50051", &with_token, Some(&open), None);
        assert_eq!(mismatch.status, Outcome::Warn);
        assert!(
            mismatch.detail.contains("started without it"),
            "{}",
            mismatch.detail
        );
        // A master doctor did not reach is not checked, wherever it would listen.
        for addr in ["10.0.0.7:50051", "127.0.0.1:50051", "localhost:50051"] {
            let unknown = check_security(addr, &none, None, None);
            assert_eq!(unknown.status, Outcome::Skip, "{addr}: {unknown:?}");
            assert!(
                unknown.detail.contains("could not be checked")
                    && !unknown.detail.contains("loopback"),
                "{addr}: {}",
                unknown.detail
            );
        }
        // ...and a refused plaintext probe (nothing listens) changes nothing.
        let refused = Err(Unanswered("connection refused".to_string()));
        assert_eq!(
            check_security("127.0.0.1:50051", &none, None, Some(&refused)).status,
            Outcome::Skip
        );
        let short = |k: &str| (k == "LUNAKV_AUTH_TOKEN").then(|| "short".to_string());
        assert_eq!(
            check_security("10.0.0.7:50051", &short, Some(&guarded), None).status,
            Outcome::Fail
        );

        let plain = check_security("etcd://e1:2379;e2:2379", &none, Some(&guarded), None);
        assert_eq!(plain.status, Outcome::Warn);
        assert!(
            plain
                .fix
                .as_deref()
                .unwrap_or("")
                .contains("LUNAKV_ETCD_CACERT"),
            "{:?}",
            plain.fix
        );

        let dir = tempfile::tempdir().unwrap();
        let pem = dir.path().join("ca.pem");
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let pem = pem.display().to_string();
        let ca_only = |k: &str| (k == "LUNAKV_ETCD_CACERT").then(|| pem.clone());
        let anon = check_security("etcd://e1:2379", &ca_only, Some(&guarded), None);
        assert_eq!(anon.status, Outcome::Warn);
        assert!(anon.detail.contains("no identity"), "{}", anon.detail);
        let with_user = |k: &str| match k {
            "LUNAKV_ETCD_CACERT" => Some(pem.clone()),
            "LUNAKV_ETCD_USER" => Some("lunakv:Hunter2-not-in-any-path".into()),
            _ => None,
        };
        let ok = check_security("etcd://e1:2379", &with_user, Some(&guarded), None);
        assert_eq!(ok.status, Outcome::Pass, "{}", ok.detail);
        // The password is distinctive on purpose: the detail holds a random temp path,
        // and a short password like "pw" turns up in those by chance.
        assert!(
            ok.detail.contains("etcd user lunakv") && !ok.detail.contains("Hunter2"),
            "{}",
            ok.detail
        );
        // etcd secured, the master open to strangers: still a warning.
        assert_eq!(
            check_security("etcd://e1:2379", &with_user, Some(&open), None).status,
            Outcome::Warn
        );
        let broken = |k: &str| (k == "LUNAKV_ETCD_CACERT").then(|| "/nonexistent.pem".to_string());
        assert_eq!(
            check_security("etcd://e1:2379", &broken, Some(&guarded), None).status,
            Outcome::Fail
        );
    }

    #[test]
    fn the_engines_connectors_say_whether_a_store_is_expected() {
        let pd = r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#;
        assert_eq!(
            Purpose::of(&doctor_args(None, Some(pd), None)),
            Purpose::PdOnly(vec!["MooncakeConnector".into()])
        );
        // From the command line too, which wins over --kv-transfer-config.
        let serve = format!("vllm serve m --kv-transfer-config={pd}");
        let store = r#"{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}"#;
        assert!(matches!(
            Purpose::of(&doctor_args(Some(&serve), Some(store), None)),
            Purpose::PdOnly(_)
        ));
        // A MultiConnector is what it wraps.
        let multi_pd = r#"{"kv_connector":"MultiConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"MooncakeConnector"},{"kv_connector":"NixlConnector"}]}}"#;
        assert!(matches!(
            Purpose::of(&doctor_args(None, Some(multi_pd), None)),
            Purpose::PdOnly(_)
        ));
        // The store, a connector that may use it, nothing said, or unreadable: a store is
        // expected, so a missing one still fails.
        let multi_store = r#"{"kv_connector":"MultiConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"MooncakeConnector"},{"kv_connector":"MooncakeStoreConnector"}]}}"#;
        let lmcache = r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#;
        for kv in [
            Some(store),
            Some(multi_store),
            Some(lmcache),
            None,
            Some("{not json"),
        ] {
            assert_eq!(
                Purpose::of(&doctor_args(None, kv, None)),
                Purpose::Store,
                "{kv:?}"
            );
        }
    }

    #[test]
    fn the_message_is_the_masters() {
        assert_eq!(
            UNSHARED_MESSAGE,
            "instances never share a block: PYTHONHASHSEED or hash algorithm differs"
        );
    }
}
