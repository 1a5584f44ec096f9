//! One shard of the object index, with each tenant's usage kept exact under the shard's lock
//! and each group's members kept in the shared [`Groups`] registry.
//!
//! Every change of an object goes through [`Index`]: inserts, removes, `retain`, and
//! [`Index::get_mut`], whose guard compares the object's charge (and group) before and after.
//! So no path that adds or drops a replica or an object (puts, eviction, offload, promotion,
//! unmounts, inventories, the zombie sweep, warm copies) can forget to account for it, quotas
//! never drift from the index, and a group always knows its members. A tenant's total is the
//! sum of its rows in the [`super::SHARDS`] shards.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use serde::Serialize;

use super::groups::Groups;
use super::types::Object;

/// What one tenant holds in one shard (or, summed, in the whole index).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TenantUsage {
    pub objects: u64,
    /// Each DRAM replica's aligned size, complete or still being put (upstream charges
    /// in-flight allocations too).
    pub dram_bytes: u64,
    /// Objects with a copy in an owner's disk tier.
    pub disk_objects: u64,
    /// DRAM bytes of protected objects (`--eviction_policy=cslru`): kept exact by every change,
    /// so eviction knows how far the protected segment is over its share.
    #[serde(skip)]
    pub protected_bytes: u64,
}

impl TenantUsage {
    fn of(o: &Object) -> TenantUsage {
        let dram_bytes = o.dram_bytes();
        TenantUsage {
            objects: 1,
            dram_bytes,
            disk_objects: u64::from(o.replicas.iter().any(|r| r.disk)),
            protected_bytes: if o.tier.protected() { dram_bytes } else { 0 },
        }
    }

    pub fn add(&mut self, o: TenantUsage) {
        self.objects = self.objects.saturating_add(o.objects);
        self.dram_bytes = self.dram_bytes.saturating_add(o.dram_bytes);
        self.disk_objects = self.disk_objects.saturating_add(o.disk_objects);
        self.protected_bytes = self.protected_bytes.saturating_add(o.protected_bytes);
    }

    fn sub(&mut self, o: TenantUsage) {
        self.objects = self.objects.saturating_sub(o.objects);
        self.dram_bytes = self.dram_bytes.saturating_sub(o.dram_bytes);
        self.disk_objects = self.disk_objects.saturating_sub(o.disk_objects);
        self.protected_bytes = self.protected_bytes.saturating_sub(o.protected_bytes);
    }
}

/// Each tenant's usage in one shard. The default tenant (unscoped keys: every key of a pool
/// without tenants) has a row of its own, so charging it hashes no name on every put.
#[derive(Default)]
pub(super) struct Usage {
    default: TenantUsage,
    others: Keyed<TenantUsage>,
}

impl Usage {
    /// Moves `key`'s tenant's row by `add` and `sub`; a row that counts no object is dropped.
    fn charge(&mut self, key: &str, add: Option<TenantUsage>, sub: Option<TenantUsage>) {
        if add == sub {
            return;
        }
        let tenant = tenant_of(key);
        let u = if tenant == lunakv_proto::DEFAULT_TENANT {
            &mut self.default
        } else {
            // One lookup on the hot path (the tenant has a row); the insert only for its first.
            match self.others.get_mut(tenant) {
                Some(u) => u,
                None => self.others.entry(tenant.into()).or_default(),
            }
        };
        if let Some(s) = sub {
            u.sub(s);
        }
        if let Some(a) = add {
            u.add(a);
        }
        if u.objects == 0 && tenant != lunakv_proto::DEFAULT_TENANT {
            self.others.remove(tenant);
        }
    }

    /// The tenants that hold something, with their usage.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&str, &TenantUsage)> {
        let default =
            (self.default.objects > 0).then_some((lunakv_proto::DEFAULT_TENANT, &self.default));
        default
            .into_iter()
            .chain(self.others.iter().map(|(t, u)| (&**t, u)))
    }

    /// Protected DRAM bytes of every tenant.
    pub(super) fn protected_bytes(&self) -> u64 {
        self.others
            .values()
            .fold(self.default.protected_bytes, |a, u| a + u.protected_bytes)
    }

    fn of(&self, tenant: &str) -> TenantUsage {
        if tenant == lunakv_proto::DEFAULT_TENANT {
            self.default
        } else {
            self.others.get(tenant).copied().unwrap_or_default()
        }
    }
}

/// The tenant of a key as the index holds it.
pub(super) fn tenant_of(key: &str) -> &str {
    lunakv_proto::split_scoped(key).0
}

/// Keys come from clients: the hasher is seeded per process (HashDoS needs the seed), and
/// foldhash's quality variant costs a fraction of std's SipHash, which profiles put at ~6% of
/// the master's CPU under a key-heavy load (docs/BENCH.md, "Metadata").
pub(super) type Keyed<V> = HashMap<Box<str>, V, foldhash::quality::RandomState>;

