//! The handle itself: one client slot (empty before `setup` and after `close`) and the name
//! the segment was mounted under.

use std::sync::Arc;

use lunakv_client::StoreClient;
use parking_lot::RwLock;
use pyo3::prelude::*;

/// The store client handle vLLM's `MooncakeStoreConnector` drives. Thread-safe: vLLM calls it
/// from its sending and receiving threads at once.
#[pyclass(module = "mooncake.store", frozen)]
pub struct MooncakeDistributedStore {
    pub(super) client: RwLock<Option<Arc<StoreClient>>>,
    pub(super) hostname: RwLock<String>,
}

impl MooncakeDistributedStore {
    pub(super) fn client(&self) -> Option<Arc<StoreClient>> {
        self.client.read().clone()
    }
}
