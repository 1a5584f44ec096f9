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
//! Every rule looks at one dp rank only, so the rules are written once, over `DpSlots`, and
//! both tables apply them: [`MemoryState`] (embedded, the default) and
//! [`crate::shared::SharedState`] (one MetaStore key per dp rank, shared by replicas).
//! Lease deadlines are wall-clock milliseconds, so replicas on different hosts agree on them
//! (their clocks must agree to well within a lease; NTP does that).
//!
//! Bounds (what an outside peer can grow): a new worker is refused once the table holds
//! [`Limits::max_registrations`] live workers, or its registering peer (source IP) holds
//! [`Limits::max_per_peer`]; a renewal is never refused. `engine_id` and `addr` are at most
//! [`MAX_FIELD_LEN`] bytes. Through several replicas the limits can be overshot by the
//! registrations that race each other on different dp ranks (each rank's change is atomic, the
//! count across ranks is not), at most one per replica at a time.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
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
    #[error(
        "lease_ttl_ms={value} is out of range: send 0 or leave it out for the default lease, or 1..={max} ms"
    )]
    LeaseOutOfRange { value: u64, max: u64 },
    #[error(
        "bootstrap table full: {limit} live registrations (--max-registrations={limit}); new workers are refused until leases lapse or engines deregister, or raise --max-registrations"
    )]
    TableFull { limit: usize },
    #[error(
        "peer {peer} already holds {limit} live registrations (--max-registrations-per-peer={limit}); new workers from it are refused until its leases lapse or it deregisters, or raise --max-registrations-per-peer"
    )]
    PeerFull { peer: IpAddr, limit: usize },
    /// The shared table's store did not answer; the engine should retry.
    #[error(transparent)]
    Unavailable(#[from] StateError),
}

/// The table's backing store failed (only the shared table has one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("bootstrap state store unavailable: {0}")]
    Unavailable(String),
}

/// Longest `engine_id` or `addr` accepted (vLLM sends a uuid and `tcp://ip:port`).
pub const MAX_FIELD_LEN: usize = 512;

/// How many live workers the table holds at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Live workers in the whole table (`--max-registrations`).
    pub max_registrations: usize,
    /// Live workers first registered from one source IP (`--max-registrations-per-peer`).
    pub max_per_peer: usize,
}

impl Limits {
    /// Far above any real deployment (a prefill deployment has dp x tp x pp workers), far below
    /// what hurts: a worker costs well under 1 KiB.
    pub const DEFAULT: Limits = Limits {
        max_registrations: 4096,
        max_per_peer: 256,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// Who registered a worker, as the listener saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    /// The registering connection's source IP (counted against [`Limits::max_per_peer`]).
    pub peer: IpAddr,
    /// Where the prober may dial the worker: its addr, checked at registration to be on the
    /// peer's host ([`on_peer_host`]). `None`: never probed.
    pub probe: Option<SocketAddr>,
}

impl Origin {
    /// A registration from `peer` whose worker is never probed.
    pub fn unprobed(peer: IpAddr) -> Origin {
        Origin { peer, probe: None }
    }
}

/// A live worker with what the prober needs (both `None` when an older version wrote it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    pub worker: Worker,
    pub peer: Option<IpAddr>,
    pub probe: Option<SocketAddr>,
}

