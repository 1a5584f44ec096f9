//! Which objects eviction takes first (`--eviction_policy`, docs/ARCHITECTURE.md "Eviction").
//!
//! `lru` is upstream's: at the high watermark, the least recently used `eviction_ratio` of the
//! pool goes at once. `cslru` (the default) is a chain-aware segmented LRU with a ghost table,
//! chosen by replaying Mooncake's published traces (docs/BENCH.md "Hits on real traffic"):
//! - new blocks enter *probation* (an LRU); a block read while on probation, or put again soon
//!   after it was evicted (the ghost table remembers it), becomes *protected*;
//! - protected blocks take at most a *share* of the pool and age by CLOCK: each read gives one
//!   more chance (up to [`MAX_CHANCES`]); one without chances left goes back to the most recent
//!   end of probation;
//! - the share adapts as ARC's target does ([`Share`]): a block put again soon after its
//!   eviction says which segment was too small: probation when it had never been protected,
//!   the protected segment when it had been. Small pools settle high (only proven re-users are
//!   worth their room), large ones low (probation must outlive the gap between a conversation's
//!   turns);
//! - eviction takes probation's least recent block first, protected ones only when probation is
//!   empty, and frees what a put needs (in small chunks), not 5% of the pool at a watermark;
//! - chains: a request's blocks arrive in prefix order in one batch. Within a batch the deeper
//!   blocks are stamped older, so a chain loses its tail before its head (a block without its
//!   predecessor can never be hit), and the last block of a put batch (the chain's end, which
//!   the traces show is almost never reused) enters at probation's cold end;
//! - the SSD tier is the second level: the end of a multi-block batch that was never read is
//!   not written to disk when DRAM evicts it ([`Tier::unread_tail`]), and a promoted disk
//!   block (admitted by its gets) comes back protected.
//!
//! Recency is the object's `last_access` stamp and the segment its `tier` byte, both kept in
//! the object under its shard's lock, so a lookup pays no extra lock. Eviction finds the oldest
//! candidates with one bounded scan (a sixteenth of the keys at a time, [`MAX_QUEUED`] at most) and consumes them across many
//! evictions, re-checking each under its shard lock: amortized O(log k) per evicted key.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Instant;

/// Where the protected share starts, and its bounds. It starts low: a large pool sees few
/// evictions to adapt from, and there a small share is right (docs/BENCH.md).
const SHARE_START: f64 = 0.3;
const SHARE_MIN: f64 = 0.1;
const SHARE_MAX: f64 = 0.95;
/// How far one ghost hit moves the share, in blocks of its size (ARC moves its target by one
/// page, scaled by the ratio of the ghost lists).
const SHARE_STEP: f64 = 0.5;
/// A proven re-user coming back weighs this many probation ones: losing it cost more than one
/// block (it would have been read again), and the replays put the balance there.
const PROTECTED_WEIGHT: f64 = 2.0;
/// Reads a protected block can bank as extra chances before it is demoted.
pub(super) const MAX_CHANCES: u8 = 3;
/// Ghost slots per key the pool holds: a block put again within about four pool turnovers of
/// its eviction is a proven re-user.
const GHOST_PER_KEY: usize = 4;
/// Bounds of the ghost table, in slots.
const GHOST_MIN: usize = 64;
const GHOST_MAX: usize = 1 << 26;
/// Candidates one scan queues per segment: the oldest [`QUEUED_SHARE`] of the keys, within
/// these bounds, so a scan's pass over the index is shared by as many evictions as the index
/// is large (at 1M keys a scan costs tens of ms; 16k candidates made that 8 us per evicted
/// key, docs/BENCH.md).
pub(super) const MIN_QUEUED: usize = 1 << 14;
pub(super) const MAX_QUEUED: usize = 1 << 18;
/// One candidate queued per this many keys.
pub(super) const QUEUED_SHARE: usize = 16;
/// With cslru a put that must evict frees at least this share of the pool at once, so a batch
/// of puts pays one FREE round trip to the owners, not one per block.
pub(super) const CHUNK_SHARE: f64 = 0.005;

/// `--eviction_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionPolicy {
    Lru,
    Cslru,
}

