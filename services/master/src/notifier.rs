//! The master's control channel to segment owners: FREE before a range is reused ("frees go
//! through the owner", docs/ARCHITECTURE.md), OFFLOAD on eviction to disk, PROMOTE on a hit.
//! Requests are typed here and become wire tuples only inside the transfer library, so the
//! core never handles the DISK_OFFSET sentinel as a plain offset.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lunakv_transfer::{DISK_OFFSET, TransferError};
use parking_lot::Mutex;

/// Where the entry an owner must drop lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// A DRAM range at this segment offset.
    Dram(u64),
    /// The owner's disk tier (no DRAM range).
    Disk,
}

/// One entry of a FREE: drop `generation` from `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeEntry {
    pub generation: u64,
    pub slot: Slot,
}

impl FreeEntry {
    /// From the wire form `(generation, offset)`, where [`DISK_OFFSET`] means the disk tier.
    pub fn from_wire(generation: u64, offset: u64) -> FreeEntry {
        let slot = if offset == DISK_OFFSET {
            Slot::Disk
        } else {
            Slot::Dram(offset)
        };
        FreeEntry { generation, slot }
    }

    /// The wire form `(generation, offset)`; byte-identical to what the master always sent.
    pub fn to_wire(self) -> (u64, u64) {
        match self.slot {
            Slot::Dram(offset) => (self.generation, offset),
            Slot::Disk => (self.generation, DISK_OFFSET),
        }
    }
}

/// One entry of an OFFLOAD: move the DRAM entry `generation` at `offset` to the disk tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadEntry {
    pub generation: u64,
    pub offset: u64,
}

/// What an owner answered to an OFFLOAD.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OffloadOutcome {
    /// Generations it could not store: those objects lost their disk replica.
    pub failed: Vec<u64>,
    /// `(key, generation)` of objects its disk tier dropped to make room for these (older disk
    /// objects, or some of these themselves). Empty from an owner that reports drops only on
    /// its Ping.
    pub dropped: Vec<(String, u64)>,
}

impl OffloadOutcome {
    /// Every entry failed, nothing dropped: the answer of a client that cannot offload.
    pub fn all_failed(entries: &[OffloadEntry]) -> OffloadOutcome {
        OffloadOutcome {
            failed: entries.iter().map(|e| e.generation).collect(),
            dropped: Vec::new(),
        }
    }
}

/// A PROMOTE: copy disk object `generation` (`key`, `len` bytes) into the DRAM range at
/// `offset` the master reserved for it, and commit the entry under the same generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promote {
    pub generation: u64,
    pub key: String,
    pub offset: u64,
    pub len: u64,
}

/// The three owner operations, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerOp {
    Free,
    Offload,
    Promote,
}

impl OwnerOp {
    fn gerund(self) -> &'static str {
        match self {
            OwnerOp::Free => "freeing",
            OwnerOp::Offload => "offloading",
            OwnerOp::Promote => "promoting",
        }
    }
}

impl fmt::Display for OwnerOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OwnerOp::Free => "free",
            OwnerOp::Offload => "offload",
            OwnerOp::Promote => "promote",
        })
    }
}

/// Why an owner did not acknowledge a request. The caller logs it and falls back (frees the
/// range anyway, evicts instead of offloading, keeps the object on disk).
#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    /// The transfer library's answer (unreachable, timed out, refused, ...).
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// The blocking task running the call panicked or was cancelled.
    #[error("{op} task failed: {source}")]
    Task {
        op: OwnerOp,
        #[source]
        source: tokio::task::JoinError,
    },
    /// This client has no way to send the op.
    #[error("{endpoint}: this notifier cannot {op}")]
    Unsupported { op: OwnerOp, endpoint: String },
    /// The core that issued the request belongs to a term that no longer leads.
    #[error("not {} on {endpoint}: term {term} no longer leads", .op.gerund())]
    Deposed {
        op: OwnerOp,
        endpoint: String,
        term: u64,
    },
    /// A test client's simulated outage.
    #[error("{endpoint} unreachable (test)")]
    Unreachable { endpoint: String },
}

