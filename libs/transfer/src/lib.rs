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

pub mod cap;
mod copy;
pub mod device;
mod drain;
mod engine;
mod error;
mod guard;
mod helpers;
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
mod transport;
mod vio;
pub mod wire;

pub use cap::{CapError, Capability, Grant, InventoryKey, MountSecret, PlacementProof};
pub use optimes::{OP_TIME_BOUNDS, OpTimesSnapshot, TimedOp};

pub use copy::copy_slice;
pub use drain::{ColdDrain, DrainProgress, DrainReport};
#[cfg(test)]
use engine::copy_helpers;
pub use engine::{LOCAL_SPLIT_MIN_BYTES, TransferEngine};
pub use error::TransferError;
pub use guard::raise_fd_limit;
pub use mem::segment_copy_gbps;
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
pub use tcp::{OffloadAnswer, TcpTransport};
pub use transport::Transport;
pub use wire::DISK_OFFSET;

/// One object handed to a [`ColdTier`]: its bytes are borrowed from the segment, pinned.
#[derive(Debug, Clone, Copy)]
pub struct ColdItem<'a> {
    pub key: &'a str,
    pub generation: u64,
    pub bytes: &'a [u8],
    /// The entry's placement proof: the tier keeps it, so the object stays provable on disk
    /// and after a promotion back to DRAM.
    pub proof: Option<PlacementProof>,
}

/// An object a [`ColdTier`] dropped to make room (its size limit), reported by
/// [`ColdTier::store_reporting`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColdDropped {
    pub key: String,
    pub generation: u64,
    pub size: u64,
}

