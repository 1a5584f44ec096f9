//! Object groups (upstream's `ReplicateConfig.group_ids`; docs/GROUPS.md): the objects one
//! logical KV block is split into (vLLM's TP shards of a chunk) live and die together.
//!
//! The registry knows each group's current members. [`super::index::Index`] keeps it in step with
//! every insert and removal, so no path can add or drop a member unseen. When a complete member
//! leaves the index while others remain (an owner died, a member was removed or lost on disk), the
//! group is *broken*: from that moment a get or exists of any remaining member answers "not found",
//! and [`MasterCore::drop_broken_groups`](super::MasterCore::drop_broken_groups) removes the rest.
//! Eviction takes a group whole or not at all ([`super::tiering`]), and removing one member removes
//! the group. So a reader sees all of a group or none of it.
//!
//! Lock order: the registry is a leaf, taken under a shard lock and never held while taking
//! one.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;

use super::types::ObjectState;

#[derive(Default)]
struct Group {
    members: HashSet<Box<str>>,
    broken: bool,
}

/// Every group with members, shared by the index's shards.
#[derive(Default)]
pub(super) struct Groups {
    groups: Mutex<HashMap<Arc<str>, Group>>,
}

impl Groups {
    /// The one shared copy of `name` for a new member's object.
    pub(super) fn name(&self, name: &str) -> Arc<str> {
        self.groups
            .lock()
            .get_key_value(name)
            .map_or_else(|| Arc::from(name), |(k, _)| k.clone())
    }

    pub(super) fn joined(&self, group: &Arc<str>, key: &str) {
        self.groups
            .lock()
            .entry(group.clone())
            .or_default()
            .members
            .insert(key.into());
    }

    /// `key` left the index; a complete member leaving others behind breaks the group.
    pub(super) fn left(&self, group: &str, key: &str, state: ObjectState) {
        let mut g = self.groups.lock();
        let Some(e) = g.get_mut(group) else {
            return;
        };
        e.members.remove(key);
        if e.members.is_empty() {
            g.remove(group);
        } else if state == ObjectState::Complete {
            e.broken = true;
        }
    }

    /// The current members of `group`.
    pub(super) fn members(&self, group: &str) -> Vec<String> {
        self.groups
            .lock()
            .get(group)
            .map(|g| g.members.iter().map(|m| m.to_string()).collect())
            .unwrap_or_default()
    }

    pub(super) fn is_broken(&self, group: &str) -> bool {
        self.groups.lock().get(group).is_some_and(|g| g.broken)
    }

    /// Each broken group and its remaining members.
    pub(super) fn broken(&self) -> Vec<(Arc<str>, Vec<String>)> {
        self.groups
            .lock()
            .iter()
            .filter(|(_, g)| g.broken)
            .map(|(n, g)| (n.clone(), g.members.iter().map(|m| m.to_string()).collect()))
            .collect()
    }

    pub(super) fn count(&self) -> usize {
        self.groups.lock().len()
    }
}
