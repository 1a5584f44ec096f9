//! Segment memory: a memfd mapped `MAP_SHARED`, so a same-host requester can map the very same
//! pages (shm path) and the tcp server can send from / receive into it without copies.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

use crate::copy::copy_bytes;

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
