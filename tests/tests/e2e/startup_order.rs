//! Services started before their peers wait instead of exiting (a DaemonSet or compose stack no
//! longer crash-loops), log the wait once (then at most every 30 s) and once when the peer
//! answers, stop at once on SIGTERM while waiting, and still exit on a configuration error.
//! Real binaries on loopback: the store before its master, the bootstrap before etcd, the
//! sidecar before its decode engine, a prefill engine before its bootstrap, and a client that
//! waits for its master.

use std::time::Duration;

use lunakv_client::{ClientOptions, MasterWait, StoreClient};
use lunakv_meta::testing;
use lunakv_tests::pd::{Bootstrap, Sidecar, Sim, post, request};
use lunakv_tests::{
    Master, Proc, Store, child_env, free_port, http_get, pattern, requester, wait_until, warn_lines,
};
use serde_json::json;

/// The WARN line a waiting store prints first.
const STORE_WAITING: &str = "waiting for lunakv-master at";

#[test]
fn a_store_started_before_its_master_waits_then_mounts_and_serves() {
    let port = free_port();
    let master_addr = format!("127.0.0.1:{port}");
    let mut store = Store::spawn_unmounted(&master_addr, "32MB", &[]);
    let admin = store.admin.expect("admin address");
    store
        .proc
        .wait_for_line(STORE_WAITING, Duration::from_secs(20));

    // Waiting, not exiting: alive (liveness 200), not ready (503, naming the master).
    assert!(store.proc.alive(), "{}", store.proc.output());
    assert_eq!(http_get(admin, "/health"), (200, "OK".to_string()));
    let (code, body) = http_get(admin, "/ready");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains(&master_addr), "{body}");
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(
        metrics.contains("lunakv_store_segment_mounted 0"),
        "{metrics}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let master = Master::start_on(dir.path(), &[], port);
    store
        .proc
        .wait_for_line("lunakv-store listening", Duration::from_secs(30));
    let (code, body) = http_get(admin, "/ready");
    assert_eq!((code, body.as_str()), (200, "ready"));
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(
        metrics.contains("lunakv_store_segment_mounted 1"),
        "{metrics}"
    );

    // The pool works: a put lands on this store's segment and reads back.
    let c = requester(&master.addr());
    let value = pattern(7, 256 << 10);
    c.put("late-master", &value).expect("put");
    assert_eq!(c.get("late-master").expect("get"), value);

    // One WARN line for the whole wait (the bound is 2; a wait under 30 s gets one),
    // and one INFO line when the master answered.
    let out = store.proc.output();
    let warns = warn_lines(&out);
    assert!(warns.len() <= 2, "{} WARN lines:\n{out}", warns.len());
    assert_eq!(
        warns.iter().filter(|l| l.contains(STORE_WAITING)).count(),
        1,
        "{out}"
    );
    assert!(out.contains("answered after"), "{out}");
    println!("store: {} WARN line(s) while waiting", warns.len());
    assert_eq!(store.proc.terminate(Duration::from_secs(20)), Some(0));
}

#[test]
fn a_waiting_store_stops_on_sigterm_with_status_0() {
    let mut store = Store::spawn_unmounted(&format!("127.0.0.1:{}", free_port()), "16MB", &[]);
    store
        .proc
        .wait_for_line(STORE_WAITING, Duration::from_secs(20));
    // The bound is generous for a loaded machine; the store stops as soon as the signal lands.
    assert_eq!(store.proc.terminate(Duration::from_secs(10)), Some(0));
    assert!(
        store
            .proc
            .output()
            .contains("shutting down before the segment was mounted"),
        "{}",
        store.proc.output()
    );
}

