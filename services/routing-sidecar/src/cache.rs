//! The bootstrap cache: prefill `host:port` -> the engines its bootstrap server announced.
//! Bounded (LRU 1024, like upstream) and, unlike upstream, an entry is dropped as soon as its
//! engine fails, so a restarted prefill engine is looked up again (llm-d #2187).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// What `/query` said: `(dp_rank, engine_id)` pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Engines {
    pub ranks: Vec<(u32, String)>,
}

impl Engines {
    /// Parses vLLM's `/query` answer; `None` if it lists no engine.
    pub fn from_query(v: &serde_json::Value) -> Option<Engines> {
        let mut ranks: Vec<(u32, String)> = v
            .as_object()?
            .iter()
            .filter_map(|(k, e)| {
                let dp = k.parse::<u32>().ok()?;
                let id = e.get("engine_id")?.as_str()?.to_string();
                Some((dp, id))
            })
            .collect();
        ranks.sort();
        (!ranks.is_empty()).then_some(Engines { ranks })
    }

    /// A random dp rank (upstream picks randomly too).
    pub fn pick(&self) -> &(u32, String) {
        let i = rand::random_range(0..self.ranks.len());
        &self.ranks[i]
    }
}

/// Entries with their last-use tick, and the tick counter.
type Lru = (HashMap<String, (Arc<Engines>, u64)>, u64);

pub struct BootstrapCache {
    cap: usize,
    inner: Mutex<Lru>,
}

impl BootstrapCache {
    pub fn new(cap: usize) -> Self {
        BootstrapCache {
            cap: cap.max(1),
            inner: Mutex::new((HashMap::new(), 0)),
        }
    }

    pub fn get(&self, key: &str) -> Option<Arc<Engines>> {
        let mut g = self.inner.lock();
        g.1 += 1;
        let tick = g.1;
        let e = g.0.get_mut(key)?;
        e.1 = tick;
        Some(e.0.clone())
    }

    pub fn insert(&self, key: &str, v: Arc<Engines>) {
        let mut g = self.inner.lock();
        g.1 += 1;
        let tick = g.1;
        if g.0.len() >= self.cap && !g.0.contains_key(key) {
            let oldest =
                g.0.iter()
                    .min_by_key(|(_, (_, t))| *t)
                    .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                g.0.remove(&k);
            }
        }
        g.0.insert(key.to_string(), (v, tick));
    }

    /// Drops `key`; true if it was cached.
    pub fn drop_entry(&self, key: &str) -> bool {
        self.inner.lock().0.remove(key).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_query_and_evicts_lru() {
        let v = serde_json::json!({"1": {"engine_id": "b", "worker_addr": {}}, "0": {"engine_id": "a", "worker_addr": {}}});
        let e = Engines::from_query(&v).unwrap();
        assert_eq!(e.ranks, vec![(0, "a".into()), (1, "b".into())]);
        assert!(Engines::from_query(&serde_json::json!({})).is_none());
        let c = BootstrapCache::new(2);
        c.insert("x", Arc::new(e.clone()));
        c.insert("y", Arc::new(e.clone()));
        c.get("x");
        c.insert("z", Arc::new(e));
        assert!(c.get("y").is_none());
        assert!(c.get("x").is_some());
        assert!(c.drop_entry("x"));
        assert!(!c.drop_entry("x"));
    }
}
