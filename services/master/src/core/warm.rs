//! HA warm standby, the core's side (docs/HA.md, "Warm standby").
//!
//! The leader's core publishes every change of its index into a bounded broadcast feed
//! ([`MasterCore::subscribe_index`]) and hands out consistent-enough snapshots
//! ([`MasterCore::index_snapshot`]): a standby subscribes first and snapshots second, so every
//! change the snapshot missed arrives after it, and the replica converges on the leader's
//! index. Changes are sent under the key's shard lock, so one key's changes keep their order.
//!
//! A standby that wins the election loads its copy into its fresh core
//! ([`MasterCore::preload_warm`]): each segment becomes a provisional mount that takes no
//! placements, each entry an object that gets can be answered from at once. The owner's remount
//! then reconciles its segment: each inventory item confirms (or replaces) the copy's entry, and
//! when the inventory is complete the copy's entries it did not confirm are dropped. A stale
//! entry can only cost a miss: a read names (generation, offset, size) and the owner serves only
//! that exact entry, answering STALE otherwise.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::broadcast;

use super::feed::{IndexChange, IndexEntry, IndexSnapshot, WarmReplicaLoc};
use super::state::MasterCore;
use super::types::{
    InventoryItem, Object, ObjectState, ReplicaLoc, Replicas, Segment, WarmSegment,
};
use crate::alloc::OffsetAllocator;

impl MasterCore {
    /// Every change of the index from now on. A receiver that falls `FEED_CAPACITY`
    /// changes behind gets `Lagged` and must start over with a snapshot.
    pub fn subscribe_index(&self) -> broadcast::Receiver<Arc<IndexChange>> {
        self.feed.subscribe()
    }

    /// The segments and complete objects, shard by shard (subscribe first: see the module doc).
    pub fn index_snapshot(&self) -> IndexSnapshot {
        let segments = self
            .segments
            .lock()
            .values()
            .map(|s| ((*s.desc).clone(), s.client_id.clone()))
            .collect();
        let mut entries = Vec::new();
        for shard in &self.shards {
            let shard = shard.lock();
            entries.extend(
                shard
                    .iter()
                    .filter(|(_, o)| o.state == ObjectState::Complete)
                    .map(|(k, o)| entry_of(k, o.generation, o.size, &o.replicas)),
            );
        }
        IndexSnapshot { segments, entries }
    }

    /// Sends a key's new state to the standbys (called under its shard lock).
    pub(super) fn replicate(&self, key: &str, generation: u64, size: u64, replicas: &[ReplicaLoc]) {
        if self.feed.receiver_count() == 0 {
            return;
        }
        let _ = self.feed.send(Arc::new(IndexChange::Entry(entry_of(
            key, generation, size, replicas,
        ))));
    }

    pub(super) fn replicate_change(&self, change: IndexChange) {
        if self.feed.receiver_count() > 0 {
            let _ = self.feed.send(Arc::new(change));
        }
    }

    /// Loads a standby's warm copy into this fresh core: provisional segments (no placements,
    /// no owner known as a client, so its next ping is told to remount) and their objects.
    /// Returns the objects loaded.
    pub fn preload_warm(&self, snap: IndexSnapshot) -> usize {
        let now = Instant::now();
        let mut mounts: HashMap<String, (u64, String)> = HashMap::new();
        {
            let mut segs = self.segments.lock();
            for (desc, client_id) in snap.segments {
                let mount_id = self.next_mount_id.fetch_add(1, Ordering::Relaxed);
                mounts.insert(desc.name.clone(), (mount_id, client_id.clone()));
                segs.insert(
                    desc.name.clone(),
                    Segment {
                        alloc: OffsetAllocator::new(desc.size),
                        desc: Arc::new(desc),
                        client_id,
                        // The stream carries no identities: the owner's remount records its own.
                        owner: None,
                        mount_id,
                        complete: false,
                        opened_at: None,
                        warm: Some(WarmSegment::default()),
                        status: Default::default(),
                    },
                );
            }
        }
        let mut loaded = 0;
        let mut unconfirmed: HashMap<String, Vec<(String, bool)>> = HashMap::new();
        for e in snap.entries {
            let replicas: Replicas = e
                .replicas
                .iter()
                .filter_map(|r| {
                    let (mount_id, _) = mounts.get(&r.segment)?;
                    Some(ReplicaLoc {
                        segment: self.names.get(&r.segment),
                        mount_id: *mount_id,
                        offset: r.offset,
                        disk: r.disk,
                    })
                })
                .collect();
            let Some(first) = replicas.first() else {
                continue;
            };
            let client_id = mounts
                .get(&*first.segment)
                .map(|(_, c)| c.clone())
                .unwrap_or_default();
            for r in &replicas {
                unconfirmed
                    .entry(r.segment.to_string())
                    .or_default()
                    .push((e.key.clone(), r.disk));
            }
            self.shard(&e.key).lock().insert(
                e.key.into(),
                Box::new(Object::complete(
                    e.generation,
                    e.size,
                    replicas,
                    self.names.get(&client_id),
                    now,
                )),
            );
            loaded += 1;
        }
        let mut segs = self.segments.lock();
        for (name, keys) in unconfirmed {
            if let Some(w) = segs.get_mut(&name).and_then(|s| s.warm.as_mut()) {
                w.unconfirmed.extend(keys);
            }
        }
        self.warm_start.store(true, Ordering::Release);
        loaded
    }

