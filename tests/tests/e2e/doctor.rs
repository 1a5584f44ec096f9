//! `lunakv doctor` against real binaries: a healthy stack passes every check, and each broken
//! stack doctor claims to detect fails exactly the row that names it, with its fix, and exit 1.
//!
//! The healthy stack: `lunakv-master --enable_offload=true`, a `lunakv-store` with the SSD tier,
//! `lunakv-bootstrap` with a registered `lunakv-engine-sim` prefill, a sidecar's flags and an
//! engine's kv-transfer-config that match, and two clients of one vLLM key namespace that share
//! keys. The broken ones: no store registered, a store killed, an offload mismatch, a test write
//! that never reaches the disk (no store-client with a disk tier; the wrong offload dir), a bootstrap
//! with no engines and one that is down, connector mismatches (top-level and nested), and two
//! clients of one namespace that never share a key. A P/D-only stack (MooncakeConnector, no
//! store) passes with no master and with a master that has no store-client.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use lunakv_tests::pd::{Bootstrap, Sim, fresh_host};
use lunakv_tests::{Master, Proc, Store, bin, fields, requester, wait_until};
use serde_json::Value;

const UNSHARED: &str = lunakv_config::messages::UNSHARED_NAMESPACE;

/// The master's default `namespace_min_keys`.
const MIN_KEYS: usize = 64;

const ALL_ROWS: [&str; 10] = [
    "engine_config",
    "master",
    "store_clients",
    "protocol",
    "offload_write",
    "offload_config",
    "bootstrap",
    "connectors",
    "vllm_stats",
    "key_consistency",
];

