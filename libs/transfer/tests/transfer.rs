//! Real sockets on 127.0.0.1 port 0 and real memfds: every data-path behaviour the rest of
//! lunakv relies on.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lunakv_transfer::wire::{self, Op, Request, Response, Status};
use lunakv_transfer::{
    ConnLimits, SegmentServer, SegmentServerConfig, Target, TransferEngine, TransferError,
    TransferOptions, TransferRequest, host_id,
};

const SEG: u64 = 16 << 20;

struct Fixture {
    server: SegmentServer,
    target: Target,
    _dir: tempfile::TempDir,
    sock: PathBuf,
}

fn server_with(size: u64, shm: bool) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("seg.sock");
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size,
        shm_socket: shm.then(|| sock.clone()),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let target = Target::from(&server.info());
    Fixture {
        server,
        target,
        _dir: dir,
        sock,
    }
}

fn server() -> Fixture {
    server_with(SEG, true)
}

fn tcp_engine() -> TransferEngine {
    TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    })
}

/// An shm engine, or None when the environment forces tcp (LUNAKV_DISABLE_SHM=1).
fn shm_engine(t: &Target) -> Option<TransferEngine> {
    let e = TransferEngine::new(TransferOptions::default());
    if !e.uses_shm(t) {
        eprintln!("shm disabled by the environment; skipping the shm half of this test");
        return None;
    }
    Some(e)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read_vec(
    e: &TransferEngine,
    t: &Target,
    generation: u64,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>, TransferError> {
    let mut buf = vec![0u8; len];
    e.read(t, generation, offset, &mut [&mut buf[..]])?;
    Ok(buf)
}

fn raw_req(
    op: Op,
    generation: u64,
    offset: u64,
    len: u64,
    key_len: u32,
    aux: u32,
) -> [u8; wire::REQ_LEN] {
    Request {
        op,
        generation,
        offset,
        len,
        key_len,
        aux,
    }
    .encode()
}

fn read_resp(r: &mut impl Read) -> Response {
    let mut hdr = [0u8; wire::RESP_LEN];
    r.read_exact(&mut hdr).unwrap();
    let resp = Response::decode(&hdr).unwrap();
    let mut rest = vec![0u8; resp.len as usize];
    r.read_exact(&mut rest).unwrap();
    resp
}

/// True if the peer closed the connection (EOF or reset) within 5 s.
fn closed_by_peer(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 64];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn tcp_write_read_round_trip() {
    let f = server();
    let e = tcp_engine();
    assert!(!e.uses_shm(&f.target));
    let data = pattern(1 << 20, 7);
    e.write(&f.target, 42, "k1", 4096, &[&data]).unwrap();
    assert_eq!(read_vec(&e, &f.target, 42, 4096, data.len()).unwrap(), data);
    let st = f.server.stats();
    assert_eq!((st.writes, st.reads, st.entries), (1, 1, 1));
    assert_eq!(st.bytes_written, data.len() as u64);
    assert_eq!(st.bytes_read, data.len() as u64);
    assert_eq!(st.used_bytes, data.len() as u64);
    // Wrong generation or wrong length are stale, never other bytes.
    assert!(matches!(
        read_vec(&e, &f.target, 43, 4096, data.len()),
        Err(TransferError::Stale { generation: 43 })
    ));
    assert!(matches!(
        read_vec(&e, &f.target, 42, 4096, 100),
        Err(TransferError::Stale { .. })
    ));
}

#[test]
fn shm_write_read_round_trip_shares_bytes_with_tcp() {
    let f = server();
    let Some(shm) = shm_engine(&f.target) else {
        return;
    };
    let tcp = tcp_engine();
    let data = pattern(300_000, 3);
    shm.write(&f.target, 7, "shm-key", 0, &[&data]).unwrap();
    // Written by memcpy into the mapped memfd, committed over the unix socket: tcp sees it.
    assert_eq!(read_vec(&tcp, &f.target, 7, 0, data.len()).unwrap(), data);
    let other = pattern(1000, 9);
    tcp.write(&f.target, 8, "tcp-key", 1 << 20, &[&other])
        .unwrap();
    assert_eq!(
        read_vec(&shm, &f.target, 8, 1 << 20, other.len()).unwrap(),
        other
    );
    assert!(matches!(
        read_vec(&shm, &f.target, 99, 0, 10),
        Err(TransferError::Stale { generation: 99 })
    ));
    let st = f.server.stats();
    assert_eq!((st.writes, st.reads), (2, 2));
    // The shm engine mapped the segment once and reused the mapping; tcp never attaches.
    assert_eq!(st.shm_attaches, 1);
    assert_eq!(f.server.inventory().len(), 2);
}

#[test]
fn scatter_gather_pieces_both_transports() {
    let f = server();
    let mut engines = vec![tcp_engine()];
    engines.extend(shm_engine(&f.target));
    for (n, e) in engines.iter().enumerate() {
        // 40 "layers" of uneven sizes written as pieces, read back split differently.
        let layers: Vec<Vec<u8>> = (0..40).map(|i| pattern(1000 + i * 37, i as u8)).collect();
        let src: Vec<&[u8]> = layers.iter().map(|l| l.as_slice()).collect();
        let whole: Vec<u8> = layers.concat();
        let offset = n as u64 * (1 << 20);
        e.write(&f.target, 100 + n as u64, "sg", offset, &src)
            .unwrap();
        let mut a = vec![0u8; 17];
        let mut b = vec![0u8; whole.len() - 17 - 5000];
        let mut c = vec![0u8; 5000];
        e.read(
            &f.target,
            100 + n as u64,
            offset,
            &mut [&mut a, &mut b, &mut c],
        )
        .unwrap();
        assert_eq!([a, b, c].concat(), whole);
    }
}

#[test]
fn batch_of_32_across_two_servers() {
    let f1 = server();
    let f2 = server();
    let e = tcp_engine();
    let objs: Vec<Vec<u8>> = (0..32)
        .map(|i| pattern(64 * 1024 + i * 100, i as u8))
        .collect();
    let keys: Vec<String> = (0..32).map(|i| format!("obj-{i}")).collect();
    let target = |i: usize| {
        if i.is_multiple_of(2) {
            &f1.target
        } else {
            &f2.target
        }
    };
    let offset = |i: usize| (i as u64 / 2) * (128 * 1024);
    let mut writes: Vec<TransferRequest<'_>> = (0..32)
        .map(|i| TransferRequest::Write {
            target: target(i),
            generation: 1000 + i as u64,
            key: &keys[i],
            offset: offset(i),
            src: vec![&objs[i][..10], &objs[i][10..]],
        })
        .collect();
    for r in e.batch(&mut writes) {
        r.unwrap();
    }
    assert_eq!(f1.server.inventory().len(), 16);
    assert_eq!(f2.server.inventory().len(), 16);

    let mut bufs: Vec<Vec<u8>> = objs.iter().map(|o| vec![0u8; o.len()]).collect();
    let mut stale_buf = [0u8; 10];
    {
        let mut reads: Vec<TransferRequest<'_>> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| TransferRequest::Read {
                target: target(i),
                generation: 1000 + i as u64,
                offset: offset(i),
                dst: vec![&mut b[..]],
            })
            .collect();
        // One stale request in the middle must fail alone, in its own slot.
        reads.insert(
            5,
            TransferRequest::Read {
                target: &f1.target,
                generation: 5,
                offset: 0,
                dst: vec![&mut stale_buf[..]],
            },
        );
        let results = e.batch(&mut reads);
        assert_eq!(results.len(), 33);
        for (i, r) in results.iter().enumerate() {
            if i == 5 {
                assert!(
                    matches!(r, Err(TransferError::Stale { generation: 5 })),
                    "{r:?}"
                );
            } else {
                assert!(r.is_ok(), "request {i}: {r:?}");
            }
        }
    }
    assert_eq!(bufs, objs);
    assert_eq!(f1.server.stats().reads + f2.server.stats().reads, 32);
}

