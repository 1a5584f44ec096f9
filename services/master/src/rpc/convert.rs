//! The prost <-> domain conversions of the master's RPCs, in one place for both transports
//! (gRPC in [`super::service`], quick calls in `rpc/quick.rs`): requests become validated
//! domain types (`TryFrom`), the core's results become the wire's messages, and whole-call
//! failures become a `tonic::Status` in [`to_status`] only.

use lunakv_proto::ErrorCode;
use lunakv_proto::master as pb;
use lunakv_proto::status::GrpcError;
use tonic::{Code, Status};

use crate::core::{
    CoreError, InventoryItem, Location, OpError, PutOptions, ReplicaView, SegmentDesc,
};
use crate::persist::PersistError;

/// A put's generation and its placements, as the core answers a put start.
pub(crate) type Placed = (u64, Vec<ReplicaView>);

/// Whole-call failures of the gRPC edge.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// The one place internal errors become gRPC statuses.
pub fn to_status(e: ServiceError) -> Status {
    lunakv_proto::status::to_status(&e)
}

impl GrpcError for ServiceError {
    fn code(&self) -> Code {
        match self {
            ServiceError::Core(
                CoreError::ClusterMismatch { .. } | CoreError::OffloadMismatch { .. },
            ) => Code::FailedPrecondition,
            ServiceError::Core(CoreError::SegmentNotFound(_)) => Code::NotFound,
            ServiceError::Core(CoreError::InventoryNotAwaited { .. }) => Code::Aborted,
            ServiceError::Core(CoreError::NotOwner { .. } | CoreError::OtherIdentity { .. }) => {
                Code::PermissionDenied
            }
            ServiceError::Core(CoreError::InvalidArgument(_)) | ServiceError::Invalid(_) => {
                Code::InvalidArgument
            }
            ServiceError::Persist(_) => Code::Internal,
        }
    }
}

impl TryFrom<pb::SegmentDescriptor> for SegmentDesc {
    type Error = ServiceError;

    fn try_from(d: pb::SegmentDescriptor) -> Result<Self, Self::Error> {
        if d.name.is_empty() {
            return Err(ServiceError::Invalid(
                "segment.name is empty: name the segment by its transfer endpoint, host:port"
                    .into(),
            ));
        }
        if d.size == 0 {
            return Err(ServiceError::Invalid(format!(
                "segment {:?} has size 0: a pure requester (global_segment_size 0) does not \
                 mount; just Ping",
                d.name
            )));
        }
        let transfer_endpoint = if d.transfer_endpoint.is_empty() {
            d.name.clone()
        } else {
            d.transfer_endpoint
        };
        Ok(SegmentDesc {
            name: d.name,
            transfer_endpoint,
            size: d.size,
            host_id: d.host_id,
            shm_socket: d.shm_socket,
            requested_protocol: if d.requested_protocol.is_empty() {
                d.protocol.clone()
            } else {
                d.requested_protocol
            },
            protocol: d.protocol,
            protocol_reason: d.protocol_reason,
            enable_offload: d.enable_offload,
            disk_capacity: if d.enable_offload {
                d.disk_capacity_bytes
            } else {
                0
            },
            instance_id: d.instance_id,
            data_secret: None,
        })
    }
}

impl From<&SegmentDesc> for pb::SegmentDescriptor {
    fn from(d: &SegmentDesc) -> Self {
        pb::SegmentDescriptor {
            name: d.name.clone(),
            transfer_endpoint: d.transfer_endpoint.clone(),
            size: d.size,
            host_id: d.host_id.clone(),
            shm_socket: d.shm_socket.clone(),
            protocol: d.protocol.clone(),
            enable_offload: d.enable_offload,
            disk_capacity_bytes: d.disk_capacity,
            instance_id: d.instance_id.clone(),
            requested_protocol: d.requested_protocol.clone(),
            protocol_reason: d.protocol_reason.clone(),
        }
    }
}

