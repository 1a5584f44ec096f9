//! # lunakv-proto
//!
//! The wire contract between lunakv's services: the generated gRPC code for `proto/*.proto`, the
//! Mooncake-compatible [`ErrorCode`]s carried in per-item results, and the key rules every side
//! enforces. Used by the master (server), and by the client library, the store-client and the
//! CLI (clients). Kept slim on purpose: no business logic lives here.

mod codes;
mod keys;

pub use codes::ErrorCode;
pub use keys::{KeyError, MAX_KEY_LEN, validate_key};

/// Generated code for `proto/lunakv/master.proto`.
pub mod master {
    #![allow(clippy::all, rust_2018_idioms)]
    tonic::include_proto!("lunakv.master.v1");
}

/// Generated code for `proto/lunakv/bootstrap.proto` (the P/D bootstrap service).
pub mod bootstrap {
    #![allow(clippy::all, rust_2018_idioms)]
    tonic::include_proto!("lunakv.bootstrap.v1");
}

/// Re-exported for message sizes (`Message::encoded_len`) without a direct prost dependency.
pub use prost;
/// Re-exported so that users of the generated clients need not depend on tonic directly.
pub use tonic;

/// gRPC metadata of the master's `UNAVAILABLE` answers that tell a client what to do.
pub mod headers {
    /// A master that has just started (or was just elected) and is rebuilding its object index
    /// from the owners' inventories: retry shortly at the same master, HA or not.
    pub const REBUILDING: &str = "x-lunakv-rebuilding";
}
