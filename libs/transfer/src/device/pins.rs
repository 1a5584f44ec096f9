//! Host mappings (segments) pinned for DMA in granules, on demand and ahead of use.

use std::sync::OnceLock;

use lunakv_config::switched_on;
use parking_lot::Mutex;

use super::*;

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