#[test]
fn batch_over_shm_round_trips() {
    let f = server();
    let Some(e) = shm_engine(&f.target) else {
        return;
    };
    let objs: Vec<Vec<u8>> = (0..8).map(|i| pattern(200_000, i as u8)).collect();
    let mut w: Vec<TransferRequest<'_>> = objs
        .iter()
        .enumerate()
        .map(|(i, o)| TransferRequest::Write {
            target: &f.target,
            generation: i as u64 + 1,
            key: "k",
            offset: i as u64 * 200_000,
            src: vec![o],
        })
        .collect();
    assert!(e.batch(&mut w).iter().all(|r| r.is_ok()));
    let mut bufs = vec![vec![0u8; 200_000]; 8];
    let mut r: Vec<TransferRequest<'_>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| TransferRequest::Read {
            target: &f.target,
            generation: i as u64 + 1,
            offset: i as u64 * 200_000,
            dst: vec![b],
        })
        .collect();
    assert!(e.batch(&mut r).iter().all(|r| r.is_ok()));
    drop(r);
    assert_eq!(bufs, objs);
}

/// A host batch over shm larger than the pipeline window (32): its PINs and COMMITs go out a
/// window at a time with the answers read in order. Every object lands; a read of a generation
/// that was never written fails alone; a read of a write that failed (out of bounds) too.
#[test]
fn shm_batch_larger_than_the_pipeline_window_answers_each_request() {
    let f = server();
    let Some(e) = shm_engine(&f.target) else {
        return;
    };
    let n = 75usize;
    let objs: Vec<Vec<u8>> = (0..n).map(|i| pattern(4000 + i, i as u8)).collect();
    let at = |i: usize| i as u64 * 8192;
    let mut w: Vec<TransferRequest<'_>> = objs
        .iter()
        .enumerate()
        .map(|(i, o)| TransferRequest::Write {
            target: &f.target,
            generation: 100 + i as u64,
            key: "k",
            // One write past the segment's end, refused alone.
            offset: if i == 40 { SEG } else { at(i) },
            src: vec![&o[..100], &o[100..]],
        })
        .collect();
    let res = e.batch(&mut w);
    drop(w);
    for (i, r) in res.iter().enumerate() {
        assert_eq!(r.is_ok(), i != 40, "write {i}: {r:?}");
    }
    let mut bufs: Vec<Vec<u8>> = objs.iter().map(|o| vec![0u8; o.len()]).collect();
    let mut r: Vec<TransferRequest<'_>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| TransferRequest::Read {
            target: &f.target,
            generation: if i == 7 { 9_999 } else { 100 + i as u64 },
            offset: at(i),
            dst: vec![b],
        })
        .collect();
    let res = e.batch(&mut r);
    drop(r);
    for (i, r) in res.iter().enumerate() {
        assert_eq!(r.is_ok(), i != 7 && i != 40, "read {i}: {r:?}");
    }
    for i in (0..n).filter(|&i| i != 7 && i != 40) {
        assert_eq!(bufs[i], objs[i], "object {i}");
    }
}

