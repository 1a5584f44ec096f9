//! Hosting a segment: serve it, mount it with the master, keep the master informed.
//!
//! Shared by `lunakv-store` (a standalone owner of a big DRAM pool) and by [`crate::StoreClient`]
//! in embedded mode, so both behave the same across master restarts: when a Ping answers
//! `remount_required`, the host mounts again with its inventory and the master rebuilds its index
//! without losing an object whose bytes survive.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lunakv_master_client::{ClientError, MasterLink, MasterWait, master_tls, rpc_error, startup};
use lunakv_proto::master as pb;
use lunakv_transfer::{
    ColdTier, ConnLimits, DrainProgress, DrainReport, ProtocolChoice, SegmentInfo, SegmentServer,
    SegmentServerConfig, WireProtocol,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Bytes of a new segment faulted in ahead of use (see `SegmentHost::start`).
const PREFAULT_CAP: u64 = 1 << 30;

/// Most keys reported per Ping; the rest wait for the next one.
const TOUCHED_KEYS_PER_PING: usize = 10_000;

/// How to host a segment.
#[derive(Debug, Clone)]
pub struct HostOptions {
    pub master_server_address: String,
    pub client_id: String,
    pub cluster_id: String,
    /// Address the transfer listener binds (port 0 for an ephemeral port).
    pub bind: SocketAddr,
    /// Host to advertise in the segment name when it differs from the bind address.
    pub advertise_host: Option<String>,
    pub size: u64,
    /// Unix socket that offers the memfd to same-host requesters (None = tcp only).
    pub shm_socket: Option<PathBuf>,
    /// The protocol asked for and the one to serve, already resolved (and its fallback
    /// already logged) by the caller: [`ProtocolChoice::resolve`].
    pub protocol: ProtocolChoice,
    pub enable_offload: bool,
    pub ping_interval: Duration,
    pub rpc_timeout: Duration,
    /// Caps and idle timeout of the transfer listener's connections.
    pub limits: ConnLimits,
    /// How long to retry binding `bind` while its port is in use.
    pub bind_retry: Duration,
}

/// What the host needs from an owner's disk tier besides serving it ([`ColdTier`]): its
/// capacity and objects for the mount, and what it dropped for the next Ping.
pub trait DiskInventory: Send + Sync + 'static {
    /// Bytes the tier may hold; 0 when it is unusable.
    fn capacity(&self) -> u64;
    /// Every object on disk (`offset` unused), with the placement proof stored with it.
    fn objects(&self) -> Vec<lunakv_transfer::Entry>;
    /// `(key, generation, size)` dropped since the last call (size limit, failed checksum).
    fn take_dropped(&self) -> Vec<(String, u64, u64)>;
}

/// An owner's disk tier as the host plugs it in (two views of one object).
#[derive(Clone)]
pub struct HostDisk {
    pub cold: Arc<dyn ColdTier>,
    pub inventory: Arc<dyn DiskInventory>,
}

/// A mounted, served segment with its heartbeat.
pub struct SegmentHost {
    server: Arc<SegmentServer>,
    info: SegmentInfo,
    client_id: String,
    master: MasterLink,
    stop: watch::Sender<bool>,
    heartbeat: parking_lot::Mutex<Option<JoinHandle<()>>>,
    rpc_timeout: Duration,
    /// Set once [`SegmentHost::drain_and_unmount`] unmounted: `shutdown` then only stops.
    unmounted: AtomicBool,
    protocol: ProtocolChoice,
    status: MountStatus,
}

/// Whether a segment is mounted with the master: a store-client's readiness. Cheap to clone;
/// every clone sees the same flag.
#[derive(Debug, Clone, Default)]
pub struct MountStatus(Arc<AtomicBool>);

impl MountStatus {
    pub fn is_mounted(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    fn set(&self, mounted: bool) {
        self.0.store(mounted, Ordering::SeqCst);
    }
}

/// A segment that is bound and served but not yet mounted ([`SegmentHost::bind`]): peers can
/// connect, the master does not know it yet.
pub struct BoundSegment {
    opts: HostOptions,
    server: Arc<SegmentServer>,
    info: SegmentInfo,
    protocol: ProtocolChoice,
    disk: Option<Arc<dyn DiskInventory>>,
    status: MountStatus,
}

impl BoundSegment {
    pub fn info(&self) -> &SegmentInfo {
        &self.info
    }

