//! The RPC port (`proto/lunakv/master.proto`, default :50051): both transports of the master's
//! calls and what they share.
//!
//! - [`service`]: the tonic service, and the gate every call passes (HA lease, rebuild).
//! - [`convert`]: prost <-> domain conversions and the error -> `Status` mapping.
//! - `quick`: quick calls, the same calls in a smaller frame on the same port.
//! - `lanes`: the threads that serve plaintext quick connections.
//! - `incoming`: sorts the port's connections (TLS, gRPC, quick calls, foreign clients).

pub mod convert;
pub(crate) mod incoming;
pub(crate) mod lanes;
pub(crate) mod quick;
pub mod service;
