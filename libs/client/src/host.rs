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

use lunakv_proto::master as pb;
use lunakv_proto::master::master_client::MasterClient;
use lunakv_telemetry::propagate::GrpcInject;
use lunakv_transfer::{
    ColdTier, ConnLimits, DrainProgress, DrainReport, ProtocolChoice, SegmentInfo, SegmentServer,
    SegmentServerConfig, WireProtocol,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

use crate::link::MasterLink;
use crate::{ClientError, MasterWait, startup};

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

/// A master client whose calls carry the caller's trace context (docs/TRACING.md).
pub(crate) type Rpc = MasterClient<InterceptedService<Channel, MasterInject>>;

/// What every call to the master carries: the trace context, and the pool's token when this
/// process has one (`LUNAKV_AUTH_TOKEN` / `LUNAKV_ADMIN_TOKEN`, docs/SECURITY.md).
#[derive(Clone)]
pub(crate) struct MasterInject {
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl tonic::service::Interceptor for MasterInject {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let mut req = GrpcInject.call(req)?;
        if let Some(a) = &self.authorization {
            req.metadata_mut().insert("authorization", a.clone());
        }
        Ok(req)
    }
}

/// The master client over `channel`. The token is read from the environment at each
/// (re)connect, so a rotated token file takes effect on the next connection.
pub(crate) fn master_client(channel: Channel) -> Result<Rpc, ClientError> {
    // A token is printable ASCII (checked when loaded), so the conversion cannot fail.
    let authorization =
        presented_authorization()?.and_then(|a| tonic::metadata::MetadataValue::try_from(a).ok());
    Ok(
        MasterClient::with_interceptor(channel, MasterInject { authorization })
            .max_decoding_message_size(256 << 20),
    )
}

/// The `authorization` value this process presents to the master (`Bearer <token>`), read
/// from the environment now; None without a token.
pub(crate) fn presented_authorization() -> Result<Option<String>, ClientError> {
    let tokens = lunakv_config::auth::PoolTokens::from_env(&lunakv_config::process_env)
        .map_err(|e| ClientError::Config(e.to_string()))?;
    Ok(tokens.presented().map(|t| format!("Bearer {}", t.as_str())))
}

/// TLS towards the master, from this process's `LUNAKV_TLS_*` (or the `tls_*` keys of the
/// engine's mooncake_config.json); `None`: plaintext. Read at each connect, as the token is.
pub(crate) fn master_tls() -> Result<Option<lunakv_tls::ClientTls>, ClientError> {
    let paths = lunakv_config::tls::TlsPaths::client_from_env(&lunakv_config::process_env)
        .map_err(|e| ClientError::Config(e.to_string()))?;
    lunakv_tls::ClientTls::from_paths(&paths).map_err(|e| ClientError::Config(e.to_string()))
}

/// A channel to `addr` (`host:port`), over TLS when `tls` is set; connected now, or lazily.
async fn channel(
    addr: &str,
    endpoint: tonic::transport::Endpoint,
    tls: Option<&lunakv_tls::ClientTls>,
    connect_timeout: Duration,
) -> Result<Channel, ClientError> {
    let connected = match tls {
        Some(t) => {
            endpoint
                .connect_with_connector(t.connector(connect_timeout))
                .await
        }
        None => endpoint.connect().await,
    };
    connected.map_err(|e| match lunakv_tls::TlsFailure::in_chain(&e) {
        Some(f) => ClientError::Tls {
            addr: addr.to_owned(),
            message: f.to_string(),
        },
        None => ClientError::Rpc {
            addr: addr.to_owned(),
            message: format!(
                "cannot connect ({}): is lunakv-master running there?",
                source_chain(&e)
            ),
        },
    })
}

/// [`channel`], connected at the first call (HA leaders).
pub(crate) fn lazy_channel(
    endpoint: tonic::transport::Endpoint,
    tls: Option<&lunakv_tls::ClientTls>,
    connect_timeout: Duration,
) -> Channel {
    match tls {
        Some(t) => endpoint.connect_with_connector_lazy(t.connector(connect_timeout)),
        None => endpoint.connect_lazy(),
    }
}

/// What a master's RPC port requires of its callers' transport (`lunakv doctor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MasterTls {
    /// Plaintext gRPC.
    Off,
    /// TLS, no client certificate asked.
    On,
    /// TLS with a client certificate from its CA (mTLS).
    Mutual,
}

