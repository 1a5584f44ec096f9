//! # lunakv-telemetry
//!
//! Logging and metrics setup shared by every lunakv binary (`lunakv-master`, `lunakv-store`,
//! the `lunakv` CLI). One call, [`init`], installs a `tracing` subscriber filtered by `RUST_LOG`
//! (default `info`), writing to stderr so that stdout stays free for machine-readable lines such
//! as the master's `listening` line. [`render`] turns a Prometheus [`Registry`] into the text
//! exposition format for a `/metrics` route. Registries are owned by each service instance, not
//! global, so tests can run several services in one process.

use prometheus::{Encoder, Registry, TextEncoder};
use tracing_subscriber::EnvFilter;

/// Installs the global tracing subscriber: `RUST_LOG` filter (default `info`), compact format on
/// stderr. Safe to call more than once (later calls do nothing), so tests may call it freely.
pub fn init(service_name: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true)
        .try_init()
        .is_ok();
    if installed {
        tracing::info!(
            service = service_name,
            version = env!("CARGO_PKG_VERSION"),
            "logging initialised"
        );
    }
}

/// Renders every metric family of `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    let encoder = TextEncoder::new();
    if let Err(e) = encoder.encode(&registry.gather(), &mut buf) {
        // Only fails on inconsistent metric families, a programming error; report it in-band.
        return format!("# error encoding metrics: {e}\n");
    }
    String::from_utf8(buf).unwrap_or_else(|e| format!("# metrics were not utf-8: {e}\n"))
}

/// The content type to send with [`render`]'s output.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{IntCounter, Opts};

    #[test]
    fn renders_a_registry_as_text() {
        let registry = Registry::new();
        let c = IntCounter::with_opts(Opts::new("demo_requests_total", "Demo requests"))
            .expect("valid metric");
        registry.register(Box::new(c.clone())).expect("register");
        c.inc_by(3);
        let text = render(&registry);
        assert!(
            text.contains("# HELP demo_requests_total Demo requests"),
            "{text}"
        );
        assert!(text.contains("demo_requests_total 3"), "{text}");
    }

    #[test]
    fn init_twice_is_harmless() {
        init("test");
        init("test");
    }
}
