//! Abuse of a segment server's transfer port by strangers (docs/SECURITY.md): memory taken
//! before any check, and connections held so that no legitimate requester gets in. Each test
//! prints its figure as one `abuse: ...` line; `cargo test -p lunakv-transfer --test abuse --
//! --nocapture` shows them. Real sockets on loopback, port 0; the strangers use source
//! addresses 127.0.0.2 and up, the legitimate requesters 127.0.0.1. Counts and times are small
//! and every wait is bounded, and nothing asserts a timing: a busy 2-core machine passes.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lunakv_transfer::cap::{READ_TTL, RIGHT_READ, RIGHT_WRITE, attach_cap};
use lunakv_transfer::wire::{self, Op, Request, Response, Status};
use lunakv_transfer::{
    Capability, ConnLimits, Grant, MountSecret, SegmentServer, SegmentServerConfig, Target,
    TransferEngine, TransferOptions,
};

/// The tests measure this process's memory, so they run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const SEG: u64 = 1 << 20;
const GEN: u64 = 5 << 32 | 1;
const OFF: u64 = 4096;
const LEN: usize = 4096;
/// Legitimate gets each scenario tries, each from a fresh requester (a new connection).
const GETS: usize = 10;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's anonymous resident memory (heap, stacks) in KiB: what a stranger's buffers
/// cost the owner. Segment pages are shared memory and do not count.
fn rss_anon_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("RssAnon in /proc/self/status")
}

/// A tcp connection to `dst` from source address `src` (one of many loopback addresses).
fn connect_from(src: Ipv4Addr, dst: SocketAddr) -> io::Result<TcpStream> {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None)?;
    bind(&fd, &SocketAddr::new(IpAddr::V4(src), 0))?;
    connect(&fd, &dst)?;
    Ok(TcpStream::from(fd))
}

fn stranger(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 2 + i as u8)
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tcp_engine() -> TransferEngine {
    TransferEngine::new(TransferOptions {
        enable_shm: false,
        io_timeout: Duration::from_secs(5),
        ..TransferOptions::default()
    })
}

fn pattern() -> Vec<u8> {
    (0..LEN).map(|i| (i % 251) as u8).collect()
}

/// A server whose tcp table holds `max_conns`, at most `per_peer` from one address, with an
/// object at (GEN, OFF) written by a requester that is gone again. With `secret`, capabilities
/// are required and the returned target carries a read capability.
fn loaded_server(
    max_conns: u32,
    per_peer: u32,
    idle: Duration,
    secret: Option<MountSecret>,
) -> (SegmentServer, Target) {
    let server = SegmentServer::start(SegmentServerConfig {
        size: SEG,
        limits: ConnLimits {
            max_conns,
            max_conns_per_peer: per_peer,
            idle_timeout: Some(idle),
        },
        ..Default::default()
    })
    .unwrap();
    let mut t = Target::from(&server.info());
    let name = server.info().name;
    let g = Grant {
        segment: &name,
        generation: GEN,
        offset: OFF,
        len: LEN as u64,
    };
    if let Some(k) = secret {
        assert!(server.require_capabilities(k));
        t.capability = Some(Capability::issue(
            &k,
            &g,
            RIGHT_READ | RIGHT_WRITE,
            READ_TTL,
        ));
    }
    {
        let e = tcp_engine();
        e.write(&t, GEN, "victim", OFF, &[&pattern()]).unwrap();
    }
    // The writer's pooled connections are closed: every get below needs a new connection.
    wait_for("the writer's connections to close", || {
        server.conn_stats().open_tcp == 0
    });
    if let Some(k) = secret {
        t.capability = Some(Capability::issue(&k, &g, RIGHT_READ, READ_TTL));
    }
    (server, t)
}

/// `GETS` gets of the object, each by a fresh requester; how many returned the right bytes.
fn legit_gets(t: &Target) -> usize {
    let want = pattern();
    (0..GETS)
        .filter(|_| {
            let e = tcp_engine();
            let mut got = vec![0u8; LEN];
            e.read(t, GEN, OFF, &mut [&mut got[..]]).is_ok() && got == want
        })
        .count()
}

/// Strangers holding connections: `per_addr` from each of `addrs` addresses, each kept open by
/// its own thread and opened again (after a short pause) whenever the server closes it. `body`
/// is what each sends once connected, one byte every `every` (empty: nothing, it just holds).
struct Flood {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Connections the server closed (or refused) so far.
    closed: Arc<AtomicU64>,
}

impl Flood {
    fn start(
        dst: SocketAddr,
        addrs: usize,
        per_addr: usize,
        body: Vec<u8>,
        every: Duration,
    ) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let closed = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for a in 0..addrs {
            for _ in 0..per_addr {
                let (stop, closed, body) = (stop.clone(), closed.clone(), body.clone());
                threads.push(std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(s) = connect_from(stranger(a), dst) {
                            hold(&s, &body, every, &stop);
                            closed.fetch_add(1, Ordering::Relaxed);
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }));
            }
        }
        Flood {
            stop,
            threads,
            closed,
        }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Keeps `s` open until the server closes it or the flood stops, trickling `body`.
