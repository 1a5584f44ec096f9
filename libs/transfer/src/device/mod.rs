//! Device memory (GPU) on the data path: engines hand lunakv CUDA device addresses (vLLM's KV
//! cache), which the CPU must never dereference. See docs/GPU.md.
//!
//! - [`DeviceLayer`] is the one small trait a backend implements: classify an address, copy
//!   device<->host asynchronously on a stream, synchronize, pin/unpin a host range. CUDA
//!   ([`cuda`], the driver API loaded at run time) is the first backend; the test double
//!   ([`fake`], `LUNAKV_DEVICE=fake`) is the second. ROCm/HIP would be a third with the same calls.
//! - [`layer`] is the process's backend, chosen once (`LUNAKV_DEVICE`, default: CUDA if
//!   libcuda.so.1 loads). Without one every address is [`MemKind::Host`] at the cost of one
//!   atomic load: no syscall, no lookup.
//! - Buffers the engine registers up front (`register_buffer`, `register_memory`) are classified
//!   once ([`register_range`]) and looked up afterwards; only unregistered addresses cost a
//!   driver call per piece, and only when a backend is loaded.
//! - [`Copier`] leases one stream per device for the thread that copies, queues copies and
//!   synchronizes once for everything it queued.
//!
//! Caller pieces stay `&[u8]` / `&mut [u8]` through the transfer API; a slice over device memory
//! is only ever handed to the functions here, which never dereference it on the CPU.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use lunakv_config::switched_on;
use parking_lot::{Mutex, RwLock};

pub mod cuda;
pub mod fake;
pub(crate) mod staging;

use crate::copy::copy_bytes;

/// Selects the device backend: unset or `auto` (CUDA when libcuda.so.1 loads, else none),
/// `cuda` (as auto, but a failure to load is logged as a warning), `off`/`none` (host only),
/// `fake` (the test double of [`fake`]), `fake-blind` (the test double, but the data path is told
/// every address is host memory: tests use it to prove a host-only path crashes).
pub const DEVICE_ENV: &str = "LUNAKV_DEVICE";

/// Where an address lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Ordinary host memory (pageable).
    Host,
    /// Host memory the device can reach by DMA (pinned: cudaHostAlloc, cuMemHostRegister).
    /// The CPU reads it like any host memory.
    HostRegistered,
    /// Device memory of GPU `ordinal`: the CPU must not touch it.
    Device { ordinal: u32 },
}

impl MemKind {
    pub fn is_device(self) -> bool {
        matches!(self, MemKind::Device { .. })
    }
}

/// Direction of a device copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDir {
    DeviceToHost,
    HostToDevice,
}

/// A backend's stream handle (a `CUstream` for CUDA).
pub type StreamId = u64;

/// Errors of the device layer.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The backend library could not be loaded or lacks a symbol.
    #[error("device backend unavailable: {0}")]
    Unavailable(String),
    /// A driver call failed: `(call, driver's error name)`.
    #[error(
        "{call} failed: {error}; check the GPU is healthy (nvidia-smi) and the buffer is live device memory"
    )]
    Driver { call: &'static str, error: String },
    /// A request the layer refuses (test double misuse, bad range).
    #[error("{0}")]
    Invalid(String),
    /// A 2D copy the backend would not take as one call, with nothing queued; `copy_2d`
    /// splits such a run into parts it takes.
    #[error("2D copy of {height} rows refused: {why}")]
    Refused2d { height: usize, why: String },
}