/// The registration table. Implementations handle their own clock and lease expiry.
#[async_trait]
pub trait BootstrapState: Send + Sync + 'static {
    /// Registers or renews `w` with a lease of `ttl`, from `origin`. A renewal keeps the
    /// origin of the first registration.
    async fn register(
        &self,
        w: Worker,
        ttl: Duration,
        origin: Origin,
    ) -> Result<Registered, RegisterError>;
    /// Live workers only.
    async fn query(&self) -> Result<Table, StateError>;
    /// Removes one worker, or all of `engine_id`'s when `ranks` is `None`; returns how many.
    async fn deregister(
        &self,
        engine_id: &str,
        ranks: Option<(u32, u32, u32)>,
    ) -> Result<usize, StateError>;
    /// Extends the lease of a worker found alive by other means (a probe); false if unknown.
    async fn renew(&self, w: &Worker) -> Result<bool, StateError>;
    /// Drops lapsed workers now (and, for a shared table, notices other replicas' changes);
    /// returns how many were dropped.
    async fn expire(&self) -> Result<usize, StateError>;
    /// Every live worker.
    async fn workers(&self) -> Result<Vec<Worker>, StateError>;
    /// Every live worker with its registering peer (for the prober).
    async fn probe_targets(&self) -> Result<Vec<ProbeTarget>, StateError>;
    /// Fires with the new version after every change this replica sees.
    fn subscribe(&self) -> watch::Receiver<u64>;
}

/// Wall-clock milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One worker's registration within a dp rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Slot {
    pub tp: u32,
    pub pp: u32,
    pub engine_id: String,
    pub addr: String,
    /// Lease deadline, wall-clock ms.
    pub expires_ms: u64,
    pub ttl_ms: u64,
    /// Source IP of the first registration (absent in entries older replicas wrote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<IpAddr>,
    /// Where the prober may dial it ([`Origin::probe`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<SocketAddr>,
}

/// One dp rank's workers, keyed by `(tp_rank, pp_rank)`. All live slots share one engine id.
pub(crate) type DpSlots = BTreeMap<(u32, u32), Slot>;

/// What a rule did to a dp rank's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Nothing to write.
    None,
    /// Only lease deadlines moved: persist, but queries see no difference.
    Lease,
    /// Workers appeared or went: persist and tell watchers.
    Table,
}

impl Change {
    pub(crate) fn max(self, o: Change) -> Change {
        use Change::*;
        match (self, o) {
            (Table, _) | (_, Table) => Table,
            (Lease, _) | (_, Lease) => Lease,
            _ => None,
        }
    }
}

/// `addr` without its scheme and trailing slash: `host:port`.
pub(crate) fn host_port(addr: &str) -> &str {
    addr.trim()
        .trim_start_matches("tcp://")
        .trim_start_matches("http://")
        .trim_end_matches('/')
}

fn same_addr(a: &str, b: &str) -> bool {
    host_port(a).eq_ignore_ascii_case(host_port(b))
}

/// Where to probe `addr` if it names `peer`'s own host, else `None`. On the peer's host means
/// an `ip:port` whose IP is the peer's, or, for a peer on loopback (on this host: vLLM's
/// workers register at 127.0.0.1 or the pod's own IP and name their pod IP), one of the
/// addresses `local` lists: this host's interface addresses, not whole routed prefixes, so a
/// loopback peer naming 127.0.0.2 is not probed. A name is never probed: it could resolve
/// anywhere by the time it is dialled.
pub fn on_peer_host(
    addr: &str,
    peer: IpAddr,
    local: impl FnOnce() -> Vec<IpAddr>,
) -> Option<SocketAddr> {
    let sa: SocketAddr = host_port(addr).parse().ok()?;
    let ip = sa.ip().to_canonical();
    let peer = peer.to_canonical();
    let ok = ip == peer || (peer.is_loopback() && local().iter().any(|l| l.to_canonical() == ip));
    ok.then(|| SocketAddr::new(ip, sa.port()))
}

/// `ttl` in ms, at least 1, saturating (a lease is at most [`crate::MAX_LEASE`] anyway).
fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Removes lapsed slots of dp rank `dp`; returns how many.
pub(crate) fn sweep(slots: &mut DpSlots, dp: u32, now: u64) -> usize {
    let before = slots.len();
    slots.retain(|_, s| {
        let keep = s.expires_ms > now;
        if !keep {
            tracing::info!(engine_id = %s.engine_id, dp, tp = s.tp, pp = s.pp, addr = %s.addr, "bootstrap lease lapsed; worker removed");
        }
        keep
    });
    before - slots.len()
}