    /// The server, for its counters while the mount waits (a store-client's /metrics).
    pub fn server(&self) -> &Arc<SegmentServer> {
        &self.server
    }

    /// The protocol asked for and the one this segment serves.
    pub fn protocol(&self) -> &ProtocolChoice {
        &self.protocol
    }

    /// The flag the [`SegmentHost`] keeps up to date once mounted; false until then.
    pub fn status(&self) -> MountStatus {
        self.status.clone()
    }

    /// Connects to the master and mounts, waiting per `wait` while the master cannot be
    /// reached yet (see `startup` for what fails at once). Dropping the future stops the wait
    /// and the segment server.
    pub async fn mount(self, wait: MasterWait) -> Result<SegmentHost, ClientError> {
        let opts = self.opts;
        let mut waiting = startup::master_wait(
            &opts.master_server_address,
            format!("to mount segment {}", self.info.name),
            wait,
        );
        let master = startup::connect_link(
            &opts.master_server_address,
            &opts.cluster_id,
            opts.rpc_timeout,
            &mut waiting,
        )
        .await?;
        let mounter = Mounter {
            master: master.clone(),
            client_id: opts.client_id.clone(),
            cluster_id: opts.cluster_id.clone(),
            protocol: self.protocol.clone(),
            enable_offload: opts.enable_offload,
            server: Some(self.server.clone()),
            disk: self.disk,
            status: self.status.clone(),
        };
        loop {
            match mounter.mount_once(opts.rpc_timeout).await {
                Ok(()) => break,
                Err(status) => {
                    // A follower names the leader: the next attempt goes there.
                    master.follow_redirect(&status);
                    let e = rpc_error(&master.addr(), &status);
                    if !startup::retryable(&status) || !waiting.retry_after(&e).await {
                        return Err(e);
                    }
                }
            }
        }
        waiting.reached();
        let (stop, stop_rx) = watch::channel(false);
        let heartbeat = tokio::spawn(heartbeat(mounter, opts.ping_interval, stop_rx));
        Ok(SegmentHost {
            server: self.server,
            info: self.info,
            client_id: opts.client_id,
            master,
            stop,
            heartbeat: parking_lot::Mutex::new(Some(heartbeat)),
            rpc_timeout: opts.rpc_timeout,
            unmounted: AtomicBool::new(false),
            protocol: self.protocol,
            status: self.status,
        })
    }
}

impl SegmentHost {
    /// Starts serving the segment and mounts it. Fails if the master is unreachable or refuses
    /// the mount (for example a cluster_id mismatch), with the master's message.
    /// `master_server_address` may be `etcd://h1:2379;h2:2379`: the segment then follows the
    /// HA leader and re-mounts with its inventory on every new leader.
    pub async fn start(opts: HostOptions) -> Result<SegmentHost, ClientError> {
        Self::start_with_disk(opts, None).await
    }

    /// [`Self::start`] for an owner with a disk tier (`lunakv-store --enable_offload`): the
    /// segment server serves OFFLOAD/LOAD from it, the mount reports its capacity and objects
    /// (LOCAL_DISK inventory), and each Ping reports what it dropped.
    pub async fn start_with_disk(
        opts: HostOptions,
        disk: Option<HostDisk>,
    ) -> Result<SegmentHost, ClientError> {
        Self::bind(opts, disk)?.mount(MasterWait::NoWait).await
    }

