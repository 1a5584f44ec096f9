//! What keeps a segment server serving while peers misbehave: connection admission (a cap per
//! source IP and a global cap sized from the fd limit, so the shm socket and the master link
//! always find a descriptor), accept errors that back off instead of spinning, warnings that
//! are rate-limited per peer, and a bind that waits out a port briefly held by someone else.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::{ConnLimits, TransferError};

/// Descriptors one served connection holds: the stream, the clone shutdown uses to unblock its
/// thread, and the clone its reader owns.
const FDS_PER_CONN: u64 = 3;
/// Descriptors kept out of every connection budget: listeners, the memfd, the master's gRPC
/// channel, the admin HTTP server, the disk tier's files, logs.
const FD_RESERVE: u64 = 256;
/// Ceiling of the derived tcp cap: each connection is a thread, and pid limits of containers
/// are often a few thousand.
const AUTO_MAX_CONNS: u64 = 8192;
/// Ceiling of the shm socket's cap (same-host engines: a few pooled connections each).
const AUTO_MAX_SHM_CONNS: u64 = 1024;
/// A repeated warning about one peer is logged at most once per this window, with a count.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(30);
/// Peers whose warnings are tracked one by one; beyond this they share one line.
const MAX_TRACKED_PEERS: usize = 4096;
/// Accept errors (EMFILE...) back off from this delay, doubling, up to the next.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The process's soft RLIMIT_NOFILE (`u64::MAX` when unlimited or unreadable).
pub(crate) fn fd_limit() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
}

/// Raises the soft RLIMIT_NOFILE to the hard limit, so a server sized from it gets every
/// descriptor the operator allows (many distributions start services at a soft 1024). Returns
/// the new `(soft, hard)`; `None` stands for unlimited.
pub fn raise_fd_limit() -> io::Result<(Option<u64>, Option<u64>)> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current != l.maximum {
        l.current = l.maximum;
        setrlimit(Resource::Nofile, l)?;
    }
    Ok((l.current, l.maximum))
}

/// The caps a server runs with, resolved from [`ConnLimits`] and the fd limit at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// 0: no per-peer cap.
    pub(crate) per_peer: u32,
    pub(crate) tcp: u32,
    pub(crate) unix: u32,
}

impl Caps {
    pub(crate) fn resolve(limits: &ConnLimits, nofile: u64) -> Caps {
        let budget = nofile.saturating_sub(FD_RESERVE) / FDS_PER_CONN;
        // The shm socket gets its share first: same-host gets must survive a tcp flood.
        let unix = (budget / 8).clamp(16, AUTO_MAX_SHM_CONNS);
        let auto_tcp = budget.saturating_sub(unix).clamp(16, AUTO_MAX_CONNS);
        let tcp = if limits.max_conns == 0 {
            auto_tcp
        } else {
            u64::from(limits.max_conns)
        };
        if tcp + unix > budget.max(16) && limits.max_conns != 0 {
            tracing::warn!(
                max_conns = tcp,
                fd_limit = nofile,
                "the transfer connection cap is above what the fd limit allows; raise `ulimit -n` or lower the cap, or a flood can still exhaust descriptors"
            );
        }
        Caps {
            per_peer: limits.max_conns_per_peer,
            tcp: u32::try_from(tcp).unwrap_or(u32::MAX),
            unix: unix as u32,
        }
    }
}

/// Why a connection was closed at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// `open` connections from this peer already, the cap.
    Peer { open: u32, cap: u32 },
    /// `open` connections in all already (tcp or shm), the cap.
    Global { open: u32, cap: u32 },
}

#[derive(Default)]
struct Open {
    tcp: u32,
    unix: u32,
    per_peer: HashMap<IpAddr, u32>,
}

/// Counts open connections against the caps. Only accept threads and connection ends touch
/// it, never a request.
pub(crate) struct Admission {
    pub(crate) caps: Caps,
    open: Mutex<Open>,
}

/// An admitted connection's place; dropping it frees the place.
pub(crate) struct Slot {
    adm: Arc<Admission>,
    /// `None` for the shm socket.
    peer: Option<IpAddr>,
}

impl Admission {
    pub(crate) fn new(caps: Caps) -> Arc<Admission> {
        Arc::new(Admission {
            caps,
            open: Mutex::new(Open::default()),
        })
    }

