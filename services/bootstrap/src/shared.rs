//! The shared table: bootstrap replicas that point at one MetaStore (etcd) serve one set of
//! registrations, so an engine registered through replica A is found through replica B.
//!
//! Layout: one key per dp rank, `<prefix>dp/<dp_rank>`, whose value is the JSON list of that
//! rank's worker slots with their lease deadlines (wall-clock ms). The prefix is
//! `mooncake-store/<cluster_id>/bootstrap/<group>/` (see `lunakv_meta::layout`). Every rule of
//! [`crate::state`] looks at one dp rank only, so a change is read-modify-write of one key with
//! compare-and-swap, retried on conflict: two replicas registering workers of one rank at the
//! same time both land, and no rule is checked against a stale view.
//!
//! Leases are deadlines in the value rather than etcd leases: an engine that registered once
//! and never again (vLLM) is kept alive by whichever replica's prober reaches it, which is a
//! rewrite of the deadline, and the same code runs on every MetaStore backend (tests use the
//! in-memory one). Lapsed workers are invisible to queries at once and deleted by the next
//! replica's upkeep. Watchers on one replica hear about another replica's changes at that
//! upkeep (every lease/4).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lunakv_meta::{CasOutcome, MetaError, MetaStore};
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::state::{
    BootstrapState, Change, Counts, DpEntry, DpSlots, Limits, Origin, ProbeTarget, RegisterError,
    Registered, Slot, StateError, Table, Worker, apply_deregister, apply_register, apply_renew,
    live_entry, live_table, live_targets, live_workers, now_ms, sweep, validate,
};

/// Compare-and-swap attempts before a change gives up (only under heavy contention).
const CAS_ATTEMPTS: usize = 32;

fn unavailable(e: MetaError) -> StateError {
    StateError::Unavailable(e.to_string())
}

/// The MetaStore-backed table.
pub struct SharedState {
    store: Arc<dyn MetaStore>,
    prefix: String,
    version: watch::Sender<u64>,
    /// The live table as this replica last saw it (to tell watchers about others' changes).
    seen: Mutex<BTreeMap<u32, DpEntry>>,
    limits: Limits,
}

impl SharedState {
    /// Registrations under `prefix` (ends with `/`) of `store`.
    pub fn new(store: Arc<dyn MetaStore>, prefix: impl Into<String>) -> SharedState {
        let mut prefix = prefix.into();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        SharedState {
            store,
            prefix,
            version: watch::channel(0).0,
            seen: Mutex::new(BTreeMap::new()),
            limits: Limits::DEFAULT,
        }
    }

    pub fn with_limits(mut self, limits: Limits) -> SharedState {
        self.limits = limits;
        self
    }

    /// `mooncake-store/<cluster_id>/bootstrap/<group>/`.
    pub fn prefix_for(cluster_id: &str, group: &str) -> String {
        format!(
            "{}{}{group}/",
            lunakv_meta::layout::cluster_prefix(cluster_id),
            lunakv_meta::layout::BOOTSTRAP_PREFIX
        )
    }

    fn key(&self, dp: u32) -> String {
        format!("{}dp/{dp}", self.prefix)
    }

    fn decode(&self, key: &str, bytes: Option<&[u8]>) -> DpSlots {
        let Some(b) = bytes else {
            return DpSlots::new();
        };
        match serde_json::from_slice::<Vec<Slot>>(b) {
            Ok(v) => v.into_iter().map(|s| ((s.tp, s.pp), s)).collect(),
            Err(e) => {
                // Not ours, or from a newer version: start the rank afresh rather than refuse
                // every registration on it forever.
                tracing::warn!(%key, error = %e, "unreadable bootstrap entry; treating the dp rank as empty");
                DpSlots::new()
            }
        }
    }

    fn encode(slots: &DpSlots) -> Vec<u8> {
        let v: Vec<&Slot> = slots.values().collect();
        serde_json::to_vec(&v).unwrap_or_default()
    }

    /// Applies `f` to dp rank `dp` with compare-and-swap, retrying on a conflicting write.
    async fn update<T, E: From<StateError>>(
        &self,
        dp: u32,
        mut f: impl FnMut(&mut DpSlots, u64) -> Result<(T, Change), E>,
    ) -> Result<T, E> {
        let key = self.key(dp);
        for _ in 0..CAS_ATTEMPTS {
            let cur = self.store.get(&key).await.map_err(unavailable)?;
            let mut slots = self.decode(&key, cur.as_deref());
            let (out, change) = f(&mut slots, now_ms())?;
            if change == Change::None {
                return Ok(out);
            }
            let new = (!slots.is_empty()).then(|| Self::encode(&slots));
            match self
                .store
                .compare_and_swap(&key, cur.as_deref(), new.as_deref())
                .await
                .map_err(unavailable)?
            {
                CasOutcome::Swapped => {
                    if change == Change::Table {
                        // What this replica now knows of the rank, so a later observation
                        // compares against it (and a lapse after this change is noticed).
                        let mut seen = self.seen.lock();
                        match live_entry(&slots, now_ms()) {
                            Some(e) => seen.insert(dp, e),
                            None => seen.remove(&dp),
                        };
                        drop(seen);
                        self.version.send_modify(|v| *v += 1);
                    }
                    return Ok(out);
                }
                CasOutcome::Conflict { .. } => continue,
            }
        }
        Err(StateError::Unavailable(format!(
            "{key} kept changing under {CAS_ATTEMPTS} compare-and-swap attempts"
        ))
        .into())
    }

