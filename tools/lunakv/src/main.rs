//! # lunakv: the operator CLI of lunakv
//!
//! One binary for the people who run a lunakv pool (the KV-cache store under vLLM/llm-d that
//! upstream calls Mooncake Store):
//!
//! - `lunakv status`: what the master knows (segments, capacity, used, keys, clients);
//! - `lunakv put|get|exists|rm`: single objects through the same client library engines use;
//! - `lunakv doctor`: a pass/fail table over the whole stack, each failure with its fix;
//! - `lunakv drain`: moves a segment's objects to the others before its store leaves;
//! - `lunakv up`: master + store-client on loopback for development (`make run`);
//! - `lunakv bench`: a self-contained benchmark next to this machine's memcpy and TCP limits.
//!
//! The master address comes from `--master`, else `MOONCAKE_MASTER`, else the
//! `master_server_address` of `--config` / `MOONCAKE_CONFIG_PATH`, else `127.0.0.1:50051`.
//! Every command takes `--json` and then prints exactly one JSON object on stdout.
//!
//! Exit status: 0 success; 1 for `exists` answering "no", a failed `doctor` check and a drain
//! that ended FAILED or CANCELED or left objects behind; 2 for
//! every error.
//!
//! `main` stays synchronous on purpose: the client library is blocking and owns its own tokio
//! runtime, so only commands that need async (the status RPC, `up`'s signal wait) build one.
#![forbid(unsafe_code)]

mod args;
mod cmd;
mod error;
mod output;
mod stack;
mod target;

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The client library logs through tracing; a CLI stays quiet unless asked (RUST_LOG). With
    // OTEL_EXPORTER_OTLP_ENDPOINT set its operations are traced; the guard flushes them at exit.
    let _telemetry = lunakv_telemetry::Init::new("lunakv")
        .default_log_filter("off")
        .install();
    let json = cli.json;
    let result = match cli.command {
        Command::Status => {
            target::resolve_cli(&cli.master, &cli.config).and_then(|t| cmd::status::run(&t, json))
        }
        Command::Put { key, file } => target::resolve_cli(&cli.master, &cli.config)
            .and_then(|t| cmd::kv::put(&t, &key, &file, json)),
        Command::Get { key, file } => target::resolve_cli(&cli.master, &cli.config)
            .and_then(|t| cmd::kv::get(&t, &key, file.as_deref(), json)),
        Command::Exists { key } => target::resolve_cli(&cli.master, &cli.config)
            .and_then(|t| cmd::kv::exists(&t, &key, json)),
        Command::Rm { key, force } => target::resolve_cli(&cli.master, &cli.config)
            .and_then(|t| cmd::kv::rm(&t, &key, force, json)),
        Command::Doctor(a) => cmd::doctor::run(&a, &cli.master, &cli.config, json),
        Command::Up(a) => cmd::up::run(&a, json),
        Command::Bench(a) => cmd::bench::run(&a, json),
        Command::Drain(a) => target::resolve_cli(&cli.master, &cli.config)
            .and_then(|t| cmd::drain::run(&a, &t.master, json)),
        Command::Keys(a) => target::resolve_cli(&cli.master, &cli.config)
            .and_then(|t| cmd::keys::run(&a, &t.master, json)),
        Command::Events(a) => cmd::events::run(&a, &cli.master, &cli.config, json),
        Command::TcpSink { port } => cmd::bench::limits::tcp_sink(port),
    };
    match result {
        Ok(code) => code,
        Err(e) => output::fail(&e, json),
    }
}
