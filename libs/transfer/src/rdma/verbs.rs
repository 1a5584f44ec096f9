//! The RDMA data path over `sideway` (libibverbs): device discovery, memory registration,
//! reliable-connection queue pairs set up over the tcp transfer connection, and one-sided
//! READ/WRITE with many work requests in flight. Compiled only with the `rdma` feature.
//!
//! Object semantics are the shm path's, with RDMA instead of memcpy: a get is PIN over the
//! control connection, RDMA READ straight into the caller's buffers, UNPIN (no answer); a put is
//! RDMA WRITE straight from the caller's buffers, then COMMIT. The owner's entry table, generation
//! check and pins work unchanged, and pins die with the control connection.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::TcpStream;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, GenericCompletionQueue, PollCompletionQueueError, WorkCompletionStatus,
};
use sideway::ibverbs::device::{
    DeviceInfo, DeviceList, GetDeviceListError, GetDeviceListErrorKind,
};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};

use super::{
    RDMA_DESC_MAX_LEN, RdmaDescriptor, gpudirect, msg_list_failed, msg_named_missing,
    msg_no_device, msg_no_kernel_support,
};
use crate::tcp::{TcpTransport, breaks_conn, check_request, io_err, recv_status, total_len};
use crate::vio::write_all_gather;
use crate::wire::{Op, Request};
use crate::{Target, TransferError, TransferRequest, Transport};

/// Send queue depth: work requests in flight per queue pair.
const SQ_DEPTH: u32 = 256;
/// Largest single work request (RDMA messages are limited to 2^31 bytes).
const MAX_WR_BYTES: usize = 1 << 30;
/// Requests per batch run (PINs or COMMITs pipelined on the control connection).
const RUN: usize = 64;

/// The opened device every queue pair and memory region of this process uses.
pub(crate) struct Device {
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    mtu: u8,
    rd_atom: u8,
}

fn env_num<T: std::str::FromStr>(env: &dyn Fn(&str) -> Option<String>, var: &str) -> Option<T> {
    env(var).and_then(|v| v.trim().parse().ok())
}

/// A verbs call that failed, said in one line naming the call and the device's answer (libibverbs
/// gives no more structure than an errno). It ends up in a [`TransferError`] or in the refusal an
/// `RDMA_CONNECT` requester reads.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub(crate) struct VerbsError(String);

/// Names of the RDMA devices libibverbs sees (`ibv_get_device_list`).
pub(crate) fn device_names() -> Result<Vec<String>, TransferError> {
    let list = DeviceList::new().map_err(|e| TransferError::RdmaUnavailable(list_err(&e)))?;
    Ok(list.iter().map(|d| d.name()).collect())
}

/// `ibv_get_device_list` failing with ENOSYS means the kernel has no RDMA support (no
/// `/sys/class/infiniband_verbs`): that is "no device", said as such.
fn list_err(e: &GetDeviceListError) -> String {
    let GetDeviceListErrorKind::Ibverbs(io) = &e.0 else {
        return msg_list_failed(&io_source(e));
    };
    if io.raw_os_error() == Some(libc::ENOSYS) {
        msg_no_kernel_support()
    } else {
        msg_list_failed(&io.to_string())
    }
}

