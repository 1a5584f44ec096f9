//! Device copies: [`Copier`] leases a stream per device for the thread that copies, queues
//! copies, issues them coalesced into runs at a flush and synchronizes once; [`gather`] and
//! [`scatter`] split a request's pieces between the CPU (host pieces) and the copier.

use parking_lot::Mutex;

use super::runs::{Pending, Run, Shape, coalesce, coalescing};
use super::*;
use crate::copy::copy_bytes;

/// Streams not leased by any [`Copier`]: `(ordinal, stream)`. Streams live as long as the process.
static IDLE_STREAMS: Mutex<Vec<(u32, StreamId)>> = Mutex::new(Vec::new());
/// Idle streams kept; more (a burst of copy threads) are destroyed on return.
const MAX_IDLE_STREAMS: usize = 64;

/// Queues device copies for one thread: one leased stream per device used, one synchronize
/// for everything queued ([`Copier::sync`]).
///
/// Copies are collected and issued at [`Copier::flush`] (or `sync`), coalesced: a vLLM batch is
/// `objects x layers x K/V` pieces of one block each, and one driver call per piece costs more
/// than the DMA of 32 KiB. Sorted by device address, the same piece of consecutive blocks forms
/// a run with one pitch on the device (the block size) and one in host memory (the object
/// stride, where the objects were placed back to back), which is one 2D copy; runs contiguous
/// on both sides are one plain copy. Copies of one flush may therefore run in any order: no
/// caller queues two copies that depend on each other before a flush.
///
/// Dropping a copier waits for copies already issued, so host buffers they use are never
/// released under a running DMA; copies queued but never flushed are dropped, never issued.
pub struct Copier {
    layer: &'static dyn DeviceLayer,
    /// `(ordinal, stream, has issued work)`.
    streams: Vec<(u32, StreamId, bool)>,
    /// Copies queued since the last flush.
    pending: Vec<Pending>,
    /// How many of them each request queued.
    shape: Shape,
    /// The ordinal whose context is current on this thread.
    bound: Option<u32>,
    /// What was current on this thread before the first bind; restored on drop.
    saved: Option<u64>,
    /// A copier is used by the thread that made it (its contexts are current there).
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Copier {
    /// A copier, or `None` when no backend is loaded.
    pub fn new() -> Option<Copier> {
        layer().map(|layer| Copier {
            layer,
            streams: Vec::new(),
            pending: Vec::new(),
            shape: Shape::default(),
            bound: None,
            saved: None,
            _not_send: std::marker::PhantomData,
        })
    }

    fn stream(&mut self, ordinal: u32) -> Result<usize, DeviceError> {
        self.bind(ordinal)?;
        if let Some(i) = self.streams.iter().position(|s| s.0 == ordinal) {
            return Ok(i);
        }
        let leased = {
            let mut idle = IDLE_STREAMS.lock();
            idle.iter()
                .position(|s| s.0 == ordinal)
                .map(|i| idle.swap_remove(i).1)
        };
        let s = match leased {
            Some(s) => s,
            None => self.layer.stream_create(ordinal)?,
        };
        self.streams.push((ordinal, s, false));
        Ok(self.streams.len() - 1)
    }

    fn bind(&mut self, ordinal: u32) -> Result<(), DeviceError> {
        if self.bound != Some(ordinal) {
            let prev = self.layer.bind_thread(ordinal)?;
            self.saved.get_or_insert(prev);
            self.bound = Some(ordinal);
        }
        Ok(())
    }

    /// Queues a device-to-host copy of `len` bytes from device address `src` to `dst` (issued
    /// at the next [`Copier::flush`] or [`Copier::sync`]).
    ///
    /// # Safety
    /// `dst` must be valid for `len` writes and not read until [`Copier::sync`]; `src` must be
    /// device memory of `ordinal`.
    pub unsafe fn d2h(
        &mut self,
        ordinal: u32,
        dst: *mut u8,
        src: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.pending.push(Pending {
            ordinal,
            dir: CopyDir::DeviceToHost,
            dev: src,
            host: dst as usize,
            len,
        });
        Ok(())
    }

    /// Queues a host-to-device copy of `len` bytes from `src` to device address `dst` (issued
    /// at the next [`Copier::flush`] or [`Copier::sync`]).
    ///
    /// # Safety
    /// `src` must stay valid and unmodified until [`Copier::sync`]; `dst` must be device memory
    /// of `ordinal`.
    pub unsafe fn h2d(
        &mut self,
        ordinal: u32,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.pending.push(Pending {
            ordinal,
            dir: CopyDir::HostToDevice,
            dev: dst,
            host: src as usize,
            len,
        });
        Ok(())
    }

    /// Issues every queued copy to the device, coalesced into as few driver calls as the
    /// addresses allow, without waiting for them (a pipeline starts the DMA of one chunk before
    /// the socket I/O of the previous one). On an error, copies not issued yet are dropped.
    pub fn flush(&mut self) -> Result<(), DeviceError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending);
        let shape = std::mem::take(&mut self.shape);
        if !coalescing() {
            for p in &pending {
                self.issue(Run::single(p))?;
            }
            return Ok(());
        }
        for run in coalesce(pending, shape) {
            self.issue(run)?;
        }
        Ok(())
    }

    fn issue(&mut self, r: Run) -> Result<(), DeviceError> {
        let i = self.stream(r.ordinal)?;
        self.streams[i].2 = true;
        let s = self.streams[i].1;
        let (dst, dst_pitch, src, src_pitch) = match r.dir {
            CopyDir::DeviceToHost => (r.host, r.host_pitch, r.dev, r.dev_pitch),
            CopyDir::HostToDevice => (r.dev, r.dev_pitch, r.host, r.host_pitch),
        };
        // SAFETY: every row is a copy a caller queued with d2h/h2d under their contracts.
        unsafe {
            if r.height == 1 {
                self.layer.copy_async(s, r.dir, dst, src, r.len)
            } else if dst_pitch == r.len && src_pitch == r.len {
                // Contiguous on both sides: one plain copy.
                self.layer.copy_async(s, r.dir, dst, src, r.len * r.height)
            } else {
                copy_2d(
                    self.layer,
                    s,
                    r.dir,
                    Rect {
                        dst,
                        dst_pitch,
                        src,
                        src_pitch,
                        width: r.len,
                        height: r.height,
                    },
                )
            }
        }
    }

    /// Issues what is queued ([`Copier::flush`]) and waits for every copy issued so far (one
    /// synchronize per stream that has work).
    pub fn sync(&mut self) -> Result<(), DeviceError> {
        let mut first = self.flush().err();
        for k in 0..self.streams.len() {
            let (ordinal, s, queued) = self.streams[k];
            if !queued {
                continue;
            }
            if let Err(e) = self.bind(ordinal) {
                first.get_or_insert(e);
                continue;
            }
            if let Err(e) = self.layer.synchronize(s) {
                first.get_or_insert(e);
            }
            self.streams[k].2 = false;
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        // Never issued: nothing reads or writes their buffers, and an error path may be
        // releasing them.
        self.pending.clear();
        if self.streams.iter().any(|s| s.2)
            && let Err(e) = self.sync()
        {
            tracing::warn!("device copies left queued by a failed transfer: {e}");
        }
        let mut idle = IDLE_STREAMS.lock();
        for (ordinal, s, _) in self.streams.drain(..) {
            if idle.len() < MAX_IDLE_STREAMS {
                idle.push((ordinal, s));
            } else {
                self.layer.stream_destroy(s);
            }
        }
        drop(idle);
        if let Some(prev) = self.saved.take() {
            self.layer.restore_thread(prev);
        }
    }
}

