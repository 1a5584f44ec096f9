//! What the Python methods do: start the region server, register and unregister memory, plan
//! a batch (pieces checked, the peer's session resolved), and run it now or in the background.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lunakv_transfer::{
    MemoryRegistry, ProtocolChoice, RawRequest, RegionServer, RegionServerConfig,
    TransferEngine as RawEngine, WireProtocol,
};
use parking_lot::Mutex;
use pyo3::prelude::*;

use super::handle::{
    Active, Dir, ERR_ADDRESS_NOT_REGISTERED, ERR_ADDRESS_OVERLAPPED, ERR_INVALID_ARGUMENT, FAILED,
    Pending, TransferEngine,
};
use crate::call::detached;
use crate::host::{env, resolve_ip, strip_port};
use crate::mem::{Range, RangeError, disjoint};

impl TransferEngine {
    pub(super) fn init(&self, py: Python<'_>, local_hostname: &str, protocol: &str) -> i64 {
        let protocol = match protocol.trim() {
            "" => ProtocolChoice::tcp(),
            p => match WireProtocol::parse(p) {
                Some(WireProtocol::Tcp) => ProtocolChoice::tcp(),
                Some(WireProtocol::Rdma) => match ProtocolChoice::resolve(WireProtocol::Rdma) {
                    // The device is there, but raw P/D regions only move over tcp (docs/RDMA.md).
                    c if !c.fell_back() => ProtocolChoice::rdma_unavailable(
                        "lunakv's P/D raw transfers (TransferEngine) have no RDMA path yet",
                    ),
                    c => c,
                },
                None => {
                    tracing::error!(
                        "lunakv: TransferEngine protocol '{p}' is not available: use \"tcp\" or \"rdma\""
                    );
                    return ERR_INVALID_ARGUMENT;
                }
            },
        };
        // vLLM's MooncakeConnector defaults to rdma: one line, then tcp.
        if let Some(w) = protocol.warning() {
            tracing::warn!("lunakv TransferEngine: {w}");
        }
        let host = Some(local_hostname.trim().to_owned())
            .filter(|h| !h.is_empty())
            .or_else(|| env("VLLM_HOST_IP"))
            .or_else(|| env("MOONCAKE_REQUESTER_LOCAL_HOSTNAME"))
            .or_else(|| env("MOONCAKE_LOCAL_HOSTNAME"));
        let Some(host) = host else {
            tracing::error!(
                "lunakv: TransferEngine.initialize: local_hostname is empty (and VLLM_HOST_IP is unset): pass this host's IP"
            );
            return ERR_INVALID_ARGUMENT;
        };
        let ip = match resolve_ip(&host) {
            Ok(ip) => ip,
            Err(msg) => {
                tracing::error!("lunakv: TransferEngine.initialize: {msg}");
                return ERR_INVALID_ARGUMENT;
            }
        };
        let advertise = strip_port(&host).to_owned();
        // A second initialize replaces the first engine, as upstream re-creates its engine.
        let old = self.active.write().take();
        let started = detached(py, Err("internal error".to_owned()), move || {
            drop(old);
            let registry = MemoryRegistry::new();
            let server = RegionServer::start(
                RegionServerConfig {
                    bind: SocketAddr::new(ip, 0),
                    advertise_host: Some(advertise),
                },
                registry.clone(),
            )
            .map_err(|e| e.to_string())?;
            Ok(Active {
                engine: crate::shared::default_engine(),
                registry,
                server,
                managed: Mutex::new(HashMap::new()),
                batches: Mutex::new(HashMap::new()),
                next_batch: AtomicU64::new(1),
                protocol,
            })
        });
        match started {
            Ok(a) => {
                tracing::debug!("lunakv: TransferEngine serving at {}", a.server.endpoint());
                *self.active.write() = Some(Arc::new(a));
                0
            }
            Err(msg) => {
                tracing::error!("lunakv: TransferEngine.initialize: {msg}");
                FAILED
            }
        }
    }

