//! The master's state and rules, free of gRPC: segment registry, object index, leases, pins,
//! eviction, zombie puts and client liveness. The gRPC and HTTP edges call into [`MasterCore`].
//!
//! Locks: the object index is split into [`SHARDS`] shards, each a `parking_lot::Mutex`; segments
//! and clients have one mutex each. Order: the drain jobs, a shard, then segments, then clients; no lock is held
//! across an `.await`. A removed object leaves the index at once, but its ranges go back to the
//! allocator only after the owner acknowledged the FREE ([`MasterCore::release`]).

mod cslru;
mod drain;
mod feed;
mod groups;
mod index;
mod intern;
mod jobs;
mod policy;
mod puts;
mod quota;
mod ramp;
mod reads;
mod reclaim;
mod removal;
mod reservations;
mod segments;
mod state;
mod sweeps;
mod tiering;
mod types;
mod views;
mod warm;

pub use feed::{IndexChange, IndexEntry, IndexSnapshot, WarmReplicaLoc};
pub use index::TenantUsage;
pub use jobs::{
    DRAIN_PING_MS, DrainError, DrainReport, DrainRequest, JobStatus,
    MAX_CONCURRENCY as DRAIN_MAX_CONCURRENCY, MoveResult, MoveTask, is_job_id,
};
pub use policy::EvictionPolicy;
pub use puts::{ChainEnd, chain_stamp};
pub use reads::Touch;
pub use state::{MasterCore, SHARDS};
pub use types::{
    Caller, CoreConfig, CoreError, Holder, InventoryItem, Location, MountOutcome, ObjectInfo,
    ObjectState, OpError, PendingFree, PendingOffload, PendingPromotion, PutOptions, ReplicaInfo,
    ReplicaView, SegmentDesc, SegmentInfo, SegmentStatus, TenantQuotas,
};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_admission;
#[cfg(test)]
mod tests_cslru;
#[cfg(test)]
mod tests_drain;
#[cfg(test)]
mod tests_groups;
#[cfg(test)]
mod tests_proofs;
#[cfg(test)]
mod tests_tenants;
