//! The in-process path (`TransferEngine::attach_local`): same semantics as the socket paths,
//! checked against a second engine that talks tcp to the very same server.

use std::time::Duration;

use lunakv_transfer::{
    SegmentServer, SegmentServerConfig, SegmentStats, Target, TransferEngine, TransferError,
    TransferOptions, TransferRequest,
};

const SEG: u64 = 16 << 20;

/// Field order matters: the server stops (waking its unix accept via the socket file) before
/// the temp dir holding that file is removed.
struct Fx {
    s: SegmentServer,
    t: Target,
    _d: tempfile::TempDir,
}

fn server() -> Fx {
    let dir = tempfile::tempdir().unwrap();
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: SEG,
        shm_socket: Some(dir.path().join("seg.sock")),
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let t = Target::from(&server.info());
    Fx {
        s: server,
        t,
        _d: dir,
    }
}

fn local_engine(s: &SegmentServer) -> TransferEngine {
    let e = TransferEngine::new(TransferOptions::default());
    e.attach_local(s);
    e
}

fn tcp_engine() -> TransferEngine {
    TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    })
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read_vec(
    e: &TransferEngine,
    t: &Target,
    g: u64,
    off: u64,
    len: usize,
) -> Result<Vec<u8>, TransferError> {
    let mut v = vec![0u8; len];
    e.read(t, g, off, &mut [&mut v[..]])?;
    Ok(v)
}

#[test]
fn local_round_trip_scatter_gather_and_shared_with_tcp() {
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    let e = local_engine(s);
    assert!(e.is_local(t));
    let tcp = tcp_engine();
    assert!(!tcp.is_local(t));

    // 32 layers x 16 KiB written locally, read back locally in other piece sizes and over tcp.
    let layers: Vec<Vec<u8>> = (0..32).map(|i| pattern(16 << 10, i)).collect();
    let src: Vec<&[u8]> = layers.iter().map(|l| &l[..]).collect();
    e.write(t, 7, "k", 4096, &src).unwrap();
    let whole = layers.concat();
    let mut a = vec![0u8; 100_000];
    let mut b = vec![0u8; whole.len() - 100_000];
    e.read(t, 7, 4096, &mut [&mut a[..], &mut b[..]]).unwrap();
    assert_eq!([a, b].concat(), whole);
    assert_eq!(read_vec(&tcp, t, 7, 4096, whole.len()).unwrap(), whole);

    // Written over tcp, read locally.
    let v = pattern(3000, 9);
    tcp.write(t, 8, "k2", 1 << 20, &[&v]).unwrap();
    assert_eq!(read_vec(&e, t, 8, 1 << 20, 3000).unwrap(), v);

    let inv = s.inventory();
    assert_eq!(inv.len(), 2);
    assert_eq!((inv[0].key.as_str(), inv[0].generation), ("k", 7));
    assert_eq!(
        s.take_touched_keys(10).len(),
        2,
        "local reads are reported as touched"
    );
}

#[test]
fn local_stats_match_the_socket_paths() {
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    let e = local_engine(s);
    e.write(t, 1, "a", 0, &[&[1u8; 1000]]).unwrap();
    e.write(t, 2, "b", 1000, &[&[2u8; 500], &[3u8; 500]])
        .unwrap();
    read_vec(&e, t, 1, 0, 1000).unwrap();
    // A stale read counts nothing, as on tcp.
    assert!(matches!(
        read_vec(&e, t, 3, 0, 1000),
        Err(TransferError::Stale { generation: 3 })
    ));
    assert_eq!(
        s.stats(),
        SegmentStats {
            bytes_read: 1000,
            bytes_written: 2000,
            reads: 1,
            writes: 2,
            shm_attaches: 0,
            entries: 2,
            used_bytes: 2000,
        }
    );
}

#[test]
fn local_stale_after_free_and_exact_entry_checks() {
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    let e = local_engine(s);
    let v = pattern(4096, 1);
    e.write(t, 11, "x", 8192, &[&v]).unwrap();
    // Wrong offset or length: stale, not a partial read.
    assert!(matches!(
        read_vec(&e, t, 11, 8192, 4095),
        Err(TransferError::Stale { .. })
    ));
    assert!(matches!(
        read_vec(&e, t, 11, 4096, 4096),
        Err(TransferError::Stale { .. })
    ));
    // FREE comes over tcp from the master.
    e.free(&t.endpoint, &[(11, 8192)], Duration::from_secs(1))
        .unwrap();
    assert!(matches!(
        read_vec(&e, t, 11, 8192, 4096),
        Err(TransferError::Stale { generation: 11 })
    ));
    assert_eq!(s.stats().entries, 0);
}

