//! W3C trace context across process boundaries (docs/TRACING.md has the contract).
//!
//! - HTTP: [`inject_http`] writes `traceparent`/`tracestate` for a span into outgoing headers;
//!   [`set_parent_from_http`] makes an incoming request's context the parent of a span;
//!   [`HttpServerLayer`] does the latter for every request of a tower (axum) service, opening a
//!   server span; [`http_client_span`] opens the span of an outgoing call.
//! - gRPC: [`GrpcInject`] is a tonic client interceptor writing the current span's context into
//!   the request metadata; [`grpc_server_span`] is the `Server::builder().trace_fn` that opens a
//!   server span under the caller's context.
//! - lunakv's transfer wire: [`TraceParent`] is the binary form (trace id, span id, flags) the
//!   framed protocol carries (libs/transfer/src/wire.rs).
//!
//! Everything here is a no-op while [`crate::enabled`] is false: spans are `Span::none()`, no
//! header is written or read, and an incoming `traceparent` an HTTP proxy copies along is passed
//! on untouched.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use opentelemetry::propagation::{Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::enabled;

/// Writes `span`'s context into `headers` as `traceparent` (and `tracestate`), replacing any
/// already there. Nothing is written for a span without a context (tracing off, filtered out).
pub fn inject_http(span: &Span, headers: &mut http::HeaderMap) {
    if !enabled() {
        return;
    }
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
    }
}

/// Makes the context in `headers` (a `traceparent`) the remote parent of `span`. Call it before
/// the span is first entered; headers without a valid `traceparent` leave `span` a root.
pub fn set_parent_from_http(span: &Span, headers: &http::HeaderMap) {
    if !enabled() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    if cx.span().span_context().is_valid() {
        // Fails only when the span was already started or is disabled: it then stays a root.
        let _ = span.set_parent(cx);
    }
}

/// For a server span built elsewhere that declares an empty `otel.kind` field: marks it as the
/// server side of a call and parents it under the caller's context in `headers`.
pub fn serve_under(span: &Span, headers: &http::HeaderMap) {
    if !enabled() {
        return;
    }
    span.record("otel.kind", "server");
    set_parent_from_http(span, headers);
}

/// Whether `headers` carry a valid `traceparent`.
pub fn carries_context(headers: &http::HeaderMap) -> bool {
    TraceContextPropagator::new()
        .extract(&HeaderExtractor(headers))
        .span()
        .span_context()
        .is_valid()
}

/// Whether the current span belongs to an exported trace.
fn in_trace() -> bool {
    enabled() && Span::current().context().span().span_context().is_valid()
}

/// The client span of an outgoing HTTP call (`GET /query`), a child of the current span.
/// Outside a trace (a heartbeat loop) it is `Span::none()`: client calls join traces, they do
/// not start them.
pub fn http_client_span(method: &http::Method, uri: &http::Uri) -> Span {
    if !in_trace() {
        return Span::none();
    }
    tracing::info_span!(
        "http.client",
        otel.name = %format_args!("{method} {}", uri.path()),
        otel.kind = "client",
        http.request.method = %method,
        url.full = %uri,
        http.response.status_code = tracing::field::Empty,
    )
}

/// The server span of one HTTP request (`POST /v1/completions`), child of the caller's context.
pub fn http_server_span(method: &http::Method, path: &str, headers: &http::HeaderMap) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        "http.server",
        otel.name = %format_args!("{method} {path}"),
        otel.kind = "server",
        http.request.method = %method,
        url.path = %path,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    set_parent_from_http(&span, headers);
    span
}

/// Records a response status on a span from [`http_server_span`] or [`http_client_span`]
/// (5xx marks the span as an error).
pub fn record_http_status(span: &Span, status: http::StatusCode) {
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
}

/// A tower layer opening an [`http_server_span`] around every request (axum: `.layer(..)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpServerLayer {
    quiet: &'static [&'static str],
}

impl HttpServerLayer {
    pub fn new() -> HttpServerLayer {
        HttpServerLayer::default()
    }

    /// Requests to these paths (health checks, heartbeats, scrapes) open a span only when they
    /// carry a trace context, so that probes do not each start a trace.
    pub fn quiet(mut self, paths: &'static [&'static str]) -> HttpServerLayer {
        self.quiet = paths;
        self
    }
}

