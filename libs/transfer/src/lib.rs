//! lunakv-transfer: the data path of lunakv, the layer that moves object bytes.
//!
//! Two halves:
//! - [`SegmentServer`]: run by a segment owner (`lunakv-store`, or an engine in embedded mode).
//!   It owns a memfd-backed segment and its *entry table* (`generation -> (key, offset, len)`)
//!   and serves it over tcp, plus a unix socket that hands same-host requesters the memfd.
//! - [`TransferEngine`]: used by requesters (`lunakv-client`, the `lunakv` CLI and bench, later
//!   the Python bindings and P/D transfers) to write and read objects, and by the master to
//!   `FREE` entries before it reuses their ranges.
//!
//! Why this shape (see docs/ARCHITECTURE.md): the per-get hot path never calls the master. A
//! read names `(generation, offset, len)`; the owner serves it only if that exact entry exists,
//! pinning it while the bytes are copied, else answers [`TransferError::Stale`] and the caller
//! asks the master again. Frees go through the owner, so a range is never rewritten under a reader.
//!
//! For P/D (a prefill engine writing KV blocks into a decode engine's memory) there is a third
//! piece without generations: [`MemoryRegistry`] + [`RegionServer`] serve raw registered memory,
//! addressed by absolute address, and [`TransferEngine::write_raw`] / `read_raw` / `batch_raw`
//! move bytes to and from it (see `region.rs`).
//!
//! Transports implement [`Transport`]: tcp everywhere, shm when the target is on this host
//! (equal [`host_id`]) and offers a socket, rdma (cargo feature `rdma`, engines built with
//! [`TransferEngine::with_rdma`]) when both sides have a device; [`select_route`] is the rule
//! (docs/RDMA.md). Caller pieces may be GPU memory: [`device`] detects it and every path copies
//! it by DMA (docs/GPU.md). Everything is blocking std I/O on std threads: on small boxes that beats an
//! async runtime for bulk copies, and the hot paths do not allocate per request.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub mod device;
mod drain;
mod guard;
mod local;
mod mem;
mod optimes;
mod raw;
pub mod rdma;
mod region;
mod server;
mod shm;
mod table;
mod tcp;
mod trace;
mod vio;
pub mod wire;

pub use optimes::{OP_TIME_BOUNDS, OpTimesSnapshot, TimedOp};

pub use drain::{ColdDrain, DrainProgress, DrainReport};
pub use guard::raise_fd_limit;
pub use raw::RawRequest;
pub use rdma::{
    GPUDIRECT_ENV, GpuDirect, PeerRdma, ProtocolChoice, RDMA_COMPILED, RdmaDescriptor,
    RdmaTransport, Route, RouteFacts, WireProtocol, gpudirect, rdma_check, rdma_devices,
    select_route,
};
pub use region::{
    MemoryRegistry, OwnedRegion, RegionDesc, RegionServer, RegionServerConfig, RegionStats,
};
pub use server::{ConnStats, SegmentServer};
pub use shm::ShmTransport;
pub use tcp::TcpTransport;
pub use wire::DISK_OFFSET;

/// One object handed to a [`ColdTier`]: its bytes are borrowed from the segment, pinned.
#[derive(Debug, Clone, Copy)]
pub struct ColdItem<'a> {
    pub key: &'a str,
    pub generation: u64,
    pub bytes: &'a [u8],
}

/// Why a [`ColdTier`] could not store or load: the tier's own error, kept whole (not flattened
/// to text) so a caller can log its chain or downcast it; it displays as the tier's error did.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct ColdTierError(pub Box<dyn std::error::Error + Send + Sync + 'static>);

impl ColdTierError {
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> ColdTierError {
        ColdTierError(Box::new(e))
    }
}

/// A segment owner's second tier (the SSD tier of `lunakv-store --enable_offload`), plugged
/// into a [`SegmentServer`] with [`SegmentServer::set_cold_tier`]. The trait keeps this crate
/// free of any storage format; `lunakv-offload` implements it in `lunakv-store`.
pub trait ColdTier: Send + Sync + 'static {
    /// Stores the objects durably; returns the generations now held (already-held ones count).
    /// An error means none of them is held; the caller logs it.
    fn store(&self, items: &[ColdItem<'_>]) -> Result<Vec<u64>, ColdTierError>;
    /// Size of the object if held.
    fn size_of(&self, generation: u64) -> Option<u64>;
    /// Fills `dst` (exactly the object's size) with verified bytes. `Ok(false)`: not held (or
    /// dropped just now because its checksum failed: never served).
    fn load(&self, generation: u64, dst: &mut [u8]) -> Result<bool, ColdTierError>;
    /// Forgets objects (the master removed them).
    fn remove(&self, generations: &[u64]);
    /// Called once before a shutdown drain ([`SegmentServer::begin_drain`]): how many bytes the
    /// drain may write without the tier's own size limit dropping any of them again (older
    /// objects may go to make room). A tier may prepare, e.g. start a new file so that the
    /// drained objects sit after every older one. Default: no bound.
    fn prepare_drain(&self) -> u64 {
        u64::MAX
    }
}

/// Socket buffer size for transfer connections: a 4 MiB object fits in flight at once.
const SOCKET_BUFFER: usize = 4 << 20;

/// Names the node in [`host_id`] instead of the hostname. Containers and Kubernetes pods on one
/// node share the kernel (and its boot id) but each has its own hostname, so without this a
/// store-client pod and an engine pod on the same node would never use shm. Set it to the same
/// value in both (the downward API's `spec.nodeName`) and mount the store's socket directory
/// into both.
pub const NODE_NAME_ENV: &str = "LUNAKV_NODE_NAME";

/// Identifies this machine: the kernel boot id plus the node name ([`NODE_NAME_ENV`], else the
/// hostname). Equal values mean the same kernel, so a memfd passed over a unix socket is usable
/// and shm is allowed (a socket that turns out unreachable falls back to tcp).
pub fn host_id() -> String {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        host_id_from(&boot, std::env::var(NODE_NAME_ENV).ok().as_deref(), || {
            rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned()
        })
    })
    .clone()
}

