//! Raw registered-memory transfers: MemoryRegistry + RegionServer + TransferEngine::*_raw.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use lunakv_transfer::wire::{self, Op, Request, Response, Status};
use lunakv_transfer::{
    MemoryRegistry, RawRequest, RegionServer, RegionServerConfig, TransferEngine, TransferError,
    TransferOptions,
};

fn server() -> (RegionServer, std::sync::Arc<MemoryRegistry>) {
    let reg = MemoryRegistry::new();
    let s = RegionServer::start(
        RegionServerConfig {
            bind: "127.0.0.1:0".parse().unwrap(),
            advertise_host: None,
        },
        reg.clone(),
    )
    .unwrap();
    (s, reg)
}

fn engine() -> TransferEngine {
    TransferEngine::new(TransferOptions::default())
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn write_then_read_raw_round_trips() {
    let (srv, reg) = server();
    let region = reg.alloc(1 << 20).unwrap();
    let e = engine();
    let data = pattern(7, 300_000);
    let at = region.addr() + 4096;
    e.write_raw(srv.endpoint(), at, &[&data[..1000], &data[1000..]])
        .unwrap();
    let mut local = vec![0u8; data.len()];
    region.read_at(4096, &mut local).unwrap();
    assert_eq!(local, data);
    let mut back = vec![0u8; data.len()];
    e.read_raw(srv.endpoint(), at, &mut [&mut back]).unwrap();
    assert_eq!(back, data);
    let st = srv.stats();
    assert_eq!(st.bytes_written, data.len() as u64);
    assert_eq!(st.bytes_read, data.len() as u64);
}

#[test]
fn out_of_region_ranges_are_refused_and_the_connection_survives() {
    let (srv, reg) = server();
    let region = reg.alloc(8192).unwrap();
    let e = engine();
    // Straddles the end of the region.
    let err = e
        .write_raw(srv.endpoint(), region.addr() + 8000, &[&[1u8; 400]])
        .unwrap_err();
    assert!(matches!(err, TransferError::OutOfBounds { .. }), "{err}");
    // Before the region, in unregistered memory.
    let err = e
        .write_raw(
            srv.endpoint(),
            region.addr().wrapping_sub(4096),
            &[&[1u8; 16]],
        )
        .unwrap_err();
    assert!(matches!(err, TransferError::OutOfBounds { .. }), "{err}");
    // Wrapping the address space is refused locally.
    let err = e
        .write_raw(srv.endpoint(), u64::MAX - 2, &[&[1u8; 16]])
        .unwrap_err();
    assert!(matches!(err, TransferError::OutOfBounds { .. }), "{err}");
    // The region is untouched and the pooled connection still works.
    assert!(region.to_vec().iter().all(|&b| b == 0));
    e.write_raw(srv.endpoint(), region.addr(), &[&[9u8; 8192]])
        .unwrap();
    assert!(region.to_vec().iter().all(|&b| b == 9));
    assert_eq!(srv.stats().out_of_bounds, 2);
}

#[test]
fn deregistered_regions_are_refused() {
    let (srv, reg) = server();
    let region = reg.alloc(4096).unwrap();
    let addr = region.addr();
    drop(region);
    assert!(reg.regions().is_empty());
    let err = e_write(&srv, addr);
    assert!(matches!(err, TransferError::OutOfBounds { .. }), "{err}");
}

fn e_write(srv: &RegionServer, addr: u64) -> TransferError {
    engine()
        .write_raw(srv.endpoint(), addr, &[&[1u8; 64]])
        .unwrap_err()
}

#[test]
fn caller_memory_registered_raw() {
    let (srv, reg) = server();
    let mut buf = vec![0u8; 65536];
    // SAFETY: `buf` outlives the registration (deregistered below) and is only read after the
    // write returned.
    let desc = unsafe { reg.register_raw(buf.as_mut_ptr() as usize, buf.len()) }.unwrap();
    // Overlapping registrations are refused.
    let overlap = unsafe { reg.register_raw(buf.as_mut_ptr() as usize + 100, 10) };
    assert!(overlap.is_err());
    engine()
        .write_raw(srv.endpoint(), desc.addr_of(100, 5).unwrap(), &[b"hello"])
        .unwrap();
    assert!(reg.deregister(desc.addr));
    assert_eq!(&buf[100..105], b"hello");
}

#[test]
fn batch_raw_spreads_blocks_over_connections() {
    let (srv, reg) = server();
    let block = 256 * 1024;
    let n = 24;
    let region = reg.alloc(block * n).unwrap();
    let blocks: Vec<Vec<u8>> = (0..n).map(|i| pattern(i as u8, block)).collect();
    let ep = srv.endpoint().to_string();
    let mut reqs: Vec<RawRequest<'_>> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| RawRequest::Write {
            endpoint: &ep,
            remote_addr: region.addr() + (i * block) as u64,
            src: vec![b.as_slice()],
        })
        .collect();
    // One bad request in the middle fails alone.
    reqs.insert(
        5,
        RawRequest::Write {
            endpoint: &ep,
            remote_addr: region.addr() + (block * n) as u64,
            src: vec![&blocks[0][..10]],
        },
    );
    let res = TransferEngine::new(TransferOptions::default()).batch_raw(&mut reqs);
    for (i, r) in res.iter().enumerate() {
        if i == 5 {
            assert!(matches!(r, Err(TransferError::OutOfBounds { .. })), "{r:?}");
        } else {
            assert!(r.is_ok(), "request {i}: {r:?}");
        }
    }
    let got = region.to_vec();
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(&got[i * block..(i + 1) * block], b.as_slice(), "block {i}");
    }
    let mut outs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; block]).collect();
    let mut reads: Vec<RawRequest<'_>> = outs
        .iter_mut()
        .enumerate()
        .map(|(i, o)| RawRequest::Read {
            endpoint: &ep,
            remote_addr: region.addr() + (i * block) as u64,
            dst: vec![o.as_mut_slice()],
        })
        .collect();
    let res = engine().batch_raw(&mut reads);
    assert!(res.iter().all(|r| r.is_ok()));
    drop(reads);
    assert_eq!(outs, blocks);
}

#[test]
fn segment_ops_on_a_region_server_close_only_that_connection() {
    let (srv, _reg) = server();
    let mut s = TcpStream::connect(srv.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hdr = Request {
        op: Op::Read,
        generation: 1,
        offset: 0,
        len: 10,
        key_len: 0,
        aux: 0,
    }
    .encode();
    s.write_all(&hdr).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap_or(0), 0, "connection closed");
    // A zero-length raw op gets BAD_REQUEST, not a close.
    let mut s = TcpStream::connect(srv.local_addr()).unwrap();
    let hdr = Request {
        op: Op::RawWrite,
        generation: 0,
        offset: 0,
        len: 0,
        key_len: 0,
        aux: 0,
    }
    .encode();
    s.write_all(&hdr).unwrap();
    let mut r = [0u8; wire::RESP_LEN];
    s.read_exact(&mut r).unwrap();
    assert_eq!(Response::decode(&r).unwrap().status, Status::BadRequest);
}
