//! # lunakv-cluster
//!
//! A lunakv cluster in the test's own process, for the logic that does not need separate
//! processes (the requester's retries, fallbacks, location cache and failover): a master and
//! any number of segments, all on 127.0.0.1 with ports bound to 0, served by one tokio runtime
//! that the [`Cluster`] owns. A test then connects a `lunakv_client::StoreClient` (which is
//! blocking and brings its own runtime) to [`Cluster::master_address`].
//!
//! Everything is started the way the binaries start it, not a second way: the master with
//! [`lunakv_master::start`] (what `lunakv-master` runs: [`lunakv_master::Master::open`] on a
//! `data_dir`, then the same listeners and background tasks), each segment with
//! [`SegmentHost::bind`] + [`lunakv_segment::BoundSegment::mount`] (what `lunakv-store` and an
//! embedded engine run).
//!
//! Dev-only: no production crate depends on it, and it depends on no requester crate, so
//! `lunakv-client`'s tests take it as a dev-dependency without a cycle.
//!
//! [`HaCluster`] does the same with several HA masters (`--enable_ha`) on a real etcd (started
//! on ephemeral ports), for the leader-change paths.
#![forbid(unsafe_code)]

mod ha;

pub use ha::HaCluster;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lunakv_master::{MasterConfig, RunningMaster};
use lunakv_master_client::MasterWait;
use lunakv_segment::{HostOptions, SegmentHost};
use lunakv_transfer::{ProtocolChoice, WireProtocol};

/// How long a harness step (a start, a remount) may take on a loaded two-core machine before the
/// test fails with the step's name. A bound, never an expected duration.
pub const STEP_DEADLINE: Duration = Duration::from_secs(60);

/// How a [`Cluster`] starts.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Segments started and mounted with the master.
    pub segments: usize,
    /// Bytes of each segment.
    pub segment_size: u64,
    /// The segments' Ping interval: how soon they notice a restarted master and re-mount.
    pub ping_interval: Duration,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            segments: 1,
            segment_size: 16 << 20,
            ping_interval: Duration::from_millis(200),
        }
    }
}

/// A master and its segments in this process. Dropping it stops them all.
pub struct Cluster {
    opts: ClusterOptions,
    /// Field order matters: the runtime drops after the services it runs.
    master: Option<RunningMaster>,
    segments: Vec<Option<SegmentHost>>,
    /// The master's RPC port, kept across [`Cluster::restart_master`] so clients and segments
    /// configured with [`Cluster::master_address`] find the restarted master.
    rpc_port: u16,
    dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
}

