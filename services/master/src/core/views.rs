//! Views: gauges and the read-only snapshots the admin edge and the CLI show.

use std::collections::HashMap;
use std::time::Instant;

use crate::metrics::MAX_TENANT_SERIES;

use super::index::TenantUsage;
use super::state::MasterCore;
use super::types::{ObjectInfo, ReplicaInfo, SegmentDesc, SegmentInfo};

impl MasterCore {
    pub(super) fn usage(&self) -> (u64, u64) {
        let segs = self.segments.lock();
        segs.values().fold((0, 0), |(u, c), s| {
            (u + s.alloc.used(), c + s.alloc.capacity())
        })
    }

    pub fn total_capacity(&self) -> u64 {
        self.usage().1
    }

    pub fn allocated_bytes(&self) -> u64 {
        self.usage().0
    }

    pub fn key_count(&self) -> u64 {
        self.shards.iter().map(|s| s.lock().len() as u64).sum()
    }

    /// The keys of the default tenant held in index shard `i` (`i < SHARDS`; past it, none),
    /// as the admin port's `/get_all_keys` streams them one shard at a time.
    pub fn default_tenant_keys_in_shard(&self, i: usize) -> Vec<String> {
        let Some(shard) = self.shards.get(i) else {
            return Vec::new();
        };
        shard
            .lock()
            .iter()
            .filter(|(k, _)| !k.contains('\0'))
            .map(|(k, _)| k.to_string())
            .collect()
    }

    pub fn active_clients(&self) -> u64 {
        self.clients.lock().len() as u64
    }

    /// Refreshes the gauges from the current state (before a scrape).
    pub fn refresh_gauges(&self) {
        let (used, cap) = self.usage();
        let m = &self.metrics;
        m.allocated_bytes
            .set(i64::try_from(used).unwrap_or(i64::MAX));
        m.total_capacity_bytes
            .set(i64::try_from(cap).unwrap_or(i64::MAX));
        let keys = i64::try_from(self.key_count()).unwrap_or(i64::MAX);
        m.key_count.set(keys);
        m.keys.set(keys);
        m.max_keys
            .set(i64::try_from(self.cfg.max_keys).unwrap_or(i64::MAX));
        m.active_clients
            .set(i64::try_from(self.active_clients()).unwrap_or(i64::MAX));
        let (disk_cap, disk_used, disk_keys) = self.disk_totals();
        m.disk_capacity_bytes
            .set(i64::try_from(disk_cap).unwrap_or(i64::MAX));
        m.disk_used_bytes
            .set(i64::try_from(disk_used).unwrap_or(i64::MAX));
        let disk_keys = i64::try_from(disk_keys).unwrap_or(i64::MAX);
        m.disk_key_count.set(disk_keys);
        m.disk_keys.set(disk_keys);
        self.refresh_tenant_gauges();
    }

    /// The per-tenant gauges: the [`MAX_TENANT_SERIES`] tenants holding the most DRAM (and
    /// every tenant with a quota) by name, the rest summed as `_other`.
    fn refresh_tenant_gauges(&self) {
        let m = &self.metrics;
        let quotas = self.tenant_quotas();
        let mut usage: Vec<(String, TenantUsage)> = self.tenant_usage().into_iter().collect();
        usage.sort_by_key(|(t, u)| (!quotas.contains_key(t), std::cmp::Reverse(u.dram_bytes)));
        m.tenant_objects.reset();
        m.tenant_dram_bytes.reset();
        m.tenant_quota_bytes.reset();
        let mut other = TenantUsage::default();
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for (i, (t, u)) in usage.iter().enumerate() {
            if i >= MAX_TENANT_SERIES && !quotas.contains_key(t) {
                other.add(*u);
                continue;
            }
            m.tenant_objects
                .with_label_values(&[t])
                .set(gauge(u.objects));
            m.tenant_dram_bytes
                .with_label_values(&[t])
                .set(gauge(u.dram_bytes));
            if let Some(q) = quotas.get(t) {
                m.tenant_quota_bytes.with_label_values(&[t]).set(gauge(*q));
            }
        }
        if other.objects > 0 {
            m.tenant_objects
                .with_label_values(&["_other"])
                .set(gauge(other.objects));
            m.tenant_dram_bytes
                .with_label_values(&["_other"])
                .set(gauge(other.dram_bytes));
        }
    }

    pub fn segments(&self) -> Vec<SegmentInfo> {
        let now = Instant::now();
        let last_seen: HashMap<String, Instant> = self
            .clients
            .lock()
            .iter()
            .map(|(id, c)| (id.clone(), c.last_seen))
            .collect();
        let disk = self.disk_usage();
        let segs = self.segments.lock();
        let mut out: Vec<SegmentInfo> = segs
            .values()
            .map(|s| SegmentInfo {
                enable_offload: s.desc.enable_offload,
                disk_capacity: s.desc.disk_capacity,
                disk_used: disk.get(&s.desc.name).map_or(0, |d| d.1),
                disk_objects: disk.get(&s.desc.name).map_or(0, |d| d.0),
                name: s.desc.name.clone(),
                transfer_endpoint: s.desc.transfer_endpoint.clone(),
                client_id: s.client_id.clone(),
                size: s.desc.size,
                used: s.alloc.used(),
                objects: s.alloc.allocations() as u64,
                last_ping_ms_ago: last_seen
                    .get(&s.client_id)
                    .map_or(0, |t| now.duration_since(*t).as_millis() as u64),
                host_id: s.desc.host_id.clone(),
                status: s.status.name(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    pub fn segment_desc(&self, name: &str) -> Option<SegmentDesc> {
        self.segments.lock().get(name).map(|s| (*s.desc).clone())
    }

    /// An object's metadata, without granting a lease (admin view).
    pub fn query_key(&self, key: &str) -> Option<ObjectInfo> {
        let now = Instant::now();
        let shard = self.shard(key).lock();
        let o = shard.get(key)?;
        let segs = self.segments.lock();
        Some(ObjectInfo {
            key: key.to_string(),
            generation: o.generation,
            size: o.size,
            state: o.state,
            client_id: o.client_id.to_string(),
            replicas: o
                .replicas
                .iter()
                .map(|r| ReplicaInfo {
                    segment: r.segment.to_string(),
                    transfer_endpoint: segs
                        .get(&*r.segment)
                        .map(|s| s.desc.transfer_endpoint.clone())
                        .unwrap_or_default(),
                    offset: r.offset,
                    kind: if r.disk { "local_disk" } else { "memory" },
                })
                .collect(),
            lease_remaining_ms: o
                .lease_until
                .map_or(0, |t| t.saturating_duration_since(now).as_millis() as u64),
            soft_pinned: o.soft_pinned(now),
            hard_pinned: o.hard_pinned,
        })
    }

    /// Groups with members now (`/metrics`).
    pub fn group_count(&self) -> usize {
        self.groups.count()
    }
}