#[test]
fn stale_after_free() {
    let f = server();
    let e = tcp_engine();
    let data = pattern(5000, 1);
    e.write(&f.target, 1, "a", 0, &[&data]).unwrap();
    e.write(&f.target, 2, "b", 8192, &[&data]).unwrap();
    e.free(&f.target.endpoint, &[(1, 0)], Duration::from_secs(1))
        .unwrap();
    assert!(matches!(
        read_vec(&e, &f.target, 1, 0, 5000),
        Err(TransferError::Stale { generation: 1 })
    ));
    assert_eq!(read_vec(&e, &f.target, 2, 8192, 5000).unwrap(), data);
    // Freeing something unknown, or with a mismatched offset, is a harmless no-op.
    e.free(
        &f.target.endpoint,
        &[(77, 0), (2, 0)],
        Duration::from_secs(1),
    )
    .unwrap();
    assert_eq!(read_vec(&e, &f.target, 2, 8192, 5000).unwrap(), data);
    let inv = f.server.inventory();
    assert_eq!(inv.len(), 1);
    assert_eq!(inv[0].key, "b");
    assert_eq!(f.server.stats().used_bytes, 5000);
}

#[test]
fn pipelined_requests_get_their_answers_in_order_whatever_follows_them() {
    let f = server();
    let e = tcp_engine();
    let (a, b) = (pattern(4096, 3), pattern(4096, 4));
    e.write(&f.target, 20, "a", 0, &[&a]).unwrap();
    e.write(&f.target, 21, "b", 8192, &[&b]).unwrap();
    let mut s = UnixStream::connect(&f.sock).unwrap();
    // A hang (an answer held back for good) fails here instead of stalling the suite.
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let frames = |reqs: &[[u8; wire::REQ_LEN]]| reqs.concat();

    // Two PINs, a stale PIN, and an UNPIN (no answer) last, in one write: the owner holds
    // answers while requests are buffered, and must still send them when the last request
    // it reads answers nothing.
    s.write_all(&frames(&[
        raw_req(Op::Pin, 20, 0, 4096, 0, 0),
        raw_req(Op::Pin, 99, 4096, 4096, 0, 0),
        raw_req(Op::Pin, 21, 8192, 4096, 0, 0),
        raw_req(Op::Unpin, 20, 0, 4096, 0, 0),
    ]))
    .unwrap();
    let got: Vec<Status> = (0..3).map(|_| read_resp(&mut s).status).collect();
    assert_eq!(got, vec![Status::Ok, Status::Stale, Status::Ok]);

    // A held answer goes out before the answer of a request that writes its own (a READ's
    // bytes): the PIN's header comes first, then the READ's header and body.
    s.write_all(&frames(&[
        raw_req(Op::Unpin, 21, 8192, 4096, 0, 0),
        raw_req(Op::Pin, 20, 0, 4096, 0, 0),
        raw_req(Op::Read, 21, 8192, 4096, 0, 0),
        raw_req(Op::Unpin, 20, 0, 4096, 0, 0),
    ]))
    .unwrap();
    let pin = read_resp(&mut s);
    assert_eq!(
        (pin.status, pin.len),
        (Status::Ok, 0),
        "the PIN's answer first"
    );
    let mut hdr = [0u8; wire::RESP_LEN];
    s.read_exact(&mut hdr).unwrap();
    let read = Response::decode(&hdr).unwrap();
    assert_eq!((read.status, read.len), (Status::Ok, 4096));
    let mut body = vec![0u8; 4096];
    s.read_exact(&mut body).unwrap();
    assert_eq!(body, b);
    // Every pin was released: a FREE of both returns at once.
    e.free(
        &f.target.endpoint,
        &[(20, 0), (21, 8192)],
        Duration::from_secs(2),
    )
    .unwrap();
}