#[test]
fn a_refused_mount_is_still_fatal() {
    // A cluster_id mismatch cannot be fixed by waiting: the store exits non-zero, naming it.
    let dir = tempfile::tempdir().expect("tempdir");
    let master = Master::start(dir.path(), &["--cluster_id=alpha"]);
    let mut p = Proc::spawn(
        "lunakv-store",
        &[
            format!("--master_server_address={}", master.addr()),
            "--cluster_id=beta".to_owned(),
            "--host=127.0.0.1".to_owned(),
            "--port=0".to_owned(),
            "--metrics_port=0".to_owned(),
            "--global_segment_size=16MB".to_owned(),
        ],
        &[],
    );
    let code = p.wait_exit(Duration::from_secs(30));
    let out = p.output();
    assert!(matches!(code, Some(c) if c != 0), "{out}");
    assert!(out.contains("cluster"), "{out}");
    assert!(
        !out.contains(STORE_WAITING),
        "a refusal is not waited on:\n{out}"
    );

    // So is a malformed address.
    let mut p = Proc::spawn(
        "lunakv-store",
        &[
            "--master_server_address=not an address".to_owned(),
            "--host=127.0.0.1".to_owned(),
            "--port=0".to_owned(),
            "--metrics_port=0".to_owned(),
            "--global_segment_size=16MB".to_owned(),
        ],
        &[],
    );
    let code = p.wait_exit(Duration::from_secs(30));
    assert!(matches!(code, Some(c) if c != 0), "{}", p.output());
}

#[test]
fn a_client_told_to_wait_connects_once_the_master_is_up() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let connecting = std::thread::spawn({
        let addr = addr.clone();
        move || {
            StoreClient::connect(ClientOptions {
                master_server_address: addr,
                // Embedded: the mount waits too.
                global_segment_size: 16 << 20,
                master_wait: MasterWait::AtMost(Duration::from_secs(120)),
                ..ClientOptions::default()
            })
        }
    });
    // Whether or not the connect has started yet, it must end connected.
    let dir = tempfile::tempdir().expect("tempdir");
    let _master = Master::start_on(dir.path(), &[], port);
    let c = connecting
        .join()
        .expect("connect thread")
        .expect("connected");
    c.put("k", b"v").expect("put");
    assert_eq!(c.get("k").expect("get"), b"v");
    c.close().expect("close");

    // Without a wait (the default, the CLI's), an absent master is an error at once.
    let e = StoreClient::connect(ClientOptions {
        master_server_address: format!("127.0.0.1:{}", free_port()),
        ..ClientOptions::default()
    })
    .err()
    .expect("no master");
    assert!(
        e.to_string().contains("is lunakv-master running there"),
        "{e}"
    );
}

#[test]
fn the_bootstrap_waits_for_etcd_then_serves_the_shared_table() {
    let Some(mut etcd) = testing::etcd_or_skip() else {
        return;
    };
    etcd.kill();
    let mut b = Proc::spawn(
        "lunakv-bootstrap",
        &[
            "--host=127.0.0.1".to_owned(),
            "--port=0".to_owned(),
            "--grpc-port=0".to_owned(),
            format!("--etcd-endpoints={}", etcd.endpoint()),
            "--cluster-id=startup-test".to_owned(),
            "--probe-workers=false".to_owned(),
        ],
        &[],
    );
    b.wait_for_line("waiting for etcd at", Duration::from_secs(20));
    assert!(b.alive(), "{}", b.output());

    etcd.restart().expect("etcd back on its port");
    let line = b.wait_for_line("lunakv-bootstrap listening", Duration::from_secs(30));
    let http: std::net::SocketAddr = lunakv_tests::fields(&line)["http"]
        .parse()
        .expect("http address");
    let reg = json!({"engine_id": "E", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                     "addr": "tcp://10.0.0.1:1"});
    assert_eq!(post(http, "/register", &[], &reg).status, 200);
    let q = request(http, "GET", "/query", &[], b"").json();
    assert_eq!(q["0"]["engine_id"], "E", "{q}");

    let out = b.output();
    let warns = warn_lines(&out);
    assert!(warns.len() <= 2, "{} WARN lines:\n{out}", warns.len());
    assert!(out.contains("answered after"), "{out}");
    println!("bootstrap: {} WARN line(s) while waiting", warns.len());
    assert_eq!(b.terminate(Duration::from_secs(20)), Some(0));

    // SIGTERM while still waiting: a clean exit.
    etcd.kill();
    let mut b = Proc::spawn(
        "lunakv-bootstrap",
        &[
            "--host=127.0.0.1".to_owned(),
            "--port=0".to_owned(),
            "--grpc-port=0".to_owned(),
            format!("--etcd-endpoints={}", etcd.endpoint()),
        ],
        &[],
    );
    b.wait_for_line("waiting for etcd at", Duration::from_secs(20));
    assert_eq!(b.terminate(Duration::from_secs(10)), Some(0));
}

