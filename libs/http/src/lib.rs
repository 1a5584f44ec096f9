//! lunakv's one HTTP/1 client, on hyper + hyper-util: pooled keep-alive connections, chunked
//! bodies, a connect timeout and a whole-request timeout, with errors that name the URL.
//!
//! Every plain-HTTP request lunakv makes goes through it: the engine simulator's bootstrap and
//! P/D side-channel calls ([`HttpClient::send`]), `lunakv doctor`'s reads of the admin endpoints
//! and the test harnesses' GETs ([`get_blocking`], for synchronous code). The routing sidecar's
//! proxy builds its own hyper-util client on the same crates because it streams bodies both ways
//! and speaks TLS upstream. Hand-written HTTP remains only where a test means to send what a
//! client library would not (raw SSE reads, early disconnects, malformed requests).
//!
//! `https://` URLs go over TLS with a [`lunakv_tls::ClientTls`]: the server verified against
//! the pool's CA (`LUNAKV_TLS_CACERT`), this client's certificate presented when it has one
//! (`LUNAKV_TLS_CERT`, `LUNAKV_TLS_KEY`), as the master's admin port under `LUNAKV_ADMIN_TLS`
//! asks ([`HttpClient::with_tls`]; [`get_blocking`] reads the variables itself).
#![forbid(unsafe_code)]

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use lunakv_tls::ClientTls;
use lunakv_tls::client::TlsIo;

/// What a caller of [`request`] names its method and headers with.
pub use hyper::Method;
pub use hyper::header::HeaderValue;

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
    /// An `https://` URL, and no TLS to speak it with (or TLS that cannot be set up).
    #[error("{url}: {reason}")]
    Tls { url: String, reason: String },
}

/// Why this process's TLS for `https://` could not be set up ([`HttpClient::from_env`]).
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    /// A variable or a key of mooncake_config.json is wrong (it is named).
    #[error(transparent)]
    Config(#[from] lunakv_config::ConfigError),
    /// A file it names cannot be used (it is named).
    #[error(transparent)]
    Tls(#[from] lunakv_tls::TlsError),
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
    inner: Client<Connector, Full<Bytes>>,
    tls: bool,
}

impl Default for HttpClient {
    fn default() -> Self {
        HttpClient::with_connect_timeout(CONNECT_TIMEOUT)
    }
}

impl HttpClient {
    /// A client whose connection attempts give up after `connect`; `http://` only.
    pub fn with_connect_timeout(connect: Duration) -> HttpClient {
        HttpClient::with_tls(connect, None)
    }

    /// A client whose connection attempts give up after `connect`, speaking `https://` with
    /// `tls` (without it an `https://` URL is refused, naming `LUNAKV_TLS_CACERT`).
    pub fn with_tls(connect: Duration, tls: Option<ClientTls>) -> HttpClient {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect));
        let has_tls = tls.is_some();
        HttpClient {
            // Idle connections are dropped before a peer's usual 5 s keep-alive would close
            // them under a request.
            inner: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(4))
                .build(Connector {
                    http,
                    tls,
                    wait: connect,
                }),
            tls: has_tls,
        }
    }

    /// A client with the TLS of this process's environment (`LUNAKV_TLS_CACERT`, and
    /// `LUNAKV_TLS_CERT` / `LUNAKV_TLS_KEY`, or the `tls_*` keys of mooncake_config.json),
    /// when it names any; `Err` names the variable or file that is wrong.
    pub fn from_env(connect: Duration) -> Result<HttpClient, TlsSetupError> {
        let paths = lunakv_config::tls::TlsPaths::client_from_env(&lunakv_config::process_env)?;
        let tls = ClientTls::from_paths(&paths)?;
        Ok(HttpClient::with_tls(connect, tls))
    }

    /// Sends `req` and reads the whole answer, all within `timeout`.
    pub async fn send(
        &self,
        req: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response, HttpError> {
        let url = req.uri().to_string();
        if req.uri().scheme_str() == Some("https") && !self.tls {
            return Err(no_tls(&url));
        }
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
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(bad(
            "write it as http://host:port/path (or https://host:port/path)".into(),
        ));
    }
    Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| bad(e.to_string()))
}

