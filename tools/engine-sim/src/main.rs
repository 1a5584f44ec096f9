//! `lunakv-engine-sim`: a test double of a vLLM engine (see the crate docs). Parse flags, serve
//! until SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use clap::Parser;
use lunakv_engine_sim::SimArgs;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = SimArgs::parse();
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-engine-sim");
    let cfg = args.into_config();
    lunakv_engine_sim::run(cfg, lunakv_telemetry::shutdown_signal("lunakv-engine-sim")).await?;
    Ok(())
}
