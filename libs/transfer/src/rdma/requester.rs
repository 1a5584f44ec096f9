//! [`RdmaTransport`], a requester's RDMA transport: queue pairs pooled per owner, each beside
//! the tcp control connection that pins, unpins and commits, and batches of one-sided READs
//! and WRITEs straight between the caller's buffers and the owner's segment. Compiled only
//! with the `rdma` feature.

use std::collections::HashMap;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;

use super::verbs::{Device, MAX_WR_BYTES, Qp, RUN, VerbsError, Wr, device};
use super::{RDMA_DESC_MAX_LEN, RdmaDescriptor, gpudirect};
use crate::tcp::{TcpTransport, breaks_conn, check_request, io_err, recv_status, total_len};
use crate::vio::write_all_gather;
use crate::wire::{Op, Request};
use crate::{Target, TransferError, TransferRequest, Transport};

/// A requester's connection to one owner: the tcp control stream (PIN/UNPIN/COMMIT) and a
/// queue pair connected to the owner's segment.
struct RdmaConn {
    ctl: TcpStream,
    qp: Qp,
    remote: RdmaDescriptor,
    /// Registered local buffers, kept for the duration of one run.
    mrs: Vec<Arc<MemoryRegion>>,
}

/// Why a caller piece could not be registered with the NIC.
enum RegFail {
    /// Host memory: the request fails (e.g. `ulimit -l`).
    Host(String),
    /// Device memory: no GPUDirect; the engine serves the request over tcp, staged.
    Device(String),
}

impl RegFail {
    fn into_error(self, ep: &str) -> TransferError {
        match self {
            RegFail::Host(why) => TransferError::Io(ep.to_string(), io::Error::other(why)),
            RegFail::Device(why) => TransferError::GpuDirectRefused(why),
        }
    }
}

/// The RDMA transport of a requester: one device, queue pairs pooled per endpoint.
pub struct RdmaTransport {
    dev: Arc<Device>,
    tcp: TcpTransport,
    pools: RwLock<HashMap<String, Arc<Mutex<Vec<RdmaConn>>>>>,
    conns_per_peer: usize,
    io_timeout: Duration,
}

impl RdmaTransport {
    /// Opens the device; the error is one line naming the fix.
    pub fn open(
        conns_per_peer: usize,
        io_timeout: Duration,
    ) -> Result<RdmaTransport, TransferError> {
        Ok(RdmaTransport {
            dev: device()?,
            tcp: TcpTransport::new(conns_per_peer, io_timeout),
            pools: RwLock::new(HashMap::new()),
            conns_per_peer: conns_per_peer.max(1),
            io_timeout,
        })
    }

    /// This side's device descriptor (no queue pair, no memory).
    pub fn local_descriptor(&self) -> RdmaDescriptor {
        self.dev.descriptor()
    }

    fn pool(&self, ep: &str) -> Arc<Mutex<Vec<RdmaConn>>> {
        if let Some(p) = self.pools.read().get(ep) {
            return p.clone();
        }
        self.pools
            .write()
            .entry(ep.to_string())
            .or_default()
            .clone()
    }

    /// tcp connect + `RDMA_CONNECT`. A peer that refuses (or an older lunakv that closes the
    /// connection on the unknown op) is [`TransferError::RdmaUnavailable`]: the engine then
    /// uses tcp for it.
    fn connect(&self, t: &Target) -> Result<RdmaConn, TransferError> {
        let ep = t.endpoint.as_str();
        let mut ctl = self.tcp.connect(ep)?.stream;
        let local = |why: VerbsError| {
            TransferError::Io(
                ep.to_string(),
                io::Error::other(format!("rdma setup: {why}")),
            )
        };
        let mut qp = Qp::new(&self.dev).map_err(local)?;
        let mine = qp.descriptor(&self.dev).encode();
        let hdr = Request {
            op: Op::RdmaConnect,
            generation: 0,
            offset: 0,
            len: 0,
            key_len: mine.len() as u32,
            aux: 0,
        }
        .encode();
        let refused = |why: String| {
            TransferError::RdmaUnavailable(format!("{ep} does not offer rdma: {why}"))
        };
        write_all_gather(&mut ctl, &[&hdr, &mine], &[]).map_err(|e| io_err(ep, e))?;
        let n = match recv_status(&mut ctl, ep, 0, 0, 0) {
            Ok(n) => n,
            Err(TransferError::InvalidArgument(m)) => return Err(refused(m)),
            Err(TransferError::Io(_, e)) => {
                return Err(refused(format!(
                    "it closed the connection on RDMA_CONNECT ({e}); an older lunakv?"
                )));
            }
            Err(e) => return Err(e),
        };
        if n as usize > RDMA_DESC_MAX_LEN {
            return Err(TransferError::Protocol(format!(
                "{ep}: RDMA_CONNECT answer of {n} bytes"
            )));
        }
        let mut buf = vec![0u8; n as usize];
        io::Read::read_exact(&mut ctl, &mut buf).map_err(|e| io_err(ep, e))?;
        let remote = RdmaDescriptor::decode(&buf)
            .map_err(|e| TransferError::Protocol(format!("{ep}: {e}")))?;
        if !remote.has_region() {
            return Err(refused("its answer offers no memory region".into()));
        }
        qp.connect(&self.dev, &remote).map_err(local)?;
        tracing::debug!(endpoint = ep, %remote, "rdma queue pair connected");
        Ok(RdmaConn {
            ctl,
            qp,
            remote,
            mrs: Vec::new(),
        })
    }

