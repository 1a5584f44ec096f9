//! Never a wrong byte, never a false miss: two stacks sharing one host, and a master restarted
//! under load. Each test names the scenario of the reliability campaign it reproduces.

use std::time::{Duration, Instant};

use lunakv_client::{ClientError, ClientOptions, StoreClient};
use lunakv_tests::{Master, Proc, Store, fields, pattern, tcp_requester};

/// A port free on both 127.0.0.1 and 127.0.0.2: two stacks on one host with the same ports,
/// as two network namespaces (or two clusters on one node) have them.
fn port_free_on_both() -> u16 {
    for _ in 0..50 {
        let a = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = a.local_addr().expect("addr").port();
        if std::net::TcpListener::bind(("127.0.0.2", port)).is_ok() {
            return port;
        }
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2");
}

/// A stack: master and store-client on `ip`, the store on `store_port`, its default shm
/// socket in `runtime_dir`.
struct Stack {
    _master: Proc,
    store: Proc,
    rpc: String,
}

fn stack(
    ip: &str,
    store_port: u16,
    runtime_dir: &std::path::Path,
    data: &std::path::Path,
) -> Stack {
    let master = Proc::spawn(
        "lunakv-master",
        &[
            format!("--rpc_address={ip}"),
            "--rpc_port=0".into(),
            "--metrics_port=0".into(),
            format!("--data_dir={}", data.display()),
        ],
        &[],
    );
    let line = master.wait_for_line("listening", Duration::from_secs(20));
    let rpc = fields(&line)["rpc"].clone();
    let store = Proc::spawn(
        "lunakv-store",
        &[
            format!("--master_server_address={rpc}"),
            format!("--host={ip}"),
            format!("--port={store_port}"),
            "--metrics_port=0".into(),
            "--global_segment_size=16MB".into(),
        ],
        &[("XDG_RUNTIME_DIR", &runtime_dir.display().to_string())],
    );
    store.wait_for_line("listening", Duration::from_secs(20));
    Stack {
        _master: master,
        store,
        rpc,
    }
}

fn shm_requester(master: &str) -> StoreClient {
    StoreClient::connect(ClientOptions {
        master_server_address: master.to_owned(),
        ..ClientOptions::default()
    })
    .expect("connect requester")
}

#[test]
fn two_stacks_on_one_host_never_serve_each_others_bytes() {
    if std::env::var("LUNAKV_DISABLE_SHM").is_ok_and(|v| v == "1") {
        eprintln!("shm disabled by the environment: nothing to share, skipping");
        return;
    }
    let runtime = tempfile::tempdir().expect("tempdir");
    let (da, db) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let port = port_free_on_both();
    let a = stack("127.0.0.1", port, runtime.path(), da.path());
    let b = stack("127.0.0.2", port, runtime.path(), db.path());
    let (ca, cb) = (shm_requester(&a.rpc), shm_requester(&b.rpc));
    let (mine, theirs) = (pattern(1, 64 << 10), pattern(2, 64 << 10));
    ca.put("victim", &mine).expect("put on stack A");
    cb.put("victim", &theirs).expect("put on stack B");
    let mut wrong = 0;
    for (c, want, who) in [(&ca, &mine, "A"), (&cb, &theirs, "B")] {
        let got = c.get("victim").expect("get");
        if &got != want {
            wrong += 1;
            eprintln!("stack {who}'s get returned the other stack's bytes");
        }
    }
    // A cold requester of each stack too (its location comes from its own master).
    for (addr, want) in [(&a.rpc, &mine), (&b.rpc, &theirs)] {
        if &shm_requester(addr).get("victim").expect("cold get") != want {
            wrong += 1;
        }
    }
    eprintln!("wrong bytes across two stacks sharing a runtime dir: {wrong}");
    assert_eq!(
        wrong,
        0,
        "store A:\n{}\nstore B:\n{}",
        a.store.output(),
        b.store.output()
    );
}

#[test]
fn a_second_store_on_a_live_shm_socket_refuses_and_names_the_first() {
    let runtime = tempfile::tempdir().expect("tempdir");
    let data = tempfile::tempdir().expect("tempdir");
    let m = Master::start(data.path(), &[]);
    let sock = runtime.path().join("shared.sock");
    let sock_flag = format!("--shm_socket={}", sock.display());
    let first = Store::start(&m.addr(), "16MB", &[&sock_flag]);
    let mut second = Proc::spawn(
        "lunakv-store",
        &[
            format!("--master_server_address={}", m.addr()),
            "--host=127.0.0.1".into(),
            "--port=0".into(),
            "--metrics_port=0".into(),
            "--global_segment_size=16MB".into(),
            sock_flag.clone(),
        ],
        &[],
    );
    let code = second.wait_exit(Duration::from_secs(20));
    let out = second.output();
    assert!(
        code.is_some_and(|c| c != 0),
        "second store kept running:\n{out}"
    );
    assert!(
        out.contains("in use by a live process")
            && out.contains(&format!("pid {}", first.proc.pid())),
        "{out}"
    );
    // The first store still serves its requesters.
    let c = shm_requester(&m.addr());
    c.put("k", b"still here").expect("put");
    assert_eq!(c.get("k").expect("get"), b"still here");
}

#[test]
fn a_restarted_single_master_never_answers_a_false_miss() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = Master::start(dir.path(), &[]);
    let _store = Store::start(&m.addr(), "32MB", &[]);
    let writer = tcp_requester(&m.addr());
    let values: Vec<Vec<u8>> = (0..40).map(|i| pattern(100 + i, 20_000)).collect();
    for (i, v) in values.iter().enumerate() {
        writer.put(&format!("k{i}"), v).expect("put");
    }
    let mut false_misses = 0;
    let mut refused_puts = 0;
    let mut wrong = 0;
    for round in 0..2 {
        m.restart();
        let started = Instant::now();
        // A cold client asks the master at once, before the store's next ping.
        let c = tcp_requester(&m.addr());
        for (i, v) in values.iter().enumerate() {
            match c.get(&format!("k{i}")) {
                Ok(got) if &got == v => {}
                Ok(_) => wrong += 1,
                Err(ClientError::ObjectNotFound(_)) => false_misses += 1,
                Err(e) => panic!("get k{i} after restart {round}: {e}"),
            }
        }
        match c.put(&format!("new-{round}"), b"after restart") {
            Ok(()) => {}
            Err(e) => {
                eprintln!("put after restart {round}: {e}");
                refused_puts += 1;
            }
        }
        eprintln!(
            "restart {round}: all gets answered {:.2} s after the master was back",
            started.elapsed().as_secs_f64()
        );
    }
    eprintln!("false misses {false_misses}, refused puts {refused_puts}, wrong bytes {wrong}");
    assert_eq!(
        (false_misses, refused_puts, wrong),
        (0, 0, 0),
        "master:\n{}",
        m.proc.output()
    );
}

