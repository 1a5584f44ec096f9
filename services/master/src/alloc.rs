//! A best-fit offset allocator with coalescing: one per mounted segment. It hands out byte
//! ranges of the segment; the bytes themselves live in the owner's memory.

use std::collections::{BTreeMap, BTreeSet};

/// Every range starts on and is sized in multiples of this many bytes (a cache line).
pub const ALIGN: u64 = 64;

/// Rounds `n` up to [`ALIGN`]; `None` on overflow.
pub fn align_up(n: u64) -> Option<u64> {
    n.checked_add(ALIGN - 1).map(|v| v & !(ALIGN - 1))
}

/// Why an exact range could not be reserved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    #[error("offset {offset} is not a multiple of {ALIGN}")]
    Unaligned { offset: u64 },
    #[error("range {offset}+{len} ends beyond the segment's {capacity} usable bytes")]
    OutOfRange {
        offset: u64,
        len: u64,
        capacity: u64,
    },
    #[error("range {offset}+{len} overlaps an allocated range")]
    Overlap { offset: u64, len: u64 },
    #[error("size 0 cannot be reserved")]
    Empty,
}

/// Free ranges indexed both by offset (for coalescing) and by (len, offset) (for best fit).
#[derive(Debug, Clone)]
pub struct OffsetAllocator {
    capacity: u64,
    free_by_off: BTreeMap<u64, u64>,
    free_by_size: BTreeSet<(u64, u64)>,
    allocated: BTreeMap<u64, u64>,
    used: u64,
}