    fn checkout(&self, t: &Target) -> Result<(RdmaConn, bool), TransferError> {
        if let Some(c) = self.pool(&t.endpoint).lock().pop() {
            return Ok((c, true));
        }
        Ok((self.connect(t)?, false))
    }

    fn checkin(&self, t: &Target, c: RdmaConn) {
        let pool = self.pool(&t.endpoint);
        let mut idle = pool.lock();
        if idle.len() < self.conns_per_peer * 4 {
            idle.push(c);
        }
    }

    /// Connects (or reuses) a queue pair to `t`: `Err(RdmaUnavailable)` if `t` offers none.
    pub(crate) fn probe(&self, t: &Target) -> Result<(), TransferError> {
        let (c, _) = self.checkout(t)?;
        self.checkin(t, c);
        Ok(())
    }

    /// Runs requests on one connection; a reused connection that fails on its first use with an
    /// I/O error (owner restarted) is replaced once.
    fn run(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
    ) -> Vec<Result<(), TransferError>> {
        let (mut c, reused) = match self.checkout(t) {
            Ok(c) => c,
            Err(e) => return reqs.iter().map(|_| Err(e.duplicate())).collect(),
        };
        let (mut out, mut broken) = c.run(t, reqs, self.io_timeout, &self.dev);
        if reused && broken && out.iter().all(|r| matches!(r, Err(TransferError::Io(..)))) {
            match self.connect(t) {
                Ok(fresh) => {
                    c = fresh;
                    (out, broken) = c.run(t, reqs, self.io_timeout, &self.dev);
                }
                Err(e) => return reqs.iter().map(|_| Err(e.duplicate())).collect(),
            }
        }
        if !broken {
            self.checkin(t, c);
        }
        out
    }
}

impl RdmaConn {
    /// Requests in runs of one kind, [`RUN`] at a time. Returns results and whether the
    /// connection must be dropped.
    fn run(
        &mut self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
        timeout: Duration,
        dev: &Device,
    ) -> (Vec<Result<(), TransferError>>, bool) {
        let mut out: Vec<Option<Result<(), TransferError>>> = reqs.iter().map(|_| None).collect();
        let mut i = 0;
        let mut broken = None;
        while i < reqs.len() && broken.is_none() {
            let is_read = matches!(reqs[i], TransferRequest::Read { .. });
            let mut j = i;
            while j < reqs.len()
                && j - i < RUN
                && matches!(reqs[j], TransferRequest::Read { .. }) == is_read
            {
                j += 1;
            }
            let r = if is_read {
                self.reads(t, &mut reqs[i..j], &mut out[i..j], timeout, dev)
            } else {
                self.writes(t, &reqs[i..j], &mut out[i..j], timeout, dev)
            };
            self.mrs.clear();
            if let Err(e) = r {
                broken = Some(e);
            }
            i = j;
        }
        let out = out
            .into_iter()
            .map(|r| match (r, &broken) {
                (Some(r), _) => r,
                (None, Some(e)) => Err(e.duplicate()),
                (None, None) => Err(TransferError::Protocol(
                    "an rdma request got no result".into(),
                )),
            })
            .collect();
        (out, broken.is_some())
    }

    fn ep(&self, t: &Target) -> String {
        t.endpoint.clone()
    }

