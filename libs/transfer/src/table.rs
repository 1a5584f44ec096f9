//! The entry table: which generation lives at which range, and who is reading it.
//!
//! Live entries never overlap (a write removes every live entry it overlaps), so a `BTreeMap`
//! keyed by offset finds overlaps with one predecessor lookup plus a range scan. An entry removed
//! while pinned stays in `entries` (not live) until its last pin drops, so FREE and overwriting
//! writes can wait for readers that are still copying its bytes.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::{Entry, PlacementProof};

struct Rec {
    generation: u64,
    key: String,
    offset: u64,
    len: u64,
    pins: u32,
    live: bool,
    /// The master's proof of the placement, reported back in the inventory.
    proof: Option<PlacementProof>,
}

#[derive(Default)]
struct Inner {
    /// Internal entry id -> record. Ids (not generations) name pins so a re-put of the same
    /// generation cannot be unpinned by the previous entry's reader.
    entries: HashMap<u64, Rec>,
    /// Live entries only.
    by_gen: HashMap<u64, u64>,
    /// Live entries only: offset -> id.
    by_offset: BTreeMap<u64, u64>,
    next_id: u64,
    used: u64,
    /// Ids of entries read since the last `take_touched_keys`.
    touched: HashSet<u64>,
    /// Set while a shutdown drain runs (see [`DrainWatch`]).
    drain: Option<DrainWatch>,
    /// Generations the master freed here (see [`Revoked`]).
    revoked: Revoked,
    /// Generations with a WRITE or COMMIT in flight, and how many ([`Table::begin_write`]).
    writing: HashMap<u64, u32>,
}

/// Most revoked generations remembered one by one ([`Revoked`]).
pub(crate) const REVOKED_MAX: usize = 256 * 1024;

/// Generations the master freed here: puts it gave up on (revoked, discarded, reclaimed under
/// pressure) and objects it removed or evicted. Their writers may still hold a write capability
/// (valid for `WRITE_TTL`), and once the master acknowledged the FREE it hands the range to
/// another put: a late WRITE or COMMIT of such a generation would land in someone else's
/// bytes, so it is refused.
///
/// Bounded: the newest [`REVOKED_MAX`] generations are kept (FIFO, 16 bytes each with the
/// order: about 6 MiB at most). Forgetting one must not reopen it, so a generation pushed out
/// raises its epoch's floor (generations carry the master's epoch in their high 32 bits and
/// a counter in the low ones): an uncommitted generation at or below its epoch's floor is
/// refused too. A live put is caught by the floor only if it started before an object that
/// was then freed here, and 256k more FREEs reached this owner while it was still writing; it
/// then fails with a clear refusal and is retried under a new generation. Never wrong bytes,
/// at worst a retried put. (An epoch's generations are never reused, so nothing the master
/// still wants written is ever at or below a floor but such a straggler.)
#[derive(Default)]
struct Revoked {
    set: HashSet<u64>,
    order: VecDeque<u64>,
    /// Epoch -> highest counter forgotten (a few epochs: one per master restart or term).
    floors: BTreeMap<u32, u32>,
}

/// Epochs whose floors are kept; the oldest (lowest) goes first, as epochs only grow.
const FLOOR_EPOCHS: usize = 64;

impl Revoked {
    fn insert(&mut self, generation: u64) {
        if !self.set.insert(generation) {
            return;
        }
        self.order.push_back(generation);
        while self.order.len() > REVOKED_MAX {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.set.remove(&old);
            let (epoch, counter) = ((old >> 32) as u32, old as u32);
            let floor = self.floors.entry(epoch).or_insert(0);
            *floor = (*floor).max(counter);
            while self.floors.len() > FLOOR_EPOCHS {
                self.floors.pop_first();
            }
        }
    }

    fn contains(&self, generation: u64) -> bool {
        self.set.contains(&generation)
            || self
                .floors
                .get(&((generation >> 32) as u32))
                .is_some_and(|&f| generation as u32 <= f)
    }
}