/// `GET url` from synchronous code (the CLI, test harnesses): a client on a one-off runtime,
/// connecting within `timeout` and answering within `timeout`; an `https://` URL with the TLS
/// of this process's environment ([`HttpClient::from_env`]). Safe to call from inside a tokio
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
        let client = if url.starts_with("https://") {
            HttpClient::from_env(timeout).map_err(|e| HttpError::Tls {
                url: url.to_string(),
                reason: e.to_string(),
            })?
        } else {
            HttpClient::with_connect_timeout(timeout)
        };
        rt.block_on(client.get(url, timeout))
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

fn no_tls(url: &str) -> HttpError {
    HttpError::Tls {
        url: url.to_string(),
        reason: "an https:// URL needs TLS: set LUNAKV_TLS_CACERT to the CA of the server's \
                 certificate (and LUNAKV_TLS_CERT, LUNAKV_TLS_KEY for a client certificate)"
            .into(),
    }
}

/// Dials `http://` with hyper-util's connector and `https://` with a [`ClientTls`] (HTTP/1,
/// no ALPN).
#[derive(Clone)]
struct Connector {
    http: HttpConnector,
    tls: Option<ClientTls>,
    wait: Duration,
}

type Connecting = Pin<Box<dyn Future<Output = io::Result<Stream>> + Send>>;

impl tower::Service<Uri> for Connector {
    type Response = Stream;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::<Uri>::poll_ready(&mut self.http, cx).map_err(io::Error::other)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        if uri.scheme_str() != Some("https") {
            let connecting = self.http.call(uri);
            return Box::pin(async move {
                connecting
                    .await
                    .map(Stream::Plain)
                    .map_err(io::Error::other)
            });
        }
        let (tls, wait) = (self.tls.clone(), self.wait);
        Box::pin(async move {
            let tls = tls.ok_or_else(|| io::Error::other(no_tls(&uri.to_string())))?;
            let auth = uri.authority().ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("no host:port in {uri}"),
                )
            })?;
            let host_port = match auth.port_u16() {
                Some(_) => auth.to_string(),
                None => format!("{}:443", auth.host()),
            };
            let s = tls.connect_http1(&host_port, wait).await?;
            Ok(Stream::Tls(Box::new(TokioIo::new(s))))
        })
    }
}

/// A connection of [`Connector`].
enum Stream {
    Plain(TokioIo<tokio::net::TcpStream>),
    Tls(Box<TokioIo<TlsIo>>),
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        match self {
            Stream::Plain(s) => s.connected(),
            Stream::Tls(_) => Connected::new(),
        }
    }
}

impl hyper::rt::Read for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
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
        for u in ["127.0.0.1:9003/metrics", "ftp://x:1/", "http:///x"] {
            let e = get_blocking(u, Duration::from_secs(1)).expect_err(u);
            assert!(matches!(e, HttpError::Url { .. }), "{u}: {e}");
        }
    }

    #[tokio::test]
    async fn https_without_tls_names_the_variable() {
        let e = HttpClient::default()
            .get("https://127.0.0.1:1/metrics", Duration::from_secs(1))
            .await
            .expect_err("no TLS");
        assert!(
            matches!(e, HttpError::Tls { .. }) && e.to_string().contains("LUNAKV_TLS_CACERT"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn blocking_get_works_inside_a_runtime() {
        let (base, h) = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        let r = get_blocking(&format!("{base}/"), Duration::from_secs(5)).expect("get");
        assert_eq!((r.status.as_u16(), r.text().as_str()), (200, "ok"));
        h.join().expect("server");
    }
}
