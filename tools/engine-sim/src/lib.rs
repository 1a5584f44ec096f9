//! # lunakv-engine-sim: a TEST DOUBLE of a vLLM engine
//!
//! This is **not** an inference engine. vLLM is a multi-GB install that takes minutes to start
//! on CPU, so lunakv's P/D tests and benchmarks run this simulator instead. It is faithful to
//! what a proxy and a KV transfer can observe:
//!
//! - OpenAI-compatible `POST /v1/completions` and `/v1/chat/completions`, streaming (SSE ending
//!   in `data: [DONE]`, usage chunk with `stream_options.include_usage`) and not; `GET /health`,
//!   `GET /v1/models`. Errors use vLLM's JSON shape.
//! - `kv_transfer_params` handled as vLLM's MooncakeConnector does (see [`pd`]): a prefill
//!   engine (`--role prefill`) registers with the bootstrap (renewing a lease), computes
//!   deterministic KV blocks from the prompt and parks them under `transfer_id`; a decode engine
//!   (`--role decode`) resolves `remote_engine_id` through `remote_bootstrap_addr`, registers a
//!   receive region with `lunakv-transfer`'s [`lunakv_transfer::RegionServer`], sends its block
//!   addresses over the side channel, and the prefill engine WRITES the blocks into that memory.
//!   NIXL-style params (`remote_host`/`remote_port`) use the same side channel.
//! - The decoder derives its output text from a checksum of the KV it holds ([`kv`]). Without
//!   remote prefill it computes the same KV itself, so the text is identical either way, and any
//!   wrong byte changes it. A failed transfer is an error, never a silent local recompute.
//! - Non-streaming responses carry `kv_transfer_params` (null, or the NIXL-style params a
//!   prefill returns); the Mooncake prefill response carries none.
//!
//! `GET /sim/stats` reports counters (KV bytes sent/received, local prefills, transfers) that
//! tests use to prove the bytes really moved.

pub mod api;
pub mod client;
pub mod kv;
pub mod pd;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lunakv_transfer::{
    MemoryRegistry, RegionServer, RegionServerConfig, TransferEngine, TransferOptions,
};
use serde_json::json;

pub use kv::KvShape;

/// What this engine does in a P/D pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Prefill,
    Decode,
    /// Both (a plain aggregated engine).
    Both,
}

/// Simulator settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub host: IpAddr,
    pub port: u16,
    pub role: Role,
    pub engine_id: String,
    pub model: String,
    pub dp_rank: u32,
    /// Where a prefill engine registers (`http://host:port`); `None` = do not register.
    pub bootstrap: Option<String>,
    pub lease: Duration,
    pub shape: KvShape,
    /// Delay per generated token.
    pub token_delay: Duration,
    /// How long a prefill keeps parked KV, and a side-channel request waits for its prefill.
    pub transfer_timeout: Duration,
}

/// Counters behind `/sim/stats`.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub remote_prefills_served: AtomicU64,
    pub local_prefills: AtomicU64,
    pub remote_decodes: AtomicU64,
    pub kv_bytes_sent: AtomicU64,
    pub kv_bytes_received: AtomicU64,
    pub transfers_ok: AtomicU64,
    pub transfers_failed: AtomicU64,
    pub inflight: AtomicU64,
}

/// The running simulator, shared by all handlers.
pub struct Sim {
    pub cfg: SimConfig,
    pub http_addr: SocketAddr,
    pub registry: Arc<MemoryRegistry>,
    pub region_server: RegionServer,
    pub region_endpoint: String,
    pub transfer: Arc<TransferEngine>,
    pub client: client::JsonClient,
    pub parked: pd::Parked,
    pub stats: Stats,
    pub registered: AtomicBool,
    /// Block hashes seen (the simulated prefix cache behind `cached_tokens`).
    pub prefix_cache: parking_lot::Mutex<std::collections::HashSet<u64>>,
}

impl Sim {
    pub fn stats_json(&self) -> serde_json::Value {
        let s = &self.stats;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let rs = self.region_server.stats();
        json!({
            "engine_id": self.cfg.engine_id,
            "role": format!("{:?}", self.cfg.role).to_lowercase(),
            "requests": g(&s.requests),
            "remote_prefills_served": g(&s.remote_prefills_served),
            "local_prefills": g(&s.local_prefills),
            "remote_decodes": g(&s.remote_decodes),
            "kv_bytes_sent": g(&s.kv_bytes_sent),
            "kv_bytes_received": g(&s.kv_bytes_received),
            "region_bytes_written": rs.bytes_written,
            "transfers_ok": g(&s.transfers_ok),
            "transfers_failed": g(&s.transfers_failed),
            "inflight": g(&s.inflight),
            "parked_transfers": self.parked.len(),
            "registered": self.registered.load(Ordering::Relaxed),
        })
    }
}

/// Errors starting the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("transfer setup failed: {0}")]
    Transfer(#[from] lunakv_transfer::TransferError),
    #[error("server error: {0}")]
    Serve(String),
}

/// Binds, prints `lunakv-engine-sim listening http=.. transfer=.. role=.. engine_id=..`, and
/// serves until `shutdown` resolves.
pub async fn run(
    cfg: SimConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    let addr = SocketAddr::new(cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| SimError::Bind { addr, source })?;
    let http_addr = listener
        .local_addr()
        .map_err(|e| SimError::Serve(e.to_string()))?;
    let registry = MemoryRegistry::new();
    let region_server = RegionServer::start(
        RegionServerConfig {
            bind: SocketAddr::new(cfg.host, 0),
            advertise_host: None,
        },
        registry.clone(),
    )?;
    let region_endpoint = region_server.endpoint().to_string();
    let sim = Arc::new(Sim {
        http_addr,
        registry,
        region_endpoint: region_endpoint.clone(),
        region_server,
        transfer: Arc::new(TransferEngine::new(TransferOptions::default())),
        client: client::JsonClient::default(),
        parked: pd::Parked::default(),
        stats: Stats::default(),
        registered: AtomicBool::new(false),
        prefix_cache: parking_lot::Mutex::new(std::collections::HashSet::new()),
        cfg,
    });
    let mut tasks = Vec::new();
    if sim.cfg.role != Role::Decode
        && let Some(b) = sim.cfg.bootstrap.clone()
    {
        tasks.push(tokio::spawn(pd::register_loop(sim.clone(), b)));
    }
    let s = sim.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            s.parked.sweep(s.cfg.transfer_timeout);
        }
    }));
    println!(
        "lunakv-engine-sim listening http={http_addr} transfer={region_endpoint} role={} engine_id={}",
        format!("{:?}", sim.cfg.role).to_lowercase(),
        sim.cfg.engine_id
    );
    let r = axum::serve(listener, api::router(sim.clone()))
        .with_graceful_shutdown(shutdown)
        .await;
    for t in tasks {
        t.abort();
    }
    sim.region_server.shutdown();
    r.map_err(|e| SimError::Serve(e.to_string()))
}