/// Checks the fields every backend requires.
pub(crate) fn validate(w: &Worker) -> Result<(), RegisterError> {
    for (field, v) in [("engine_id", &w.engine_id), ("addr", &w.addr)] {
        if v.is_empty() {
            return Err(RegisterError::Invalid(format!("{field} is empty")));
        }
        if v.len() > MAX_FIELD_LEN {
            return Err(RegisterError::Invalid(format!(
                "{field} is {} bytes; at most {MAX_FIELD_LEN} are accepted",
                v.len()
            )));
        }
    }
    Ok(())
}

/// Live workers outside the dp rank being changed: all of them, and those `peer` registered.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counts {
    pub total: usize,
    pub peer: usize,
}

impl Counts {
    /// Over `ranks` (which must not hold the rank being changed).
    pub(crate) fn of<'a>(
        ranks: impl IntoIterator<Item = &'a DpSlots>,
        peer: IpAddr,
        now: u64,
    ) -> Counts {
        let mut c = Counts::default();
        for s in ranks.into_iter().flat_map(|r| r.values()) {
            if s.expires_ms > now {
                c.total += 1;
                c.peer += usize::from(s.peer == Some(peer));
            }
        }
        c
    }
}

/// Why [`apply_register`] did not register.
#[derive(Debug)]
pub(crate) enum Refused {
    Rule(RegisterError),
    /// The registration adds a worker: call again with the [`Counts`] of the other dp ranks.
    NeedCounts,
}

impl From<RegisterError> for Refused {
    fn from(e: RegisterError) -> Self {
        Refused::Rule(e)
    }
}

impl From<StateError> for Refused {
    fn from(e: StateError) -> Self {
        Refused::Rule(e.into())
    }
}

impl From<Refused> for RegisterError {
    fn from(r: Refused) -> Self {
        match r {
            Refused::Rule(e) => e,
            // Callers pass the counts on the second call, so this is never reached.
            Refused::NeedCounts => RegisterError::Unavailable(StateError::Unavailable(
                "registration needed the table's counts twice".into(),
            )),
        }
    }
}

/// Whether `after` (this rank once the registration is applied) fits the limits, given the
/// other ranks' `others`. Only growth is checked: a change that adds no worker (overall, or of
/// `peer`'s) is never refused, even over a limit that was lowered since.
fn admit(
    before: &DpSlots,
    after: &DpSlots,
    peer: IpAddr,
    limits: &Limits,
    others: Option<&Counts>,
) -> Result<(), Refused> {
    let of_peer = |s: &DpSlots| s.values().filter(|s| s.peer == Some(peer)).count();
    let (peer_before, peer_after) = (of_peer(before), of_peer(after));
    let grows_total = after.len() > before.len();
    let grows_peer = peer_after > peer_before;
    if !grows_total && !grows_peer {
        return Ok(());
    }
    let Some(o) = others else {
        return Err(Refused::NeedCounts);
    };
    if grows_total && o.total.saturating_add(after.len()) > limits.max_registrations {
        return Err(RegisterError::TableFull {
            limit: limits.max_registrations,
        }
        .into());
    }
    if grows_peer && o.peer.saturating_add(peer_after) > limits.max_per_peer {
        return Err(RegisterError::PeerFull {
            peer,
            limit: limits.max_per_peer,
        }
        .into());
    }
    Ok(())
}

