//! The master's Prometheus metrics, under Mooncake's names, in a registry owned by one master
//! (not global), so several masters can run in one test process.

use lunakv_telemetry::metrics::{counter, gauge};
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// The RPCs counted as `master_<rpc>_requests_total` / `master_<rpc>_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    PutStart,
    BatchPutStart,
    PutEnd,
    BatchPutEnd,
    PutRevoke,
    BatchPutRevoke,
    GetReplicaList,
    BatchGetReplicaList,
    ExistKey,
    BatchExistKey,
    Remove,
    BatchRemove,
    RemoveAll,
    RemoveByRegex,
    MountSegment,
    MountInventory,
    UnmountSegment,
    Ping,
}

impl Rpc {
    pub const ALL: [Rpc; 18] = [
        Rpc::PutStart,
        Rpc::BatchPutStart,
        Rpc::PutEnd,
        Rpc::BatchPutEnd,
        Rpc::PutRevoke,
        Rpc::BatchPutRevoke,
        Rpc::GetReplicaList,
        Rpc::BatchGetReplicaList,
        Rpc::ExistKey,
        Rpc::BatchExistKey,
        Rpc::Remove,
        Rpc::BatchRemove,
        Rpc::RemoveAll,
        Rpc::RemoveByRegex,
        Rpc::MountSegment,
        Rpc::MountInventory,
        Rpc::UnmountSegment,
        Rpc::Ping,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Rpc::PutStart => "put_start",
            Rpc::BatchPutStart => "batch_put_start",
            Rpc::PutEnd => "put_end",
            Rpc::BatchPutEnd => "batch_put_end",
            Rpc::PutRevoke => "put_revoke",
            Rpc::BatchPutRevoke => "batch_put_revoke",
            Rpc::GetReplicaList => "get_replica_list",
            Rpc::BatchGetReplicaList => "batch_get_replica_list",
            Rpc::ExistKey => "exist_key",
            Rpc::BatchExistKey => "batch_exist_key",
            Rpc::Remove => "remove",
            Rpc::BatchRemove => "batch_remove",
            Rpc::RemoveAll => "remove_all",
            Rpc::RemoveByRegex => "remove_by_regex",
            Rpc::MountSegment => "mount_segment",
            Rpc::MountInventory => "mount_inventory",
            Rpc::UnmountSegment => "unmount_segment",
            Rpc::Ping => "ping",
        }
    }
}

/// Tenants given their own series in the per-tenant gauges; the rest are summed under
/// `tenant_id="_other"` (`_` starts no tenant name), so made-up tenant names cannot grow a
/// scrape without bound.
pub const MAX_TENANT_SERIES: usize = 256;

