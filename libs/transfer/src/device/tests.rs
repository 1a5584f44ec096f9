//! Unit tests of the device layer: the test double's semantics and the classification rules.
//! They use private `Fake` instances (leaked to `'static`), never the process-wide layer.

use super::fake::Fake;
use super::{CopyDir, DeviceLayer, MemKind};

fn fake() -> &'static Fake {
    Box::leak(Box::new(Fake::new(false)))
}

#[test]
fn fake_device_memory_is_classified_and_reached_only_through_copies() {
    let f = fake();
    let l: &dyn DeviceLayer = &f;
    let d = f.alloc(3 * 4096 + 5).unwrap();
    assert_eq!(l.classify(d).unwrap(), MemKind::Device { ordinal: 0 });
    assert_eq!(
        l.classify(d + 3 * 4096 + 4).unwrap(),
        MemKind::Device { ordinal: 0 }
    );
    let host = [0u8; 64];
    assert_eq!(l.classify(host.as_ptr() as usize).unwrap(), MemKind::Host);

    // Copies run at synchronize, not before (a real DMA may finish any time before it).
    let src: Vec<u8> = (0..100u8).collect();
    let s = l.stream_create(0).unwrap();
    // SAFETY: `src` outlives the synchronize; the device range lies in the allocation.
    unsafe {
        l.copy_async(s, CopyDir::HostToDevice, d + 10, src.as_ptr() as usize, 100)
            .unwrap()
    };
    assert_eq!(
        f.read(d + 10, 100).unwrap(),
        vec![0u8; 100],
        "queued, not run"
    );
    l.synchronize(s).unwrap();
    assert_eq!(f.read(d + 10, 100).unwrap(), src);

    let mut back = vec![0u8; 100];
    // SAFETY: `back` is not read before the synchronize.
    unsafe {
        l.copy_async(
            s,
            CopyDir::DeviceToHost,
            back.as_mut_ptr() as usize,
            d + 10,
            100,
        )
        .unwrap()
    };
    l.synchronize(s).unwrap();
    assert_eq!(back, src);

    // A copy past the allocation is refused, not performed.
    // SAFETY: refused before any byte moves.
    let past = unsafe {
        l.copy_async(
            s,
            CopyDir::DeviceToHost,
            back.as_mut_ptr() as usize,
            d,
            3 * 4096 + 6,
        )
    };
    assert!(past.is_err());
    let st = f.stats();
    assert_eq!((st.h2d_copies, st.d2h_copies, st.syncs), (1, 1, 2));
    l.stream_destroy(s);
    f.free(d).unwrap();
    assert_eq!(
        l.classify(d).unwrap(),
        MemKind::Host,
        "freed memory is no device memory"
    );
    assert!(f.free(d).is_err());
}

#[test]
fn fake_pins_like_cu_mem_host_register() {
    let f = fake();
    let l: &dyn DeviceLayer = &f;
    let buf = vec![0u8; 8192];
    let a = buf.as_ptr() as usize;
    // SAFETY: the double only records the range.
    unsafe {
        l.pin(a, 8192).unwrap();
        assert!(
            l.pin(a + 4096, 10).is_err(),
            "overlapping registration is refused"
        );
    }
    assert_eq!(l.classify(a + 100).unwrap(), MemKind::HostRegistered);
    // SAFETY: as above.
    unsafe {
        l.unpin(a).unwrap();
        assert!(l.unpin(a).is_err());
    }
    assert_eq!(l.classify(a).unwrap(), MemKind::Host);
    assert_eq!(f.stats().pinned_bytes, 0);
}

#[test]
fn a_blind_fake_still_allocates_but_the_data_path_sees_host_memory() {
    let f: &'static Fake = Box::leak(Box::new(Fake::new(true)));
    let l: &dyn DeviceLayer = &f;
    let d = f.alloc(4096).unwrap();
    assert!(l.blind());
    assert_eq!(super::classify_with(l, d), MemKind::Host);
    f.free(d).unwrap();
}

