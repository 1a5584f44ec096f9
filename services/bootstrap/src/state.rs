//! The registration table behind both APIs, and the rules for leases and replacement.
//!
//! Rules (vLLM's bootstrap server plus leases; see the crate docs for why):
//! - The key is `(dp_rank, tp_rank, pp_rank)`; one dp rank belongs to one engine at a time.
//! - Registering a worker that is already registered with the same engine id and the same addr
//!   **renews** its lease (that is the heartbeat). A different addr for the same key is a
//!   duplicate (400), unless the old lease lapsed.
//! - A different engine id on a dp rank held by a live engine is an "Engine ID mismatch" (400),
//!   **except** when the new worker's addr is one of the old engine's addrs on that dp rank: that
//!   is the engine restarted in place, so the old engine's workers on that dp rank are replaced.
//! - A worker whose lease lapsed is gone: it disappears from queries, and anyone may take its
//!   key.
//!
//! State sits behind [`BootstrapState`] so a shared (etcd / `lunakv-meta` MetaStore) backend can
//! replace [`MemoryState`] for replicated bootstrap servers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

/// One registered worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub engine_id: String,
    pub dp_rank: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    /// Side-channel address as the engine sent it, e.g. `tcp://127.0.0.1:17000`.
    pub addr: String,
}

/// What `/query` shows for one dp rank.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DpEntry {
    pub engine_id: String,
    /// tp rank -> pp rank -> addr.
    pub workers: BTreeMap<u32, BTreeMap<u32, String>>,
}

/// A snapshot of the live table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table {
    pub entries: BTreeMap<u32, DpEntry>,
    pub version: u64,
}

/// A successful registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// True if this only renewed an existing lease.
    pub renewed: bool,
    /// Engine ids whose workers on this dp rank were replaced.
    pub replaced: Vec<String>,
    pub lease: Duration,
}

/// Why a registration is refused. Messages follow vLLM's bootstrap server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error(
        "Engine ID mismatch for dp_rank={dp_rank}: registered {registered}, got {got}; a different engine holds this dp rank (restart it on the same address, or wait for its lease to lapse)"
    )]
    EngineIdMismatch {
        dp_rank: u32,
        registered: String,
        got: String,
    },
    #[error(
        "Duplicate registration for dp_rank={dp_rank}, tp_rank={tp_rank}, pp_rank={pp_rank}: already registered at {addr}"
    )]
    Duplicate {
        dp_rank: u32,
        tp_rank: u32,
        pp_rank: u32,
        addr: String,
    },
    #[error("invalid registration: {0}")]
    Invalid(String),
}

/// The registration table. Implementations handle their own clock and lease expiry.
pub trait BootstrapState: Send + Sync + 'static {
    /// Registers or renews `w` with a lease of `ttl`.
    fn register(&self, w: Worker, ttl: Duration) -> Result<Registered, RegisterError>;
    /// Live workers only.
    fn query(&self) -> Table;
    /// Removes one worker, or all of `engine_id`'s when `ranks` is `None`; returns how many.
    fn deregister(&self, engine_id: &str, ranks: Option<(u32, u32, u32)>) -> usize;
    /// Extends the lease of a worker found alive by other means (a probe); false if unknown.
    fn renew(&self, w: &Worker) -> bool;
    /// Drops lapsed workers now; returns how many.
    fn expire(&self) -> usize;
    /// Every live worker (for the prober).
    fn workers(&self) -> Vec<Worker>;
    /// Fires with the new version after every change.
    fn subscribe(&self) -> watch::Receiver<u64>;
}

#[derive(Debug, Clone)]
struct Slot {
    engine_id: String,
    addr: String,
    expires: Instant,
    ttl: Duration,
}

/// The embedded, in-memory table (the default).
pub struct MemoryState {
    slots: Mutex<BTreeMap<(u32, u32, u32), Slot>>,
    version: watch::Sender<u64>,
}

impl Default for MemoryState {
    fn default() -> Self {
        MemoryState {
            slots: Mutex::new(BTreeMap::new()),
            version: watch::channel(0).0,
        }
    }
}