/// Runs `lunakv --json doctor --master MASTER ARGS...`; (exit code, the JSON report).
fn doctor(master: &str, args: &[String]) -> (i32, Value) {
    let out = Command::new(bin("lunakv"))
        .args(["--json", "doctor", "--master", master])
        .args(args)
        .output()
        .expect("run lunakv doctor");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "doctor printed no JSON ({e}):\n{stdout}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

fn row<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no row {name} in {report:#}"))
}

fn failed_rows(report: &Value) -> Vec<String> {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["status"] == "fail")
        .map(|c| c["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Asserts that `name` is the only failed row, that its detail and fix contain the given texts,
/// and that doctor exited 1.
fn assert_only_failure(code: i32, report: &Value, name: &str, detail: &str, fix: &str) {
    assert_eq!(failed_rows(report), vec![name.to_string()], "{report:#}");
    let r = row(report, name);
    let d = r["detail"].as_str().unwrap_or_default();
    let f = r["fix"].as_str().unwrap_or_default();
    assert!(d.contains(detail), "{name} detail lacks {detail:?}: {d}");
    assert!(f.contains(fix), "{name} fix lacks {fix:?}: {f}");
    assert_eq!(report["ok"], false);
    assert_eq!(code, 1, "a failed check exits 1: {report:#}");
}

fn engine_config(dir: &Path, master: &str, enable_offload: bool) -> String {
    let p = dir.join("mooncake_config.json");
    std::fs::write(
        &p,
        serde_json::json!({
            "master_server_address": master,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": "64MB",
            "enable_offload": enable_offload,
        })
        .to_string(),
    )
    .expect("write config");
    p.display().to_string()
}

/// A store-client with the SSD tier in `dir`; (process, admin address).
fn offload_store(master: &str, dir: &Path) -> (Proc, String) {
    let args = vec![
        format!("--master_server_address={master}"),
        "--host=127.0.0.1".to_owned(),
        "--port=0".to_owned(),
        "--metrics_port=0".to_owned(),
        "--global_segment_size=32MB".to_owned(),
        "--enable_offload=true".to_owned(),
    ];
    let path = dir.display().to_string();
    let proc = Proc::spawn(
        "lunakv-store",
        &args,
        &[("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", path.as_str())],
    );
    let line = proc.wait_for_line("listening", Duration::from_secs(20));
    let admin = fields(&line).get("admin").cloned().expect("admin address");
    (proc, admin)
}

fn vllm_key(model: &str, rank: u32, hash: u64) -> String {
    format!("{model}@tp_rank:{rank}@{hash:016x}")
}

const MULTI_MOONCAKE: &str = r#"{"kv_connector":"MultiConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"connectors":[{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"},{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_consumer"}]}}"#;

#[test]
fn healthy_stack_passes_every_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let offload_dir = dir.path().join("offload");
    let m = Master::start(&dir.path().join("m"), &["--enable_offload=true"]);
    let (_store, store_admin) = offload_store(&m.addr(), &offload_dir);
    let bootstrap = Bootstrap::start(fresh_host(), 0, &[]);
    let _prefill = Sim::prefill(fresh_host(), &bootstrap, &[]);

    // Two instances of one model and rank: the second finds the first's blocks (as vLLM's
    // batch_is_exist does before saving) and adds its own.
    let a = requester(&m.addr());
    let b = requester(&m.addr());
    let shared: Vec<String> = (0..MIN_KEYS as u64)
        .map(|i| vllm_key("Qwen3-8B", 0, i))
        .collect();
    for k in &shared {
        a.put(k, b"block").expect("put a");
    }
    let refs: Vec<&str> = shared.iter().map(String::as_str).collect();
    assert!(b.batch_exists(&refs).iter().all(|r| matches!(r, Ok(true))));
    for i in 0..MIN_KEYS as u64 {
        b.put(&vllm_key("Qwen3-8B", 0, 1000 + i), b"block")
            .expect("put b");
    }

    let config = engine_config(dir.path(), &m.addr(), true);
    let args = vec![
        format!("--config={config}"),
        format!("--store={store_admin}"),
        format!("--offload-dir={}", offload_dir.display()),
        format!("--bootstrap={}", bootstrap.http),
        "--sidecar-args=--port=8000 --vllm-port=8200 --kv-connector=mooncake".to_string(),
        format!("--kv-transfer-config={MULTI_MOONCAKE}"),
        format!(
            "--vllm-args=vllm serve Qwen/Qwen3-8B --port=8200 --disable-log-stats \
             --kv-transfer-config={MULTI_MOONCAKE}"
        ),
    ];
    let (code, report) = doctor(&m.addr(), &args);
    for name in ALL_ROWS {
        assert_eq!(row(&report, name)["status"], "pass", "{report:#}");
    }
    assert_eq!(report["ok"], true);
    assert_eq!(code, 0);
    // The probe went to disk and was cleaned up afterwards.
    assert!(
        row(&report, "offload_write")["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("reached the SSD tier"),
        "{report:#}"
    );
    let (_, summary) = m.http_get("/metrics/summary");
    assert!(
        summary.contains(&format!("keys: {}", 2 * MIN_KEYS)),
        "the probe key is removed: {summary}"
    );
    assert!(m.metric("master_offloaded_keys_total").unwrap_or(0.0) >= 1.0);

    // The same checks as a table on stdout.
    let out = Command::new(bin("lunakv"))
        .args(["doctor", "--master", &m.addr()])
        .args(&args)
        .output()
        .expect("run lunakv doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("CHECK") && text.contains("RESULT"), "{text}");
    assert!(text.contains("all checks passed"), "{text}");
}

#[test]
fn no_store_registered_fails_the_master_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let (code, report) = doctor(&m.addr(), &[]);
    assert_only_failure(
        code,
        &report,
        "master",
        "no segment is registered",
        "start a store-client: lunakv-store",
    );
}

#[test]
fn unreachable_master_fails_the_master_row() {
    let (code, report) = doctor(&format!("127.0.0.1:{}", unused_port()), &[]);
    assert_only_failure(
        code,
        &report,
        "master",
        "cannot reach the master",
        "start lunakv-master",
    );
    assert_eq!(row(&report, "key_consistency")["status"], "skip");
    // Loopback or not, a master that was not reached is not vouched for.
    let security = row(&report, "security");
    assert_eq!(security["status"], "skip", "{report:#}");
    assert!(
        !security["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("listens on loopback"),
        "{report:#}"
    );
}

/// A port nothing listens on.
fn unused_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// P/D only: the engines move KV with MooncakeConnector through the bootstrap, no store.
const PD_ONLY: &str = r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}"#;

#[test]
fn a_pd_only_stack_passes_without_a_store_or_a_master() {
    let bootstrap = Bootstrap::start(fresh_host(), 0, &[]);
    let _prefill = Sim::prefill(fresh_host(), &bootstrap, &[]);
    let args = vec![
        format!("--bootstrap={}", bootstrap.http),
        "--sidecar-args=--port=8000 --vllm-port=8200 --kv-connector=mooncake".to_string(),
        format!("--kv-transfer-config={PD_ONLY}"),
        format!("--vllm-args=vllm serve Qwen/Qwen3-8B --port=8200 --kv-transfer-config={PD_ONLY}"),
    ];
    let text = |report: &Value, name: &str| {
        row(report, name)["detail"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };

    // No master at all: the P/D rows pass, the master row says why it is not needed, and the
    // security row claims nothing about a master it did not reach.
    let (code, report) = doctor(&format!("127.0.0.1:{}", unused_port()), &args);
    assert!(failed_rows(&report).is_empty(), "{report:#}");
    assert_eq!((code, &report["ok"]), (0, &Value::Bool(true)), "{report:#}");
    for name in ["bootstrap", "connectors", "vllm_stats"] {
        assert_eq!(row(&report, name)["status"], "pass", "{report:#}");
    }
    assert_eq!(row(&report, "master")["status"], "skip", "{report:#}");
    let d = text(&report, "master");
    assert!(
        d.contains("run only MooncakeConnector") && d.contains("no MooncakeStoreConnector"),
        "{d}"
    );
    assert_eq!(row(&report, "security")["status"], "skip", "{report:#}");
    let d = text(&report, "security");
    assert!(
        d.contains("could not be checked") && !d.contains("loopback"),
        "{d}"
    );

    // A master with no store-client mounted: reported, not failed.
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let (code, report) = doctor(&m.addr(), &args);
    assert!(failed_rows(&report).is_empty(), "{report:#}");
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(row(&report, "master")["status"], "pass", "{report:#}");
    assert!(
        text(&report, "master").contains("no segment registered"),
        "{report:#}"
    );

    // The same master where a store is expected still fails: told nothing about the engines
    // (the fix says how to tell it), or told they run MooncakeStoreConnector.
    let (code, report) = doctor(&m.addr(), &[]);
    assert_only_failure(
        code,
        &report,
        "master",
        "no segment is registered",
        "pass the engine's --kv-transfer-config",
    );
    let (code, report) = doctor(
        &m.addr(),
        &[format!("--kv-transfer-config={MULTI_MOONCAKE}")],
    );
    assert_only_failure(
        code,
        &report,
        "master",
        "no segment is registered",
        "start a store-client",
    );
}

#[test]
fn a_killed_store_fails_the_store_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A long client_ttl keeps the dead store's segment registered while doctor looks at it.
    let m = Master::start(&dir.path().join("m"), &["--client_ttl=120"]);
    let mut store = Store::start(&m.addr(), "16MB", &[]);
    let admin = store.admin.expect("store admin").to_string();
    let (code, report) = doctor(&m.addr(), &[format!("--store={admin}")]);
    assert_eq!(
        row(&report, "store_clients")["status"],
        "pass",
        "{report:#}"
    );
    assert_eq!(code, 0, "{report:#}");

    store.proc.kill9();
    let (code, report) = doctor(&m.addr(), &[format!("--store={admin}")]);
    assert_only_failure(
        code,
        &report,
        "store_clients",
        &format!("store-client admin {admin} does not answer"),
        "restart the dead lunakv-store",
    );

    // Without --store, the master's view alone: the segment stops pinging.
    let segment = store.segment_name();
    let seen = wait_until(Duration::from_secs(60), || {
        let (code, report) = doctor(&m.addr(), &["--stale-ping-ms=1500".to_string()]);
        (row(&report, "store_clients")["status"] == "fail").then_some((code, report))
    });
    let (code, report) = seen.expect("the master's view never showed the dead store");
    assert_only_failure(
        code,
        &report,
        "store_clients",
        &format!("{segment} (client "),
        "restart the dead lunakv-store",
    );
    let d = row(&report, "store_clients")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(d.contains("last pinged the master"), "{d}");
}

#[test]
fn offload_mismatch_fails_the_offload_config_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let _store = Store::start(&m.addr(), "16MB", &[]);
    // The engine asks for the SSD tier; neither the master nor the store-client has it.
    let config = engine_config(dir.path(), &m.addr(), true);
    let (code, report) = doctor(&m.addr(), &[format!("--config={config}")]);
    assert_only_failure(
        code,
        &report,
        "offload_config",
        "\"enable_offload\": true but the master false",
        "lunakv-master --enable_offload=true",
    );
    let d = row(&report, "offload_config")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(d.contains("no store-client offers a disk tier"), "{d}");

    // The same engine config with offload off agrees with that stack.
    let config = engine_config(dir.path(), &m.addr(), false);
    let (code, report) = doctor(&m.addr(), &[format!("--config={config}")]);
    assert_eq!(
        row(&report, "offload_config")["status"],
        "pass",
        "{report:#}"
    );
    assert_eq!(code, 0);
}

#[test]
fn a_test_write_that_never_reaches_the_disk_fails_the_offload_write_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &["--enable_offload=true"]);

    // A master with the SSD tier but a store-client without one: the probe has nowhere to go.
    let dram_only = Store::start(&m.addr(), "16MB", &[]);
    let (code, report) = doctor(&m.addr(), &[]);
    let r = row(&report, "offload_write");
    assert_eq!(r["status"], "fail", "{report:#}");
    let d = r["detail"].as_str().unwrap_or_default();
    assert!(
        d.contains("no mounted store-client offers a usable disk tier"),
        "{d}"
    );
    let f = r["fix"].as_str().unwrap_or_default();
    assert!(f.contains("--enable_offload=true"), "{f}");
    assert_eq!(code, 1, "{report:#}");
    drop(dram_only);
    drop(m);

    // A store-client that offloads, but --offload-dir names another directory: the probe
    // reaches the master's disk index while the directory the operator watches stays empty,
    // which is exactly the seed's "an all-Ready cluster does not prove the Store works".
    let m = Master::start(&dir.path().join("m2"), &["--enable_offload=true"]);
    let offload_dir = dir.path().join("offload");
    let (_store, store_admin) = offload_store(&m.addr(), &offload_dir);
    let elsewhere = dir.path().join("not-the-offload-dir");
    std::fs::create_dir_all(&elsewhere).expect("mkdir");
    let (code, report) = doctor(
        &m.addr(),
        &[
            format!("--store={store_admin}"),
            format!("--offload-dir={}", elsewhere.display()),
        ],
    );
    assert_only_failure(
        code,
        &report,
        "offload_write",
        "did not grow",
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
    );
    // The right directory passes the same check.
    let (code, report) = doctor(
        &m.addr(),
        &[
            format!("--store={store_admin}"),
            format!("--offload-dir={}", offload_dir.display()),
        ],
    );
    assert_eq!(
        row(&report, "offload_write")["status"],
        "pass",
        "{report:#}"
    );
    assert_eq!(code, 0, "{report:#}");
}