/// What a device backend does. Small on purpose: a ROCm/HIP backend maps each call to one HIP
/// runtime call.
pub trait DeviceLayer: Send + Sync + 'static {
    /// Short name for logs ("cuda", "fake").
    fn name(&self) -> &'static str;
    /// Where `addr` lives. Plain host memory is `Ok(Host)`, never an error.
    fn classify(&self, addr: usize) -> Result<MemKind, DeviceError>;
    /// Makes device `ordinal`'s context current on the calling thread (CUDA: its primary
    /// context, the one torch uses). Streams of that device are used only after this. Returns
    /// what was current before, for [`DeviceLayer::restore_thread`].
    fn bind_thread(&self, ordinal: u32) -> Result<u64, DeviceError>;
    /// Makes `previous` (from [`DeviceLayer::bind_thread`]) current again, so the caller's
    /// thread (torch's, with its own current device) is left as it was.
    fn restore_thread(&self, previous: u64);
    /// A new stream on device `ordinal`; call after binding `ordinal` on this thread.
    fn stream_create(&self, ordinal: u32) -> Result<StreamId, DeviceError>;
    fn stream_destroy(&self, stream: StreamId);
    /// Queues a copy of `len` bytes from `src` to `dst` on `stream`.
    ///
    /// # Safety
    /// The host side must stay valid (and, for DeviceToHost, unread) until the stream is
    /// synchronized; the device side must be live device memory of the stream's device.
    unsafe fn copy_async(
        &self,
        stream: StreamId,
        dir: CopyDir,
        dst: usize,
        src: usize,
        len: usize,
    ) -> Result<(), DeviceError>;
    /// Queues `r.height` copies of `r.width` bytes on `stream`: row `i` goes from
    /// `r.src + i * r.src_pitch` to `r.dst + i * r.dst_pitch` (CUDA: one `cuMemcpy2DAsync`). This is
    /// how a batch of vLLM blocks moves in a few calls instead of one per piece
    /// ([`Copier::flush`]). The default queues one [`DeviceLayer::copy_async`] per row.
    ///
    /// A backend answers [`DeviceError::Refused2d`], queuing nothing, for a shape it does not
    /// take as one call; callers go through `copy_2d`, which splits such runs.
    ///
    /// # Safety
    /// As [`DeviceLayer::copy_async`], for every row; both pitches are at least `width`.
    unsafe fn copy_2d_async(
        &self,
        stream: StreamId,
        dir: CopyDir,
        r: Rect,
    ) -> Result<(), DeviceError> {
        // SAFETY: forwarded from the caller.
        unsafe { copy_rows(self, stream, dir, r) }
    }
    /// Waits for everything queued on `stream`.
    fn synchronize(&self, stream: StreamId) -> Result<(), DeviceError>;
    /// Pins `[addr, addr+len)` of host memory for DMA (CUDA: cuMemHostRegister, portable).
    ///
    /// # Safety
    /// The range must be mapped host memory that stays mapped until [`DeviceLayer::unpin`].
    unsafe fn pin(&self, addr: usize, len: usize) -> Result<(), DeviceError>;
    /// Undoes [`DeviceLayer::pin`] of the range starting at `addr`.
    ///
    /// # Safety
    /// No copy into or out of the range may be in flight.
    unsafe fn unpin(&self, addr: usize) -> Result<(), DeviceError>;
    /// True when the data path must believe every address is host memory (`fake-blind` only).
    fn blind(&self) -> bool {
        false
    }
}

/// A 2D copy as one [`DeviceLayer::copy_async`] per row: the trait's default, and what a
/// backend falls back to for rows it cannot copy as one.
///
/// # Safety
/// As [`DeviceLayer::copy_2d_async`].
pub(crate) unsafe fn copy_rows<L: DeviceLayer + ?Sized>(
    l: &L,
    stream: StreamId,
    dir: CopyDir,
    r: Rect,
) -> Result<(), DeviceError> {
    for i in 0..r.height {
        let (dst, src) = (r.dst + i * r.dst_pitch, r.src + i * r.src_pitch);
        // SAFETY: forwarded from the caller, row by row.
        unsafe { l.copy_async(stream, dir, dst, src, r.width) }?;
    }
    Ok(())
}

/// 2D copies a backend refused ([`DeviceError::Refused2d`]), parts of split runs included.
static REFUSED_2D: AtomicU64 = AtomicU64::new(0);
/// Runs that were copied in parts because their 2D copy was refused.
static SPLIT_RUNS: AtomicU64 = AtomicU64::new(0);

/// How often the process's backend refused a 2D copy and a run was split (see `copy_2d`).
/// On an H200 runs over two allocations, and runs over an embedded owner's segment, were
/// refused; these counts show at once whether a GPU run split anything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SplitStats {
    /// 2D copy calls refused, each part of a split run that was refused again included.
    pub refused_2d: u64,
    /// Runs copied in parts after their 2D copy was refused.
    pub split_runs: u64,
}

/// The process's [`SplitStats`] so far.
pub fn split_stats() -> SplitStats {
    SplitStats {
        refused_2d: REFUSED_2D.load(Ordering::Relaxed),
        split_runs: SPLIT_RUNS.load(Ordering::Relaxed),
    }
}

