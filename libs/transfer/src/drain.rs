//! The shutdown drain of an owner with a disk tier: on a graceful stop (SIGTERM of a DaemonSet
//! rolling update), the objects still in DRAM only are written to the disk tier, newest first,
//! within a time budget, so that the restarted owner mounts them back with its disk inventory.
//! Without it every object not yet evicted to disk was lost with the process.
//!
//! The segment keeps serving while it drains (reads, and the master's FREE and OFFLOAD), so:
//! - a drained object is pinned while its bytes go to disk, exactly as OFFLOAD pins them;
//! - the master does not know the drained copies. If it frees such an object meanwhile (a
//!   remove, an overwrite, an eviction), [`ColdDrain::finish`] removes the copy again, or the
//!   restart would bring back an object the master dropped; one it OFFLOADs meanwhile keeps its
//!   copy (the master holds that disk replica). The entry table records both (`DrainWatch`).
//! - objects written during the drain are taken by a later pass ([`ColdDrain::run`] again after
//!   the unmount, when no new object can arrive).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::ColdTier;
use crate::server::SegmentServer;
use crate::server::state::Shared;
use crate::table::Pinned;

/// Most bytes per disk batch: one fsync each, and the budget is checked between batches, so a
/// drain overshoots its deadline by at most one batch.
const BATCH_BYTES: u64 = 32 << 20;
/// Most objects per disk batch (the disk tier's buckets hold 500).
const BATCH_ITEMS: usize = 256;

/// Live counts of a drain, for /metrics while it runs.
#[derive(Debug, Default)]
pub struct DrainProgress {
    drained: AtomicU64,
    drained_bytes: AtomicU64,
    dropped: AtomicU64,
}

impl DrainProgress {
    /// Objects written to the disk tier so far.
    pub fn drained(&self) -> u64 {
        self.drained.load(Ordering::Relaxed)
    }

    pub fn drained_bytes(&self) -> u64 {
        self.drained_bytes.load(Ordering::Relaxed)
    }

    /// Objects lost (known once the drain finished; 0 before).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// What a finished drain did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Objects the drain wrote to the disk tier that are still there: a restart serves them.
    pub drained: u64,
    pub drained_bytes: u64,
    /// Objects that were in DRAM only and are lost (budget spent, no room, a write error).
    pub dropped: u64,
    pub dropped_bytes: u64,
    /// Objects in DRAM that already had a disk copy (promoted ones): nothing to write.
    pub already_on_disk: u64,
    /// Drained copies removed again because the master freed their object during the drain.
    pub freed_meanwhile: u64,
    /// Objects skipped because the disk tier had no room for them without dropping what the
    /// drain wrote before.
    pub no_room: u64,
    /// The budget ran out with objects left.
    pub budget_spent: bool,
    /// A disk write failed (the drain stopped there).
    pub write_failed: bool,
    pub elapsed: Duration,
}

/// A drain in progress; see the module docs. Start it with [`SegmentServer::begin_drain`].
pub struct ColdDrain {
    shared: Arc<Shared>,
    cold: Arc<dyn ColdTier>,
    progress: Arc<DrainProgress>,
    /// Bytes the disk tier can still take without dropping a drained object.
    room: u64,
    /// Generations looked at (drained, already on disk, or given up).
    seen: HashSet<u64>,
    /// Generation -> bytes, written by this drain.
    drained: HashMap<u64, u64>,
    already_on_disk: u64,
    no_room: u64,
    budget_spent: bool,
    write_failed: bool,
    started: Instant,
    finished: bool,
}

impl SegmentServer {
    /// Starts a shutdown drain into the disk tier; `None` when no tier is plugged in. From now on
    /// the entry table records FREE and OFFLOAD of what the drain takes, until
    /// [`ColdDrain::finish`] (or its drop).
    pub fn begin_drain(&self, progress: Arc<DrainProgress>) -> Option<ColdDrain> {
        let cold = self.shared.cold.get()?.clone();
        self.shared.table.watch_drain();
        let room = cold.prepare_drain();
        Some(ColdDrain {
            shared: self.shared.clone(),
            cold,
            progress,
            room,
            seen: HashSet::new(),
            drained: HashMap::new(),
            already_on_disk: 0,
            no_room: 0,
            budget_spent: false,
            write_failed: false,
            started: Instant::now(),
            finished: false,
        })
    }
}

