//! # lunakv-telemetry
//!
//! Logs, traces and metrics setup shared by every lunakv binary (`lunakv-master`, `lunakv-store`,
//! `lunakv-bootstrap`, `lunakv-sidecar`, `lunakv-engine-sim`, the `lunakv` CLI and the Python
//! module). One call, [`init`] (or [`Init`] for the few knobs), installs the global `tracing`
//! subscriber:
//!
//! - logs filtered by `RUST_LOG` (default `info`), written to stderr so that stdout stays free
//!   for machine-readable lines such as the master's `listening` line; one event per line, the
//!   control characters of every field escaped ([`escape`]: a peer's key cannot forge lines);
//!   coloured only when
//!   stderr is a terminal and `NO_COLOR` is unset (<https://no-color.org>), one JSON object per
//!   line with `LUNAKV_LOG_FORMAT=json` (for log collectors);
//! - when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, every
//!   `tracing` span also becomes an OpenTelemetry span exported over OTLP, honouring the standard
//!   `OTEL_*` variables (docs/TRACING.md). Without it no exporter, thread or runtime is created,
//!   and [`enabled`] stays false, which turns every hook of [`propagate`] into a no-op.
//!
//! [`init`] returns a [`Telemetry`] guard: hold it in `main` until exit. Dropping it flushes the
//! spans still queued and stops the exporter, so a SIGTERM drain loses no trace.
//!
//! [`propagate`] carries W3C trace context across process boundaries: HTTP headers, gRPC
//! metadata, and a binary form for lunakv's own transfer wire.
//!
//! [`render`] turns a Prometheus [`Registry`] into the text exposition format for a `/metrics`
//! route; [`metrics`] registers a service's counters, gauges and histograms into one. Registries
//! are owned by each service instance, not global, so tests can run several services in one
//! process.
//!
//! [`shutdown_signal`] is the SIGTERM/SIGINT wait each binary hands its server to start the drain.
//!
//! [`wait`] is how a service waits for a peer at startup (the master, etcd, a decode engine):
//! backoff, one WARN line, one more every 30 s while waiting, one INFO line when it answers.
#![forbid(unsafe_code)]

pub mod announce;
pub mod escape;
mod export;
pub mod metrics;
pub mod propagate;
mod shutdown;
pub use announce::announce;
pub mod wait;

use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::{Encoder, Registry, TextEncoder};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use export::ExportError;
pub use shutdown::shutdown_signal;

/// Set while an OTLP exporter is installed; read by every propagation hook, so with tracing off
/// they cost one relaxed load.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// What the trace layer records unless `LUNAKV_TRACE_FILTER` says otherwise: lunakv's own info
/// spans, never the exporter's transport crates (an export must not trace itself).
const DEFAULT_TRACE_FILTER: &str = "info,h2=off,hyper=off,hyper_util=off,tonic=off,tower=off,\
     opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off,opentelemetry_http=off";

/// True while spans are exported (an OTLP endpoint was configured and [`init`] installed the
/// exporter). Propagation hooks and optional spans check it first.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// `make()` when spans are exported, else [`tracing::Span::none`]: for spans on hot paths that
/// exist for traces only (a client `put`), so that logging without traces pays nothing for them.
pub fn trace_span(make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    if enabled() {
        make()
    } else {
        tracing::Span::none()
    }
}

/// The few things a binary may choose about its subscriber; [`init`] is `Init::new(service)`.
#[derive(Clone)]
pub struct Init<'a> {
    service: &'a str,
    log_env: &'a [&'a str],
    default_log_filter: &'a str,
    log_target: bool,
    ansi: Option<bool>,
    env: Option<&'a Env>,
}

/// A lookup in an environment: the process's, or a test's map.
pub type Env = dyn Fn(&str) -> Option<String>;

impl<'a> Init<'a> {
    /// `service` names the process in logs and is the default `service.name` of its spans
    /// (`OTEL_SERVICE_NAME` or a `service.name` in `OTEL_RESOURCE_ATTRIBUTES` win).
    pub fn new(service: &'a str) -> Init<'a> {
        Init {
            service,
            log_env: &["RUST_LOG"],
            default_log_filter: "info",
            log_target: true,
            ansi: None,
            env: None,
        }
    }

    /// Where lunakv's own decisions (export on or off, protocol, endpoint, filters) read the
    /// environment [default: the process environment]; for tests, which must not change the
    /// process environment. The SDK still reads its own `OTEL_*` knobs (sampler, batching,
    /// resource, headers, timeout) from the process.
    pub fn env(mut self, env: &'a Env) -> Self {
        self.env = Some(env);
        self
    }

    /// Variables holding the log filter, first non-empty one wins [default: `RUST_LOG`].
    pub fn log_env(mut self, vars: &'a [&'a str]) -> Self {
        self.log_env = vars;
        self
    }

