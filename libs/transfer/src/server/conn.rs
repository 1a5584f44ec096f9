//! One connection's requests: the request loop, the capability checks, and the data calls
//! (WRITE, READ, pins, ATTACH's memfd, RDMA_CONNECT). The owner's calls are in `owner.rs`.

use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::state::{MAX_PINS_PER_CONN, OVERWRITE_PIN_WAIT, REVOKED, Shared};
use crate::cap::{CAP_LEN, CAP_MAX_LEN, Capability, Grant, RIGHT_READ, RIGHT_WRITE};
use crate::guard::{Paced, Slot, peer_name};
use crate::optimes::TimedOp;
use crate::table::{PinId, PinResult, RevokedGeneration};
use crate::wire::{self, Op, Request, Response, Status};

/// A connected stream either listener hands out.
pub(super) trait Stream: Read + Write + AsFd + Sized {
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
pub(super) enum End {
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
fn write_body<W: Write>(w: &mut W, value: u64, body: &[u8]) -> io::Result<()> {
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
pub(super) struct Conn<'a, S: Stream> {
    pub(super) shared: &'a Shared,
    pub(super) rd: BufReader<Paced<S>>,
    pub(super) wr: S,
    pub(super) unix: bool,
    pub(super) pins: &'a mut Vec<(u64, u64, u64, PinId)>,
    /// The segment's size: the bound of every range and the value of an OUT_OF_BOUNDS answer.
    pub(super) size: u64,
    pub(super) key_buf: Vec<u8>,
    pub(super) free_buf: Vec<u8>,
    pub(super) load_buf: Vec<u8>,
    /// After RDMA_CONNECT: the queue pairs of this connection (they live as long as it does),
    /// and PIN/UNPIN/COMMIT become valid on tcp (the control ops of the RDMA data path).
    pub(super) rdma_qps: Vec<Box<dyn std::any::Any + Send>>,
    /// The capability of the request being served, if it carried one.
    pub(super) cap: Option<Capability>,
    pub(super) slot: &'a Slot,
    /// Whether the slot was told this connection completed a valid request (once: later
    /// requests skip admission's lock).
    pub(super) known: bool,
    /// The request being served passed its capability (or owner tag) check.
    pub(super) passed: bool,
    /// Status answers held back while the requester's next requests are already read
    /// ([`Conn::reply`]), written together when the read buffer runs dry or before any other
    /// answer ([`Conn::reply_body`], [`Conn::send_fd`]).
    pub(super) held: Vec<u8>,
}

pub(super) fn serve<S: Stream>(
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
        held: Vec::new(),
    };
    let r = serve_requests(&mut c);
    // Answers of requests already served reach the requester even when the next one ended
    // the connection.
    let _ = c.flush_held();
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
        if c.rd.buffer().is_empty() {
            // About to wait for the requester: it may be waiting for these.
            c.flush_held()?;
        }
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
                c.send_fd(wire::wants_identity(&hdr))?;
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
    pub(super) fn allowed(&mut self, req: &Request, need: u8) -> io::Result<bool> {
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
    pub(super) fn owner_allowed(&mut self, req: &Request, body: &[u8]) -> io::Result<bool> {
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

    pub(super) fn refuse(&mut self, req: &Request, why: &str) -> io::Result<()> {
        self.shared.refused.fetch_add(1, Ordering::Relaxed);
        let peer = self.slot.peer();
        if let Some(suppressed) = self.shared.refusal_log.check(peer) {
            tracing::warn!(peer = %peer_name(peer), op = req.op.name(), generation = req.generation, offset = req.offset, len = req.len, %why, suppressed, "refusing a transfer request");
        }
        self.reply(Status::Refused, 0, why)
    }

    /// A status answer. A pipelining requester (shm batches: 32 COMMITs or PINs per window)
    /// has its next requests in our read buffer already: their answers are held and leave in
    /// one write when the buffer runs dry, instead of one system call each.
    pub(super) fn reply(&mut self, status: Status, value: u64, msg: &str) -> io::Result<()> {
        reply(&mut self.held, status, value, msg)?;
        if self.rd.buffer().is_empty() {
            self.flush_held()?;
        }
        Ok(())
    }

    /// An `OK` answer carrying `body`, written after the answers held before it. Every answer
    /// leaves through [`Conn::reply`], this, or [`Conn::send_fd`], so answers keep the order of
    /// their requests whatever the requester pipelines.
    pub(super) fn reply_body(&mut self, value: u64, body: &[u8]) -> io::Result<()> {
        self.flush_held()?;
        write_body(&mut self.wr, value, body)
    }

    /// ATTACH's answer (with the segment's fd), after the answers held before it.
    fn send_fd(&mut self, identity: bool) -> io::Result<()> {
        self.flush_held()?;
        send_fd(&self.wr, self.shared, identity)
    }

    /// Writes the answers held by [`Conn::reply`].
    pub(super) fn flush_held(&mut self) -> io::Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        let r = self.wr.write_all(&self.held);
        self.held.clear();
        r
    }

    fn out_of_bounds(&mut self) -> io::Result<()> {
        self.reply(Status::OutOfBounds, self.size, "range outside the segment")
    }

    /// The mapped range a request names, or `None` once OUT_OF_BOUNDS is answered.
    pub(super) fn range(&mut self, req: &Request) -> io::Result<Option<(usize, usize)>> {
        let r = self.shared.mem.check(req.offset, req.len);
        if r.is_none() {
            self.out_of_bounds()?;
        }
        Ok(r)
    }

    /// Reads a request's key (at most [`wire::MAX_KEY_LEN`] bytes) into `key_buf`.
    pub(super) fn read_key(&mut self, req: &Request) -> Result<(), End> {
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
    pub(super) fn item_count(req: &Request, what: &str) -> Result<usize, End> {
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
    pub(super) fn write(&mut self, req: &Request, started: Instant) -> Result<(), End> {
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
    pub(super) fn read(&mut self, req: &Request, started: Instant) -> Result<(), End> {
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
        let r = self.reply_body(0, body);
        shared.table.unpin(pin);
        r?;
        let took = started.elapsed();
        shared.counters.op_times.observe(TimedOp::Read, took);
        Ok(())
    }

    pub(super) fn unpin(&mut self, req: &Request) {
        if let Some(i) = self
            .pins
            .iter()
            .position(|&(g, o, l, _)| (g, o, l) == (req.generation, req.offset, req.len))
        {
            let (_, _, _, pin) = self.pins.swap_remove(i);
            self.shared.table.unpin(pin);
        }
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
                self.reply_body(0, &desc)?;
            }
            Err(why) => self.reply(Status::BadRequest, 0, &why.to_string())?,
        }
        Ok(())
    }
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
