//! [`CoreSlot`], the current core every request goes through. The edges (RPC, admin API) read it
//! per request and the HA election replaces it each won term; it sits apart from both so
//! neither imports the other for it.

use std::sync::Arc;

use parking_lot::RwLock;

use crate::core::MasterCore;

/// The current core. A new leader term gets a fresh core (empty index, its own epoch); the
/// edges look it up per request.
pub struct CoreSlot(RwLock<Arc<MasterCore>>);

impl CoreSlot {
    pub fn new(core: Arc<MasterCore>) -> Arc<CoreSlot> {
        Arc::new(CoreSlot(RwLock::new(core)))
    }

    pub fn get(&self) -> Arc<MasterCore> {
        self.0.read().clone()
    }

    pub fn replace(&self, core: Arc<MasterCore>) {
        *self.0.write() = core;
    }
}
