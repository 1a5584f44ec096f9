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

/// Raises this test process's soft open-file limit to the hard one; returns the new soft limit.
fn raise_own_fd_limit() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on our own process with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
    }
    l.rlim_cur
}

/// A `lunakv-store` whose open-file limit is `nofile` (soft and hard), as on a host that never
/// raised it: a flood exhausts it quickly.
fn store_with_fd_limit(master: &str, nofile: u64, env: &[(&str, &str)]) -> Store {
    let args = vec![
        "-c".to_owned(),
        format!("ulimit -n {nofile} && exec \"$0\" \"$@\""),
        lunakv_tests::bin("lunakv-store").display().to_string(),
        format!("--master_server_address={master}"),
        "--host=127.0.0.1".to_owned(),
        "--port=0".to_owned(),
        "--metrics_port=0".to_owned(),
        "--global_segment_size=16MB".to_owned(),
    ];
    let proc =
        lunakv_tests::Proc::spawn_path(std::path::Path::new("/bin/sh"), "lunakv-store", &args, env);
    store_from(proc)
}

fn store_from(proc: lunakv_tests::Proc) -> Store {
    let line = proc.wait_for_line("listening", Duration::from_secs(40));
    let f = lunakv_tests::fields(&line);
    Store {
        transfer: f["transfer"].parse().expect("transfer address"),
        admin: f.get("admin").and_then(|a| a.parse().ok()),
        proc,
    }
}

fn store_metric(store: &Store, name: &str) -> Option<f64> {
    let (_, body) = lunakv_tests::http_get(store.admin.expect("admin address"), "/metrics");
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok())?
    })
}

/// Opens up to `n` idle connections to `to` from the loopback address `from` (another peer
/// than the test's clients on 127.0.0.1), all at once; returns the ones that connected.
fn flood(from: &str, to: std::net::SocketAddr, n: usize) -> Vec<std::net::TcpStream> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let src: std::net::SocketAddr = format!("{from}:0").parse().expect("source address");
    rt.block_on(async {
        let tries = (0..n).map(|_| async move {
            let s = tokio::net::TcpSocket::new_v4().ok()?;
            s.bind(src).ok()?;
            let c = tokio::time::timeout(Duration::from_secs(2), s.connect(to))
                .await
                .ok()?
                .ok()?;
            c.into_std().ok()
        });
        futures::future::join_all(tries)
            .await
            .into_iter()
            .flatten()
            .collect()
    })
}

#[test]
fn connection_flood_from_one_peer_leaves_tcp_and_shm_gets_working() {
    let own = raise_own_fd_limit();
    // Enough idle connections to exhaust a store held to 1024 descriptors several times over.
    let n = 2000.min(own.saturating_sub(400) as usize);
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    // The cap comes from the environment (a flag works too), so an older store still starts.
    let store = store_with_fd_limit(
        &m.addr(),
        1024,
        &[("LUNAKV_TRANSFER_MAX_CONNS_PER_PEER", "64")],
    );
    let value = pattern(17, 300_000);
    tcp_requester(&m.addr())
        .put("flood-victim", &value)
        .expect("put before the flood");

    let held = flood("127.0.0.2", store.transfer, n);
    assert!(!held.is_empty(), "the flood could not connect at all");
    // Fresh clients during the flood: new tcp connections, a new shm attach.
    let tcp = tcp_requester(&m.addr());
    assert_eq!(
        tcp.get("flood-victim").expect("tcp get during the flood"),
        value
    );
    let attaches = store_metric(&store, "lunakv_store_shm_attaches_total").unwrap_or(0.0);
    let shm = requester(&m.addr());
    assert_eq!(
        shm.get("flood-victim").expect("shm get during the flood"),
        value
    );
    assert!(
        store_metric(&store, "lunakv_store_shm_attaches_total").unwrap_or(0.0) > attaches,
        "the get did not go through shm"
    );
    let refused = store_metric(&store, "lunakv_store_transfer_connections_refused_total")
        .expect("refused metric");
    let open = store_metric(&store, "lunakv_store_transfer_connections").expect("open metric");
    eprintln!(
        "flood of {n}: {} connected, store holds {open}, refused {refused}",
        held.len()
    );
    assert!(
        refused > 0.0,
        "nothing refused: the per-peer cap did not apply"
    );
    assert!(
        open <= 64.0 + 16.0,
        "{open} connections open despite a cap of 64 per peer"
    );
    assert!(
        store
            .proc
            .output()
            .matches("refusing a transfer connection")
            .count()
            <= 2,
        "refusals are logged once per peer per 30 s"
    );
    drop(held);
}