#[test]
fn a_bad_engine_config_fails_its_row_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let _store = Store::start(&m.addr(), "16MB", &[]);
    // vLLM's bool("false") trap: lunakv refuses the string instead of reading it as true.
    let p = dir.path().join("bad.json");
    std::fs::write(
        &p,
        format!(
            r#"{{"master_server_address":"{}","mode":"standalone-store","global_segment_size":0,"local_buffer_size":"64MB","protocol":"tcp","enable_offload":"false"}}"#,
            m.addr()
        ),
    )
    .expect("write");
    let (code, report) = doctor(&m.addr(), &[format!("--config={}", p.display())]);
    assert_only_failure(
        code,
        &report,
        "engine_config",
        "enable_offload",
        "mooncake_config.json",
    );
    // The rest still ran against the master given on the command line.
    assert_eq!(row(&report, "master")["status"], "pass", "{report:#}");
}

#[test]
fn bootstrap_without_engines_or_down_fails_the_bootstrap_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let _store = Store::start(&m.addr(), "16MB", &[]);
    let mut bootstrap = Bootstrap::start(fresh_host(), 0, &[]);
    let arg = format!("--bootstrap={}", bootstrap.http);

    let (code, report) = doctor(&m.addr(), std::slice::from_ref(&arg));
    assert_only_failure(
        code,
        &report,
        "bootstrap",
        "lists no engine",
        "start the prefill engines with MooncakeConnector",
    );

    bootstrap.proc.kill9();
    let (code, report) = doctor(&m.addr(), &[arg]);
    assert_only_failure(
        code,
        &report,
        "bootstrap",
        "does not answer GET /query",
        "start lunakv-bootstrap",
    );
}

