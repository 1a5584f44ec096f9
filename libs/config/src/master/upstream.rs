//! Upstream `mooncake_master` keys lunakv does not define, each ignored with the reason or
//! refused with the fix.

use crate::gflags::{Upstream, UpstreamFlag};

/// Upstream `mooncake_master` flags and config keys lunakv does not define: each is ignored
/// with the reason (in the file, the environment or on the command line) or refused with the
/// fix. Read from upstream's master.cpp; lunakv's own keys are `KEYS`.
pub const UPSTREAM_KEYS: &[UpstreamFlag] = &[
    ignored("max_threads", false, THREADS),
    ignored("rpc_thread_num", false, THREADS),
    ignored(
        "enable_metric_reporting",
        true,
        "metrics are always served on metrics_port (/metrics)",
    ),
    ignored(
        "rpc_conn_timeout_seconds",
        false,
        "gRPC connections are HTTP/2 and closed by the client or by keepalive",
    ),
    ignored(
        "rpc_enable_tcp_no_delay",
        true,
        "the gRPC server always sets TCP_NODELAY",
    ),
    ignored(
        "memory_allocator",
        false,
        "each segment has one offset allocator; there is no cachelib",
    ),
    ignored("enable_http_metadata_server", true, NO_METADATA_SERVER),
    ignored("http_metadata_server_port", false, NO_METADATA_SERVER),
    ignored("http_metadata_server_host", false, NO_METADATA_SERVER),
    ignored("root_fs_dir", false, SSD_ON_STORES),
    ignored("global_file_segment_size", false, SSD_ON_STORES),
    ignored("enable_disk_eviction", true, SSD_ON_STORES),
    ignored("quota_bytes", false, SSD_ON_STORES),
    ignored(
        "offload_on_evict",
        true,
        "evicted objects always go to the SSD tier when enable_offload is on",
    ),
    ignored("offloading_queue_limit", false, SSD_ON_STORES),
    ignored(
        "allow_evict_soft_pinned_objects",
        true,
        "soft-pinned objects are evicted last, after every unpinned one",
    ),
    ignored("enable_snapshot", true, NO_SNAPSHOTS),
    ignored("snapshot_interval_seconds", false, NO_SNAPSHOTS),
    ignored("snapshot_child_timeout_seconds", false, NO_SNAPSHOTS),
    ignored("snapshot_retention_count", false, NO_SNAPSHOTS),
    ignored("snapshot_backup_dir", false, NO_SNAPSHOTS),
    ignored("snapshot_object_store_type", false, NO_SNAPSHOTS),
    ignored("snapshot_payload_store_type", false, NO_SNAPSHOTS),
    ignored("snapshot_payload_backend_type", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_store_type", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_backend_type", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_store_connstring", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_backend_connstring", false, NO_SNAPSHOTS),
    refused(
        "enable_snapshot_restore",
        true,
        "the index is rebuilt from the store-clients' inventories when a master starts; there is no snapshot to restore",
    ),
    ignored("max_total_finished_tasks", false, NO_TASKS),
    ignored("max_total_pending_tasks", false, NO_TASKS),
    ignored("max_total_processing_tasks", false, NO_TASKS),
    ignored("pending_task_timeout_sec", false, NO_TASKS),
    ignored("processing_task_timeout_sec", false, NO_TASKS),
    ignored("max_retry_attempts", false, NO_TASKS),
    refused(
        "rpc_interface",
        false,
        "resolve the interface's IPv4 address and pass it as --rpc_address (in a pod: --rpc_address=$(POD_IP))",
    ),
    refused("enable_cxl", true, NO_CXL),
    refused("cxl_path", false, NO_CXL),
    refused("cxl_size", false, NO_CXL),
    ignored(
        "kv_event_publisher_send_interval_ms",
        false,
        "lunakv sends each KV event batch as soon as it is drained (docs/EVENTS.md)",
    ),
    ignored(
        "kv_event_publisher_auto_port",
        true,
        "lunakv binds the KV event port it is given; a taken port is a startup error naming it, not a silent move to a port no subscriber knows",
    ),
    // Upstream flags added by mid-2026 (master.cpp at 3b5a594).
    ignored("enable_oplog", true, NO_OPLOG),
    ignored("oplog_poll_interval_ms", false, NO_OPLOG),
    ignored("oplog_batch_max_entries", false, NO_OPLOG),
    ignored("batch_oplog_retry_timeout_sec", false, NO_OPLOG),
    UpstreamFlag {
        name: "dynamic_replication_mode",
        boolean: false,
        treatment: Upstream::OnlyValue {
            value: "off",
            fix: "lunakv places replica_num replicas when an object is put; there is no dynamic fan-out of hot objects",
        },
    },
    ignored("dynamic_replication_heat_window_seconds", false, NO_DYNAMIC),
    ignored("kv_events_additional_salt", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_block_size", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_dp_rank", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_lora_name", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_model_name", false, DEPRECATED_EVENT_FIELD),
    ignored(
        "kv_events_tenant_id",
        false,
        "deprecated upstream (each event carries its object's tenant there); lunakv's streams carry the default tenant's keys only (docs/TENANTS.md)",
    ),
    ignored("nof_eviction_high_watermark_ratio", false, NO_NOF),
    ignored("nof_eviction_ratio", false, NO_NOF),
    ignored("nof_heartbeat_interval_sec", false, NO_NOF),
    ignored("nof_heartbeat_probe_timeout_ms", false, NO_NOF),
    ignored("offload_cap_ratio", false, NO_OFFLOAD_QUEUE),
    ignored("offload_force_evict", true, NO_OFFLOAD_QUEUE),
    ignored("pod_name", false, NO_POD_ROUTING),
    ignored("pod_namespace", false, NO_POD_ROUTING),
    ignored("promotion_max_per_heartbeat", false, NO_PROMOTION_QUEUE),
];

