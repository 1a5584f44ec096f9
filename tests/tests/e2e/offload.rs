//! The SSD tier end to end (issue 4): real `lunakv-master --enable_offload` and
//! `lunakv-store --enable_offload` binaries, a workload larger than DRAM, crashes, corruption,
//! unusable directories and mismatched switches.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lunakv_client::{ClientError, ClientOptions, StoreClient};
use lunakv_tests::{Master, Proc, fields, http_get, pattern, tcp_requester, wait_until};

const OBJ: usize = 512 << 10;

/// A store-client with the SSD tier in `dir`. It binds the transfer `port` it is given (0: any),
/// and `port` is the one it bound, so a store restarted there has the same segment name.
struct OffloadStore {
    proc: Proc,
    admin: SocketAddr,
    port: u16,
}

fn start_store(master: &str, dir: &Path, port: u16, env: &[(&str, &str)]) -> OffloadStore {
    start_store_with(master, dir, port, env, "--enable_offload=true")
}

/// lunakv-store built with the `failpoints` feature: the production binary carries no failpoint
/// code. `make test` builds it into `<target>/failpoints`.
fn failpoints_store() -> PathBuf {
    let profile_dir = lunakv_tests::bin_dir();
    let p = profile_dir
        .parent()
        .expect("target dir")
        .join("failpoints")
        .join(profile_dir.file_name().expect("profile"))
        .join("lunakv-store");
    let fix = "build it with `cargo build -p lunakv-store --features failpoints \
         --target-dir target/failpoints` (make test does)";
    assert!(p.exists(), "{} is missing: {fix}", p.display());
    lunakv_tests::assert_fresh(&p, fix);
    p
}

fn start_store_with(
    master: &str,
    dir: &Path,
    port: u16,
    env: &[(&str, &str)],
    offload_flag: &str,
) -> OffloadStore {
    start_store_bin(None, master, dir, port, env, offload_flag)
}

fn start_store_bin(
    binary: Option<&Path>,
    master: &str,
    dir: &Path,
    port: u16,
    env: &[(&str, &str)],
    offload_flag: &str,
) -> OffloadStore {
    let args = vec![
        format!("--master_server_address={master}"),
        "--host=127.0.0.1".to_owned(),
        format!("--port={port}"),
        "--metrics_port=0".to_owned(),
        "--global_segment_size=8MB".to_owned(),
        offload_flag.to_owned(),
    ];
    let path = dir.display().to_string();
    let mut all: Vec<(&str, &str)> = vec![("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", path.as_str())];
    all.extend_from_slice(env);
    let proc = match binary {
        Some(path) => Proc::spawn_path(path, "lunakv-store", &args, &all),
        None => Proc::spawn("lunakv-store", &args, &all),
    };
    let line = proc.wait_for_line("listening", Duration::from_secs(20));
    let admin = fields(&line)
        .get("admin")
        .and_then(|a| a.parse().ok())
        .expect("admin address");
    let port = fields(&line)
        .get("transfer")
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .expect("transfer address")
        .port();
    OffloadStore { proc, admin, port }
}

fn metric(admin: SocketAddr, name: &str) -> Option<f64> {
    let (_, body) = http_get(admin, "/metrics");
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok())?
    })
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Puts `n` objects of OBJ bytes (keys `k-<i>`, content `pattern(i)`); returns those that landed.
fn fill(c: &StoreClient, n: u64) -> Vec<u64> {
    (0..n)
        .filter(|i| c.put(&format!("k-{i}"), &pattern(*i, OBJ)).is_ok())
        .collect()
}

#[test]
fn spill_and_reload_every_key_comes_back() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &["--enable_offload=true"]);
    let s = start_store(&m.addr(), odir.path(), 0, &[]);
    let c = tcp_requester(&m.addr());
    // 32 MiB through an 8 MiB pool.
    let put = fill(&c, 64);
    assert_eq!(put.len(), 64, "with offload every put finds room");
    for i in &put {
        let got = c.get(&format!("k-{i}")).expect("every key comes back");
        assert!(got == pattern(*i, OBJ), "k-{i}: wrong bytes");
    }
    // The seed's verification: the directory grew, and the master shows disk capacity.
    assert!(
        dir_bytes(odir.path()) > 16 << 20,
        "offload dir did not grow"
    );
    assert!(m.metric("master_disk_capacity_bytes").unwrap_or(0.0) > 0.0);
    assert!(m.metric("master_disk_key_count").unwrap_or(0.0) > 0.0);
    assert!(m.metric("master_offloaded_keys_total").unwrap_or(0.0) >= 40.0);
    assert!(metric(s.admin, "lunakv_store_disk_objects").unwrap_or(0.0) > 0.0);
    assert!(metric(s.admin, "lunakv_store_disk_loads_total").unwrap_or(0.0) > 0.0);
    let st = c.cluster_status().expect("status");
    assert!(st.enable_offload);
    assert!(st.segments[0].disk_capacity_bytes > 0);
    assert!(st.segments[0].disk_object_count > 0);
    // remove also forgets the disk copy.
    c.remove("k-0", true).expect("remove");
    assert!(matches!(c.get("k-0"), Err(ClientError::ObjectNotFound(_))));
}

