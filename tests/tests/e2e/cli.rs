//! The `lunakv` CLI as an operator uses it: a separate process talking to real services, and
//! the config checks an engine's mooncake_config.json goes through.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use lunakv_tests::{Master, Store, bin, pattern, tcp_requester};

fn lunakv(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(bin("lunakv"))
        .args(args)
        .env_remove("MOONCAKE_MASTER")
        .env_remove("MOONCAKE_CONFIG_PATH")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn lunakv");
    if let Some(data) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(data)
            .expect("write stdin");
    }
    child.wait_with_output().expect("lunakv output")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn cli_put_get_exists_rm_across_processes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let _store = Store::start(&m.addr(), "32MB", &[]);
    let master = m.addr();

    // CLI process puts from stdin; this test process reads it back.
    let value = pattern(42, 300_001);
    let out = lunakv(&["--master", &master, "put", "from-cli", "-"], Some(&value));
    assert!(out.status.success(), "put failed: {}", stderr(&out));
    let c = tcp_requester(&master);
    assert_eq!(c.get("from-cli").expect("get what the CLI put"), value);

    // This process puts; the CLI process gets it into a file.
    let v2 = pattern(43, 1 << 20);
    c.put("from-test", &v2).expect("put");
    let file = dir.path().join("out.bin");
    let out = lunakv(
        &[
            "--master",
            &master,
            "get",
            "from-test",
            file.to_str().expect("utf8"),
        ],
        None,
    );
    assert!(out.status.success(), "get failed: {}", stderr(&out));
    assert_eq!(std::fs::read(&file).expect("read out file"), v2);

    // get to stdout
    let out = lunakv(&["--master", &master, "get", "from-cli"], None);
    assert!(out.status.success());
    assert_eq!(out.stdout, value);

    // exists: exit 0 yes, 1 no
    assert_eq!(
        lunakv(&["--master", &master, "exists", "from-cli"], None)
            .status
            .code(),
        Some(0)
    );
    assert_eq!(
        lunakv(&["--master", &master, "exists", "nope"], None)
            .status
            .code(),
        Some(1)
    );

    // a missing key is an error with Mooncake's code in --json
    let out = lunakv(&["--master", &master, "--json", "get", "nope"], None);
    assert!(!out.status.success());
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json error object");
    assert_eq!(j["ok"], false);
    assert_eq!(j["code"], -704);

    // rm, with --force because exists/get granted leases
    let out = lunakv(&["--master", &master, "rm", "from-cli", "--force"], None);
    assert!(out.status.success(), "rm: {}", stderr(&out));
    assert!(!c.exists("from-cli").expect("exists"));

    // status --json reports the store's segment and the remaining key
    let out = lunakv(&["--master", &master, "--json", "status"], None);
    assert!(out.status.success(), "status: {}", stderr(&out));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status json");
    let text = s.to_string();
    assert!(text.contains(&_store.segment_name()), "{text}");
    assert_eq!(s["keys"], 1, "{text}");
    assert_eq!(s["capacity_bytes"].as_u64(), Some(32 << 20), "{text}");
    assert_eq!(s["used_bytes"].as_u64(), Some(1 << 20), "{text}");

    // The master address can also come from MOONCAKE_MASTER.
    let out = Command::new(bin("lunakv"))
        .args(["exists", "from-test"])
        .env("MOONCAKE_MASTER", &master)
        .env_remove("MOONCAKE_CONFIG_PATH")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn cli_reports_a_dead_master_clearly() {
    // A port nothing listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    drop(l);
    let out = lunakv(&["--master", &addr, "put", "k", "-"], Some(b"v"));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains(&addr), "should name the address: {err}");
}

/// Each mooncake_config.json check, through the CLI's `--config`, gives vLLM's message (or
/// lunakv's stricter one) and a non-zero exit.
#[test]
fn config_checks_and_their_messages() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: &[(&str, &str)] = &[
        (
            r#"{"mode":"weird","master_server_address":"127.0.0.1:1","global_segment_size":0,"local_buffer_size":"1GB"}"#,
            "unknown Mooncake mode: 'weird'",
        ),
        (
            r#"{"mode":"standalone-store","master_server_address":"127.0.0.1:1","global_segment_size":0,"local_buffer_size":0}"#,
            "local_buffer_size must be > 0",
        ),
        (
            r#"{"mode":"embedded","master_server_address":"127.0.0.1:1","global_segment_size":0,"local_buffer_size":"1GB"}"#,
            "embedded mode requires global_segment_size > 0",
        ),
        (
            r#"{"mode":"standalone-store","master_server_address":"127.0.0.1:1","global_segment_size":"4GB","local_buffer_size":"1GB"}"#,
            "standalone-store mode requires global_segment_size == 0",
        ),
        (
            r#"{"mode":"standalone-store","master_server_address":"127.0.0.1:1","global_segment_size":0,"local_buffer_size":"1GB","enable_offload":"false"}"#,
            "enable_offload must be a JSON boolean",
        ),
        (
            r#"{"mode":"standalone-store", "master_server_address":"#,
            "invalid JSON",
        ),
        (r#"{"mode": "standalone-store",, }"#, "invalid JSON"),
    ];
    for (i, (json, want)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("c{i}.json"));
        std::fs::write(&path, json).expect("write config");
        let out = lunakv(
            &["--config", path.to_str().expect("utf8"), "exists", "k"],
            None,
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "case {i}: {err}");
        assert!(err.contains(want), "case {i}: expected '{want}' in: {err}");
    }
    // MOONCAKE_CONFIG_PATH pointing nowhere names the file.
    let out = Command::new(bin("lunakv"))
        .args(["exists", "k"])
        .env("MOONCAKE_CONFIG_PATH", dir.path().join("missing.json"))
        .env_remove("MOONCAKE_MASTER")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("missing.json"), "{}", stderr(&out));
}

