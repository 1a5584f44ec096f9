//! The simulator's command line, [`SimArgs`], and the [`SimConfig`] it resolves to.

use std::net::IpAddr;
use std::time::Duration;

use crate::{KvShape, Role, ServiceTime, SimConfig};

/// TEST DOUBLE of a vLLM engine with the MooncakeConnector P/D flow. Not an inference engine.
// The field docs are clap's --help text, shown verbatim: `<host>` there is a placeholder, not HTML.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Debug, clap::Parser)]
#[command(name = "lunakv-engine-sim", version)]
pub struct SimArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, default_value_t = 8200)]
    pub port: u16,
    #[arg(long, value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// Engine id [default: a fresh uuid, as vLLM does at every start].
    #[arg(long = "engine-id")]
    pub engine_id: Option<String>,
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// The (first) data-parallel rank this process serves.
    #[arg(long = "dp-rank", default_value_t = 0)]
    pub dp_rank: u32,
    /// Data-parallel ranks, vLLM multi-port style: rank i on port+i with its own engine id.
    #[arg(long = "data-parallel-size", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub data_parallel_size: u32,
    /// Bootstrap a prefill engine registers with [default: http://<host>:$MOONCAKE_BOOTSTRAP_PORT or 8998].
    #[arg(long)]
    pub bootstrap: Option<String>,
    /// Lease asked for at registration, ms (renewed every third of it).
    #[arg(long = "lease-ttl-ms", default_value_t = 10_000)]
    pub lease_ttl_ms: u64,
    /// Tokens per KV block.
    #[arg(long = "block-tokens", default_value_t = 16)]
    pub block_tokens: usize,
    /// KV bytes per block.
    #[arg(long = "block-bytes", default_value_t = 64 * 1024)]
    pub block_bytes: usize,
    /// Simulated GPU time per prompt token of a prefill, us (an async sleep; 0 = none).
    #[arg(long = "prefill-us-per-token", default_value_t = 0)]
    pub prefill_us_per_token: u64,
    /// Simulated GPU time per decode step (one generated token), us (an async sleep; 0 = none).
    #[arg(long = "decode-us-per-token", default_value_t = 0)]
    pub decode_us_per_token: u64,
    /// Close a connection idle this long, ms (uvicorn's --timeout-keep-alive, 5 s in vLLM).
    #[arg(long = "timeout-keep-alive-ms", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_keep_alive_ms: u64,
    /// How long parked KV waits for its decoder (and a decoder for its prefill), s.
    #[arg(long = "transfer-timeout-s", default_value_t = 30)]
    pub transfer_timeout_s: u64,
}

impl SimArgs {
    /// The configuration these flags give; the bootstrap address of a prefill engine falls
    /// back to `MOONCAKE_BOOTSTRAP_PORT` on `--host`, as vLLM's does.
    pub fn into_config(self) -> SimConfig {
        let bootstrap = self.bootstrap.clone().or_else(|| {
            let port = std::env::var("MOONCAKE_BOOTSTRAP_PORT")
                .ok()
                .and_then(|p| p.parse::<u16>().ok())
                .unwrap_or(8998);
            Some(format!("http://{}:{port}", self.host))
        });
        SimConfig {
            host: self.host,
            port: self.port,
            role: self.role,
            engine_id: self
                .engine_id
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            model: self.model,
            dp_rank: self.dp_rank,
            data_parallel_size: self.data_parallel_size,
            bootstrap: if self.role == Role::Prefill {
                bootstrap
            } else {
                None
            },
            lease: Duration::from_millis(self.lease_ttl_ms.max(1)),
            shape: KvShape {
                block_tokens: self.block_tokens.max(1),
                block_bytes: self.block_bytes.max(1),
            },
            service: ServiceTime {
                prefill_per_token: Duration::from_micros(self.prefill_us_per_token),
                decode_per_token: Duration::from_micros(self.decode_us_per_token),
            },
            keep_alive: Duration::from_millis(self.timeout_keep_alive_ms),
            transfer_timeout: Duration::from_secs(self.transfer_timeout_s.max(1)),
        }
    }
}
