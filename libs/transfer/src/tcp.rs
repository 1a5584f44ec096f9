//! The tcp transport: pooled blocking connections per endpoint; a get is one request header out
//! and the object read straight into the caller's buffers, a put is one `writev` of header, key
//! and the caller's pieces.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::device::staging::{read_exact_staged, write_all_staged};
use crate::vio::{read_exact_scatter, write_all_gather};
use crate::wire::{self, Op, Request, Response, Status};
use crate::{Target, TransferError, TransferRequest, Transport, tune_socket};

/// How many requests of one kind go out on a connection before their answers are read. Bounded
/// so unread answers always fit the socket buffers (no deadlock with a blocking peer).
pub(crate) const PIPELINE_DEPTH: usize = 64;

/// One pooled connection to a segment server.
pub(crate) struct TcpConn {
    pub(crate) stream: TcpStream,
    /// Whether the peer reads trace contexts ([`wire::FEATURE_TRACE`]); `None` until a
    /// requester that exports traces probed it.
    peer_traces: Option<bool>,
}

/// Maps an I/O error on an established connection to the error callers branch on.
pub(crate) fn io_err(endpoint: &str, e: io::Error) -> TransferError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransferError::Timeout,
        _ => TransferError::Io(endpoint.to_string(), e),
    }
}

/// True if the connection can no longer be trusted (stream position unknown).
pub(crate) fn breaks_conn(e: &TransferError) -> bool {
    matches!(
        e,
        TransferError::Io(..)
            | TransferError::Timeout
            | TransferError::Protocol(_)
            | TransferError::Connect { .. }
    )
}

/// Reads a response header; maps error statuses (reading their message) to request-level errors.
/// `Ok(len)` is the payload length of an OK answer.
pub(crate) fn recv_status<R: Read>(
    r: &mut R,
    endpoint: &str,
    generation: u64,
    offset: u64,
    len: u64,
) -> Result<u64, TransferError> {
    recv_status_features(r, endpoint, generation, offset, len).map(|(n, _)| n)
}

/// As [`recv_status`], with the answering peer's features byte.
pub(crate) fn recv_status_features<R: Read>(
    r: &mut R,
    endpoint: &str,
    generation: u64,
    offset: u64,
    len: u64,
) -> Result<(u64, u8), TransferError> {
    let mut hdr = [0u8; wire::RESP_LEN];
    r.read_exact(&mut hdr).map_err(|e| io_err(endpoint, e))?;
    let resp = Response::decode(&hdr)
        .map_err(|why| TransferError::Protocol(format!("{endpoint}: {why}")))?;
    if resp.status == Status::Ok {
        return Ok((resp.len, wire::features(&hdr)));
    }
    if resp.len > wire::MAX_MSG_LEN {
        return Err(TransferError::Protocol(format!(
            "{endpoint}: error message of {} bytes",
            resp.len
        )));
    }
    let mut msg = vec![0u8; resp.len as usize];
    r.read_exact(&mut msg).map_err(|e| io_err(endpoint, e))?;
    let msg = String::from_utf8_lossy(&msg);
    Err(match resp.status {
        Status::Stale => TransferError::Stale { generation },
        Status::OutOfBounds => TransferError::OutOfBounds {
            offset,
            len,
            size: resp.value,
        },
        Status::Timeout => TransferError::Timeout,
        Status::Refused => TransferError::Refused {
            endpoint: endpoint.to_string(),
            message: msg.into_owned(),
        },
        _ => TransferError::InvalidArgument(format!("{endpoint} refused the request: {msg}")),
    })
}

/// Client-side checks shared by every transport, so bad requests never reach the wire.
pub(crate) fn check_request(
    t: &Target,
    key: Option<&str>,
    offset: u64,
    len: u64,
) -> Result<(), TransferError> {
    if len == 0 {
        return Err(TransferError::InvalidArgument(
            "zero-length transfer; objects have at least one byte".into(),
        ));
    }
    if let Some(k) = key
        && k.len() > wire::MAX_KEY_LEN
    {
        return Err(TransferError::InvalidArgument(format!(
            "key of {} bytes exceeds the {} byte limit",
            k.len(),
            wire::MAX_KEY_LEN
        )));
    }
    match offset.checked_add(len) {
        Some(end) if end <= t.size => Ok(()),
        _ => Err(TransferError::OutOfBounds {
            offset,
            len,
            size: t.size,
        }),
    }
}

