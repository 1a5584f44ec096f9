//! Tiering: eviction, offload to disk and promotion back to DRAM (the sweeps of unfinished
//! puts and the key limit are in [`super::sweeps`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lunakv_proto::ErrorCode;

use crate::alloc::align_up;
use crate::notifier::{OffloadEntry, OffloadOutcome, Promote};

use super::policy::{EvictionPolicy, Tier};
use super::state::MasterCore;
use super::types::{
    Caller, Object, ObjectState, OpError, PendingFree, PendingOffload, PendingPromotion,
    ReplicaLoc, fan_out_by_owner, not_found, tiers_of,
};

/// A group whose newest member was put this recently may still be waiting for members (the
/// other TP ranks' shards of a chunk arrive within a step of each other): eviction takes it
/// only after every settled candidate, so it is not emptied before it is whole.
const GROUP_SETTLE: Duration = Duration::from_secs(5);

/// What eviction takes at once: one object, or a whole group.
struct Unit {
    /// A group still settling ([`GROUP_SETTLE`]); always false for an object alone.
    young: bool,
    soft_pinned: bool,
    last_access: Instant,
    /// Every member may go (complete, unleased, not hard-pinned).
    evictable: bool,
    /// (key, generation, DRAM bytes) of each member with DRAM to free.
    members: Vec<(String, u64, u64)>,
}

impl MasterCore {
    /// Allocated share of total capacity, in [0, 1].
    pub fn usage_ratio(&self) -> f64 {
        let (used, cap) = self.usage();
        if cap == 0 {
            0.0
        } else {
            used as f64 / cap as f64
        }
    }

    /// Usage is at or above the high watermark (lru only: cslru evicts what puts need, when
    /// they need it, so the pool's last 5% is not left empty).
    pub fn eviction_due(&self) -> bool {
        if self.cfg.eviction_policy == EvictionPolicy::Cslru {
            return false;
        }
        // One pass over the segments: PutEnd asks this for every key.
        let (used, cap) = self.usage();
        cap > 0 && used as f64 / cap as f64 >= self.cfg.high_watermark
    }

    /// Evicts if usage is at or above the high watermark. Returns keys evicted.
    pub async fn evict_if_needed(&self) -> u64 {
        if self.eviction_due() {
            self.evict(0).await
        } else {
            0
        }
    }

    /// Evicts at least `max(eviction_ratio * capacity, min_bytes)` bytes of DRAM if it can:
    /// complete, unleased, unpinned objects, least recently used first; soft-pinned ones only
    /// after all others; hard-pinned, leased and in-progress ones never. With offload on, an
    /// object whose owner has a disk tier is not dropped: its owner writes it to disk before the
    /// DRAM range is freed, and it stays indexed with a LOCAL_DISK replica. An object that already
    /// has a disk copy just loses its DRAM replicas. Returns keys evicted from DRAM.
    pub async fn evict(&self, min_bytes: u64) -> u64 {
        match self.cfg.eviction_policy {
            EvictionPolicy::Lru => {
                let target = ((self.total_capacity() as f64 * self.cfg.eviction_ratio) as u64)
                    .max(min_bytes);
                self.evict_matching(target, |_| true).await
            }
            EvictionPolicy::Cslru => {
                let chunk = (self.total_capacity() as f64 * super::policy::CHUNK_SHARE) as u64;
                self.evict_cslru(min_bytes.max(chunk)).await
            }
        }
    }

