//! Domain types for what the master reports (cluster status, replica lists, namespace stats),
//! converted from the generated prost types with `TryFrom` at the gRPC edge. The client API, the
//! CLI and the Python bindings use these, so a proto change stops at this crate.

use crate::master as pb;

/// A master answer that breaks the contract: a required field unset, an unknown enum value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// A message field the master always sets was missing.
    #[error(
        "the master's answer has no {field}: the master and this client disagree on the protocol; run the same lunakv release on both"
    )]
    Missing {
        /// The field's path, e.g. `segments[2].segment`.
        field: String,
    },
    /// An enum field carried a value this client does not know.
    #[error(
        "the master's answer has {field} = {value}, unknown to this client: run the same lunakv release on both"
    )]
    UnknownValue {
        /// The field's path.
        field: String,
        /// The raw value.
        value: i32,
    },
}

/// A segment as registered with the master (`SegmentDescriptor`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Segment {
    /// The segment's identity: `host:port` of its transfer endpoint.
    pub name: String,
    pub transfer_endpoint: String,
    pub size: u64,
    pub host_id: String,
    /// Empty when shm is not offered.
    pub shm_socket: String,
    /// The protocol the owner serves (`tcp` or `rdma`).
    pub protocol: String,
    pub enable_offload: bool,
    pub disk_capacity_bytes: u64,
    pub instance_id: String,
    /// The protocol the owner was configured with; empty from older owners.
    pub requested_protocol: String,
    /// Why `protocol` differs from `requested_protocol`.
    pub protocol_reason: String,
}

impl From<pb::SegmentDescriptor> for Segment {
    fn from(d: pb::SegmentDescriptor) -> Self {
        Segment {
            name: d.name,
            transfer_endpoint: d.transfer_endpoint,
            size: d.size,
            host_id: d.host_id,
            shm_socket: d.shm_socket,
            protocol: d.protocol,
            enable_offload: d.enable_offload,
            disk_capacity_bytes: d.disk_capacity_bytes,
            instance_id: d.instance_id,
            requested_protocol: d.requested_protocol,
            protocol_reason: d.protocol_reason,
        }
    }
}

/// One segment's line in [`ClusterStatus`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SegmentStatus {
    /// `None` when the master named none (displays show an empty row, as before).
    pub segment: Option<Segment>,
    pub client_id: String,
    pub used_bytes: u64,
    pub object_count: u64,
    pub last_ping_ms_ago: u64,
    pub disk_capacity_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_object_count: u64,
}

/// The master's view of the cluster (`GetClusterStatus`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterStatus {
    pub cluster_id: String,
    pub segments: Vec<SegmentStatus>,
    pub total_capacity_bytes: u64,
    pub allocated_bytes: u64,
    pub key_count: u64,
    pub active_clients: u64,
    pub evicted_key_count: u64,
    pub master_version: String,
    pub enable_offload: bool,
    pub disk_capacity_bytes: u64,
    pub disk_used_bytes: u64,
    pub promotion_on_hit: bool,
    pub kv_events_enabled: bool,
    pub kv_events_endpoint: String,
    pub kv_events_replay_endpoint: String,
    pub kv_events_topic: String,
    pub kv_events_vllm_endpoint: String,
    /// Each tenant holding objects or having a quota (docs/TENANTS.md).
    pub tenants: Vec<TenantStatus>,
    /// The master runs with `--enable_multi_tenants` (quotas are enforced).
    pub enable_multi_tenants: bool,
}

/// One tenant's usage and quota (`GetClusterStatus`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantStatus {
    pub tenant_id: String,
    pub objects: u64,
    /// DRAM charged: each memory replica's aligned size, complete or being put.
    pub dram_bytes: u64,
    pub disk_objects: u64,
    /// `None`: no quota.
    pub quota_bytes: Option<u64>,
    /// Puts refused for the quota since the master started.
    pub quota_rejected: u64,
}