/// Queues a 2D copy ([`DeviceLayer::copy_2d_async`]); a run the backend refuses is split in
/// halves until each part is taken, down to single rows ([`DeviceLayer::copy_async`]). A
/// refusal queues nothing, so no row is copied twice. The CUDA backend and the test double go
/// through this same code: the double refuses the shapes an H200 refused.
///
/// # Safety
/// As [`DeviceLayer::copy_2d_async`].
pub(crate) unsafe fn copy_2d<L: DeviceLayer + ?Sized>(
    l: &L,
    stream: StreamId,
    dir: CopyDir,
    rect: Rect,
) -> Result<(), DeviceError> {
    let Rect {
        dst_pitch,
        src_pitch,
        width,
        height,
        ..
    } = rect;
    // SAFETY: forwarded from the caller.
    match unsafe { l.copy_2d_async(stream, dir, rect) } {
        Err(DeviceError::Refused2d { why, .. }) => {
            REFUSED_2D.fetch_add(1, Ordering::Relaxed);
            let n = SPLIT_RUNS.fetch_add(1, Ordering::Relaxed);
            if n == 0 {
                tracing::warn!(
                    "{}: 2D copy of {height} rows of {width} bytes (pitches {src_pitch}/{dst_pitch}) refused ({why}); splitting it and later refused runs (counted in lunakv_device_copy_2d_split_runs_total)",
                    l.name()
                );
            } else {
                tracing::debug!(
                    "2D copy of {height} rows of {width} bytes refused ({why}); split run {}",
                    n + 1
                );
            }
            // SAFETY: the same rows, in parts.
            unsafe { split_halves(l, stream, dir, rect) }
        }
        r => r,
    }
}

/// The rows of one 2D copy.
#[derive(Debug, Clone, Copy)]
pub struct Rect {
    pub dst: usize,
    pub dst_pitch: usize,
    pub src: usize,
    pub src_pitch: usize,
    pub width: usize,
    pub height: usize,
}

/// Queues `r`'s rows as two halves, each as one 2D copy or, refused again, split further.
///
/// # Safety
/// As [`DeviceLayer::copy_2d_async`].
unsafe fn split_halves<L: DeviceLayer + ?Sized>(
    l: &L,
    stream: StreamId,
    dir: CopyDir,
    r: Rect,
) -> Result<(), DeviceError> {
    let h = r.height / 2;
    for (first, rows) in [(0, h), (h, r.height - h)] {
        let part = Rect {
            dst: r.dst + first * r.dst_pitch,
            src: r.src + first * r.src_pitch,
            height: rows,
            ..r
        };
        // SAFETY: rows of the caller's run.
        unsafe {
            if rows == 1 {
                l.copy_async(stream, dir, part.dst, part.src, part.width)?;
                continue;
            }
            match l.copy_2d_async(stream, dir, part) {
                Err(DeviceError::Refused2d { .. }) => {
                    REFUSED_2D.fetch_add(1, Ordering::Relaxed);
                    split_halves(l, stream, dir, part)?;
                }
                other => other?,
            }
        }
    }
    Ok(())
}

static LAYER: OnceLock<Option<Box<dyn DeviceLayer>>> = OnceLock::new();

/// The process's device backend, loaded on first use; `None` on a host-only machine.
#[inline]
pub fn layer() -> Option<&'static dyn DeviceLayer> {
    LAYER.get_or_init(load).as_deref()
}

/// Installs `l` as the process's backend instead of what [`DEVICE_ENV`] selects (tests that
/// cannot set the environment before the process starts; embedders with their own backend).
/// Refused once a backend was chosen: the data path relies on it never changing.
pub fn install(l: Box<dyn DeviceLayer>) -> Result<(), DeviceError> {
    let name = l.name();
    LAYER.set(Some(l)).map_err(|_| {
        DeviceError::Invalid(format!(
            "cannot install the {name} device layer: the process already uses '{}'",
            layer_name()
        ))
    })
}