#[test]
fn classification_without_a_layer_is_host() {
    // The process-wide layer of this test binary is never installed and LUNAKV_DEVICE is not
    // set by the test harness, so it is either none or a real CUDA driver.
    if super::layer().is_none() {
        let v = [1u8; 16];
        assert_eq!(super::kind_of(v.as_ptr() as usize, 16), MemKind::Host);
        assert_eq!(
            super::register_range(v.as_ptr() as usize, 16),
            MemKind::Host
        );
        assert!(!super::any_device(&[&v[..]]));
        assert!(super::Copier::new().is_none());
    }
}

#[test]
fn without_an_nvidia_driver_cuda_does_not_load_and_says_why() {
    match super::cuda::Cuda::load() {
        // A machine with a GPU and its driver: nothing to check here (docs/GPU.md).
        Ok(c) => assert_eq!(DeviceLayer::name(&c), "cuda"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("libcuda.so.1") || msg.contains("CUDA driver"),
                "{msg}"
            );
        }
    }
}

fn d2h(dev: usize, host: usize, len: usize) -> super::runs::Pending {
    super::runs::Pending {
        ordinal: 0,
        dir: CopyDir::DeviceToHost,
        dev,
        host,
        len,
    }
}

/// Runs of `pending` by the sorting path (no request shape known).
fn sorted(pending: Vec<super::runs::Pending>) -> Vec<super::runs::Run> {
    super::runs::coalesce(pending, super::runs::Shape::default())
}

/// vLLM's save, queued object by object: `blocks` objects of `tensors.len()` pieces of `bb`
/// bytes, object `j` taking block `ids[j]` of every tensor, placed back to back from host
/// 1 MiB. Returns the queue and its shape (one request per object).
fn vllm_queue(
    tensors: &[usize],
    ids: &[usize],
    bb: usize,
) -> (Vec<super::runs::Pending>, super::runs::Shape) {
    let mut pending = Vec::new();
    let mut shape = super::runs::Shape::default();
    for (j, &id) in ids.iter().enumerate() {
        for (t, base) in tensors.iter().enumerate() {
            pending.push(d2h(
                base + id * bb,
                (1 << 20) + (j * tensors.len() + t) * bb,
                bb,
            ));
        }
        shape.note(tensors.len());
    }
    (pending, shape)
}

#[test]
fn a_batch_queued_in_columns_coalesces_without_a_sort_into_the_sorted_runs() {
    let bb = 4096;
    // 4 tensors of 64 blocks, not in address order; blocks ascending (a fresh vLLM cache).
    let tensors = [0x7300_0000usize, 0x7000_0000, 0x7200_0000, 0x7100_0000];
    let ids: Vec<usize> = (0..64).collect();
    let (pending, queued) = vllm_queue(&tensors, &ids, bb);
    let order = super::runs::column_order(&pending, 4).expect("the merge applies");
    assert_eq!(order, vec![1, 3, 2, 0], "columns in device address order");
    let merged = super::runs::coalesce(pending.clone(), queued);
    assert_eq!(shape(&merged), shape(&sorted(pending)));
    assert_eq!(merged.len(), 4, "one 2D copy per tensor");

    // What the merge must refuse, and the result it then gives (the sort's).
    let cases: Vec<(&str, Vec<super::runs::Pending>, super::runs::Shape)> = vec![
        // Blocks in descending order: each column falls.
        {
            let ids: Vec<usize> = (0..64).rev().collect();
            let (p, s) = vllm_queue(&tensors, &ids, bb);
            ("descending blocks", p, s)
        },
        // Two "tensors" whose ranges interleave (the same tensor twice, one block apart).
        {
            let (p, s) = vllm_queue(&[0x7000_0000, 0x7000_1000], &ids, 2 * bb);
            ("interleaved columns", p, s)
        },
        // Pieces of two sizes.
        {
            let (mut p, s) = vllm_queue(&tensors, &ids, bb);
            p[5].len = bb / 2;
            ("mixed sizes", p, s)
        },
    ];
    for (what, pending, queued) in cases {
        assert!(
            super::runs::column_order(&pending, 4).is_none(),
            "{what}: not a merge"
        );
        assert_eq!(
            shape(&super::runs::coalesce(pending.clone(), queued)),
            shape(&sorted(pending)),
            "{what}"
        );
    }
}

