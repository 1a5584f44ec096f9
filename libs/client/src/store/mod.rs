//! [`StoreClient`]: the blocking engine-side API.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lunakv_proto::master as pb;
use lunakv_proto::quick::Method;
use lunakv_proto::{ErrorCode, KeyError, validate_key};
use lunakv_transfer::{
    ProtocolChoice, TransferEngine, TransferError, TransferOptions, TransferRequest, WireProtocol,
};
use parking_lot::Mutex;
use std::borrow::Cow;
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::cache::LocationCache;
use lunakv_master_client::quick::{Quick, QuickLink};
use lunakv_master_client::{MasterLink, Rpc, startup};

use crate::{ClientError, ClientOptions, Location, Mode, ReplicateConfig, Result};
use lunakv_segment::{HostOptions, SegmentHost};

mod admin;
mod get;
mod put;
mod session;

pub use session::{GetRanges, PutRanges};

/// What a batch answer with fewer per-item results than items asked is reported as.
const SHORT_ANSWER_ITEMS: &str = "master answered fewer results than items";
/// As [`SHORT_ANSWER_ITEMS`], for batches of keys (lookups).
const SHORT_ANSWER_KEYS: &str = "master answered fewer results than keys";

/// Attempts at a get when owners answer "stale" (the object was evicted or removed and maybe
/// re-put between our lookup and our read).
const READ_ATTEMPTS: usize = 3;

/// The engine-side client. Blocking: call it from worker threads, not from inside an async task.
pub struct StoreClient {
    opts: ClientOptions,
    client_id: String,
    rt: Runtime,
    master: MasterLink,
    engine: Arc<TransferEngine>,
    cache: LocationCache,
    /// The exists and location reads, on the caller's thread ([`lunakv_master_client::quick`]).
    quick: QuickLink,
    host: Mutex<Option<SegmentHost>>,
    heartbeat_stop: watch::Sender<bool>,
    buffers: Mutex<BTreeMap<usize, usize>>,
    closed: AtomicBool,
    /// Set when the engine config's enable_offload differs from the master's.
    offload_mismatch: Option<String>,
    /// The protocol asked for and the one this client serves.
    protocol: ProtocolChoice,
    /// Open layer-wise sessions ([`session`]).
    sessions: session::Sessions,
}

impl StoreClient {
    /// Connects to the master and, in embedded mode, starts serving and mounts this client's
    /// own segment. Fails fast with a clear error when the master is unreachable.
    pub fn connect(opts: ClientOptions) -> Result<StoreClient> {
        let mut protocol = ProtocolChoice::resolve(opts.wire_protocol()?);
        let topts = TransferOptions {
            enable_shm: opts.enable_shm,
            ..TransferOptions::default()
        };
        let engine = if protocol.effective == WireProtocol::Rdma {
            TransferEngine::with_rdma(topts.clone()).unwrap_or_else(|e| {
                // The device listed but did not open: served over tcp, said once below.
                protocol = ProtocolChoice::rdma_unavailable(lunakv_transfer::rdma::reason_of(
                    &e.to_string(),
                ));
                TransferEngine::new(topts)
            })
        } else {
            TransferEngine::new(topts)
        };
        StoreClient::connect_resolved(opts, Arc::new(engine), protocol)
    }

    /// As [`StoreClient::connect`], but moves bytes with `engine`, a transfer engine shared with
    /// the rest of the process (its connection pools and shm attachments), e.g. the Python
    /// module's one engine for `mooncake.store` and `mooncake.engine`. The engine's own options
    /// (shm on or off) apply, not `opts.enable_shm`.
    pub fn connect_with_engine(
        opts: ClientOptions,
        engine: Arc<TransferEngine>,
    ) -> Result<StoreClient> {
        let mut protocol = ProtocolChoice::resolve(opts.wire_protocol()?);
        if protocol.effective == WireProtocol::Rdma && !engine.has_rdma() {
            protocol = ProtocolChoice::rdma_unavailable(
                "the transfer engine this client shares was opened without RDMA",
            );
        }
        StoreClient::connect_resolved(opts, engine, protocol)
    }

