//! Objects: puts, reads and removal, and the release of freed ranges.

use lunakv_transfer::cap::{READ_TTL, RIGHT_READ, RIGHT_WRITE, WRITE_TTL};
use lunakv_transfer::{Capability, Grant, PlacementProof};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use lunakv_config::master::AllocationStrategy;
use lunakv_proto::ErrorCode;
use rand::Rng;
use rand::seq::SliceRandom;

use crate::alloc::align_up;
use crate::events::PoolEvent;
use crate::notifier::FreeEntry;

use super::index::tenant_of;
use super::policy::EvictionPolicy;
use super::ramp::{self, Pass};
use super::reservations::Refusal;
use super::types::{
    Caller, CoreConfig, CoreError, Holder, Location, Object, ObjectState, OpError, PendingFree,
    PendingPromotion, PutOptions, ReplicaLoc, ReplicaView, Replicas,
};
use super::{MasterCore, fan_out_by_owner, not_found, tiers_of};

/// Who a put is for: the caller's identity (mTLS), the holder its reservation is charged to,
/// and its client id.
pub(super) struct Putter<'a> {
    owner: Option<&'a Arc<str>>,
    holder: &'a Holder,
    client_id: &'a str,
}

impl MasterCore {
    /// Starts a put: places `replica_num` replicas on distinct segments, evicting once if
    /// nothing fits. The object is invisible until [`Self::put_end`].
    pub async fn put_start(
        &self,
        client_id: &str,
        key: &str,
        size: u64,
        opts: &PutOptions,
    ) -> Result<(u64, Vec<ReplicaView>), OpError> {
        self.put_start_by(&Caller::default(), client_id, key, size, opts)
            .await
    }

    /// [`Self::put_start`] for `caller`: under mTLS the reservation records its identity, and
    /// only that identity (or an admin identity) may end or revoke it.
    pub async fn put_start_by(
        &self,
        caller: &Caller,
        client_id: &str,
        key: &str,
        size: u64,
        opts: &PutOptions,
    ) -> Result<(u64, Vec<ReplicaView>), OpError> {
        let holder = caller.holder(client_id);
        if let Err(refused) = self.admit(&holder, size, opts).await {
            if refused.short.is_none() {
                return Err(refused.err);
            }
            // Unfinished puts of all holders fill put_reservation_total_ratio: take back
            // zombies of others (reclaim.rs), then ask once more. One round at a time, and
            // the shortfall is measured again inside it (another round may have made room).
            let _round = self.reclaim_lock.lock().await;
            if let Err(refused) = self.admit(&holder, size, opts).await {
                let Some(short) = refused.short else {
                    return Err(refused.err);
                };
                self.reclaim_reservations(&holder, short).await;
                self.admit_put(&holder, size, opts).await?;
            }
        }
        // Held until the object is in the index, which then charges its tenant.
        let _quota = self.admit_tenant(key, size, opts).await?;
        let who = Putter {
            owner: caller.identity.as_ref(),
            holder: &holder,
            client_id,
        };
        match self.try_place(&who, key, size, opts, Pass::First) {
            Err(e) if e.code == ErrorCode::NoAvailableHandle => {}
            other => return other,
        }
        if self.total_capacity() > 0 {
            // Bounded: admit_put refused a put that would need more than
            // put_eviction_limit_ratio of the pool, or that fits no segment.
            self.evict(self.eviction_need(size, opts)).await;
        }
        let mut r = self.try_place(&who, key, size, opts, Pass::Retry);
        if matches!(&r, Err(e) if e.code == ErrorCode::NoAvailableHandle)
            && self.total_capacity() > 0
        {
            // Nothing left to evict: what remains is held by unfinished puts. Reclaim other
            // holders' zombies and place once more.
            let _round = self.reclaim_lock.lock().await;
            let need = self.eviction_need(size, opts);
            if self.reclaim_reservations(&holder, need).await > 0 {
                r = self.try_place(&who, key, size, opts, Pass::Retry);
            }
        }
        if matches!(&r, Err(e) if e.code == ErrorCode::NoAvailableHandle) {
            self.metrics.put_start_alloc_failures_total.inc();
        }
        r
    }

    /// The DRAM a put must find for all its replicas.
    fn eviction_need(&self, size: u64, opts: &PutOptions) -> u64 {
        align_up(size)
            .unwrap_or(u64::MAX)
            .saturating_mul(u64::from(opts.replica_num.max(1)))
    }