    /// Evicts at least `target` bytes of DRAM, as [`Self::evict`] does, from the objects whose
    /// key `pick` selects (a tenant's, when its quota is full).
    pub(super) async fn evict_matching(&self, target: u64, pick: impl Fn(&str) -> bool) -> u64 {
        let _guard = self.eviction_lock.lock().await;
        let now = Instant::now();
        // A unit is one object, or every member of a group: a group goes whole or not at all,
        // only when no member is leased, pinned or being put (docs/GROUPS.md).
        let mut candidates: Vec<Unit> = Vec::new();
        let mut groups: HashMap<Arc<str>, Unit> = HashMap::new();
        for shard in &self.shards {
            for (k, o) in shard.lock().iter() {
                if !pick(k) {
                    continue;
                }
                let in_dram = o.replicas.iter().filter(|r| !r.disk).count() as u64;
                let evictable =
                    o.state == ObjectState::Complete && !o.leased(now) && !o.hard_pinned;
                let bytes = align_up(o.size).unwrap_or(o.size) * in_dram;
                let member = (k.to_string(), o.generation, bytes);
                match &o.group {
                    None if in_dram > 0 && evictable => candidates.push(Unit {
                        young: false,
                        soft_pinned: o.soft_pinned(now),
                        last_access: o.last_access,
                        evictable: true,
                        members: vec![member],
                    }),
                    None => {}
                    Some(g) => {
                        let u = groups.entry(g.clone()).or_insert_with(|| Unit {
                            young: false,
                            soft_pinned: false,
                            last_access: o.last_access,
                            evictable: true,
                            members: Vec::new(),
                        });
                        u.evictable &= evictable;
                        u.young |= now.saturating_duration_since(o.put_start) < GROUP_SETTLE;
                        u.soft_pinned |= o.soft_pinned(now);
                        u.last_access = u.last_access.max(o.last_access);
                        if in_dram > 0 {
                            u.members.push(member);
                        }
                    }
                }
            }
        }
        candidates.extend(
            groups
                .into_values()
                .filter(|u| u.evictable && !u.members.is_empty()),
        );
        candidates.sort_by_key(|c| (c.young, c.soft_pinned, c.last_access));
        let mut freed = 0u64;
        let mut evicted = 0u64;
        let mut frees = Vec::new();
        let mut offloads = Vec::new();
        for unit in candidates {
            // The target is checked per unit, so it never cuts a group in half.
            if freed >= target {
                break;
            }
            for (key, generation, _) in unit.members {
                // Re-check: a reader may have leased it since the scan.
                let now = Instant::now();
                let evictable = |o: &Object| {
                    o.generation == generation
                        && o.state == ObjectState::Complete
                        && !o.leased(now)
                        && !o.hard_pinned
                };
                if let Some(bytes) = self.evict_one(&key, evictable, &mut frees, &mut offloads) {
                    freed += bytes;
                    evicted += 1;
                }
            }
        }
        if evicted > 0 {
            tracing::debug!(
                evicted,
                offloaded = offloads.len(),
                freed,
                target,
                "eviction pass"
            );
            self.metrics.evicted(evicted);
            self.metrics.successful_evictions_total.inc();
        }
        self.release(frees).await;
        self.run_offloads(offloads).await;
        // A member leased between the scan and its turn stayed: its group goes whole now.
        self.drop_broken_groups().await;
        evicted
    }

