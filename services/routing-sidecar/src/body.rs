//! Body plumbing: the boxed body type, a body that holds a guard until it is finished or dropped
//! (in-flight gauges), the streaming `cached_tokens` rewrite, vLLM-style error responses, and
//! the budget of request-body bytes buffered at once ([`BodyBudget`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode, header};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;

use crate::metrics::Metrics;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The one body type of the proxy, both directions.
pub type Body = BoxBody<Bytes, BoxError>;

pub fn full(b: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(b.into())
        .map_err(|never| match never {})
        .boxed()
}

pub fn empty() -> Body {
    full(Bytes::new())
}

/// Boxes any body whose errors convert.
pub fn boxed<B>(b: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed()
}

/// vLLM's error JSON: `{"error": {"message", "type", "param", "code"}}`.
pub fn error_response(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    let kind = match status.as_u16() {
        400 => "BadRequestError",
        429 => "RateLimitError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        413 => "RequestEntityTooLargeError",
        502 => "BadGatewayError",
        503 => "ServiceUnavailableError",
        504 => "GatewayTimeoutError",
        _ => "InternalServerError",
    };
    let body = serde_json::json!({"error": {"message": msg.into(), "type": kind, "param": null, "code": status.as_u16()}});
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// How many copies of a request body the disaggregated flows hold at most, and so how many
/// times its size a body is charged against [`BodyBudget`]: while parsing, the raw bytes and
/// the parsed map; then the map, each leg's serialized body, and one leg's map being built.
pub const BODY_COPIES: usize = 4;

/// The memory the disaggregated routes may spend on request bodies at once (each charged
/// [`BODY_COPIES`] times its size), across every connection
/// and listener (`--max-buffered-body-bytes`). Those routes buffer the whole body (they rewrite
/// the JSON for both legs), so without it N parallel large bodies cost N times several times
/// `--max-body-bytes`. Counted in KiB so any byte budget fits the semaphore's `u32`
/// acquisitions.
pub struct BodyBudget {
    sem: Arc<tokio::sync::Semaphore>,
    limit_bytes: usize,
    metrics: Arc<Metrics>,
}

/// Part of the budget, held until the request's flow ends; released when dropped.
pub struct BodyPermit {
    permit: tokio::sync::OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

/// Why a body did not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverBudget {
    pub limit_bytes: usize,
}

fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl BodyBudget {
    pub fn new(limit_bytes: usize, metrics: Arc<Metrics>) -> BodyBudget {
        let permits = (kib(limit_bytes) as usize).min(tokio::sync::Semaphore::MAX_PERMITS);
        BodyBudget {
            sem: Arc::new(tokio::sync::Semaphore::new(permits)),
            limit_bytes,
            metrics,
        }
    }

    pub fn limit_bytes(&self) -> usize {
        self.limit_bytes
    }

    /// An empty permit, to [`BodyBudget::grow`] as the body arrives.
    pub fn empty(&self) -> BodyPermit {
        self.reserve(0)
            .expect("a zero-permit acquisition always succeeds")
    }

    /// Reserves `bytes` now, without waiting: a request is refused rather than queued, so a
    /// burst of huge bodies cannot hold every connection open.
    pub fn reserve(&self, bytes: usize) -> Result<BodyPermit, OverBudget> {
        let n = kib(bytes);
        let permit = self.sem.clone().try_acquire_many_owned(n).map_err(|_| {
            self.metrics.body_budget_refused.inc();
            OverBudget {
                limit_bytes: self.limit_bytes,
            }
        })?;
        self.metrics.buffered_body_bytes.add(i64::from(n) * 1024);
        Ok(BodyPermit {
            permit,
            metrics: self.metrics.clone(),
        })
    }

    /// Grows `p` to cover `total` bytes (a body of unknown length, frame by frame).
    pub fn grow(&self, p: &mut BodyPermit, total: usize) -> Result<(), OverBudget> {
        let held = p.permit.num_permits();
        let want = kib(total) as usize;
        if want > held {
            let mut more = self.reserve((want - held) * 1024)?;
            // All of `more`'s permits move into `p`, so `more` drops holding none and its Drop
            // subtracts nothing from the gauge; `p`'s Drop gives back the whole.
            let n = more.permit.num_permits();
            if let Some(taken) = more.permit.split(n) {
                p.permit.merge(taken);
            }
        }
        Ok(())
    }
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        let n = self.permit.num_permits() as i64;
        self.metrics.buffered_body_bytes.sub(n * 1024);
    }
}

/// Decrements a gauge once, when dropped.
pub struct GaugeGuard {
    metrics: Arc<Metrics>,
    which: fn(&Metrics) -> &prometheus::IntGauge,
}

impl GaugeGuard {
    pub fn new(metrics: Arc<Metrics>, which: fn(&Metrics) -> &prometheus::IntGauge) -> Self {
        which(&metrics).inc();
        GaugeGuard { metrics, which }
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        (self.which)(&self.metrics).dec();
    }
}

