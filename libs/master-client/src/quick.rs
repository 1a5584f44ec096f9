//! The client's side of quick calls ([`lunakv_proto::quick`]): the hottest master calls (exists,
//! location reads, the two halves of a put) written and read on the calling thread over a plain
//! TCP connection, instead of handing each call to the client runtime's HTTP/2 connection task
//! and back.
//!
//! A quick call answers, steps aside, or is lost:
//! - With quick calls off (`LUNAKV_QUICK_CALLS=0`), while the process exports traces, against a
//!   master that does not speak them, with a frame that could not be sent, or on any status from
//!   the master, it steps aside: the caller makes the same call over gRPC, which follows
//!   leaders, waits out rebuilds and reports errors.
//! - A frame sent whose answer never came is lost. A read is then asked again over gRPC. A
//!   mutation (BatchPutStart, BatchPutEnd) may have been applied, so it is treated as a gRPC
//!   call whose connection broke: made again at the leader under HA (a deposed leader refuses
//!   it), reported failed otherwise. Idle connections are dropped well before the master's idle
//!   limit closes them, so a healthy master does not lose frames.
//!
//! So a quick call never changes an answer, only how fast it comes.
//!
//! With TLS towards the master (`LUNAKV_TLS_*`), a quick connection is a TLS session too (the
//! same certificate and CA; no ALPN, the master tells it from gRPC by the decrypted magic). A
//! handshake or a first answer that fails with a TLS error steps aside: gRPC then reports the
//! refusal by name, and nothing was sent in the clear.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use lunakv_proto::quick::{self, Method};
use parking_lot::Mutex;
use prost::Message;
use rustix::net::RecvFlags;

/// Set to 0 to send every master call over gRPC.
pub const QUICK_CALLS_ENV: &str = "LUNAKV_QUICK_CALLS";

/// Idle connections kept per client (concurrent callers beyond this open and close their own).
const MAX_IDLE: usize = 4;
/// After a master closed a fresh quick connection unanswered (an older lunakv-master, or one at
/// its connection limit), quick calls to it rest this long.
const REST: Duration = Duration::from_secs(30);
/// Bytes of an answer reserved before it is read: a batch of 128 placements is about 2 KiB.
const ANSWER_AHEAD: usize = 64 << 10;
/// The longest a connect may take before the call goes over gRPC instead.
const CONNECT_WAIT: Duration = Duration::from_secs(1);
/// Idle connections older than this are dropped, not reused: well inside the master's 300 s
/// idle limit, so a reused connection is never one the master is closing.
const MAX_IDLE_AGE: Duration = Duration::from_secs(60);

/// A quick connection: plain TCP, or a TLS session over it.
enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

struct Conn {
    addr: String,
    stream: Stream,
    authorization: Vec<u8>,
    last_used: Instant,
}

impl Conn {
    /// Whether the master closed this idle connection (it restarted, or dropped it): then no
    /// frame of ours can be on it, and a fresh connection is taken instead of losing the call.
    /// Pending bytes (a TLS session ticket) leave it open; the read of the answer handles them.
    fn closed_by_peer(&self) -> bool {
        let tcp = match &self.stream {
            Stream::Plain(s) => s,
            Stream::Tls(s) => &s.sock,
        };
        // One non-blocking peek on the blocking socket: toggling O_NONBLOCK around a plain
        // peek cost two more syscalls on every quick call.
        let mut byte = [0u8; 1];
        match rustix::net::recv(tcp, &mut byte[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((0, _)) => true,
            Ok(_) => false,
            Err(e) => e != rustix::io::Errno::AGAIN && e != rustix::io::Errno::INTR,
        }
    }
}

/// What became of a quick call.
pub enum Quick<T> {
    Answered(T),
    /// Not sent, or refused with a status: make the call over gRPC.
    StepAside,
    /// Sent, and no answer came: the master may have applied it.
    Lost(String),
}

/// Quick calls to the current master: a few idle connections, reused, and a rest after a master
/// closed them.
pub struct QuickLink {
    enabled: bool,
    timeout: Duration,
    tls: Option<lunakv_tls::ClientTls>,
    idle: Mutex<Vec<Conn>>,
    rest_until: Mutex<Option<(String, Instant)>>,
}

impl QuickLink {
    pub fn new(timeout: Duration, tls: Option<lunakv_tls::ClientTls>) -> QuickLink {
        QuickLink {
            enabled: lunakv_config::switched_on(QUICK_CALLS_ENV),
            timeout,
            tls,
            idle: Mutex::new(Vec::new()),
            rest_until: Mutex::new(None),
        }
    }

