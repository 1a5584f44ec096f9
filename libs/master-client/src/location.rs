//! Validated domain types for where an object lives, converted from the prost types at the edge.

use lunakv_proto::master as pb;
use lunakv_transfer::Target;

/// A placement or location from the master that cannot be used: it names no segment, or a
/// range that does not fit. The caller reports it as a master failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocationError {
    #[error("replica names segment {index} of an answer that lists {table}")]
    NoSegment { index: u32, table: usize },
    #[error("segment '{0}' has no transfer endpoint")]
    NoEndpoint(String),
    #[error("replica on '{segment}' holds {replica} bytes, object has {object}")]
    SizeMismatch {
        segment: String,
        replica: u64,
        object: u64,
    },
    #[error(
        "replica range {offset}+{size} lies outside segment '{segment}' of {segment_size} bytes"
    )]
    OutsideSegment {
        offset: u64,
        size: u64,
        segment: String,
        segment_size: u64,
    },
    #[error("no memory or local disk replica")]
    NoReplica,
    #[error(
        "replica on '{segment}' carries a capability of {len} bytes, expected {}; the master and this client versions differ",
        lunakv_transfer::cap::CAP_LEN
    )]
    BadCapability { segment: String, len: usize },
}

/// One complete replica: the owner to ask and the range it holds.
#[derive(Debug, Clone)]
pub struct ReplicaLocation {
    pub segment_name: String,
    pub target: Target,
    pub offset: u64,
    /// A LOCAL_DISK replica: the owner reads it from its disk tier (LOAD), `offset` is unused.
    pub disk: bool,
}

/// Where an object's bytes are, and under which generation the owners know them.
#[derive(Debug, Clone)]
pub struct Location {
    pub generation: u64,
    pub size: u64,
    pub replicas: Vec<ReplicaLocation>,
}

/// A replica of an object of the given size, its segment looked up in the answer's table.
impl TryFrom<(&pb::Replica, u64, &[pb::SegmentDescriptor])> for ReplicaLocation {
    type Error = LocationError;

    fn try_from(
        (r, object_size, segments): (&pb::Replica, u64, &[pb::SegmentDescriptor]),
    ) -> Result<ReplicaLocation, LocationError> {
        let seg = segments
            .get(r.segment as usize)
            .ok_or(LocationError::NoSegment {
                index: r.segment,
                table: segments.len(),
            })?;
        if seg.transfer_endpoint.is_empty() {
            return Err(LocationError::NoEndpoint(seg.name.clone()));
        }
        if r.size != object_size {
            return Err(LocationError::SizeMismatch {
                segment: seg.name.clone(),
                replica: r.size,
                object: object_size,
            });
        }
        let capability = if r.capability.is_empty() {
            None
        } else {
            Some(
                lunakv_transfer::Capability::from_slice(&r.capability).ok_or_else(|| {
                    LocationError::BadCapability {
                        segment: seg.name.clone(),
                        len: r.capability.len(),
                    }
                })?,
            )
        };
        let disk = r.kind == pb::ReplicaKind::LocalDisk as i32;
        let end = r.offset.checked_add(r.size);
        if !disk && end.is_none_or(|e| e > seg.size) {
            return Err(LocationError::OutsideSegment {
                offset: r.offset,
                size: r.size,
                segment: seg.name.clone(),
                segment_size: seg.size,
            });
        }
        Ok(ReplicaLocation {
            segment_name: seg.name.clone(),
            target: Target {
                endpoint: seg.transfer_endpoint.clone(),
                host_id: seg.host_id.clone(),
                shm_socket: (!seg.shm_socket.is_empty()).then(|| seg.shm_socket.clone()),
                size: seg.size,
                instance_id: (!seg.instance_id.is_empty()).then(|| seg.instance_id.clone()),
                capability,
            },
            offset: r.offset,
            disk,
        })
    }
}

/// The segment table a result's replicas index: its own when it came alone, else the batch's
/// (a result inside a batch answer leaves its own empty).
pub fn segment_table<'a>(
    own: &'a [pb::SegmentDescriptor],
    batch: &'a [pb::SegmentDescriptor],
) -> &'a [pb::SegmentDescriptor] {
    if own.is_empty() { batch } else { own }
}

/// A put placement (memory replicas only) for an object of the given size; `batch` is the
/// table of the answer around it (empty for a single PutStart).
impl TryFrom<(&pb::PutStartResponse, u64, &[pb::SegmentDescriptor])> for Location {
    type Error = LocationError;

    fn try_from(
        (resp, size, batch): (&pb::PutStartResponse, u64, &[pb::SegmentDescriptor]),
    ) -> Result<Location, LocationError> {
        let segments = segment_table(&resp.segments, batch);
        Self::build(resp.generation, size, &resp.replicas, segments)
    }
}

impl Location {
    /// Some replica's capability is expired or about to: the location must come from the
    /// master again (a cache miss), since the owner would refuse it.
    pub fn capabilities_expire_soon(&self) -> bool {
        self.replicas.iter().any(|r| {
            r.target
                .capability
                .as_ref()
                .is_some_and(|c| c.expires_soon())
        })
    }

    pub(crate) fn build(
        generation: u64,
        size: u64,
        replicas: &[pb::Replica],
        segments: &[pb::SegmentDescriptor],
    ) -> Result<Location, LocationError> {
        // Memory replicas first (one transfer away), then disk ones (the owner reads its disk).
        let mem = pb::ReplicaKind::Memory as i32;
        let disk = pb::ReplicaKind::LocalDisk as i32;
        let replicas = replicas
            .iter()
            .filter(|r| r.kind == mem)
            .chain(replicas.iter().filter(|r| r.kind == disk))
            .map(|r| ReplicaLocation::try_from((r, size, segments)))
            .collect::<Result<Vec<_>, _>>()?;
        if replicas.is_empty() {
            return Err(LocationError::NoReplica);
        }
        Ok(Location {
            generation,
            size,
            replicas,
        })
    }
}

/// An object's location; `batch` is the table of the answer around it (empty for a single
/// lookup).
impl TryFrom<(&pb::ObjectLocation, &[pb::SegmentDescriptor])> for Location {
    type Error = LocationError;

    fn try_from(
        (l, batch): (&pb::ObjectLocation, &[pb::SegmentDescriptor]),
    ) -> Result<Location, LocationError> {
        let segments = segment_table(&l.segments, batch);
        Location::build(l.generation, l.size, &l.replicas, segments)
    }
}
