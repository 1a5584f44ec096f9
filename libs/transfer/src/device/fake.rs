//! The device test double (`LUNAKV_DEVICE=fake`): "device" memory the CPU cannot touch, so a
//! CI machine without a GPU proves that no data path dereferences a device pointer.
//!
//! - [`alloc`] maps a memfd twice: the address it returns is a `PROT_NONE` mapping (any CPU
//!   access is SIGSEGV, as for a CUDA address, whose range is likewise reserved but not
//!   CPU-mapped), and a second, read-write mapping of the same pages is the "device side" its
//!   copies use.
//! - Copies are queued per stream and only run at [`DeviceLayer::synchronize`], as a real DMA
//!   may finish any time before it: a path that uses bytes before synchronizing reads stale
//!   ones and fails its test.
//! - [`stats`] counts copies, synchronizations and pins, so tests can assert the shape of a
//!   path (one DMA per piece, no bounce buffer, pinned segments).
//! - It refuses, as [`DeviceError::Refused2d`], the 2D copies an H200 refused: rows spanning two
//!   allocations, and rows whose host side spans two pinned ranges (an embedded owner's segment
//!   is pinned in 64 MiB granules), so the split of `device::copy_2d` runs on CI.
//! - It times its copies ([`FakeStats::copy_ns`]: wall time during which any stream was
//!   copying), so a benchmark can tell the copies from everything else in a call.
//! - `fake-blind` is the same double, but tells the data path that every address is host
//!   memory: the copy then dereferences the `PROT_NONE` address and the process dies, which
//!   is what a host-only data path does on a GPU.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};
use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

use super::{CopyDir, DeviceError, DeviceLayer, MemKind, StreamId};

struct Alloc {
    len: usize,
    /// The read-write mapping of the same pages ("device side").
    shadow: usize,
    _fd: OwnedFd,
}

/// One queued copy: host-visible addresses on both sides, `rows` rows of `len` bytes (a plain
/// copy is one row). A 2D copy is one entry, as it is one driver call: queueing it row by row
/// would put the double's own per-row work into the overhead `lunakv bench --device` measures.
struct Op {
    dst: usize,
    src: usize,
    len: usize,
    rows: usize,
    dst_pitch: usize,
    src_pitch: usize,
}

impl Op {
    fn plain(dst: usize, src: usize, len: usize) -> Op {
        Op {
            dst,
            src,
            len,
            rows: 1,
            dst_pitch: len,
            src_pitch: len,
        }
    }
}

/// Counters of the double, for tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FakeStats {
    pub d2h_copies: u64,
    pub h2d_copies: u64,
    pub d2h_bytes: u64,
    pub h2d_bytes: u64,
    pub syncs: u64,
    /// 2D copy calls ([`DeviceLayer::copy_2d_async`]) taken as one; each row also counts in
    /// the copies.
    pub copies_2d: u64,
    /// Copy calls queued: plain copies and the 2D copies taken, one each whatever their rows
    /// (what a driver charges per call).
    pub copy_calls: u64,
    /// 2D copy calls refused ([`DeviceError::Refused2d`]): nothing queued, the caller splits.
    pub refused_2d: u64,
    /// Wall nanoseconds during which at least one stream was running its copies (at
    /// synchronize): the double's stand-in for the time a GPU spends in DMA.
    pub copy_ns: u64,
    pub pins: u64,
    pub unpins: u64,
    /// Host bytes pinned now.
    pub pinned_bytes: u64,
    pub streams: u64,
}

#[derive(Default)]
struct Counters {
    d2h_copies: AtomicU64,
    h2d_copies: AtomicU64,
    d2h_bytes: AtomicU64,
    h2d_bytes: AtomicU64,
    syncs: AtomicU64,
    copies_2d: AtomicU64,
    copy_calls: AtomicU64,
    refused_2d: AtomicU64,
    pins: AtomicU64,
    unpins: AtomicU64,
    streams: AtomicU64,
}

/// The test double. Device ordinal 0 only.
pub struct Fake {
    blind: bool,
    allocs: RwLock<BTreeMap<usize, Alloc>>,
    pinned: Mutex<BTreeMap<usize, usize>>,
    queues: Mutex<HashMap<StreamId, Vec<Op>>>,
    next_stream: AtomicU64,
    counters: Counters,
    copying: Mutex<CopyClock>,
}

/// Wall time during which any stream copies: copies of parallel streams overlap, and a
/// benchmark subtracts copy time from a call's wall time.
#[derive(Default)]
struct CopyClock {
    active: usize,
    since: Option<std::time::Instant>,
    total_ns: u64,
}

