//! The data path's error type: what a transfer can fail with, and which failures a caller
//! retries (at another replica, or after asking the master again).

use super::*;

/// Errors of the data path.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The owner has no entry with this generation/offset/len: it was evicted, removed or
    /// overwritten. Drop the cached location and ask the master.
    #[error(
        "generation {generation} is stale at the owner (evicted, removed or overwritten); ask the master for the current location"
    )]
    Stale { generation: u64 },
    #[error(
        "range [{offset}, {offset}+{len}) is outside the {size} byte segment; the location is wrong or the segment was remounted smaller"
    )]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error(
        "cannot connect to {endpoint}: {source}; check the segment owner is running and reachable at that address"
    )]
    Connect {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    /// A listener could not bind its configured address.
    #[error(
        "cannot bind {addr}: {source}; the address is in use or not local to this host, pick another port/host"
    )]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// I/O failure on an established connection: `(endpoint, error)`.
    #[error(
        "i/o error talking to {0}: {1}; the owner may have restarted or died, retry or ask the master"
    )]
    Io(String, #[source] std::io::Error),
    #[error("transfer protocol error: {0}; peer and local lunakv versions may differ")]
    Protocol(String),
    /// A socket operation exceeded `TransferOptions::io_timeout`, or FREE waited its whole budget
    /// for readers' pins (the entries are dropped regardless).
    #[error(
        "transfer timed out; the peer is overloaded or stuck (raise TransferOptions.io_timeout), or FREE waited too long for pinned readers"
    )]
    Timeout,
    /// The owner refused the request's capability (missing, expired, forged, too few rights),
    /// or a WRITE of a generation it already holds. Nothing was read or written.
    #[error("{endpoint} refused the request: {message}")]
    Refused { endpoint: String, message: String },
    #[error("shm unavailable: {0}")]
    ShmUnavailable(String),
    /// A live process already serves the shm socket path: never unlinked, since its clients
    /// would then map this segment instead of theirs.
    #[error(
        "the shm socket {path} is in use by a live process ({owner}); give this store a path of its own (--shm_socket=<file or directory/>) or stop that process"
    )]
    ShmSocketInUse { path: String, owner: String },
    /// The request itself is invalid (zero length, key too long, refused by the owner).
    #[error("invalid transfer request: {0}")]
    InvalidArgument(String),
    /// RDMA cannot be used: this build lacks the `rdma` feature, no device exists (the message
    /// is one line naming the fix), or a peer refused `RDMA_CONNECT`.
    #[error("{0}")]
    RdmaUnavailable(String),
    /// A copy to or from device (GPU) memory failed (docs/GPU.md).
    #[error("device memory: {0}")]
    Device(String),
    /// The NIC refused to register device (GPU) memory (no GPUDirect RDMA). The engine
    /// remembers it and serves such requests over tcp, staged; callers never see it.
    #[error("GPUDirect RDMA refused: {0}")]
    GpuDirectRefused(String),
}

impl From<device::DeviceError> for TransferError {
    fn from(e: device::DeviceError) -> TransferError {
        TransferError::Device(e.to_string())
    }
}

impl TransferError {
    /// A copy for fanning one connection failure out to every request that was riding on it
    /// (`std::io::Error` is not `Clone`).
    pub fn duplicate(&self) -> TransferError {
        match self {
            TransferError::Stale { generation } => TransferError::Stale {
                generation: *generation,
            },
            TransferError::OutOfBounds { offset, len, size } => TransferError::OutOfBounds {
                offset: *offset,
                len: *len,
                size: *size,
            },
            TransferError::Connect { endpoint, source } => TransferError::Connect {
                endpoint: endpoint.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            TransferError::Bind { addr, source } => TransferError::Bind {
                addr: addr.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            TransferError::Io(ep, e) => {
                TransferError::Io(ep.clone(), std::io::Error::new(e.kind(), e.to_string()))
            }
            TransferError::Protocol(m) => TransferError::Protocol(m.clone()),
            TransferError::Timeout => TransferError::Timeout,
            TransferError::Refused { endpoint, message } => TransferError::Refused {
                endpoint: endpoint.clone(),
                message: message.clone(),
            },
            TransferError::ShmUnavailable(m) => TransferError::ShmUnavailable(m.clone()),
            TransferError::ShmSocketInUse { path, owner } => TransferError::ShmSocketInUse {
                path: path.clone(),
                owner: owner.clone(),
            },
            TransferError::InvalidArgument(m) => TransferError::InvalidArgument(m.clone()),
            TransferError::RdmaUnavailable(m) => TransferError::RdmaUnavailable(m.clone()),
            TransferError::Device(m) => TransferError::Device(m.clone()),
            TransferError::GpuDirectRefused(m) => TransferError::GpuDirectRefused(m.clone()),
        }
    }
}