/// `MountSegment.data_secret`: empty (no capabilities) or exactly 32 bytes.
pub(crate) fn data_secret(b: &[u8]) -> Result<Option<lunakv_transfer::MountSecret>, ServiceError> {
    if b.is_empty() {
        return Ok(None);
    }
    lunakv_transfer::MountSecret::from_slice(b).map(Some).ok_or_else(|| {
        ServiceError::Invalid(format!(
            "data_secret has {} bytes; it must be empty (no capabilities) or exactly 32 random bytes",
            b.len()
        ))
    })
}

impl From<pb::InventoryItem> for InventoryItem {
    fn from(i: pb::InventoryItem) -> Self {
        InventoryItem {
            key: i.key,
            offset: i.offset,
            size: i.size,
            generation: i.generation,
            disk: i.kind == pb::ReplicaKind::LocalDisk as i32,
            proof: lunakv_transfer::PlacementProof::from_slice(&i.proof),
        }
    }
}

impl From<Option<pb::ReplicateConfig>> for PutOptions {
    fn from(c: Option<pb::ReplicateConfig>) -> Self {
        let c = c.unwrap_or_default();
        PutOptions {
            // 0 (the proto default) means "one replica", as upstream's default config.
            replica_num: c.replica_num.max(1),
            preferred_segments: {
                let mut v: Vec<String> = Vec::new();
                for s in std::iter::once(c.preferred_segment).chain(c.preferred_segments) {
                    if !s.is_empty() && !v.contains(&s) {
                        v.push(s);
                    }
                }
                v
            },
            soft_pin: c.with_soft_pin,
            soft_pin_ttl: c.soft_pin_ttl_ms.map(std::time::Duration::from_millis),
            hard_pin: c.with_hard_pin,
            group: None,
        }
    }
}

/// Longest RemoveByRegex pattern taken.
const MAX_REGEX_LEN: usize = 4096;

/// Why a request's `tenant_id` or `regex` is refused; the message names the fix.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ParamError {
    #[error(transparent)]
    Tenant(#[from] lunakv_proto::KeyError),
    #[error("regex of {0} bytes: at most {MAX_REGEX_LEN}; match a shorter prefix")]
    RegexTooLong(usize),
    #[error("regex {pattern:?} is invalid: {source}; use Rust regex syntax (RE2-like)")]
    Regex {
        pattern: String,
        #[source]
        source: regex::Error,
    },
}

/// A caller's key pattern, compiled with bounded program and cache sizes (the regex crate
/// matches in linear time, so no pattern can stall the master); the refusal names the fix.
pub(crate) fn key_regex(pattern: &str) -> Result<regex::Regex, ParamError> {
    if pattern.len() > MAX_REGEX_LEN {
        return Err(ParamError::RegexTooLong(pattern.len()));
    }
    regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .dfa_size_limit(1 << 20)
        .build()
        .map_err(|source| ParamError::Regex {
            pattern: pattern.to_owned(),
            source,
        })
}

pub(crate) fn replica(r: &ReplicaView) -> pb::Replica {
    pb::Replica {
        segment: Some((&*r.segment).into()),
        offset: r.offset,
        size: r.size,
        kind: if r.disk {
            pb::ReplicaKind::LocalDisk as i32
        } else {
            pb::ReplicaKind::Memory as i32
        },
        capability: r
            .capability
            .map(|c| c.as_bytes().to_vec())
            .unwrap_or_default(),
    }
}

pub(crate) fn put_start(r: Result<Placed, OpError>) -> pb::PutStartResponse {
    match r {
        Ok((generation, replicas)) => pb::PutStartResponse {
            code: 0,
            message: String::new(),
            generation,
            replicas: replicas.iter().map(replica).collect(),
        },
        Err(e) => pb::PutStartResponse {
            code: e.code.as_i32(),
            message: e.message,
            ..Default::default()
        },
    }
}

pub(crate) fn location(r: Result<Location, OpError>) -> pb::ObjectLocation {
    match r {
        Ok(l) => pb::ObjectLocation {
            code: 0,
            message: String::new(),
            generation: l.generation,
            size: l.size,
            replicas: l.replicas.iter().map(replica).collect(),
            lease_ttl_ms: l.lease_ttl.as_millis() as u64,
        },
        Err(e) => pb::ObjectLocation {
            code: e.code.as_i32(),
            message: e.message,
            ..Default::default()
        },
    }
}