fn io_source(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The process-wide device, opened once: `LUNAKV_RDMA_DEVICE` (default: the first device),
/// `LUNAKV_RDMA_PORT` (default 1), `LUNAKV_RDMA_GID_INDEX` (default: the first RoCE v2 GID,
/// preferring an IPv4-mapped one, on Ethernet; 0 on InfiniBand).
pub(crate) fn device() -> Result<Arc<Device>, TransferError> {
    static DEV: OnceLock<Result<Arc<Device>, VerbsError>> = OnceLock::new();
    DEV.get_or_init(|| open_device().map(Arc::new))
        .clone()
        .map_err(|e| TransferError::RdmaUnavailable(e.0))
}

fn open_device() -> Result<Device, VerbsError> {
    let list = DeviceList::new().map_err(|e| VerbsError(list_err(&e)))?;
    if list.is_empty() {
        return Err(VerbsError(msg_no_device()));
    }
    let env = &lunakv_config::process_env;
    let want = env("LUNAKV_RDMA_DEVICE").filter(|s| !s.trim().is_empty());
    let dev = match &want {
        Some(w) => list.iter().find(|d| d.name() == w.trim()).ok_or_else(|| {
            VerbsError(msg_named_missing(
                w,
                &list.iter().map(|d| d.name()).collect::<Vec<_>>(),
            ))
        })?,
        None => list
            .iter()
            .next()
            .ok_or_else(|| VerbsError(msg_no_device()))?,
    };
    let name = dev.name();
    let fail = |what: &str, e: &dyn std::error::Error| {
        VerbsError(format!(
            "protocol \"rdma\": RDMA device {name}: {what} failed: {}; check the device with `ibv_devinfo`, or use \"protocol\": \"tcp\"",
            io_source(e)
        ))
    };
    let ctx = dev.open().map_err(|e| fail("open", &e))?;
    let port: u8 = env_num(env, "LUNAKV_RDMA_PORT").unwrap_or(1);
    let pattr = ctx
        .query_port(port)
        .map_err(|e| fail(&format!("query port {port}"), &e))?;
    let gid_index: u8 = match env_num(env, "LUNAKV_RDMA_GID_INDEX") {
        Some(i) => i,
        None if pattr.link_layer() == LinkLayer::Ethernet => {
            pick_roce_gid(&ctx, port, pattr.gid_tbl_len())
        }
        None => 0,
    };
    let gid = ctx
        .query_gid(port, u32::from(gid_index))
        .map_err(|e| fail(&format!("query gid {gid_index}"), &e))?;
    let attr = ctx.query_device().map_err(|e| fail("query device", &e))?;
    let rd_atom = attr.max_qp_rd_atom().clamp(1, 16) as u8;
    let pd = ctx
        .alloc_pd()
        .map_err(|e| fail("allocate protection domain", &e))?;
    let d = Device {
        ctx,
        pd,
        name,
        port,
        gid_index,
        gid: gid.raw,
        lid: pattr.lid(),
        mtu: pattr.active_mtu() as u32 as u8,
        rd_atom,
    };
    tracing::info!(device = %d.name, port, gid_index, gid = %Gid { raw: d.gid }, "rdma device opened");
    Ok(d)
}

/// The first RoCE v2 GID, preferring an IPv4-mapped one (routable, what most RoCE fabrics use);
/// else the first non-zero GID; else 0.
fn pick_roce_gid(ctx: &DeviceContext, port: u8, len: i32) -> u8 {
    let mut v2 = None;
    let mut any = None;
    for i in 0..len.clamp(0, 256) as u32 {
        let Ok(e) = ctx.query_gid_ex(port, i) else {
            if let Ok(g) = ctx.query_gid(port, i)
                && !g.is_zero()
            {
                any.get_or_insert(i);
            }
            continue;
        };
        let g = e.gid();
        if g.is_zero() {
            continue;
        }
        any.get_or_insert(i);
        if e.gid_type() == GidType::RoceV2 {
            let v4 = g.raw[..10].iter().all(|&b| b == 0) && g.raw[10..12] == [0xff, 0xff];
            if v4 {
                return i as u8;
            }
            v2.get_or_insert(i);
        }
    }
    v2.or(any).unwrap_or(0) as u8
}

impl Device {
    /// This device's descriptor with no queue pair and no memory.
    pub(crate) fn descriptor(&self) -> RdmaDescriptor {
        RdmaDescriptor {
            device: self.name.clone(),
            port: self.port,
            gid_index: self.gid_index,
            gid: self.gid,
            lid: self.lid,
            mtu: self.mtu,
            qpn: 0,
            psn: 0,
            rkey: 0,
            addr: 0,
            len: 0,
        }
    }

    /// Registers `[addr, addr+len)`.
    ///
    /// # Safety
    /// The range must be valid memory that stays mapped while the returned region lives.
    unsafe fn register(
        &self,
        addr: usize,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<MemoryRegion>, VerbsError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.pd.reg_mr(addr, len, access) }.map_err(|e| {
            VerbsError(format!(
                "ibv_reg_mr of {len} bytes at {addr:#x}: {}",
                io_source(&e)
            ))
        })
    }
}

fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    (h.finish() as u32) & 0x00ff_ffff
}

/// A reliable-connection queue pair with its own completion queue.
pub(crate) struct Qp {
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    psn: u32,
}

/// One work request: `id` names the transfer request it belongs to.
struct Wr {
    id: usize,
    read: bool,
    laddr: u64,
    len: u32,
    lkey: u32,
    raddr: u64,
}

impl Qp {
    /// Creates the queue pair and moves it to INIT.
    fn new(dev: &Device) -> Result<Qp, VerbsError> {
        let cq = dev
            .ctx
            .create_cq_builder()
            .setup_cqe(SQ_DEPTH * 2)
            .build()
            .map_err(|e| VerbsError(format!("create completion queue: {}", io_source(&e))))?;
        let mut qp = dev
            .pd
            .create_qp_builder()
            .setup_send_cq(GenericCompletionQueue::from(cq.clone()))
            .setup_recv_cq(GenericCompletionQueue::from(cq.clone()))
            .setup_max_send_wr(SQ_DEPTH)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| VerbsError(format!("create queue pair: {}", io_source(&e))))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            );
        qp.modify(&attr)
            .map_err(|e| VerbsError(format!("queue pair to INIT: {}", io_source(&e))))?;
        Ok(Qp {
            qp,
            cq,
            psn: random_psn(),
        })
    }

    fn descriptor(&self, dev: &Device) -> RdmaDescriptor {
        RdmaDescriptor {
            qpn: self.qp.qp_number(),
            psn: self.psn,
            ..dev.descriptor()
        }
    }

    /// INIT -> RTR -> RTS against `remote`'s queue pair.
    fn connect(&mut self, dev: &Device, remote: &RdmaDescriptor) -> Result<(), VerbsError> {
        let mtu = Mtu::from(u32::from(dev.mtu.min(remote.mtu).clamp(1, 5)));
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(dev.rd_atom)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(dev.port)
            .setup_service_level(0);
        if remote.gid != [0u8; 16] {
            ah.setup_grh_dest_gid(&Gid { raw: remote.gid })
                .setup_grh_src_gid_index(dev.gid_index)
                .setup_grh_hop_limit(64);
        }
        attr.setup_address_vector(&ah);
        self.qp
            .modify(&attr)
            .map_err(|e| VerbsError(format!("queue pair to RTR: {}", io_source(&e))))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(dev.rd_atom);
        self.qp
            .modify(&attr)
            .map_err(|e| VerbsError(format!("queue pair to RTS: {}", io_source(&e))))
    }

    /// Posts `wrs` with at most [`SQ_DEPTH`] in flight and waits for all of them. A failed
    /// completion is recorded in `failed[wr.id]`. `Err` means the queue pair is unusable
    /// (post failure, error completion, timeout): drop it.
    fn run(
        &mut self,
        wrs: &[Wr],
        rkey: u32,
        timeout: Duration,
        failed: &mut HashMap<usize, String>,
    ) -> Result<(), VerbsError> {
        let deadline = Instant::now() + timeout;
        let mut next = 0usize;
        let mut inflight = 0usize;
        let mut broken: Option<String> = None;
        while next < wrs.len() || inflight > 0 {
            if broken.is_none() && next < wrs.len() && inflight < SQ_DEPTH as usize {
                let n = (SQ_DEPTH as usize - inflight).min(wrs.len() - next);
                let mut guard = self.qp.start_post_send();
                for (i, w) in wrs[next..next + n].iter().enumerate() {
                    let h = guard.construct_wr((next + i) as u64, WorkRequestFlags::Signaled);
                    let h = if w.read {
                        h.setup_read(rkey, w.raddr)
                    } else {
                        h.setup_write(rkey, w.raddr)
                    };
                    // SAFETY: `laddr..laddr+len` lies in a buffer registered as `lkey` that the
                    // caller keeps alive (and does not touch) until this function returns, which
                    // is after every posted work request completed or the QP was destroyed.
                    unsafe { h.setup_sge(w.lkey, w.laddr, w.len) };
                }
                match guard.post() {
                    Ok(()) => {
                        next += n;
                        inflight += n;
                    }
                    Err(e) => {
                        let why = format!("ibv_post_send: {}", io_source(&e));
                        for w in &wrs[next..] {
                            failed.entry(w.id).or_insert_with(|| why.clone());
                        }
                        next = wrs.len();
                        broken = Some(why);
                    }
                }
            }
            if inflight == 0 {
                continue;
            }
            match self.cq.start_poll() {
                Ok(poller) => {
                    for wc in poller {
                        inflight = inflight.saturating_sub(1);
                        if wc.status() != WorkCompletionStatus::Success as u32 {
                            let idx = wc.wr_id() as usize;
                            let why = format!(
                                "rdma {} completion failed: {:?} (vendor error {:#x})",
                                if wrs.get(idx).is_some_and(|w| w.read) {
                                    "READ"
                                } else {
                                    "WRITE"
                                },
                                WorkCompletionStatus::from(wc.status()),
                                wc.vendor_err()
                            );
                            if let Some(w) = wrs.get(idx) {
                                failed.entry(w.id).or_insert_with(|| why.clone());
                            }
                            broken.get_or_insert(why);
                        }
                    }
                }
                Err(PollCompletionQueueError::CompletionQueueEmpty) => {
                    if Instant::now() > deadline {
                        let why = format!(
                            "rdma: {inflight} work requests not completed within {timeout:?}"
                        );
                        for w in wrs {
                            failed.entry(w.id).or_insert_with(|| why.clone());
                        }
                        return Err(VerbsError(why));
                    }
                    std::hint::spin_loop();
                }
                Err(e) => {
                    let why = format!("ibv_poll_cq: {}", io_source(&e));
                    for w in wrs {
                        failed.entry(w.id).or_insert_with(|| why.clone());
                    }
                    return Err(VerbsError(why));
                }
            }
        }
        match broken {
            Some(why) => Err(VerbsError(why)),
            None => Ok(()),
        }
    }
}

