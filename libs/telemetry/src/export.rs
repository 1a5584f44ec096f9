//! The OTLP pipeline behind [`crate::init`]: which environment turns it on, the exporter
//! (`http/protobuf` or `grpc`), the resource, and the tracer provider with its batch processor.
//!
//! Exports run on a one-thread tokio runtime owned by the pipeline, never on the service's own:
//! the batch processor's thread hands each batch to it. So `init` works before the service
//! starts its runtime (`lunakv-store`), inside a host that has none (the Python module), and the
//! final flush on SIGTERM cannot deadlock on a runtime that is busy shutting down.
//!
//! An unreachable collector costs little and says so once: each batch is tried once (no
//! retries: a CLI's exit flush would wait ~1 s for them), and after a failure the batches of the
//! next [`COOLDOWN`] are dropped without touching the network. The first failure logs one WARN
//! naming the endpoint, then one WARN per [`REPORT_EVERY`] while it lasts, and one INFO when
//! export works again ([`Health`]). The SDK's own per-batch error lines are compiled out (the
//! workspace builds the opentelemetry crates without `internal-logs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Key, KeyValue};
use opentelemetry_otlp::{
    Protocol, RetryPolicy, WithExportConfig, WithHttpConfig, WithTonicConfig,
};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanData, SpanExporter};

/// Why traces cannot be exported; `init` logs it and runs without traces.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(
        "{var}={value:?} is not an OTLP protocol lunakv exports: set it to http/protobuf (the \
         default) or grpc"
    )]
    Protocol { var: &'static str, value: String },
    #[error(
        "cannot set up the OTLP exporter for {var}={endpoint:?}: {message}; set it to the \
         collector's URL, e.g. http://otel-collector:4318 (http/protobuf) or \
         http://otel-collector:4317 (grpc)"
    )]
    Exporter {
        var: &'static str,
        endpoint: String,
        message: String,
    },
    #[error("cannot start the trace export thread: {0}")]
    Runtime(#[source] std::io::Error),
}

/// The endpoint variable that turns export on, and its value; `None` when traces stay off:
/// no endpoint, `OTEL_SDK_DISABLED=true`, or an `OTEL_TRACES_EXPORTER` without `otlp`.
fn endpoint(env: &dyn Fn(&str) -> Option<String>) -> Option<(&'static str, String)> {
    let set = |k: &str| {
        env(k)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return None;
    }
    if let Some(exporters) = set("OTEL_TRACES_EXPORTER")
        && !exporters.split(',').any(|e| e.trim() == "otlp")
    {
        return None;
    }
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .find_map(|k| set(k).map(|v| (k, v)))
}

/// The http/protobuf URL: the generic endpoint is a base that gets the signal's path, the
/// signal-specific one is used as it is (the OTLP exporter spec's rule).
fn http_url(var: &str, endpoint: &str) -> String {
    if var == "OTEL_EXPORTER_OTLP_ENDPOINT" {
        format!("{}/v1/traces", endpoint.trim_end_matches('/'))
    } else {
        endpoint.to_owned()
    }
}

/// The signal's protocol variable, else the generic one, else http/protobuf (the OTLP spec's
/// default).
fn protocol(env: &dyn Fn(&str) -> Option<String>) -> Result<Protocol, ExportError> {
    let chosen = [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]
    .into_iter()
    .find_map(|k| {
        env(k)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .map(|v| (k, v))
    });
    match chosen {
        None => Ok(Protocol::HttpBinary),
        Some((_, v)) if v.eq_ignore_ascii_case("http/protobuf") => Ok(Protocol::HttpBinary),
        Some((_, v)) if v.eq_ignore_ascii_case("grpc") => Ok(Protocol::Grpc),
        Some((var, value)) => Err(ExportError::Protocol { var, value }),
    }
}

/// The detected resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), with `service` as
/// `service.name` unless those named one.
fn resource(service: &str) -> Resource {
    let detected = Resource::builder().build();
    let has = |k: &'static str| detected.get(&Key::from_static_str(k)).is_some();
    let named = detected
        .get(&Key::from_static_str("service.name"))
        .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
    let mut b = Resource::builder();
    if !named {
        b = b.with_service_name(service.to_owned());
    }
    if !has("service.version") {
        b = b.with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    }
    b.build()
}