pub(crate) fn total_len(pieces: impl IntoIterator<Item = usize>) -> u64 {
    pieces.into_iter().map(|l| l as u64).sum()
}

impl TcpConn {
    fn new(stream: TcpStream) -> TcpConn {
        TcpConn {
            stream,
            peer_traces: None,
        }
    }

    /// The trace context to send with the next requests, when this process exports traces and
    /// the peer reads them. The first call on a connection probes the peer with `probe` at
    /// length 0 (READ for a segment server, RAW_READ for a region server: both refuse it
    /// harmlessly); so call it before pipelining, with no answer outstanding.
    pub(crate) fn trace_context(
        &mut self,
        endpoint: &str,
        probe: Op,
    ) -> Result<Option<[u8; wire::TRACE_LEN]>, TransferError> {
        let Some(tc) = crate::trace::current() else {
            return Ok(None);
        };
        let traces = match self.peer_traces {
            Some(t) => t,
            None => {
                let t = self.probe(endpoint, probe)?;
                self.peer_traces = Some(t);
                t
            }
        };
        Ok(traces.then_some(tc))
    }

    fn probe(&mut self, endpoint: &str, op: Op) -> Result<bool, TransferError> {
        let hdr = Request::bare(op).encode();
        write_all_gather(&mut self.stream, &[&hdr], &[]).map_err(|e| io_err(endpoint, e))?;
        let mut resp = [0u8; wire::RESP_LEN];
        self.stream
            .read_exact(&mut resp)
            .map_err(|e| io_err(endpoint, e))?;
        let r = Response::decode(&resp)
            .map_err(|why| TransferError::Protocol(format!("{endpoint}: {why}")))?;
        if r.len > wire::MAX_MSG_LEN {
            return Err(TransferError::Protocol(format!(
                "{endpoint}: probe answer of {} bytes",
                r.len
            )));
        }
        let mut msg = [0u8; 256];
        let mut left = r.len as usize;
        while left > 0 {
            let n = left.min(msg.len());
            self.stream
                .read_exact(&mut msg[..n])
                .map_err(|e| io_err(endpoint, e))?;
            left -= n;
        }
        Ok(wire::features(&resp) & wire::FEATURE_TRACE != 0)
    }

    fn send_write(
        &mut self,
        generation: u64,
        key: &str,
        offset: u64,
        src: &[&[u8]],
        trace: Option<&[u8; wire::TRACE_LEN]>,
        cap: Option<&crate::Capability>,
    ) -> io::Result<()> {
        let len = total_len(src.iter().map(|s| s.len()));
        let (mut hdr, tc) = Request {
            op: Op::Write,
            generation,
            offset,
            len,
            key_len: key.len() as u32,
            aux: 0,
        }
        .encode_with(trace);
        let cb = crate::cap::attach_cap(&mut hdr, cap);
        write_from(&mut self.stream, &[&hdr, tc, cb, key.as_bytes()], src)
    }

    fn send_read(
        &mut self,
        generation: u64,
        offset: u64,
        len: u64,
        trace: Option<&[u8; wire::TRACE_LEN]>,
        cap: Option<&crate::Capability>,
    ) -> io::Result<()> {
        let (mut hdr, tc) = Request {
            op: Op::Read,
            generation,
            offset,
            len,
            key_len: 0,
            aux: 0,
        }
        .encode_with(trace);
        let cb = crate::cap::attach_cap(&mut hdr, cap);
        write_all_gather(&mut self.stream, &[&hdr, tc, cb], &[])
    }