/// [`probe_master_tls`], async.
pub(crate) async fn master_tls_mode(
    addr: &str,
    timeout: Duration,
) -> Result<MasterTls, ClientError> {
    let rpc_err = |message: String| ClientError::Rpc {
        addr: addr.to_owned(),
        message,
    };
    let connect_timeout = Duration::from_secs(3).min(timeout);
    let endpoint = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| rpc_err(format!("not a valid address ({e})")))?
        .connect_timeout(connect_timeout)
        .timeout(timeout);
    let channel = channel(addr, endpoint, None, connect_timeout).await?;
    match MasterClient::new(channel)
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
    {
        Ok(_) => Ok(MasterTls::Off),
        Err(s) => match s
            .metadata()
            .get(lunakv_tls::grpc::TLS_REQUIRED_HEADER)
            .and_then(|v| v.to_str().ok())
        {
            Some("mtls") => Ok(MasterTls::Mutual),
            Some(_) => Ok(MasterTls::On),
            // Refused for its token: a plaintext master.
            None if s.code() == tonic::Code::Unauthenticated => Ok(MasterTls::Off),
            None => Err(rpc_err(format!("status in plaintext: {}", s.message()))),
        },
    }
}

/// What the master at `addr` (`host:port`) requires of its callers' transport, from
/// synchronous code (`lunakv doctor`, which may not have connected: a master with mTLS refuses a
/// doctor without a certificate): one status call in plaintext, which a master with TLS refuses
/// with the `x-lunakv-tls-required` header. Not from inside a runtime.
pub fn probe_master_tls(addr: &str, timeout: Duration) -> Result<MasterTls, ClientError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ClientError::Config(format!("cannot start a runtime: {e}")))?;
    rt.block_on(master_tls_mode(addr, timeout))
}

/// Whether the master at `addr` turns away a caller that presents no pool token: one status
/// call on a fresh connection without credentials (`lunakv doctor`'s security row). Over TLS
/// when this process has it (the certificate is not a token).
pub(crate) async fn refuses_anonymous(addr: &str, timeout: Duration) -> Result<bool, ClientError> {
    let rpc_err = |message: String| ClientError::Rpc {
        addr: addr.to_owned(),
        message,
    };
    let tls = master_tls()?;
    let connect_timeout = Duration::from_secs(3).min(timeout);
    let endpoint = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| rpc_err(format!("not a valid address ({e})")))?
        .connect_timeout(connect_timeout)
        .timeout(timeout);
    let channel = channel(addr, endpoint, tls.as_ref(), connect_timeout).await?;
    let mut anonymous = MasterClient::new(channel);
    match anonymous
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
    {
        Ok(_) => Ok(false),
        Err(s) if s.code() == tonic::Code::Unauthenticated => Ok(true),
        Err(s) => Err(rpc_err(format!("status without a token: {}", s.message()))),
    }
}

pub(crate) async fn connect_master(
    addr: &str,
    timeout: Duration,
    tls: Option<&lunakv_tls::ClientTls>,
) -> Result<Rpc, ClientError> {
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let endpoint = Channel::from_shared(uri).map_err(|e| ClientError::Config(format!(
        "master_server_address '{addr}' is not a valid address ({e}): use host:port, e.g. \"127.0.0.1:50051\""
    )))?;
    speaks_grpc(addr, timeout, tls).await?;
    let connect_timeout = Duration::from_secs(3).min(timeout);
    let endpoint = endpoint
        .tcp_nodelay(true)
        .connect_timeout(connect_timeout)
        .timeout(timeout);
    master_client(channel(addr, endpoint, tls, connect_timeout).await?)
}

