//! Removal: of one key, of a tenant's keys (all or by pattern), of broken groups' rest, and
//! the release of freed ranges through their owners.

use std::time::{Duration, Instant};

use lunakv_proto::ErrorCode;

use crate::events::PoolEvent;
use crate::notifier::FreeEntry;

use super::index::tenant_of;
use super::state::MasterCore;
use super::types::{
    Object, ObjectState, OpError, PendingFree, ReplicaLoc, fan_out_by_owner, not_found, tiers_of,
};

impl MasterCore {
    /// Removes an object. A leased object (-706) or a put in progress (-703) is kept unless
    /// `force`. Answers after the owners acknowledged the FREE (or timed out).
    pub async fn remove(&self, key: &str, force: bool) -> Result<(), OpError> {
        let frees = self.unindex(key, force)?;
        self.release(frees).await;
        // A grouped object takes its group with it.
        self.drop_broken_groups().await;
        Ok(())
    }

    /// [`Self::remove`] for each key of a batch, one result per key in order. The ranges of
    /// all of them are released together: one FREE per owner for the whole batch, where a
    /// loop of removals waited for one FREE round trip per key (128 keys: about 11 ms).
    pub async fn remove_many<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k str>,
        force: bool,
    ) -> Vec<Result<(), OpError>> {
        let mut frees = Vec::new();
        let results = keys
            .into_iter()
            .map(|key| self.unindex(key, force).map(|mut f| frees.append(&mut f)))
            .collect();
        self.release(frees).await;
        self.drop_broken_groups().await;
        results
    }

    /// Takes `key` out of the index under its shard lock (the checks of [`Self::remove`]) and
    /// says which ranges its owners must free.
    fn unindex(&self, key: &str, force: bool) -> Result<Vec<PendingFree>, OpError> {
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
        Ok(o.map(|o| self.pending_frees(&o)).unwrap_or_default())
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

    /// Removes what is left of every broken group (run after each removal and eviction, and
    /// on every background tick). Returns how many objects went.
    pub async fn drop_broken_groups(&self) -> u64 {
        let broken = self.groups.broken();
        if broken.is_empty() {
            return 0;
        }
        let mut frees: Vec<PendingFree> = Vec::new();
        let mut removed = 0;
        for (group, members) in broken {
            for key in members {
                let mut shard = self.shard(&key).lock();
                let ours = shard
                    .get(&key)
                    .is_some_and(|o| o.group.as_deref() == Some(&*group));
                if !ours {
                    continue;
                }
                if let Some(o) = shard.remove(&key) {
                    if o.state == ObjectState::Complete {
                        self.emit_updated(&key, (o.generation, o.size), tiers_of(&o.replicas), &[]);
                    }
                    frees.extend(self.pending_frees(&o));
                    removed += 1;
                }
            }
        }
        if removed > 0 {
            self.metrics.group_members_dropped_total.inc_by(removed);
            tracing::debug!(removed, "dropped the rest of broken groups");
        }
        self.release(frees).await;
        removed
    }
}
