//! [`TransferEngine`], the requester half: routes each request to a transport (in-process,
//! shm, rdma or tcp), splits batches across connections and threads, and falls back to tcp
//! when a faster route is refused.

use super::*;

/// A batch is split into units of at least this many bytes per connection; below that a thread
/// costs more than it saves on a small box.
pub(crate) const MIN_UNIT_BYTES: u64 = 512 * 1024;
/// In-process copies are split across threads only in shares of at least this many bytes: a
/// helper costs ~30-90 us to wake or spawn, which a 2 MiB copy (~250 us) amortises.
pub const LOCAL_SPLIT_MIN_BYTES: u64 = 2 << 20;
/// How long a failed shm attach sends a target to tcp before trying shm again.
const SHM_RETRY_AFTER: Duration = Duration::from_secs(10);
/// How long a peer that refused `RDMA_CONNECT` is served over tcp before asking again.
const RDMA_RETRY_AFTER: Duration = Duration::from_secs(60);

/// How a shm route finds out that shm is unusable: a batch unit probes the segment first (its
/// submit answers per request, so one failure cannot be told from its answer); a single
/// request learns it from its own [`TransferError::ShmUnavailable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShmCheck {
    Probe,
    Answer,
}

/// A request to an in-process segment inside [`TransferEngine::batch`]: its index in the batch,
/// the server, the request.
type LocalReq<'r, 'a> = (
    usize,
    std::sync::Arc<server::state::Shared>,
    &'r mut TransferRequest<'a>,
);

/// Helper threads (beside the caller) for in-process requests of `lens` bytes: one per
/// [`LOCAL_SPLIT_MIN_BYTES`] beyond the first share, at most `copy_threads - 1`, never more
/// than requests to share out.
pub(crate) fn copy_helpers(lens: &[u64], copy_threads: usize) -> usize {
    let total: u64 = lens.iter().sum();
    let shares = (total / LOCAL_SPLIT_MIN_BYTES).min(lens.len() as u64) as usize;
    shares.min(copy_threads).saturating_sub(1)
}

/// Moves bytes between caller buffers and segments. `Send + Sync`: one engine per process,
/// shared by every thread; it pools tcp connections per endpoint and caches shm attachments.
pub struct TransferEngine {
    pub(crate) enable_shm: bool,
    pub(crate) tcp: TcpTransport,
    pub(crate) shm: ShmTransport,
    /// shm sockets whose attach failed, and when: they go over tcp for a while.
    pub(crate) shm_failed: Mutex<std::collections::HashMap<String, Instant>>,
    /// The RDMA transport, when built with [`TransferEngine::with_rdma`].
    pub(crate) rdma: Option<RdmaTransport>,
    /// Endpoints that answered `RDMA_CONNECT`: `(offered, when)`.
    pub(crate) rdma_peers: Mutex<std::collections::HashMap<String, (bool, Instant)>>,
    /// Segment servers of this process reached by direct memcpy ([`TransferEngine::attach_local`]).
    pub(crate) local: local::LocalSegments,
    /// [`TransferOptions::copy_threads`], at least 1.
    pub(crate) copy_threads: usize,
    /// The threads beside the caller that share a batch's in-process copies.
    pub(crate) helpers: crate::helpers::CopyHelpers,
    /// The threads beside the caller that run a batch's other units (one connection each).
    pub(crate) unit_helpers: crate::helpers::CopyHelpers,
}

impl TransferEngine {
    pub fn new(opts: TransferOptions) -> TransferEngine {
        TransferEngine {
            enable_shm: opts.enable_shm && !shm_disabled_by_env(&lunakv_config::process_env),
            tcp: TcpTransport::new(opts.conns_per_peer, opts.io_timeout),
            shm: ShmTransport::new(opts.conns_per_peer, opts.io_timeout),
            shm_failed: Mutex::new(std::collections::HashMap::new()),
            rdma: None,
            rdma_peers: Mutex::new(std::collections::HashMap::new()),
            local: local::LocalSegments::default(),
            copy_threads: opts.copy_threads.max(1),
            helpers: crate::helpers::CopyHelpers::new(opts.copy_threads.max(1), "lunakv-copy"),
            unit_helpers: crate::helpers::CopyHelpers::new(opts.conns_per_peer, "lunakv-unit"),
        }
    }

