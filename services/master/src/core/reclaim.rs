//! Reclaiming unfinished puts under pressure (docs/SECURITY.md, "One caller cannot take the pool
//! down").
//!
//! The reservation bounds ([`super::reservations`]) stop one holder from pinning the pool, but
//! zombies at a few addresses still fill `put_reservation_total_ratio` and every other put is
//! refused until the discard and release timeouts (30 s + 600 s). So a PutStart that finds no
//! room takes back the unfinished puts of other holders started more than
//! `put_reclaim_grace_ms` ago, largest holders first, until it has the bytes it needs.
//!
//! Reusing a zombie's range is safe only if its writer can no longer write into it: its write
//! capability is valid for minutes. So a reclaimed put's ranges go back to the allocator only
//! once their owner acknowledged the FREE, and an owner acknowledges only after it revoked the
//! generation (later WRITEs and COMMITs of it are refused) and every write of it in flight
//! ended (libs/transfer `Table::free_items`). A FREE not acknowledged leaves the range in
//! quarantine until the put's release deadline, as a discarded put's.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::alloc::align_up;
use crate::notifier::FreeEntry;

use super::state::MasterCore;
use super::types::{Holder, ObjectState, PendingFree, Quarantined, fan_out_by_owner};

/// Longest a PutStart waits for other holders' puts to reach the grace: past it, it is refused
/// as before and retries (a grace set longer than this reclaims only puts already that old).
const MAX_WAIT: Duration = Duration::from_secs(1);

/// An unfinished put another holder may lose.
struct Candidate {
    generation: u64,
    key: String,
    holder: Holder,
    started: Instant,
    bytes: u64,
}

/// A put taken out of the index, whose ranges wait for their owners' acknowledgment.
struct Taken {
    key: String,
    client_id: String,
    owner: Option<std::sync::Arc<str>>,
    put_start: Instant,
    /// The reserved bytes of one replica (one range).
    replica_bytes: u64,
    frees: Vec<PendingFree>,
}

impl MasterCore {
    /// Frees unfinished puts of holders other than `holder`, started more than
    /// `put_reclaim_grace` ago, the largest holders' first (their oldest first), until `need`
    /// bytes are reclaimed or none is left. When the puts old enough fall short but younger
    /// ones would do within [`MAX_WAIT`], waits for those to age once. Returns bytes reclaimed
    /// and acknowledged by their owners (the rest is quarantined).
    ///
    /// Callers serialize rounds with `reclaim_lock`, so two short PutStarts do not pick the
    /// same puts and each find less than it needs.
    pub(super) async fn reclaim_reservations(&self, holder: &Holder, need: u64) -> u64 {
        if need == 0 {
            return 0;
        }
        let grace = self.cfg.put_reclaim_grace;
        let mut candidates = self.reclaim_candidates(holder);
        let now = Instant::now();
        let ripe = |c: &Candidate, at: Instant| at.saturating_duration_since(c.started) >= grace;
        let ready: u64 = candidates
            .iter()
            .filter(|c| ripe(c, now))
            .map(|c| c.bytes)
            .sum();
        if ready < need {
            // The soonest moment enough puts are old enough, if any is: a victim arriving just
            // after the zombies waits for them to age instead of being refused.
            let mut by_age: Vec<(Instant, u64)> =
                candidates.iter().map(|c| (c.started, c.bytes)).collect();
            by_age.sort_unstable_by_key(|&(t, _)| t);
            let mut sum = 0;
            let at = by_age.into_iter().find_map(|(t, b)| {
                sum += b;
                (sum >= need).then_some(t + grace)
            });
            if let Some(at) = at.filter(|&at| at.saturating_duration_since(now) <= MAX_WAIT) {
                tokio::time::sleep_until(at.into()).await;
                candidates = self.reclaim_candidates(holder);
            }
        }
        let now = Instant::now();
        candidates.retain(|c| ripe(c, now));
        if candidates.is_empty() {
            return 0;
        }
        let held: HashMap<Holder, u64> = {
            let r = self.reserved.lock();
            candidates
                .iter()
                .map(|c| (c.holder.clone(), r.held(&c.holder)))
                .collect()
        };
        // Largest holders first: an attacker spread over addresses loses its biggest stake
        // before any small writer is touched; within a holder, its oldest puts first.
        candidates.sort_by(|a, b| {
            let (ha, hb) = (held[&a.holder], held[&b.holder]);
            hb.cmp(&ha)
                .then_with(|| a.holder.to_string().cmp(&b.holder.to_string()))
                .then_with(|| a.started.cmp(&b.started))
        });
        let mut taken = Vec::new();
        let mut by_holder: Vec<(Holder, u64, u64)> = Vec::new();
        let mut got = 0u64;
        for c in candidates {
            if got >= need {
                break;
            }
            let Some(t) = self.take_for_reclaim(&c, grace) else {
                continue;
            };
            got = got.saturating_add(c.bytes);
            match by_holder.iter_mut().find(|(h, _, _)| *h == c.holder) {
                Some(row) => {
                    row.1 += 1;
                    row.2 += c.bytes;
                }
                None => by_holder.push((c.holder.clone(), 1, c.bytes)),
            }
            taken.push(t);
        }
        if taken.is_empty() {
            return 0;
        }
        self.metrics
            .put_reservations_reclaimed_total
            .inc_by(taken.len() as u64);
        if let Some(suppressed) = self.reclaim_log.check(Instant::now()) {
            let holders = by_holder
                .iter()
                .map(|(h, n, b)| format!("{h}: {n} puts, {b} bytes"))
                .collect::<Vec<_>>()
                .join("; ");
            tracing::warn!(
                for_holder = %holder,
                puts = taken.len(),
                bytes = got,
                %holders,
                suppressed_rounds = suppressed,
                "no room for a put: reclaimed unfinished puts of other callers older than \
                 put_reclaim_grace_ms; their owners refuse the writers' late writes"
            );
        }
        let mut acknowledged = got;
        let frees: Vec<PendingFree> = taken.iter().flat_map(|t| t.frees.clone()).collect();
        let unacked = self.release_acknowledged(frees).await;
        if !unacked.is_empty() {
            let mut q = self.quarantine.lock();
            for t in taken {
                let left: Vec<PendingFree> = t
                    .frees
                    .into_iter()
                    .filter(|f| unacked.contains(&f.endpoint))
                    .collect();
                if left.is_empty() {
                    continue;
                }
                acknowledged = acknowledged.saturating_sub(left.len() as u64 * t.replica_bytes);
                q.push(Quarantined {
                    until: t.put_start + self.cfg.put_release_timeout,
                    key: t.key,
                    client_id: t.client_id,
                    owner: t.owner,
                    frees: left,
                });
            }
        }
        acknowledged
    }