/// The registration rules (module docs) applied to `w`'s dp rank, from `peer`. A registration
/// that adds a worker needs `others` (the other ranks' [`Counts`]) to check the [`Limits`];
/// without them it answers [`Refused::NeedCounts`] having changed nothing but lapsed slots.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply_register(
    slots: &mut DpSlots,
    w: &Worker,
    ttl: Duration,
    now: u64,
    origin: Origin,
    limits: &Limits,
    others: Option<&Counts>,
) -> Result<(Registered, Change), Refused> {
    let mut change = if sweep(slots, w.dp_rank, now) > 0 {
        Change::Table
    } else {
        Change::None
    };
    let peer = origin.peer.to_canonical();
    let key = (w.tp_rank, w.pp_rank);
    let ttl_ms = ttl_ms(ttl);
    let mut slot = Slot {
        tp: w.tp_rank,
        pp: w.pp_rank,
        engine_id: w.engine_id.clone(),
        addr: w.addr.clone(),
        expires_ms: now.saturating_add(ttl_ms),
        ttl_ms,
        peer: Some(peer),
        probe: origin.probe,
    };
    // The engine holding this dp rank now.
    let holder = slots.values().map(|s| s.engine_id.clone()).next();
    let mut replaced = Vec::new();
    let mut next = slots.clone();
    match holder {
        Some(e) if e == w.engine_id => {
            if let Some(old) = slots.get(&key) {
                if same_addr(&old.addr, &w.addr) {
                    // A renewal: the worker stays whoever registered it first (and probed, or
                    // not, as decided then), unless an older version left no peer.
                    if old.peer.is_some() {
                        slot.peer = old.peer;
                        slot.probe = old.probe;
                    }
                    slots.insert(key, slot);
                    let registered = Registered {
                        renewed: true,
                        replaced,
                        lease: ttl,
                    };
                    return Ok((registered, change.max(Change::Lease)));
                }
                return Err(RegisterError::Duplicate {
                    dp_rank: w.dp_rank,
                    tp_rank: w.tp_rank,
                    pp_rank: w.pp_rank,
                    addr: old.addr.clone(),
                }
                .into());
            }
        }
        Some(e) => {
            let restarted_in_place = slots.values().any(|s| same_addr(&s.addr, &w.addr));
            if !restarted_in_place {
                return Err(RegisterError::EngineIdMismatch {
                    dp_rank: w.dp_rank,
                    registered: e,
                    got: w.engine_id.clone(),
                }
                .into());
            }
            next.retain(|_, s| s.engine_id != e);
            replaced.push(e);
        }
        None => {}
    }
    next.insert(key, slot);
    admit(slots, &next, peer, limits, others)?;
    if let Some(old) = replaced.first() {
        tracing::info!(dp = w.dp_rank, %old, new = %w.engine_id, addr = %w.addr, "engine restarted in place; replaced its stale registration");
    }
    *slots = next;
    change = Change::Table;
    Ok((
        Registered {
            renewed: false,
            replaced,
            lease: ttl,
        },
        change,
    ))
}

/// Extends `w`'s lease if it is registered and live.
pub(crate) fn apply_renew(slots: &mut DpSlots, w: &Worker, now: u64) -> (bool, Change) {
    match slots.get_mut(&(w.tp_rank, w.pp_rank)) {
        Some(s) if s.engine_id == w.engine_id && s.expires_ms > now => {
            s.expires_ms = now.saturating_add(s.ttl_ms);
            (true, Change::Lease)
        }
        _ => (false, Change::None),
    }
}

/// Removes `engine_id`'s worker `(tp, pp)`, or all its workers when `ranks` is `None`.
pub(crate) fn apply_deregister(
    slots: &mut DpSlots,
    engine_id: &str,
    ranks: Option<(u32, u32)>,
) -> (usize, Change) {
    let before = slots.len();
    slots.retain(|k, s| !(s.engine_id == engine_id && ranks.is_none_or(|r| r == *k)));
    let n = before - slots.len();
    (n, if n > 0 { Change::Table } else { Change::None })
}

/// The live part of a dp rank, as `/query` shows it.
pub(crate) fn live_entry(slots: &DpSlots, now: u64) -> Option<DpEntry> {
    let mut e: Option<DpEntry> = None;
    for s in slots.values().filter(|s| s.expires_ms > now) {
        let e = e.get_or_insert_with(DpEntry::default);
        e.engine_id.clone_from(&s.engine_id);
        e.workers
            .entry(s.tp)
            .or_default()
            .insert(s.pp, s.addr.clone());
    }
    e
}