#[test]
fn block_ids_in_any_order_coalesce_the_same_with_or_without_the_merge() {
    // vLLM hands blocks in the order its allocator gave them: random permutations, some
    // ascending runs. Whatever path coalesce takes, the runs are the sort's.
    let tensors = [0x9000_0000usize, 0x8000_0000, 0xa000_0000];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for trial in 0..200 {
        let n = 1 + trial % 40;
        let mut ids: Vec<usize> = (0..n).map(|i| i * 3).collect();
        if trial % 2 == 1 {
            for i in (1..n).rev() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ids.swap(i, (seed % (i as u64 + 1)) as usize);
            }
        }
        let (pending, queued) = vllm_queue(&tensors, &ids, 2048);
        assert_eq!(
            shape(&super::runs::coalesce(pending.clone(), queued)),
            shape(&sorted(pending)),
            "trial {trial}: ids {ids:?}"
        );
    }
}

fn shape(runs: &[super::runs::Run]) -> Vec<(usize, usize, usize, usize, usize, usize)> {
    runs.iter()
        .map(|r| (r.dev, r.dev_pitch, r.host, r.host_pitch, r.len, r.height))
        .collect()
}

#[test]
fn vllm_blocks_placed_back_to_back_coalesce_into_one_2d_copy_per_piece() {
    // 2 layers x K/V, 4 blocks of 4 KiB per tensor; objects of 16 KiB at host 1 MiB + 16 KiB * i,
    // queued object by object as the transfer path does.
    let (bb, blocks, obj) = (4096usize, 4usize, 4 * 4096usize);
    let bases = [0x7000_0000usize, 0x7100_0000];
    let mut pending = Vec::new();
    for i in 0..blocks {
        for (l, base) in bases.iter().enumerate() {
            for k in 0..2 {
                let piece = l * 2 + k;
                pending.push(d2h(
                    base + (k * blocks + i) * bb,
                    (1 << 20) + i * obj + piece * bb,
                    bb,
                ));
            }
        }
    }
    let runs = sorted(pending);
    // One run per (layer, K/V): 4 rows, device pitch one block, host pitch one object.
    assert_eq!(runs.len(), 4, "{:?}", shape(&runs));
    for r in &runs {
        assert_eq!((r.dev_pitch, r.host_pitch, r.height), (bb, obj, blocks));
    }
}

#[test]
fn coalescing_merges_contiguous_runs_and_keeps_what_does_not_line_up_apart() {
    assert!(sorted(Vec::new()).is_empty());
    // Contiguous on both sides: one run whose pitches equal the row (issued as one plain copy).
    let runs = sorted(vec![
        d2h(0x2000, 0x10_0000, 0x1000),
        d2h(0x1000, 0x0f_f000, 0x1000),
    ]);
    assert_eq!(
        shape(&runs),
        vec![(0x1000, 0x1000, 0x0f_f000, 0x1000, 0x1000, 2)]
    );
    // Host side descending while the device side ascends: no positive pitch fits, two copies.
    let runs = sorted(vec![
        d2h(0x1000, 0x20_0000, 0x100),
        d2h(0x2000, 0x10_0000, 0x100),
    ]);
    assert_eq!(runs.len(), 2);
    // Rows overlapping on the host side (pitch under the row size) are not one 2D copy.
    let runs = sorted(vec![
        d2h(0x1000, 0x10_0000, 0x100),
        d2h(0x2000, 0x10_0080, 0x100),
    ]);
    assert_eq!(runs.len(), 2);
    // Different sizes, directions or devices never share a run.
    let mut h2d = d2h(0x2000, 0x10_1000, 0x1000);
    h2d.dir = CopyDir::HostToDevice;
    let mut other = d2h(0x3000, 0x10_2000, 0x1000);
    other.ordinal = 1;
    let runs = sorted(vec![
        d2h(0x1000, 0x10_0000, 0x1000),
        h2d,
        other,
        d2h(0x4000, 0x10_3000, 0x800),
    ]);
    assert_eq!(runs.len(), 4);
    // A pitch past what a 2D copy takes (2^31 - 1) is issued row by row.
    let far = super::runs::MAX_PITCH + 1;
    let runs = sorted(vec![
        d2h(0x1000, 0x1000, 0x100),
        d2h(0x1000 + far, 0x2000, 0x100),
    ]);
    assert_eq!(runs.len(), 2);
    // A third row that breaks the pitch starts a new run.
    let runs = sorted(vec![
        d2h(0x1000, 0x10_0000, 0x100),
        d2h(0x2000, 0x20_0000, 0x100),
        d2h(0x3000, 0x30_0000, 0x100),
        d2h(0x4000, 0x30_1000, 0x100),
    ]);
    assert_eq!(
        shape(&runs),
        vec![
            (0x1000, 0x1000, 0x10_0000, 0x10_0000, 0x100, 3),
            (0x4000, 0x100, 0x30_1000, 0x100, 0x100, 1)
        ]
    );
}