    /// Whether reads are answered from a warm copy while the owners remount.
    pub fn warm_start(&self) -> bool {
        self.warm_start.load(Ordering::Acquire)
    }

    /// A remount of `name`: when it is a provisional segment not remounted yet, its mount id
    /// and unconfirmed entries carry over to the owner's mount (the entries stay readable
    /// while the inventory arrives). Called with the segments lock held.
    pub(super) fn carry_warm(old: &mut Segment) -> Option<(u64, WarmSegment)> {
        let w = old.warm.take_if(|w| !w.remounted)?;
        Some((
            old.mount_id,
            WarmSegment {
                unconfirmed: w.unconfirmed,
                remounted: true,
            },
        ))
    }

    /// An inventory item of `segment` (mount `mount_id`) that is exactly the warm copy's
    /// unconfirmed entry (same generation and size, same segment, tier and offset): the entry
    /// stays in place, its range is reserved in the owner's allocator and it counts as
    /// confirmed. Readers, standbys and KV-event subscribers see no change, so nothing is sent:
    /// removing and re-inserting it cost a KV event and a feed change per key, which made a
    /// rebuild with the copy slower than one without. Returns `false`, touching
    /// nothing, when the item does not match (or its range cannot be reserved): the general
    /// path then replaces the copy's entry or rejects the item as before. Called with the
    /// key's shard locked.
    pub(super) fn confirm_warm_in_place(
        &self,
        shard: &mut super::index::Index,
        client_id: &str,
        segment: &str,
        mount_id: u64,
        item: &InventoryItem,
    ) -> bool {
        if item.disk && !self.cfg.enable_offload {
            return false;
        }
        let Some(mut o) = shard.get_mut(item.key.as_str()) else {
            return false;
        };
        let offset = if item.disk {
            lunakv_transfer::DISK_OFFSET
        } else {
            item.offset
        };
        if o.generation != item.generation
            || o.size != item.size
            || o.state != ObjectState::Complete
            || !o.replicas.iter().any(|r| {
                *r.segment == *segment
                    && r.mount_id == mount_id
                    && r.disk == item.disk
                    && r.offset == offset
            })
        {
            return false;
        }
        {
            let mut segs = self.segments.lock();
            let Some(seg) = segs.get_mut(segment).filter(|s| s.mount_id == mount_id) else {
                return false;
            };
            let id = (item.key.clone(), item.disk);
            if !seg
                .warm
                .as_ref()
                .is_some_and(|w| w.unconfirmed.contains(&id))
            {
                return false;
            }
            if !item.disk && seg.alloc.reserve(item.offset, item.size).is_err() {
                return false;
            }
            if let Some(w) = seg.warm.as_mut() {
                w.unconfirmed.remove(&id);
            }
        }
        if *o.client_id != *client_id {
            o.client_id = self.names.get(client_id);
        }
        true
    }

