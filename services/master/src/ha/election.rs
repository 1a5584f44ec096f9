//! Master high availability on etcd (`--enable_ha --etcd_endpoints=h1:2379;h2:2379`).
//!
//! N masters campaign for the leader key `mooncake-store/<cluster_id>/master_view` (upstream's
//! name) with a transaction "create if absent", attached to a lease (`ha_lease_ttl_sec`, 2 s)
//! that the leader renews every fifth of it. Followers watch the key and campaign as soon as it
//! disappears. With `ha_fast_takeover` they also dial the leader's RPC port, and revoke the
//! lease of a leader whose port refuses connections (its process is gone), so a crashed leader
//! is replaced in a few hundred milliseconds rather than after its lease. A follower answers every
//! RPC with `UNAVAILABLE` and the leader's address in the `x-lunakv-leader` metadata.
//!
//! **Terms.** Before campaigning a master increments `master/epoch` in etcd by compare-and-swap;
//! the winner's value is its term and the high 32 bits of every generation it issues, so two
//! leaders never issue the same generation.
//!
//! **Fencing.** The leader tracks its lease locally: deadline = time the renewal was *sent* +
//! granted TTL - a margin ([`LeaseTiming`]). etcd expires the lease no earlier than TTL after it *received*
//! that renewal, so the local deadline always passes first. Every RPC checks the deadline before
//! acting, and every mutating RPC checks it again (and that the term did not change) before
//! acknowledging, so an acknowledged write was applied while the lease was certainly held — a
//! process paused past its lease (SIGSTOP) refuses everything when it wakes. Its etcd writes are
//! also fenced by etcd itself ([`lunakv_meta::WriteFence`]: a transaction conditioned on the
//! leader key still carrying this lease), and FREEs to owners go out only while leading.
//!
//! **Takeover.** A new leader starts from an empty object index and rebuilds it from the
//! store-clients' inventories: they see the leader key change (they watch it), ping the new
//! leader, get `remount_required`, and mount again with their inventory. Until every segment
//! recorded in etcd has remounted (at most [`RECOVERY_GRACE`]) the new leader answers
//! object RPCs with `UNAVAILABLE` ("rebuilding"), so no client ever reads a half-built index as
//! "object not found".

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lunakv_meta::etcd::WatchEvent;
use lunakv_meta::layout::{self, LeaderView};
use lunakv_meta::{EtcdClient, MetaStore, WriteFence};
use lunakv_proto::headers::LeaderRedirect;
use parking_lot::RwLock;

use tokio::sync::watch;
use tonic::Status;

use crate::core::{CoreConfig, MasterCore};
use crate::ha::metrics::HaMetrics;
use crate::ha::recovery::{Access, RECOVERY_GRACE, RecoveryGate};
use crate::notifier::{FreeEntry, OffloadEntry, OwnerClient, OwnerError, OwnerOp, Promote};
use crate::persist;
use crate::slot::CoreSlot;

/// The most subtracted from the granted TTL for the local lease deadline: covers the renewal's
/// transit, scheduling delays and clock-rate differences between this host and etcd's. A short
/// lease uses a quarter of its TTL instead (see [`LeaseTiming`]).
pub const SAFETY_MARGIN: Duration = Duration::from_millis(1500);
/// How often standbys dial the leader's RPC port with `ha_fast_takeover` on.
pub const PROBE_EVERY: Duration = Duration::from_millis(100);
/// Consecutive refused dials before a standby revokes the leader's lease: one refusal could be
/// a listener being replaced; two, [`PROBE_EVERY`] apart, mean nothing is listening.
pub const PROBE_REFUSALS: u32 = 2;
/// Timeout of each etcd call made by the election loop.
pub const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Renewal period and local-deadline margin for a granted lease TTL.
///
/// After a crash the lease outlives the leader by the TTL minus the time since its last
/// renewal, so the TTL is the failover floor when a leader's host dies; the renewal period and
/// the margin then decide how long a busy leader may go without a renewal before it fences
/// itself: TTL - margin - period (1.1 s at the default 2 s TTL: 400 ms renewals, 500 ms margin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    pub ttl: Duration,
    pub renew_every: Duration,
    pub margin: Duration,
}