impl Fake {
    pub fn new(blind: bool) -> Fake {
        Fake {
            blind,
            allocs: RwLock::new(BTreeMap::new()),
            pinned: Mutex::new(BTreeMap::new()),
            queues: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            counters: Counters::default(),
            copying: Mutex::new(CopyClock::default()),
        }
    }

    /// Allocates `len` bytes of "device" memory; returns its (CPU-inaccessible) address.
    pub fn alloc(&self, len: usize) -> Result<usize, DeviceError> {
        if len == 0 {
            return Err(DeviceError::Invalid("device_alloc of 0 bytes".into()));
        }
        let err = |what: &str, e: rustix::io::Errno| {
            DeviceError::Invalid(format!("fake device_alloc({len}): {what}: {e}"))
        };
        let fd = memfd_create("lunakv-fake-device", MemfdFlags::CLOEXEC)
            .map_err(|e| err("memfd_create", e))?;
        ftruncate(&fd, len as u64).map_err(|e| err("ftruncate", e))?;
        // SAFETY: fresh kernel-chosen mappings of a memfd at least `len` long; they alias only
        // each other, which is the point (two views of the same pages).
        let (dev, shadow) = unsafe {
            let dev = mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::empty(),
                MapFlags::SHARED,
                &fd,
                0,
            )
            .map_err(|e| err("mmap PROT_NONE", e))?;
            let shadow = match mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            ) {
                Ok(p) => p,
                Err(e) => {
                    let _ = munmap(dev, len);
                    return Err(err("mmap shadow", e));
                }
            };
            (dev as usize, shadow as usize)
        };
        self.allocs.write().insert(
            dev,
            Alloc {
                len,
                shadow,
                _fd: fd,
            },
        );
        Ok(dev)
    }

    /// Frees an allocation by its start address.
    pub fn free(&self, addr: usize) -> Result<(), DeviceError> {
        let a = self.allocs.write().remove(&addr).ok_or_else(|| {
            DeviceError::Invalid(format!("{addr:#x} is not a fake device allocation"))
        })?;
        // SAFETY: both mappings were made by `alloc` with these lengths and are no longer
        // reachable through the table; the caller promises no copy uses them any more.
        unsafe {
            let _ = munmap(addr as *mut _, a.len);
            let _ = munmap(a.shadow as *mut _, a.len);
        }
        Ok(())
    }

    /// The shadow address of device range `[addr, addr+len)`, if it lies in one allocation.
    fn shadow(&self, addr: usize, len: usize) -> Option<usize> {
        let a = self.allocs.read();
        let (&start, al) = a.range(..=addr).next_back()?;
        let off = addr - start;
        (off < al.len && len <= al.len - off).then_some(al.shadow + off)
    }

    /// Copies device bytes out through the shadow mapping (test helper, synchronous).
    pub fn read(&self, addr: usize, len: usize) -> Result<Vec<u8>, DeviceError> {
        let s = self.shadow(addr, len).ok_or_else(|| outside(addr, len))?;
        let mut v = vec![0u8; len];
        // SAFETY: `shadow` proved the range lies inside a live read-write mapping.
        unsafe { std::ptr::copy_nonoverlapping(s as *const u8, v.as_mut_ptr(), len) };
        Ok(v)
    }

    /// Copies bytes into device memory through the shadow mapping (test helper, synchronous).
    pub fn write(&self, addr: usize, bytes: &[u8]) -> Result<(), DeviceError> {
        let s = self
            .shadow(addr, bytes.len())
            .ok_or_else(|| outside(addr, bytes.len()))?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), s as *mut u8, bytes.len()) };
        Ok(())
    }

    /// How many pinned ranges `[addr, addr+len)` overlaps.
    fn pinned_ranges(&self, addr: usize, len: usize) -> usize {
        let p = self.pinned.lock();
        let end = addr.saturating_add(len);
        let first = p
            .range(..=addr)
            .next_back()
            .filter(|(s, l)| *s + *l > addr)
            .map_or(addr, |(s, _)| *s);
        p.range(first..end).filter(|(s, l)| *s + *l > addr).count()
    }

    pub fn stats(&self) -> FakeStats {
        let c = &self.counters;
        FakeStats {
            d2h_copies: c.d2h_copies.load(Ordering::Relaxed),
            h2d_copies: c.h2d_copies.load(Ordering::Relaxed),
            d2h_bytes: c.d2h_bytes.load(Ordering::Relaxed),
            h2d_bytes: c.h2d_bytes.load(Ordering::Relaxed),
            syncs: c.syncs.load(Ordering::Relaxed),
            copies_2d: c.copies_2d.load(Ordering::Relaxed),
            copy_calls: c.copy_calls.load(Ordering::Relaxed),
            refused_2d: c.refused_2d.load(Ordering::Relaxed),
            copy_ns: {
                let k = self.copying.lock();
                k.total_ns + k.since.map_or(0, |t| t.elapsed().as_nanos() as u64)
            },
            pins: c.pins.load(Ordering::Relaxed),
            unpins: c.unpins.load(Ordering::Relaxed),
            pinned_bytes: self.pinned.lock().values().map(|&l| l as u64).sum(),
            streams: c.streams.load(Ordering::Relaxed),
        }
    }
}