#[test]
fn local_overwrite_invalidates_overlapping_entries() {
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    let e = local_engine(s);
    let tcp = tcp_engine();
    e.write(t, 1, "a", 0, &[&pattern(1000, 1)]).unwrap();
    e.write(t, 2, "b", 1000, &[&pattern(1000, 2)]).unwrap();
    e.write(t, 3, "c", 4000, &[&pattern(1000, 3)]).unwrap();
    // Overlaps the tail of a and the head of b.
    let n = pattern(1000, 4);
    e.write(t, 4, "n", 500, &[&n]).unwrap();
    for g in [1, 2] {
        let off = (g - 1) * 1000;
        assert!(matches!(
            read_vec(&tcp, t, g, off, 1000),
            Err(TransferError::Stale { .. })
        ));
        assert!(matches!(
            read_vec(&e, t, g, off, 1000),
            Err(TransferError::Stale { .. })
        ));
    }
    assert_eq!(read_vec(&e, t, 4, 500, 1000).unwrap(), n);
    assert_eq!(read_vec(&tcp, t, 3, 4000, 1000).unwrap(), pattern(1000, 3));
    // Re-putting a generation elsewhere retires its old entry.
    e.write(t, 3, "c", 8000, &[&pattern(10, 5)]).unwrap();
    assert!(matches!(
        read_vec(&e, t, 3, 4000, 1000),
        Err(TransferError::Stale { .. })
    ));
    let gens: Vec<u64> = s.inventory().iter().map(|x| x.generation).collect();
    assert_eq!(gens, vec![4, 3]);
    assert_eq!(s.stats().used_bytes, 1010);
}

#[test]
fn local_refuses_what_the_server_refuses() {
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    let e = local_engine(s);
    assert!(matches!(
        e.write(t, 1, "k", SEG - 10, &[&[0u8; 11]]),
        Err(TransferError::OutOfBounds { .. })
    ));
    assert!(matches!(
        e.write(t, 1, "k", 0, &[&[]]),
        Err(TransferError::InvalidArgument(_))
    ));
    let long = "k".repeat(lunakv_transfer::wire::MAX_KEY_LEN + 1);
    assert!(matches!(
        e.write(t, 1, &long, 0, &[&[0u8; 4]]),
        Err(TransferError::InvalidArgument(_))
    ));
    assert!(matches!(
        read_vec(&e, t, 1, u64::MAX - 2, 4),
        Err(TransferError::OutOfBounds { .. })
    ));
    assert_eq!(s.stats().writes, 0);
}

#[test]
fn local_batch_mixed_with_a_remote_server_keeps_order() {
    let s1_fx = server();
    let (s1, t1) = (&s1_fx.s, &s1_fx.t);
    let s2_fx = server();
    let (s2, t2) = (&s2_fx.s, &s2_fx.t);
    let e = local_engine(s1);
    assert!(e.is_local(t1) && !e.is_local(t2));
    let vals: Vec<Vec<u8>> = (0..32).map(|i| pattern(20_000 + i, i as u8)).collect();
    let targets: Vec<&Target> = (0..32).map(|i| if i % 3 == 0 { t2 } else { t1 }).collect();
    let mut reqs: Vec<TransferRequest<'_>> = (0..32)
        .map(|i| TransferRequest::Write {
            target: targets[i],
            generation: 100 + i as u64,
            key: "k",
            offset: (i as u64) * 32_768,
            src: vec![&vals[i][..]],
        })
        .collect();
    // One bad request in the middle fails alone.
    reqs[5] = TransferRequest::Write {
        target: t1,
        generation: 105,
        key: "k",
        offset: SEG,
        src: vec![&vals[5][..]],
    };
    let out = e.batch(&mut reqs);
    assert_eq!(out.len(), 32);
    for (i, r) in out.iter().enumerate() {
        assert_eq!(r.is_ok(), i != 5, "request {i}: {r:?}");
    }
    let mut bufs: Vec<Vec<u8>> = vals.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut reads: Vec<TransferRequest<'_>> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| TransferRequest::Read {
            target: targets[i],
            generation: 100 + i as u64,
            offset: (i as u64) * 32_768,
            dst: vec![&mut b[..]],
        })
        .collect();
    let out = e.batch(&mut reads);
    drop(reads);
    for (i, r) in out.iter().enumerate() {
        if i == 5 {
            assert!(matches!(r, Err(TransferError::Stale { .. })), "{r:?}");
        } else {
            r.as_ref().unwrap();
            assert_eq!(bufs[i], vals[i]);
        }
    }
    let local_n = (0..32).filter(|i| i % 3 != 0 && *i != 5).count() as u64;
    assert_eq!(s1.stats().writes, local_n);
    assert_eq!(s1.stats().reads, local_n);
    assert_eq!(s2.stats().writes, 11);
}

