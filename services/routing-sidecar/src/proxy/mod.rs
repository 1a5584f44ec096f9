//! The proxy service: routing, the three connector flows, and error mapping.

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

/// Result of one mooncake attempt.
enum Attempt {
    Done(Response<Body>),
    /// Retry with a fresh bootstrap lookup (the failure is logged and counted already); the
    /// response is what the client gets if no retry is left.
    Retry(Response<Body>),
    /// Both legs succeeded: relay the decode response.
    Relay(Response<Incoming>, Option<u64>),
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

    async fn disaggregate(&self, req: Request<Incoming>, target: String) -> Response<Body> {
        let shared = &self.shared;
        shared.metrics.disaggregated.inc();
        let (mut parts, body) = req.into_parts();
        parts.headers.remove(PREFILLER_HEADER);
        strip_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        parts.headers.remove(header::CONTENT_LENGTH);
        let Some((host, port)) =
            split_host_port(&target).and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        else {
            return error_response(
                StatusCode::BAD_REQUEST,
                format!("{PREFILLER_HEADER} '{target}' is not host:port"),
            );
        };
        if let Some(allow) = &shared.allow
            && !allow.allows(&host, port)
        {
            shared.metrics.ssrf_denied.inc();
            tracing::warn!(%target, "prefill target refused by SSRF protection");
            return error_response(
                StatusCode::FORBIDDEN,
                "Forbidden: prefill target not allowed by SSRF protection",
            );
        }
        // `_permit` lives until this function returns: the body, parsed and copied for both
        // legs, is held until then.
        let (original, _permit) = match self.read_json(body).await {
            Ok(m) => m,
            Err(r) => return r,
        };
        let path = parts.uri.path().to_string();
        let host_port = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let scheme = if shared.cfg.tls.prefiller {
            "https"
        } else {
            "http"
        };
        let prefill_url = format!("{scheme}://{host_port}{path}");
        let decode_url = format!(
            "{}{}",
            self.decoder,
            parts
                .uri
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or(&path)
        );
        let ctx = Ctx {
            headers: parts.headers,
            prefill_url,
            decode_url,
            host,
            host_port,
        };
        match shared.cfg.connector {
            Connector::Mooncake => self.mooncake(&ctx, original).await,
            Connector::NixlV2 => self.sequential(&ctx, original, true).await,
            Connector::SharedStorage => self.sequential(&ctx, original, false).await,
        }
    }

    /// The prefill body every connector shares: no streaming, one token.
    fn prefill_body(original: &Map<String, Value>, params: Value) -> Map<String, Value> {
        let mut b = original.clone();
        if !params.is_null() {
            b.insert("kv_transfer_params".into(), params);
        } else {
            b.remove("kv_transfer_params");
        }
        b.insert("stream".into(), Value::Bool(false));
        b.remove("stream_options");
        b.insert("max_tokens".into(), json!(1));
        if b.contains_key("max_completion_tokens") {
            b.insert("max_completion_tokens".into(), json!(1));
        }
        b
    }