impl EvictionPolicy {
    pub fn parse(s: &str) -> Option<EvictionPolicy> {
        match s {
            "lru" => Some(EvictionPolicy::Lru),
            "cslru" => Some(EvictionPolicy::Cslru),
            _ => None,
        }
    }
}

/// An object's place in cslru: the protected bit, whether it was protected before (demoted
/// to probation), and its banked chances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tier(u8);

const PROTECTED: u8 = 0x80;
const DEMOTED: u8 = 0x40;
/// A chain's end that no read has touched yet: probation's coldest, and not worth the SSD tier.
const TAIL: u8 = 0x20;

impl Tier {
    pub(super) const PROBATION: Tier = Tier(0);
    pub(super) const PROTECTED: Tier = Tier(PROTECTED);
    /// Back on probation after the protected segment's CLOCK passed it without chances.
    pub(super) const DEMOTED: Tier = Tier(DEMOTED);
    /// The last block of a put batch, entered at probation's cold end; a read clears it.
    pub(super) const TAIL: Tier = Tier(TAIL);

    pub(super) fn protected(self) -> bool {
        self.0 & PROTECTED != 0
    }

    /// Protected now or before: what its eviction tells the [`Share`] if it comes back.
    pub(super) fn proven(self) -> bool {
        self.0 & (PROTECTED | DEMOTED) != 0
    }

    /// A chain's end never read: when DRAM evicts it, it is not written to disk. The replays
    /// show such blocks are almost never read later (docs/BENCH.md), and skipping them leaves
    /// the SSD tier's room and write bandwidth to blocks that are.
    pub(super) fn unread_tail(self) -> bool {
        self.0 == TAIL
    }

    pub(super) fn chances(self) -> u8 {
        self.0 & 0x03
    }

    /// A read: probation becomes protected; protected banks a chance.
    pub(super) fn read(self) -> Tier {
        if self.protected() {
            Tier(PROTECTED | (self.chances() + 1).min(MAX_CHANCES))
        } else {
            Tier::PROTECTED
        }
    }

    /// The CLOCK hand passed it: one chance spent, or `None` when it goes back to probation.
    pub(super) fn spend(self) -> Option<Tier> {
        (self.chances() > 0).then(|| Tier(PROTECTED | (self.chances() - 1)))
    }
}

/// Keys evicted recently: 32-bit fingerprints of their hashes in a FIFO of [`GHOST_PER_KEY`]
/// times the keys the pool holds, each with whether the key had been protected. O(1) per
/// eviction and put, about 20 bytes a slot; a false "seen" (about 1 in 200,000 at 4 slots per
/// key) only protects one block early. An exact FIFO matters: a direct-mapped table that
/// forgets at random keeps some keys for many pool turnovers, and protecting those cost a
/// quarter of the hits (docs/BENCH.md). Each slot carries its sequence number, so a key
/// evicted again is forgotten only when its newest slot ages out.
pub(super) struct Ghost {
    order: VecDeque<(u32, u32)>,
    slots: HashMap<u32, (u32, bool), foldhash::fast::RandomState>,
    seq: u32,
    /// Live slots by origin: `[probation, proven]`.
    live: [usize; 2],
    cap: usize,
}

impl Ghost {
    pub(super) fn new() -> Ghost {
        Ghost {
            order: VecDeque::new(),
            slots: Default::default(),
            seq: 0,
            live: [0; 2],
            cap: GHOST_MIN,
        }
    }

    fn fingerprint(hash: u64) -> u32 {
        (hash >> 32) as u32
    }

    /// Remembers an eviction; `proven`: the key had been protected.
    pub(super) fn remember(&mut self, hash: u64, proven: bool) {
        let fp = Self::fingerprint(hash);
        self.seq = self.seq.wrapping_add(1);
        if let Some((_, was)) = self.slots.insert(fp, (self.seq, proven)) {
            self.live[usize::from(was)] -= 1;
        }
        self.live[usize::from(proven)] += 1;
        self.order.push_back((fp, self.seq));
        while self.order.len() > self.cap {
            let Some((old, seq)) = self.order.pop_front() else {
                break;
            };
            if self.slots.get(&old).is_some_and(|&(s, _)| s == seq) {
                let (_, was) = self.slots.remove(&old).unwrap_or_default();
                self.live[usize::from(was)] -= 1;
            }
        }
    }

