//! The segment owner's side: a memfd segment, its entry table, a tcp listener and (optionally)
//! a unix socket for same-host requesters. One std thread per connection: a connection is a
//! long-lived pooled stream from one requester thread, and blocking I/O straight between the
//! socket and the mmap is the fastest thing on a small box.

use std::collections::HashMap;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::cap::{CAP_LEN, CAP_MAX_LEN, Capability, Grant, MountSecret, RIGHT_READ, RIGHT_WRITE};
use crate::guard::{
    AcceptBackoff, Admission, Caps, Evicted, Paced, PeerLog, REQUEST_TIMEOUT, Refusal, Slot,
    peer_name,
};
use crate::mem::Mapping;
use crate::optimes::TimedOp;
use crate::table::{Freed, PinId, PinResult, Pinned, RevokedGeneration, Table};
use crate::wire::{self, Op, Request, Response, Status};
use crate::{
    ColdDropped, ColdItem, ColdTier, Entry, SegmentIdentity, SegmentInfo, SegmentServerConfig,
    SegmentStats, TransferError, host_id, tune_socket,
};

/// How long a WRITE waits for readers of the entries it overwrites before writing anyway.
pub(crate) const OVERWRITE_PIN_WAIT: Duration = Duration::from_secs(5);
/// A reader that stops draining its socket this long is cut off, so its pin (held during the
/// send) cannot block FREE forever. Idle pooled connections have no read timeout.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// The refusal of a WRITE or COMMIT of a generation the master freed here (an unfinished put it
/// revoked, discarded or reclaimed, or an object it removed): the range may be someone else's.
const REVOKED: &str = "put revoked by the master: its generation was freed here (revoked, \
                       discarded or reclaimed under pressure); start a new put";
/// Most pins one unix connection may hold (bounds memory a misbehaving peer can take).
const MAX_PINS_PER_CONN: usize = 1 << 16;
/// Buffer for request headers: pipelined small requests are parsed from one read.
const READ_BUF: usize = 16 * 1024;
/// FREE and OFFLOAD bodies are read and applied this many pairs at a time (64 KiB), so a
/// header claiming a million pairs costs nothing until the pairs arrive.
const PAIRS_PER_CHUNK: usize = 4096;
/// Bytes all LOADs together may hold in buffers (a disk object is read whole, its checksum
/// verified, then sent). A LOAD over the budget waits for the others; a single larger object
/// waits until it is alone.
const LOAD_BUDGET: u64 = 1 << 30;
/// A connection keeps its LOAD buffer between requests only up to this capacity.
const LOAD_BUF_KEEP: usize = 1 << 20;
/// Bytes all FREE/OFFLOAD bodies together may hold while their header passed the master's tag
/// but the whole request's tag is not checked yet (it covers the body, so the body is held
/// until it is all in): two bodies of the most pairs a FREE may carry. Only a replay of a
/// header the master tagged gets this far, and it cannot take more than this from the owner.
const UNVERIFIED_BODY_BUDGET: u64 = 2 * wire::MAX_FREE_ITEMS as u64 * 16;
/// Such a body is buffered in steps of this many bytes, so the owner's memory grows only with
/// bytes received.
const BODY_STEP: usize = 64 * 1024;

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) shm_attaches: AtomicU64,
    pub(crate) conns_refused: AtomicU64,
    pub(crate) bad_frames: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) too_slow: AtomicU64,
    pub(crate) op_times: crate::optimes::OpTimes,
}

/// Connection counters of a segment server (the store's /metrics shows them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// tcp connections open now.
    pub open_tcp: u64,
    /// shm (unix socket) connections open now.
    pub open_shm: u64,
    /// Connections closed at accept because a cap was reached (tcp and shm).
    pub refused_total: u64,
    /// Connections closed because they sent a malformed or oversized frame, or one that did not
    /// arrive whole in time (counted in `too_slow_total` too).
    pub bad_frames_total: u64,
    /// Of `refused_total`: connections that never completed a valid request, closed to make
    /// room for a newcomer while the tcp table was full.
    pub evicted_total: u64,
    /// Connections closed because a request did not arrive whole within its deadline (a peer
    /// trickling bytes).
    pub too_slow_total: u64,
    /// The caps in force: tcp in all, tcp per source IP (0 = none), shm.
    pub max_tcp: u64,
    pub max_tcp_per_peer: u64,
    pub max_shm: u64,
}

/// Bytes of LOAD buffers in use, against [`LOAD_BUDGET`].
#[derive(Default)]
struct LoadBudget {
    used: Mutex<u64>,
    freed: Condvar,
}

/// Bytes of FREE/OFFLOAD bodies held before their tag is checked, against
/// [`UNVERIFIED_BODY_BUDGET`].
#[derive(Default)]
struct BodyBudget {
    used: Mutex<u64>,
    freed: Condvar,
}

/// One body's share of the [`BodyBudget`]; given back on drop.
struct BodyLease<'a> {
    budget: &'a BodyBudget,
    held: u64,
}

impl BodyBudget {
    fn lease(&self) -> BodyLease<'_> {
        BodyLease {
            budget: self,
            held: 0,
        }
    }
}

impl BodyLease<'_> {
    /// Grows this share to `to` bytes, waiting until `until` for other bodies to give theirs
    /// back; false when it could not. A single body never exceeds the budget, so it always
    /// fits once it is alone.
    fn grow(&mut self, to: u64, until: Instant) -> bool {
        let more = to.saturating_sub(self.held);
        let mut used = self.budget.used.lock();
        while *used + more > UNVERIFIED_BODY_BUDGET {
            if self.budget.freed.wait_until(&mut used, until).timed_out() {
                return false;
            }
        }
        *used += more;
        self.held += more;
        true
    }
}

impl Drop for BodyLease<'_> {
    fn drop(&mut self) {
        if self.held > 0 {
            *self.budget.used.lock() -= self.held;
            self.budget.freed.notify_all();
        }
    }
}

impl LoadBudget {
    fn take(&self, want: u64) -> u64 {
        let want = want.min(LOAD_BUDGET);
        let mut used = self.used.lock();
        while *used + want > LOAD_BUDGET {
            self.freed.wait(&mut used);
        }
        *used += want;
        want
    }

    fn give(&self, n: u64) {
        *self.used.lock() -= n;
        self.freed.notify_all();
    }
}

enum Live {
    Tcp(TcpStream),
    Unix(UnixStream),
}

pub(crate) struct Shared {
    /// The segment's RDMA memory region, once [`SegmentServer::enable_rdma`] registered it.
    /// Declared before `mem` so it is deregistered before the memory is unmapped.
    rdma: crate::rdma::ServerRdma,
    pub(crate) mem: Mapping,
    pub(crate) table: Table,
    pub(crate) counters: Counters,
    pub(crate) stopping: AtomicBool,
    /// Clones of every open connection by its admission slot's id, so shutdown can unblock
    /// their threads and admission can close one it evicts.
    conns: Mutex<HashMap<u64, Live>>,
    /// The owner's disk tier, if it offloads.
    pub(crate) cold: std::sync::OnceLock<Arc<dyn ColdTier>>,
    /// What ATTACH answers when asked ([`wire::FLAG_IDENTITY`]).
    identity: parking_lot::RwLock<SegmentIdentity>,
    admission: Arc<Admission>,
    /// tcp connections idle this long are closed.
    idle_timeout: Option<Duration>,
    /// How long one tcp request may take to arrive whole (plus its length's allowance): the
    /// idle timeout when shorter, else [`REQUEST_TIMEOUT`]. Also the tcp connections'
    /// SO_RCVTIMEO, set once per connection, so a read inside a request never blocks long past
    /// its deadline; between requests the idle timeout is counted in such waits.
    request_timeout: Duration,
    slow_log: PeerLog,
    evicted_log: PeerLog,
    unverified: BodyBudget,
    bad_frame_log: PeerLog,
    refused_log: PeerLog,
    load_budget: LoadBudget,
    /// Set once the owner requires capabilities ([`SegmentServer::require_capabilities`]).
    /// With the segment's name, which every capability covers.
    secret: std::sync::OnceLock<(MountSecret, String)>,
    /// Requests refused for their capability (`lunakv_store_transfer_refused_total`).
    refused: AtomicU64,
    refusal_log: PeerLog,
}

