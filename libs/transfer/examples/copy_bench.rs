//! The in-process copy path at vLLM's shape, against memcpy of the same shape.
//!
//! A "KV cache" laid out as vLLM does (one region per layer, 16 KiB blocks in each) is saved into
//! and loaded from an attached segment in batches of 32 objects x 32 layers, through
//! `TransferEngine::batch` with 1 and 2 copy threads. The ceiling is the C library's memcpy of
//! the very same pieces. The cache starts `offset` bytes into a page: numpy's data pointers sit
//! 16 bytes in, torch's at 64-byte alignment, and glibc's memcpy (`rep movsb`) is ~3x slower
//! on AMD Zen when the destination is a few bytes ahead of the source modulo 4 KiB.
//!
//! `cargo run --release -p lunakv-transfer --example copy_bench [rounds]`

use std::time::Instant;

use lunakv_transfer::{
    SegmentServer, SegmentServerConfig, Target, TransferEngine, TransferOptions, TransferRequest,
};

const LAYERS: usize = 32;
const PIECE: usize = 16 << 10;
const OBJ: usize = LAYERS * PIECE;
const BATCH: usize = 32;
const OBJECTS: usize = 512;
const CACHE: usize = OBJECTS * OBJ;

/// Where piece `layer` of object `obj` lives in the cache.
fn at(obj: usize, layer: usize) -> usize {
    layer * OBJECTS * PIECE + obj * PIECE
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let s = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: CACHE as u64,
        shm_socket: None,
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    s.prefault_in_background(CACHE as u64)
        .unwrap()
        .join()
        .unwrap();
    let t = Target::from(&s.info());
    // Warm, page-aligned backing for the caches (+4096 for the offsets).
    let mut src_buf: Vec<u8> = (0..CACHE + 8192)
        .map(|i| (i * 7 + i / 4099) as u8)
        .collect();
    let mut dst_buf = vec![1u8; CACHE + 8192];
    // The ceiling's "segment": page-aligned, like the real one.
    let mut seg_buf = vec![1u8; CACHE + 4096];
    let c = seg_buf.as_ptr() as usize;
    let seg_off = (4096 - c % 4096) % 4096;
    let seg_copy = &mut seg_buf[seg_off..seg_off + CACHE];
    println!(
        "{} objects of {LAYERS} x {} KiB in batches of {BATCH}; GB/s, best of {rounds}",
        OBJECTS,
        PIECE >> 10
    );
    println!(
        "{:>7} {:>22} {:>22} {:>22}",
        "offset", "memcpy put / get", "1 thread put / get", "2 threads put / get"
    );
    let mut generation = 0u64;
    for offset in [0usize, 16, 64] {
        let a = src_buf.as_ptr() as usize;
        let src_off = (4096 - a % 4096) % 4096 + offset;
        let src = &src_buf[src_off..src_off + CACHE];
        let b = dst_buf.as_ptr() as usize;
        let dst_off = (4096 - b % 4096) % 4096 + offset;
        let mut row = vec![];
        // The ceiling: memcpy of the same pieces into / out of a plain buffer.
        let (mut put, mut get) = (f64::MAX, f64::MAX);
        for _ in 0..rounds {
            let t0 = Instant::now();
            for o in 0..OBJECTS {
                for l in 0..LAYERS {
                    let d = o * OBJ + l * PIECE;
                    seg_copy[d..d + PIECE].copy_from_slice(&src[at(o, l)..at(o, l) + PIECE]);
                }
            }
            put = put.min(t0.elapsed().as_secs_f64());
            let dst = &mut dst_buf[dst_off..dst_off + CACHE];
            let t0 = Instant::now();
            for o in 0..OBJECTS {
                for l in 0..LAYERS {
                    let d = o * OBJ + l * PIECE;
                    dst[at(o, l)..at(o, l) + PIECE].copy_from_slice(&seg_copy[d..d + PIECE]);
                }
            }
            get = get.min(t0.elapsed().as_secs_f64());
        }
        row.push((gbps(CACHE, put), gbps(CACHE, get)));
        for threads in [1usize, 2] {
            let e = TransferEngine::new(TransferOptions {
                copy_threads: threads,
                ..TransferOptions::default()
            });
            e.attach_local(&s);
            let (mut put, mut get) = (f64::MAX, f64::MAX);
            for _ in 0..rounds {
                let first = generation;
                let t0 = Instant::now();
                for b in (0..OBJECTS).step_by(BATCH) {
                    let mut reqs: Vec<TransferRequest<'_>> = (b..b + BATCH)
                        .map(|o| {
                            generation += 1;
                            TransferRequest::Write {
                                target: &t,
                                generation,
                                key: "k",
                                offset: (o * OBJ) as u64,
                                src: (0..LAYERS)
                                    .map(|l| &src[at(o, l)..at(o, l) + PIECE])
                                    .collect(),
                            }
                        })
                        .collect();
                    for r in e.batch(&mut reqs) {
                        r.unwrap();
                    }
                }
                put = put.min(t0.elapsed().as_secs_f64());
                let dst = &mut dst_buf[dst_off..dst_off + CACHE];
                let mut layers: Vec<Vec<&mut [u8]>> = (0..OBJECTS).map(|_| Vec::new()).collect();
                for (l, region) in dst.chunks_mut(OBJECTS * PIECE).enumerate() {
                    for (o, piece) in region.chunks_mut(PIECE).enumerate() {
                        debug_assert_eq!(at(o, l) % PIECE, 0);
                        layers[o].push(piece);
                    }
                }
                let t0 = Instant::now();
                let mut objs = layers.into_iter().enumerate();
                loop {
                    let mut reqs: Vec<TransferRequest<'_>> = objs
                        .by_ref()
                        .take(BATCH)
                        .map(|(o, pieces)| TransferRequest::Read {
                            target: &t,
                            generation: first + 1 + o as u64,
                            offset: (o * OBJ) as u64,
                            dst: pieces,
                        })
                        .collect();
                    if reqs.is_empty() {
                        break;
                    }
                    for r in e.batch(&mut reqs) {
                        r.unwrap();
                    }
                }
                get = get.min(t0.elapsed().as_secs_f64());
                assert!(
                    dst_buf[dst_off..dst_off + CACHE] == *src,
                    "loaded bytes differ"
                );
                dst_buf[dst_off..dst_off + CACHE].fill(1);
            }
            row.push((gbps(CACHE, put), gbps(CACHE, get)));
        }
        let cell = |(p, g): (f64, f64)| format!("{p:>9.2} / {g:<9.2}");
        println!(
            "{offset:>7} {:>22} {:>22} {:>22}",
            cell(row[0]),
            cell(row[1]),
            cell(row[2])
        );
    }
    let _ = &mut src_buf;
}