/// Why a WRITE or COMMIT of a generation is refused before or after its bytes land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RevokedGeneration;

/// A WRITE or COMMIT in flight ([`Table::begin_write`]); dropping it unregisters the write and
/// wakes a FREE waiting for it.
pub(crate) struct WriteGuard<'a> {
    table: &'a Table,
    generation: u64,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        let mut g = self.table.inner.lock();
        if let Some(n) = g.writing.get_mut(&self.generation) {
            *n -= 1;
            if *n == 0 {
                g.writing.remove(&self.generation);
                drop(g);
                self.table.unpinned.notify_all();
            }
        }
    }
}

/// What a FREE must wait for before it is acknowledged ([`Table::free_items`]).
#[derive(Default)]
pub(crate) struct Freed {
    /// Retired entries still pinned by readers.
    pub(crate) pinned: Vec<u64>,
    /// Just revoked generations with a write in flight.
    pub(crate) writing: Vec<u64>,
}

/// What the master did, during a shutdown drain, to the generations the drain copied to disk.
/// The master does not know those disk copies: a FREE of one (a remove, an overwrite, a plain
/// eviction) must take the copy away again, or a restart would bring the object back; an OFFLOAD
/// made the copy the master's own disk replica, which stays.
#[derive(Default)]
struct DrainWatch {
    /// Generations the drain pinned to copy (bounded by the table's entries).
    taken: HashSet<u64>,
    /// Of those, the ones a FREE or OFFLOAD dropped from DRAM.
    freed: HashSet<u64>,
    /// Of those, the ones an OFFLOAD stored (the master now holds a disk replica of them).
    offloaded: HashSet<u64>,
}

/// A pin on an entry; hand it back to [`Table::unpin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PinId(u64);

/// An entry pinned for the disk tier (OFFLOAD, a shutdown drain): what it must store.
pub(crate) struct Pinned {
    pub(crate) pin: PinId,
    pub(crate) generation: u64,
    pub(crate) offset: u64,
    pub(crate) key: String,
    pub(crate) len: u64,
    pub(crate) proof: Option<PlacementProof>,
}

pub(crate) enum PinResult {
    Pinned(PinId),
    Stale,
}

#[derive(Default)]
pub(crate) struct Table {
    inner: Mutex<Inner>,
    unpinned: Condvar,
}

impl Inner {
    fn pin_at(&mut self, generation: u64, offset: u64) -> Option<Pinned> {
        let &id = self.by_gen.get(&generation)?;
        let rec = self.entries.get_mut(&id)?;
        if rec.offset != offset {
            return None;
        }
        rec.pins += 1;
        Some(Pinned {
            pin: PinId(id),
            generation,
            offset,
            key: rec.key.clone(),
            len: rec.len,
            proof: rec.proof,
        })
    }

    /// Makes an entry not live; returns its id if it is still pinned (someone must wait).
    fn retire(&mut self, id: u64) -> Option<u64> {
        let rec = self.entries.get_mut(&id)?;
        if !rec.live {
            return (rec.pins > 0).then_some(id);
        }
        rec.live = false;
        self.used -= rec.len;
        if self.by_gen.get(&rec.generation) == Some(&id) {
            self.by_gen.remove(&rec.generation);
        }
        self.by_offset.remove(&rec.offset);
        if rec.pins == 0 {
            self.entries.remove(&id);
            None
        } else {
            Some(id)
        }
    }

    /// Ids of live entries overlapping `[offset, end)`.
    fn overlapping(&self, offset: u64, end: u64) -> Vec<u64> {
        let mut out = Vec::new();
        if let Some((_, &id)) = self.by_offset.range(..offset).next_back() {
            let r = &self.entries[&id];
            if r.offset + r.len > offset {
                out.push(id);
            }
        }
        out.extend(self.by_offset.range(offset..end).map(|(_, &id)| id));
        out
    }
}

