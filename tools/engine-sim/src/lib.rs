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
//! - Simulated GPU time ([`ServiceTime`], `--prefill-us-per-token`, `--decode-us-per-token`) is
//!   an async sleep, never CPU work: a real engine's host CPU mostly waits for its GPU, so a
//!   benchmark of a proxy in front of it must not make the engine compete for the CPU. Both are
//!   0 by default, so tests run at full speed.
//! - Idle keep-alive as uvicorn's (`--timeout-keep-alive-ms`, 5 s like vLLM): see [`server`].
//! - Multi-port data parallelism (`--data-parallel-size`): see [`run`].
//!
//! `GET /sim/stats` reports counters (KV bytes sent/received, local prefills, transfers, HTTP
//! connections and who closed them) that tests use to prove the bytes really moved.
#![forbid(unsafe_code)]

pub mod api;
pub mod args;
pub mod client;
pub mod kv;
pub mod pd;
pub mod server;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lunakv_telemetry::metrics::register;
use lunakv_transfer::{
    MemoryRegistry, RegionServer, RegionServerConfig, TransferEngine, TransferOptions,
};
use prometheus::{IntCounter, IntGauge, Registry};
use serde_json::json;

pub use args::SimArgs;
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
    /// The first data-parallel rank this process serves.
    pub dp_rank: u32,
    /// Data-parallel ranks served (multi-port: rank i on `port + i`).
    pub data_parallel_size: u32,
    /// Where a prefill engine registers (`http://host:port`); `None` = do not register.
    pub bootstrap: Option<String>,
    pub lease: Duration,
    pub shape: KvShape,
    /// Simulated GPU time per prompt token of a local or remote-serving prefill (see
    /// [`ServiceTime`]).
    pub service: ServiceTime,
    /// Idle HTTP keep-alive: a connection with no request for this long is closed, as
    /// vLLM's uvicorn does (`--timeout-keep-alive`, 5 s by default).
    pub keep_alive: Duration,
    /// How long a prefill keeps parked KV, and a side-channel request waits for its prefill.
    pub transfer_timeout: Duration,
}

/// Simulated GPU time, spent as an async sleep (the host CPU stays free, as it does while a real
/// engine waits for its GPU). Zero by default, so tests run at full speed.
///
/// The model is vLLM's: a prefill forward covers the whole prompt and yields the first token,
/// so time to first token is `prompt_tokens * prefill_per_token`, and every further token costs
/// one decode step. A decoder that received the prompt's KV from a remote prefill skips the
/// prefill but spends one decode step on its first token too. Concurrent requests sleep
/// concurrently, like sequences sharing a batch on a GPU that is not saturated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServiceTime {
    pub prefill_per_token: Duration,
    pub decode_per_token: Duration,
}

impl ServiceTime {
    /// Time of a prefill over `prompt_tokens`.
    pub fn prefill(&self, prompt_tokens: usize) -> Duration {
        self.prefill_per_token
            .saturating_mul(u32::try_from(prompt_tokens).unwrap_or(u32::MAX))
    }

    /// Time of `n` decode steps.
    pub fn decode(&self, n: usize) -> Duration {
        self.decode_per_token
            .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
    }
}