/// Why a cluster step failed (the harness's own failures; tests unwrap them).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster: {0}")]
    Io(#[from] std::io::Error),
    #[error("cluster master: {0}")]
    Master(#[from] lunakv_master::ServeError),
    #[error("cluster segment: {0}")]
    Segment(#[from] lunakv_master_client::ClientError),
}

impl Cluster {
    /// A master and one segment.
    pub fn start() -> Result<Cluster, ClusterError> {
        Cluster::with(ClusterOptions::default())
    }

    /// A master and `opts.segments` segments, each mounted before this returns.
    pub fn with(opts: ClusterOptions) -> Result<Cluster, ClusterError> {
        let rt = runtime()?;
        let dir = tempfile::tempdir()?;
        let master = rt.block_on(lunakv_master::start(master_config(dir.path(), 0)))?;
        let mut c = Cluster {
            rpc_port: master.rpc_addr.port(),
            master: Some(master),
            segments: Vec::new(),
            dir,
            rt,
            opts,
        };
        for _ in 0..c.opts.segments {
            c.add_segment()?;
        }
        Ok(c)
    }

    /// `127.0.0.1:PORT` of the master's RPC port (the same across restarts).
    pub fn master_address(&self) -> String {
        format!("127.0.0.1:{}", self.rpc_port)
    }

    /// The running master. Panics while it is stopped.
    pub fn master(&self) -> &RunningMaster {
        self.master.as_ref().expect("the master is stopped")
    }

    /// Starts and mounts one more segment; returns its index.
    pub fn add_segment(&mut self) -> Result<usize, ClusterError> {
        let i = self.segments.len();
        let opts = segment_options(self.master_address(), i, &self.opts);
        let host = self.rt.block_on(start_segment(opts))?;
        self.segments.push(Some(host));
        Ok(i)
    }

    /// The name (`host:port`) of segment `i`, as replicas name it.
    pub fn segment_name(&self, i: usize) -> String {
        self.segment(i).info().name.clone()
    }

    fn segment(&self, i: usize) -> &SegmentHost {
        self.segments[i].as_ref().expect("segment stopped")
    }

    /// Segment `i` disappears as a crashed owner does: it stops serving at once, without
    /// unmounting, so the master still lists its replicas until client_ttl expires it.
    pub fn crash_segment(&mut self, i: usize) {
        let host = self.segments[i].take().expect("segment already stopped");
        // Dropping stops the heartbeat and closes the listener and every live connection.
        let _guard = self.rt.enter();
        drop(host);
    }

    /// Segment `i` stops gracefully: it unmounts (the master drops its replicas), then stops.
    pub fn stop_segment(&mut self, i: usize) {
        let host = self.segments[i].take().expect("segment already stopped");
        self.rt
            .block_on(host.shutdown())
            .expect("segment unmounted");
    }

    /// Whether segment `i` is mounted with the current master.
    pub fn segment_mounted(&self, i: usize) -> bool {
        self.segment(i).status().is_mounted()
    }

    /// Stops the master (a graceful drain); segments and clients keep running and retrying.
    pub fn stop_master(&mut self) -> Result<(), ClusterError> {
        if let Some(m) = self.master.take() {
            self.rt.block_on(m.shutdown())?;
        }
        Ok(())
    }

    /// Starts the master again on the same RPC port and `data_dir`, as a restarted
    /// `lunakv-master` would be: it knows the segments recorded in its meta store and answers
    /// "rebuilding" until they re-mounted with their inventories. Returns once it listens; the
    /// segments re-mount on their next Ping.
    pub fn start_master(&mut self) -> Result<(), ClusterError> {
        assert!(self.master.is_none(), "the master is already running");
        let cfg = master_config(self.dir.path(), self.rpc_port);
        self.master = Some(self.rt.block_on(lunakv_master::start(cfg))?);
        Ok(())
    }

    /// [`Cluster::stop_master`] then [`Cluster::start_master`].
    pub fn restart_master(&mut self) -> Result<(), ClusterError> {
        self.stop_master()?;
        self.start_master()
    }

    /// `master_<rpc>_requests_total` of the current master (it restarts at 0 with the master):
    /// how a test tells whether a client call reached the master at all.
    pub fn master_requests(&self, rpc: &str) -> u64 {
        let name = format!("master_{rpc}_requests_total");
        self.master()
            .core
            .metrics
            .registry
            .gather()
            .iter()
            .find(|f| f.name() == name)
            .and_then(|f| {
                f.get_metric()
                    .first()
                    .map(|m| m.get_counter().get_value() as u64)
            })
            .unwrap_or(0)
    }

    /// Runs `f` in the cluster's runtime (e.g. to read the master's core).
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Segments first: their unmounts go to a master that still answers.
        for s in self.segments.drain(..).flatten() {
            let _ = self.rt.block_on(s.shutdown());
        }
        if let Some(m) = self.master.take() {
            let _ = self.rt.block_on(m.shutdown());
        }
    }
}

/// Polls `cond` until it holds; panics with `what` once `deadline` passed. For conditions the
/// harness cannot be told about (a re-mount after a restart, an expiry).
pub fn wait_for(what: &str, deadline: Duration, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + deadline;
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How segment `i` of a cluster is hosted: loopback, port 0, tcp only (the client reads through
/// the transfer wire, not a shared mapping).
fn segment_options(master: String, i: usize, opts: &ClusterOptions) -> HostOptions {
    HostOptions {
        master_server_address: master,
        client_id: format!("cluster-segment-{i}"),
        cluster_id: MasterConfig::default().cluster_id,
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        advertise_host: None,
        size: opts.segment_size,
        shm_socket: None,
        protocol: ProtocolChoice::resolve(WireProtocol::Tcp),
        enable_offload: false,
        ping_interval: opts.ping_interval,
        rpc_timeout: Duration::from_secs(10),
        limits: Default::default(),
        bind_retry: Duration::ZERO,
    }
}

/// Binds, serves and mounts a segment, as `lunakv-store` does.
async fn start_segment(opts: HostOptions) -> Result<SegmentHost, ClusterError> {
    Ok(SegmentHost::bind(opts, None)?
        .mount(MasterWait::NoWait)
        .await?)
}

/// The runtime a cluster's master and segments run on, beside the test's own thread.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("lunakv-cluster")
        .enable_all()
        .build()
}

fn master_config(dir: &std::path::Path, rpc_port: u16) -> MasterConfig {
    MasterConfig {
        rpc_address: "127.0.0.1".to_owned(),
        rpc_port,
        metrics_port: 0,
        data_dir: dir.to_path_buf(),
        ..MasterConfig::default()
    }
}