/// The live table, dp rank by dp rank.
pub(crate) fn live_table(ranks: &BTreeMap<u32, DpSlots>, now: u64) -> BTreeMap<u32, DpEntry> {
    ranks
        .iter()
        .filter_map(|(dp, s)| Some((*dp, live_entry(s, now)?)))
        .collect()
}

/// Every live worker of the table, with its registering peer.
pub(crate) fn live_targets(ranks: &BTreeMap<u32, DpSlots>, now: u64) -> Vec<ProbeTarget> {
    ranks
        .iter()
        .flat_map(|(dp, slots)| {
            slots
                .values()
                .filter(move |s| s.expires_ms > now)
                .map(move |s| ProbeTarget {
                    worker: Worker {
                        engine_id: s.engine_id.clone(),
                        dp_rank: *dp,
                        tp_rank: s.tp,
                        pp_rank: s.pp,
                        addr: s.addr.clone(),
                    },
                    peer: s.peer,
                    probe: s.probe,
                })
        })
        .collect()
}

/// Every live worker of the table.
pub(crate) fn live_workers(ranks: &BTreeMap<u32, DpSlots>, now: u64) -> Vec<Worker> {
    live_targets(ranks, now)
        .into_iter()
        .map(|t| t.worker)
        .collect()
}

/// The embedded, in-memory table (the default).
pub struct MemoryState {
    ranks: Mutex<BTreeMap<u32, DpSlots>>,
    version: watch::Sender<u64>,
    limits: Limits,
}

impl Default for MemoryState {
    fn default() -> Self {
        MemoryState {
            ranks: Mutex::new(BTreeMap::new()),
            version: watch::channel(0).0,
            limits: Limits::DEFAULT,
        }
    }
}

impl MemoryState {
    pub fn new() -> MemoryState {
        MemoryState::default()
    }

    pub fn with_limits(mut self, limits: Limits) -> MemoryState {
        self.limits = limits;
        self
    }

    fn bump(&self, c: Change) {
        if c == Change::Table {
            self.version.send_modify(|v| *v += 1);
        }
    }

    /// Drops lapsed workers of every dp rank; the caller holds the lock.
    fn sweep_all(ranks: &mut BTreeMap<u32, DpSlots>, now: u64) -> usize {
        let n = ranks.iter_mut().map(|(dp, s)| sweep(s, *dp, now)).sum();
        ranks.retain(|_, s| !s.is_empty());
        n
    }
}

#[async_trait]
impl BootstrapState for MemoryState {
    async fn register(
        &self,
        w: Worker,
        ttl: Duration,
        origin: Origin,
    ) -> Result<Registered, RegisterError> {
        validate(&w)?;
        let now = now_ms();
        let mut ranks = self.ranks.lock();
        // Out of the map while it changes, so the other ranks can be counted beside it.
        let mut slots = ranks.remove(&w.dp_rank).unwrap_or_default();
        let mut r = apply_register(&mut slots, &w, ttl, now, origin, &self.limits, None);
        if matches!(r, Err(Refused::NeedCounts)) {
            let others = Counts::of(ranks.values(), origin.peer.to_canonical(), now);
            r = apply_register(
                &mut slots,
                &w,
                ttl,
                now,
                origin,
                &self.limits,
                Some(&others),
            );
        }
        if !slots.is_empty() {
            ranks.insert(w.dp_rank, slots);
        }
        drop(ranks);
        let (registered, change) = r?;
        self.bump(change);
        Ok(registered)
    }

    async fn query(&self) -> Result<Table, StateError> {
        let now = now_ms();
        let mut ranks = self.ranks.lock();
        if Self::sweep_all(&mut ranks, now) > 0 {
            self.bump(Change::Table);
        }
        Ok(Table {
            entries: live_table(&ranks, now),
            version: *self.version.borrow(),
        })
    }

