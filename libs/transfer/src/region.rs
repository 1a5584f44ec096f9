//! Raw registered memory, the P/D half of the data path.
//!
//! A segment (see [`crate::SegmentServer`]) holds *objects*, each checked by generation. P/D
//! needs something simpler and closer to upstream Mooncake's `TransferEngine`: a decode engine
//! registers the buffers its KV cache lives in, tells the prefill engine their addresses, and the
//! prefill engine WRITES blocks straight into them. So this module has:
//!
//! - [`MemoryRegistry`]: the buffers a process registered, each `(id, addr, len)`. Regions are
//!   addressed by their absolute address, like upstream's `register_memory(ptr, len)` /
//!   `transfer_sync_write(peer, local_ptr, peer_ptr, len)`. [`MemoryRegistry::alloc`] hands out
//!   owned (memfd-backed) regions; [`MemoryRegistry::register_raw`] registers caller memory, the
//!   shape a Python `register_memory` binding needs.
//! - [`RegionServer`]: serves one registry over tcp with the `RAW_WRITE`/`RAW_READ` ops of
//!   [`crate::wire`]. Every range must lie inside one registered region (strict bounds check, no
//!   generations); anything else is answered `OUT_OF_BOUNDS` without touching memory.
//! - The client calls live on [`crate::TransferEngine`]: `write_raw`, `read_raw`, `batch_raw`
//!   (in `raw.rs`), over the same pooled tcp connections as segment transfers.
//!
//! Ordering: the registry only guarantees memory safety of the copy (a region is kept alive and
//! cannot be deregistered while a copy into it runs). Who may read a region while a peer writes
//! it is the caller's protocol: P/D readers wait for the writer's FINISH message.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::mem::Mapping;
use crate::wire::{self, Op, Request, Response, Status};
use crate::{TransferError, tune_socket};

/// A peer that stops draining its socket this long is cut off.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest payload a RAW_WRITE to an unknown range may carry before the connection is closed as
/// garbage instead of drained (a registered region is never this large on a real host).
const MAX_DISCARD: u64 = 1 << 40;

/// A registered region, as peers address it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionDesc {
    /// Process-unique id, for logs and for deregistering.
    pub id: u64,
    /// Absolute address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RegionDesc {
    /// Absolute address of `offset` in this region; `None` if `[offset, offset+len)` is outside.
    pub fn addr_of(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(self.addr + offset)
    }
}

/// One region. `live` is read-locked for the duration of every copy and write-locked by
/// deregistration, so a deregistered region is never touched again.
pub(crate) struct Region {
    desc: RegionDesc,
    live: RwLock<bool>,
    /// Caller memory on a GPU (classified once at registration): peers' bytes go through
    /// staging buffers and DMA, never a CPU copy.
    device: bool,
    /// Owned memory (from [`MemoryRegistry::alloc`]); `None` for caller memory.
    _owned: Option<Mapping>,
}

impl Region {
    /// Runs `f` with a pointer to absolute address `addr` if the region is still registered.
    /// The caller has checked `[addr, addr+len)` lies inside the region.
    fn with_ptr<R>(&self, addr: u64, f: impl FnOnce(*mut u8) -> R) -> Option<R> {
        let live = self.live.read();
        if !*live {
            return None;
        }
        Some(f(addr as usize as *mut u8))
    }
}

/// The memory regions this process registered for raw transfers.
#[derive(Default)]
pub struct MemoryRegistry {
    /// By start address; regions never overlap.
    regions: RwLock<BTreeMap<u64, Arc<Region>>>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for MemoryRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegistry")
            .field("regions", &self.regions())
            .finish()
    }
}

impl MemoryRegistry {
    pub fn new() -> Arc<MemoryRegistry> {
        Arc::new(MemoryRegistry::default())
    }