    /// The log filter when none of [`Init::log_env`] is set [default: `info`; a CLI uses `off`].
    pub fn default_log_filter(mut self, filter: &'a str) -> Self {
        self.default_log_filter = filter;
        self
    }

    /// Whether log lines show the module they come from [default: yes].
    pub fn log_target(mut self, on: bool) -> Self {
        self.log_target = on;
        self
    }

    /// Colours in log lines [default: when stderr is a terminal]. `NO_COLOR` (non-empty)
    /// turns them off regardless.
    pub fn ansi(mut self, on: bool) -> Self {
        self.ansi = Some(on);
        self
    }

    /// Installs the global subscriber and, when configured, the OTLP exporter. Safe to call more
    /// than once: when a global subscriber exists already (a second call, a host process that
    /// installed its own), nothing is installed and the guard is inert.
    pub fn install(self) -> Telemetry {
        let process = |k: &str| std::env::var(k).ok();
        let env = self.env.unwrap_or(&process);
        let (log_filter, log_problem) = filter_from(env, self.log_env, self.default_log_filter);
        let (pipeline, export_problem) = match export::Pipeline::from_env(self.service, env) {
            Ok(p) => (p, None),
            Err(e) => (None, Some(e)),
        };
        let (trace_filter, trace_problem) =
            filter_from(env, &["LUNAKV_TRACE_FILTER"], DEFAULT_TRACE_FILTER);
        let trace_layer = pipeline.as_ref().map(|p| {
            tracing_opentelemetry::layer()
                .with_tracer(p.tracer())
                .with_filter(trace_filter)
        });
        let (format, format_problem) = log_format(env);
        let no_color = env("NO_COLOR").is_some_and(|v| !v.is_empty());
        let ansi = !no_color
            && self
                .ansi
                .unwrap_or_else(|| std::io::IsTerminal::is_terminal(&std::io::stderr()));
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_target(self.log_target);
        let fmt_layer = match format {
            LogFormat::Json => fmt.json().with_ansi(false).with_filter(log_filter).boxed(),
            // Peer-supplied values (keys, ids, names) cannot break a line: escape::EscapedFields.
            LogFormat::Text => fmt
                .fmt_fields(escape::EscapedFields)
                .with_ansi(ansi)
                .with_filter(log_filter)
                .boxed(),
        };
        let installed = tracing_subscriber::registry()
            .with(fmt_layer)
            .with(trace_layer)
            .try_init()
            .is_ok();
        if !installed {
            // Spans go to the subscriber already installed, never to this exporter: drop it.
            if let Some(p) = pipeline {
                p.shutdown();
            }
            return Telemetry { pipeline: None };
        }
        let traces = pipeline.is_some();
        ENABLED.store(traces, Ordering::Relaxed);
        tracing::info!(
            service = self.service,
            version = env!("CARGO_PKG_VERSION"),
            traces,
            "telemetry initialised"
        );
        for p in [
            log_problem,
            format_problem,
            trace_problem.filter(|_| traces),
        ]
        .into_iter()
        .flatten()
        {
            tracing::warn!("{p}");
        }
        if let Some(e) = export_problem {
            tracing::error!("{e}; traces are not exported");
        }
        Telemetry { pipeline }
    }
}

/// How log lines are written (`LUNAKV_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

/// `LUNAKV_LOG_FORMAT`: `text` (default) or `json`; anything else is text with a message
/// naming the variable, its value and the choices.
fn log_format(env: &dyn Fn(&str) -> Option<String>) -> (LogFormat, Option<String>) {
    let Some(v) = env("LUNAKV_LOG_FORMAT").filter(|v| !v.trim().is_empty()) else {
        return (LogFormat::Text, None);
    };
    match v.trim().to_ascii_lowercase().as_str() {
        "text" => (LogFormat::Text, None),
        "json" => (LogFormat::Json, None),
        _ => (
            LogFormat::Text,
            Some(format!(
                "LUNAKV_LOG_FORMAT={v:?} is not a log format; using text. Use \"text\" or \
                 \"json\" (one JSON object per line)"
            )),
        ),
    }
}

/// The first non-empty filter among `vars`, else `default`; a bad filter falls back to the
/// default with a message naming the variable, its value and the fix.
fn filter_from(
    env: &dyn Fn(&str) -> Option<String>,
    vars: &[&str],
    default: &str,
) -> (EnvFilter, Option<String>) {
    let fallback = || EnvFilter::try_new(default).unwrap_or_else(|_| EnvFilter::new("info"));
    let Some((var, value)) = vars
        .iter()
        .find_map(|v| env(v).filter(|s| !s.trim().is_empty()).map(|s| (*v, s)))
    else {
        return (fallback(), None);
    };
    match EnvFilter::try_new(&value) {
        Ok(f) => (f, None),
        Err(e) => (
            fallback(),
            Some(format!(
                "{var}={value:?} is not a valid filter ({e}); using '{default}'. Use a level \
                 (warn) or directives (info,lunakv_master=debug)"
            )),
        ),
    }
}