/// The production binary has no failpoint: the variable that kills the crash tests' build
/// changes nothing here.
#[test]
fn the_production_store_ignores_the_crash_failpoint() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &["--enable_offload=true"]);
    let mut s = start_store(
        &m.addr(),
        odir.path(),
        0,
        &[("LUNAKV_FAILPOINT_OFFLOAD_CRASH_AFTER_BYTES", "1")],
    );
    let c = tcp_requester(&m.addr());
    let put = fill(&c, 40);
    wait_until(Duration::from_secs(10), || {
        metric(s.admin, "lunakv_store_disk_objects").filter(|v| *v > 0.0)
    })
    .expect("objects reached the disk tier");
    assert!(
        s.proc.alive(),
        "the production store aborted at the failpoint"
    );
    assert!(!put.is_empty());
}

#[test]
fn kill9_mid_offload_serves_no_torn_object_and_recovers_the_rest() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &["--enable_offload=true", "--client_ttl=2"]);
    // The store aborts in the middle of a bucket write once 6 MiB went to disk.
    let mut s = start_store_bin(
        Some(&failpoints_store()),
        &m.addr(),
        odir.path(),
        0,
        &[(
            "LUNAKV_FAILPOINT_OFFLOAD_CRASH_AFTER_BYTES",
            &(6u64 << 20 | 1234).to_string(),
        )],
        "--enable_offload=true",
    );
    let c = tcp_requester(&m.addr());
    let put = fill(&c, 40);
    assert!(
        s.proc.wait_exit(Duration::from_secs(10)).is_some() || !s.proc.alive(),
        "the failpoint should have killed the store"
    );
    // Restart on the same port and directory: the index is recovered, torn tails dropped.
    let s2 = start_store(&m.addr(), odir.path(), s.port, &[]);
    let recovered = wait_until(Duration::from_secs(10), || {
        metric(s2.admin, "lunakv_store_disk_objects").filter(|v| *v > 0.0)
    })
    .expect("disk objects recovered");
    // The restarted store's mount replaced the crashed one's segment of the same name; wait
    // until the master indexes exactly what the recovered disk tier holds.
    wait_until(Duration::from_secs(10), || {
        (m.metric("master_disk_key_count") == Some(recovered)).then_some(())
    })
    .expect("the master indexes the recovered objects");
    let reader = tcp_requester(&m.addr());
    let mut served = 0;
    for i in &put {
        match reader.get(&format!("k-{i}")) {
            Ok(b) => {
                assert!(b == pattern(*i, OBJ), "k-{i}: wrong bytes after a crash");
                served += 1;
            }
            Err(ClientError::ObjectNotFound(_)) => {}
            Err(e) => panic!("k-{i}: unexpected {e}"),
        }
    }
    assert!(
        served as f64 >= recovered,
        "every recovered object is served ({served} < {recovered})"
    );
    assert!(recovered >= 8.0, "only {recovered} objects recovered");
    drop(s2);
}