/// A body that keeps `guard` alive until it ends or is dropped (client gone mid-stream).
pub struct Guarded<B> {
    inner: B,
    guard: Option<GaugeGuard>,
}

impl<B> Guarded<B> {
    pub fn new(inner: B, guard: GaugeGuard) -> Self {
        Guarded {
            inner,
            guard: Some(guard),
        }
    }
}

impl<B: HttpBody + Unpin> HttpBody for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let p = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) | Poll::Ready(Some(Err(_))) = &p {
            self.guard = None;
        }
        p
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Sets `usage.prompt_tokens_details.cached_tokens` in a JSON value if `usage` is an object.
/// Returns true if it changed anything.
pub fn rewrite_cached(v: &mut serde_json::Value, cached: u64) -> bool {
    let Some(usage) = v.get_mut("usage").and_then(|u| u.as_object_mut()) else {
        return false;
    };
    let details = usage
        .entry("prompt_tokens_details")
        .or_insert_with(|| serde_json::json!({}));
    if details.is_null() {
        *details = serde_json::json!({});
    }
    match details.as_object_mut() {
        Some(d) => {
            d.insert("cached_tokens".into(), cached.into());
            true
        }
        None => false,
    }
}

/// Rewrites one SSE event (`data: {...}`) if it carries usage.
fn rewrite_event(ev: &[u8], cached: u64) -> Option<Bytes> {
    let text = std::str::from_utf8(ev).ok()?;
    let data = text.trim_end().strip_prefix("data:")?.trim_start();
    if data == "[DONE]" {
        return None;
    }
    let mut v: serde_json::Value = serde_json::from_str(data).ok()?;
    if !rewrite_cached(&mut v, cached) {
        return None;
    }
    Some(Bytes::from(format!("data: {v}\n\n")))
}

/// Streams SSE through, rewriting `cached_tokens` in events that carry usage. Chunks that hold
/// only whole events and no usage pass through untouched (no copy); a partial event waits for
/// its end.
pub struct SseRewrite<B> {
    inner: B,
    cached: u64,
    pending: BytesMut,
}

impl<B> SseRewrite<B> {
    pub fn new(inner: B, cached: u64) -> Self {
        SseRewrite {
            inner,
            cached,
            pending: BytesMut::new(),
        }
    }

    fn process(&mut self, chunk: Bytes) -> Bytes {
        const USAGE: &[u8] = b"\"usage\"";
        let has = |b: &[u8]| b.windows(USAGE.len()).any(|w| w == USAGE);
        if self.pending.is_empty() && chunk.ends_with(b"\n\n") && !has(&chunk) {
            return chunk;
        }
        self.pending.extend_from_slice(&chunk);
        let Some(end) = find_last(&self.pending, b"\n\n") else {
            return Bytes::new();
        };
        let complete = self.pending.split_to(end + 2).freeze();
        if !has(&complete) {
            return complete;
        }
        let mut out = BytesMut::with_capacity(complete.len() + 16);
        for ev in split_events(&complete) {
            match rewrite_event(ev, self.cached) {
                Some(b) => out.extend_from_slice(&b),
                None => out.extend_from_slice(ev),
            }
        }
        out.freeze()
    }
}

fn find_last(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).rposition(|w| w == n)
}

/// Splits complete SSE text into events, each keeping its trailing blank line.
fn split_events(b: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\n' && b[i + 1] == b'\n' {
            out.push(&b[start..i + 2]);
            start = i + 2;
            i += 2;
        } else {
            i += 1;
        }
    }
    if start < b.len() {
        out.push(&b[start..]);
    }
    out
}

impl<B> HttpBody for SseRewrite<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        loop {
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => match f.into_data() {
                    Ok(d) => {
                        let out = self.process(d);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    Err(f) => return Poll::Ready(Some(Ok(f))),
                },
                Poll::Ready(None) => {
                    if self.pending.is_empty() {
                        return Poll::Ready(None);
                    }
                    let rest = self.pending.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(rest))));
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_rewrite_handles_split_events_and_passthrough() {
        let mut r = SseRewrite::new(http_body_util::Empty::<Bytes>::new(), 7);
        let plain = Bytes::from_static(b"data: {\"choices\":[]}\n\n");
        assert_eq!(r.process(plain.clone()), plain);
        let a = r.process(Bytes::from_static(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,",
        ));
        assert!(a.is_empty());
        let b = r.process(Bytes::from_static(
            b"\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\ndata: [DONE]\n\n",
        ));
        let s = String::from_utf8(b.to_vec()).unwrap();
        assert!(s.contains("\"cached_tokens\":7"), "{s}");
        assert!(s.ends_with("data: [DONE]\n\n"), "{s}");
    }

    #[test]
    fn json_rewrite() {
        let mut v =
            serde_json::json!({"usage": {"prompt_tokens": 5, "prompt_tokens_details": null}});
        assert!(rewrite_cached(&mut v, 4));
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
        let mut v = serde_json::json!({"choices": []});
        assert!(!rewrite_cached(&mut v, 4));
    }
}
