//! # lunakv-client
//!
//! The engine-side store API: what vLLM's `MooncakeStoreConnector` (through the Python module)
//! and the `lunakv` CLI call to put and get KV-cache objects in the pool.
//!
//! - [`StoreClient`] talks to the master for placement and metadata and moves bytes with
//!   `lunakv-transfer`, never through gRPC. It is blocking by design: engines call it from worker
//!   threads (Python releases the GIL around it), so it owns a small tokio runtime for its RPCs.
//! - The two modes of the seed: **embedded** (`global_segment_size > 0`: the client hosts a
//!   segment of its own DRAM, served in-process) and **standalone-store** (`== 0`: a pure
//!   requester against a `lunakv-store`'s pool).
//! - Embedded mode hosts its segment with `lunakv-segment` (as `lunakv-store` does); every call
//!   to the master goes through `lunakv-master-client`, whose [`ClientError`] and [`Location`]
//!   this crate re-exports.
//! - HA: `master_server_address = "etcd://h1:2379;h2:2379"` finds the master leader in etcd and
//!   follows it (a watch on the leader key); calls retry across a failover, segments re-mount
//!   with their inventory on the new leader. Cached gets never need the master.
//!
//! Gets skip the master when the client already knows the object's generation and location
//! (see docs/ARCHITECTURE.md, "The generation, and why gets skip the master").
#![forbid(unsafe_code)]

mod cache;
mod options;
mod store;

pub use lunakv_master_client::{ClientError, Location, LocationError, MasterWait, ReplicaLocation};
pub use lunakv_proto::ErrorCode;
/// What the master reports, as domain types (the prost types stay behind the gRPC edge).
pub use lunakv_proto::views::{
    ClusterStatus, NamespaceReport, NamespaceStats, ReplicaDesc, ReplicaKind, Segment,
    SegmentStatus,
};
pub use options::{ClientOptions, Mode, ReplicateConfig, tenant_or_default};
pub use store::{GetRanges, PutRanges, StoreClient};

/// Result alias for the client API.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;
