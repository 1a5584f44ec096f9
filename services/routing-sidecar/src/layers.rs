//! Tower layers wrapped around [`crate::proxy::Proxy`] (outermost first):
//! [`RequestIdLayer`] gives every request an `x-request-id` (the client's, or a new uuid), opens
//! its tracing span and echoes the id on the response; [`InflightLayer`] counts the request as
//! in flight until its response body is finished *or dropped*, which is how a client that
//! disconnects mid-stream is seen to leave nothing behind.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response};
use tower::{Layer, Service};
use tracing::Instrument;

use crate::body::{self, Body, GaugeGuard, Guarded};
use crate::metrics::Metrics;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A fresh uuid v4 request id. The random bytes come from the thread's RNG (seeded once from
/// the OS) instead of `Uuid::new_v4`'s getrandom syscall per request, and the text is encoded
/// on the stack.
fn new_request_id() -> HeaderValue {
    let id = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    HeaderValue::from_str(id.hyphenated().encode_lower(&mut buf))
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

#[derive(Clone, Copy, Debug, Default)]
pub struct RequestIdLayer;

impl<S> Layer<S> for RequestIdLayer {
    type Service = RequestId<S>;
    fn layer(&self, inner: S) -> RequestId<S> {
        RequestId { inner }
    }
}

#[derive(Clone, Debug)]
pub struct RequestId<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for RequestId<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let rid = match req.headers().get("x-request-id") {
            Some(v) if !v.is_empty() => v.clone(),
            _ => new_request_id(),
        };
        req.headers_mut().insert("x-request-id", rid.clone());
        // Kubelet probes and metric scrapes arrive every few seconds: without a caller's trace
        // they get no span, so they neither start traces nor flood the collector.
        let quiet = matches!(req.uri().path(), "/health" | crate::METRICS_PATH)
            && !lunakv_telemetry::propagate::carries_context(req.headers());
        let span = if quiet {
            tracing::Span::none()
        } else {
            tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = ?rid, otel.kind = tracing::field::Empty)
        };
        // The request continues its caller's trace (docs/TRACING.md).
        lunakv_telemetry::propagate::serve_under(&span, req.headers());
        let fut = self.inner.call(req);
        Box::pin(
            async move {
                let mut r = fut.await?;
                r.headers_mut().insert("x-request-id", rid);
                Ok(r)
            }
            .instrument(span),
        )
    }
}

#[derive(Clone, Debug)]
pub struct InflightLayer {
    metrics: Arc<Metrics>,
}

impl InflightLayer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        InflightLayer { metrics }
    }
}

impl<S> Layer<S> for InflightLayer {
    type Service = Inflight<S>;
    fn layer(&self, inner: S) -> Inflight<S> {
        Inflight {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Inflight<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B> Service<Request<B>> for Inflight<S>
where
    S: Service<Request<B>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Dropped with the future if the client leaves before the response, else with the body.
        let guard = GaugeGuard::new(self.metrics.clone(), |m| &m.inflight);
        let started = std::time::Instant::now();
        let metrics = self.metrics.clone();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await?;
            metrics.observe_response(r.status().as_u16(), started.elapsed());
            Ok(r.map(|b| body::boxed(Guarded::new(b, guard))))
        })
    }
}
