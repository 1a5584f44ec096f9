//! `lunakv up` (`make run`): a master and a store-client on loopback, the mooncake_config.json
//! an engine should use, then wait for Ctrl-C / SIGTERM and stop the store before the master.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use lunakv_proto::ErrorCode;
use serde::Serialize;
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::args::UpArgs;
use crate::error::Coded;
use crate::output::print_json;
use crate::stack::{Stack, StackOptions, bin_dir};

/// The engine's mooncake_config.json for the store `up` started: standalone-store mode (the
/// engine is a pure requester; the store owns the DRAM pool), field order as in vLLM's docs.
#[derive(Debug, Serialize)]
pub struct EngineConfig {
    pub mode: &'static str,
    pub metadata_server: &'static str,
    pub master_server_address: String,
    pub global_segment_size: u64,
    pub local_buffer_size: &'static str,
    pub protocol: &'static str,
    pub device_name: &'static str,
    pub enable_offload: bool,
    pub local_hostname: &'static str,
}

impl EngineConfig {
    pub fn standalone(master: &str) -> EngineConfig {
        EngineConfig {
            mode: "standalone-store",
            metadata_server: "P2PHANDSHAKE",
            master_server_address: master.to_owned(),
            global_segment_size: 0,
            local_buffer_size: "1GB",
            protocol: "tcp",
            device_name: "",
            enable_offload: false,
            local_hostname: "127.0.0.1",
        }
    }
}

pub fn run(a: &UpArgs, json: bool) -> anyhow::Result<ExitCode> {
    // Refuse a bad size here, with the flag's name, rather than as a store startup failure.
    lunakv_config::parse_size(&a.segment_size)
        .map_err(|e| Coded::new(ErrorCode::InvalidParams, format!("--segment-size: {e}")))?;
    std::fs::create_dir_all(&a.run_dir)
        .with_context(|| format!("cannot create the run dir {}", a.run_dir.display()))?;
    let data_dir = a
        .data_dir
        .clone()
        .unwrap_or_else(|| a.run_dir.join("master"));
    // Before any child exists: a stop that arrives while they start, or right after the banner,
    // is then held for wait_for_stop instead of killing `up` alone and orphaning them.
    let stop = StopSignals::install()?;
    let mut stack = Stack::start(&StackOptions {
        bin_dir: bin_dir(a.bin_dir.as_deref())?,
        rpc_port: a.rpc_port,
        master_metrics_port: a.metrics_port,
        data_dir: data_dir.clone(),
        store_port: a.store_port,
        store_metrics_port: a.store_metrics_port,
        segment_size: a.segment_size.clone(),
        default_log: None,
    })?;

    let config = EngineConfig::standalone(&stack.master_rpc);
    let config_text = serde_json::to_string_pretty(&config)?;
    let config_path = a.run_dir.join("mooncake_config.json");
    std::fs::write(&config_path, format!("{config_text}\n"))
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    let config_abs = std::fs::canonicalize(&config_path).unwrap_or(config_path.clone());
    let metrics = stack.master_admin.as_ref().map(|a| {
        let scheme = if stack.master_admin_https {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{a}/metrics")
    });

    if json {
        print_json(&serde_json::json!({
            "ok": true,
            "master": stack.master_rpc,
            "master_admin": stack.master_admin,
            "master_pid": stack.master.pid(),
            "store": stack.store_transfer,
            "store_admin": stack.store_admin,
            "store_pid": stack.store.pid(),
            "segment_size": a.segment_size,
            "data_dir": data_dir,
            "metrics_url": metrics,
            "config_path": config_abs,
            "config": config,
        }))?;
    } else {
        print_banner(
            &stack,
            a,
            &data_dir,
            &config_text,
            &config_abs,
            metrics.as_deref(),
        );
    }

    let outcome = stop.wait(&mut stack);
    eprintln!("lunakv up: stopping the store (it unmounts), then the master");
    let stopped = stack.stop();
    // A dead child is the error to report (and exit non-zero for); the stop result comes next.
    outcome?;
    stopped?;
    eprintln!("lunakv up: stopped");
    Ok(ExitCode::SUCCESS)
}

fn print_banner(
    stack: &Stack,
    a: &UpArgs,
    data_dir: &Path,
    config_text: &str,
    config_path: &Path,
    metrics: Option<&str>,
) {
    let admin = |x: &Option<String>| {
        x.as_ref()
            .map(|a| format!("  admin http://{a}"))
            .unwrap_or_default()
    };
    println!(
        "lunakv-master  rpc {}{}  data {}  (pid {})",
        stack.master_rpc,
        admin(&stack.master_admin),
        data_dir.display(),
        stack.master.pid()
    );
    println!(
        "lunakv-store   transfer {}{}  segment {}  (pid {})",
        stack.store_transfer,
        admin(&stack.store_admin),
        a.segment_size,
        stack.store.pid()
    );
    println!();
    println!(
        "mooncake_config.json for an engine (written to {}):",
        config_path.display()
    );
    println!("{config_text}");
    println!();
    println!("  export MOONCAKE_CONFIG_PATH={}", config_path.display());
    if let Some(m) = metrics {
        println!("metrics: {m}");
    }
    println!("try:     lunakv --master {} status", stack.master_rpc);
    println!("Ctrl-C stops both.");
}

/// SIGINT, SIGTERM and SIGHUP handlers, with the small runtime that waits on them.
struct StopSignals {
    rt: tokio::runtime::Runtime,
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl StopSignals {
    fn install() -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (int, term, hup) = {
            let _in_runtime = rt.enter();
            let listen = |kind: SignalKind, name: &str| {
                signal(kind).with_context(|| format!("cannot listen for {name}"))
            };
            (
                listen(SignalKind::interrupt(), "SIGINT")?,
                listen(SignalKind::terminate(), "SIGTERM")?,
                listen(SignalKind::hangup(), "SIGHUP")?,
            )
        };
        Ok(Self { rt, int, term, hup })
    }

    /// Blocks until one of the signals (Ok) or a child dies (Err naming it).
    fn wait(self, stack: &mut Stack) -> anyhow::Result<()> {
        let Self {
            rt,
            mut int,
            mut term,
            mut hup,
        } = self;
        rt.block_on(async {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    _ = int.recv() => return Ok(()),
                    _ = term.recv() => return Ok(()),
                    _ = hup.recv() => return Ok(()),
                    _ = tick.tick() => stack.check_alive()?,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_config_is_a_valid_standalone_config() {
        let text =
            serde_json::to_string(&EngineConfig::standalone("127.0.0.1:50051")).expect("json");
        let loaded = lunakv_config::MooncakeConfig::from_json_str(&text, "up").expect("parses");
        let c = loaded.config;
        assert_eq!(c.mode, lunakv_config::Mode::StandaloneStore);
        assert_eq!(c.master_server_address, "127.0.0.1:50051");
        assert_eq!(c.global_segment_size, 0);
        assert_eq!(c.local_buffer_size, 1 << 30);
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        c.validate().expect("passes vLLM's checks");
    }
}
