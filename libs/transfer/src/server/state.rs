//! What every connection of a segment server shares: the segment, its table, the counters,
//! the budgets that bound unauthenticated bodies and LOAD buffers, and the knobs set at start.

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::cap::MountSecret;
use crate::guard::{Admission, PeerLog};
use crate::mem::Mapping;
use crate::table::Table;
use crate::wire::{self};
use crate::{ColdTier, SegmentIdentity};

/// How long a WRITE waits for readers of the entries it overwrites before writing anyway.
pub(crate) const OVERWRITE_PIN_WAIT: Duration = Duration::from_secs(5);
/// A reader that stops draining its socket this long is cut off, so its pin (held during the
/// send) cannot block FREE forever. Idle pooled connections have no read timeout.
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// The refusal of a WRITE or COMMIT of a generation the master freed here (an unfinished put it
/// revoked, discarded or reclaimed, or an object it removed): the range may be someone else's.
pub(super) const REVOKED: &str = "put revoked by the master: its generation was freed here (revoked, \
                       discarded or reclaimed under pressure); start a new put";
/// Most pins one unix connection may hold (bounds memory a misbehaving peer can take).
pub(super) const MAX_PINS_PER_CONN: usize = 1 << 16;
/// Buffer for request headers: pipelined small requests are parsed from one read.
pub(super) const READ_BUF: usize = 16 * 1024;
/// FREE and OFFLOAD bodies are read and applied this many pairs at a time (64 KiB), so a
/// header claiming a million pairs costs nothing until the pairs arrive.
pub(super) const PAIRS_PER_CHUNK: usize = 4096;
/// Bytes all LOADs together may hold in buffers (a disk object is read whole, its checksum
/// verified, then sent). A LOAD over the budget waits for the others; a single larger object
/// waits until it is alone.
const LOAD_BUDGET: u64 = 1 << 30;
/// A connection keeps its LOAD buffer between requests only up to this capacity.
pub(super) const LOAD_BUF_KEEP: usize = 1 << 20;
/// Bytes all FREE/OFFLOAD bodies together may hold while their header passed the master's tag
/// but the whole request's tag is not checked yet (it covers the body, so the body is held
/// until it is all in): two bodies of the most pairs a FREE may carry. Only a replay of a
/// header the master tagged gets this far, and it cannot take more than this from the owner.
pub(super) const UNVERIFIED_BODY_BUDGET: u64 = 2 * wire::MAX_FREE_ITEMS as u64 * 16;
/// Such a body is buffered in steps of this many bytes, so the owner's memory grows only with
/// bytes received.
pub(super) const BODY_STEP: usize = 64 * 1024;

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) shm_attaches: AtomicU64,
    pub(crate) conns_refused: AtomicU64,
    pub(crate) bad_frames: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) too_slow: AtomicU64,
    pub(crate) op_times: crate::optimes::OpTimes,
}

/// Connection counters of a segment server (the store's /metrics shows them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// tcp connections open now.
    pub open_tcp: u64,
    /// shm (unix socket) connections open now.
    pub open_shm: u64,
    /// Connections closed at accept because a cap was reached (tcp and shm).
    pub refused_total: u64,
    /// Connections closed because they sent a malformed or oversized frame, or one that did not
    /// arrive whole in time (counted in `too_slow_total` too).
    pub bad_frames_total: u64,
    /// Of `refused_total`: connections that never completed a valid request, closed to make
    /// room for a newcomer while the tcp table was full.
    pub evicted_total: u64,
    /// Connections closed because a request did not arrive whole within its deadline (a peer
    /// trickling bytes).
    pub too_slow_total: u64,
    /// The caps in force: tcp in all, tcp per source IP (0 = none), shm.
    pub max_tcp: u64,
    pub max_tcp_per_peer: u64,
    pub max_shm: u64,
}

/// Bytes of LOAD buffers in use, against [`LOAD_BUDGET`].
#[derive(Default)]
pub(super) struct LoadBudget {
    pub(super) used: Mutex<u64>,
    pub(super) freed: Condvar,
}