/// An owner with more objects than one default-sized gRPC message can list (tens of thousands of
/// vLLM-shaped keys: their inventory is over 4 MiB) remounts after a master restart, and every
/// object is served again. Before, the master refused the remount ("message length too large")
/// and, after the recovery grace, answered "not found" for every one of them.
#[test]
fn an_owner_with_a_large_inventory_remounts_after_a_master_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = Master::start(dir.path(), &[]);
    let _store = Store::start(&m.addr(), "256MB", &["--enable_shm=false"]);
    let writer = tcp_requester(&m.addr());
    // vLLM's MooncakeStoreConnector key shape: model, tp/pp ranks, then the block hash.
    let key = |i: usize| {
        format!(
            "meta-llama/Llama-3.1-8B-Instruct@tp_rank:0@pp_rank:0@pcp0@dcp0@{:064x}",
            i as u128 * 0x9e37_79b9_7f4a_7c15
        )
    };
    let n = 40_000;
    let cfg = lunakv_client::ReplicateConfig::default();
    let value = [7u8; 64];
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let keys: Vec<String> = chunk.iter().map(|&i| key(i)).collect();
        let items: Vec<(&str, Vec<&[u8]>)> = keys
            .iter()
            .map(|k| (k.as_str(), vec![&value[..]]))
            .collect();
        for r in writer.batch_put(&items, &cfg) {
            r.expect("batch put");
        }
    }
    m.restart();
    let restarted = Instant::now();
    let c = tcp_requester(&m.addr());
    c.get(&key(n - 1)).expect("the first get after the restart");
    eprintln!(
        "{n} objects: first get answered {:.0} ms after the master was back (remount in parts + \
         index rebuild)",
        restarted.elapsed().as_secs_f64() * 1e3
    );
    let mut missing = Vec::new();
    for i in (0..n).step_by(997) {
        match c.get(&key(i)) {
            Ok(v) => assert_eq!(v, value, "{}", key(i)),
            Err(e) => missing.push(format!("{i}: {e}")),
        }
    }
    assert!(
        missing.is_empty(),
        "{} objects missing after the restart: {:?}\nmaster:\n{}",
        missing.len(),
        &missing[..missing.len().min(3)],
        m.proc
            .output()
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
}