#[test]
fn a_flipped_byte_is_dropped_and_reported_never_served() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &["--enable_offload=true"]);
    let mut s = start_store(&m.addr(), odir.path(), 0, &[]);
    let c = tcp_requester(&m.addr());
    let put = fill(&c, 48);
    assert_eq!(put.len(), 48);
    s.proc.terminate(Duration::from_secs(10));
    // Flip one byte inside the first object of the oldest bucket.
    let mut buckets: Vec<_> = std::fs::read_dir(odir.path())
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "bucket"))
        .collect();
    buckets.sort();
    let mut bytes = std::fs::read(&buckets[0]).expect("read bucket");
    bytes[1000] ^= 0x5a;
    std::fs::write(&buckets[0], &bytes).expect("write bucket");

    let s2 = start_store(&m.addr(), odir.path(), s.port, &[]);
    let recovered = wait_until(Duration::from_secs(10), || {
        metric(s2.admin, "lunakv_store_disk_objects").filter(|v| *v > 0.0)
    })
    .expect("recovered");
    let reader = tcp_requester(&m.addr());
    let (mut served, mut missing) = (0, 0);
    for i in &put {
        match reader.get(&format!("k-{i}")) {
            Ok(b) => {
                assert!(b == pattern(*i, OBJ), "k-{i}: corrupt bytes served");
                served += 1;
            }
            Err(ClientError::ObjectNotFound(_)) => missing += 1,
            Err(e) => panic!("k-{i}: unexpected {e}"),
        }
    }
    assert_eq!(
        served as f64,
        recovered - 1.0,
        "all but the corrupt one served"
    );
    assert!(missing > 0);
    assert_eq!(
        metric(s2.admin, "lunakv_store_disk_corrupt_objects_total"),
        Some(1.0)
    );
    assert!(
        s2.proc.output().contains("failed its checksum"),
        "the corruption is logged"
    );
    // The next ping tells the master.
    assert!(
        wait_until(Duration::from_secs(5), || m
            .metric("master_disk_dropped_keys_total")
            .filter(|v| *v >= 1.0))
        .is_some()
    );
}

#[test]
fn unusable_directory_is_a_clear_error_and_dram_keeps_serving() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").expect("write");
    let m = Master::start(mdir.path(), &["--enable_offload=true"]);
    // A directory below a regular file can never be created.
    let s = start_store(&m.addr(), &file.join("offload"), 0, &[]);
    assert!(
        s.proc
            .output()
            .contains("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"),
        "the log names the setting to fix"
    );
    assert_eq!(
        metric(s.admin, "lunakv_store_offload_open_errors"),
        Some(1.0)
    );
    let c = tcp_requester(&m.addr());
    let put = fill(&c, 32);
    assert_eq!(put.len(), 32, "DRAM service continues (plain eviction)");
    let last = put[put.len() - 1];
    assert!(c.get(&format!("k-{last}")).expect("recent key") == pattern(last, OBJ));
}

#[test]
fn tiny_disk_limit_drops_the_oldest_and_never_serves_wrong_bytes() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &["--enable_offload=true"]);
    let s = start_store(
        &m.addr(),
        odir.path(),
        0,
        &[("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "4194304")],
    );
    let c = tcp_requester(&m.addr());
    let put = fill(&c, 64);
    assert_eq!(put.len(), 64);
    assert!(dir_bytes(odir.path()) <= (4 << 20) + (1 << 20));
    assert!(metric(s.admin, "lunakv_store_disk_evicted_objects_total").unwrap_or(0.0) > 0.0);
    // The reads below are judged against the master's index: wait until it names exactly the
    // objects the store's disk tier holds (no drop still on its way to the master).
    wait_until(Duration::from_secs(10), || {
        let indexed = m.metric("master_disk_key_count")?;
        (indexed > 0.0 && metric(s.admin, "lunakv_store_disk_objects") == Some(indexed))
            .then_some(())
    })
    .expect("the master indexes what the disk tier holds");
    let mut served = 0;
    for i in &put {
        match c.get(&format!("k-{i}")) {
            Ok(b) => {
                assert!(b == pattern(*i, OBJ), "k-{i}: wrong bytes");
                served += 1;
            }
            Err(ClientError::ObjectNotFound(_)) => {}
            Err(e) => panic!("k-{i}: unexpected {e}"),
        }
    }
    assert!(
        served >= 16,
        "DRAM + 4 MiB of disk hold at least 16 objects, got {served}"
    );
    // The newest key is there; the oldest went first (FIFO).
    assert!(c.get("k-63").is_ok());
    assert!(matches!(c.get("k-0"), Err(ClientError::ObjectNotFound(_))));
}

#[test]
fn mismatched_enable_offload_is_refused_or_reported() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    // Store with offload, master without: refused at mount, naming both and the fix.
    let plain = Master::start(mdir.path(), &[]);
    let args = vec![
        format!("--master_server_address={}", plain.addr()),
        "--host=127.0.0.1".to_owned(),
        "--port=0".to_owned(),
        "--metrics_port=0".to_owned(),
        "--global_segment_size=8MB".to_owned(),
        "--enable_offload=true".to_owned(),
    ];
    let path = odir.path().display().to_string();
    let mut p = Proc::spawn(
        "lunakv-store",
        &args,
        &[("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", path.as_str())],
    );
    let code = p.wait_exit(Duration::from_secs(20));
    assert!(
        matches!(code, Some(c) if c != 0),
        "store must exit non-zero"
    );
    let out = p.output();
    assert!(out.contains("offload mismatch"), "{out}");
    assert!(
        out.contains("lunakv-master with --enable_offload=true"),
        "{out}"
    );

    // Master with offload, store without: reported (log + metric).
    let mdir2 = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir2.path(), &["--enable_offload=true"]);
    let _s = start_store_with(&m.addr(), odir.path(), 0, &[], "--enable_offload=false");
    assert!(m.metric("master_offload_mismatch_total").unwrap_or(0.0) >= 1.0);
    assert!(m.proc.output().contains("offload mismatch"));

    // Engine config vs master: the client warns and exposes it.
    let c = StoreClient::connect(ClientOptions {
        master_server_address: m.addr(),
        enable_offload: Some(false),
        ..ClientOptions::default()
    })
    .expect("connect");
    let w = c.offload_mismatch().expect("mismatch reported");
    assert!(w.contains("--enable_offload=true"), "{w}");
    let agree = StoreClient::connect(ClientOptions {
        master_server_address: m.addr(),
        enable_offload: Some(true),
        ..ClientOptions::default()
    })
    .expect("connect");
    assert!(agree.offload_mismatch().is_none());
}

