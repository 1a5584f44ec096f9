//! `lunakv-engine-sim`: a test double of a vLLM engine (see the crate docs). Parse flags, serve
//! until SIGTERM/SIGINT.
#![forbid(unsafe_code)]

use std::net::IpAddr;
use std::time::Duration;

use clap::Parser;
use lunakv_engine_sim::{KvShape, Role, ServiceTime, SimConfig};

/// TEST DOUBLE of a vLLM engine with the MooncakeConnector P/D flow. Not an inference engine.
#[derive(Debug, Parser)]
#[command(name = "lunakv-engine-sim", version)]
struct Cli {
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8200)]
    port: u16,
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// Engine id [default: a fresh uuid, as vLLM does at every start].
    #[arg(long = "engine-id")]
    engine_id: Option<String>,
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// The (first) data-parallel rank this process serves.
    #[arg(long = "dp-rank", default_value_t = 0)]
    dp_rank: u32,
    /// Data-parallel ranks, vLLM multi-port style: rank i on port+i with its own engine id.
    #[arg(long = "data-parallel-size", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    data_parallel_size: u32,
    /// Bootstrap a prefill engine registers with [default: http://<host>:$MOONCAKE_BOOTSTRAP_PORT or 8998].
    #[arg(long)]
    bootstrap: Option<String>,
    /// Lease asked for at registration, ms (renewed every third of it).
    #[arg(long = "lease-ttl-ms", default_value_t = 10_000)]
    lease_ttl_ms: u64,
    /// Tokens per KV block.
    #[arg(long = "block-tokens", default_value_t = 16)]
    block_tokens: usize,
    /// KV bytes per block.
    #[arg(long = "block-bytes", default_value_t = 64 * 1024)]
    block_bytes: usize,
    /// Simulated GPU time per prompt token of a prefill, us (an async sleep; 0 = none).
    #[arg(long = "prefill-us-per-token", default_value_t = 0)]
    prefill_us_per_token: u64,
    /// Simulated GPU time per decode step (one generated token), us (an async sleep; 0 = none).
    #[arg(long = "decode-us-per-token", default_value_t = 0)]
    decode_us_per_token: u64,
    /// Close a connection idle this long, ms (uvicorn's --timeout-keep-alive, 5 s in vLLM).
    #[arg(long = "timeout-keep-alive-ms", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(1..))]
    timeout_keep_alive_ms: u64,
    /// How long parked KV waits for its decoder (and a decoder for its prefill), s.
    #[arg(long = "transfer-timeout-s", default_value_t = 30)]
    transfer_timeout_s: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-engine-sim");
    let bootstrap = cli.bootstrap.clone().or_else(|| {
        let port = std::env::var("MOONCAKE_BOOTSTRAP_PORT")
            .ok()
            .and_then(|p| p.parse::<u16>().ok())
            .unwrap_or(8998);
        Some(format!("http://{}:{port}", cli.host))
    });
    let cfg = SimConfig {
        host: cli.host,
        port: cli.port,
        role: cli.role,
        engine_id: cli
            .engine_id
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
        model: cli.model,
        dp_rank: cli.dp_rank,
        data_parallel_size: cli.data_parallel_size,
        bootstrap: if cli.role == Role::Prefill {
            bootstrap
        } else {
            None
        },
        lease: Duration::from_millis(cli.lease_ttl_ms.max(1)),
        shape: KvShape {
            block_tokens: cli.block_tokens.max(1),
            block_bytes: cli.block_bytes.max(1),
        },
        service: ServiceTime {
            prefill_per_token: Duration::from_micros(cli.prefill_us_per_token),
            decode_per_token: Duration::from_micros(cli.decode_us_per_token),
        },
        keep_alive: Duration::from_millis(cli.timeout_keep_alive_ms),
        transfer_timeout: Duration::from_secs(cli.transfer_timeout_s.max(1)),
    };
    lunakv_engine_sim::run(cfg, lunakv_telemetry::shutdown_signal("lunakv-engine-sim")).await?;
    Ok(())
}
