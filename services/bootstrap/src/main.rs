//! `lunakv-bootstrap`: parse flags, bind, serve the bootstrap APIs until SIGTERM/SIGINT, drain.

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use std::time::Duration;

use lunakv_bootstrap::{
    BootstrapConfig, BootstrapState, Limits, Listeners, MemoryState, SharedState, parse_duration,
    port_from_env,
};
use lunakv_meta::{EtcdClient, EtcdMetaStore};

/// vLLM-compatible Mooncake P/D bootstrap service with leased registrations.
#[derive(Debug, Parser)]
#[command(name = "lunakv-bootstrap", version)]
struct Cli {
    /// Address the listeners bind [default: 127.0.0.1; upstream binds 0.0.0.0].
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP port [default: MOONCAKE_BOOTSTRAP_PORT, VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998].
    #[arg(long)]
    port: Option<u16>,
    /// gRPC port.
    #[arg(long = "grpc-port", default_value_t = lunakv_bootstrap::DEFAULT_GRPC_PORT)]
    grpc_port: u16,
    /// Default lease of a registration (e.g. 10s, 500ms; at most 1h).
    #[arg(long = "lease-ttl", default_value = "10s", value_parser = parse_duration)]
    lease_ttl: std::time::Duration,
    /// Renew the lease of workers whose side-channel addr accepts a TCP connection.
    #[arg(long = "probe-workers", default_value_t = true, action = clap::ArgAction::Set)]
    probe_workers: bool,
    /// Also probe addrs that are not on the registering peer's host (only where NAT hides the
    /// engines' addresses and only trusted peers reach the bootstrap: any peer could otherwise
    /// make the service dial any address).
    #[arg(long = "probe-any-host", default_value_t = false, action = clap::ArgAction::Set)]
    probe_any_host: bool,
    /// Live workers the table holds at most; a new one beyond is refused (507).
    #[arg(long = "max-registrations", default_value_t = Limits::DEFAULT.max_registrations)]
    max_registrations: usize,
    /// Live workers one source IP may register; a new one beyond is refused (429).
    #[arg(long = "max-registrations-per-peer", default_value_t = Limits::DEFAULT.max_per_peer)]
    max_registrations_per_peer: usize,
    /// Keep the table in etcd so replicas share it (comma or `;` list of host:port); unset =
    /// embedded, in memory.
    #[arg(long = "etcd-endpoints", env = "LUNAKV_BOOTSTRAP_ETCD_ENDPOINTS")]
    etcd_endpoints: Option<String>,
    /// With etcd: the cluster the keys go under (`mooncake-store/<cluster-id>/bootstrap/...`).
    #[arg(long = "cluster-id", default_value = "default")]
    cluster_id: String,
    /// With etcd: which table the replicas share (one per prefill deployment).
    #[arg(long = "group", default_value = "default")]
    group: String,
}

/// The table: embedded, or in etcd when endpoints are given (checked before serving).
async fn state(cli: &Cli, limits: Limits) -> anyhow::Result<Arc<dyn BootstrapState>> {
    let Some(eps) = cli
        .etcd_endpoints
        .as_deref()
        .filter(|e| !e.trim().is_empty())
    else {
        return Ok(Arc::new(MemoryState::new().with_limits(limits)));
    };
    for (flag, v) in [("--cluster-id", &cli.cluster_id), ("--group", &cli.group)] {
        anyhow::ensure!(
            !v.is_empty() && !v.contains('/'),
            "{flag} '{v}' must be a non-empty name without '/'"
        );
    }
    let endpoints: Vec<String> = eps
        .split([',', ';'])
        .map(|e| e.trim().to_string())
        .filter(|e| !e.is_empty())
        .collect();
    let client = EtcdClient::connect(&endpoints, Duration::from_secs(3))?;
    client
        .check()
        .await
        .with_context(|| format!("cannot reach etcd at {eps} (--etcd-endpoints)"))?;
    let prefix = SharedState::prefix_for(&cli.cluster_id, &cli.group);
    tracing::info!(etcd = %eps, %prefix, "bootstrap table shared through etcd");
    Ok(Arc::new(
        SharedState::new(Arc::new(EtcdMetaStore::new(client)), prefix).with_limits(limits),
    ))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-bootstrap");
    let env_port = port_from_env(&|k| std::env::var(k).ok())?;
    let cfg = BootstrapConfig {
        host: cli.host,
        http_port: cli
            .port
            .or(env_port)
            .unwrap_or(lunakv_bootstrap::DEFAULT_HTTP_PORT),
        grpc_port: cli.grpc_port,
        lease: cli.lease_ttl,
        probe_workers: cli.probe_workers,
        probe_any_host: cli.probe_any_host,
        limits: Limits {
            max_registrations: cli.max_registrations,
            max_per_peer: cli.max_registrations_per_peer,
        },
    };
    cfg.validate()?;
    let state = state(&cli, cfg.limits).await?;
    let listeners = Listeners::bind(&cfg).await.context("cannot start")?;
    lunakv_bootstrap::serve(
        cfg,
        listeners,
        state,
        lunakv_telemetry::shutdown_signal("lunakv-bootstrap"),
    )
    .await?;
    Ok(())
}