impl MemoryState {
    pub fn new() -> MemoryState {
        MemoryState::default()
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Removes lapsed slots; the caller holds the lock.
    fn sweep(slots: &mut BTreeMap<(u32, u32, u32), Slot>, now: Instant) -> usize {
        let before = slots.len();
        slots.retain(|k, s| {
            let keep = s.expires > now;
            if !keep {
                tracing::info!(engine_id = %s.engine_id, dp = k.0, tp = k.1, pp = k.2, addr = %s.addr, "bootstrap lease lapsed; worker removed");
            }
            keep
        });
        before - slots.len()
    }
}

fn same_addr(a: &str, b: &str) -> bool {
    fn strip(s: &str) -> &str {
        s.trim()
            .trim_start_matches("tcp://")
            .trim_start_matches("http://")
            .trim_end_matches('/')
    }
    strip(a).eq_ignore_ascii_case(strip(b))
}

impl BootstrapState for MemoryState {
    fn register(&self, w: Worker, ttl: Duration) -> Result<Registered, RegisterError> {
        if w.engine_id.is_empty() {
            return Err(RegisterError::Invalid("engine_id is empty".into()));
        }
        if w.addr.is_empty() {
            return Err(RegisterError::Invalid("addr is empty".into()));
        }
        let now = Instant::now();
        let mut slots = self.slots.lock();
        let mut changed = Self::sweep(&mut slots, now) > 0;
        let key = (w.dp_rank, w.tp_rank, w.pp_rank);
        let slot = Slot {
            engine_id: w.engine_id.clone(),
            addr: w.addr.clone(),
            expires: now + ttl,
            ttl,
        };
        // The engine holding this dp rank now (all live slots of a dp rank share one engine).
        let holder = slots
            .range((w.dp_rank, 0, 0)..=(w.dp_rank, u32::MAX, u32::MAX))
            .map(|(_, s)| s.engine_id.clone())
            .next();
        let mut replaced = Vec::new();
        match holder {
            Some(e) if e == w.engine_id => {
                if let Some(old) = slots.get(&key) {
                    if same_addr(&old.addr, &w.addr) {
                        slots.insert(key, slot);
                        drop(slots);
                        if changed {
                            self.bump();
                        }
                        return Ok(Registered {
                            renewed: true,
                            replaced,
                            lease: ttl,
                        });
                    }
                    return Err(RegisterError::Duplicate {
                        dp_rank: w.dp_rank,
                        tp_rank: w.tp_rank,
                        pp_rank: w.pp_rank,
                        addr: old.addr.clone(),
                    });
                }
            }
            Some(e) => {
                let restarted_in_place = slots
                    .range((w.dp_rank, 0, 0)..=(w.dp_rank, u32::MAX, u32::MAX))
                    .any(|(_, s)| same_addr(&s.addr, &w.addr));
                if !restarted_in_place {
                    return Err(RegisterError::EngineIdMismatch {
                        dp_rank: w.dp_rank,
                        registered: e,
                        got: w.engine_id,
                    });
                }
                slots.retain(|k, s| !(k.0 == w.dp_rank && s.engine_id == e));
                tracing::info!(dp = w.dp_rank, old = %e, new = %w.engine_id, addr = %w.addr, "engine restarted in place; replaced its stale registration");
                replaced.push(e);
            }
            None => {}
        }
        slots.insert(key, slot);
        changed = true;
        drop(slots);
        if changed {
            self.bump();
        }
        Ok(Registered {
            renewed: false,
            replaced,
            lease: ttl,
        })
    }

    fn query(&self) -> Table {
        let mut slots = self.slots.lock();
        if Self::sweep(&mut slots, Instant::now()) > 0 {
            self.bump();
        }
        let mut entries: BTreeMap<u32, DpEntry> = BTreeMap::new();
        for ((dp, tp, pp), s) in slots.iter() {
            let e = entries.entry(*dp).or_default();
            e.engine_id.clone_from(&s.engine_id);
            e.workers
                .entry(*tp)
                .or_default()
                .insert(*pp, s.addr.clone());
        }
        Table {
            entries,
            version: *self.version.borrow(),
        }
    }

