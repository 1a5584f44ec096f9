//! `lunakv-sidecar`: parse flags (exit 2 with the reason on bad ones), bind, serve until
//! SIGTERM/SIGINT, drain.

use clap::Parser;
use lunakv_sidecar::{Cli, SidecarConfig};

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = term.recv() => {},
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the sidecar");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-sidecar");
    let cfg = match SidecarConfig::from_cli(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lunakv-sidecar: {e}");
            std::process::exit(2);
        }
    };
    let bound = match lunakv_sidecar::bind(cfg).await {
        Ok(b) => b,
        Err(e) => {
            eprintln!("lunakv-sidecar: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = lunakv_sidecar::serve(bound, shutdown_signal()).await {
        eprintln!("lunakv-sidecar: {e}");
        std::process::exit(1);
    }
}
