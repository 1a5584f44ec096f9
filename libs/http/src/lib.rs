//! lunakv's one HTTP/1 client, on hyper + hyper-util: pooled keep-alive connections, chunked
//! bodies, a connect timeout and a whole-request timeout, with errors that name the URL.
//!
//! Every plain-HTTP request lunakv makes goes through it: the engine simulator's bootstrap and
//! P/D side-channel calls ([`HttpClient::send`]), `lunakv doctor`'s reads of the admin endpoints
//! and the test harnesses' GETs ([`get_blocking`], for synchronous code). The routing sidecar's
//! proxy builds its own hyper-util client on the same crates because it streams bodies both ways
//! and speaks TLS upstream. Hand-written HTTP remains only where a test means to send what a
//! client library would not (raw SSE reads, early disconnects, malformed requests).
#![forbid(unsafe_code)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// What a request can fail with; each names the URL.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The URL does not parse (or the request cannot be built from it).
    #[error("bad url {url}: {reason}")]
    Url { url: String, reason: String },
    /// Connecting, writing or reading failed; `msg` is the innermost cause
    /// (e.g. "Connection refused (os error 111)").
    #[error("{url}: {msg}")]
    Transport { url: String, msg: String },
    /// No complete answer within the request's timeout.
    #[error("{url}: timed out after {after:?}")]
    Timeout { url: String, after: Duration },
}

/// A complete answer: status, headers and the whole (de-chunked) body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Response {
    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Connect timeout of [`HttpClient::default`].
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A pooled HTTP/1 client; clones share the pool.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        HttpClient::with_connect_timeout(CONNECT_TIMEOUT)
    }
}

impl HttpClient {
    /// A client whose connection attempts give up after `connect`.
    pub fn with_connect_timeout(connect: Duration) -> HttpClient {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect));
        HttpClient {
            // Idle connections are dropped before a peer's usual 5 s keep-alive would close
            // them under a request.
            inner: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(4))
                .build(http),
        }
    }

    /// Sends `req` and reads the whole answer, all within `timeout`.
    pub async fn send(
        &self,
        req: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response, HttpError> {
        let url = req.uri().to_string();
        let fut = async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| transport(&url, &e))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| transport(&url, &e))?
                .to_bytes();
            Ok(Response {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| HttpError::Timeout {
                url: url.clone(),
                after: timeout,
            })?
    }

    /// `GET url` within `timeout`.
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<Response, HttpError> {
        self.send(request(Method::GET, url, Bytes::new())?, timeout)
            .await
    }
}

/// A request with `body` (empty for none) to `url`, for [`HttpClient::send`]; add headers to it.
pub fn request(method: Method, url: &str, body: Bytes) -> Result<Request<Full<Bytes>>, HttpError> {
    let bad = |reason: String| HttpError::Url {
        url: url.to_string(),
        reason,
    };
    let uri: Uri = url.parse().map_err(|e| bad(format!("{e}")))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(bad("write it as http://host:port/path".into()));
    }
    Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| bad(e.to_string()))
}

/// `GET url` from synchronous code (the CLI, test harnesses): a client on a one-off runtime,
/// connecting within `timeout` and answering within `timeout`. Safe to call from inside a tokio
/// runtime too (it then runs on a thread of its own).
pub fn get_blocking(url: &str, timeout: Duration) -> Result<Response, HttpError> {
    let run = || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| HttpError::Transport {
                url: url.to_string(),
                msg: format!("cannot start an I/O runtime: {e}"),
            })?;
        rt.block_on(HttpClient::with_connect_timeout(timeout).get(url, timeout))
    };
    if tokio::runtime::Handle::try_current().is_err() {
        return run();
    }
    std::thread::scope(|s| {
        s.spawn(run).join().unwrap_or_else(|_| {
            Err(HttpError::Transport {
                url: url.to_string(),
                msg: "the request thread panicked".into(),
            })
        })
    })
}

/// The innermost cause: hyper-util's own layers ("client error (Connect)", "tcp connect
/// error") say less than the OS error under them.
fn transport(url: &str, e: &(dyn std::error::Error + 'static)) -> HttpError {
    let mut inner = e;
    while let Some(next) = inner.source() {
        inner = next;
    }
    HttpError::Transport {
        url: url.to_string(),
        msg: inner.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A one-shot server answering `answer` to the first request; returns the request's head.
    fn serve_once(answer: &'static [u8]) -> (String, std::thread::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).expect("read");
            s.write_all(answer).expect("write");
            String::from_utf8_lossy(&buf[..n]).into_owned()
        });
        (format!("http://{addr}"), h)
    }

    #[test]
    fn chunked_body_status_and_host() {
        let (base, h) = serve_once(
            b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n5\r\nnot r\r\n4\r\neady\r\n0\r\n\r\n",
        );
        let r = get_blocking(&format!("{base}/ready"), Duration::from_secs(5)).expect("get");
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.text(), "not ready");
        let head = h.join().expect("server");
        assert!(head.starts_with("GET /ready HTTP/1.1\r\n"), "{head}");
        assert!(
            head.to_ascii_lowercase().contains("host: 127.0.0.1:"),
            "{head}"
        );
    }

    #[test]
    fn refused_names_the_url_and_the_os_error() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let url = format!("http://127.0.0.1:{port}/health");
        let e = get_blocking(&url, Duration::from_secs(2)).expect_err("nothing listens");
        let msg = e.to_string();
        assert!(msg.starts_with(&url), "{msg}");
        assert!(msg.contains("refused"), "{msg}");
    }

    #[test]
    fn a_silent_server_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/metrics", l.local_addr().expect("addr"));
        let t = std::time::Instant::now();
        let e = get_blocking(&url, Duration::from_millis(300)).expect_err("no answer");
        assert!(matches!(e, HttpError::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        drop(l);
    }

    #[test]
    fn bad_urls_say_how_to_write_one() {
        for u in ["127.0.0.1:9003/metrics", "https://x:1/", "http:///x"] {
            let e = get_blocking(u, Duration::from_secs(1)).expect_err(u);
            assert!(matches!(e, HttpError::Url { .. }), "{u}: {e}");
        }
    }

    #[tokio::test]
    async fn blocking_get_works_inside_a_runtime() {
        let (base, h) = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        let r = get_blocking(&format!("{base}/"), Duration::from_secs(5)).expect("get");
        assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "ok"));
        h.join().expect("server");
    }
}
