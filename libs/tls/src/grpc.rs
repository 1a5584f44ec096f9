//! A tonic server's port with TLS: connections that open with a TLS handshake are decrypted
//! ([`ServerTls::accept`]); plaintext ones still reach tonic, where [`PlaintextHealthOnly`] (or
//! the master's own auth layer) answers `grpc.health.v1` only, so the kubelet's gRPC probes
//! (which speak no TLS) keep working and every other call is refused by name. Each call carries
//! its connection's [`Peer`] as a request extension (tonic's `Connected`).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;

use crate::io::{Prefixed, TLS_HANDSHAKE};
use crate::{Peer, ServerTls};

/// The health service's path prefix: open on plaintext for probes.
pub const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";
/// How long a TLS handshake may take.
pub const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// How long a new connection may stay silent before it counts as plaintext.
const FIRST_BYTE_WAIT: Duration = Duration::from_secs(2);

type Tls = Prefixed<tokio_rustls::server::TlsStream<TcpStream>>;

enum Io {
    Plain(TcpStream),
    Tls(Box<Tls>),
}

/// A connection of a gRPC port, plaintext or TLS.
pub struct ServerIo {
    io: Io,
    peer: Peer,
}

impl ServerIo {
    /// A plaintext connection from `addr`.
    pub fn plain(stream: TcpStream, addr: SocketAddr) -> ServerIo {
        ServerIo {
            io: Io::Plain(stream),
            peer: Peer {
                addr,
                tls: false,
                identity: None,
            },
        }
    }

    /// A TLS connection (whose first decrypted bytes may have been read ahead).
    pub fn tls(stream: Tls, peer: Peer) -> ServerIo {
        ServerIo {
            io: Io::Tls(Box::new(stream)),
            peer,
        }
    }
}

impl tonic::transport::server::Connected for ServerIo {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

impl AsyncRead for ServerIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ServerIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Whether a connection whose first bytes are `first` opens a TLS handshake.
pub fn opens_tls(first: &[u8]) -> bool {
    first.first() == Some(&TLS_HANDSHAKE)
}

/// The first byte a new connection sends: `None` when it stays silent for a moment (or closes
/// at once); `Err` when its socket failed.
pub async fn first_byte(stream: &TcpStream) -> io::Result<Option<u8>> {
    let mut first = [0u8; 1];
    match tokio::time::timeout(FIRST_BYTE_WAIT, stream.peek(&mut first)).await {
        Ok(Ok(0)) | Err(_) => Ok(None),
        Ok(Ok(_)) => Ok(Some(first[0])),
        Ok(Err(e)) => Err(e),
    }
}

/// The connections of `listener` for `serve_with_incoming`: with `tls`, those that open a TLS
/// handshake are decrypted (a refused one is logged and closed), the rest stay plaintext.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
) -> ReceiverStream<io::Result<ServerIo>> {
    ReceiverStream::new(crate::accept::each_connection(
        listener,
        "gRPC",
        move |stream, addr| {
            let tls = tls.clone();
            async move {
                let Some(tls) = tls else {
                    return Some(Ok(ServerIo::plain(stream, addr)));
                };
                let first = first_byte(&stream).await.ok()?;
                let io = if first.is_some_and(|b| opens_tls(&[b])) {
                    let (s, peer) = tls.accept(stream, addr, HANDSHAKE_WAIT).await?;
                    ServerIo::tls(Prefixed::new(Vec::new(), s), peer)
                } else {
                    ServerIo::plain(stream, addr)
                };
                Some(Ok(io))
            }
        },
    ))
}

/// A tower layer for a tonic server whose port may serve TLS: with `tls` on, calls on plaintext
/// connections other than `grpc.health.v1` get UNAUTHENTICATED with a message that names
/// `service` and the variables to set; without, every call passes.
#[derive(Clone)]
pub struct PlaintextHealthOnly {
    service: &'static str,
    /// `None`: TLS off; else whether client certificates are required.
    mutual: Option<bool>,
}

impl PlaintextHealthOnly {
    pub fn new(service: &'static str, tls: Option<&ServerTls>) -> PlaintextHealthOnly {
        PlaintextHealthOnly {
            service,
            mutual: tls.map(ServerTls::requires_client_certificates),
        }
    }
}

/// The metadata key of [`plaintext_refusal`]: `mtls` or `tls`, what the port requires.
pub const TLS_REQUIRED_HEADER: &str = "x-lunakv-tls-required";

/// The refusal of a plaintext call on a port that serves TLS; carries
/// [`TLS_REQUIRED_HEADER`] so a client (`lunakv doctor`) can tell without reading the text.
pub fn plaintext_refusal(service: &str, mutual: bool) -> tonic::Status {
    let mut s = tonic::Status::unauthenticated(if mutual {
        format!(
            "{service} requires mTLS on this port and this client connected in plaintext: set \
             LUNAKV_TLS_CACERT (the pool's CA), LUNAKV_TLS_CERT and LUNAKV_TLS_KEY (this \
             client's certificate and key) in its environment, or tls_cacert, tls_cert and \
             tls_key in its mooncake_config.json"
        )
    } else {
        format!(
            "{service} requires TLS on this port and this client connected in plaintext: set \
             LUNAKV_TLS_CACERT (the CA of the server's certificate) in its environment, or \
             tls_cacert in its mooncake_config.json"
        )
    });
    s.metadata_mut().insert(
        TLS_REQUIRED_HEADER,
        tonic::metadata::MetadataValue::from_static(if mutual { "mtls" } else { "tls" }),
    );
    s
}

impl<S> tower::Layer<S> for PlaintextHealthOnly {
    type Service = PlaintextHealthOnlyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PlaintextHealthOnlyService {
            inner,
            layer: self.clone(),
        }
    }
}

/// [`PlaintextHealthOnly`]'s service.
#[derive(Clone)]
pub struct PlaintextHealthOnlyService<S> {
    inner: S,
    layer: PlaintextHealthOnly,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for PlaintextHealthOnlyService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let Some(mutual) = self.layer.mutual else {
            return Box::pin(self.inner.call(req));
        };
        let tls = req.extensions().get::<Peer>().is_some_and(|p| p.tls);
        if tls || req.uri().path().starts_with(HEALTH_PREFIX) {
            return Box::pin(self.inner.call(req));
        }
        let resp = plaintext_refusal(self.layer.service, mutual).into_http();
        Box::pin(async move { Ok(resp) })
    }
}