    /// Takes `key`'s DRAM copies if `evictable` still holds for it under its shard lock: with
    /// offload on, an object whose owner has a disk tier moves there (its DRAM range is freed
    /// once the OFFLOAD made it durable); an object with a disk copy just loses its DRAM
    /// replicas; any other leaves the index. Returns the DRAM bytes freed.
    pub(super) fn evict_one(
        &self,
        key: &str,
        evictable: impl FnOnce(&Object) -> bool,
        frees: &mut Vec<PendingFree>,
        offloads: &mut Vec<PendingOffload>,
    ) -> Option<u64> {
        let mut shard = self.shard(key).lock();
        let mut o = shard.get_mut(key).filter(|o| evictable(o))?;
        let in_dram = o.replicas.iter().filter(|r| !r.disk).count() as u64;
        let bytes = align_up(o.size).unwrap_or(o.size) * in_dram;
        if in_dram == 0 {
            return None;
        }
        let has_disk = o.replicas.iter().any(|r| r.disk);
        let before = tiers_of(&o.replicas);
        // The SSD tier is the policy's second level: what it expects no read for is dropped.
        let declined = self.cfg.eviction_policy == EvictionPolicy::Cslru && o.tier.unread_tail();
        let spill_to = if has_disk || !self.cfg.enable_offload {
            None
        } else {
            let segs = self.segments.lock();
            o.replicas.iter().filter(|r| !r.disk).find_map(|r| {
                segs.get(&*r.segment)
                    .filter(|s| {
                        s.mount_id == r.mount_id
                            && s.desc.enable_offload
                            && s.desc.disk_capacity >= o.size
                    })
                    .map(|s| (r.clone(), s.desc.transfer_endpoint.clone()))
            })
        };
        let spill_to = match spill_to {
            Some(_) if declined => {
                self.metrics.offload_declined_total.inc();
                None
            }
            s => s,
        };
        if has_disk || spill_to.is_some() {
            // The object survives on disk; its DRAM replicas go (the one being offloaded
            // is freed by the OFFLOAD round trip, after the owner made it durable).
            let mem: Vec<ReplicaLoc> = o
                .replicas
                .iter()
                .filter(|r| !r.disk)
                .filter(|r| {
                    spill_to
                        .as_ref()
                        .is_none_or(|(t, _)| !(t.segment == r.segment && t.offset == r.offset))
                })
                .cloned()
                .collect();
            frees.extend(self.frees_of(o.generation, &mem));
            o.replicas.retain(|r| r.disk);
            // Promotion's admission counts the reads it takes from disk from here.
            o.disk_reads = 0;
            if let Some((t, endpoint)) = spill_to {
                offloads.push(PendingOffload {
                    key: key.to_string(),
                    endpoint,
                    segment: t.segment.to_string(),
                    mount_id: t.mount_id,
                    generation: o.generation,
                    offset: t.offset,
                });
                o.replicas.push(ReplicaLoc {
                    offset: lunakv_transfer::DISK_OFFSET,
                    disk: true,
                    ..t
                });
            }
            self.emit_updated(key, (o.generation, o.size), before, &o.replicas);
        } else {
            drop(o);
            let o = shard.remove(key)?;
            self.emit_updated(key, (o.generation, o.size), before, &[]);
            frees.extend(self.pending_frees(&o));
        }
        Some(bytes)
    }