    pub(super) fn register(&self, py: Python<'_>, ranges: Vec<(i128, i128)>) -> i64 {
        let Some(a) = self.active() else {
            tracing::error!("lunakv: register_memory before initialize");
            return ERR_INVALID_ARGUMENT;
        };
        let mut checked = Vec::with_capacity(ranges.len());
        for (p, s) in ranges {
            match Range::new(p, s) {
                Ok(r) if r.len > 0 => checked.push(r),
                Ok(_) => {
                    tracing::error!("lunakv: register_memory refused: zero-length buffer");
                    return ERR_INVALID_ARGUMENT;
                }
                Err(msg) => {
                    tracing::error!("lunakv: register_memory refused: {msg}");
                    return ERR_INVALID_ARGUMENT;
                }
            }
        }
        detached(py, FAILED, move || {
            let mut done = Vec::with_capacity(checked.len());
            for r in &checked {
                // SAFETY: upstream's register_memory contract, which the Python caller accepts:
                // the buffer is valid writable memory that stays allocated until
                // unregister_memory (or this engine's shutdown) has returned for it.
                match unsafe { a.registry.register_raw(r.ptr, r.len) } {
                    Ok(d) => done.push(d.addr),
                    Err(e) => {
                        tracing::error!("lunakv: register_memory: {e}");
                        // All or nothing: undo this call's registrations.
                        for addr in done {
                            a.registry.deregister(addr);
                        }
                        let overlap = e.to_string().contains("overlaps");
                        return if overlap {
                            ERR_ADDRESS_OVERLAPPED
                        } else {
                            ERR_INVALID_ARGUMENT
                        };
                    }
                }
            }
            0
        })
    }

    pub(super) fn unregister(&self, py: Python<'_>, addrs: Vec<i128>) -> i64 {
        let Some(a) = self.active() else {
            return ERR_INVALID_ARGUMENT;
        };
        detached(py, FAILED, move || {
            let mut rc = 0;
            for p in addrs {
                let ok = u64::try_from(p).is_ok_and(|p| a.registry.deregister(p));
                if !ok {
                    tracing::warn!("lunakv: unregister_memory: no region starts at {p:#x}");
                    rc = ERR_ADDRESS_NOT_REGISTERED;
                }
            }
            rc
        })
    }

    /// Checks a transfer's arguments; the pieces `(local range, remote address)` on success.
    fn plan(
        target: &str,
        buffers: &[i128],
        peers: &[i128],
        lengths: &[i128],
        dir: Dir,
    ) -> Result<(String, Vec<(Range, u64)>), PlanError> {
        let endpoint = session_endpoint(target)?;
        if buffers.len() != peers.len() || buffers.len() != lengths.len() {
            return Err(PlanError::Counts {
                buffers: buffers.len(),
                peers: peers.len(),
                lengths: lengths.len(),
            });
        }
        let mut out = Vec::with_capacity(buffers.len());
        for ((&b, &p), &l) in buffers.iter().zip(peers).zip(lengths) {
            let r = Range::new(b, l)?;
            if r.len == 0 {
                return Err(PlanError::ZeroLength);
            }
            let peer = u64::try_from(p)
                .ok()
                .filter(|&p| p > 0 && p.checked_add(r.len as u64).is_some())
                .ok_or(PlanError::Peer { addr: p, len: l })?;
            out.push((r, peer));
        }
        if dir == Dir::Read && !disjoint(out.iter().map(|(r, _)| r)) {
            return Err(PlanError::Overlap);
        }
        Ok((endpoint, out))
    }