fn load() -> Option<Box<dyn DeviceLayer>> {
    let want = lunakv_config::process_env(DEVICE_ENV)
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match want.as_str() {
        "off" | "none" | "0" | "false" | "host" => None,
        "fake" => Some(fake::from_env(false)),
        "fake-blind" => Some(fake::from_env(true)),
        other => {
            if !matches!(other, "" | "auto" | "cuda") {
                tracing::warn!(
                    "{DEVICE_ENV}={other} is not one of auto, cuda, off, fake: using auto"
                );
            }
            match cuda::Cuda::load() {
                Ok(c) => {
                    tracing::info!("device layer: CUDA driver loaded");
                    Some(Box::new(c))
                }
                Err(e) => {
                    if other == "cuda" {
                        tracing::warn!("{DEVICE_ENV}=cuda but {e}; device buffers are unsupported");
                    } else {
                        tracing::debug!("no device layer: {e}");
                    }
                    None
                }
            }
        }
    }
}

/// The loaded backend's name, or "none".
pub fn layer_name() -> &'static str {
    layer().map_or("none", |l| l.name())
}

// === classification ===

struct Registered {
    len: usize,
    kind: MemKind,
    refs: usize,
}

/// Buffers registered up front, classified once, by start address.
static RANGES: RwLock<BTreeMap<usize, Registered>> = RwLock::new(BTreeMap::new());

/// Classifies `[addr, addr+len)` once and remembers it, so later pieces inside it are looked up
/// instead of asking the driver. Registering the same start again (the store and the P/D engine
/// both register vLLM's KV cache) counts a reference. Without a backend: `Host`, nothing kept.
pub fn register_range(addr: usize, len: usize) -> MemKind {
    let Some(l) = layer() else {
        return MemKind::Host;
    };
    let kind = classify_with(l, addr);
    let mut r = RANGES.write();
    match r.get_mut(&addr) {
        Some(e) => {
            e.refs += 1;
            e.len = e.len.max(len);
            e.kind = kind;
        }
        None => {
            r.insert(addr, Registered { len, kind, refs: 1 });
        }
    }
    kind
}

/// Drops one reference taken by [`register_range`] at `addr`.
pub fn unregister_range(addr: usize) {
    if layer().is_none() {
        return;
    }
    let mut r = RANGES.write();
    if let Some(e) = r.get_mut(&addr) {
        e.refs -= 1;
        if e.refs == 0 {
            r.remove(&addr);
        }
    }
}

fn classify_with(l: &dyn DeviceLayer, addr: usize) -> MemKind {
    if l.blind() {
        return MemKind::Host;
    }
    match l.classify(addr) {
        Ok(k) => k,
        Err(e) => {
            // A driver that cannot say is a broken driver; host is what every path did before.
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| tracing::warn!("cannot classify {addr:#x}: {e}; treating as host"));
            MemKind::Host
        }
    }
}

/// Where `[addr, addr+len)` lives: one atomic load without a backend; a lookup in the
/// registered ranges, else one driver call, with one.
#[inline]
pub fn kind_of(addr: usize, len: usize) -> MemKind {
    match layer() {
        None => MemKind::Host,
        Some(l) => kind_slow(l, addr, len),
    }
}

#[inline(never)]
fn kind_slow(l: &dyn DeviceLayer, addr: usize, len: usize) -> MemKind {
    {
        let r = RANGES.read();
        if let Some((&start, e)) = r.range(..=addr).next_back()
            && addr - start < e.len
            && len <= e.len - (addr - start)
        {
            return if l.blind() { MemKind::Host } else { e.kind };
        }
    }
    classify_with(l, addr)
}

/// The device ordinal of a piece, if it is device memory.
#[inline]
pub(crate) fn device_of(p: &[u8]) -> Option<u32> {
    match kind_of(p.as_ptr() as usize, p.len()) {
        MemKind::Device { ordinal } => Some(ordinal),
        _ => None,
    }
}

/// True if any piece is device memory (false at once without a backend).
#[inline]
pub fn any_device(pieces: &[&[u8]]) -> bool {
    layer().is_some() && pieces.iter().any(|p| device_of(p).is_some())
}

/// As [`any_device`] for destination pieces.
#[inline]
pub fn any_device_mut(pieces: &[&mut [u8]]) -> bool {
    layer().is_some() && pieces.iter().any(|p| device_of(p).is_some())
}

// === streams and copies ===

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
    /// The ordinal whose context is current on this thread.
    bound: Option<u32>,
    /// What was current on this thread before the first bind; restored on drop.
    saved: Option<u64>,
    /// A copier is used by the thread that made it (its contexts are current there).
    _not_send: std::marker::PhantomData<*const ()>,
}

