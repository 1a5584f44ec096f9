//! `ReplicateConfig` and `ReplicaDescriptor`, the value classes of `mooncake.store`.

use lunakv_proto::views::ReplicaDesc;
use pyo3::prelude::*;

/// Where and how to place an object's replicas; vLLM builds one per put. Attribute names and
/// defaults are upstream's. lunakv acts on `replica_num`, `preferred_segment` and
/// `preferred_segments` (replicas go to `preferred_segment`, then to each listed segment in
/// order, each where it has room, then anywhere), `with_soft_pin`, `with_hard_pin` and
/// `group_ids` (one group id per key of the put, `""` for none: the objects of a group are
/// evicted and removed together and read all or none; docs/GROUPS.md),
/// `soft_pin_action` (upstream's replacement of `with_soft_pin`: `ENABLE` pins, `DISABLE`
/// does not, `PRESERVE` leaves `with_soft_pin` in charge) and `soft_pin_ttl_ms` (the pin's
/// lifetime, capped by the master's `max_kv_soft_pin_ttl`; 0 pins nothing). A new object has
/// no pin to preserve, and lunakv's upsert is a remove then a put, so `PRESERVE` on an upsert
/// does not carry the old object's pin over. `prefer_alloc_in_same_node`, `nof_replica_num`
/// and `dfs_replica_num` keep their defaults' meaning (no same-node preference, no NoF or DFS
/// replicas).
#[pyclass(module = "mooncake.store", get_all, set_all)]
#[derive(Debug, Clone)]
pub struct ReplicateConfig {
    pub soft_pin_action: SoftPinAction,
    pub soft_pin_ttl_ms: Option<u64>,
    pub replica_num: usize,
    pub preferred_segment: String,
    pub preferred_segments: Vec<String>,
    pub with_soft_pin: bool,
    pub with_hard_pin: bool,
    pub prefer_alloc_in_same_node: bool,
    pub nof_replica_num: usize,
    pub dfs_replica_num: usize,
    pub group_ids: Option<Vec<String>>,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig {
            soft_pin_action: SoftPinAction::PRESERVE,
            soft_pin_ttl_ms: None,
            replica_num: 1,
            preferred_segment: String::new(),
            preferred_segments: Vec::new(),
            with_soft_pin: false,
            with_hard_pin: false,
            prefer_alloc_in_same_node: false,
            nof_replica_num: 0,
            dfs_replica_num: 0,
            group_ids: None,
        }
    }
}

#[pymethods]
impl ReplicateConfig {
    #[new]
    fn py_new() -> Self {
        Self::default()
    }

    fn __repr__(&self) -> String {
        format!(
            "ReplicateConfig(replica_num={}, preferred_segment={:?}, preferred_segments={:?}, with_soft_pin={}, with_hard_pin={})",
            self.replica_num,
            self.preferred_segment,
            self.preferred_segments,
            if self.with_soft_pin { "True" } else { "False" },
            if self.with_hard_pin { "True" } else { "False" },
        )
    }

    fn __str__(&self) -> String {
        self.__repr__()
    }
}

impl ReplicateConfig {
    /// The client's config. `replica_num` 0 means 1, as upstream's allocator treats it.
    pub fn to_client(&self) -> lunakv_client::ReplicateConfig {
        lunakv_client::ReplicateConfig {
            replica_num: u32::try_from(self.replica_num.max(1)).unwrap_or(u32::MAX),
            preferred_segment: Some(self.preferred_segment.clone()).filter(|s| !s.is_empty()),
            preferred_segments: self.preferred_segments.clone(),
            with_soft_pin: match self.soft_pin_action {
                SoftPinAction::ENABLE => true,
                SoftPinAction::DISABLE => false,
                SoftPinAction::PRESERVE => self.with_soft_pin,
            },
            soft_pin_ttl_ms: self.soft_pin_ttl_ms,
            with_hard_pin: self.with_hard_pin,
            group_ids: self.group_ids.clone(),
        }
    }
}

/// Upstream's `SoftPinAction`, the pin request of `ReplicateConfig.soft_pin_action`.
#[pyclass(module = "mooncake.store", eq, eq_int, from_py_object)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum SoftPinAction {
    PRESERVE,
    ENABLE,
    DISABLE,
}

