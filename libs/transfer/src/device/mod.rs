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

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

mod copier;
pub mod cuda;
pub mod fake;
mod pins;
mod ranges;
mod runs;
pub(crate) mod staging;

pub use copier::{Copier, read_from, write_to};
pub(crate) use copier::{gather, scatter};
pub(crate) use pins::HostPins;
#[cfg(test)]
use ranges::classify_with;
pub use ranges::{kind_of, register_range, unregister_range};

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

#[cfg(test)]
mod tests;