/// One copy waiting for [`Copier::flush`]: `dev` is the device side, `host` the host side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    ordinal: u32,
    dir: CopyDir,
    dev: usize,
    host: usize,
    len: usize,
}

/// Set `LUNAKV_DEVICE_COALESCE=0` to issue one driver call per piece (diagnostics: the GPU
/// check compares both).
const COALESCE_ENV: &str = "LUNAKV_DEVICE_COALESCE";

/// Largest pitch handed to a 2D copy: CUDA's `CU_DEVICE_ATTRIBUTE_MAX_PITCH` is 2^31 - 1 on
/// every GPU it has shipped on; wider strides are issued row by row.
const MAX_PITCH: usize = i32::MAX as usize;

fn coalescing() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| switched_on(COALESCE_ENV))
}

/// A run of copies that is one 2D copy: `height` rows of `len` bytes, row `r` at
/// `dev + r * dev_pitch` and `host + r * host_pitch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    ordinal: u32,
    dir: CopyDir,
    dev: usize,
    dev_pitch: usize,
    host: usize,
    host_pitch: usize,
    len: usize,
    height: usize,
}

impl Run {
    /// One copy as a run of one row.
    fn single(p: &Pending) -> Run {
        Run {
            ordinal: p.ordinal,
            dir: p.dir,
            dev: p.dev,
            dev_pitch: p.len,
            host: p.host,
            host_pitch: p.len,
            len: p.len,
            height: 1,
        }
    }
}

/// Groups `pending` into runs (sorted by device, direction, size and device address; a run
/// keeps one device pitch and one host pitch, both at least the row size).
fn coalesce(mut pending: Vec<Pending>) -> Vec<Run> {
    pending.sort_unstable_by_key(|p| (p.ordinal, p.dir == CopyDir::HostToDevice, p.len, p.dev));
    let mut runs: Vec<Run> = Vec::with_capacity(pending.len());
    for p in pending {
        if let Some(r) = runs.last_mut()
            && r.ordinal == p.ordinal
            && r.dir == p.dir
            && r.len == p.len
        {
            let last_dev = r.dev + (r.height - 1) * r.dev_pitch;
            let last_host = r.host + (r.height - 1) * r.host_pitch;
            let dp = p.dev.wrapping_sub(last_dev);
            let hp = p.host.wrapping_sub(last_host);
            let fits = |pitch: usize| (p.len..=MAX_PITCH).contains(&pitch);
            let extends = if r.height == 1 {
                fits(dp) && fits(hp)
            } else {
                dp == r.dev_pitch && hp == r.host_pitch
            };
            if extends {
                if r.height == 1 {
                    r.dev_pitch = dp;
                    r.host_pitch = hp;
                }
                r.height += 1;
                continue;
            }
        }
        runs.push(Run::single(&p));
    }
    runs
}

