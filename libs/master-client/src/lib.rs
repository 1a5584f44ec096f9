//! # lunakv-master-client
//!
//! The caller's side of the master's wire: everything in this project that dials a
//! lunakv-master goes through this crate, so TLS, the pool token and trace context are applied
//! the same way by the store (`lunakv-store`), the engines (`lunakv-client`, the Python module),
//! the master's standby and the `lunakv` CLI.
//!
//! - [`MasterLink`]: "the master", a `host:port` or, for HA (`etcd://h1:2379;h2:2379`), whichever
//!   master holds the leader key; follows leader changes and retries calls across a failover.
//! - [`startup`]: reaching the master when it may not be up yet ([`MasterWait`]).
//! - [`quick`]: the hottest calls over a plain TCP connection on the calling thread.
//! - The channel itself ([`master_tls`], [`connect_endpoint`], [`bearer`]), and the look at a
//!   port that names a peer which is not a lunakv-master.
//! - [`probe`]: what `lunakv doctor` asks of a master's port.
//! - [`ClientError`] and the validated [`Location`] of an object, as the master answers them.
#![forbid(unsafe_code)]

mod connect;
mod error;
mod link;
mod location;
mod preface;
pub mod probe;
pub mod quick;
pub mod startup;

pub use connect::{MasterInject, Rpc, bearer, connect_endpoint, master_tls, rpc_error};
pub use error::ClientError;
pub use link::MasterLink;
pub use location::{Location, LocationError, ReplicaLocation, segment_table};
pub use probe::{MasterTls, probe_master_tls};
pub use startup::MasterWait;