    fn deregister(&self, engine_id: &str, ranks: Option<(u32, u32, u32)>) -> usize {
        let mut slots = self.slots.lock();
        let before = slots.len();
        slots.retain(|k, s| !(s.engine_id == engine_id && ranks.is_none_or(|r| r == *k)));
        let n = before - slots.len();
        drop(slots);
        if n > 0 {
            self.bump();
        }
        n
    }

    fn renew(&self, w: &Worker) -> bool {
        let mut slots = self.slots.lock();
        match slots.get_mut(&(w.dp_rank, w.tp_rank, w.pp_rank)) {
            Some(s) if s.engine_id == w.engine_id && s.expires > Instant::now() => {
                s.expires = Instant::now() + s.ttl;
                true
            }
            _ => false,
        }
    }

    fn expire(&self) -> usize {
        let n = Self::sweep(&mut self.slots.lock(), Instant::now());
        if n > 0 {
            self.bump();
        }
        n
    }

    fn workers(&self) -> Vec<Worker> {
        let now = Instant::now();
        self.slots
            .lock()
            .iter()
            .filter(|(_, s)| s.expires > now)
            .map(|((dp, tp, pp), s)| Worker {
                engine_id: s.engine_id.clone(),
                dp_rank: *dp,
                tp_rank: *tp,
                pp_rank: *pp,
                addr: s.addr.clone(),
            })
            .collect()
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(engine: &str, dp: u32, tp: u32, addr: &str) -> Worker {
        Worker {
            engine_id: engine.into(),
            dp_rank: dp,
            tp_rank: tp,
            pp_rank: 0,
            addr: addr.into(),
        }
    }

    const TTL: Duration = Duration::from_secs(30);

    #[test]
    fn vllm_rules_mismatch_and_duplicate() {
        let s = MemoryState::new();
        s.register(w("A", 0, 0, "tcp://h:1"), TTL).unwrap();
        s.register(w("A", 0, 1, "tcp://h:2"), TTL).unwrap();
        let e = s.register(w("B", 0, 2, "tcp://h:9"), TTL).unwrap_err();
        assert!(matches!(e, RegisterError::EngineIdMismatch { .. }), "{e}");
        assert!(e.to_string().starts_with("Engine ID mismatch"));
        let e = s.register(w("A", 0, 0, "tcp://h:3"), TTL).unwrap_err();
        assert!(matches!(e, RegisterError::Duplicate { .. }), "{e}");
        // Another dp rank may hold another engine.
        s.register(w("B", 1, 0, "tcp://h:9"), TTL).unwrap();
        let t = s.query();
        assert_eq!(t.entries[&0].engine_id, "A");
        assert_eq!(t.entries[&0].workers[&1][&0], "tcp://h:2");
        assert_eq!(t.entries[&1].engine_id, "B");
    }

    #[test]
    fn same_worker_renews_and_restart_in_place_replaces() {
        let s = MemoryState::new();
        s.register(w("A", 0, 0, "tcp://h:1"), TTL).unwrap();
        s.register(w("A", 0, 1, "tcp://h:2"), TTL).unwrap();
        let r = s.register(w("A", 0, 0, "tcp://h:1"), TTL).unwrap();
        assert!(r.renewed);
        let r = s.register(w("A2", 0, 0, "tcp://h:1"), TTL).unwrap();
        assert_eq!(r.replaced, vec!["A".to_string()]);
        let t = s.query();
        assert_eq!(t.entries[&0].engine_id, "A2");
        assert_eq!(
            t.entries[&0].workers.len(),
            1,
            "the old engine's other workers are gone"
        );
    }

    #[test]
    fn lapsed_leases_disappear_and_free_the_rank() {
        let s = MemoryState::new();
        let mut rx = s.subscribe();
        s.register(w("A", 0, 0, "tcp://h:1"), Duration::from_millis(50))
            .unwrap();
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        std::thread::sleep(Duration::from_millis(80));
        assert!(s.query().entries.is_empty());
        assert!(rx.has_changed().unwrap());
        s.register(w("B", 0, 0, "tcp://other:1"), TTL).unwrap();
        assert_eq!(s.query().entries[&0].engine_id, "B");
        assert_eq!(s.deregister("B", None), 1);
        assert!(s.query().entries.is_empty());
    }
}