    /// Lets this engine reach `server`, a segment server of this same process (embedded mode:
    /// the engine's own segment), by direct memcpy against its mapping and entry table: no
    /// socket, no syscall. Requests whose [`Target`] names the server (same endpoint and host)
    /// take this path before shm, rdma or tcp, with the same generation checks, overlap
    /// invalidation and stats. The engine holds a weak reference: a dropped or shut-down server
    /// is skipped. Attaching again (or another server on the same endpoint) replaces it.
    pub fn attach_local(&self, server: &SegmentServer) {
        self.local.attach(server);
    }

    /// Undoes [`TransferEngine::attach_local`]; requests to `server` use the sockets again.
    pub fn detach_local(&self, server: &SegmentServer) {
        self.local.detach(server);
    }

    /// True if requests to `t` take the in-process path (an attached, running server).
    pub fn is_local(&self, t: &Target) -> bool {
        self.local.find(t).is_some()
    }

    /// An engine that also moves bytes over RDMA (what `protocol: "rdma"` selects): per target,
    /// shm on the same host, else rdma if the target offers it, else tcp ([`select_route`]).
    /// Fails with [`TransferError::RdmaUnavailable`] (one line naming the fix) when this build
    /// has no `rdma` feature or no RDMA device is present; it never falls back silently.
    pub fn with_rdma(opts: TransferOptions) -> Result<TransferEngine, TransferError> {
        let rdma = RdmaTransport::open(opts.conns_per_peer, opts.io_timeout)?;
        let mut e = TransferEngine::new(opts);
        e.rdma = Some(rdma);
        Ok(e)
    }

    /// True if this engine has an open RDMA device.
    pub fn has_rdma(&self) -> bool {
        self.rdma.is_some()
    }

    /// What this engine knows about `endpoint`'s RDMA offer.
    fn peer_rdma(&self, endpoint: &str) -> PeerRdma {
        let mut peers = self.rdma_peers.lock();
        match peers.get(endpoint) {
            None => PeerRdma::Unknown,
            Some(&(true, _)) => PeerRdma::Offered,
            Some(&(false, at)) if at.elapsed() < RDMA_RETRY_AFTER => PeerRdma::NotOffered,
            Some(_) => {
                peers.remove(endpoint);
                PeerRdma::Unknown
            }
        }
    }

    fn note_rdma(&self, t: &Target, offered: Result<(), &TransferError>) {
        let ok = offered.is_ok();
        if let Err(e) = offered {
            tracing::warn!(endpoint = %t.endpoint, error = %e, "peer offers no rdma; using tcp for it");
        }
        self.rdma_peers
            .lock()
            .insert(t.endpoint.clone(), (ok, Instant::now()));
    }

    /// The transport requests to `t` take now ([`select_route`] over what the engine knows).
    pub fn route_for(&self, t: &Target) -> Route {
        let same_host = t.host_id == host_id();
        let shm_offered = t.shm_socket.is_some();
        select_route(&RouteFacts {
            shm_enabled: self.enable_shm,
            same_host,
            shm_offered,
            // uses_shm also expires old failures.
            shm_failed_recently: self.enable_shm && same_host && shm_offered && !self.uses_shm(t),
            local_rdma: self.rdma.is_some(),
            peer_rdma: self.peer_rdma(&t.endpoint),
        })
    }

    /// The rdma transport if `t` offers rdma (asking it once), else tcp.
    fn rdma_or_tcp(&self, t: &Target) -> &dyn Transport {
        let Some(rdma) = &self.rdma else {
            return &self.tcp;
        };
        if self.peer_rdma(&t.endpoint) == PeerRdma::Offered {
            return rdma;
        }
        match rdma.probe(t) {
            Ok(()) => {
                self.note_rdma(t, Ok(()));
                rdma
            }
            Err(e @ TransferError::RdmaUnavailable(_)) => {
                self.note_rdma(t, Err(&e));
                &self.tcp
            }
            // Unreachable peer or a broken rdma setup: let the request report it.
            Err(_) => rdma,
        }
    }