#[test]
fn free_waits_for_a_pinned_shm_read_and_dead_connections_release_pins() {
    let f = server();
    let e = tcp_engine();
    let data = pattern(4096, 2);
    e.write(&f.target, 10, "pinned", 0, &[&data]).unwrap();
    e.write(&f.target, 11, "pinned2", 8192, &[&data]).unwrap();

    // A same-host reader pins entry 10 and holds it, as during its memcpy.
    let mut s = UnixStream::connect(&f.sock).unwrap();
    s.write_all(&raw_req(Op::Pin, 10, 0, 4096, 0, 0)).unwrap();
    assert_eq!(read_resp(&mut s).status, Status::Ok);

    // A short FREE budget times out while the pin is held (entry is dropped regardless).
    let t0 = Instant::now();
    let r = e.free(&f.target.endpoint, &[(10, 0)], Duration::from_millis(200));
    assert!(matches!(r, Err(TransferError::Timeout)), "{r:?}");
    assert!(t0.elapsed() >= Duration::from_millis(200));
    assert!(matches!(
        read_vec(&e, &f.target, 10, 0, 4096),
        Err(TransferError::Stale { .. })
    ));

    // Pin 11, start a FREE, check it blocks until UNPIN.
    s.write_all(&raw_req(Op::Pin, 11, 8192, 4096, 0, 0))
        .unwrap();
    assert_eq!(read_resp(&mut s).status, Status::Ok);
    let ep = f.target.endpoint.clone();
    let freer = std::thread::spawn(move || {
        let e = tcp_engine();
        let r = e.free(&ep, &[(11, 8192)], Duration::from_secs(10));
        (r, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !freer.is_finished(),
        "FREE returned while a reader held a pin"
    );
    let unpinned_at = Instant::now();
    s.write_all(&raw_req(Op::Unpin, 11, 8192, 4096, 0, 0))
        .unwrap();
    let (r, done_at) = freer.join().unwrap();
    r.unwrap();
    assert!(
        done_at >= unpinned_at,
        "FREE acked before the pin was released"
    );

    // A reader that dies while pinned does not block FREE.
    e.write(&f.target, 12, "pinned3", 16384, &[&data]).unwrap();
    let mut s2 = UnixStream::connect(&f.sock).unwrap();
    s2.write_all(&raw_req(Op::Pin, 12, 16384, 4096, 0, 0))
        .unwrap();
    assert_eq!(read_resp(&mut s2).status, Status::Ok);
    drop(s2);
    e.free(&f.target.endpoint, &[(12, 16384)], Duration::from_secs(5))
        .unwrap();
    assert!(f.server.inventory().is_empty());
}

#[test]
fn overwrite_of_a_range_removes_the_old_entry() {
    let f = server();
    let e = tcp_engine();
    let old = pattern(100, 1);
    let new = pattern(100, 2);
    e.write(&f.target, 1, "old", 0, &[&old]).unwrap();
    e.write(&f.target, 2, "neighbour", 200, &[&old]).unwrap();
    e.write(&f.target, 3, "new", 50, &[&new]).unwrap(); // overlaps [0,100) only
    assert!(matches!(
        read_vec(&e, &f.target, 1, 0, 100),
        Err(TransferError::Stale { generation: 1 })
    ));
    assert_eq!(read_vec(&e, &f.target, 3, 50, 100).unwrap(), new);
    assert_eq!(read_vec(&e, &f.target, 2, 200, 100).unwrap(), old);
    let gens: Vec<u64> = f.server.inventory().iter().map(|x| x.generation).collect();
    assert_eq!(gens, vec![3, 2]);
    // Overlap from the left edge through a later entry, over shm too.
    if let Some(shm) = shm_engine(&f.target) {
        shm.write(&f.target, 4, "wide", 0, &[&pattern(260, 4)])
            .unwrap();
        let inv = f.server.inventory();
        assert_eq!(inv.len(), 1);
        assert_eq!((inv[0].generation, inv[0].size), (4, 260));
    }
}

#[test]
fn out_of_bounds_is_rejected_client_and_server_side() {
    let f = server_with(1 << 20, true);
    let e = tcp_engine();
    let data = pattern(100, 0);
    let r = e.write(&f.target, 1, "k", (1 << 20) - 50, &[&data]);
    assert!(
        matches!(r, Err(TransferError::OutOfBounds { size, .. }) if size == 1 << 20),
        "{r:?}"
    );
    let r = read_vec(&e, &f.target, 1, u64::MAX - 10, 100);
    assert!(matches!(r, Err(TransferError::OutOfBounds { .. })), "{r:?}");

    // A target that claims a bigger segment gets the owner's refusal, connection still usable.
    let liar = Target {
        size: 1 << 30,
        ..f.target.clone()
    };
    let r = e.write(&liar, 1, "k", (1 << 20) - 50, &[&data]);
    assert!(
        matches!(r, Err(TransferError::OutOfBounds { size, .. }) if size == 1 << 20),
        "{r:?}"
    );
    let r = read_vec(&e, &liar, 1, 2 << 20, 100);
    assert!(matches!(r, Err(TransferError::OutOfBounds { .. })), "{r:?}");
    if let Some(shm) = shm_engine(&liar) {
        let r = shm.write(&liar, 1, "k", (1 << 20) - 50, &[&data]);
        assert!(matches!(r, Err(TransferError::OutOfBounds { .. })), "{r:?}");
    }
    e.write(&liar, 2, "ok", 0, &[&data]).unwrap();
    assert_eq!(read_vec(&e, &liar, 2, 0, 100).unwrap(), data);
    assert_eq!(f.server.inventory().len(), 1);

    // Raw overflowing READ over the wire.
    let mut s = TcpStream::connect(f.server.local_addr()).unwrap();
    s.write_all(&raw_req(Op::Read, 2, u64::MAX, 2, 0, 0))
        .unwrap();
    let resp = read_resp(&mut s);
    assert_eq!((resp.status, resp.value), (Status::OutOfBounds, 1 << 20));
}

#[test]
fn zero_length_and_long_keys_are_refused() {
    let f = server();
    let e = tcp_engine();
    assert!(matches!(
        e.write(&f.target, 1, "k", 0, &[]),
        Err(TransferError::InvalidArgument(_))
    ));
    let long = "x".repeat(wire::MAX_KEY_LEN + 1);
    assert!(matches!(
        e.write(&f.target, 1, &long, 0, &[b"abc"]),
        Err(TransferError::InvalidArgument(_))
    ));
    // The server refuses a zero-length WRITE frame too, and keeps the connection.
    let mut s = TcpStream::connect(f.server.local_addr()).unwrap();
    s.write_all(&raw_req(Op::Write, 1, 0, 0, 1, 0)).unwrap();
    s.write_all(b"k").unwrap();
    assert_eq!(read_resp(&mut s).status, Status::BadRequest);
    s.write_all(&raw_req(Op::Read, 1, 0, 0, 0, 0)).unwrap();
    assert_eq!(read_resp(&mut s).status, Status::BadRequest);
    assert!(f.server.inventory().is_empty());
}

#[test]
fn garbage_frames_close_only_that_connection() {
    let f = server();
    let e = tcp_engine();
    let data = pattern(70_000, 5);
    e.write(&f.target, 1, "k", 0, &[&data]).unwrap();

    let cases: Vec<Vec<u8>> = vec![
        vec![0xAB; wire::REQ_LEN], // bad magic
        {
            let mut b = raw_req(Op::Read, 1, 0, 1, 0, 0).to_vec();
            b[4] = 200; // bad op
            b
        },
        raw_req(Op::Write, 1, 0, 10, 1 << 30, 0).to_vec(), // absurd key length
        raw_req(Op::Write, 1, 0, u64::MAX / 2, 1, 0).to_vec(), // absurd payload length
        raw_req(Op::Free, 0, 0, 0, u32::MAX, 0).to_vec(),  // absurd FREE count
        raw_req(Op::Attach, 0, 0, 0, 0, 0).to_vec(),       // shm-only op over tcp
    ];
    let mut held = TcpStream::connect(f.server.local_addr()).unwrap();
    for frame in cases {
        let mut s = TcpStream::connect(f.server.local_addr()).unwrap();
        s.write_all(&frame).unwrap();
        let _ = s.write_all(b"k");
        assert!(
            closed_by_peer(&mut s),
            "server kept a connection after {:?}",
            &frame[..8]
        );
    }
    // Other connections, old and new, are still served.
    held.write_all(&raw_req(Op::Read, 1, 0, 70_000, 0, 0))
        .unwrap();
    let mut hdr = [0u8; wire::RESP_LEN];
    held.read_exact(&mut hdr).unwrap();
    assert_eq!(Response::decode(&hdr).unwrap().status, Status::Ok);
    let mut body = vec![0u8; 70_000];
    held.read_exact(&mut body).unwrap();
    assert_eq!(body, data);
    assert_eq!(read_vec(&e, &f.target, 1, 0, data.len()).unwrap(), data);
}

#[test]
fn truncated_frames_commit_nothing() {
    let f = server();
    // Half a header, then close.
    let mut s = TcpStream::connect(f.server.local_addr()).unwrap();
    s.write_all(&raw_req(Op::Read, 1, 0, 10, 0, 0)[..20])
        .unwrap();
    drop(s);
    // A WRITE that promises 1000 bytes and sends 10.
    let mut s = TcpStream::connect(f.server.local_addr()).unwrap();
    s.write_all(&raw_req(Op::Write, 9, 0, 1000, 3, 0)).unwrap();
    s.write_all(b"key0123456789").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(closed_by_peer(&mut s));
    drop(s);
    std::thread::sleep(Duration::from_millis(50));
    assert!(f.server.inventory().is_empty());
    assert_eq!(f.server.stats().writes, 0);
    // The server still serves.
    let e = tcp_engine();
    e.write(&f.target, 9, "key", 0, &[b"fine"]).unwrap();
    assert_eq!(read_vec(&e, &f.target, 9, 0, 4).unwrap(), b"fine");
}

#[test]
fn inventory_lists_committed_entries() {
    let f = server();
    let e = tcp_engine();
    e.write(&f.target, (7 << 32) | 3, "c", 300, &[&[3u8; 30]])
        .unwrap();
    e.write(&f.target, (7 << 32) | 1, "a", 0, &[&[1u8; 10]])
        .unwrap();
    e.write(&f.target, (7 << 32) | 2, "b/with/slash", 100, &[&[2u8; 20]])
        .unwrap();
    let inv = f.server.inventory();
    let got: Vec<(String, u64, u64, u64)> = inv
        .into_iter()
        .map(|x| (x.key, x.offset, x.size, x.generation))
        .collect();
    assert_eq!(
        got,
        vec![
            ("a".to_string(), 0, 10, (7 << 32) | 1),
            ("b/with/slash".to_string(), 100, 20, (7 << 32) | 2),
            ("c".to_string(), 300, 30, (7 << 32) | 3),
        ]
    );
    assert_eq!(f.server.stats().used_bytes, 60);
}

#[test]
fn touched_keys_are_distinct_and_drained() {
    let f = server();
    let e = tcp_engine();
    for (g, k) in [(1u64, "a"), (2, "b"), (3, "c")] {
        e.write(&f.target, g, k, g * 100, &[&[g as u8; 10]])
            .unwrap();
    }
    assert!(
        f.server.take_touched_keys(10).is_empty(),
        "writes are not reads"
    );
    read_vec(&e, &f.target, 1, 100, 10).unwrap();
    read_vec(&e, &f.target, 1, 100, 10).unwrap();
    read_vec(&e, &f.target, 2, 200, 10).unwrap();
    let _ = read_vec(&e, &f.target, 3, 300, 5); // stale (wrong len): not a read
    let first = f.server.take_touched_keys(1);
    assert_eq!(first.len(), 1);
    let mut all = first;
    all.extend(f.server.take_touched_keys(10));
    all.sort();
    assert_eq!(all, vec!["a".to_string(), "b".to_string()]);
    assert!(f.server.take_touched_keys(10).is_empty());
}

#[test]
fn listener_binds_only_the_configured_address() {
    let f = server_with(1 << 20, false);
    let addr = f.server.local_addr();
    assert_eq!(addr.ip().to_string(), "127.0.0.1");
    assert_ne!(addr.port(), 0);
    let info = f.server.info();
    assert_eq!(info.transfer_endpoint, format!("127.0.0.1:{}", addr.port()));
    assert_eq!(info.name, info.transfer_endpoint);
    assert_eq!(info.host_id, host_id());
    assert_eq!(info.shm_socket, None);
    // 127.0.0.2 is also loopback on Linux: a 0.0.0.0 listener would accept there.
    let other: SocketAddr = format!("127.0.0.2:{}", addr.port()).parse().unwrap();
    assert!(TcpStream::connect_timeout(&other, Duration::from_secs(2)).is_err());
    assert!(TcpStream::connect(addr).is_ok());

    let adv = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 4096,
        shm_socket: None,
        advertise_host: Some("node-a".into()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(
        adv.info().transfer_endpoint,
        format!("node-a:{}", adv.local_addr().port())
    );
}

#[test]
fn shm_chosen_only_for_same_host_with_a_socket() {
    let f = server();
    let e = TransferEngine::new(TransferOptions::default());
    let remote = Target {
        host_id: "other-boot@other-host".into(),
        ..f.target.clone()
    };
    assert!(!e.uses_shm(&remote));
    let no_sock = Target {
        shm_socket: None,
        ..f.target.clone()
    };
    assert!(!e.uses_shm(&no_sock));
    assert!(!tcp_engine().uses_shm(&f.target));
    // A bogus socket path falls back to tcp instead of failing the get.
    if e.uses_shm(&f.target) {
        let broken = Target {
            shm_socket: Some("/nonexistent/lunakv.sock".into()),
            ..f.target.clone()
        };
        e.write(&broken, 1, "k", 0, &[b"via tcp"]).unwrap();
        assert!(!e.uses_shm(&broken));
        assert_eq!(read_vec(&e, &f.target, 1, 0, 7).unwrap(), b"via tcp");
    }
}

#[test]
fn shutdown_stops_serving_and_reconnect_after_restart_works() {
    let f = server();
    let e = tcp_engine();
    e.write(&f.target, 1, "k", 0, &[b"abc"]).unwrap();
    let addr = f.server.local_addr();
    f.server.shutdown();
    assert!(TcpStream::connect(addr).is_err());
    assert!(!f.sock.exists(), "shm socket file removed");
    assert!(read_vec(&e, &f.target, 1, 0, 3).is_err());

    // A new owner on the same port: the engine's pooled (dead) connection is replaced.
    let again = SegmentServer::start(SegmentServerConfig {
        bind: addr,
        size: SEG,
        shm_socket: Some(f.sock.clone()),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    e.write(&f.target, 2, "k2", 0, &[b"xyz"]).unwrap();
    assert_eq!(read_vec(&e, &f.target, 2, 0, 3).unwrap(), b"xyz");
    drop(again);
}

#[test]
fn shm_reattaches_after_owner_restart() {
    let f = server();
    let Some(e) = shm_engine(&f.target) else {
        return;
    };
    e.write(&f.target, 1, "k", 0, &[b"first"]).unwrap();
    let addr = f.server.local_addr();
    f.server.shutdown();
    let again = SegmentServer::start(SegmentServerConfig {
        bind: addr,
        size: SEG,
        shm_socket: Some(f.sock.clone()),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    // The old mapping belongs to the dead owner; the write must land in the new memfd.
    e.write(&f.target, 2, "k", 0, &[b"second"]).unwrap();
    assert_eq!(
        read_vec(&tcp_engine(), &f.target, 2, 0, 6).unwrap(),
        b"second"
    );
    assert_eq!(again.inventory().len(), 1);
}

/// Two segments on one host, and the socket path the master named for one of them now leads
/// to the other (another stack's store took the path over). Before identities, the requester
/// mapped whatever answered: its get returned the other segment's bytes with rc=0, and its put
/// landed in the other memfd. Now the ATTACH answer must carry the instance id the master
/// named; anything else is refused and the transfer goes over tcp to the right owner.
#[test]
fn shm_never_maps_a_segment_other_than_the_one_the_master_named() {
    let ours = server();
    let theirs = server();
    let Some(e) = shm_engine(&ours.target) else {
        return;
    };
    let mine = pattern(4096, 1);
    let foreign = pattern(4096, 2);
    // Same generation and offset in both: what two fresh clusters used to hand out.
    tcp_engine()
        .write(&ours.target, 4_294_967_297, "victim", 0, &[&mine])
        .unwrap();
    tcp_engine()
        .write(&theirs.target, 4_294_967_297, "victim", 0, &[&foreign])
        .unwrap();
    std::fs::rename(&theirs.sock, &ours.sock).unwrap();

    assert_eq!(
        read_vec(&e, &ours.target, 4_294_967_297, 0, 4096).unwrap(),
        mine,
        "a get through a hijacked socket path returned another segment's bytes"
    );
    e.write(&ours.target, 7, "after", 8192, &[b"mine"]).unwrap();
    assert!(
        !e.uses_shm(&ours.target),
        "the refused path is remembered and tcp used"
    );
    assert_eq!(
        read_vec(&tcp_engine(), &ours.target, 7, 8192, 4).unwrap(),
        b"mine"
    );
    assert!(
        matches!(
            read_vec(&tcp_engine(), &theirs.target, 7, 8192, 4),
            Err(TransferError::Stale { .. })
        ),
        "the put landed in the other segment"
    );
    assert_eq!(
        theirs.server.stats().shm_attaches,
        1,
        "only the refused probe"
    );
}

/// A store starting on a socket path that a live store serves refuses, naming that process,
/// instead of unlinking it (which silently redirected the first store's requesters).
#[test]
fn a_live_shm_socket_is_never_unlinked() {
    let first = server();
    let err = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        shm_socket: Some(first.sock.clone()),
        advertise_host: None,
        ..Default::default()
    })
    .err()
    .expect("a second server on a live socket path");
    let msg = err.to_string();
    assert!(
        matches!(err, TransferError::ShmSocketInUse { .. })
            && msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
    // The first one still serves its requesters over shm.
    if let Some(e) = shm_engine(&first.target) {
        e.write(&first.target, 1, "k", 0, &[b"still mine"]).unwrap();
        assert_eq!(
            read_vec(&e, &first.target, 1, 0, 10).unwrap(),
            b"still mine"
        );
    }
    // A leftover file nobody listens on is replaced.
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        shm_socket: Some(stale),
        advertise_host: None,
        ..Default::default()
    })
    .expect("a stale socket file is replaced");
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn pooled_connections_closed_by_the_idle_timeout_reconnect_without_an_error() {
    let server = SegmentServer::start(SegmentServerConfig {
        size: SEG,
        limits: ConnLimits {
            idle_timeout: Some(Duration::from_millis(200)),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let t = Target::from(&server.info());
    let e = tcp_engine();
    let idle_out = || wait_for("the idle timeout", || server.conn_stats().open_tcp == 0);
    e.write(&t, 1, "a", 0, &[b"alpha"]).unwrap();
    e.write(&t, 2, "b", 4096, &[b"bravo"]).unwrap();
    // Each call below finds its pooled connection closed by the owner.
    idle_out();
    assert_eq!(read_vec(&e, &t, 1, 0, 5).unwrap(), b"alpha");
    idle_out();
    let (mut a, mut b) = ([0u8; 5], [0u8; 5]);
    let mut reads = vec![
        TransferRequest::Read {
            target: &t,
            generation: 1,
            offset: 0,
            dst: vec![&mut a[..]],
        },
        TransferRequest::Read {
            target: &t,
            generation: 2,
            offset: 4096,
            dst: vec![&mut b[..]],
        },
    ];
    for r in e.batch(&mut reads) {
        r.expect("batch on a connection the owner closed");
    }
    drop(reads);
    assert_eq!((&a, &b), (b"alpha", b"bravo"));
    idle_out();
    e.free(&t.endpoint, &[(1, 0)], Duration::from_secs(1))
        .expect("free on a connection the owner closed");
    // An idle close is quiet: no bad frame.
    assert_eq!(server.conn_stats().bad_frames_total, 0);
}

#[test]
fn connections_over_the_per_peer_cap_are_closed_and_counted() {
    let server = SegmentServer::start(SegmentServerConfig {
        size: SEG,
        limits: ConnLimits {
            max_conns_per_peer: 2,
            idle_timeout: None,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let addr = server.local_addr();
    let conns: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(addr).unwrap()).collect();
    wait_for("3 refusals", || server.conn_stats().refused_total == 3);
    // The zero-length READ probe: every server answers it with BAD_REQUEST.
    let served = conns
        .iter()
        .filter(|s| {
            let mut s: &TcpStream = s;
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut hdr = [0u8; wire::RESP_LEN];
            s.write_all(&Request::bare(Op::Read).encode()).is_ok() && s.read_exact(&mut hdr).is_ok()
        })
        .count();
    assert_eq!(served, 2);
    let st = server.conn_stats();
    assert_eq!((st.open_tcp, st.max_tcp_per_peer), (2, 2));
}