/// Counters behind `/sim/stats`; those also served at `/metrics` are prometheus metrics in
/// [`Stats::registry`], the rest plain atomics.
pub struct Stats {
    /// The `lunakv_engine_sim_*` families, labelled with this engine's role and id so that a
    /// prefill and a decode engine scraped under one job stay apart.
    pub registry: Registry,
    pub requests: IntCounter,
    pub remote_prefills_served: IntCounter,
    pub local_prefills: AtomicU64,
    pub remote_decodes: IntCounter,
    pub kv_bytes_sent: IntCounter,
    pub kv_bytes_received: IntCounter,
    pub transfers_ok: IntCounter,
    pub transfers_failed: IntCounter,
    pub inflight: IntGauge,
    /// HTTP connections accepted.
    pub connections: IntCounter,
    /// Connections this engine closed because they sat idle past its keep-alive.
    pub connections_closed_idle: AtomicU64,
    /// Connections the client closed (or that ended in an error other than the idle timeout).
    pub connections_closed_by_peer: AtomicU64,
    /// Requests that still carried the scheduler's `x-prefiller-host-port` (a proxy must strip
    /// it before forwarding).
    pub prefiller_header_seen: AtomicU64,
    /// Remote-decode prefill requests that asked to stream or for more than one token (a proxy
    /// must send `stream: false`, `max_tokens: 1`).
    pub prefill_requests_not_minimal: AtomicU64,
    /// The `x-request-id` of the last generate request.
    pub last_request_id: parking_lot::Mutex<String>,
    /// Requests to paths this simulator does not implement, by path (answered 404).
    pub unrouted: parking_lot::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl Stats {
    /// Zeroed counters of the engine `engine_id` serving as `role`.
    pub fn new(role: Role, engine_id: &str) -> Stats {
        let r = Registry::new();
        let labels = std::collections::HashMap::from([
            ("role".to_owned(), format!("{role:?}").to_lowercase()),
            ("engine_id".to_owned(), engine_id.to_owned()),
        ]);
        let opts = |name: &str, help: &str| {
            prometheus::Opts::new(format!("lunakv_engine_sim_{name}"), help)
                .const_labels(labels.clone())
        };
        let counter = |name: &str, help: &str| {
            register(
                &r,
                IntCounter::with_opts(opts(name, help)).expect("static metric definition"),
            )
        };
        Stats {
            requests: counter("requests_total", "Generate requests answered."),
            remote_prefills_served: counter(
                "remote_prefills_served_total",
                "Prefill requests served for a remote decoder.",
            ),
            local_prefills: AtomicU64::new(0),
            remote_decodes: counter(
                "remote_decodes_total",
                "Decodes whose KV came from a prefill engine.",
            ),
            kv_bytes_sent: counter("kv_sent_bytes_total", "KV bytes written to decoders."),
            kv_bytes_received: counter(
                "kv_received_bytes_total",
                "KV bytes received from prefill engines.",
            ),
            transfers_ok: counter("transfers_ok_total", "KV transfers that completed."),
            transfers_failed: counter("transfers_failed_total", "KV transfers that failed."),
            inflight: register(
                &r,
                IntGauge::with_opts(opts("inflight_requests", "Generate requests in progress."))
                    .expect("static metric definition"),
            ),
            connections: counter("connections_total", "HTTP connections accepted."),
            connections_closed_idle: AtomicU64::new(0),
            connections_closed_by_peer: AtomicU64::new(0),
            prefiller_header_seen: AtomicU64::new(0),
            prefill_requests_not_minimal: AtomicU64::new(0),
            last_request_id: parking_lot::Mutex::default(),
            unrouted: parking_lot::Mutex::default(),
            registry: r,
        }
    }
}

impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stats").finish_non_exhaustive()
    }
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
    /// Every data-parallel rank of this process, this one included (see [`run`]).
    pub dp_peers: std::sync::OnceLock<Vec<std::sync::Weak<Sim>>>,
}

impl Sim {
    /// The rank that serves `dp` in this process, if any.
    pub fn dp_peer(&self, dp: u32) -> Option<Arc<Sim>> {
        self.dp_peers
            .get()?
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .find(|s| s.cfg.dp_rank == dp)
    }

    /// The dp ranks this process serves.
    pub fn dp_ranks(&self) -> Vec<u32> {
        self.dp_peers
            .get()
            .into_iter()
            .flatten()
            .filter_map(std::sync::Weak::upgrade)
            .map(|s| s.cfg.dp_rank)
            .collect()
    }
}

impl Sim {
    /// [`Sim::stats_json`]'s counters as Prometheus families (`lunakv_engine_sim_*`, labelled
    /// with this engine's role and id).
    pub fn metrics_text(&self) -> String {
        lunakv_telemetry::render(&self.stats.registry)
    }

