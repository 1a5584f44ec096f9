//! The placement ramp: a segment that joins a pool of settled segments (a restarted or added
//! store) takes a bounded, growing share of new puts while it fills, instead of all of them.
//!
//! Why: an empty segment in a full pool is the only one with room, and under
//! `free_ratio_first` the emptiest, so without a ramp it takes every put until it is as full as
//! the others (upstream MC#3688): one store's NIC and CPU then carry the whole fleet's writes,
//! and the hottest (newest) blocks all live there. While it ramps, a put skips it unless a draw
//! under `max(1 / segments, elapsed / ramp)` keeps it; the settled segments make room by
//! eviction as a full pool always does. A retry after eviction only moves the ramping segment
//! last, so the ramp never fails a put, and a caller's preferred segments (an engine's own) are
//! never skipped.

use std::time::{Duration, Instant};

/// Which placement attempt of a PutStart this is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Pass {
    /// The first try: a ramping segment the draw does not keep is left out.
    First,
    /// After eviction or reclaim: a ramping segment the draw does not keep goes last.
    Retry,
}

/// The share of new puts a segment opened to placements at `opened_at` may take at `now`;
/// `None` when it does not ramp (never opened, or opened at least `ramp` ago).
pub(super) fn share(
    opened_at: Option<Instant>,
    now: Instant,
    ramp: Duration,
    segments: usize,
) -> Option<f64> {
    let opened = opened_at?;
    let elapsed = now.saturating_duration_since(opened);
    if ramp.is_zero() || elapsed >= ramp {
        return None;
    }
    let floor = 1.0 / segments.max(1) as f64;
    Some((elapsed.as_secs_f64() / ramp.as_secs_f64()).max(floor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_grows_from_a_fair_share_to_none() {
        let now = Instant::now();
        let ramp = Duration::from_secs(100);
        let ago = |s| now.checked_sub(Duration::from_secs(s));
        // Just opened beside 3 others: a fair quarter, not nothing.
        assert_eq!(share(Some(now), now, ramp, 4), Some(0.25));
        if let Some(t) = ago(50) {
            assert_eq!(share(Some(t), now, ramp, 4), Some(0.5));
        }
        if let Some(t) = ago(100) {
            assert_eq!(share(Some(t), now, ramp, 4), None, "the ramp is over");
        }
        assert_eq!(share(None, now, ramp, 4), None, "never opened");
        assert_eq!(share(Some(now), now, Duration::ZERO, 4), None, "ramp off");
    }
}