    async fn deregister(
        &self,
        engine_id: &str,
        ranks: Option<(u32, u32, u32)>,
    ) -> Result<usize, StateError> {
        let mut all = self.ranks.lock();
        let mut n = 0;
        for (dp, slots) in all.iter_mut() {
            match ranks {
                Some((d, tp, pp)) if d == *dp => {
                    n += apply_deregister(slots, engine_id, Some((tp, pp))).0
                }
                Some(_) => {}
                None => n += apply_deregister(slots, engine_id, None).0,
            }
        }
        all.retain(|_, s| !s.is_empty());
        drop(all);
        if n > 0 {
            self.bump(Change::Table);
        }
        Ok(n)
    }

    async fn renew(&self, w: &Worker) -> Result<bool, StateError> {
        let mut ranks = self.ranks.lock();
        Ok(ranks
            .get_mut(&w.dp_rank)
            .is_some_and(|s| apply_renew(s, w, now_ms()).0))
    }

    async fn expire(&self) -> Result<usize, StateError> {
        let n = Self::sweep_all(&mut self.ranks.lock(), now_ms());
        if n > 0 {
            self.bump(Change::Table);
        }
        Ok(n)
    }

    async fn workers(&self) -> Result<Vec<Worker>, StateError> {
        Ok(live_workers(&self.ranks.lock(), now_ms()))
    }

