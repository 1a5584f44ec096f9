//! Client-side location cache: key -> (generation, replicas). Entries are hints: the owner
//! checks the generation on every read, so a stale entry costs one extra round trip, never
//! wrong bytes.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::Location;

const SHARDS: usize = 32;

pub(crate) struct LocationCache {
    shards: Vec<Mutex<HashMap<String, Arc<Location>>>>,
    per_shard_cap: usize,
    hasher: RandomState,
}

impl LocationCache {
    pub(crate) fn new(capacity: usize) -> LocationCache {
        LocationCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard_cap: (capacity / SHARDS).max(16),
            hasher: RandomState::new(),
        }
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Arc<Location>>> {
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    /// The cached location, unless its capabilities expire soon (then it is dropped: the
    /// caller asks the master, which issues fresh ones).
    pub(crate) fn get(&self, key: &str) -> Option<Arc<Location>> {
        let mut shard = self.shard(key).lock();
        let loc = shard.get(key)?;
        if loc.capabilities_expire_soon() {
            shard.remove(key);
            return None;
        }
        Some(loc.clone())
    }

    pub(crate) fn insert(&self, key: &str, loc: Location) {
        let mut shard = self.shard(key).lock();
        if shard.len() >= self.per_shard_cap && !shard.contains_key(key) {
            // A full shard is dropped whole: cheaper than LRU bookkeeping on every get, and a
            // miss only costs one master round trip.
            shard.clear();
        }
        shard.insert(key.to_owned(), Arc::new(loc));
    }

    /// Drops the entry only if it still names `generation`, so a newer location learned
    /// concurrently survives.
    pub(crate) fn invalidate(&self, key: &str, generation: Option<u64>) {
        let mut shard = self.shard(key).lock();
        if let Some(cur) = shard.get(key)
            && generation.is_none_or(|g| cur.generation == g)
        {
            shard.remove(key);
        }
    }

    pub(crate) fn clear(&self) {
        for s in &self.shards {
            s.lock().clear();
        }
    }
}
