//! The process-wide transfer engine that `mooncake.store` and `mooncake.engine` share.
//!
//! vLLM's MultiConnector[MooncakeConnector + MooncakeStoreConnector] (XpYd) runs both modules in
//! one worker process. They move bytes through one [`TransferEngine`], so connections to a peer
//! are pooled once per process, whichever module opened them. There are two instances at most:
//! one with shm and one without, because `LUNAKV_DISABLE_SHM` / `"enable_shm": false` is a
//! per-client setting and an engine's shm choice is fixed when it is made.

use std::sync::{Arc, OnceLock};

use lunakv_transfer::{TransferEngine, TransferOptions};

static WITH_SHM: OnceLock<Arc<TransferEngine>> = OnceLock::new();
static WITHOUT_SHM: OnceLock<Arc<TransferEngine>> = OnceLock::new();
/// Engines that also move bytes over RDMA (`protocol: "rdma"` on a build and machine with it).
static RDMA_WITH_SHM: OnceLock<Arc<TransferEngine>> = OnceLock::new();
static RDMA_WITHOUT_SHM: OnceLock<Arc<TransferEngine>> = OnceLock::new();

/// The process's engine for clients that use shm (`true`) or not (`false`).
pub fn engine(enable_shm: bool) -> Arc<TransferEngine> {
    let cell = if enable_shm { &WITH_SHM } else { &WITHOUT_SHM };
    cell.get_or_init(|| {
        Arc::new(TransferEngine::new(TransferOptions {
            enable_shm,
            ..TransferOptions::default()
        }))
    })
    .clone()
}

/// The process's engine for a client that asked for `rdma`: one with the RDMA transport when
/// this build has it and a device opens, else the plain one (the client then serves tcp and
/// says so in one warning line).
pub fn engine_for_rdma(enable_shm: bool) -> Arc<TransferEngine> {
    if lunakv_transfer::rdma_check().is_err() {
        return engine(enable_shm);
    }
    let cell = if enable_shm {
        &RDMA_WITH_SHM
    } else {
        &RDMA_WITHOUT_SHM
    };
    if let Some(e) = cell.get() {
        return e.clone();
    }
    match TransferEngine::with_rdma(TransferOptions {
        enable_shm,
        ..TransferOptions::default()
    }) {
        Ok(e) => cell.get_or_init(|| Arc::new(e)).clone(),
        Err(e) => {
            tracing::debug!(error = %e, "rdma engine not opened");
            engine(enable_shm)
        }
    }
}

/// The engine for raw P/D transfers (they always go over tcp, so either instance serves):
/// the one a store client in this process already uses, else the default one.
pub fn default_engine() -> Arc<TransferEngine> {
    if let Some(e) = WITH_SHM.get().or(WITHOUT_SHM.get()) {
        return e.clone();
    }
    engine(TransferOptions::default().enable_shm)
}

/// Identity of an engine, for tests that check the modules share one.
pub fn id(e: &Arc<TransferEngine>) -> usize {
    Arc::as_ptr(e) as usize
}