    /// Moves one object's DRAM copy to its owner's disk tier now, as eviction would (the
    /// explicit request behind `lunakv doctor`'s SSD check). Answers once the owner made the
    /// bytes durable; an object already on disk is left as it is.
    pub async fn offload_key(&self, key: &str) -> Result<(), OpError> {
        if !self.cfg.enable_offload {
            return Err(OpError::new(
                ErrorCode::InvalidParams,
                "the master runs without --enable_offload: start it with --enable_offload=true \
                 to use the SSD tier",
            ));
        }
        let item = {
            let mut shard = self.shard(key).lock();
            let mut o = shard
                .get_mut(key)
                .ok_or_else(|| not_found(key, "not found"))?;
            if o.state != ObjectState::Complete {
                return Err(not_found(key, "its put has not ended yet"));
            }
            if o.replicas.iter().any(|r| r.disk) {
                return Ok(());
            }
            let segs = self.segments.lock();
            let target = o.replicas.iter().position(|r| {
                segs.get(&*r.segment).is_some_and(|s| {
                    s.mount_id == r.mount_id
                        && s.desc.enable_offload
                        && s.desc.disk_capacity >= o.size
                })
            });
            let Some(i) = target else {
                return Err(OpError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "key {key:?} has no replica on a store-client with a usable disk tier: \
                         start lunakv-store with --enable_offload=true and a writable \
                         --offload_dir (or MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)"
                    ),
                ));
            };
            let before = tiers_of(&o.replicas);
            let r = o.replicas.remove(i);
            let endpoint = segs
                .get(&*r.segment)
                .map(|s| s.desc.transfer_endpoint.clone())
                .unwrap_or_default();
            drop(segs);
            let item = PendingOffload {
                key: key.to_string(),
                endpoint,
                segment: r.segment.to_string(),
                mount_id: r.mount_id,
                generation: o.generation,
                offset: r.offset,
            };
            o.replicas.push(ReplicaLoc {
                offset: lunakv_transfer::DISK_OFFSET,
                disk: true,
                ..r
            });
            self.emit_updated(key, (o.generation, o.size), before, &o.replicas);
            item
        };
        let generation = item.generation;
        self.run_offloads(vec![item]).await;
        let on_disk = self
            .shard(key)
            .lock()
            .get(key)
            .is_some_and(|o| o.generation == generation && o.replicas.iter().any(|r| r.disk));
        if on_disk {
            Ok(())
        } else {
            Err(OpError::new(
                ErrorCode::InternalError,
                format!(
                    "the owner of {key:?} could not write it to disk: see the store-client's log"
                ),
            ))
        }
    }

    /// Sends OFFLOAD to each owner (in parallel, one call per owner), then returns the DRAM
    /// ranges to their allocators. Objects an owner could not store (disk full, unwritable,
    /// unreachable) lose their LOCAL_DISK replica: a plain eviction, never a dangling replica.
    /// Objects its disk tier dropped to make room, named in its answer, lose their disk replica
    /// on that segment before this returns: an eviction runs inside the put that needed the
    /// room, so no lookup after that put calls them present (they would read as -704 and
    /// refuse a re-put with -705 until the owner's next Ping).
    pub async fn run_offloads(&self, items: Vec<PendingOffload>) {
        if items.is_empty() {
            return;
        }
        let timeout = self.cfg.free_timeout;
        let notifier = &self.notifier;
        let owners = items.iter().map(|f| {
            let entry = OffloadEntry {
                generation: f.generation,
                offset: f.offset,
            };
            (f.endpoint.clone(), entry)
        });
        let answers: Vec<(String, OffloadOutcome)> =
            fan_out_by_owner(owners, |endpoint, entries| async move {
                // Writing a whole eviction pass to disk takes a while: allow for it.
                let budget = timeout + Duration::from_secs(120);
                let r =
                    tokio::time::timeout(budget, notifier.offload(&endpoint, &entries, timeout))
                        .await;
                let outcome = match r {
                    Ok(Ok(outcome)) => {
                        if !outcome.failed.is_empty() {
                            tracing::warn!(%endpoint, failed = outcome.failed.len(), of = entries.len(), "owner could not offload some objects (see its log); they are evicted");
                        }
                        outcome
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%endpoint, entries = entries.len(), error = %e, "OFFLOAD failed; the objects are evicted");
                        OffloadOutcome::all_failed(&entries)
                    }
                    Err(_) => {
                        tracing::warn!(%endpoint, entries = entries.len(), "OFFLOAD timed out; the objects are evicted");
                        OffloadOutcome::all_failed(&entries)
                    }
                };
                (endpoint, outcome)
            })
            .await;
        let failed: HashSet<u64> = answers
            .iter()
            .flat_map(|(_, a)| a.failed.iter().copied())
            .collect();
        let mut dropped = 0u64;
        for f in &items {
            if !failed.contains(&f.generation) {
                continue;
            }
            let mut shard = self.shard(&f.key).lock();
            let Some(mut o) = shard
                .get_mut(f.key.as_str())
                .filter(|o| o.generation == f.generation)
            else {
                continue;
            };
            let before = tiers_of(&o.replicas);
            o.replicas
                .retain(|r| !(r.disk && *r.segment == *f.segment && r.mount_id == f.mount_id));
            self.emit_updated(&f.key, (o.generation, o.size), before, &o.replicas);
            let empty = o.replicas.is_empty();
            drop(o);
            if empty {
                shard.remove(f.key.as_str());
                dropped += 1;
            }
        }
        let ok = items.len() as u64 - failed.len().min(items.len()) as u64;
        self.metrics.offloaded_keys_total.inc_by(ok);
        self.metrics
            .offload_failures_total
            .inc_by(failed.len() as u64);
        if dropped > 0 {
            tracing::debug!(dropped, "objects lost on a failed offload");
        }
        for (endpoint, answer) in &answers {
            if answer.dropped.is_empty() {
                continue;
            }
            // The owner's disk tier serves the segments offloaded to through this endpoint,
            // as mounted when the eviction picked them: a remount since is a new inventory.
            let owned: HashSet<(String, u64)> = items
                .iter()
                .filter(|f| f.endpoint == *endpoint)
                .map(|f| (f.segment.clone(), f.mount_id))
                .collect();
            let gone = self.forget_disk_copies(&answer.dropped, &owned);
            tracing::debug!(%endpoint, dropped = answer.dropped.len(), gone, "owner's disk tier dropped objects to make room");
        }
        let mut segs = self.segments.lock();
        for f in items {
            if let Some(seg) = segs
                .get_mut(&f.segment)
                .filter(|s| s.mount_id == f.mount_id)
            {
                seg.alloc.free(f.offset);
            }
        }
    }

    /// Resolves when a get reserved a promotion (`--promotion_on_hit`); the background task
    /// then calls [`Self::run_promotions`].
    pub async fn promotion_wanted(&self) {
        self.promotion_wanted.notified().await;
    }

    /// Promotions reserved by gets and not yet run.
    pub fn pending_promotions(&self) -> usize {
        self.promotions.lock().len()
    }

    /// Runs the promotions reserved by gets, in parallel: each owner copies its disk object into
    /// the reserved DRAM range (PROMOTE) and commits the entry under the same generation. Once it
    /// confirmed, the object gains a MEMORY replica (first, so readers prefer it) and keeps its
    /// disk one. A failed promotion, or one whose object was removed or replaced meanwhile, gives
    /// the range back through its owner (FREE, then the allocator). Returns promotions done.
    pub async fn run_promotions(&self) -> u64 {
        let items = std::mem::take(&mut *self.promotions.lock());
        if items.is_empty() {
            return 0;
        }
        let (mut ready, short): (Vec<_>, Vec<_>) =
            items.into_iter().partition(|p| p.offset.is_some());
        ready.extend(self.reserve_promotions(short).await);
        let budget = self.cfg.free_timeout + Duration::from_secs(60);
        let notifier = &self.notifier;
        // One call per promotion, not per owner: each copies its own object from disk.
        let results = futures::future::join_all(ready.into_iter().map(|p| async move {
            let req = Promote {
                generation: p.generation,
                key: p.key.clone(),
                offset: p.offset.unwrap_or_default(),
                len: p.size,
            };
            let r = tokio::time::timeout(budget, notifier.promote(&p.endpoint, &req)).await;
            let ok = match r {
                Ok(Ok(())) => true,
                Ok(Err(e)) => {
                    tracing::warn!(key = %p.key, endpoint = %p.endpoint, error = %e, "promotion failed; the object stays on disk");
                    false
                }
                Err(_) => {
                    tracing::warn!(key = %p.key, endpoint = %p.endpoint, "promotion timed out; the object stays on disk");
                    false
                }
            };
            (p, ok)
        }))
        .await;
        self.promotions_in_flight
            .fetch_sub(results.len(), Ordering::Relaxed);
        let mut frees = Vec::new();
        let mut done = 0u64;
        let mut failed = 0u64;
        for (p, ok) in results {
            if !ok {
                failed += 1;
            }
            let mounted = || {
                self.segments
                    .lock()
                    .get(&p.segment)
                    .is_some_and(|s| s.mount_id == p.mount_id)
            };
            let mut shard = self.shard(&p.key).lock();
            let kept = match shard
                .get_mut(p.key.as_str())
                .filter(|o| o.generation == p.generation)
            {
                Some(mut o) => {
                    o.promoting = false;
                    if ok && mounted() {
                        let before = tiers_of(&o.replicas);
                        o.replicas.insert(
                            0,
                            ReplicaLoc {
                                segment: self.names.get(&p.segment),
                                mount_id: p.mount_id,
                                offset: p.offset.unwrap_or_default(),
                                disk: false,
                            },
                        );
                        // Admitted by its reads: under cslru it comes back proven, at the
                        // protected segment's recent end.
                        o.disk_reads = 0;
                        o.last_access = Instant::now();
                        if self.cfg.eviction_policy == EvictionPolicy::Cslru {
                            o.tier = Tier::PROTECTED;
                        }
                        self.emit_updated(&p.key, (o.generation, o.size), before, &o.replicas);
                        true
                    } else {
                        false
                    }
                }
                None => false,
            };
            drop(shard);
            if kept {
                done += 1;
            } else {
                frees.push(PendingFree {
                    endpoint: p.endpoint,
                    segment: p.segment,
                    mount_id: p.mount_id,
                    generation: p.generation,
                    offset: p.offset.unwrap_or_default(),
                });
            }
        }
        self.metrics.promotions_total.inc_by(done);
        self.metrics.promotion_failures_total.inc_by(failed);
        if done > 0 || failed > 0 {
            tracing::debug!(done, failed, "promotions on hit");
        }
        self.release(frees).await;
        done
    }

    /// Makes room for admitted promotions that found none (cslru: one eviction round for all
    /// of them), then reserves each one's range on its segment. One still without room stays
    /// on disk: its flag is cleared, so a later read may try again.
    async fn reserve_promotions(&self, short: Vec<PendingPromotion>) -> Vec<PendingPromotion> {
        if short.is_empty() {
            return short;
        }
        let bytes = short
            .iter()
            .map(|p| align_up(p.size).unwrap_or(p.size))
            .sum();
        self.evict(bytes).await;
        let mut ready = Vec::with_capacity(short.len());
        for mut p in short {
            p.offset = self
                .segments
                .lock()
                .get_mut(&p.segment)
                .filter(|s| s.mount_id == p.mount_id && s.placeable())
                .and_then(|s| s.alloc.allocate(p.size));
            if p.offset.is_some() {
                ready.push(p);
                continue;
            }
            self.promotions_in_flight.fetch_sub(1, Ordering::Relaxed);
            if let Some(mut o) = self
                .shard(&p.key)
                .lock()
                .get_mut(p.key.as_str())
                .filter(|o| o.generation == p.generation)
            {
                o.promoting = false;
            }
        }
        ready
    }

    /// The owner's disk tier dropped these objects (its size limit, a failed checksum): forget
    /// their LOCAL_DISK replicas on `client_id`'s segments (under mTLS, only those `caller`'s
    /// identity mounted). Returns objects that disappeared.
    pub fn disk_dropped(&self, caller: &Caller, client_id: &str, items: &[(String, u64)]) -> u64 {
        if items.is_empty() {
            return 0;
        }
        let owned: HashSet<(String, u64)> = self
            .segments
            .lock()
            .iter()
            .filter(|(_, s)| s.client_id == client_id && caller.may_act_for(s.owner.as_ref()))
            .map(|(n, s)| (n.clone(), s.mount_id))
            .collect();
        self.forget_disk_copies(items, &owned)
    }

    /// Forgets the LOCAL_DISK replicas on the `owned` (segment, mount id) pairs of these
    /// objects, each only while the index still holds that generation; an object left without
    /// replicas leaves the index. Returns objects that disappeared.
    fn forget_disk_copies(&self, items: &[(String, u64)], owned: &HashSet<(String, u64)>) -> u64 {
        let mut gone = 0;
        for (key, generation) in items {
            let mut shard = self.shard(key).lock();
            let Some(mut o) = shard
                .get_mut(key.as_str())
                .filter(|o| o.generation == *generation)
            else {
                continue;
            };
            let before = tiers_of(&o.replicas);
            o.replicas
                .retain(|r| !(r.disk && owned.contains(&(r.segment.to_string(), r.mount_id))));
            if tiers_of(&o.replicas) != before {
                self.emit_updated(key, (o.generation, o.size), before, &o.replicas);
            }
            let empty = o.replicas.is_empty();
            drop(o);
            if empty {
                shard.remove(key.as_str());
                gone += 1;
            }
        }
        self.metrics
            .disk_dropped_keys_total
            .inc_by(items.len() as u64);
        gone
    }

    /// Per segment: (disk objects, disk bytes) the index holds.
    pub(super) fn disk_usage(&self) -> HashMap<String, (u64, u64)> {
        let mut out: HashMap<String, (u64, u64)> = HashMap::new();
        for shard in &self.shards {
            for o in shard.lock().values() {
                for r in o.replicas.iter().filter(|r| r.disk) {
                    let e = out.entry(r.segment.to_string()).or_default();
                    e.0 += 1;
                    e.1 += o.size;
                }
            }
        }
        out
    }

    /// (disk capacity of mounted segments, disk bytes indexed, disk objects indexed).
    pub fn disk_totals(&self) -> (u64, u64, u64) {
        let cap = self
            .segments
            .lock()
            .values()
            .map(|s| s.desc.disk_capacity)
            .sum();
        let (objects, bytes) = self
            .disk_usage()
            .values()
            .fold((0, 0), |(a, b), (o, by)| (a + o, b + by));
        (cap, bytes, objects)
    }
}

