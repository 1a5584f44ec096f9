//! `lunakv-bootstrap`: parse flags, bind, wait for etcd (with `--etcd-endpoints`), serve the
//! bootstrap APIs until SIGTERM/SIGINT, drain.

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use std::time::Duration;

use lunakv_bootstrap::{
    BootstrapConfig, BootstrapState, Limits, Listeners, MemoryState, SharedState, parse_duration,
    port_from_env,
};
use lunakv_meta::{EtcdClient, EtcdMetaStore, EtcdSecurity};
use lunakv_telemetry::wait::PeerWait;

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

/// The table: embedded, or in etcd when endpoints are given. An etcd that does not answer yet
/// (started together with this service) is waited for: one WARN line, one more every 30 s,
/// one INFO line when it answers. Malformed flags and endpoints fail at once.
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
    let security = EtcdSecurity::from_env(&lunakv_config::process_env)?;
    let client = EtcdClient::connect_with(&endpoints, Duration::from_secs(3), &security)
        .with_context(|| format!("--etcd-endpoints={eps}"))?;
    let prefix = SharedState::prefix_for(&cli.cluster_id, &cli.group);
    let mut waiting = PeerWait::new(
        format!("etcd at {eps}"),
        format!("(--etcd-endpoints) to share the bootstrap table {prefix}"),
    );
    // Every failure of a reachable-or-not etcd is one waiting can fix: the endpoints parsed.
    while let Err(e) = client.check().await {
        waiting.retry_after(&e).await;
    }
    waiting.reached();
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
    // Installed before any wait, so SIGTERM stops a bootstrap that is still waiting for etcd.
    let mut shutdown = Box::pin(lunakv_telemetry::shutdown_signal("lunakv-bootstrap"));
    cfg.validate()?;
    // Bound before the wait: a port in use is a configuration error, reported at once.
    let listeners = Listeners::bind(&cfg).await.context("cannot start")?;
    let state = tokio::select! {
        s = state(&cli, cfg.limits) => s?,
        () = &mut shutdown => {
            tracing::info!("shutting down before serving (etcd never answered)");
            return Ok(());
        }
    };
    lunakv_bootstrap::serve(cfg, listeners, state, shutdown).await?;
    Ok(())
}
