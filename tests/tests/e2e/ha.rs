//! Master HA on etcd, with real processes on loopback: a real etcd (Debian's etcd-server,
//! started on ephemeral ports), three `lunakv-master --enable_ha`, store-clients and clients that
//! find the leader through `etcd://...`.
//!
//! These tests fail with the fix when etcd is not installed; `LUNAKV_SKIP_ETCD=1` skips them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lunakv_client::{ClientError, ClientOptions, StoreClient};
use lunakv_meta::testing::{self, EtcdServer};
use lunakv_proto::master as pb;
use lunakv_proto::tonic;
use lunakv_tests::{Master, Proc, Store, pattern, tcp_requester, wait_until};

const OBJ: usize = 32 << 10;

struct Cluster {
    etcd: EtcdServer,
    masters: Vec<Master>,
    stores: Vec<Store>,
    _dirs: Vec<tempfile::TempDir>,
    master_args: Vec<String>,
}

impl Cluster {
    fn start(n_masters: usize, n_stores: usize) -> Option<Cluster> {
        Cluster::start_with(n_masters, n_stores, &[], "64MB")
    }

    /// `master_args` go to every master, including those [`Cluster::replace`] starts.
    fn start_with(
        n_masters: usize,
        n_stores: usize,
        master_args: &[&str],
        store_size: &str,
    ) -> Option<Cluster> {
        let etcd = testing::etcd_or_skip()?;
        let mut c = Cluster {
            etcd,
            masters: Vec::new(),
            stores: Vec::new(),
            _dirs: Vec::new(),
            master_args: master_args.iter().map(|s| s.to_string()).collect(),
        };
        for _ in 0..n_masters {
            let m = c.new_master();
            c.masters.push(m);
        }
        c.wait_leader(None, Duration::from_secs(20))
            .expect("a leader is elected");
        for _ in 0..n_stores {
            let s = Store::start(&c.url(), store_size, &["--enable_shm=false"]);
            c.stores.push(s);
        }
        Some(c)
    }

    fn new_master(&mut self) -> Master {
        let d = tempfile::tempdir().expect("tempdir");
        let args: Vec<&str> = self.master_args.iter().map(String::as_str).collect();
        let m = Master::start_ha(d.path(), &self.etcd.endpoint(), &args);
        self._dirs.push(d);
        m
    }

    /// Starts a fresh standby in place of master `i` (after a kill).
    fn replace(&mut self, i: usize) {
        self.masters[i] = self.new_master();
    }

    /// Sum of an HA counter over the masters that answer, except `exclude`.
    fn sum_metric(&self, name: &str, exclude: Option<usize>) -> f64 {
        (0..self.masters.len())
            .filter(|&i| Some(i) != exclude)
            .filter_map(|i| self.masters[i].metric(name))
            .sum()
    }

    /// `etcd://127.0.0.1:PORT`: what clients and stores use as the master address.
    fn url(&self) -> String {
        self.etcd.etcd_url()
    }

    /// The index of the one master reporting `leader` (None if zero or several).
    fn leader(&self, exclude: Option<usize>) -> Option<usize> {
        let leaders: Vec<usize> = (0..self.masters.len())
            .filter(|&i| Some(i) != exclude)
            .filter(|&i| self.masters[i].role().as_deref() == Some("leader"))
            .collect();
        (leaders.len() == 1).then(|| leaders[0])
    }

    fn wait_leader(&self, exclude: Option<usize>, timeout: Duration) -> Option<usize> {
        wait_until(timeout, || self.leader(exclude))
    }
}

fn client(url: &str) -> StoreClient {
    tcp_requester(url)
}