/// Owns a memfd-backed segment plus its entry table and serves it over tcp (and a unix socket
/// for shm). Stops on [`SegmentServer::shutdown`] or drop.
pub struct SegmentServer {
    pub(crate) shared: Arc<Shared>,
    local_addr: SocketAddr,
    info: SegmentInfo,
    unix_path: Option<PathBuf>,
    /// A clone of the unix listener (shutdown wakes its accept through it, not through the
    /// path, which another process may have taken over) and the socket file's (dev, inode), so
    /// shutdown unlinks only the file it created.
    unix_wake: Option<(UnixListener, (u64, u64))>,
    acceptors: Mutex<Vec<JoinHandle<()>>>,
}

impl SegmentServer {
    /// Creates the segment and binds exactly `cfg.bind` (and `cfg.shm_socket` if set).
    pub fn start(cfg: SegmentServerConfig) -> Result<SegmentServer, TransferError> {
        if cfg.size == 0 {
            return Err(TransferError::InvalidArgument(
                "segment size is 0; a pure requester does not start a SegmentServer".into(),
            ));
        }
        let mem = Mapping::create(cfg.size).map_err(|e| {
            TransferError::InvalidArgument(format!(
                "cannot create a {} byte memfd segment: {e}; lower the segment size or raise memory limits",
                cfg.size
            ))
        })?;
        let listener = crate::guard::bind_tcp(cfg.bind, cfg.bind_retry)?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| TransferError::Io(cfg.bind.to_string(), e))?;
        let unix = match &cfg.shm_socket {
            Some(path) => {
                remove_stale_socket(path)?;
                let l = UnixListener::bind(path).map_err(|e| {
                    TransferError::ShmUnavailable(format!(
                        "cannot bind shm socket {}: {e}; pick a writable path or disable shm",
                        path.display()
                    ))
                })?;
                // Whoever connects gets the whole segment mapped read-write: the owner and its
                // group (engine pods given the store's group), never everyone on the host.
                use std::os::unix::fs::PermissionsExt;
                if let Err(e) =
                    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
                {
                    tracing::warn!(path = %path.display(), error = %e, "cannot set the shm socket's mode to 0660");
                }
                Some(l)
            }
            None => None,
        };
        let host = cfg
            .advertise_host
            .clone()
            .unwrap_or_else(|| local_addr.ip().to_string());
        let endpoint = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{}", local_addr.port())
        } else {
            format!("{host}:{}", local_addr.port())
        };
        let info = SegmentInfo {
            name: endpoint.clone(),
            transfer_endpoint: endpoint,
            size: cfg.size,
            host_id: host_id(),
            shm_socket: cfg.shm_socket.as_ref().map(|p| p.display().to_string()),
            rdma: None,
            instance_id: new_instance_id(),
        };
        let idle_timeout = cfg.limits.idle_timeout.filter(|t| !t.is_zero());
        let request_timeout = idle_timeout.map_or(REQUEST_TIMEOUT, |i| i.min(REQUEST_TIMEOUT));
        let shared = Arc::new(Shared {
            mem,
            table: Table::default(),
            counters: Counters::default(),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            cold: std::sync::OnceLock::new(),
            rdma: crate::rdma::ServerRdma::default(),
            identity: parking_lot::RwLock::new(SegmentIdentity {
                cluster_id: String::new(),
                name: info.name.clone(),
                instance_id: info.instance_id.clone(),
            }),
            admission: Admission::new(Caps::resolve(&cfg.limits, crate::guard::fd_limit())),
            idle_timeout,
            request_timeout,
            slow_log: PeerLog::default(),
            evicted_log: PeerLog::default(),
            unverified: BodyBudget::default(),
            bad_frame_log: PeerLog::default(),
            refused_log: PeerLog::default(),
            load_budget: LoadBudget::default(),
            secret: std::sync::OnceLock::new(),
            refused: AtomicU64::new(0),
            refusal_log: PeerLog::default(),
        });
        let unix_wake = match (&unix, &cfg.shm_socket) {
            (Some(l), Some(path)) => {
                let clone = l
                    .try_clone()
                    .map_err(|e| TransferError::Io(path.display().to_string(), e))?;
                let st = rustix::fs::stat(path)
                    .map_err(|e| TransferError::Io(path.display().to_string(), e.into()))?;
                Some((clone, crate::shm::stat_ident(&st)))
            }
            _ => None,
        };
        let mut acceptors = Vec::new();
        let s = shared.clone();
        acceptors.push(spawn("lunakv-seg-accept", move || accept_tcp(s, listener))?);
        if let Some(unix) = unix {
            let s = shared.clone();
            acceptors.push(spawn("lunakv-seg-shm", move || accept_unix(s, unix))?);
        }
        let caps = shared.admission.caps;
        tracing::info!(addr = %local_addr, size = cfg.size, shm = ?cfg.shm_socket, max_conns = caps.tcp, max_conns_per_peer = caps.per_peer, max_shm_conns = caps.unix, idle_timeout = ?shared.idle_timeout, request_timeout = ?shared.request_timeout, "segment server started");
        Ok(SegmentServer {
            shared,
            local_addr,
            info,
            unix_path: cfg.shm_socket,
            unix_wake,
            acceptors: Mutex::new(acceptors),
        })
    }

    /// The bound tcp address (the real port when `bind` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What to register with the master.
    pub fn info(&self) -> SegmentInfo {
        SegmentInfo {
            rdma: self.shared.rdma.descriptor(),
            ..self.info.clone()
        }
    }

    /// Offers the segment over RDMA (`protocol: "rdma"`): registers its memory with the device
    /// (pinning it: a sparse segment is fully allocated) and from then on answers `RDMA_CONNECT`.
    /// Returns the descriptor [`SegmentServer::info`] publishes. Idempotent. Fails with
    /// [`TransferError::RdmaUnavailable`], one line naming the fix, when this build has no
    /// `rdma` feature, no device exists, or registration fails (e.g. `ulimit -l`).
    pub fn enable_rdma(&self) -> Result<crate::RdmaDescriptor, TransferError> {
        let mem = &self.shared.mem;
        // SAFETY: the mapping and the ServerRdma both live in `shared`, and `rdma` is declared
        // (so dropped, deregistering the region) before `mem` is unmapped. Queue pairs that
        // could touch the region belong to connection threads, which hold `shared` alive.
        unsafe { self.shared.rdma.enable(mem.ptr_at(0), mem.len() as usize) }
    }

    /// The cluster this segment is mounted in, for the identity ATTACH answers (the owner
    /// learns it from its configuration; the server itself does not care).
    pub fn set_cluster_id(&self, cluster_id: &str) {
        self.shared.identity.write().cluster_id = cluster_id.to_owned();
    }

    /// From now on every READ, WRITE, PIN, COMMIT, LOAD and ATTACH must carry a capability the
    /// master issued under `secret`, and FREE, OFFLOAD and PROMOTE the master's tag under it
    /// (docs/SECURITY.md, "Capabilities"). The owner sends the same secret in every
    /// MountSegment. Set once; a later call with another secret is refused (returns false).
    pub fn require_capabilities(&self, secret: MountSecret) -> bool {
        let name = self.shared.identity.read().name.clone();
        self.shared.secret.get_or_init(|| (secret, name)).0 == secret
    }

    /// The secret set by [`SegmentServer::require_capabilities`]: the owner sends it in every
    /// MountSegment, so a remount after a master restart re-sends the same one.
    pub fn capability_secret(&self) -> Option<MountSecret> {
        self.shared.secret.get().map(|(k, _)| *k)
    }

    /// Requests refused so far because their capability was missing, expired or forged.
    pub fn refused_total(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Plugs in the disk tier: OFFLOAD and LOAD are served from then on (before, OFFLOAD stores
    /// nothing and LOAD serves DRAM only). Set once; later calls are ignored (returns false).
    pub fn set_cold_tier(&self, tier: Arc<dyn ColdTier>) -> bool {
        self.shared.cold.set(tier).is_ok()
    }

    /// Committed entries, in offset order (reported to a restarted master).
    pub fn inventory(&self) -> Vec<Entry> {
        self.shared.table.inventory()
    }

    /// Up to `max` distinct keys read since the last call (the rest stay for the next call).
    pub fn take_touched_keys(&self, max: usize) -> Vec<String> {
        self.shared.table.take_touched_keys(max)
    }

    pub fn stats(&self) -> SegmentStats {
        let c = &self.shared.counters;
        let (entries, used_bytes) = self.shared.table.counts();
        SegmentStats {
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            shm_attaches: c.shm_attaches.load(Ordering::Relaxed),
            entries,
            used_bytes,
        }
    }

    /// Latency histograms of WRITE, COMMIT, READ and PIN as this server handled them.
    pub fn op_times(&self) -> Vec<crate::OpTimesSnapshot> {
        self.shared.counters.op_times.snapshot()
    }

    /// Open connections, refusals and bad frames.
    pub fn conn_stats(&self) -> ConnStats {
        let c = &self.shared.counters;
        let (tcp, unix) = self.shared.admission.open();
        let caps = self.shared.admission.caps;
        ConnStats {
            open_tcp: u64::from(tcp),
            open_shm: u64::from(unix),
            refused_total: c.conns_refused.load(Ordering::Relaxed),
            bad_frames_total: c.bad_frames.load(Ordering::Relaxed),
            evicted_total: c.evicted.load(Ordering::Relaxed),
            too_slow_total: c.too_slow.load(Ordering::Relaxed),
            max_tcp: u64::from(caps.tcp),
            max_tcp_per_peer: u64::from(caps.per_peer),
            max_shm: u64::from(caps.unix),
        }
    }

    /// Stops the listeners and closes every connection (their pins are released). Idempotent.
    pub fn shutdown(&self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the blocking accept calls; they see `stopping` and return.
        let wake = if self.local_addr.ip().is_unspecified() {
            SocketAddr::new(
                if self.local_addr.is_ipv4() {
                    std::net::Ipv4Addr::LOCALHOST.into()
                } else {
                    std::net::Ipv6Addr::LOCALHOST.into()
                },
                self.local_addr.port(),
            )
        } else {
            self.local_addr
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some((l, _)) = &self.unix_wake {
            // A blocked accept on a shut-down listening socket returns at once (EINVAL).
            let _ = rustix::net::shutdown(l, rustix::net::Shutdown::Both);
        }
        for h in self.acceptors.lock().drain(..) {
            let _ = h.join();
        }
        for (_, c) in self.shared.conns.lock().drain() {
            let _ = match c {
                Live::Tcp(s) => s.shutdown(Shutdown::Both),
                Live::Unix(s) => s.shutdown(Shutdown::Both),
            };
        }
        if let (Some(p), Some((_, ours))) = (&self.unix_path, &self.unix_wake)
            && rustix::fs::stat(p).is_ok_and(|st| crate::shm::stat_ident(&st) == *ours)
        {
            let _ = std::fs::remove_file(p);
        }
        tracing::info!(addr = %self.local_addr, "segment server stopped");
    }
}

impl Drop for SegmentServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, TransferError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| TransferError::Io(format!("spawning {name}"), e))
}

