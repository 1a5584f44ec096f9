//! The window after a master takes over an empty object index, HA or not: until every segment
//! recorded in the MetaStore has remounted with its inventory (or [`RECOVERY_GRACE`] passed),
//! object RPCs answer `UNAVAILABLE` with [`REBUILDING_HEADER`], and clients retry. Without it a
//! restarted master answers "not found" for objects that exist and "no segment is mounted" for
//! puts until the owners' next ping.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::Status;

use crate::core::MasterCore;
use crate::slot::CoreSlot;

/// The longest a master waits for recorded segments to remount before serving without them.
pub const RECOVERY_GRACE: Duration = Duration::from_secs(3);

/// Set on every "rebuilding" refusal: a client retries it, HA or not, for at most the grace.
pub const REBUILDING_HEADER: &str = lunakv_proto::headers::REBUILDING;

struct Waiting {
    until: Instant,
    segments: BTreeSet<String>,
}

/// What a request does, for the gates: mounts rebuild the index, so they pass while it is
/// rebuilt; reads pass too when a warm copy answers them (HA, docs/HA.md); writes wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Mount,
    Read,
    Write,
}

/// Whether the index is still being rebuilt. Cheap when it is not (one atomic load).
#[derive(Default)]
pub struct RecoveryGate {
    active: AtomicBool,
    waiting: Mutex<Option<Waiting>>,
}

impl RecoveryGate {
    /// Starts a recovery that waits for `known` segments (none: nothing to wait for).
    pub fn begin(&self, known: BTreeSet<String>, grace: Duration) {
        if known.is_empty() {
            self.clear();
            return;
        }
        *self.waiting.lock() = Some(Waiting {
            until: Instant::now() + grace,
            segments: known,
        });
        self.active.store(true, Ordering::Release);
    }

    /// Ends any recovery (a master that steps down).
    pub fn clear(&self) {
        *self.waiting.lock() = None;
        self.active.store(false, Ordering::Release);
    }

    /// True once every awaited segment is mounted in `core`, or the grace has passed.
    pub fn done(&self, core: &MasterCore) -> bool {
        if !self.active.load(Ordering::Acquire) {
            return true;
        }
        let mut w = self.waiting.lock();
        let done = match w.as_mut() {
            None => true,
            Some(rec) if Instant::now() >= rec.until => {
                tracing::warn!(missing = ?rec.segments, "serving without segments that did not remount within the recovery grace");
                true
            }
            Some(rec) => {
                // Mounted with its whole inventory: a segment whose inventory is still
                // arriving would answer "not found" for the objects still to come.
                let mounted = core.complete_segments();
                rec.segments.retain(|s| !mounted.contains(s));
                rec.segments.is_empty()
            }
        };
        if done && w.take().is_some() {
            self.active.store(false, Ordering::Release);
            core.end_warm();
            tracing::info!("object index rebuilt; serving");
        }
        done
    }

    /// The refusal while rebuilding: `why` says which master and why it is empty.
    pub fn refusal(why: &str) -> Status {
        lunakv_proto::status::rebuilding(format!(
            "{why} and is rebuilding its object index from the store-clients' inventories; \
             retry in a moment"
        ))
    }
}

/// After the grace: segments that did not remount belong to dead owners. Forgets their
/// records, or every later restart or failover would wait the full grace for them again.
/// `still_ours` is false once this master no longer serves the term that waited.
pub async fn forget_unmounted(
    known: BTreeSet<String>,
    slot: std::sync::Arc<CoreSlot>,
    meta: std::sync::Arc<dyn lunakv_meta::MetaStore>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    still_ours: impl Fn() -> bool,
) {
    // A stopping master lets go of its MetaStore at once (a restart in the same process must
    // be able to open the file again).
    tokio::select! {
        _ = tokio::time::sleep(RECOVERY_GRACE) => {}
        _ = stop.changed() => return,
    }
    if *stop.borrow() || !still_ours() {
        return;
    }
    let core = slot.get();
    // The warm copy's segments whose owner never remounted leave the index first, so that
    // their records are forgotten too.
    core.end_warm();
    let mounted: BTreeSet<String> = core.segments().into_iter().map(|s| s.name).collect();
    for name in known.difference(&mounted) {
        tracing::warn!(segment = %name, "segment did not remount after the master took over; forgetting its record");
        if let Err(e) = crate::persist::forget_segment(meta.as_ref(), name).await {
            tracing::warn!(segment = %name, error = %e, "cannot forget the segment record");
        }
    }
}