    /// A slot for a tcp connection from `peer`, or a unix one (`None`), unless a cap is reached.
    pub(crate) fn admit(self: &Arc<Self>, peer: Option<IpAddr>) -> Result<Slot, Refusal> {
        let mut o = self.open.lock();
        match peer {
            Some(ip) => {
                if o.tcp >= self.caps.tcp {
                    return Err(Refusal::Global {
                        open: o.tcp,
                        cap: self.caps.tcp,
                    });
                }
                let n = o.per_peer.get(&ip).copied().unwrap_or(0);
                if self.caps.per_peer != 0 && n >= self.caps.per_peer {
                    return Err(Refusal::Peer {
                        open: n,
                        cap: self.caps.per_peer,
                    });
                }
                o.per_peer.insert(ip, n + 1);
                o.tcp += 1;
            }
            None => {
                if o.unix >= self.caps.unix {
                    return Err(Refusal::Global {
                        open: o.unix,
                        cap: self.caps.unix,
                    });
                }
                o.unix += 1;
            }
        }
        Ok(Slot {
            adm: self.clone(),
            peer,
        })
    }

    /// Open (tcp, unix) connections.
    pub(crate) fn open(&self) -> (u32, u32) {
        let o = self.open.lock();
        (o.tcp, o.unix)
    }
}

impl Slot {
    /// The peer's IP; `None` for the shm socket.
    pub(crate) fn peer(&self) -> Option<IpAddr> {
        self.peer
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.adm.open.lock();
        match self.peer {
            Some(ip) => {
                o.tcp = o.tcp.saturating_sub(1);
                if let Some(n) = o.per_peer.get_mut(&ip) {
                    *n -= 1;
                    if *n == 0 {
                        o.per_peer.remove(&ip);
                    }
                }
            }
            None => o.unix = o.unix.saturating_sub(1),
        }
    }
}

/// Rate-limits one kind of warning per peer: the first is logged, then at most one line per
/// [`WARN_EVERY`] carrying how many were suppressed in between. Counting every occurrence is
/// the metrics' job.
#[derive(Default)]
pub(crate) struct PeerLog {
    /// peer (`None`: the shm socket) -> (when last logged, suppressed since).
    seen: Mutex<HashMap<Option<IpAddr>, (Instant, u64)>>,
}