fn accept_tcp(shared: Arc<Shared>, listener: TcpListener) {
    let mut backoff = AcceptBackoff::new("tcp");
    loop {
        let conn = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok((stream, peer)) => {
                backoff.succeeded();
                let Some(slot) = admit(&shared, Some(peer.ip())) else {
                    continue;
                };
                tune_socket(&stream);
                let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
                // Once per connection, so the request path pays nothing for it.
                let _ = stream.set_read_timeout(Some(shared.request_timeout));
                if let Ok(clone) = stream.try_clone() {
                    spawn_conn(&shared, stream, Live::Tcp(clone), false, slot);
                }
            }
            Err(e) => backoff.failed(&e),
        }
    }
}

fn accept_unix(shared: Arc<Shared>, listener: UnixListener) {
    let mut backoff = AcceptBackoff::new("shm");
    loop {
        let conn = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok((stream, _)) => {
                backoff.succeeded();
                let Some(slot) = admit(&shared, None) else {
                    continue;
                };
                let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
                if let Ok(clone) = stream.try_clone() {
                    spawn_conn(&shared, stream, Live::Unix(clone), true, slot);
                }
            }
            Err(e) => backoff.failed(&e),
        }
    }
}

/// A slot for a new connection from `peer` (`None`: the shm socket), or `None` after counting
/// and (rate-limited) logging the refusal; the caller then drops the stream, closing it.
fn admit(shared: &Shared, peer: Option<IpAddr>) -> Option<Slot> {
    let refusal = match shared.admission.admit(peer) {
        Ok((slot, evicted)) => {
            if let Some(ev) = evicted {
                evict(shared, ev, peer);
            }
            return Some(slot);
        }
        Err(r) => r,
    };
    shared
        .counters
        .conns_refused
        .fetch_add(1, Ordering::Relaxed);
    if let Some(suppressed) = shared.refused_log.check(peer) {
        let peer_is_tcp = peer.is_some();
        let peer = peer_name(peer);
        match refusal {
            Refusal::Peer { open, cap } => tracing::warn!(
                %peer, open, cap, suppressed,
                "refusing a transfer connection: this peer holds the most connections one peer may (see lunakv-store --transfer_max_conns_per_peer)"
            ),
            Refusal::Global { open, cap } if peer_is_tcp => tracing::warn!(
                %peer, open, cap, suppressed,
                "refusing a transfer connection: the server holds the most connections it may, every one from a requester that completed a valid request (see lunakv-store --transfer_max_conns)"
            ),
            Refusal::Global { open, cap } => tracing::warn!(
                %peer, open, cap, suppressed,
                "refusing an shm connection: the shm socket holds the most connections its share of the fd limit allows (raise `ulimit -n`)"
            ),
        }
    }
    None
}

/// Closes connection `ev`, which never completed a valid request, to admit one from
/// `newcomer` into a full tcp table. Its thread sees the shutdown and ends quietly.
fn evict(shared: &Shared, ev: Evicted, newcomer: Option<IpAddr>) {
    if let Some(Live::Tcp(s)) = shared.conns.lock().get(&ev.id) {
        let _ = s.shutdown(Shutdown::Both);
    }
    let c = &shared.counters;
    c.evicted.fetch_add(1, Ordering::Relaxed);
    c.conns_refused.fetch_add(1, Ordering::Relaxed);
    if let Some(suppressed) = shared.evicted_log.check(Some(ev.peer)) {
        tracing::warn!(
            peer = %ev.peer, newcomer = %peer_name(newcomer), cap = shared.admission.caps.tcp, suppressed,
            "closing a transfer connection that never completed a valid request, to admit a new one: the tcp table is full (strangers holding connections? lower lunakv-store --transfer_max_conns_per_peer, or keep the transfer port from untrusted networks)"
        );
    }
}