    /// The first half of [`Self::start_with_disk`]: binds and serves the segment, without the
    /// master. A service that must answer probes while it waits for its master
    /// (`lunakv-store`) binds first, reports, then [`BoundSegment::mount`]s.
    pub fn bind(opts: HostOptions, disk: Option<HostDisk>) -> Result<BoundSegment, ClientError> {
        // Bound before dialling the master: that connection's source port, picked from the
        // ephemeral range, must not be the one we are about to listen on.
        let server = SegmentServer::start(SegmentServerConfig {
            bind: opts.bind,
            size: opts.size,
            shm_socket: opts.shm_socket.clone(),
            advertise_host: opts.advertise_host.clone(),
            limits: opts.limits.clone(),
            bind_retry: opts.bind_retry,
        })
        .map_err(|e| {
            ClientError::Config(format!("cannot serve a segment on {}: {e}", opts.bind))
        })?;
        server.set_cluster_id(&opts.cluster_id);
        // The pool token or TLS towards the master is the switch: with either the control
        // channel is private, so the secret can travel in MountSegment; without, a secret
        // would protect nothing.
        let tokens = lunakv_config::auth::PoolTokens::from_env(&lunakv_config::process_env)
            .map_err(|e| ClientError::Config(e.to_string()))?;
        let tls = master_tls()?.is_some();
        if tokens.presented().is_some() || tls {
            server.require_capabilities(lunakv_transfer::MountSecret::generate());
            tracing::info!(
                "{} is set: this segment requires capabilities on every transfer request",
                if tls {
                    "TLS towards the master"
                } else {
                    "the pool token"
                }
            );
        }
        // Fresh pages cost a fault per 4 KiB on the first put into them (7-12x slower than warm
        // memory); fault the head of the segment in on a background thread. Capped so a 40 GB
        // pool does not commit all its RAM at start.
        if let Err(e) = server.prefault_in_background(opts.size.min(PREFAULT_CAP)) {
            tracing::debug!(error = %e, "prefault not started");
        }
        let mut protocol = opts.protocol.clone();
        if protocol.effective == WireProtocol::Rdma {
            // Registers the segment with the device so peers can READ/WRITE it one-sided. The
            // device opened, so what fails here is the registration itself (`ulimit -l`): the
            // segment is still served over tcp, with the one warning line.
            if let Err(e) = server.enable_rdma() {
                protocol = ProtocolChoice::rdma_unavailable(lunakv_transfer::rdma::reason_of(
                    &e.to_string(),
                ));
                if let Some(w) = protocol.warning() {
                    tracing::warn!("{w}");
                }
            }
        }
        if let Some(d) = &disk {
            server.set_cold_tier(d.cold.clone());
        }
        let server = Arc::new(server);
        let info = server.info();
        Ok(BoundSegment {
            opts,
            server,
            info,
            protocol,
            disk: disk.map(|d| d.inventory),
            status: MountStatus::default(),
        })
    }

    pub fn info(&self) -> &SegmentInfo {
        &self.info
    }

    /// The protocol this segment was asked for and the one it serves (as mounted).
    pub fn protocol(&self) -> &ProtocolChoice {
        &self.protocol
    }

    pub fn server(&self) -> &SegmentServer {
        &self.server
    }

    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// Whether the master knows this segment now (false while re-mounting and once unmounted).
    pub fn status(&self) -> MountStatus {
        self.status.clone()
    }

    /// Graceful stop: unmount (the master drops this segment's replicas at once instead of after
    /// client_ttl), then close the listeners.
    pub async fn shutdown(self) -> Result<(), ClientError> {
        self.stop_heartbeat().await;
        let res = if self.unmounted.load(Ordering::SeqCst) {
            Ok(())
        } else {
            self.unmount(self.rpc_timeout).await
        };
        self.server.shutdown();
        res
    }

