//! `lunakv-bootstrap`: parse flags, bind, wait for etcd (with `--etcd-endpoints`), serve the
//! bootstrap APIs until SIGTERM/SIGINT, drain.
#![forbid(unsafe_code)]

use anyhow::Context;
use clap::Parser;
use lunakv_bootstrap::{BootstrapArgs, Listeners};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = BootstrapArgs::parse();
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-bootstrap");
    let cfg = args.config(&|k| std::env::var(k).ok())?;
    // Installed before any wait, so SIGTERM stops a bootstrap that is still waiting for etcd.
    let mut shutdown = Box::pin(lunakv_telemetry::shutdown_signal("lunakv-bootstrap"));
    cfg.validate()?;
    // Bound before the wait: a port in use is a configuration error, reported at once.
    let listeners = Listeners::bind(&cfg).await.context("cannot start")?;
    let state = tokio::select! {
        s = args.state(cfg.limits) => s?,
        () = &mut shutdown => {
            tracing::info!("shutting down before serving (etcd never answered)");
            return Ok(());
        }
    };
    lunakv_bootstrap::serve(cfg, listeners, state, shutdown).await?;
    Ok(())
}
