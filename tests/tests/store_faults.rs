//! Pressure, liveness, restarts, and bad input: the pool keeps its promises and keeps serving.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use lunakv_client::{ClientError, ErrorCode, ReplicateConfig};
use lunakv_tests::{Master, Store, pattern, requester, tcp_requester, wait_until};

#[test]
fn eviction_under_pressure_never_takes_leased_objects() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Leases long enough to outlast the whole test.
    let m = Master::start(dir.path(), &["--default_kv_lease_ttl=120000"]);
    let _store = Store::start(&m.addr(), "8MB", &[]);
    let c = tcp_requester(&m.addr());
    let obj = 256 << 10;

    // Fill about half the pool, then lease every one of those objects.
    let leased: Vec<String> = (0..14).map(|i| format!("leased-{i}")).collect();
    for (i, k) in leased.iter().enumerate() {
        c.put(k, &pattern(i as u64, obj)).expect("put leased");
    }
    let refs: Vec<&str> = leased.iter().map(String::as_str).collect();
    assert!(c.batch_exists(&refs).iter().all(|r| matches!(r, Ok(true))));

    // Now write three times the pool's size. Only unleased objects may make room.
    let mut written = Vec::new();
    for i in 0..96u64 {
        let k = format!("churn-{i}");
        match c.put(&k, &pattern(1000 + i, obj)) {
            Ok(()) => written.push((k, 1000 + i)),
            Err(e) => assert_eq!(
                e.code(),
                ErrorCode::NoAvailableHandle,
                "unexpected put error {e}"
            ),
        }
    }
    assert!(
        written.len() > 20,
        "pressure should have been relieved by eviction, only {} puts landed",
        written.len()
    );
    let evicted = m
        .metric("master_evicted_key_count")
        .expect("evicted metric");
    assert!(evicted > 0.0, "nothing was evicted");
    assert!(m.metric("master_successful_evictions_total").unwrap_or(0.0) > 0.0);

    // Every leased object survived with its bytes; every object still present is intact.
    let reader = requester(&m.addr());
    for (i, k) in leased.iter().enumerate() {
        assert_eq!(
            reader.get(k).expect("leased object kept"),
            pattern(i as u64, obj),
            "{k}"
        );
    }
    let mut present = 0;
    for (k, seed) in &written {
        match reader.get(k) {
            Ok(v) => {
                assert_eq!(v, pattern(*seed, obj), "{k} corrupted");
                present += 1;
            }
            Err(ClientError::ObjectNotFound(_)) => {}
            Err(e) => panic!("{k}: {e}"),
        }
    }
    assert!(present > 0);
    // A leased object cannot be removed without force, and can with it.
    let e = c.remove(&leased[0], false).expect_err("leased");
    assert_eq!(e.code(), ErrorCode::ObjectHasLease);
    c.remove(&leased[0], true).expect("forced remove");
}

#[test]
fn killed_store_is_unmounted_within_client_ttl() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ttl = 3;
    let m = Master::start(dir.path(), &[&format!("--client_ttl={ttl}")]);
    let mut store = Store::start(&m.addr(), "16MB", &[]);
    let c = tcp_requester(&m.addr());
    c.put("doomed", &pattern(1, 4096)).expect("put");
    let seg = store.segment_name();
    let (_, before) = m.http_get("/get_all_segments");
    assert!(before.contains(&seg), "{before}");

    store.proc.kill9();
    let killed = Instant::now();
    let gone = wait_until(Duration::from_secs(ttl + 2), || {
        let (_, body) = m.http_get("/get_all_segments");
        (!body.contains(&seg)).then_some(())
    });
    assert!(
        gone.is_some(),
        "segment {seg} still mounted {:?} after kill -9 (client_ttl {ttl}s)",
        killed.elapsed()
    );
    assert_eq!(m.metric("master_total_capacity_bytes"), Some(0.0));
    assert!(!c.exists("doomed").expect("exists"));
}