    fn recv_read(
        &mut self,
        endpoint: &str,
        generation: u64,
        offset: u64,
        dst: &mut [&mut [u8]],
        len: u64,
    ) -> Result<(), TransferError> {
        let got = recv_status(&mut self.stream, endpoint, generation, offset, len)?;
        if got != len {
            return Err(TransferError::Protocol(format!(
                "{endpoint} answered {got} bytes for a {len} byte read"
            )));
        }
        read_into(&mut self.stream, dst).map_err(|e| io_err(endpoint, e))
    }
}

/// Reads a payload into caller pieces: straight from the socket, or through staging buffers
/// when a piece is device memory.
pub(crate) fn read_into<R: Read>(r: &mut R, dst: &mut [&mut [u8]]) -> io::Result<()> {
    if crate::device::any_device_mut(dst) {
        read_exact_staged(r, dst)
    } else {
        read_exact_scatter(r, dst)
    }
}

/// Writes a header and caller pieces: one gathered write, or through staging buffers when a
/// piece is device memory.
pub(crate) fn write_from<W: Write>(w: &mut W, head: &[&[u8]], body: &[&[u8]]) -> io::Result<()> {
    if crate::device::any_device(body) {
        write_all_staged(w, head, body)
    } else {
        write_all_gather(w, head, body)
    }
}

#[derive(Default)]
pub(crate) struct Pool {
    idle: Mutex<Vec<TcpConn>>,
}

/// An owner's answer to OFFLOAD (see [`TcpTransport::offload_reporting`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OffloadAnswer {
    /// Generations it could not store (gone from DRAM too).
    pub failed: Vec<u64>,
    /// Objects its disk tier dropped to make room for these, named in the answer.
    pub dropped: Vec<wire::DroppedObject>,
    /// The owner understood [`wire::FLAG_DROPS`]; when false, its drops come on its next Ping.
    pub reported: bool,
}

/// The tcp transport, with a connection pool per endpoint.
pub struct TcpTransport {
    pools: RwLock<HashMap<String, Arc<Pool>>>,
    conns_per_peer: usize,
    io_timeout: Duration,
    /// The master's side: mount secrets of owners that require capabilities, by endpoint.
    owner_keys: parking_lot::Mutex<HashMap<String, crate::MountSecret>>,
}

