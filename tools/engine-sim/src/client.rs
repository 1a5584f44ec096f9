//! JSON over lunakv's HTTP client ([`lunakv_http`]) for the bootstrap and the P/D side channel.

use std::time::Duration;

use bytes::Bytes;
use hyper::{Method, StatusCode};
use lunakv_http::{HttpClient, HttpError};
use lunakv_telemetry::propagate;
use tracing::Instrument;

/// Errors of a side-channel or bootstrap call.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("bad url {0}")]
    Url(String),
    #[error("{url}: {msg}")]
    Http { url: String, msg: String },
    #[error("{url}: timed out after {after:?}")]
    Timeout { url: String, after: Duration },
    #[error("{url}: answered {status}: {body}")]
    Status {
        url: String,
        status: StatusCode,
        body: String,
    },
    #[error("{url}: answer is not JSON: {msg}")]
    Json { url: String, msg: String },
}

/// Shared, pooled HTTP/1 client: lunakv's one client ([`lunakv_http`]) plus JSON and the trace
/// context.
#[derive(Clone, Default)]
pub struct JsonClient {
    inner: HttpClient,
}

impl JsonClient {
    /// Sends `body` (or nothing) and parses a 2xx JSON answer.
    pub async fn call(
        &self,
        method: Method,
        url: &str,
        body: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<serde_json::Value, CallError> {
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut req = lunakv_http::request(method, url, bytes).map_err(|e| match e {
            HttpError::Url { .. } => CallError::Url(url.to_string()),
            other => CallError::Url(format!("{url}: {other}")),
        })?;
        let span = propagate::http_client_span(req.method(), req.uri());
        req.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        propagate::inject_http(&span, req.headers_mut());
        let resp = self
            .inner
            .send(req, timeout)
            .instrument(span.clone())
            .await
            .map_err(|e| match e {
                HttpError::Timeout { after, .. } => CallError::Timeout {
                    url: url.to_string(),
                    after,
                },
                HttpError::Url { reason, .. } => CallError::Url(format!("{url}: {reason}")),
                HttpError::Transport { msg, .. } | HttpError::Tls { reason: msg, .. } => {
                    CallError::Http {
                        url: url.to_string(),
                        msg,
                    }
                }
            })?;
        propagate::record_http_status(&span, resp.status);
        if !resp.status.is_success() {
            return Err(CallError::Status {
                url: url.to_string(),
                status: resp.status,
                body: resp.text(),
            });
        }
        serde_json::from_slice(&resp.body).map_err(|e| CallError::Json {
            url: url.to_string(),
            msg: e.to_string(),
        })
    }
}