impl<S> tower::Layer<S> for HttpServerLayer {
    type Service = HttpServer<S>;
    fn layer(&self, inner: S) -> HttpServer<S> {
        HttpServer {
            inner,
            quiet: self.quiet,
        }
    }
}

/// The service [`HttpServerLayer`] builds.
#[derive(Debug, Clone)]
pub struct HttpServer<S> {
    inner: S,
    quiet: &'static [&'static str],
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for HttpServer<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let quiet = || self.quiet.contains(&req.uri().path()) && !carries_context(req.headers());
        if !enabled() || quiet() {
            return Box::pin(self.inner.call(req));
        }
        let span = http_server_span(req.method(), req.uri().path(), req.headers());
        let fut = span.in_scope(|| self.inner.call(req));
        let outer = span.clone();
        Box::pin(
            async move {
                let r = fut.await;
                if let Ok(resp) = &r {
                    record_http_status(&span, resp.status());
                }
                r
            }
            .instrument(outer),
        )
    }
}

/// A tonic client interceptor that sends the current span's context in the request metadata
/// (`MasterClient::with_interceptor(channel, GrpcInject)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcInject;

impl tonic::service::Interceptor for GrpcInject {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if enabled() {
            let cx = Span::current().context();
            if cx.span().span_context().is_valid() {
                TraceContextPropagator::new()
                    .inject_context(&cx, &mut MetadataInjector(req.metadata_mut()));
            }
        }
        Ok(req)
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        let key = tonic::metadata::MetadataKey::from_bytes(key.as_bytes());
        let value = tonic::metadata::MetadataValue::try_from(value.as_str());
        if let (Ok(k), Ok(v)) = (key, value) {
            self.0.insert(k, v);
        }
    }
}

/// For `tonic::transport::Server::builder().trace_fn(grpc_server_span)`: the server span of one
/// call (`otel.name` = `package.Service/Method`), child of the context in its metadata.
pub fn grpc_server_span(req: &http::Request<()>) -> Span {
    grpc_span(req, &[])
}

/// [`grpc_server_span`], except that calls of the `quiet` methods (a once-a-second heartbeat)
/// open a span only when they carry a trace context.
pub fn grpc_server_span_quiet(
    quiet: &'static [&'static str],
) -> impl Fn(&http::Request<()>) -> Span + Clone + Send + Sync + 'static {
    move |req| grpc_span(req, quiet)
}

fn grpc_span(req: &http::Request<()>, quiet: &[&str]) -> Span {
    if !enabled() {
        return Span::none();
    }
    let path = req.uri().path().trim_start_matches('/');
    let (service, method) = path.split_once('/').unwrap_or((path, ""));
    if quiet.contains(&method) && !carries_context(req.headers()) {
        return Span::none();
    }
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = %path,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = %service,
        rpc.method = %method,
    );
    set_parent_from_http(&span, req.headers());
    span
}

/// A span's W3C context in binary form, as lunakv's transfer wire carries it: the fields of a
/// `traceparent` without its text encoding (`tracestate` is not carried there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// W3C trace flags; bit 0 = sampled.
    pub flags: u8,
}

impl TraceParent {
    /// The current span's context, when spans are exported and it has one.
    pub fn current() -> Option<TraceParent> {
        if !enabled() {
            return None;
        }
        Self::of(&Span::current())
    }

    /// `span`'s context, if it has a valid one.
    pub fn of(span: &Span) -> Option<TraceParent> {
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        sc.is_valid().then(|| TraceParent {
            trace_id: sc.trace_id().to_bytes(),
            span_id: sc.span_id().to_bytes(),
            flags: sc.trace_flags().to_u8(),
        })
    }

    /// Makes this the remote parent of `span` (not yet entered). Ignored when spans are not
    /// exported or the ids are invalid (all zero).
    pub fn set_parent_of(&self, span: &Span) {
        if !enabled() {
            return;
        }
        let sc = SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            TraceFlags::new(self.flags),
            true,
            TraceState::default(),
        );
        if sc.is_valid() {
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
        }
    }
}