/// What [`ColdTier::store_reporting`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ColdStored {
    /// The generations now held (already-held ones count).
    pub stored: Vec<u64>,
    /// Objects dropped to make room for these, which the tier will not report otherwise.
    pub dropped: Vec<ColdDropped>,
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
    /// As [`Self::store`], and hands back the objects dropped to make room for these, so an
    /// OFFLOAD answer tells the master at once (it would otherwise call them present until the
    /// owner's next Ping). A tier that returns drops here must not report them again, and takes
    /// back those the caller could not deliver through [`Self::report_later`]. Default: drops
    /// are left to the tier's own reporting (the Ping).
    fn store_reporting(&self, items: &[ColdItem<'_>]) -> Result<ColdStored, ColdTierError> {
        self.store(items).map(|stored| ColdStored {
            stored,
            dropped: Vec::new(),
        })
    }
    /// Drops from [`Self::store_reporting`] the caller could not deliver (the answer was lost,
    /// or there were more than one answer carries): report them the usual way.
    fn report_later(&self, dropped: Vec<ColdDropped>) {
        let _ = dropped;
    }
    /// Size of the object if held.
    fn size_of(&self, generation: u64) -> Option<u64>;
    /// The placement proof stored with the object, if any (a promotion carries it back to DRAM).
    fn proof_of(&self, generation: u64) -> Option<PlacementProof>;
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
        host_id_from(
            &boot,
            lunakv_config::process_env(NODE_NAME_ENV).as_deref(),
            || {
                rustix::system::uname()
                    .nodename()
                    .to_string_lossy()
                    .into_owned()
            },
        )
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
    /// Whatever it is, one request must arrive whole within 30 s of its first bytes, or within
    /// this timeout when shorter, plus 1 s per MiB received: a peer sending a byte at a time is
    /// never idle, and is cut off by that deadline instead.
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
    /// The master's proof of this placement, when its write capability carried one; the owner
    /// reports it in its inventory (docs/SECURITY.md, "Verified inventories").
    pub proof: Option<PlacementProof>,
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

/// True when `LUNAKV_DISABLE_SHM` is set to 1/true/yes in `env`
/// ([`lunakv_config::process_env`] outside tests).
fn shm_disabled_by_env(env: &dyn Fn(&str) -> Option<String>) -> bool {
    env("LUNAKV_DISABLE_SHM")
        .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            enable_shm: !shm_disabled_by_env(&lunakv_config::process_env),
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
    /// The master's capability for the one range this target is used for (the client builds a
    /// target per replica); sent with every request when set. `None` when the owner does not
    /// require capabilities.
    pub capability: Option<Capability>,
}

impl Target {
    /// Same owner and segment, whatever the capability: a batch groups its requests by this.
    pub fn same_segment(&self, other: &Target) -> bool {
        self.endpoint == other.endpoint
            && self.host_id == other.host_id
            && self.shm_socket == other.shm_socket
            && self.size == other.size
            && self.instance_id == other.instance_id
    }
}

impl From<&SegmentInfo> for Target {
    fn from(i: &SegmentInfo) -> Target {
        Target {
            endpoint: i.transfer_endpoint.clone(),
            host_id: i.host_id.clone(),
            shm_socket: i.shm_socket.clone(),
            size: i.size,
            instance_id: Some(i.instance_id.clone()),
            capability: None,
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
    use super::{copy_helpers, host_id_from, shm_disabled_by_env};

    /// A segment server of `size` bytes on a loopback port, and its target.
    fn segment(size: u64) -> (SegmentServer, Target) {
        let s = SegmentServer::start(SegmentServerConfig {
            bind: "127.0.0.1:0".parse().unwrap(),
            size,
            ..Default::default()
        })
        .unwrap();
        let t = Target::from(&s.info());
        (s, t)
    }

    /// A batch split into units (one connection each) runs them on the engine's kept unit
    /// threads, the caller's beside them: the first such batch starts `conns_per_peer - 1`,
    /// later ones reuse them, and every request lands.
    #[test]
    fn a_batch_in_units_runs_them_on_kept_threads() {
        let (_s, t) = segment(8 << 20);
        let e = TransferEngine::new(TransferOptions {
            enable_shm: false,
            conns_per_peer: 4,
            ..TransferOptions::default()
        });
        assert_eq!(e.unit_helpers.started(), 0);
        const LEN: usize = 256 << 10;
        for round in 0..3u8 {
            let objs: Vec<Vec<u8>> = (0..16u8).map(|i| vec![i ^ round; LEN]).collect();
            let mut w: Vec<TransferRequest<'_>> = objs
                .iter()
                .enumerate()
                .map(|(i, o)| TransferRequest::Write {
                    target: &t,
                    generation: u64::from(round) * 100 + i as u64 + 1,
                    key: "k",
                    offset: (i * LEN) as u64,
                    src: vec![&o[..]],
                })
                .collect();
            assert!(e.batch(&mut w).iter().all(Result::is_ok));
            assert_eq!(e.unit_helpers.started(), 3, "round {round}");
            let mut bufs = vec![vec![0u8; LEN]; 16];
            let mut r: Vec<TransferRequest<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| TransferRequest::Read {
                    target: &t,
                    generation: u64::from(round) * 100 + i as u64 + 1,
                    offset: (i * LEN) as u64,
                    dst: vec![&mut b[..]],
                })
                .collect();
            assert!(e.batch(&mut r).iter().all(Result::is_ok));
            drop(r);
            assert_eq!(bufs, objs, "round {round}");
        }
    }

    /// What the rdma transport answers for a device piece the NIC refuses (no GPUDirect): the
    /// engine serves exactly those requests again over tcp and remembers the refusal.
    #[test]
    fn requests_refused_by_gpudirect_are_served_over_tcp() {
        let (_s, t) = segment(1 << 20);
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

    #[test]
    fn only_a_yes_in_the_env_map_disables_shm() {
        let env = |v: &'static str| move |k: &str| (k == "LUNAKV_DISABLE_SHM").then(|| v.into());
        for v in ["1", " TRUE ", "yes"] {
            assert!(shm_disabled_by_env(&env(v)), "{v:?}");
        }
        for v in ["0", "no", ""] {
            assert!(!shm_disabled_by_env(&env(v)), "{v:?}");
        }
        assert!(!shm_disabled_by_env(&|_: &str| None));
    }
}
