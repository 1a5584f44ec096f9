//! The proxy service: routing, passthrough, relaying answers, and error mapping. The three
//! connector flows of a disaggregated request are in `flows.rs`.

// Flows return the client's error `Response` as their `Err`: built once per failed request, so
// boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Map, Value, json};
use tracing::Instrument;

use crate::body::{
    self, Body, BodyBudget, BodyPermit, GaugeGuard, Guarded, OverBudget, SseRewrite,
    error_response, rewrite_cached,
};
use crate::cache::{BootstrapCache, Engines};
use crate::config::{Connector, SidecarConfig};
use crate::metrics::Metrics;
use crate::peers::{DECODE_ENGINE, PREFILL_BOOTSTRAP, PREFILL_ENGINE, PeerLog};
use crate::ssrf::{Allowlist, split_host_port};

mod flows;

/// The header the scheduler sets to the chosen prefill pod(s).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// Routes that go through disaggregation when [`PREFILLER_HEADER`] is present.
pub const DISAGG_ROUTES: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
];
/// Bootstrap `/query` timeout (upstream's).
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(5);

pub type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>;

/// State shared by every listener.
pub struct Shared {
    pub cfg: SidecarConfig,
    pub prefill_client: HttpClient,
    pub decode_client: HttpClient,
    pub cache: BootstrapCache,
    /// Request-body bytes buffered at once (`--max-buffered-body-bytes`).
    pub body_budget: BodyBudget,
    pub allow: Option<Arc<Allowlist>>,
    pub metrics: Arc<Metrics>,
    /// Upstreams that refuse connections, logged once (and every 30 s) instead of per request.
    pub peers: Arc<PeerLog>,
}

/// One listener's service: the shared state plus its model server (data-parallel rank).
#[derive(Clone)]
pub struct Proxy {
    pub shared: Arc<Shared>,
    /// `http(s)://host:port` of the local model server for this listener.
    pub decoder: Arc<str>,
    /// The same, pre-parsed: passthrough requests reuse it instead of formatting and parsing a
    /// URL per request.
    pub decoder_base: DecoderBase,
}

/// Scheme and authority of the local model server.
#[derive(Clone, Debug)]
pub struct DecoderBase {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
}

impl DecoderBase {
    /// Parses `http(s)://host:port`.
    pub fn parse(base: &str) -> Result<DecoderBase, DecoderBaseError> {
        let u: Uri = base.parse().map_err(|source| DecoderBaseError::Invalid {
            base: base.to_string(),
            source,
        })?;
        let p = u.into_parts();
        match (p.scheme, p.authority) {
            (Some(scheme), Some(authority)) => Ok(DecoderBase { scheme, authority }),
            _ => Err(DecoderBaseError::Incomplete {
                base: base.to_string(),
            }),
        }
    }

    /// This server with the request's path and query.
    fn uri(&self, pq: Option<http::uri::PathAndQuery>) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(pq.unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")))
            .build()
    }
}

/// Why a model server url is unusable (the sidecar names the flag it came from).
#[derive(Debug, thiserror::Error)]
pub enum DecoderBaseError {
    #[error("model server url {base}: {source}")]
    Invalid {
        base: String,
        source: http::uri::InvalidUri,
    },
    #[error("model server url {base} needs a scheme and host:port")]
    Incomplete { base: String },
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<Request<Incoming>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let me = self.clone();
        Box::pin(async move { Ok(me.handle(req).await) })
    }
}

/// Hop-by-hop headers, as pre-built names: removing by `&str` would parse each name again on
/// every request.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip_hop(h: &mut HeaderMap) {
    for name in &HOP_BY_HOP {
        h.remove(name);
    }
}

/// Failure of one upstream call.
#[derive(Debug, thiserror::Error)]
enum UpstreamError {
    #[error("cannot connect to {0}: {1}")]
    Connect(String, String),
    #[error("request to {0} failed: {1}")]
    Other(String, String),
}