fn outside(addr: usize, len: usize) -> DeviceError {
    DeviceError::Invalid(format!(
        "[{addr:#x}, +{len}) is not inside one fake device allocation"
    ))
}

impl DeviceLayer for &'static Fake {
    fn name(&self) -> &'static str {
        if self.blind { "fake-blind" } else { "fake" }
    }

    fn classify(&self, addr: usize) -> Result<MemKind, DeviceError> {
        if self.shadow(addr, 0).is_some() || self.shadow(addr, 1).is_some() {
            return Ok(MemKind::Device { ordinal: 0 });
        }
        let p = self.pinned.lock();
        if let Some((&start, &len)) = p.range(..=addr).next_back()
            && addr - start < len
        {
            return Ok(MemKind::HostRegistered);
        }
        Ok(MemKind::Host)
    }

    fn blind(&self) -> bool {
        self.blind
    }

    fn bind_thread(&self, ordinal: u32) -> Result<u64, DeviceError> {
        if ordinal != 0 {
            return Err(DeviceError::Invalid(format!(
                "the fake device has ordinal 0 only, not {ordinal}"
            )));
        }
        Ok(0)
    }

    fn restore_thread(&self, _previous: u64) {}

    fn stream_create(&self, ordinal: u32) -> Result<StreamId, DeviceError> {
        self.bind_thread(ordinal)?;
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        self.queues.lock().insert(id, Vec::new());
        self.counters.streams.fetch_add(1, Ordering::Relaxed);
        Ok(id)
    }

    fn stream_destroy(&self, stream: StreamId) {
        self.queues.lock().remove(&stream);
    }

    unsafe fn copy_async(
        &self,
        stream: StreamId,
        dir: CopyDir,
        dst: usize,
        src: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        let op = match dir {
            CopyDir::DeviceToHost => {
                let s = self.shadow(src, len).ok_or_else(|| outside(src, len))?;
                self.counters.d2h_copies.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .d2h_bytes
                    .fetch_add(len as u64, Ordering::Relaxed);
                Op::plain(dst, s, len)
            }
            CopyDir::HostToDevice => {
                let d = self.shadow(dst, len).ok_or_else(|| outside(dst, len))?;
                self.counters.h2d_copies.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .h2d_bytes
                    .fetch_add(len as u64, Ordering::Relaxed);
                Op::plain(d, src, len)
            }
        };
        self.queues
            .lock()
            .get_mut(&stream)
            .ok_or_else(|| DeviceError::Invalid(format!("unknown fake stream {stream}")))?
            .push(op);
        self.counters.copy_calls.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// One call (counted in `copies_2d`), or refused as the H200 refused: device rows in two
    /// allocations, or host rows over two pinned ranges.
    unsafe fn copy_2d_async(
        &self,
        stream: StreamId,
        dir: CopyDir,
        rect: super::Rect,
    ) -> Result<(), DeviceError> {
        let super::Rect {
            dst,
            dst_pitch,
            src,
            src_pitch,
            width,
            height,
        } = rect;
        if height == 0 || dst_pitch < width || src_pitch < width {
            return Err(DeviceError::Invalid(format!(
                "fake 2D copy: {height} rows of {width} bytes with pitches {src_pitch}/{dst_pitch}"
            )));
        }
        let ((dev, dev_pitch), (host, host_pitch)) = match dir {
            CopyDir::DeviceToHost => ((src, src_pitch), (dst, dst_pitch)),
            CopyDir::HostToDevice => ((dst, dst_pitch), (src, src_pitch)),
        };
        let span = |pitch: usize| (height - 1) * pitch + width;
        let shadow = match self.shadow(dev, span(dev_pitch)) {
            Some(s) if self.pinned_ranges(host, span(host_pitch)) <= 1 => s,
            found => {
                let why = match found {
                    None => "device rows span two allocations",
                    Some(_) => "host rows span two pinned ranges",
                };
                self.counters.refused_2d.fetch_add(1, Ordering::Relaxed);
                return Err(DeviceError::Refused2d {
                    height,
                    why: why.into(),
                });
            }
        };
        // The device span lies inside one allocation, so each row's shadow is one pitch on;
        // the host side is the caller's (copy_2d_async's contract).
        let (copies, bytes, op) = match dir {
            CopyDir::DeviceToHost => (
                &self.counters.d2h_copies,
                &self.counters.d2h_bytes,
                Op {
                    dst,
                    src: shadow,
                    len: width,
                    rows: height,
                    dst_pitch,
                    src_pitch,
                },
            ),
            CopyDir::HostToDevice => (
                &self.counters.h2d_copies,
                &self.counters.h2d_bytes,
                Op {
                    dst: shadow,
                    src,
                    len: width,
                    rows: height,
                    dst_pitch,
                    src_pitch,
                },
            ),
        };
        self.queues
            .lock()
            .get_mut(&stream)
            .ok_or_else(|| DeviceError::Invalid(format!("unknown fake stream {stream}")))?
            .push(op);
        self.counters.copies_2d.fetch_add(1, Ordering::Relaxed);
        self.counters.copy_calls.fetch_add(1, Ordering::Relaxed);
        copies.fetch_add(height as u64, Ordering::Relaxed);
        bytes.fetch_add((height * width) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn synchronize(&self, stream: StreamId) -> Result<(), DeviceError> {
        let ops = match self.queues.lock().get_mut(&stream) {
            Some(q) => std::mem::take(q),
            None => {
                return Err(DeviceError::Invalid(format!(
                    "unknown fake stream {stream}"
                )));
            }
        };
        self.counters.syncs.fetch_add(1, Ordering::Relaxed);
        if ops.is_empty() {
            return Ok(());
        }
        {
            let mut k = self.copying.lock();
            k.active += 1;
            k.since.get_or_insert_with(std::time::Instant::now);
        }
        for op in ops {
            for r in 0..op.rows {
                let (src, dst) = (op.src + r * op.src_pitch, op.dst + r * op.dst_pitch);
                // SAFETY: the device side was checked inside a live allocation when queued;
                // the host side is valid until this synchronize (copy_async's contract).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, op.len) };
            }
        }
        let mut k = self.copying.lock();
        k.active -= 1;
        if k.active == 0
            && let Some(t) = k.since.take()
        {
            k.total_ns += t.elapsed().as_nanos() as u64;
        }
        Ok(())
    }

    unsafe fn pin(&self, addr: usize, len: usize) -> Result<(), DeviceError> {
        let mut p = self.pinned.lock();
        let end = addr.saturating_add(len);
        if let Some((&s, &l)) = p.range(..end).next_back()
            && s + l > addr
        {
            // cuMemHostRegister answers CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED.
            return Err(DeviceError::Driver {
                call: "cuMemHostRegister",
                error: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED".into(),
            });
        }
        p.insert(addr, len);
        self.counters.pins.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn unpin(&self, addr: usize) -> Result<(), DeviceError> {
        match self.pinned.lock().remove(&addr) {
            Some(_) => {
                self.counters.unpins.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            None => Err(DeviceError::Driver {
                call: "cuMemHostUnregister",
                error: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED".into(),
            }),
        }
    }
}

/// The double the process uses, set by [`install`] or by `LUNAKV_DEVICE=fake`.
static INSTANCE: std::sync::OnceLock<Fake> = std::sync::OnceLock::new();

/// Makes the double the process's device layer (`blind` as `fake-blind`). Fails when another
/// layer was chosen already; installing the same kind again returns the installed double.
pub fn install(blind: bool) -> Result<&'static Fake, DeviceError> {
    let f = INSTANCE.get_or_init(|| Fake::new(blind));
    match super::install(Box::new(f)) {
        Ok(()) => Ok(f),
        Err(e) => active().map_err(|_| e),
    }
}

/// What `LUNAKV_DEVICE=fake` / `fake-blind` loads.
pub(super) fn from_env(blind: bool) -> Box<dyn DeviceLayer> {
    Box::new(INSTANCE.get_or_init(|| Fake::new(blind)))
}

/// The process's double, or an error naming how to select it.
pub fn active() -> Result<&'static Fake, DeviceError> {
    let name = super::layer_name();
    match INSTANCE.get() {
        Some(f) if name == f.name() => Ok(f),
        _ => Err(DeviceError::Invalid(format!(
            "the device layer is '{name}', not the test double: set {}=fake before the first transfer",
            super::DEVICE_ENV
        ))),
    }
}

/// [`Fake::alloc`] on the active double.
pub fn alloc(len: usize) -> Result<usize, DeviceError> {
    active()?.alloc(len)
}

/// [`Fake::free`] on the active double.
pub fn free(addr: usize) -> Result<(), DeviceError> {
    active()?.free(addr)
}

/// [`Fake::read`] on the active double.
pub fn read(addr: usize, len: usize) -> Result<Vec<u8>, DeviceError> {
    active()?.read(addr, len)
}

/// [`Fake::write`] on the active double.
pub fn write(addr: usize, bytes: &[u8]) -> Result<(), DeviceError> {
    active()?.write(addr, bytes)
}

/// [`Fake::stats`] of the active double.
pub fn stats() -> Result<FakeStats, DeviceError> {
    Ok(active()?.stats())
}

/// vLLM's KV cache on the active double: one allocation per layer shaped `(K/V, blocks,
/// block_bytes)`, freed on drop. Its pieces are slices over device memory for the store and
/// transfer APIs, which copy them through the device layer: a CPU read of one is SIGSEGV, which
/// is the double's point (benchmarks and tools without `unsafe` of their own use this).
pub struct FakeKvCache {
    f: &'static Fake,
    tensors: Vec<usize>,
    blocks: usize,
    block_bytes: usize,
}

impl FakeKvCache {
    pub fn new(layers: usize, blocks: usize, block_bytes: usize) -> Result<Self, DeviceError> {
        let f = active()?;
        let mut c = FakeKvCache {
            f,
            tensors: Vec::with_capacity(layers),
            blocks,
            block_bytes,
        };
        for _ in 0..layers {
            let t = f.alloc(2 * blocks * block_bytes)?;
            c.tensors.push(t);
        }
        Ok(c)
    }

    /// Start addresses of the layers' tensors (what vLLM registers).
    pub fn tensors(&self) -> &[usize] {
        &self.tensors
    }

    /// Bytes of one layer's tensor.
    pub fn tensor_bytes(&self) -> usize {
        2 * self.blocks * self.block_bytes
    }

    /// Writes a layer's whole tensor (test data; through the double's second mapping).
    pub fn write_layer(&self, layer: usize, bytes: &[u8]) -> Result<(), DeviceError> {
        self.f.write(self.tensor(layer)?, bytes)
    }

    /// Reads a layer's whole tensor (through the double's second mapping).
    pub fn read_layer(&self, layer: usize) -> Result<Vec<u8>, DeviceError> {
        self.f.read(self.tensor(layer)?, self.tensor_bytes())
    }

    fn tensor(&self, layer: usize) -> Result<usize, DeviceError> {
        self.tensors.get(layer).copied().ok_or_else(|| {
            DeviceError::Invalid(format!(
                "layer {layer} of a fake KV cache of {} layers",
                self.tensors.len()
            ))
        })
    }

    fn piece_addrs(&self, block: usize) -> impl Iterator<Item = usize> + '_ {
        assert!(block < self.blocks, "block {block} of {}", self.blocks);
        let (n, bb) = (self.blocks, self.block_bytes);
        self.tensors
            .iter()
            .flat_map(move |&t| (0..2).map(move |k| t + (k * n + block) * bb))
    }

    /// Per block of `blocks`, its pieces as vLLM hands them to `batch_put_from_multi_buffers`:
    /// per layer, its K block then its V block.
    pub fn pieces(&self, blocks: std::ops::Range<usize>) -> Vec<Vec<&[u8]>> {
        let bb = self.block_bytes;
        blocks
            .map(|b| {
                self.piece_addrs(b)
                    // SAFETY: inside a live allocation of this cache (freed only on drop, after
                    // the borrow); device memory, handed only to APIs that copy it by "DMA".
                    .map(|a| unsafe { std::slice::from_raw_parts(a as *const u8, bb) })
                    .collect()
            })
            .collect()
    }

    /// As [`FakeKvCache::pieces`], as load targets (`batch_get_into_multi_buffers`). Distinct
    /// blocks never overlap, and `&mut self` keeps any other borrow out.
    pub fn pieces_mut(&mut self, blocks: std::ops::Range<usize>) -> Vec<Vec<&mut [u8]>> {
        let bb = self.block_bytes;
        blocks
            .map(|b| {
                self.piece_addrs(b)
                    // SAFETY: as in `pieces`; the ranges of distinct (block, layer, K/V) are
                    // disjoint and the cache is borrowed mutably for their lifetime.
                    .map(|a| unsafe { std::slice::from_raw_parts_mut(a as *mut u8, bb) })
                    .collect()
            })
            .collect()
    }
}

impl Drop for FakeKvCache {
    fn drop(&mut self) {
        for &t in &self.tensors {
            let _ = self.f.free(t);
        }
    }
}