impl Copier {
    /// A copier, or `None` when no backend is loaded.
    pub fn new() -> Option<Copier> {
        layer().map(|layer| Copier {
            layer,
            streams: Vec::new(),
            pending: Vec::new(),
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
        if !coalescing() {
            for p in &pending {
                self.issue(Run::single(p))?;
            }
            return Ok(());
        }
        for run in coalesce(pending) {
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

// === pinning host mappings ===

/// A host mapping (a segment) pinned for DMA in granules. The granules a device copy touches
/// are pinned before it, and the first such copy starts one background thread that pins the
/// rest of the mapping ahead of use (`LUNAKV_PIN_AHEAD=0` turns that off). Pinning costs about
/// as much as copying the bytes once, so pinning only on demand makes every batch that lands on
/// fresh granules pay it inline: on an H200, shm puts ran at 4.7 GB/s against 53 GB/s for a
/// pinned copy. Pinning a store segment commits no memory: the store populates its segment
/// when it maps it, and a requester's pins hold the same pages.
pub(crate) struct HostPins {
    inner: std::sync::Arc<PinState>,
    ahead: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set once the pin-ahead thread was started (or failed to start: not retried per copy).
    ahead_started: std::sync::atomic::AtomicBool,
}

struct PinState {
    base: usize,
    len: usize,
    /// Per granule: see the `G_*` states.
    state: Mutex<Vec<u8>>,
    /// Signalled when a granule leaves `G_PINNING`.
    settled: parking_lot::Condvar,
    stop: std::sync::atomic::AtomicBool,
}

const G_UNPINNED: u8 = 0;
const G_PINNED: u8 = 1;
/// Pinning failed: copies still work, unpinned.
const G_FAILED: u8 = 2;
/// A thread is pinning it now.
const G_PINNING: u8 = 3;

/// Pinning unit of [`HostPins`].
const PIN_GRANULE: usize = 64 << 20;

/// `LUNAKV_PIN_AHEAD=0` pins only the granules device copies touch.
const PIN_AHEAD_ENV: &str = "LUNAKV_PIN_AHEAD";

fn pin_ahead() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| switched_on(PIN_AHEAD_ENV))
}

impl PinState {
    /// Pins granule `g` unless it is pinned, failed, or (`wait` false) being pinned by another
    /// thread; with `wait`, waits for that other thread instead.
    fn pin(&self, l: &dyn DeviceLayer, g: usize, wait: bool) {
        let mut st = self.state.lock();
        loop {
            match st.get(g).copied() {
                Some(G_UNPINNED) => break,
                Some(G_PINNING) if wait => self.settled.wait(&mut st),
                _ => return,
            }
        }
        st[g] = G_PINNING;
        drop(st);
        let start = g * PIN_GRANULE;
        let n = PIN_GRANULE.min(self.len - start).next_multiple_of(4096);
        // SAFETY: the granule lies inside the mapping (page-rounded: mmap maps whole pages),
        // which outlives this state (its owner stops the pinning thread and unpins before
        // unmapping).
        let done = match unsafe { l.pin(self.base + start, n) } {
            Ok(()) => G_PINNED,
            Err(e) => {
                tracing::warn!(
                    "cannot pin {n} bytes of a segment for DMA: {e}; device copies to it run unpinned (slower)"
                );
                G_FAILED
            }
        };
        self.state.lock()[g] = done;
        self.settled.notify_all();
    }
}

impl HostPins {
    pub(crate) fn new(base: usize, len: usize) -> HostPins {
        HostPins {
            inner: std::sync::Arc::new(PinState {
                base,
                len,
                state: Mutex::new(vec![G_UNPINNED; len.div_ceil(PIN_GRANULE)]),
                settled: parking_lot::Condvar::new(),
                stop: std::sync::atomic::AtomicBool::new(false),
            }),
            ahead: Mutex::new(None),
            ahead_started: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Pins the granules covering `[off, off+len)` that are not pinned yet (waiting for one the
    /// background thread is pinning), then starts that thread if it is not running.
    pub(crate) fn ensure(&self, off: usize, len: usize) {
        let Some(l) = layer() else { return };
        if len == 0 {
            return;
        }
        let granules = self.inner.state.lock().len();
        let (first, last) = (off / PIN_GRANULE, (off + len - 1) / PIN_GRANULE);
        for g in first..=last.min(granules.saturating_sub(1)) {
            self.inner.pin(l, g, true);
        }
        if pin_ahead()
            && granules > 1
            && !self
                .ahead_started
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let inner = self.inner.clone();
            let spawned = std::thread::Builder::new()
                .name("lunakv-pin-ahead".into())
                .spawn(move || {
                    for g in 0..granules {
                        if inner.stop.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                        inner.pin(l, g, false);
                    }
                });
            match spawned {
                Ok(h) => *self.ahead.lock() = Some(h),
                // No thread: the granules are pinned on demand, as with LUNAKV_PIN_AHEAD=0.
                Err(e) => tracing::warn!("cannot start the pin-ahead thread: {e}"),
            }
        }
    }
}

impl Drop for HostPins {
    fn drop(&mut self) {
        self.inner
            .stop
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.ahead.lock().take() {
            // It finishes the granule it is pinning, then sees `stop`.
            let _ = h.join();
        }
        let Some(l) = layer() else { return };
        for (g, s) in self.inner.state.lock().iter().enumerate() {
            if *s == G_PINNED {
                // SAFETY: pinned by `PinState::pin`; the owner drops this before unmapping,
                // after the copies that used it were synchronized.
                if let Err(e) = unsafe { l.unpin(self.inner.base + g * PIN_GRANULE) } {
                    tracing::warn!("unpinning a segment granule failed: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