    /// What no eviction can fix is refused before anything is evicted: an object larger than
    /// every segment (it would wipe the pool and fail anyway), a holder past its reservation
    /// limit or all holders past theirs, a put that would evict more than its share of the pool,
    /// and the index at `max_keys` with nothing evictable.
    pub(super) async fn admit_put(
        &self,
        holder: &Holder,
        size: u64,
        opts: &PutOptions,
    ) -> Result<(), OpError> {
        self.admit(holder, size, opts).await.map_err(|r| r.err)
    }

    /// [`Self::admit_put`], saying by how many bytes the total reservation bound refused it
    /// (what reclaiming other holders' zombies must free).
    async fn admit(&self, holder: &Holder, size: u64, opts: &PutOptions) -> Result<(), Refused> {
        let len = align_up(size).unwrap_or(u64::MAX);
        let (largest, capacity, complete, placeable, roomy, free) = {
            let segs = self.segments.lock();
            (
                segs.values().map(|s| s.alloc.capacity()).max(),
                segs.values().map(|s| s.alloc.capacity()).sum::<u64>(),
                segs.values().filter(|s| s.complete).count(),
                segs.values().filter(|s| s.placeable()).count(),
                segs.values()
                    .filter(|s| s.placeable() && s.alloc.largest_free() >= len)
                    .count(),
                segs.values()
                    .map(|s| s.alloc.capacity().saturating_sub(s.alloc.used()))
                    .sum::<u64>(),
            )
        };
        if largest.is_some() && complete == 0 {
            // Evicting would only drop objects the inventories just brought back.
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                "every mounted segment is still receiving its owner's inventory: retry in a \
                 moment",
            )
            .into());
        }
        if complete > 0 && placeable == 0 {
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                "every mounted segment is draining or drained (a drain job moves its objects \
                 away): mount another segment, or cancel the drain",
            )
            .into());
        }
        if let Some(largest) = largest
            && len > largest
        {
            self.metrics.put_start_oversized_total.inc();
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                format!(
                    "an object of {size} bytes can never fit: the largest segment holds \
                     {largest} bytes (the pool {capacity}); split the object or start \
                     store-clients with a larger --global_segment_size"
                ),
            )
            .into());
        }
        let wanted = len.saturating_mul(u64::from(opts.replica_num.max(1)));
        if capacity > 0 {
            let limit = (capacity as f64 * self.cfg.put_reservation_limit_ratio) as u64;
            let total = (capacity as f64 * self.cfg.put_reservation_total_ratio) as u64;
            // The first put of a holder counts too: one put of the whole pool is a zombie
            // reservation of everything.
            let checked = self.reserved.lock().check(holder, wanted, limit, total);
            if let Err(why) = checked {
                self.metrics.put_start_reservation_refused_total.inc();
                let short = match why {
                    Refusal::Total { total, limit } => {
                        Some(total.saturating_add(wanted).saturating_sub(limit))
                    }
                    Refusal::Holder { .. } => None,
                };
                return Err(Refused {
                    err: OpError::new(
                        ErrorCode::NoAvailableHandle,
                        reservation_refusal(holder, wanted, why, &self.cfg),
                    ),
                    short,
                });
            }
            let evictable = (capacity as f64 * self.cfg.put_eviction_limit_ratio) as u64;
            let fits = roomy >= (opts.replica_num.max(1) as usize).min(placeable);
            if wanted > evictable && !fits {
                self.metrics.put_start_eviction_refused_total.inc();
                return Err(OpError::new(
                    ErrorCode::NoAvailableHandle,
                    format!(
                        "a put of {wanted} bytes (all replicas) into a pool with {} bytes free \
                         would evict more than put_eviction_limit_ratio {} of the pool \
                         ({evictable} bytes): split the object, or raise \
                         put_eviction_limit_ratio if one object may push out that much",
                        free, self.cfg.put_eviction_limit_ratio
                    ),
                )
                .into());
            }
        }
        let max = self.cfg.max_keys;
        if max > 0 && self.approx_keys.load(Ordering::Relaxed) >= max {
            self.enforce_key_limit().await;
            if self.key_count() >= max {
                self.metrics.put_start_key_limit_refused_total.inc();
                return Err(OpError::new(
                    ErrorCode::NoAvailableHandle,
                    format!(
                        "the master holds max_keys = {max} objects and none can be evicted \
                         (leased, pinned or being put); raise max_keys or remove objects"
                    ),
                )
                .into());
            }
        }
        Ok(())
    }

    pub(super) fn try_place(
        &self,
        who: &Putter<'_>,
        key: &str,
        size: u64,
        opts: &PutOptions,
        pass: Pass,
    ) -> Result<(u64, Vec<ReplicaView>), OpError> {
        let Putter {
            owner,
            holder,
            client_id,
        } = *who;
        let now = Instant::now();
        let mut shard = self.shard(key).lock();
        if let Some(o) = shard.get(key) {
            if *o.client_id != *client_id {
                // Another instance holds this block: the cross-instance sharing doctor checks.
                self.namespaces.record_put(client_id, key, true);
            }
            let what = match o.state {
                ObjectState::Complete => "exists",
                ObjectState::Processing => "is being put",
            };
            return Err(OpError::new(
                ErrorCode::ObjectAlreadyExists,
                format!("key {key:?} {what} (generation {})", o.generation),
            ));
        }
        let mut segs = self.segments.lock();
        if segs.is_empty() {
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                "no segment is mounted: start a store-client or an embedded client with \
                 global_segment_size > 0",
            ));
        }
        let len = align_up(size).unwrap_or(u64::MAX);
        // Complete segments that are not draining.
        let placeable = segs.values().filter(|s| s.placeable()).count();
        let wanted = (opts.replica_num.max(1) as usize).min(placeable);
        let ramp = self.cfg.placement_ramp;
        let ramping = |s: &super::types::Segment| ramp::share(s.opened_at, now, ramp, placeable);
        // A ramp needs settled segments to make room instead; alone, a newcomer takes it all.
        let settled = segs
            .values()
            .filter(|s| s.placeable() && ramping(s).is_none())
            .count();
        let mut rng = rand::rng();
        let mut held_back: smallvec::SmallVec<[&String; 2]> = smallvec::SmallVec::new();
        let mut room: smallvec::SmallVec<[(&String, &crate::alloc::OffsetAllocator); 8]> =
            smallvec::SmallVec::new();
        for (n, s) in segs.iter() {
            if !s.placeable() || s.alloc.largest_free() < len {
                continue;
            }
            let preferred = opts.preferred_segments.iter().any(|p| p == n);
            if settled >= wanted
                && !preferred
                && let Some(share) = ramping(s)
                && !rng.random_bool(share.clamp(0.0, 1.0))
            {
                held_back.push(n);
                continue;
            }
            room.push((n, &s.alloc));
        }
        room.shuffle(&mut rng);
        if self.cfg.placement == AllocationStrategy::FreeRatioFirst {
            // Stable: equally empty segments keep the shuffled order, so ties spread.
            room.sort_by(|(_, a), (_, b)| a.emptier_first(b));
        }
        let mut order: smallvec::SmallVec<[&String; 8]> =
            room.into_iter().map(|(n, _)| n).collect();
        if !held_back.is_empty() {
            self.metrics.placement_ramp_deferred_total.inc();
        }
        // A retry has evicted already: a ramping segment then beats failing the put.
        match pass {
            Pass::Retry => order.extend(held_back),
            Pass::First => drop(held_back),
        }
        // Preferred segments first, in the caller's order (those with room).
        let mut at = 0;
        for p in &opts.preferred_segments {
            if let Some(pos) = order.iter().position(|n| *n == p)
                && pos >= at
            {
                let pref = order.remove(pos);
                order.insert(at, pref);
                at += 1;
            }
        }
        if order.len() < wanted || wanted == 0 {
            let largest = segs.values().map(|s| s.alloc.largest_free()).max();
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                format!(
                    "no room for {size} bytes x {wanted} replica(s): largest free range is {} \
                     bytes",
                    largest.unwrap_or(0)
                ),
            ));
        }
        // The shared copies of the names, which the replicas keep (no copy of a name per put).
        let chosen: smallvec::SmallVec<[Arc<str>; 2]> = order
            .into_iter()
            .take(wanted)
            .map(|n| self.names.get(n))
            .collect();
        let mut replicas = Replicas::with_capacity(wanted);
        let mut views = Vec::with_capacity(wanted);
        for name in chosen {
            let Some(seg) = segs.get_mut(&*name) else {
                continue;
            };
            // largest_free >= len was checked under this same lock, so best fit succeeds.
            let Some(offset) = seg.alloc.allocate(size) else {
                continue;
            };
            replicas.push(ReplicaLoc {
                segment: name,
                mount_id: seg.mount_id,
                offset,
                disk: false,
            });
            views.push(ReplicaView {
                segment: seg.desc.clone(),
                offset,
                size,
                disk: false,
                capability: None,
            });
        }
        drop(segs);
        let placed = replicas.len() as u64;
        let generation = self.next_generation()?;
        // Only capabilities carry it, so it is computed only when an owner requires them.
        let mut proof = None;
        for v in &mut views {
            // The writer reads its own put back from its cache: read and write. The proof
            // goes to the owner with the bytes, which it reports at its next mount.
            v.capability =
                capability(v, generation, RIGHT_READ | RIGHT_WRITE, WRITE_TTL).map(|c| {
                    let p = *proof.get_or_insert_with(|| {
                        self.cfg
                            .inventory_key
                            .as_ref()
                            .map(|k| PlacementProof::issue(k, key, generation, size))
                    });
                    p.map_or(c, |p| c.with_proof(p))
                });
        }
        let soft_ttl = opts
            .soft_pin_ttl
            .unwrap_or(self.cfg.soft_pin_ttl)
            .min(self.cfg.max_soft_pin_ttl);
        // Upstream: a soft pin of ttl 0 pins nothing.
        let soft_pin = opts.soft_pin && !soft_ttl.is_zero();
        shard.insert(
            key.into(),
            Box::new(Object {
                generation,
                size,
                replicas,
                state: ObjectState::Processing,
                client_id: self.names.get(client_id),
                put_start: now,
                lease_until: None,
                soft_pin_until: soft_pin.then(|| now + soft_ttl),
                soft_pin_ms: if soft_pin {
                    u32::try_from(soft_ttl.as_millis()).unwrap_or(u32::MAX)
                } else {
                    0
                },
                hard_pinned: opts.hard_pin,
                last_access: now,
                promoting: false,
                disk_reads: 0,
                tier: super::policy::Tier::PROBATION,
                group: opts.group.as_deref().map(|g| {
                    self.groups
                        .name(&lunakv_proto::scope_key(tenant_of(key), g))
                }),
            }),
        );
        if let Some(id) = owner {
            // Before the shard is released: PutEnd and PutRevoke check it under that lock.
            self.put_owners
                .lock()
                .insert(generation, (key.into(), id.clone()));
        }
        drop(shard);
        self.inflight
            .lock()
            .insert(generation, (key.to_string(), holder.clone()));
        self.reserved.lock().add(holder, len.saturating_mul(placed));
        self.approx_keys.fetch_add(1, Ordering::Relaxed);
        self.namespaces.record_put(client_id, key, false);
        Ok((generation, views))
    }

    /// Publishes a put: from now on gets and exists see it.
    pub fn put_end(&self, key: &str) -> Result<(), OpError> {
        self.put_end_by(&Caller::default(), key)
    }

    /// The identity that started the put of `o` (`key`), when one did (mTLS).
    fn put_owner(&self, o: &Object) -> Option<std::sync::Arc<str>> {
        if o.state != ObjectState::Processing {
            return None;
        }
        self.put_owners
            .lock()
            .get(&o.generation)
            .map(|(_, id)| id.clone())
    }

    fn other_identity(key: &str, owner: &str, caller: &Caller) -> CoreError {
        CoreError::OtherIdentity {
            what: format!("the put of key {key:?}"),
            owner: owner.to_string(),
            caller: caller.name().to_string(),
        }
    }

    /// Refuses the whole call when any of `keys` is a put another identity started (under
    /// mTLS): PutEnd and PutRevoke ask this before they act on any key, so a batch that names a
    /// stranger's reservation changes nothing. The calls check each key again as they act.
    pub fn check_reservations<'a>(
        &self,
        caller: &Caller,
        keys: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), CoreError> {
        if self.put_owners.lock().is_empty() {
            return Ok(());
        }
        for key in keys {
            let owner = self
                .shard(key)
                .lock()
                .get(key)
                .and_then(|o| self.put_owner(o));
            if !caller.may_act_for(owner.as_ref()) {
                return Err(Self::other_identity(
                    key,
                    owner.as_deref().unwrap_or_default(),
                    caller,
                ));
            }
        }
        Ok(())
    }

    /// [`Self::put_end`] for `caller`: under mTLS only the identity that started the put, or
    /// an admin identity, ends it.
    pub fn put_end_by(&self, caller: &Caller, key: &str) -> Result<(), OpError> {
        self.put_end_at(caller, key, Instant::now(), ChainEnd::No)
    }

    /// [`Self::put_end_by`] for one key of a batch: `stamp` orders it in eviction (see
    /// [`chain_stamp`]); with cslru the batch's last key enters probation's cold end, and the
    /// last of several is not written to the SSD tier unless it is read first.
    pub fn put_end_at(
        &self,
        caller: &Caller,
        key: &str,
        stamp: Instant,
        end: ChainEnd,
    ) -> Result<(), OpError> {
        let mut shard = self.shard(key).lock();
        let mut o = shard
            .get_mut(key)
            .ok_or_else(|| not_found(key, "no put in progress"))?;
        let owner = self.put_owner(&o);
        if !caller.may_act_for(owner.as_ref()) {
            return Err(OpError::new(
                ErrorCode::InvalidWrite,
                Self::other_identity(key, owner.as_deref().unwrap_or_default(), caller).to_string(),
            ));
        }
        let first = o.state == ObjectState::Processing;
        if first {
            // The sweep need not look this put up again (a lookup in a large index costs
            // more than this one in a small map).
            self.unreserve(&o);
            if owner.is_some() {
                self.put_owners.lock().remove(&o.generation);
            }
        }
        o.state = ObjectState::Complete;
        o.last_access = Instant::now();
        if first && self.cfg.eviction_policy == EvictionPolicy::Cslru {
            let mut recent = self.recent.lock();
            if recent.came_back(self.hasher.hash_one(key), || o.dram_bytes()) {
                // Put again soon after its eviction: a proven re-user.
                o.tier = super::policy::Tier::PROTECTED;
                o.last_access = stamp;
            } else {
                // The stamp stays ordinary (the lru orders of tenant quotas and the key limit
                // read it too); the cold list is what puts a chain's end first.
                o.last_access = stamp;
                if end == ChainEnd::Last {
                    o.tier = super::policy::Tier::TAIL;
                }
                if end != ChainEnd::No {
                    recent.push_cold(key, o.generation, stamp);
                }
            }
        }
        if first {
            self.emit_stored(key, (o.generation, o.size), &o.replicas);
        }
        Ok(())
    }

    /// Abandons a put in progress; its ranges are freed through their owners. A put already
    /// discarded as a zombie is still held in quarantine: its writer's revoke frees it now
    /// (`client_id` empty = any client).
    pub async fn put_revoke(&self, client_id: &str, key: &str) -> Result<(), OpError> {
        self.put_revoke_by(&Caller::default(), client_id, key).await
    }

    /// [`Self::put_revoke`] for `caller`: under mTLS only the identity that started the put,
    /// or an admin identity, revokes it.
    pub async fn put_revoke_by(
        &self,
        caller: &Caller,
        client_id: &str,
        key: &str,
    ) -> Result<(), OpError> {
        let frees = {
            let mut shard = self.shard(key).lock();
            if let Some(o) = shard.get(key) {
                let owner = self.put_owner(o);
                if !caller.may_act_for(owner.as_ref()) {
                    return Err(OpError::new(
                        ErrorCode::InvalidWrite,
                        Self::other_identity(key, owner.as_deref().unwrap_or_default(), caller)
                            .to_string(),
                    ));
                }
            }
            match shard.get(key) {
                None => {
                    let frees = self.unquarantine(|q| {
                        q.key == key
                            && (client_id.is_empty() || q.client_id == client_id)
                            && caller.may_act_for(q.owner.as_ref())
                    });
                    if frees.is_empty() {
                        return Err(not_found(key, "no put in progress"));
                    }
                    tracing::info!(
                        key,
                        client_id,
                        "revoke of a discarded put: its ranges are freed now"
                    );
                    self.metrics
                        .put_reservations_reclaimed_total
                        .inc_by(frees.len() as u64);
                    frees
                }
                Some(o) if o.state == ObjectState::Complete => {
                    return Err(OpError::new(
                        ErrorCode::InvalidWrite,
                        format!("key {key:?} is complete; remove it instead of revoking"),
                    ));
                }
                Some(_) => shard
                    .remove(key)
                    .map(|o| {
                        self.unreserve(&o);
                        self.put_owners.lock().remove(&o.generation);
                        self.pending_frees(&o)
                    })
                    .unwrap_or_default(),
            }
        };
        self.release(frees).await;
        Ok(())
    }

    // === reads ===

    /// The location of a complete object; grants (extends) a lease on it.
    pub fn get_replica_list(&self, key: &str) -> Result<Location, OpError> {
        self.get_replica_list_for("", key)
    }

    /// [`Self::get_replica_list`] on behalf of `client_id` (exists and get lookups): finding a
    /// key another client put counts as a shared key of its namespace.
    pub fn get_replica_list_for(&self, client_id: &str, key: &str) -> Result<Location, OpError> {
        self.lookup(client_id, key, Touch::Read(Instant::now()))
    }

    /// [`Self::get_replica_list_for`], doing `touch` to the object's lease and eviction order.
    pub fn lookup(&self, client_id: &str, key: &str, touch: Touch) -> Result<Location, OpError> {
        let now = Instant::now();
        let touch = match (touch, self.cfg.eviction_policy) {
            // Upstream's order: every lookup leases and renews.
            (Touch::Look, EvictionPolicy::Lru) => Touch::Read(now),
            (t, _) => t,
        };
        let mut shard = self.shard(key).lock();
        let mut o = shard
            .get_mut(key)
            .ok_or_else(|| not_found(key, "not found"))?;
        if o.state != ObjectState::Complete {
            return Err(not_found(key, "its put has not ended yet"));
        }
        if let Some(g) = &o.group
            && self.groups.is_broken(g)
        {
            return Err(not_found(
                key,
                "another object of its group is gone, so the group is (docs/GROUPS.md)",
            ));
        }
        if !client_id.is_empty() && *o.client_id != *client_id {
            self.namespaces.record_found_from_other(client_id, key);
        }
        let disk_only = o.replicas.iter().all(|r| r.disk);
        // Promotion's admission counts requests, not calls: vLLM checks a request's keys and
        // then gets them (a client with the locations cached never asks again), so a read
        // within the read window of the last one is the same request.
        if disk_only && matches!(touch, Touch::Read(_)) && !self.reading(&o, now) {
            o.disk_reads = o.disk_reads.saturating_add(1);
        }
        if let Touch::Read(stamp) = touch {
            let lease_until = now + self.cfg.lease_ttl;
            o.lease_until = Some(o.lease_until.map_or(lease_until, |t| t.max(lease_until)));
            match self.cfg.eviction_policy {
                EvictionPolicy::Lru => o.last_access = now,
                // A protected object keeps its CLOCK place and banks a chance; a probation
                // one joins the protected segment's tail.
                EvictionPolicy::Cslru => {
                    if !o.tier.protected() {
                        o.last_access = stamp;
                    }
                    o.tier = o.tier.read();
                }
            }
        }
        if o.soft_pin_until.is_some() {
            let ttl = match o.soft_pin_ms {
                0 => self.cfg.soft_pin_ttl.min(self.cfg.max_soft_pin_ttl),
                ms => Duration::from_millis(u64::from(ms)),
            };
            o.soft_pin_until = Some(now + ttl);
        }
        let mut segs = self.segments.lock();
        let replicas = o
            .replicas
            .iter()
            .filter_map(|r| {
                segs.get(&*r.segment)
                    .filter(|s| s.mount_id == r.mount_id)
                    .map(|s| {
                        let mut v = ReplicaView {
                            segment: s.desc.clone(),
                            offset: if r.disk { 0 } else { r.offset },
                            size: o.size,
                            disk: r.disk,
                            capability: None,
                        };
                        v.capability = capability(&v, o.generation, RIGHT_READ, READ_TTL);
                        v
                    })
            })
            .collect();
        let admitted = disk_only
            && matches!(touch, Touch::Read(_))
            && self.cfg.promotion_on_hit
            && !o.promoting
            && o.disk_reads >= self.cfg.promotion_admission_threshold
            && self.promotions_in_flight.load(Ordering::Relaxed) < self.cfg.promotion_queue_limit;
        let promotion = if admitted {
            // Reserve a DRAM range on a disk replica's owner. Under lru no room means no
            // promotion (upstream promotes only below the high watermark) and the next hit
            // tries again; under cslru an admitted object is worth an eviction, which the
            // background task makes before it reserves the range (`offset: None`).
            let evict_for_it = self.cfg.eviction_policy == EvictionPolicy::Cslru;
            o.replicas.iter().filter(|r| r.disk).find_map(|r| {
                let seg = segs
                    .get_mut(&*r.segment)
                    .filter(|s| s.mount_id == r.mount_id && s.placeable())?;
                let offset = seg.alloc.allocate(o.size);
                if offset.is_none() && !evict_for_it {
                    return None;
                }
                Some(PendingPromotion {
                    key: key.to_string(),
                    endpoint: seg.desc.transfer_endpoint.clone(),
                    segment: r.segment.to_string(),
                    mount_id: r.mount_id,
                    generation: o.generation,
                    offset,
                    size: o.size,
                })
            })
        } else {
            None
        };
        drop(segs);
        if disk_only {
            self.metrics.disk_hits_total.inc();
        }
        if let Some(p) = promotion {
            o.promoting = true;
            self.promotions_in_flight.fetch_add(1, Ordering::Relaxed);
            self.promotions.lock().push(p);
            self.promotion_wanted.notify_one();
        }
        Ok(Location {
            generation: o.generation,
            size: o.size,
            replicas,
            lease_ttl: self.cfg.lease_ttl,
        })
    }

    // === removal ===

    /// Removes an object. A leased object (-706) or a put in progress (-703) is kept unless
    /// `force`. Answers after the owners acknowledged the FREE (or timed out).
    pub async fn remove(&self, key: &str, force: bool) -> Result<(), OpError> {
        let frees = {
            let mut shard = self.shard(key).lock();
            let o = shard.get(key).ok_or_else(|| not_found(key, "not found"))?;
            let now = Instant::now();
            if !force && o.state == ObjectState::Processing {
                return Err(OpError::new(
                    ErrorCode::ReplicaIsNotReady,
                    format!("key {key:?} is being put; retry after PutEnd or use force"),
                ));
            }
            if !force && o.leased(now) {
                return Err(OpError::new(
                    ErrorCode::ObjectHasLease,
                    format!(
                        "key {key:?} is leased to a reader for up to {} ms more; retry later or \
                         use force",
                        o.lease_until
                            .map_or(0, |t| t.saturating_duration_since(now).as_millis())
                    ),
                ));
            }
            let o = shard.remove(key);
            if let Some(o) = &o
                && o.state == ObjectState::Complete
            {
                self.emit_updated(key, (o.generation, o.size), tiers_of(&o.replicas), &[]);
            }
            o.map(|o| self.pending_frees(&o)).unwrap_or_default()
        };
        self.release(frees).await;
        // A grouped object takes its group with it.
        self.drop_broken_groups().await;
        Ok(())
    }

    /// Removes every complete, unleased object of `tenant` (with `force`: every one of its
    /// objects); other tenants' objects stay. Returns how many.
    pub async fn remove_all(&self, tenant: &str, force: bool) -> u64 {
        let default = tenant == lunakv_proto::DEFAULT_TENANT;
        // The event streams speak for the default tenant's keys only (docs/TENANTS.md): its
        // RemoveAll is one "all cleared" event, another tenant's is nothing to them.
        let (removed, frees) = self.remove_matching(force, !default, |k| tenant_of(k) == tenant);
        if default && let Some(sink) = &self.events {
            sink.emit(PoolEvent::RemovedAll);
        }
        self.release(frees).await;
        // Without force a group's leased member stays behind; the group goes whole.
        self.drop_broken_groups().await;
        removed
    }

    /// Upstream's RemoveByRegex: removes every object of `tenant` whose key (without the
    /// tenant) `re` matches, complete and unleased ones only unless `force`, as
    /// [`MasterCore::remove`] would one by one. Returns how many.
    pub async fn remove_by_regex(&self, tenant: &str, re: &regex::Regex, force: bool) -> u64 {
        let (removed, frees) = self.remove_matching(force, true, |k| {
            let (t, user) = lunakv_proto::split_scoped(k);
            t == tenant && re.is_match(user)
        });
        self.release(frees).await;
        // A pattern that matches part of a group removes the group.
        self.drop_broken_groups().await;
        removed
    }

    /// Removes the objects whose key `pick` selects: complete and unleased ones, or (`force`)
    /// every one. Warm standbys drop each complete one; with `announce`, each is also an event,
    /// as a single remove is. Returns how many, and the frees to release.
    fn remove_matching(
        &self,
        force: bool,
        announce: bool,
        pick: impl Fn(&str) -> bool,
    ) -> (u64, Vec<PendingFree>) {
        let now = Instant::now();
        let mut frees = Vec::new();
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            let keys: Vec<String> = shard
                .iter()
                .filter(|(k, o)| {
                    pick(k) && (force || (o.state == ObjectState::Complete && !o.leased(now)))
                })
                .map(|(k, _)| k.to_string())
                .collect();
            for k in keys {
                if let Some(o) = shard.remove(k.as_str()) {
                    if o.state == ObjectState::Complete {
                        if announce {
                            self.emit_updated(
                                &k,
                                (o.generation, o.size),
                                tiers_of(&o.replicas),
                                &[],
                            );
                        } else {
                            // No per-key event (RemoveAll announces itself), but the warm
                            // standbys must drop the key too, or a new leader would answer
                            // for objects removed before the failover.
                            self.replicate(&k, o.generation, o.size, &[]);
                        }
                    }
                    frees.extend(self.pending_frees(&o));
                    removed += 1;
                }
            }
        }
        (removed, frees)
    }

    pub(super) fn pending_frees(&self, o: &Object) -> Vec<PendingFree> {
        self.frees_of(o.generation, &o.replicas)
    }

    /// FREEs for `replicas` of `generation`: DRAM ranges, and disk copies (offset
    /// [`lunakv_transfer::DISK_OFFSET`]) so the owner's disk tier forgets them too and a
    /// restart cannot bring a removed object back.
    pub(super) fn frees_of(&self, generation: u64, replicas: &[ReplicaLoc]) -> Vec<PendingFree> {
        let segs = self.segments.lock();
        replicas
            .iter()
            .filter_map(|r| {
                segs.get(&*r.segment)
                    .filter(|s| s.mount_id == r.mount_id)
                    .map(|s| PendingFree {
                        endpoint: s.desc.transfer_endpoint.clone(),
                        segment: r.segment.to_string(),
                        mount_id: r.mount_id,
                        generation,
                        offset: if r.disk {
                            lunakv_transfer::DISK_OFFSET
                        } else {
                            r.offset
                        },
                    })
            })
            .collect()
    }

    /// Asks each owner (in parallel, one call per owner) to drop the entries, then returns the
    /// ranges to their allocators. An owner that does not answer within `free_timeout` is
    /// logged and its ranges are freed anyway (it is dead or about to be declared dead).
    pub async fn release(&self, frees: Vec<PendingFree>) {
        if frees.is_empty() {
            return;
        }
        let timeout = self.cfg.free_timeout;
        let notifier = &self.notifier;
        let owners = frees.iter().map(|f| {
            let entry = FreeEntry::from_wire(f.generation, f.offset);
            (f.endpoint.clone(), entry)
        });
        fan_out_by_owner(owners, |endpoint, entries| async move {
            let r = tokio::time::timeout(
                timeout + Duration::from_millis(500),
                notifier.free(&endpoint, &entries, timeout),
            )
            .await;
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(%endpoint, entries = entries.len(), error = %e, "owner did not acknowledge FREE; freeing the ranges anyway"),
                Err(_) => tracing::warn!(%endpoint, entries = entries.len(), "FREE timed out; freeing the ranges anyway"),
            }
        })
        .await;
        let mut segs = self.segments.lock();
        for f in frees {
            if f.offset == lunakv_transfer::DISK_OFFSET {
                continue;
            }
            if let Some(seg) = segs
                .get_mut(&f.segment)
                .filter(|s| s.mount_id == f.mount_id)
            {
                seg.alloc.free(f.offset);
            }
        }
    }
}

