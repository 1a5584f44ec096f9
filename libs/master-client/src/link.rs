//! [`MasterLink`]: the connection to "the master", which for an HA cluster
//! (`master_server_address = etcd://h1:2379;h2:2379`) is whichever master holds the leader key
//! `mooncake-store/<cluster_id>/master_view`.
//!
//! In etcd mode a background task *watches* the leader key (no polling) and switches the channel
//! as soon as the key names a new leader; a follower's redirect (`x-lunakv-leader` metadata)
//! switches it too. [`MasterLink::call`] retries calls that failed because of a leader change
//! (UNAVAILABLE: a follower, a leader rebuilding its index, a dead leader) until the failover
//! budget runs out, and abandons a call in flight when the leader changes under it (a paused
//! leader never answers). With a plain `host:port` nothing of this applies: one attempt, exactly
//! the single-master behaviour.

use std::sync::Arc;
use std::time::Duration;

use lunakv_config::MasterAddress;
use lunakv_meta::etcd::WatchEvent;
use lunakv_meta::layout::{self, LeaderView};
use lunakv_meta::{EtcdClient, EtcdSecurity};
use lunakv_proto::headers::LeaderRedirect;
use parking_lot::RwLock;
use tokio::sync::watch;
use tonic::transport::Channel;

use crate::ClientError;
use crate::connect::{Rpc, connect_master, lazy_channel, master_client, master_tls, rpc_error};

/// How long an HA call keeps retrying across a failover: the 5 s lease, the election, and the
/// new leader's index rebuild (at most 3 s), with room to spare.
pub const FAILOVER_BUDGET: Duration = Duration::from_secs(30);

/// How long a single master's call keeps retrying a "rebuilding" answer: the master's recovery
/// grace (3 s) with room to spare. Any other failure is returned at once.
pub const REBUILD_BUDGET: Duration = Duration::from_secs(6);

#[derive(Clone)]
struct Current {
    addr: String,
    term: u64,
    client: Rpc,
}

struct Inner {
    /// What the user configured, for messages.
    spec: String,
    ha: bool,
    current: RwLock<Current>,
    /// Bumped on every switch, so waiters and heartbeats react at once.
    changed: watch::Sender<u64>,
    timeout: Duration,
    /// TLS towards every master this link talks to (`LUNAKV_TLS_*`), read once at connect.
    tls: Option<lunakv_tls::ClientTls>,
    /// Dropped with the last link: stops the watcher task.
    _stop: watch::Sender<()>,
}

/// A cheap-to-clone handle on the current master.
#[derive(Clone)]
pub struct MasterLink(Arc<Inner>);

fn lazy_client(
    addr: &str,
    timeout: Duration,
    tls: Option<&lunakv_tls::ClientTls>,
) -> Result<Rpc, ClientError> {
    let uri = format!("http://{addr}");
    let ep = Channel::from_shared(uri).map_err(|e| ClientError::Rpc {
        addr: addr.to_owned(),
        message: format!("the leader key names an invalid address '{addr}': {e}"),
    })?;
    let connect_timeout = Duration::from_secs(2).min(timeout);
    let ep = ep
        .tcp_nodelay(true)
        .connect_timeout(connect_timeout)
        .timeout(timeout);
    master_client(lazy_channel(ep, tls, connect_timeout))
}