    /// Whether `hash` was evicted recently, and if so whether it had been protected; a hit
    /// is consumed (its slot in the FIFO stays until it ages out: it only costs a slot).
    pub(super) fn take(&mut self, hash: u64) -> Option<bool> {
        let (_, proven) = self.slots.remove(&Self::fingerprint(hash))?;
        self.live[usize::from(proven)] -= 1;
        Some(proven)
    }

    /// Sizes the table for `keys` resident keys.
    pub(super) fn fit(&mut self, keys: usize) {
        self.cap = keys
            .saturating_mul(GHOST_PER_KEY)
            .clamp(GHOST_MIN, GHOST_MAX);
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.cap
    }
}

/// The protected segment's share of the pool, adapted by ghost hits as ARC adapts its target:
/// a step towards the segment that lost the block, scaled by how much rarer that segment's
/// ghosts are than the other's, so the two kinds of hits balance rather than the more common
/// one winning.
#[derive(Debug, Clone, Copy)]
pub(super) struct Share(f64);

impl Share {
    pub(super) fn new() -> Share {
        Share(SHARE_START)
    }

    pub(super) fn get(self) -> f64 {
        self.0
    }

    /// A ghost hit on a block that takes `fraction` of the pool; `proven`: it had been
    /// protected; `live`: the ghost's live slots `[probation, proven]` after the hit.
    pub(super) fn adapt(&mut self, proven: bool, fraction: f64, live: [usize; 2]) {
        let [probation, protected] = live.map(|n| n.max(1) as f64);
        self.0 = if proven {
            self.0 + SHARE_STEP * PROTECTED_WEIGHT * fraction * (probation / protected).max(1.0)
        } else {
            self.0 - SHARE_STEP * fraction * (protected / probation).max(1.0)
        }
        .clamp(SHARE_MIN, SHARE_MAX);
    }
}

/// A candidate found by a scan: taken only if still the same object, in the same segment,
/// with the same stamp (not touched since).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Candidate {
    pub(super) stamp: Instant,
    pub(super) key: Box<str>,
    pub(super) generation: u64,
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.stamp
            .cmp(&other.stamp)
            .then_with(|| self.generation.cmp(&other.generation))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The oldest `cap` of what a scan offers, oldest first.
pub(super) struct Oldest {
    heap: BinaryHeap<Candidate>,
    cap: usize,
}

impl Oldest {
    pub(super) fn new(cap: usize) -> Oldest {
        Oldest {
            heap: BinaryHeap::with_capacity(cap.min(1024)),
            cap,
        }
    }

    /// Offers a candidate; `key` is only copied when it is among the oldest so far.
    pub(super) fn offer(&mut self, stamp: Instant, key: &str, generation: u64) {
        if self.heap.len() >= self.cap {
            match self.heap.peek() {
                Some(top) if stamp < top.stamp => {
                    self.heap.pop();
                }
                _ => return,
            }
        }
        self.heap.push(Candidate {
            stamp,
            key: key.into(),
            generation,
        });
    }

    pub(super) fn into_queue(self) -> VecDeque<Candidate> {
        self.heap.into_sorted_vec().into()
    }
}

/// What eviction consumes between scans (taken only by eviction, under its lock).
pub(super) struct Queues {
    pub(super) probation: VecDeque<Candidate>,
    pub(super) protected: VecDeque<Candidate>,
}

impl Queues {
    pub(super) fn new() -> Queues {
        Queues {
            probation: VecDeque::new(),
            protected: VecDeque::new(),
        }
    }
}

/// Most chain ends remembered between scans; older ones are still found by the next scan, in
/// their ordinary place.
const MAX_COLD: usize = 1 << 16;

/// What puts leave for eviction: the ghost table to consult, and the chain ends to take
/// before anything a scan found (a leaf lock, taken by PutEnd under a shard lock).
pub(super) struct Recent {
    pub(super) ghost: Ghost,
    pub(super) cold: VecDeque<Candidate>,
    pub(super) share: Share,
    /// The pool's DRAM bytes as eviction last saw them (a put must not take the segments'
    /// lock under its shard's to size a step of the share).
    pub(super) capacity: u64,
}

impl Recent {
    pub(super) fn new() -> Recent {
        Recent {
            ghost: Ghost::new(),
            cold: VecDeque::new(),
            share: Share::new(),
            capacity: 0,
        }
    }

