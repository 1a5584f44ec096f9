//! The OTLP pipeline behind [`crate::init`]: which environment turns it on, the exporter
//! (`http/protobuf` or `grpc`), the resource, and the tracer provider with its batch processor.
//!
//! Exports run on a one-thread tokio runtime owned by the pipeline, never on the service's own:
//! the batch processor's thread hands each batch to it. So `init` works before the service
//! starts its runtime (`lunakv-store`), inside a host that has none (the Python module), and the
//! final flush on SIGTERM cannot deadlock on a runtime that is busy shutting down.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Key, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
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
                    .build(),
                _ => opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(Protocol::HttpBinary)
                    .with_endpoint(http_url(var, &endpoint))
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
#[derive(Debug)]
struct OnRuntime {
    inner: Arc<opentelemetry_otlp::SpanExporter>,
    rt: tokio::runtime::Handle,
}

impl SpanExporter for OnRuntime {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let inner = self.inner.clone();
        let task = self.rt.spawn(async move { inner.export(batch).await });
        async move {
            task.await.unwrap_or_else(|e| {
                Err(OTelSdkError::InternalFailure(format!(
                    "the trace export task failed: {e}"
                )))
            })
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called once while the provider is built, before any export holds a clone.
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