pub(super) struct Index {
    map: Keyed<Box<Object>>,
    usage: Usage,
    groups: Arc<Groups>,
}

impl Index {
    pub(super) fn new(groups: Arc<Groups>) -> Index {
        Index {
            map: Keyed::default(),
            usage: Usage::default(),
            groups,
        }
    }

    fn charge(&mut self, key: &str, add: Option<TenantUsage>, sub: Option<TenantUsage>) {
        self.usage.charge(key, add, sub);
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn get(&self, key: &str) -> Option<&Object> {
        self.map.get(key).map(|o| &**o)
    }

    /// The object under `key`, for a change: its tenant's usage follows when the guard drops.
    pub(super) fn get_mut<'a, 'k>(&'a mut self, key: &'k str) -> Option<Charged<'a, 'k>> {
        let obj = self.map.get_mut(key)?;
        let before = TenantUsage::of(obj);
        let group = obj.group.clone();
        let state = obj.state;
        Some(Charged {
            obj,
            usage: &mut self.usage,
            groups: &self.groups,
            key,
            before,
            group,
            state,
        })
    }

    pub(super) fn insert(&mut self, key: Box<str>, o: Box<Object>) -> Option<Box<Object>> {
        let add = TenantUsage::of(&o);
        let group = o.group.clone();
        let (usage, groups) = (&mut self.usage, &self.groups);
        // Accounted through the entry's own key: a put inserts with no copy of its key.
        let mut note = |key: &str, old: Option<&Object>| {
            usage.charge(key, Some(add), old.map(TenantUsage::of));
            let old_group = old.and_then(|o| o.group.clone());
            if old_group != group {
                if let (Some(g), Some(o)) = (&old_group, old) {
                    groups.left(g, key, o.state);
                }
                if let Some(g) = &group {
                    groups.joined(g, key);
                }
            }
        };
        match self.map.entry(key) {
            Entry::Occupied(mut e) => {
                let old = e.insert(o);
                note(e.key(), Some(&old));
                Some(old)
            }
            Entry::Vacant(e) => {
                note(e.key(), None);
                e.insert(o);
                None
            }
        }
    }

    pub(super) fn remove(&mut self, key: &str) -> Option<Box<Object>> {
        let old = self.map.remove(key)?;
        self.charge(key, None, Some(TenantUsage::of(&old)));
        if let Some(g) = &old.group {
            self.groups.left(g, key, old.state);
        }
        Some(old)
    }

    /// `HashMap::retain`, accounting for what `keep` changes or drops.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&str, &mut Object) -> bool) {
        let mut deltas: Vec<(Box<str>, Option<TenantUsage>, TenantUsage)> = Vec::new();
        let groups = &self.groups;
        self.map.retain(|k, o| {
            let before = TenantUsage::of(o);
            let kept = keep(k, o);
            let after = kept.then(|| TenantUsage::of(o));
            if after != Some(before) {
                deltas.push((k.clone(), after, before));
            }
            if !kept && let Some(g) = &o.group {
                groups.left(g, k, o.state);
            }
            kept
        });
        for (k, add, sub) in deltas {
            self.charge(&k, add, Some(sub));
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&str, &Object)> {
        self.map.iter().map(|(k, o)| (&**k, &**o))
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Object> {
        self.map.values().map(|o| &**o)
    }

    /// Each tenant's usage in this shard.
    pub(super) fn usage(&self) -> &Usage {
        &self.usage
    }

    /// One tenant's usage in this shard.
    pub(super) fn usage_of(&self, tenant: &str) -> TenantUsage {
        self.usage.of(tenant)
    }
}

/// An object borrowed for a change; on drop its tenant's usage moves by what changed, and its
/// group learns of a changed membership.
pub(super) struct Charged<'a, 'k> {
    obj: &'a mut Box<Object>,
    usage: &'a mut Usage,
    groups: &'a Groups,
    key: &'k str,
    before: TenantUsage,
    group: Option<Arc<str>>,
    state: super::types::ObjectState,
}

impl Deref for Charged<'_, '_> {
    type Target = Object;
    fn deref(&self) -> &Object {
        self.obj
    }
}

impl DerefMut for Charged<'_, '_> {
    fn deref_mut(&mut self) -> &mut Object {
        self.obj
    }
}

impl Drop for Charged<'_, '_> {
    fn drop(&mut self) {
        if self.obj.group != self.group {
            if let Some(g) = &self.group {
                self.groups.left(g, self.key, self.state);
            }
            if let Some(g) = &self.obj.group {
                self.groups.joined(g, self.key);
            }
        }
        let after = TenantUsage::of(self.obj);
        if after == self.before {
            return;
        }
        self.usage.charge(self.key, Some(after), Some(self.before));
    }
}
