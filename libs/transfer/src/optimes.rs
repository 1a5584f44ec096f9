//! Latency of the segment server's ops, in fixed buckets of atomics: one relaxed add per op on
//! the serving threads, and a snapshot the store renders as a Prometheus histogram
//! (`lunakv_store_transfer_op_duration_seconds{op}`). Not a prometheus histogram (as the other
//! services' are, through `lunakv_telemetry::metrics`): its observe adds a compare-and-swap
//! loop for the sum to every op of the data path, and the library has no registry of its own
//! (embedded segments have none at all), while a prometheus histogram cannot be filled from a
//! snapshot at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in seconds (the last bucket, +Inf, is implicit).
pub const OP_TIME_BOUNDS: [f64; 12] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25,
];

/// The ops timed, as they appear in the `op` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimedOp {
    /// tcp WRITE: header, payload, commit, reply.
    Write,
    /// shm COMMIT (the bytes were copied by the requester).
    Commit,
    /// tcp READ: pin, send, unpin.
    Read,
    /// shm PIN (the requester copies out of the mapping).
    Pin,
}

impl TimedOp {
    pub const ALL: [TimedOp; 4] = [TimedOp::Write, TimedOp::Commit, TimedOp::Read, TimedOp::Pin];

    pub fn label(self) -> &'static str {
        match self {
            TimedOp::Write => "write",
            TimedOp::Commit => "commit",
            TimedOp::Read => "read",
            TimedOp::Pin => "pin",
        }
    }
}

/// One op's buckets.
#[derive(Default)]
struct Buckets {
    /// Non-cumulative: `counts[i]` holds the observations in (bound[i-1], bound[i]].
    counts: [AtomicU64; OP_TIME_BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

/// Every timed op's buckets.
#[derive(Default)]
pub(crate) struct OpTimes([Buckets; 4]);

impl OpTimes {
    pub(crate) fn observe(&self, op: TimedOp, took: Duration) {
        let b = &self.0[op as usize];
        let secs = took.as_secs_f64();
        let i = OP_TIME_BOUNDS
            .iter()
            .position(|&bound| secs <= bound)
            .unwrap_or(OP_TIME_BOUNDS.len());
        b.counts[i].fetch_add(1, Ordering::Relaxed);
        b.sum_ns.fetch_add(
            took.as_nanos().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
    }

    pub(crate) fn snapshot(&self) -> Vec<OpTimesSnapshot> {
        TimedOp::ALL
            .iter()
            .map(|&op| {
                let b = &self.0[op as usize];
                let mut cumulative = Vec::with_capacity(OP_TIME_BOUNDS.len());
                let mut total = 0;
                for c in &b.counts[..OP_TIME_BOUNDS.len()] {
                    total += c.load(Ordering::Relaxed);
                    cumulative.push(total);
                }
                total += b.counts[OP_TIME_BOUNDS.len()].load(Ordering::Relaxed);
                OpTimesSnapshot {
                    op,
                    cumulative,
                    count: total,
                    sum_seconds: b.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
                }
            })
            .collect()
    }
}

/// One op's histogram at a moment, in Prometheus' shape.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTimesSnapshot {
    pub op: TimedOp,
    /// Observations at or under each of [`OP_TIME_BOUNDS`].
    pub cumulative: Vec<u64>,
    /// All observations (the +Inf bucket).
    pub count: u64,
    pub sum_seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_cumulative_buckets() {
        let t = OpTimes::default();
        t.observe(TimedOp::Read, Duration::from_micros(30));
        t.observe(TimedOp::Read, Duration::from_millis(2));
        t.observe(TimedOp::Read, Duration::from_secs(3));
        t.observe(TimedOp::Write, Duration::from_micros(5));
        let s = t.snapshot();
        let read = s.iter().find(|s| s.op == TimedOp::Read).expect("read");
        assert_eq!(read.count, 3);
        assert_eq!(read.cumulative[1], 0, "<= 25 us");
        assert_eq!(read.cumulative[2], 1, "<= 50 us");
        assert_eq!(read.cumulative[7], 2, "<= 2.5 ms");
        assert_eq!(
            *read.cumulative.last().expect("bounds"),
            2,
            "3 s is only in +Inf"
        );
        assert!((read.sum_seconds - 3.00203).abs() < 1e-6);
        let write = s.iter().find(|s| s.op == TimedOp::Write).expect("write");
        assert_eq!((write.count, write.cumulative[0]), (1, 1));
    }
}