    /// Graceful stop of an owner with a disk tier (`lunakv-store --enable_offload`, on SIGTERM):
    /// writes the objects only in DRAM to the disk tier, newest first, until `budget` is spent,
    /// then unmounts and stops serving. The restarted owner mounts the drained objects back with
    /// its disk inventory (same directory), so a rolling update keeps them.
    ///
    /// Order, and why:
    /// 1. Drain while still mounted and serving: gets keep being answered from DRAM during the
    ///    drain, and the master's FREE/OFFLOAD keep working (the drain undoes its copy of an
    ///    object the master frees meanwhile, see `lunakv_transfer::ColdDrain`).
    /// 2. Stop the heartbeat (so no re-mount can follow), unmount: the master forgets this
    ///    segment's replicas and places no new object here. Objects are clean misses until the
    ///    restart re-mounts them.
    /// 3. Drain again what was written between the first pass and the unmount, within the same
    ///    budget; stop serving; count what is lost.
    ///
    /// A segment without a disk tier just unmounts (every object is dropped, as `shutdown`).
    /// The report is returned even when the unmount failed (the master then expires the segment
    /// after client_ttl); `progress` is updated while it runs, for /metrics.
    pub async fn drain_and_unmount(
        &self,
        budget: Duration,
        progress: Arc<DrainProgress>,
    ) -> (Option<DrainReport>, Result<(), ClientError>) {
        let deadline = Instant::now() + budget;
        let Some(drain) = self.server.begin_drain(progress) else {
            self.stop_heartbeat().await;
            let res = self.unmount(self.rpc_timeout).await;
            self.unmounted.store(true, Ordering::SeqCst);
            self.server.shutdown();
            return (None, res);
        };
        // Later passes take what was written during the earlier ones; bounded so a steady stream
        // of puts cannot hold the unmount back for the whole budget.
        let drain = run_blocking(drain, move |d| d.run(deadline, 3)).await;
        self.stop_heartbeat().await;
        // The unmount must not eat the whole grace period when the master is away.
        let res = self.unmount(self.rpc_timeout.min(UNMOUNT_TIMEOUT)).await;
        self.unmounted.store(true, Ordering::SeqCst);
        let drain = match drain {
            Some(d) => run_blocking(d, move |d| d.run(deadline, 1)).await,
            None => None,
        };
        self.server.shutdown();
        let report = match drain {
            Some(d) => tokio::task::spawn_blocking(move || d.finish()).await.ok(),
            None => None,
        };
        match &report {
            Some(r) => tracing::info!(
                drained = r.drained,
                dropped = r.dropped,
                drained_bytes = r.drained_bytes,
                dropped_bytes = r.dropped_bytes,
                already_on_disk = r.already_on_disk,
                freed_meanwhile = r.freed_meanwhile,
                no_room = r.no_room,
                budget_spent = r.budget_spent,
                write_failed = r.write_failed,
                elapsed_ms = r.elapsed.as_millis() as u64,
                budget_ms = budget.as_millis() as u64,
                "shutdown drain finished: {} objects drained to the disk tier, {} dropped",
                r.drained,
                r.dropped
            ),
            None => tracing::error!(
                "shutdown drain did not finish (its task failed); objects still in DRAM are lost"
            ),
        }
        (report, res)
    }

    async fn stop_heartbeat(&self) {
        let _ = self.stop.send(true);
        let h = self.heartbeat.lock().take();
        if let Some(h) = h {
            let _ = h.await;
        }
    }

    async fn unmount(&self, timeout: Duration) -> Result<(), ClientError> {
        // Leaving the pool: not ready from here on, whatever the master answers.
        self.status.set(false);
        let mut master = self.master.client();
        let req = pb::UnmountSegmentRequest {
            client_id: self.client_id.clone(),
            segment_name: self.info.name.clone(),
            instance_id: self.info.instance_id.clone(),
        };
        match tokio::time::timeout(timeout, master.unmount_segment(req)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(status)) => Err(rpc_error(&self.master.addr(), &status)),
            Err(_) => Err(ClientError::Rpc {
                addr: self.master.addr(),
                message: "unmount timed out".to_owned(),
            }),
        }
    }
}

/// Longest the drain's unmount waits for the master.
const UNMOUNT_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `f` on the drain on a blocking thread (disk writes and fsyncs); `None` if that thread
/// panicked (the drain and its pins are gone then, and the table stops watching).
async fn run_blocking(
    mut drain: lunakv_transfer::ColdDrain,
    f: impl FnOnce(&mut lunakv_transfer::ColdDrain) + Send + 'static,
) -> Option<lunakv_transfer::ColdDrain> {
    tokio::task::spawn_blocking(move || {
        f(&mut drain);
        drain
    })
    .await
    .ok()
}

impl Drop for SegmentHost {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.server.shutdown();
    }
}

/// Mounts (and re-mounts) a segment; also drives the heartbeat of a pure requester, which has
/// no segment.
pub(crate) struct Mounter {
    pub(crate) master: MasterLink,
    pub(crate) client_id: String,
    pub(crate) cluster_id: String,
    pub(crate) protocol: ProtocolChoice,
    pub(crate) enable_offload: bool,
    pub(crate) server: Option<Arc<SegmentServer>>,
    pub(crate) disk: Option<Arc<dyn DiskInventory>>,
    /// Set after every successful mount, cleared while a re-mount is due.
    pub(crate) status: MountStatus,
}