#[test]
fn detach_shutdown_and_drop_leave_the_local_path() {
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    let e = local_engine(s);
    e.write(t, 1, "a", 0, &[&[7u8; 64]]).unwrap();
    e.detach_local(s);
    assert!(!e.is_local(t));
    // Same bytes over the sockets.
    assert_eq!(read_vec(&e, t, 1, 0, 64).unwrap(), vec![7u8; 64]);
    e.attach_local(s);
    assert!(e.is_local(t));
    s.shutdown();
    assert!(!e.is_local(t), "a stopped server is not served locally");
    assert!(read_vec(&e, t, 1, 0, 64).is_err());
    let t = t.clone();
    drop(s_fx);
    assert!(!e.is_local(&t));
}

#[test]
fn prefaulted_segment_works() {
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    s.prefault_in_background(SEG).unwrap().join().unwrap();
    let e = local_engine(s);
    let v = pattern(1 << 20, 3);
    e.write(t, 1, "a", SEG - (1 << 20), &[&v]).unwrap();
    assert_eq!(read_vec(&e, t, 1, SEG - (1 << 20), 1 << 20).unwrap(), v);
    assert_eq!(s.stats().entries, 1);
}

fn engine_with_copy_threads(s: &SegmentServer, copy_threads: usize) -> TransferEngine {
    let e = TransferEngine::new(TransferOptions {
        copy_threads,
        ..TransferOptions::default()
    });
    e.attach_local(s);
    e
}

/// A big batch is spread over copy threads; every request still gets its own result, in
/// order, and its own bytes (failures included), whatever the thread count.
#[test]
fn local_batch_split_over_threads_keeps_results_and_bytes_in_order() {
    const OBJ: usize = 512 << 10;
    const N: usize = 24; // 12 MiB: 2 or more shares of >= LOCAL_SPLIT_MIN_BYTES
    for threads in [1, 2, 4] {
        let s_fx = server();
        let (s, t) = (&s_fx.s, &s_fx.t);
        let e = engine_with_copy_threads(s, threads);
        let objs: Vec<Vec<u8>> = (0..N).map(|i| pattern(OBJ, i as u8)).collect();
        let mut reqs: Vec<TransferRequest<'_>> = objs
            .iter()
            .enumerate()
            .map(|(i, o)| TransferRequest::Write {
                target: t,
                generation: 100 + i as u64,
                key: "k",
                // Object 5 lands past the end of the segment.
                offset: if i == 5 { SEG } else { (i * OBJ) as u64 },
                // Two pieces per object, as vLLM's layers.
                src: vec![&o[..OBJ / 2], &o[OBJ / 2..]],
            })
            .collect();
        let out = e.batch(&mut reqs);
        for (i, r) in out.iter().enumerate() {
            match i {
                5 => assert!(
                    matches!(r, Err(TransferError::OutOfBounds { .. })),
                    "{threads} threads, write {i}: {r:?}"
                ),
                _ => assert!(r.is_ok(), "{threads} threads, write {i}: {r:?}"),
            }
        }
        let mut dst: Vec<Vec<u8>> = (0..N).map(|_| vec![0u8; OBJ]).collect();
        let mut reqs: Vec<TransferRequest<'_>> = dst
            .iter_mut()
            .enumerate()
            .map(|(i, d)| {
                let (a, b) = d.split_at_mut(1000);
                TransferRequest::Read {
                    target: t,
                    // Object 7 asks for a generation that never existed.
                    generation: if i == 7 { 9999 } else { 100 + i as u64 },
                    offset: (i * OBJ) as u64,
                    dst: vec![a, b],
                }
            })
            .collect();
        let out = e.batch(&mut reqs);
        drop(reqs);
        for (i, r) in out.iter().enumerate() {
            match i {
                5 | 7 => assert!(
                    matches!(r, Err(TransferError::Stale { .. })),
                    "{threads} threads, read {i}: {r:?}"
                ),
                _ => {
                    assert!(r.is_ok(), "{threads} threads, read {i}: {r:?}");
                    assert!(
                        dst[i] == objs[i],
                        "{threads} threads: object {i} bytes differ"
                    );
                }
            }
        }
        assert!(dst[7].iter().all(|&b| b == 0), "a stale read wrote nothing");
        let st = s.stats();
        assert_eq!((st.writes, st.reads), (N as u64 - 1, N as u64 - 2));
    }
}