impl MasterLink {
    /// Connects to `spec`: a `host:port` (connected eagerly; an unreachable master is an error
    /// now) or `etcd://h1:2379;h2:2379` (the leader is looked up in etcd under `cluster_id`;
    /// unreachable etcd, a malformed list or no leader for that cluster id are errors that say
    /// what to fix). Must run inside the tokio runtime that will drive the link.
    pub async fn connect(
        spec: &str,
        cluster_id: &str,
        timeout: Duration,
    ) -> Result<MasterLink, ClientError> {
        let trimmed = spec.trim();
        let tls = master_tls()?;
        if !trimmed.starts_with("etcd://") {
            let client = connect_master(trimmed, timeout, tls.as_ref()).await?;
            let (changed, _) = watch::channel(0);
            let (stop, _) = watch::channel(());
            return Ok(MasterLink(Arc::new(Inner {
                spec: spec.to_owned(),
                ha: false,
                current: RwLock::new(Current {
                    addr: trimmed.to_owned(),
                    term: 0,
                    client,
                }),
                changed,
                timeout,
                tls,
                _stop: stop,
            })));
        }
        let endpoints = match MasterAddress::parse("master_server_address", trimmed) {
            Ok(MasterAddress::Etcd(e)) => e,
            Ok(MasterAddress::Direct(_)) => unreachable!("an etcd:// address parses as etcd"),
            Err(e) => return Err(ClientError::Config(e.to_string())),
        };
        let security = EtcdSecurity::from_env(&lunakv_config::process_env)
            .map_err(|e| ClientError::Config(e.to_string()))?;
        let etcd =
            EtcdClient::connect_with(&endpoints.to_strings(), Duration::from_secs(3), &security)
                .map_err(|e| ClientError::Config(e.to_string()))?;
        let unreachable = |e: lunakv_meta::MetaError| ClientError::Rpc {
            addr: spec.to_owned(),
            message: format!(
                "cannot reach etcd ({e}): check the endpoints in master_server_address \
                 (etcd://h1:2379;h2:2379) or --etcd_endpoints, and that etcd is running"
            ),
        };
        etcd.check().await.map_err(unreachable)?;
        let key = layout::leader_key(cluster_id);
        // A leader may be moments away (masters starting together): wait a little for one.
        let deadline = tokio::time::Instant::now() + timeout.min(Duration::from_secs(10));
        let view = loop {
            let (kv, rev) = match etcd.get_kv(key.as_bytes()).await {
                Ok(got) => got,
                // etcd answered check() just now: a failed read here is transient (a slow or
                // cancelled call on a loaded host), so retry until the deadline.
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!(error = %e, "reading the leader key failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(unreachable(e)),
            };
            if let Some(v) = kv.and_then(|kv| LeaderView::decode(&kv.value)) {
                break v;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(no_leader(spec, cluster_id, &key, &etcd).await);
            }
            if let Ok(mut w) = etcd.watch_key(key.as_bytes(), rev + 1).await {
                let _ = tokio::time::timeout(left, w.next()).await;
            } else {
                tokio::time::sleep(Duration::from_millis(200).min(left)).await;
            }
        };
        let client = lazy_client(&view.address, timeout, tls.as_ref())?;
        let (changed, _) = watch::channel(0);
        let (stop, stop_rx) = watch::channel(());
        let link = MasterLink(Arc::new(Inner {
            spec: spec.to_owned(),
            ha: true,
            current: RwLock::new(Current {
                addr: view.address.clone(),
                term: view.term,
                client,
            }),
            changed,
            timeout,
            tls,
            _stop: stop,
        }));
        tracing::info!(leader = %view.address, term = view.term, etcd = %endpoints, "following the lunakv-master leader through etcd");
        tokio::spawn(follow(Arc::downgrade(&link.0), etcd, key, stop_rx));
        Ok(link)
    }

    /// TLS towards the master, when this client has it (quick calls use it too).
    pub fn tls(&self) -> Option<&lunakv_tls::ClientTls> {
        self.0.tls.as_ref()
    }

    /// Whether the master is found through etcd.
    pub fn is_ha(&self) -> bool {
        self.0.ha
    }

    /// The current master's client (a channel clone).
    pub fn client(&self) -> Rpc {
        self.0.current.read().client.clone()
    }

    /// The current master's address, for messages.
    pub fn addr(&self) -> String {
        if self.0.ha {
            format!(
                "{} (leader via {})",
                self.0.current.read().addr,
                self.0.spec
            )
        } else {
            self.0.spec.clone()
        }
    }

    /// The address calls go to now (the leader's, for an `etcd://` spec).
    pub fn current_addr(&self) -> String {
        self.0.current.read().addr.clone()
    }

    /// Notified on every leader switch.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.changed.subscribe()
    }

    /// Points the link at `addr` (term `term`, 0 = unknown) unless it already does.
    fn switch(&self, addr: &str, term: u64) {
        switch(&self.0, addr, term);
    }