    /// Unfinished puts of holders other than `holder` still in the index.
    fn reclaim_candidates(&self, holder: &Holder) -> Vec<Candidate> {
        let inflight: Vec<(u64, String, Holder)> = self
            .inflight
            .lock()
            .iter()
            .filter(|(_, (_, h))| h != holder)
            .map(|(g, (k, h))| (*g, k.clone(), h.clone()))
            .collect();
        inflight
            .into_iter()
            .filter_map(|(generation, key, holder)| {
                let shard = self.shard(&key).lock();
                let o = shard
                    .get(key.as_str())
                    .filter(|o| o.generation == generation && o.state == ObjectState::Processing)?;
                let bytes = align_up(o.size).unwrap_or(o.size) * o.replicas.len() as u64;
                let started = o.put_start;
                drop(shard);
                Some(Candidate {
                    generation,
                    key,
                    holder,
                    started,
                    bytes,
                })
            })
            .collect()
    }

    /// Takes `c` out of the index as a PutRevoke would, if it is still that unfinished put and
    /// old enough; its reservation no longer counts.
    fn take_for_reclaim(&self, c: &Candidate, grace: Duration) -> Option<Taken> {
        let mut shard = self.shard(&c.key).lock();
        let o = shard.get(c.key.as_str())?;
        if o.generation != c.generation
            || o.state != ObjectState::Processing
            || o.put_start.elapsed() < grace
        {
            return None;
        }
        let o = shard.remove(c.key.as_str())?;
        self.unreserve(&o);
        let owner = self
            .put_owners
            .lock()
            .remove(&o.generation)
            .map(|(_, id)| id);
        let frees = self.pending_frees(&o);
        drop(shard);
        Some(Taken {
            key: c.key.clone(),
            client_id: o.client_id.to_string(),
            owner,
            put_start: o.put_start,
            replica_bytes: align_up(o.size).unwrap_or(o.size),
            frees,
        })
    }

    /// [`Self::release`] for ranges a writer may still hold a capability for: each owner is
    /// asked (in parallel) to drop its entries, and only the ranges of owners that
    /// acknowledged go back to their allocators (an owner's OK means it revoked the
    /// generations and no write of them is in flight). Returns the endpoints that did not
    /// acknowledge; their ranges stay allocated for the caller to quarantine.
    pub(super) async fn release_acknowledged(&self, frees: Vec<PendingFree>) -> Vec<String> {
        if frees.is_empty() {
            return Vec::new();
        }
        let timeout = self.cfg.free_timeout;
        let notifier = &self.notifier;
        let owners = frees.iter().map(|f| {
            (
                f.endpoint.clone(),
                FreeEntry::from_wire(f.generation, f.offset),
            )
        });
        let answers = fan_out_by_owner(owners, |endpoint, entries| async move {
            let r = tokio::time::timeout(
                timeout + Duration::from_millis(500),
                notifier.free(&endpoint, &entries, timeout),
            )
            .await;
            let ok = match r {
                Ok(Ok(())) => true,
                Ok(Err(e)) => {
                    tracing::warn!(%endpoint, entries = entries.len(), error = %e, "owner did not acknowledge the FREE of reclaimed puts; their ranges stay quarantined until the puts' release deadline");
                    false
                }
                Err(_) => {
                    tracing::warn!(%endpoint, entries = entries.len(), "FREE of reclaimed puts timed out; their ranges stay quarantined until the puts' release deadline");
                    false
                }
            };
            (endpoint, ok)
        })
        .await;
        let unacked: Vec<String> = answers
            .into_iter()
            .filter(|(_, ok)| !ok)
            .map(|(e, _)| e)
            .collect();
        let mut segs = self.segments.lock();
        for f in frees {
            if f.offset == lunakv_transfer::DISK_OFFSET || unacked.contains(&f.endpoint) {
                continue;
            }
            if let Some(seg) = segs
                .get_mut(&f.segment)
                .filter(|s| s.mount_id == f.mount_id)
            {
                seg.alloc.free(f.offset);
            }
        }
        unacked
    }
}
