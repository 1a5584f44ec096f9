//! Socket I/O of device memory: the bytes go through pinned host staging buffers, chunk by
//! chunk, with the DMA of one chunk overlapping the socket I/O of the previous one.
//!
//! Write (device -> socket): fill chunk 0, wait; then for each chunk n: queue the DMA of chunk
//! n+1 into the other buffer, send chunk n, wait. Read (socket -> device): receive chunk n,
//! wait for the DMA of chunk n-1 (it ran during the receive), queue the DMA of chunk n.
//! Host pieces of a request that also has device pieces are copied through the same buffers.

use std::io::{self, Read, Write};

use parking_lot::Mutex;
use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};

use super::{Copier, DeviceError, gather, layer, scatter};
use crate::vio::{read_exact_scatter, write_all_gather};

/// Bytes per staging buffer (and per pipelined chunk).
pub(crate) const CHUNK: usize = 1 << 20;
/// Idle staging buffers kept for reuse (each connection in flight holds two).
const MAX_IDLE: usize = 32;

/// One pinned (if the backend allows) host buffer of [`CHUNK`] bytes.
struct Buf {
    ptr: *mut u8,
    pinned: bool,
}

// SAFETY: a private anonymous mapping owned by this value; moved between threads whole.
unsafe impl Send for Buf {}

impl Buf {
    fn new() -> io::Result<Buf> {
        // SAFETY: a fresh private anonymous mapping chosen by the kernel.
        let p = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                CHUNK,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }?;
        let ptr = p.cast::<u8>();
        // SAFETY: the mapping is ours and lives until Drop, which unpins first.
        let pinned = layer().is_some_and(|l| match unsafe { l.pin(ptr as usize, CHUNK) } {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("staging buffer not pinned: {e}");
                false
            }
        });
        Ok(Buf { ptr, pinned })
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if self.pinned
            && let Some(l) = layer()
        {
            // SAFETY: pinned by `new`; buffers go back only after their copies were synchronized.
            let _ = unsafe { l.unpin(self.ptr as usize) };
        }
        // SAFETY: the mapping made in `new`.
        let _ = unsafe { munmap(self.ptr.cast(), CHUNK) };
    }
}

static POOL: Mutex<Vec<Buf>> = Mutex::new(Vec::new());

/// Two staging buffers, back to the pool on drop.
struct Pair {
    bufs: Vec<Buf>,
}

impl Pair {
    fn take() -> io::Result<Pair> {
        let mut bufs = Vec::with_capacity(2);
        {
            let mut pool = POOL.lock();
            while bufs.len() < 2 {
                match pool.pop() {
                    Some(b) => bufs.push(b),
                    None => break,
                }
            }
        }
        while bufs.len() < 2 {
            bufs.push(Buf::new()?);
        }
        Ok(Pair { bufs })
    }

    fn ptr(&self, i: usize) -> *mut u8 {
        self.bufs[i & 1].ptr
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let mut pool = POOL.lock();
        for b in self.bufs.drain(..) {
            if pool.len() < MAX_IDLE {
                pool.push(b);
            }
        }
    }
}

fn dev_io(e: DeviceError) -> io::Error {
    io::Error::other(format!("device copy failed: {e}"))
}

fn copier() -> io::Result<Copier> {
    Copier::new().ok_or_else(|| io::Error::other("no device layer is loaded"))
}

/// Writes `head`, then the concatenation of `body` (pieces on the host or a device).
pub(crate) fn write_all_staged<W: Write>(
    w: &mut W,
    head: &[&[u8]],
    body: &[&[u8]],
) -> io::Result<()> {
    let total: usize = body.iter().map(|p| p.len()).sum();
    // Declared before the copier: dropped after it, so a failed write waits for queued DMA
    // before the buffers go back to the pool.
    let bufs = Pair::take()?;
    let mut c = copier()?;
    let chunks = total.div_ceil(CHUNK);
    let chunk_len = |n: usize| CHUNK.min(total - n * CHUNK);
    if chunks > 0 {
        // SAFETY: buffer 0 holds CHUNK bytes and is not read before the sync below.
        unsafe { gather(&mut c, bufs.ptr(0), body, 0, chunk_len(0)) }.map_err(dev_io)?;
    }
    let mut head = Some(head);
    for n in 0..chunks {
        c.sync().map_err(dev_io)?;
        if n + 1 < chunks {
            // SAFETY: the other buffer was fully sent (write_all below is synchronous).
            unsafe {
                gather(
                    &mut c,
                    bufs.ptr(n + 1),
                    body,
                    (n + 1) * CHUNK,
                    chunk_len(n + 1),
                )
            }
            .map_err(dev_io)?;
            // Started now, so its DMA runs while chunk n is on the socket.
            c.flush().map_err(dev_io)?;
        }
        // SAFETY: chunk n was synchronized above; the slice lives for this write only.
        let chunk = unsafe { std::slice::from_raw_parts(bufs.ptr(n), chunk_len(n)) };
        match head.take() {
            Some(h) => write_all_gather(w, h, &[chunk])?,
            None => write_all_gather(w, &[chunk], &[])?,
        }
    }
    if let Some(h) = head {
        write_all_gather(w, h, &[])?;
    }
    Ok(())
}

/// Fills every `dst` piece (on the host or a device) in order from `r`.
pub(crate) fn read_exact_staged<R: Read>(r: &mut R, dst: &mut [&mut [u8]]) -> io::Result<()> {
    let total: usize = dst.iter().map(|p| p.len()).sum();
    let bufs = Pair::take()?;
    let mut c = copier()?;
    for n in 0..total.div_ceil(CHUNK) {
        let len = CHUNK.min(total - n * CHUNK);
        // SAFETY: this buffer's previous DMA (chunk n-2) was synchronized in iteration n-1.
        let chunk = unsafe { std::slice::from_raw_parts_mut(bufs.ptr(n), len) };
        read_exact_scatter(r, &mut [chunk])?;
        // The DMA of chunk n-1 ran while this chunk arrived; wait for it so its buffer is free.
        c.sync().map_err(dev_io)?;
        // SAFETY: the buffer holds `len` received bytes and is not reused before the next sync.
        unsafe { scatter(&mut c, bufs.ptr(n), dst, n * CHUNK, len) }.map_err(dev_io)?;
        // Started now, so its DMA runs while chunk n+1 arrives.
        c.flush().map_err(dev_io)?;
    }
    c.sync().map_err(dev_io)
}
