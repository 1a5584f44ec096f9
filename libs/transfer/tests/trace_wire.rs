//! The trace-context extension of the transfer wire (wire.rs: `FLAG_TRACE`, `FEATURE_TRACE`)
//! with traces on in this process: a requester probes each tcp connection once, sends its
//! span's context only to peers that announce they read it, never to a peer that predates the
//! extension, and the real servers stay in step with traced frames on every path.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::OnceLock;
use std::sync::mpsc;

use lunakv_telemetry::Telemetry;
use lunakv_telemetry::propagate::TraceParent;
use lunakv_transfer::wire::{self, Op, Request, Response, Status};
use lunakv_transfer::{
    MemoryRegistry, RawRequest, RegionServer, RegionServerConfig, SegmentServer,
    SegmentServerConfig, Target, TransferEngine, TransferOptions, TransferRequest,
};

/// Traces on for this test binary: an exporter towards a port nothing listens on (exports fail
/// quietly; spans get real contexts, which is all these tests need).
fn tracing_on() {
    static GUARD: OnceLock<Telemetry> = OnceLock::new();
    GUARD.get_or_init(|| {
        let env = |k: &str| match k {
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some("http://127.0.0.1:9".to_owned()),
            "OTEL_EXPORTER_OTLP_PROTOCOL" => Some("grpc".to_owned()),
            _ => None,
        };
        lunakv_telemetry::Init::new("trace-wire-test")
            .default_log_filter("off")
            .env(&env)
            .install()
    });
    assert!(
        lunakv_telemetry::enabled(),
        "the test exporter is not installed"
    );
}

/// What a fake peer saw of one request.
#[derive(Debug)]
struct Seen {
    op: Op,
    len: u64,
    traced: bool,
    context: Option<TraceParent>,
}

/// A segment server double answering READ(len 0) and WRITE. `announce` = a current peer
/// (features byte set, reads trace contexts); otherwise one that predates the extension
/// (features 0; a flagged frame would be misparsed, which the test catches by recording it).
/// A WRITE of at least 1 MiB is answered only once `hold` connections are open (or after 10 s):
/// a sender that spreads a batch over several connections then has to open them, however
/// busy the machine, instead of one thread finishing on the first before the next starts.
fn fake_peer(announce: bool, hold: usize) -> (SocketAddr, mpsc::Receiver<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = mpsc::channel();
    let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut s) = conn else { return };
            conns.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let conns = conns.clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let reply = |s: &mut std::net::TcpStream, status: Status, msg: &[u8]| {
                    let mut h = Response {
                        status,
                        value: 0,
                        len: msg.len() as u64,
                    }
                    .encode();
                    h[wire::FLAGS_AT] = if announce { wire::FEATURE_TRACE } else { 0 };
                    s.write_all(&h).and_then(|_| s.write_all(msg))
                };
                loop {
                    let mut hdr = [0u8; wire::REQ_LEN];
                    if s.read_exact(&mut hdr).is_err() {
                        return;
                    }
                    let Ok(req) = Request::decode(&hdr) else {
                        return;
                    };
                    let traced = wire::is_traced(&hdr);
                    let mut context = None;
                    if announce && traced {
                        let mut tc = [0u8; wire::TRACE_LEN];
                        if s.read_exact(&mut tc).is_err() {
                            return;
                        }
                        context = wire::decode_trace(&tc);
                    }
                    let _ = tx.send(Seen {
                        op: req.op,
                        len: req.len,
                        traced,
                        context,
                    });
                    let r = match req.op {
                        Op::Read if req.len == 0 => {
                            reply(&mut s, Status::BadRequest, b"zero-length read")
                        }
                        Op::Write => {
                            let mut body = vec![0u8; req.key_len as usize + req.len as usize];
                            if s.read_exact(&mut body).is_err() {
                                return;
                            }
                            let until =
                                std::time::Instant::now() + std::time::Duration::from_secs(10);
                            while req.len >= 1 << 20
                                && conns.load(std::sync::atomic::Ordering::SeqCst) < hold
                                && std::time::Instant::now() < until
                            {
                                std::thread::sleep(std::time::Duration::from_millis(1));
                            }
                            reply(&mut s, Status::Ok, b"")
                        }
                        _ => return,
                    };
                    if r.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

fn tcp_engine() -> TransferEngine {
    TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    })
}

fn target(addr: SocketAddr) -> Target {
    Target {
        endpoint: addr.to_string(),
        host_id: "another-host".into(),
        shm_socket: None,
        size: 64 << 20,
        instance_id: None,
        capability: None,
    }
}

/// How many zero-length READ probes the peer saw.
fn probes(seen: &[Seen]) -> usize {
    seen.iter()
        .filter(|s| s.op == Op::Read && s.len == 0)
        .count()
}

/// Traces on, a fake peer (see [`fake_peer`]) and a tcp engine aimed at it.
fn against_fake_peer(
    announce: bool,
    hold: usize,
) -> (TransferEngine, Target, mpsc::Receiver<Seen>) {
    tracing_on();
    let (addr, rx) = fake_peer(announce, hold);
    (tcp_engine(), target(addr), rx)
}

fn drain(rx: &mpsc::Receiver<Seen>) -> Vec<Seen> {
    let mut out = Vec::new();
    while let Ok(s) = rx.recv_timeout(std::time::Duration::from_millis(300)) {
        out.push(s);
    }
    out
}