/// Registers the connection (so shutdown can close it) and serves it on its own thread, which
/// holds its admission `slot` until it ends.
fn spawn_conn<S: Stream + Send + 'static>(
    shared: &Arc<Shared>,
    stream: S,
    live: Live,
    unix: bool,
    slot: Slot,
) {
    let id = slot.id();
    shared.conns.lock().insert(id, live);
    let s = shared.clone();
    let r = std::thread::Builder::new()
        .name(
            if unix {
                "lunakv-seg-shm"
            } else {
                "lunakv-seg-tcp"
            }
            .into(),
        )
        .spawn(move || {
            run_conn(&s, stream, unix, slot);
            s.conns.lock().remove(&id);
        });
    if let Err(e) = r {
        if shared.refused_log.check(None).is_some() {
            tracing::warn!(error = %e, "cannot spawn a connection thread; dropping the connection");
        }
        shared
            .counters
            .conns_refused
            .fetch_add(1, Ordering::Relaxed);
        shared.conns.lock().remove(&id);
    }
}

/// A connected stream either listener hands out.
trait Stream: Read + Write + AsFd + Sized {
    fn clone_stream(&self) -> io::Result<Self>;
    fn clear_read_timeout(&self) -> io::Result<()>;
}
impl Stream for TcpStream {
    fn clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn clear_read_timeout(&self) -> io::Result<()> {
        self.set_read_timeout(None)
    }
}
impl Stream for UnixStream {
    fn clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn clear_read_timeout(&self) -> io::Result<()> {
        self.set_read_timeout(None)
    }
}

/// Why a connection ends: a clean close, or something to log.
enum End {
    Closed,
    Io(io::Error),
    Garbage(String),
    /// A request did not arrive whole within its deadline.
    TooSlow,
    /// Bodies not yet authenticated held their whole budget for as long as this one could wait.
    Busy,
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> End {
        End::Io(e)
    }
}

fn run_conn<S: Stream>(shared: &Shared, stream: S, unix: bool, slot: Slot) {
    let mut pins: Vec<(u64, u64, u64, PinId)> = Vec::new();
    let end = match stream.clone_stream() {
        Ok(r) => serve(
            shared,
            // The shm socket's peers are the owner's group on this host, and its requests
            // carry no bodies: only tcp requests have a deadline.
            BufReader::with_capacity(
                READ_BUF,
                Paced::new(r, (!unix).then_some(shared.request_timeout)),
            ),
            stream,
            unix,
            &mut pins,
            &slot,
        )
        .err()
        .unwrap_or(End::Closed),
        Err(e) => End::Io(e),
    };
    // A connection that dies releases its pins, so FREE never waits on a crashed reader.
    for (_, _, _, pin) in pins {
        shared.table.unpin(pin);
    }
    let peer = slot.peer();
    match end {
        End::Closed => {}
        // Closed for a newcomer: admission counted and logged it.
        _ if slot.evicted() => {}
        End::Io(e) => tracing::debug!(error = %e, "transfer connection closed"),
        End::Garbage(why) => {
            shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = shared.bad_frame_log.check(peer) {
                tracing::warn!(peer = %peer_name(peer), %why, suppressed, "closing a transfer connection that sent a bad frame");
            }
        }
        End::TooSlow => {
            shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
            shared.counters.too_slow.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = shared.slow_log.check(peer) {
                tracing::warn!(
                    peer = %peer_name(peer), deadline_ms = shared.request_timeout.as_millis() as u64,
                    min_rate_bytes_per_sec = crate::guard::MIN_REQUEST_RATE, suppressed,
                    "closing a transfer connection whose request did not arrive whole in time (a peer trickling bytes holds a connection though never idle; the deadline is lunakv-store --transfer_idle_timeout_sec when shorter than 30 s)"
                );
            }
        }
        End::Busy => {
            if let Some(suppressed) = shared.slow_log.check(peer) {
                tracing::warn!(
                    peer = %peer_name(peer), budget_bytes = UNVERIFIED_BODY_BUDGET, suppressed,
                    "closing a transfer connection: FREE/OFFLOAD bodies not yet authenticated hold their whole budget (replayed master requests? keep the transfer port from untrusted networks)"
                );
            }
        }
    }
    drop(slot);
}

fn reply<W: Write>(w: &mut W, status: Status, value: u64, msg: &str) -> io::Result<()> {
    let hdr = Response {
        status,
        value,
        len: msg.len() as u64,
    }
    .encode();
    if msg.is_empty() {
        w.write_all(&hdr)
    } else {
        crate::vio::write_all_gather(w, &[&hdr, msg.as_bytes()], &[])
    }
}

/// An `OK` answer carrying `body` (object bytes, failed generations, a descriptor): header and
/// body in one gathered write.
fn reply_body<W: Write>(w: &mut W, value: u64, body: &[u8]) -> io::Result<()> {
    let hdr = Response {
        status: Status::Ok,
        value,
        len: body.len() as u64,
    }
    .encode();
    crate::vio::write_all_gather(w, &[&hdr, body], &[])
}

/// One connection's state across its requests: the streams, the pins it holds, reusable
/// buffers, and the RDMA queue pairs it set up.
struct Conn<'a, S: Stream> {
    shared: &'a Shared,
    rd: BufReader<Paced<S>>,
    wr: S,
    unix: bool,
    pins: &'a mut Vec<(u64, u64, u64, PinId)>,
    /// The segment's size: the bound of every range and the value of an OUT_OF_BOUNDS answer.
    size: u64,
    key_buf: Vec<u8>,
    free_buf: Vec<u8>,
    load_buf: Vec<u8>,
    /// After RDMA_CONNECT: the queue pairs of this connection (they live as long as it does),
    /// and PIN/UNPIN/COMMIT become valid on tcp (the control ops of the RDMA data path).
    rdma_qps: Vec<Box<dyn std::any::Any + Send>>,
    /// The capability of the request being served, if it carried one.
    cap: Option<Capability>,
    slot: &'a Slot,
    /// Whether the slot was told this connection completed a valid request (once: later
    /// requests skip admission's lock).
    known: bool,
    /// The request being served passed its capability (or owner tag) check.
    passed: bool,
}

fn serve<S: Stream>(
    shared: &Shared,
    rd: BufReader<Paced<S>>,
    wr: S,
    unix: bool,
    pins: &mut Vec<(u64, u64, u64, PinId)>,
    slot: &Slot,
) -> Result<(), End> {
    let mut c = Conn {
        shared,
        rd,
        wr,
        unix,
        pins,
        size: shared.mem.len(),
        key_buf: Vec::with_capacity(256),
        free_buf: Vec::new(),
        load_buf: Vec::new(),
        rdma_qps: Vec::new(),
        cap: None,
        slot,
        known: false,
        passed: false,
    };
    let r = serve_requests(&mut c);
    if c.rd.get_ref().expired {
        return Err(End::TooSlow);
    }
    r
}

