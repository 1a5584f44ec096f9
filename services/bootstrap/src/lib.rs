//! # lunakv-bootstrap
//!
//! The P/D bootstrap service: where decode engines and the routing sidecar (`lunakv-sidecar`)
//! find a prefill engine's workers. Its HTTP API is exactly vLLM's MooncakeConnector bootstrap
//! server, so engines and sidecars cannot tell them apart:
//!
//! - `POST /register {engine_id, dp_rank, tp_rank, pp_rank, addr}` -> `{"status":"ok"}`; 400
//!   `{"detail": ...}` on an engine-id mismatch or a duplicate. An optional `lease_ttl_ms` field
//!   asks for a lease other than the default.
//! - `GET /query` -> `{"<dp>": {"engine_id": ..., "worker_addr": {"<tp>": {"<pp>": addr}}}}`.
//! - `GET /health` -> 200.
//!
//! A gRPC API (`proto/lunakv/bootstrap.proto`) offers Register / Query / Deregister / Watch.
//!
//! ## Leases (what upstream lacks, llm-d #2187)
//! Every registration carries a lease (default [`DEFAULT_LEASE`], `--lease-ttl`; a request's
//! `lease_ttl_ms` may ask for 1 ms ..= [`MAX_LEASE`], anything else is refused naming the field).
//! It is renewed by registering the same worker again (the engine's heartbeat; lunakv's engine
//! simulator does this) or, for engines that register once and never again (vLLM), by the
//! prober: every `lease/3` the service opens a TCP connection to each worker's side-channel
//! `addr` and renews the lease if it connects (`--probe-workers=false` turns this off).
//!
//! The prober only dials an `addr` on the registering peer's own host, as checked when it
//! registered ([`state::on_peer_host`]): an `ip:port` whose IP is the source IP of the
//! registering connection, or, for a peer on loopback, one of this host's interface addresses
//! (vLLM's workers post to the bootstrap at 127.0.0.1 or their own IP and name their pod IP).
//! Any other `addr` (another host, 127.0.0.2 from 127.0.0.1, a name) is accepted but never
//! probed, with a warning and `lunakv_bootstrap_registrations_unprobed_total`: its lease lapses
//! unless it registers again. Otherwise any peer could make the service dial any address every
//! few seconds (SSRF, port scans). `--probe-any-host=true` restores dialling every `addr`, for
//! deployments where NAT hides the engines' addresses and only trusted peers reach the service.
//!
//! ## Limits
//! At most `--max-registrations` (4096) live workers, and `--max-registrations-per-peer` (256)
//! first registered from one source IP; a new worker beyond either is refused (HTTP 507 or 429
//! with a `detail` naming the limit and its flag; gRPC RESOURCE_EXHAUSTED) and counted in
//! `lunakv_bootstrap_registrations_over_limit_total`. Renewals are never refused, and workers
//! already registered keep answering `/query`. A dead engine therefore
//! disappears one lease after it stops answering, and a restarted prefill engine with a new
//! engine id is accepted when either its old lease lapsed or it registers on the same address
//! as the old one (restart in place); see [`state`] for the exact rules.
//!
//! ## Binding
//! Listeners bind exactly `--host` (default 127.0.0.1; upstream binds 0.0.0.0, pass
//! `--host 0.0.0.0` for that). The HTTP port is `--port`, else `MOONCAKE_BOOTSTRAP_PORT`, else
//! `VLLM_MOONCAKE_BOOTSTRAP_PORT`, else 8998; gRPC is `--grpc-port` (default 8999). Once bound
//! the binary prints `lunakv-bootstrap listening http=IP:PORT grpc=IP:PORT`.
//!
//! ## State
//! Embedded by default ([`MemoryState`]). With `--etcd-endpoints` the table lives in etcd
//! ([`SharedState`] over `lunakv-meta`'s MetaStore, keys under
//! `mooncake-store/<--cluster-id>/bootstrap/<--group>/`), so several replicas serve one set of
//! registrations: register through one, query through another; leases, replacement and
//! expiry behave as on one server.

mod api;
pub mod cli;
pub mod grpc;
pub mod http;
pub mod shared;
pub mod state;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

pub use api::lease_from_request;
pub use cli::BootstrapArgs;
pub use shared::SharedState;
pub use state::{
    BootstrapState, Limits, MemoryState, Origin, ProbeTarget, RegisterError, StateError, Table,
    Worker,
};