/// One replica of an object, as `batch_get_replica_desc` returns it. vLLM probes
/// `is_memory_replica()` / `is_disk_replica()` / `is_local_disk_replica()` to learn the tier.
#[pyclass(module = "mooncake.store", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct ReplicaDescriptor {
    /// "MEMORY", "DISK" or "LOCAL_DISK".
    pub kind: String,
    /// Upstream's ReplicaStatus name; the master only reports complete replicas.
    pub status: String,
    /// The segment ("host:port") that holds the replica.
    pub segment_name: String,
    /// Where that segment's owner serves transfers.
    pub transport_endpoint: String,
    pub offset: u64,
    pub size: u64,
}

#[pymethods]
impl ReplicaDescriptor {
    fn is_memory_replica(&self) -> bool {
        self.kind == "MEMORY"
    }

    fn is_disk_replica(&self) -> bool {
        self.kind == "DISK"
    }

    fn is_local_disk_replica(&self) -> bool {
        self.kind == "LOCAL_DISK"
    }

    /// NVMe-oF replicas do not exist in lunakv.
    fn is_nof_replica(&self) -> bool {
        false
    }

    /// Upstream's accessor of a memory replica's buffer; `RuntimeError` on another kind, as
    /// upstream's ("Expected MemoryDescriptor"). `buffer_address` is the replica's offset in its
    /// segment: lunakv addresses segments by offset, not by the owner's virtual addresses.
    fn get_memory_descriptor(&self) -> PyResult<MemoryDescriptor> {
        if !self.is_memory_replica() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "Expected MemoryDescriptor: this replica is {}",
                self.kind
            )));
        }
        Ok(MemoryDescriptor {
            buffer_descriptor: BufferDescriptor {
                size: self.size,
                buffer_address: self.offset,
                transport_endpoint: self.transport_endpoint.clone(),
            },
        })
    }

    /// Upstream's accessor of a disk replica; `RuntimeError` on a memory one. lunakv's SSD tier
    /// keeps objects in bucket files of its owner, not one file each: `file_path` is empty.
    fn get_disk_descriptor(&self) -> PyResult<DiskDescriptor> {
        if self.is_memory_replica() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "Expected DiskDescriptor: this replica is MEMORY",
            ));
        }
        Ok(DiskDescriptor {
            file_path: String::new(),
            object_size: self.size,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "ReplicaDescriptor(kind={}, status={}, segment_name={:?}, offset={}, size={})",
            self.kind, self.status, self.segment_name, self.offset, self.size
        )
    }
}

/// Upstream's `MemoryDescriptor`: the buffer of a memory replica.
#[pyclass(module = "mooncake.store", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct MemoryDescriptor {
    pub buffer_descriptor: BufferDescriptor,
}

/// Upstream's allocated-buffer `Descriptor` (`size`, `buffer_address`, `transport_endpoint`).
#[pyclass(module = "mooncake.store", name = "Descriptor", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct BufferDescriptor {
    pub size: u64,
    pub buffer_address: u64,
    pub transport_endpoint: String,
}

#[pymethods]
impl BufferDescriptor {
    fn __repr__(&self) -> String {
        format!(
            "<Descriptor size={} buffer_address={} transport_endpoint={}>",
            self.size, self.buffer_address, self.transport_endpoint
        )
    }
}

/// Upstream's `DiskDescriptor`.
#[pyclass(module = "mooncake.store", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct DiskDescriptor {
    pub file_path: String,
    pub object_size: u64,
}

impl From<&ReplicaDesc> for ReplicaDescriptor {
    fn from(r: &ReplicaDesc) -> Self {
        let kind = r.kind.map_or("UNKNOWN", |k| k.as_str());
        let (segment_name, transport_endpoint) = r
            .segment
            .as_ref()
            .map(|s| (s.name.clone(), s.transfer_endpoint.clone()))
            .unwrap_or_default();
        ReplicaDescriptor {
            kind: kind.to_owned(),
            status: "COMPLETE".to_owned(),
            segment_name,
            transport_endpoint,
            offset: r.offset,
            size: r.size,
        }
    }
}