/// What a lookup does to the object's lease and its place in eviction order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Touch {
    /// A read: a get, or a key of an existence batch's leading run, which the caller reads
    /// next. Leased, and its recency (or protection) renewed; `stamp` orders it within its
    /// batch (deeper keys older, see `core::policy`).
    Read(Instant),
    /// An existence check past the batch's first miss, which no prefix read can reach:
    /// nothing changes (with `--eviction_policy=lru` it is a read, as upstream's).
    Look,
}

/// Where a put's key sits in its BatchPutEnd: vLLM saves a request's missing blocks as one
/// batch in prefix order, so the last key is the chain's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainEnd {
    /// Not the batch's last key (or a plain PutEnd).
    No,
    /// The only key of its batch: its chain's end too, but it may as well be an object put on
    /// its own, so the SSD tier still takes it.
    Alone,
    /// The last of several keys.
    Last,
}

impl ChainEnd {
    /// The place of the `pos`-th of `len` keys.
    pub fn of(pos: usize, len: usize) -> ChainEnd {
        match (pos + 1 == len, len) {
            (false, _) => ChainEnd::No,
            (true, 1) => ChainEnd::Alone,
            (true, _) => ChainEnd::Last,
        }
    }
}

/// The stamp of the `pos`-th key of a batch started at `now`: deeper keys are older, so a
/// chain loses its tail before its head.
pub fn chain_stamp(now: Instant, pos: usize) -> Instant {
    now.checked_sub(Duration::from_nanos(pos as u64))
        .unwrap_or(now)
}

