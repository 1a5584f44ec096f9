//! Body plumbing: the boxed body type, a body that holds a guard until it is finished or dropped
//! (in-flight gauges), the streaming `cached_tokens` rewrite, and vLLM-style error responses.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
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

/// Decrements a gauge once, when dropped.
pub struct GaugeGuard {
    metrics: Arc<Metrics>,
    which: fn(&Metrics) -> &std::sync::atomic::AtomicI64,
}

impl GaugeGuard {
    pub fn new(
        metrics: Arc<Metrics>,
        which: fn(&Metrics) -> &std::sync::atomic::AtomicI64,
    ) -> Self {
        which(&metrics).fetch_add(1, Ordering::Relaxed);
        GaugeGuard { metrics, which }
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        (self.which)(&self.metrics).fetch_sub(1, Ordering::Relaxed);
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
