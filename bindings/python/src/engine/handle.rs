//! The engine handle and its state: the region server once `initialize` ran (with its
//! registry), the batches submitted and not yet collected, and upstream's error codes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use lunakv_transfer::{
    MemoryRegistry, OwnedRegion, ProtocolChoice, RegionServer, TransferEngine as RawEngine,
};
use parking_lot::{Condvar, Mutex, RwLock};
use pyo3::prelude::*;

/// Upstream's transfer-engine error codes (mooncake-transfer-engine error.h).
pub(super) const ERR_INVALID_ARGUMENT: i64 = -1;
pub(super) const ERR_ADDRESS_NOT_REGISTERED: i64 = -3;
pub(super) const ERR_ADDRESS_OVERLAPPED: i64 = -7;
/// What upstream's Python transfer calls return for any failure.
pub(super) const FAILED: i64 = -1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    Read,
    Write,
}

impl Dir {
    /// Upstream's `TransferOpcode`: Read = 0, Write = 1.
    pub(super) fn from_opcode(op: i64) -> Option<Dir> {
        match op {
            0 => Some(Dir::Read),
            1 => Some(Dir::Write),
            _ => None,
        }
    }
}

/// A submitted asynchronous batch: its result once the worker thread finished.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) result: Mutex<Option<i64>>,
    pub(super) done: Condvar,
}

impl Pending {
    pub(super) fn finish(&self, r: i64) {
        *self.result.lock() = Some(r);
        self.done.notify_all();
    }

    pub(super) fn wait(&self) -> i64 {
        let mut r = self.result.lock();
        while r.is_none() {
            self.done.wait(&mut r);
        }
        r.unwrap_or(FAILED)
    }
}

/// One initialized engine: the region server and what it serves.
pub(super) struct Active {
    pub(super) engine: Arc<RawEngine>,
    pub(super) registry: Arc<MemoryRegistry>,
    pub(super) server: RegionServer,
    /// Buffers from `allocate_managed_buffer`, by address.
    pub(super) managed: Mutex<HashMap<u64, OwnedRegion>>,
    pub(super) batches: Mutex<HashMap<u64, Arc<Pending>>>,
    pub(super) next_batch: AtomicU64,
    /// The protocol `initialize` asked for and the one served.
    pub(super) protocol: ProtocolChoice,
}

impl Active {
    /// Stops serving, then deregisters every region (waiting for copies in flight), so no peer
    /// touches caller memory after this returns.
    fn stop(&self) {
        self.server.shutdown();
        self.managed.lock().clear();
        for r in self.registry.regions() {
            self.registry.deregister(r.addr);
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Upstream's `mooncake.engine.TransferEngine`. Thread-safe: vLLM's sender pool calls the
/// transfer methods from many threads at once.
#[pyclass(module = "mooncake.engine", frozen)]
pub struct TransferEngine {
    pub(super) active: RwLock<Option<Arc<Active>>>,
}

impl TransferEngine {
    pub(super) fn active(&self) -> Option<Arc<Active>> {
        self.active.read().clone()
    }

    pub(super) fn find_batch(&self, id: i128) -> Option<Arc<Pending>> {
        let a = self.active()?;
        let id = u64::try_from(id).ok()?;
        let batches = a.batches.lock();
        batches.get(&id).cloned()
    }

    pub(super) fn forget_batch(&self, id: i128) {
        if let (Some(a), Ok(id)) = (self.active(), u64::try_from(id)) {
            a.batches.lock().remove(&id);
        }
    }
}