#[test]
fn master_restart_on_embedded_metadata_keeps_objects() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = Master::start(dir.path(), &[]);
    let _store = Store::start(&m.addr(), "32MB", &[]);
    let c = tcp_requester(&m.addr());
    let values: Vec<Vec<u8>> = (0..20).map(|i| pattern(i, 100_000 + i as usize)).collect();
    for (i, v) in values.iter().enumerate() {
        c.put(&format!("keep-{i}"), v).expect("put");
    }
    m.restart();
    // The store notices at its next ping and mounts again with its inventory.
    let back = wait_until(Duration::from_secs(10), || {
        let (_, body) = m.http_get("/get_all_segments");
        (m.metric("master_key_count") == Some(20.0)).then_some(body)
    });
    assert!(
        back.is_some(),
        "index not rebuilt; master said:\n{}",
        m.proc.output()
    );

    let fresh = tcp_requester(&m.addr());
    for (i, v) in values.iter().enumerate() {
        assert_eq!(&fresh.get(&format!("keep-{i}")).expect("after restart"), v);
    }
    // New puts after the restart never collide with objects from before it.
    for i in 0..20 {
        fresh
            .put(&format!("new-{i}"), &pattern(500 + i, 50_000))
            .expect("put after restart");
    }
    for (i, v) in values.iter().enumerate() {
        assert_eq!(&c.get(&format!("keep-{i}")).expect("old client"), v);
    }
}

#[test]
fn bad_input_gets_clear_errors_and_service_continues() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let mut store = Store::start(&m.addr(), "8MB", &[]);
    let c = requester(&m.addr());

    let e = c.put("", b"x").expect_err("empty key");
    assert!(matches!(e, ClientError::InvalidKey(_)), "{e}");
    assert!(e.to_string().contains("empty"), "{e}");
    let long = "k".repeat(10_000);
    let e = c.put(&long, b"x").expect_err("oversized key");
    assert!(e.to_string().contains("10000 bytes"), "{e}");
    let e = c.put("zero", b"").expect_err("size 0");
    assert!(e.to_string().contains("size 0"), "{e}");
    let huge = vec![7u8; 9 << 20];
    let e = c.put("huge", &huge).expect_err("larger than any segment");
    assert_eq!(e.code(), ErrorCode::NoAvailableHandle, "{e}");
    let e = c.get("never-put").expect_err("missing");
    assert_eq!(e.code(), ErrorCode::ObjectNotFound);
    let mut small = [0u8; 3];
    c.put("four", b"four").expect("put");
    let e = c
        .get_into("four", &mut small)
        .expect_err("buffer too small");
    assert!(
        matches!(
            e,
            ClientError::BufferTooSmall {
                need: 4,
                have: 3,
                ..
            }
        ),
        "{e}"
    );

    // Garbage on the transfer port and on the master's gRPC port.
    for addr in [store.transfer, m.rpc] {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(&[0xde; 4096]).expect("garbage");
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let mut sink = [0u8; 64];
        let _ = s.read(&mut sink);
    }
    // A truncated frame: a plausible header start, then the peer goes away.
    {
        let mut s = TcpStream::connect(store.transfer).expect("connect");
        s.write_all(&[1, 0, 0]).expect("partial");
    }
    assert!(
        store.proc.alive(),
        "store died on garbage:\n{}",
        store.proc.output()
    );
    let other = tcp_requester(&m.addr());
    other
        .put("still-here", &pattern(3, 70_000))
        .expect("put after garbage");
    assert_eq!(
        c.get("still-here").expect("get after garbage"),
        pattern(3, 70_000)
    );
    assert_eq!(other.get("four").expect("tcp get"), b"four");

    // Preferred segment that does not exist: placed elsewhere, not refused.
    let cfg = ReplicateConfig {
        preferred_segment: Some("10.255.255.1:1".into()),
        ..Default::default()
    };
    c.put_parts("elsewhere", &[b"abc"], &cfg)
        .expect("placed on an existing segment");
}

