//! `lunakv-bootstrap`: parse flags, bind, serve the bootstrap APIs until SIGTERM/SIGINT, drain.

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use lunakv_bootstrap::{BootstrapConfig, Listeners, MemoryState, parse_duration, port_from_env};

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
    /// Default lease of a registration (e.g. 10s, 500ms).
    #[arg(long = "lease-ttl", default_value = "10s", value_parser = parse_duration)]
    lease_ttl: std::time::Duration,
    /// Renew the lease of workers whose side-channel addr accepts a TCP connection.
    #[arg(long = "probe-workers", default_value_t = true, action = clap::ArgAction::Set)]
    probe_workers: bool,
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = term.recv() => {},
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the service");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
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
    };
    let listeners = Listeners::bind(&cfg).await.context("cannot start")?;
    lunakv_bootstrap::serve(
        cfg,
        listeners,
        Arc::new(MemoryState::new()),
        shutdown_signal(),
    )
    .await?;
    Ok(())
}