/// Fills 32 MiB through an 8 MiB pool, then removes the newest keys so DRAM has room for a
/// promotion. Returns a key that is on disk only.
fn spill_for_promotion(m: &Master, c: &StoreClient) -> u64 {
    let put = fill(c, 64);
    assert_eq!(put.len(), 64);
    for i in 56..64 {
        c.remove(&format!("k-{i}"), true).expect("remove");
    }
    (0..56)
        .find(|i| {
            let (_, body) = m.http_get(&format!("/query_key?key=k-{i}"));
            body.contains("local_disk") && !body.contains("\"memory\"")
        })
        .expect("a disk-only key")
}

#[test]
fn promotion_on_hit_brings_a_disk_object_back_to_dram() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(
        mdir.path(),
        &["--enable_offload=true", "--promotion_on_hit=true"],
    );
    let s = start_store(&m.addr(), odir.path(), 0, &[]);
    let c = tcp_requester(&m.addr());
    let i = spill_for_promotion(&m, &c);
    let key = format!("k-{i}");
    // Each hit is served from disk at once. The master counts requests (reads more than its
    // 100 ms read window apart): the second admits the object (--promotion_admission_threshold,
    // upstream's default 2) and the promotion runs behind it. Each reader is a fresh client
    // (no cached location), so its read reaches the master.
    assert!(c.get(&key).expect("get from disk") == pattern(i, OBJ));
    let mut requests = 1;
    let body = wait_until(Duration::from_secs(10), || {
        let (_, body) = m.http_get(&format!("/query_key?key={key}"));
        if body.contains("\"memory\"") {
            return Some(body);
        }
        std::thread::sleep(Duration::from_millis(150));
        let reader = tcp_requester(&m.addr());
        assert!(reader.get(&key).expect("get again") == pattern(i, OBJ));
        requests += 1;
        None
    })
    .expect("the object gains a memory replica");
    assert!(requests >= 2, "promoted on the first request");
    assert!(body.contains("local_disk"), "the disk copy stays: {body}");
    assert!(m.metric("master_promotions_total").unwrap_or(0.0) >= 1.0);
    // A fresh client (no cached location) reads it from DRAM: no disk load on the owner.
    let loads = metric(s.admin, "lunakv_store_disk_loads_total").unwrap_or(0.0);
    let fresh = tcp_requester(&m.addr());
    assert!(fresh.get(&key).expect("get from DRAM") == pattern(i, OBJ));
    assert!(c.get(&key).expect("get again") == pattern(i, OBJ));
    assert_eq!(
        metric(s.admin, "lunakv_store_disk_loads_total").unwrap_or(0.0),
        loads,
        "served from DRAM, not disk"
    );
    // Removing it frees both copies.
    c.remove(&key, true).expect("remove");
    assert!(matches!(c.get(&key), Err(ClientError::ObjectNotFound(_))));
}