/// The H200 refused 2D copies whose host rows cross from one pinned granule of an embedded
/// owner's segment to the next; the double refuses the same shape, and `copy_2d` splits the
/// run in halves until each part is taken. Every row must land once, where its run says.
#[test]
fn a_run_over_two_pinned_ranges_is_split_and_every_row_lands() {
    let f = fake();
    let l: &dyn DeviceLayer = &f;
    let (width, pitch, rows) = (100usize, 256usize, 8usize);
    let host: Vec<u8> = (0..rows * pitch).map(|i| (i * 7 % 251) as u8).collect();
    let h = host.as_ptr() as usize;
    // SAFETY: the double only records the ranges; `host` outlives them.
    unsafe {
        l.pin(h, 5 * pitch).unwrap();
        l.pin(h + 5 * pitch, 3 * pitch).unwrap();
    }
    let d = f.alloc(rows * width).unwrap();
    let s = l.stream_create(0).unwrap();
    let before = super::split_stats();
    // SAFETY: `host` stays unmodified until the synchronize; the device rows lie in `d`.
    unsafe {
        let rect = super::Rect {
            dst: d,
            dst_pitch: width,
            src: h,
            src_pitch: pitch,
            width,
            height: rows,
        };
        super::copy_2d(l, s, CopyDir::HostToDevice, rect).unwrap();
    }
    l.synchronize(s).unwrap();
    let got = f.read(d, rows * width).unwrap();
    for r in 0..rows {
        assert_eq!(
            &got[r * width..(r + 1) * width],
            &host[r * pitch..r * pitch + width],
            "row {r}"
        );
    }
    let st = f.stats();
    // Rows 0-7 refused; 0-3 taken; 4-7 refused; 4-5 refused, so rows 4 and 5 alone; 6-7 taken.
    assert_eq!((st.refused_2d, st.copies_2d, st.h2d_copies), (3, 2, 8));
    let after = super::split_stats();
    assert!(after.split_runs > before.split_runs);
    assert!(after.refused_2d >= before.refused_2d + 3);
    // SAFETY: no copy in flight.
    unsafe {
        l.unpin(h).unwrap();
        l.unpin(h + 5 * pitch).unwrap();
    }
    l.stream_destroy(s);
    f.free(d).unwrap();
}