/// Writers overwrite the same ranges with new generations in split batches while readers read
/// them in split batches: a read either fails STALE or returns exactly one generation's bytes,
/// never a mix (the overlap invalidation and pins hold across copy threads).
#[test]
fn local_readers_never_see_half_written_objects_across_copy_threads() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const OBJ: usize = 1 << 20;
    const SLOTS: usize = 8; // 8 MiB per batch: split in two
    const ROUNDS: u64 = 30;
    let s_fx = server();
    let (s, t) = (&s_fx.s, &s_fx.t);
    let e = engine_with_copy_threads(s, 2);
    let latest: Vec<AtomicU64> = (0..SLOTS).map(|_| AtomicU64::new(0)).collect();
    let done = AtomicBool::new(false);
    // Generation g's bytes: every byte is g % 251.
    let fill = |g: u64| vec![(g % 251) as u8; OBJ];
    let (good, stale) = std::thread::scope(|sc| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                sc.spawn(|| {
                    let (mut good, mut stale) = (0u64, 0u64);
                    let mut bufs: Vec<Vec<u8>> = (0..SLOTS).map(|_| vec![0u8; OBJ]).collect();
                    loop {
                        // Read once more after the writer is done: that pass must succeed.
                        let finished = done.load(Ordering::SeqCst);
                        let gens: Vec<u64> =
                            latest.iter().map(|g| g.load(Ordering::SeqCst)).collect();
                        if gens.contains(&0) {
                            std::thread::yield_now();
                            continue;
                        }
                        let mut reqs: Vec<TransferRequest<'_>> = bufs
                            .iter_mut()
                            .enumerate()
                            .map(|(i, b)| TransferRequest::Read {
                                target: t,
                                generation: gens[i],
                                offset: (i * OBJ) as u64,
                                dst: vec![&mut b[..]],
                            })
                            .collect();
                        let out = e.batch(&mut reqs);
                        drop(reqs);
                        for (i, r) in out.into_iter().enumerate() {
                            match r {
                                Ok(()) => {
                                    let want = (gens[i] % 251) as u8;
                                    assert!(
                                        bufs[i].iter().all(|&b| b == want),
                                        "slot {i}: generation {} read back mixed bytes",
                                        gens[i]
                                    );
                                    good += 1;
                                }
                                Err(TransferError::Stale { .. }) => stale += 1,
                                Err(e) => panic!("slot {i}: {e}"),
                            }
                        }
                        if finished {
                            break;
                        }
                    }
                    (good, stale)
                })
            })
            .collect();
        for round in 1..=ROUNDS {
            let bytes: Vec<Vec<u8>> = (0..SLOTS as u64).map(|i| fill(round * 100 + i)).collect();
            let mut reqs: Vec<TransferRequest<'_>> = bytes
                .iter()
                .enumerate()
                .map(|(i, b)| TransferRequest::Write {
                    target: t,
                    generation: round * 100 + i as u64,
                    key: "slot",
                    offset: (i * OBJ) as u64,
                    src: vec![&b[..]],
                })
                .collect();
            for r in e.batch(&mut reqs) {
                r.unwrap();
            }
            for (i, g) in latest.iter().enumerate() {
                g.store(round * 100 + i as u64, Ordering::SeqCst);
            }
        }
        done.store(true, Ordering::SeqCst);
        readers
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    assert!(
        good >= SLOTS as u64,
        "the readers' last pass must read every slot ({good} good, {stale} stale)"
    );
    assert_eq!(s.stats().entries, SLOTS as u64);
}
