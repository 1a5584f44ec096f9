//! The prost <-> domain conversions of the master's RPCs, in one place for both transports
//! (gRPC in [`super::service`], quick calls in `rpc/quick.rs`): requests become validated
//! domain types (`TryFrom`), the core's results become the wire's messages, and whole-call
//! failures become a `tonic::Status` in [`to_status`] only.

use std::collections::HashMap;
use std::sync::Arc;

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

/// The segment table of one answer: each segment its replicas name, once, in the order first
/// named; a replica carries its segment's index. A batch of 32 keys on one segment sends one
/// descriptor (eleven strings), not 32.
///
/// A segment is known by the identity of its `Arc`, which `named` holds so the address cannot
/// be reused meanwhile; a segment mounted again is a new `Arc`, a new entry.
#[derive(Default)]
pub(crate) struct SegmentTable {
    named: Vec<Arc<SegmentDesc>>,
    /// Filled once the table outgrows [`SegmentTable::SCAN`]: a batch spread over a large pool.
    index: HashMap<*const SegmentDesc, u32>,
}

impl SegmentTable {
    /// A scan of this many beats hashing (an answer usually names one to a few segments).
    const SCAN: usize = 16;

    fn index_of(&mut self, seg: &Arc<SegmentDesc>) -> u32 {
        let at = if self.named.len() <= Self::SCAN {
            self.named.iter().position(|d| Arc::ptr_eq(d, seg))
        } else {
            if self.index.is_empty() {
                self.index = (0..)
                    .zip(&self.named)
                    .map(|(i, d)| (Arc::as_ptr(d), i))
                    .collect();
            }
            self.index.get(&Arc::as_ptr(seg)).map(|&i| i as usize)
        };
        match at {
            Some(i) => i as u32,
            None => {
                let i = self.named.len() as u32;
                self.named.push(seg.clone());
                if !self.index.is_empty() {
                    self.index.insert(Arc::as_ptr(seg), i);
                }
                i
            }
        }
    }

