//! Segments and clients: mounts, inventories, unmounts, pings and client expiry.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::alloc::OffsetAllocator;

use super::state::MasterCore;
use super::types::{
    Caller, ClientEntry, CoreError, InventoryItem, InventoryReject, MountOutcome, Object,
    ObjectState, PendingFree, ReplicaLoc, Segment, SegmentDesc, tiers_of,
};

impl MasterCore {
    /// Mounts a segment for `client_id`, indexing the objects its inventory reports. A segment
    /// of the same name mounted before is replaced (its replicas are dropped).
    pub fn mount(
        &self,
        client_id: &str,
        cluster_id: &str,
        desc: SegmentDesc,
        inventory: Vec<InventoryItem>,
    ) -> Result<MountOutcome, CoreError> {
        self.mount_parts(
            &Caller::default(),
            client_id,
            cluster_id,
            desc,
            inventory,
            false,
        )
    }

    /// [`MasterCore::mount`] with the first part of the inventory. With `inventory_follows`
    /// the rest arrives through [`MasterCore::mount_inventory`] (an inventory can be larger
    /// than one gRPC message) and the segment takes no placements until its last part.
    /// Under mTLS the mount records `caller`'s identity, and a segment another identity
    /// mounted cannot be mounted over ([`Caller::may_act_for`]).
    pub fn mount_parts(
        &self,
        caller: &Caller,
        client_id: &str,
        cluster_id: &str,
        desc: SegmentDesc,
        inventory: Vec<InventoryItem>,
        inventory_follows: bool,
    ) -> Result<MountOutcome, CoreError> {
        if cluster_id != self.cfg.cluster_id {
            return Err(CoreError::ClusterMismatch {
                ours: self.cfg.cluster_id.clone(),
                theirs: cluster_id.to_string(),
            });
        }
        if desc.enable_offload && !self.cfg.enable_offload {
            self.metrics.offload_mismatch_total.inc();
            return Err(CoreError::OffloadMismatch {
                segment: desc.name.clone(),
            });
        }
        if self.cfg.enable_offload && !desc.enable_offload {
            self.metrics.offload_mismatch_total.inc();
            tracing::warn!(segment = %desc.name, "offload mismatch: this master runs with --enable_offload=true but store-client {} mounted without it; objects evicted from its DRAM are dropped, not offloaded. Start that store-client with --enable_offload=true and MOONCAKE_OFFLOAD_FILE_STORAGE_PATH, or the master without --enable_offload", desc.name);
        } else if desc.enable_offload && desc.disk_capacity == 0 {
            tracing::warn!(segment = %desc.name, "store-client has --enable_offload=true but no usable disk tier (see its log: offload directory); its evictions drop objects");
        }
        let name = desc.name.clone();
        let (mount_id, replaced) = {
            let mut segs = self.segments.lock();
            if let Some(old) = segs.get(&name)
                && !caller.may_act_for(old.owner.as_ref())
            {
                self.metrics.foreign_unmounts_refused_total.inc();
                return Err(CoreError::OtherIdentity {
                    what: format!("segment {name:?}, mounted by client {:?},", old.client_id),
                    owner: old.owner.as_deref().unwrap_or_default().to_string(),
                    caller: caller.name().to_string(),
                });
            }
            // A segment of the warm copy keeps its mount id and entries: the inventory
            // confirms them one by one instead of the index losing them until it arrives.
            let warm = segs.get_mut(&name).and_then(MasterCore::carry_warm);
            let mount_id = match &warm {
                Some((id, _)) => *id,
                None => self.next_mount_id.fetch_add(1, Ordering::Relaxed),
            };
            let carried = warm.is_some();
            let old = segs.insert(
                name.clone(),
                Segment {
                    alloc: OffsetAllocator::new(desc.size),
                    desc: Arc::new(desc.clone()),
                    client_id: client_id.to_string(),
                    owner: caller.identity.clone(),
                    mount_id,
                    complete: false,
                    opened_at: None,
                    warm: warm.map(|(_, w)| w),
                    status: Default::default(),
                },
            );
            (
                mount_id,
                old.filter(|_| !carried).map(|o| (o.client_id, o.mount_id)),
            )
        };
        // Before any FREE for this endpoint (the old mount's replicas just below): an owner
        // that requires capabilities refuses the master's requests without its tag.
        self.notifier
            .set_owner_key(&desc.transfer_endpoint, desc.data_secret);
        self.replicate_change(super::feed::IndexChange::Mounted {
            desc: Box::new(desc.clone()),
            client_id: client_id.to_string(),
        });
        if let Some((old_client, old_mount)) = replaced {
            tracing::info!(segment = %name, %old_client, "segment mounted again; dropping its old replicas");
            if let Some(c) = self.clients.lock().get_mut(&old_client) {
                c.segments.remove(&name);
            }
            self.drop_replicas(&name, old_mount);
        }
        {
            let mut clients = self.clients.lock();
            let c = clients
                .entry(client_id.to_string())
                .or_insert_with(|| ClientEntry {
                    last_seen: Instant::now(),
                    segments: BTreeSet::new(),
                });
            c.last_seen = Instant::now();
            c.segments.insert(name.clone());
        }
        let out = self.index_inventory(client_id, &desc, mount_id, inventory, !inventory_follows);
        tracing::info!(segment = %name, client_id, size = desc.size, accepted = out.accepted, rejected = out.rejected_generations.len(), inventory_follows, "segment mounted");
        Ok(out)
    }

