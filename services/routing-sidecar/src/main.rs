//! `lunakv-sidecar`: parse flags (exit 2 with the reason on bad ones), start the runtime
//! (`--worker-threads`), bind, serve until SIGTERM/SIGINT, drain.
#![forbid(unsafe_code)]

use lunakv_sidecar::{ConfigError, SidecarConfig};

fn main() {
    let cli = match lunakv_sidecar::parse_args(std::env::args_os()) {
        Ok(c) => c,
        Err(ConfigError::Flags(e)) => e.exit(),
        Err(e) => {
            eprintln!("lunakv-sidecar: {e}");
            std::process::exit(2);
        }
    };
    // The runtime comes first: its flavour is a flag (--worker-threads).
    let rt = match cli.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    };
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lunakv-sidecar: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(async {
        // Held until serving ends: dropping it flushes the spans still queued
        // (docs/TRACING.md).
        let _telemetry = lunakv_telemetry::init("lunakv-sidecar");
        let cfg = match SidecarConfig::from_cli(cli) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("lunakv-sidecar: {e}");
                std::process::exit(2);
            }
        };
        let bound = match lunakv_sidecar::bind(cfg).await {
            Ok(b) => b,
            Err(e) => {
                eprintln!("lunakv-sidecar: {e}");
                std::process::exit(1);
            }
        };
        if let Err(e) =
            lunakv_sidecar::serve(bound, lunakv_telemetry::shutdown_signal("lunakv-sidecar")).await
        {
            eprintln!("lunakv-sidecar: {e}");
            std::process::exit(1);
        }
    });
}