#[test]
fn without_promotion_on_hit_nothing_is_promoted() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &["--enable_offload=true"]);
    let _s = start_store(&m.addr(), odir.path(), 0, &[]);
    let c = tcp_requester(&m.addr());
    let i = spill_for_promotion(&m, &c);
    let key = format!("k-{i}");
    assert!(c.get(&key).expect("get from disk") == pattern(i, OBJ));
    // The point of the test is an absence: the window in which a promotion, which runs in the
    // background after the get, would have been seen. No condition marks its end.
    std::thread::sleep(Duration::from_millis(1500));
    let (_, body) = m.http_get(&format!("/query_key?key={key}"));
    assert!(
        !body.contains("\"memory\""),
        "promoted without the switch: {body}"
    );
    assert_eq!(m.metric("master_promotions_total").unwrap_or(0.0), 0.0);
}

/// With `--enable_ha`, eviction still offloads: the HA master's fenced owner notifier forwards
/// OFFLOAD (it once inherited the trait's "cannot offload" default and dropped every object).
#[test]
fn offload_works_under_an_ha_master() {
    let Some(etcd) = lunakv_meta::testing::etcd_or_skip() else {
        return;
    };
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start_ha(mdir.path(), &etcd.endpoint(), &["--enable_offload=true"]);
    let url = format!("etcd://{}", etcd.endpoint());
    wait_until(Duration::from_secs(20), || {
        m.http_get("/role").1.contains("leader").then_some(())
    })
    .expect("the only master leads");
    let _s = start_store(&url, odir.path(), 0, &[]);
    let c = StoreClient::connect(ClientOptions {
        master_server_address: url.clone(),
        enable_shm: false,
        ..ClientOptions::default()
    })
    .expect("client through etcd");
    let put = fill(&c, 40);
    assert_eq!(put.len(), 40, "with offload every put finds room");
    for i in &put {
        let got = c.get(&format!("k-{i}")).expect("every key comes back");
        assert!(got == pattern(*i, OBJ), "k-{i}: wrong bytes");
    }
    assert!(m.metric("master_offloaded_keys_total").unwrap_or(0.0) > 0.0);
    assert_eq!(
        m.metric("master_offload_failures_total").unwrap_or(0.0),
        0.0
    );
}

/// `name=<u64>` in a log line (tracing fields; colour codes stripped).
fn log_field(line: &str, name: &str) -> Option<u64> {
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ ... final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    let pat = format!("{name}=");
    plain
        .split_whitespace()
        .find_map(|t| t.strip_prefix(&pat)?.parse().ok())
}

/// The drain tests leave DRAM under upstream's 95% watermark (the `lru` order's), so part of it
/// is free and part still holds objects when the store stops; cslru would run the pool full.
const WATERMARK_OFFLOAD: [&str; 2] = ["--enable_offload=true", "--eviction_policy=lru"];

/// Fills 24 MiB through the 8 MiB pool and waits until the master's eviction is done (DRAM use
/// under its 95% watermark): about 15 objects are then in DRAM only, the rest on disk.
/// Returns the keys put and how many objects the store holds in DRAM.
fn fill_and_settle(c: &StoreClient, s: &OffloadStore) -> (Vec<u64>, u64) {
    let put = fill(c, 48);
    assert_eq!(put.len(), 48, "with offload every put finds room");
    let in_dram = wait_until(Duration::from_secs(10), || {
        let used = metric(s.admin, "lunakv_store_segment_used_bytes")?;
        let cap = metric(s.admin, "lunakv_store_segment_capacity_bytes")?;
        (cap > 0.0 && used < 0.95 * cap)
            .then(|| metric(s.admin, "lunakv_store_objects"))
            .flatten()
    })
    .expect("eviction settles under the watermark");
    assert!(
        in_dram >= 8.0,
        "most of DRAM still holds objects: {in_dram}"
    );
    (put, in_dram as u64)
}