impl LeaseTiming {
    pub fn for_ttl(ttl: Duration) -> LeaseTiming {
        LeaseTiming {
            ttl,
            renew_every: ttl / 5,
            margin: SAFETY_MARGIN.min(ttl / 4),
        }
    }

    /// Slack a renewal has before the local deadline passes.
    pub fn slack(&self) -> Duration {
        self.ttl.saturating_sub(self.margin + self.renew_every)
    }
}

/// Shared HA state: the role, the local lease deadline, the known leader.
pub struct HaState {
    base: Instant,
    /// Local lease deadline in ns since `base`; 0 = not leading.
    deadline_ns: AtomicU64,
    /// Term while leading, 0 otherwise.
    term: AtomicU64,
    /// The lease TTL etcd granted this master's term, in ms; 0 when not leading.
    granted_ttl_ms: AtomicU64,
    /// `ha_fast_takeover`, for /ha_status.
    fast_takeover: AtomicBool,
    recovery: RecoveryGate,
    leader: RwLock<Option<LeaderView>>,
    me: RwLock<LeaderView>,
    pub metrics: HaMetrics,
    pub cluster_id: String,
    pub etcd_endpoints: String,
}

/// This master's role, for /role and /health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Leader => "leader",
            Role::Follower => "follower",
        }
    }
}

impl HaState {
    pub fn new(cluster_id: &str, etcd_endpoints: &str) -> Arc<HaState> {
        Arc::new(HaState {
            base: Instant::now(),
            deadline_ns: AtomicU64::new(0),
            term: AtomicU64::new(0),
            granted_ttl_ms: AtomicU64::new(0),
            fast_takeover: AtomicBool::new(false),
            recovery: RecoveryGate::default(),
            leader: RwLock::new(None),
            me: RwLock::new(LeaderView {
                address: String::new(),
                admin: String::new(),
                term: 0,
            }),
            metrics: HaMetrics::new(),
            cluster_id: cluster_id.to_string(),
            etcd_endpoints: etcd_endpoints.to_string(),
        })
    }

    fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    fn at_ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_nanos() as u64
    }

    /// Whether this master holds a lease that cannot have expired in etcd yet.
    pub fn lease_valid(&self) -> bool {
        let d = self.deadline_ns.load(Ordering::Acquire);
        d != 0 && self.now_ns() < d
    }

    /// The term while leading with a valid lease.
    pub fn leading_term(&self) -> Option<u64> {
        let t = self.term.load(Ordering::Acquire);
        (t != 0 && self.lease_valid()).then_some(t)
    }

    pub fn role(&self) -> Role {
        if self.leading_term().is_some() {
            Role::Leader
        } else {
            Role::Follower
        }
    }

    /// The leader this master knows (itself when leading).
    pub fn leader(&self) -> Option<LeaderView> {
        self.leader.read().clone()
    }

    /// The lease TTL etcd granted this master, while it leads.
    pub fn granted_ttl(&self) -> Option<Duration> {
        let ms = self.granted_ttl_ms.load(Ordering::Acquire);
        (ms != 0 && self.role() == Role::Leader).then(|| Duration::from_millis(ms))
    }

    /// Whether standbys revoke a dead leader's lease (`ha_fast_takeover`).
    pub fn fast_takeover(&self) -> bool {
        self.fast_takeover.load(Ordering::Relaxed)
    }

    /// Time left on the local lease, when leading.
    pub fn lease_left(&self) -> Option<Duration> {
        let d = self.deadline_ns.load(Ordering::Acquire);
        let now = self.now_ns();
        (d != 0 && now < d).then(|| Duration::from_nanos(d - now))
    }

    fn redirect(&self, why: &str) -> Status {
        // Never redirect to ourselves: a master that refuses does not lead (any more).
        let me = self.me.read().address.clone();
        let leader = self.leader().filter(|l| l.address != me);
        let message = match &leader {
            Some(l) => format!(
                "{why}; the leader is {} (term {}): follow it through etcd \
                 (master_server_address etcd://{}) or retry there",
                l.address, l.term, self.etcd_endpoints
            ),
            None => format!(
                "{why}; no leader is elected yet for cluster {:?}: retry in a moment",
                self.cluster_id
            ),
        };
        let leader = leader.map(|l| LeaderRedirect {
            address: l.address,
            term: l.term,
        });
        lunakv_proto::status::redirect(message, leader.as_ref())
    }

    /// Gate at the start of an RPC. Mounts (mount, ping, unmount) pass during recovery: they
    /// are how the index is rebuilt. Returns the term to re-check with [`HaState::confirm`],
    /// and `warm` when a read is admitted during the rebuild because the core started from a
    /// warm copy (a miss must then be retried, not answered "not found": the copy may lag the
    /// dead leader by a few changes).
    pub fn admit(&self, core: &MasterCore, access: Access) -> Result<(u64, bool), Status> {
        let term = self.term.load(Ordering::Acquire);
        if term == 0 {
            return Err(self.redirect("this lunakv-master is a follower"));
        }
        if !self.lease_valid() {
            self.metrics.fenced_writes_total.inc();
            return Err(self.redirect(
                "this lunakv-master's leader lease may have expired (etcd unreachable or the \
                 process was paused); it refuses requests and steps down",
            ));
        }
        if access != Access::Mount && !self.recovery.done(core) {
            if access == Access::Read && core.warm_start() {
                return Ok((term, true));
            }
            return Err(self.rebuilding(term));
        }
        Ok((term, false))
    }

    /// The "rebuilding" refusal of the leader of `term`.
    pub fn rebuilding(&self, term: u64) -> Status {
        RecoveryGate::refusal(&format!(
            "this lunakv-master was just elected leader (term {term})"
        ))
    }

    /// Gate before acknowledging a mutation admitted under `term`: the lease must still be
    /// valid and the term unchanged, so the mutation happened while leading.
    pub fn confirm(&self, term: u64) -> Result<(), Status> {
        if self.term.load(Ordering::Acquire) == term && self.lease_valid() {
            return Ok(());
        }
        self.metrics.fenced_writes_total.inc();
        Err(self.redirect(
            "this lunakv-master lost its leader lease while handling the request; it was not \
             acknowledged",
        ))
    }

    fn step_down(&self, reason: &str) {
        let was = self.term.swap(0, Ordering::AcqRel);
        self.deadline_ns.store(0, Ordering::Release);
        self.recovery.clear();
        self.metrics.is_leader.set(0);
        if was != 0 {
            *self.leader.write() = None;
            tracing::error!(
                term = was,
                reason,
                "stepping down: no longer the leader; refusing every request"
            );
        }
    }
}