    /// Connects with the protocol already resolved; logs its fallback, if any, in one line.
    fn connect_resolved(
        opts: ClientOptions,
        engine: Arc<TransferEngine>,
        mut protocol: ProtocolChoice,
    ) -> Result<StoreClient> {
        opts.validate()?;
        if let Some(w) = protocol.warning() {
            tracing::warn!("lunakv client: {w}");
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lunakv-client")
            .enable_all()
            .build()
            .map_err(|e| ClientError::Config(format!("cannot start the client runtime: {e}")))?;
        let client_id = uuid::Uuid::new_v4().to_string();
        // `host:port`, or `etcd://h1:2379;h2:2379` to find and follow the HA leader. A master
        // that is not reachable yet is waited for as `opts.master_wait` says (the Python
        // setup waits a little, the CLI not at all).
        let master = rt.block_on(async {
            let mut waiting = startup::master_wait(
                &opts.master_server_address,
                "to connect this client".to_owned(),
                opts.master_wait,
            );
            let link = startup::connect_link(
                &opts.master_server_address,
                &opts.cluster_id,
                opts.rpc_timeout,
                &mut waiting,
            )
            .await?;
            waiting.reached();
            Ok::<_, ClientError>(link)
        })?;

        // The seed's rule: enable_offload is set together on the engine config, the master and
        // the store-client. Compare with the master's now, while someone reads the log.
        let offload_mismatch = match opts.enable_offload {
            Some(ours) => rt
                .block_on(async {
                    let mut m = master.client();
                    tokio::time::timeout(
                        opts.rpc_timeout,
                        m.get_cluster_status(pb::GetClusterStatusRequest {}),
                    )
                    .await
                })
                .ok()
                .and_then(|r| r.ok())
                .map(|r| r.into_inner().enable_offload)
                .filter(|theirs| *theirs != ours)
                .map(|theirs| {
                    let msg = format!(
                        "enable_offload mismatch: mooncake_config.json says \"enable_offload\": {ours} but the master at {} runs with --enable_offload={theirs}; set the same value on the engine config, the master and every lunakv-store",
                        opts.master_server_address
                    );
                    tracing::warn!("{msg}");
                    msg
                }),
            None => None,
        };

        let host = if opts.mode() == Mode::Embedded {
            let ip: IpAddr = opts.local_hostname.parse().map_err(|_| {
                ClientError::Config(format!(
                    "local_hostname '{}' is not an IP address: embedded mode binds its segment there; use this host's IP, e.g. \"127.0.0.1\"",
                    opts.local_hostname
                ))
            })?;
            let shm_dir = opts.shm_dir.clone().unwrap_or_else(std::env::temp_dir);
            let host_opts = HostOptions {
                master_server_address: opts.master_server_address.clone(),
                client_id: client_id.clone(),
                cluster_id: opts.cluster_id.clone(),
                bind: SocketAddr::new(ip, 0),
                advertise_host: None,
                size: opts.global_segment_size,
                shm_socket: opts
                    .enable_shm
                    .then(|| shm_dir.join(format!("lunakv-embedded-{client_id}.sock"))),
                protocol: protocol.clone(),
                enable_offload: false,
                ping_interval: Duration::from_secs(1),
                rpc_timeout: opts.rpc_timeout,
                limits: Default::default(),
                // An ephemeral port is never in use.
                bind_retry: Duration::ZERO,
            };
            let host = rt.block_on(SegmentHost::bind(host_opts, None)?.mount(opts.master_wait))?;
            // A registration that failed after the device opened fell back (and said so).
            protocol = host.protocol().clone();
            // Our own segment lives in this process: reach it by memcpy, not through a socket.
            engine.attach_local(host.server());
            Some(host)
        } else {
            None
        };

        // A requester pings too, so the master counts it among active clients. The segment
        // host has its own heartbeat.
        let (heartbeat_stop, stop_rx) = watch::channel(false);
        if host.is_none() {
            rt.spawn(lunakv_segment::requester_heartbeat(
                master.clone(),
                client_id.clone(),
                opts.cluster_id.clone(),
                protocol.clone(),
                Duration::from_secs(1),
                stop_rx,
            ));
        }

        Ok(StoreClient {
            cache: LocationCache::new(opts.location_cache_capacity),
            sessions: session::Sessions::new(&opts),
            quick: QuickLink::new(opts.rpc_timeout, master.tls().cloned()),
            opts,
            client_id,
            rt,
            master,
            engine,
            host: Mutex::new(host),
            heartbeat_stop,
            buffers: Mutex::new(BTreeMap::new()),
            closed: AtomicBool::new(false),
            offload_mismatch,
            protocol,
        })
    }

    /// The warning logged at connect when the engine config's `enable_offload` differs from the
    /// master's (`None` when they agree or the config did not say).
    pub fn offload_mismatch(&self) -> Option<&str> {
        self.offload_mismatch.as_deref()
    }

    /// The protocol asked for and the one this client serves: `tcp (rdma unavailable: ...)`
    /// where `rdma` was asked on a build or machine without it.
    pub fn protocol(&self) -> &ProtocolChoice {
        &self.protocol
    }

    /// The transfer engine this client moves bytes with.
    pub fn engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }

    /// The key this client sends for `key`: scoped by its tenant (`<tenant>\0<key>`), or `key`
    /// itself for the default tenant (lunakv_proto's key rules).
    pub(super) fn scoped<'a>(&self, key: &'a str) -> Cow<'a, str> {
        if self.opts.tenant_id == lunakv_proto::DEFAULT_TENANT {
            Cow::Borrowed(key)
        } else {
            Cow::Owned(lunakv_proto::scope_key(&self.opts.tenant_id, key))
        }
    }

    /// Checks a key this client scoped: the caller's own key must follow the key rules (a NUL
    /// in it can never pass as a tenant separator).
    pub(super) fn check_key(&self, scoped: &str) -> std::result::Result<(), KeyError> {
        let user = if self.opts.tenant_id == lunakv_proto::DEFAULT_TENANT {
            scoped
        } else {
            scoped
                .strip_prefix(self.opts.tenant_id.as_str())
                .and_then(|k| k.strip_prefix('\0'))
                .unwrap_or(scoped)
        };
        validate_key(user)
    }

    /// The tenant this client's keys belong to.
    pub fn tenant_id(&self) -> &str {
        &self.opts.tenant_id
    }

    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// The name ("host:port") of this client's own segment in embedded mode.
    pub fn segment_name(&self) -> Option<String> {
        self.host.lock().as_ref().map(|h| h.info().name.clone())
    }

    // === plumbing ===

    /// A master failure: its batch answer had fewer results than were asked for.
    fn short_answer(&self, message: &str) -> ClientError {
        ClientError::Rpc {
            addr: self.opts.master_server_address.clone(),
            message: message.to_owned(),
        }
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(ClientError::Closed)
        } else {
            Ok(())
        }
    }

    fn replicate_config(&self, cfg: &ReplicateConfig) -> pb::ReplicateConfig {
        pb::ReplicateConfig {
            replica_num: cfg.replica_num.max(1),
            preferred_segment: cfg
                .preferred_segment
                .clone()
                .or_else(|| self.opts.preferred_segment.clone())
                .unwrap_or_default(),
            with_soft_pin: cfg.with_soft_pin,
            with_hard_pin: cfg.with_hard_pin,
            preferred_segments: cfg.preferred_segments.clone(),
            soft_pin_ttl_ms: cfg.soft_pin_ttl_ms,
        }
    }

    /// One master call as a quick call where it can be ([`lunakv_master_client::quick`]), else
    /// over gRPC.
    fn quick_or_rpc<Req, T, F, Fut>(&self, method: Method, req: &Req, call: F) -> Result<T>
    where
        Req: prost::Message,
        T: prost::Message + Default,
        F: Fn(Rpc) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        match self.quick.call(&self.master.current_addr(), method, req) {
            Quick::Answered(r) => Ok(r),
            // As a gRPC call whose connection broke: under HA it is made again at the leader
            // (a deposed one refuses it), otherwise a mutation is reported failed.
            Quick::Lost(message) if method.mutates() && !self.master.is_ha() => {
                Err(ClientError::Rpc {
                    addr: self.opts.master_server_address.clone(),
                    message,
                })
            }
            Quick::Lost(_) | Quick::StepAside => self.rpc(call),
        }
    }

    /// One master call; with an etcd master address it retries across a leader failover
    /// (`call` runs once per attempt, so it clones its request).
    fn rpc<T, F, Fut>(&self, call: F) -> Result<T>
    where
        F: Fn(Rpc) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        self.rt.block_on(self.master.call(call))
    }
}

impl Drop for StoreClient {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "close on drop failed");
        }
    }
}

/// The span of one client operation, parent of its master calls and transfers; only when traces
/// are exported (docs/TRACING.md), so gets pay nothing for it otherwise.
fn op_span(name: &'static str, objects: usize) -> tracing::Span {
    lunakv_telemetry::trace_span(|| {
        tracing::info_span!("client", otel.name = name, otel.kind = "client", objects)
    })
}

enum ReadError {
    /// Every owner said the generation is gone: refresh the location and try again.
    Stale,
    Failed(ClientError),
}

/// The prefix of `dst` that covers exactly `size` bytes, or None if `dst` is too small.
fn trim<'a>(dst: &'a mut [&mut [u8]], size: u64) -> Option<Vec<&'a mut [u8]>> {
    let mut left = size as usize;
    let mut out = Vec::with_capacity(dst.len());
    for d in dst.iter_mut() {
        if left == 0 {
            break;
        }
        let n = d.len().min(left);
        out.push(&mut d[..n]);
        left -= n;
    }
    (left == 0).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::trim;

    #[test]
    fn trim_covers_exactly_the_object() {
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        let mut dst: Vec<&mut [u8]> = vec![&mut a, &mut b];
        let t = trim(&mut dst, 6).expect("fits");
        assert_eq!(t.iter().map(|s| s.len()).collect::<Vec<_>>(), vec![4, 2]);
        assert!(trim(&mut dst, 9).is_none());
        assert_eq!(trim(&mut dst, 0).expect("empty").len(), 0);
    }
}