    /// Plans and runs one (batch) transfer synchronously with the GIL released.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sync(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        buffers: &[i128],
        peers: &[i128],
        lengths: &[i128],
        dir: Dir,
    ) -> i64 {
        let Some(a) = self.active() else {
            tracing::error!("lunakv: {what} before initialize");
            return FAILED;
        };
        let (endpoint, pieces) = match TransferEngine::plan(target, buffers, peers, lengths, dir) {
            Ok(p) => p,
            Err(msg) => {
                tracing::error!("lunakv: {what} refused: {msg}");
                return FAILED;
            }
        };
        if pieces.is_empty() {
            return 0;
        }
        let what = what.to_owned();
        detached(py, FAILED, move || {
            run(&a.engine, &endpoint, &pieces, dir, &what)
        })
    }

    /// Plans a transfer and starts it on a worker thread; its batch id, or `on_error`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit(
        &self,
        what: &str,
        target: &str,
        buffers: &[i128],
        peers: &[i128],
        lengths: &[i128],
        dir: Dir,
        on_error: i64,
    ) -> i64 {
        let Some(a) = self.active() else {
            tracing::error!("lunakv: {what} before initialize");
            return on_error;
        };
        let (endpoint, pieces) = match TransferEngine::plan(target, buffers, peers, lengths, dir) {
            Ok(p) => p,
            Err(msg) => {
                tracing::error!("lunakv: {what} refused: {msg}");
                return on_error;
            }
        };
        let id = a.next_batch.fetch_add(1, Ordering::Relaxed);
        let pending = Arc::new(Pending::default());
        a.batches.lock().insert(id, pending.clone());
        let engine = a.engine.clone();
        let label = what.to_owned();
        let spawned = std::thread::Builder::new()
            .name("lunakv-te-async".into())
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    if pieces.is_empty() {
                        0
                    } else {
                        run(&engine, &endpoint, &pieces, dir, &label)
                    }
                }))
                .unwrap_or(FAILED);
                pending.finish(r);
            });
        if spawned.is_err() {
            a.batches.lock().remove(&id);
            tracing::error!("lunakv: {what}: cannot start a transfer thread");
            return on_error;
        }
        i64::try_from(id).unwrap_or(on_error)
    }
}

/// Why a transfer's arguments were refused (logged; the call returns an error code).
#[derive(Debug, thiserror::Error)]
pub(super) enum PlanError {
    #[error(
        "target '{0}' is not a session id: pass the peer's \"host:rpc_port\" (its get_rpc_port())"
    )]
    NotSession(String),
    #[error(
        "{buffers} buffers, {peers} peer addresses and {lengths} lengths: pass one of each per transfer"
    )]
    Counts {
        buffers: usize,
        peers: usize,
        lengths: usize,
    },
    #[error(transparent)]
    Range(#[from] RangeError),
    #[error("zero-length transfer")]
    ZeroLength,
    #[error("peer address {addr:#x} (+{len}) is not a valid address")]
    Peer { addr: i128, len: i128 },
    #[error("local destination buffers overlap each other")]
    Overlap,
}

/// The tcp endpoint of an upstream session id, `"host:rpc_port"` (IPv6 as `[addr]:port`).
pub(super) fn session_endpoint(target: &str) -> Result<String, PlanError> {
    let t = target.trim();
    let port = t
        .rsplit_once(':')
        .and_then(|(h, p)| (!h.is_empty()).then_some(p))
        .and_then(|p| p.parse::<u16>().ok())
        .filter(|&p| p != 0);
    if port.is_none() {
        return Err(PlanError::NotSession(target.to_string()));
    }
    Ok(t.to_owned())
}

/// Moves the pieces; 0 if every one succeeded, else -1 (the first failure is logged).
fn run(engine: &RawEngine, endpoint: &str, pieces: &[(Range, u64)], dir: Dir, what: &str) -> i64 {
    let mut reqs: Vec<RawRequest<'_>> = pieces
        .iter()
        .map(|&(r, remote_addr)| match dir {
            // SAFETY: upstream's contract for transfer buffers, accepted by the Python caller:
            // each local range is valid for the duration of the transfer; `plan` proved read
            // destinations disjoint, so no two mutable slices alias.
            Dir::Write => RawRequest::Write {
                endpoint,
                remote_addr,
                src: vec![unsafe { r.slice() }],
            },
            Dir::Read => RawRequest::Read {
                endpoint,
                remote_addr,
                dst: vec![unsafe { r.slice_mut() }],
            },
        })
        .collect();
    let results = engine.batch_raw(&mut reqs);
    let failed = results.iter().filter(|r| r.is_err()).count();
    match results.into_iter().find_map(Result::err) {
        None => 0,
        Some(e) => {
            tracing::warn!(
                "lunakv: {what} to {endpoint}: {failed} of {} transfers failed: {e}",
                pieces.len()
            );
            FAILED
        }
    }
}