/// A running OTLP pipeline.
pub(crate) struct Pipeline {
    provider: SdkTracerProvider,
    runtime: tokio::runtime::Runtime,
}

impl Pipeline {
    /// `Ok(None)` when the environment asks for no traces (see [`endpoint`]).
    pub(crate) fn from_env(
        service: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Pipeline>, ExportError> {
        let Some((var, endpoint)) = endpoint(env) else {
            return Ok(None);
        };
        let protocol = protocol(env)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lunakv-otlp")
            .enable_all()
            .build()
            .map_err(ExportError::Runtime)?;
        let built = {
            // tonic's lazy channel spawns its connection task on the current runtime: ours.
            let _rt = runtime.enter();
            match protocol {
                Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint.clone())
                    .with_retry_policy(RetryPolicy::disabled())
                    .build(),
                _ => opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(Protocol::HttpBinary)
                    .with_endpoint(http_url(var, &endpoint))
                    .with_retry_policy(RetryPolicy::disabled())
                    .build(),
            }
        };
        let exporter = match built {
            Ok(e) => e,
            Err(e) => {
                // init may run inside a service's runtime, where dropping ours would panic.
                runtime.shutdown_background();
                return Err(ExportError::Exporter {
                    var,
                    endpoint: endpoint.clone(),
                    message: e.to_string(),
                });
            }
        };
        let provider = SdkTracerProvider::builder()
            .with_resource(resource(service))
            .with_batch_exporter(OnRuntime {
                inner: Arc::new(exporter),
                rt: runtime.handle().clone(),
                health: Arc::new(parking_lot::Mutex::new(Health::new(endpoint.clone()))),
            })
            .build();
        Ok(Some(Pipeline { provider, runtime }))
    }

    pub(crate) fn tracer(&self) -> SdkTracer {
        self.provider.tracer("lunakv")
    }

    /// Exports what is queued (bounded by the exporter's timeout), then stops.
    pub(crate) fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "flushing traces at exit failed; the last spans may be lost");
        }
        // The exports are done; and unlike dropping it (or shutdown_timeout), this is allowed
        // inside the service's runtime, where the guard usually drops.
        self.runtime.shutdown_background();
    }
}

/// Runs every export of `inner` on the pipeline's runtime: the batch processor calls exporters
/// from its own plain thread, where neither hyper's client nor tokio timers work.
/// After a failed export, how long batches are dropped without a try.
pub(crate) const COOLDOWN: Duration = Duration::from_secs(10);
/// While exports keep failing, how often that is logged again.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(300);

/// Whether the collector answers, and what has been said about it: decides when a batch is
/// tried and which failures are worth a log line.
#[derive(Debug)]
pub(crate) struct Health {
    endpoint: String,
    /// Set while exports fail: since when, and the batches and spans lost since.
    failing: Option<Failing>,
}

#[derive(Debug, Clone, Copy)]
struct Failing {
    since: Instant,
    retry_at: Instant,
    reported_at: Instant,
    batches: u64,
    spans: u64,
}

/// What [`Health`] wants logged after an export.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Report {
    /// The first failure: the endpoint and the error.
    Down { error: String },
    /// Still failing, [`REPORT_EVERY`] after the last line.
    StillDown {
        batches: u64,
        spans: u64,
        for_secs: u64,
    },
    /// Export works again.
    Up { batches: u64, spans: u64 },
}

impl Health {
    pub(crate) fn new(endpoint: String) -> Health {
        Health {
            endpoint,
            failing: None,
        }
    }

    /// Should a batch go out now? No during the cooldown after a failure; the batch's spans are
    /// counted as lost then.
    pub(crate) fn attempt(&mut self, now: Instant, spans: usize) -> bool {
        match &mut self.failing {
            Some(f) if now < f.retry_at => {
                f.batches += 1;
                f.spans += spans as u64;
                false
            }
            _ => true,
        }
    }