/// A refused admission: the answer, and by how many bytes unfinished puts of all holders are
/// over `put_reservation_total_ratio` when that bound refused it.
struct Refused {
    err: OpError,
    short: Option<u64>,
}

impl From<OpError> for Refused {
    fn from(err: OpError) -> Refused {
        Refused { err, short: None }
    }
}

/// Why a put's reservation was refused, with the limit's setting and the way out.
fn reservation_refusal(holder: &Holder, wanted: u64, why: Refusal, cfg: &CoreConfig) -> String {
    match why {
        Refusal::Holder { held, limit } => format!(
            "{holder} already holds {held} bytes in puts it has not ended and asks for \
             {wanted} more; one caller may hold at most {limit} (put_reservation_limit_ratio {} \
             of the pool): end or revoke those puts first, or split the object",
            cfg.put_reservation_limit_ratio
        ),
        Refusal::Total { total, limit } => format!(
            "unfinished puts of all callers hold {total} bytes and this one asks for {wanted} \
             more; together they may hold at most {limit} (put_reservation_total_ratio {} of \
             the pool): retry once puts in flight end",
            cfg.put_reservation_total_ratio
        ),
    }
}

/// The capability for `v` when its owner requires them (it mounted with a secret).
pub(super) fn capability(
    v: &ReplicaView,
    generation: u64,
    rights: u8,
    ttl: std::time::Duration,
) -> Option<Capability> {
    let secret = v.segment.data_secret.as_ref()?;
    let grant = Grant {
        segment: &v.segment.name,
        generation,
        offset: v.offset,
        len: v.size,
    };
    Some(Capability::issue(secret, &grant, rights, ttl))
}