/// Lease granted when the request names none.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// Longest lease a registration may ask for (`lease_ttl_ms`) or `--lease-ttl` may set: a worker
/// that dies keeps its table entry at most this long.
pub const MAX_LEASE: Duration = Duration::from_secs(3600);
/// vLLM's default bootstrap port.
pub const DEFAULT_HTTP_PORT: u16 = 8998;
pub const DEFAULT_GRPC_PORT: u16 = 8999;

/// Errors starting or running the service.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("cannot bind {addr}: {source}; the port is in use or the host is not local")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("server error: {0}")]
    Serve(String),
}

/// Resolved configuration.
#[derive(Debug, Clone)]
pub struct BootstrapConfig {
    pub host: IpAddr,
    pub http_port: u16,
    pub grpc_port: u16,
    pub lease: Duration,
    /// Renew leases of workers whose side-channel address accepts a TCP connection.
    pub probe_workers: bool,
    /// Also probe addresses that are not on the registering peer's host (see the crate docs).
    pub probe_any_host: bool,
    /// The table's bounds (the table enforces them; here for `/metrics`).
    pub limits: Limits,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        BootstrapConfig {
            host: IpAddr::from([127, 0, 0, 1]),
            http_port: DEFAULT_HTTP_PORT,
            grpc_port: DEFAULT_GRPC_PORT,
            lease: DEFAULT_LEASE,
            probe_workers: true,
            probe_any_host: false,
            limits: Limits::DEFAULT,
        }
    }
}

impl BootstrapConfig {
    /// Checks what clap cannot; the message names the flag.
    pub fn validate(&self) -> Result<(), BootstrapError> {
        if self.lease.is_zero() || self.lease > MAX_LEASE {
            return Err(BootstrapError::Config(format!(
                "--lease-ttl={:?} is out of range: 1ms..={}s",
                self.lease,
                MAX_LEASE.as_secs()
            )));
        }
        for (flag, v) in [
            ("--max-registrations", self.limits.max_registrations),
            ("--max-registrations-per-peer", self.limits.max_per_peer),
        ] {
            if v == 0 {
                return Err(BootstrapError::Config(format!(
                    "{flag}=0 would refuse every registration; it must be at least 1"
                )));
            }
        }
        Ok(())
    }
}

/// The HTTP port from the environment: `MOONCAKE_BOOTSTRAP_PORT`, then
/// `VLLM_MOONCAKE_BOOTSTRAP_PORT`. `env` is a lookup (tests pass a map, not the process env).
pub fn port_from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<u16>, BootstrapError> {
    for var in ["MOONCAKE_BOOTSTRAP_PORT", "VLLM_MOONCAKE_BOOTSTRAP_PORT"] {
        if let Some(v) = env(var) {
            return v.trim().parse::<u16>().map(Some).map_err(|_| {
                BootstrapError::Config(format!("{var}={v} is not a port (0..65535)"))
            });
        }
    }
    Ok(None)
}

/// Go durations (`500ms`, `1m30s`) or a bare number of seconds.
pub use lunakv_config::parse_duration;

/// Bound listeners (bind first, then report the real addresses).
pub struct Listeners {
    pub http: TcpListener,
    pub grpc: TcpListener,
}

impl Listeners {
    pub async fn bind(cfg: &BootstrapConfig) -> Result<Listeners, BootstrapError> {
        let bind = |port| async move {
            let addr = SocketAddr::new(cfg.host, port);
            TcpListener::bind(addr)
                .await
                .map_err(|source| BootstrapError::Bind { addr, source })
        };
        Ok(Listeners {
            http: bind(cfg.http_port).await?,
            grpc: bind(cfg.grpc_port).await?,
        })
    }
}

