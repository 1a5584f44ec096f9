//! Hosting a segment: serve it, mount it with the master, keep the master informed.
//!
//! Shared by `lunakv-store` (a standalone owner of a big DRAM pool) and by `lunakv-client`'s
//! `StoreClient` in embedded mode, so both behave the same across master restarts: when a Ping answers
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
    ConnLimits, DrainProgress, DrainReport, ProtocolChoice, SegmentInfo, SegmentServer,
    SegmentServerConfig, WireProtocol,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::heartbeat::heartbeat;
use crate::inventory::{DiskInventory, HostDisk};
use crate::mount::{MountStatus, Mounter};

/// Bytes of a new segment faulted in ahead of use (see `SegmentHost::start`).
const PREFAULT_CAP: u64 = 1 << 30;

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