    /// True if requests to `t` go over shm: shm enabled, same host, socket offered, and no
    /// recent attach failure.
    pub fn uses_shm(&self, t: &Target) -> bool {
        let Some(path) = t.shm_socket.as_deref() else {
            return false;
        };
        if !self.enable_shm || t.host_id != host_id() {
            return false;
        }
        let mut failed = self.shm_failed.lock();
        match failed.get(path) {
            Some(at) if at.elapsed() < SHM_RETRY_AFTER => false,
            Some(_) => {
                failed.remove(path);
                true
            }
            None => true,
        }
    }

    /// True when requests to `t` would take rdma but carry device pieces and GPUDirect was
    /// refused: the rdma transport registers caller memory with the NIC, which device memory
    /// needs GPUDirect for, so they go over tcp, staged (docs/GPU.md). `has_device` is only
    /// asked on an rdma route.
    fn rdma_skips_device(&self, t: &Target, has_device: impl FnOnce() -> bool) -> bool {
        self.rdma.is_some()
            && !gpudirect().allowed()
            && self.route_for(t) == Route::Rdma
            && has_device()
    }

    /// Serves again over tcp, staged, every request the rdma transport answered with
    /// [`TransferError::GpuDirectRefused`], and remembers the refusal (one WARN line).
    pub(crate) fn redo_refused_device(
        &self,
        t: &Target,
        reqs: &mut [&mut TransferRequest<'_>],
        out: &mut [Result<(), TransferError>],
    ) {
        let mut idx = Vec::new();
        let mut again: Vec<&mut TransferRequest<'_>> = Vec::new();
        for (k, (r, req)) in out.iter().zip(reqs.iter_mut()).enumerate() {
            if let Err(TransferError::GpuDirectRefused(why)) = r {
                gpudirect().refuse(why);
                idx.push(k);
                again.push(&mut **req);
            }
        }
        if again.is_empty() {
            return;
        }
        for (k, r) in idx.into_iter().zip(self.tcp.submit(t, &mut again)) {
            out[k] = r;
        }
    }

    /// Runs `op` on the transport requests to `t` take: the one place the route and its
    /// fallbacks are decided. Device pieces bound for rdma without GPUDirect go over tcp,
    /// staged ([`Self::rdma_skips_device`]; `has_device` is asked of `io` only then). Else
    /// [`Self::route_for`]'s route: shm, falling back to rdma-or-tcp when shm turns out
    /// unusable (remembered for a while); rdma when the peer offers it, else tcp. An answer of
    /// [`TransferError::GpuDirectRefused`] is served again over tcp, staged.
    fn on_route<S: ?Sized, R>(
        &self,
        t: &Target,
        io: &mut S,
        has_device: impl FnOnce(&S) -> bool,
        check: ShmCheck,
        mut op: impl FnMut(&dyn Transport, &mut S) -> Result<R, TransferError>,
    ) -> Result<R, TransferError> {
        if self.rdma_skips_device(t, || has_device(io)) {
            return op(&self.tcp, io);
        }
        let r = match self.route_for(t) {
            Route::Tcp => op(&self.tcp, io),
            Route::Rdma => op(self.rdma_or_tcp(t), io),
            Route::Shm => {
                if check == ShmCheck::Probe
                    && let Err(e) = self.shm.probe(t)
                {
                    tracing::warn!(endpoint = %t.endpoint, error = %e, "shm unavailable, falling back to tcp");
                    self.shm_failed(t);
                    op(self.rdma_or_tcp(t), io)
                } else {
                    match op(&self.shm, io) {
                        Err(TransferError::ShmUnavailable(why)) => {
                            tracing::warn!(endpoint = %t.endpoint, %why, "shm unavailable, falling back to tcp");
                            self.shm_failed(t);
                            op(self.rdma_or_tcp(t), io)
                        }
                        r => r,
                    }
                }
            }
        };
        match r {
            Err(TransferError::GpuDirectRefused(why)) => {
                gpudirect().refuse(&why);
                op(&self.tcp, io)
            }
            r => r,
        }
    }

    /// Remembers that `t`'s shm socket would not attach: requests to it go another way for a
    /// while ([`Self::uses_shm`]).
    fn shm_failed(&self, t: &Target) {
        if let Some(p) = &t.shm_socket {
            self.shm_failed.lock().insert(p.clone(), Instant::now());
        }
    }

    /// One request, on the calling thread, routed like [`TransferEngine::write`] /
    /// [`TransferEngine::read`].
    pub fn execute(&self, req: &mut TransferRequest<'_>) -> Result<(), TransferError> {
        req.dispatch(
            |t, generation, key, offset, src| self.write(t, generation, key, offset, src),
            |t, generation, offset, dst| self.read(t, generation, offset, dst),
        )
    }

    /// Writes the concatenation of `src` (scatter-gather: one piece per layer is fine) at
    /// `offset` of `t`'s segment, recorded as entry `generation` for `key`.
    pub fn write(
        &self,
        t: &Target,
        generation: u64,
        key: &str,
        offset: u64,
        src: &[&[u8]],
    ) -> Result<(), TransferError> {
        if let Some(s) = self.local.find(t) {
            return local::write(&s, t, generation, key, offset, src);
        }
        self.on_route(
            t,
            &mut (),
            |_| device::any_device(src),
            ShmCheck::Answer,
            |tr, _| tr.write(t, generation, key, offset, src),
        )
    }

    /// Reads entry `(generation, offset, total len of dst)` into the `dst` pieces, in order.
    pub fn read(
        &self,
        t: &Target,
        generation: u64,
        offset: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        if let Some(s) = self.local.find(t) {
            return local::read(&s, t, generation, offset, dst);
        }
        self.on_route(
            t,
            dst,
            device::any_device_mut,
            ShmCheck::Answer,
            |tr, dst| tr.read(t, generation, offset, dst),
        )
    }

    /// Runs many requests; results in request order. Requests are grouped per target, each
    /// group pipelined on up to `conns_per_peer` connections, all groups in parallel. Requests
    /// to attached in-process segments run on the calling thread, beside the others.
    pub fn batch(&self, reqs: &mut [TransferRequest<'_>]) -> Vec<Result<(), TransferError>> {
        let total = reqs.len();
        // Requests to in-process segments, with the server (looked up once per target).
        let mut locals: Vec<LocalReq<'_, '_>> = Vec::new();
        let mut local_seen: Vec<(&Target, Option<std::sync::Arc<server::state::Shared>>)> =
            Vec::new();
        // Group by target (few peers per batch: linear search beats hashing).
        let mut groups: Vec<(&Target, Vec<(usize, &mut TransferRequest<'_>)>)> = Vec::new();
        for (i, r) in reqs.iter_mut().enumerate() {
            let t: &Target = match r {
                TransferRequest::Read { target, .. } | TransferRequest::Write { target, .. } => {
                    target
                }
            };
            let shared = match local_seen.iter().find(|(g, _)| g.same_segment(t)) {
                Some((_, s)) => s.clone(),
                None => {
                    let s = self.local.find(t);
                    local_seen.push((t, s.clone()));
                    s
                }
            };
            if let Some(s) = shared {
                locals.push((i, s, r));
                continue;
            }
            match groups.iter_mut().find(|(g, _)| g.same_segment(t)) {
                Some((_, v)) => v.push((i, r)),
                None => groups.push((t, vec![(i, r)])),
            }
        }
        // Split each group into units, one connection (and thread) each.
        let mut units: Vec<(&Target, Vec<(usize, &mut TransferRequest<'_>)>)> = Vec::new();
        for (t, v) in groups {
            let bytes: u64 = v.iter().map(|(_, r)| r.len()).sum();
            let n = (self.tcp.conns_per_peer() as u64)
                .min(bytes.div_ceil(MIN_UNIT_BYTES))
                .min(v.len() as u64)
                .max(1) as usize;
            let per = v.len().div_ceil(n);
            let mut v = v;
            while v.len() > per {
                let rest = v.split_off(per);
                units.push((t, v));
                v = rest;
            }
            units.push((t, v));
        }
        let mut results: Vec<Option<Result<(), TransferError>>> =
            (0..total).map(|_| None).collect();
        let run_locals = |locals: Vec<LocalReq<'_, '_>>| self.run_locals(locals);
        let run_unit = |t: &Target,
                        v: &mut Vec<(usize, &mut TransferRequest<'_>)>|
         -> Vec<(usize, Result<(), TransferError>)> {
            let idx: Vec<usize> = v.iter().map(|(i, _)| *i).collect();
            let mut rs: Vec<&mut TransferRequest<'_>> =
                v.iter_mut().map(|(_, r)| &mut **r).collect();
            // submit answers per request, never with one error, so the batch probes shm first.
            let Ok(mut out) = self.on_route(
                t,
                &mut rs,
                |rs| rs.iter().any(|r| r.has_device()),
                ShmCheck::Probe,
                |tr, rs| Ok::<_, TransferError>(tr.submit(t, rs)),
            ) else {
                unreachable!("a batch unit's submit answers per request")
            };
            self.redo_refused_device(t, &mut rs, &mut out);
            idx.into_iter().zip(out).collect()
        };
        // Units on other threads send the caller's trace context too.
        let carry = trace::Carry::current();
        let run_unit = |t: &Target, v: &mut Vec<(usize, &mut TransferRequest<'_>)>| {
            carry.run(|| run_unit(t, v))
        };
        let mut collected: Vec<(usize, Result<(), TransferError>)> = Vec::new();
        if units.is_empty() {
            collected = run_locals(locals);
        } else if !locals.is_empty() {
            // The local copies run here while the remote units run on their own threads.
            std::thread::scope(|s| {
                let handles: Vec<_> = units
                    .into_iter()
                    .map(|(t, mut v)| s.spawn(move || run_unit(t, &mut v)))
                    .collect();
                collected = run_locals(locals);
                for h in handles {
                    match h.join() {
                        Ok(r) => collected.extend(r),
                        Err(p) => std::panic::resume_unwind(p),
                    }
                }
            });
        } else if units.len() == 1 {
            let (t, mut v) = units.pop().unwrap_or_else(|| unreachable!());
            collected = run_unit(t, &mut v);
        } else if !units.is_empty() {
            collected = self
                .unit_helpers
                .share(units.len() - 1, units, |(t, mut v)| run_unit(t, &mut v));
        }
        for (i, r) in collected {
            results[i] = Some(r);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(TransferError::Protocol(
                        "a batch request got no result".into(),
                    ))
                })
            })
            .collect()
    }

    /// Runs a batch's in-process requests: on the calling thread, or, when the batch is large
    /// enough, shared out over up to `copy_threads` threads (the caller's included). Each
    /// request is still one entry written or read whole by one thread, with the same
    /// invalidate -> copy -> commit and pin -> copy -> unpin as alone.
    fn run_locals(&self, locals: Vec<LocalReq<'_, '_>>) -> Vec<(usize, Result<(), TransferError>)> {
        // With device pieces (all puts or all gets, as clients batch them), each thread queues
        // its requests' DMA on its stream and synchronizes once before committing/unpinning.
        if device::layer().is_some() && locals.len() > 1 {
            let reads = locals
                .iter()
                .filter(|(_, _, r)| matches!(r, TransferRequest::Read { .. }))
                .count();
            // A read pinned by this thread would stall a later overlapping write of the same
            // batch (it waits for pins), so mixed batches keep one sync per request.
            let one_direction = reads == 0 || reads == locals.len();
            if one_direction && locals.iter().any(|(_, _, r)| r.has_device()) {
                return self.run_locals_queued(locals);
            }
        }
        let one = |(i, s, r): LocalReq<'_, '_>| (i, local::execute(&s, r));
        let lens: Vec<u64> = locals.iter().map(|(_, _, r)| r.len()).collect();
        let helpers = copy_helpers(&lens, self.copy_threads);
        if helpers == 0 {
            return locals.into_iter().map(one).collect();
        }
        // Work sharing, not a fixed split (CopyHelpers::share).
        self.helpers
            .share(helpers, locals, |req| std::iter::once(one(req)))
    }

    /// [`TransferEngine::run_locals`] for a batch with device pieces: the same work sharing,
    /// but each thread starts its requests on one [`device::Copier`], synchronizes it once, then
    /// commits or unpins them.
    fn run_locals_queued(
        &self,
        locals: Vec<LocalReq<'_, '_>>,
    ) -> Vec<(usize, Result<(), TransferError>)> {
        let lens: Vec<u64> = locals.iter().map(|(_, _, r)| r.len()).collect();
        let helpers = copy_helpers(&lens, self.copy_threads);
        let slots: Vec<parking_lot::Mutex<Option<LocalReq<'_, '_>>>> = locals
            .into_iter()
            .map(|l| parking_lot::Mutex::new(Some(l)))
            .collect();
        // Each thread takes one contiguous share of the batch: consecutive blocks, placed back
        // to back, coalesce into few device copies (Copier::flush); interleaved they would not.
        let share = slots.len().div_ceil(helpers + 1).max(1);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let work = || {
            let mut out = Vec::new();
            let Some(mut c) = device::Copier::new() else {
                return out;
            };
            let mut started = Vec::new();
            let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            for slot in slots.iter().skip(k * share).take(share) {
                if let Some((i, s, r)) = slot.lock().take() {
                    match local::start(&s, r, &mut c) {
                        Ok(q) => started.push((i, s, q)),
                        Err(e) => out.push((i, Err(e))),
                    }
                }
            }
            let synced = c.sync().map_err(TransferError::from);
            for (i, s, q) in started {
                out.push((i, q.finish(&s, &synced)));
            }
            out
        };
        self.helpers.run(helpers, work)
    }

    /// FREE: asks the owner at `endpoint` to drop entries `(generation, offset)`; returns once it
    /// has, after their readers' pins are released. `Err(Timeout)` if pins outlived `timeout`
    /// (the entries are dropped anyway). Used by the master before reusing a range.
    pub fn free(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<(), TransferError> {
        self.tcp.free(endpoint, items, timeout)
    }

    /// The master's side: FREE and OFFLOAD to `endpoint` carry a tag under `secret` from now
    /// on ([`TcpTransport::set_owner_key`]).
    pub fn set_owner_key(&self, endpoint: &str, secret: Option<MountSecret>) {
        self.tcp.set_owner_key(endpoint, secret);
    }

    /// OFFLOAD: asks the owner at `endpoint` to move entries `(generation, offset)` to its disk
    /// tier and drop them from DRAM. Returns the generations it could not store (they are gone
    /// from DRAM too). Used by the master's eviction when the owner offloads.
    pub fn offload(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<Vec<u64>, TransferError> {
        self.tcp.offload(endpoint, items, timeout)
    }

    /// OFFLOAD, and the owner names in its answer the objects its disk tier dropped to make
    /// room for these ([`crate::wire::FLAG_DROPS`]), so the caller can forget them before it
    /// answers another lookup. An owner that predates the flag answers as for
    /// [`Self::offload`] (`reported` false): its drops come on its next Ping.
    pub fn offload_reporting(
        &self,
        endpoint: &str,
        items: &[(u64, u64)],
        timeout: Duration,
    ) -> Result<crate::OffloadAnswer, TransferError> {
        self.tcp.offload_reporting(endpoint, items, timeout)
    }

    /// LOAD: reads object `generation` (total length of `dst`) from the owner's DRAM or disk
    /// tier, over tcp (the disk read dominates; shm would not save anything).
    pub fn load(
        &self,
        t: &Target,
        generation: u64,
        dst: &mut [&mut [u8]],
    ) -> Result<(), TransferError> {
        self.tcp
            .load(&t.endpoint, generation, dst, t.capability.as_ref())
    }
}