/// Copies bytes `[from, from+len)` of the concatenation of `src` pieces to host memory at
/// `dst`: host pieces by the CPU now, device pieces queued on `c` (valid after `c.sync()`).
///
/// # Safety
/// `dst` must be valid for `len` writes and must not overlap any device piece's DMA target;
/// the pieces must be what they are classified as.
pub(crate) unsafe fn gather(
    c: &mut Copier,
    dst: *mut u8,
    src: &[&[u8]],
    from: usize,
    len: usize,
) -> Result<(), DeviceError> {
    let mut at = 0usize; // offset of the current piece in the concatenation
    let mut out = 0usize; // bytes produced
    let queued = c.pending.len();
    for p in src {
        if out == len {
            break;
        }
        let (start, end) = (at, at + p.len());
        at = end;
        if end <= from {
            continue;
        }
        let skip = from.saturating_sub(start);
        let n = (p.len() - skip).min(len - out);
        let s = p.as_ptr() as usize + skip;
        // SAFETY: dst+out..+n is inside the caller's `len` bytes; s..s+n is inside piece `p`.
        unsafe {
            match device_of(p) {
                Some(ordinal) => c.d2h(ordinal, dst.add(out), s, n)?,
                None => copy_bytes(dst.add(out), s as *const u8, n),
            }
        }
        out += n;
    }
    c.shape.note(c.pending.len() - queued);
    Ok(())
}