    /// A further part of the inventory of a segment mounted with `inventory_follows`; `last`
    /// opens it to placements. Refused unless `client_id` owns the mount `instance_id` names:
    /// an owner that meets this refusal mounts again from the start. Under mTLS only the
    /// identity that mounted the segment may add to its inventory.
    pub fn mount_inventory(
        &self,
        caller: &Caller,
        client_id: &str,
        segment_name: &str,
        instance_id: &str,
        items: Vec<InventoryItem>,
        last: bool,
    ) -> Result<MountOutcome, CoreError> {
        let (desc, mount_id) = {
            let segs = self.segments.lock();
            let not_awaited = || CoreError::InventoryNotAwaited {
                segment: segment_name.to_string(),
                instance: instance_id.to_string(),
                client: client_id.to_string(),
            };
            let seg = segs.get(segment_name).ok_or_else(not_awaited)?;
            if !caller.may_act_for(seg.owner.as_ref()) {
                return Err(CoreError::OtherIdentity {
                    what: format!("the inventory of segment {segment_name:?}"),
                    owner: seg.owner.as_deref().unwrap_or_default().to_string(),
                    caller: caller.name().to_string(),
                });
            }
            if seg.client_id != client_id || seg.desc.instance_id != instance_id || seg.complete {
                return Err(not_awaited());
            }
            (seg.desc.clone(), seg.mount_id)
        };
        if let Some(c) = self.clients.lock().get_mut(client_id) {
            c.last_seen = Instant::now();
        }
        let out = self.index_inventory(client_id, &desc, mount_id, items, last);
        if last {
            tracing::info!(segment = %segment_name, client_id, "segment inventory complete; placing objects there");
        }
        Ok(out)
    }

    /// Indexes `items` into the mount `mount_id`; `complete` then opens the segment to
    /// placements (if that mount is still the current one).
    pub(super) fn index_inventory(
        &self,
        client_id: &str,
        desc: &SegmentDesc,
        mount_id: u64,
        items: Vec<InventoryItem>,
        complete: bool,
    ) -> MountOutcome {
        let mut out = MountOutcome::default();
        let mut unproven = 0u64;
        for item in items {
            match self.index_inventory_item(client_id, desc, mount_id, &item) {
                Ok(displaced) => {
                    out.accepted += 1;
                    out.displaced.extend(displaced);
                }
                // One line per mount, not per item: a forged inventory may hold millions.
                Err(InventoryReject::Unproven) => {
                    unproven += 1;
                    out.rejected_generations.push(item.generation);
                }
                Err(reason) => {
                    tracing::warn!(segment = %desc.name, key = %item.key, generation = item.generation, %reason, "inventory entry rejected");
                    out.rejected_generations.push(item.generation);
                }
            }
        }
        if unproven > 0 {
            self.metrics.inventory_unproven_total.inc_by(unproven);
            tracing::warn!(segment = %desc.name, client_id, items = unproven, "inventory entries without a valid placement proof rejected: this master did not place them there (a forged inventory, or entries written before the pool token was set); their ranges go to new placements");
        }
        if complete {
            self.finish_warm(&desc.name, mount_id);
            if let Some(seg) = self.segments.lock().get_mut(&desc.name)
                && seg.mount_id == mount_id
            {
                if !seg.complete {
                    seg.opened_at = Some(Instant::now());
                }
                seg.complete = true;
            }
        }
        out
    }