    /// An inventory item of `segment` (mount `mount_id`) arrived: the warm copy's replica of
    /// that key there, if any, is dropped, so that the owner's item replaces it (same
    /// generation: the same entry, now confirmed; another: the owner's wins). Called with the
    /// key's shard locked (passed in), before the item is indexed.
    pub(super) fn confirm_warm(
        &self,
        shard: &mut super::index::Index,
        segment: &str,
        mount_id: u64,
        key: &str,
        disk: bool,
    ) {
        let was_warm = {
            let mut segs = self.segments.lock();
            segs.get_mut(segment)
                .filter(|s| s.mount_id == mount_id)
                .and_then(|s| s.warm.as_mut())
                .is_some_and(|w| w.unconfirmed.remove(&(key.to_string(), disk)))
        };
        if !was_warm {
            return;
        }
        let Some(mut o) = shard.get_mut(key) else {
            return;
        };
        o.replicas
            .retain(|r| !(*r.segment == *segment && r.mount_id == mount_id && r.disk == disk));
        let empty = o.replicas.is_empty();
        drop(o);
        if empty {
            shard.remove(key);
        }
    }

    /// The owner's inventory of `segment` is complete (or the rebuild ended first): the warm
    /// entries it did not confirm are not on the owner (removed, evicted or never written
    /// there) and leave the index. Each key is checked and dropped under its shard lock, as
    /// [`Self::confirm_warm`] confirms it, so an inventory item arriving meanwhile is either
    /// confirmed before or indexed as new after, never refused as a duplicate of the copy's
    /// entry (the owner would drop what it holds).
    pub(super) fn finish_warm(&self, segment: &str, mount_id: u64) {
        let keys: Vec<(String, bool)> = {
            let segs = self.segments.lock();
            match segs
                .get(segment)
                .filter(|s| s.mount_id == mount_id)
                .and_then(|s| s.warm.as_ref())
            {
                Some(w) => w.unconfirmed.iter().cloned().collect(),
                None => return,
            }
        };
        let mut dropped = 0;
        for (key, disk) in keys {
            let mut shard = self.shard(&key).lock();
            let still = {
                let mut segs = self.segments.lock();
                segs.get_mut(segment)
                    .filter(|s| s.mount_id == mount_id)
                    .and_then(|s| s.warm.as_mut())
                    .is_some_and(|w| w.unconfirmed.remove(&(key.clone(), disk)))
            };
            if !still {
                continue;
            }
            dropped += 1;
            let Some(mut o) = shard.get_mut(key.as_str()) else {
                continue;
            };
            o.replicas
                .retain(|r| !(*r.segment == *segment && r.mount_id == mount_id && r.disk == disk));
            self.replicate(&key, o.generation, o.size, &o.replicas);
            let empty = o.replicas.is_empty();
            drop(o);
            if empty {
                shard.remove(key.as_str());
            }
        }
        if let Some(s) = self.segments.lock().get_mut(segment)
            && s.mount_id == mount_id
        {
            s.warm = None;
        }
        if dropped > 0 {
            tracing::info!(
                segment,
                dropped,
                "warm copy reconciled with the owner's inventory: entries the owner does not hold dropped"
            );
        }
    }

    /// The rebuild is over (every recorded segment remounted, or the grace passed): segments of
    /// the warm copy whose owner never remounted are unmounted, and unconfirmed entries of
    /// segments still sending their inventory are dropped (their items are indexed as new
    /// when they arrive).
    pub fn end_warm(&self) {
        if !self.warm_start.swap(false, Ordering::AcqRel) {
            return;
        }
        let (never, partial): (Vec<_>, Vec<_>) = {
            let segs = self.segments.lock();
            segs.iter()
                .filter_map(|(n, s)| {
                    s.warm
                        .as_ref()
                        .map(|w| (n.clone(), s.mount_id, w.remounted))
                })
                .partition(|(_, _, remounted)| !remounted)
        };
        for (name, _, _) in never {
            tracing::warn!(segment = %name, "the owner of a segment in the warm copy did not remount; its entries leave the index");
            let _ = self.unmount(&name);
        }
        for (name, mount_id, _) in partial {
            self.finish_warm(&name, mount_id);
        }
    }
}

fn entry_of(key: &str, generation: u64, size: u64, replicas: &[ReplicaLoc]) -> IndexEntry {
    IndexEntry {
        key: key.to_string(),
        generation,
        size,
        replicas: replicas
            .iter()
            .map(|r| WarmReplicaLoc {
                segment: r.segment.to_string(),
                offset: r.offset,
                disk: r.disk,
            })
            .collect(),
    }
}
