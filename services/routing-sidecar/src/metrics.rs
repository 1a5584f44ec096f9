//! The sidecar's own counters, served at [`crate::METRICS_PATH`] in the Prometheus text format
//! (every other path belongs to the model server).

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    /// Requests whose response (including a streamed body) is not finished yet.
    pub inflight: AtomicI64,
    pub disaggregated: AtomicU64,
    pub prefill_failures: AtomicU64,
    pub prefill_retries: AtomicU64,
    pub bootstrap_queries: AtomicU64,
    pub bootstrap_cache_drops: AtomicU64,
    pub ssrf_denied: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Upstream response bodies still being relayed.
    pub upstream_streams: AtomicI64,
}

impl Metrics {
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut c = |name: &str, help: &str, kind: &str, v: i64| {
            let _ = writeln!(out, "# HELP lunakv_sidecar_{name} {help}");
            let _ = writeln!(out, "# TYPE lunakv_sidecar_{name} {kind}");
            let _ = writeln!(out, "lunakv_sidecar_{name} {v}");
        };
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed) as i64;
        c(
            "requests_total",
            "Requests received.",
            "counter",
            g(&self.requests),
        );
        c(
            "inflight_requests",
            "Requests not finished (body included).",
            "gauge",
            self.inflight.load(Ordering::Relaxed),
        );
        c(
            "disaggregated_total",
            "Requests run through P/D.",
            "counter",
            g(&self.disaggregated),
        );
        c(
            "prefill_failures_total",
            "Prefill attempts that failed.",
            "counter",
            g(&self.prefill_failures),
        );
        c(
            "prefill_retries_total",
            "Prefill retries.",
            "counter",
            g(&self.prefill_retries),
        );
        c(
            "bootstrap_queries_total",
            "Bootstrap /query calls.",
            "counter",
            g(&self.bootstrap_queries),
        );
        c(
            "bootstrap_cache_drops_total",
            "Bootstrap cache entries dropped after a failure.",
            "counter",
            g(&self.bootstrap_cache_drops),
        );
        c(
            "ssrf_denied_total",
            "Prefill targets refused by SSRF protection.",
            "counter",
            g(&self.ssrf_denied),
        );
        c(
            "decode_errors_total",
            "Decode legs that failed.",
            "counter",
            g(&self.decode_errors),
        );
        c(
            "upstream_streams",
            "Upstream bodies being relayed.",
            "gauge",
            self.upstream_streams.load(Ordering::Relaxed),
        );
        out
    }
}