    /// Registers `pieces` and appends their work requests for request `id` at remote `offset`.
    /// On failure nothing of this request is appended. A device (GPU) piece the NIC refuses is
    /// [`RegFail::Device`], which the engine serves over tcp instead.
    fn add_wrs(
        &mut self,
        dev: &Device,
        id: usize,
        read: bool,
        pieces: &[(usize, usize)],
        offset: u64,
        wrs: &mut Vec<Wr>,
    ) -> Result<(), RegFail> {
        let mark = wrs.len();
        let mut raddr = self.remote.addr + offset;
        let access = if read {
            AccessFlags::LocalWrite
        } else {
            AccessFlags::none()
        };
        for &(addr, len) in pieces {
            if len == 0 {
                continue;
            }
            let on_device = crate::device::kind_of(addr, len).is_device();
            if on_device && !gpudirect().allowed() {
                wrs.truncate(mark);
                return Err(RegFail::Device("refused earlier in this process".into()));
            }
            // SAFETY: the piece is a live caller buffer borrowed for this whole run; the MR is
            // dropped (deregistered) at the end of the run, before the borrow ends. With
            // GPUDirect (nvidia-peermem) the NIC pins device pages itself, so a device address
            // registers like host memory.
            let mr = match unsafe { dev.register(addr, len, access) } {
                Ok(mr) => mr,
                Err(why) => {
                    wrs.truncate(mark);
                    return Err(if on_device {
                        RegFail::Device(why.0)
                    } else {
                        RegFail::Host(why.0)
                    });
                }
            };
            if on_device {
                gpudirect().worked();
            }
            let lkey = mr.lkey();
            self.mrs.push(mr);
            let mut done = 0usize;
            while done < len {
                let n = (len - done).min(MAX_WR_BYTES);
                wrs.push(Wr {
                    id,
                    read,
                    laddr: (addr + done) as u64,
                    len: n as u32,
                    lkey,
                    raddr,
                });
                done += n;
                raddr += n as u64;
            }
        }
        Ok(())
    }