/// A mount as the requests that make it: MountSegment with the first part of the inventory,
/// then one MountInventory per further part.
struct MountPlan {
    first: pb::MountSegmentRequest,
    rest: Vec<pb::MountInventoryRequest>,
    info: SegmentInfo,
    /// Inventory items in all.
    items: usize,
}

/// An entry as its owner reports it at mount, with its placement proof.
fn inventory_item(e: lunakv_transfer::Entry, kind: pb::ReplicaKind) -> pb::InventoryItem {
    let disk = kind == pb::ReplicaKind::LocalDisk;
    pb::InventoryItem {
        key: e.key,
        offset: if disk { 0 } else { e.offset },
        size: e.size,
        generation: e.generation,
        kind: kind as i32,
        proof: e.proof.map(|p| p.as_bytes().to_vec()).unwrap_or_default(),
    }
}

/// What the master accepted over a plan's requests.
#[derive(Default)]
struct MountTally {
    accepted: u64,
    rejected: usize,
}

impl MountTally {
    fn add(&mut self, accepted: u64, rejected: usize) {
        self.accepted += accepted;
        self.rejected += rejected;
    }
}

impl Mounter {
    /// The requests that mount the segment as it is now (with its inventory); `None` for a
    /// pure requester.
    fn plan(&self) -> Option<MountPlan> {
        let server = self.server.as_ref()?;
        let info = server.info();
        let mut inventory: Vec<pb::InventoryItem> = server
            .inventory()
            .into_iter()
            .map(|e| inventory_item(e, pb::ReplicaKind::Memory))
            .collect();
        if let Some(d) = &self.disk {
            inventory.extend(
                d.objects()
                    .into_iter()
                    .map(|e| inventory_item(e, pb::ReplicaKind::LocalDisk)),
            );
        }
        let items = inventory.len();
        let mut segment = descriptor(&info, &self.protocol, self.enable_offload);
        segment.disk_capacity_bytes = self.disk.as_ref().map_or(0, |d| d.capacity());
        let instance_id = segment.instance_id.clone();
        // The master takes at most 4 MiB per message (gRPC's default): tens of thousands of
        // vLLM-shaped keys are more than that, so the inventory goes in parts.
        let mut parts = inventory_parts(inventory).into_iter();
        let first = parts.next().unwrap_or_default();
        let rest: Vec<Vec<pb::InventoryItem>> = parts.collect();
        let last = rest.len();
        let first = pb::MountSegmentRequest {
            client_id: self.client_id.clone(),
            cluster_id: self.cluster_id.clone(),
            segment: Some(segment),
            inventory: first,
            inventory_follows: !rest.is_empty(),
            data_secret: server
                .capability_secret()
                .map(|k| k.as_bytes().to_vec())
                .unwrap_or_default(),
        };
        let rest = rest
            .into_iter()
            .enumerate()
            .map(|(i, items)| pb::MountInventoryRequest {
                client_id: self.client_id.clone(),
                segment_name: info.name.clone(),
                instance_id: instance_id.clone(),
                items,
                last: i + 1 == last,
            })
            .collect();
        Some(MountPlan {
            first,
            rest,
            info,
            items,
        })
    }

    /// Mounts (or re-mounts) through the link, with its HA and rebuild retries.
    async fn mount(&self) -> Result<(), ClientError> {
        let Some(plan) = self.plan() else {
            return Ok(());
        };
        let resp = self
            .master
            .call(|mut m| {
                let req = plan.first.clone();
                async move { m.mount_segment(req).await }
            })
            .await?;
        let mut tally = MountTally::default();
        tally.add(resp.accepted_objects, resp.rejected_generations.len());
        for req in &plan.rest {
            let resp = self
                .master
                .call(|mut m| {
                    let req = req.clone();
                    async move { m.mount_inventory(req).await }
                })
                .await?;
            tally.add(resp.accepted_objects, resp.rejected_generations.len());
        }
        self.mounted(&plan, &tally);
        Ok(())
    }