impl Table {
    /// Pins the entry `(generation, offset, len)` if it exists exactly; records the read.
    pub(crate) fn pin(&self, generation: u64, offset: u64, len: u64) -> PinResult {
        let mut g = self.inner.lock();
        let Some(&id) = g.by_gen.get(&generation) else {
            return PinResult::Stale;
        };
        let Some(rec) = g.entries.get_mut(&id) else {
            return PinResult::Stale;
        };
        if rec.offset != offset || rec.len != len {
            return PinResult::Stale;
        }
        rec.pins += 1;
        g.touched.insert(id);
        PinResult::Pinned(PinId(id))
    }

    /// Pins the live entry of `generation` at `offset`, whatever its length (OFFLOAD knows the
    /// master's `(generation, offset)` only).
    pub(crate) fn pin_at(&self, generation: u64, offset: u64) -> Option<Pinned> {
        self.inner.lock().pin_at(generation, offset)
    }

    /// Pins the live entry of `generation` if it has length `len`; returns the pin and offset
    /// (LOAD serves an object still in DRAM without knowing where).
    pub(crate) fn pin_gen(&self, generation: u64, len: u64) -> Option<(PinId, u64)> {
        let mut g = self.inner.lock();
        let &id = g.by_gen.get(&generation)?;
        let rec = g.entries.get_mut(&id)?;
        if rec.len != len {
            return None;
        }
        rec.pins += 1;
        let off = rec.offset;
        g.touched.insert(id);
        Some((PinId(id), off))
    }

    pub(crate) fn unpin(&self, pin: PinId) {
        let mut g = self.inner.lock();
        let Some(rec) = g.entries.get_mut(&pin.0) else {
            return;
        };
        rec.pins = rec.pins.saturating_sub(1);
        if rec.pins == 0 && !rec.live {
            g.entries.remove(&pin.0);
            drop(g);
            self.unpinned.notify_all();
        }
    }

    /// Called before bytes land in `[offset, offset+len)`: retires every live entry there (new
    /// reads answer STALE) and waits up to `wait` for readers still copying them.
    pub(crate) fn invalidate_range(&self, offset: u64, len: u64, wait: Duration) {
        let mut g = self.inner.lock();
        let ids = g.overlapping(offset, offset + len);
        let pinned: Vec<u64> = ids.into_iter().filter_map(|id| g.retire(id)).collect();
        if !pinned.is_empty() {
            self.wait_gone(&mut g, &pinned, Instant::now() + wait);
        }
    }

    /// Records a committed entry, retiring anything it overlaps (a no-op when the WRITE path
    /// already invalidated; the shm COMMIT path relies on it).
    pub(crate) fn commit(
        &self,
        generation: u64,
        key: String,
        offset: u64,
        len: u64,
        proof: Option<PlacementProof>,
    ) {
        Self::commit_locked(&mut self.inner.lock(), generation, key, offset, len, proof);
    }

    fn commit_locked(
        g: &mut Inner,
        generation: u64,
        key: String,
        offset: u64,
        len: u64,
        proof: Option<PlacementProof>,
    ) {
        for id in g.overlapping(offset, offset + len) {
            g.retire(id);
        }
        if let Some(&old) = g.by_gen.get(&generation) {
            g.retire(old);
        }
        let id = g.next_id;
        g.next_id += 1;
        g.entries.insert(
            id,
            Rec {
                generation,
                key,
                offset,
                len,
                pins: 0,
                live: true,
                proof,
            },
        );
        g.by_gen.insert(generation, id);
        g.by_offset.insert(offset, id);
        g.used += len;
    }

    /// FREE, first half: drops the entries `(generation, offset)` (new reads answer STALE) and
    /// returns those still pinned, for [`Table::wait_unpinned`]. Two halves so a FREE body is
    /// applied chunk by chunk as it arrives; the pinned list is bounded by the table.
    pub(crate) fn retire_items(&self, items: &[(u64, u64)]) -> Vec<u64> {
        self.retire(items, false).pinned
    }

