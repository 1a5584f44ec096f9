//! Device (GPU) pieces on every path of the transfer library, with the test double installed as
//! this test binary's device layer: its "device" memory is `PROT_NONE`, so a path that touched
//! it with the CPU would kill the binary (docs/GPU.md).

use lunakv_transfer::device::{self, MemKind, fake};
use lunakv_transfer::{
    MemoryRegistry, RegionServer, RegionServerConfig, SegmentServer, SegmentServerConfig, Target,
    TransferEngine, TransferOptions, TransferRequest,
};

/// Held by every test of this binary: the double's counters are process-wide, and the tests
/// that assert how many copies a batch made must not count another test's copies.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn double() -> &'static fake::Fake {
    fake::install(false).expect("the test double is this binary's only device layer")
}

/// `len` bytes of fake device memory, freed on drop.
struct Dev {
    addr: usize,
    len: usize,
}

impl Dev {
    fn new(len: usize) -> Dev {
        Dev {
            addr: double().alloc(len).unwrap(),
            len,
        }
    }
    fn piece(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: a slice over device memory, only ever handed to the transfer library, which
        // must not dereference it (that is what these tests check).
        unsafe { std::slice::from_raw_parts((self.addr + off) as *const u8, len) }
    }
    #[allow(clippy::mut_from_ref)]
    fn piece_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: as `piece`; each test takes disjoint ranges.
        unsafe { std::slice::from_raw_parts_mut((self.addr + off) as *mut u8, len) }
    }
    fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        double().read(self.addr + off, len).unwrap()
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = double().free(self.addr);
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8)
        .collect()
}

struct Fx {
    s: SegmentServer,
    t: Target,
    _d: tempfile::TempDir,
}

fn server() -> Fx {
    let dir = tempfile::tempdir().unwrap();
    let s = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 32 << 20,
        shm_socket: Some(dir.path().join("seg.sock")),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let t = Target::from(&s.info());
    Fx { s, t, _d: dir }
}

/// Writes a 3-piece object (device, host, device; 2.5 MiB + odd: several staging chunks) and
/// reads it back into (host, device) pieces over `e`.
fn round_trip(e: &TransferEngine, t: &Target, g: u64, seed: u8) {
    let (a, b, c) = (1_300_001usize, 777usize, 1_400_003usize);
    let want = pattern(a + b + c, seed);
    let dev = Dev::new(a + c + 64);
    double().write(dev.addr + 1, &want[..a]).unwrap();
    double().write(dev.addr + 1 + a, &want[a + b..]).unwrap();
    let src = [dev.piece(1, a), &want[a..a + b], dev.piece(1 + a, c)];
    e.write(t, g, "k", 4096, &src).unwrap();

    let out = Dev::new(want.len() + 3);
    let mut host = vec![0u8; 1000];
    {
        let mut dst = [&mut host[..], out.piece_mut(3, want.len() - 1000)];
        e.read(t, g, 4096, &mut dst).unwrap();
    }
    assert_eq!(&host[..], &want[..1000]);
    assert_eq!(out.bytes(3, want.len() - 1000), &want[1000..]);
}

#[test]
fn device_pieces_on_the_in_process_shm_and_tcp_paths() {
    let _serial = serial();
    double();
    let fx = server();
    let local = TransferEngine::new(TransferOptions::default());
    local.attach_local(&fx.s);
    let shm = TransferEngine::new(TransferOptions {
        enable_shm: true,
        ..TransferOptions::default()
    });
    let tcp = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    let before = double().stats();
    round_trip(&local, &fx.t, 1, 1);
    let mid = double().stats();
    // In-process: one DMA per device piece, straight into / out of the pinned segment.
    assert_eq!(mid.d2h_copies - before.d2h_copies, 2);
    assert_eq!(mid.h2d_copies - before.h2d_copies, 1);
    assert!(mid.pinned_bytes > 0, "the segment was pinned for DMA");
    assert!(shm.uses_shm(&fx.t));
    round_trip(&shm, &fx.t, 2, 2);
    round_trip(&tcp, &fx.t, 3, 3);
    // What the tcp engine wrote from device memory, read into host memory in-process.
    let mut v = vec![0u8; 1_300_001 + 777 + 1_400_003];
    local.read(&fx.t, 3, 4096, &mut [&mut v[..]]).unwrap();
    assert_eq!(v, pattern(v.len(), 3));
}

