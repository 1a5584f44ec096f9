//! `lunakv-store`: parse flags (Mooncake `mooncake_client` names), load the layered config,
//! start telemetry, serve the segment, and unmount on SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser};

#[derive(Parser)]
#[command(
    name = "lunakv-store",
    version,
    about = "lunakv store-client: owns and serves a DRAM segment of the pool"
)]
struct Cli {
    #[command(flatten)]
    store: lunakv_config::store::StoreArgs,
}

fn main() -> anyhow::Result<()> {
    // Upstream's command lines are gflags (`-port=50052`, `--noenable_offload`): docs/FLAGS.md.
    let argv = lunakv_config::gflags::normalize(
        &Cli::command(),
        lunakv_config::store::UPSTREAM_FLAGS,
        std::env::args_os(),
    )?;
    let matches = Cli::command().get_matches_from(&argv.args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
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
    let loaded = lunakv_config::StoreConfig::load(
        &cli.store.sources(&matches),
        &lunakv_config::process_env,
    )?;
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let cfg = loaded.config;
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