impl From<pb::ClusterStatus> for ClusterStatus {
    fn from(s: pb::ClusterStatus) -> Self {
        ClusterStatus {
            cluster_id: s.cluster_id,
            segments: s
                .segments
                .into_iter()
                .map(|g| SegmentStatus {
                    segment: g.segment.map(Segment::from),
                    client_id: g.client_id,
                    used_bytes: g.used_bytes,
                    object_count: g.object_count,
                    last_ping_ms_ago: g.last_ping_ms_ago,
                    disk_capacity_bytes: g.disk_capacity_bytes,
                    disk_used_bytes: g.disk_used_bytes,
                    disk_object_count: g.disk_object_count,
                })
                .collect(),
            total_capacity_bytes: s.total_capacity_bytes,
            allocated_bytes: s.allocated_bytes,
            key_count: s.key_count,
            active_clients: s.active_clients,
            evicted_key_count: s.evicted_key_count,
            master_version: s.master_version,
            enable_offload: s.enable_offload,
            disk_capacity_bytes: s.disk_capacity_bytes,
            disk_used_bytes: s.disk_used_bytes,
            promotion_on_hit: s.promotion_on_hit,
            kv_events_enabled: s.kv_events_enabled,
            kv_events_endpoint: s.kv_events_endpoint,
            kv_events_replay_endpoint: s.kv_events_replay_endpoint,
            kv_events_topic: s.kv_events_topic,
            kv_events_vllm_endpoint: s.kv_events_vllm_endpoint,
            tenants: s
                .tenants
                .into_iter()
                .map(|t| TenantStatus {
                    tenant_id: t.tenant_id,
                    objects: t.objects,
                    dram_bytes: t.dram_bytes,
                    disk_objects: t.disk_objects,
                    quota_bytes: (t.quota_bytes > 0).then_some(t.quota_bytes),
                    quota_rejected: t.quota_rejected,
                })
                .collect(),
            enable_multi_tenants: s.enable_multi_tenants,
        }
    }
}

/// Where a replica's bytes live (upstream's replica kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaKind {
    Memory,
    Disk,
    LocalDisk,
}

impl ReplicaKind {
    /// Upstream's name (`MEMORY`, `DISK`, `LOCAL_DISK`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaKind::Memory => "MEMORY",
            ReplicaKind::Disk => "DISK",
            ReplicaKind::LocalDisk => "LOCAL_DISK",
        }
    }
}

/// One replica of an object, as the master lists it (`Replica`). `segment` is `None` when the
/// index the master sent is outside its answer's segment table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaDesc {
    pub segment: Option<Segment>,
    pub offset: u64,
    pub size: u64,
    /// `Err(raw)` for a kind this client does not know; callers decide how to show it.
    pub kind: Result<ReplicaKind, i32>,
}

/// A replica with the segment table of the answer that carried it.
impl From<(&pb::Replica, &[pb::SegmentDescriptor])> for ReplicaDesc {
    fn from((r, segments): (&pb::Replica, &[pb::SegmentDescriptor])) -> Self {
        let kind = match pb::ReplicaKind::try_from(r.kind) {
            Ok(pb::ReplicaKind::Memory) => Ok(ReplicaKind::Memory),
            Ok(pb::ReplicaKind::Disk) => Ok(ReplicaKind::Disk),
            Ok(pb::ReplicaKind::LocalDisk) => Ok(ReplicaKind::LocalDisk),
            Err(_) => Err(r.kind),
        };
        ReplicaDesc {
            segment: segments.get(r.segment as usize).cloned().map(Segment::from),
            offset: r.offset,
            size: r.size,
            kind,
        }
    }
}

/// One client's share of a namespace in [`NamespaceStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceClientStats {
    pub client_id: String,
    pub keys_put: u64,
    pub put_already_held: u64,
    pub found_from_other: u64,
}

/// Key sharing within one namespace (`NamespaceStats`): how doctor spots engines that never
/// share a block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceStats {
    pub namespace: String,
    pub keys_put: u64,
    pub shared_keys: u64,
    pub active_clients: u64,
    pub unshared: bool,
    pub message: String,
    pub clients: Vec<NamespaceClientStats>,
}

/// The master's namespace report (`GetNamespaceStats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceReport {
    pub min_keys: u64,
    pub namespaces: Vec<NamespaceStats>,
    pub untracked: u64,
}

impl From<pb::NamespaceStatsResponse> for NamespaceReport {
    fn from(r: pb::NamespaceStatsResponse) -> Self {
        NamespaceReport {
            min_keys: r.min_keys,
            namespaces: r
                .namespaces
                .into_iter()
                .map(|n| NamespaceStats {
                    namespace: n.namespace,
                    keys_put: n.keys_put,
                    shared_keys: n.shared_keys,
                    active_clients: n.active_clients,
                    unshared: n.unshared,
                    message: n.message,
                    clients: n
                        .clients
                        .into_iter()
                        .map(|c| NamespaceClientStats {
                            client_id: c.client_id,
                            keys_put: c.keys_put,
                            put_already_held: c.put_already_held,
                            found_from_other: c.found_from_other,
                        })
                        .collect(),
                })
                .collect(),
            untracked: r.untracked,
        }
    }
}
