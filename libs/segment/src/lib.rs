//! # lunakv-segment
//!
//! The segment owner's side of the master's wire: serve a segment of DRAM (and optionally a
//! disk tier), mount it with the master, keep the master informed, and re-mount it with its
//! inventory when the master restarted or a new HA leader took over, so the master rebuilds its
//! index without losing an object whose bytes survive.
//!
//! - [`SegmentHost`] (`host`): bind, mount, unmount and the shutdown drain to disk.
//!   `lunakv-store` is a `SegmentHost` plus flags; `lunakv-client` hosts one in embedded mode.
//! - `mount`: the MountSegment / MountInventory requests and [`MountStatus`].
//! - `heartbeat`: the Ping loop (touched keys, disk drops, re-mounts, drain moves), also run by
//!   a pure requester ([`requester_heartbeat`]).
//! - `inventory`: what an owner reports at mount ([`DiskInventory`], [`HostDisk`]).
//! - `drain`: the owner's side of drain jobs (copying objects the master moves elsewhere).
//!
//! The master is reached through `lunakv-master-client`.
#![forbid(unsafe_code)]

mod drain;
mod heartbeat;
mod host;
mod inventory;
mod mount;

pub use heartbeat::requester_heartbeat;
pub use host::{BoundSegment, HostOptions, SegmentHost};
pub use inventory::{DiskInventory, HostDisk};
pub use mount::MountStatus;
