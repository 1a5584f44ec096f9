//! How lunakv's services turn their errors into gRPC statuses: each error type says which code
//! it is, and [`to_status`] builds the one status from it. The master's gRPC edge and the
//! bootstrap's both use it, so a code means the same thing from either service. The master's
//! two refusals that carry metadata, [`rebuilding`] and [`redirect`], are built here too.

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::headers::LeaderRedirect;

/// An error a gRPC edge answers with: its display is the status message.
pub trait GrpcError: std::fmt::Display {
    /// The gRPC code a client acts on (retry, fix the request, give up).
    fn code(&self) -> Code;
}

/// The status for `e`: its code and its message.
pub fn to_status<E: GrpcError + ?Sized>(e: &E) -> Status {
    Status::new(e.code(), e.to_string())
}

/// A master rebuilding its object index: `UNAVAILABLE` with `message` and the
/// [`REBUILDING`](crate::headers::REBUILDING) header, which clients retry at the same master.
pub fn rebuilding(message: String) -> Status {
    let mut s = Status::unavailable(message);
    s.metadata_mut()
        .insert(crate::headers::REBUILDING, MetadataValue::from_static("1"));
    s
}

/// A follower's refusal: `UNAVAILABLE` with `message`, naming the leader when one is known so
/// that clients switch to it.
pub fn redirect(message: String, leader: Option<&LeaderRedirect>) -> Status {
    let mut s = Status::unavailable(message);
    if let Some(l) = leader {
        l.insert_into(s.metadata_mut());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebuilding_is_unavailable_with_the_header_clients_retry_on() {
        let s = rebuilding("master 10.0.0.1:50051 just started and is rebuilding".into());
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(
            s.message(),
            "master 10.0.0.1:50051 just started and is rebuilding"
        );
        assert_eq!(
            s.metadata()
                .get(crate::headers::REBUILDING)
                .and_then(|v| v.to_str().ok()),
            Some("1")
        );
        assert!(LeaderRedirect::from_metadata(s.metadata()).is_none());
    }
}