fn hold(mut s: &TcpStream, body: &[u8], every: Duration, stop: &AtomicBool) {
    let _ = s.set_read_timeout(Some(every));
    let mut sent = 0;
    let mut b = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        if sent < body.len() {
            if s.write_all(&body[sent..sent + 1]).is_err() {
                return;
            }
            sent += 1;
        }
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// A WRITE header claiming a long key, to be trickled: the request never completes.
fn trickle_body() -> Vec<u8> {
    Request {
        op: Op::Write,
        generation: 77,
        offset: 0,
        len: 1,
        key_len: 4000,
        aux: 0,
    }
    .encode()
    .into_iter()
    .chain(std::iter::repeat_n(b'k', 4000))
    .collect()
}

/// Item 1: with capabilities required, 128 FREE headers claiming the most pairs a FREE may
/// carry, from strangers whose tags are forged; one in four followed by all of its body but the
/// last byte. The owner must check a tag before it buffers any body byte: its memory must not
/// grow with the claimed or sent bodies (before the fix every connection buffered up to 16 MiB:
/// header-only ones as the allocator touched the buffer, the others as their bytes arrived).
#[test]
fn a_free_header_flood_with_security_on_buffers_no_body() {
    let _g = serial();
    const CONNS: usize = 128;
    const WITH_BODY_EVERY: usize = 4;
    let secret = MountSecret::generate();
    let server = SegmentServer::start(SegmentServerConfig {
        size: SEG,
        ..Default::default()
    })
    .unwrap();
    assert!(server.require_capabilities(secret));
    let ep = server.info().transfer_endpoint;
    let addr = server.local_addr();
    // The master's FREE works before (and warms every path it takes).
    let master = tcp_engine();
    master.set_owner_key(&ep, Some(secret));
    master
        .free(&ep, &[(GEN, OFF)], Duration::from_millis(100))
        .unwrap();
    let before = rss_anon_kib();

    let count = wire::MAX_FREE_ITEMS;
    let body = u64::from(count) * 16 - 1;
    let zeros = vec![0u8; 1 << 20];
    let mut conns = Vec::new();
    for i in 0..CONNS {
        let mut hdr = Request {
            op: Op::Free,
            generation: 0,
            offset: 0,
            len: 0,
            key_len: count,
            aux: 0,
        }
        .encode();
        // A stranger's tag: a secret of its own.
        let tag = Capability::owner(&MountSecret::generate(), &hdr, &[]);
        let tb = attach_cap(&mut hdr, Some(&tag)).to_vec();
        let mut s = connect_from(stranger(i % 4), addr).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut ok = s.write_all(&hdr).is_ok() && s.write_all(&tb).is_ok();
        let mut left = if i % WITH_BODY_EVERY == 0 { body } else { 0 };
        while ok && left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            ok = s.write_all(&zeros[..n]).is_ok();
            left -= n as u64;
        }
        conns.push(s);
    }
    // What the owner holds while every body sits one byte short.
    let mut peak = rss_anon_kib();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(50));
        peak = peak.max(rss_anon_kib());
    }
    let growth_mib = peak.saturating_sub(before) as f64 / 1024.0;
    println!(
        "abuse: header-flood conns={CONNS} with_bodies={} rss_growth_mib={growth_mib:.1} (target < 64)",
        CONNS / WITH_BODY_EVERY
    );
    // The master's FREE is still served while the strangers hold their connections.
    master
        .free(&ep, &[(GEN, OFF)], Duration::from_millis(100))
        .unwrap();
    drop(conns);
    assert!(
        growth_mib < 64.0,
        "{CONNS} forged FREE headers with bodies grew the owner by {growth_mib:.1} MiB"
    );
    assert!(
        server.refused_total() >= CONNS as u64,
        "every forged FREE is refused at its header: {} refusals",
        server.refused_total()
    );
}