#[test]
fn connector_mismatch_fails_the_connectors_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let _store = Store::start(&m.addr(), "16MB", &[]);
    let sidecar = "--sidecar-args=--port=8000 --kv-connector=mooncake".to_string();

    // Top level: the engine runs NixlConnector.
    let top = r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#;
    let (code, report) = doctor(
        &m.addr(),
        &[sidecar.clone(), format!("--kv-transfer-config={top}")],
    );
    assert_only_failure(
        code,
        &report,
        "connectors",
        "--kv-connector=mooncake does not match",
        "needs the engine to run MooncakeConnector",
    );

    // Nested: a MultiConnector without MooncakeConnector among its connectors.
    let nested = r#"{"kv_connector":"MultiConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_consumer"},{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_consumer"}]}}"#;
    let (code, report) = doctor(
        &m.addr(),
        &[sidecar.clone(), format!("--kv-transfer-config={nested}")],
    );
    assert_only_failure(
        code,
        &report,
        "connectors",
        "--kv-connector=mooncake does not match",
        "needs the engine to run MooncakeConnector",
    );

    // ...and the nested MooncakeConnector matches.
    let (code, report) = doctor(
        &m.addr(),
        &[sidecar, format!("--kv-transfer-config={MULTI_MOONCAKE}")],
    );
    assert_eq!(row(&report, "connectors")["status"], "pass", "{report:#}");
    assert_eq!(code, 0);
}