    /// The master's answer to `req` at `addr` (a `host:port`); see the module docs.
    pub fn call<Req: Message, Resp: Message + Default>(
        &self,
        addr: &str,
        method: Method,
        req: &Req,
    ) -> Quick<Resp> {
        // Frames carry no trace context: while this process exports traces, its master calls
        // go over gRPC, so that a traced put or get shows its master calls (docs/TRACING.md).
        if !self.enabled || lunakv_telemetry::enabled() || addr.starts_with("https://") {
            return Quick::StepAside;
        }
        let addr = addr.strip_prefix("http://").unwrap_or(addr);
        if let Some((a, until)) = &*self.rest_until.lock()
            && a == addr
            && Instant::now() < *until
        {
            return Quick::StepAside;
        }
        let (mut conn, fresh) = match self.take_idle(addr) {
            Some(c) => (c, false),
            None => match self.connect(addr) {
                Some(c) => (c, true),
                None => return Quick::StepAside,
            },
        };
        let frame = quick::encode_request(method, &conn.authorization, &req.encode_to_vec());
        if let Err(e) = conn
            .stream
            .write_all(&frame)
            .and_then(|()| conn.stream.flush())
        {
            tracing::debug!(addr, error = %e, "quick call not sent; over gRPC instead");
            return Quick::StepAside;
        }
        let answer = match read_frame(&mut conn.stream) {
            Ok(a) => a,
            Err(e) => {
                if fresh {
                    // An older master closes a connection it cannot classify, unread; a TLS
                    // master that refused this client's certificate says so in an alert,
                    // before it read the frame. gRPC then reports either.
                    *self.rest_until.lock() = Some((addr.to_owned(), Instant::now() + REST));
                    if e.kind() == std::io::ErrorKind::UnexpectedEof
                        || e.kind() == std::io::ErrorKind::ConnectionReset
                        || lunakv_tls::rustls_error(&e).is_some()
                    {
                        return Quick::StepAside;
                    }
                }
                return Quick::Lost(format!("no answer to a quick {method:?} from {addr}: {e}"));
            }
        };
        let out = match quick::decode_response(&answer) {
            Ok(quick::Response::Ok(body)) => match Resp::decode(body) {
                Ok(r) => Quick::Answered(r),
                Err(e) => {
                    return Quick::Lost(format!(
                        "a quick {method:?} answer from {addr} does not decode: {e}"
                    ));
                }
            },
            Ok(st @ quick::Response::Status { .. }) => {
                tracing::debug!(addr, answer = %st, "quick call answered a status; over gRPC instead");
                Quick::StepAside
            }
            Err(e) => {
                return Quick::Lost(format!(
                    "a quick {method:?} answer from {addr} is unreadable: {e}"
                ));
            }
        };
        conn.last_used = Instant::now();
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
        out
    }

    fn take_idle(&self, addr: &str) -> Option<Conn> {
        let mut idle = self.idle.lock();
        // A leader switch leaves connections to the old address: they are dropped here, as are
        // connections idle long enough that the master may be closing them.
        idle.retain(|c| c.addr == addr && c.last_used.elapsed() < MAX_IDLE_AGE);
        // One the master closed while it sat idle (a restarted master) never saw our frame:
        // skipping it keeps a mutation from being reported lost when it was never sent.
        while let Some(c) = idle.pop() {
            if !c.closed_by_peer() {
                return Some(c);
            }
        }
        None
    }

    fn connect(&self, addr: &str) -> Option<Conn> {
        let authorization = match crate::connect::presented_authorization() {
            Ok(a) => a.unwrap_or_default().into_bytes(),
            // A bad token file: gRPC reports it.
            Err(_) => return None,
        };
        let sa = addr.to_socket_addrs().ok()?.next()?;
        let tcp = TcpStream::connect_timeout(&sa, CONNECT_WAIT.min(self.timeout)).ok()?;
        tcp.set_nodelay(true).ok()?;
        tcp.set_read_timeout(Some(self.timeout)).ok()?;
        tcp.set_write_timeout(Some(self.timeout)).ok()?;
        let mut stream = match &self.tls {
            None => Stream::Plain(tcp),
            Some(t) => match t.handshake_blocking(addr, tcp) {
                Ok(s) => Stream::Tls(Box::new(s)),
                Err(e) => {
                    tracing::debug!(addr, error = %e, "quick-call TLS handshake failed; over gRPC instead");
                    return None;
                }
            },
        };
        stream.write_all(quick::MAGIC).ok()?;
        stream.flush().ok()?;
        Some(Conn {
            addr: addr.to_owned(),
            stream,
            authorization,
            last_used: Instant::now(),
        })
    }
}

/// Reads one response frame's body.
fn read_frame(stream: &mut Stream) -> std::io::Result<Vec<u8>> {
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix)?;
    let len = quick::answer_len(prefix)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    // Room for a usual answer up front (an empty Vec grows 32, 64, 128... bytes, one read
    // each: eight reads for a 2 KiB answer); beyond that it grows as bytes arrive, so the
    // prefix alone does not reserve up to 256 MiB.
    let mut body = Vec::with_capacity(len.min(ANSWER_AHEAD));
    let n = stream.take(len as u64).read_to_end(&mut body)?;
    if n < len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use lunakv_proto::master as pb;