fn host_id_from(boot: &str, node_name: Option<&str>, hostname: impl FnOnce() -> String) -> String {
    match node_name.map(str::trim).filter(|n| !n.is_empty()) {
        Some(node) => format!("{boot}@node:{node}"),
        None => format!("{boot}@{}", hostname()),
    }
}

/// TCP_NODELAY (requests are small and latency-bound) and large buffers (bulk objects).
/// Public so benchmarks measure raw TCP under the same socket settings as the transfer path.
pub fn tune_socket(s: &std::net::TcpStream) {
    let _ = s.set_nodelay(true);
    let _ = rustix::net::sockopt::set_socket_send_buffer_size(s, SOCKET_BUFFER);
    let _ = rustix::net::sockopt::set_socket_recv_buffer_size(s, SOCKET_BUFFER);
}

/// How a [`SegmentServer`] is started.
#[derive(Debug, Clone)]
pub struct SegmentServerConfig {
    /// Exactly the address the tcp listener binds (port 0 picks a free port).
    pub bind: SocketAddr,
    /// Segment bytes (a sparse memfd: pages are only allocated when written).
    pub size: u64,
    /// Unix socket path offering shm to same-host requesters; `None` offers tcp only.
    pub shm_socket: Option<PathBuf>,
    /// Host used in the advertised name/endpoint; defaults to the bound ip.
    pub advertise_host: Option<String>,
    /// What peers of the tcp listener may hold open.
    pub limits: ConnLimits,
    /// How long to keep retrying a `bind` whose port is in use before failing (see
    /// [`DEFAULT_BIND_RETRY`]); zero fails at once.
    pub bind_retry: Duration,
}

impl Default for SegmentServerConfig {
    /// Loopback, an ephemeral port, no segment (set `size`), tcp only, default limits.
    fn default() -> Self {
        SegmentServerConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            size: 0,
            shm_socket: None,
            advertise_host: None,
            limits: ConnLimits::default(),
            bind_retry: DEFAULT_BIND_RETRY,
        }
    }
}

/// Most tcp connections one source IP may hold open on a segment server by default.
pub const DEFAULT_MAX_CONNS_PER_PEER: u32 = 256;
/// A tcp connection idle this long (no request) is closed by default.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a segment server retries binding a port in use by default.
pub const DEFAULT_BIND_RETRY: Duration = Duration::from_secs(30);

/// Bounds on the connections of a [`SegmentServer`]: one process must not be able to take the
/// descriptors (and threads) every other requester needs. A connection over a cap is closed
/// right after accept and counted ([`SegmentServer::conn_stats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnLimits {
    /// Most tcp connections open from one source IP; 0 = no per-peer cap.
    pub max_conns_per_peer: u32,
    /// Most tcp connections open in all; 0 = derived from the soft RLIMIT_NOFILE at start
    /// (3 descriptors each, a reserve kept for the shm socket's connections, the master link
    /// and files, at most 8192).
    pub max_conns: u32,
    /// A tcp connection that sends no request for this long is closed; pooled requesters
    /// reconnect on their next request without an error. `None` keeps idle connections forever.
    /// A connection that stalls inside a frame this long is cut off too.
    pub idle_timeout: Option<Duration>,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_conns_per_peer: DEFAULT_MAX_CONNS_PER_PEER,
            max_conns: 0,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
        }
    }
}

/// What a segment owner tells the master about its segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Segment name, `host:port`.
    pub name: String,
    /// Where requesters connect over tcp, `host:port`.
    pub transfer_endpoint: String,
    pub size: u64,
    /// [`host_id`] of the owner.
    pub host_id: String,
    /// Unix socket path for shm, if offered.
    pub shm_socket: Option<String>,
    /// The segment's RDMA descriptor (device, gid, region address/length/rkey) once
    /// [`SegmentServer::enable_rdma`] registered it; publish it with [`RdmaDescriptor::to_hex`].
    pub rdma: Option<RdmaDescriptor>,
    /// Random per server instance (a new one each time a segment's memory is created): the
    /// master hands it out with the segment, and a same-host requester checks the ATTACH
    /// answer against it, so it never maps another segment that took over the socket path.
    pub instance_id: String,
}

/// Who answers an ATTACH: a requester maps the memfd only if this is the segment the master
/// named.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SegmentIdentity {
    pub cluster_id: String,
    /// Segment name, `host:port`.
    pub name: String,
    /// [`SegmentInfo::instance_id`].
    pub instance_id: String,
}

/// One committed object in a segment's entry table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub offset: u64,
    pub size: u64,
    pub generation: u64,
}

/// Counters of a segment server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    /// Bytes served to readers (tcp READ and shm PIN).
    pub bytes_read: u64,
    /// Bytes committed by writers (tcp WRITE and shm COMMIT).
    pub bytes_written: u64,
    pub reads: u64,
    pub writes: u64,
    /// Requesters that mapped the segment over the shm socket (ATTACH answered).
    pub shm_attaches: u64,
    /// Committed entries now.
    pub entries: u64,
    /// Sum of committed entry sizes.
    pub used_bytes: u64,
}

/// Engine options.
#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Use shm for same-host targets. `LUNAKV_DISABLE_SHM=1` forces false (benchmarks use it
    /// for their cross-process tcp rows).
    pub enable_shm: bool,
    /// Connections a batch spreads one peer's requests over.
    pub conns_per_peer: usize,
    /// Bound on connecting and on every blocking send/receive.
    pub io_timeout: Duration,
    /// Threads (the caller's included) a batch's in-process copies are spread over once it
    /// moves at least [`LOCAL_SPLIT_MIN_BYTES`] per thread. One memcpy stream does not saturate
    /// memory bandwidth: two threads copy a vLLM batch ~1.7x faster than one on a 2-core box.
    /// Default: the machine's cores, at most 2 (the engine shares the box with its model loop).
    pub copy_threads: usize,
}

