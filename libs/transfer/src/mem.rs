//! Segment memory: a memfd mapped `MAP_SHARED`, so a same-host requester can map the very same
//! pages (shm path) and the tcp server can send from / receive into it without copies.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

/// A shared read-write mapping of a memfd.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    /// Parts pinned for device DMA, made when the first device copy touches the mapping.
    pins: OnceLock<crate::device::HostPins>,
}

// SAFETY: the mapping is plain shared memory; it is only accessed through raw pointers whose
// ranges are bounds-checked, and the entry table (pins, overlap invalidation) orders writers and
// readers of one range. Sharing the pointer between threads is the point of the type.
unsafe impl Send for Mapping {}
// SAFETY: see `Send`; `&Mapping` hands out only raw pointers, never references.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Creates a fresh memfd of `size` bytes (sparse: pages are allocated on first touch) and maps it.
    pub(crate) fn create(size: u64) -> std::io::Result<Mapping> {
        let fd = memfd_create("lunakv-segment", MemfdFlags::CLOEXEC)?;
        ftruncate(&fd, size)?;
        Mapping::map(fd, size)
    }

    /// Maps an existing memfd (received over SCM_RIGHTS) of `size` bytes.
    pub(crate) fn map(fd: OwnedFd, size: u64) -> std::io::Result<Mapping> {
        let len = usize::try_from(size)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| {
                std::io::Error::other(format!("cannot map a segment of {size} bytes"))
            })?;
        // SAFETY: a fresh mapping chosen by the kernel (null hint), so it aliases nothing; the fd
        // is a memfd at least `len` bytes long (ftruncate'd by its creator). MAP_NORESERVE keeps
        // a large, mostly empty segment from being charged up front.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::NORESERVE,
                fd.as_fd(),
                0,
            )?
        };
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| std::io::Error::other("mmap returned null"))?;
        Ok(Mapping {
            ptr,
            len,
            fd,
            pins: OnceLock::new(),
        })
    }

    pub(crate) fn len(&self) -> u64 {
        self.len as u64
    }

    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Checks `[offset, offset+len)` lies inside the mapping (no overflow) and returns it as usizes.
    pub(crate) fn check(&self, offset: u64, len: u64) -> Option<(usize, usize)> {
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        Some((offset as usize, len as usize))
    }

    /// Raw pointer to `offset`; callers must have passed the range through [`Mapping::check`].
    pub(crate) fn ptr_at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        // SAFETY: offset <= len, so the result stays inside (or one past) the mapping.
        unsafe { self.ptr.as_ptr().add(offset) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Unpinned before the pages go away (cuMemHostUnregister needs them mapped).
        drop(self.pins.take());
        // SAFETY: ptr/len are exactly what mmap returned, and no borrowed slice outlives `self`
        // (slices are only made for the duration of one syscall or memcpy).
        if let Err(e) = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "munmap of a segment failed");
        }
    }
}

impl Mapping {
    /// Pins the parts of `[offset, offset+len)` not pinned yet, so a device copy is one DMA
    /// straight into or out of the mapping.
    fn pin_for_dma(&self, offset: usize, len: usize) {
        self.pins
            .get_or_init(|| crate::device::HostPins::new(self.ptr.as_ptr() as usize, self.len))
            .ensure(offset, len);
    }
}

/// Copies `src` pieces (host or device) into the mapping at `offset`: host pieces now, device
/// pieces queued on `c` as DMA into the (pinned) mapping (coalesced when `c` flushes). The range must have been
/// checked, and must not be read before `c` synchronized.
pub(crate) fn queue_in(
    m: &Mapping,
    offset: usize,
    src: &[&[u8]],
    c: &mut crate::device::Copier,
) -> Result<(), crate::TransferError> {
    let len = src.iter().map(|p| p.len()).sum();
    if crate::device::any_device(src) {
        m.pin_for_dma(offset, len);
    }
    // SAFETY: the caller checked the range and keeps readers off it until the sync.
    unsafe { crate::device::gather(c, m.ptr_at(offset), src, 0, len) }?;
    Ok(())
}