pub(crate) fn key_result(r: Result<(), OpError>) -> pb::KeyResult {
    match r {
        Ok(()) => pb::KeyResult::default(),
        Err(e) => pb::KeyResult {
            code: e.code.as_i32(),
            message: e.message,
        },
    }
}

/// A request's `tenant_id` (empty: the default tenant), checked with upstream's rules.
pub(crate) fn tenant_field(tenant: &str) -> Result<&str, ParamError> {
    if tenant.is_empty() {
        return Ok(lunakv_proto::DEFAULT_TENANT);
    }
    lunakv_proto::validate_tenant(tenant)?;
    Ok(tenant)
}

pub(crate) fn check_key(key: &str) -> Result<(), OpError> {
    lunakv_proto::validate_scoped_key(key)
        .map_err(|e| OpError::new(ErrorCode::InvalidKey, e.to_string()))
}

/// A validated put request item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutItem {
    pub key: String,
    pub size: u64,
    /// Its group (`None`: ungrouped; docs/GROUPS.md).
    pub group: Option<String>,
}

impl TryFrom<(String, u64, String)> for PutItem {
    type Error = OpError;

    fn try_from((key, size, group): (String, u64, String)) -> Result<Self, OpError> {
        check_key(&key)?;
        if size == 0 {
            return Err(OpError::new(
                ErrorCode::InvalidParams,
                format!("key {key:?}: size 0 cannot be stored; put at least one byte"),
            ));
        }
        let group = if group.is_empty() {
            None
        } else {
            // A group id follows the key rules (it is scoped by the key's tenant the same way).
            lunakv_proto::validate_key(&group).map_err(|e| {
                OpError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "key {key:?}: group_id {}",
                        e.to_string().replacen("key ", "", 1)
                    ),
                )
            })?;
            Some(group)
        };
        Ok(PutItem { key, size, group })
    }
}

/// The namespace report, as the wire shape.
pub(crate) fn namespace_report(
    r: &crate::namespaces::NamespaceReport,
) -> pb::NamespaceStatsResponse {
    pb::NamespaceStatsResponse {
        min_keys: r.min_keys,
        untracked: r.untracked,
        namespaces: r
            .namespaces
            .iter()
            .map(|n| pb::NamespaceStats {
                namespace: n.namespace.clone(),
                keys_put: n.keys_put,
                shared_keys: n.shared_keys,
                active_clients: n.active_clients,
                unshared: n.unshared,
                message: n.message.clone().unwrap_or_default(),
                clients: n
                    .clients
                    .iter()
                    .map(|c| pb::NamespaceClientStats {
                        client_id: c.client_id.clone(),
                        keys_put: c.keys_put,
                        put_already_held: c.put_already_held,
                        found_from_other: c.found_from_other,
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Tenants shown in a status answer at most (those with a quota first, then by DRAM held): the
/// answer stays far below gRPC's message limit however many tenant names peers make up.
const MAX_STATUS_TENANTS: usize = 1024;

pub(crate) fn tenant_statuses(core: &crate::core::MasterCore) -> Vec<pb::TenantStatus> {
    let quotas = core.tenant_quotas();
    let rejected = core.tenant_quota_rejected();
    let mut rows: Vec<pb::TenantStatus> = core
        .tenant_usage()
        .into_iter()
        .map(|(t, u)| pb::TenantStatus {
            quota_bytes: quotas.get(&t).copied().unwrap_or(0),
            quota_rejected: rejected.get(&t).copied().unwrap_or(0),
            tenant_id: t,
            objects: u.objects,
            dram_bytes: u.dram_bytes,
            disk_objects: u.disk_objects,
        })
        .collect();
    rows.sort_by_key(|r| (r.quota_bytes == 0, std::cmp::Reverse(r.dram_bytes)));
    rows.truncate(MAX_STATUS_TENANTS);
    rows.sort_by(|a, b| a.tenant_id.cmp(&b.tenant_id));
    rows
}
