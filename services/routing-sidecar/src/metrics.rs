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
    /// Request-body bytes held against `--max-buffered-body-bytes` (KiB-rounded).
    pub buffered_body_bytes: AtomicI64,
    /// Requests refused because their body did not fit `--max-buffered-body-bytes`.
    pub body_budget_refused: AtomicU64,
    /// Time from a request's arrival to its response headers.
    pub latency: Latency,
    /// Responses by status class, 1xx..5xx (index = class - 1).
    pub responses: [AtomicU64; 5],
}

/// Upper bounds (seconds) of the latency histogram's buckets.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A Prometheus histogram over [`LATENCY_BUCKETS`], lock-free.
#[derive(Debug, Default)]
pub struct Latency {
    /// Per-bucket counts (not cumulative); the last slot is +Inf.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Latency {
    pub fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        let i = LATENCY_BUCKETS
            .iter()
            .position(|le| secs <= *le)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }
}

impl Metrics {
    /// Records one response: its status class and the time to its headers.
    pub fn observe_response(&self, status: u16, elapsed: std::time::Duration) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.responses[class].fetch_add(1, Ordering::Relaxed);
        self.latency.observe(elapsed);
    }
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
        c(
            "buffered_body_bytes",
            "Request-body bytes buffered now (held against --max-buffered-body-bytes).",
            "gauge",
            self.buffered_body_bytes.load(Ordering::Relaxed),
        );
        c(
            "body_budget_refused_total",
            "Requests refused (503) because --max-buffered-body-bytes was in use.",
            "counter",
            g(&self.body_budget_refused),
        );
        let h = "lunakv_sidecar_request_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {h} Time from a request's arrival to its response headers."
        );
        let _ = writeln!(out, "# TYPE {h} histogram");
        let mut cumulative = 0u64;
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            cumulative += self.latency.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{h}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        cumulative += self.latency.buckets[LATENCY_BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{h}_bucket{{le=\"+Inf\"}} {cumulative}");
        let sum = self.latency.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{h}_sum {sum}");
        let _ = writeln!(out, "{h}_count {cumulative}");
        let r = "lunakv_sidecar_responses_total";
        let _ = writeln!(out, "# HELP {r} Responses sent, by status class.");
        let _ = writeln!(out, "# TYPE {r} counter");
        for (i, n) in self.responses.iter().enumerate() {
            let _ = writeln!(
                out,
                "{r}{{class=\"{}xx\"}} {}",
                i + 1,
                n.load(Ordering::Relaxed)
            );
        }
        out
    }
}