/// Serves both APIs until `shutdown` resolves, then drains.
pub async fn serve(
    cfg: BootstrapConfig,
    listeners: Listeners,
    state: Arc<dyn BootstrapState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), BootstrapError> {
    let local = |l: &TcpListener| {
        l.local_addr()
            .map_err(|e| BootstrapError::Serve(e.to_string()))
    };
    let http_addr = local(&listeners.http)?;
    let grpc_addr = local(&listeners.grpc)?;
    // mTLS on the gRPC port (LUNAKV_TLS_*; docs/SECURITY.md). The HTTP API stays vLLM's
    // plaintext one.
    let tls_paths = lunakv_config::tls::TlsPaths::server_from_env(&lunakv_config::process_env)
        .map_err(|e| BootstrapError::Config(e.to_string()))?;
    let tls = lunakv_tls::ServerTls::from_paths("lunakv-bootstrap", &tls_paths, &[b"h2"])
        .map_err(|e| BootstrapError::Config(e.to_string()))?
        .map(Arc::new);
    let (stop_tx, stop_rx) = watch::channel(false);
    let api = Arc::new(api::Api {
        state: state.clone(),
        cfg: cfg.clone(),
        metrics: api::Metrics::default(),
    });

    let mut rx = stop_rx.clone();
    let http = tokio::spawn(
        axum::serve(
            listeners.http,
            http::router(api.clone()).into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async move {
            let _ = rx.changed().await;
        })
        .into_future(),
    );
    // grpc.health.v1: "" is SERVING while the process runs (bootstraps are active-active).
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_service_status(
            "lunakv.bootstrap.v1.Bootstrap",
            tonic_health::ServingStatus::Serving,
        )
        .await;
    let (reflection_v1, reflection_v1alpha) = lunakv_proto::reflection();
    let mut rx = stop_rx.clone();
    let grpc = tokio::spawn(
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .layer(lunakv_tls::grpc::PlaintextHealthOnly::new(
                "lunakv-bootstrap",
                tls.as_deref(),
            ))
            .trace_fn(lunakv_telemetry::propagate::grpc_server_span)
            .add_service(grpc::server(api.clone(), stop_rx.clone()))
            .add_service(health)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .serve_with_incoming_shutdown(
                lunakv_tls::grpc::incoming(listeners.grpc, tls.clone()),
                async move {
                    let _ = rx.changed().await;
                },
            ),
    );
    let upkeep = tokio::spawn(upkeep(state.clone(), cfg.clone(), stop_rx.clone()));

    {
        let mut fields: Vec<(&str, &dyn std::fmt::Display)> =
            vec![("http", &http_addr), ("grpc", &grpc_addr)];
        let mode = tls.as_ref().map(|t| t.mode_name());
        if let Some(mode) = &mode {
            fields.push(("tls", mode));
        }
        lunakv_telemetry::announce("lunakv-bootstrap", &fields);
    }
    tracing::info!(%http_addr, %grpc_addr, lease = ?cfg.lease, probe = cfg.probe_workers, probe_any_host = cfg.probe_any_host, limits = ?cfg.limits, "lunakv-bootstrap serving");

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    let drain = async {
        let h = http.await;
        let g = grpc.await;
        let _ = upkeep.await;
        (h, g)
    };
    match tokio::time::timeout(Duration::from_secs(5), drain).await {
        Ok((h, g)) => {
            if let Ok(Err(e)) = h {
                return Err(BootstrapError::Serve(e.to_string()));
            }
            if let Ok(Err(e)) = g {
                return Err(BootstrapError::Serve(e.to_string()));
            }
        }
        Err(_) => tracing::warn!("drain timed out; exiting anyway"),
    }
    Ok(())
}

/// Expires lapsed leases (so watchers hear about it) and probes workers' side channels.
async fn upkeep(
    state: Arc<dyn BootstrapState>,
    cfg: BootstrapConfig,
    mut stop: watch::Receiver<bool>,
) {
    let every = (cfg.lease / 4).max(Duration::from_millis(20));
    let probe_every = (cfg.lease / 3).max(Duration::from_millis(50));
    let mut last_probe = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(e) = state.expire().await {
            tracing::warn!(error = %e, "lease upkeep failed; retrying");
            continue;
        }
        if cfg.probe_workers && last_probe.elapsed() >= probe_every {
            last_probe = tokio::time::Instant::now();
            let targets = match state.probe_targets().await {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list workers to probe");
                    continue;
                }
            };
            let probes = targets.into_iter().filter_map(|t| {
                let dial = dial_target(&t, cfg.probe_any_host)?;
                let state = state.clone();
                let w = t.worker;
                Some(async move {
                    if probe(&dial).await
                        && let Err(e) = state.renew(&w).await
                    {
                        tracing::warn!(error = %e, addr = %w.addr, "cannot renew a probed worker");
                    }
                })
            });
            futures_join_all(probes).await;
        }
    }
}

async fn futures_join_all<F: std::future::Future<Output = ()> + Send + 'static>(
    fs: impl Iterator<Item = F>,
) {
    let handles: Vec<_> = fs.map(tokio::spawn).collect();
    for h in handles {
        let _ = h.await;
    }
}