    async fn probe_targets(&self) -> Result<Vec<ProbeTarget>, StateError> {
        Ok(live_targets(&self.ranks.lock(), now_ms()))
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn w(engine: &str, dp: u32, tp: u32, addr: &str) -> Worker {
        Worker {
            engine_id: engine.into(),
            dp_rank: dp,
            tp_rank: tp,
            pp_rank: 0,
            addr: addr.into(),
        }
    }

    const TTL: Duration = Duration::from_secs(30);
    pub(crate) const P: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    pub(crate) const O: Origin = Origin {
        peer: P,
        probe: None,
    };

    /// The limits every backend must enforce; `s` is built with [`SMALL`].
    pub(crate) const SMALL: Limits = Limits {
        max_registrations: 3,
        max_per_peer: 2,
    };

    pub(crate) async fn limits(s: &dyn BootstrapState) {
        let q = IpAddr::from([10, 0, 0, 2]);
        let r = IpAddr::from([10, 0, 0, 3]);
        s.register(w("A", 0, 0, "tcp://h:1"), TTL, O).await.unwrap();
        s.register(w("A", 0, 1, "tcp://h:2"), TTL, O).await.unwrap();
        let e = s
            .register(w("A", 0, 2, "tcp://h:3"), TTL, O)
            .await
            .unwrap_err();
        assert_eq!(e, RegisterError::PeerFull { peer: P, limit: 2 });
        assert!(
            e.to_string().contains("--max-registrations-per-peer=2"),
            "{e}"
        );
        // Another peer still gets in, on another dp rank too, up to the table's limit.
        s.register(w("B", 1, 0, "tcp://h:4"), TTL, Origin::unprobed(q))
            .await
            .unwrap();
        let e = s
            .register(w("C", 2, 0, "tcp://h:5"), TTL, Origin::unprobed(r))
            .await
            .unwrap_err();
        assert_eq!(e, RegisterError::TableFull { limit: 3 });
        assert!(e.to_string().contains("--max-registrations=3"), "{e}");
        // Full, yet renewals and restarts in place (no growth) go through, and the table
        // still answers.
        assert!(
            s.register(w("A", 0, 0, "tcp://h:1"), TTL, O)
                .await
                .unwrap()
                .renewed
        );
        let t = s
            .register(w("B2", 1, 0, "tcp://h:4"), TTL, Origin::unprobed(q))
            .await
            .unwrap();
        assert_eq!(t.replaced, vec!["B".to_string()]);
        assert_eq!(s.workers().await.unwrap().len(), 3);
        // Room again once a worker goes.
        assert_eq!(s.deregister("B2", None).await.unwrap(), 1);
        s.register(w("C", 2, 0, "tcp://h:5"), TTL, Origin::unprobed(r))
            .await
            .unwrap();
        // A lease of u64::MAX ms saturates instead of wrapping into the past.
        assert_eq!(s.deregister("C", None).await.unwrap(), 1);
        s.register(
            w("D", 3, 0, "tcp://h:6"),
            Duration::from_millis(u64::MAX),
            Origin::unprobed(r),
        )
        .await
        .unwrap();
        assert_eq!(s.query().await.unwrap().entries[&3].engine_id, "D");
        for e in ["A", "D"] {
            s.deregister(e, None).await.unwrap();
        }
    }

    #[tokio::test]
    async fn memory_state_enforces_the_limits() {
        limits(&MemoryState::new().with_limits(SMALL)).await;
    }

    /// The rules every backend must follow; the shared table's tests call this too.
    pub(crate) async fn rules(s: &dyn BootstrapState) {
        // vLLM's mismatch and duplicate.
        s.register(w("A", 0, 0, "tcp://h:1"), TTL, O).await.unwrap();
        s.register(w("A", 0, 1, "tcp://h:2"), TTL, O).await.unwrap();
        let e = s
            .register(w("B", 0, 2, "tcp://h:9"), TTL, O)
            .await
            .unwrap_err();
        assert!(matches!(e, RegisterError::EngineIdMismatch { .. }), "{e}");
        assert!(e.to_string().starts_with("Engine ID mismatch"));
        let e = s
            .register(w("A", 0, 0, "tcp://h:3"), TTL, O)
            .await
            .unwrap_err();
        assert!(matches!(e, RegisterError::Duplicate { .. }), "{e}");
        // Another dp rank may hold another engine.
        s.register(w("B", 1, 0, "tcp://h:9"), TTL, O).await.unwrap();
        let t = s.query().await.unwrap();
        assert_eq!(t.entries[&0].engine_id, "A");
        assert_eq!(t.entries[&0].workers[&1][&0], "tcp://h:2");
        assert_eq!(t.entries[&1].engine_id, "B");
        // The same worker again renews; a restart in place replaces every old worker of the rank.
        let r = s.register(w("A", 0, 0, "tcp://h:1"), TTL, O).await.unwrap();
        assert!(r.renewed);
        let r = s
            .register(w("A2", 0, 0, "tcp://h:1"), TTL, O)
            .await
            .unwrap();
        assert_eq!(r.replaced, vec!["A".to_string()]);
        let t = s.query().await.unwrap();
        assert_eq!(t.entries[&0].engine_id, "A2");
        assert_eq!(
            t.entries[&0].workers.len(),
            1,
            "the old engine's workers are gone"
        );
        assert!(s.renew(&w("A2", 0, 0, "tcp://h:1")).await.unwrap());
        assert!(!s.renew(&w("A", 0, 1, "tcp://h:2")).await.unwrap());
        assert_eq!(s.workers().await.unwrap().len(), 2);
        assert_eq!(s.deregister("B", None).await.unwrap(), 1);
        assert_eq!(s.deregister("A2", Some((0, 0, 0))).await.unwrap(), 1);
        assert!(s.query().await.unwrap().entries.is_empty());
        // A lapsed lease disappears, tells watchers, and frees the rank.
        let mut rx = s.subscribe();
        rx.mark_unchanged();
        s.register(w("A", 0, 0, "tcp://h:1"), Duration::from_millis(50), O)
            .await
            .unwrap();
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(s.query().await.unwrap().entries.is_empty());
        assert!(rx.has_changed().unwrap());
        s.register(w("B", 0, 0, "tcp://other:1"), TTL, O)
            .await
            .unwrap();
        assert_eq!(s.query().await.unwrap().entries[&0].engine_id, "B");
        assert_eq!(s.deregister("B", None).await.unwrap(), 1);
    }

    #[tokio::test]
    async fn memory_state_follows_the_rules() {
        rules(&MemoryState::new()).await;
    }
}