/// Item 1, the master's side: a FREE whose header the master tagged is buffered as it arrives
/// and served, however many pairs it carries; the same tagged header followed by another body
/// (a replay with the pairs swapped) is refused and applies none of them.
#[test]
fn a_tagged_free_is_served_and_a_replayed_header_with_another_body_applies_nothing() {
    let _g = serial();
    let secret = MountSecret::generate();
    let (server, t) = loaded_server(0, 0, Duration::from_secs(60), Some(secret));
    let ep = t.endpoint.clone();
    // 100,000 pairs naming nothing, then the victim's.
    let mut items: Vec<(u64, u64)> = (0..100_000u64).map(|i| (1 << 60 | i, 0)).collect();
    items.push((GEN, OFF));
    let pairs = |items: &[(u64, u64)]| -> Vec<u8> {
        items
            .iter()
            .flat_map(|(g, o)| g.to_le_bytes().into_iter().chain(o.to_le_bytes()))
            .collect()
    };
    let mut hdr = Request {
        op: Op::Free,
        generation: 0,
        offset: 0,
        len: 0,
        key_len: items.len() as u32,
        aux: 100,
    }
    .encode();
    // The master tagged a FREE of harmless pairs; the replay carries the victim's instead.
    let harmless = pairs(&vec![(1 << 61, 0); items.len()]);
    let tag = Capability::owner(&secret, &hdr, &harmless);
    let tb = attach_cap(&mut hdr, Some(&tag)).to_vec();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&hdr).unwrap();
    s.write_all(&tb).unwrap();
    s.write_all(&pairs(&items)).unwrap();
    let mut r = [0u8; wire::RESP_LEN];
    s.read_exact(&mut r).unwrap();
    assert_eq!(Response::decode(&r).unwrap().status, Status::Refused);
    let mut got = vec![0u8; LEN];
    tcp_engine()
        .read(&t, GEN, OFF, &mut [&mut got[..]])
        .expect("a replayed header with another body frees nothing");
    assert_eq!(got, pattern());
    // The master's own FREE of the same pairs is served.
    let master = tcp_engine();
    master.set_owner_key(&ep, Some(secret));
    master
        .free(&ep, &items, Duration::from_millis(100))
        .expect("the master's FREE");
    assert!(
        tcp_engine()
            .read(&t, GEN, OFF, &mut [&mut got[..]])
            .is_err(),
        "freed"
    );
}

/// Item 2: strangers from many addresses, each under the per-address cap, fill the whole tcp
/// table and open their connections again as soon as they are closed. A legitimate requester
/// must still get in: 10 of 10 gets served. Capabilities are on, as where strangers are expected.
#[test]
fn strangers_from_many_addresses_cannot_starve_the_transfer_port() {
    let _g = serial();
    let (server, t) = loaded_server(
        32,
        8,
        Duration::from_secs(60),
        Some(MountSecret::generate()),
    );
    let flood = Flood::start(
        server.local_addr(),
        4,
        8,
        Vec::new(),
        Duration::from_millis(100),
    );
    wait_for("the strangers to fill the table", || {
        server.conn_stats().open_tcp == 32
    });
    let served = legit_gets(&t);
    println!("abuse: many-address-flood legit_gets_served={served}/{GETS} (target {GETS}/{GETS})");
    let st = server.conn_stats();
    flood.stop();
    assert_eq!(
        served, GETS,
        "legitimate gets served while strangers fill the table"
    );
    assert!(
        st.open_tcp <= 32,
        "the table never grows past its cap: {st:?}"
    );
    // A get finds the table full at least the first time; later ones may find the place the
    // previous requester left before a stranger takes it back.
    assert!(st.evicted_total >= 1, "a get displaced a stranger: {st:?}");
}

/// Item 2: strangers that send a request one byte at a time defeat an idle timeout (each byte
/// restarts it). A request must arrive whole within a deadline: a trickling connection is closed
/// even though it is never idle, and while trickling strangers fill the table, legitimate
/// requesters still get in: 10 of 10 gets served.
#[test]
fn trickling_strangers_are_cut_off_and_cannot_starve_the_transfer_port() {
    let _g = serial();
    // The idle timeout (1 s) also bounds how long one request may take to arrive.
    let (server, t) = loaded_server(32, 8, Duration::from_secs(1), None);
    let every = Duration::from_millis(100);

    // Alone: 4 trickling connections, far under every cap, are cut off by the deadline.
    let few = Flood::start(server.local_addr(), 1, 4, trickle_body(), every);
    wait_for("the trickling connections to open", || {
        server.conn_stats().open_tcp == 4
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    while few.closed.load(Ordering::Relaxed) < 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let cut = few.closed.load(Ordering::Relaxed).min(4);
    few.stop();
    let slow = server.conn_stats().too_slow_total;
    println!("abuse: trickle conns_cut_off={cut}/4 (target 4/4)");

    // Filling the table: legitimate gets still get in.
    let flood = Flood::start(server.local_addr(), 4, 8, trickle_body(), every);
    wait_for("the trickling strangers to fill the table", || {
        server.conn_stats().open_tcp >= 30
    });
    let served = legit_gets(&t);
    println!("abuse: trickle legit_gets_served={served}/{GETS} (target {GETS}/{GETS})");
    flood.stop();
    assert_eq!(
        cut, 4,
        "trickling connections are closed although never idle"
    );
    assert!(slow >= 4, "closed for their deadline: {slow}");
    assert_eq!(
        served, GETS,
        "legitimate gets served while trickling strangers fill the table"
    );
}