    use super::*;

    fn req() -> pb::BatchExistKeyRequest {
        pb::BatchExistKeyRequest {
            client_id: "c".into(),
            keys: vec!["k".into()],
        }
    }

    /// An older master closes a connection whose first bytes are not HTTP/2: the call steps
    /// aside to gRPC, and quick calls to that master rest instead of reconnecting every call.
    #[test]
    fn a_master_that_closes_quick_connections_is_left_alone_for_a_while() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let accepts = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut magic = [0u8; 8];
            s.read_exact(&mut magic).unwrap();
            drop(s);
            l.set_nonblocking(true).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            l.accept().is_ok()
        });
        let q = QuickLink::new(Duration::from_secs(5), None);
        let r: Quick<pb::BatchObjectLocations> = q.call(&addr, Method::BatchExistKey, &req());
        assert!(matches!(r, Quick::StepAside), "over gRPC instead");
        let again: Quick<pb::BatchObjectLocations> =
            q.call(&format!("http://{addr}"), Method::BatchExistKey, &req());
        assert!(matches!(again, Quick::StepAside));
        assert!(
            !accepts.join().unwrap(),
            "no second connection while resting"
        );
    }

    /// A master that speaks quick frames answers on the caller's thread, over one connection
    /// kept for the next call; a status answer steps aside but keeps the connection.
    #[test]
    fn answers_come_back_and_the_connection_is_reused() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut magic = [0u8; 8];
            s.read_exact(&mut magic).unwrap();
            assert_eq!(&magic, quick::MAGIC);
            for i in 0..3 {
                let mut prefix = [0u8; 4];
                s.read_exact(&mut prefix).unwrap();
                let mut body = vec![0u8; quick::frame_len(prefix).unwrap()];
                s.read_exact(&mut body).unwrap();
                let r = quick::decode_request(&body).unwrap();
                let keys = pb::BatchExistKeyRequest::decode(r.body).unwrap().keys;
                let out = if i == 1 {
                    quick::encode_status(14, "not the leader")
                } else {
                    let results = keys
                        .into_iter()
                        .map(|_| pb::ObjectLocation {
                            size: 7,
                            ..Default::default()
                        })
                        .collect();
                    quick::encode_ok(
                        &pb::BatchObjectLocations {
                            results,
                            segments: Vec::new(),
                        }
                        .encode_to_vec(),
                    )
                };
                s.write_all(&out).unwrap();
            }
        });
        let q = QuickLink::new(Duration::from_secs(5), None);
        let Quick::Answered::<pb::BatchObjectLocations>(r) =
            q.call(&addr, Method::BatchExistKey, &req())
        else {
            panic!("an answer");
        };
        assert_eq!(r.results[0].size, 7);
        let st: Quick<pb::BatchObjectLocations> = q.call(&addr, Method::BatchExistKey, &req());
        assert!(matches!(st, Quick::StepAside), "a status goes over gRPC");
        let Quick::Answered::<pb::BatchObjectLocations>(r) =
            q.call(&addr, Method::BatchExistKey, &req())
        else {
            panic!("an answer");
        };
        assert_eq!(r.results.len(), 1);
        server.join().unwrap();
        // The master closed the kept connection while it sat idle (it restarted): nothing of
        // the next call was sent on it, so it is not lost; with no master listening any more,
        // the call steps aside to gRPC, which reports the refusal.
        let gone: Quick<pb::BatchObjectLocations> = q.call(&addr, Method::BatchExistKey, &req());
        assert!(
            matches!(gone, Quick::StepAside),
            "a connection closed while idle is not used"
        );
    }

    /// The master reads a frame and dies before answering: that frame is lost, not stepped
    /// aside, because the master may have applied it.
    #[test]
    fn a_frame_sent_without_an_answer_is_lost() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut magic = [0u8; 8];
            s.read_exact(&mut magic).unwrap();
            for answered in [true, false] {
                let mut prefix = [0u8; 4];
                s.read_exact(&mut prefix).unwrap();
                let mut body = vec![0u8; quick::frame_len(prefix).unwrap()];
                s.read_exact(&mut body).unwrap();
                if answered {
                    let empty = pb::BatchObjectLocations::default().encode_to_vec();
                    s.write_all(&quick::encode_ok(&empty)).unwrap();
                }
            }
            // The second frame is dropped unanswered.
        });
        let q = QuickLink::new(Duration::from_secs(5), None);
        let first: Quick<pb::BatchObjectLocations> = q.call(&addr, Method::BatchExistKey, &req());
        assert!(matches!(first, Quick::Answered(_)));
        let lost: Quick<pb::BatchObjectLocations> = q.call(&addr, Method::BatchExistKey, &req());
        server.join().unwrap();
        assert!(
            matches!(lost, Quick::Lost(_)),
            "a sent frame without an answer is lost"
        );
    }
}