/// Sends owner requests only while the core that issues them belongs to the current, leased
/// term: a deposed leader must not make owners drop entries the new leader indexed.
pub struct FencedOwnerClient {
    pub inner: Arc<dyn OwnerClient>,
    pub ha: Arc<HaState>,
    pub term: u64,
}

impl FencedOwnerClient {
    fn check(&self, op: OwnerOp, endpoint: &str) -> Result<(), OwnerError> {
        if self.ha.leading_term() != Some(self.term) {
            return Err(OwnerError::Deposed {
                op,
                endpoint: endpoint.to_string(),
                term: self.term,
            });
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl OwnerClient for FencedOwnerClient {
    fn set_owner_key(&self, endpoint: &str, secret: Option<lunakv_transfer::MountSecret>) {
        self.inner.set_owner_key(endpoint, secret);
    }

    async fn free(
        &self,
        endpoint: &str,
        entries: &[FreeEntry],
        timeout: Duration,
    ) -> Result<(), OwnerError> {
        self.check(OwnerOp::Free, endpoint)?;
        self.inner.free(endpoint, entries, timeout).await
    }

    // Every method is forwarded explicitly: the trait's defaults mean "cannot", and inheriting
    // them here once made every offload fail under HA.
    async fn offload(
        &self,
        endpoint: &str,
        entries: &[OffloadEntry],
        timeout: Duration,
    ) -> Result<crate::notifier::OffloadOutcome, OwnerError> {
        self.check(OwnerOp::Offload, endpoint)?;
        self.inner.offload(endpoint, entries, timeout).await
    }

    async fn promote(&self, endpoint: &str, req: &Promote) -> Result<(), OwnerError> {
        self.check(OwnerOp::Promote, endpoint)?;
        self.inner.promote(endpoint, req).await
    }
}

/// What the election loop needs.
pub struct Election {
    pub ha: Arc<HaState>,
    pub etcd: EtcdClient,
    /// The cluster's namespace in etcd, unfenced (epoch counter, reads).
    pub meta: Arc<dyn MetaStore>,
    pub fence: Arc<WriteFence>,
    /// The fenced namespace the service writes through (segment records).
    pub service_meta: Arc<dyn MetaStore>,
    pub slot: Arc<CoreSlot>,
    pub core_cfg: CoreConfig,
    pub notifier: Arc<dyn OwnerClient>,
    /// The KV event queue each won term's core feeds (`enable_kv_event_publish`).
    pub events: Option<crate::events::EventSink>,
    /// This master's addresses (published in the leader key).
    pub address: String,
    pub admin: String,
    /// `ha_lease_ttl_sec`: the TTL asked of etcd (which may raise it to its minimum).
    pub lease_ttl: Duration,
    /// `ha_fast_takeover`: revoke the lease of a leader whose port refuses connections.
    pub fast_takeover: bool,
    /// `ha_warm_standby`: the copy of the leader's index this standby keeps (None: off).
    pub warm: Option<Arc<crate::ha::standby::WarmCopy>>,
    /// The token a standby presents to the leader's `ReplicateIndex` (admin, else pool).
    pub token: Option<String>,
    /// TLS towards the leader when the RPC ports serve it (the master's own `LUNAKV_TLS_*`).
    pub tls: Option<lunakv_tls::ClientTls>,
}

impl Election {
    fn leader_key(&self) -> String {
        layout::leader_key(&self.ha.cluster_id)
    }

    fn etcd_down(&self, what: &str, e: &dyn std::fmt::Display, logged: &mut bool) {
        self.ha.metrics.etcd_up.set(0);
        if !*logged {
            tracing::error!(etcd = %self.etcd.endpoints(), error = %e, "etcd unreachable while {what}; retrying every 500 ms (followers cannot take over and the leader steps down when its lease runs out)");
            *logged = true;
        }
    }

    fn etcd_back(&self, logged: &mut bool) {
        self.ha.metrics.etcd_up.set(1);
        if *logged {
            tracing::info!(etcd = %self.etcd.endpoints(), "etcd reachable again");
            *logged = false;
        }
    }

    /// Campaigns, leads and follows until `stop` turns true.
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        {
            let mut me = self.ha.me.write();
            me.address = self.address.clone();
            me.admin = self.admin.clone();
        }
        self.ha
            .fast_takeover
            .store(self.fast_takeover, Ordering::Relaxed);
        let key = self.leader_key();
        let mut logged = false;
        // A lease of ours that may still hold the key (we stepped down while etcd was away):
        // revoked once etcd answers, so nobody waits for it to expire.
        let stale_lease = AtomicI64::new(0);
        loop {
            if *stop.borrow() {
                return;
            }
            let got = self.etcd.get_kv(key.as_bytes()).await;
            let (kv, rev) = match got {
                Ok(v) => {
                    self.etcd_back(&mut logged);
                    v
                }
                Err(e) => {
                    self.etcd_down("reading the leader key", &e, &mut logged);
                    if sleep_or_stop(&mut stop, Duration::from_millis(500)).await {
                        return;
                    }
                    continue;
                }
            };
            if let Some(kv) = kv {
                let stale = stale_lease.load(Ordering::Acquire);
                if stale != 0 && kv.lease == stale {
                    if self.etcd.lease_revoke(stale).await.is_ok() {
                        tracing::info!("revoked this master's old leader lease");
                        stale_lease.store(0, Ordering::Release);
                    }
                    continue;
                }
                let view = LeaderView::decode(&kv.value);
                if let Some(v) = &view {
                    self.ha.metrics.leader_term.set(v.term as i64);
                }
                let mut copying = self.follow_index(view.as_ref());
                *self.ha.leader.write() = view;
                // Follow until the key changes hands.
                let mut probe = self
                    .fast_takeover
                    .then(|| LeaderProbe::new(&kv, &self.address))
                    .flatten();
                match self.etcd.watch_key(key.as_bytes(), rev + 1).await {
                    Err(e) => {
                        self.etcd_down("watching the leader key", &e, &mut logged);
                        if sleep_or_stop(&mut stop, Duration::from_millis(500)).await {
                            return;
                        }
                    }
                    Ok(mut w) => loop {
                        let tick = async {
                            match probe.as_mut() {
                                Some(p) => p.dead().await,
                                None => std::future::pending().await,
                            }
                        };
                        tokio::select! {
                            _ = stop.changed() => return,
                            dead = tick => {
                                if dead && let Some(p) = probe.take() {
                                    self.revoke_dead_leader(&key, p).await;
                                }
                            }
                            ev = w.next() => match ev {
                                // A watch also ends while etcd is healthy (a member restarts,
                                // a connection is recycled): the read of the key that follows
                                // decides whether etcd is unreachable, not the stream.
                                Err(e) => {
                                    tracing::info!(error = %e, "the leader key watch ended; reading the key again");
                                    break;
                                }
                                Ok(events) => {
                                    let mut gone = false;
                                    for e in events {
                                        match e {
                                            WatchEvent::Delete(_) => gone = true,
                                            WatchEvent::Put(kv) => {
                                                let v = LeaderView::decode(&kv.value);
                                                if let Some(v) = &v {
                                                    self.ha.metrics.leader_term.set(v.term as i64);
                                                }
                                                copying = self.follow_index(v.as_ref());
                                                *self.ha.leader.write() = v;
                                                probe = self
                                                    .fast_takeover
                                                    .then(|| LeaderProbe::new(&kv, &self.address))
                                                    .flatten();
                                            }
                                        }
                                    }
                                    if gone {
                                        tracing::info!("the leader key is gone: campaigning");
                                        *self.ha.leader.write() = None;
                                        break;
                                    }
                                }
                            }
                        }
                    },
                }
                drop(copying);
                continue;
            }
            // No leader: campaign.
            match self.campaign().await {
                Ok(Some((lease, granted_at, ttl, term))) => {
                    stale_lease.store(lease, Ordering::Release);
                    let outcome = self.lead(lease, granted_at, ttl, term, &mut stop).await;
                    match outcome {
                        LeadOutcome::Stopped => return,
                        LeadOutcome::SteppedDown { revoked } => {
                            if revoked {
                                stale_lease.store(0, Ordering::Release);
                            }
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    self.etcd_down("campaigning", &e, &mut logged);
                    if sleep_or_stop(&mut stop, Duration::from_millis(500)).await {
                        return;
                    }
                }
            }
        }
    }

    /// Starts keeping the warm copy of `leader`'s index (`ha_warm_standby`); the copy stops
    /// following when the returned guard drops.
    fn follow_index(&self, leader: Option<&LeaderView>) -> Option<AbortOnDrop> {
        let (warm, leader) = (self.warm.as_ref()?, leader?);
        if leader.address == self.address {
            return None;
        }
        let task = tokio::spawn(warm.clone().follow(
            leader.address.clone(),
            self.address.clone(),
            self.token.clone(),
            self.tls.clone(),
        ));
        Some(AbortOnDrop(task))
    }

    /// Revokes the lease of a leader whose RPC port refused [`PROBE_REFUSALS`] dials in a row,
    /// if the key still carries that lease. A refused dial means nothing listens there: the
    /// process is gone (kill -9, OOM, crash) while its host is up, so it can accept no write,
    /// and waiting for its lease to expire would only keep the cluster without a leader. A
    /// paused or partitioned leader does not refuse (the kernel still accepts, or nothing
    /// answers), so it keeps the lease path and its fencing.
    async fn revoke_dead_leader(&self, key: &str, p: LeaderProbe) {
        let still = match self.etcd.get_kv(key.as_bytes()).await {
            Ok((Some(kv), _)) => kv.lease == p.lease,
            _ => false,
        };
        if !still {
            return;
        }
        match self.etcd.lease_revoke(p.lease).await {
            Ok(()) => {
                self.ha.metrics.fast_takeovers_total.inc();
                tracing::warn!(leader = %p.addr, lease = p.lease, "the leader's RPC port refuses connections (its process is gone): revoked its lease instead of waiting for it to expire");
            }
            Err(e) => {
                tracing::info!(leader = %p.addr, error = %e, "could not revoke a dead leader's lease; it expires on its own")
            }
        }
    }

    /// One attempt: bump the term, take a lease, create the key if absent. `Some` on a win.
    async fn campaign(
        &self,
    ) -> Result<Option<(i64, Instant, Duration, u64)>, persist::PersistError> {
        let term = persist::bump_epoch(self.meta.as_ref()).await?;
        let granted_at = Instant::now();
        let (lease, ttl) = self.etcd.lease_grant(self.lease_ttl).await?;
        let view = LeaderView {
            address: self.address.clone(),
            admin: self.admin.clone(),
            term: u64::from(term),
        };
        match self
            .etcd
            .create_if_absent(self.leader_key().as_bytes(), &view.encode(), lease)
            .await
        {
            Ok(None) => Ok(Some((
                lease,
                granted_at,
                Duration::from_secs(ttl.max(1) as u64),
                u64::from(term),
            ))),
            Ok(Some(holder)) => {
                let _ = self.etcd.lease_revoke(lease).await;
                let v = LeaderView::decode(&holder.value);
                tracing::info!(leader = ?v.as_ref().map(|v| &v.address), "another master won the election; following it");
                Ok(None)
            }
            Err(e) => {
                let _ = self.etcd.lease_revoke(lease).await;
                Err(e.into())
            }
        }
    }

    async fn lead(
        &self,
        lease: i64,
        granted_at: Instant,
        ttl: Duration,
        term: u64,
        stop: &mut watch::Receiver<bool>,
    ) -> LeadOutcome {
        let ha = &self.ha;
        let key = self.leader_key();
        let timing = LeaseTiming::for_ttl(ttl);
        let deadline_of =
            |sent: Instant, ttl: Duration| ha.at_ns(sent + ttl.saturating_sub(timing.margin));
        // A fresh core for this term: its epoch is the term, its index is rebuilt by remounts.
        let notifier: Arc<dyn OwnerClient> = Arc::new(FencedOwnerClient {
            inner: self.notifier.clone(),
            ha: ha.clone(),
            term,
        });
        let core = MasterCore::new(self.core_cfg.clone(), term as u32, notifier)
            .with_events(self.events.clone());
        // The warm copy, when it is a whole copy of the index of the leader this master saw
        // last (an older one could miss a removal whose FREE the owner has not handled yet).
        let last_term = u64::try_from(ha.metrics.leader_term.get()).unwrap_or(0);
        let warm = self.warm.as_ref().and_then(|w| w.take(last_term));
        let mut warm_segments = BTreeSet::new();
        if let Some(snap) = warm {
            warm_segments = snap.segments.iter().map(|(d, _)| d.name.clone()).collect();
            let keys = core.preload_warm(snap);
            tracing::info!(
                term,
                keys,
                segments = warm_segments.len(),
                from_term = last_term,
                "starting from the warm copy of the index: reads are answered at once, writes wait for the owners' remounts"
            );
        }
        self.slot.replace(Arc::new(core));
        let mut known: BTreeSet<String> = match persist::known_segments(self.meta.as_ref()).await {
            Ok(s) => s.into_iter().map(|d| d.name).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list known segments; serving after the recovery grace");
                BTreeSet::new()
            }
        };
        // The rebuild also waits for the warm copy's segments, so that their entries are
        // reconciled (or dropped) before writes resume.
        known.extend(warm_segments);
        let n_known = known.len();
        {
            let ha = ha.clone();
            tokio::spawn(crate::ha::recovery::forget_unmounted(
                known.clone(),
                self.slot.clone(),
                self.service_meta.clone(),
                stop.clone(),
                move || ha.leading_term() == Some(term),
            ));
        }
        ha.recovery.begin(known, RECOVERY_GRACE);
        self.fence.set(key.as_bytes(), lease);
        *ha.leader.write() = Some(LeaderView {
            address: self.address.clone(),
            admin: self.admin.clone(),
            term,
        });
        ha.deadline_ns
            .store(deadline_of(granted_at, ttl), Ordering::Release);
        ha.granted_ttl_ms
            .store(ttl.as_millis() as u64, Ordering::Release);
        ha.term.store(term, Ordering::Release);
        ha.metrics.is_leader.set(1);
        ha.metrics.leader_term.set(term as i64);
        ha.metrics.leader_changes_total.inc();
        tracing::info!(term, address = %self.address, known_segments = n_known, lease_ttl_ms = ttl.as_millis() as u64, renew_every_ms = timing.renew_every.as_millis() as u64, "elected leader; rebuilding the object index from store-clients' inventories");

        let mut watch = self.etcd.watch_key(key.as_bytes(), 0).await.ok();
        let mut next_renewal = tokio::time::Instant::now() + timing.renew_every;
        let mut etcd_logged = false;
        let reason: String = loop {
            let deadline = ha.base + Duration::from_nanos(ha.deadline_ns.load(Ordering::Acquire));
            let watch_next = async {
                match watch.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.changed() => {
                    // Graceful stop: hand over at once instead of after the TTL.
                    ha.step_down("shutting down");
                    self.fence.close();
                    let _ = self.etcd.lease_revoke(lease).await;
                    return LeadOutcome::Stopped;
                }
                _ = tokio::time::sleep_until(deadline.into()) => {
                    if !ha.lease_valid() {
                        break "the local lease deadline passed without a successful renewal \
                               (etcd unreachable or this process was paused)".to_string();
                    }
                }
                ev = watch_next => match ev {
                    Ok(events) => {
                        let lost = events.iter().any(|e| match e {
                            WatchEvent::Delete(_) => true,
                            WatchEvent::Put(kv) => kv.lease != lease,
                        });
                        if lost {
                            break "the leader key was deleted or taken over".to_string();
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "leader key watch broke; relying on lease renewals");
                        watch = None;
                    }
                },
                _ = tokio::time::sleep_until(next_renewal) => {
                    let sent = Instant::now();
                    match self.etcd.lease_keep_alive(lease).await {
                        Ok(left) if left > 0 => {
                            let d = deadline_of(sent, Duration::from_secs(left as u64));
                            ha.deadline_ns.fetch_max(d, Ordering::AcqRel);
                            self.etcd_back(&mut etcd_logged);
                            next_renewal = tokio::time::Instant::now() + timing.renew_every;
                            if watch.is_none() {
                                watch = self.etcd.watch_key(key.as_bytes(), 0).await.ok();
                            }
                        }
                        Ok(_) => break "etcd reports the leader lease expired".to_string(),
                        Err(e) => {
                            self.etcd_down("renewing the leader lease", &e, &mut etcd_logged);
                            if let Some(left) = ha.lease_left() {
                                tracing::warn!(lease_left_ms = left.as_millis() as u64, "cannot renew the leader lease; writes stop when it runs out");
                            }
                            next_renewal = tokio::time::Instant::now() + Duration::from_millis(300);
                        }
                    }
                }
            }
        };
        ha.step_down(&reason);
        self.fence.close();
        // Best effort: if etcd still has the lease, release the key now.
        let revoked = tokio::time::timeout(ETCD_CALL_TIMEOUT, self.etcd.lease_revoke(lease))
            .await
            .is_ok_and(|r| r.is_ok());
        LeadOutcome::SteppedDown { revoked }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

enum LeadOutcome {
    Stopped,
    SteppedDown { revoked: bool },
}

/// A standby's dials of the leader's RPC port (`ha_fast_takeover`).
struct LeaderProbe {
    addr: String,
    lease: i64,
    refusals: u32,
}

impl LeaderProbe {
    /// None for ourselves, an undecodable key, or a key without a lease.
    fn new(kv: &lunakv_meta::etcd::KeyValue, me: &str) -> Option<LeaderProbe> {
        let v = LeaderView::decode(&kv.value)?;
        (kv.lease != 0 && v.address != me).then_some(LeaderProbe {
            addr: v.address,
            lease: kv.lease,
            refusals: 0,
        })
    }

    /// Dials every [`PROBE_EVERY`]; resolves once [`PROBE_REFUSALS`] dials in a row were
    /// refused. Timeouts and other errors reset the count: they say nothing about the process.
    async fn dead(&mut self) -> bool {
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            let dial =
                tokio::time::timeout(PROBE_EVERY, tokio::net::TcpStream::connect(&self.addr));
            match dial.await {
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    self.refusals += 1;
                    if self.refusals >= PROBE_REFUSALS {
                        return true;
                    }
                }
                _ => self.refusals = 0,
            }
        }
    }
}

/// Sleeps `d`; true when `stop` fired instead.
async fn sleep_or_stop(stop: &mut watch::Receiver<bool>, d: Duration) -> bool {
    tokio::select! {
        _ = stop.changed() => true,
        _ = tokio::time::sleep(d) => *stop.borrow(),
    }
}
