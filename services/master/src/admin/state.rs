//! What every admin handler reads: the current core, the HA state, the rebuild gate and the
//! event publisher. Apart from the router so [`super::upstream`]'s handlers and the router use
//! it without importing each other.

use std::sync::Arc;

use crate::events::publisher::Publisher;
use crate::ha::election::HaState;
use crate::ha::recovery::RecoveryGate;
use crate::slot::CoreSlot;

#[derive(Clone)]
pub(super) struct AdminState {
    pub(super) slot: Arc<CoreSlot>,
    pub(super) ha: Option<Arc<HaState>>,
    /// A single master's rebuild after a restart: writes wait for it as RPCs do.
    pub(super) recovery: Arc<RecoveryGate>,
    pub(super) events: Option<Arc<Publisher>>,
}