/// True when `LUNAKV_DISABLE_SHM` is set to 1/true/yes.
fn shm_disabled_by_env() -> bool {
    std::env::var("LUNAKV_DISABLE_SHM")
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
        .unwrap_or(false)
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            enable_shm: !shm_disabled_by_env(),
            conns_per_peer: 4,
            io_timeout: Duration::from_secs(10),
            copy_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(2),
        }
    }
}

/// Where a transfer goes: one segment, as registered with the master.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// tcp `host:port` of the owner.
    pub endpoint: String,
    /// Owner's [`host_id`]; equal to ours means shm is possible.
    pub host_id: String,
    /// Owner's unix socket for shm, if offered.
    pub shm_socket: Option<String>,
    /// Segment size; ranges past it are refused before anything is sent.
    pub size: u64,
    /// The segment's [`SegmentInfo::instance_id`] as the master knows it. shm maps only a
    /// segment whose ATTACH answer carries this id; `None` (a master that predates it) skips
    /// the check.
    pub instance_id: Option<String>,
}

impl From<&SegmentInfo> for Target {
    fn from(i: &SegmentInfo) -> Target {
        Target {
            endpoint: i.transfer_endpoint.clone(),
            host_id: i.host_id.clone(),
            shm_socket: i.shm_socket.clone(),
            size: i.size,
            instance_id: Some(i.instance_id.clone()),
        }
    }
}

/// One request of a [`TransferEngine::batch`].
#[derive(Debug)]
pub enum TransferRequest<'a> {
    Read {
        target: &'a Target,
        generation: u64,
        offset: u64,
        dst: Vec<&'a mut [u8]>,
    },
    Write {
        target: &'a Target,
        generation: u64,
        key: &'a str,
        offset: u64,
        src: Vec<&'a [u8]>,
    },
}

/// Errors of the data path.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The owner has no entry with this generation/offset/len: it was evicted, removed or
    /// overwritten. Drop the cached location and ask the master.
    #[error(
        "generation {generation} is stale at the owner (evicted, removed or overwritten); ask the master for the current location"
    )]
    Stale { generation: u64 },
    #[error(
        "range [{offset}, {offset}+{len}) is outside the {size} byte segment; the location is wrong or the segment was remounted smaller"
    )]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error(
        "cannot connect to {endpoint}: {source}; check the segment owner is running and reachable at that address"
    )]
    Connect {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    /// A listener could not bind its configured address.
    #[error(
        "cannot bind {addr}: {source}; the address is in use or not local to this host, pick another port/host"
    )]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// I/O failure on an established connection: `(endpoint, error)`.
    #[error(
        "i/o error talking to {0}: {1}; the owner may have restarted or died, retry or ask the master"
    )]
    Io(String, #[source] std::io::Error),
    #[error("transfer protocol error: {0}; peer and local lunakv versions may differ")]
    Protocol(String),
    /// A socket operation exceeded `TransferOptions::io_timeout`, or FREE waited its whole budget
    /// for readers' pins (the entries are dropped regardless).
    #[error(
        "transfer timed out; the peer is overloaded or stuck (raise TransferOptions.io_timeout), or FREE waited too long for pinned readers"
    )]
    Timeout,
    #[error("shm unavailable: {0}")]
    ShmUnavailable(String),
    /// A live process already serves the shm socket path: never unlinked, since its clients
    /// would then map this segment instead of theirs.
    #[error(
        "the shm socket {path} is in use by a live process ({owner}); give this store a path of its own (--shm_socket=<file or directory/>) or stop that process"
    )]
    ShmSocketInUse { path: String, owner: String },
    /// The request itself is invalid (zero length, key too long, refused by the owner).
    #[error("invalid transfer request: {0}")]
    InvalidArgument(String),
    /// RDMA cannot be used: this build lacks the `rdma` feature, no device exists (the message
    /// is one line naming the fix), or a peer refused `RDMA_CONNECT`.
    #[error("{0}")]
    RdmaUnavailable(String),
    /// A copy to or from device (GPU) memory failed (docs/GPU.md).
    #[error("device memory: {0}")]
    Device(String),
    /// The NIC refused to register device (GPU) memory (no GPUDirect RDMA). The engine
    /// remembers it and serves such requests over tcp, staged; callers never see it.
    #[error("GPUDirect RDMA refused: {0}")]
    GpuDirectRefused(String),
}

impl From<device::DeviceError> for TransferError {
    fn from(e: device::DeviceError) -> TransferError {
        TransferError::Device(e.to_string())
    }
}

