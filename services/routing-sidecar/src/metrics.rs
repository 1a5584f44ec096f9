//! The sidecar's own counters, served at [`crate::METRICS_PATH`] in the Prometheus text format
//! (every other path belongs to the model server). Each sidecar owns its registry, so tests can
//! run several in one process.

use lunakv_telemetry::metrics::{counter, counter_vec, gauge, histogram};
use prometheus::{Histogram, IntCounter, IntGauge, Registry};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounter,
    /// Requests whose response (including a streamed body) is not finished yet.
    pub inflight: IntGauge,
    pub disaggregated: IntCounter,
    pub prefill_failures: IntCounter,
    pub prefill_retries: IntCounter,
    pub bootstrap_queries: IntCounter,
    pub bootstrap_cache_drops: IntCounter,
    pub ssrf_denied: IntCounter,
    pub decode_errors: IntCounter,
    /// Upstream response bodies still being relayed.
    pub upstream_streams: IntGauge,
    /// Request-body bytes held against `--max-buffered-body-bytes` (KiB-rounded).
    pub buffered_body_bytes: IntGauge,
    /// Requests refused because their body did not fit `--max-buffered-body-bytes`.
    pub body_budget_refused: IntCounter,
    /// Time from a request's arrival to its response headers.
    pub latency: Histogram,
    /// Responses by status class, 1xx..5xx (index = class - 1).
    pub responses: [IntCounter; 5],
}

/// Upper bounds (seconds) of the latency histogram's buckets.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl Default for Metrics {
    fn default() -> Self {
        let r = Registry::new();
        let responses = counter_vec(
            &r,
            "lunakv_sidecar_responses_total",
            "Responses sent, by status class.",
            &["class"],
        );
        // Every class is a series from the start: a dashboard's rate() sees 0, not no data.
        let responses =
            ["1xx", "2xx", "3xx", "4xx", "5xx"].map(|c| responses.with_label_values(&[c]));
        Metrics {
            requests: counter(&r, "lunakv_sidecar_requests_total", "Requests received."),
            inflight: gauge(
                &r,
                "lunakv_sidecar_inflight_requests",
                "Requests not finished (body included).",
            ),
            disaggregated: counter(
                &r,
                "lunakv_sidecar_disaggregated_total",
                "Requests run through P/D.",
            ),
            prefill_failures: counter(
                &r,
                "lunakv_sidecar_prefill_failures_total",
                "Prefill attempts that failed.",
            ),
            prefill_retries: counter(
                &r,
                "lunakv_sidecar_prefill_retries_total",
                "Prefill retries.",
            ),
            bootstrap_queries: counter(
                &r,
                "lunakv_sidecar_bootstrap_queries_total",
                "Bootstrap /query calls.",
            ),
            bootstrap_cache_drops: counter(
                &r,
                "lunakv_sidecar_bootstrap_cache_drops_total",
                "Bootstrap cache entries dropped after a failure.",
            ),
            ssrf_denied: counter(
                &r,
                "lunakv_sidecar_ssrf_denied_total",
                "Prefill targets refused by SSRF protection.",
            ),
            decode_errors: counter(
                &r,
                "lunakv_sidecar_decode_errors_total",
                "Decode legs that failed.",
            ),
            upstream_streams: gauge(
                &r,
                "lunakv_sidecar_upstream_streams",
                "Upstream bodies being relayed.",
            ),
            buffered_body_bytes: gauge(
                &r,
                "lunakv_sidecar_buffered_body_bytes",
                "Request-body bytes buffered now (held against --max-buffered-body-bytes).",
            ),
            body_budget_refused: counter(
                &r,
                "lunakv_sidecar_body_budget_refused_total",
                "Requests refused (503) because --max-buffered-body-bytes was in use.",
            ),
            latency: histogram(
                &r,
                "lunakv_sidecar_request_duration_seconds",
                "Time from a request's arrival to its response headers.",
                &LATENCY_BUCKETS,
            ),
            responses,
            registry: r,
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Records one response: its status class and the time to its headers.
    pub fn observe_response(&self, status: u16, elapsed: std::time::Duration) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.responses[class].inc();
        self.latency.observe(elapsed.as_secs_f64());
    }

    pub fn render(&self) -> String {
        lunakv_telemetry::render(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Users' dashboards (deploy/) read these names, types and bounds: they stay as they were.
    #[test]
    fn families_keep_their_names_types_help_and_buckets() {
        let m = Metrics::default();
        m.observe_response(200, std::time::Duration::from_millis(3));
        let text = m.render();
        let lines = [
            "# HELP lunakv_sidecar_requests_total Requests received.",
            "# TYPE lunakv_sidecar_requests_total counter",
            "# HELP lunakv_sidecar_inflight_requests Requests not finished (body included).",
            "# TYPE lunakv_sidecar_inflight_requests gauge",
            "# TYPE lunakv_sidecar_upstream_streams gauge",
            "# TYPE lunakv_sidecar_buffered_body_bytes gauge",
            "# HELP lunakv_sidecar_body_budget_refused_total Requests refused (503) because \
             --max-buffered-body-bytes was in use.",
            "# HELP lunakv_sidecar_request_duration_seconds Time from a request's arrival to its \
             response headers.",
            "# TYPE lunakv_sidecar_request_duration_seconds histogram",
            "lunakv_sidecar_request_duration_seconds_bucket{le=\"0.001\"} 0",
            "lunakv_sidecar_request_duration_seconds_bucket{le=\"0.005\"} 1",
            "lunakv_sidecar_request_duration_seconds_bucket{le=\"60\"} 1",
            "lunakv_sidecar_request_duration_seconds_bucket{le=\"+Inf\"} 1",
            "lunakv_sidecar_request_duration_seconds_count 1",
            "# TYPE lunakv_sidecar_responses_total counter",
            "lunakv_sidecar_responses_total{class=\"1xx\"} 0",
            "lunakv_sidecar_responses_total{class=\"2xx\"} 1",
            "lunakv_sidecar_responses_total{class=\"5xx\"} 0",
        ];
        for line in lines {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
    }
}
