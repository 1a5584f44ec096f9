//! # lunakv-proto
//!
//! The wire contract between lunakv's services: the generated gRPC code for `proto/*.proto`, the
//! Mooncake-compatible [`ErrorCode`]s carried in per-item results, and the key rules every side
//! enforces. Used by the master (server), and by the client library, the store-client and the
//! CLI (clients). Kept slim on purpose: no business logic lives here.
#![forbid(unsafe_code)]

mod codes;
pub mod foreign;
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
/// The encoded descriptors of every lunakv proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("lunakv_descriptor");

/// gRPC server reflection (`grpc.reflection.v1` and the `v1alpha` that grpcurl and grpcio's
/// reflection client still ask for) over lunakv's protos and `grpc.health.v1`.
pub fn reflection() -> (
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
) {
    let build = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    (
        build()
            .build_v1()
            .expect("lunakv's descriptor set is built from its protos"),
        build()
            .build_v1alpha()
            .expect("lunakv's descriptor set is built from its protos"),
    )
}

/// Re-exported so that users of the generated clients need not depend on tonic directly.
pub use tonic;

/// gRPC metadata of the master's `UNAVAILABLE` answers that tell a client what to do.
pub mod headers {
    /// A master that has just started (or was just elected) and is rebuilding its object index
    /// from the owners' inventories: retry shortly at the same master, HA or not.
    pub const REBUILDING: &str = "x-lunakv-rebuilding";
}