/// Sends the master's control requests to the owner at `endpoint`.
#[async_trait]
pub trait OwnerClient: Send + Sync + 'static {
    /// Tells an owner to drop entries. `Ok` means the owner acknowledged (every entry is gone
    /// and no reader holds it); an error means it could not be reached in time.
    async fn free(
        &self,
        endpoint: &str,
        entries: &[FreeEntry],
        timeout: Duration,
    ) -> Result<(), OwnerError>;

    /// Asks an owner to move entries to its disk tier and drop them from DRAM. `Ok` lists the
    /// generations it could not store and the objects its disk tier dropped to make room. The
    /// default (a client that cannot offload) reports every entry failed, so the objects are
    /// simply evicted.
    async fn offload(
        &self,
        endpoint: &str,
        entries: &[OffloadEntry],
        timeout: Duration,
    ) -> Result<OffloadOutcome, OwnerError> {
        let _ = (endpoint, timeout);
        Ok(OffloadOutcome::all_failed(entries))
    }

    /// The owner at `endpoint` mounted with this secret (`None`: it requires no capabilities):
    /// from now on its FREE, OFFLOAD and PROMOTE carry a tag under it. The default ignores it.
    fn set_owner_key(&self, endpoint: &str, secret: Option<lunakv_transfer::MountSecret>) {
        let _ = (endpoint, secret);
    }

    /// Asks an owner to promote a disk object into DRAM (promotion on hit). `Ok` once
    /// committed. The default (a client that cannot promote) fails.
    async fn promote(&self, endpoint: &str, req: &Promote) -> Result<(), OwnerError> {
        let _ = req;
        Err(OwnerError::Unsupported {
            op: OwnerOp::Promote,
            endpoint: endpoint.to_string(),
        })
    }
}

/// The production client: the transfer library's FREE/OFFLOAD/PROMOTE frames (blocking calls,
/// run on the blocking pool).
pub struct TransferOwnerClient {
    engine: Arc<lunakv_transfer::TransferEngine>,
    /// PROMOTE is a master-only op: spoken over a tcp transport of the client's own.
    tcp: Arc<lunakv_transfer::TcpTransport>,
}

impl TransferOwnerClient {
    pub fn new() -> TransferOwnerClient {
        TransferOwnerClient {
            engine: Arc::new(lunakv_transfer::TransferEngine::new(
                lunakv_transfer::TransferOptions::default(),
            )),
            tcp: Arc::new(lunakv_transfer::TcpTransport::new(
                2,
                lunakv_transfer::TransferOptions::default().io_timeout,
            )),
        }
    }
}

impl Default for TransferOwnerClient {
    fn default() -> Self {
        TransferOwnerClient::new()
    }
}

/// Runs a blocking transfer call off the async workers.
async fn blocking<T: Send + 'static>(
    op: OwnerOp,
    call: impl FnOnce() -> Result<T, TransferError> + Send + 'static,
) -> Result<T, OwnerError> {
    tokio::task::spawn_blocking(call)
        .await
        .map_err(|source| OwnerError::Task { op, source })?
        .map_err(OwnerError::from)
}

#[async_trait]
impl OwnerClient for TransferOwnerClient {
    fn set_owner_key(&self, endpoint: &str, secret: Option<lunakv_transfer::MountSecret>) {
        self.engine.set_owner_key(endpoint, secret);
        self.tcp.set_owner_key(endpoint, secret);
    }

    async fn free(
        &self,
        endpoint: &str,
        entries: &[FreeEntry],
        timeout: Duration,
    ) -> Result<(), OwnerError> {
        let engine = self.engine.clone();
        let endpoint = endpoint.to_string();
        let entries: Vec<(u64, u64)> = entries.iter().map(|e| e.to_wire()).collect();
        blocking(OwnerOp::Free, move || {
            engine.free(&endpoint, &entries, timeout)
        })
        .await
    }

