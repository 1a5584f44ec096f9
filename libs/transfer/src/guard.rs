//! What keeps a segment server serving while peers misbehave: connection admission (a cap per
//! source IP and a global cap sized from the fd limit, so the shm socket and the master link
//! always find a descriptor; when the table is full, the oldest connection that never completed
//! a valid request makes room, so strangers cannot lock out known requesters), a deadline on
//! each request's arrival (a peer trickling bytes is never idle), accept errors that back off
//! instead of spinning, warnings that are rate-limited per peer, and a bind that waits out a
//! port briefly held by someone else.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Read};
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
    /// `open` connections in all already (tcp or shm), the cap; on tcp, every one of them
    /// completed a valid request, so none was closed to make room.
    Global { open: u32, cap: u32 },
}

/// A connection closed to make room for a new one ([`Admission::admit`]): the caller shuts its
/// stream down, and its thread ends on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Evicted {
    pub(crate) id: u64,
    pub(crate) peer: IpAddr,
}

#[derive(Default)]
struct Open {
    tcp: u32,
    unix: u32,
    per_peer: HashMap<IpAddr, u32>,
    /// Every tcp slot open now, by id, with its peer.
    tcp_slots: HashMap<u64, IpAddr>,
    /// The tcp slots that have not completed a valid request yet ([`Slot::mark_known`]),
    /// oldest first (ids grow with admission). When the table is full the first one is closed
    /// for a newcomer: a flood of strangers then only ever displaces itself, and a requester
    /// that just connected is displaced last, after every stranger that came before it.
    unknown: BTreeSet<u64>,
    next_id: u64,
}

impl Open {
    /// Forgets tcp slot `id` (closed, or evicted); its peer if it was open.
    fn forget_tcp(&mut self, id: u64) -> Option<IpAddr> {
        let ip = self.tcp_slots.remove(&id)?;
        self.unknown.remove(&id);
        self.tcp = self.tcp.saturating_sub(1);
        if let Some(n) = self.per_peer.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_peer.remove(&ip);
            }
        }
        Some(ip)
    }
}

/// Counts open connections against the caps. Only accept threads, connection ends and a
/// connection's first valid request touch it, never a later request.
pub(crate) struct Admission {
    pub(crate) caps: Caps,
    open: Mutex<Open>,
}

/// An admitted connection's place; dropping it frees the place.
pub(crate) struct Slot {
    adm: Arc<Admission>,
    /// `None` for the shm socket.
    peer: Option<IpAddr>,
    /// Unique among this server's connections (the key of its registry of open streams).
    id: u64,
}

impl Admission {
    pub(crate) fn new(caps: Caps) -> Arc<Admission> {
        Arc::new(Admission {
            caps,
            open: Mutex::new(Open::default()),
        })
    }