    /// Checks a range against the owner's region (as well as the target's size).
    fn check_region(&self, offset: u64, len: u64) -> Result<(), TransferError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.remote.len => Ok(()),
            _ => Err(TransferError::OutOfBounds {
                offset,
                len,
                size: self.remote.len,
            }),
        }
    }

    /// PIN all (pipelined), RDMA READ the pinned ones, UNPIN them. `Err`: connection broken.
    fn reads(
        &mut self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
        out: &mut [Option<Result<(), TransferError>>],
        timeout: Duration,
        dev: &Device,
    ) -> Result<(), TransferError> {
        let ep = self.ep(t);
        let mut hdrs: Vec<Option<Request>> = Vec::with_capacity(reqs.len());
        for (k, r) in reqs.iter().enumerate() {
            let TransferRequest::Read {
                generation,
                offset,
                dst,
                ..
            } = &**r
            else {
                hdrs.push(None);
                continue;
            };
            let len = total_len(dst.iter().map(|d| d.len()));
            match check_request(t, None, *offset, len)
                .and_then(|()| self.check_region(*offset, len))
            {
                Ok(()) => {
                    let h = Request {
                        op: Op::Pin,
                        generation: *generation,
                        offset: *offset,
                        len,
                        key_len: 0,
                        aux: 0,
                    };
                    write_all_gather(&mut self.ctl, &[&h.encode()], &[])
                        .map_err(|e| io_err(&ep, e))?;
                    hdrs.push(Some(h));
                }
                Err(e) => {
                    out[k] = Some(Err(e));
                    hdrs.push(None);
                }
            }
        }
        let mut pinned = Vec::new();
        for (k, h) in hdrs.iter().enumerate() {
            let Some(h) = h else { continue };
            match recv_status(&mut self.ctl, &ep, h.generation, h.offset, h.len) {
                Ok(_) => pinned.push(k),
                Err(e) if breaks_conn(&e) => return Err(e),
                Err(e) => out[k] = Some(Err(e)),
            }
        }
        let mut wrs = Vec::new();
        let mut failed: HashMap<usize, String> = HashMap::new();
        // Requests whose registration failed: they send no work requests.
        let mut refused: HashMap<usize, TransferError> = HashMap::new();
        for &k in &pinned {
            let TransferRequest::Read { offset, dst, .. } = &mut *reqs[k] else {
                continue;
            };
            let pieces: Vec<(usize, usize)> = dst
                .iter_mut()
                .map(|d| (d.as_mut_ptr() as usize, d.len()))
                .collect();
            if let Err(e) = self.add_wrs(dev, k, true, &pieces, *offset, &mut wrs) {
                refused.insert(k, e.into_error(&ep));
            }
        }
        let run = self.qp.run(&wrs, self.remote.rkey, timeout, &mut failed);
        // UNPIN every pin, one writev, no answers.
        let mut unpins = Vec::with_capacity(pinned.len() * crate::wire::REQ_LEN);
        for &k in &pinned {
            if let Some(mut h) = hdrs[k] {
                h.op = Op::Unpin;
                unpins.extend_from_slice(&h.encode());
            }
        }
        let unpinned = write_all_gather(&mut self.ctl, &[&unpins], &[]).map_err(|e| io_err(&ep, e));
        for &k in &pinned {
            out[k] = Some(match (refused.remove(&k), failed.remove(&k)) {
                (Some(e), _) => Err(e),
                (None, Some(why)) => Err(TransferError::Io(ep.clone(), io::Error::other(why))),
                (None, None) => Ok(()),
            });
        }
        if let Err(why) = run {
            return Err(TransferError::Io(ep, io::Error::other(why)));
        }
        unpinned
    }

    /// RDMA WRITE all, then COMMIT the written ones (pipelined). `Err`: connection broken.
    fn writes(
        &mut self,
        t: &Target,
        reqs: &[&mut TransferRequest<'_>],
        out: &mut [Option<Result<(), TransferError>>],
        timeout: Duration,
        dev: &Device,
    ) -> Result<(), TransferError> {
        let ep = self.ep(t);
        let mut wrs = Vec::new();
        let mut failed: HashMap<usize, String> = HashMap::new();
        let mut live = Vec::new();
        for (k, r) in reqs.iter().enumerate() {
            let TransferRequest::Write {
                key, offset, src, ..
            } = &**r
            else {
                continue;
            };
            let len = total_len(src.iter().map(|s| s.len()));
            if let Err(e) = check_request(t, Some(key), *offset, len)
                .and_then(|()| self.check_region(*offset, len))
            {
                out[k] = Some(Err(e));
                continue;
            }
            let pieces: Vec<(usize, usize)> =
                src.iter().map(|s| (s.as_ptr() as usize, s.len())).collect();
            match self.add_wrs(dev, k, false, &pieces, *offset, &mut wrs) {
                Ok(()) => live.push(k),
                Err(e) => out[k] = Some(Err(e.into_error(&ep))),
            }
        }
        let run = self.qp.run(&wrs, self.remote.rkey, timeout, &mut failed);
        let mut committed = Vec::new();
        for &k in &live {
            if let Some(why) = failed.remove(&k) {
                out[k] = Some(Err(TransferError::Io(ep.clone(), io::Error::other(why))));
                continue;
            }
            if run.is_err() {
                continue;
            }
            let TransferRequest::Write {
                generation,
                key,
                offset,
                src,
                ..
            } = &*reqs[k]
            else {
                continue;
            };
            let len = total_len(src.iter().map(|s| s.len()));
            let h = Request {
                op: Op::Commit,
                generation: *generation,
                offset: *offset,
                len,
                key_len: key.len() as u32,
                aux: 0,
            };
            write_all_gather(&mut self.ctl, &[&h.encode(), key.as_bytes()], &[])
                .map_err(|e| io_err(&ep, e))?;
            committed.push((k, h));
        }
        if let Err(why) = run {
            return Err(TransferError::Io(ep, io::Error::other(why)));
        }
        for (k, h) in committed {
            let r = recv_status(&mut self.ctl, &ep, h.generation, h.offset, h.len).map(|_| ());
            if let Err(e) = &r
                && breaks_conn(e)
            {
                return Err(e.duplicate());
            }
            out[k] = Some(r);
        }
        Ok(())
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn write(
        &self,
        t: &Target,
        generation: u64,
        key: &str,
        offset: u64,
        src: &[&[u8]],
    ) -> Result<(), TransferError> {
        let mut r = TransferRequest::Write {
            target: t,
            generation,
            key,
            offset,
            src: src.to_vec(),
        };
        self.run(t, &mut [&mut r]).pop().unwrap_or(Ok(()))
    }

    fn read(
        &self,
        t: &Target,
        generation: u64,
        offset: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        let mut r = TransferRequest::Read {
            target: t,
            generation,
            offset,
            dst: dst.iter_mut().map(|d| &mut **d).collect(),
        };
        self.run(t, &mut [&mut r]).pop().unwrap_or(Ok(()))
    }

    fn submit(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
    ) -> Vec<Result<(), TransferError>> {
        self.run(t, reqs)
    }
}