impl TcpTransport {
    pub fn new(conns_per_peer: usize, io_timeout: Duration) -> TcpTransport {
        TcpTransport {
            pools: RwLock::new(HashMap::new()),
            conns_per_peer: conns_per_peer.max(1),
            io_timeout,
            owner_keys: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn conns_per_peer(&self) -> usize {
        self.conns_per_peer
    }

    pub(crate) fn pool(&self, endpoint: &str) -> Arc<Pool> {
        if let Some(p) = self.pools.read().get(endpoint) {
            return p.clone();
        }
        self.pools
            .write()
            .entry(endpoint.to_string())
            .or_default()
            .clone()
    }

    pub(crate) fn connect(&self, endpoint: &str) -> Result<TcpConn, TransferError> {
        let cerr = |source: io::Error| TransferError::Connect {
            endpoint: endpoint.to_string(),
            source,
        };
        let mut last = io::Error::new(io::ErrorKind::NotFound, "endpoint resolved to no address");
        for addr in endpoint.to_socket_addrs().map_err(cerr)? {
            match TcpStream::connect_timeout(&addr, self.io_timeout) {
                Ok(stream) => {
                    tune_socket(&stream);
                    stream
                        .set_read_timeout(Some(self.io_timeout))
                        .map_err(cerr)?;
                    stream
                        .set_write_timeout(Some(self.io_timeout))
                        .map_err(cerr)?;
                    return Ok(TcpConn::new(stream));
                }
                Err(e) => last = e,
            }
        }
        Err(cerr(last))
    }

    /// A pooled connection (`true` if reused) or a new one.
    pub(crate) fn checkout(
        &self,
        pool: &Pool,
        endpoint: &str,
    ) -> Result<(TcpConn, bool), TransferError> {
        if let Some(c) = pool.idle.lock().pop() {
            return Ok((c, true));
        }
        Ok((self.connect(endpoint)?, false))
    }

    pub(crate) fn checkin(&self, pool: &Pool, c: TcpConn) {
        let mut idle = pool.idle.lock();
        // Keep enough for bursts from several threads; beyond that, close.
        if idle.len() < self.conns_per_peer * 4 {
            idle.push(c);
        }
    }

    /// Runs `f` on a pooled connection. A reused connection that fails with an I/O error was
    /// most likely closed by a restarted peer, so the request is retried once on a fresh one
    /// (both ops are idempotent: same bytes, same generation).
    pub(crate) fn with_conn(
        &self,
        endpoint: &str,
        mut f: impl FnMut(&mut TcpConn) -> Result<(), TransferError>,
    ) -> Result<(), TransferError> {
        let pool = self.pool(endpoint);
        let (mut c, reused) = self.checkout(&pool, endpoint)?;
        let mut r = f(&mut c);
        if reused && matches!(r, Err(TransferError::Io(..))) {
            c = self.connect(endpoint)?;
            r = f(&mut c);
        }
        match &r {
            Err(e) if breaks_conn(e) => {}
            _ => self.checkin(&pool, c),
        }
        r
    }

    /// The master's side: from now on FREE, OFFLOAD and PROMOTE to `endpoint` carry a tag under
    /// `secret` (the owner's mount secret); `None` forgets it (the segment was unmounted).
    pub fn set_owner_key(&self, endpoint: &str, secret: Option<crate::MountSecret>) {
        let mut keys = self.owner_keys.lock();
        match secret {
            Some(k) => keys.insert(endpoint.to_string(), k),
            None => keys.remove(endpoint),
        };
    }

    fn owner_key(&self, endpoint: &str) -> Option<crate::MountSecret> {
        self.owner_keys.lock().get(endpoint).copied()
    }

    /// FREE `(generation, offset)` pairs on the owner at `endpoint`, waiting up to `timeout`.
    pub fn free(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<(), TransferError> {
        if items.is_empty() {
            return Ok(());
        }
        let mut body = Vec::with_capacity(items.len() * 16);
        for &(g, o) in items {
            body.extend_from_slice(&g.to_le_bytes());
            body.extend_from_slice(&o.to_le_bytes());
        }
        let key = self.owner_key(endpoint);
        for chunk in body.chunks(wire::MAX_FREE_ITEMS as usize * 16) {
            let mut hdr = Request {
                op: Op::Free,
                generation: 0,
                offset: 0,
                len: 0,
                key_len: (chunk.len() / 16) as u32,
                aux: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
            }
            .encode();
            let tag = key.map(|k| crate::Capability::owner(&k, &hdr, chunk));
            let tb = crate::cap::attach_cap(&mut hdr, tag.as_ref());
            self.with_conn(endpoint, |c| {
                // The owner may legitimately wait `timeout` for pins before answering.
                let wait = self.io_timeout + timeout;
                c.stream
                    .set_read_timeout(Some(wait))
                    .map_err(|e| io_err(endpoint, e))?;
                write_all_gather(&mut c.stream, &[&hdr, tb, chunk], &[])
                    .map_err(|e| io_err(endpoint, e))?;
                let r = recv_status(&mut c.stream, endpoint, 0, 0, 0).map(|_| ());
                c.stream
                    .set_read_timeout(Some(self.io_timeout))
                    .map_err(|e| io_err(endpoint, e))?;
                r
            })?;
        }
        Ok(())
    }

    /// OFFLOAD pairs (see [`crate::TransferEngine::offload`]); returns generations not stored.
    pub fn offload(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<Vec<u64>, TransferError> {
        self.offload_with(endpoint, items, timeout, false)
            .map(|a| a.failed)
    }

    /// OFFLOAD pairs asking for the disk tier's drops ([`wire::FLAG_DROPS`]); see
    /// [`crate::TransferEngine::offload_reporting`].
    pub fn offload_reporting(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<OffloadAnswer, TransferError> {
        self.offload_with(endpoint, items, timeout, true)
    }

    fn offload_with(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
        report: bool,
    ) -> Result<OffloadAnswer, TransferError> {
        let mut failed = Vec::new();
        let mut dropped = Vec::new();
        let mut reported = report;
        let key = self.owner_key(endpoint);
        for chunk in items.chunks(wire::MAX_FREE_ITEMS as usize) {
            let mut body = Vec::with_capacity(chunk.len() * 16);
            for &(g, o) in chunk {
                body.extend_from_slice(&g.to_le_bytes());
                body.extend_from_slice(&o.to_le_bytes());
            }
            let mut hdr = Request {
                op: Op::Offload,
                generation: 0,
                offset: 0,
                len: 0,
                key_len: chunk.len() as u32,
                aux: u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX),
            }
            .encode();
            let tag = key.map(|k| crate::Capability::owner(&k, &hdr, &body));
            let tb = crate::cap::attach_cap(&mut hdr, tag.as_ref());
            if report {
                // After the tag: owners check the header's tag without its flags.
                hdr[wire::FLAGS_AT] |= wire::FLAG_DROPS;
            }
            self.with_conn(endpoint, |c| {
                // Disk writes of a whole eviction pass plus the pin wait: allow for both.
                let wait = self.io_timeout * 6 + timeout;
                c.stream
                    .set_read_timeout(Some(wait))
                    .map_err(|e| io_err(endpoint, e))?;
                write_all_gather(&mut c.stream, &[&hdr, tb, &body], &[])
                    .map_err(|e| io_err(endpoint, e))?;
                let (n, features) = recv_status_features(&mut c.stream, endpoint, 0, 0, 0)?;
                if report && features & wire::FEATURE_DROPS != 0 {
                    if n > wire::max_offload_answer_len(chunk.len()) {
                        return Err(TransferError::Protocol(format!(
                            "{endpoint}: OFFLOAD answered {n} bytes for {} pairs",
                            chunk.len()
                        )));
                    }
                    let mut buf = vec![0u8; n as usize];
                    c.stream
                        .read_exact(&mut buf)
                        .map_err(|e| io_err(endpoint, e))?;
                    let (f, d) = wire::decode_offload_answer(&buf, chunk.len())
                        .map_err(|why| TransferError::Protocol(format!("{endpoint}: {why}")))?;
                    failed.extend(f);
                    dropped.extend(d);
                    return c
                        .stream
                        .set_read_timeout(Some(self.io_timeout))
                        .map_err(|e| io_err(endpoint, e));
                }
                // An owner that predates FLAG_DROPS ignored it: the old answer, and its drops
                // reach the master on its next Ping.
                reported = false;
                if n % 8 != 0 || n > chunk.len() as u64 * 8 {
                    return Err(TransferError::Protocol(format!(
                        "{endpoint}: OFFLOAD answered {n} bytes of failed generations"
                    )));
                }
                let mut buf = vec![0u8; n as usize];
                c.stream
                    .read_exact(&mut buf)
                    .map_err(|e| io_err(endpoint, e))?;
                failed.extend(buf.chunks_exact(8).map(|b| {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    u64::from_le_bytes(a)
                }));
                c.stream
                    .set_read_timeout(Some(self.io_timeout))
                    .map_err(|e| io_err(endpoint, e))
            })?;
        }
        Ok(OffloadAnswer {
            failed,
            dropped,
            reported,
        })
    }

    /// PROMOTE (wire op 13): asks the owner at `endpoint` to copy object `generation` (of
    /// `len` bytes, named `key`) from its disk tier into `[offset, offset+len)` of its segment
    /// and commit the DRAM entry. `Ok` once committed; `Err(Stale)` when its disk tier does
    /// not hold the object. Used by the master's promotion on hit.
    pub fn promote(
        &self,
        endpoint: &str,
        generation: u64,
        key: &str,
        offset: u64,
        len: u64,
    ) -> Result<(), TransferError> {
        if len == 0 {
            return Err(TransferError::InvalidArgument("zero-length promote".into()));
        }
        let mut hdr = Request {
            op: Op::Promote,
            generation,
            offset,
            len,
            key_len: key.len() as u32,
            aux: 0,
        }
        .encode();
        let tag = self
            .owner_key(endpoint)
            .map(|k| crate::Capability::owner(&k, &hdr, key.as_bytes()));
        let tb = crate::cap::attach_cap(&mut hdr, tag.as_ref());
        self.with_conn(endpoint, |c| {
            // A disk read of up to a whole object: allow for it.
            let wait = self.io_timeout * 6;
            c.stream
                .set_read_timeout(Some(wait))
                .map_err(|e| io_err(endpoint, e))?;
            write_all_gather(&mut c.stream, &[&hdr, tb, key.as_bytes()], &[])
                .map_err(|e| io_err(endpoint, e))?;
            let r = recv_status(&mut c.stream, endpoint, generation, offset, len).map(|_| ());
            c.stream
                .set_read_timeout(Some(self.io_timeout))
                .map_err(|e| io_err(endpoint, e))?;
            r
        })
    }

    /// LOAD (see [`crate::TransferEngine::load`]).
    pub fn load(
        &self,
        endpoint: &str,
        generation: u64,
        dst: &mut [&mut [u8]],
        cap: Option<&crate::Capability>,
    ) -> Result<(), TransferError> {
        let len = total_len(dst.iter().map(|s| s.len()));
        if len == 0 {
            return Err(TransferError::InvalidArgument("zero-length load".into()));
        }
        let mut hdr = Request {
            op: Op::Load,
            generation,
            offset: 0,
            len,
            key_len: 0,
            aux: 0,
        }
        .encode();
        let cb = crate::cap::attach_cap(&mut hdr, cap);
        self.with_conn(endpoint, |c| {
            write_all_gather(&mut c.stream, &[&hdr, cb], &[]).map_err(|e| io_err(endpoint, e))?;
            c.recv_read(endpoint, generation, 0, dst, len)
        })
    }

    /// Requests to one endpoint, pipelined on one connection. Answers arrive in request order.
    /// A pooled connection the owner closed meanwhile (its idle timeout, a restart) fails
    /// before any answer; the batch then runs once more on a fresh connection, so callers never
    /// see it (every request is idempotent: same bytes, same generation).
    fn pipeline(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
    ) -> Vec<Result<(), TransferError>> {
        let endpoint = t.endpoint.as_str();
        let pool = self.pool(endpoint);
        let n = reqs.len();
        let unanswered = move || (0..n).map(|_| None).collect::<Vec<_>>();
        let (mut conn, mut reused) = match self.checkout(&pool, endpoint) {
            Ok(c) => c,
            Err(e) => return fail_all(unanswered(), &e),
        };
        loop {
            let mut out = unanswered();
            match self.pipeline_on(t, reqs, &mut conn, &mut out) {
                Ok(()) => {
                    self.checkin(&pool, conn);
                    return out.into_iter().map(|r| r.unwrap_or(Ok(()))).collect();
                }
                Err((e, answered)) => {
                    if reused && !answered && matches!(e, TransferError::Io(..)) {
                        reused = false;
                        match self.connect(endpoint) {
                            Ok(c) => {
                                conn = c;
                                continue;
                            }
                            Err(e) => return fail_all(out, &e),
                        }
                    }
                    return fail_all(out, &e);
                }
            }
        }
    }

    /// One pass of [`Self::pipeline`] on `conn`, filling `out`. `Err((error, answered))`: the
    /// connection broke; `answered` says whether any answer had arrived on it.
    fn pipeline_on(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
        conn: &mut TcpConn,
        out: &mut [Option<Result<(), TransferError>>],
    ) -> Result<(), (TransferError, bool)> {
        let endpoint = t.endpoint.as_str();
        let mut answered = false;
        let trace = match conn.trace_context(endpoint, Op::Read) {
            Ok(t) => t,
            Err(e) => return Err((e, answered)),
        };
        let trace = trace.as_ref();
        let mut i = 0;
        while i < reqs.len() {
            let is_read = matches!(reqs[i], TransferRequest::Read { .. });
            let mut j = i;
            while j < reqs.len()
                && j - i < PIPELINE_DEPTH
                && matches!(reqs[j], TransferRequest::Read { .. }) == is_read
            {
                j += 1;
            }
            // Send the run. Requests failing local checks are answered here and not sent.
            let mut sent = [false; PIPELINE_DEPTH];
            for k in i..j {
                let r = match &*reqs[k] {
                    TransferRequest::Write {
                        target,
                        generation,
                        key,
                        offset,
                        src,
                    } => {
                        let len = total_len(src.iter().map(|s| s.len()));
                        let cap = target.capability.as_ref();
                        check_request(t, Some(key), *offset, len).and_then(|()| {
                            conn.send_write(*generation, key, *offset, src, trace, cap)
                                .map_err(|e| io_err(endpoint, e))
                        })
                    }
                    TransferRequest::Read {
                        target,
                        generation,
                        offset,
                        dst,
                    } => {
                        let len = total_len(dst.iter().map(|s| s.len()));
                        let cap = target.capability.as_ref();
                        check_request(t, None, *offset, len).and_then(|()| {
                            conn.send_read(*generation, *offset, len, trace, cap)
                                .map_err(|e| io_err(endpoint, e))
                        })
                    }
                };
                match r {
                    Ok(()) => sent[k - i] = true,
                    Err(e) if breaks_conn(&e) => return Err((e, answered)),
                    Err(e) => out[k] = Some(Err(e)),
                }
            }
            for k in i..j {
                if !sent[k - i] {
                    continue;
                }
                let r = match &mut *reqs[k] {
                    TransferRequest::Write {
                        generation,
                        offset,
                        src,
                        ..
                    } => {
                        let len = total_len(src.iter().map(|s| s.len()));
                        recv_status(&mut conn.stream, endpoint, *generation, *offset, len)
                            .map(|_| ())
                    }
                    TransferRequest::Read {
                        generation,
                        offset,
                        dst,
                        ..
                    } => {
                        let len = total_len(dst.iter().map(|s| s.len()));
                        conn.recv_read(endpoint, *generation, *offset, dst, len)
                    }
                };
                if let Err(e) = &r
                    && breaks_conn(e)
                {
                    return Err((e.duplicate(), answered));
                }
                answered = true;
                out[k] = Some(r);
            }
            i = j;
        }
        Ok(())
    }
}

/// Fills every unanswered slot with a copy of `e` (the connection died under them).
fn fail_all(
    out: Vec<Option<Result<(), TransferError>>>,
    e: &TransferError,
) -> Vec<Result<(), TransferError>> {
    out.into_iter()
        .map(|r| match r {
            Some(r) => r,
            None => Err(e.duplicate()),
        })
        .collect()
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn write(
        &self,
        t: &Target,
        generation: u64,
        key: &str,
        offset: u64,
        src: &[&[u8]],
    ) -> Result<(), TransferError> {
        let len = total_len(src.iter().map(|s| s.len()));
        check_request(t, Some(key), offset, len)?;
        let ep = t.endpoint.as_str();
        self.with_conn(ep, |c| {
            let trace = c.trace_context(ep, Op::Read)?;
            c.send_write(
                generation,
                key,
                offset,
                src,
                trace.as_ref(),
                t.capability.as_ref(),
            )
            .map_err(|e| io_err(ep, e))?;
            recv_status(&mut c.stream, ep, generation, offset, len).map(|_| ())
        })
    }

    fn read(
        &self,
        t: &Target,
        generation: u64,
        offset: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        let len = total_len(dst.iter().map(|s| s.len()));
        check_request(t, None, offset, len)?;
        let ep = t.endpoint.as_str();
        self.with_conn(ep, |c| {
            let trace = c.trace_context(ep, Op::Read)?;
            c.send_read(
                generation,
                offset,
                len,
                trace.as_ref(),
                t.capability.as_ref(),
            )
            .map_err(|e| io_err(ep, e))?;
            c.recv_read(ep, generation, offset, dst, len)
        })
    }

    fn submit(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
    ) -> Vec<Result<(), TransferError>> {
        if reqs.len() == 1 {
            // No pipelining to gain; take the retrying single-op path.
            return vec![self.execute(t, reqs[0])];
        }
        self.pipeline(t, reqs)
    }
}