    /// Records an export's outcome; returns what to log, if anything.
    pub(crate) fn outcome(
        &mut self,
        now: Instant,
        spans: usize,
        result: &OTelSdkResult,
    ) -> Option<Report> {
        match (result, &mut self.failing) {
            (Ok(()), None) => None,
            (Ok(()), Some(f)) => {
                let r = Report::Up {
                    batches: f.batches,
                    spans: f.spans,
                };
                self.failing = None;
                Some(r)
            }
            (Err(e), None) => {
                self.failing = Some(Failing {
                    since: now,
                    retry_at: now + COOLDOWN,
                    reported_at: now,
                    batches: 1,
                    spans: spans as u64,
                });
                Some(Report::Down {
                    error: e.to_string(),
                })
            }
            (Err(_), Some(f)) => {
                f.batches += 1;
                f.spans += spans as u64;
                f.retry_at = now + COOLDOWN;
                if now.duration_since(f.reported_at) >= REPORT_EVERY {
                    f.reported_at = now;
                    Some(Report::StillDown {
                        batches: f.batches,
                        spans: f.spans,
                        for_secs: now.duration_since(f.since).as_secs(),
                    })
                } else {
                    None
                }
            }
        }
    }

    fn log(&self, r: Report) {
        let endpoint = &self.endpoint;
        match r {
            Report::Down { error } => tracing::warn!(
                endpoint = %endpoint,
                %error,
                "cannot export traces to the OTLP collector; dropping spans, trying again every \
                 {}s and reporting every {}s while it fails",
                COOLDOWN.as_secs(),
                REPORT_EVERY.as_secs()
            ),
            Report::StillDown {
                batches,
                spans,
                for_secs,
            } => tracing::warn!(
                endpoint = %endpoint,
                batches,
                spans,
                "trace export still failing after {for_secs}s; spans dropped meanwhile"
            ),
            Report::Up { batches, spans } => tracing::info!(
                endpoint = %endpoint,
                batches,
                spans,
                "trace export works again; spans dropped while it failed"
            ),
        }
    }
}

/// The exporter behind the batch processor: runs each export on the pipeline's runtime (the
/// processor's thread has none) and keeps an unreachable collector cheap and quiet ([`Health`]).
#[derive(Debug)]
struct OnRuntime<E> {
    inner: Arc<E>,
    rt: tokio::runtime::Handle,
    health: Arc<parking_lot::Mutex<Health>>,
}

