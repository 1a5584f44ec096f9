//! # lunakv-sidecar
//!
//! A drop-in replacement for llm-d-router's `pd-sidecar`: the reverse proxy in front of a
//! decode engine that runs prefill/decode disaggregation. Same flags and defaults ([`config`]),
//! same routes, same `x-prefiller-host-port` header and request rewriting per connector:
//!
//! - `GET /health` -> 200. `POST /v1/completions`, `/v1/chat/completions`, `/v1/responses`,
//!   `/v1/messages`, `/inference/v1/generate` with `x-prefiller-host-port` go through
//!   disaggregation (the header is removed; with a comma list the first entry is used);
//!   everything else is reverse-proxied to the local engine, streaming both ways.
//! - `mooncake`: `GET http://<prefill-host>:<bootstrap-port>/query` (5 s timeout, cached per
//!   host:port), `transfer_id = xfer-<uuid>`, prefill and decode concurrently (see
//!   [`proxy`] for the exact bodies). `nixlv2`: prefill, then decode with the prefiller's
//!   `kv_transfer_params`. `shared-storage`: prefill, then the original request.
//!
//! Where upstream has known failures it does better: a failed prefill is retried
//! (`--prefill-max-retries`, `--prefill-retry-backoff`, on connect errors and 502/503/504) or
//! returned to the client as a vLLM-style JSON error, the concurrent decode leg is cancelled (no
//! silent decode-side recompute, no hanging client); a bootstrap cache entry is dropped when its
//! engine fails; idle upstream connections close after 4 s (`--idle-conn-timeout`), before
//! vLLM's 5 s keep-alive; the SSRF allowlist checks host AND port ([`ssrf`]); `x-request-id` is
//! propagated (or created) and the prefill and decode legs are separate tracing spans.
//!
//! Configuration: flags over the environment over `--configuration-file` (upstream's YAML,
//! [`file`](mod@file)); validated in [`config`] with messages that name the flag or field.
//!
//! The service is a tower stack (see [`layers`]): request id -> in-flight accounting ->
//! [`proxy::Proxy`], served by hyper-util on one listener per data-parallel rank ([`server`]).
//! The sidecar's own counters are at [`METRICS_PATH`] (every other path belongs to the engine).
#![forbid(unsafe_code)]

pub mod body;
pub mod cache;
pub mod config;
pub mod file;
pub mod layers;
pub mod metrics;
pub mod peers;
pub mod proxy;
pub mod server;
pub mod ssrf;
pub mod tls;
mod values;

use std::net::SocketAddr;

pub use config::{Cli, ConfigError, Connector, SidecarConfig};
pub use file::parse_args;
pub use server::{Bound, bind, serve};

/// Where the sidecar serves its own Prometheus counters.
pub const METRICS_PATH: &str = "/lunakv/sidecar/metrics";

/// Errors starting the sidecar.
#[derive(Debug, thiserror::Error)]
pub enum SidecarError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot bind {addr}: {source}; the port is in use or the host is not local")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}