/// One look at what `addr` speaks before tonic connects: a peer that closes the connection on
/// the HTTP/2 preface, or answers with something other than HTTP/2, is not a lunakv-master
/// (upstream's `mooncake_master` speaks coro_rpc); without this the first call fails with a bare
/// transport error. `Err` ([`ClientError::Rpc`]) only when that is certain: a refused or silent
/// peer is left to tonic's connect and its usual errors. Over TLS the same look also shows
/// whether the master accepted this client's certificate (under TLS 1.3 its refusal arrives
/// after the handshake), as a [`ClientError::Tls`] that names the certificate.
///
/// A lunakv-master being killed or restarting also closes or resets a connection it had
/// accepted (issue 33 item 10: puts during a master kill were told "not a lunakv-master", which
/// is final). So a peer that closes on the preface is looked at once more: a foreign server
/// closes again, a restarting master by then refuses, stays silent while it starts, or answers
/// HTTP/2. Only the first is "not a lunakv-master"; the others say the master is unreachable or
/// restarting, an error the callers retry.
async fn speaks_grpc(
    addr: &str,
    timeout: Duration,
    tls: Option<&lunakv_tls::ClientTls>,
) -> Result<(), ClientError> {
    let wait = Duration::from_secs(2).min(timeout);
    let how = match look(addr, wait, tls).await? {
        Look::Http2 | Look::Unreachable => return Ok(()),
        Look::Foreign(seen) => return Err(not_a_master(addr, &seen)),
        Look::Closed(how) => how,
    };
    tokio::time::sleep(RELOOK_AFTER.min(wait)).await;
    match look(addr, wait, tls).await? {
        Look::Http2 => Ok(()),
        Look::Foreign(seen) => Err(not_a_master(addr, &seen)),
        Look::Closed(again) => Err(not_a_master(
            addr,
            &format!("it {how} on the HTTP/2 preface, and {again} on it again"),
        )),
        Look::Unreachable => Err(ClientError::Rpc {
            addr: addr.to_owned(),
            message: format!(
                "the master at {addr} {how} before answering, and a moment later no longer \
                 answered: it is unreachable or restarting (retrying)"
            ),
        }),
    }
}

/// How long [`speaks_grpc`] waits before it looks again at a peer that closed on the preface:
/// long enough for a killed process's port to refuse, short next to a connect's timeout.
const RELOOK_AFTER: Duration = Duration::from_millis(200);

/// What one look at the master's port showed.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    /// An HTTP/2 server answered.
    Http2,
    /// No connection (refused, timed out), or a connection that stayed silent.
    Unreachable,
    /// The peer closed ("closed the connection") or reset ("reset the connection") the
    /// connection without a byte.
    Closed(&'static str),
    /// The peer answered something other than HTTP/2: what it answered.
    Foreign(String),
}

fn not_a_master(addr: &str, seen: &str) -> ClientError {
    use lunakv_proto::foreign::NOT_A_LUNAKV_MASTER;
    ClientError::Rpc {
        addr: addr.to_owned(),
        message: format!(
            "the master at {addr} does not speak gRPC ({seen}): {NOT_A_LUNAKV_MASTER} (upstream Mooncake's mooncake_master speaks coro_rpc); point master_server_address at a lunakv-master, or use upstream's mooncake package with an upstream master"
        ),
    }
}

/// Connects to `addr` (over TLS with `tls`) and sends HTTP/2's preface: what came back.
async fn look(
    addr: &str,
    wait: Duration,
    tls: Option<&lunakv_tls::ClientTls>,
) -> Result<Look, ClientError> {
    let host = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    match tls {
        None => {
            let Ok(Ok(s)) = tokio::time::timeout(wait, tokio::net::TcpStream::connect(host)).await
            else {
                return Ok(Look::Unreachable);
            };
            first_frame(addr, s, wait).await
        }
        Some(t) => {
            let s = match t.connect(host, wait).await {
                Ok(s) => s,
                Err(e) => {
                    return match lunakv_tls::TlsFailure::of(&e) {
                        Some(f) => Err(ClientError::Tls {
                            addr: addr.to_owned(),
                            message: f.to_string(),
                        }),
                        None => Ok(Look::Unreachable),
                    };
                }
            };
            first_frame(addr, s, wait).await
        }
    }
}

