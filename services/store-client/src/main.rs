//! `lunakv-store`: parse flags (Mooncake `mooncake_client` names), start telemetry, serve the
//! segment, and unmount on SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use anyhow::Context;
use clap::{CommandFactory, Parser};

#[derive(Parser)]
#[command(
    name = "lunakv-store",
    version,
    about = "lunakv store-client: owns and serves a DRAM segment of the pool"
)]
struct Cli {
    #[command(flatten)]
    store: lunakv_config::StoreConfig,
}

fn main() -> anyhow::Result<()> {
    // Upstream's command lines are gflags (`-port=50052`, `--noenable_offload`): docs/FLAGS.md.
    let argv = lunakv_config::gflags::normalize(
        &Cli::command(),
        lunakv_config::store::UPSTREAM_FLAGS,
        std::env::args_os(),
    )?;
    let mut cfg = Cli::parse_from(&argv.args).store;
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-store");
    for w in argv.warnings() {
        tracing::warn!("{w}");
    }
    // Connection caps are sized from the fd limit: take all the operator allows.
    match lunakv_transfer::raise_fd_limit() {
        Ok((soft, hard)) => tracing::debug!(?soft, ?hard, "open-file limit"),
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the soft open-file limit to the hard one")
        }
    }
    let mut warnings = cfg.apply_env(&lunakv_config::process_env)?;
    warnings.extend(cfg.validate()?);
    for w in &warnings {
        tracing::warn!("{w}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    // Installed inside the runtime, before serve: a SIGTERM right after startup still drains.
    let shutdown = {
        let _in_runtime = rt.enter();
        lunakv_telemetry::shutdown_signal("lunakv-store")
    };
    rt.block_on(lunakv_store::serve(cfg, shutdown))?;
    Ok(())
}
