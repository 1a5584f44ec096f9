//! Where an address lives: buffers registered up front (vLLM's KV cache) are classified once
//! and looked up afterwards; anything else asks the backend.
//!
//! A vLLM batch classifies every piece (8192 per 256 MiB batch), on up to two copy threads at
//! once. Behind one reader-writer lock those lookups cost more than the rest of queuing the
//! batch: each takes the lock's shared counter, a cache line the threads pass back and forth.
//! Lookups therefore binary-search a per-thread copy of the ranges, checked against a
//! generation counter that every change bumps: one shared load per piece, no shared write.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{DeviceLayer, MemKind, layer};

struct Registered {
    len: usize,
    kind: MemKind,
    refs: usize,
}

/// `(start, len, kind)` of every registered range, sorted by start.
type Snapshot = Arc<[(usize, usize, MemKind)]>;

struct Ranges {
    by_start: BTreeMap<usize, Registered>,
    /// What lookups copy, rebuilt at every change, with the generation it was built at.
    snapshot: Option<(u64, Snapshot)>,
}

/// Buffers registered up front, classified once, by start address.
static RANGES: Mutex<Ranges> = Mutex::new(Ranges {
    by_start: BTreeMap::new(),
    snapshot: None,
});

/// The generation of [`Ranges::snapshot`]; bumped, under the lock, after each change.
static GENERATION: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's copy of the snapshot and its generation.
    static SEEN: RefCell<Option<(u64, Snapshot)>> = const { RefCell::new(None) };
}

impl Ranges {
    fn publish(&mut self) {
        let g = GENERATION.load(Ordering::Relaxed) + 1;
        let list: Snapshot = self
            .by_start
            .iter()
            .map(|(&start, e)| (start, e.len, e.kind))
            .collect();
        self.snapshot = Some((g, list));
        // After the snapshot is in place: a lookup that loads `g` finds it.
        GENERATION.store(g, Ordering::Release);
    }
}

/// Classifies `[addr, addr+len)` once and remembers it, so later pieces inside it are looked up
/// instead of asking the driver. Registering the same start again (the store and the P/D engine
/// both register vLLM's KV cache) counts a reference. Without a backend: `Host`, nothing kept.
pub fn register_range(addr: usize, len: usize) -> MemKind {
    let Some(l) = layer() else {
        return MemKind::Host;
    };
    let kind = classify_with(l, addr);
    insert(addr, len, kind);
    kind
}

/// Drops one reference taken by [`register_range`] at `addr`.
pub fn unregister_range(addr: usize) {
    if layer().is_some() {
        remove(addr);
    }
}

fn insert(addr: usize, len: usize, kind: MemKind) {
    let mut r = RANGES.lock();
    match r.by_start.get_mut(&addr) {
        Some(e) => {
            e.refs += 1;
            e.len = e.len.max(len);
            e.kind = kind;
        }
        None => {
            r.by_start.insert(addr, Registered { len, kind, refs: 1 });
        }
    }
    r.publish();
}

fn remove(addr: usize) {
    let mut r = RANGES.lock();
    if let Some(e) = r.by_start.get_mut(&addr) {
        e.refs -= 1;
        if e.refs == 0 {
            r.by_start.remove(&addr);
        }
        r.publish();
    }
}

pub(super) fn classify_with(l: &dyn DeviceLayer, addr: usize) -> MemKind {
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
    match registered(addr, len) {
        Some(_) if l.blind() => MemKind::Host,
        Some(kind) => kind,
        None => classify_with(l, addr),
    }
}

/// The kind of the registered range holding all of `[addr, addr+len)`, if one does.
fn registered(addr: usize, len: usize) -> Option<MemKind> {
    let g = GENERATION.load(Ordering::Acquire);
    if g == 0 {
        return None; // nothing was ever registered
    }
    SEEN.try_with(|seen| {
        let mut seen = seen.borrow_mut();
        if seen.as_ref().is_none_or(|(at, _)| *at != g) {
            *seen = RANGES.lock().snapshot.clone();
        }
        seen.as_ref().and_then(|(_, list)| find(list, addr, len))
    })
    // This thread is exiting (its copy is gone): ask the shared one.
    .unwrap_or_else(|_| {
        let r = RANGES.lock();
        r.snapshot
            .as_ref()
            .and_then(|(_, list)| find(list, addr, len))
    })
}

fn find(list: &[(usize, usize, MemKind)], addr: usize, len: usize) -> Option<MemKind> {
    let i = list.partition_point(|&(start, _, _)| start <= addr);
    let &(start, rlen, kind) = list.get(i.checked_sub(1)?)?;
    (addr - start < rlen && len <= rlen - (addr - start)).then_some(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_of_the_ranges_reaches_a_thread_that_looked_them_up_before() {
        // Far from anything another test of this binary registers.
        let a = 0x5eed_0000_0000usize;
        insert(a, 4096, MemKind::Device { ordinal: 0 });
        assert_eq!(registered(a + 10, 16), Some(MemKind::Device { ordinal: 0 }));
        assert_eq!(registered(a + 4090, 16), None, "past the range's end");
        assert_eq!(registered(a - 1, 1), None, "before its start");
        // This thread now holds a copy; the changes below must reach it.
        let other = std::thread::spawn(move || registered(a, 1)).join().unwrap();
        assert_eq!(other, Some(MemKind::Device { ordinal: 0 }));

        insert(a, 4096, MemKind::Device { ordinal: 0 }); // a second reference
        remove(a);
        assert_eq!(registered(a + 10, 16), Some(MemKind::Device { ordinal: 0 }));
        remove(a);
        assert_eq!(registered(a + 10, 16), None, "unregistered");

        insert(a, 8192, MemKind::Device { ordinal: 1 });
        assert_eq!(
            registered(a + 5000, 16),
            Some(MemKind::Device { ordinal: 1 })
        );
        let b = a + 0x10_0000;
        insert(b, 4096, MemKind::HostRegistered);
        assert_eq!(registered(b + 1, 1), Some(MemKind::HostRegistered));
        assert_eq!(registered(a + 1, 1), Some(MemKind::Device { ordinal: 1 }));
        remove(a);
        remove(b);
        assert_eq!(registered(b + 1, 1), None);
    }
}