/// Why a bootstrap `/query` failed: refused connections are logged per peer and period.
enum QueryError {
    Refused(UpstreamError),
    Failed(String),
}

fn classify(url: &str, e: hyper_util::client::legacy::Error) -> UpstreamError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    if e.is_connect() {
        UpstreamError::Connect(url.to_string(), msg)
    } else {
        UpstreamError::Other(url.to_string(), msg)
    }
}

/// A buffered upstream answer.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    /// Relays it unchanged.
    fn into_response(self) -> Response<Body> {
        let mut r = Response::new(body::full(self.body));
        *r.status_mut() = self.status;
        *r.headers_mut() = self.headers;
        strip_hop(r.headers_mut());
        r.headers_mut().remove(header::CONTENT_LENGTH);
        r
    }

    fn retryable(&self) -> bool {
        matches!(self.status.as_u16(), 502..=504)
    }
}

impl Proxy {
    async fn handle(self, req: Request<Incoming>) -> Response<Body> {
        let m = &self.shared.metrics;
        m.requests.inc();
        let path = req.uri().path();
        if path == "/health" && req.method() == Method::GET {
            return Response::new(body::empty());
        }
        if path == crate::METRICS_PATH && req.method() == Method::GET {
            let mut text = m.render();
            text.push_str(&lunakv_telemetry::render_process("lunakv-sidecar"));
            let mut r = Response::new(body::full(text));
            // Prometheus 3 refuses a scrape without a Content-Type.
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(lunakv_telemetry::METRICS_CONTENT_TYPE),
            );
            return r;
        }
        let disagg = req.method() == Method::POST && DISAGG_ROUTES.contains(&path);
        if disagg && let Some(v) = req.headers().get(PREFILLER_HEADER) {
            let target = v
                .to_str()
                .ok()
                .and_then(|s| s.split(',').map(str::trim).find(|s| !s.is_empty()))
                .map(str::to_string);
            return match target {
                Some(t) => self.disaggregate(req, t).await,
                None => error_response(
                    StatusCode::BAD_REQUEST,
                    format!("header {PREFILLER_HEADER} holds no host:port"),
                ),
            };
        }
        self.passthrough(req).await
    }

    fn request_id(h: &HeaderMap) -> HeaderValue {
        h.get("x-request-id")
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("unknown"))
    }

    /// Everything without disaggregation: straight to the local model server, streaming both ways.
    async fn passthrough(&self, req: Request<Incoming>) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        let pq = std::mem::take(&mut parts.uri).into_parts().path_and_query;
        parts.uri = match self.decoder_base.uri(pq) {
            Ok(u) => u,
            Err(e) => return error_response(StatusCode::BAD_REQUEST, format!("bad path: {e}")),
        };
        strip_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        parts.headers.remove(PREFILLER_HEADER);
        let mut req = Request::from_parts(parts, body::boxed(body));
        let span = tracing::info_span!("decode", request_id = ?Self::request_id(req.headers()), disaggregated = false);
        lunakv_telemetry::propagate::inject_http(&span, req.headers_mut());
        match self
            .shared
            .decode_client
            .request(req)
            .instrument(span)
            .await
        {
            Ok(resp) => {
                self.shared.peers.reachable(DECODE_ENGINE, &self.decoder);
                self.relay(resp, None).await
            }
            Err(e) => self.decode_error(classify(&self.decoder, e)),
        }
    }

    fn decode_error(&self, e: UpstreamError) -> Response<Body> {
        self.shared.metrics.decode_errors.inc();
        // A decode engine still loading its model refuses every request: one line, not one
        // per request (counted in decode_errors either way).
        match &e {
            UpstreamError::Connect(..) => {
                self.shared
                    .peers
                    .unreachable(DECODE_ENGINE, &self.decoder, &e);
            }
            UpstreamError::Other(..) => tracing::warn!(error = %e, "decode request failed"),
        }
        match e {
            UpstreamError::Connect(..) => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("The decode node is not ready: {e}"),
            ),
            UpstreamError::Other(..) => error_response(StatusCode::BAD_GATEWAY, e.to_string()),
        }
    }

    /// Relays a decoder response, rewriting `cached_tokens` when the prefiller reported one.
    async fn relay(&self, resp: Response<Incoming>, cached: Option<u64>) -> Response<Body> {
        let (mut parts, body) = resp.into_parts();
        strip_hop(&mut parts.headers);
        let guard = GaugeGuard::new(self.shared.metrics.clone(), |m| &m.upstream_streams);
        let is_sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        let body: Body = match cached {
            Some(c) if is_sse => body::boxed(Guarded::new(SseRewrite::new(body, c), guard)),
            Some(c) if parts.status.is_success() => {
                // A non-streaming JSON answer: small, buffer it and rewrite.
                let bytes = match body.collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(e) => {
                        return error_response(
                            StatusCode::BAD_GATEWAY,
                            format!("reading the decode response failed: {e}"),
                        );
                    }
                };
                drop(guard);
                match serde_json::from_slice::<Value>(&bytes) {
                    Ok(mut v) => {
                        if rewrite_cached(&mut v, c) {
                            parts.headers.remove(header::CONTENT_LENGTH);
                            body::full(v.to_string())
                        } else {
                            body::full(bytes)
                        }
                    }
                    Err(_) => body::full(bytes),
                }
            }
            _ => body::boxed(Guarded::new(body, guard)),
        };
        Response::from_parts(parts, body)
    }

    /// Body read within `--max-body-bytes` and the shared `--max-buffered-body-bytes`, parsed
    /// as a JSON object. The permit covers [`body::BODY_COPIES`] times the body's size (the raw
    /// bytes, then the parsed body and a serialized copy per leg) until the caller drops it,
    /// when the request's flow ends.
    async fn read_json(
        &self,
        mut body: Incoming,
    ) -> Result<(Map<String, Value>, BodyPermit), Response<Body>> {
        let max = self.shared.cfg.max_body_bytes;
        let budget = &self.shared.body_budget;
        let too_large = || {
            error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body exceeds {max} bytes (--max-body-bytes)"),
            )
        };
        let busy = |e: OverBudget| {
            // Counted in lunakv_sidecar_body_budget_refused_total; a WARN per refusal would let
            // a burst of large bodies flood the log.
            tracing::debug!(
                limit = e.limit_bytes,
                "request refused: --max-buffered-body-bytes is in use by other requests"
            );
            let mut r = error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the sidecar is already buffering its limit of {} bytes of request bodies (--max-buffered-body-bytes); retry shortly",
                    e.limit_bytes
                ),
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        };
        // A declared length is checked and reserved before a byte is read; a chunked body
        // reserves as it arrives.
        let declared = body
            .size_hint()
            .exact()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
        if declared.is_some_and(|n| n > max) {
            return Err(too_large());
        }
        let charge = |n: usize| n.saturating_mul(body::BODY_COPIES);
        let mut permit = match declared {
            Some(n) => budget.reserve(charge(n)).map_err(busy)?,
            None => budget.empty(),
        };
        let mut buf = bytes::BytesMut::with_capacity(declared.unwrap_or(0));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                error_response(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {e}"),
                )
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let total = buf.len().saturating_add(data.len());
            if total > max {
                return Err(too_large());
            }
            if declared.is_none() {
                budget.grow(&mut permit, charge(total)).map_err(busy)?;
            }
            buf.extend_from_slice(&data);
        }
        match serde_json::from_slice::<Value>(&buf) {
            Ok(Value::Object(m)) => Ok((m, permit)),
            Ok(_) => Err(error_response(
                StatusCode::BAD_REQUEST,
                "request body must be a JSON object",
            )),
            Err(e) => Err(error_response(
                StatusCode::BAD_REQUEST,
                format!("invalid JSON in request body: {e}"),
            )),
        }
    }
}