    /// Segments whose owner's whole inventory is indexed.
    pub fn complete_segments(&self) -> BTreeSet<String> {
        self.segments
            .lock()
            .iter()
            .filter(|(_, s)| s.complete)
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub(super) fn index_inventory_item(
        &self,
        client_id: &str,
        desc: &SegmentDesc,
        mount_id: u64,
        item: &InventoryItem,
    ) -> Result<Vec<PendingFree>, InventoryReject> {
        lunakv_proto::validate_scoped_key(&item.key)?;
        if item.size == 0 {
            return Err(InventoryReject::SizeZero);
        }
        if self.cfg.verify_inventories {
            let proven = match (&self.cfg.inventory_key, &item.proof) {
                (Some(k), Some(p)) => p.verify(k, &item.key, item.generation, item.size),
                _ => false,
            };
            if !proven {
                return Err(InventoryReject::Unproven);
            }
        }
        let now = Instant::now();
        let mut shard = self.shard(&item.key).lock();
        if self.confirm_warm_in_place(&mut shard, client_id, &desc.name, mount_id, item) {
            return Ok(Vec::new());
        }
        self.confirm_warm(&mut shard, &desc.name, mount_id, &item.key, item.disk);
        let mut displaced = Vec::new();
        if let Some(existing) = shard.get(item.key.as_str()) {
            if existing.generation > item.generation {
                return Err(InventoryReject::Newer(existing.generation));
            }
            if existing.generation == item.generation
                && existing
                    .replicas
                    .iter()
                    .any(|r| *r.segment == *desc.name && r.disk == item.disk)
            {
                return Err(InventoryReject::Duplicate);
            }
            if existing.generation == item.generation && existing.size != item.size {
                return Err(InventoryReject::SizeMismatch {
                    size: item.size,
                    indexed: existing.size,
                });
            }
        }
        if item.disk && !self.cfg.enable_offload {
            return Err(InventoryReject::DiskWithoutOffload);
        }
        {
            let mut segs = self.segments.lock();
            let seg = segs
                .get_mut(&desc.name)
                .filter(|s| s.mount_id == mount_id)
                .ok_or(InventoryReject::Unmounted)?;
            // A disk object holds no DRAM range.
            if !item.disk {
                seg.alloc.reserve(item.offset, item.size)?;
            }
        }
        let loc = ReplicaLoc {
            segment: self.names.get(&desc.name),
            mount_id,
            offset: if item.disk {
                lunakv_transfer::DISK_OFFSET
            } else {
                item.offset
            },
            disk: item.disk,
        };
        if shard.get(item.key.as_str()).is_none() {
            self.emit_stored(
                &item.key,
                (item.generation, item.size),
                std::slice::from_ref(&loc),
            );
            shard.insert(
                item.key.as_str().into(),
                Box::new(Object::complete(
                    item.generation,
                    item.size,
                    smallvec::smallvec![loc],
                    self.names.get(client_id),
                    now,
                )),
            );
            return Ok(displaced);
        }
        let Some(mut existing) = shard.get_mut(item.key.as_str()) else {
            return Ok(displaced);
        };
        if existing.generation == item.generation {
            let before = tiers_of(&existing.replicas);
            existing.replicas.push(loc);
            self.emit_updated(
                &item.key,
                (existing.generation, existing.size),
                before,
                &existing.replicas,
            );
        } else {
            // An older copy: the inventory's is newer, so it wins.
            displaced = self.pending_frees(&existing);
            *existing = Object::complete(
                item.generation,
                item.size,
                smallvec::smallvec![loc],
                self.names.get(client_id),
                now,
            );
            self.emit_stored(&item.key, (item.generation, item.size), &existing.replicas);
        }
        Ok(displaced)
    }

    /// [`Self::unmount`] on behalf of `client_id`: only the client that mounted the segment,
    /// and (when `instance_id` is given) only for the server instance it mounted. Under mTLS,
    /// also only the client identity that mounted it; an admin identity may unmount any.
    pub fn unmount_owned(
        &self,
        caller: &Caller,
        client_id: &str,
        segment_name: &str,
        instance_id: &str,
    ) -> Result<u64, CoreError> {
        {
            let segs = self.segments.lock();
            let seg = segs
                .get(segment_name)
                .ok_or_else(|| CoreError::SegmentNotFound(segment_name.to_string()))?;
            if !caller.may_act_for(seg.owner.as_ref()) {
                self.metrics.foreign_unmounts_refused_total.inc();
                return Err(CoreError::OtherIdentity {
                    what: format!(
                        "segment {segment_name:?}, mounted by client {:?},",
                        seg.client_id
                    ),
                    owner: seg.owner.as_deref().unwrap_or_default().to_string(),
                    caller: caller.name().to_string(),
                });
            }
            let by_admin = caller.overrides_owners();
            if !by_admin
                && (seg.client_id != client_id
                    || (!instance_id.is_empty() && seg.desc.instance_id != instance_id))
            {
                self.metrics.foreign_unmounts_refused_total.inc();
                return Err(CoreError::NotOwner {
                    segment: segment_name.to_string(),
                    owner: seg.client_id.clone(),
                    instance: seg.desc.instance_id.clone(),
                    caller: client_id.to_string(),
                });
            }
        }
        self.unmount(segment_name)
    }

    /// Unmounts a segment: its replicas are dropped (objects left without one disappear).
    /// Returns the number of objects that disappeared.
    pub fn unmount(&self, segment_name: &str) -> Result<u64, CoreError> {
        let seg = self
            .segments
            .lock()
            .remove(segment_name)
            .ok_or_else(|| CoreError::SegmentNotFound(segment_name.to_string()))?;
        if let Some(c) = self.clients.lock().get_mut(&seg.client_id) {
            c.segments.remove(segment_name);
        }
        self.replicate_change(super::feed::IndexChange::Unmounted {
            segment: segment_name.to_string(),
        });
        let dropped = self.drop_replicas(segment_name, seg.mount_id);
        tracing::info!(segment = segment_name, dropped, "segment unmounted");
        Ok(dropped)
    }

    pub(super) fn drop_replicas(&self, segment: &str, mount_id: u64) -> u64 {
        let mut dropped = 0;
        for shard in &self.shards {
            shard.lock().retain(|k, o| {
                let before = o.replicas.len();
                let tiers = tiers_of(&o.replicas);
                o.replicas
                    .retain(|r| !(*r.segment == *segment && r.mount_id == mount_id));
                if o.replicas.len() != before && o.state == ObjectState::Complete {
                    self.emit_updated(k, (o.generation, o.size), tiers, &o.replicas);
                }
                let keep = !o.replicas.is_empty();
                if !keep {
                    dropped += 1;
                }
                keep
            });
        }
        dropped
    }

    /// A client's liveness signal. Returns `true` ("remount required") when the client was not
    /// known (the master restarted or declared it dead), or when one of the segments it says
    /// it serves (`mounted`) is not mounted for it here; it is known from then on.
    pub fn ping(&self, client_id: &str, touched_keys: &[String], mounted: &[String]) -> bool {
        let now = Instant::now();
        let remount = {
            let mut clients = self.clients.lock();
            match clients.get_mut(client_id) {
                Some(c) => {
                    c.last_seen = now;
                    mounted.iter().any(|s| !c.segments.contains(s))
                }
                None => {
                    clients.insert(
                        client_id.to_string(),
                        ClientEntry {
                            last_seen: now,
                            segments: BTreeSet::new(),
                        },
                    );
                    true
                }
            }
        };
        for key in touched_keys {
            if let Some(mut o) = self.shard(key).lock().get_mut(key.as_str()) {
                o.last_access = now;
            }
        }
        remount
    }

    /// Declares clients silent for `client_ttl` dead and unmounts their segments. Returns the
    /// clients removed, each with the segments unmounted.
    pub fn expire_clients(&self) -> Vec<(String, Vec<String>)> {
        let now = Instant::now();
        let dead: Vec<(String, BTreeSet<String>)> = {
            let mut clients = self.clients.lock();
            let ids: Vec<String> = clients
                .iter()
                .filter(|(_, c)| now.duration_since(c.last_seen) >= self.cfg.client_ttl)
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| clients.remove(&id).map(|c| (id, c.segments)))
                .collect()
        };
        let mut out = Vec::new();
        for (id, _) in &dead {
            self.orphan_puts_of(id);
        }
        for (id, segs) in dead {
            if segs.is_empty() {
                // A pure requester that went away (an engine restart): nothing to clean up.
                tracing::info!(client_id = %id, "requester silent past client_ttl; forgotten");
            } else {
                tracing::warn!(client_id = %id, segments = segs.len(), ttl_s = self.cfg.client_ttl.as_secs_f64(), "client silent past client_ttl; unmounting its segments");
            }
            let mut unmounted = Vec::new();
            for s in segs {
                let owned = self
                    .segments
                    .lock()
                    .get(&s)
                    .is_some_and(|seg| seg.client_id == id);
                // A concurrent unmount may have won; that is fine.
                if owned && self.unmount(&s).is_ok() {
                    unmounted.push(s);
                }
            }
            out.push((id, unmounted));
        }
        out
    }

    /// A dead writer's unfinished puts and quarantined ranges: out of the index now, their
    /// ranges freed by the next [`Self::release_orphaned`].
    pub(super) fn orphan_puts_of(&self, client_id: &str) {
        let mut frees = self.unquarantine(|q| q.client_id == client_id);
        let mut puts = 0u64;
        for shard in &self.shards {
            let mut shard = shard.lock();
            let keys: Vec<String> = shard
                .iter()
                .filter(|(_, o)| o.state == ObjectState::Processing && *o.client_id == *client_id)
                .map(|(k, _)| k.to_string())
                .collect();
            for k in keys {
                if let Some(o) = shard.remove(k.as_str()) {
                    self.unreserve(&o);
                    frees.extend(self.pending_frees(&o));
                    puts += 1;
                }
            }
        }
        if !frees.is_empty() {
            tracing::warn!(
                client_id,
                unfinished_puts = puts,
                ranges = frees.len(),
                "client died with puts in progress; their reservations are freed now"
            );
            self.orphaned.lock().extend(frees);
        }
    }
}