impl ColdDrain {
    /// Writes the DRAM-only objects not handled yet to the disk tier, the most recently committed
    /// first, in batches, until none is left, `deadline` passes (checked before each batch), or
    /// `passes` scans of the table were done (each pass takes the objects committed since the
    /// last one). Blocking: disk writes and fsyncs.
    pub fn run(&mut self, deadline: Instant, passes: u32) {
        for _ in 0..passes {
            if self.write_failed {
                return;
            }
            let todo: Vec<(u64, u64, u64)> = self
                .shared
                .table
                .newest_first()
                .into_iter()
                .filter(|(g, ..)| !self.seen.contains(g))
                .collect();
            if todo.is_empty() {
                return;
            }
            let mut next = 0;
            while next < todo.len() {
                if Instant::now() >= deadline {
                    self.budget_spent = true;
                    return;
                }
                let mut pinned: Vec<Pinned> = Vec::new();
                let mut bytes = 0u64;
                while next < todo.len()
                    && pinned.len() < BATCH_ITEMS
                    && (bytes == 0 || bytes + todo[next].2 <= BATCH_BYTES)
                {
                    let (generation, offset, len) = todo[next];
                    next += 1;
                    self.seen.insert(generation);
                    if self.cold.size_of(generation).is_some() {
                        self.already_on_disk += 1;
                        continue;
                    }
                    if len > self.room {
                        // An older, smaller object may still fit.
                        self.no_room += 1;
                        continue;
                    }
                    // None: freed since the scan; the master dropped it, nothing to keep.
                    let Some(p) = self.shared.table.pin_for_drain(generation, offset) else {
                        continue;
                    };
                    self.room -= p.len;
                    bytes += p.len;
                    pinned.push(p);
                }
                self.store(&pinned);
                for p in pinned {
                    self.shared.table.unpin(p.pin);
                }
                if self.write_failed {
                    return;
                }
            }
        }
    }

    fn store(&mut self, pinned: &[Pinned]) {
        if pinned.is_empty() {
            return;
        }
        let batch = crate::server::owner::cold_items(&self.shared, pinned, |_| {});
        match self.cold.store(&batch) {
            Ok(done) => {
                let sizes: HashMap<u64, u64> = batch
                    .iter()
                    .map(|b| (b.generation, b.bytes.len() as u64))
                    .collect();
                for g in done {
                    let len = sizes.get(&g).copied().unwrap_or_default();
                    if self.drained.insert(g, len).is_none() {
                        self.progress.drained.fetch_add(1, Ordering::Relaxed);
                        self.progress
                            .drained_bytes
                            .fetch_add(len, Ordering::Relaxed);
                    }
                }
            }
            Err(msg) => {
                tracing::error!(objects = batch.len(), error = %msg, "shutdown drain: writing to the disk tier failed; the objects left in DRAM are dropped");
                self.write_failed = true;
            }
        }
    }

    /// Ends the drain; call it once no request can arrive any more (the segment server shut
    /// down). Removes the drained copies of objects the master freed meanwhile, and counts what
    /// is lost: every object still in DRAM without a disk copy.
    pub fn finish(mut self) -> DrainReport {
        self.finished = true;
        let freed: Vec<u64> = self
            .shared
            .table
            .end_drain_watch()
            .into_iter()
            .filter(|g| self.drained.contains_key(g))
            .collect();
        if !freed.is_empty() {
            self.cold.remove(&freed);
        }
        let (mut dropped, mut dropped_bytes) = (0, 0);
        for (generation, _, len) in self.shared.table.newest_first() {
            if self.cold.size_of(generation).is_none() {
                dropped += 1;
                dropped_bytes += len;
            }
        }
        // Still on disk: not freed since, nor dropped by the tier (a corrupt read).
        let (mut drained, mut drained_bytes) = (0, 0);
        for (g, len) in &self.drained {
            if self.cold.size_of(*g).is_some() {
                drained += 1;
                drained_bytes += len;
            }
        }
        self.progress.dropped.store(dropped, Ordering::Relaxed);
        self.progress.drained.store(drained, Ordering::Relaxed);
        self.progress
            .drained_bytes
            .store(drained_bytes, Ordering::Relaxed);
        DrainReport {
            drained,
            drained_bytes,
            dropped,
            dropped_bytes,
            already_on_disk: self.already_on_disk,
            freed_meanwhile: freed.len() as u64,
            no_room: self.no_room,
            budget_spent: self.budget_spent,
            write_failed: self.write_failed,
            elapsed: self.started.elapsed(),
        }
    }
}

impl Drop for ColdDrain {
    fn drop(&mut self) {
        if !self.finished {
            self.shared.table.end_drain_watch();
        }
    }
}