    /// One call with HA retries (see the module docs). `f` is called once per attempt.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, ClientError>
    where
        F: Fn(Rpc) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        if !self.0.ha {
            // A restarted master answers "rebuilding" until its owners remounted: wait that
            // out rather than report a miss (or a refused put) that is not true.
            let deadline = tokio::time::Instant::now() + REBUILD_BUDGET;
            loop {
                match f(self.client()).await {
                    Ok(r) => return Ok(r.into_inner()),
                    Err(s)
                        if s.metadata().contains_key(lunakv_proto::headers::REBUILDING)
                            && tokio::time::Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(s) => return Err(rpc_error(&self.0.spec, &s)),
                }
            }
        }
        let deadline = tokio::time::Instant::now() + FAILOVER_BUDGET;
        let mut changed = self.subscribe();
        loop {
            changed.borrow_and_update();
            let client = self.client();
            let status = tokio::select! {
                r = f(client) => match r {
                    Ok(r) => return Ok(r.into_inner()),
                    Err(s) => s,
                },
                // The leader changed under an unanswered call (the old one died or is paused):
                // retry at the new one. An abandoned mutation is refused by a deposed leader.
                _ = changed.changed() => continue,
            };
            if !retryable(&status) || tokio::time::Instant::now() >= deadline {
                return Err(rpc_error(&self.addr(), &status));
            }
            if let Some(l) = LeaderRedirect::from_metadata(status.metadata())
                .filter(|l| l.address != self.0.current.read().addr)
            {
                self.switch(&l.address, l.term);
                continue;
            }
            // Wait for the watch to report a new leader, or back off briefly (a leader
            // rebuilding its index answers UNAVAILABLE for a moment).
            let _ = tokio::time::timeout(Duration::from_millis(100), changed.changed()).await;
        }
    }

    /// Switches to the leader a follower's redirect names (HA only).
    pub fn follow_redirect(&self, status: &tonic::Status) {
        if !self.0.ha {
            return;
        }
        if let Some(l) = LeaderRedirect::from_metadata(status.metadata()) {
            self.switch(&l.address, l.term);
        }
    }
}

fn switch(inner: &Inner, addr: &str, term: u64) {
    {
        let cur = inner.current.read();
        if cur.addr == addr && (term == 0 || cur.term == term) {
            return;
        }
    }
    match lazy_client(addr, inner.timeout, inner.tls.as_ref()) {
        Ok(client) => {
            let mut cur = inner.current.write();
            let same_addr = cur.addr == addr;
            tracing::info!(from = %cur.addr, to = %addr, term, "master leader changed");
            if !same_addr {
                cur.client = client;
                cur.addr = addr.to_owned();
            }
            cur.term = term;
            drop(cur);
            inner.changed.send_modify(|n| *n += 1);
        }
        Err(e) => tracing::warn!(error = %e, "ignoring an unusable leader address"),
    }
}

/// UNAVAILABLE covers a follower's redirect, a leader rebuilding or fenced, and a connection
/// refused by a dead leader; a connection reset under a call in flight (the leader died mid-call)
/// surfaces as UNKNOWN with a transport message. Retrying after a leader change is safe: a dead
/// or deposed leader's unacknowledged work is discarded with its term. Timeouts are not retried:
/// the call may still be applied by a live leader.
fn retryable(s: &tonic::Status) -> bool {
    match s.code() {
        tonic::Code::Unavailable => true,
        tonic::Code::Unknown | tonic::Code::Internal => {
            let m = s.message().to_ascii_lowercase();
            m.contains("transport") || m.contains("connection") || m.contains("broken pipe")
        }
        _ => false,
    }
}

async fn no_leader(spec: &str, cluster_id: &str, key: &str, etcd: &EtcdClient) -> ClientError {
    // Name the clusters that do have a leader: the usual cause is a cluster_id mismatch.
    let others: Vec<String> = etcd
        .range_prefix(layout::ROOT.as_bytes())
        .await
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| {
            let k = String::from_utf8(kv.key).ok()?;
            let rest = k.strip_prefix(layout::ROOT)?;
            let (cluster, name) = rest.split_once('/')?;
            (name == layout::LEADER_KEY).then(|| cluster.to_owned())
        })
        .collect();
    let hint = if others.is_empty() {
        "start lunakv-master with --enable_ha --etcd_endpoints=... and the same --cluster_id"
            .to_owned()
    } else {
        format!(
            "etcd has leaders for cluster_id {others:?}: the cluster_id of this client \
             ({cluster_id:?}) must match the masters' --cluster_id"
        )
    };
    ClientError::Rpc {
        addr: spec.to_owned(),
        message: format!(
            "no lunakv-master leads cluster {cluster_id:?} (etcd key {key} is absent): {hint}"
        ),
    }
}