#[test]
fn vllm_stats_on_with_multiconnector_mooncake_is_a_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let _store = Store::start(&m.addr(), "16MB", &[]);
    // The pd-mooncake prefill's command line without --disable-log-stats (vLLM #43828).
    let args = [
        format!(
            "--vllm-args=vllm serve Qwen/Qwen3-0.6B --port=8000 --kv-transfer-config={MULTI_MOONCAKE}"
        ),
        "--vllm-version=0.32.0".to_string(),
    ];
    let (code, report) = doctor(&m.addr(), &args);
    let r = row(&report, "vllm_stats");
    assert_eq!(r["status"], "warn", "{report:#}");
    let detail = r["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("vLLM issue #43828") && detail.contains("vLLM 0.32.0"),
        "{report:#}"
    );
    assert!(
        r["fix"]
            .as_str()
            .unwrap_or_default()
            .contains("--disable-log-stats"),
        "{report:#}"
    );
    // A warning does not fail the run.
    assert!(failed_rows(&report).is_empty(), "{report:#}");
    assert_eq!(code, 0);
}

#[test]
fn instances_that_never_share_a_key_are_flagged_by_doctor_and_the_metric() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let _store = Store::start(&m.addr(), "16MB", &[]);
    // Two instances of one model and rank whose hash chains differ: disjoint keys.
    let a = requester(&m.addr());
    let b = requester(&m.addr());
    for i in 0..MIN_KEYS as u64 {
        a.put(&vllm_key("Qwen3-8B", 0, i), b"block-a")
            .expect("put a");
        b.put(&vllm_key("Qwen3-8B", 0, 1 << 40 | i), b"block-b")
            .expect("put b");
        // Each looks up only its own keys: no hit crosses instances.
        assert!(a.exists(&vllm_key("Qwen3-8B", 0, i)).expect("exists"));
    }

    let (code, report) = doctor(&m.addr(), &[]);
    assert_only_failure(code, &report, "key_consistency", UNSHARED, "PYTHONHASHSEED");
    let d = row(&report, "key_consistency")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(d.contains("Qwen3-8B@tp_rank:0"), "{d}");

    // The metric and the admin route say the same.
    let (_, metrics) = m.http_get("/metrics");
    assert!(
        metrics.contains("lunakv_namespace_unshared_instances{namespace=\"Qwen3-8B@tp_rank:0\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("lunakv_namespace_keys_put_total{namespace=\"Qwen3-8B@tp_rank:0\"} 128"),
        "{metrics}"
    );
    let (status, body) = m.http_get("/namespaces");
    assert_eq!(status, 200);
    let ns: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(ns["namespaces"][0]["unshared"], true, "{ns:#}");
    assert_eq!(ns["namespaces"][0]["message"], UNSHARED);

    // One cross-instance hit clears it.
    assert!(b.exists(&vllm_key("Qwen3-8B", 0, 0)).expect("exists"));
    let (code, report) = doctor(&m.addr(), &[]);
    assert_eq!(
        row(&report, "key_consistency")["status"],
        "pass",
        "{report:#}"
    );
    assert_eq!(code, 0);
    assert_eq!(m.metric("lunakv_namespace_unshared_namespaces"), Some(0.0));
}