impl PeerLog {
    /// `Some(suppressed since the last line)` when this occurrence should be logged.
    pub(crate) fn check(&self, peer: Option<IpAddr>) -> Option<u64> {
        let now = Instant::now();
        let mut seen = self.seen.lock();
        let key = if seen.len() >= MAX_TRACKED_PEERS && !seen.contains_key(&peer) {
            seen.retain(|_, (at, n)| now.duration_since(*at) < WARN_EVERY || *n > 0);
            if seen.len() >= MAX_TRACKED_PEERS {
                // Too many distinct peers at once: they share one budget.
                Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
            } else {
                peer
            }
        } else {
            peer
        };
        match seen.get_mut(&key) {
            Some((at, n)) if now.duration_since(*at) < WARN_EVERY => {
                *n += 1;
                None
            }
            Some((at, n)) => {
                let suppressed = *n;
                *at = now;
                *n = 0;
                Some(suppressed)
            }
            None => {
                seen.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

/// A peer as log fields show it.
pub(crate) fn peer_name(peer: Option<IpAddr>) -> String {
    peer.map_or_else(|| "shm socket".to_string(), |ip| ip.to_string())
}

/// Accept errors (EMFILE, ENFILE, ENOBUFS...) sleep with exponential backoff and log at most
/// once per [`WARN_EVERY`], instead of spinning and logging each time.
pub(crate) struct AcceptBackoff {
    listener: &'static str,
    delay: Duration,
    last_log: Option<Instant>,
    suppressed: u64,
}

impl AcceptBackoff {
    pub(crate) fn new(listener: &'static str) -> AcceptBackoff {
        AcceptBackoff {
            listener,
            delay: ACCEPT_BACKOFF_MIN,
            last_log: None,
            suppressed: 0,
        }
    }

    pub(crate) fn succeeded(&mut self) {
        self.delay = ACCEPT_BACKOFF_MIN;
    }

    pub(crate) fn failed(&mut self, e: &io::Error) {
        // A peer that reset before we accepted it: nothing is wrong here.
        if matches!(
            e.kind(),
            io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted
        ) {
            return;
        }
        if self.last_log.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            tracing::warn!(
                listener = self.listener,
                error = %e,
                suppressed = self.suppressed,
                backoff_ms = self.delay.as_millis() as u64,
                "accept failed; backing off (too many open files: lower the connection caps or raise `ulimit -n`)"
            );
            self.last_log = Some(Instant::now());
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
        std::thread::sleep(self.delay);
        self.delay = (self.delay * 2).min(ACCEPT_BACKOFF_MAX);
    }
}

/// Binds `addr`, retrying for up to `retry_for` while it is in use. A store restarted after a
/// kill -9 often finds its port taken for a while: 50052 sits in Linux's ephemeral range, so
/// any outgoing connection on the host may hold it as its source port.
pub(crate) fn bind_tcp(
    addr: SocketAddr,
    retry_for: Duration,
) -> Result<TcpListener, TransferError> {
    let start = Instant::now();
    let mut delay = Duration::from_millis(50);
    let mut logged = false;
    loop {
        match TcpListener::bind(addr) {
            Ok(l) => {
                if logged {
                    tracing::info!(%addr, waited_ms = start.elapsed().as_millis() as u64, "transfer port free again; bound");
                }
                return Ok(l);
            }
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                let left = retry_for.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(TransferError::Bind {
                        addr: addr.to_string(),
                        source: io::Error::new(
                            e.kind(),
                            format!(
                                "{e}, still after retrying for {}s: another process listens there, or a connection took it as its source port (reserve lunakv's ports with net.ipv4.ip_local_reserved_ports, deploy/README.md)",
                                retry_for.as_secs()
                            ),
                        ),
                    });
                }
                if !logged {
                    tracing::warn!(%addr, retry_secs = retry_for.as_secs(), "transfer port in use (a connection may hold it as its source port; reserve it with net.ipv4.ip_local_reserved_ports); retrying");
                    logged = true;
                }
                std::thread::sleep(delay.min(left));
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => {
                return Err(TransferError::Bind {
                    addr: addr.to_string(),
                    source: e,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_follow_the_fd_limit_and_keep_a_share_for_shm() {
        let d = ConnLimits::default();
        let small = Caps::resolve(&d, 1024);
        assert!(small.tcp * 3 + small.unix * 3 + 256 <= 1024, "{small:?}");
        assert!(small.unix >= 16);
        let big = Caps::resolve(&d, 1 << 20);
        assert_eq!((big.tcp, big.unix), (8192, 1024));
        let set = Caps::resolve(
            &ConnLimits {
                max_conns: 10,
                ..d.clone()
            },
            1 << 20,
        );
        assert_eq!(set.tcp, 10);
    }

    #[test]
    fn admission_caps_per_peer_and_in_all_and_frees_on_drop() {
        let adm = Admission::new(Caps {
            per_peer: 2,
            tcp: 3,
            unix: 1,
        });
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let s1 = adm.admit(Some(a)).unwrap();
        let _s2 = adm.admit(Some(a)).unwrap();
        assert_eq!(
            adm.admit(Some(a)).err(),
            Some(Refusal::Peer { open: 2, cap: 2 })
        );
        let _s3 = adm.admit(Some(b)).unwrap();
        assert_eq!(
            adm.admit(Some(b)).err(),
            Some(Refusal::Global { open: 3, cap: 3 })
        );
        let _u = adm.admit(None).unwrap();
        assert!(adm.admit(None).is_err());
        drop(s1);
        let _s4 = adm.admit(Some(b)).expect("a freed place is reused");
        assert_eq!(adm.open(), (3, 1));
    }

    #[test]
    fn peer_log_logs_the_first_then_suppresses_within_the_window() {
        let log = PeerLog::default();
        let a = Some("10.0.0.1".parse().unwrap());
        assert_eq!(log.check(a), Some(0));
        for _ in 0..100 {
            assert_eq!(log.check(a), None);
        }
        // Another peer has its own budget.
        assert_eq!(log.check(None), Some(0));
    }
}