    fn insert(
        &self,
        addr: u64,
        len: u64,
        owned: Option<Mapping>,
    ) -> Result<Arc<Region>, TransferError> {
        if len == 0 {
            return Err(TransferError::InvalidArgument(
                "cannot register a zero-length region".into(),
            ));
        }
        let end = addr.checked_add(len).ok_or_else(|| {
            TransferError::InvalidArgument(format!(
                "region {addr:#x}+{len} wraps the address space"
            ))
        })?;
        let mut regions = self.regions.write();
        let before = regions.range(..end).next_back();
        if let Some((_, r)) = before
            && r.desc.addr + r.desc.len > addr
        {
            return Err(TransferError::InvalidArgument(format!(
                "region [{addr:#x}, {end:#x}) overlaps registered region {} at [{:#x}, {:#x})",
                r.desc.id,
                r.desc.addr,
                r.desc.addr + r.desc.len
            )));
        }
        let desc = RegionDesc {
            id: self.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            addr,
            len,
        };
        // Caller memory is classified once here; the range stays known to the device layer
        // (so local sources inside it are looked up, not asked of the driver) until deregistered.
        let device = owned.is_none()
            && crate::device::register_range(addr as usize, len as usize).is_device();
        let region = Arc::new(Region {
            desc,
            live: RwLock::new(true),
            device,
            _owned: owned,
        });
        regions.insert(addr, region.clone());
        Ok(region)
    }

    /// Registers caller memory `[addr, addr+len)` for peers to write and read.
    ///
    /// # Safety
    /// The range must be valid, writable memory that nothing else reads or writes through a Rust
    /// reference while peers may access it, and it must stay valid until
    /// [`MemoryRegistry::deregister`] has returned for it (deregistration waits for copies in
    /// flight). This is the contract of upstream's `register_memory(ptr, len)`.
    pub unsafe fn register_raw(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<RegionDesc, TransferError> {
        Ok(self.insert(addr as u64, len as u64, None)?.desc)
    }

    /// Allocates `len` zeroed bytes (sparse memfd) and registers them. The region is deregistered
    /// when the returned handle drops.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<OwnedRegion, TransferError> {
        let map = Mapping::create(len as u64).map_err(|e| {
            TransferError::InvalidArgument(format!("cannot allocate a {len} byte region: {e}"))
        })?;
        let addr = map.ptr_at(0) as usize as u64;
        let region = self.insert(addr, len as u64, Some(map))?;
        Ok(OwnedRegion {
            registry: self.clone(),
            region,
        })
    }

    /// Deregisters the region starting at `addr`; waits for copies into or out of it that are in
    /// flight. Returns false if no region starts there.
    pub fn deregister(&self, addr: u64) -> bool {
        let Some(region) = self.regions.write().remove(&addr) else {
            return false;
        };
        *region.live.write() = false;
        if region._owned.is_none() {
            crate::device::unregister_range(addr as usize);
        }
        true
    }

    /// Every registered region, by address.
    pub fn regions(&self) -> Vec<RegionDesc> {
        self.regions.read().values().map(|r| r.desc).collect()
    }

    /// The region holding all of `[addr, addr+len)`, if one does.
    pub(crate) fn find(&self, addr: u64, len: u64) -> Option<Arc<Region>> {
        let end = addr.checked_add(len)?;
        let regions = self.regions.read();
        let (_, r) = regions.range(..=addr).next_back()?;
        (end <= r.desc.addr + r.desc.len).then(|| r.clone())
    }
}

/// A region allocated by [`MemoryRegistry::alloc`]; deregistered (and freed once no copy uses it)
/// on drop.
pub struct OwnedRegion {
    registry: Arc<MemoryRegistry>,
    region: Arc<Region>,
}

impl std::fmt::Debug for OwnedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedRegion")
            .field(&self.region.desc)
            .finish()
    }
}

impl OwnedRegion {
    pub fn desc(&self) -> RegionDesc {
        self.region.desc
    }

    pub fn addr(&self) -> u64 {
        self.region.desc.addr
    }

