//! RDMA: what runs everywhere (the refusal lines, the `RDMA_CONNECT` wire op against a segment
//! that offers no rdma, routing of an engine without rdma), and the data path, which runs only
//! with the `rdma` feature on a host with an RDMA device (soft-RoCE counts): those tests are
//! `#[ignore]`d, run them with `--ignored` there.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use lunakv_transfer::wire::{self, Op, Request, Response, Status};
use lunakv_transfer::{
    RDMA_COMPILED, RdmaDescriptor, Route, SegmentServer, SegmentServerConfig, Target,
    TransferEngine, TransferError, TransferOptions, TransferRequest, rdma_check, rdma_devices,
};

const SEG: u64 = 16 << 20;

fn server() -> SegmentServer {
    SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        shm_socket: None,
        advertise_host: None,
        ..Default::default()
    })
    .unwrap()
}

fn opts() -> TransferOptions {
    TransferOptions {
        enable_shm: false,
        io_timeout: Duration::from_secs(10),
        ..TransferOptions::default()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

/// Why the data-path tests cannot run here, or None when they can.
fn no_device_reason() -> Option<String> {
    if !RDMA_COMPILED {
        return Some("built without the `rdma` feature".into());
    }
    match rdma_devices() {
        Ok(d) if d.is_empty() => Some("ibv_get_device_list returned none".into()),
        Ok(_) => rdma_check().err().map(|e| e.to_string()),
        Err(e) => Some(e.to_string()),
    }
}

/// The data-path tests are `#[ignore]`d (most hosts have no RDMA device); run with
/// `--ignored` they need one, so a missing device fails them with the reason.
macro_rules! need_device {
    () => {
        if let Some(why) = no_device_reason() {
            panic!(
                "no RDMA device: {why}; build with --features rdma on a host with one (soft-RoCE counts)"
            );
        }
    };
}

fn one_line_naming_tcp(e: &TransferError) {
    let msg = e.to_string();
    assert!(matches!(e, TransferError::RdmaUnavailable(_)), "{e:?}");
    assert!(!msg.contains('\n'), "one line: {msg}");
    assert!(msg.starts_with("protocol \"rdma\": "), "{msg}");
    assert!(msg.ends_with("use \"protocol\": \"tcp\""), "{msg}");
}

#[test]
fn without_a_device_rdma_is_refused_in_one_line_naming_tcp() {
    if no_device_reason().is_none() {
        eprintln!("skipped: this host has an RDMA device, so nothing is refused");
        return;
    }
    let e = rdma_check().unwrap_err();
    one_line_naming_tcp(&e);
    if RDMA_COMPILED {
        assert!(e.to_string().contains("no RDMA device found"), "{e}");
    } else {
        assert!(e.to_string().contains("cargo feature `rdma`"), "{e}");
    }
    one_line_naming_tcp(&TransferEngine::with_rdma(opts()).err().unwrap());
    let s = server();
    one_line_naming_tcp(&s.enable_rdma().unwrap_err());
    assert_eq!(
        s.info().rdma,
        None,
        "a refused segment publishes no descriptor"
    );
}

#[test]
fn rdma_connect_to_a_segment_without_rdma_is_refused_and_the_connection_lives_on() {
    let s = server();
    let mut c = TcpStream::connect(s.local_addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let me = RdmaDescriptor {
        device: "rxe0".into(),
        port: 1,
        gid_index: 1,
        gid: [0; 16],
        lid: 0,
        mtu: 3,
        qpn: 17,
        psn: 1,
        rkey: 0,
        addr: 0,
        len: 0,
    }
    .encode();
    let hdr = Request {
        op: Op::RdmaConnect,
        generation: 0,
        offset: 0,
        len: 0,
        key_len: me.len() as u32,
        aux: 0,
    }
    .encode();
    c.write_all(&[&hdr[..], &me].concat()).unwrap();
    let mut r = [0u8; wire::RESP_LEN];
    c.read_exact(&mut r).unwrap();
    let r = Response::decode(&r).unwrap();
    assert_eq!(r.status, Status::BadRequest);
    let mut msg = vec![0u8; r.len as usize];
    c.read_exact(&mut msg).unwrap();
    let msg = String::from_utf8(msg).unwrap();
    assert!(
        msg.contains("not started with protocol \"rdma\"") || msg.contains("no RDMA transport"),
        "{msg}"
    );
    // The connection still serves ordinary requests.
    let read = Request {
        op: Op::Read,
        generation: 1,
        offset: 0,
        len: 1,
        key_len: 0,
        aux: 0,
    }
    .encode();
    c.write_all(&read).unwrap();
    let mut r = [0u8; wire::RESP_LEN];
    c.read_exact(&mut r).unwrap();
    let r = Response::decode(&r).unwrap();
    assert_eq!(r.status, Status::Stale);
    let mut rest = vec![0u8; r.len as usize];
    c.read_exact(&mut rest).unwrap();
    // Refused, so PIN stays a unix-socket-only op: the connection is closed as garbage.
    let pin = Request {
        op: Op::Pin,
        generation: 1,
        offset: 0,
        len: 1,
        key_len: 0,
        aux: 0,
    }
    .encode();
    c.write_all(&pin).unwrap();
    let mut b = [0u8; 1];
    assert!(matches!(c.read(&mut b), Ok(0) | Err(_)));
}

#[test]
fn an_engine_without_rdma_routes_remote_targets_over_tcp() {
    let s = server();
    let t = Target::from(&s.info());
    let e = TransferEngine::new(opts());
    assert!(!e.has_rdma());
    assert_eq!(e.route_for(&t), Route::Tcp);
    let data = pattern(4096, 1);
    e.write(&t, 7, "k", 0, &[&data]).unwrap();
    let mut back = vec![0u8; 4096];
    e.read(&t, 7, 0, &mut [&mut back]).unwrap();
    assert_eq!(back, data);
}

#[test]
#[ignore = "needs an RDMA device (soft-RoCE counts) and --features rdma; run with --ignored"]
fn rdma_data_path_write_read_batch_stale() {
    need_device!();
    let s = server();
    let desc = s.enable_rdma().unwrap();
    assert!(desc.has_region());
    assert_eq!(desc.len, SEG);
    let info = s.info();
    assert_eq!(info.rdma.as_ref(), Some(&desc));
    assert_eq!(RdmaDescriptor::from_hex(&desc.to_hex()).unwrap(), desc);
    let t = Target::from(&info);
    let e = TransferEngine::with_rdma(opts()).unwrap();
    assert_eq!(e.route_for(&t), Route::Rdma);

    // One object in two pieces, read back in three.
    let a = pattern(100_000, 3);
    let b = pattern(28_000, 9);
    e.write(&t, 1, "obj", 4096, &[&a, &b]).unwrap();
    let (mut x, mut y, mut z) = (vec![0u8; 50_000], vec![0u8; 50_000], vec![0u8; 28_000]);
    e.read(&t, 1, 4096, &mut [&mut x, &mut y, &mut z]).unwrap();
    assert_eq!([x, y].concat(), a);
    assert_eq!(z, b);
    assert_eq!(s.stats().writes, 1);
    assert_eq!(s.inventory().len(), 1);

    // A batch: many requests in flight, then the reads.
    let objs: Vec<Vec<u8>> = (0..200).map(|i| pattern(16 << 10, i as u8)).collect();
    let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    let mut reqs: Vec<TransferRequest<'_>> = objs
        .iter()
        .zip(&keys)
        .enumerate()
        .map(|(i, (o, k))| TransferRequest::Write {
            target: &t,
            generation: 100 + i as u64,
            key: k,
            offset: (1 << 20) + (i as u64) * (16 << 10),
            src: vec![o],
        })
        .collect();
    assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
    let mut outs: Vec<Vec<u8>> = (0..200).map(|_| vec![0u8; 16 << 10]).collect();
    let mut reqs: Vec<TransferRequest<'_>> = outs
        .iter_mut()
        .enumerate()
        .map(|(i, o)| TransferRequest::Read {
            target: &t,
            generation: 100 + i as u64,
            offset: (1 << 20) + (i as u64) * (16 << 10),
            dst: vec![o],
        })
        .collect();
    assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
    drop(reqs);
    assert_eq!(outs, objs);

    // Generation checks still hold: a wrong generation is stale, a freed one too.
    let mut buf = vec![0u8; 16 << 10];
    assert!(matches!(
        e.read(&t, 999, 1 << 20, &mut [&mut buf]),
        Err(TransferError::Stale { .. })
    ));
    e.free(&t.endpoint, &[(100, 1 << 20)], Duration::from_secs(5))
        .unwrap();
    assert!(matches!(
        e.read(&t, 100, 1 << 20, &mut [&mut buf]),
        Err(TransferError::Stale { .. })
    ));
    // Bounds are checked before anything is posted.
    assert!(matches!(
        e.read(&t, 1, SEG - 1, &mut [&mut buf]),
        Err(TransferError::OutOfBounds { .. })
    ));
    assert_eq!(e.route_for(&t), Route::Rdma);
}

#[test]
#[ignore = "needs an RDMA device (soft-RoCE counts) and --features rdma; run with --ignored"]
fn rdma_engine_uses_tcp_for_a_peer_without_rdma() {
    need_device!();
    let s = server(); // never enable_rdma()
    let t = Target::from(&s.info());
    let e = TransferEngine::with_rdma(opts()).unwrap();
    let data = pattern(8192, 5);
    e.write(&t, 3, "k", 0, &[&data]).unwrap();
    assert_eq!(e.route_for(&t), Route::Tcp, "remembered: the peer refused");
    let mut back = vec![0u8; 8192];
    e.read(&t, 3, 0, &mut [&mut back]).unwrap();
    assert_eq!(back, data);
}