    pub(crate) fn replica(&mut self, r: &ReplicaView) -> pb::Replica {
        pb::Replica {
            segment: self.index_of(&r.segment),
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

    /// The table's descriptors, in index order.
    pub(crate) fn descriptors(&self) -> Vec<pb::SegmentDescriptor> {
        self.named.iter().map(|d| (&**d).into()).collect()
    }

    /// One put start's answer, its replicas indexing this table.
    pub(crate) fn put_start(&mut self, r: Result<Placed, OpError>) -> pb::PutStartResponse {
        match r {
            Ok((generation, replicas)) => pb::PutStartResponse {
                generation,
                replicas: replicas.iter().map(|r| self.replica(r)).collect(),
                ..Default::default()
            },
            Err(e) => pb::PutStartResponse {
                code: e.code.as_i32(),
                message: e.message,
                ..Default::default()
            },
        }
    }

    /// One lookup's answer, its replicas indexing this table.
    pub(crate) fn location(&mut self, r: Result<Location, OpError>) -> pb::ObjectLocation {
        match r {
            Ok(l) => pb::ObjectLocation {
                generation: l.generation,
                size: l.size,
                replicas: l.replicas.iter().map(|r| self.replica(r)).collect(),
                lease_ttl_ms: l.lease_ttl.as_millis() as u64,
                ..Default::default()
            },
            Err(e) => pb::ObjectLocation {
                code: e.code.as_i32(),
                message: e.message,
                ..Default::default()
            },
        }
    }
}

/// A single put start's answer, with its own segment table.
pub(crate) fn put_start(r: Result<Placed, OpError>) -> pb::PutStartResponse {
    let mut table = SegmentTable::default();
    let mut answer = table.put_start(r);
    answer.segments = table.descriptors();
    answer
}

/// A single lookup's answer, with its own segment table.
pub(crate) fn location(r: Result<Location, OpError>) -> pb::ObjectLocation {
    let mut table = SegmentTable::default();
    let mut answer = table.location(r);
    answer.segments = table.descriptors();
    answer
}

/// A batch of put starts' answers, one table for all.
pub(crate) fn put_starts(results: Vec<Result<Placed, OpError>>) -> pb::BatchPutStartResponse {
    let mut table = SegmentTable::default();
    let results = results.into_iter().map(|r| table.put_start(r)).collect();
    pb::BatchPutStartResponse {
        results,
        segments: table.descriptors(),
    }
}

/// A batch of lookups' answers, one table for all.
pub(crate) fn locations(results: Vec<Result<Location, OpError>>) -> pb::BatchObjectLocations {
    let mut table = SegmentTable::default();
    let results = results.into_iter().map(|r| table.location(r)).collect();
    pb::BatchObjectLocations {
        results,
        segments: table.descriptors(),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn desc(name: &str) -> Arc<SegmentDesc> {
        Arc::new(SegmentDesc {
            name: name.into(),
            transfer_endpoint: format!("{name}:17000"),
            size: 1 << 30,
            host_id: "boot-1".into(),
            shm_socket: String::new(),
            protocol: "tcp".into(),
            enable_offload: false,
            disk_capacity: 0,
            instance_id: String::new(),
            requested_protocol: String::new(),
            protocol_reason: String::new(),
            data_secret: None,
        })
    }

    fn at(seg: &Arc<SegmentDesc>, offset: u64) -> ReplicaView {
        ReplicaView {
            segment: seg.clone(),
            offset,
            size: 64,
            disk: false,
            capability: None,
        }
    }

    fn found(replicas: Vec<ReplicaView>) -> Result<Location, OpError> {
        Ok(Location {
            generation: 1,
            size: 64,
            replicas,
            lease_ttl: Duration::from_secs(5),
        })
    }

    /// Every replica's index names its own segment, whether the table is scanned (few
    /// segments) or hashed (more than `SCAN`), and each segment is in the table once.
    #[test]
    fn each_segment_is_named_once_and_every_index_finds_it() {
        for n in [
            1,
            3,
            SegmentTable::SCAN,
            SegmentTable::SCAN + 1,
            3 * SegmentTable::SCAN,
        ] {
            let segs: Vec<_> = (0..n).map(|i| desc(&format!("s{i}"))).collect();
            // Two passes over the segments, the second in reverse, two replicas per object.
            let results: Vec<_> = (0..2 * n)
                .map(|i| {
                    let a = if i < n { i } else { 2 * n - 1 - i };
                    found(vec![at(&segs[a], i as u64), at(&segs[(a + 1) % n], 0)])
                })
                .collect();
            let answer = locations(results.clone());
            assert_eq!(answer.segments.len(), n, "{n} segments, each once");
            for (r, l) in results.iter().zip(&answer.results) {
                let want = &r.as_ref().expect("found").replicas;
                assert_eq!(l.replicas.len(), want.len());
                for (w, got) in want.iter().zip(&l.replicas) {
                    assert_eq!(answer.segments[got.segment as usize].name, w.segment.name);
                    assert_eq!(got.offset, w.offset);
                }
            }
        }
    }

    /// A segment mounted again is a new descriptor (its endpoint may have moved): an answer
    /// naming both the old and the new carries both.
    #[test]
    fn a_remounted_segment_is_a_new_entry() {
        let old = desc("a");
        let mut again = (*old).clone();
        again.transfer_endpoint = "a:17001".into();
        let again = Arc::new(again);
        let answer = locations(vec![found(vec![at(&old, 0)]), found(vec![at(&again, 0)])]);
        assert_eq!(answer.segments.len(), 2);
        let endpoint = |i: usize| {
            let s = answer.results[i].replicas[0].segment as usize;
            answer.segments[s].transfer_endpoint.clone()
        };
        assert_eq!(endpoint(0), "a:17000");
        assert_eq!(endpoint(1), "a:17001");
    }

    /// A failed item carries its code and message and names no segment.
    #[test]
    fn failures_name_no_segment() {
        let answer = put_starts(vec![
            Err(OpError::new(ErrorCode::NoAvailableHandle, "no room")),
            Ok((7, vec![at(&desc("b"), 64)])),
        ]);
        assert_eq!(
            answer.results[0].code,
            ErrorCode::NoAvailableHandle.as_i32()
        );
        assert!(answer.results[0].replicas.is_empty());
        assert_eq!(answer.results[1].generation, 7);
        assert_eq!(answer.segments.len(), 1);
    }
}