fn serve_requests<S: Stream>(c: &mut Conn<'_, S>) -> Result<(), End> {
    let shared = c.shared;
    // How many SO_RCVTIMEO waits (each the request timeout, at most the idle timeout) make
    // the idle timeout. The shm socket has none.
    let idle_waits = match shared.idle_timeout {
        Some(idle) if !shared.request_timeout.is_zero() => idle
            .as_nanos()
            .div_ceil(shared.request_timeout.as_nanos())
            .max(1),
        _ => u128::MAX,
    };
    loop {
        let mut hdr = [0u8; wire::REQ_LEN];
        c.rd.get_mut().disarm();
        // EOF before the first byte of a frame is a clean close; inside a frame it is truncation.
        let mut waited = 0u128;
        loop {
            match c.rd.read(&mut hdr[..1]) {
                Ok(0) => return Err(End::Closed),
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // The idle timeout between frames: a quiet close, the requester's pool
                // reconnects on its next request.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    waited += 1;
                    if waited >= idle_waits {
                        return Err(End::Closed);
                    }
                }
                Err(e) => return Err(End::Io(e)),
            }
        }
        // From here the request must arrive whole within its deadline.
        c.rd.get_mut().arm();
        c.passed = false;
        if let Err(e) = c.rd.read_exact(&mut hdr[1..]) {
            return Err(End::Garbage(format!("truncated header: {e}")));
        }
        let req = match Request::decode(&hdr) {
            Ok(r) => r,
            Err(why) => return Err(End::Garbage(why.to_string())),
        };
        // The requester's trace context, if any: this request's work is a span of its trace.
        let span = match crate::trace::read_context(&hdr, &mut c.rd) {
            Ok(tc) => tc.and_then(|tc| crate::trace::server_span(&req, &tc)),
            Err(e) => return Err(End::Garbage(format!("truncated trace context: {e}"))),
        };
        let _in_span = span.as_ref().map(|s| s.enter());
        c.cap = None;
        if wire::has_cap(&hdr) {
            let mut b = [0u8; CAP_MAX_LEN];
            let n = if wire::has_proof(&hdr) {
                CAP_MAX_LEN
            } else {
                CAP_LEN
            };
            if let Err(e) = c.rd.read_exact(&mut b[..n]) {
                return Err(End::Garbage(format!("truncated capability: {e}")));
            }
            c.cap = Capability::from_slice(&b[..n]);
        }
        let shm_only = matches!(req.op, Op::Attach | Op::Pin | Op::Unpin | Op::Commit);
        if shm_only && !c.unix && (c.rdma_qps.is_empty() || req.op == Op::Attach) {
            return Err(End::Garbage(format!(
                "{:?} is only valid on the shm unix socket",
                req.op
            )));
        }
        let started = Instant::now();
        match req.op {
            Op::Write | Op::Commit => c.write(&req, started)?,
            Op::Read | Op::Pin => c.read(&req, started)?,
            Op::Unpin => c.unpin(&req),
            Op::Free => c.free(&req)?,
            Op::Offload => c.offload(&req, wire::wants_drops(&hdr))?,
            Op::Load => c.load(&req)?,
            Op::Promote => c.promote(&req)?,
            Op::Attach => {
                if !c.allowed(&req, 0)? {
                    continue;
                }
                send_fd(&c.wr, shared, wire::wants_identity(&hdr))?;
                shared.counters.shm_attaches.fetch_add(1, Ordering::Relaxed);
            }
            Op::RdmaConnect => c.rdma_connect(&req)?,
            Op::RawWrite | Op::RawRead => {
                return Err(End::Garbage(format!(
                    "{:?} addresses registered memory and is served by a RegionServer, not a segment",
                    req.op
                )));
            }
        }
        // A completed request makes the connection known (never evicted for a newcomer): with
        // capabilities required, only one that passed its check; without, any well-formed one.
        if !c.known && (c.passed || shared.secret.get().is_none()) {
            c.known = true;
            c.slot.mark_known();
        }
    }
}