    pub fn len(&self) -> usize {
        self.region.desc.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.region.desc.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<u64, TransferError> {
        self.region
            .desc
            .addr_of(offset as u64, len as u64)
            .ok_or(TransferError::OutOfBounds {
                offset: offset as u64,
                len: len as u64,
                size: self.region.desc.len,
            })
    }

    /// Copies `dst.len()` bytes at `offset` out of the region. Callers order this after the
    /// peer's writes (for P/D: after the prefill engine answered FINISH).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransferError> {
        let addr = self.check(offset, dst.len())?;
        self.region
            .with_ptr(addr, |p| {
                // SAFETY: [addr, addr+len) is inside the owned mapping, which lives as long as
                // `self.region`; `dst` is caller memory and cannot overlap the private mapping.
                unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), dst.len()) }
            })
            .ok_or_else(|| TransferError::InvalidArgument("region was deregistered".into()))
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), TransferError> {
        let addr = self.check(offset, src.len())?;
        self.region
            .with_ptr(addr, |p| {
                // SAFETY: as in `read_at`.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) }
            })
            .ok_or_else(|| TransferError::InvalidArgument("region was deregistered".into()))
    }

    /// The whole region, copied out.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        // Cannot fail: the range is the region itself and the handle keeps it registered.
        let _ = self.read_at(0, &mut v);
        v
    }
}

impl Drop for OwnedRegion {
    fn drop(&mut self) {
        self.registry.deregister(self.region.desc.addr);
    }
}

/// How a [`RegionServer`] is started.
#[derive(Debug, Clone)]
pub struct RegionServerConfig {
    /// Exactly the address the listener binds (port 0 picks a free port).
    pub bind: SocketAddr,
    /// Host in the advertised endpoint; defaults to the bound ip.
    pub advertise_host: Option<String>,
}

/// Counters of a region server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionStats {
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub writes: u64,
    pub reads: u64,
    /// Requests refused because no region held their range.
    pub out_of_bounds: u64,
}

#[derive(Default)]
struct Counters {
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
    out_of_bounds: AtomicU64,
}

struct Shared {
    registry: Arc<MemoryRegistry>,
    counters: Counters,
    stopping: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
}