/// Puts and gets from several threads until `stop`; records what was acknowledged.
struct Load {
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<(String, u64)>>>,
    corrupt: Arc<Mutex<Vec<String>>>,
    put_errors: Arc<AtomicU64>,
    get_errors: Arc<AtomicU64>,
    gets_ok: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(url: &str, writers: usize, readers: usize, tag: &str) -> Load {
        let l = Load {
            stop: Arc::new(AtomicBool::new(false)),
            acked: Arc::new(Mutex::new(Vec::new())),
            corrupt: Arc::new(Mutex::new(Vec::new())),
            put_errors: Arc::new(AtomicU64::new(0)),
            get_errors: Arc::new(AtomicU64::new(0)),
            gets_ok: Arc::new(AtomicU64::new(0)),
            threads: Vec::new(),
        };
        let mut threads = Vec::new();
        for w in 0..writers {
            let (stop, acked, errs) = (l.stop.clone(), l.acked.clone(), l.put_errors.clone());
            let c = client(url);
            let tag = tag.to_owned();
            threads.push(std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("{tag}-w{w}-{i}");
                    let seed = (w as u64) << 40 | i;
                    match c.put(&key, &pattern(seed, OBJ)) {
                        Ok(()) => acked.lock().expect("acked").push((key, seed)),
                        Err(_) => {
                            errs.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    i += 1;
                }
            }));
        }
        for r in 0..readers {
            let (stop, acked, corrupt) = (l.stop.clone(), l.acked.clone(), l.corrupt.clone());
            let (errs, ok) = (l.get_errors.clone(), l.gets_ok.clone());
            let c = client(url);
            threads.push(std::thread::spawn(move || {
                let mut n = r as u64;
                while !stop.load(Ordering::Relaxed) {
                    let pick = {
                        let a = acked.lock().expect("acked");
                        (!a.is_empty()).then(|| a[(n as usize * 7919) % a.len()].clone())
                    };
                    n += 1;
                    let Some((key, seed)) = pick else {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    match c.get(&key) {
                        Ok(v) if v == pattern(seed, OBJ) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => corrupt.lock().expect("corrupt").push(key),
                        Err(_) => {
                            errs.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        Load { threads, ..l }
    }

    fn acked_len(&self) -> usize {
        self.acked.lock().expect("acked").len()
    }

    fn stop(mut self) -> Load {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().expect("load thread");
        }
        self
    }
}

/// Every acknowledged object is present with its exact bytes, read by a fresh client (nothing
/// cached: every location comes from the current leader's rebuilt index).
fn verify_all(url: &str, acked: &[(String, u64)]) {
    let c = client(url);
    let mut lost = Vec::new();
    for (key, seed) in acked {
        match c.get(key) {
            Ok(v) => assert!(v == pattern(*seed, OBJ), "{key} corrupted"),
            Err(e) => lost.push(format!("{key}: {e}")),
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged objects lost: {:?}",
        lost.len(),
        acked.len(),
        &lost[..lost.len().min(10)]
    );
}

/// Kills the current leader and returns (old leader index, reattach time): death to the first
/// put acknowledged by the new leader.
fn fail_over(c: &mut Cluster, probe: &StoreClient, tag: &str) -> (usize, Duration) {
    let old = c.leader(None).expect("a leader before the failover");
    c.masters[old].proc.kill9();
    let killed = Instant::now();
    let mut i = 0;
    let reattach = loop {
        match probe.put(&format!("{tag}-probe-{i}"), b"probe") {
            Ok(()) => break killed.elapsed(),
            Err(e) => {
                assert!(
                    killed.elapsed() < Duration::from_secs(60),
                    "no reattach: {e}"
                );
                i += 1;
            }
        }
    };
    (old, reattach)
}

#[test]
fn kill9_leader_under_load_loses_no_acknowledged_object() {
    let Some(mut c) = Cluster::start(3, 2) else {
        return;
    };
    let url = c.url();
    let load = Load::start(&url, 2, 2, "k9");
    assert!(
        wait_until(Duration::from_secs(20), || (load.acked_len() > 200)
            .then_some(()))
        .is_some(),
        "the load does not make progress before the failover"
    );
    let probe = client(&url);
    let (old, reattach) = fail_over(&mut c, &probe, "k9");
    let new = c
        .wait_leader(Some(old), Duration::from_secs(10))
        .expect("a new leader");
    let before = load.acked_len();
    assert!(
        wait_until(Duration::from_secs(20), || (load.acked_len()
            > before + 200)
            .then_some(()))
        .is_some(),
        "the load does not resume on the new leader"
    );
    let load = load.stop();
    let acked = load.acked.lock().expect("acked").clone();
    assert!(
        load.corrupt.lock().expect("corrupt").is_empty(),
        "corrupt reads"
    );
    verify_all(&url, &acked);
    let m = &c.masters[new];
    assert_eq!(m.metric("master_is_leader"), Some(1.0));
    assert_eq!(m.metric("master_etcd_up"), Some(1.0));
    // The dead leader's port refused the standbys' dials: exactly one of them revoked its lease
    // rather than every client waiting out the lease TTL.
    assert_eq!(
        c.sum_metric("master_fast_takeovers_total", Some(old)),
        1.0,
        "a standby revokes the lease of a leader whose process is gone"
    );
    let (_, st) = m.http_get("/ha_status");
    let st: serde_json::Value = serde_json::from_str(&st).expect("ha_status json");
    assert_eq!(st["lease_ttl_ms"], 2000, "the default leader lease: {st}");
    // grpc.health.v1: the Master service is SERVING only at the leader; every live master's
    // process ("") is SERVING (a Deployment's readiness must not depend on leadership).
    const SERVING: i32 = 1;
    const NOT_SERVING: i32 = 2;
    for (i, master) in c.masters.iter().enumerate().filter(|(i, _)| *i != old) {
        let want = if i == new { SERVING } else { NOT_SERVING };
        let got = wait_until(Duration::from_secs(5), || {
            let s = grpc_health(master.rpc, "lunakv.master.v1.Master");
            (s == want).then_some(s)
        });
        assert_eq!(got, Some(want), "master {i} (leader {new})");
        assert_eq!(grpc_health(master.rpc, ""), SERVING);
    }
    println!(
        "kill -9 failover: reattach {:.2} s (death of the leader -> first put acknowledged by the \
         new one); {} objects acknowledged and verified; {} put / {} get errors during the \
         failover; {} gets ok",
        reattach.as_secs_f64(),
        acked.len(),
        load.put_errors.load(Ordering::Relaxed),
        load.get_errors.load(Ordering::Relaxed),
        load.gets_ok.load(Ordering::Relaxed),
    );
}

/// Runs `f` on a channel straight to one master (no leader following), with `timeout` per call.
fn on_channel<T>(
    addr: std::net::SocketAddr,
    timeout: Duration,
    f: impl AsyncFnOnce(tonic::transport::Channel) -> T,
) -> T {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .timeout(timeout)
            .connect_lazy();
        f(ch).await
    })
}

/// `grpc.health.v1` status of `service` at one master (the numeric ServingStatus).
fn grpc_health(addr: std::net::SocketAddr, service: &str) -> i32 {
    on_channel(addr, Duration::from_secs(5), async move |ch| {
        tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health check")
            .into_inner()
            .status
    })
}

/// A PutStart sent straight to one master, bypassing the client library's leader following:
/// the answer's code and message.
fn raw_put_start(addr: std::net::SocketAddr, key: &str) -> Result<(i32, String), tonic::Status> {
    on_channel(addr, Duration::from_secs(60), async move |ch| {
        let mut m = pb::master_client::MasterClient::new(ch);
        let r = m
            .put_start(pb::PutStartRequest {
                client_id: "raw".into(),
                key: key.into(),
                size: 4096,
                config: None,
                group_id: String::new(),
            })
            .await?;
        let r = r.into_inner();
        Ok((r.code, r.message))
    })
}

#[test]
fn paused_leader_accepts_no_write_after_waking_and_steps_down() {
    let Some(c) = Cluster::start(3, 1) else {
        return;
    };
    let url = c.url();
    let cl = client(&url);
    for i in 0..20u64 {
        cl.put(&format!("pause-{i}"), &pattern(i, OBJ))
            .expect("put before");
    }
    let old = c.leader(None).expect("leader");
    let old_rpc = c.masters[old].rpc;
    c.masters[old].proc.pause();
    let paused = Instant::now();
    // A write queued at the paused leader: it is handled only after SIGCONT.
    let queued = std::thread::spawn(move || raw_put_start(old_rpc, "written-while-paused"));
    let new = c
        .wait_leader(Some(old), Duration::from_secs(20))
        .expect("a new leader while the old one is paused");
    let elected = paused.elapsed();
    // A paused process still has its listening socket (the kernel accepts for it): the
    // standbys must not take that for death, only the lease may depose it.
    assert_eq!(
        c.sum_metric("master_fast_takeovers_total", Some(old)),
        0.0,
        "a paused leader is deposed by its lease, not by the dial probe"
    );
    for i in 20..40u64 {
        cl.put(&format!("pause-{i}"), &pattern(i, OBJ))
            .expect("put at the new leader");
    }
    c.masters[old].proc.signal(libc::SIGCONT);
    match queued.join().expect("queued thread") {
        Err(s) => assert_eq!(
            s.code(),
            tonic::Code::Unavailable,
            "the woken leader refuses with a redirect: {s:?}"
        ),
        // Said in full: this has failed rarely under load, and the answer tells an admitted
        // write (code 0) from an error answered before the lease check.
        Ok((code, message)) => panic!(
            "the woken, deposed leader answered a PutStart (code {code}, {message:?}); it now \
             says role {:?}, fenced writes {:?}",
            c.masters[old].role(),
            c.masters[old].metric("master_fenced_writes_total"),
        ),
    }
    assert!(
        wait_until(Duration::from_secs(5), || (c.masters[old]
            .role()
            .as_deref()
            == Some("follower"))
        .then_some(()))
        .is_some(),
        "the paused leader steps down after waking"
    );
    // Once it follows again, its refusals name the new leader.
    let new_rpc = c.masters[new].rpc.to_string();
    let redirect = wait_until(Duration::from_secs(5), || {
        let s = raw_put_start(old_rpc, "written-after-waking").expect_err("refused");
        assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
        let l = s
            .metadata()
            .get("x-lunakv-leader")?
            .to_str()
            .ok()?
            .to_owned();
        (l == new_rpc).then_some(l)
    });
    assert!(redirect.is_some(), "the redirect names the new leader");
    assert_eq!(c.leader(None), Some(new), "exactly one leader");
    assert_eq!(c.masters[old].metric("master_is_leader"), Some(0.0));
    assert_eq!(c.masters[new].metric("master_is_leader"), Some(1.0));
    let keys: Vec<(String, u64)> = (0..40u64).map(|i| (format!("pause-{i}"), i)).collect();
    verify_all(&url, &keys);
    let fresh = client(&url);
    assert!(
        !fresh.exists("written-while-paused").expect("exists"),
        "the write queued at the paused leader is nowhere"
    );
    println!(
        "SIGSTOP: a new leader was elected {:.2} s after the pause; the woken leader refused \
         the queued write and stepped down",
        elected.as_secs_f64()
    );
}

#[test]
fn etcd_restart_under_load_loses_nothing_and_service_resumes() {
    let Some(mut c) = Cluster::start(3, 2) else {
        return;
    };
    let url = c.url();
    let load = Load::start(&url, 2, 1, "er");
    assert!(
        wait_until(Duration::from_secs(20), || (load.acked_len() > 100)
            .then_some(()))
        .is_some()
    );
    c.etcd.kill();
    let down = Instant::now();
    // The leader steps down once its local lease validity runs out. Polled rather than slept:
    // the deadline is generous for a busy machine, and the test goes on as soon as it holds.
    let leading = || {
        c.masters
            .iter()
            .filter(|m| m.role().as_deref() == Some("leader"))
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(20), || (leading() == 0).then_some(())).is_some(),
        "with etcd down no master may keep leading past its lease"
    );
    let mid = load.acked_len();
    c.etcd.restart().expect("etcd restarts");
    let back = Instant::now();
    let resumed = wait_until(Duration::from_secs(30), || {
        (load.acked_len() > mid + 100).then_some(back.elapsed())
    })
    .expect("the service resumes after etcd returns");
    let load = load.stop();
    let acked = load.acked.lock().expect("acked").clone();
    assert!(
        load.corrupt.lock().expect("corrupt").is_empty(),
        "corrupt reads"
    );
    verify_all(&url, &acked);
    let leader = c.leader(None).expect("one leader again");
    assert_eq!(c.masters[leader].metric("master_etcd_up"), Some(1.0));
    println!(
        "etcd down for {:.1} s: writes resumed {:.2} s after etcd returned; {} objects \
         acknowledged and verified",
        (back - down).as_secs_f64(),
        resumed.as_secs_f64(),
        acked.len()
    );
}

/// A master started before etcd waits for it (one WARN naming the endpoints) instead of exiting
/// into a crash loop, leads once etcd is up, and a SIGTERM while it waits exits 0.
#[test]
fn a_master_started_before_etcd_waits_for_it() {
    let Some(mut etcd) = testing::etcd_or_skip() else {
        return;
    };
    etcd.kill();
    let dir = tempfile::tempdir().expect("tempdir");
    let args: Vec<String> = [
        "--rpc_address=127.0.0.1",
        "--rpc_port=0",
        "--metrics_port=0",
        "--enable_ha=true",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!("--etcd_endpoints={}", etcd.endpoint()),
        format!("--data_dir={}", dir.path().display()),
    ])
    .collect();
    let mut waiting = Proc::spawn("lunakv-master", &args, &[]);
    waiting.wait_for_line("waiting", Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        waiting.alive(),
        "exited instead of waiting:\n{}",
        waiting.output()
    );
    let warns = waiting
        .output()
        .lines()
        .filter(|l| l.contains("WARN"))
        .count();
    assert!(
        warns <= 2,
        "{warns} WARN lines while waiting:\n{}",
        waiting.output()
    );
    assert!(
        waiting.output().contains(&etcd.endpoint()),
        "the wait names the endpoints:\n{}",
        waiting.output()
    );
    assert_eq!(waiting.terminate(Duration::from_secs(10)), Some(0));

    let m = Proc::spawn("lunakv-master", &args, &[]);
    m.wait_for_line("waiting", Duration::from_secs(20));
    etcd.restart().expect("etcd starts");
    m.wait_for_line("elected leader", Duration::from_secs(30));
}

/// With `--ha_fast_takeover=false` a dead leader is replaced only when its lease expires (the
/// path a dead host takes): still one leader, no revoke.
#[test]
fn without_fast_takeover_a_dead_leaders_lease_expires() {
    let Some(mut c) = Cluster::start_with(3, 1, &["--ha_fast_takeover=false"], "64MB") else {
        return;
    };
    let url = c.url();
    let probe = client(&url);
    probe.put("before", b"x").expect("put");
    let (old, _) = fail_over(&mut c, &probe, "nofast");
    let new = c
        .wait_leader(Some(old), Duration::from_secs(20))
        .expect("a new leader after the lease expired");
    assert_eq!(c.sum_metric("master_fast_takeovers_total", Some(old)), 0.0);
    let (_, st) = c.masters[new].http_get("/ha_status");
    assert!(st.contains("\"fast_takeover\":false"), "{st}");
    assert_eq!(client(&url).get("before").expect("get"), b"x");
}

fn run_to_exit(bin: &str, args: &[String]) -> (Option<i32>, String) {
    let mut p = Proc::spawn(bin, args, &[]);
    let code = p.wait_exit(Duration::from_secs(30));
    (code, p.output())
}

#[test]
fn bad_ha_input_is_an_error_that_says_what_to_fix() {
    if testing::skip_requested() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let base = |extra: &[&str]| {
        let mut a = vec![
            "--rpc_address=127.0.0.1".to_owned(),
            "--rpc_port=0".to_owned(),
            "--metrics_port=0".to_owned(),
            format!("--data_dir={}", dir.path().display()),
            "--enable_ha=true".to_owned(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    // A malformed endpoint list.
    let (code, out) = run_to_exit(
        "lunakv-master",
        &base(&["--etcd_endpoints=127.0.0.1:2379;;h2"]),
    );
    assert!(matches!(code, Some(c) if c != 0), "{out}");
    assert!(
        out.contains("etcd_endpoints") && out.contains("h1:2379;h2:2379"),
        "{out}"
    );
    let (code, out) = run_to_exit("lunakv-master", &base(&[]));
    assert!(matches!(code, Some(c) if c != 0), "{out}");
    assert!(out.contains("--etcd_endpoints="), "{out}");
    // A lease that could not work.
    let (code, out) = run_to_exit(
        "lunakv-master",
        &base(&["--etcd_endpoints=127.0.0.1:2379", "--ha_lease_ttl_sec=0"]),
    );
    assert!(matches!(code, Some(c) if c != 0), "{out}");
    assert!(
        out.contains("ha_lease_ttl_sec") && out.contains("1..=60"),
        "{out}"
    );
    let (code, out) = run_to_exit(
        "lunakv-store",
        &[
            "--etcd_endpoints=nohost".to_owned(),
            "--port=0".to_owned(),
            "--metrics_port=0".to_owned(),
        ],
    );
    assert!(matches!(code, Some(c) if c != 0), "{out}");
    assert!(out.contains("--etcd_endpoints 'nohost'"), "{out}");

    // A cluster_id mismatch between the masters and a store-client / client.
    let Some(etcd) = testing::etcd_or_skip() else {
        return;
    };
    let mdir = tempfile::tempdir().expect("tempdir");
    let m = Master::start_ha(mdir.path(), &etcd.endpoint(), &["--cluster_id=alpha"]);
    wait_until(Duration::from_secs(20), || {
        (m.role().as_deref() == Some("leader")).then_some(())
    })
    .expect("leader");
    let (code, out) = run_to_exit(
        "lunakv-store",
        &[
            format!("--etcd_endpoints={}", etcd.endpoint()),
            "--cluster_id=beta".to_owned(),
            "--host=127.0.0.1".to_owned(),
            "--port=0".to_owned(),
            "--metrics_port=0".to_owned(),
            "--global_segment_size=16MB".to_owned(),
        ],
    );
    assert!(matches!(code, Some(c) if c != 0), "{out}");
    assert!(
        out.contains("no lunakv-master leads cluster \"beta\"") && out.contains("\"alpha\""),
        "the message names both cluster ids: {out}"
    );
    let e = StoreClient::connect(ClientOptions {
        master_server_address: etcd.etcd_url(),
        cluster_id: "beta".into(),
        rpc_timeout: Duration::from_secs(2),
        ..ClientOptions::default()
    })
    .err()
    .expect("mismatch");
    assert!(
        matches!(e, ClientError::Rpc { .. }) && e.to_string().contains("cluster_id"),
        "{e}"
    );
}

/// What one cluster's kill -9 trials gave.
#[derive(Default)]
struct Trials {
    reattach: Vec<Duration>,
    acked: Vec<(String, u64)>,
    wrong: usize,
    put_errors: u64,
    get_errors: u64,
}

impl Trials {
    /// (p50, p99) of the reattach times; with fewer than 100 trials p99 is the maximum.
    fn percentiles(&self) -> (f64, f64) {
        let mut v: Vec<f64> = self.reattach.iter().map(Duration::as_secs_f64).collect();
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
        (at(0.5), at(0.99))
    }
}

/// One kill -9 of `c`'s leader under a put/get load. Reattach = death of the leader to the first
/// successful get of a key the probing client has never seen (so the master must answer it),
/// through `etcd://`, as an engine would.
fn timed_failover(c: &mut Cluster, tag: &str, t: &mut Trials) {
    let url = c.url();
    let seed_client = client(&url);
    for i in 0..64u64 {
        seed_client
            .put(&format!("{tag}-pre-{i}"), &pattern(i, OBJ))
            .expect("put before the failover");
        t.acked.push((format!("{tag}-pre-{i}"), i));
    }
    let probe = client(&url);
    let load = Load::start(&url, 2, 1, tag);
    wait_until(Duration::from_secs(20), || {
        (load.acked_len() > 20).then_some(())
    })
    .expect("the load makes progress");
    let old = c.leader(None).expect("a leader before the failover");
    c.masters[old].proc.kill9();
    let killed = Instant::now();
    let mut k = 0u64;
    let reattach = loop {
        match probe.get(&format!("{tag}-pre-{k}")) {
            Ok(v) => {
                if v != pattern(k, OBJ) {
                    t.wrong += 1;
                }
                break killed.elapsed();
            }
            Err(e) => {
                assert!(
                    killed.elapsed() < Duration::from_secs(60),
                    "no reattach: {e}"
                );
                k = (k + 1) % 64;
            }
        }
    };
    t.reattach.push(reattach);
    std::thread::sleep(Duration::from_millis(500));
    let load = load.stop();
    t.acked
        .extend(load.acked.lock().expect("acked").iter().cloned());
    t.wrong += load.corrupt.lock().expect("corrupt").len();
    t.put_errors += load.put_errors.load(Ordering::Relaxed);
    t.get_errors += load.get_errors.load(Ordering::Relaxed);
    c.replace(old);
    wait_until(Duration::from_secs(20), || {
        (c.masters[old].role().as_deref() == Some("follower")).then_some(())
    })
    .expect("the replacement standby follows");
    // Let the standby's dials start before the next kill.
    std::thread::sleep(Duration::from_millis(500));
}

/// (lost, wrong) among `acked`, read by a fresh client from the current leader's index.
fn count_lost(url: &str, acked: &[(String, u64)]) -> (usize, usize) {
    let c = client(url);
    let (mut lost, mut wrong) = (0, 0);
    for (key, seed) in acked {
        match c.get(key) {
            Ok(v) if v == pattern(*seed, OBJ) => {}
            Ok(_) => wrong += 1,
            Err(_) => lost += 1,
        }
    }
    (lost, wrong)
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Printed, not asserted (`make bench-failover`):
/// - kill -9 of the leader under a put/get load, in paired trials: a cluster with the default
///   settings (standbys revoke a dead leader's lease) and one with `--ha_fast_takeover=false`
///   (the path a dead *host* takes: the lease must expire), alternating, with p50/p99 reattach
///   and the acknowledged objects lost or wrong;
/// - false failovers: leader changes while the CPU is starved by busy threads (4 per core) and
///   the load runs;
/// - put/get throughput with HA against a single master, in the same run.
///
/// `LUNAKV_FAILOVER_ROUNDS` (default 8 per cluster), `LUNAKV_FAILOVER_STRESS_SECS` (default 30).
#[test]
#[ignore = "benchmark: run explicitly (make bench-failover)"]
fn ha_bench() {
    let rounds = env_or("LUNAKV_FAILOVER_ROUNDS", 8) as usize;
    let stress_secs = env_or("LUNAKV_FAILOVER_STRESS_SECS", 30);
    // Room for every object the trials acknowledge, so that no eviction hides or fakes a loss
    // (memfd pages are only backed once written).
    let Some(mut fast) = Cluster::start_with(3, 1, &[], "4GB") else {
        return;
    };
    let mut lease = Cluster::start_with(3, 1, &["--ha_fast_takeover=false"], "4GB").expect("etcd");
    let (mut tf, mut tl) = (Trials::default(), Trials::default());
    for round in 0..rounds {
        timed_failover(&mut fast, &format!("fast{round}"), &mut tf);
        timed_failover(&mut lease, &format!("lease{round}"), &mut tl);
        eprintln!(
            "failover round {}/{rounds}: revoke {:.2} s, lease expiry {:.2} s",
            round + 1,
            tf.reattach[round].as_secs_f64(),
            tl.reattach[round].as_secs_f64()
        );
    }
    let (lf, wf) = count_lost(&fast.url(), &tf.acked);
    let (ll, wl) = count_lost(&lease.url(), &tl.acked);
    let evicted = |c: &Cluster| {
        c.leader(None)
            .and_then(|i| c.masters[i].metric("master_evicted_key_count"))
            .unwrap_or(f64::NAN)
    };
    let (ef, el) = (evicted(&fast), evicted(&lease));

    // False failovers: nothing is killed, the CPU is starved.
    let url = fast.url();
    let before = fast.sum_metric("master_leader_changes_total", None);
    let fenced_before = fast.sum_metric("master_fenced_writes_total", None);
    let load = Load::start(&url, 2, 2, "stress");
    let stop = Arc::new(AtomicBool::new(false));
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let spinners: Vec<_> = (0..4 * cores)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(stress_secs));
    stop.store(true, Ordering::Relaxed);
    for s in spinners {
        s.join().expect("spinner");
    }
    let load = load.stop();
    let changes = fast.sum_metric("master_leader_changes_total", None) - before;
    let fenced = fast.sum_metric("master_fenced_writes_total", None) - fenced_before;

    // Steady state: HA against a single master, same run.
    let n = 1000;
    let payload = pattern(7, 64 << 10);
    let measure = |cl: &StoreClient, tag: &str| {
        let t = Instant::now();
        for i in 0..n {
            cl.put(&format!("{tag}-{i}"), &payload).expect("bench put");
        }
        let puts = n as f64 / t.elapsed().as_secs_f64();
        let t = Instant::now();
        for i in 0..n {
            cl.get(&format!("{tag}-{i}")).expect("bench get");
        }
        (puts, n as f64 / t.elapsed().as_secs_f64())
    };
    let sdir = tempfile::tempdir().expect("tempdir");
    let single = Master::start(sdir.path(), &[]);
    let _sstore = Store::start(&single.addr(), "512MB", &["--enable_shm=false"]);
    fast.stores
        .push(Store::start(&fast.url(), "512MB", &["--enable_shm=false"]));
    let (sp, sg) = measure(&client(&single.addr()), "single");
    let (hp, hg) = measure(&client(&fast.url()), "ha");

    let (f50, f99) = tf.percentiles();
    let (l50, l99) = tl.percentiles();
    println!("HA failover bench: kill -9 of the leader under put/get load, {rounds} paired trials");
    println!("  reattach = kill -> first get of an uncached key answered through etcd://");
    println!(
        "  process death (standby revokes the lease): p50 {f50:.2} s  p99 {f99:.2} s  lost {lf}  wrong {}  ({} acked, {ef} evicted, {} put / {} get errors during failovers)",
        wf + tf.wrong,
        tf.acked.len(),
        tf.put_errors,
        tf.get_errors
    );
    println!(
        "  lease expiry only (a dead host):          p50 {l50:.2} s  p99 {l99:.2} s  lost {ll}  wrong {}  ({} acked, {el} evicted, {} put / {} get errors)",
        wl + tl.wrong,
        tl.acked.len(),
        tl.put_errors,
        tl.get_errors
    );
    println!(
        "  CPU starved ({} busy threads on {cores} cores, {stress_secs} s, load on): {changes} leader changes (false failovers), {fenced} fenced requests, {} puts acked",
        4 * cores,
        load.acked_len()
    );
    println!(
        "  steady state (64 KiB, tcp, one thread): single put {sp:.0} get {sg:.0} ops/s; HA put {hp:.0} ({:.0}%) get {hg:.0} ({:.0}%)",
        hp / sp * 100.0,
        hg / sg * 100.0
    );
    println!("  (p99 is the maximum when there are fewer than 100 trials)");
}

/// Issue 33 item 9: followers used to log ERROR "etcd unreachable while watching the leader
/// key" about every 8 s next to a healthy etcd. Their etcd channel pinged every 2 s, and etcd
/// (`--grpc-keepalive-min-time`, 5 s by default) answers a client that pings more often with
/// GOAWAY "too_many_pings" after two strikes, which broke the watch. Over a window of several
/// such cycles, no master reports etcd unreachable, and each one's watch (or lease) holds.
#[test]
fn followers_next_to_a_healthy_etcd_log_no_false_unreachable() {
    let Some(c) = Cluster::start(2, 0) else {
        return;
    };
    // Three of the old 8 s cycles. Not a timing assertion: a healthy etcd must never be
    // reported unreachable, however slow the machine.
    std::thread::sleep(Duration::from_secs(25));
    for (i, m) in c.masters.iter().enumerate() {
        let out = m.proc.output();
        let false_alarms: Vec<&str> = out
            .lines()
            .filter(|l| l.contains("etcd unreachable") || l.contains("watch broke"))
            .collect();
        assert!(
            false_alarms.is_empty(),
            "master {i} ({:?}) reported a healthy etcd unreachable:\n{}",
            m.role(),
            false_alarms.join("\n")
        );
        assert_eq!(m.metric("master_etcd_up"), Some(1.0), "master {i}");
    }
}

/// The admin API's writes pass the RPCs' gate: an HA follower refuses remove_all and the drain
/// jobs with upstream's 503 (jobs live in the leader's core), while the leader takes them.
#[test]
fn admin_writes_on_a_follower_get_upstreams_503_and_the_leader_takes_them() {
    let Some(c) = Cluster::start(2, 1) else {
        return;
    };
    let leader = c.leader(None).expect("leader");
    let follower = 1 - leader;
    let seg = c.stores[0].segment_name();
    let body = format!(r#"{{"segments": ["{seg}"]}}"#);
    let at = |i: usize, method: &str, path: &str, body: &[u8]| {
        lunakv_tests::pd::request(c.masters[i].admin, method, path, &[], body)
    };
    let refused = |r: lunakv_tests::pd::Resp, what: &str| {
        assert_eq!(
            r.status,
            503,
            "{what}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("JSON");
        assert_eq!(v["success"], false, "{what}: {v}");
        assert_eq!(v["error_code"], -1010, "{what}: {v}");
    };
    refused(
        at(follower, "POST", "/api/v1/remove_all?force=true", b""),
        "remove_all",
    );
    refused(
        at(follower, "POST", "/api/v1/drain_jobs", body.as_bytes()),
        "create",
    );
    let some_job = "0f0e0d0c-0b0a-4908-8706-050403020100";
    refused(
        at(
            follower,
            "GET",
            &format!("/api/v1/drain_jobs/query?job_id={some_job}"),
            b"",
        ),
        "query",
    );
    refused(
        at(
            follower,
            "POST",
            &format!("/api/v1/drain_jobs/cancel?job_id={some_job}"),
            b"",
        ),
        "cancel",
    );

    // The leader takes the same calls.
    let r = at(leader, "POST", "/api/v1/drain_jobs", body.as_bytes());
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v: serde_json::Value = serde_json::from_slice(&r.body).expect("JSON");
    let job = v["job_id"].as_str().expect("job_id").to_owned();
    let r = at(
        leader,
        "POST",
        &format!("/api/v1/drain_jobs/cancel?job_id={job}"),
        b"",
    );
    assert!(
        r.status == 200 || r.status == 409,
        "cancel at the leader (409 once the job has ended): {}",
        String::from_utf8_lossy(&r.body)
    );
    let r = at(leader, "POST", "/api/v1/remove_all?force=true", b"");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}
