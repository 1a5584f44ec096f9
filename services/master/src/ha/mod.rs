//! High availability (`--enable_ha`, docs/HA.md), and the rebuild window any master passes
//! after it starts from an empty index.
//!
//! - [`election`]: leader election on etcd, the lease-based write fence, redirects.
//! - [`metrics`]: the HA metrics, which outlive each term's core.
//! - [`recovery`]: the window after a takeover or restart while the owners remount.
//! - [`standby`]: the warm standby's wire side (`ReplicateIndex`).

pub mod election;
pub mod metrics;
pub mod recovery;
pub mod standby;
