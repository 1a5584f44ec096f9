//! Logs a collector can parse, from the real binaries: no ANSI colour when stderr is not a
//! terminal (a pod's, compose's), colour on a terminal unless `NO_COLOR` is set, and one JSON
//! object per line with `LUNAKV_LOG_FORMAT=json`.

use std::process::Command;
use std::time::Duration;

use lunakv_tests::{Master, Store, bin, child_env};

const ESC: char = '\u{1b}';

/// What a master and a store-client (piped, as in a pod) print up to the store's mount.
fn master_and_store_logs() -> [(&'static str, String); 2] {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let s = Store::start(&m.addr(), "16MB", &["--enable_shm=false"]);
    s.proc
        .wait_for_line("segment mounted", Duration::from_secs(20));
    [("master", m.proc.output()), ("store", s.proc.output())]
}

#[test]
fn piped_logs_carry_no_colour() {
    for (name, out) in master_and_store_logs() {
        assert!(out.lines().count() > 2, "{name} logged nothing:\n{out}");
        let coloured = out.lines().filter(|l| l.contains(ESC)).count();
        assert_eq!(
            coloured, 0,
            "{name}: {coloured} lines with escape codes:\n{out}"
        );
    }
}

#[test]
fn json_logs_are_one_object_per_line() {
    let _env = child_env(&[("LUNAKV_LOG_FORMAT", "json")]);
    for (name, out) in master_and_store_logs() {
        // stdout's machine-readable lines ("lunakv-master listening ...", "lunakv-store bound
        // ...", "lunakv-store listening ...") are not log lines.
        let logs: Vec<&str> = out.lines().filter(|l| !l.starts_with("lunakv-")).collect();
        assert!(logs.len() > 2, "{name} logged nothing:\n{out}");
        for l in logs {
            let v: serde_json::Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{name}: not a JSON line ({e}): {l}"));
            assert!(
                v["level"].is_string() && v["fields"]["message"].is_string(),
                "{l}"
            );
        }
    }
}

/// Runs the master on a pseudo-terminal (util-linux `script`) for a moment; returns what it
/// printed there.
fn on_a_terminal(env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let cmd = format!(
        "{} --rpc_address=127.0.0.1 --rpc_port=0 --metrics_port=0 --data_dir={}",
        bin("lunakv-master").display(),
        dir.path().display()
    );
    let out = Command::new("timeout")
        .args(["-s", "TERM", "3", "script", "-qec", &cmd, "/dev/null"])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .envs(env.iter().copied())
        .output()
        .expect("timeout + script (util-linux) run");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_terminal_gets_colour_unless_no_color_is_set() {
    let tty = on_a_terminal(&[]);
    assert!(tty.contains("lunakv-master serving"), "{tty}");
    assert!(tty.contains(ESC), "no colour on a terminal:\n{tty}");
    let plain = on_a_terminal(&[("NO_COLOR", "1")]);
    assert!(plain.contains("lunakv-master serving"), "{plain}");
    assert!(!plain.contains(ESC), "NO_COLOR=1 still coloured:\n{plain}");
}

/// Issue 33 item 7: a peer's strings reach the master's log (here an inventory key and a
/// segment name, logged when the unproven entry is rejected). With CR, LF and ESC in them a
/// caller used to write lines of its own into the log and drive the reader's terminal. Every
/// field is now escaped: the forged text stays inside the WARN line that quotes it.
#[test]
fn a_peers_key_with_newlines_and_escapes_forges_no_log_line() {
    use lunakv_proto::master as pb;

    const FORGED: &str = "2030-01-01T00:00:00.000000Z ERROR forged-by-a-peer";
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let evil = format!("k\n{FORGED} key\r\n\u{1b}[2J\u{1b}[31mred");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r = rt.block_on(async {
        let mut c = pb::master_client::MasterClient::connect(format!("http://{}", m.addr()))
            .await
            .unwrap();
        let req = pb::MountSegmentRequest {
            client_id: "00000000-0000-0000-0000-00000000e71c".into(),
            cluster_id: "mooncake_cluster".into(),
            segment: Some(pb::SegmentDescriptor {
                name: format!("127.0.0.1:1\n{FORGED} segment"),
                transfer_endpoint: "127.0.0.1:1".into(),
                size: 1 << 20,
                protocol: "tcp".into(),
                ..Default::default()
            }),
            inventory: vec![pb::InventoryItem {
                key: evil.clone(),
                // Size 0: rejected, and the master logs the entry's key.
                offset: 0,
                size: 0,
                generation: 7,
                ..Default::default()
            }],
            ..Default::default()
        };
        c.mount_segment(tonic::Request::new(req)).await
    });
    let r = r.expect("the mount is answered").into_inner();
    assert_eq!(r.rejected_generations, vec![7], "the size-0 entry");
    let line = m
        .proc
        .wait_for_line("inventory entry rejected", Duration::from_secs(10));
    let out = m.proc.output();
    assert!(
        line.contains("k\\n2030"),
        "the key is logged, escaped: {line}"
    );
    assert!(
        line.contains("127.0.0.1:1\\n2030"),
        "the segment, escaped: {line}"
    );
    let forged: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(FORGED))
        .collect();
    assert!(forged.is_empty(), "forged lines {forged:?} in:\n{out}");
    assert!(
        !out.contains(ESC) && !out.contains('\r'),
        "control characters in the log:\n{out}"
    );
}