#[test]
fn the_sidecar_logs_an_absent_decoder_once_not_per_request() {
    let port = free_port();
    let decoder: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let sc = Sidecar::start_at(decoder, "nixlv2", 8998, &[]);
    sc.proc
        .wait_for_line("decode engine at", Duration::from_secs(20));
    // llm-d's scheduler scrapes the engine's /metrics through the sidecar; each scrape fails
    // while vLLM loads its model.
    for _ in 0..20 {
        assert_eq!(request(sc.http, "GET", "/metrics", &[], b"").status, 503);
    }
    let out = sc.proc.output();
    let warns = warn_lines(&out);
    assert!(warns.len() <= 2, "{} WARN lines:\n{out}", warns.len());
    println!(
        "sidecar: {} WARN line(s) for 20 requests to an absent decoder",
        warns.len()
    );

    let _sim = Sim::start(decoder.ip(), port, "decode", &[]);
    sc.proc
        .wait_for_line("is reachable", Duration::from_secs(30));
    let ok = wait_until(Duration::from_secs(10), || {
        (request(sc.http, "GET", "/v1/models", &[], b"").status == 200).then_some(())
    });
    assert!(ok.is_some(), "{}", sc.proc.output());
}

/// compose starts the bootstrap beside the prefill engine only once etcd is healthy; the engine
/// used to log one WARN per 100 ms attempt meanwhile (47 in 5 s, measured).
#[test]
fn a_prefill_engine_started_before_its_bootstrap_warns_once_then_registers() {
    let host: std::net::IpAddr = [127, 0, 0, 1].into();
    let port = free_port();
    // Every failed attempt logs at DEBUG, so the test counts attempts instead of waiting a
    // fixed time for them.
    let _debug = child_env(&[("RUST_LOG", "info,lunakv_telemetry::wait=debug")]);
    let sim = Sim::start(
        host,
        0,
        "prefill",
        &[
            format!("--bootstrap=http://{host}:{port}"),
            "--lease-ttl-ms=1500".to_string(),
        ],
    );
    sim.proc
        .wait_for_line("waiting for the bootstrap at", Duration::from_secs(20));
    // Six attempts (the first and five retries, 3 s of backoff) used to be six WARN lines.
    const RETRIES: usize = 5;
    let retried = |out: &str| {
        out.lines()
            .filter(|l| l.contains("DEBUG") && l.contains("still waiting for the bootstrap"))
            .count()
    };
    wait_until(Duration::from_secs(30), || {
        (retried(&sim.proc.output()) >= RETRIES).then_some(())
    })
    .unwrap_or_else(|| panic!("{RETRIES} retries expected:\n{}", sim.proc.output()));
    let out = sim.proc.output();
    let warns = warn_lines(&out);
    let attempts = 1 + retried(&out);
    assert_eq!(
        warns.len(),
        1,
        "{} WARN lines in {attempts} attempts:\n{out}",
        warns.len()
    );
    println!(
        "prefill engine: {} WARN line(s) in {attempts} attempts without its bootstrap",
        warns.len()
    );

    let b = Bootstrap::start(host, port, &[]);
    sim.wait_registered();
    let q = b.query();
    assert_eq!(q["0"]["engine_id"], sim.engine_id.as_str(), "{q}");
    let out = sim.proc.output();
    assert!(out.contains("answered after"), "{out}");
    assert_eq!(warn_lines(&out).len(), 1, "{out}");
}