/// What the prober dials for `t`, if anything: the address checked at registration to be on the
/// registering peer's host (an IP, never a name resolved later), or whatever `addr` names with
/// `any_host`. Entries written by a version that recorded no peer are dialled as before,
/// so a rolling upgrade does not drop engines that registered once (vLLM).
fn dial_target(t: &ProbeTarget, any_host: bool) -> Option<String> {
    if any_host || t.peer.is_none() {
        return Some(state::host_port(&t.worker.addr).to_string());
    }
    t.probe.map(|sa| sa.to_string())
}

/// True if `host_port` accepts a connection within a second.
async fn probe(host_port: &str) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::TcpStream::connect(host_port)
        )
        .await,
        Ok(Ok(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_port_order_and_errors() {
        let env = |k: &str| match k {
            "VLLM_MOONCAKE_BOOTSTRAP_PORT" => Some("9001".to_string()),
            _ => None,
        };
        assert_eq!(port_from_env(&env).unwrap(), Some(9001));
        let env = |k: &str| match k {
            "MOONCAKE_BOOTSTRAP_PORT" => Some("9002".to_string()),
            "VLLM_MOONCAKE_BOOTSTRAP_PORT" => Some("9001".to_string()),
            _ => None,
        };
        assert_eq!(port_from_env(&env).unwrap(), Some(9002));
        let env = |_: &str| Some("nope".to_string());
        assert!(port_from_env(&env).is_err());
        assert_eq!(port_from_env(&|_| None).unwrap(), None);
    }

    #[test]
    fn the_prober_dials_only_the_registering_peers_host() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let me = ip("10.0.0.5");
        let none = Vec::new;
        assert_eq!(
            state::on_peer_host("tcp://10.0.0.5:7000", me, none),
            Some("10.0.0.5:7000".parse().unwrap())
        );
        assert_eq!(state::on_peer_host("tcp://10.0.0.6:7000", me, none), None);
        assert_eq!(
            state::on_peer_host("tcp://metadata.internal:80", me, none),
            None
        );
        assert_eq!(state::on_peer_host("garbage", me, none), None);
        // An IPv4 peer seen through a dual-stack listener is the same host.
        assert!(state::on_peer_host("tcp://10.0.0.5:1", ip("::ffff:10.0.0.5"), none).is_some());
        // A loopback peer is on this host: it may name this host's interface addresses (vLLM
        // registers at 127.0.0.1 naming its pod IP), not any loopback or remote address.
        let local = || vec![ip("127.0.0.1"), ip("10.0.0.9")];
        let lo = ip("127.0.0.1");
        assert!(state::on_peer_host("tcp://10.0.0.9:5", lo, local).is_some());
        assert_eq!(state::on_peer_host("tcp://127.0.0.2:5", lo, local), None);
        assert_eq!(state::on_peer_host("tcp://10.0.0.6:5", lo, local), None);
        // A remote peer may not name this host's addresses.
        assert_eq!(state::on_peer_host("tcp://10.0.0.9:5", me, local), None);

        let t = |addr: &str, peer: Option<IpAddr>, probe: Option<&str>| ProbeTarget {
            worker: Worker {
                engine_id: "e".into(),
                dp_rank: 0,
                tp_rank: 0,
                pp_rank: 0,
                addr: addr.into(),
            },
            peer,
            probe: probe.map(|p| p.parse().unwrap()),
        };
        assert_eq!(
            dial_target(
                &t("tcp://10.0.0.5:7000", Some(me), Some("10.0.0.5:7000")),
                false
            )
            .as_deref(),
            Some("10.0.0.5:7000")
        );
        assert_eq!(
            dial_target(&t("tcp://10.0.0.6:7000", Some(me), None), false),
            None
        );
        assert_eq!(
            dial_target(&t("tcp://10.0.0.6:7000", Some(me), None), true).as_deref(),
            Some("10.0.0.6:7000")
        );
        // Written by an older replica (no peer recorded): probed as it was.
        assert_eq!(
            dial_target(&t("tcp://10.0.0.6:7000", None, None), false).as_deref(),
            Some("10.0.0.6:7000")
        );
    }

    #[test]
    fn lease_range() {
        let d = Duration::from_secs(10);
        assert_eq!(lease_from_request(None, d).unwrap(), d);
        assert_eq!(lease_from_request(Some(0), d).unwrap(), d);
        assert_eq!(
            lease_from_request(Some(1500), d).unwrap(),
            Duration::from_millis(1500)
        );
        let e = lease_from_request(Some(u64::MAX), d).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("lease_ttl_ms=18446744073709551615"), "{m}");
        assert!(m.contains("1..=3600000"), "{m}");
    }
}