const THREADS: &str = "the tokio runtime sizes its worker threads to the CPUs it may use";
const NO_METADATA_SERVER: &str = "the master keeps segment metadata itself, so no HTTP metadata server is needed (clients say metadata_server P2PHANDSHAKE)";
const SSD_ON_STORES: &str = "the SSD tier lives on the store-clients (lunakv-store --enable_offload, MOONCAKE_OFFLOAD_* variables; docs/OFFLOAD.md)";
const NO_SNAPSHOTS: &str = "a master rebuilds its index from the store-clients' inventories (and, with --enable_ha, keeps its view in etcd), so there are no snapshots";
const NO_TASKS: &str = "lunakv has no copy/move task manager";
const NO_CXL: &str = "lunakv has no CXL memory support; remove the flag";
const NO_OPLOG: &str = "HA standbys copy the leader's index over ReplicateIndex and elect through etcd (--enable_ha, docs/HA.md); there is no OpLog";
const NO_DYNAMIC: &str = "lunakv places replica_num replicas when an object is put; there is no dynamic fan-out of hot objects";
const DEPRECATED_EVENT_FIELD: &str = "deprecated upstream and not emitted on events there either; an indexer learns it when its engines register";
const NO_NOF: &str =
    "lunakv has no NVMe-oF tier; the SSD tier lives on the store-clients (docs/OFFLOAD.md)";
const NO_OFFLOAD_QUEUE: &str = "eviction with --enable_offload offloads every evicted object through its owner; there is no offload queue to cap";
const NO_POD_ROUTING: &str =
    "clients reach segments by their advertised address; there is no label-based routing";
const NO_PROMOTION_QUEUE: &str = "the master hands each promotion to the object's owner when a read admits it (--promotion_admission_threshold, --promotion_queue_limit), not through the owners' heartbeats";

const fn ignored(name: &'static str, boolean: bool, why: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean,
        treatment: Upstream::Ignored(why),
    }
}

const fn refused(name: &'static str, boolean: bool, fix: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean,
        treatment: Upstream::Refused(fix),
    }
}