    /// One mount attempt with the master's own status, so that a starting owner can tell a
    /// refusal from a master that is not ready yet (`startup::retryable`). A failure part-way
    /// is retried from MountSegment, which starts the inventory again.
    async fn mount_once(&self, timeout: Duration) -> Result<(), tonic::Status> {
        let Some(plan) = self.plan() else {
            return Ok(());
        };
        let timed_out = |rpc: &str| tonic::Status::deadline_exceeded(format!("{rpc} timed out"));
        let mut m = self.master.client();
        let resp = tokio::time::timeout(timeout, m.mount_segment(plan.first.clone()))
            .await
            .map_err(|_| timed_out("MountSegment"))??
            .into_inner();
        let mut tally = MountTally::default();
        tally.add(resp.accepted_objects, resp.rejected_generations.len());
        for req in &plan.rest {
            let resp = tokio::time::timeout(timeout, m.mount_inventory(req.clone()))
                .await
                .map_err(|_| timed_out("MountInventory"))??
                .into_inner();
            tally.add(resp.accepted_objects, resp.rejected_generations.len());
        }
        self.mounted(&plan, &tally);
        Ok(())
    }

    fn mounted(&self, plan: &MountPlan, tally: &MountTally) {
        self.status.set(true);
        tracing::info!(
            segment = %plan.info.name,
            size = plan.info.size,
            inventory = plan.items,
            parts = plan.rest.len() + 1,
            accepted = tally.accepted,
            rejected = tally.rejected,
            "segment mounted"
        );
    }
}

/// Encoded bytes per inventory part: well under the master's 4 MiB message limit.
const INVENTORY_PART_BYTES: usize = 1 << 20;

/// Splits an inventory into parts of at most [`INVENTORY_PART_BYTES`] encoded (at least one
/// item each, and one empty part for an empty inventory).
fn inventory_parts(items: Vec<pb::InventoryItem>) -> Vec<Vec<pb::InventoryItem>> {
    use lunakv_proto::prost::Message;
    let mut parts = vec![Vec::new()];
    let mut bytes = 0;
    for item in items {
        // Field tag + length prefix: a few bytes over the item itself.
        let len = item.encoded_len() + 8;
        let cur = parts.last_mut().expect("parts is never empty");
        if !cur.is_empty() && bytes + len > INVENTORY_PART_BYTES {
            parts.push(Vec::new());
            bytes = 0;
        }
        bytes += len;
        parts.last_mut().expect("parts is never empty").push(item);
    }
    parts
}

