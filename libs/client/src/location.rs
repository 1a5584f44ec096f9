//! Validated domain types for where an object lives, converted from the prost types at the edge.

use lunakv_proto::master as pb;
use lunakv_transfer::Target;

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

impl ReplicaLocation {
    fn from_pb(r: &pb::Replica, object_size: u64) -> Result<ReplicaLocation, String> {
        let seg = r
            .segment
            .as_ref()
            .ok_or_else(|| "replica without a segment descriptor".to_owned())?;
        if seg.transfer_endpoint.is_empty() {
            return Err(format!("segment '{}' has no transfer endpoint", seg.name));
        }
        if r.size != object_size {
            return Err(format!(
                "replica on '{}' holds {} bytes, object has {}",
                seg.name, r.size, object_size
            ));
        }
        let disk = r.kind == pb::ReplicaKind::LocalDisk as i32;
        let end = r.offset.checked_add(r.size);
        if !disk && end.is_none_or(|e| e > seg.size) {
            return Err(format!(
                "replica range {}+{} lies outside segment '{}' of {} bytes",
                r.offset, r.size, seg.name, seg.size
            ));
        }
        Ok(ReplicaLocation {
            segment_name: seg.name.clone(),
            target: Target {
                endpoint: seg.transfer_endpoint.clone(),
                host_id: seg.host_id.clone(),
                shm_socket: (!seg.shm_socket.is_empty()).then(|| seg.shm_socket.clone()),
                size: seg.size,
                instance_id: (!seg.instance_id.is_empty()).then(|| seg.instance_id.clone()),
            },
            offset: r.offset,
            disk,
        })
    }
}

impl Location {
    /// Converts a put placement (memory replicas only).
    pub(crate) fn from_put(resp: &pb::PutStartResponse, size: u64) -> Result<Location, String> {
        Self::build(resp.generation, size, &resp.replicas)
    }

    pub(crate) fn build(
        generation: u64,
        size: u64,
        replicas: &[pb::Replica],
    ) -> Result<Location, String> {
        // Memory replicas first (one transfer away), then disk ones (the owner reads its disk).
        let mem = pb::ReplicaKind::Memory as i32;
        let disk = pb::ReplicaKind::LocalDisk as i32;
        let replicas = replicas
            .iter()
            .filter(|r| r.kind == mem)
            .chain(replicas.iter().filter(|r| r.kind == disk))
            .map(|r| ReplicaLocation::from_pb(r, size))
            .collect::<Result<Vec<_>, _>>()?;
        if replicas.is_empty() {
            return Err("no memory or local disk replica".to_owned());
        }
        Ok(Location {
            generation,
            size,
            replicas,
        })
    }
}

impl TryFrom<&pb::ObjectLocation> for Location {
    type Error = String;

    fn try_from(l: &pb::ObjectLocation) -> Result<Location, String> {
        Location::build(l.generation, l.size, &l.replicas)
    }
}