    fn upstream_request(
        url: &str,
        headers: &HeaderMap,
        body: Bytes,
        extra: Option<(&'static str, String)>,
    ) -> Result<Request<Body>, Response<Body>> {
        let mut r = Request::new(body::full(body));
        *r.method_mut() = Method::POST;
        *r.uri_mut() = url.parse().map_err(|e| {
            error_response(
                StatusCode::BAD_REQUEST,
                format!("bad upstream url {url}: {e}"),
            )
        })?;
        *r.headers_mut() = headers.clone();
        // Called inside the leg's span: the engine's span becomes its child.
        lunakv_telemetry::propagate::inject_http(&tracing::Span::current(), r.headers_mut());
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some((k, v)) = extra
            && let Ok(v) = HeaderValue::from_str(&v)
        {
            r.headers_mut().insert(HeaderName::from_static(k), v);
        }
        Ok(r)
    }

    /// A leg's body, serialized: the legs hold bytes, not a second parsed copy, so a buffered
    /// request costs at most [`crate::body::BODY_COPIES`] times its size.
    fn json_bytes(m: &Map<String, Value>) -> Bytes {
        // A map of JSON values with string keys always serializes.
        Bytes::from(serde_json::to_vec(m).unwrap_or_default())
    }

    /// Sends a prefill request and buffers its (small, non-streaming) answer.
    async fn prefill(
        &self,
        ctx: &Ctx,
        bytes: Bytes,
        dp_rank: Option<u32>,
    ) -> Result<Answer, UpstreamError> {
        let extra = dp_rank.map(|r| ("x-data-parallel-rank", r.to_string()));
        let req = Self::upstream_request(&ctx.prefill_url, &ctx.headers, bytes, extra)
            .map_err(|_| UpstreamError::Other(ctx.prefill_url.clone(), "bad url".into()))?;
        let resp = self
            .shared
            .prefill_client
            .request(req)
            .await
            .map_err(|e| classify(&ctx.prefill_url, e))?;
        let (parts, b) = resp.into_parts();
        let body = b
            .collect()
            .await
            .map_err(|e| UpstreamError::Other(ctx.prefill_url.clone(), e.to_string()))?
            .to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    async fn decode(&self, ctx: &Ctx, bytes: Bytes) -> Result<Response<Incoming>, UpstreamError> {
        let req = Self::upstream_request(&ctx.decode_url, &ctx.headers, bytes, None)
            .map_err(|_| UpstreamError::Other(ctx.decode_url.clone(), "bad url".into()))?;
        self.shared
            .decode_client
            .request(req)
            .await
            .map_err(|e| classify(&ctx.decode_url, e))
    }

    fn cached_tokens(a: &Answer) -> (Option<Value>, Option<u64>) {
        let v: Option<Value> = serde_json::from_slice(&a.body).ok();
        let cached = v
            .as_ref()
            .and_then(|v| v.pointer("/usage/prompt_tokens_details/cached_tokens"))
            .and_then(|c| c.as_u64());
        (v, cached)
    }

    /// A prefill engine that refuses connections is logged once per period (see [`PeerLog`]);
    /// any other failure once per request.
    fn log_prefill_failure(&self, ctx: &Ctx, e: &UpstreamError, what: &str) {
        match e {
            UpstreamError::Connect(..) => {
                self.shared
                    .peers
                    .unreachable(PREFILL_ENGINE, &ctx.host_port, e);
            }
            UpstreamError::Other(..) => tracing::warn!(error = %e, "{what}"),
        }
    }

    fn prefill_error(&self, e: &UpstreamError) -> Response<Body> {
        match e {
            UpstreamError::Connect(..) => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("The prefill node is not ready: {e}"),
            ),
            UpstreamError::Other(..) => {
                error_response(StatusCode::BAD_GATEWAY, format!("prefill failed: {e}"))
            }
        }
    }

    /// Counts and sleeps before retry `n+1`; false when `--prefill-max-retries` is used up.
    async fn next_retry(&self, n: &mut u32) -> bool {
        let cfg = &self.shared.cfg;
        if *n >= cfg.prefill_max_retries {
            return false;
        }
        *n += 1;
        self.shared.metrics.prefill_retries.inc();
        tokio::time::sleep(cfg.prefill_retry_backoff).await;
        true
    }

    /// nixlv2 (`nixl` = true) and shared-storage: prefill first, then decode.
    async fn sequential(
        &self,
        ctx: &Ctx,
        original: Map<String, Value>,
        nixl: bool,
    ) -> Response<Body> {
        let params = if nixl {
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        } else {
            Value::Null
        };
        let pbody = Self::json_bytes(&Self::prefill_body(&original, params));
        let rid = Self::request_id(&ctx.headers);
        let mut n = 0;
        let a = loop {
            let span = tracing::info_span!("prefill", target = %ctx.host_port, request_id = ?rid, attempt = n);
            let fail = match self
                .prefill(ctx, pbody.clone(), None)
                .instrument(span)
                .await
            {
                Ok(a) if a.status.is_success() => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    break a;
                }
                Ok(a) => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    self.shared.metrics.prefill_failures.inc();
                    tracing::warn!(status = %a.status, "prefill answered an error");
                    if !a.retryable() {
                        return a.into_response();
                    }
                    a.into_response()
                }
                Err(e) => {
                    self.shared.metrics.prefill_failures.inc();
                    self.log_prefill_failure(ctx, &e, "prefill failed");
                    self.prefill_error(&e)
                }
            };
            if !self.next_retry(&mut n).await {
                return fail;
            }
        };
        let (v, cached) = Self::cached_tokens(&a);
        let mut dbody = original;
        if nixl {
            match v
                .as_ref()
                .and_then(|v| v.get("kv_transfer_params"))
                .filter(|p| p.is_object())
            {
                Some(p) => {
                    dbody.insert("kv_transfer_params".into(), p.clone());
                }
                None => {
                    // Upstream would decode anyway and the engine would silently recompute.
                    return error_response(
                        StatusCode::BAD_GATEWAY,
                        "the prefill response carries no kv_transfer_params; refusing a silent decode-side recompute",
                    );
                }
            }
        }
        let span = tracing::info_span!("decode", request_id = ?rid, disaggregated = true);
        // Only the decode body's bytes stay alive while it runs.
        drop(pbody);
        let dbody = {
            let bytes = Self::json_bytes(&dbody);
            drop(dbody);
            bytes
        };
        match self.decode(ctx, dbody).instrument(span).await {
            Ok(resp) => self.relay(resp, cached).await,
            Err(e) => self.decode_error(e),
        }
    }

    /// Looks up the prefill host's engines: cached, or `GET /query` on its bootstrap server.
    async fn engines(&self, ctx: &Ctx) -> Result<(Arc<Engines>, bool), Response<Body>> {
        let key = format!("{}:{}", ctx.host, self.shared.cfg.bootstrap_port);
        if let Some(e) = self.shared.cache.get(&key) {
            return Ok((e, true));
        }
        self.shared.metrics.bootstrap_queries.inc();
        let authority = self.bootstrap_authority(ctx);
        let url = format!("http://{authority}/query");
        let answer = |msg: &str| {
            error_response(
                StatusCode::BAD_GATEWAY,
                format!("bootstrap query {url} failed: {msg}"),
            )
        };
        let fail = |msg: String| {
            tracing::warn!(%url, "bootstrap query failed: {msg}");
            answer(&msg)
        };
        let mut req = Request::new(body::empty());
        *req.uri_mut() = url.parse().map_err(|e| fail(format!("{e}")))?;
        let span = lunakv_telemetry::propagate::http_client_span(&Method::GET, req.uri());
        lunakv_telemetry::propagate::inject_http(&span, req.headers_mut());
        let call = async {
            let resp = self.shared.prefill_client.request(req).await.map_err(|e| {
                match classify(&url, e) {
                    // Refused: logged per bootstrap once per period, not per request.
                    e @ UpstreamError::Connect(..) => QueryError::Refused(e),
                    e @ UpstreamError::Other(..) => QueryError::Failed(e.to_string()),
                }
            })?;
            self.shared.peers.reachable(PREFILL_BOOTSTRAP, &authority);
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| QueryError::Failed(e.to_string()))?
                .to_bytes();
            if !status.is_success() {
                return Err(QueryError::Failed(format!("answered {status}")));
            }
            serde_json::from_slice::<Value>(&body)
                .map_err(|e| QueryError::Failed(format!("not JSON: {e}")))
        };
        let v = match tokio::time::timeout(BOOTSTRAP_TIMEOUT, call)
            .instrument(span)
            .await
            .unwrap_or_else(|_| {
                Err(QueryError::Failed(format!(
                    "no answer within {BOOTSTRAP_TIMEOUT:?}"
                )))
            }) {
            Ok(v) => v,
            Err(QueryError::Failed(msg)) => return Err(fail(msg)),
            Err(QueryError::Refused(refused)) => {
                self.shared
                    .peers
                    .unreachable(PREFILL_BOOTSTRAP, &authority, &refused);
                return Err(answer(&refused.to_string()));
            }
        };
        let engines = Engines::from_query(&v)
            .ok_or_else(|| fail("no prefill engine is registered".into()))?;
        let engines = Arc::new(engines);
        self.shared.cache.insert(&key, engines.clone());
        Ok((engines, false))
    }

    fn bootstrap_authority(&self, ctx: &Ctx) -> String {
        let p = self.shared.cfg.bootstrap_port;
        if ctx.host.contains(':') {
            format!("[{}]:{p}", ctx.host)
        } else {
            format!("{}:{p}", ctx.host)
        }
    }

    fn drop_cache(&self, ctx: &Ctx, why: &str) {
        let key = format!("{}:{}", ctx.host, self.shared.cfg.bootstrap_port);
        if self.shared.cache.drop_entry(&key) {
            self.shared.metrics.bootstrap_cache_drops.inc();
            tracing::info!(%key, why, "dropped the bootstrap cache entry");
        }
    }

    /// mooncake: prefill and decode concurrently on one transfer_id. Unlike upstream, a failed
    /// prefill cancels the decode and is retried or returned; it never turns into a silent
    /// decode-side recompute (llm-d-router #1220) or a client left waiting (vLLM #55870).
    async fn mooncake(&self, ctx: &Ctx, original: Map<String, Value>) -> Response<Body> {
        let rid = Self::request_id(&ctx.headers);
        let mut stale_retry_left = true;
        let mut n = 0;
        loop {
            let span =
                tracing::info_span!("pd", target = %ctx.host_port, request_id = ?rid, attempt = n);
            let fail = match self
                .mooncake_attempt(ctx, &original, &mut stale_retry_left)
                .instrument(span)
                .await
            {
                Attempt::Done(r) => return r,
                Attempt::Relay(resp, cached) => return self.relay(resp, cached).await,
                Attempt::Retry(r) => r,
            };
            if !self.next_retry(&mut n).await {
                return fail;
            }
        }
    }

    fn prefill_failed(&self, ctx: &Ctx, r: Response<Body>, retry: bool) -> Attempt {
        self.shared.metrics.prefill_failures.inc();
        if retry {
            self.drop_cache(ctx, "prefill failed");
            Attempt::Retry(r)
        } else {
            Attempt::Done(r)
        }
    }

    async fn mooncake_attempt(
        &self,
        ctx: &Ctx,
        original: &Map<String, Value>,
        stale_retry_left: &mut bool,
    ) -> Attempt {
        loop {
            let (engines, from_cache) = match self.engines(ctx).await {
                Ok(e) => e,
                Err(r) => {
                    self.shared.metrics.prefill_failures.inc();
                    return Attempt::Retry(r);
                }
            };
            let (dp, engine_id) = engines.pick().clone();
            let transfer_id = format!(
                "xfer-{}",
                uuid::Builder::from_random_bytes(rand::random()).into_uuid()
            );
            // Each leg's map is serialized and dropped at once: with the original, the two
            // serialized bodies and one map being built, at most four copies are alive.
            let pbody = Self::json_bytes(&Self::prefill_body(
                original,
                json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer_id}),
            ));
            let dbody = {
                let mut d = original.clone();
                d.insert(
                    "kv_transfer_params".into(),
                    json!({"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": transfer_id,
                           "remote_bootstrap_addr": format!("http://{}", self.bootstrap_authority(ctx)),
                           "remote_engine_id": engine_id}),
                );
                Self::json_bytes(&d)
            };
            let prefill = self
                .prefill(ctx, pbody, Some(dp))
                .instrument(tracing::info_span!("prefill", %transfer_id, dp));
            let decode = self
                .decode(ctx, dbody)
                .instrument(tracing::info_span!("decode", %transfer_id));
            tokio::pin!(prefill);
            tokio::pin!(decode);
            let mut early = None;
            let p = loop {
                tokio::select! {
                    biased;
                    p = &mut prefill => break p,
                    d = &mut decode, if early.is_none() => early = Some(d),
                }
            };
            // On a failed prefill, returning drops `decode`, which cancels the decode leg.
            let a = match p {
                Ok(a) if a.status.is_success() => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    a
                }
                Ok(a) => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    tracing::warn!(status = %a.status, "prefill answered an error; decode cancelled");
                    let retry = a.retryable();
                    return self.prefill_failed(ctx, a.into_response(), retry);
                }
                Err(e) => {
                    self.log_prefill_failure(ctx, &e, "prefill failed; decode cancelled");
                    return self.prefill_failed(ctx, self.prefill_error(&e), true);
                }
            };
            let (_, cached) = Self::cached_tokens(&a);
            let d = match early {
                Some(d) => d,
                None => decode.await,
            };
            if d.is_ok() {
                self.shared.peers.reachable(DECODE_ENGINE, &self.decoder);
            }
            match d {
                Ok(resp) if resp.status().is_success() => return Attempt::Relay(resp, cached),
                Ok(resp) if from_cache && *stale_retry_left => {
                    // The cached engine id may be stale (the prefill engine restarted): look it
                    // up again once; nothing has reached the client yet.
                    *stale_retry_left = false;
                    tracing::info!(status = %resp.status(), "decode failed with a cached bootstrap entry; looking it up again");
                    self.drop_cache(ctx, "decode failed with a cached engine id");
                }
                Ok(resp) => {
                    self.shared.metrics.decode_errors.inc();
                    return Attempt::Done(self.relay(resp, None).await);
                }
                Err(e) => return Attempt::Done(self.decode_error(e)),
            }
        }
    }
}

/// Per-request values the connector flows share.
struct Ctx {
    headers: HeaderMap,
    prefill_url: String,
    decode_url: String,
    host: String,
    host_port: String,
}