    /// Whether a put found its key in the ghost table; if so the share adapts by the object's
    /// `bytes` (asked only then: most puts miss, and this runs on every PutEnd).
    pub(super) fn came_back(&mut self, hash: u64, bytes: impl FnOnce() -> u64) -> bool {
        let Some(proven) = self.ghost.take(hash) else {
            return false;
        };
        if self.capacity > 0 {
            let fraction = bytes() as f64 / self.capacity as f64;
            self.share.adapt(proven, fraction, self.ghost.live);
        }
        true
    }

    pub(super) fn push_cold(&mut self, key: &str, generation: u64, stamp: Instant) {
        if self.cold.len() >= MAX_COLD {
            self.cold.pop_front();
        }
        self.cold.push_back(Candidate {
            stamp,
            key: key.into(),
            generation,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_read_protects_then_banks_chances_up_to_the_cap() {
        let t = Tier::PROBATION.read();
        assert!(t.protected());
        assert_eq!(t.chances(), 0);
        let t = t.read().read().read().read();
        assert_eq!(t.chances(), MAX_CHANCES);
        let t = t.spend().and_then(Tier::spend).and_then(Tier::spend);
        assert_eq!(t, Some(Tier::PROTECTED));
        assert_eq!(Tier::PROTECTED.spend(), None, "no chance left: demoted");
    }

    #[test]
    fn the_ghost_remembers_an_eviction_once() {
        let mut g = Ghost::new();
        g.remember(0xdead_beef_1234_5678, true);
        assert_eq!(g.take(0x1111_2222_3333_4444), None);
        assert_eq!(g.take(0xdead_beef_1234_5678), Some(true), "with its origin");
        assert_eq!(g.take(0xdead_beef_1234_5678), None, "a hit is consumed");
        g.fit(10_000);
        assert_eq!(g.len(), 40_000, "four slots per resident key");
        let mut g = Ghost::new();
        g.fit(16);
        for h in 0..100u64 {
            g.remember(h << 32, false);
        }
        assert_eq!(g.take(0), None, "the oldest aged out of the FIFO");
        assert_eq!(g.take(99 << 32), Some(false));
        assert_eq!(g.live, [GHOST_MIN - 1, 0]);
    }

    #[test]
    fn a_key_evicted_again_is_forgotten_only_with_its_newest_slot() {
        let mut g = Ghost::new();
        g.fit(16);
        g.remember(7 << 32, false);
        assert_eq!(g.take(7 << 32), Some(false));
        for h in 100..100 + GHOST_MIN as u64 / 2 {
            g.remember(h << 32, false);
        }
        g.remember(7 << 32, true);
        // The first slot of key 7 ages out now; the second must keep it.
        for h in 200..200 + GHOST_MIN as u64 / 2 + 1 {
            g.remember(h << 32, false);
        }
        assert_eq!(g.take(7 << 32), Some(true));
    }

    #[test]
    fn the_share_moves_towards_the_segment_that_lost_the_block() {
        let mut s = Share::new();
        s.adapt(false, 0.01, [100, 10]);
        assert!(
            s.get() < SHARE_START,
            "a probation block came back: probation grows"
        );
        let low = s.get();
        s.adapt(true, 0.01, [100, 10]);
        assert!(
            s.get() - low > 10.0 * 0.01 * SHARE_STEP,
            "a proven one, rarer, moves it further"
        );
        for _ in 0..1000 {
            s.adapt(true, 0.01, [1, 1]);
        }
        assert_eq!(s.get(), SHARE_MAX);
        for _ in 0..1000 {
            s.adapt(false, 0.01, [1, 1]);
        }
        assert_eq!(s.get(), SHARE_MIN);
    }

    #[test]
    fn a_scan_keeps_the_oldest_in_order() {
        let base = Instant::now();
        let mut o = Oldest::new(3);
        for (i, k) in ["e", "a", "d", "b", "c"].iter().enumerate() {
            let age = [5, 1, 4, 2, 3][i];
            o.offer(base + Duration::from_millis(age), k, i as u64);
        }
        let q: Vec<_> = o.into_queue().into_iter().map(|c| c.key).collect();
        assert_eq!(q, vec!["a".into(), "b".into(), "c".into()] as Vec<Box<str>>);
    }
}
