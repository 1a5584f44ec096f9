//! Segment memory: a memfd mapped `MAP_SHARED`, so a same-host requester can map the very same
//! pages (shm path) and the tcp server can send from / receive into it without copies.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

/// A shared read-write mapping of a memfd.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
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
        Ok(Mapping { ptr, len, fd })
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
        // SAFETY: ptr/len are exactly what mmap returned, and no borrowed slice outlives `self`
        // (slices are only made for the duration of one syscall or memcpy).
        if let Err(e) = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(error = %e, "munmap of a segment failed");
        }
    }
}

/// Copies `src` pieces into the mapping at `offset`. The range must have been checked.
pub(crate) fn copy_in(m: &Mapping, offset: usize, src: &[&[u8]]) {
    let mut at = offset;
    for piece in src {
        // SAFETY: the caller checked [offset, offset + sum(len)) is inside the mapping; `piece` is
        // caller memory, which cannot overlap our private mmap of the memfd.
        unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), m.ptr_at(at), piece.len()) };
        at += piece.len();
    }
}

/// Copies the mapping at `offset` out into `dst` pieces. The range must have been checked.
pub(crate) fn copy_out(m: &Mapping, offset: usize, dst: &mut [&mut [u8]]) {
    let mut at = offset;
    for piece in dst.iter_mut() {
        // SAFETY: as in `copy_in`; the entry is pinned by the caller so nobody rewrites the range.
        unsafe { std::ptr::copy_nonoverlapping(m.ptr_at(at), piece.as_mut_ptr(), piece.len()) };
        at += piece.len();
    }
}