    /// FREE, first half: [`Self::retire_items`], and every DRAM generation named is revoked:
    /// its WRITE and COMMIT are refused from now on, and the writes of it already in flight
    /// are returned, for [`Self::wait_freed`]. Done under the table's lock, so a write either
    /// registered before (and is waited for) or sees the revocation.
    ///
    /// Every generation, not only those with no committed entry here (the unfinished puts the
    /// master reclaimed): a zombie that copied its bytes and never ended its put holds a
    /// committed entry, which this FREE retires, and `holds` alone would then let its still
    /// valid capability write the generation again into the range's next owner.
    pub(crate) fn free_items(&self, items: &[(u64, u64)]) -> Freed {
        self.retire(items, true)
    }

    fn retire(&self, items: &[(u64, u64)], revoke: bool) -> Freed {
        let mut g = self.inner.lock();
        let mut pinned = Vec::new();
        let mut writing = Vec::new();
        for &(generation, offset) in items {
            // A disk copy's FREE drops the disk entry only: no write lands there.
            if revoke && offset != crate::wire::DISK_OFFSET {
                g.revoked.insert(generation);
                if g.writing.contains_key(&generation) {
                    writing.push(generation);
                }
            }
            let Some(&id) = g.by_gen.get(&generation) else {
                continue;
            };
            if g.entries[&id].offset != offset {
                continue;
            }
            if let Some(id) = g.retire(id) {
                pinned.push(id);
            }
        }
        if let Some(w) = g.drain.as_mut() {
            for &(generation, _) in items {
                if w.taken.contains(&generation) {
                    w.freed.insert(generation);
                }
            }
        }
        Freed { pinned, writing }
    }

