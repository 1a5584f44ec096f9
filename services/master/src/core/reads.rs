//! Reads: a key's location for get and exists, with the lease and eviction order a lookup
//! touches.

use lunakv_transfer::cap::{READ_TTL, RIGHT_READ};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::policy::EvictionPolicy;
use super::puts::capability;
use super::state::MasterCore;
use super::types::{Location, ObjectState, OpError, PendingPromotion, ReplicaView, not_found};

impl MasterCore {
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
