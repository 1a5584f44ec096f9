//! Registering a service's metrics: one call per metric, with its name, HELP text and (for
//! histograms) bucket bounds, into a registry the service owns. Every service renders its
//! registry with [`crate::render`], so its `# HELP` / `# TYPE` lines and histogram series are
//! written by the prometheus encoder rather than by hand.
//!
//! Definitions are static, so a bad name or a name registered twice is a programming error:
//! these functions panic on it (at startup, where a test meets it first).

use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Registers `metric` with `r` and hands it back, for families built with options these helpers
/// do not cover.
pub fn register<C: Collector + Clone + 'static>(r: &Registry, metric: C) -> C {
    r.register(Box::new(metric.clone()))
        .expect("metric names are unique within a registry");
    metric
}

/// A counter `name`.
pub fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    register(
        r,
        IntCounter::with_opts(Opts::new(name, help)).expect("static metric definition"),
    )
}

/// A gauge `name`.
pub fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    register(
        r,
        IntGauge::with_opts(Opts::new(name, help)).expect("static metric definition"),
    )
}

/// A counter `name` with one series per value of `labels`.
pub fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(
        r,
        IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition"),
    )
}

/// A gauge `name` with one series per value of `labels`.
pub fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(
        r,
        IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition"),
    )
}

/// A histogram `name` over `buckets` (upper bounds in ascending order; +Inf is implicit).
pub fn histogram(r: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    register(
        r,
        Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
            .expect("static metric definition"),
    )
}

/// A histogram `name` over `buckets` with one series per value of `labels`.
pub fn histogram_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    register(
        r,
        HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            labels,
        )
        .expect("static metric definition"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_renders_its_help_type_and_series() {
        let r = Registry::new();
        counter(&r, "demo_total", "Demo events.").inc_by(2);
        gauge(&r, "demo_inflight", "Demo in flight.").set(-1);
        counter_vec(&r, "demo_by_class_total", "By class.", &["class"])
            .with_label_values(&["2xx"])
            .inc();
        histogram(&r, "demo_seconds", "Demo time.", &[0.001, 1.0, 60.0]).observe(0.5);
        let text = crate::render(&r);
        for line in [
            "# HELP demo_total Demo events.",
            "# TYPE demo_total counter",
            "demo_total 2",
            "# TYPE demo_inflight gauge",
            "demo_inflight -1",
            "demo_by_class_total{class=\"2xx\"} 1",
            "# TYPE demo_seconds histogram",
            "demo_seconds_bucket{le=\"0.001\"} 0",
            "demo_seconds_bucket{le=\"1\"} 1",
            "demo_seconds_bucket{le=\"60\"} 1",
            "demo_seconds_bucket{le=\"+Inf\"} 1",
            "demo_seconds_sum 0.5",
            "demo_seconds_count 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "unique")]
    fn a_name_registered_twice_is_a_bug() {
        let r = Registry::new();
        counter(&r, "twice_total", "Once.");
        counter(&r, "twice_total", "Twice.");
    }
}
