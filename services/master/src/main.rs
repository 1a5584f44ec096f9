//! `lunakv-master`: parse flags, load the layered config, init telemetry, serve until
//! SIGTERM/SIGINT, drain.
#![forbid(unsafe_code)]

use anyhow::Context;
use clap::{CommandFactory, Parser};
use lunakv_config::master::MasterArgs;
use lunakv_master::{Listeners, MasterConfig};

/// The index makes millions of small allocations of a few sizes: mimalloc holds them without a
/// per-allocation header and frees them into per-thread pages, where glibc spilled the batch
/// answers' strings out of its thread cache into its locked slow path (docs/BENCH.md,
/// "Metadata"). Built without transparent huge pages (`no_thp`): each 2 MiB first-touch fault
/// zeroed a huge page in the put path (puts about 15% faster per CPU-second without them,
/// lookups about 7% slower), and a metadata server that grows and shrinks its index is better
/// off without THP's stalls and bloat, as Redis and MongoDB advise for theirs.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The lunakv master: placement and metadata for the KV-cache pool (Mooncake-compatible flags).
#[derive(Debug, Parser)]
#[command(name = "lunakv-master", version)]
struct Cli {
    #[command(flatten)]
    args: MasterArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Upstream's command lines are gflags (`-rpc_port=50051`, `--noenable_ha`): docs/FLAGS.md.
    let argv = lunakv_config::gflags::normalize(
        &Cli::command(),
        lunakv_config::master::UPSTREAM_KEYS,
        std::env::args_os(),
    )?;
    let cli = Cli::parse_from(&argv.args);
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-master");
    for w in argv.warnings() {
        tracing::warn!("{w}");
    }
    let loaded = MasterConfig::load(&cli.args.sources(), &lunakv_config::process_env)
        .context("invalid master configuration")?;
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let cfg = loaded.config;
    let listeners = Listeners::bind(&cfg).await?;
    lunakv_master::serve(
        cfg,
        listeners,
        lunakv_telemetry::shutdown_signal("lunakv-master"),
    )
    .await?;
    Ok(())
}
