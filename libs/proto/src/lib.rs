//! # lunakv-proto
//!
//! The wire contract between lunakv's services: the generated gRPC code for `proto/*.proto`, the
//! Mooncake-compatible [`ErrorCode`]s carried in per-item results, and the key rules every side
//! enforces. Used by the master (server), and by the client library, the store-client and the
//! CLI (clients). Also the contracts both sides must spell alike: the gRPC metadata names
//! ([`headers`]), the error-to-status mapping ([`status`]), and the domain types of the
//! master's reports ([`views`]) so that prost types stay behind the gRPC edges. Kept slim on
//! purpose: no business logic lives here.
#![forbid(unsafe_code)]

mod codes;
pub mod foreign;
mod keys;
pub mod quick;
pub mod status;
pub mod views;

pub use codes::ErrorCode;
pub use keys::{
    DEFAULT_TENANT, KeyError, MAX_KEY_LEN, MAX_TENANT_LEN, scope_key, split_scoped, validate_key,
    validate_scoped_key, validate_tenant,
};

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
    /// A follower's redirect: the leader's `host:port`.
    pub const LEADER: &str = "x-lunakv-leader";
    /// A follower's redirect: the leader's term, so that a client ignores a stale redirect.
    pub const LEADER_TERM: &str = "x-lunakv-leader-term";

    use tonic::metadata::{MetadataMap, MetadataValue};

    /// The leader a follower names in its `UNAVAILABLE` answer ([`LEADER`] and [`LEADER_TERM`]):
    /// the master writes it, the client follows it, and both read the names from here.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct LeaderRedirect {
        /// The leader's `host:port`.
        pub address: String,
        /// The leader's term; 0 when the redirect carried none (or an unreadable one).
        pub term: u64,
    }

    impl LeaderRedirect {
        /// Writes both headers, or neither when the address is not valid metadata: a redirect
        /// without its leader is still a plain `UNAVAILABLE` that clients retry.
        pub fn insert_into(&self, md: &mut MetadataMap) {
            if let (Ok(a), Ok(t)) = (
                MetadataValue::try_from(self.address.as_str()),
                MetadataValue::try_from(self.term.to_string().as_str()),
            ) {
                md.insert(LEADER, a);
                md.insert(LEADER_TERM, t);
            }
        }

        /// The redirect in `md`, if it names a leader.
        pub fn from_metadata(md: &MetadataMap) -> Option<Self> {
            let address = md.get(LEADER)?.to_str().ok()?.to_owned();
            let term = md
                .get(LEADER_TERM)
                .and_then(|v| v.to_str().ok())
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            Some(Self { address, term })
        }
    }
}