impl TransferError {
    /// A copy for fanning one connection failure out to every request that was riding on it
    /// (`std::io::Error` is not `Clone`).
    pub fn duplicate(&self) -> TransferError {
        match self {
            TransferError::Stale { generation } => TransferError::Stale {
                generation: *generation,
            },
            TransferError::OutOfBounds { offset, len, size } => TransferError::OutOfBounds {
                offset: *offset,
                len: *len,
                size: *size,
            },
            TransferError::Connect { endpoint, source } => TransferError::Connect {
                endpoint: endpoint.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            TransferError::Bind { addr, source } => TransferError::Bind {
                addr: addr.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            TransferError::Io(ep, e) => {
                TransferError::Io(ep.clone(), std::io::Error::new(e.kind(), e.to_string()))
            }
            TransferError::Protocol(m) => TransferError::Protocol(m.clone()),
            TransferError::Timeout => TransferError::Timeout,
            TransferError::ShmUnavailable(m) => TransferError::ShmUnavailable(m.clone()),
            TransferError::ShmSocketInUse { path, owner } => TransferError::ShmSocketInUse {
                path: path.clone(),
                owner: owner.clone(),
            },
            TransferError::InvalidArgument(m) => TransferError::InvalidArgument(m.clone()),
            TransferError::RdmaUnavailable(m) => TransferError::RdmaUnavailable(m.clone()),
            TransferError::Device(m) => TransferError::Device(m.clone()),
            TransferError::GpuDirectRefused(m) => TransferError::GpuDirectRefused(m.clone()),
        }
    }
}

/// A way to move bytes to and from a segment. tcp and shm implement it; an RDMA transport
/// implements the same three calls.
pub trait Transport: Send + Sync {
    /// Short name for logs and metrics ("tcp", "shm").
    fn name(&self) -> &'static str;
    /// Stores the concatenation of `src` at `offset` as entry `generation` named `key`.
    fn write(
        &self,
        t: &Target,
        generation: u64,
        key: &str,
        offset: u64,
        src: &[&[u8]],
    ) -> Result<(), TransferError>;
    /// Fills `dst` in order from entry `(generation, offset, total dst len)`.
    fn read(
        &self,
        t: &Target,
        generation: u64,
        offset: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError>;
    /// Runs requests that all go to `t`, results in order. The default runs them one by one;
    /// transports that can pipeline override it.
    fn submit(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
    ) -> Vec<Result<(), TransferError>> {
        reqs.iter_mut().map(|r| self.execute(t, r)).collect()
    }

    /// One request through [`Transport::write`] or [`Transport::read`].
    fn execute(&self, t: &Target, req: &mut TransferRequest<'_>) -> Result<(), TransferError> {
        req.dispatch(
            |_, generation, key, offset, src| self.write(t, generation, key, offset, src),
            |_, generation, offset, dst| self.read(t, generation, offset, dst),
        )
    }
}

/// A batch is split into units of at least this many bytes per connection; below that a thread
/// costs more than it saves on a small box.
const MIN_UNIT_BYTES: u64 = 512 * 1024;
/// In-process copies are split across threads only in shares of at least this many bytes: a
/// scoped thread costs ~30 us, which a 2 MiB copy (~250 us) amortises.
pub const LOCAL_SPLIT_MIN_BYTES: u64 = 2 << 20;
/// How long a failed shm attach sends a target to tcp before trying shm again.
const SHM_RETRY_AFTER: Duration = Duration::from_secs(10);
/// How long a peer that refused `RDMA_CONNECT` is served over tcp before asking again.
const RDMA_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A request to an in-process segment inside [`TransferEngine::batch`]: its index in the batch,
/// the server, the request.
type LocalReq<'r, 'a> = (
    usize,
    std::sync::Arc<server::Shared>,
    &'r mut TransferRequest<'a>,
);

/// Helper threads (beside the caller) for in-process requests of `lens` bytes: one per
/// [`LOCAL_SPLIT_MIN_BYTES`] beyond the first share, at most `copy_threads - 1`, never more
/// than requests to share out.
fn copy_helpers(lens: &[u64], copy_threads: usize) -> usize {
    let total: u64 = lens.iter().sum();
    let shares = (total / LOCAL_SPLIT_MIN_BYTES).min(lens.len() as u64) as usize;
    shares.min(copy_threads).saturating_sub(1)
}

/// Moves bytes between caller buffers and segments. `Send + Sync`: one engine per process,
/// shared by every thread; it pools tcp connections per endpoint and caches shm attachments.
pub struct TransferEngine {
    enable_shm: bool,
    tcp: TcpTransport,
    shm: ShmTransport,
    /// shm sockets whose attach failed, and when: they go over tcp for a while.
    shm_failed: Mutex<std::collections::HashMap<String, Instant>>,
    /// The RDMA transport, when built with [`TransferEngine::with_rdma`].
    rdma: Option<RdmaTransport>,
    /// Endpoints that answered `RDMA_CONNECT`: `(offered, when)`.
    rdma_peers: Mutex<std::collections::HashMap<String, (bool, Instant)>>,
    /// Segment servers of this process reached by direct memcpy ([`TransferEngine::attach_local`]).
    local: local::LocalSegments,
    /// [`TransferOptions::copy_threads`], at least 1.
    copy_threads: usize,
}

impl TransferEngine {
    pub fn new(opts: TransferOptions) -> TransferEngine {
        TransferEngine {
            enable_shm: opts.enable_shm && !shm_disabled_by_env(),
            tcp: TcpTransport::new(opts.conns_per_peer, opts.io_timeout),
            shm: ShmTransport::new(opts.conns_per_peer, opts.io_timeout),
            shm_failed: Mutex::new(std::collections::HashMap::new()),
            rdma: None,
            rdma_peers: Mutex::new(std::collections::HashMap::new()),
            local: local::LocalSegments::default(),
            copy_threads: opts.copy_threads.max(1),
        }
    }

    /// Lets this engine reach `server`, a segment server of this same process (embedded mode:
    /// the engine's own segment), by direct memcpy against its mapping and entry table: no
    /// socket, no syscall. Requests whose [`Target`] names the server (same endpoint and host)
    /// take this path before shm, rdma or tcp, with the same generation checks, overlap
    /// invalidation and stats. The engine holds a weak reference: a dropped or shut-down server
    /// is skipped. Attaching again (or another server on the same endpoint) replaces it.
    pub fn attach_local(&self, server: &SegmentServer) {
        self.local.attach(server);
    }

    /// Undoes [`TransferEngine::attach_local`]; requests to `server` use the sockets again.
    pub fn detach_local(&self, server: &SegmentServer) {
        self.local.detach(server);
    }

    /// True if requests to `t` take the in-process path (an attached, running server).
    pub fn is_local(&self, t: &Target) -> bool {
        self.local.find(t).is_some()
    }

    /// An engine that also moves bytes over RDMA (what `protocol: "rdma"` selects): per target,
    /// shm on the same host, else rdma if the target offers it, else tcp ([`select_route`]).
    /// Fails with [`TransferError::RdmaUnavailable`] (one line naming the fix) when this build
    /// has no `rdma` feature or no RDMA device is present; it never falls back silently.
    pub fn with_rdma(opts: TransferOptions) -> Result<TransferEngine, TransferError> {
        let rdma = RdmaTransport::open(opts.conns_per_peer, opts.io_timeout)?;
        let mut e = TransferEngine::new(opts);
        e.rdma = Some(rdma);
        Ok(e)
    }

    /// True if this engine has an open RDMA device.
    pub fn has_rdma(&self) -> bool {
        self.rdma.is_some()
    }

    /// What this engine knows about `endpoint`'s RDMA offer.
    fn peer_rdma(&self, endpoint: &str) -> PeerRdma {
        let mut peers = self.rdma_peers.lock();
        match peers.get(endpoint) {
            None => PeerRdma::Unknown,
            Some(&(true, _)) => PeerRdma::Offered,
            Some(&(false, at)) if at.elapsed() < RDMA_RETRY_AFTER => PeerRdma::NotOffered,
            Some(_) => {
                peers.remove(endpoint);
                PeerRdma::Unknown
            }
        }
    }

    fn note_rdma(&self, t: &Target, offered: Result<(), &TransferError>) {
        let ok = offered.is_ok();
        if let Err(e) = offered {
            tracing::warn!(endpoint = %t.endpoint, error = %e, "peer offers no rdma; using tcp for it");
        }
        self.rdma_peers
            .lock()
            .insert(t.endpoint.clone(), (ok, Instant::now()));
    }

    /// The transport requests to `t` take now ([`select_route`] over what the engine knows).
    pub fn route_for(&self, t: &Target) -> Route {
        let same_host = t.host_id == host_id();
        let shm_offered = t.shm_socket.is_some();
        select_route(&RouteFacts {
            shm_enabled: self.enable_shm,
            same_host,
            shm_offered,
            // uses_shm also expires old failures.
            shm_failed_recently: self.enable_shm && same_host && shm_offered && !self.uses_shm(t),
            local_rdma: self.rdma.is_some(),
            peer_rdma: self.peer_rdma(&t.endpoint),
        })
    }

    /// The rdma transport if `t` offers rdma (asking it once), else tcp.
    fn rdma_or_tcp(&self, t: &Target) -> &dyn Transport {
        let Some(rdma) = &self.rdma else {
            return &self.tcp;
        };
        if self.peer_rdma(&t.endpoint) == PeerRdma::Offered {
            return rdma;
        }
        match rdma.probe(t) {
            Ok(()) => {
                self.note_rdma(t, Ok(()));
                rdma
            }
            Err(e @ TransferError::RdmaUnavailable(_)) => {
                self.note_rdma(t, Err(&e));
                &self.tcp
            }
            // Unreachable peer or a broken rdma setup: let the request report it.
            Err(_) => rdma,
        }
    }

    /// True if requests to `t` go over shm: shm enabled, same host, socket offered, and no
    /// recent attach failure.
    pub fn uses_shm(&self, t: &Target) -> bool {
        let Some(path) = t.shm_socket.as_deref() else {
            return false;
        };
        if !self.enable_shm || t.host_id != host_id() {
            return false;
        }
        let mut failed = self.shm_failed.lock();
        match failed.get(path) {
            Some(at) if at.elapsed() < SHM_RETRY_AFTER => false,
            Some(_) => {
                failed.remove(path);
                true
            }
            None => true,
        }
    }

    /// The transport for a batch unit: shm only if the segment attaches (cached after the
    /// first time), so a batch never fails just because shm is unusable.
    fn pick(&self, t: &Target) -> &dyn Transport {
        match self.route_for(t) {
            Route::Tcp => return &self.tcp,
            Route::Rdma => return self.rdma_or_tcp(t),
            Route::Shm => {}
        }
        match self.shm.probe(t) {
            Ok(()) => &self.shm,
            Err(e) => {
                tracing::warn!(endpoint = %t.endpoint, error = %e, "shm unavailable, falling back to tcp");
                if let Some(p) = &t.shm_socket {
                    self.shm_failed.lock().insert(p.clone(), Instant::now());
                }
                self.rdma_or_tcp(t)
            }
        }
    }

    /// True when requests to `t` would take rdma but carry device pieces and GPUDirect was
    /// refused: the rdma transport registers caller memory with the NIC, which device memory
    /// needs GPUDirect for, so they go over tcp, staged (docs/GPU.md). `has_device` is only
    /// asked on an rdma route.
    fn rdma_skips_device(&self, t: &Target, has_device: impl FnOnce() -> bool) -> bool {
        self.rdma.is_some()
            && !gpudirect().allowed()
            && self.route_for(t) == Route::Rdma
            && has_device()
    }

    /// Serves again over tcp, staged, every request the rdma transport answered with
    /// [`TransferError::GpuDirectRefused`], and remembers the refusal (one WARN line).
    fn redo_refused_device(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
        out: &mut [Result<(), TransferError>],
    ) {
        let mut idx = Vec::new();
        let mut again: Vec<&mut TransferRequest<'_>> = Vec::new();
        for (k, (r, req)) in out.iter().zip(reqs.iter_mut()).enumerate() {
            if let Err(TransferError::GpuDirectRefused(why)) = r {
                gpudirect().refuse(why);
                idx.push(k);
                again.push(&mut **req);
            }
        }
        if again.is_empty() {
            return;
        }
        for (k, r) in idx.into_iter().zip(self.tcp.submit(t, &mut again)) {
            out[k] = r;
        }
    }

    /// Runs `op` on the chosen transport; if shm turns out unusable, remembers that and uses tcp.
    fn route<R>(
        &self,
        t: &Target,
        mut op: impl FnMut(&dyn Transport) -> Result<R, TransferError>,
    ) -> Result<R, TransferError> {
        match self.route_for(t) {
            Route::Tcp => return op(&self.tcp),
            Route::Rdma => return op(self.rdma_or_tcp(t)),
            Route::Shm => {}
        }
        match op(&self.shm) {
            Err(TransferError::ShmUnavailable(why)) => {
                tracing::warn!(endpoint = %t.endpoint, %why, "shm unavailable, falling back to tcp");
                if let Some(p) = &t.shm_socket {
                    self.shm_failed.lock().insert(p.clone(), Instant::now());
                }
                op(self.rdma_or_tcp(t))
            }
            r => r,
        }
    }

    /// One request, on the calling thread, routed like [`TransferEngine::write`] /
    /// [`TransferEngine::read`].
    pub fn execute(&self, req: &mut TransferRequest<'_>) -> Result<(), TransferError> {
        req.dispatch(
            |t, generation, key, offset, src| self.write(t, generation, key, offset, src),
            |t, generation, offset, dst| self.read(t, generation, offset, dst),
        )
    }

    /// Writes the concatenation of `src` (scatter-gather: one piece per layer is fine) at
    /// `offset` of `t`'s segment, recorded as entry `generation` for `key`.
    pub fn write(
        &self,
        t: &Target,
        generation: u64,
        key: &str,
        offset: u64,
        src: &[&[u8]],
    ) -> Result<(), TransferError> {
        if let Some(s) = self.local.find(t) {
            return local::write(&s, t, generation, key, offset, src);
        }
        if self.rdma_skips_device(t, || device::any_device(src)) {
            return self.tcp.write(t, generation, key, offset, src);
        }
        match self.route(t, |tr| tr.write(t, generation, key, offset, src)) {
            Err(TransferError::GpuDirectRefused(why)) => {
                gpudirect().refuse(&why);
                self.tcp.write(t, generation, key, offset, src)
            }
            r => r,
        }
    }

    /// Reads entry `(generation, offset, total len of dst)` into the `dst` pieces, in order.
    pub fn read(
        &self,
        t: &Target,
        generation: u64,
        offset: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        if let Some(s) = self.local.find(t) {
            return local::read(&s, t, generation, offset, dst);
        }
        if self.rdma_skips_device(t, || device::any_device_mut(dst)) {
            return self.tcp.read(t, generation, offset, dst);
        }
        match self.route(t, |tr| tr.read(t, generation, offset, dst)) {
            Err(TransferError::GpuDirectRefused(why)) => {
                gpudirect().refuse(&why);
                self.tcp.read(t, generation, offset, dst)
            }
            r => r,
        }
    }

    /// Runs many requests; results in request order. Requests are grouped per target, each
    /// group pipelined on up to `conns_per_peer` connections, all groups in parallel. Requests
    /// to attached in-process segments run on the calling thread, beside the others.
    pub fn batch(&self, reqs: &mut [TransferRequest<'_>]) -> Vec<Result<(), TransferError>> {
        let total = reqs.len();
        // Requests to in-process segments, with the server (looked up once per target).
        let mut locals: Vec<LocalReq<'_, '_>> = Vec::new();
        let mut local_seen: Vec<(&Target, Option<std::sync::Arc<server::Shared>>)> = Vec::new();
        // Group by target (few peers per batch: linear search beats hashing).
        let mut groups: Vec<(&Target, Vec<(usize, &mut TransferRequest<'_>)>)> = Vec::new();
        for (i, r) in reqs.iter_mut().enumerate() {
            let t: &Target = match r {
                TransferRequest::Read { target, .. } | TransferRequest::Write { target, .. } => {
                    target
                }
            };
            let shared = match local_seen.iter().find(|(g, _)| *g == t) {
                Some((_, s)) => s.clone(),
                None => {
                    let s = self.local.find(t);
                    local_seen.push((t, s.clone()));
                    s
                }
            };
            if let Some(s) = shared {
                locals.push((i, s, r));
                continue;
            }
            match groups.iter_mut().find(|(g, _)| *g == t) {
                Some((_, v)) => v.push((i, r)),
                None => groups.push((t, vec![(i, r)])),
            }
        }
        // Split each group into units, one connection (and thread) each.
        let mut units: Vec<(&Target, Vec<(usize, &mut TransferRequest<'_>)>)> = Vec::new();
        for (t, v) in groups {
            let bytes: u64 = v.iter().map(|(_, r)| r.len()).sum();
            let n = (self.tcp.conns_per_peer() as u64)
                .min(bytes.div_ceil(MIN_UNIT_BYTES))
                .min(v.len() as u64)
                .max(1) as usize;
            let per = v.len().div_ceil(n);
            let mut v = v;
            while v.len() > per {
                let rest = v.split_off(per);
                units.push((t, v));
                v = rest;
            }
            units.push((t, v));
        }
        let mut results: Vec<Option<Result<(), TransferError>>> =
            (0..total).map(|_| None).collect();
        let run_locals = |locals: Vec<LocalReq<'_, '_>>| self.run_locals(locals);
        let run_unit = |t: &Target,
                        v: &mut Vec<(usize, &mut TransferRequest<'_>)>|
         -> Vec<(usize, Result<(), TransferError>)> {
            let idx: Vec<usize> = v.iter().map(|(i, _)| *i).collect();
            let mut rs: Vec<&mut TransferRequest<'_>> =
                v.iter_mut().map(|(_, r)| &mut **r).collect();
            let tr: &dyn Transport =
                if self.rdma_skips_device(t, || rs.iter().any(|r| r.has_device())) {
                    &self.tcp
                } else {
                    self.pick(t)
                };
            let mut out = tr.submit(t, &mut rs);
            self.redo_refused_device(t, &mut rs, &mut out);
            idx.into_iter().zip(out).collect()
        };
        // Units on other threads send the caller's trace context too.
        let carry = trace::Carry::current();
        let run_unit = |t: &Target, v: &mut Vec<(usize, &mut TransferRequest<'_>)>| {
            carry.run(|| run_unit(t, v))
        };
        let mut collected: Vec<(usize, Result<(), TransferError>)> = Vec::new();
        if units.is_empty() {
            collected = run_locals(locals);
        } else if !locals.is_empty() {
            // The local copies run here while the remote units run on their own threads.
            std::thread::scope(|s| {
                let handles: Vec<_> = units
                    .into_iter()
                    .map(|(t, mut v)| s.spawn(move || run_unit(t, &mut v)))
                    .collect();
                collected = run_locals(locals);
                for h in handles {
                    match h.join() {
                        Ok(r) => collected.extend(r),
                        Err(p) => std::panic::resume_unwind(p),
                    }
                }
            });
        } else if units.len() == 1 {
            let (t, mut v) = units.pop().unwrap_or_else(|| unreachable!());
            collected = run_unit(t, &mut v);
        } else if !units.is_empty() {
            std::thread::scope(|s| {
                let mut first = None;
                let mut handles = Vec::new();
                for (t, mut v) in units {
                    if first.is_none() {
                        first = Some((t, v));
                        continue;
                    }
                    handles.push(s.spawn(move || run_unit(t, &mut v)));
                }
                if let Some((t, mut v)) = first {
                    collected.extend(run_unit(t, &mut v));
                }
                for h in handles {
                    match h.join() {
                        Ok(r) => collected.extend(r),
                        Err(p) => std::panic::resume_unwind(p),
                    }
                }
            });
        }
        for (i, r) in collected {
            results[i] = Some(r);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(TransferError::Protocol(
                        "a batch request got no result".into(),
                    ))
                })
            })
            .collect()
    }

    /// Runs a batch's in-process requests: on the calling thread, or, when the batch is large
    /// enough, shared out over up to `copy_threads` threads (the caller's included). Each
    /// request is still one entry written or read whole by one thread, with the same
    /// invalidate -> copy -> commit and pin -> copy -> unpin as alone.
    fn run_locals(&self, locals: Vec<LocalReq<'_, '_>>) -> Vec<(usize, Result<(), TransferError>)> {
        // With device pieces (all puts or all gets, as clients batch them), each thread queues
        // its requests' DMA on its stream and synchronizes once before committing/unpinning.
        if device::layer().is_some() && locals.len() > 1 {
            let reads = locals
                .iter()
                .filter(|(_, _, r)| matches!(r, TransferRequest::Read { .. }))
                .count();
            // A read pinned by this thread would stall a later overlapping write of the same
            // batch (it waits for pins), so mixed batches keep one sync per request.
            let one_direction = reads == 0 || reads == locals.len();
            if one_direction && locals.iter().any(|(_, _, r)| r.has_device()) {
                return self.run_locals_queued(locals);
            }
        }
        let one = |(i, s, r): LocalReq<'_, '_>| (i, local::execute(&s, r));
        let lens: Vec<u64> = locals.iter().map(|(_, _, r)| r.len()).collect();
        let helpers = copy_helpers(&lens, self.copy_threads);
        if helpers == 0 {
            return locals.into_iter().map(one).collect();
        }
        // Work sharing, not a fixed split: each thread claims the next request until none is
        // left, so a helper the scheduler starts late (a busy box) costs nothing: the caller
        // simply copies more. The lock per slot is uncontended (each index is claimed once).
        let slots: Vec<parking_lot::Mutex<Option<LocalReq<'_, '_>>>> = locals
            .into_iter()
            .map(|l| parking_lot::Mutex::new(Some(l)))
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let work = || {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(slot) = slots.get(i) else {
                    return out;
                };
                if let Some(req) = slot.lock().take() {
                    out.push(one(req));
                }
            }
        };
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..helpers).map(|_| sc.spawn(work)).collect();
            let mut out = work();
            for h in handles {
                match h.join() {
                    Ok(r) => out.extend(r),
                    Err(p) => std::panic::resume_unwind(p),
                }
            }
            out
        })
    }

    /// [`TransferEngine::run_locals`] for a batch with device pieces: the same work sharing,
    /// but each thread starts its requests on one [`device::Copier`], synchronizes it once, then
    /// commits or unpins them.
    fn run_locals_queued(
        &self,
        locals: Vec<LocalReq<'_, '_>>,
    ) -> Vec<(usize, Result<(), TransferError>)> {
        let lens: Vec<u64> = locals.iter().map(|(_, _, r)| r.len()).collect();
        let helpers = copy_helpers(&lens, self.copy_threads);
        let slots: Vec<parking_lot::Mutex<Option<LocalReq<'_, '_>>>> = locals
            .into_iter()
            .map(|l| parking_lot::Mutex::new(Some(l)))
            .collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let work = || {
            let mut out = Vec::new();
            let Some(mut c) = device::Copier::new() else {
                return out;
            };
            let mut started = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(slot) = slots.get(i) else { break };
                if let Some((i, s, r)) = slot.lock().take() {
                    match local::start(&s, r, &mut c) {
                        Ok(q) => started.push((i, s, q)),
                        Err(e) => out.push((i, Err(e))),
                    }
                }
            }
            let synced = c.sync().map_err(TransferError::from);
            for (i, s, q) in started {
                out.push((i, q.finish(&s, &synced)));
            }
            out
        };
        if helpers == 0 {
            return work();
        }
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..helpers).map(|_| sc.spawn(work)).collect();
            let mut out = work();
            for h in handles {
                match h.join() {
                    Ok(r) => out.extend(r),
                    Err(p) => std::panic::resume_unwind(p),
                }
            }
            out
        })
    }

    /// FREE: asks the owner at `endpoint` to drop entries `(generation, offset)`; returns once it
    /// has, after their readers' pins are released. `Err(Timeout)` if pins outlived `timeout`
    /// (the entries are dropped anyway). Used by the master before reusing a range.
    pub fn free(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<(), TransferError> {
        self.tcp.free(endpoint, items, timeout)
    }

    /// OFFLOAD: asks the owner at `endpoint` to move entries `(generation, offset)` to its disk
    /// tier and drop them from DRAM. Returns the generations it could not store (they are gone
    /// from DRAM too). Used by the master's eviction when the owner offloads.
    pub fn offload(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<Vec<u64>, TransferError> {
        self.tcp.offload(endpoint, items, timeout)
    }

    /// LOAD: reads object `generation` (total length of `dst`) from the owner's DRAM or disk
    /// tier, over tcp (the disk read dominates; shm would not save anything).
    pub fn load(
        &self,
        t: &Target,
        generation: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        self.tcp.load(&t.endpoint, generation, dst)
    }
}

// Compile-time check: one engine and one server are shared by many threads.
const _: () = {
    const fn is<T: Send + Sync>() {}
    is::<TransferEngine>();
    is::<SegmentServer>();
    is::<RegionServer>();
    is::<MemoryRegistry>();
    is::<TransferError>();
};

impl TransferRequest<'_> {
    /// Runs `write(target, generation, key, offset, src)` or `read(target, generation, offset,
    /// dst)` for this request: the one place a request is taken apart, for every path that
    /// executes one (engine, transports, the in-process segment).
    pub(crate) fn dispatch<R>(
        &mut self,
        write: impl FnOnce(&Target, u64, &str, u64, &[&[u8]]) -> R,
        read: impl FnOnce(&Target, u64, u64, &mut [&mut [u8]]) -> R,
    ) -> R {
        match self {
            TransferRequest::Write {
                target,
                generation,
                key,
                offset,
                src,
            } => write(target, *generation, key, *offset, src),
            TransferRequest::Read {
                target,
                generation,
                offset,
                dst,
            } => read(target, *generation, *offset, dst),
        }
    }

    /// Payload bytes of this request.
    pub fn len(&self) -> u64 {
        match self {
            TransferRequest::Read { dst, .. } => dst.iter().map(|d| d.len() as u64).sum(),
            TransferRequest::Write { src, .. } => src.iter().map(|d| d.len() as u64).sum(),
        }
    }

    /// True if the request moves no bytes (it will be refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True if a piece is device memory ([`device`]).
    pub fn has_device(&self) -> bool {
        match self {
            TransferRequest::Read { dst, .. } => device::any_device_mut(dst),
            TransferRequest::Write { src, .. } => device::any_device(src),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        SegmentServer, SegmentServerConfig, Target, TransferEngine, TransferError, TransferOptions,
        TransferRequest, gpudirect,
    };
    use super::{copy_helpers, host_id_from};

    /// What the rdma transport answers for a device piece the NIC refuses (no GPUDirect): the
    /// engine serves exactly those requests again over tcp and remembers the refusal.
    #[test]
    fn requests_refused_by_gpudirect_are_served_over_tcp() {
        let s = SegmentServer::start(SegmentServerConfig {
            bind: "127.0.0.1:0".parse().unwrap(),
            size: 1 << 20,
            ..Default::default()
        })
        .unwrap();
        let t = Target::from(&s.info());
        let e = TransferEngine::new(TransferOptions {
            enable_shm: false,
            ..TransferOptions::default()
        });
        let (a, b) = (vec![1u8; 4096], vec![2u8; 4096]);
        let mut reqs = [
            TransferRequest::Write {
                target: &t,
                generation: 1,
                key: "a",
                offset: 0,
                src: vec![&a[..]],
            },
            TransferRequest::Write {
                target: &t,
                generation: 2,
                key: "b",
                offset: 4096,
                src: vec![&b[..]],
            },
        ];
        let mut rs: Vec<&mut TransferRequest<'_>> = reqs.iter_mut().collect();
        // The first "went over rdma" and failed for another reason; the second was refused.
        let mut out = vec![
            Err(TransferError::Timeout),
            Err(TransferError::GpuDirectRefused(
                "ibv_reg_mr: Bad address".into(),
            )),
        ];
        e.redo_refused_device(&t, &mut rs, &mut out);
        assert!(
            matches!(out[0], Err(TransferError::Timeout)),
            "{:?}",
            out[0]
        );
        assert!(out[1].is_ok(), "{:?}", out[1]);
        assert!(!gpudirect().allowed());
        assert!(gpudirect().describe().contains("Bad address"));
        let mut got = vec![0u8; 4096];
        e.read(&t, 2, 4096, &mut [&mut got[..]]).unwrap();
        assert_eq!(got, b, "the refused write reached the segment over tcp");
        assert!(
            e.read(&t, 1, 0, &mut [&mut got[..]]).is_err(),
            "only the refused request is served again"
        );
    }

    #[test]
    fn node_name_replaces_the_hostname_in_the_host_id() {
        // Two pods of one node: same boot id, different hostnames.
        let pod = |h: &'static str| move || h.to_string();
        assert_ne!(
            host_id_from("b1", None, pod("store-x")),
            host_id_from("b1", None, pod("vllm-y"))
        );
        assert_eq!(
            host_id_from("b1", Some("node-a"), pod("store-x")),
            host_id_from("b1", Some("node-a"), pod("vllm-y"))
        );
        // Another node, or another kernel boot, is never the same host.
        assert_ne!(
            host_id_from("b1", Some("node-a"), pod("p")),
            host_id_from("b1", Some("node-b"), pod("p"))
        );
        assert_ne!(
            host_id_from("b1", Some("node-a"), pod("p")),
            host_id_from("b2", Some("node-a"), pod("p"))
        );
        // Blank means unset.
        assert_eq!(
            host_id_from("b1", Some(" "), pod("h")),
            host_id_from("b1", None, pod("h"))
        );
    }

    #[test]
    fn copy_helpers_only_for_batches_worth_sharing() {
        let mib = 1u64 << 20;
        // A vLLM batch: 32 objects of 512 KiB = 16 MiB: one helper with 2 copy threads.
        assert_eq!(copy_helpers(&[mib / 2; 32], 2), 1);
        assert_eq!(copy_helpers(&[mib / 2; 32], 4), 3);
        // Under two shares of 2 MiB: the caller alone, whatever the thread count.
        assert_eq!(copy_helpers(&[mib / 2; 7], 4), 0);
        assert_eq!(copy_helpers(&[mib; 8], 1), 0);
        // Never more threads than requests.
        assert_eq!(copy_helpers(&[10 * mib], 4), 0);
        assert_eq!(copy_helpers(&[10 * mib, 10 * mib], 4), 1);
        assert_eq!(copy_helpers(&[], 2), 0);
    }
}