/// Serves a [`MemoryRegistry`] to peers over tcp (`RAW_WRITE` / `RAW_READ`). One std thread per
/// connection, like [`crate::SegmentServer`]. Stops on [`RegionServer::shutdown`] or drop.
pub struct RegionServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    endpoint: String,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl RegionServer {
    /// Binds exactly `cfg.bind` and starts serving `registry`.
    pub fn start(
        cfg: RegionServerConfig,
        registry: Arc<MemoryRegistry>,
    ) -> Result<RegionServer, TransferError> {
        let listener = TcpListener::bind(cfg.bind).map_err(|e| TransferError::Bind {
            addr: cfg.bind.to_string(),
            source: e,
        })?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| TransferError::Io(cfg.bind.to_string(), e))?;
        let host = cfg
            .advertise_host
            .clone()
            .unwrap_or_else(|| local_addr.ip().to_string());
        let endpoint = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{}", local_addr.port())
        } else {
            format!("{host}:{}", local_addr.port())
        };
        let shared = Arc::new(Shared {
            registry,
            counters: Counters::default(),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("lunakv-region-accept".into())
            .spawn(move || accept(s, listener))
            .map_err(|e| TransferError::Io("spawning the region acceptor".into(), e))?;
        tracing::info!(addr = %local_addr, "region server started");
        Ok(RegionServer {
            shared,
            local_addr,
            endpoint,
            acceptor: Mutex::new(Some(acceptor)),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// `host:port` peers pass to `TransferEngine::write_raw`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn registry(&self) -> &Arc<MemoryRegistry> {
        &self.shared.registry
    }

    pub fn stats(&self) -> RegionStats {
        let c = &self.shared.counters;
        RegionStats {
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            out_of_bounds: c.out_of_bounds.load(Ordering::Relaxed),
        }
    }

    /// Stops the listener and closes every connection. Idempotent.
    pub fn shutdown(&self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut wake = self.local_addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(h) = self.acceptor.lock().take() {
            let _ = h.join();
        }
        for (_, c) in self.shared.conns.lock().drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for RegionServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept(shared: Arc<Shared>, listener: TcpListener) {
    for conn in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "region accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        tune_socket(&stream);
        let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        shared.conns.lock().insert(id, clone);
        let s = shared.clone();
        let r = std::thread::Builder::new()
            .name("lunakv-region-conn".into())
            .spawn(move || {
                if let Err(why) = serve(&s, stream) {
                    tracing::debug!(%why, "region connection closed");
                }
                s.conns.lock().remove(&id);
            });
        if r.is_err() {
            shared.conns.lock().remove(&id);
        }
    }
}

fn reply<W: Write>(w: &mut W, status: Status, msg: &str) -> io::Result<()> {
    let hdr = Response {
        status,
        value: 0,
        len: msg.len() as u64,
    }
    .encode();
    crate::vio::write_all_gather(w, &[&hdr, msg.as_bytes()], &[])
}

/// Why a raw-memory connection ended early (logged at debug; the peer sees the socket close).
#[derive(Debug, thiserror::Error)]
enum ConnEnd {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Wire(#[from] crate::wire::WireError),
    #[error("{0:?} is not a raw-memory op")]
    NotRaw(Op),
    #[error("raw write of {0} bytes to no region")]
    UnroutedWrite(u64),
}

fn serve(shared: &Shared, stream: TcpStream) -> Result<(), ConnEnd> {
    let mut wr = stream.try_clone()?;
    let mut rd = BufReader::with_capacity(16 * 1024, stream);
    loop {
        let mut hdr = [0u8; wire::REQ_LEN];
        match rd.read(&mut hdr[..1]) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
        rd.read_exact(&mut hdr[1..])?;
        let req = Request::decode(&hdr)?;
        // The requester's trace context, if any: this request's work is a span of its trace.
        let span = crate::trace::read_context(&hdr, &mut rd)?
            .and_then(|tc| crate::trace::server_span(&req, &tc));
        let _in_span = span.as_ref().map(|s| s.enter());
        if !matches!(req.op, Op::RawWrite | Op::RawRead) {
            return Err(ConnEnd::NotRaw(req.op));
        }
        if req.len == 0 {
            reply(&mut wr, Status::BadRequest, "zero-length transfer")?;
            continue;
        }
        let (addr, len) = (req.offset, req.len);
        let region = shared.registry.find(addr, len);
        let Some(region) = region else {
            shared
                .counters
                .out_of_bounds
                .fetch_add(1, Ordering::Relaxed);
            if req.op == Op::RawWrite {
                if len > MAX_DISCARD {
                    return Err(ConnEnd::UnroutedWrite(len));
                }
                crate::vio::discard(&mut rd, len)?;
            }
            let msg = format!("no registered region holds [{addr:#x}, +{len})");
            reply(&mut wr, Status::OutOfBounds, &msg)?;
            continue;
        };
        let n = len as usize;
        match req.op {
            Op::RawWrite => {
                let r = region.with_ptr(addr, |p| {
                    // SAFETY: [addr, addr+len) lies inside a registered region (checked by
                    // `find`) that cannot be deregistered while `with_ptr` holds its read lock;
                    // the registrant promised nothing reads it through a reference meanwhile.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p, n) };
                    if region.device {
                        crate::device::staging::read_exact_staged(&mut rd, &mut [dst])
                    } else {
                        rd.read_exact(dst)
                    }
                });
                match r {
                    Some(r) => r?,
                    None => {
                        crate::vio::discard(&mut rd, len)?;
                        reply(&mut wr, Status::OutOfBounds, "region was deregistered")?;
                        continue;
                    }
                }
                shared.counters.writes.fetch_add(1, Ordering::Relaxed);
                shared
                    .counters
                    .bytes_written
                    .fetch_add(len, Ordering::Relaxed);
                reply(&mut wr, Status::Ok, "")?;
            }
            _ => {
                // Counted before the bytes go out, so a reader that got them sees the count.
                shared.counters.reads.fetch_add(1, Ordering::Relaxed);
                shared.counters.bytes_read.fetch_add(len, Ordering::Relaxed);
                let hdr = Response {
                    status: Status::Ok,
                    value: 0,
                    len,
                }
                .encode();
                let r = region.with_ptr(addr, |p| {
                    // SAFETY: as for RAW_WRITE; the slice only lives for this writev.
                    let src = unsafe { std::slice::from_raw_parts(p.cast_const(), n) };
                    if region.device {
                        crate::device::staging::write_all_staged(&mut wr, &[&hdr], &[src])
                    } else {
                        crate::vio::write_all_gather(&mut wr, &[&hdr, src], &[])
                    }
                });
                match r {
                    Some(r) => r?,
                    None => {
                        reply(&mut wr, Status::OutOfBounds, "region was deregistered")?;
                        continue;
                    }
                }
            }
        }
    }
}