pub(crate) async fn heartbeat(m: Mounter, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut healthy = true;
    // A new HA leader knows nobody: ping it at once (it answers remount_required and the
    // inventory goes over) instead of waiting for the next tick.
    let mut leader_changed = m.master.subscribe();
    // Right after a leader change the new leader may not serve yet (its election is still
    // settling): retry quickly for a moment instead of waiting for the next tick.
    let mut changed_at: Option<tokio::time::Instant> = None;
    // Drain jobs: the moves the master handed this owner, copied beside the heartbeat and
    // reported in the Ping after they ended.
    let mut drain = crate::drain::DrainWork::new(m.server.clone());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // Report at once and take the next moves.
            _ = drain.finished() => {}
            _ = leader_changed.changed() => changed_at = Some(tokio::time::Instant::now()),
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let touched = m
            .server
            .as_ref()
            .map(|s| s.take_touched_keys(TOUCHED_KEYS_PER_PING))
            .unwrap_or_default();
        let dropped: Vec<pb::InventoryItem> = m
            .disk
            .as_ref()
            .map(|d| d.take_dropped())
            .unwrap_or_default()
            .into_iter()
            .map(|(key, generation, size)| pb::InventoryItem {
                key,
                offset: 0,
                size,
                generation,
                kind: pb::ReplicaKind::LocalDisk as i32,
                proof: Vec::new(),
            })
            .collect();
        let req = pb::PingRequest {
            client_id: m.client_id.clone(),
            touched_keys: touched,
            disk_dropped: dropped,
            mounted_segments: m
                .server
                .as_ref()
                .map(|s| vec![s.info().name])
                .unwrap_or_default(),
            drain_results: std::mem::take(&mut drain.results),
        };
        // Kept until a Ping carried them: a lost report would leave the master waiting for
        // the move's timeout.
        let sent_results = req.drain_results.clone();
        // One attempt per tick (the next tick retries); the ping of a paused leader is
        // abandoned as soon as the leader key names another master.
        let mut client = m.master.client();
        let ping = tokio::time::timeout(every * 3, client.ping(req));
        let outcome = tokio::select! {
            r = ping => Some(r),
            _ = leader_changed.changed() => None,
        };
        if !matches!(outcome, Some(Ok(Ok(_)))) {
            drain.results.splice(0..0, sent_results);
        }
        let Some(outcome) = outcome else {
            // Ping the new leader right away.
            changed_at = Some(tokio::time::Instant::now());
            tick.reset_immediately();
            continue;
        };
        if outcome.as_ref().is_ok_and(|r| r.is_err())
            && changed_at.is_some_and(|t| t.elapsed() < LEADER_SETTLE)
        {
            tick.reset_after(LEADER_SETTLE_RETRY);
        }
        match outcome {
            Ok(Ok(resp)) => {
                if !healthy {
                    tracing::info!(master = %m.master.addr(), "master reachable again");
                    healthy = true;
                }
                let resp = resp.into_inner();
                if !resp.drain_moves.is_empty() {
                    drain.start(resp.drain_moves);
                }
                if resp.next_ping_ms > 0 {
                    tick.reset_after(Duration::from_millis(u64::from(resp.next_ping_ms)));
                }
                if resp.remount_required && m.server.is_some() {
                    // Not ready until the new master knows the segment again.
                    m.status.set(false);
                    tracing::warn!(master = %m.master.addr(), "master does not know this client (restarted, or a new HA leader): mounting again with inventory");
                    if let Err(e) = m.mount().await {
                        tracing::warn!(error = %e, "re-mount failed; retrying on the next ping");
                    }
                }
            }
            Ok(Err(status)) => {
                m.master.follow_redirect(&status);
                if healthy {
                    tracing::warn!(master = %m.master.addr(), error = %status.message(), "ping failed; will keep trying");
                    healthy = false;
                }
            }
            Err(_) => {
                if healthy {
                    tracing::warn!(master = %m.master.addr(), "ping timed out; will keep trying");
                    healthy = false;
                }
            }
        }
    }
}

/// How long after a leader change a failed ping is retried every [`LEADER_SETTLE_RETRY`].
const LEADER_SETTLE: Duration = Duration::from_secs(3);
const LEADER_SETTLE_RETRY: Duration = Duration::from_millis(50);

pub(crate) fn descriptor(
    info: &SegmentInfo,
    protocol: &ProtocolChoice,
    enable_offload: bool,
) -> pb::SegmentDescriptor {
    pb::SegmentDescriptor {
        name: info.name.clone(),
        transfer_endpoint: info.transfer_endpoint.clone(),
        size: info.size,
        host_id: info.host_id.clone(),
        shm_socket: info.shm_socket.clone().unwrap_or_default(),
        protocol: protocol.effective.as_str().to_owned(),
        enable_offload,
        disk_capacity_bytes: 0,
        instance_id: info.instance_id.clone(),
        requested_protocol: protocol.requested.as_str().to_owned(),
        protocol_reason: protocol.reason_str().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inventory_parts_stay_under_the_message_limit_and_keep_every_item() {
        assert_eq!(inventory_parts(Vec::new()), vec![Vec::new()]);
        let items: Vec<pb::InventoryItem> = (0..40_000u64)
            .map(|i| pb::InventoryItem {
                key: format!("model@tp_rank:0@pp_rank:0@{i:064x}"),
                offset: i * 4096,
                size: 4096,
                generation: (7 << 32) | i,
                kind: pb::ReplicaKind::Memory as i32,
                // As with a pool token: every entry carries its proof.
                proof: vec![0xAB; 16],
            })
            .collect();
        let parts = inventory_parts(items.clone());
        assert!(parts.len() > 1);
        for p in &parts {
            let req = pb::MountInventoryRequest {
                items: p.clone(),
                ..Default::default()
            };
            let len = lunakv_proto::prost::Message::encoded_len(&req);
            assert!(len <= INVENTORY_PART_BYTES, "{len}");
        }
        assert_eq!(parts.concat(), items);
    }
}
