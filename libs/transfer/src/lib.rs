//! lunakv-transfer: the data path (stub API, implementation in progress).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Identifies this machine: equal values mean same host, so shm is allowed.
pub fn host_id() -> String {
    String::new()
}

/// How a [`SegmentServer`] is started.
#[derive(Debug, Clone)]
pub struct SegmentServerConfig {
    pub bind: SocketAddr,
    pub size: u64,
    pub shm_socket: Option<PathBuf>,
    pub advertise_host: Option<String>,
}

/// What a segment owner tells the master about its segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    pub name: String,
    pub transfer_endpoint: String,
    pub size: u64,
    pub host_id: String,
    pub shm_socket: Option<String>,
}

/// One committed object in a segment's entry table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub offset: u64,
    pub size: u64,
    pub generation: u64,
}

/// Counters of a segment server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub reads: u64,
    pub writes: u64,
    pub entries: u64,
    pub used_bytes: u64,
}

/// Owns a segment and serves it.
pub struct SegmentServer {
    _p: (),
}

impl SegmentServer {
    pub fn start(_cfg: SegmentServerConfig) -> Result<SegmentServer, TransferError> {
        Err(TransferError::Protocol("not implemented yet".into()))
    }
    pub fn local_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }
    pub fn info(&self) -> SegmentInfo {
        SegmentInfo {
            name: String::new(),
            transfer_endpoint: String::new(),
            size: 0,
            host_id: String::new(),
            shm_socket: None,
        }
    }
    pub fn inventory(&self) -> Vec<Entry> {
        Vec::new()
    }
    pub fn take_touched_keys(&self, _max: usize) -> Vec<String> {
        Vec::new()
    }
    pub fn stats(&self) -> SegmentStats {
        SegmentStats::default()
    }
    pub fn shutdown(&self) {}
}

/// Engine options.
#[derive(Debug, Clone)]
pub struct TransferOptions {
    pub enable_shm: bool,
    pub conns_per_peer: usize,
    pub io_timeout: Duration,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            enable_shm: true,
            conns_per_peer: 4,
            io_timeout: Duration::from_secs(10),
        }
    }
}

/// Where a transfer goes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub endpoint: String,
    pub host_id: String,
    pub shm_socket: Option<String>,
    pub size: u64,
}

/// One request of a batch.
pub enum TransferRequest<'a> {
    Read {
        target: &'a Target,
        generation: u64,
        offset: u64,
        dst: Vec<&'a mut [u8]>,
    },
    Write {
        target: &'a Target,
        generation: u64,
        key: &'a str,
        offset: u64,
        src: Vec<&'a [u8]>,
    },
}

/// Errors of the data path.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("generation {generation} is stale")]
    Stale { generation: u64 },
    #[error("range out of bounds: offset {offset} + len {len} > segment size {size}")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("i/o error with {0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("timed out")]
    Timeout,
    #[error("shm unavailable: {0}")]
    ShmUnavailable(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// A way to move bytes to and from a segment.
pub trait Transport: Send + Sync {
    fn name(&self) -> &'static str;
}

/// Moves bytes between caller buffers and segments.
pub struct TransferEngine {
    _opts: TransferOptions,
}

impl TransferEngine {
    pub fn new(opts: TransferOptions) -> TransferEngine {
        TransferEngine { _opts: opts }
    }
    pub fn write(
        &self,
        _t: &Target,
        _generation: u64,
        _key: &str,
        _offset: u64,
        _src: &[&[u8]],
    ) -> Result<(), TransferError> {
        Err(TransferError::Protocol("not implemented yet".into()))
    }
    pub fn read(
        &self,
        _t: &Target,
        _generation: u64,
        _offset: u64,
        _dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        Err(TransferError::Protocol("not implemented yet".into()))
    }
    pub fn batch(&self, reqs: &mut [TransferRequest<'_>]) -> Vec<Result<(), TransferError>> {
        reqs.iter()
            .map(|_| Err(TransferError::Protocol("not implemented yet".into())))
            .collect()
    }
    pub fn free(
        &self,
        _endpoint: &str,
        _items: &[(u64, u64)],
        _timeout: Duration,
    ) -> Result<(), TransferError> {
        Err(TransferError::Protocol("not implemented yet".into()))
    }
    pub fn uses_shm(&self, _t: &Target) -> bool {
        false
    }
}