/// Copies the mapping at `offset` into `dst` pieces (host or device): host pieces now, device
/// pieces queued on `c`. The range must have been checked and must stay unmodified until `c`
/// synchronized.
pub(crate) fn queue_out(
    m: &Mapping,
    offset: usize,
    dst: &mut [&mut [u8]],
    c: &mut crate::device::Copier,
) -> Result<(), crate::TransferError> {
    let len = dst.iter().map(|p| p.len()).sum();
    if crate::device::any_device_mut(dst) {
        m.pin_for_dma(offset, len);
    }
    // SAFETY: the caller checked the range and pinned it until the sync.
    unsafe { crate::device::scatter(c, m.ptr_at(offset), dst, 0, len) }?;
    Ok(())
}

/// [`copy_in`] for pieces that may be device memory: device pieces are one DMA each straight
/// into the (pinned) mapping, synchronized once. The range must have been checked.
pub(crate) fn copy_in_any(
    m: &Mapping,
    offset: usize,
    src: &[&[u8]],
) -> Result<(), crate::TransferError> {
    if !crate::device::any_device(src) {
        copy_in(m, offset, src);
        return Ok(());
    }
    let len = src.iter().map(|p| p.len()).sum();
    m.pin_for_dma(offset, len);
    let mut c = crate::device::Copier::new()
        .ok_or_else(|| crate::TransferError::Device("no device layer".into()))?;
    // SAFETY: the caller checked the range; nobody reads it until the sync (its entries were
    // retired or are not committed yet).
    unsafe { crate::device::gather(&mut c, m.ptr_at(offset), src, 0, len) }?;
    c.sync()?;
    Ok(())
}

/// [`copy_out`] for pieces that may be device memory (one DMA per device piece, one sync).
pub(crate) fn copy_out_any(
    m: &Mapping,
    offset: usize,
    dst: &mut [&mut [u8]],
) -> Result<(), crate::TransferError> {
    if !crate::device::any_device_mut(dst) {
        copy_out(m, offset, dst);
        return Ok(());
    }
    let len = dst.iter().map(|p| p.len()).sum();
    m.pin_for_dma(offset, len);
    let mut c = crate::device::Copier::new()
        .ok_or_else(|| crate::TransferError::Device("no device layer".into()))?;
    // SAFETY: the caller checked the range and pinned its entry: it is not rewritten before
    // the sync below.
    unsafe { crate::device::scatter(&mut c, m.ptr_at(offset), dst, 0, len) }?;
    c.sync()?;
    Ok(())
}

/// Copy bandwidth out of segment memory, GB/s per copy: a fresh `bytes`-long memfd mapping (as
/// every segment is), filled, then copied into a private buffer `reps` times after one warm-up,
/// with the copy routine shm gets use. Public for benchmarks: the limit a shm get is held to
/// must copy from the same kind of pages, because the kernel may back private memory with
/// transparent huge pages and shmem not, and that alone nearly doubles a copy's speed.
pub fn segment_copy_gbps(bytes: usize, reps: usize) -> std::io::Result<Vec<f64>> {
    let m = Mapping::create(bytes as u64)?;
    copy_in(&m, 0, &[&vec![0x5au8; bytes]]);
    let mut dst = vec![0xa5u8; bytes];
    copy_out(&m, 0, &mut [&mut dst]);
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = std::time::Instant::now();
        copy_out(&m, 0, &mut [std::hint::black_box(&mut dst[..])]);
        out.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(out)
}

/// Copies `src` pieces into the mapping at `offset`. The range must have been checked.
pub(crate) fn copy_in(m: &Mapping, offset: usize, src: &[&[u8]]) {
    let mut at = offset;
    for piece in src {
        // SAFETY: the caller checked [offset, offset + sum(len)) is inside the mapping; `piece` is
        // caller memory (if it aliases the segment, `copy_bytes` falls back to memmove).
        unsafe { copy_bytes(m.ptr_at(at), piece.as_ptr(), piece.len()) };
        at += piece.len();
    }
}

/// Copies the mapping at `offset` out into `dst` pieces. The range must have been checked.
pub(crate) fn copy_out(m: &Mapping, offset: usize, dst: &mut [&mut [u8]]) {
    let mut at = offset;
    for piece in dst.iter_mut() {
        // SAFETY: as in `copy_in`; the entry is pinned by the caller so nobody rewrites the range.
        unsafe { copy_bytes(piece.as_mut_ptr(), m.ptr_at(at), piece.len()) };
        at += piece.len();
    }
}

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