#[test]
fn a_batch_of_host_and_device_objects_lands_where_each_belongs() {
    let _serial = serial();
    double();
    let fx = server();
    let e = TransferEngine::new(TransferOptions {
        copy_threads: 2,
        ..TransferOptions::default()
    });
    e.attach_local(&fx.s);
    let n = 3 << 20;
    let dev = Dev::new(4 * n);
    let host: Vec<Vec<u8>> = (0..4).map(|i| pattern(n, 10 + i as u8)).collect();
    for i in [1usize, 3] {
        double().write(dev.addr + i * n, &host[i]).unwrap();
    }
    let keys = ["a", "b", "c", "d"];
    let mut reqs: Vec<TransferRequest<'_>> = (0..4)
        .map(|i| TransferRequest::Write {
            target: &fx.t,
            generation: 100 + i as u64,
            key: keys[i],
            offset: (i * n) as u64,
            src: vec![if i % 2 == 1 {
                dev.piece(i * n, n)
            } else {
                &host[i][..]
            }],
        })
        .collect();
    assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
    drop(reqs);
    let out = Dev::new(4 * n);
    let mut hout = vec![vec![0u8; n]; 4];
    {
        let mut it = hout.iter_mut();
        let mut reqs: Vec<TransferRequest<'_>> = (0..4)
            .map(|i| {
                let h = it.next().unwrap();
                TransferRequest::Read {
                    target: &fx.t,
                    generation: 100 + i as u64,
                    offset: (i * n) as u64,
                    dst: vec![if i % 2 == 0 {
                        out.piece_mut(i * n, n)
                    } else {
                        &mut h[..]
                    }],
                }
            })
            .collect();
        assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
    }
    for i in 0..4 {
        let got = if i % 2 == 0 {
            out.bytes(i * n, n)
        } else {
            hout[i].clone()
        };
        assert_eq!(got, host[i], "object {i}");
    }
}

#[test]
fn raw_regions_on_a_device_are_written_and_read_by_dma() {
    let _serial = serial();
    double();
    let registry = MemoryRegistry::new();
    let server = RegionServer::start(
        RegionServerConfig {
            bind: "127.0.0.1:0".parse().unwrap(),
            advertise_host: None,
        },
        registry.clone(),
    )
    .unwrap();
    let n = 2_500_001;
    let region = Dev::new(n + 10);
    // SAFETY: fake device memory stays allocated until after deregistration below.
    let desc = unsafe { registry.register_raw(region.addr, n + 10) }.unwrap();
    assert_eq!(
        device::kind_of(region.addr + 5, 10),
        MemKind::Device { ordinal: 0 },
        "classified once at registration"
    );
    let e = TransferEngine::new(TransferOptions::default());
    let src_dev = Dev::new(n);
    let want = pattern(n, 42);
    double().write(src_dev.addr, &want).unwrap();
    e.write_raw(server.endpoint(), desc.addr + 7, &[src_dev.piece(0, n)])
        .unwrap();
    assert_eq!(region.bytes(7, n), want);
    let mut host = vec![0u8; n];
    e.read_raw(server.endpoint(), desc.addr + 7, &mut [&mut host[..]])
        .unwrap();
    assert_eq!(host, want);
    assert!(registry.deregister(desc.addr));
    assert_eq!(
        device::kind_of(region.addr + 5, 10),
        MemKind::Device { ordinal: 0 }
    );
}