#[cfg(test)]
mod drop_tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::tests::desc;
    use super::super::{CoreConfig, MasterCore, PutOptions, SegmentDesc};
    use crate::notifier::RecordingNotifier;

    const BLOCK: u64 = 64;

    fn offload_desc(name: &str, size: u64) -> SegmentDesc {
        SegmentDesc {
            enable_offload: true,
            disk_capacity: 1 << 30,
            ..desc(name, size)
        }
    }

    async fn put(core: &MasterCore, key: &str) -> u64 {
        let o = PutOptions {
            replica_num: 1,
            ..PutOptions::default()
        };
        let (g, _) = core
            .put_start("cl", key, BLOCK, &o)
            .await
            .expect("put_start");
        core.put_end(key).expect("put_end");
        g
    }

    /// Without a lookup's lease, which would keep the object from eviction.
    fn on_disk(core: &MasterCore, key: &str) -> bool {
        core.query_key(key).is_some_and(|o| {
            !o.replicas.is_empty() && o.replicas.iter().all(|r| r.kind == "local_disk")
        })
    }

    /// The owner's OFFLOAD answer names objects its disk tier dropped: the put whose eviction
    /// sent it returns only after they left the index, and their keys take a new put at once.
    #[tokio::test]
    async fn drops_named_in_an_offload_answer_are_forgotten_before_the_put_returns() {
        let n = Arc::new(RecordingNotifier::default());
        let core = MasterCore::new(
            CoreConfig {
                cluster_id: "c".into(),
                lease_ttl: Duration::from_secs(60),
                put_reservation_limit_ratio: 1.0,
                put_reservation_total_ratio: 1.0,
                put_eviction_limit_ratio: 1.0,
                enable_offload: true,
                ..CoreConfig::default()
            },
            7,
            n.clone(),
        );
        core.mount("cl", "c", offload_desc("s:1", 16 * BLOCK), vec![])
            .expect("mount");
        let g0 = put(&core, "k0").await;
        let g1 = put(&core, "k1").await;
        let mut i = 2;
        while !(on_disk(&core, "k0") && on_disk(&core, "k1")) {
            put(&core, &format!("k{i}")).await;
            i += 1;
            assert!(i < 100, "k0 and k1 never went to disk");
        }
        // The next OFFLOAD's answer: k0 dropped, and a k1 of another generation (a stale name:
        // the object indexed under k1 is not that one and stays).
        *n.offload_drops.lock() = vec![("k0".into(), g0), ("k1".into(), g1 + 1000)];
        let offloads = n.offloads.lock().len();
        while n.offloads.lock().len() == offloads {
            put(&core, &format!("k{i}")).await;
            i += 1;
            assert!(i < 200, "no further OFFLOAD");
        }
        assert!(n.offload_drops.lock().is_empty(), "the answer was used");
        assert!(
            core.query_key("k0").is_none(),
            "a dropped object must not be served as present"
        );
        assert!(on_disk(&core, "k1"), "only the named generation goes");
        // The key takes a new put at once (before: -705 until the owner's Ping).
        put(&core, "k0").await;
        assert!(core.get_replica_list("k0").is_ok());
    }
}