/// An engine config that works but draws the connector's warnings (standalone-store without
/// offload, an unknown key) is still a fine `--config` for the CLI: each call warns only about
/// what bears on it, and `doctor` reports the engine's setup in its `engine_config` row.
#[test]
fn engine_setup_warnings_stay_out_of_every_cli_call() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(&dir.path().join("m"), &[]);
    let _store = Store::start(&m.addr(), "16MB", &[]);
    let write = |name: &str, extra: &str| {
        let p = dir.path().join(name);
        std::fs::write(
            &p,
            format!(
                r#"{{"master_server_address":"{}","mode":"standalone-store","global_segment_size":0,"local_buffer_size":"64MB","protocol":"tcp"{extra}}}"#,
                m.addr()
            ),
        )
        .expect("write config");
        p.to_str().expect("utf8").to_string()
    };
    let standalone = write("standalone.json", "");
    let c = standalone.as_str();
    let calls: [(&[&str], Option<&[u8]>); 4] = [
        (&["--config", c, "put", "k", "-"], Some(&b"v"[..])),
        (&["--config", c, "get", "k"], None),
        (&["--config", c, "exists", "k"], None),
        (&["--config", c, "status"], None),
    ];
    for (args, stdin) in calls {
        let out = lunakv(args, stdin);
        let err = stderr(&out);
        assert!(out.status.success(), "{args:?}: {err}");
        assert!(
            !err.contains("enable_offload") && !err.contains("warning"),
            "{args:?} repeats the engine's warning: {err}"
        );
    }

    // Doctor is where it shows, as a warning that does not fail the run.
    let out = lunakv(&["--json", "--config", c, "doctor"], None);
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("doctor prints JSON");
    let row = report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|r| r["name"] == "engine_config")
        .cloned()
        .expect("engine_config row");
    assert_eq!(row["status"], "warn", "{report:#}");
    assert!(
        row["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("standalone-store mode without enable_offload"),
        "{report:#}"
    );
    assert_eq!(out.status.code(), Some(0), "{report:#}");

    // A misspelt key still warns on every call: it may be why the CLI misbehaves.
    let typo = write("typo.json", r#","enable_shm":true,"protcol":"tcp""#);
    let out = lunakv(&["--config", &typo, "exists", "k"], None);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("unknown key \"protcol\"") && !err.contains("enable_offload"),
        "{err}"
    );
}

/// `make run` is `lunakv up`: a master and a store that form a pool, a mooncake_config.json an
/// engine can use, and a SIGTERM that stops both children instead of orphaning them.
#[test]
fn up_serves_a_pool_and_stops_both_children_on_sigterm() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut up = Command::new(bin("lunakv"))
        .args(["--json", "up", "--rpc-port=0", "--metrics-port=0"])
        .args([
            "--store-port=0",
            "--store-metrics-port=0",
            "--segment-size=32MB",
        ])
        .arg("--run-dir")
        .arg(dir.path())
        .env_remove("MOONCAKE_MASTER")
        .env_remove("MOONCAKE_CONFIG_PATH")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn lunakv up");
    let mut first = String::new();
    std::io::BufReader::new(up.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("read the ready line");
    let ready: serde_json::Value = serde_json::from_str(&first).expect("ready line is JSON");
    let pids: Vec<u64> = ["master_pid", "store_pid"]
        .iter()
        .map(|k| {
            ready[k]
                .as_u64()
                .unwrap_or_else(|| panic!("{k} in {ready}"))
        })
        .collect();

    // The written config reaches the pool: a put through it, then the master sees the segment.
    let config = ready["config_path"]
        .as_str()
        .expect("config_path")
        .to_string();
    let put = lunakv(&["--config", &config, "put", "up-key", "-"], Some(b"hello"));
    assert!(put.status.success(), "put via {config}: {}", stderr(&put));
    let master = ready["master"].as_str().expect("master").to_string();
    let out = lunakv(&["--master", &master, "--json", "status"], None);
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status json");
    assert_eq!(s["capacity_bytes"].as_u64(), Some(32 << 20), "{s}");
    assert_eq!(s["keys"], 1, "{s}");

    let sent = Command::new("kill")
        .args(["-TERM", &up.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(st) = up.try_wait().expect("wait") {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "lunakv up still running after SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "lunakv up exits cleanly on SIGTERM: {status:?}"
    );
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "child {pid} outlived lunakv up"
        );
    }
}