#[test]
fn rdma_without_a_device_serves_tcp_with_one_warning_line() {
    // llm-d's DaemonSet and vLLM's default say rdma. Where this build or machine has none, the
    // store starts anyway, serves tcp, says why in ONE warning line, and every view shows it.
    // (It used to refuse to start: issue 12 asks for the fallback instead.)
    let choice = lunakv_transfer::ProtocolChoice::resolve(lunakv_transfer::WireProtocol::Rdma);
    if !choice.fell_back() {
        eprintln!("skipped: this machine has an RDMA device, rdma is served");
        return;
    }
    let reason = choice.reason.clone().expect("a fallback has a reason");
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let store = Store::start(&m.addr(), "8MB", &["--protocol=rdma"]);
    let seg = store.segment_name();

    // Mounted and serving: a tcp requester round-trips through it.
    assert_eq!(
        m.metric("master_total_capacity_bytes"),
        Some(8.0 * 1048576.0)
    );
    let c = tcp_requester(&m.addr());
    c.put("rdma-fallback", &pattern(7, 300_000)).expect("put");
    assert_eq!(c.get("rdma-fallback").expect("get"), pattern(7, 300_000));

    // Exactly one warning line, naming the reason and what is served.
    let out = store.proc.output();
    let warns: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("protocol \"rdma\" requested but unavailable"))
        .collect();
    assert_eq!(warns.len(), 1, "{out}");
    assert!(warns[0].contains("WARN"), "{}", warns[0]);
    assert!(
        warns[0].contains(&reason) && warns[0].contains("serving tcp"),
        "{}",
        warns[0]
    );

    // The store's /metrics.
    let admin = store.admin.expect("admin address");
    let (code, body) = lunakv_tests::http_get(admin, "/metrics");
    assert_eq!(code, 200);
    let line = body
        .lines()
        .find(|l| l.starts_with("lunakv_store_protocol_info{"))
        .unwrap_or_else(|| panic!("no protocol gauge in:\n{body}"));
    assert!(
        line.contains("requested=\"rdma\"")
            && line.contains("effective=\"tcp\"")
            && line.ends_with(" 1"),
        "{line}"
    );
    assert!(
        line.contains(&format!(
            "reason=\"{}\"",
            reason.replace('\\', "\\\\").replace('"', "\\\"")
        )),
        "{line}"
    );

    // The master's /metrics, per segment.
    let (_, body) = m.http_get("/metrics");
    let line = body
        .lines()
        .find(|l| l.starts_with("master_segment_protocol_info{") && l.contains(&seg))
        .unwrap_or_else(|| panic!("no segment protocol gauge in:\n{body}"));
    assert!(
        line.contains("requested=\"rdma\",effective=\"tcp\""),
        "{line}"
    );

    // An embedded client asking for rdma: starts, falls back, and its segment says so too.
    let e = lunakv_client::StoreClient::connect(lunakv_client::ClientOptions {
        master_server_address: m.addr(),
        global_segment_size: 4 << 20,
        protocol: "rdma".into(),
        ..Default::default()
    })
    .expect("an rdma client starts on tcp");
    assert_eq!(e.protocol(), &choice);
    let embedded_seg = e.segment_name().expect("embedded segment");

    // `lunakv status`: both segments show `tcp (rdma unavailable: <reason>)`.
    let status = std::process::Command::new(lunakv_tests::bin("lunakv"))
        .args(["--master", &m.addr(), "status"])
        .env_remove("MOONCAKE_MASTER")
        .env_remove("MOONCAKE_CONFIG_PATH")
        .output()
        .expect("run lunakv status");
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{text}");
    let shown = format!("tcp (rdma unavailable: {reason})");
    for s in [&seg, &embedded_seg] {
        let row = text
            .lines()
            .find(|l| l.starts_with(s.as_str()))
            .unwrap_or_else(|| panic!("no row for {s} in:\n{text}"));
        assert!(row.contains(&shown), "{row}");
    }

    // `lunakv doctor`: a warning row naming both segments; a warning alone does not fail.
    let doc = std::process::Command::new(lunakv_tests::bin("lunakv"))
        .args(["--json", "doctor", "--master", &m.addr()])
        .env_remove("MOONCAKE_MASTER")
        .env_remove("MOONCAKE_CONFIG_PATH")
        .output()
        .expect("run lunakv doctor");
    let report: serde_json::Value =
        serde_json::from_slice(&doc.stdout).expect("doctor prints JSON");
    let row = report["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "protocol"))
        .unwrap_or_else(|| panic!("no protocol row: {report:#}"));
    assert_eq!(row["status"], "warn", "{report:#}");
    let detail = row["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(&seg) && detail.contains(&embedded_seg),
        "{detail}"
    );
    assert!(detail.contains("rdma unavailable"), "{detail}");
    e.close().expect("close");
}