/// Anonymous resident memory of `pid` in bytes (heap and stacks; the segment is shared memory).
fn rss_anon(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("RssAnon");
    kb << 10
}

#[test]
fn free_header_flood_keeps_store_memory_bounded() {
    use lunakv_transfer::wire::{MAX_FREE_ITEMS, Op, Request};
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let store = Store::start(&m.addr(), "8MB", &[]);
    let pid = store.proc.pid();
    let before = rss_anon(pid);
    // Each header claims a million FREE pairs (16 MiB) and never sends them.
    let hdr = Request {
        key_len: MAX_FREE_ITEMS,
        ..Request::bare(Op::Free)
    }
    .encode();
    let conns: Vec<TcpStream> = (0..100)
        .map(|_| {
            let mut s = TcpStream::connect(store.transfer).expect("connect");
            s.write_all(&hdr).expect("header");
            s
        })
        .collect();
    // Every header has been read once the store holds all 100 connections (or its memory
    // already shows it).
    let mut peak = 0;
    wait_until(Duration::from_secs(20), || {
        peak = peak.max(rss_anon(pid));
        let open = store_metric(&store, "lunakv_store_transfer_connections").unwrap_or(0.0);
        (open >= 100.0 || peak > before + (512 << 20)).then_some(())
    });
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(50));
        peak = peak.max(rss_anon(pid));
    }
    let grew = peak.saturating_sub(before);
    eprintln!(
        "store RssAnon before {} MiB, peak under 100 FREE headers {} MiB",
        before >> 20,
        peak >> 20
    );
    assert!(
        grew < 64 << 20,
        "100 FREE headers without a body grew the store by {} MiB",
        grew >> 20
    );
    drop(conns);
    // Still serving.
    let c = tcp_requester(&m.addr());
    c.put("after-free-flood", b"ok").expect("put");
    assert_eq!(c.get("after-free-flood").expect("get"), b"ok");
}

#[test]
fn bad_frames_from_one_peer_log_a_bounded_number_of_warnings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let store = Store::start(&m.addr(), "8MB", &[]);
    let frames = 300;
    for _ in 0..frames {
        let mut s = TcpStream::connect(store.transfer).expect("connect");
        s.write_all(&[0xde; 40]).expect("garbage");
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        // The store closes the connection: a bad frame ends only that one.
        let _ = s.read(&mut [0u8; 64]);
    }
    let counted = wait_until(Duration::from_secs(10), || {
        let n = store_metric(&store, "lunakv_store_transfer_bad_frames_total")?;
        (n >= frames as f64).then_some(n)
    });
    let warnings = store.proc.output().matches("sent a bad frame").count();
    assert!(
        warnings <= 2,
        "{warnings} warnings for {frames} bad frames from one peer"
    );
    assert_eq!(
        counted,
        Some(frames as f64),
        "the metric counts every bad frame"
    );
    let c = tcp_requester(&m.addr());
    c.put("after-garbage", b"ok").expect("put after bad frames");
}

#[test]
fn store_restarted_while_its_port_is_held_binds_once_it_is_free() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    // What a kill -9 leaves behind: the port held by someone else for a while.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("hold a port");
    let port = holder.local_addr().expect("addr").port();
    let args: Vec<String> = vec![
        format!("--master_server_address={}", m.addr()),
        "--host=127.0.0.1".into(),
        format!("--port={port}"),
        "--metrics_port=0".into(),
        "--global_segment_size=8MB".into(),
    ];
    let proc = lunakv_tests::Proc::spawn("lunakv-store", &args, &[]);
    proc.wait_for_line("transfer port in use", Duration::from_secs(20));
    drop(holder);
    let store = store_from(proc);
    assert_eq!(store.transfer.port(), port);
    assert_eq!(
        store.proc.output().matches("transfer port in use").count(),
        1,
        "the retry is logged once"
    );
    let c = tcp_requester(&m.addr());
    c.put("after-bind-retry", b"ok").expect("put");
    assert_eq!(c.get("after-bind-retry").expect("get"), b"ok");
}

/// The store's /metrics carries the device layer's refused-2D-copy and split-run counters
/// (docs/GPU.md), so a GPU run's scrape shows whether the split happened; a store that moved no
/// device memory reports both at 0.
#[test]
fn store_metrics_count_refused_2d_copies_and_split_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let store = store_with_fd_limit(&m.addr(), 1024, &[]);
    for name in [
        "lunakv_device_copy_2d_refused_total",
        "lunakv_device_copy_2d_split_runs_total",
    ] {
        assert_eq!(store_metric(&store, name), Some(0.0), "{name}");
    }
}