    /// Registers a WRITE or COMMIT of `generation` as in flight, then checks that the master
    /// has not revoked it (in this order, under one lock: a FREE that revokes it afterwards
    /// waits for the guard to drop). The bytes may be copied while the guard lives; commit
    /// them with [`Self::commit_write`].
    pub(crate) fn begin_write(&self, generation: u64) -> Result<WriteGuard<'_>, RevokedGeneration> {
        let mut g = self.inner.lock();
        *g.writing.entry(generation).or_insert(0) += 1;
        let guard = WriteGuard {
            table: self,
            generation,
        };
        if g.revoked.contains(generation) {
            drop(g);
            // The guard's drop unregisters it again.
            return Err(RevokedGeneration);
        }
        Ok(guard)
    }

    /// [`Self::commit`] for a write begun with [`Self::begin_write`], unless a FREE revoked
    /// its generation while the bytes were copied (the FREE waits for the guard, so the range
    /// is not reused before the refusal).
    pub(crate) fn commit_write(
        &self,
        _guard: &WriteGuard<'_>,
        generation: u64,
        key: String,
        (offset, len): (u64, u64),
        proof: Option<PlacementProof>,
    ) -> Result<(), RevokedGeneration> {
        let mut g = self.inner.lock();
        if g.revoked.contains(generation) {
            return Err(RevokedGeneration);
        }
        Self::commit_locked(&mut g, generation, key, offset, len, proof);
        Ok(())
    }

    /// Waits until the retired entries lost their last pin and no write of the revoked
    /// generations is in flight; false if `deadline` passed first.
    pub(crate) fn wait_freed(&self, freed: &Freed, deadline: Instant) -> bool {
        if freed.pinned.is_empty() && freed.writing.is_empty() {
            return true;
        }
        let mut g = self.inner.lock();
        loop {
            let done = freed.pinned.iter().all(|id| !g.entries.contains_key(id))
                && freed.writing.iter().all(|w| !g.writing.contains_key(w));
            if done {
                return true;
            }
            if self.unpinned.wait_until(&mut g, deadline).timed_out() {
                return freed.pinned.iter().all(|id| !g.entries.contains_key(id))
                    && freed.writing.iter().all(|w| !g.writing.contains_key(w));
            }
        }
    }

    /// Waits until every retired entry in `pinned` lost its last pin; false if `deadline`
    /// passed first.
    pub(crate) fn wait_unpinned(&self, pinned: &[u64], deadline: Instant) -> bool {
        if pinned.is_empty() {
            return true;
        }
        let mut g = self.inner.lock();
        self.wait_gone(&mut g, pinned, deadline)
    }

    fn wait_gone(
        &self,
        g: &mut parking_lot::MutexGuard<'_, Inner>,
        ids: &[u64],
        deadline: Instant,
    ) -> bool {
        loop {
            if ids.iter().all(|id| !g.entries.contains_key(id)) {
                return true;
            }
            if self.unpinned.wait_until(g, deadline).timed_out() {
                return ids.iter().all(|id| !g.entries.contains_key(id));
            }
        }
    }

    /// Whether `generation` is committed here (a WRITE of it again is refused).
    pub(crate) fn holds(&self, generation: u64) -> bool {
        self.inner.lock().by_gen.contains_key(&generation)
    }

    pub(crate) fn inventory(&self) -> Vec<Entry> {
        let g = self.inner.lock();
        g.by_offset
            .values()
            .map(|id| {
                let r = &g.entries[id];
                Entry {
                    key: r.key.clone(),
                    offset: r.offset,
                    size: r.len,
                    generation: r.generation,
                    proof: r.proof,
                }
            })
            .collect()
    }

    pub(crate) fn take_touched_keys(&self, max: usize) -> Vec<String> {
        let mut g = self.inner.lock();
        let mut keys: Vec<String> = Vec::new();
        let mut seen = HashSet::new();
        let mut taken = Vec::new();
        for &id in g.touched.iter() {
            if keys.len() >= max {
                break;
            }
            taken.push(id);
            // Entries freed since the read are skipped: the master already forgot them.
            if let Some(r) = g.entries.get(&id).filter(|r| r.live)
                && seen.insert(r.key.as_str())
            {
                keys.push(r.key.clone());
            }
        }
        drop(seen);
        for id in taken {
            g.touched.remove(&id);
        }
        keys
    }

    /// Live entries `(generation, offset, len)`, the most recently committed first (entry ids
    /// grow with every commit), for a shutdown drain that writes the newest objects first.
    pub(crate) fn newest_first(&self) -> Vec<(u64, u64, u64)> {
        let g = self.inner.lock();
        let mut ids: Vec<u64> = g.by_offset.values().copied().collect();
        ids.sort_unstable_by(|a, b| b.cmp(a));
        ids.iter()
            .map(|id| {
                let r = &g.entries[id];
                (r.generation, r.offset, r.len)
            })
            .collect()
    }

    /// Starts recording what FREE and OFFLOAD do to the generations a drain takes.
    pub(crate) fn watch_drain(&self) {
        self.inner
            .lock()
            .drain
            .get_or_insert_with(DrainWatch::default);
    }

    /// [`Self::pin_at`] for the drain: also records `generation` as taken, in the same lock, so
    /// a FREE that lands from now on is seen.
    pub(crate) fn pin_for_drain(&self, generation: u64, offset: u64) -> Option<Pinned> {
        let mut g = self.inner.lock();
        let pinned = g.pin_at(generation, offset)?;
        if let Some(w) = g.drain.as_mut() {
            w.taken.insert(generation);
        }
        Some(pinned)
    }

    /// OFFLOAD stored these generations on disk for the master (a no-op without a drain).
    pub(crate) fn note_offloaded(&self, generations: &[u64]) {
        let mut g = self.inner.lock();
        if let Some(w) = g.drain.as_mut() {
            for gen_ in generations {
                if w.taken.contains(gen_) {
                    w.offloaded.insert(*gen_);
                }
            }
        }
    }

    /// Ends the watch; returns the taken generations the master freed and did not offload
    /// (their disk copies must go).
    pub(crate) fn end_drain_watch(&self) -> Vec<u64> {
        let Some(w) = self.inner.lock().drain.take() else {
            return Vec::new();
        };
        w.freed
            .into_iter()
            .filter(|g| !w.offloaded.contains(g))
            .collect()
    }

    /// (entries, used bytes)
    pub(crate) fn counts(&self) -> (u64, u64) {
        let g = self.inner.lock();
        (g.by_gen.len() as u64, g.used)
    }
}
