//! [`StoreClient`]: the blocking engine-side API.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lunakv_proto::master as pb;
use lunakv_proto::{ErrorCode, validate_key};
use lunakv_transfer::{
    ProtocolChoice, TransferEngine, TransferError, TransferOptions, TransferRequest, WireProtocol,
};
use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::cache::LocationCache;
use crate::host::{HostOptions, Mounter, SegmentHost};
use crate::link::MasterLink;
use crate::{ClientError, ClientOptions, Location, Mode, ReplicateConfig, Result};

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
    host: Mutex<Option<SegmentHost>>,
    heartbeat_stop: watch::Sender<bool>,
    buffers: Mutex<BTreeMap<usize, usize>>,
    closed: AtomicBool,
    /// Set when the engine config's enable_offload differs from the master's.
    offload_mismatch: Option<String>,
    /// The protocol asked for and the one this client serves.
    protocol: ProtocolChoice,
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
            let mut waiting = crate::startup::master_wait(
                &opts.master_server_address,
                "to connect this client".to_owned(),
                opts.master_wait,
            );
            let link = crate::startup::connect_link(
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
            let m = Mounter {
                master: master.clone(),
                client_id: client_id.clone(),
                cluster_id: opts.cluster_id.clone(),
                protocol: protocol.clone(),
                enable_offload: false,
                server: None,
                disk: None,
                status: Default::default(),
            };
            rt.spawn(crate::host::heartbeat(m, Duration::from_secs(1), stop_rx));
        }

        Ok(StoreClient {
            cache: LocationCache::new(opts.location_cache_capacity),
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

    // === puts ===

    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.put_parts(key, &[value], &ReplicateConfig::default())
    }

    /// Puts one object made of several pieces (vLLM: one piece per layer), stored contiguously.
    pub fn put_parts(&self, key: &str, parts: &[&[u8]], cfg: &ReplicateConfig) -> Result<()> {
        let mut out = self.batch_put(&[(key, parts.to_vec())], cfg);
        out.pop().unwrap_or(Err(ClientError::Closed))
    }

    /// Puts many objects: one BatchPutStart, all bytes in one transfer batch, one BatchPutEnd.
    pub fn batch_put(
        &self,
        items: &[(&str, Vec<&[u8]>)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        let _span = op_span("put", items.len()).entered();
        let mut results: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        if self.check_open().is_err() {
            return items.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let mut started = Vec::new();
        let mut pb_items = Vec::new();
        for (i, (key, parts)) in items.iter().enumerate() {
            let size: u64 = parts.iter().map(|p| p.len() as u64).sum();
            if let Err(e) = validate_key(key) {
                results[i] = Some(Err(e.into()));
            } else if size == 0 {
                results[i] = Some(Err(ClientError::InvalidParams(format!(
                    "object '{key}' has size 0: store at least one byte"
                ))));
            } else {
                started.push((i, size));
                pb_items.push(pb::PutStartItem {
                    key: (*key).to_owned(),
                    size,
                });
            }
        }
        if !pb_items.is_empty() {
            let req = pb::BatchPutStartRequest {
                client_id: self.client_id.clone(),
                items: pb_items,
                config: Some(self.replicate_config(cfg)),
            };
            match self.rpc(|mut m| {
                let req = req.clone();
                async move { m.batch_put_start(req).await }
            }) {
                Err(e) => {
                    let msg = e.to_string();
                    for (i, _) in &started {
                        results[*i] = Some(Err(ClientError::Rpc {
                            addr: self.opts.master_server_address.clone(),
                            message: msg.clone(),
                        }));
                    }
                }
                Ok(resp) => self.finish_puts(items, &started, resp.results, &mut results),
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ClientError::Closed)))
            .collect()
    }

    fn finish_puts(
        &self,
        items: &[(&str, Vec<&[u8]>)],
        started: &[(usize, u64)],
        placements: Vec<pb::PutStartResponse>,
        results: &mut [Option<Result<()>>],
    ) {
        // Per started item: its location, and the index range of its write requests.
        let mut locs: Vec<Option<Location>> = Vec::with_capacity(started.len());
        for (j, (i, size)) in started.iter().enumerate() {
            let key = items[*i].0;
            let loc = match placements.get(j) {
                None => Err(ClientError::Rpc {
                    addr: self.opts.master_server_address.clone(),
                    message: "master answered fewer results than items".to_owned(),
                }),
                Some(p) if p.code != 0 => {
                    Err(ClientError::from_item(key, *size, p.code, &p.message))
                }
                Some(p) => Location::from_put(p, *size).map_err(|m| ClientError::Rpc {
                    addr: self.opts.master_server_address.clone(),
                    message: format!("bad placement for '{key}': {m}"),
                }),
            };
            match loc {
                Ok(l) => locs.push(Some(l)),
                Err(e) => {
                    results[*i] = Some(Err(e));
                    locs.push(None);
                }
            }
        }
        let mut reqs = Vec::new();
        let mut owner = Vec::new();
        for (j, (i, _)) in started.iter().enumerate() {
            let Some(loc) = &locs[j] else { continue };
            let (key, parts) = &items[*i];
            for r in &loc.replicas {
                reqs.push(TransferRequest::Write {
                    target: &r.target,
                    generation: loc.generation,
                    key,
                    offset: r.offset,
                    src: parts.clone(),
                });
                owner.push(j);
            }
        }
        let outcomes = if reqs.len() == 1 {
            vec![self.engine.execute(&mut reqs[0])]
        } else {
            self.engine.batch(&mut reqs)
        };
        let mut failed: Vec<Option<TransferError>> = (0..started.len()).map(|_| None).collect();
        for (k, r) in outcomes.into_iter().enumerate() {
            if let Err(e) = r {
                failed[owner[k]].get_or_insert(e);
            }
        }
        let mut end_keys = Vec::new();
        let mut end_idx = Vec::new();
        let mut revoke_keys = Vec::new();
        for (j, (i, _)) in started.iter().enumerate() {
            if locs[j].is_none() {
                continue;
            }
            let key = items[*i].0;
            match failed[j].take() {
                Some(e) => {
                    revoke_keys.push(key.to_owned());
                    results[*i] = Some(Err(ClientError::Transfer {
                        key: key.to_owned(),
                        source: e,
                    }));
                }
                None => {
                    end_keys.push(key.to_owned());
                    end_idx.push(j);
                }
            }
        }
        if !revoke_keys.is_empty() {
            let req = pb::BatchKeysRequest {
                client_id: self.client_id.clone(),
                keys: revoke_keys,
            };
            // Best effort: a put never ended is reclaimed by the master's discard timeout anyway.
            if let Err(e) = self.rpc(|mut m| {
                let req = req.clone();
                async move { m.batch_put_revoke(req).await }
            }) {
                tracing::warn!(error = %e, "put revoke failed; the master reclaims the space after its discard timeout");
            }
        }
        if end_keys.is_empty() {
            return;
        }
        let req = pb::BatchKeysRequest {
            client_id: self.client_id.clone(),
            keys: end_keys,
        };
        // Keys whose PutEnd did not succeed are revoked: a put is either published or
        // abandoned, never left half-visible. After an HA failover the new leader may not know
        // the put at all (its PutEnd fails with "not found"); the revoke is then a no-op and the
        // bytes at the owner stay unpublished until the space is reused.
        let mut unpublished = Vec::new();
        match self.rpc(|mut m| {
            let req = req.clone();
            async move { m.batch_put_end(req).await }
        }) {
            Err(e) => {
                let msg = e.to_string();
                for j in end_idx {
                    unpublished.push(items[started[j].0].0.to_owned());
                    results[started[j].0] = Some(Err(ClientError::Rpc {
                        addr: self.opts.master_server_address.clone(),
                        message: msg.clone(),
                    }));
                }
            }
            Ok(resp) => {
                for (n, j) in end_idx.into_iter().enumerate() {
                    let (i, size) = started[j];
                    let key = items[i].0;
                    let r = match resp.results.get(n) {
                        Some(r) if r.code == 0 => {
                            if let Some(loc) = locs[j].take() {
                                self.cache.insert(key, loc);
                            }
                            Ok(())
                        }
                        Some(r) => Err(ClientError::from_item(key, size, r.code, &r.message)),
                        None => Err(ClientError::Rpc {
                            addr: self.opts.master_server_address.clone(),
                            message: "master answered fewer results than items".to_owned(),
                        }),
                    };
                    if r.is_err() {
                        unpublished.push(key.to_owned());
                    }
                    results[i] = Some(r);
                }
            }
        }
        if !unpublished.is_empty() && self.master.is_ha() {
            let req = pb::BatchKeysRequest {
                client_id: self.client_id.clone(),
                keys: unpublished,
            };
            if let Err(e) = self.rpc(|mut m| {
                let req = req.clone();
                async move { m.batch_put_revoke(req).await }
            }) {
                tracing::warn!(error = %e, "revoking unpublished puts failed; the master reclaims them after its discard timeout");
            }
        }
    }

    // === gets ===

    /// Returns the object's bytes.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let _span = op_span("get", 1).entered();
        self.check_open()?;
        validate_key(key)?;
        for attempt in 0..READ_ATTEMPTS {
            let loc = self.resolve(key, attempt > 0)?;
            let mut buf = vec![0u8; loc.size as usize];
            match self.read_replicas(key, &loc, &mut [&mut buf[..]]) {
                Ok(()) => return Ok(buf),
                Err(ReadError::Stale) => continue,
                // A cached location may name an owner that is gone: ask the master once.
                Err(ReadError::Failed(_)) if attempt == 0 => continue,
                Err(ReadError::Failed(e)) => return Err(e),
            }
        }
        Err(ClientError::ObjectNotFound(key.to_owned()))
    }

    /// Reads the object into `buf` (no intermediate copy) and returns its size.
    pub fn get_into(&self, key: &str, buf: &mut [u8]) -> Result<u64> {
        self.get_into_parts(key, &mut [buf])
    }

    /// Reads the object into several buffers in order (vLLM: one per layer). Their total length
    /// must be at least the object's size.
    pub fn get_into_parts(&self, key: &str, dst: &mut [&mut [u8]]) -> Result<u64> {
        let _span = op_span("get", 1).entered();
        self.check_open()?;
        validate_key(key)?;
        for attempt in 0..READ_ATTEMPTS {
            let loc = self.resolve(key, attempt > 0)?;
            let have: u64 = dst.iter().map(|d| d.len() as u64).sum();
            let mut trimmed = trim(dst, loc.size).ok_or_else(|| ClientError::BufferTooSmall {
                key: key.to_owned(),
                need: loc.size,
                have,
            })?;
            match self.read_replicas(key, &loc, &mut trimmed) {
                Ok(()) => return Ok(loc.size),
                Err(ReadError::Stale) => continue,
                Err(ReadError::Failed(_)) if attempt == 0 => continue,
                Err(ReadError::Failed(e)) => return Err(e),
            }
        }
        Err(ClientError::ObjectNotFound(key.to_owned()))
    }

    /// Gets many objects into caller buffers; one master round trip for the keys not cached,
    /// then one transfer batch.
    pub fn batch_get_into(&self, keys: &[&str], dsts: &mut [Vec<&mut [u8]>]) -> Vec<Result<u64>> {
        assert_eq!(keys.len(), dsts.len(), "one destination list per key");
        let _span = op_span("batch_get", keys.len()).entered();
        let mut results: Vec<Option<Result<u64>>> = (0..keys.len()).map(|_| None).collect();
        if self.check_open().is_err() {
            return keys.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let mut locs: Vec<Option<Arc<Location>>> = vec![None; keys.len()];
        let mut misses = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if let Err(e) = validate_key(key) {
                results[i] = Some(Err(e.into()));
                continue;
            }
            match self.cache.get(key) {
                Some(l) => locs[i] = Some(l),
                None => misses.push(i),
            }
        }
        self.lookup_many(keys, &misses, &mut locs, &mut results);

        // One transfer batch over the first replica of each object; anything that fails
        // (stale, owner gone) goes through the single-object path, which refreshes and tries
        // the other replicas.
        let mut retry = Vec::new();
        {
            let mut reqs = Vec::new();
            let mut idx = Vec::new();
            for (i, dst) in dsts.iter_mut().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                let Some(loc) = &locs[i] else { continue };
                let have: u64 = dst.iter().map(|d| d.len() as u64).sum();
                let Some(trimmed) = trim(dst, loc.size) else {
                    results[i] = Some(Err(ClientError::BufferTooSmall {
                        key: keys[i].to_owned(),
                        need: loc.size,
                        have,
                    }));
                    continue;
                };
                let r = &loc.replicas[self.preferred_replica(loc)];
                if r.disk {
                    // Disk-only: the single-object path asks the owner to LOAD it.
                    retry.push(i);
                    continue;
                }
                reqs.push(TransferRequest::Read {
                    target: &r.target,
                    generation: loc.generation,
                    offset: r.offset,
                    dst: trimmed,
                });
                idx.push(i);
            }
            let outcomes = self.engine.batch(&mut reqs);
            for (n, r) in outcomes.into_iter().enumerate() {
                let i = idx[n];
                let loc = locs[i].as_ref().map(|l| (l.generation, l.size));
                match (r, loc) {
                    (Ok(()), Some((_, size))) => results[i] = Some(Ok(size)),
                    (Err(_), Some((generation, _))) => {
                        self.cache.invalidate(keys[i], Some(generation));
                        retry.push(i);
                    }
                    _ => retry.push(i),
                }
            }
        }
        for i in retry {
            results[i] = Some(self.get_into_parts(keys[i], &mut dsts[i]));
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ClientError::Closed)))
            .collect()
    }

    /// Gets many objects as owned bytes.
    pub fn batch_get(&self, keys: &[&str]) -> Vec<Result<Vec<u8>>> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    fn lookup_many(
        &self,
        keys: &[&str],
        misses: &[usize],
        locs: &mut [Option<Arc<Location>>],
        results: &mut [Option<Result<u64>>],
    ) {
        if misses.is_empty() {
            return;
        }
        let req = pb::BatchGetReplicaListRequest {
            client_id: self.client_id.clone(),
            keys: misses.iter().map(|&i| keys[i].to_owned()).collect(),
        };
        match self.rpc(|mut m| {
            let req = req.clone();
            async move { m.batch_get_replica_list(req).await }
        }) {
            Err(e) => {
                let msg = e.to_string();
                for &i in misses {
                    results[i] = Some(Err(ClientError::Rpc {
                        addr: self.opts.master_server_address.clone(),
                        message: msg.clone(),
                    }));
                }
            }
            Ok(resp) => {
                for (n, &i) in misses.iter().enumerate() {
                    match resp
                        .results
                        .get(n)
                        .map(|l| self.accept_location(keys[i], l))
                    {
                        Some(Ok(l)) => locs[i] = Some(l),
                        Some(Err(e)) => results[i] = Some(Err(e)),
                        None => {
                            results[i] = Some(Err(ClientError::Rpc {
                                addr: self.opts.master_server_address.clone(),
                                message: "master answered fewer results than keys".to_owned(),
                            }))
                        }
                    }
                }
            }
        }
    }

    /// The cached location, or the master's answer (which is then cached).
    fn resolve(&self, key: &str, refresh: bool) -> Result<Arc<Location>> {
        if !refresh && let Some(l) = self.cache.get(key) {
            return Ok(l);
        }
        let req = pb::GetReplicaListRequest {
            client_id: self.client_id.clone(),
            key: key.to_owned(),
        };
        let resp = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.get_replica_list(req).await }
        })?;
        self.accept_location(key, &resp)
    }

    fn accept_location(&self, key: &str, l: &pb::ObjectLocation) -> Result<Arc<Location>> {
        if l.code != 0 {
            self.cache.invalidate(key, None);
            return Err(ClientError::from_item(key, l.size, l.code, &l.message));
        }
        let loc = Location::try_from(l).map_err(|m| ClientError::Rpc {
            addr: self.opts.master_server_address.clone(),
            message: format!("bad location for '{key}': {m}"),
        })?;
        self.cache.insert(key, loc);
        self.cache
            .get(key)
            .ok_or_else(|| ClientError::ObjectNotFound(key.to_owned()))
    }

    /// Our own segment first (a plain memcpy), then same-host replicas (memcpy + a round trip).
    fn preferred_replica(&self, loc: &Location) -> usize {
        let find = |f: &dyn Fn(&lunakv_transfer::Target) -> bool| {
            loc.replicas.iter().position(|r| !r.disk && f(&r.target))
        };
        find(&|t| self.engine.is_local(t))
            .or_else(|| find(&|t| self.engine.uses_shm(t)))
            .unwrap_or(0)
    }

    fn read_replicas(
        &self,
        key: &str,
        loc: &Location,
        dst: &mut [&mut [u8]],
    ) -> std::result::Result<(), ReadError> {
        let first = self.preferred_replica(loc);
        let order = std::iter::once(first).chain((0..loc.replicas.len()).filter(|&i| i != first));
        let mut last = None;
        let mut stale = false;
        for i in order {
            let r = &loc.replicas[i];
            let got = if r.disk {
                self.engine.load(&r.target, loc.generation, dst)
            } else {
                self.engine.read(&r.target, loc.generation, r.offset, dst)
            };
            match got {
                Ok(()) => return Ok(()),
                Err(TransferError::Stale { .. }) => stale = true,
                Err(e) => {
                    tracing::debug!(key, replica = %r.segment_name, error = %e, "replica read failed; trying the next");
                    last = Some(e);
                }
            }
        }
        self.cache.invalidate(key, Some(loc.generation));
        match last {
            Some(e) if !stale => Err(ReadError::Failed(ClientError::Transfer {
                key: key.to_owned(),
                source: e,
            })),
            _ => Err(ReadError::Stale),
        }
    }

    // === metadata ===

    pub fn exists(&self, key: &str) -> Result<bool> {
        self.batch_exists(&[key])
            .pop()
            .unwrap_or(Err(ClientError::Closed))
    }

    /// Like upstream, existence grants a lease; the answer also warms the location cache so the
    /// get that usually follows skips the master.
    pub fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.per_key(
            keys,
            |keys| {
                let req = pb::BatchExistKeyRequest {
                    client_id: self.client_id.clone(),
                    keys,
                };
                self.rpc(|mut m| {
                    let req = req.clone();
                    async move { m.batch_exist_key(req).await }
                })
                .map(|r| r.results)
            },
            |key, l| match ErrorCode::from_i32(l.code) {
                ErrorCode::Ok => {
                    if let Ok(loc) = Location::try_from(l) {
                        self.cache.insert(key, loc);
                    }
                    Ok(true)
                }
                ErrorCode::ObjectNotFound => {
                    self.cache.invalidate(key, None);
                    Ok(false)
                }
                _ => Err(ClientError::from_item(key, 0, l.code, &l.message)),
            },
        )
    }

    /// One BatchGetReplicaList for `keys`.
    fn batch_locations(&self, keys: Vec<String>) -> Result<Vec<pb::ObjectLocation>> {
        let req = pb::BatchGetReplicaListRequest {
            client_id: self.client_id.clone(),
            keys,
        };
        self.rpc(|mut m| {
            let req = req.clone();
            async move { m.batch_get_replica_list(req).await }
        })
        .map(|r| r.results)
    }

    /// The shape of every per-key batch call: invalid keys fail alone, the valid ones go to the
    /// master in one `call`, and each answer is mapped by `each`. A failed call fails every key
    /// it carried; a short answer fails the keys it left out.
    fn per_key<T, R>(
        &self,
        keys: &[&str],
        call: impl FnOnce(Vec<String>) -> Result<Vec<R>>,
        each: impl Fn(&str, &R) -> Result<T>,
    ) -> Vec<Result<T>> {
        if self.check_open().is_err() {
            return keys.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let mut out: Vec<Option<Result<T>>> = (0..keys.len()).map(|_| None).collect();
        let mut ask = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match validate_key(k) {
                Ok(()) => ask.push(i),
                Err(e) => out[i] = Some(Err(e.into())),
            }
        }
        if !ask.is_empty() {
            let rpc_fail = |message: String| ClientError::Rpc {
                addr: self.opts.master_server_address.clone(),
                message,
            };
            match call(ask.iter().map(|&i| keys[i].to_owned()).collect()) {
                Err(e) => {
                    let msg = e.to_string();
                    for &i in &ask {
                        out[i] = Some(Err(rpc_fail(msg.clone())));
                    }
                }
                Ok(results) => {
                    for (n, &i) in ask.iter().enumerate() {
                        out[i] = Some(match results.get(n) {
                            Some(r) => each(keys[i], r),
                            None => Err(rpc_fail(
                                "master answered fewer results than keys".to_owned(),
                            )),
                        });
                    }
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or(Err(ClientError::Closed)))
            .collect()
    }

    /// Every replica of each object as the master reports it, disk tiers included
    /// ([`Location`] keeps memory replicas only). One master round trip; backs the Python
    /// `batch_get_replica_desc`, which vLLM probes for the tier an object lives in.
    pub fn batch_replicas(&self, keys: &[&str]) -> Vec<Result<Vec<pb::Replica>>> {
        self.per_key(
            keys,
            |keys| self.batch_locations(keys),
            |key, l| match l.code {
                0 => Ok(l.replicas.clone()),
                code => Err(ClientError::from_item(key, l.size, code, &l.message)),
            },
        )
    }

    /// The object's size in bytes (asks the master: sizes are cheap and must not be stale).
    pub fn get_size(&self, key: &str) -> Result<u64> {
        self.check_open()?;
        validate_key(key)?;
        let req = pb::ExistKeyRequest {
            client_id: self.client_id.clone(),
            key: key.to_owned(),
        };
        let l = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.exist_key(req).await }
        })?;
        if l.code != 0 {
            return Err(ClientError::from_item(key, 0, l.code, &l.message));
        }
        Ok(l.size)
    }

    pub fn remove(&self, key: &str, force: bool) -> Result<()> {
        self.batch_remove(&[key], force)
            .pop()
            .unwrap_or(Err(ClientError::Closed))
    }

    pub fn batch_remove(&self, keys: &[&str], force: bool) -> Vec<Result<()>> {
        for k in keys {
            self.cache.invalidate(k, None);
        }
        self.per_key(
            keys,
            |keys| {
                let req = pb::BatchRemoveRequest {
                    client_id: self.client_id.clone(),
                    keys,
                    force,
                };
                self.rpc(|mut m| {
                    let req = req.clone();
                    async move { m.batch_remove(req).await }
                })
                .map(|r| r.results)
            },
            |key, r| match r.code {
                0 => Ok(()),
                code => Err(ClientError::from_item(key, 0, code, &r.message)),
            },
        )
    }

    /// Removes every object (leased ones too when `force`); returns how many were removed.
    pub fn remove_all(&self, force: bool) -> Result<u64> {
        self.check_open()?;
        self.cache.clear();
        let req = pb::RemoveAllRequest {
            client_id: self.client_id.clone(),
            force,
        };
        let r = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.remove_all(req).await }
        })?;
        if r.code != 0 {
            return Err(ClientError::from_item("*", 0, r.code, &r.message));
        }
        Ok(r.removed)
    }

    /// Records a caller buffer that transfers will use. tcp and shm need no registration; it is
    /// kept so misuse (overlaps, unknown buffers) is reported the same way RDMA will need. A GPU
    /// buffer (vLLM registers its CUDA KV cache) is classified here once, so pieces inside it
    /// are copied by DMA without a driver call per piece (docs/GPU.md). Buffers given to
    /// `put_parts` / `get_into_parts` / `batch_*` may be device memory whether registered or not.
    pub fn register_buffer(&self, ptr: usize, len: usize) -> Result<()> {
        if ptr == 0 || len == 0 {
            return Err(ClientError::InvalidParams(format!(
                "register_buffer(ptr={ptr:#x}, size={len}): pointer and size must be non-zero"
            )));
        }
        let mut b = self.buffers.lock();
        let end = ptr.checked_add(len).ok_or_else(|| {
            ClientError::InvalidParams(format!(
                "register_buffer(ptr={ptr:#x}, size={len}) wraps the address space"
            ))
        })?;
        if let Some((&p, &l)) = b.range(..end).next_back()
            && p + l > ptr
        {
            return Err(ClientError::InvalidParams(format!(
                "buffer {ptr:#x}+{len} overlaps the registered buffer {p:#x}+{l}: unregister it first"
            )));
        }
        b.insert(ptr, len);
        let kind = lunakv_transfer::device::register_range(ptr, len);
        tracing::debug!(ptr, len, ?kind, "buffer registered");
        Ok(())
    }

    pub fn unregister_buffer(&self, ptr: usize) -> Result<()> {
        self.buffers
            .lock()
            .remove(&ptr)
            .map(|_| ())
            .ok_or_else(|| {
                ClientError::InvalidParams(format!("buffer {ptr:#x} was never registered"))
            })?;
        lunakv_transfer::device::unregister_range(ptr);
        Ok(())
    }

    /// Stops the heartbeat and, in embedded mode, unmounts this client's segment. Idempotent.
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let _ = self.heartbeat_stop.send(true);
        // The device layer forgets this client's buffers (their memory may be freed next).
        for (&ptr, _) in std::mem::take(&mut *self.buffers.lock()).iter() {
            lunakv_transfer::device::unregister_range(ptr);
        }
        if let Some(h) = self.host.lock().take() {
            self.engine.detach_local(h.server());
            self.rt.block_on(h.shutdown())?;
        }
        Ok(())
    }

    /// The master's view of the pool: segments, capacity, usage, keys, clients (`lunakv status`).
    /// Follows the HA leader like every other call.
    pub fn cluster_status(&self) -> Result<pb::ClusterStatus> {
        self.check_open()?;
        self.rpc(|mut m| async move { m.get_cluster_status(pb::GetClusterStatusRequest {}).await })
    }

    /// Asks the master to move `key`'s DRAM copy to its owner's disk tier now (the SSD tier
    /// probe of `lunakv doctor`). Returns once the owner made the bytes durable.
    pub fn offload_key(&self, key: &str) -> Result<()> {
        self.check_open()?;
        validate_key(key)?;
        let req = pb::OffloadKeyRequest {
            client_id: self.client_id.clone(),
            key: key.to_owned(),
        };
        let r = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.offload_key(req).await }
        })?;
        // The location changed (DRAM -> disk): forget the cached one.
        self.cache.invalidate(key, None);
        if r.code != 0 {
            return Err(ClientError::from_item(key, 0, r.code, &r.message));
        }
        Ok(())
    }

    /// The master's per key namespace bookkeeping (cross-instance key consistency).
    pub fn namespace_stats(&self) -> Result<pb::NamespaceStatsResponse> {
        self.check_open()?;
        self.rpc(
            |mut m| async move { m.get_namespace_stats(pb::GetNamespaceStatsRequest {}).await },
        )
    }

    // === plumbing ===

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
        }
    }

    /// One master call; with an etcd master address it retries across a leader failover
    /// (`call` runs once per attempt, so it clones its request).
    fn rpc<T, F, Fut>(&self, call: F) -> Result<T>
    where
        F: Fn(crate::host::Rpc) -> Fut,
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
