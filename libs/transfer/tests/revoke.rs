//! Revoked generations: once the master freed a generation here, a late
//! WRITE or COMMIT of it is refused, and the FREE is acknowledged only after every write of it
//! already in flight ended, so the master never hands a range to a new put while a zombie's
//! bytes can still land in it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lunakv_transfer::wire::{self, Op, Request, Response, Status};
use lunakv_transfer::{
    SegmentServer, SegmentServerConfig, Target, TransferEngine, TransferError, TransferOptions,
};

const SEG: u64 = 16 << 20;

fn server() -> (SegmentServer, Target) {
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        ..Default::default()
    })
    .unwrap();
    let target = Target::from(&server.info());
    (server, target)
}

fn tcp_engine() -> TransferEngine {
    TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    })
}

fn read_resp(r: &mut impl Read) -> (Response, String) {
    let mut hdr = [0u8; wire::RESP_LEN];
    r.read_exact(&mut hdr).unwrap();
    let resp = Response::decode(&hdr).unwrap();
    let mut rest = vec![0u8; resp.len as usize];
    r.read_exact(&mut rest).unwrap();
    (resp, String::from_utf8_lossy(&rest).into_owned())
}

fn is_revoked(r: &Result<(), TransferError>) -> bool {
    matches!(r, Err(TransferError::Refused { message, .. }) if message.contains("put revoked by the master"))
}

#[test]
fn a_write_of_a_generation_freed_before_its_commit_is_refused() {
    let (server, t) = server();
    let e = tcp_engine();
    // The master reclaimed the put of generation 5 at offset 4096 before any byte arrived.
    e.free(&t.endpoint, &[(5, 4096)], Duration::from_secs(1))
        .expect("FREE of an unknown generation is acknowledged");
    let late = e.write(&t, 5, "zombie", 4096, &[&[0xEE; 4096]]);
    assert!(is_revoked(&late), "{late:?}");
    assert!(server.inventory().is_empty(), "nothing committed");
    // Another generation (the range's next owner) writes as before.
    e.write(&t, 6, "victim", 4096, &[&[0x11; 4096]]).unwrap();
    let mut back = vec![0u8; 4096];
    e.read(&t, 6, 4096, &mut [&mut back[..]]).unwrap();
    assert!(back.iter().all(|&b| b == 0x11));
    // A zombie that committed its bytes and never ended its put: the FREE retires the entry,
    // and its capability may not write the generation again into the next owner's range.
    e.write(&t, 7, "zombie2", 0, &[&[0x22; 64]]).unwrap();
    e.free(&t.endpoint, &[(7, 0)], Duration::from_secs(1))
        .unwrap();
    let again = e.write(&t, 7, "zombie2", 0, &[&[0x22; 64]]);
    assert!(is_revoked(&again), "{again:?}");
    // A disk copy's FREE revokes nothing.
    e.free(
        &t.endpoint,
        &[(8, wire::DISK_OFFSET)],
        Duration::from_secs(1),
    )
    .unwrap();
    e.write(&t, 8, "fresh", 8192, &[&[0x33; 64]]).unwrap();
}

#[test]
fn a_free_waits_for_a_write_of_its_generation_in_flight() {
    let (server, t) = server();
    let len = 64 * 1024u64;
    // A WRITE of generation 9 whose bytes trickle in: the header, the key and half the body.
    let mut w = TcpStream::connect(server.local_addr()).unwrap();
    let hdr = Request {
        op: Op::Write,
        generation: 9,
        offset: 0,
        len,
        key_len: 1,
        aux: 0,
    }
    .encode();
    w.write_all(&hdr).unwrap();
    w.write_all(b"z").unwrap();
    w.write_all(&vec![0xEE; (len / 2) as usize]).unwrap();
    // Let the server start copying (the write registers before it reads the body).
    std::thread::sleep(Duration::from_millis(200));

    let (tx, rx) = mpsc::channel();
    let ep = t.endpoint.clone();
    let freer = std::thread::spawn(move || {
        let e = tcp_engine();
        let started = Instant::now();
        let r = e.free(&ep, &[(9, 0)], Duration::from_secs(10));
        tx.send((r.is_ok(), started.elapsed())).unwrap();
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "the FREE was acknowledged while a write of its generation was still arriving"
    );
    w.write_all(&vec![0xEE; (len / 2) as usize]).unwrap();
    w.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (resp, msg) = read_resp(&mut w);
    assert_eq!(resp.status, Status::Refused, "{msg}");
    assert!(msg.contains("put revoked by the master"), "{msg}");
    let (ok, took) = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("FREE answered");
    assert!(ok, "FREE acknowledged once the write ended");
    assert!(took >= Duration::from_millis(400), "{took:?}");
    freer.join().unwrap();
    assert!(
        server.inventory().is_empty(),
        "the revoked write committed nothing"
    );

    // Past its deadline the FREE answers Timeout (not OK) while the write still hangs.
    let mut w = TcpStream::connect(server.local_addr()).unwrap();
    let hdr = Request {
        generation: 10,
        ..Request::decode(&hdr).unwrap()
    }
    .encode();
    w.write_all(&hdr).unwrap();
    w.write_all(b"z").unwrap();
    w.write_all(&[0xEE; 100]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let r = tcp_engine().free(&t.endpoint, &[(10, 0)], Duration::from_millis(200));
    assert!(
        matches!(r, Err(TransferError::Timeout)),
        "not acknowledged while the write hangs: {r:?}"
    );
}