/// Copies host memory at `src` (`len` bytes) into bytes `[from, from+len)` of the concatenation
/// of `dst` pieces: host pieces by the CPU now, device pieces queued on `c`.
///
/// # Safety
/// `src` must be valid for `len` reads and stay unmodified until `c.sync()`.
pub(crate) unsafe fn scatter(
    c: &mut Copier,
    src: *const u8,
    dst: &mut [&mut [u8]],
    from: usize,
    len: usize,
) -> Result<(), DeviceError> {
    let mut at = 0usize;
    let mut done = 0usize;
    let queued = c.pending.len();
    for p in dst.iter_mut() {
        if done == len {
            break;
        }
        let (start, end) = (at, at + p.len());
        at = end;
        if end <= from {
            continue;
        }
        let skip = from.saturating_sub(start);
        let n = (p.len() - skip).min(len - done);
        let d = p.as_mut_ptr() as usize + skip;
        // SAFETY: src+done..+n is inside the caller's `len` bytes; d..d+n is inside piece `p`.
        unsafe {
            match device_of(p) {
                Some(ordinal) => c.h2d(ordinal, d, src.add(done), n)?,
                None => copy_bytes(d as *mut u8, src.add(done), n),
            }
        }
        done += n;
    }
    c.shape.note(c.pending.len() - queued);
    Ok(())
}

/// Copies `src` into caller memory at `dst`, host or device, and waits for it.
///
/// # Safety
/// `[dst, dst+src.len())` must be writable caller memory (host or device) not otherwise
/// referenced during the call.
pub unsafe fn write_to(dst: usize, src: &[u8]) -> Result<(), DeviceError> {
    // SAFETY: forwarded from the caller; `src` is valid for its length.
    let mut d = [unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, src.len()) }];
    match Copier::new() {
        Some(mut c) if any_device_mut(&d) => {
            // SAFETY: `src` stays borrowed (unmodified) until the sync.
            unsafe { scatter(&mut c, src.as_ptr(), &mut d, 0, src.len()) }?;
            c.sync()
        }
        _ => {
            d[0].copy_from_slice(src);
            Ok(())
        }
    }
}

/// Copies caller memory at `src` (host or device) into `dst`, and waits for it.
///
/// # Safety
/// `[src, src+dst.len())` must be readable caller memory (host or device).
pub unsafe fn read_from(src: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
    // SAFETY: forwarded from the caller.
    let s = [unsafe { std::slice::from_raw_parts(src as *const u8, dst.len()) }];
    match Copier::new() {
        Some(mut c) if any_device(&s) => {
            // SAFETY: `dst` is exclusively borrowed and not read before the sync.
            unsafe { gather(&mut c, dst.as_mut_ptr(), &s, 0, dst.len()) }?;
            c.sync()
        }
        _ => {
            dst.copy_from_slice(s[0]);
            Ok(())
        }
    }
}