impl<S: Stream> Conn<'_, S> {
    /// Whether the request may go on: always when the owner requires no capabilities, else
    /// when its capability grants `need` (0: any right, for ATTACH) for exactly the request's
    /// `(generation, offset, len)` on this segment. A refusal is answered (REFUSED, the reason)
    /// and counted here; the caller must still consume the request's body.
    fn allowed(&mut self, req: &Request, need: u8) -> io::Result<bool> {
        let Some((secret, name)) = self.shared.secret.get() else {
            return Ok(true);
        };
        let grant = Grant {
            segment: name,
            generation: req.generation,
            offset: req.offset,
            len: req.len,
        };
        let r = match &self.cap {
            None => Err(crate::CapError::Missing),
            Some(c) if need == 0 => c.verify_any(secret, name),
            Some(c) => c.verify(secret, &grant, need),
        };
        match r {
            Ok(()) => {
                self.passed = true;
                Ok(true)
            }
            Err(why) => {
                self.refuse(req, &why.to_string())?;
                Ok(false)
            }
        }
    }

    /// The master's FREE/OFFLOAD/PROMOTE: the tag over `hdr` and `body` under the secret.
    fn owner_allowed(&mut self, req: &Request, body: &[u8]) -> io::Result<bool> {
        let Some((secret, _)) = self.shared.secret.get() else {
            return Ok(true);
        };
        let hdr = req.encode();
        let r = match &self.cap {
            None => Err(crate::CapError::Missing),
            Some(c) => c.verify_owner(secret, &hdr, body),
        };
        match r {
            Ok(()) => {
                self.passed = true;
                Ok(true)
            }
            Err(why) => {
                self.refuse(
                    req,
                    &format!("{} not from the master: {why}", req.op.name()),
                )?;
                Ok(false)
            }
        }
    }

    fn refuse(&mut self, req: &Request, why: &str) -> io::Result<()> {
        self.shared.refused.fetch_add(1, Ordering::Relaxed);
        let peer = self.slot.peer();
        if let Some(suppressed) = self.shared.refusal_log.check(peer) {
            tracing::warn!(peer = %peer_name(peer), op = req.op.name(), generation = req.generation, offset = req.offset, len = req.len, %why, suppressed, "refusing a transfer request");
        }
        self.reply(Status::Refused, 0, why)
    }

    fn reply(&mut self, status: Status, value: u64, msg: &str) -> io::Result<()> {
        reply(&mut self.wr, status, value, msg)
    }

    fn out_of_bounds(&mut self) -> io::Result<()> {
        self.reply(Status::OutOfBounds, self.size, "range outside the segment")
    }

    /// The mapped range a request names, or `None` once OUT_OF_BOUNDS is answered.
    fn range(&mut self, req: &Request) -> io::Result<Option<(usize, usize)>> {
        let r = self.shared.mem.check(req.offset, req.len);
        if r.is_none() {
            self.out_of_bounds()?;
        }
        Ok(r)
    }

    /// Reads a request's key (at most [`wire::MAX_KEY_LEN`] bytes) into `key_buf`.
    fn read_key(&mut self, req: &Request) -> Result<(), End> {
        let key_len = req.key_len as usize;
        if key_len > wire::MAX_KEY_LEN {
            return Err(End::Garbage(format!(
                "key length {key_len} > {}",
                wire::MAX_KEY_LEN
            )));
        }
        self.key_buf.resize(key_len, 0);
        self.rd.read_exact(&mut self.key_buf)?;
        Ok(())
    }

    /// The item count of a FREE or OFFLOAD, bounded by [`wire::MAX_FREE_ITEMS`].
    fn item_count(req: &Request, what: &str) -> Result<usize, End> {
        let count = req.key_len;
        if count > wire::MAX_FREE_ITEMS {
            return Err(End::Garbage(format!(
                "{what} of {count} items > {}",
                wire::MAX_FREE_ITEMS
            )));
        }
        Ok(count as usize)
    }

    /// WRITE (key and bytes) and COMMIT (key only: the bytes came by shm or RDMA).
    fn write(&mut self, req: &Request, started: Instant) -> Result<(), End> {
        let shared = self.shared;
        self.read_key(req)?;
        let payload = if req.op == Op::Write { req.len } else { 0 };
        if req.len == 0 {
            self.reply(Status::BadRequest, 0, "zero-length object")?;
            return Ok(());
        }
        let Some((off, len)) = shared.mem.check(req.offset, req.len) else {
            if payload > self.size {
                // Cannot be a real object of this segment: a garbage length.
                return Err(End::Garbage(format!(
                    "write length {} > segment size {}",
                    req.len, self.size
                )));
            }
            crate::vio::discard(&mut self.rd, payload)?;
            self.out_of_bounds()?;
            return Ok(());
        };
        if !self.allowed(req, RIGHT_WRITE)? {
            crate::vio::discard(&mut self.rd, payload)?;
            return Ok(());
        }
        if req.op == Op::Write && shared.table.holds(req.generation) {
            // A committed object never changes: its bytes are what readers of this
            // generation trust. Only a bug or an attacker writes one again.
            crate::vio::discard(&mut self.rd, payload)?;
            self.refuse(
                req,
                "generation already committed here; objects are never rewritten",
            )?;
            return Ok(());
        }
        // In flight from here until the reply: a FREE that revokes this generation meanwhile
        // waits for the guard, so the master reuses the range only after these bytes landed
        // (and were refused), never while they still arrive.
        let guard = match shared.table.begin_write(req.generation) {
            Ok(g) => g,
            Err(RevokedGeneration) => {
                crate::vio::discard(&mut self.rd, payload)?;
                self.refuse(req, REVOKED)?;
                return Ok(());
            }
        };
        if req.op == Op::Write {
            shared
                .table
                .invalidate_range(req.offset, req.len, OVERWRITE_PIN_WAIT);
            // SAFETY: [off, off+len) was bounds-checked against the mapping, and the
            // entries there were just retired and their readers waited for, so nothing
            // else reads this range through a reference while we fill it. The slice
            // lives only for this read_exact.
            let dst = unsafe { std::slice::from_raw_parts_mut(shared.mem.ptr_at(off), len) };
            self.rd.read_exact(dst)?;
        }
        let Ok(key) = std::str::from_utf8(&self.key_buf) else {
            self.reply(Status::BadRequest, 0, "key is not UTF-8")?;
            return Ok(());
        };
        // Only a capability that passed `allowed` gets here, so the proof is the master's
        // answer to this very placement (or, with capabilities off, none).
        let proof = self.cap.as_ref().and_then(Capability::proof);
        let committed = shared.table.commit_write(
            &guard,
            req.generation,
            key.to_owned(),
            (req.offset, req.len),
            proof,
        );
        if committed.is_err() {
            // Revoked while the bytes arrived: they stay uncommitted in a range the master
            // takes back once this guard drops.
            drop(guard);
            self.refuse(req, REVOKED)?;
            return Ok(());
        }
        drop(guard);
        shared.counters.writes.fetch_add(1, Ordering::Relaxed);
        shared
            .counters
            .bytes_written
            .fetch_add(req.len, Ordering::Relaxed);
        self.reply(Status::Ok, 0, "")?;
        let op = if req.op == Op::Write {
            TimedOp::Write
        } else {
            TimedOp::Commit
        };
        shared.counters.op_times.observe(op, started.elapsed());
        Ok(())
    }

    /// READ (bytes back on this stream) and PIN (the requester copies them by shm or RDMA).
    fn read(&mut self, req: &Request, started: Instant) -> Result<(), End> {
        let shared = self.shared;
        if req.len == 0 {
            self.reply(Status::BadRequest, 0, "zero-length read")?;
            return Ok(());
        }
        let Some((off, len)) = self.range(req)? else {
            return Ok(());
        };
        if !self.allowed(req, RIGHT_READ)? {
            return Ok(());
        }
        if req.op == Op::Pin && self.pins.len() >= MAX_PINS_PER_CONN {
            self.reply(Status::BadRequest, 0, "too many pins on one connection")?;
            return Ok(());
        }
        let pin = match shared.table.pin(req.generation, req.offset, req.len) {
            PinResult::Pinned(p) => p,
            PinResult::Stale => {
                self.reply(Status::Stale, 0, "")?;
                return Ok(());
            }
        };
        shared.counters.reads.fetch_add(1, Ordering::Relaxed);
        shared
            .counters
            .bytes_read
            .fetch_add(req.len, Ordering::Relaxed);
        if req.op == Op::Pin {
            self.pins.push((req.generation, req.offset, req.len, pin));
            self.reply(Status::Ok, 0, "")?;
            let took = started.elapsed();
            shared.counters.op_times.observe(TimedOp::Pin, took);
            return Ok(());
        }
        // SAFETY: the range is bounds-checked and the entry is pinned, so no WRITE or
        // FREE reuses it until we unpin; the slice only lives for this writev.
        let body = unsafe { std::slice::from_raw_parts(shared.mem.ptr_at(off), len) };
        let r = reply_body(&mut self.wr, 0, body);
        shared.table.unpin(pin);
        r?;
        let took = started.elapsed();
        shared.counters.op_times.observe(TimedOp::Read, took);
        Ok(())
    }

    fn unpin(&mut self, req: &Request) {
        if let Some(i) = self
            .pins
            .iter()
            .position(|&(g, o, l, _)| (g, o, l) == (req.generation, req.offset, req.len))
        {
            let (_, _, _, pin) = self.pins.swap_remove(i);
            self.shared.table.unpin(pin);
        }
    }

    fn free(&mut self, req: &Request) -> Result<(), End> {
        let shared = self.shared;
        let count = Self::item_count(req, "FREE")?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(req.aux));
        let mut pinned = Vec::new();
        let mut writing = Vec::new();
        let Some(buffered) = self.owner_body(req, count)? else {
            return Ok(());
        };
        let mut body = Body::of(&mut self.rd, buffered);
        for_each_chunk(&mut body, &mut self.free_buf, count, |items| {
            let disk: Vec<u64> = items
                .iter()
                .filter(|(_, o)| *o == wire::DISK_OFFSET)
                .map(|(g, _)| *g)
                .collect();
            if !disk.is_empty()
                && let Some(cold) = shared.cold.get()
            {
                cold.remove(&disk);
            }
            let freed = shared.table.free_items(items);
            pinned.extend(freed.pinned);
            writing.extend(freed.writing);
        })?;
        // OK promises the master the ranges are unused: no reader holds a pin and no write of
        // a freed generation is still copying (it could land in the range's next owner).
        let freed = Freed { pinned, writing };
        if shared.table.wait_freed(&freed, deadline) {
            self.reply(Status::Ok, 0, "")?;
        } else {
            let why = if freed.writing.is_empty() {
                "entries dropped but readers still hold pins"
            } else {
                "entries dropped but writes of them are still in flight"
            };
            self.reply(Status::Timeout, 0, why)?;
        }
        Ok(())
    }

    /// The body of a FREE or OFFLOAD of `count` pairs, to be read from: the socket itself when
    /// the owner requires no capabilities (pairs are applied as they arrive), else the whole
    /// body read first so that the master's tag is checked before any pair is applied.
    /// `Ok(None)`: refused (answered); `Ok(Some(None))`: read the socket.
    ///
    /// Before a single body byte is buffered the header must pass the master's header-only tag
    /// ([`Capability::verify_owner_header`]): anyone else's body is discarded as it arrives, so
    /// a stranger's FREE costs the owner its header, however large a body it claims. A tagged
    /// header's body is then buffered as it arrives, [`BODY_STEP`] bytes at a time, against
    /// [`UNVERIFIED_BODY_BUDGET`] shared by every such body until its whole tag is checked.
    #[allow(clippy::option_option)]
    fn owner_body(&mut self, req: &Request, count: usize) -> Result<Option<Option<Vec<u8>>>, End> {
        let Some((secret, _)) = self.shared.secret.get() else {
            return Ok(Some(None));
        };
        let total = count * 16;
        let header = match &self.cap {
            None => Err(crate::CapError::Missing),
            Some(c) => c.verify_owner_header(secret, &req.encode()),
        };
        if let Err(why) = header {
            self.refuse(
                req,
                &format!("{} not from the master: {why}", req.op.name()),
            )?;
            // Consumed without keeping a byte, so the stream stays in step (as after a refused
            // WRITE); the request's deadline bounds how long a peer may take to send it.
            crate::vio::discard(&mut self.rd, total as u64)?;
            return Ok(None);
        }
        let mut lease = self.shared.unverified.lease();
        let until = Instant::now() + self.shared.request_timeout;
        let mut all: Vec<u8> = Vec::new();
        while all.len() < total {
            let n = (total - all.len()).min(BODY_STEP);
            if all.capacity() < all.len() + n {
                // Doubling, so a big body costs few copies; the budget counts what is reserved.
                let cap = (all.capacity() * 2).clamp(all.len() + n, total);
                if !lease.grow(cap as u64, until) {
                    return Err(End::Busy);
                }
                all.reserve_exact(cap - all.len());
            }
            let at = all.len();
            all.resize(at + n, 0);
            self.rd.read_exact(&mut all[at..])?;
        }
        if !self.owner_allowed(req, &all)? {
            return Ok(None);
        }
        Ok(Some(Some(all)))
    }

    /// `report`: the master asked for the disk tier's drops in the answer ([`wire::FLAG_DROPS`]).
    fn offload(&mut self, req: &Request, report: bool) -> Result<(), End> {
        let shared = self.shared;
        let count = Self::item_count(req, "OFFLOAD")?;
        let deadline = Instant::now() + Duration::from_millis(u64::from(req.aux));
        let mut pinned = Vec::new();
        let mut stored = 0u64;
        // Grow only with pairs actually received (failed: at most one per pair).
        let mut failed: Vec<u64> = Vec::new();
        let mut dropped: Vec<ColdDropped> = Vec::new();
        let Some(buffered) = self.owner_body(req, count)? else {
            return Ok(());
        };
        let mut pairs = Body::of(&mut self.rd, buffered);
        let read = for_each_chunk(&mut pairs, &mut self.free_buf, count, |items| {
            let (s, f, d) = offload(shared, items, report);
            stored += s;
            failed.extend(f);
            dropped.extend(d);
            // Durable (or failed): now the DRAM entries go, exactly as FREE.
            pinned.extend(shared.table.retire_items(items));
        });
        let cold = shared.cold.get();
        // Drops that no answer will carry go back to the tier's own reporting (the Ping), or
        // the master would keep calling those objects present.
        let report_later = |d: Vec<ColdDropped>| {
            if let Some(cold) = cold
                && !d.is_empty()
            {
                cold.report_later(d);
            }
        };
        if let Err(e) = read {
            report_later(dropped);
            return Err(e.into());
        }
        shared.table.wait_unpinned(&pinned, deadline);
        if !report {
            let body: Vec<u8> = failed.iter().flat_map(|g| g.to_le_bytes()).collect();
            reply_body(&mut self.wr, stored, &body)?;
            return Ok(());
        }
        // What one answer may carry (the requester's bounds); the rest goes on the Ping.
        let (mut fit, mut rest) = (Vec::new(), Vec::new());
        let mut bytes = 0usize;
        for d in dropped {
            let len = wire::offload_drop_len(d.key.len());
            if d.key.len() <= wire::MAX_KEY_LEN
                && fit.len() < wire::MAX_OFFLOAD_DROPS
                && bytes + len <= wire::MAX_OFFLOAD_DROP_BYTES
            {
                bytes += len;
                fit.push(d);
            } else {
                rest.push(d);
            }
        }
        report_later(rest);
        let listed: Vec<wire::DroppedObject> = fit
            .iter()
            .map(|d| wire::DroppedObject {
                generation: d.generation,
                key: d.key.clone(),
            })
            .collect();
        let body = wire::encode_offload_answer(&failed, &listed);
        if let Err(e) = reply_body(&mut self.wr, stored, &body) {
            report_later(fit);
            return Err(e.into());
        }
        Ok(())
    }

    fn load(&mut self, req: &Request) -> Result<(), End> {
        let shared = self.shared;
        if req.len == 0 || req.len > self.size.max(1 << 30) {
            self.reply(Status::BadRequest, 0, "bad load length")?;
            return Ok(());
        }
        if !self.allowed(req, RIGHT_READ)? {
            return Ok(());
        }
        // DRAM first: an offload in flight drops the DRAM entry only after the disk
        // copy is indexed, so checking DRAM then disk never misses the object.
        if let Some((pin, off)) = shared.table.pin_gen(req.generation, req.len) {
            let r = match shared.mem.check(off, req.len) {
                Some((o, l)) => {
                    // SAFETY: bounds-checked and pinned, as for READ.
                    let body = unsafe { std::slice::from_raw_parts(shared.mem.ptr_at(o), l) };
                    reply_body(&mut self.wr, 0, body)
                }
                None => self.reply(Status::Stale, 0, ""),
            };
            shared.table.unpin(pin);
            r?;
            return Ok(());
        }
        let Some(cold) = shared.cold.get() else {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        };
        if cold.size_of(req.generation) != Some(req.len) {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        }
        // Only a real object of this length gets here; the budget bounds how many
        // such buffers all connections hold at once.
        let taken = shared.load_budget.take(req.len);
        self.load_buf.resize(req.len as usize, 0);
        let r = match cold.load(req.generation, &mut self.load_buf) {
            Ok(true) => {
                shared.counters.reads.fetch_add(1, Ordering::Relaxed);
                shared
                    .counters
                    .bytes_read
                    .fetch_add(req.len, Ordering::Relaxed);
                reply_body(&mut self.wr, 0, &self.load_buf)
            }
            Ok(false) => self.reply(Status::Stale, 0, ""),
            Err(msg) => {
                tracing::warn!(generation = req.generation, error = %msg, "disk load failed");
                self.reply(Status::Stale, 0, "")
            }
        };
        // Keep the buffer for the next load only while small: idle connections must
        // not sit on big buffers outside the budget.
        if self.load_buf.capacity() > LOAD_BUF_KEEP {
            self.load_buf = Vec::new();
        }
        shared.load_budget.give(taken);
        r?;
        Ok(())
    }

    fn promote(&mut self, req: &Request) -> Result<(), End> {
        let shared = self.shared;
        self.read_key(req)?;
        let key = std::mem::take(&mut self.key_buf);
        let ok = self.owner_allowed(req, &key)?;
        self.key_buf = key;
        if !ok {
            return Ok(());
        }
        if self.unix {
            self.reply(
                Status::BadRequest,
                0,
                "PROMOTE is only valid on the tcp listener",
            )?;
            return Ok(());
        }
        if req.len == 0 {
            self.reply(Status::BadRequest, 0, "zero-length object")?;
            return Ok(());
        }
        let Ok(key) = std::str::from_utf8(&self.key_buf) else {
            self.reply(Status::BadRequest, 0, "key is not UTF-8")?;
            return Ok(());
        };
        let key = key.to_owned();
        let Some((off, len)) = self.range(req)? else {
            return Ok(());
        };
        let Some(cold) = shared.cold.get() else {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        };
        if cold.size_of(req.generation) != Some(req.len) {
            self.reply(Status::Stale, 0, "")?;
            return Ok(());
        }
        // The master reserved this range for the promotion; retire anything stale
        // there and wait for its readers, as WRITE does.
        shared
            .table
            .invalidate_range(req.offset, req.len, OVERWRITE_PIN_WAIT);
        // SAFETY: [off, off+len) was bounds-checked against the mapping, and the
        // entries there were just retired and their readers waited for, so nothing
        // reads this range through a reference while the disk tier fills it. The
        // slice lives only for this load.
        let dst = unsafe { std::slice::from_raw_parts_mut(shared.mem.ptr_at(off), len) };
        match cold.load(req.generation, dst) {
            Ok(true) => {
                let proof = cold.proof_of(req.generation);
                shared
                    .table
                    .commit(req.generation, key, req.offset, req.len, proof);
                self.reply(Status::Ok, 0, "")?;
            }
            Ok(false) => self.reply(Status::Stale, 0, "")?,
            Err(msg) => {
                tracing::warn!(generation = req.generation, error = %msg, "promotion from disk failed");
                self.reply(Status::Stale, 0, "")?
            }
        }
        Ok(())
    }

    fn rdma_connect(&mut self, req: &Request) -> Result<(), End> {
        let n = req.key_len as usize;
        if n > crate::rdma::RDMA_DESC_MAX_LEN {
            return Err(End::Garbage(format!(
                "RDMA_CONNECT descriptor of {n} bytes"
            )));
        }
        self.key_buf.resize(n, 0);
        self.rd.read_exact(&mut self.key_buf)?;
        let answer = if self.unix {
            Err(crate::rdma::RdmaAcceptError::UnixListener)
        } else if self.shared.secret.get().is_some() {
            // A queue pair reaches the whole registered segment, and its PIN/COMMIT carry no
            // capability yet: with capabilities required the requester falls back to tcp.
            Err(crate::rdma::RdmaAcceptError::CapabilitiesRequired)
        } else {
            self.shared.rdma.accept(&self.key_buf)
        };
        match answer {
            Ok((qp, desc)) => {
                self.rdma_qps.push(qp);
                // The queue pair lives as long as this connection, and RDMA reads
                // leave it quiet: it is not idle.
                self.wr.clear_read_timeout()?;
                reply_body(&mut self.wr, 0, &desc)?;
            }
            Err(why) => self.reply(Status::BadRequest, 0, &why.to_string())?,
        }
        Ok(())
    }
}