/// Every metric the master exports.
pub struct Metrics {
    pub registry: Registry,
    /// Upstream's `mooncake_tenant_quota_reject_total{tenant_id, reason}`.
    pub tenant_quota_reject: IntCounterVec,
    /// Per tenant: objects, DRAM bytes charged, quota (docs/TENANTS.md).
    pub tenant_objects: IntGaugeVec,
    pub tenant_dram_bytes: IntGaugeVec,
    pub tenant_quota_bytes: IntGaugeVec,
    pub allocated_bytes: IntGauge,
    pub total_capacity_bytes: IntGauge,
    pub key_count: IntGauge,
    /// `master_keys`: `master_key_count` under a name `promtool check metrics` accepts (the
    /// upstream name stays for upstream's dashboards).
    pub keys: IntGauge,
    pub active_clients: IntGauge,
    /// Keys removed by eviction since start.
    pub evicted_key_count: IntCounter,
    /// `master_evicted_keys_total`, the promtool-clean twin of `master_evicted_key_count`.
    pub evicted_keys_total: IntCounter,
    /// Eviction passes that freed at least one key.
    pub successful_evictions_total: IntCounter,
    /// Objects removed because another member of their group was gone (docs/GROUPS.md).
    pub group_members_dropped_total: IntCounter,
    /// PutStarts that found no room even after eviction.
    pub put_start_alloc_failures_total: IntCounter,
    /// Placements that held back a segment still ramping up (core/ramp.rs).
    pub placement_ramp_deferred_total: IntCounter,
    /// PutStarts refused before any eviction: larger than every segment.
    pub put_start_oversized_total: IntCounter,
    /// PutStarts refused: the client holds too much in unfinished puts.
    pub put_start_eviction_refused_total: IntCounter,
    pub eviction_lease_skipped_total: IntCounter,
    pub put_start_reservation_refused_total: IntCounter,
    /// PutStarts refused: the index is at max_keys and nothing could be dropped.
    pub put_start_key_limit_refused_total: IntCounter,
    /// Calls answered as quick frames instead of gRPC (lunakv_proto::quick).
    pub quick_calls_total: IntCounter,
    /// Ranges of unfinished puts freed because their writer died or revoked them late.
    pub put_reservations_reclaimed_total: IntCounter,
    /// Objects dropped because the index reached max_keys.
    pub key_limit_evictions_total: IntCounter,
    /// The max_keys limit (0 = none).
    pub max_keys: IntGauge,
    /// UnmountSegment calls refused because the caller does not own the segment.
    pub foreign_unmounts_refused_total: IntCounter,
    /// SSD tier: disk capacity of mounted offloading owners, and what the index holds there.
    pub disk_capacity_bytes: IntGauge,
    pub disk_used_bytes: IntGauge,
    pub disk_key_count: IntGauge,
    /// `master_disk_keys`, the promtool-clean twin of `master_disk_key_count`.
    pub disk_keys: IntGauge,
    /// Objects moved from DRAM to an owner's disk by eviction.
    pub offloaded_keys_total: IntCounter,
    /// Offloads the owner could not complete (the objects were evicted instead).
    pub offload_failures_total: IntCounter,
    /// DRAM evictions the policy kept off the SSD tier (cslru: a chain's end never read).
    pub offload_declined_total: IntCounter,
    /// Disk objects the owners dropped (size limit, failed checksum) and reported.
    pub disk_dropped_keys_total: IntCounter,
    /// Gets answered with a disk-only location.
    pub disk_hits_total: IntCounter,
    /// Mounts whose enable_offload disagreed with the master's (refused or warned).
    pub offload_mismatch_total: IntCounter,
    /// Inventory entries rejected for want of a valid placement proof (docs/SECURITY.md).
    pub inventory_unproven_total: IntCounter,
    /// Disk-only objects copied back into their owner's DRAM on a hit (`--promotion_on_hit`).
    pub promotions_total: IntCounter,
    /// Promotions the owner could not complete (the object stays served from disk).
    pub promotion_failures_total: IntCounter,
    /// Objects drain jobs moved off their segments (swapped into the index).
    pub drain_moved_objects_total: IntCounter,
    /// Bytes of those objects.
    pub drain_moved_bytes_total: IntCounter,
    /// One entry per [`Rpc::ALL`], in its order.
    per_rpc: Vec<RpcSeries>,
    /// `master_rpc_duration_seconds{rpc}`: admission to answer, per RPC.
    durations: prometheus::HistogramVec,
}