/// vLLM's MooncakeStoreConnector batch: one tensor per layer shaped (K/V, blocks, block), an
/// object per block made of one piece per layer per K/V, the objects placed back to back. In
/// process and over shm the whole batch moves in one 2D copy per (layer, K/V), not one call per
/// piece, and every byte lands where its piece says.
#[test]
fn a_vllm_shaped_batch_moves_in_one_2d_copy_per_layer_and_kv() {
    let _serial = serial();
    double();
    let fx = server();
    let (layers, blocks, bb, n) = (3usize, 16usize, 4096usize, 8usize);
    let obj = 2 * layers * bb;
    let src: Vec<Dev> = (0..layers).map(|_| Dev::new(2 * blocks * bb)).collect();
    let dst: Vec<Dev> = (0..layers).map(|_| Dev::new(2 * blocks * bb)).collect();
    for (l, t) in src.iter().enumerate() {
        double()
            .write(t.addr, &pattern(2 * blocks * bb, 40 + l as u8))
            .unwrap();
    }
    let pieces = |t: &[Dev], i: usize| -> Vec<usize> {
        t.iter()
            .flat_map(|d| (0..2).map(move |k| (k * blocks + i) * bb + d.addr))
            .collect()
    };
    let keys: Vec<String> = (0..n).map(|i| format!("block{i}")).collect();
    let local = TransferEngine::new(TransferOptions {
        copy_threads: 1,
        ..TransferOptions::default()
    });
    local.attach_local(&fx.s);
    let shm = TransferEngine::new(TransferOptions {
        enable_shm: true,
        copy_threads: 1,
        ..TransferOptions::default()
    });
    for (round, e) in [&local, &shm].into_iter().enumerate() {
        let base = round * n * obj;
        let before = double().stats();
        let mut reqs: Vec<TransferRequest<'_>> = (0..n)
            .map(|i| TransferRequest::Write {
                target: &fx.t,
                generation: 500 + (round * n + i) as u64,
                key: &keys[i],
                offset: (base + i * obj) as u64,
                src: pieces(&src, i)
                    .into_iter()
                    // SAFETY: device addresses, handed only to the transfer library.
                    .map(|a| unsafe { std::slice::from_raw_parts(a as *const u8, bb) })
                    .collect(),
            })
            .collect();
        assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
        drop(reqs);
        let put = double().stats();
        assert_eq!(put.d2h_copies - before.d2h_copies, (n * 2 * layers) as u64);
        assert_eq!(
            put.copies_2d - before.copies_2d,
            (2 * layers) as u64,
            "path {round}"
        );
        let mut reqs: Vec<TransferRequest<'_>> = (0..n)
            .map(|i| TransferRequest::Read {
                target: &fx.t,
                generation: 500 + (round * n + i) as u64,
                offset: (base + i * obj) as u64,
                dst: pieces(&dst, i)
                    .into_iter()
                    // SAFETY: as above; the pieces are disjoint.
                    .map(|a| unsafe { std::slice::from_raw_parts_mut(a as *mut u8, bb) })
                    .collect(),
            })
            .collect();
        assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
        drop(reqs);
        let get = double().stats();
        assert_eq!(
            get.copies_2d - put.copies_2d,
            (2 * layers) as u64,
            "path {round}"
        );
        for (l, t) in dst.iter().enumerate() {
            let want = pattern(2 * blocks * bb, 40 + l as u8);
            for k in 0..2 {
                let at = k * blocks * bb;
                assert_eq!(
                    t.bytes(at, n * bb),
                    &want[at..at + n * bb],
                    "path {round} layer {l} kv {k}"
                );
            }
        }
    }
}

