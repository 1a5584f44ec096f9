//! The shm transport for requesters on the owner's host: ATTACH once per connection receives the
//! segment's memfd over SCM_RIGHTS; a get is PIN (one round trip) + memcpy + UNPIN (no answer);
//! a put is memcpy + COMMIT (one round trip). Bytes never cross a socket.

use std::collections::HashMap;
use std::io::{self, BufReader, IoSliceMut, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::device::Copier;
use crate::mem::{Mapping, copy_in_any, copy_out_any, queue_in, queue_out};
use crate::tcp::{breaks_conn, check_request, io_err, recv_status, total_len};
use crate::vio::write_all_gather;
use crate::wire::{self, Op, Request, Response, Status};
use crate::{SegmentIdentity, Target, TransferError, TransferRequest, Transport};

/// One attached segment: our mapping of the owner's memfd plus pooled unix connections.
struct Attachment {
    map: Mapping,
    /// (st_dev, st_ino) of the memfd: a new connection whose ATTACH returns another memfd means
    /// the owner restarted behind the same socket path, and this mapping is obsolete.
    ident: (u64, u64),
    idle: Mutex<Vec<UnixStream>>,
    /// The owner reads trace contexts (its ATTACH answer carried [`wire::FEATURE_TRACE`]).
    traces: bool,
    /// Who answered the ATTACH (`None` from an owner that predates identities).
    identity: Option<SegmentIdentity>,
}

impl Attachment {
    /// The trace context for the next request, when we export traces and the owner reads them.
    fn trace(&self) -> Option<[u8; wire::TRACE_LEN]> {
        if self.traces {
            crate::trace::current()
        } else {
            None
        }
    }
}

/// The shm transport; attachments are cached per unix socket path.
pub struct ShmTransport {
    attachments: RwLock<HashMap<String, Arc<Attachment>>>,
    conns_per_peer: usize,
    io_timeout: Duration,
}

fn fd_ident(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    let st = rustix::fs::fstat(fd)?;
    Ok(stat_ident(&st))
}

/// (st_dev, st_ino): which file this is, whatever path or descriptor led to it.
// Both are u64 on x86-64 but not on every target libc serves.
#[allow(clippy::unnecessary_cast)]
pub(crate) fn stat_ident(st: &rustix::fs::Stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

/// What an ATTACH answered.
struct Attached {
    stream: UnixStream,
    fd: OwnedFd,
    size: u64,
    features: u8,
    identity: Option<SegmentIdentity>,
}

/// An owner that predates identities cannot prove it is the expected segment; only a master
/// that predates them (no expected id) lets it through.
fn matches_expected(got: Option<&SegmentIdentity>, expected: Option<&str>) -> bool {
    match expected {
        None | Some("") => true,
        Some(want) => got.is_some_and(|g| g.instance_id == want),
    }
}

fn describe(id: Option<&SegmentIdentity>) -> String {
    match id {
        Some(i) => format!(
            "segment {} of cluster {:?} (instance {})",
            i.name, i.cluster_id, i.instance_id
        ),
        None => "a store that does not say which segment it serves".into(),
    }
}

fn unavailable(path: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::ShmUnavailable(format!(
        "cannot attach segment over {path}: {e}; check the owner runs on this host and the path is reachable, or set LUNAKV_DISABLE_SHM=1"
    ))
}

impl ShmTransport {
    pub fn new(conns_per_peer: usize, io_timeout: Duration) -> ShmTransport {
        ShmTransport {
            attachments: RwLock::new(HashMap::new()),
            conns_per_peer: conns_per_peer.max(1),
            io_timeout,
        }
    }

    /// Connects and ATTACHes: returns the stream, the memfd with its size, the owner's
    /// features byte and its identity (if it sent one).
    fn connect(
        &self,
        path: &str,
        cap: Option<&crate::Capability>,
    ) -> Result<Attached, TransferError> {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
        let s = UnixStream::connect(path).map_err(|e| unavailable(path, e))?;
        s.set_read_timeout(Some(self.io_timeout))
            .map_err(|e| unavailable(path, e))?;
        s.set_write_timeout(Some(self.io_timeout))
            .map_err(|e| unavailable(path, e))?;
        let mut req = Request::bare(Op::Attach).encode_identity_request();
        let cb = crate::cap::attach_cap(&mut req, cap);
        write_all_gather(&mut &s, &[&req, cb], &[]).map_err(|e| unavailable(path, e))?;
        let mut hdr = [0u8; wire::RESP_LEN];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut cmsg = RecvAncillaryBuffer::new(&mut space);
        let got = recvmsg(
            &s,
            &mut [IoSliceMut::new(&mut hdr)],
            &mut cmsg,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(|e| unavailable(path, e))?
        .bytes;
        let mut fd = None;
        for msg in cmsg.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                for f in fds {
                    // Keep the first; any extra fds are closed as they drop.
                    fd.get_or_insert(f);
                }
            }
        }
        if got == 0 {
            return Err(unavailable(path, "connection closed during ATTACH"));
        }
        if got < hdr.len() {
            io::Read::read_exact(&mut &s, &mut hdr[got..]).map_err(|e| unavailable(path, e))?;
        }
        let resp = Response::decode(&hdr).map_err(|e| unavailable(path, e))?;
        if resp.status != Status::Ok {
            return Err(unavailable(
                path,
                format!("ATTACH answered {:?}", resp.status),
            ));
            // (A REFUSED attach, a capability the owner did not accept, also falls back to tcp,
            // where the same capability gets the owner's full answer.)
        }
        let fd = fd.ok_or_else(|| unavailable(path, "ATTACH carried no file descriptor"))?;
        let identity = if resp.len == 0 {
            None
        } else if resp.len > wire::MAX_IDENTITY_LEN {
            return Err(unavailable(
                path,
                format!("ATTACH identity of {} bytes", resp.len),
            ));
        } else {
            let mut body = vec![0u8; resp.len as usize];
            io::Read::read_exact(&mut &s, &mut body).map_err(|e| unavailable(path, e))?;
            Some(
                wire::decode_identity(&body)
                    .ok_or_else(|| unavailable(path, "malformed ATTACH identity"))?,
            )
        };
        Ok(Attached {
            stream: s,
            fd,
            size: resp.value,
            features: wire::features(&hdr),
            identity,
        })
    }

    /// The attachment behind `path`, mapping it first if needed. With `expected` (the
    /// instance id the master named), only a segment whose ATTACH answer carries that id is
    /// mapped: another stack's store that took over the path is refused before one byte moves.
    fn attachment(
        &self,
        path: &str,
        expected: Option<&str>,
        cap: Option<&crate::Capability>,
    ) -> Result<Arc<Attachment>, TransferError> {
        if let Some(a) = self.attachments.read().get(path)
            && matches_expected(a.identity.as_ref(), expected)
        {
            return Ok(a.clone());
        }
        let at = self.connect(path, cap)?;
        if !matches_expected(at.identity.as_ref(), expected) {
            return Err(TransferError::ShmUnavailable(format!(
                "{path} is served by {}, not by the segment instance {} the master named: another store took over this socket path; using tcp",
                describe(at.identity.as_ref()),
                expected.unwrap_or_default()
            )));
        }
        let ident = fd_ident(&at.fd).map_err(|e| unavailable(path, e))?;
        let map = Mapping::map(at.fd, at.size).map_err(|e| unavailable(path, e))?;
        let a = Arc::new(Attachment {
            map,
            ident,
            idle: Mutex::new(vec![at.stream]),
            traces: at.features & wire::FEATURE_TRACE != 0,
            identity: at.identity,
        });
        let mut w = self.attachments.write();
        // Another thread may have attached meanwhile; keep one mapping per segment.
        match w.get(path) {
            Some(cur) if matches_expected(cur.identity.as_ref(), expected) => Ok(cur.clone()),
            _ => {
                w.insert(path.to_string(), a.clone());
                Ok(a)
            }
        }
    }

    /// Attaches `t`'s segment if not yet attached.
    pub(crate) fn probe(&self, t: &Target) -> Result<(), TransferError> {
        let path = t.shm_socket.as_deref().ok_or_else(|| {
            TransferError::ShmUnavailable(format!("{} offers no shm socket", t.endpoint))
        })?;
        self.attachment(path, t.instance_id.as_deref(), t.capability.as_ref())
            .map(|_| ())
    }

    /// Drops a cached attachment (owner restarted or went away); the next call re-attaches.
    fn forget(&self, path: &str, a: &Arc<Attachment>) {
        let mut w = self.attachments.write();
        if w.get(path).is_some_and(|cur| Arc::ptr_eq(cur, a)) {
            w.remove(path);
        }
    }

    fn checkout(
        &self,
        path: &str,
        a: &Attachment,
        cap: Option<&crate::Capability>,
    ) -> Result<UnixStream, TransferError> {
        if let Some(s) = a.idle.lock().pop() {
            return Ok(s);
        }
        let at = self.connect(path, cap)?;
        let ident = fd_ident(&at.fd).map_err(|e| unavailable(path, e))?;
        if ident != a.ident || at.identity != a.identity {
            return Err(TransferError::ShmUnavailable(format!(
                "the segment behind {path} was replaced (owner restarted); re-attaching"
            )));
        }
        Ok(at.stream)
    }

    fn checkin(&self, a: &Attachment, s: UnixStream) {
        let mut idle = a.idle.lock();
        if idle.len() < self.conns_per_peer * 4 {
            idle.push(s);
        }
    }

    /// Runs `f` with the attachment and a connection. A broken connection or a replaced segment
    /// drops the cached attachment and retries once against a fresh one.
    fn run(
        &self,
        t: &Target,
        mut f: impl FnMut(&Attachment, &mut UnixStream) -> Result<(), TransferError>,
    ) -> Result<(), TransferError> {
        let path = t.shm_socket.as_deref().ok_or_else(|| {
            TransferError::ShmUnavailable(format!("{} offers no shm socket", t.endpoint))
        })?;
        let mut retried = false;
        loop {
            let cap = t.capability.as_ref();
            let a = self.attachment(path, t.instance_id.as_deref(), cap)?;
            let r = self.checkout(path, &a, cap).and_then(|mut s| {
                let r = f(&a, &mut s);
                if !matches!(&r, Err(e) if breaks_conn(e)) {
                    self.checkin(&a, s);
                }
                r
            });
            match r {
                Err(TransferError::ShmUnavailable(_) | TransferError::Io(..)) if !retried => {
                    self.forget(path, &a);
                    retried = true;
                }
                r => return r,
            }
        }
    }
}

/// Requests of a batch sent before their answers are read (PIN before the copies, COMMIT
/// after): one round trip per window instead of one per object, so a batch of vLLM blocks
/// wakes the store's connection thread (and ours) a few times instead of once per block. A
/// window's requests leave in one write and its answers are read through one buffer: one
/// system call each way instead of one per request (256 per 128-object batch before). A
/// request with its key is under 400 bytes and an answer is small, so a window never fills
/// either socket buffer while the other side waits.
const PIPELINE: usize = 32;

/// Sends a window's requests, gathered in `out`, in one write.
fn send_window(s: &mut UnixStream, out: &mut Vec<u8>, path: &str) -> Result<(), TransferError> {
    let r = s.write_all(out).map_err(|e| io_err(path, e));
    out.clear();
    r
}

impl ShmTransport {
    /// A batch in one direction on one connection, its PINs and COMMITs pipelined
    /// ([`PIPELINE`]). With device pieces (`device`) every request's DMA is queued on one
    /// stream and synchronized once, then the puts are committed (or the gets unpinned); host
    /// pieces are copied by the CPU as each request goes. Puts and gets are not mixed here
    /// (clients batch one direction); a mixed batch runs one by one.
    fn submit_pipelined(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
        device: bool,
    ) -> Vec<Result<(), TransferError>> {
        let n = reqs.len();
        let fail = |e: &TransferError| (0..n).map(|_| Err(e.duplicate())).collect();
        let path = match t.shm_socket.as_deref() {
            Some(p) => p,
            None => {
                return fail(&TransferError::ShmUnavailable(format!(
                    "{} offers no shm socket",
                    t.endpoint
                )));
            }
        };
        let cap = t.capability.as_ref();
        let a = match self.attachment(path, t.instance_id.as_deref(), cap) {
            Ok(a) => a,
            Err(e) => return fail(&e),
        };
        let mut s = match self.checkout(path, &a, cap) {
            Ok(s) => s,
            Err(e) => return fail(&e),
        };
        // Device pieces are queued on a copier and synchronized once; a host-only batch is
        // copied by the CPU as each request goes.
        let mut c = if device {
            match Copier::new() {
                Some(c) => Some(c),
                None => return fail(&TransferError::Device("no device layer".into())),
            }
        } else {
            None
        };
        let trace = a.trace();
        let mut out: Vec<Option<Result<(), TransferError>>> = (0..n).map(|_| None).collect();
        // Requests whose copies are queued: (index, request header to send after the sync).
        let mut queued: Vec<(usize, Request)> = Vec::with_capacity(n);
        let mut broken: Option<TransferError> = None;
        // Reads pinned in this window, waiting for their PIN answers: (index, request, offset
        // in the mapping). Answers are read a window at a time, not one round trip per object.
        let mut pinning: Vec<(usize, Request, usize)> = Vec::with_capacity(PIPELINE);
        // The window's requests, written together ([`send_window`]).
        let mut sending: Vec<u8> = Vec::new();
        let n_reqs = reqs.len();
        for i in 0..n_reqs {
            let res = match &mut *reqs[i] {
                TransferRequest::Write {
                    generation,
                    key,
                    offset,
                    src,
                    ..
                } => {
                    let len = total_len(src.iter().map(|p| p.len()));
                    check_request(t, Some(*key), *offset, len)
                        .and_then(|()| {
                            let (off, _) =
                                a.map
                                    .check(*offset, len)
                                    .ok_or(TransferError::OutOfBounds {
                                        offset: *offset,
                                        len,
                                        size: a.map.len(),
                                    })?;
                            match c.as_mut() {
                                Some(c) => queue_in(&a.map, off, src, c),
                                None => copy_in_any(&a.map, off, src),
                            }
                        })
                        .map(|()| {
                            queued.push((
                                i,
                                Request {
                                    op: Op::Commit,
                                    generation: *generation,
                                    offset: *offset,
                                    len,
                                    key_len: key.len() as u32,
                                    aux: 0,
                                },
                            ))
                        })
                }
                TransferRequest::Read {
                    target,
                    generation,
                    offset,
                    dst,
                } => {
                    let len = total_len(dst.iter().map(|p| p.len()));
                    let cap = target.capability;
                    let req = Request {
                        op: Op::Pin,
                        generation: *generation,
                        offset: *offset,
                        len,
                        key_len: 0,
                        aux: 0,
                    };
                    check_request(t, None, *offset, len)
                        .and_then(|()| {
                            a.map.check(*offset, len).ok_or(TransferError::OutOfBounds {
                                offset: *offset,
                                len,
                                size: a.map.len(),
                            })
                        })
                        .map(|(off, _)| {
                            let (mut hdr, tc) = req.encode_with(trace.as_ref());
                            let cb = crate::cap::attach_cap(&mut hdr, cap.as_ref());
                            for part in [&hdr[..], tc, cb] {
                                sending.extend_from_slice(part);
                            }
                            pinning.push((i, req, off));
                        })
                }
            };
            if let Err(e) = res {
                if breaks_conn(&e) {
                    broken = Some(e);
                    break;
                }
                out[i] = Some(Err(e));
            }
            if pinning.len() == PIPELINE || (i + 1 == n_reqs && !pinning.is_empty()) {
                if let Err(e) = send_window(&mut s, &mut sending, path) {
                    broken = Some(e);
                    break;
                }
                // The PIN answers, in the order sent; each pinned read's copy is queued. Only
                // this window's answers are in flight, so the buffer ends empty with it.
                let mut answers = BufReader::new(&s);
                for (j, req, off) in pinning.drain(..) {
                    let r = recv_status(&mut answers, path, req.generation, req.offset, req.len)
                        .and_then(|_| {
                            // Pinned from here: unpinned after the sync below.
                            queued.push((
                                j,
                                Request {
                                    op: Op::Unpin,
                                    ..req
                                },
                            ));
                            match (&mut *reqs[j], c.as_mut()) {
                                (TransferRequest::Read { dst, .. }, Some(c)) => {
                                    queue_out(&a.map, off, dst, c)
                                }
                                (TransferRequest::Read { dst, .. }, None) => {
                                    copy_out_any(&a.map, off, dst)
                                }
                                (TransferRequest::Write { .. }, _) => Ok(()),
                            }
                        });
                    if let Err(e) = r {
                        if breaks_conn(&e) {
                            broken = Some(e);
                            break;
                        }
                        out[j] = Some(Err(e));
                    }
                }
                if broken.is_some() {
                    break;
                }
            }
        }
        let synced = c
            .as_mut()
            .map_or(Ok(()), |c| c.sync())
            .map_err(TransferError::from);
        // COMMITs (with answers) and UNPINs (without), a window at a time: sent, then the
        // window's COMMIT answers read in order.
        for window in queued.chunks(PIPELINE) {
            let mut answers: Vec<(usize, Request)> = Vec::with_capacity(window.len());
            let mut unpins: Vec<usize> = Vec::new();
            for &(i, req) in window {
                if let Some(e) = &broken {
                    out[i].get_or_insert(Err(e.duplicate()));
                    continue;
                }
                match req.op {
                    Op::Commit => match &synced {
                        // A request already answered (its copy failed to queue) keeps that
                        // answer.
                        Err(e) => {
                            out[i].get_or_insert(Err(e.duplicate()));
                        }
                        Ok(()) => {
                            let (key, cap) = match &*reqs[i] {
                                TransferRequest::Write { key, target, .. } => {
                                    (*key, target.capability)
                                }
                                TransferRequest::Read { .. } => ("", None),
                            };
                            let (mut hdr, tc) = req.encode_with(trace.as_ref());
                            let cb = crate::cap::attach_cap(&mut hdr, cap.as_ref());
                            for part in [&hdr[..], tc, cb, key.as_bytes()] {
                                sending.extend_from_slice(part);
                            }
                            answers.push((i, req));
                        }
                    },
                    // UNPIN has no answer (see `read`); the copy's own result is the request's.
                    _ => {
                        sending.extend_from_slice(&req.encode());
                        unpins.push(i);
                    }
                }
            }
            if broken.is_none()
                && let Err(e) = send_window(&mut s, &mut sending, path)
            {
                broken = Some(e);
            }
            for i in unpins {
                let r = match &broken {
                    Some(e) => Err(e.duplicate()),
                    None => synced.as_ref().map(|_| ()).map_err(|e| e.duplicate()),
                };
                out[i].get_or_insert(r);
            }
            let mut rd = BufReader::new(&s);
            for (i, req) in answers {
                let r = match &broken {
                    Some(e) => Err(e.duplicate()),
                    None => {
                        recv_status(&mut rd, path, req.generation, req.offset, req.len).map(|_| ())
                    }
                };
                if let Err(e) = &r
                    && breaks_conn(e)
                {
                    broken = Some(e.duplicate());
                }
                out[i].get_or_insert(r);
            }
        }
        if broken.is_none() {
            self.checkin(&a, s);
        }
        out.into_iter()
            .map(|r| match (r, &broken) {
                (Some(r), _) => r,
                (None, Some(e)) => Err(e.duplicate()),
                (None, None) => Err(TransferError::Protocol(
                    "an shm batch request got no result".into(),
                )),
            })
            .collect()
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
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
        let path = t.shm_socket.as_deref().unwrap_or_default();
        self.run(t, |a, s| {
            let Some((off, _)) = a.map.check(offset, len) else {
                return Err(TransferError::OutOfBounds {
                    offset,
                    len,
                    size: a.map.len(),
                });
            };
            copy_in_any(&a.map, off, src)?;
            let trace = a.trace();
            let (mut hdr, tc) = Request {
                op: Op::Commit,
                generation,
                offset,
                len,
                key_len: key.len() as u32,
                aux: 0,
            }
            .encode_with(trace.as_ref());
            let cb = crate::cap::attach_cap(&mut hdr, t.capability.as_ref());
            write_all_gather(s, &[&hdr, tc, cb, key.as_bytes()], &[])
                .map_err(|e| io_err(path, e))?;
            recv_status(s, path, generation, offset, len).map(|_| ())
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
        let path = t.shm_socket.as_deref().unwrap_or_default();
        self.run(t, |a, s| {
            let Some((off, _)) = a.map.check(offset, len) else {
                return Err(TransferError::OutOfBounds {
                    offset,
                    len,
                    size: a.map.len(),
                });
            };
            let mut req = Request {
                op: Op::Pin,
                generation,
                offset,
                len,
                key_len: 0,
                aux: 0,
            };
            let trace = a.trace();
            let (mut hdr, tc) = req.encode_with(trace.as_ref());
            let cb = crate::cap::attach_cap(&mut hdr, t.capability.as_ref());
            write_all_gather(s, &[&hdr, tc, cb], &[]).map_err(|e| io_err(path, e))?;
            recv_status(s, path, generation, offset, len)?;
            let copied = copy_out_any(&a.map, off, dst);
            // UNPIN has no answer: the next request on this connection is ordered after it, and
            // if the connection dies the owner drops the pin anyway.
            req.op = Op::Unpin;
            write_all_gather(s, &[&req.encode()], &[]).map_err(|e| io_err(path, e))?;
            copied
        })
    }

    fn submit(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
    ) -> Vec<Result<(), TransferError>> {
        let reads = reqs
            .iter()
            .filter(|r| matches!(r, TransferRequest::Read { .. }))
            .count();
        if reqs.len() > 1 && (reads == 0 || reads == reqs.len()) {
            let device = reqs.iter().any(|r| r.has_device());
            let mut out = self.submit_pipelined(t, reqs, device);
            // A broken connection or a replaced segment (the owner restarted): the requests it
            // failed run again one by one, each retried once on a fresh attachment as alone.
            for (r, o) in reqs.iter_mut().zip(out.iter_mut()) {
                if matches!(o, Err(e) if breaks_conn(e) || matches!(e, TransferError::ShmUnavailable(_)))
                {
                    *o = self.execute(t, r);
                }
            }
            return out;
        }
        reqs.iter_mut().map(|r| self.execute(t, r)).collect()
    }
}