impl<E: SpanExporter + Send + Sync + 'static> SpanExporter for OnRuntime<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let spans = batch.len();
        let go = self.health.lock().attempt(Instant::now(), spans);
        let inner = self.inner.clone();
        let health = self.health.clone();
        let task = go.then(|| self.rt.spawn(async move { inner.export(batch).await }));
        async move {
            let Some(task) = task else {
                return Err(OTelSdkError::InternalFailure(
                    "the OTLP collector failed recently; batch dropped".into(),
                ));
            };
            let result = task.await.unwrap_or_else(|e| {
                Err(OTelSdkError::InternalFailure(format!(
                    "the trace export task failed: {e}"
                )))
            });
            let mut h = health.lock();
            if let Some(r) = h.outcome(Instant::now(), spans, &result) {
                h.log(r);
            }
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        if let Some(e) = Arc::get_mut(&mut self.inner) {
            e.set_resource(resource);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let m: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn export_needs_an_endpoint_and_respects_the_off_switches() {
        assert_eq!(endpoint(&env_of(&[])), None);
        assert_eq!(
            endpoint(&env_of(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])),
            None
        );
        let on = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318");
        assert_eq!(
            endpoint(&env_of(&[on])),
            Some(("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318".into()))
        );
        assert_eq!(
            endpoint(&env_of(&[
                on,
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://t:4318/v1/traces"
                )
            ]))
            .map(|(k, _)| k),
            Some("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        );
        assert_eq!(
            endpoint(&env_of(&[on, ("OTEL_SDK_DISABLED", "TRUE")])),
            None
        );
        assert_eq!(
            endpoint(&env_of(&[on, ("OTEL_TRACES_EXPORTER", "none")])),
            None
        );
        assert!(endpoint(&env_of(&[on, ("OTEL_TRACES_EXPORTER", "console,otlp")])).is_some());
        // Without an endpoint nothing is built: no runtime, no thread.
        assert!(Pipeline::from_env("t", &env_of(&[])).unwrap().is_none());
    }

    fn failed(why: &str) -> OTelSdkResult {
        Err(OTelSdkError::InternalFailure(why.into()))
    }

    #[test]
    fn an_unreachable_collector_is_tried_once_per_cooldown_and_logged_once() {
        let t0 = Instant::now();
        let mut h = Health::new("http://c:4318".into());
        assert!(h.attempt(t0, 3));
        assert_eq!(h.outcome(t0, 3, &Ok(())), None, "success says nothing");
        assert!(h.attempt(t0, 4));
        assert_eq!(
            h.outcome(t0, 4, &failed("connection refused")),
            Some(Report::Down {
                error: "Operation failed: connection refused".into()
            })
        );
        // Within the cooldown: no network, nothing logged, the spans counted.
        let mut tries = 0;
        let mut logged = 0;
        let mut t = t0;
        while t < t0 + REPORT_EVERY - COOLDOWN {
            t += Duration::from_millis(500);
            if h.attempt(t, 2) {
                tries += 1;
                logged += h.outcome(t, 2, &failed("refused")).is_some() as u32;
            }
        }
        let expected = (REPORT_EVERY - COOLDOWN).as_secs() / COOLDOWN.as_secs();
        assert!(
            tries as u64 <= expected,
            "{tries} export attempts in {}s, want at most one per {}s",
            (REPORT_EVERY - COOLDOWN).as_secs(),
            COOLDOWN.as_secs()
        );
        assert_eq!(logged, 0, "no line per failed batch");
        // REPORT_EVERY after the first line, one more, with the totals.
        let t = t0 + REPORT_EVERY + COOLDOWN;
        assert!(h.attempt(t, 1));
        match h.outcome(t, 1, &failed("refused")) {
            Some(Report::StillDown { batches, spans, .. }) => {
                assert!(
                    batches > 100 && spans > 200,
                    "{batches} batches, {spans} spans"
                );
            }
            other => panic!("want a StillDown report, got {other:?}"),
        }
        // The collector answers again: one INFO, and the next failure is news again.
        let t = t + COOLDOWN;
        assert!(h.attempt(t, 1));
        assert!(matches!(h.outcome(t, 1, &Ok(())), Some(Report::Up { .. })));
        assert!(h.attempt(t, 1), "no cooldown once it works");
        assert!(matches!(
            h.outcome(t, 1, &failed("x")),
            Some(Report::Down { .. })
        ));
    }

    #[test]
    fn http_urls_follow_the_spec() {
        let generic = "OTEL_EXPORTER_OTLP_ENDPOINT";
        assert_eq!(
            http_url(generic, "http://c:4318/"),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            http_url(generic, "http://c:4318"),
            "http://c:4318/v1/traces"
        );
        let signal = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
        assert_eq!(http_url(signal, "http://c:4318/x"), "http://c:4318/x");
    }

    #[test]
    fn protocol_defaults_to_http_protobuf_and_refuses_unknown_values() {
        assert_eq!(protocol(&env_of(&[])).unwrap(), Protocol::HttpBinary);
        let grpc = ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc");
        assert_eq!(protocol(&env_of(&[grpc])).unwrap(), Protocol::Grpc);
        let signal = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf");
        assert_eq!(
            protocol(&env_of(&[grpc, signal])).unwrap(),
            Protocol::HttpBinary
        );
        let e = protocol(&env_of(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\"") && e.contains("grpc"),
            "{e}"
        );
    }

    #[test]
    fn setup_failure_and_shutdown_inside_a_services_runtime_do_not_panic() {
        // Services call init and drop the guard inside #[tokio::main], where dropping a runtime
        // (ours) panics unless it is shut down in the background.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let bad = env_of(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ]);
            assert!(Pipeline::from_env("t", &bad).is_err());
            for protocol in ["grpc", "http/protobuf"] {
                let ok = env_of(&[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9"),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
                ]);
                let p = Pipeline::from_env("t", &ok)
                    .expect("valid settings")
                    .expect("an endpoint turns export on");
                p.shutdown();
            }
        });
    }

    #[test]
    fn a_bad_endpoint_is_an_error_naming_the_variable() {
        let env = env_of(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]);
        match Pipeline::from_env("t", &env) {
            Err(e @ ExportError::Exporter { .. }) => {
                let m = e.to_string();
                assert!(
                    m.contains("OTEL_EXPORTER_OTLP_ENDPOINT=\"not a url\""),
                    "{m}"
                );
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a bad endpoint built an exporter"),
        }
    }
}