/// Where a FREE/OFFLOAD body is read from (see [`Conn::owner_body`]).
enum Body<'a, R: Read> {
    Stream(&'a mut R),
    Buffered(std::io::Cursor<Vec<u8>>),
}

impl<'a, R: Read> Body<'a, R> {
    fn of(rd: &'a mut R, buffered: Option<Vec<u8>>) -> Body<'a, R> {
        match buffered {
            Some(b) => Body::Buffered(std::io::Cursor::new(b)),
            None => Body::Stream(rd),
        }
    }
}

impl<R: Read> Read for Body<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Body::Stream(r) => r.read(buf),
            Body::Buffered(c) => c.read(buf),
        }
    }
}

/// Reads a FREE/OFFLOAD body of `count` pairs [`PAIRS_PER_CHUNK`] at a time into `buf`, and
/// hands each chunk to `f` as it arrives.
fn for_each_chunk<R: Read>(
    rd: &mut R,
    buf: &mut Vec<u8>,
    count: usize,
    mut f: impl FnMut(&[(u64, u64)]),
) -> io::Result<()> {
    let mut left = count;
    while left > 0 {
        let n = left.min(PAIRS_PER_CHUNK);
        buf.resize(n * 16, 0);
        rd.read_exact(buf)?;
        f(&parse_pairs(buf));
        left -= n;
    }
    Ok(())
}