    pub fn stats_json(&self) -> serde_json::Value {
        let s = &self.stats;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let rs = self.region_server.stats();
        json!({
            "engine_id": self.cfg.engine_id,
            "dp_rank": self.cfg.dp_rank,
            "role": format!("{:?}", self.cfg.role).to_lowercase(),
            "requests": s.requests.get(),
            "remote_prefills_served": s.remote_prefills_served.get(),
            "local_prefills": g(&s.local_prefills),
            "remote_decodes": s.remote_decodes.get(),
            "kv_bytes_sent": s.kv_bytes_sent.get(),
            "kv_bytes_received": s.kv_bytes_received.get(),
            "region_bytes_written": rs.bytes_written,
            "transfers_ok": s.transfers_ok.get(),
            "transfers_failed": s.transfers_failed.get(),
            "inflight": s.inflight.get(),
            "connections": s.connections.get(),
            "connections_closed_idle": g(&s.connections_closed_idle),
            "connections_closed_by_peer": g(&s.connections_closed_by_peer),
            "parked_transfers": self.parked.len(),
            "registered": self.registered.load(Ordering::Relaxed),
            "prefiller_header_seen": g(&s.prefiller_header_seen),
            "prefill_requests_not_minimal": g(&s.prefill_requests_not_minimal),
            "last_request_id": *s.last_request_id.lock(),
            "unrouted": *s.unrouted.lock(),
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

/// Binds every data-parallel rank, prints one `lunakv-engine-sim listening http=..
/// transfer=.. role=.. engine_id=.. dp_rank=..` line per rank, and serves until `shutdown`
/// resolves.
///
/// With `data_parallel_size` N > 1 this is vLLM's multi-port data parallelism: rank
/// `dp_rank + i` serves on `port + i` (each its own free port when `port` is 0), has its own
/// engine id (`<engine_id>-dp<rank>`) and registers with the bootstrap under its own dp rank,
/// never all as rank 0 (vLLM #51531). Any rank's API server routes a request carrying
/// `X-data-parallel-rank` to that rank, as vLLM's internal load balancer does.
pub async fn run(
    cfg: SimConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    let n = cfg.data_parallel_size.max(1);
    let mut ranks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let mut c = cfg.clone();
        c.dp_rank = cfg.dp_rank + i;
        if cfg.port != 0 {
            c.port = cfg.port.checked_add(i as u16).ok_or_else(|| {
                SimError::Serve(format!(
                    "--port {} + --data-parallel-size {n} passes 65535",
                    cfg.port
                ))
            })?;
        }
        if n > 1 {
            c.engine_id = format!("{}-dp{}", cfg.engine_id, c.dp_rank);
        }
        ranks.push(start_rank(c).await?);
    }
    let all: Arc<[Arc<Sim>]> = ranks.iter().map(|(s, _)| s.clone()).collect();
    for (s, _) in &ranks {
        let _ = s.dp_peers.set(all.iter().map(Arc::downgrade).collect());
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut servers = Vec::new();
    let mut tasks = Vec::new();
    for (sim, listener) in ranks {
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
        lunakv_telemetry::announce(
            "lunakv-engine-sim",
            &[
                ("http", &sim.http_addr),
                ("transfer", &sim.region_endpoint),
                ("role", &format!("{:?}", sim.cfg.role).to_lowercase()),
                ("engine_id", &sim.cfg.engine_id),
                ("dp_rank", &sim.cfg.dp_rank),
            ],
        );
        let mut stop = stop_rx.clone();
        servers.push(tokio::spawn(server::serve(sim, listener, async move {
            let _ = stop.changed().await;
        })));
    }
    shutdown.await;
    let _ = stop_tx.send(true);
    for s in servers {
        let _ = s.await;
    }
    for t in tasks {
        t.abort();
    }
    for s in all.iter() {
        s.region_server.shutdown();
    }
    Ok(())
}

/// Binds one rank's HTTP listener and transfer region server.
async fn start_rank(cfg: SimConfig) -> Result<(Arc<Sim>, tokio::net::TcpListener), SimError> {
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
        region_endpoint,
        region_server,
        transfer: Arc::new(TransferEngine::new(TransferOptions::default())),
        client: client::JsonClient::default(),
        parked: pd::Parked::default(),
        stats: Stats::new(cfg.role, &cfg.engine_id),
        registered: AtomicBool::new(false),
        prefix_cache: parking_lot::Mutex::new(std::collections::HashSet::new()),
        dp_peers: std::sync::OnceLock::new(),
        cfg,
    });
    Ok((sim, listener))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dashboards and the sidecar's tests read these families: names, types, HELP texts and
    /// labels stay as they were.
    #[test]
    fn metrics_keep_their_names_types_help_and_labels() {
        let s = Stats::new(Role::Prefill, "e\"1");
        s.kv_bytes_sent.inc_by(7);
        let text = lunakv_telemetry::render(&s.registry);
        let labels = "{engine_id=\"e\\\"1\",role=\"prefill\"}";
        for line in [
            "# HELP lunakv_engine_sim_requests_total Generate requests answered.".to_owned(),
            "# TYPE lunakv_engine_sim_requests_total counter".to_owned(),
            "# HELP lunakv_engine_sim_kv_sent_bytes_total KV bytes written to decoders.".to_owned(),
            format!("lunakv_engine_sim_kv_sent_bytes_total{labels} 7"),
            "# TYPE lunakv_engine_sim_inflight_requests gauge".to_owned(),
            format!("lunakv_engine_sim_inflight_requests{labels} 0"),
            "# TYPE lunakv_engine_sim_connections_total counter".to_owned(),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
        assert_eq!(text.matches("# TYPE ").count(), 9, "{text}");
    }
}