/// One RPC's series.
struct RpcSeries {
    requests: IntCounter,
    failures: IntCounter,
    /// Its series of `durations`, found on its first call (a series appears once its RPC is
    /// called): `with_label_values` hashed the label under the vector's lock per call.
    duration: std::sync::OnceLock<prometheus::Histogram>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        let per_rpc = Rpc::ALL
            .iter()
            .map(|rpc| {
                let n = rpc.name();
                RpcSeries {
                    requests: counter(
                        &r,
                        &format!("master_{n}_requests_total"),
                        &format!("{n} calls received"),
                    ),
                    failures: counter(
                        &r,
                        &format!("master_{n}_failures_total"),
                        &format!("{n} calls that failed (or had a failed item)"),
                    ),
                    duration: std::sync::OnceLock::new(),
                }
            })
            .collect();
        let durations = prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new(
                "master_rpc_duration_seconds",
                "Time from admission to answer of each master RPC",
            )
            .buckets(vec![
                50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25,
                1.0,
            ]),
            &["rpc"],
        )
        .expect("static metric definition");
        r.register(Box::new(durations.clone()))
            .expect("metric names are unique within a fresh registry");
        let tenant_gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["tenant_id"])
                .expect("static metric definition");
            r.register(Box::new(g.clone()))
                .expect("metric names are unique within a fresh registry");
            g
        };
        let tenant_objects = tenant_gauge("lunakv_tenant_objects", "Objects each tenant holds");
        let tenant_dram_bytes = tenant_gauge(
            "lunakv_tenant_dram_bytes",
            "DRAM charged to each tenant (memory replicas, complete or being put)",
        );
        let tenant_quota_bytes = tenant_gauge(
            "lunakv_tenant_quota_bytes",
            "Each tenant's DRAM quota (tenants with a policy)",
        );
        let tenant_quota_reject = IntCounterVec::new(
            Opts::new(
                "mooncake_tenant_quota_reject_total",
                "Total number of tenant quota admission rejects",
            ),
            &["tenant_id", "reason"],
        )
        .expect("static metric definition");
        r.register(Box::new(tenant_quota_reject.clone()))
            .expect("metric names are unique within a fresh registry");
        Metrics {
            tenant_quota_reject,
            tenant_objects,
            tenant_dram_bytes,
            tenant_quota_bytes,
            allocated_bytes: gauge(&r, "master_allocated_bytes", "Bytes allocated in segments"),
            total_capacity_bytes: gauge(
                &r,
                "master_total_capacity_bytes",
                "Bytes of all mounted segments",
            ),
            key_count: gauge(&r, "master_key_count", "Objects in the index"),
            keys: gauge(&r, "master_keys", "Objects in the index"),
            active_clients: gauge(&r, "master_active_clients", "Clients that ping"),
            evicted_key_count: counter(&r, "master_evicted_key_count", "Keys evicted"),
            evicted_keys_total: counter(&r, "master_evicted_keys_total", "Keys evicted"),
            group_members_dropped_total: counter(
                &r,
                "lunakv_group_members_dropped_total",
                "Objects removed because another member of their group was gone",
            ),
            successful_evictions_total: counter(
                &r,
                "master_successful_evictions_total",
                "Eviction passes that freed space",
            ),
            put_start_alloc_failures_total: counter(
                &r,
                "master_put_start_alloc_failures_total",
                "PutStarts with no room even after eviction",
            ),
            placement_ramp_deferred_total: counter(
                &r,
                "master_placement_ramp_deferred_total",
                "Placements that held back a segment still ramping up after it joined settled ones",
            ),
            put_start_oversized_total: counter(
                &r,
                "master_put_start_oversized_total",
                "PutStarts refused at once: the object is larger than every segment",
            ),
            put_start_reservation_refused_total: counter(
                &r,
                "master_put_start_reservation_refused_total",
                "PutStarts refused: the caller holds put_reservation_limit_ratio of the pool in unfinished puts, or all callers put_reservation_total_ratio",
            ),
            eviction_lease_skipped_total: counter(
                &r,
                "master_eviction_lease_skipped_total",
                "Eviction candidates passed over because a reader holds a lease or a soft pin (cslru takes them only when nothing else is left)",
            ),
            put_start_eviction_refused_total: counter(
                &r,
                "master_put_start_eviction_refused_total",
                "PutStarts refused: making room would evict more than put_eviction_limit_ratio of the pool",
            ),
            put_start_key_limit_refused_total: counter(
                &r,
                "master_put_start_key_limit_refused_total",
                "PutStarts refused: the index is at max_keys and nothing can be evicted",
            ),
            quick_calls_total: counter(
                &r,
                "master_quick_calls_total",
                "BatchExistKey, BatchGetReplicaList, BatchPutStart and BatchPutEnd calls answered as quick frames on the RPC port instead of gRPC",
            ),
            put_reservations_reclaimed_total: counter(
                &r,
                "master_put_reservations_reclaimed_total",
                "Ranges of unfinished puts freed early (writer died, or revoked after the discard)",
            ),
            key_limit_evictions_total: counter(
                &r,
                "master_key_limit_evictions_total",
                "Objects dropped because the index reached max_keys",
            ),
            max_keys: gauge(
                &r,
                "master_max_keys",
                "The max_keys limit of the object index (0 = none)",
            ),
            foreign_unmounts_refused_total: counter(
                &r,
                "master_foreign_unmounts_refused_total",
                "UnmountSegment calls refused: the caller is not the segment's owner",
            ),
            disk_capacity_bytes: gauge(
                &r,
                "master_disk_capacity_bytes",
                "SSD tier bytes offered by mounted store-clients",
            ),
            disk_used_bytes: gauge(
                &r,
                "master_disk_used_bytes",
                "Bytes of objects held on store-client disks",
            ),
            disk_key_count: gauge(&r, "master_disk_key_count", "Objects with a disk replica"),
            disk_keys: gauge(&r, "master_disk_keys", "Objects with a disk replica"),
            offloaded_keys_total: counter(
                &r,
                "master_offloaded_keys_total",
                "Objects moved from DRAM to disk by eviction",
            ),
            offload_failures_total: counter(
                &r,
                "master_offload_failures_total",
                "Offloads that failed (the object was evicted instead)",
            ),
            offload_declined_total: counter(
                &r,
                "master_offload_declined_total",
                "DRAM evictions not written to disk: the policy expects no read (a chain's end never read)",
            ),
            disk_dropped_keys_total: counter(
                &r,
                "master_disk_dropped_keys_total",
                "Disk objects dropped by their owner (size limit, bad checksum)",
            ),
            disk_hits_total: counter(
                &r,
                "master_disk_hits_total",
                "Lookups answered with a disk-only location",
            ),
            offload_mismatch_total: counter(
                &r,
                "master_offload_mismatch_total",
                "Mounts whose enable_offload disagreed with the master's",
            ),
            inventory_unproven_total: counter(
                &r,
                "master_inventory_unproven_total",
                "Inventory entries rejected for want of a valid placement proof",
            ),
            promotions_total: counter(
                &r,
                "master_promotions_total",
                "Disk-only objects promoted back to DRAM on a hit",
            ),
            promotion_failures_total: counter(
                &r,
                "master_promotion_failures_total",
                "Promotions on hit the owner could not complete",
            ),
            drain_moved_objects_total: counter(
                &r,
                "master_drain_moved_objects_total",
                "Objects drain jobs moved to another segment",
            ),
            drain_moved_bytes_total: counter(
                &r,
                "master_drain_moved_bytes_total",
                "Bytes of the objects drain jobs moved to another segment",
            ),
            per_rpc,
            durations,
            registry: r,
        }
    }

    /// Counts one call of `rpc`, failed or not.
    /// Counts a put refused for its tenant's quota.
    pub fn tenant_quota_rejected(&self, tenant: &str) {
        self.tenant_quota_reject
            .with_label_values(&[tenant, "quota_exceeded"])
            .inc();
    }

    /// Counts a put refused because multi-tenant mode does not know its tenant (one series for
    /// all of them: the names come from peers).
    pub fn tenant_not_registered(&self) {
        self.tenant_quota_reject
            .with_label_values(&["_unregistered", "not_registered"])
            .inc();
    }

    /// Counts `n` evicted keys under both names.
    pub fn evicted(&self, n: u64) {
        self.evicted_key_count.inc_by(n);
        self.evicted_keys_total.inc_by(n);
    }

    pub fn record(&self, rpc: Rpc, failed: bool, took: std::time::Duration) {
        let idx = Rpc::ALL.iter().position(|r| *r == rpc).unwrap_or(0);
        if let Some(s) = self.per_rpc.get(idx) {
            s.duration
                .get_or_init(|| self.durations.with_label_values(&[rpc.name()]))
                .observe(took.as_secs_f64());
            s.requests.inc();
            if failed {
                s.failures.inc();
            }
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each RPC's latency series is resolved once and kept: its count follows every call, and
    /// an RPC never called shows no series.
    #[test]
    fn each_rpc_keeps_its_own_latency_series() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.record(
                Rpc::BatchExistKey,
                false,
                std::time::Duration::from_micros(80),
            );
        }
        m.record(Rpc::BatchPutEnd, true, std::time::Duration::from_millis(2));
        let count = |rpc: Rpc| {
            m.durations
                .get_metric_with_label_values(&[rpc.name()])
                .ok()
                .map(|h| h.get_sample_count())
        };
        assert_eq!(count(Rpc::BatchExistKey), Some(3));
        assert_eq!(count(Rpc::BatchPutEnd), Some(1));
        let series: Vec<_> = m
            .registry
            .gather()
            .into_iter()
            .filter(|f| f.name() == "master_rpc_duration_seconds")
            .flat_map(|f| f.get_metric().to_vec())
            .collect();
        assert_eq!(
            series.len(),
            2,
            "only the RPCs that were called have a series"
        );
    }
}
