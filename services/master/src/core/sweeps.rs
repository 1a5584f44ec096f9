//! Sweeps: zombie puts (started and never ended), the quarantine of discarded puts' ranges,
//! orphaned ranges of dead writers, and the key limit.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::alloc::align_up;

use super::state::MasterCore;
use super::types::{Holder, Object, ObjectState, PendingFree, Quarantined, tiers_of};

impl MasterCore {
    /// Drops puts started more than `put_discard_timeout` ago and never ended (their keys become
    /// free at once), and frees the ranges of those whose release deadline has passed.
    /// Returns the number of puts discarded.
    pub async fn sweep_puts(&self) -> u64 {
        let now = Instant::now();
        let mut discarded = 0;
        let mut reserved: Vec<(Holder, u64)> = Vec::new();
        // Puts started while this runs land in the live map and are left for the next sweep.
        let candidates = std::mem::take(&mut *self.inflight.lock());
        let mut still = Vec::new();
        for (generation, (key, holder)) in candidates {
            let mut shard = self.shard(&key).lock();
            let Some(o) = shard.get(key.as_str()) else {
                continue;
            };
            if o.state != ObjectState::Processing || o.generation != generation {
                continue;
            }
            if now.duration_since(o.put_start) < self.cfg.put_discard_timeout {
                let bytes = align_up(o.size).unwrap_or(o.size) * o.replicas.len() as u64;
                reserved.push((holder.clone(), bytes));
                still.push((key, generation, holder));
                continue;
            }
            if let Some(o) = shard.remove(key.as_str()) {
                tracing::warn!(key = %key, client_id = %o.client_id, generation = o.generation, "put never ended; discarded");
                let frees = self.pending_frees(&o);
                // The writer may still be copying into these ranges: they stay allocated
                // until put_start + put_release_timeout, its revoke, or its death.
                let owner = self
                    .put_owners
                    .lock()
                    .remove(&o.generation)
                    .map(|(_, id)| id);
                self.quarantine.lock().push(Quarantined {
                    until: o.put_start + self.cfg.put_release_timeout,
                    key,
                    client_id: o.client_id.to_string(),
                    owner,
                    frees,
                });
                discarded += 1;
            }
        }
        {
            // A put of the same key started meanwhile has a generation of its own: both are
            // followed, and the older one is dropped once the index holds the newer.
            self.inflight
                .lock()
                .extend(still.into_iter().map(|(k, g, h)| (g, (k, h))));
        }
        self.forget_gone_put_owners();
        let keys = self.shards.iter().map(|s| s.lock().len() as u64).sum();
        self.names.trim();
        // Discarded puts are no longer reservations (their ranges wait in quarantine).
        self.reserved.lock().recount(reserved);
        self.approx_keys.store(keys, Ordering::Relaxed);
        let due = self.unquarantine(|q| q.until <= now);
        self.release(due).await;
        discarded
    }

    /// Drops the recorded identities of puts that went without PutEnd, PutRevoke or discard (a
    /// remove, an unmount, the writer's death): those whose object is gone or complete.
    fn forget_gone_put_owners(&self) {
        let owned: Vec<(u64, Box<str>)> = self
            .put_owners
            .lock()
            .iter()
            .map(|(g, (k, _))| (*g, k.clone()))
            .collect();
        for (generation, key) in owned {
            let live =
                self.shard(&key).lock().get(&key).is_some_and(|o| {
                    o.generation == generation && o.state == ObjectState::Processing
                });
            if !live {
                self.put_owners.lock().remove(&generation);
            }
        }
    }

    /// A put of `o` ended or was revoked: it leaves the sweep's list and its bytes no longer
    /// count against its holder (other exits are corrected by the next sweep's recount).
    pub(super) fn unreserve(&self, o: &Object) {
        let bytes = align_up(o.size).unwrap_or(o.size) * o.replicas.len() as u64;
        if let Some((_, holder)) = self.inflight.lock().remove(&o.generation) {
            self.reserved.lock().sub(&holder, bytes);
        }
    }

    /// Takes the quarantined puts `pick` selects; returns their ranges to free.
    pub(super) fn unquarantine(&self, pick: impl Fn(&Quarantined) -> bool) -> Vec<PendingFree> {
        let mut q = self.quarantine.lock();
        let (due, keep): (Vec<_>, Vec<_>) = q.drain(..).partition(|e| pick(e));
        *q = keep;
        due.into_iter().flat_map(|e| e.frees).collect()
    }

    /// Frees what [`Self::expire_clients`] took from dead writers: their unfinished puts and
    /// quarantined ranges (nobody is left to copy into them).
    pub async fn release_orphaned(&self) {
        let frees = std::mem::take(&mut *self.orphaned.lock());
        if !frees.is_empty() {
            self.metrics
                .put_reservations_reclaimed_total
                .inc_by(frees.len() as u64);
            self.release(frees).await;
        }
    }

    /// At `max_keys`: drops the least recently used objects (DRAM and disk copies alike) down
    /// to 95% of the limit. Leased, pinned and unfinished objects stay. Returns keys dropped.
    pub async fn enforce_key_limit(&self) -> u64 {
        let max = self.cfg.max_keys;
        if max == 0 {
            return 0;
        }
        let _guard = self.eviction_lock.lock().await;
        let count = self.key_count();
        self.approx_keys.store(count, Ordering::Relaxed);
        if count < max {
            return 0;
        }
        let excess = count - max * 19 / 20;
        let now = Instant::now();
        let mut candidates: Vec<(bool, Instant, String, u64)> = Vec::new();
        for shard in &self.shards {
            for (k, o) in shard.lock().iter() {
                if o.state == ObjectState::Complete && !o.leased(now) && !o.hard_pinned {
                    candidates.push((
                        o.soft_pinned(now),
                        o.last_access,
                        k.to_string(),
                        o.generation,
                    ));
                }
            }
        }
        candidates.sort_by_key(|c| (c.0, c.1));
        let mut frees = Vec::new();
        let mut dropped = 0u64;
        for (_, _, key, generation) in candidates.into_iter().take(excess as usize) {
            let mut shard = self.shard(&key).lock();
            if shard
                .get(key.as_str())
                .is_some_and(|o| o.generation == generation && !o.leased(Instant::now()))
                && let Some(o) = shard.remove(key.as_str())
            {
                self.emit_updated(&key, (o.generation, o.size), tiers_of(&o.replicas), &[]);
                frees.extend(self.pending_frees(&o));
                dropped += 1;
            }
        }
        self.release(frees).await;
        self.approx_keys
            .fetch_sub(dropped.min(count), Ordering::Relaxed);
        self.metrics.key_limit_evictions_total.inc_by(dropped);
        self.metrics.evicted(dropped);
        tracing::warn!(
            max_keys = max,
            dropped,
            "object index at max_keys: dropped the least recently used objects"
        );
        dropped
    }
}