fn parse_pairs(buf: &[u8]) -> Vec<(u64, u64)> {
    buf.chunks_exact(16)
        .map(|c| {
            let (g, o) = c.split_at(8);
            (
                u64::from_le_bytes(g.try_into().unwrap_or_default()),
                u64::from_le_bytes(o.try_into().unwrap_or_default()),
            )
        })
        .collect()
}

/// Writes the pinned entries to the disk tier. Returns (objects now on disk, generations that
/// could not be stored). Entries the owner no longer has count as stored if the disk tier holds
/// them (a retried OFFLOAD) and as failed otherwise.
/// With `report`, also the objects the tier dropped to make room for these (see
/// [`ColdTier::store_reporting`]); without, the tier reports its drops itself.
fn offload(
    shared: &Shared,
    items: &[(u64, u64)],
    report: bool,
) -> (u64, Vec<u64>, Vec<ColdDropped>) {
    let Some(cold) = shared.cold.get() else {
        return (0, items.iter().map(|(g, _)| *g).collect(), Vec::new());
    };
    let mut pinned = Vec::with_capacity(items.len());
    let mut failed = Vec::new();
    let mut stored = 0u64;
    for &(generation, offset) in items {
        match shared.table.pin_at(generation, offset) {
            Some(p) => pinned.push(p),
            None if cold.size_of(generation).is_some() => stored += 1,
            None => failed.push(generation),
        }
    }
    let batch = cold_items(shared, &pinned, |g| failed.push(g));
    let mut dropped = Vec::new();
    let r = if report {
        cold.store_reporting(&batch).map(|s| {
            dropped = s.dropped;
            s.stored
        })
    } else {
        cold.store(&batch)
    };
    match r {
        Ok(done) => {
            // A shutdown drain keeps these disk copies: they are the master's replicas now.
            shared.table.note_offloaded(&done);
            stored += done.len() as u64;
            let done: std::collections::HashSet<u64> = done.into_iter().collect();
            failed.extend(
                batch
                    .iter()
                    .map(|b| b.generation)
                    .filter(|g| !done.contains(g)),
            );
        }
        Err(msg) => {
            tracing::error!(objects = batch.len(), error = %msg, "offload to disk failed; the objects are dropped from DRAM as a plain eviction");
            failed.extend(batch.iter().map(|b| b.generation));
        }
    }
    drop(batch);
    for p in pinned {
        shared.table.unpin(p.pin);
    }
    (stored, failed, dropped)
}

/// The disk tier's items for pinned entries: their bytes in the mapping, with key and proof.
/// An entry whose range is outside the mapping (cannot happen for a committed one) goes to
/// `outside`.
pub(crate) fn cold_items<'a>(
    shared: &'a Shared,
    pinned: &'a [Pinned],
    mut outside: impl FnMut(u64),
) -> Vec<ColdItem<'a>> {
    let mut batch = Vec::with_capacity(pinned.len());
    for p in pinned {
        let Some((o, l)) = shared.mem.check(p.offset, p.len) else {
            outside(p.generation);
            continue;
        };
        // SAFETY: bounds-checked and pinned: no WRITE or FREE reuses the range until the
        // caller unpins, after the disk tier is done with the slice.
        let bytes = unsafe { std::slice::from_raw_parts(shared.mem.ptr_at(o), l) };
        batch.push(ColdItem {
            key: &p.key,
            generation: p.generation,
            bytes,
            proof: p.proof,
        });
    }
    batch
}

/// ATTACH: the response header travels with the memfd in SCM_RIGHTS, followed by the
/// segment's identity when the requester asked for it.
fn send_fd<S: AsFd>(sock: &S, shared: &Shared, identity: bool) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let body = if identity {
        wire::encode_identity(&shared.identity.read())
    } else {
        Vec::new()
    };
    let mut hdr = Response {
        status: Status::Ok,
        value: shared.mem.len(),
        len: body.len() as u64,
    }
    .encode()
    .to_vec();
    hdr.extend_from_slice(&body);
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds = [shared.mem.fd().as_fd()];
    if !cmsg.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("ancillary buffer too small for one fd"));
    }
    let sent = sendmsg(sock, &[IoSlice::new(&hdr)], &mut cmsg, SendFlags::NOSIGNAL)?;
    if sent < hdr.len() {
        // The fd went with the first byte; the rest of the header follows as plain data.
        let mut w = sock.as_fd().try_clone_to_owned().map(std::fs::File::from)?;
        w.write_all(&hdr[sent..])?;
    }
    Ok(())
}

/// A random id for one server instance (128 bits, hex).
fn new_instance_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Makes room for the shm socket: a file left by a dead owner goes; a socket some live
/// process still accepts on is never unlinked (its requesters would silently map our segment
/// instead of theirs), and refusing names that process.
fn remove_stale_socket(path: &std::path::Path) -> Result<(), TransferError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        // bind reports EADDRINUSE with the path; never delete a file that is not a socket.
        return Ok(());
    }
    match UnixStream::connect(path) {
        Ok(s) => {
            let owner = match rustix::net::sockopt::socket_peercred(&s) {
                Ok(c) => {
                    let pid = c.pid.as_raw_nonzero().get();
                    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .map(|c| c.trim().to_owned())
                        .unwrap_or_else(|_| "unknown".into());
                    format!("pid {pid}, {comm}")
                }
                Err(_) => "pid unknown".into(),
            };
            Err(TransferError::ShmSocketInUse {
                path: path.display().to_string(),
                owner,
            })
        }
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            // Nobody listens: a previous run's leftover.
            let _ = std::fs::remove_file(path);
            Ok(())
        }
        Err(e) => Err(TransferError::ShmUnavailable(format!(
            "cannot probe the existing shm socket {}: {e}; remove it if no store uses it, or pick another --shm_socket",
            path.display()
        ))),
    }
}