    /// A slot for a tcp connection from `peer`, or a unix one (`None`), unless a cap is reached.
    /// A tcp table at its cap makes room by evicting its oldest connection that never completed
    /// a valid request (returned: the caller closes it); only a table of known connections
    /// refuses. A peer at its own cap is refused first, so it cannot evict anyone.
    pub(crate) fn admit(
        self: &Arc<Self>,
        peer: Option<IpAddr>,
    ) -> Result<(Slot, Option<Evicted>), Refusal> {
        let mut o = self.open.lock();
        let mut evicted = None;
        match peer {
            Some(ip) => {
                let n = o.per_peer.get(&ip).copied().unwrap_or(0);
                if self.caps.per_peer != 0 && n >= self.caps.per_peer {
                    return Err(Refusal::Peer {
                        open: n,
                        cap: self.caps.per_peer,
                    });
                }
                if o.tcp >= self.caps.tcp {
                    let full = Refusal::Global {
                        open: o.tcp,
                        cap: self.caps.tcp,
                    };
                    let victim = o.unknown.first().copied().ok_or(full)?;
                    let vpeer = o.forget_tcp(victim).ok_or(full)?;
                    evicted = Some(Evicted {
                        id: victim,
                        peer: vpeer,
                    });
                }
                *o.per_peer.entry(ip).or_insert(0) += 1;
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
        let id = o.next_id;
        o.next_id += 1;
        if let Some(ip) = peer {
            o.tcp_slots.insert(id, ip);
            o.unknown.insert(id);
        }
        Ok((
            Slot {
                adm: self.clone(),
                peer,
                id,
            },
            evicted,
        ))
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

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// This connection completed a valid request: it is never evicted for a newcomer. Called
    /// once per connection (the caller remembers), so requests never take this lock.
    pub(crate) fn mark_known(&self) {
        if self.peer.is_some() {
            self.adm.open.lock().unknown.remove(&self.id);
        }
    }

    /// Whether this slot was evicted to make room for another connection.
    pub(crate) fn evicted(&self) -> bool {
        self.peer.is_some() && !self.adm.open.lock().tcp_slots.contains_key(&self.id)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.adm.open.lock();
        match self.peer {
            // An evicted slot was forgotten already.
            Some(_) => {
                o.forget_tcp(self.id);
            }
            None => o.unix = o.unix.saturating_sub(1),
        }
    }
}

/// How long one request may take to arrive whole, from its first bytes to its last, on top of
/// the allowance for its length ([`MIN_REQUEST_RATE`]); the idle timeout, when shorter, is the
/// bound instead. A peer that trickles a byte at a time is never idle, so only this frees its
/// connection.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Slowest rate a request's bytes may arrive at once past [`REQUEST_TIMEOUT`]: every byte
/// received extends the request's deadline by 1/this seconds, so a large WRITE on a slow link
/// is served as long as it keeps moving.
pub(crate) const MIN_REQUEST_RATE: u64 = 1 << 20;
const NANOS_PER_BYTE: u64 = 1_000_000_000 / MIN_REQUEST_RATE;

/// A connection's reading half under a per-request deadline. The server arms it when a
/// request's first byte is in and disarms it between requests (where the idle timeout rules).
/// The clock is read only after a read of the socket itself returned, and only while armed: a
/// request parsed from bytes already buffered costs nothing, and no read costs a syscall more.
pub(crate) struct Paced<S> {
    inner: S,
    /// The bound of one request, `None` for none.
    timeout: Option<Duration>,
    state: Pace,
    /// A read came back past the deadline: the connection ends as too slow.
    pub(crate) expired: bool,
}

#[derive(Clone, Copy)]
enum Pace {
    /// Between requests.
    Off,
    /// A request has begun; its deadline starts at the next socket read.
    Armed,
    Until(Instant),
}

impl<S> Paced<S> {
    pub(crate) fn new(inner: S, timeout: Option<Duration>) -> Paced<S> {
        Paced {
            inner,
            timeout,
            state: Pace::Off,
            expired: false,
        }
    }

    /// A request's first byte is in.
    pub(crate) fn arm(&mut self) {
        if self.timeout.is_some() {
            self.state = Pace::Armed;
        }
    }

    /// The request is read whole; until the next one only the idle timeout applies.
    pub(crate) fn disarm(&mut self) {
        self.state = Pace::Off;
    }
}

impl<S: Read> Read for Paced<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let r = self.inner.read(buf);
        let now = match self.state {
            Pace::Off => return r,
            _ => Instant::now(),
        };
        let got = r.as_ref().map_or(0, |n| *n as u64);
        let allowance = Duration::from_nanos(got.saturating_mul(NANOS_PER_BYTE));
        match self.state {
            Pace::Until(at) if now > at => {
                self.expired = true;
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "request not received within its deadline",
                ));
            }
            Pace::Until(at) => self.state = Pace::Until(at + allowance),
            _ => {
                let t = self.timeout.unwrap_or(REQUEST_TIMEOUT);
                self.state = Pace::Until(now + t + allowance);
            }
        }
        r
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
        let known = |r: Result<(Slot, Option<Evicted>), Refusal>| {
            let (s, ev) = r.unwrap();
            assert_eq!(ev, None);
            s.mark_known();
            s
        };
        let s1 = known(adm.admit(Some(a)));
        let _s2 = known(adm.admit(Some(a)));
        assert_eq!(
            adm.admit(Some(a)).err(),
            Some(Refusal::Peer { open: 2, cap: 2 })
        );
        let _s3 = known(adm.admit(Some(b)));
        assert_eq!(
            adm.admit(Some(b)).err(),
            Some(Refusal::Global { open: 3, cap: 3 })
        );
        let _u = adm.admit(None).unwrap();
        assert!(adm.admit(None).is_err());
        drop(s1);
        let _s4 = known(adm.admit(Some(b)));
        assert_eq!(adm.open(), (3, 1));
    }

    #[test]
    fn a_full_table_evicts_its_oldest_stranger_and_never_a_known_connection() {
        let adm = Admission::new(Caps {
            per_peer: 2,
            tcp: 3,
            unix: 1,
        });
        let ip = |i: u8| -> IpAddr { format!("10.0.0.{i}").parse().unwrap() };
        let master = adm.admit(Some(ip(1))).unwrap().0;
        master.mark_known();
        let (old, _) = adm.admit(Some(ip(2))).unwrap();
        let (young, _) = adm.admit(Some(ip(3))).unwrap();
        // Full: a newcomer displaces the oldest stranger, whatever its address.
        let (new, ev) = adm.admit(Some(ip(4))).unwrap();
        assert_eq!(
            ev,
            Some(Evicted {
                id: old.id(),
                peer: ip(2)
            })
        );
        assert!(old.evicted() && !young.evicted() && !master.evicted());
        assert_eq!(adm.open(), (3, 0));
        // The evicted slot's end frees nothing twice.
        drop(old);
        assert_eq!(adm.open(), (3, 0));
        let (y2, ev) = adm.admit(Some(ip(3))).unwrap();
        assert_eq!(ev.map(|e| e.id), Some(young.id()));
        let (y3, ev) = adm.admit(Some(ip(3))).unwrap();
        assert_eq!(ev.map(|e| e.id), Some(new.id()));
        // A peer at its own cap is refused before it may evict anyone, strangers or not.
        assert_eq!(
            adm.admit(Some(ip(3))).err(),
            Some(Refusal::Peer { open: 2, cap: 2 })
        );
        // Only known connections left: refused.
        y2.mark_known();
        y3.mark_known();
        assert_eq!(
            adm.admit(Some(ip(5))).err(),
            Some(Refusal::Global { open: 3, cap: 3 })
        );
        drop((young, new));
        assert_eq!(adm.open(), (3, 0));
        drop(y3);
        assert_eq!(adm.open(), (2, 0));
    }

    #[test]
    fn a_paced_reader_ends_a_request_that_outlives_its_deadline() {
        // A reader that hands out one byte per read, as a trickling peer does.
        struct Trickle;
        impl Read for Trickle {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                std::thread::sleep(Duration::from_millis(5));
                buf[0] = 1;
                Ok(1)
            }
        }
        let mut p = Paced::new(Trickle, Some(Duration::from_millis(30)));
        let mut b = [0u8; 1];
        // Disarmed (between requests): no deadline at all.
        for _ in 0..20 {
            p.read_exact(&mut b).unwrap();
        }
        p.arm();
        let mut n = 0;
        while p.read_exact(&mut b).is_ok() {
            n += 1;
            assert!(n < 10_000, "the deadline never fired");
        }
        assert!(p.expired);
        p.disarm();
        p.expired = false;
        p.read_exact(&mut b).unwrap();
        // A peer that keeps its rate gets its allowance: 1 MiB per read here.
        struct Fast;
        impl Read for Fast {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                Ok(buf.len())
            }
        }
        let mut f = Paced::new(Fast, Some(Duration::from_millis(1)));
        f.arm();
        let mut big = vec![0u8; 1 << 20];
        for _ in 0..50 {
            f.read_exact(&mut big).unwrap();
        }
        assert!(!f.expired);
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