/// Bytes of FREE/OFFLOAD bodies held before their tag is checked, against
/// [`UNVERIFIED_BODY_BUDGET`].
#[derive(Default)]
pub(super) struct BodyBudget {
    pub(super) used: Mutex<u64>,
    pub(super) freed: Condvar,
}

/// One body's share of the [`BodyBudget`]; given back on drop.
pub(super) struct BodyLease<'a> {
    pub(super) budget: &'a BodyBudget,
    pub(super) held: u64,
}

impl BodyBudget {
    pub(super) fn lease(&self) -> BodyLease<'_> {
        BodyLease {
            budget: self,
            held: 0,
        }
    }
}

impl BodyLease<'_> {
    /// Grows this share to `to` bytes, waiting until `until` for other bodies to give theirs
    /// back; false when it could not. A single body never exceeds the budget, so it always
    /// fits once it is alone.
    pub(super) fn grow(&mut self, to: u64, until: Instant) -> bool {
        let more = to.saturating_sub(self.held);
        let mut used = self.budget.used.lock();
        while *used + more > UNVERIFIED_BODY_BUDGET {
            if self.budget.freed.wait_until(&mut used, until).timed_out() {
                return false;
            }
        }
        *used += more;
        self.held += more;
        true
    }
}

impl Drop for BodyLease<'_> {
    fn drop(&mut self) {
        if self.held > 0 {
            *self.budget.used.lock() -= self.held;
            self.budget.freed.notify_all();
        }
    }
}

impl LoadBudget {
    pub(super) fn take(&self, want: u64) -> u64 {
        let want = want.min(LOAD_BUDGET);
        let mut used = self.used.lock();
        while *used + want > LOAD_BUDGET {
            self.freed.wait(&mut used);
        }
        *used += want;
        want
    }

    pub(super) fn give(&self, n: u64) {
        *self.used.lock() -= n;
        self.freed.notify_all();
    }
}

pub(super) enum Live {
    Tcp(TcpStream),
    Unix(UnixStream),
}

pub(crate) struct Shared {
    /// The segment's RDMA memory region, once [`SegmentServer::enable_rdma`] registered it.
    /// Declared before `mem` so it is deregistered before the memory is unmapped.
    pub(super) rdma: crate::rdma::ServerRdma,
    pub(crate) mem: Mapping,
    pub(crate) table: Table,
    pub(crate) counters: Counters,
    pub(crate) stopping: AtomicBool,
    /// Clones of every open connection by its admission slot's id, so shutdown can unblock
    /// their threads and admission can close one it evicts.
    pub(super) conns: Mutex<HashMap<u64, Live>>,
    /// The owner's disk tier, if it offloads.
    pub(crate) cold: std::sync::OnceLock<Arc<dyn ColdTier>>,
    /// What ATTACH answers when asked ([`wire::FLAG_IDENTITY`]).
    pub(super) identity: parking_lot::RwLock<SegmentIdentity>,
    pub(super) admission: Arc<Admission>,
    /// tcp connections idle this long are closed.
    pub(super) idle_timeout: Option<Duration>,
    /// How long one tcp request may take to arrive whole (plus its length's allowance): the
    /// idle timeout when shorter, else [`REQUEST_TIMEOUT`]. Also the tcp connections'
    /// SO_RCVTIMEO, set once per connection, so a read inside a request never blocks long past
    /// its deadline; between requests the idle timeout is counted in such waits.
    pub(super) request_timeout: Duration,
    pub(super) slow_log: PeerLog,
    pub(super) evicted_log: PeerLog,
    pub(super) unverified: BodyBudget,
    pub(super) bad_frame_log: PeerLog,
    pub(super) refused_log: PeerLog,
    pub(super) load_budget: LoadBudget,
    /// Set once the owner requires capabilities ([`SegmentServer::require_capabilities`]).
    /// With the segment's name, which every capability covers.
    pub(super) secret: std::sync::OnceLock<(MountSecret, String)>,
    /// Requests refused for their capability (`lunakv_store_transfer_refused_total`).
    pub(super) refused: AtomicU64,
    pub(super) refusal_log: PeerLog,
}