/// Watches the leader key and switches the link on every change, until the link is dropped.
async fn follow(
    link: std::sync::Weak<Inner>,
    etcd: EtcdClient,
    key: String,
    mut stop: watch::Receiver<()>,
) {
    let mut logged = false;
    loop {
        let step = async {
            let (kv, rev) = etcd.get_kv(key.as_bytes()).await?;
            if let Some(v) = kv.and_then(|kv| LeaderView::decode(&kv.value)) {
                let Some(inner) = link.upgrade() else {
                    return Ok(());
                };
                switch(&inner, &v.address, v.term);
            }
            let mut w = etcd.watch_key(key.as_bytes(), rev + 1).await?;
            loop {
                for ev in w.next().await? {
                    let Some(inner) = link.upgrade() else {
                        return Ok(());
                    };
                    match ev {
                        WatchEvent::Put(kv) => {
                            if let Some(v) = LeaderView::decode(&kv.value) {
                                switch(&inner, &v.address, v.term);
                            }
                        }
                        // No leader for a moment: keep the old channel (cached gets do not
                        // need it; calls retry) until the next one is elected.
                        WatchEvent::Delete(_) => {
                            tracing::info!("the master leader key is gone; waiting for an election")
                        }
                    }
                }
            }
        };
        let r: Result<(), lunakv_meta::MetaError> = tokio::select! {
            r = step => r,
            _ = stop.changed() => return,
        };
        match r {
            Ok(()) => return,
            Err(e) => {
                if !logged {
                    tracing::warn!(error = %e, "lost the etcd watch on the master leader key; retrying (cached gets keep working)");
                    logged = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = stop.changed() => return,
                }
            }
        }
        if link.strong_count() == 0 {
            return;
        }
    }
}

/// The retry loops of [`MasterLink::call`] on tokio's paused clock: their backoff and budgets are
/// tokio timers, so the 6 s and 30 s budgets pass at once and the attempts are counted exactly.
#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A link to `addr` that never dials (the calls below never touch its channel).
    fn link(ha: bool) -> MasterLink {
        let client = lazy_client("127.0.0.1:9", Duration::from_secs(1), None).expect("client");
        let (changed, _) = watch::channel(0);
        let (stop, _) = watch::channel(());
        MasterLink(Arc::new(Inner {
            spec: "127.0.0.1:9".to_owned(),
            ha,
            current: RwLock::new(Current {
                addr: "127.0.0.1:9".to_owned(),
                term: 1,
                client,
            }),
            changed,
            timeout: Duration::from_secs(1),
            tls: None,
            _stop: stop,
        }))
    }

    /// Calls `link` with a call that fails with `fail()` `failures` times, then answers.
    async fn call_failing(
        link: &MasterLink,
        failures: usize,
        fail: impl Fn() -> tonic::Status,
    ) -> (Result<u32, ClientError>, usize, Duration) {
        let attempts = AtomicUsize::new(0);
        let started = tokio::time::Instant::now();
        let r = link
            .call(|_| {
                let n = attempts.fetch_add(1, Ordering::SeqCst);
                let out = if n < failures {
                    Err(fail())
                } else {
                    Ok(tonic::Response::new(7u32))
                };
                async move { out }
            })
            .await;
        (r, attempts.load(Ordering::SeqCst), started.elapsed())
    }

    fn rebuilding() -> tonic::Status {
        lunakv_proto::status::rebuilding("restarted".to_owned())
    }

    #[tokio::test(start_paused = true)]
    async fn a_single_master_rebuilding_is_waited_out() {
        let (r, attempts, took) = call_failing(&link(false), 3, rebuilding).await;
        assert_eq!(r.expect("answered once rebuilt"), 7);
        assert_eq!(attempts, 4);
        assert!(
            took >= Duration::from_millis(300),
            "backs off between tries"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_single_master_rebuilding_past_the_budget_is_reported() {
        let (r, attempts, took) = call_failing(&link(false), usize::MAX, rebuilding).await;
        assert!(matches!(r, Err(ClientError::Rpc { .. })), "{r:?}");
        assert!(took >= REBUILD_BUDGET, "retried for the whole budget");
        assert!(
            attempts as u128 >= REBUILD_BUDGET.as_millis() / 100,
            "one try per backoff: {attempts}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_single_master_is_asked_once_for_anything_but_a_rebuild() {
        let (r, attempts, _) =
            call_failing(&link(false), 1, || tonic::Status::unavailable("down")).await;
        assert!(r.is_err());
        assert_eq!(attempts, 1, "no HA: one attempt");
    }

    #[tokio::test(start_paused = true)]
    async fn an_ha_call_retries_a_failover_and_gives_up_after_its_budget() {
        let l = link(true);
        let (r, attempts, _) =
            call_failing(&l, 5, || tonic::Status::unavailable("no leader")).await;
        assert_eq!(r.expect("answered after the failover"), 7);
        assert_eq!(attempts, 6);

        let (r, _, took) =
            call_failing(&l, usize::MAX, || tonic::Status::unavailable("no leader")).await;
        assert!(r.is_err());
        assert!(took >= FAILOVER_BUDGET, "retried for the failover budget");

        let (r, attempts, _) = call_failing(&l, usize::MAX, || {
            tonic::Status::invalid_argument("bad key")
        })
        .await;
        assert!(r.is_err());
        assert_eq!(
            attempts, 1,
            "an answer that is not a failover is not retried"
        );
    }
}