/// The H200 refused the embedded owner's 2D copies of a vLLM batch whose objects cross from
/// one 64 MiB pinned granule of the segment to the next. The double refuses that shape too:
/// the run is split (counted in `split_stats`), and every byte still lands, in process and over
/// shm.
#[test]
fn a_batch_across_two_pinned_granules_is_split_and_lands() {
    let _serial = serial();
    double();
    let dir = tempfile::tempdir().unwrap();
    let s = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        // Three granules: each path's batch crosses its own granule boundary.
        size: 136 << 20,
        shm_socket: Some(dir.path().join("seg.sock")),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let t = Target::from(&s.info());
    let (layers, blocks, bb, n) = (2usize, 16usize, 4096usize, 8usize);
    let obj = 2 * layers * bb;
    let src: Vec<Dev> = (0..layers).map(|_| Dev::new(2 * blocks * bb)).collect();
    let dst: Vec<Dev> = (0..layers).map(|_| Dev::new(2 * blocks * bb)).collect();
    for (l, d) in src.iter().enumerate() {
        double()
            .write(d.addr, &pattern(2 * blocks * bb, 90 + l as u8))
            .unwrap();
    }
    let pieces = |ts: &[Dev], i: usize| -> Vec<usize> {
        ts.iter()
            .flat_map(|d| (0..2).map(move |k| (k * blocks + i) * bb + d.addr))
            .collect()
    };
    let keys: Vec<String> = (0..n).map(|i| format!("granule{i}")).collect();
    let local = TransferEngine::new(TransferOptions {
        copy_threads: 1,
        ..TransferOptions::default()
    });
    local.attach_local(&s);
    let shm = TransferEngine::new(TransferOptions {
        enable_shm: true,
        copy_threads: 1,
        ..TransferOptions::default()
    });
    for (round, e) in [&local, &shm].into_iter().enumerate() {
        // Half the objects below a 64 MiB granule boundary, half above.
        let base = ((round + 1) << 26) - (n / 2) * obj;
        let before = (
            double().stats().refused_2d,
            device::split_stats().split_runs,
        );
        let mut reqs: Vec<TransferRequest<'_>> = (0..n)
            .map(|i| TransferRequest::Write {
                target: &t,
                generation: 900 + (round * n + i) as u64,
                key: &keys[i],
                offset: (base + i * obj) as u64,
                src: pieces(&src, i)
                    .into_iter()
                    // SAFETY: device addresses, handed only to the transfer library.
                    .map(|a| unsafe { std::slice::from_raw_parts(a as *const u8, bb) })
                    .collect(),
            })
            .collect();
        assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
        drop(reqs);
        let mut reqs: Vec<TransferRequest<'_>> = (0..n)
            .map(|i| TransferRequest::Read {
                target: &t,
                generation: 900 + (round * n + i) as u64,
                offset: (base + i * obj) as u64,
                dst: pieces(&dst, i)
                    .into_iter()
                    // SAFETY: as above; the pieces are disjoint.
                    .map(|a| unsafe { std::slice::from_raw_parts_mut(a as *mut u8, bb) })
                    .collect(),
            })
            .collect();
        assert!(e.batch(&mut reqs).iter().all(|r| r.is_ok()));
        drop(reqs);
        let after = (
            double().stats().refused_2d,
            device::split_stats().split_runs,
        );
        assert!(after.0 > before.0, "path {round}: no 2D copy was refused");
        assert!(after.1 > before.1, "path {round}: no run was split");
        for (l, d) in dst.iter().enumerate() {
            let want = pattern(2 * blocks * bb, 90 + l as u8);
            for k in 0..2 {
                let at = k * blocks * bb;
                assert_eq!(
                    d.bytes(at, n * bb),
                    &want[at..at + n * bb],
                    "path {round} layer {l} kv {k}"
                );
            }
        }
        for d in &dst {
            double().write(d.addr, &vec![0u8; 2 * blocks * bb]).unwrap();
        }
    }
}

/// More objects than the shm path's pipeline window (32): PINs and COMMITs go out a window at
/// a time, their answers read in order. Every object lands, and one read of a generation that
/// is not there fails alone without breaking the answers of the others.
#[test]
fn an_shm_device_batch_larger_than_the_pipeline_window_lands_whole() {
    let _serial = serial();
    double();
    let fx = server();
    let shm = TransferEngine::new(TransferOptions {
        enable_shm: true,
        ..TransferOptions::default()
    });
    let (n, bb) = (70usize, 4096usize);
    let src = Dev::new(2 * n * bb);
    let dst = Dev::new(2 * n * bb);
    let want = pattern(2 * n * bb, 7);
    double().write(src.addr, &want).unwrap();
    let keys: Vec<String> = (0..n).map(|i| format!("win{i}")).collect();
    let mut reqs: Vec<TransferRequest<'_>> = (0..n)
        .map(|i| TransferRequest::Write {
            target: &fx.t,
            generation: 3000 + i as u64,
            key: &keys[i],
            offset: (i * 2 * bb) as u64,
            src: vec![src.piece(i * bb, bb), src.piece((n + i) * bb, bb)],
        })
        .collect();
    assert!(shm.batch(&mut reqs).iter().all(|r| r.is_ok()));
    drop(reqs);
    let bad = 41;
    let mut reqs: Vec<TransferRequest<'_>> = (0..n)
        .map(|i| TransferRequest::Read {
            target: &fx.t,
            // One generation that was never written: refused by the owner, alone.
            generation: if i == bad { 9999 } else { 3000 + i as u64 },
            offset: (i * 2 * bb) as u64,
            dst: vec![dst.piece_mut(i * bb, bb), dst.piece_mut((n + i) * bb, bb)],
        })
        .collect();
    let res = shm.batch(&mut reqs);
    drop(reqs);
    for (i, r) in res.iter().enumerate() {
        assert_eq!(r.is_ok(), i != bad, "object {i}: {r:?}");
    }
    let got = dst.bytes(0, 2 * n * bb);
    for i in (0..n).filter(|&i| i != bad) {
        for k in 0..2 {
            let at = (k * n + i) * bb;
            assert_eq!(
                &got[at..at + bb],
                &want[at..at + bb],
                "object {i} piece {k}"
            );
        }
    }
}