    async fn offload(
        &self,
        endpoint: &str,
        entries: &[OffloadEntry],
        timeout: Duration,
    ) -> Result<OffloadOutcome, OwnerError> {
        let engine = self.engine.clone();
        let endpoint = endpoint.to_string();
        let entries: Vec<(u64, u64)> = entries.iter().map(|e| (e.generation, e.offset)).collect();
        let answer = blocking(OwnerOp::Offload, move || {
            engine.offload_reporting(&endpoint, &entries, timeout)
        })
        .await?;
        Ok(OffloadOutcome {
            failed: answer.failed,
            dropped: answer
                .dropped
                .into_iter()
                .map(|d| (d.key, d.generation))
                .collect(),
        })
    }

    async fn promote(&self, endpoint: &str, req: &Promote) -> Result<(), OwnerError> {
        let tcp = self.tcp.clone();
        let endpoint = endpoint.to_string();
        let req = req.clone();
        blocking(OwnerOp::Promote, move || {
            tcp.promote(&endpoint, req.generation, &req.key, req.offset, req.len)
        })
        .await
    }
}

/// One call seen by a [`RecordingNotifier`], entries in wire form `(generation, offset)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeCall {
    pub endpoint: String,
    pub entries: Vec<(u64, u64)>,
}

/// One PROMOTE seen by a [`RecordingNotifier`]: (endpoint, generation, key, offset, len).
pub type PromoteCall = (String, u64, String, u64, u64);

/// A client for tests: records every call and answers `Ok`, or an error for endpoints listed
/// in `unreachable`.
#[derive(Default)]
pub struct RecordingNotifier {
    pub calls: Mutex<Vec<FreeCall>>,
    /// OFFLOAD calls (answered "all stored").
    pub offloads: Mutex<Vec<FreeCall>>,
    /// What the next OFFLOAD answers as dropped by the owner's disk tier (taken by that call).
    pub offload_drops: Mutex<Vec<(String, u64)>>,
    /// PROMOTE calls, answered OK.
    pub promotes: Mutex<Vec<PromoteCall>>,
    pub unreachable: Mutex<Vec<String>>,
}

impl RecordingNotifier {
    /// Every `(generation, offset)` freed so far, over all endpoints.
    pub fn freed(&self) -> Vec<(u64, u64)> {
        self.calls
            .lock()
            .iter()
            .flat_map(|c| c.entries.iter().copied())
            .collect()
    }

    fn answer(&self, endpoint: &str) -> Result<(), OwnerError> {
        if self.unreachable.lock().iter().any(|e| e == endpoint) {
            return Err(OwnerError::Unreachable {
                endpoint: endpoint.to_string(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl OwnerClient for RecordingNotifier {
    async fn free(
        &self,
        endpoint: &str,
        entries: &[FreeEntry],
        _timeout: Duration,
    ) -> Result<(), OwnerError> {
        self.calls.lock().push(FreeCall {
            endpoint: endpoint.to_string(),
            entries: entries.iter().map(|e| e.to_wire()).collect(),
        });
        self.answer(endpoint)
    }

    async fn offload(
        &self,
        endpoint: &str,
        entries: &[OffloadEntry],
        _timeout: Duration,
    ) -> Result<OffloadOutcome, OwnerError> {
        self.offloads.lock().push(FreeCall {
            endpoint: endpoint.to_string(),
            entries: entries.iter().map(|e| (e.generation, e.offset)).collect(),
        });
        self.answer(endpoint)?;
        Ok(OffloadOutcome {
            failed: Vec::new(),
            dropped: std::mem::take(&mut *self.offload_drops.lock()),
        })
    }

    async fn promote(&self, endpoint: &str, req: &Promote) -> Result<(), OwnerError> {
        self.promotes.lock().push((
            endpoint.to_string(),
            req.generation,
            req.key.clone(),
            req.offset,
            req.len,
        ));
        self.answer(endpoint)
    }
}
