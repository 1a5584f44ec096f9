//! A tiny JSON-over-HTTP client (hyper-util) for the bootstrap and the P/D side channel.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
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

/// Shared, pooled HTTP/1 client.
#[derive(Clone)]
pub struct JsonClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for JsonClient {
    fn default() -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(3)));
        JsonClient {
            inner: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(4))
                .build(http),
        }
    }
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
        let uri: hyper::Uri = url.parse().map_err(|_| CallError::Url(url.to_string()))?;
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let span = propagate::http_client_span(&method, &uri);
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .body(Full::new(bytes))
            .map_err(|e| CallError::Url(format!("{url}: {e}")))?;
        propagate::inject_http(&span, req.headers_mut());
        let http = |msg: String| CallError::Http {
            url: url.to_string(),
            msg,
        };
        let fut = async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| http(format!("{e:?}")))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| http(e.to_string()))?
                .to_bytes();
            Ok::<_, CallError>((status, body))
        };
        let (status, body) = tokio::time::timeout(timeout, fut)
            .instrument(span.clone())
            .await
            .map_err(|_| CallError::Timeout {
                url: url.to_string(),
                after: timeout,
            })??;
        propagate::record_http_status(&span, status);
        if !status.is_success() {
            return Err(CallError::Status {
                url: url.to_string(),
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        serde_json::from_slice(&body).map_err(|e| CallError::Json {
            url: url.to_string(),
            msg: e.to_string(),
        })
    }
}