/// Sends HTTP/2's preface and reads the first frame's header; `Err` when the peer refused this
/// client's TLS certificate.
async fn first_frame<S>(addr: &str, mut s: S, wait: Duration) -> Result<Look, ClientError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use lunakv_proto::foreign::{
        CORO_RPC_MAGIC, HTTP2_EMPTY_SETTINGS, HTTP2_PREFACE, server_speaks_http2,
    };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut hello = HTTP2_PREFACE.to_vec();
    hello.extend_from_slice(&HTTP2_EMPTY_SETTINGS);
    if s.write_all(&hello).await.is_err() {
        return Ok(Look::Unreachable);
    }
    let mut first = [0u8; 9];
    let mut got = 0;
    let mut tls_failure = None;
    let mut reset = false;
    let read = tokio::time::timeout(wait, async {
        while got < first.len() {
            match s.read(&mut first[got..]).await {
                Ok(0) => break,
                Err(e) => {
                    if lunakv_tls::TlsFailure::of(&e).is_some() {
                        tls_failure = Some(e);
                    } else {
                        reset = true;
                    }
                    break;
                }
                Ok(n) => got += n,
            }
        }
    })
    .await;
    if let Some(f) = tls_failure.as_ref().and_then(lunakv_tls::TlsFailure::of) {
        return Err(ClientError::Tls {
            addr: addr.to_owned(),
            message: f.to_string(),
        });
    }
    if read.is_err() && got == 0 {
        // Silent: maybe overloaded, or starting; tonic decides.
        return Ok(Look::Unreachable);
    }
    if server_speaks_http2(&first[..got]) {
        return Ok(Look::Http2);
    }
    Ok(if got == 0 {
        Look::Closed(if reset {
            "reset the connection"
        } else {
            "closed the connection"
        })
    } else if first[0] == CORO_RPC_MAGIC {
        Look::Foreign("it answered with a coro_rpc header".to_string())
    } else {
        Look::Foreign(format!("it answered {:02x?}", &first[..got]))
    })
}

pub(crate) fn rpc_error(addr: &str, status: &tonic::Status) -> ClientError {
    ClientError::Rpc {
        addr: addr.to_owned(),
        message: format!("{:?}: {}", status.code(), status.message()),
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer on loopback that takes `n` connections, reads part of the preface and drops each
    /// (the unread rest makes the kernel reset it), then closes its port.
    fn dropping_peer(n: usize) -> String {
        use std::io::Read;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for _ in 0..n {
                let Ok((mut c, _)) = l.accept() else { return };
                let mut h = [0u8; 20];
                let _ = c.read_exact(&mut h);
            }
            // `l` drops here: the port refuses from now on.
        });
        addr
    }

    /// Issue 33 item 10: a master killed while a client connects resets the connection it had
    /// accepted, then its port refuses. That is a master unreachable or restarting (retried),
    /// not a foreign server (final).
    #[tokio::test]
    async fn a_reset_then_a_refusal_is_a_restarting_master_not_a_foreign_one() {
        let addr = dropping_peer(1);
        let e = speaks_grpc(&addr, Duration::from_secs(5), None)
            .await
            .expect_err("the master went away");
        let msg = e.to_string();
        assert!(
            msg.contains("unreachable or restarting")
                && !msg.contains(lunakv_proto::foreign::NOT_A_LUNAKV_MASTER),
            "{msg}"
        );
        assert!(crate::startup::connect_retryable(&e), "{msg}");
    }

    /// A foreign server (upstream's coro_rpc master) drops the preface every time: still named
    /// as such.
    #[tokio::test]
    async fn a_peer_that_drops_the_preface_twice_is_not_a_lunakv_master() {
        let addr = dropping_peer(2);
        let e = speaks_grpc(&addr, Duration::from_secs(5), None)
            .await
            .expect_err("a foreign server");
        let msg = e.to_string();
        assert!(
            msg.contains(lunakv_proto::foreign::NOT_A_LUNAKV_MASTER) && msg.contains("on it again"),
            "{msg}"
        );
    }

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