impl OffsetAllocator {
    /// An allocator over `[0, capacity)`, rounded down to [`ALIGN`].
    pub fn new(capacity: u64) -> OffsetAllocator {
        let capacity = capacity & !(ALIGN - 1);
        let mut a = OffsetAllocator {
            capacity,
            free_by_off: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            allocated: BTreeMap::new(),
            used: 0,
        };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes in allocated ranges (sizes rounded up to [`ALIGN`]).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Number of allocated ranges.
    pub fn allocations(&self) -> usize {
        self.allocated.len()
    }

    /// The largest request that would succeed now.
    pub fn largest_free(&self) -> u64 {
        self.free_by_size.last().map_or(0, |(len, _)| *len)
    }

    /// Orders allocators emptiest first: by the share of their capacity that is free, compared
    /// exactly (cross-multiplied), so a 1 GiB and a 64 GiB segment rank by fill, not by bytes.
    pub fn emptier_first(&self, other: &OffsetAllocator) -> std::cmp::Ordering {
        let free = |a: &OffsetAllocator| u128::from(a.capacity - a.used);
        let (cap_a, cap_b) = (u128::from(self.capacity), u128::from(other.capacity));
        // free_a / cap_a > free_b / cap_b  <=>  free_a * cap_b > free_b * cap_a (caps > 0);
        // an empty-capacity allocator has nothing free and sorts last.
        (free(other) * cap_a.max(1)).cmp(&(free(self) * cap_b.max(1)))
    }

    /// Number of free ranges (1 = unfragmented).
    pub fn free_ranges(&self) -> usize {
        self.free_by_off.len()
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.free_by_off.insert(off, len);
        self.free_by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: u64, len: u64) {
        self.free_by_off.remove(&off);
        self.free_by_size.remove(&(len, off));
    }

    /// Allocates `size` bytes in the smallest free range that fits; returns the offset.
    pub fn allocate(&mut self, size: u64) -> Option<u64> {
        if size == 0 {
            return None;
        }
        let len = align_up(size)?;
        let &(flen, foff) = self.free_by_size.range((len, 0)..).next()?;
        self.remove_free(foff, flen);
        if flen > len {
            self.insert_free(foff + len, flen - len);
        }
        self.allocated.insert(foff, len);
        self.used += len;
        Some(foff)
    }

    /// Marks exactly `[offset, offset + align_up(size))` allocated: used when an owner reports a
    /// range it already holds (mount with inventory).
    pub fn reserve(&mut self, offset: u64, size: u64) -> Result<(), ReserveError> {
        if size == 0 {
            return Err(ReserveError::Empty);
        }
        if !offset.is_multiple_of(ALIGN) {
            return Err(ReserveError::Unaligned { offset });
        }
        let len = align_up(size).unwrap_or(u64::MAX);
        let end = offset.checked_add(len);
        if end.is_none_or(|e| e > self.capacity) {
            return Err(ReserveError::OutOfRange {
                offset,
                len,
                capacity: self.capacity,
            });
        }
        let end = offset + len;
        let Some((&foff, &flen)) = self.free_by_off.range(..=offset).next_back() else {
            return Err(ReserveError::Overlap { offset, len });
        };
        if foff + flen < end {
            return Err(ReserveError::Overlap { offset, len });
        }
        self.remove_free(foff, flen);
        if foff < offset {
            self.insert_free(foff, offset - foff);
        }
        if end < foff + flen {
            self.insert_free(end, foff + flen - end);
        }
        self.allocated.insert(offset, len);
        self.used += len;
        Ok(())
    }

    /// Frees the range that starts at `offset`, merging it with free neighbours. Returns its
    /// length, or `None` if nothing is allocated there.
    pub fn free(&mut self, offset: u64) -> Option<u64> {
        let len = self.allocated.remove(&offset)?;
        self.used -= len;
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&poff, &plen)) = self.free_by_off.range(..offset).next_back()
            && poff + plen == start
        {
            self.remove_free(poff, plen);
            start = poff;
        }
        if let Some(&nlen) = self.free_by_off.get(&end) {
            self.remove_free(end, nlen);
            end += nlen;
        }
        self.insert_free(start, end - start);
        Some(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_aligned_and_tracks_usage() {
        let mut a = OffsetAllocator::new(1000);
        assert_eq!(a.capacity(), 960);
        assert_eq!(a.allocate(1), Some(0));
        assert_eq!(a.allocate(65), Some(64));
        assert_eq!(a.used(), 64 + 128);
        assert_eq!(a.allocate(0), None);
        assert_eq!(
            a.allocate(960),
            None,
            "no room for the whole segment any more"
        );
        assert_eq!(a.largest_free(), 960 - 192);
    }

    #[test]
    fn emptier_first_ranks_by_share_free_not_bytes_free() {
        use std::cmp::Ordering::{Equal, Greater, Less};
        let mut small = OffsetAllocator::new(64 * 10);
        let mut big = OffsetAllocator::new(64 * 1000);
        // small: 9/10 free (576 bytes); big: 500/1000 free (32000 bytes).
        small.allocate(64).unwrap();
        big.allocate(64 * 500).unwrap();
        assert_eq!(
            small.emptier_first(&big),
            Less,
            "90% free ranks before 50% free"
        );
        assert_eq!(big.emptier_first(&small), Greater);
        let mut half = OffsetAllocator::new(64 * 10);
        half.allocate(64 * 5).unwrap();
        assert_eq!(half.emptier_first(&big), Equal, "both half free");
        let none = OffsetAllocator::new(0);
        assert_eq!(none.emptier_first(&big), Greater, "no capacity sorts last");
    }

    #[test]
    fn best_fit_picks_the_smallest_hole() {
        let mut a = OffsetAllocator::new(64 * 100);
        let offs: Vec<u64> = (0..10).map(|_| a.allocate(64 * 4).expect("fits")).collect();
        // Holes of 4 blocks (at offs[1]) and 8 blocks (offs[3..5]), then the tail of 60 blocks.
        a.free(offs[1]);
        a.free(offs[3]);
        a.free(offs[4]);
        assert_eq!(a.allocate(64 * 3), Some(offs[1]), "smallest hole that fits");
        assert_eq!(a.allocate(64 * 6), Some(offs[3]), "next smallest");
        assert_eq!(a.allocate(64 * 50), Some(64 * 40), "tail");
    }

    #[test]
    fn fragmentation_then_coalescing_restores_one_range() {
        let mut a = OffsetAllocator::new(64 * 16);
        let offs: Vec<u64> = (0..16).map(|_| a.allocate(64).expect("fits")).collect();
        assert_eq!(a.allocate(64), None);
        // Free every other block: 8 blocks free, but no 2-block range.
        for o in offs.iter().step_by(2) {
            assert_eq!(a.free(*o), Some(64));
        }
        assert_eq!(a.free_ranges(), 8);
        assert_eq!(a.allocate(128), None, "fragmented");
        for o in offs.iter().skip(1).step_by(2) {
            a.free(*o);
        }
        assert_eq!(a.free_ranges(), 1, "neighbours merged on both sides");
        assert_eq!(a.used(), 0);
        assert_eq!(a.allocate(64 * 16), Some(0));
    }

    #[test]
    fn double_free_and_unknown_offsets_are_refused() {
        let mut a = OffsetAllocator::new(4096);
        let o = a.allocate(100).expect("fits");
        assert_eq!(a.free(o), Some(128));
        assert_eq!(a.free(o), None);
        assert_eq!(a.free(12345), None);
    }

    #[test]
    fn reserve_exact_ranges() {
        let mut a = OffsetAllocator::new(64 * 10);
        a.reserve(64 * 2, 64 * 2).expect("middle");
        a.reserve(0, 10).expect("start");
        a.reserve(64 * 9, 64).expect("end");
        assert_eq!(a.used(), 64 * 4);
        assert_eq!(
            a.reserve(64 * 3, 64),
            Err(ReserveError::Overlap {
                offset: 192,
                len: 64
            })
        );
        assert_eq!(
            a.reserve(64, 128),
            Err(ReserveError::Overlap {
                offset: 64,
                len: 128
            })
        );
        assert!(matches!(
            a.reserve(65, 1),
            Err(ReserveError::Unaligned { .. })
        ));
        assert!(matches!(
            a.reserve(64 * 9, 128),
            Err(ReserveError::OutOfRange { .. })
        ));
        assert!(matches!(
            a.reserve(u64::MAX - 63, 64),
            Err(ReserveError::OutOfRange { .. })
        ));
        assert_eq!(a.reserve(64, 0), Err(ReserveError::Empty));
        // Remaining holes: [64,128) and [256,576). Best fit still works around reservations.
        assert_eq!(a.allocate(64), Some(64));
        assert_eq!(a.allocate(64 * 5), Some(256));
        assert_eq!(a.allocate(1), None);
        for o in [0, 64, 128, 256, 576] {
            a.free(o);
        }
        assert_eq!(a.free_ranges(), 1);
    }

    #[test]
    fn empty_segment_allocates_nothing() {
        let mut a = OffsetAllocator::new(10);
        assert_eq!(a.capacity(), 0);
        assert_eq!(a.allocate(1), None);
        assert_eq!(a.largest_free(), 0);
    }
}
