//! The RDMA data path over `sideway` (libibverbs): device discovery, memory registration,
//! reliable-connection queue pairs set up over the tcp transfer connection, and one-sided
//! READ/WRITE with many work requests in flight. Compiled only with the `rdma` feature. The
//! requester's transport built on these is in `requester.rs`.
//!
//! Object semantics are the shm path's, with RDMA instead of memcpy: a get is PIN over the
//! control connection, RDMA READ straight into the caller's buffers, UNPIN (no answer); a put is
//! RDMA WRITE straight from the caller's buffers, then COMMIT. The owner's entry table, generation
//! check and pins work unchanged, and pins die with the control connection.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

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
    RdmaDescriptor, msg_list_failed, msg_named_missing, msg_no_device, msg_no_kernel_support,
};
use crate::TransferError;

/// Send queue depth: work requests in flight per queue pair.
const SQ_DEPTH: u32 = 256;
/// Largest single work request (RDMA messages are limited to 2^31 bytes).
pub(super) const MAX_WR_BYTES: usize = 1 << 30;
/// Requests per batch run (PINs or COMMITs pipelined on the control connection).
pub(super) const RUN: usize = 64;

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
pub(crate) struct VerbsError(pub(super) String);

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
    pub(super) unsafe fn register(
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
pub(super) struct Wr {
    pub(super) id: usize,
    pub(super) read: bool,
    pub(super) laddr: u64,
    pub(super) len: u32,
    pub(super) lkey: u32,
    pub(super) raddr: u64,
}

impl Qp {
    /// Creates the queue pair and moves it to INIT.
    pub(super) fn new(dev: &Device) -> Result<Qp, VerbsError> {
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

    pub(super) fn descriptor(&self, dev: &Device) -> RdmaDescriptor {
        RdmaDescriptor {
            qpn: self.qp.qp_number(),
            psn: self.psn,
            ..dev.descriptor()
        }
    }

    /// INIT -> RTR -> RTS against `remote`'s queue pair.
    pub(super) fn connect(
        &mut self,
        dev: &Device,
        remote: &RdmaDescriptor,
    ) -> Result<(), VerbsError> {
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
    pub(super) fn run(
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