/// Installs logging (and traces when `OTEL_EXPORTER_OTLP_ENDPOINT` is set) for `service_name`;
/// see the crate docs. Keep the returned guard until exit.
pub fn init(service_name: &str) -> Telemetry {
    Init::new(service_name).install()
}

/// Returned by [`init`]: owns the trace exporter, if any. Dropping it (or [`Telemetry::shutdown`])
/// exports the spans still queued, waiting at most the exporter's timeout, then stops it.
#[must_use = "dropping the guard stops trace export at once; keep it until main returns"]
pub struct Telemetry {
    pipeline: Option<export::Pipeline>,
}

impl Telemetry {
    /// Whether this process exports traces.
    pub fn exporting(&self) -> bool {
        self.pipeline.is_some()
    }

    /// Flushes and stops the exporter now (what dropping the guard does).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(p) = self.pipeline.take() {
            // Spans ending after this are not exported; stop propagating contexts for them.
            ENABLED.store(false, Ordering::Relaxed);
            p.shutdown();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("exporting", &self.exporting())
            .finish()
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

/// A Prometheus label value escaped for the text format (backslash, quote, newline), for
/// hand-written info gauges whose labels come from peers or configs.
pub fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The process-wide families every service's `/metrics` ends with: `process_*` (CPU seconds,
/// resident memory, open fds, start time; Linux) and `lunakv_build_info{service,version} 1`.
/// Registered once per process (the first `service` named wins); append it once per scrape.
pub fn render_process(service: &str) -> String {
    static PROCESS: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    let registry = PROCESS.get_or_init(|| {
        let r = Registry::new();
        // Both only fail on a duplicate name in this fresh registry.
        let _ = r.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
        if let Ok(info) = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "lunakv_build_info",
                "Build of this lunakv process (always 1)",
            ),
            &["service", "version"],
        ) {
            info.with_label_values(&[service, env!("CARGO_PKG_VERSION")])
                .set(1);
            let _ = r.register(Box::new(info));
        }
        r
    });
    render(registry)
}

/// The content type to send with [`render`]'s output.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{IntCounter, Opts};

    #[test]
    fn log_format_is_text_unless_json_is_asked_and_a_bad_value_names_the_choices() {
        let env = |v: &'static str| move |k: &str| (k == "LUNAKV_LOG_FORMAT").then(|| v.into());
        assert_eq!(log_format(&|_: &str| None), (LogFormat::Text, None));
        assert_eq!(log_format(&env("JSON")).0, LogFormat::Json);
        assert_eq!(log_format(&env("text")), (LogFormat::Text, None));
        let (f, problem) = log_format(&env("xml"));
        let problem = problem.expect("a message");
        assert_eq!(f, LogFormat::Text);
        assert!(
            problem.contains("LUNAKV_LOG_FORMAT=\"xml\"") && problem.contains("\"json\""),
            "{problem}"
        );
    }

    #[test]
    fn process_families_and_build_info_render() {
        let text = render_process("test-service");
        assert!(
            text.contains("lunakv_build_info{service=\"test-service\",version=\""),
            "{text}"
        );
        assert!(
            text.contains("# TYPE process_cpu_seconds_total counter"),
            "{text}"
        );
        assert!(text.contains("process_resident_memory_bytes"), "{text}");
    }

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
    fn init_twice_is_harmless_and_exports_nothing_without_an_endpoint() {
        let none = |_: &str| None;
        let first = Init::new("test").env(&none).install();
        let second = Init::new("test").env(&none).install();
        assert!(!first.exporting() && !second.exporting());
        assert!(!enabled());
        assert!(trace_span(|| tracing::info_span!("x")).is_none());
    }

    #[test]
    fn a_bad_filter_names_its_variable_and_falls_back() {
        let env = |k: &str| (k == "RUST_LOG").then(|| "info,[".to_owned());
        let (_, problem) = filter_from(&env, &["RUST_LOG"], "warn");
        let p = problem.expect("a bad filter is reported");
        assert!(
            p.contains("RUST_LOG=\"info,[\"") && p.contains("'warn'"),
            "{p}"
        );
        let env = |k: &str| (k == "B").then(|| "debug".to_owned());
        let (f, problem) = filter_from(&env, &["A", "B"], "warn");
        assert!(problem.is_none());
        assert_eq!(f.to_string(), "debug");
    }
}