#[test]
fn a_peer_that_predates_the_extension_never_gets_a_flagged_frame() {
    let (engine, t, rx) = against_fake_peer(false, 0);
    let _span = tracing::info_span!("caller").entered();
    assert!(TraceParent::current().is_some(), "the caller has a context");
    for g in 1..=3u64 {
        engine
            .write(&t, g, "k", 0, &[b"hello"])
            .expect("write to an old peer");
    }
    let seen = drain(&rx);
    assert_eq!(probes(&seen), 1, "one probe per connection: {seen:?}");
    let writes: Vec<&Seen> = seen.iter().filter(|s| s.op == Op::Write).collect();
    assert_eq!(writes.len(), 3, "{seen:?}");
    assert!(writes.iter().all(|w| !w.traced), "{seen:?}");
}

#[test]
fn a_peer_that_announces_it_gets_the_callers_context_on_every_request() {
    // The batch's big writes wait for a second connection (see fake_peer).
    let (engine, t, rx) = against_fake_peer(true, 2);
    let span = tracing::info_span!("caller");
    let me = TraceParent::of(&span).expect("the caller has a context");
    // 4 MiB in 4 objects: the batch spreads over several connections and threads, and each
    // thread must still send the caller's context.
    let big = vec![1u8; 1 << 20];
    span.in_scope(|| {
        engine
            .write(&t, 1, "k", 0, &[b"one"])
            .expect("single write");
        let mut reqs: Vec<TransferRequest<'_>> = (0..4u64)
            .map(|g| TransferRequest::Write {
                target: &t,
                generation: 10 + g,
                key: "k",
                offset: g << 20,
                src: vec![&big],
            })
            .collect();
        for r in engine.batch(&mut reqs) {
            r.expect("pipelined write");
        }
    });
    // Outside any span nothing is attached.
    engine
        .write(&t, 2, "k", 0, &[b"two"])
        .expect("untraced write");
    let seen = drain(&rx);
    assert!(
        probes(&seen) >= 2,
        "the batch used several connections: {seen:?}"
    );
    let writes: Vec<&Seen> = seen.iter().filter(|s| s.op == Op::Write).collect();
    assert_eq!(writes.len(), 6, "{seen:?}");
    let (traced, plain) = writes.split_at(5);
    for w in traced {
        assert!(w.traced, "{w:?}");
        assert_eq!(w.context, Some(me), "the caller's span is the parent");
    }
    assert!(!plain[0].traced, "{:?}", plain[0]);
}

#[test]
fn the_real_servers_stay_in_step_with_traced_frames() {
    tracing_on();
    let dir = tempfile::tempdir().expect("tempdir");
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().expect("addr"),
        size: 4 << 20,
        shm_socket: Some(dir.path().join("seg.sock")),
        advertise_host: None,
        ..Default::default()
    })
    .expect("segment server");
    let t = Target::from(&server.info());
    let registry = MemoryRegistry::new();
    let regions = RegionServer::start(
        RegionServerConfig {
            bind: "127.0.0.1:0".parse().expect("addr"),
            advertise_host: None,
        },
        registry.clone(),
    )
    .expect("region server");
    let region = registry.alloc(64 << 10).expect("region");
    let _span = tracing::info_span!("caller").entered();

    // tcp: single ops, then a pipelined batch of writes and reads.
    let tcp = tcp_engine();
    let a = vec![7u8; 100_000];
    tcp.write(&t, 1, "a", 0, &[&a]).expect("tcp write");
    let mut back = vec![0u8; a.len()];
    tcp.read(&t, 1, 0, &mut [&mut back]).expect("tcp read");
    assert_eq!(back, a);
    let bodies: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 4096]).collect();
    let mut reqs: Vec<TransferRequest<'_>> = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| TransferRequest::Write {
            target: &t,
            generation: 100 + i as u64,
            key: "b",
            offset: (1 << 20) + i as u64 * 4096,
            src: vec![b],
        })
        .collect();
    assert!(tcp.batch(&mut reqs).iter().all(|r| r.is_ok()));
    let mut outs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; 4096]).collect();
    let mut reqs: Vec<TransferRequest<'_>> = outs
        .iter_mut()
        .enumerate()
        .map(|(i, o)| TransferRequest::Read {
            target: &t,
            generation: 100 + i as u64,
            offset: (1 << 20) + i as u64 * 4096,
            dst: vec![&mut o[..]],
        })
        .collect();
    assert!(tcp.batch(&mut reqs).iter().all(|r| r.is_ok()));
    drop(reqs);
    assert_eq!(outs, bodies);

    // shm: COMMIT and PIN carry the context (learned from the ATTACH answer).
    let shm = TransferEngine::new(TransferOptions::default());
    if shm.uses_shm(&t) {
        let c = vec![9u8; 5000];
        shm.write(&t, 2, "c", 2 << 20, &[&c]).expect("shm write");
        let mut back = vec![0u8; c.len()];
        shm.read(&t, 2, 2 << 20, &mut [&mut back])
            .expect("shm read");
        assert_eq!(back, c);
    } else {
        eprintln!("shm disabled by the environment; skipping the shm half");
    }

    // Raw regions: single and batched RAW_WRITE, then RAW_READ.
    let ep = regions.endpoint().to_string();
    tcp.write_raw(&ep, region.addr(), &[b"raw-one"])
        .expect("raw write");
    let blocks: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i + 1; 1024]).collect();
    let mut reqs: Vec<RawRequest<'_>> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| RawRequest::Write {
            endpoint: &ep,
            remote_addr: region.addr() + 4096 + i as u64 * 1024,
            src: vec![b],
        })
        .collect();
    assert!(tcp.batch_raw(&mut reqs).iter().all(|r| r.is_ok()));
    let mut got = vec![0u8; 4096];
    tcp.read_raw(&ep, region.addr() + 4096, &mut [&mut got])
        .expect("raw read");
    assert_eq!(got, blocks.concat());
    assert_eq!(server.stats().writes, 1 + 6 + u64::from(shm.uses_shm(&t)));
}