/// Issue 17 item 9: a SIGTERM (a DaemonSet rolling update) lost every object still in DRAM
/// (15 of 48). Now the store writes them to the SSD tier before it unmounts, and the store
/// restarted on the same directory serves all 48 through the master, with the right bytes.
#[test]
fn sigterm_drains_dram_to_disk_and_the_restart_serves_every_object() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &WATERMARK_OFFLOAD);
    let mut s = start_store(&m.addr(), odir.path(), 0, &[]);
    let c = tcp_requester(&m.addr());
    let (put, in_dram) = fill_and_settle(&c, &s);
    assert!(
        m.metric("master_offloaded_keys_total").unwrap_or(0.0) >= 20.0,
        "some objects were already offloaded"
    );

    let code = s.proc.terminate(Duration::from_secs(60));
    assert_eq!(code, Some(0), "a graceful stop exits 0");

    // A new process on the same directory, and a client that never saw these keys.
    let s2 = start_store(&m.addr(), odir.path(), s.port, &[]);
    let reader = tcp_requester(&m.addr());
    let mut lost = Vec::new();
    for i in &put {
        match reader.get(&format!("k-{i}")) {
            Ok(b) => assert!(
                b == pattern(*i, OBJ),
                "k-{i}: wrong bytes after the restart"
            ),
            Err(ClientError::ObjectNotFound(_)) => lost.push(*i),
            Err(e) => panic!("k-{i}: unexpected {e}"),
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} objects lost across the SIGTERM + restart: {lost:?}",
        lost.len(),
        put.len()
    );
    // The stopped store said what it did.
    let line = s
        .proc
        .wait_for_line("shutdown drain finished", Duration::from_secs(5));
    assert_eq!(
        log_field(&line, "drained"),
        Some(in_dram),
        "every DRAM object drained: {line}"
    );
    assert_eq!(log_field(&line, "dropped"), Some(0), "{line}");
    assert_eq!(
        metric(s2.admin, "lunakv_store_disk_objects"),
        Some(48.0),
        "all 48 recovered from disk"
    );
}

/// A drain budget of 0 (`--offload_drain_timeout_sec=0`): nothing is drained, the DRAM objects
/// are dropped and counted in the log, and after the restart each of them is a clean miss
/// (never wrong bytes) while the objects already on disk are served.
#[test]
fn a_zero_drain_budget_drops_the_dram_objects_and_reports_them() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &WATERMARK_OFFLOAD);
    let mut s = start_store(
        &m.addr(),
        odir.path(),
        0,
        &[("LUNAKV_OFFLOAD_DRAIN_TIMEOUT_SEC", "0")],
    );
    let c = tcp_requester(&m.addr());
    let (put, in_dram) = fill_and_settle(&c, &s);

    assert_eq!(s.proc.terminate(Duration::from_secs(30)), Some(0));
    let line = s
        .proc
        .wait_for_line("shutdown drain finished", Duration::from_secs(5));
    assert_eq!(log_field(&line, "drained"), Some(0), "{line}");
    assert_eq!(log_field(&line, "dropped"), Some(in_dram), "{line}");

    let _s2 = start_store(&m.addr(), odir.path(), s.port, &[]);
    let reader = tcp_requester(&m.addr());
    let (mut served, mut missing) = (0, 0);
    for i in &put {
        match reader.get(&format!("k-{i}")) {
            Ok(b) => {
                assert!(b == pattern(*i, OBJ), "k-{i}: wrong bytes");
                served += 1;
            }
            Err(ClientError::ObjectNotFound(_)) => missing += 1,
            Err(e) => panic!("k-{i}: unexpected {e}"),
        }
    }
    assert_eq!(missing, in_dram, "exactly the dropped objects are missing");
    assert_eq!(served + missing, 48);
}

