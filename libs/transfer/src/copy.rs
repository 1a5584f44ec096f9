//! The data path's host copy: a 32-byte vector loop instead of the C library's memcpy for bulk
//! copies (why: [`copy_bytes`]). Segment memory, device staging and other crates' staged
//! buffers all copy through it.

/// Copies `src` into `dst` (of the same length; panics otherwise) with the data path's copy
/// loop, for memory other crates stage (the client's layer-wise sessions): a 32-byte vector
/// loop that avoids glibc's `rep movsb` cliff into numpy buffers, as the segment copies do.
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_slice: lengths differ");
    // SAFETY: both slices are valid for `src.len()` bytes, and a `&mut` slice never overlaps
    // a live shared one.
    unsafe { copy_bytes(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// Copies below this size go to the C library's memcpy: the vector loop only pays off once
/// its head/tail handling is amortised, and small copies are not where the time goes.
const VECTOR_COPY_MIN: usize = 2048;

/// Copies `len` bytes from `src` to `dst`, like `ptr::copy` (overlap is allowed).
///
/// Why not plain memcpy: the bulk copies of the data path go between page-aligned segment
/// memory and caller buffers whose address is whatever the allocator gave (numpy's data
/// pointers sit 16 bytes into a page). glibc's memcpy uses `rep movsb` for these sizes, and on
/// AMD Zen (this project's machines) `rep movsb` runs ~3x slower when the destination is a few
/// bytes ahead of the source modulo 4 KiB: a 16 KiB piece copied segment -> numpy buffer
/// moves at 2.7 GB/s instead of 8-9 GB/s (libs/transfer/examples/copy_bench.rs). A plain
/// 32-byte vector loop has no such cliff, and is as fast as memcpy where memcpy is fast.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes, as for `ptr::copy`.
pub(crate) unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize) {
    let (d, s) = (dst as usize, src as usize);
    let overlap = d < s.wrapping_add(len) && s < d.wrapping_add(len);
    if len < VECTOR_COPY_MIN || overlap {
        // SAFETY: forwarded from the caller; memmove handles overlap.
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present; the ranges are valid (caller) and disjoint (checked).
            unsafe { copy_avx2(dst, src, len) };
            return;
        }
    }
    // SAFETY: forwarded from the caller; the ranges are disjoint (checked above).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// The vector loop of [`copy_bytes`]: unaligned 32-byte loads, stores aligned to 32 bytes.
///
/// # Safety
/// AVX2 must be available; `src`/`dst` valid and disjoint for `len >= 32` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_store_si256, _mm256_storeu_si256};
    debug_assert!(len >= 32);
    // SAFETY (whole body): every access lies in [0, len) of `src` or `dst`, which the caller
    // vouches for; stores through `dst.add(i)` are 32-byte aligned where `_store_` is used
    // (`i` starts at the distance to the next 32-byte boundary and advances by multiples of 32).
    unsafe {
        let load = |i: usize| _mm256_loadu_si256(src.add(i).cast::<__m256i>());
        // Head and tail: one unaligned vector each (they may overlap the body: same bytes).
        let first = load(0);
        let last = load(len - 32);
        let mut i = (32 - (dst as usize & 31)) & 31;
        while i + 128 <= len {
            let (a, b, c, e) = (load(i), load(i + 32), load(i + 64), load(i + 96));
            _mm256_store_si256(dst.add(i).cast(), a);
            _mm256_store_si256(dst.add(i + 32).cast(), b);
            _mm256_store_si256(dst.add(i + 64).cast(), c);
            _mm256_store_si256(dst.add(i + 96).cast(), e);
            i += 128;
        }
        while i + 32 <= len {
            _mm256_store_si256(dst.add(i).cast(), load(i));
            i += 32;
        }
        _mm256_storeu_si256(dst.cast(), first);
        _mm256_storeu_si256(dst.add(len - 32).cast(), last);
    }
}

#[cfg(test)]
mod tests {
    use super::{copy_bytes, copy_slice};

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + i / 251) as u8).collect()
    }

    #[test]
    fn copy_bytes_matches_memcpy_at_every_alignment_and_length() {
        let src = pattern(40_000);
        for len in [
            0,
            1,
            31,
            32,
            33,
            2047,
            2048,
            2049,
            4096,
            16 << 10,
            16_411,
            32_768,
        ] {
            for so in [0usize, 1, 16, 31, 63] {
                for dof in [0usize, 1, 16, 17, 32, 63] {
                    let mut dst = vec![0xAAu8; len + 128];
                    // SAFETY: both ranges lie inside their vectors; they are distinct vectors.
                    unsafe { copy_bytes(dst.as_mut_ptr().add(dof), src.as_ptr().add(so), len) };
                    assert_eq!(
                        &dst[dof..dof + len],
                        &src[so..so + len],
                        "len {len} src+{so} dst+{dof}"
                    );
                    assert!(
                        dst[..dof].iter().all(|&b| b == 0xAA),
                        "wrote before dst+{dof}"
                    );
                    assert!(
                        dst[dof + len..].iter().all(|&b| b == 0xAA),
                        "wrote past the end, len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn copy_slice_copies_and_refuses_different_lengths() {
        let src: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; 5003];
        copy_slice(&mut dst[3..], &src);
        assert_eq!(&dst[3..], &src[..]);
        let r = std::panic::catch_unwind(|| copy_slice(&mut [0u8; 2], &[1u8; 3]));
        assert!(r.is_err());
    }

    #[test]
    fn copy_bytes_handles_overlap_like_memmove() {
        for (from, to) in [(0usize, 100usize), (100, 0), (0, 1), (1, 0)] {
            let mut buf = pattern(20_000);
            let want: Vec<u8> = {
                let mut w = buf.clone();
                w.copy_within(from..from + 10_000, to);
                w
            };
            let p = buf.as_mut_ptr();
            // SAFETY: both ranges lie inside `buf`; overlap is what is being tested.
            unsafe { copy_bytes(p.add(to), p.add(from), 10_000) };
            assert_eq!(buf, want, "{from} -> {to}");
        }
    }
}
