//! The segment owner's side: a memfd segment, its entry table, a tcp listener and (optionally)
//! a unix socket for same-host requesters. One std thread per connection: a connection is a
//! long-lived pooled stream from one requester thread, and blocking I/O straight between the
//! socket and the mmap is the fastest thing on a small box.
//!
//! Here the server's life (start, identity, capabilities, shutdown); what its connections share
//! in `state.rs`; accepting and admitting them in `accept.rs`; a connection's request loop and
//! data calls in `conn.rs`; the owner's calls (FREE, OFFLOAD, LOAD, PROMOTE) in `owner.rs`.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::cap::MountSecret;
use crate::guard::{Admission, Caps, PeerLog, REQUEST_TIMEOUT};
use crate::mem::Mapping;
use crate::table::Table;
use crate::{
    ColdTier, Entry, SegmentIdentity, SegmentInfo, SegmentServerConfig, SegmentStats,
    TransferError, host_id,
};

mod accept;
mod conn;
pub(crate) mod owner;
pub(crate) mod state;

use self::accept::{accept_tcp, accept_unix};
pub use self::state::ConnStats;
use self::state::{BodyBudget, Counters, Live, LoadBudget, Shared};

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
