//! Embedded-mode data path: an engine writing to and reading from a segment server of its own
//! process, through the shm socket (PIN/COMMIT round trips) versus the in-process path
//! (`attach_local`), on fresh (never touched) and warm pages, with and without prefaulting.
//! Batches of 32 objects, each 32 layers x 16 KiB (512 KiB), as vLLM puts them.
//!
//! `cargo run --release -p lunakv-transfer --example local_bench [batches]`

use std::time::{Duration, Instant};

use lunakv_transfer::{
    SegmentServer, SegmentServerConfig, Target, TransferEngine, TransferOptions, TransferRequest,
};

const LAYERS: usize = 32;
const LAYER: usize = 16 << 10;
const OBJ: usize = LAYERS * LAYER;
const BATCH: usize = 32;

struct Row {
    cold_put: Duration,
    warm_put: Duration,
    get: Duration,
}

fn run(mode: &str, batches: usize) -> Row {
    let seg = (batches * BATCH * OBJ) as u64;
    let sock = std::env::temp_dir().join(format!(
        "lunakv-local-bench-{}-{mode}.sock",
        std::process::id()
    ));
    let s = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: seg,
        shm_socket: Some(sock),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let t = Target::from(&s.info());
    let e = TransferEngine::new(TransferOptions::default());
    if mode != "shm" {
        e.attach_local(&s);
    }
    if mode == "local+prefault" {
        s.prefault_in_background(seg).unwrap().join().unwrap();
    }
    let layers: Vec<Vec<u8>> = (0..LAYERS).map(|i| vec![i as u8 + 1; LAYER]).collect();
    let src: Vec<&[u8]> = layers.iter().map(|l| &l[..]).collect();
    let mut dst: Vec<Vec<u8>> = (0..BATCH).map(|_| vec![0u8; OBJ]).collect();
    let mut next_gen = 0u64;
    let put = |t: &Target, b: usize, next_gen: &mut u64| {
        let mut reqs: Vec<TransferRequest<'_>> = (0..BATCH)
            .map(|i| {
                *next_gen += 1;
                TransferRequest::Write {
                    target: t,
                    generation: *next_gen,
                    key: "k",
                    offset: ((b * BATCH + i) * OBJ) as u64,
                    src: src.clone(),
                }
            })
            .collect();
        for r in e.batch(&mut reqs) {
            r.unwrap();
        }
    };
    // Warm up the engine (connections, attachment) on the last batch's range.
    put(&t, batches - 1, &mut next_gen);
    let t0 = Instant::now();
    for b in 0..batches - 1 {
        put(&t, b, &mut next_gen);
    }
    let cold_put = t0.elapsed() / (batches - 1) as u32;
    let t0 = Instant::now();
    for b in 0..batches - 1 {
        put(&t, b, &mut next_gen);
    }
    let warm_put = t0.elapsed() / (batches - 1) as u32;
    // Gets of the last round's generations.
    let first_gen = next_gen - ((batches - 1) * BATCH) as u64;
    let t0 = Instant::now();
    for b in 0..batches - 1 {
        let mut reqs: Vec<TransferRequest<'_>> = dst
            .iter_mut()
            .enumerate()
            .map(|(i, d)| {
                let (a, z) = d.split_at_mut(OBJ / 2);
                TransferRequest::Read {
                    target: &t,
                    generation: first_gen + 1 + (b * BATCH + i) as u64,
                    offset: ((b * BATCH + i) * OBJ) as u64,
                    dst: vec![a, z],
                }
            })
            .collect();
        for r in e.batch(&mut reqs) {
            r.unwrap();
        }
    }
    let get = t0.elapsed() / (batches - 1) as u32;
    assert!(dst.iter().all(|d| d[0] == 1 && d[OBJ - 1] == LAYERS as u8));
    Row {
        cold_put,
        warm_put,
        get,
    }
}

fn main() {
    let batches: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(33);
    let mb = (BATCH * OBJ) as f64 / 1e6;
    println!(
        "batch = {BATCH} objects x {LAYERS} x {} KiB = {mb:.1} MB; {} timed batches per column",
        LAYER >> 10,
        batches - 1
    );
    println!(
        "{:<16} {:>22} {:>22} {:>22}",
        "path", "put fresh pages", "put warm pages", "get"
    );
    for mode in ["shm", "local", "local+prefault"] {
        let r = run(mode, batches);
        let cell = |d: Duration| {
            format!(
                "{:>7.0} us {:>6.2} GB/s",
                d.as_secs_f64() * 1e6,
                mb / 1e3 / d.as_secs_f64()
            )
        };
        println!(
            "{mode:<16} {:>22} {:>22} {:>22}",
            cell(r.cold_put),
            cell(r.warm_put),
            cell(r.get)
        );
    }
}
