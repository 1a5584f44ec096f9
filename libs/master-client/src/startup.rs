//! Reaching the master at startup, when it may not be up yet.
//!
//! A store-client (or an engine) started before its master is a startup-order problem, not a
//! configuration error: it waits ([`crate::MasterWait`], logged by
//! [`lunakv_telemetry::wait::PeerWait`]) instead of exiting, so a DaemonSet does not crash-loop.
//! What waiting cannot fix fails at once:
//!
//! - a malformed address (`ClientError::Config`: bad `host:port`, bad etcd endpoint list);
//! - with `etcd://`, no leader for this cluster_id while etcd holds leaders of other clusters
//!   (after the 10 s the link itself waits for one): a cluster_id mismatch;
//! - a mount the master refuses ([`retryable`] is false): cluster_id or enable_offload mismatch
//!   (FAILED_PRECONDITION), an invalid segment (INVALID_ARGUMENT), another owner's segment
//!   (PERMISSION_DENIED), a request too large (RESOURCE_EXHAUSTED), a peer that is not a
//!   lunakv-master (UNIMPLEMENTED), ...
//!
//! What waiting fixes: nothing listening at the address, etcd unreachable, no leader elected
//! yet, a master still rebuilding its index or a follower (UNAVAILABLE), a timeout, a
//! transient failure of the master's metadata store (INTERNAL).

use std::time::Duration;

use lunakv_telemetry::wait::PeerWait;

use crate::ClientError;
use crate::link::MasterLink;

/// What connecting does while the master cannot be reached yet (not yet listening, etcd down,
/// no leader elected): that is a startup-order problem that waiting fixes. A refusal (a
/// cluster_id or enable_offload mismatch) and a malformed address fail at once whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MasterWait {
    /// Fail on the first attempt (the CLI, tests).
    #[default]
    NoWait,
    /// Retry for at most this long, then fail with the last error (the Python `setup`).
    AtMost(Duration),
    /// Retry until the master answers; the caller stops it by dropping the future
    /// (`lunakv-store` on SIGTERM).
    Forever,
}

impl MasterWait {
    /// The limit as [`lunakv_telemetry::wait::PeerWait::limit`] takes it.
    fn limit(self) -> Option<Duration> {
        match self {
            MasterWait::NoWait => Some(Duration::ZERO),
            MasterWait::AtMost(d) => Some(d),
            MasterWait::Forever => None,
        }
    }
}

/// The hint `link::no_leader` gives when etcd has leaders of other clusters only: the one
/// connect error about an existing etcd that retrying cannot fix.
const CLUSTER_MISMATCH_HINT: &str = "must match the masters' --cluster_id";

/// Whether waiting may fix a failure of [`MasterLink::connect`].
pub fn connect_retryable(e: &ClientError) -> bool {
    match e {
        ClientError::Rpc { message, .. } => {
            !message.contains(CLUSTER_MISMATCH_HINT)
                && !message.contains(lunakv_proto::foreign::NOT_A_LUNAKV_MASTER)
        }
        _ => false,
    }
}

/// Whether waiting may fix a master's answer to a mount (see the module docs).
pub fn retryable(status: &tonic::Status) -> bool {
    use tonic::Code;
    matches!(
        status.code(),
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Aborted
            | Code::Internal
            | Code::Unknown
    )
}

/// [`MasterLink::connect`], retried per `wait` while the failure is one waiting can fix.
pub async fn connect_link(
    spec: &str,
    cluster_id: &str,
    timeout: Duration,
    wait: &mut PeerWait,
) -> Result<MasterLink, ClientError> {
    loop {
        match MasterLink::connect(spec, cluster_id, timeout).await {
            Ok(link) => return Ok(link),
            Err(e) if connect_retryable(&e) => {
                if !wait.retry_after(&e).await {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// The wait for the master at `spec`, `purpose` saying what for.
pub fn master_wait(spec: &str, purpose: String, wait: MasterWait) -> PeerWait {
    PeerWait::new(format!("lunakv-master at {}", spec.trim()), purpose).limit(wait.limit())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preface::speaks_grpc;

    #[test]
    fn what_waiting_can_fix() {
        let rpc = |m: &str| ClientError::Rpc {
            addr: "a".into(),
            message: m.into(),
        };
        assert!(connect_retryable(&rpc(
            "cannot connect (connection refused): is lunakv-master running there?"
        )));
        assert!(connect_retryable(&rpc(
            "no lunakv-master leads cluster \"c\" (etcd key k is absent): start lunakv-master \
             with --enable_ha"
        )));
        assert!(!connect_retryable(&rpc(
            "etcd has leaders for cluster_id [\"a\"]: the cluster_id of this client (\"b\") must \
             match the masters' --cluster_id"
        )));
        assert!(!connect_retryable(&rpc(&format!(
            "the master at a does not speak gRPC (it closed the connection on the HTTP/2 \
             preface): {}",
            lunakv_proto::foreign::NOT_A_LUNAKV_MASTER
        ))));
        assert!(!connect_retryable(&ClientError::Config(
            "bad address".into()
        )));

        assert!(retryable(&tonic::Status::unavailable("rebuilding")));
        assert!(retryable(&tonic::Status::deadline_exceeded("slow")));
        assert!(retryable(&tonic::Status::internal("etcd write failed")));
        assert!(!retryable(&tonic::Status::failed_precondition(
            "cluster_id mismatch"
        )));
        assert!(!retryable(&tonic::Status::invalid_argument("segment.size")));
        assert!(!retryable(&tonic::Status::permission_denied("not owner")));
        assert!(!retryable(&tonic::Status::resource_exhausted("too large")));
        assert!(!retryable(&tonic::Status::unimplemented("not a master")));
    }

    // The look before connecting (`preface`), as the waits above take its answers.

    /// A peer on loopback that takes `n` connections, reads part of the preface and drops each
    /// (the unread rest makes the kernel reset it), then closes its port.
    fn dropping_peer(n: usize) -> String {
        use std::io::Read;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for _ in 0..n {
                let Ok((mut c, _)) = l.accept() else { return };
                let mut h = [0u8; 20];
                let _ = c.read_exact(&mut h);
            }
            // `l` drops here: the port refuses from now on.
        });
        addr
    }

    /// A master killed while a client connects resets the connection it had
    /// accepted, then its port refuses. That is a master unreachable or restarting (retried),
    /// not a foreign server (final).
    #[tokio::test]
    async fn a_reset_then_a_refusal_is_a_restarting_master_not_a_foreign_one() {
        let addr = dropping_peer(1);
        let e = speaks_grpc(&addr, Duration::from_secs(5), None)
            .await
            .expect_err("the master went away");
        let msg = e.to_string();
        assert!(
            msg.contains("unreachable or restarting")
                && !msg.contains(lunakv_proto::foreign::NOT_A_LUNAKV_MASTER),
            "{msg}"
        );
        assert!(connect_retryable(&e), "{msg}");
    }

    /// A foreign server (upstream's coro_rpc master) drops the preface every time: still named
    /// as such.
    #[tokio::test]
    async fn a_peer_that_drops_the_preface_twice_is_not_a_lunakv_master() {
        let addr = dropping_peer(2);
        let e = speaks_grpc(&addr, Duration::from_secs(5), None)
            .await
            .expect_err("a foreign server");
        let msg = e.to_string();
        assert!(
            msg.contains(lunakv_proto::foreign::NOT_A_LUNAKV_MASTER) && msg.contains("on it again"),
            "{msg}"
        );
    }
}