/// The other shape the H200 refused: one run whose device rows lie in two allocations (two
/// tensors). Split, each row is copied from its own allocation.
#[test]
fn a_run_over_two_allocations_is_split_and_every_row_lands() {
    let f = fake();
    let l: &dyn DeviceLayer = &f;
    let width = 4096usize;
    let (a, b) = (f.alloc(width).unwrap(), f.alloc(width).unwrap());
    f.write(a, &[0xa1; 4096]).unwrap();
    f.write(b, &[0xb2; 4096]).unwrap();
    let (lo, hi) = (a.min(b), a.max(b));
    let mut out = vec![0u8; 2 * width];
    let s = l.stream_create(0).unwrap();
    // SAFETY: `out` is not read before the synchronize; each row lies in one allocation.
    unsafe {
        let rect = super::Rect {
            dst: out.as_mut_ptr() as usize,
            dst_pitch: width,
            src: lo,
            src_pitch: hi - lo,
            width,
            height: 2,
        };
        super::copy_2d(l, s, CopyDir::DeviceToHost, rect).unwrap();
    }
    l.synchronize(s).unwrap();
    assert_eq!(out[..width], f.read(lo, width).unwrap()[..]);
    assert_eq!(out[width..], f.read(hi, width).unwrap()[..]);
    assert_ne!(out[..width], out[width..], "two allocations, two patterns");
    let st = f.stats();
    assert_eq!((st.refused_2d, st.copies_2d, st.d2h_copies), (1, 0, 2));
    l.stream_destroy(s);
    f.free(a).unwrap();
    f.free(b).unwrap();
}

/// A 2D copy the double takes is one queued call, as it is one driver call on a GPU, and its
/// rows still run only at synchronize, each at its own pitch on both sides and in both
/// directions; the row and byte counters count its rows.
#[test]
fn a_2d_copy_lands_each_row_at_its_pitches_at_synchronize() {
    let f = fake();
    let l: &dyn DeviceLayer = &f;
    let (width, rows) = (48usize, 5usize);
    let (dev_pitch, host_pitch) = (64usize, 80usize);
    let d = f.alloc(rows * dev_pitch).unwrap();
    let pattern: Vec<u8> = (0..rows * dev_pitch)
        .map(|i| (i * 13 % 251) as u8)
        .collect();
    f.write(d, &pattern).unwrap();
    let s = l.stream_create(0).unwrap();
    let mut host = vec![0u8; rows * host_pitch];
    let before = f.stats();
    // SAFETY: `host` is not read before the synchronize; the device rows lie in `d`.
    unsafe {
        let rect = super::Rect {
            dst: host.as_mut_ptr() as usize,
            dst_pitch: host_pitch,
            src: d,
            src_pitch: dev_pitch,
            width,
            height: rows,
        };
        l.copy_2d_async(s, CopyDir::DeviceToHost, rect).unwrap();
    }
    assert!(host.iter().all(|&b| b == 0), "queued, not run");
    l.synchronize(s).unwrap();
    for r in 0..rows {
        let row = &host[r * host_pitch..][..host_pitch];
        assert_eq!(&row[..width], &pattern[r * dev_pitch..][..width], "row {r}");
        assert!(
            row[width..].iter().all(|&b| b == 0),
            "row {r}: past its width"
        );
    }
    let st = f.stats();
    assert_eq!(st.copies_2d - before.copies_2d, 1);
    assert_eq!(
        st.copy_calls - before.copy_calls,
        1,
        "one call, not one per row"
    );
    assert_eq!(st.d2h_copies - before.d2h_copies, rows as u64);
    assert_eq!(st.d2h_bytes - before.d2h_bytes, (rows * width) as u64);

    // And back: host rows at host_pitch into a second allocation at dev_pitch.
    let e = f.alloc(rows * dev_pitch).unwrap();
    // SAFETY: `host` stays unmodified until the synchronize; the device rows lie in `e`.
    unsafe {
        let rect = super::Rect {
            dst: e,
            dst_pitch: dev_pitch,
            src: host.as_ptr() as usize,
            src_pitch: host_pitch,
            width,
            height: rows,
        };
        l.copy_2d_async(s, CopyDir::HostToDevice, rect).unwrap();
    }
    assert_eq!(
        f.read(e, rows * dev_pitch).unwrap(),
        vec![0u8; rows * dev_pitch]
    );
    l.synchronize(s).unwrap();
    let got = f.read(e, rows * dev_pitch).unwrap();
    for r in 0..rows {
        assert_eq!(
            &got[r * dev_pitch..][..width],
            &pattern[r * dev_pitch..][..width],
            "row {r}"
        );
    }
    assert_eq!(f.stats().h2d_copies - st.h2d_copies, rows as u64);
    l.stream_destroy(s);
    f.free(d).unwrap();
    f.free(e).unwrap();
}