/// Issue 18 item 3 (docs/SECURITY.md, "Verified inventories"): with the pool token the master
/// indexes only inventory entries that carry its placement proof. Every genuine entry must keep
/// one wherever it went: written into DRAM, offloaded to disk by eviction, drained to disk by a
/// SIGTERM. After a master restart (DRAM and disk entries remount) and a store restart (disk
/// only), every object is still served with its bytes, and nothing was rejected.
#[test]
fn with_the_pool_token_every_dram_and_disk_entry_survives_restarts_with_its_proof() {
    const TOKEN: &str = "pool-0123456789abcdef0123456789";
    const N: u64 = 24;
    let env = [("LUNAKV_AUTH_TOKEN", TOKEN)];
    let _env = lunakv_tests::child_env(&env);
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let mut m = Master::start(mdir.path(), &["--enable_offload=true"]);
    let mut s = start_store(&m.addr(), odir.path(), 0, &[]);
    for i in 0..N {
        let file = mdir.path().join(format!("v-{i}"));
        std::fs::write(&file, pattern(i, OBJ)).unwrap();
        let out = lunakv_tests::cli(
            &m.addr(),
            &["put", &format!("k-{i}"), &file.display().to_string()],
            &env,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    wait_until(Duration::from_secs(10), || {
        (metric(s.admin, "lunakv_store_disk_objects")? >= 4.0).then_some(())
    })
    .expect("eviction moved objects to disk");
    let every_object_is_served = |m: &Master, when: &str| {
        for i in 0..N {
            let got = wait_until(Duration::from_secs(30), || {
                let out = lunakv_tests::cli(&m.addr(), &["get", &format!("k-{i}")], &env);
                out.status.success().then_some(out.stdout)
            })
            .unwrap_or_else(|| panic!("k-{i} is not served {when}"));
            assert!(got == pattern(i, OBJ), "k-{i}: wrong bytes {when}");
        }
        assert_eq!(
            m.metric("master_inventory_unproven_total"),
            Some(0.0),
            "no genuine entry was rejected {when}"
        );
    };

    m.restart();
    every_object_is_served(&m, "after a master restart");

    assert_eq!(s.proc.terminate(Duration::from_secs(60)), Some(0));
    let _s2 = start_store(&m.addr(), odir.path(), s.port, &[]);
    every_object_is_served(&m, "after a store restart");
}

/// Issue 31 item 5: never a false "present". When an OFFLOAD makes the disk tier drop older
/// objects (its size limit), the owner names them in the OFFLOAD's answer and the master forgets
/// them before the put that caused the eviction returns. The store pings once an hour here, so
/// the Ping (the only way before) cannot explain a pass: right after every batch of puts, each
/// key the master calls present must read back, and a dropped key takes a new put at once.
#[test]
fn keys_the_disk_tier_dropped_are_never_present_and_take_a_new_put_at_once() {
    let mdir = tempfile::tempdir().expect("tempdir");
    let odir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(mdir.path(), &["--enable_offload=true", "--client_ttl=7200"]);
    let s = start_store(
        &m.addr(),
        odir.path(),
        0,
        &[
            ("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "4194304"),
            ("LUNAKV_STORE_PING_INTERVAL_MS", "3600000"),
        ],
    );
    let c = tcp_requester(&m.addr());
    // 48 MiB through 8 MiB of DRAM and 4 MiB of disk, 4 objects per batch.
    let mut put: Vec<u64> = Vec::new();
    let mut unreadable: Vec<String> = Vec::new();
    let mut absent: Vec<u64> = Vec::new();
    for batch in 0..24u64 {
        for i in batch * 4..batch * 4 + 4 {
            c.put(&format!("k-{i}"), &pattern(i, OBJ))
                .unwrap_or_else(|e| panic!("put k-{i}: {e}"));
            put.push(i);
        }
        let keys: Vec<String> = put.iter().map(|i| format!("k-{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        absent.clear();
        for (i, exists) in put.iter().zip(c.batch_exists(&refs)) {
            match exists.unwrap_or_else(|e| panic!("exists k-{i}: {e}")) {
                true => match c.get(&format!("k-{i}")) {
                    Ok(b) => assert!(b == pattern(*i, OBJ), "k-{i}: wrong bytes"),
                    Err(e) => unreadable.push(format!("batch {batch}: k-{i}: {e}")),
                },
                false => absent.push(*i),
            }
        }
    }
    assert!(
        metric(s.admin, "lunakv_store_disk_evicted_objects_total").unwrap_or(0.0) > 0.0,
        "the disk tier never dropped anything: the test shows nothing"
    );
    assert!(
        unreadable.is_empty(),
        "{} keys the master called present could not be read: {unreadable:?}",
        unreadable.len()
    );
    assert!(!absent.is_empty(), "no key was dropped");
    assert!(
        m.metric("master_disk_dropped_keys_total").unwrap_or(0.0) > 0.0,
        "the master learned of no drop"
    );
    // A dropped key takes a new put at once (it was refused with -705 until the next Ping).
    for i in absent.iter().take(4) {
        let key = format!("k-{i}");
        let fresh = pattern(i + 1000, OBJ);
        c.put(&key, &fresh)
            .unwrap_or_else(|e| panic!("re-put of dropped {key}: {e}"));
        assert!(
            c.get(&key).expect("re-put key reads") == fresh,
            "{key}: wrong bytes"
        );
    }
}