    /// Every dp rank's slots, as stored (lapsed ones included).
    async fn load(&self) -> Result<BTreeMap<u32, DpSlots>, StateError> {
        let items = self
            .store
            .list_prefix(&format!("{}dp/", self.prefix))
            .await
            .map_err(unavailable)?;
        Ok(items
            .into_iter()
            .filter_map(|(k, v)| {
                let dp = k.rsplit('/').next()?.parse::<u32>().ok()?;
                Some((dp, self.decode(&k, Some(&v))))
            })
            .collect())
    }

    /// The live table; bumps the version when it differs from what this replica last saw.
    fn observe(&self, ranks: &BTreeMap<u32, DpSlots>, now: u64) -> BTreeMap<u32, DpEntry> {
        let entries = live_table(ranks, now);
        let mut seen = self.seen.lock();
        if *seen != entries {
            seen.clone_from(&entries);
            self.version.send_modify(|v| *v += 1);
        }
        entries
    }
}

#[async_trait]
impl BootstrapState for SharedState {
    async fn register(
        &self,
        w: Worker,
        ttl: Duration,
        origin: Origin,
    ) -> Result<Registered, RegisterError> {
        validate(&w)?;
        let limits = self.limits;
        let first = self
            .update(w.dp_rank, |slots, now| {
                apply_register(slots, &w, ttl, now, origin, &limits, None)
            })
            .await;
        match first {
            Err(crate::state::Refused::NeedCounts) => {}
            r => return r.map_err(Into::into),
        }
        // A new worker: count the other ranks (one listing, only for new workers, never for
        // the renewals that are most registrations), then apply again.
        let mut ranks = self.load().await?;
        ranks.remove(&w.dp_rank);
        let others = Counts::of(ranks.values(), origin.peer.to_canonical(), now_ms());
        self.update(w.dp_rank, |slots, now| {
            apply_register(slots, &w, ttl, now, origin, &limits, Some(&others))
        })
        .await
        .map_err(Into::into)
    }

    async fn query(&self) -> Result<Table, StateError> {
        let ranks = self.load().await?;
        Ok(Table {
            entries: self.observe(&ranks, now_ms()),
            version: *self.version.borrow(),
        })
    }

    async fn deregister(
        &self,
        engine_id: &str,
        ranks: Option<(u32, u32, u32)>,
    ) -> Result<usize, StateError> {
        let dps: Vec<u32> = match ranks {
            Some((dp, _, _)) => vec![dp],
            None => self.load().await?.into_keys().collect(),
        };
        let mut n = 0;
        for dp in dps {
            let one = ranks.map(|(_, tp, pp)| (tp, pp));
            n += self
                .update::<_, StateError>(dp, |slots, _| Ok(apply_deregister(slots, engine_id, one)))
                .await?;
        }
        Ok(n)
    }

    async fn renew(&self, w: &Worker) -> Result<bool, StateError> {
        self.update::<_, StateError>(w.dp_rank, |slots, now| Ok(apply_renew(slots, w, now)))
            .await
    }

    async fn expire(&self) -> Result<usize, StateError> {
        let now = now_ms();
        let ranks = self.load().await?;
        let mut n = 0;
        for (dp, slots) in &ranks {
            if slots.values().any(|s| s.expires_ms <= now) {
                n += self
                    .update::<_, StateError>(*dp, |slots, now| {
                        let k = sweep(slots, *dp, now);
                        Ok((k, if k > 0 { Change::Table } else { Change::None }))
                    })
                    .await?;
            }
        }
        self.observe(&ranks, now);
        Ok(n)
    }

    async fn workers(&self) -> Result<Vec<Worker>, StateError> {
        Ok(live_workers(&self.load().await?, now_ms()))
    }

    async fn probe_targets(&self) -> Result<Vec<ProbeTarget>, StateError> {
        Ok(live_targets(&self.load().await?, now_ms()))
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::{O, SMALL, limits, rules, w};
    use lunakv_meta::MemMetaStore;

    #[tokio::test]
    async fn shared_state_follows_the_rules() {
        let store: Arc<dyn MetaStore> = Arc::new(MemMetaStore::new());
        rules(&SharedState::new(store, "t/")).await;
    }

    #[tokio::test]
    async fn shared_state_enforces_the_limits() {
        let store: Arc<dyn MetaStore> = Arc::new(MemMetaStore::new());
        limits(&SharedState::new(store, "t/").with_limits(SMALL)).await;
    }

    #[tokio::test]
    async fn replicas_share_one_table() {
        let store: Arc<dyn MetaStore> = Arc::new(MemMetaStore::new());
        let prefix = SharedState::prefix_for("c1", "g");
        assert_eq!(prefix, "mooncake-store/c1/bootstrap/g/");
        let (a, b) = (
            SharedState::new(store.clone(), &prefix),
            SharedState::new(store.clone(), &prefix),
        );
        let ttl = Duration::from_secs(30);
        a.register(w("E", 0, 0, "tcp://h:1"), ttl, O).await.unwrap();
        assert_eq!(b.query().await.unwrap().entries[&0].engine_id, "E");
        // B enforces A's registration.
        assert!(matches!(
            b.register(w("F", 0, 1, "tcp://h:2"), ttl, O).await,
            Err(RegisterError::EngineIdMismatch { .. })
        ));
        // A watcher on B hears about A's change at B's next upkeep.
        let mut rx = b.subscribe();
        rx.mark_unchanged();
        a.register(w("E", 1, 0, "tcp://h:3"), ttl, O).await.unwrap();
        b.expire().await.unwrap();
        assert!(rx.has_changed().unwrap());
        // Garbage under the prefix does not wedge the rank.
        store
            .put(&format!("{prefix}dp/7"), b"not json")
            .await
            .unwrap();
        b.register(w("G", 7, 0, "tcp://h:4"), ttl, O).await.unwrap();
        assert_eq!(a.query().await.unwrap().entries[&7].engine_id, "G");
    }
}