/// The owner's side: the segment registered with the device, and queue pairs accepted over
/// `RDMA_CONNECT` (each lives as long as its tcp connection).
pub(crate) struct SegmentMr {
    dev: Arc<Device>,
    _mr: Arc<MemoryRegion>,
    desc: RdmaDescriptor,
}

impl SegmentMr {
    /// Registers the segment for remote READ and WRITE.
    ///
    /// # Safety
    /// `[base, base+len)` must stay mapped as long as the returned value lives.
    pub(crate) unsafe fn register(base: *mut u8, len: usize) -> Result<SegmentMr, TransferError> {
        let dev = device()?;
        // SAFETY: forwarded to the caller.
        let mr = unsafe {
            dev.register(
                base as usize,
                len,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            )
        }
        .map_err(|why| {
            TransferError::RdmaUnavailable(format!(
                "protocol \"rdma\": cannot register the {len} byte segment with {}: {why}; raise `ulimit -l` (locked memory) or use \"protocol\": \"tcp\"",
                dev.name
            ))
        })?;
        let desc = RdmaDescriptor {
            rkey: mr.rkey(),
            addr: base as u64,
            len: len as u64,
            ..dev.descriptor()
        };
        tracing::info!(%desc, "segment registered for rdma");
        Ok(SegmentMr { dev, _mr: mr, desc })
    }

    pub(crate) fn descriptor(&self) -> RdmaDescriptor {
        self.desc.clone()
    }

    /// Creates a queue pair connected to the requester's, and our answer.
    pub(crate) fn accept(&self, peer: &RdmaDescriptor) -> Result<(Qp, RdmaDescriptor), VerbsError> {
        let mut qp = Qp::new(&self.dev)?;
        qp.connect(&self.dev, peer)?;
        let answer = RdmaDescriptor {
            qpn: qp.qp.qp_number(),
            psn: qp.psn,
            ..self.desc.clone()
        };
        Ok((qp, answer))
    }
}

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
