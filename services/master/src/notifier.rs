//! How the master asks a segment owner to drop entries before their ranges are reused
//! ("frees go through the owner", docs/ARCHITECTURE.md).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

/// Tells an owner to drop `(generation, offset)` entries. `Ok` means the owner acknowledged
/// (every entry is gone and no reader holds it); an error means it could not be reached in time.
#[async_trait]
pub trait OwnerNotifier: Send + Sync + 'static {
    async fn free(
        &self,
        endpoint: &str,
        entries: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<(), String>;

    /// Asks an owner to move `(generation, offset)` entries to its disk tier and drop them from
    /// DRAM. `Ok` lists the generations it could not store. The default (a notifier that
    /// cannot offload) reports every entry failed, so the objects are simply evicted.
    async fn offload(
        &self,
        endpoint: &str,
        entries: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<Vec<u64>, String> {
        let _ = (endpoint, timeout);
        Ok(entries.iter().map(|(g, _)| *g).collect())
    }

    /// Asks an owner to copy disk object `generation` (`key`, `len` bytes) into the DRAM range
    /// at `offset` the master reserved for it, and commit the entry (promotion on hit). `Ok`
    /// once committed. The default (a notifier that cannot promote) fails.
    async fn promote(
        &self,
        endpoint: &str,
        generation: u64,
        key: &str,
        offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let _ = (generation, key, offset, len);
        Err(format!("{endpoint}: this notifier cannot promote"))
    }
}

/// The production notifier: a FREE frame over the transfer library (a blocking call, run on
/// the blocking pool).
pub struct TransferNotifier {
    engine: Arc<lunakv_transfer::TransferEngine>,
    /// PROMOTE is a master-only op: spoken over a tcp transport of the notifier's own.
    tcp: Arc<lunakv_transfer::TcpTransport>,
}

impl TransferNotifier {
    pub fn new() -> TransferNotifier {
        TransferNotifier {
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

impl Default for TransferNotifier {
    fn default() -> Self {
        TransferNotifier::new()
    }
}

#[async_trait]
impl OwnerNotifier for TransferNotifier {
    async fn free(
        &self,
        endpoint: &str,
        entries: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<(), String> {
        let engine = self.engine.clone();
        let endpoint = endpoint.to_string();
        let entries = entries.to_vec();
        tokio::task::spawn_blocking(move || engine.free(&endpoint, &entries, timeout))
            .await
            .map_err(|e| format!("free task failed: {e}"))?
            .map_err(|e| e.to_string())
    }

    async fn offload(
        &self,
        endpoint: &str,
        entries: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<Vec<u64>, String> {
        let engine = self.engine.clone();
        let endpoint = endpoint.to_string();
        let entries = entries.to_vec();
        tokio::task::spawn_blocking(move || engine.offload(&endpoint, &entries, timeout))
            .await
            .map_err(|e| format!("offload task failed: {e}"))?
            .map_err(|e| e.to_string())
    }

    async fn promote(
        &self,
        endpoint: &str,
        generation: u64,
        key: &str,
        offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let tcp = self.tcp.clone();
        let endpoint = endpoint.to_string();
        let key = key.to_string();
        tokio::task::spawn_blocking(move || tcp.promote(&endpoint, generation, &key, offset, len))
            .await
            .map_err(|e| format!("promote task failed: {e}"))?
            .map_err(|e| e.to_string())
    }
}

/// One call seen by a [`RecordingNotifier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeCall {
    pub endpoint: String,
    pub entries: Vec<(u64, u64)>,
}

/// One PROMOTE seen by a [`RecordingNotifier`]: (endpoint, generation, key, offset, len).
pub type PromoteCall = (String, u64, String, u64, u64);

/// A notifier for tests: records every call and answers `Ok`, or an error for endpoints listed
/// in `unreachable`.
#[derive(Default)]
pub struct RecordingNotifier {
    pub calls: Mutex<Vec<FreeCall>>,
    /// OFFLOAD calls (answered "all stored").
    pub offloads: Mutex<Vec<FreeCall>>,
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
}

#[async_trait]
impl OwnerNotifier for RecordingNotifier {
    async fn free(
        &self,
        endpoint: &str,
        entries: &[(u64, u64)],
        _timeout: Duration,
    ) -> Result<(), String> {
        self.calls.lock().push(FreeCall {
            endpoint: endpoint.to_string(),
            entries: entries.to_vec(),
        });
        if self.unreachable.lock().iter().any(|e| e == endpoint) {
            return Err(format!("{endpoint} unreachable (test)"));
        }
        Ok(())
    }

    async fn offload(
        &self,
        endpoint: &str,
        entries: &[(u64, u64)],
        _timeout: Duration,
    ) -> Result<Vec<u64>, String> {
        self.offloads.lock().push(FreeCall {
            endpoint: endpoint.to_string(),
            entries: entries.to_vec(),
        });
        if self.unreachable.lock().iter().any(|e| e == endpoint) {
            return Err(format!("{endpoint} unreachable (test)"));
        }
        Ok(Vec::new())
    }

    async fn promote(
        &self,
        endpoint: &str,
        generation: u64,
        key: &str,
        offset: u64,
        len: u64,
    ) -> Result<(), String> {
        self.promotes.lock().push((
            endpoint.to_string(),
            generation,
            key.to_string(),
            offset,
            len,
        ));
        if self.unreachable.lock().iter().any(|e| e == endpoint) {
            return Err(format!("{endpoint} unreachable (test)"));
        }
        Ok(())
    }
}
