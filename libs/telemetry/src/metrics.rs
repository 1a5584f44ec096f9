//! Registering a service's metrics: one call per metric, with its name, HELP text and (for
//! histograms) bucket bounds, into a registry the service owns. Every service renders its
//! registry with [`crate::render`], so its `# HELP` / `# TYPE` lines and histogram series are
//! written by the prometheus encoder rather than by hand.
//!
//! Definitions are static, so a bad name or a name registered twice is a programming error:
//! these functions panic on it (at startup, where a test meets it first).

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};
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

/// Series read at scrape time from state the service keeps elsewhere: an info gauge per
/// mounted segment, or histogram buckets counted in atomics by a library that does not link
/// prometheus. Labels keep the order given (a gauge vec sorts them by name). Fill one per
/// scrape and [`register`] it in that scrape's registry.
#[derive(Clone)]
pub struct Scraped {
    desc: Desc,
    family: MetricFamily,
}

impl Scraped {
    /// An empty gauge family `name`.
    pub fn gauge(name: &str, help: &str) -> Scraped {
        Scraped::new(name, help, MetricType::GAUGE)
    }

    /// An empty histogram family `name`.
    pub fn histogram(name: &str, help: &str) -> Scraped {
        Scraped::new(name, help, MetricType::HISTOGRAM)
    }

    fn new(name: &str, help: &str, kind: MetricType) -> Scraped {
        let desc = Desc::new(
            name.to_string(),
            help.to_string(),
            Vec::new(),
            Default::default(),
        )
        .expect("static metric definition");
        let mut family = MetricFamily::default();
        family.set_name(name.to_string());
        family.set_help(help.to_string());
        family.set_field_type(kind);
        Scraped { desc, family }
    }

    /// One gauge series.
    pub fn add_gauge(&mut self, labels: &[(&str, &str)], value: f64) {
        let mut gauge = proto::Gauge::default();
        gauge.set_value(value);
        let mut m = proto::Metric::from_label(label_pairs(labels));
        m.set_gauge(gauge);
        self.family.mut_metric().push(m);
    }

    /// One histogram series: `cumulative` holds `(upper bound, observations at or below it)`
    /// in ascending order; the `+Inf` bucket is `count`.
    pub fn add_histogram(
        &mut self,
        labels: &[(&str, &str)],
        cumulative: impl IntoIterator<Item = (f64, u64)>,
        count: u64,
        sum: f64,
    ) {
        let mut h = proto::Histogram::default();
        h.set_bucket(
            cumulative
                .into_iter()
                .map(|(bound, n)| {
                    let mut b = proto::Bucket::default();
                    b.set_upper_bound(bound);
                    b.set_cumulative_count(n);
                    b
                })
                .collect(),
        );
        h.set_sample_count(count);
        h.set_sample_sum(sum);
        let mut m = proto::Metric::from_label(label_pairs(labels));
        m.set_histogram(h);
        self.family.mut_metric().push(m);
    }
}

fn label_pairs(labels: &[(&str, &str)]) -> Vec<LabelPair> {
    labels
        .iter()
        .map(|(name, value)| {
            let mut pair = LabelPair::default();
            pair.set_name((*name).to_string());
            pair.set_value((*value).to_string());
            pair
        })
        .collect()
}

impl Collector for Scraped {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        vec![self.family.clone()]
    }
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
    fn scraped_series_keep_their_label_order_and_buckets() {
        let r = Registry::new();
        let mut info = Scraped::gauge("demo_info", "Demo info.");
        info.add_gauge(&[("segment", "s\"1"), ("requested", "rdma")], 1.0);
        register(&r, info);
        let mut h = Scraped::histogram("demo_op_seconds", "Demo ops.");
        h.add_histogram(&[("op", "get")], [(0.001, 1), (1.0, 3)], 4, 2.5);
        register(&r, h);
        let text = crate::render(&r);
        for line in [
            "# HELP demo_info Demo info.",
            "# TYPE demo_info gauge",
            "demo_info{segment=\"s\\\"1\",requested=\"rdma\"} 1",
            "# TYPE demo_op_seconds histogram",
            "demo_op_seconds_bucket{op=\"get\",le=\"0.001\"} 1",
            "demo_op_seconds_bucket{op=\"get\",le=\"1\"} 3",
            "demo_op_seconds_bucket{op=\"get\",le=\"+Inf\"} 4",
            "demo_op_seconds_sum{op=\"get\"} 2.5",
            "demo_op_seconds_count{op=\"get\"} 4",
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
