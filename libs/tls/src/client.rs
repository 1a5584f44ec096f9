//! The client side: the server verified against the CA (reloaded when its file changes), this
//! client's certificate presented (reloaded too), and handshake failures turned into messages
//! that name the certificate and the fix ([`ClientTls::explain`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use lunakv_config::tls::{ENV_TLS_SERVER_NAME, TlsPaths};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::sign::CertifiedKey;
use rustls::{AlertDescription, CertificateError, DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::{CertSummary, TlsError, Watched, files, provider, rustls_error};

/// A TLS failure explained ([`ClientTls::explain`]): what the I/O errors of [`ClientTls`]'s
/// streams and handshakes carry, so a caller can tell a refused certificate from a connection
/// that waiting would fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsFailure(pub String);

impl TlsFailure {
    /// The explained failure inside `e`, if it is one.
    pub fn of(e: &io::Error) -> Option<&TlsFailure> {
        e.get_ref()?.downcast_ref::<TlsFailure>()
    }

    /// The first explained failure in `e`'s chain of sources (a tonic or hyper error).
    pub fn in_chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a TlsFailure> {
        let mut cur = Some(e);
        while let Some(c) = cur {
            if let Some(f) = c.downcast_ref::<TlsFailure>() {
                return Some(f);
            }
            if let Some(f) = c.downcast_ref::<io::Error>().and_then(TlsFailure::of) {
                return Some(f);
            }
            cur = c.source();
        }
        None
    }
}

/// The server's certificate verified against the CA in a file, reloaded when it changes.
#[derive(Debug)]
struct ServerVerifier(Watched<Arc<WebPkiServerVerifier>>);

impl ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0
            .get()
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.get().supported_verify_schemes()
    }
}

/// This client's certificate, reloaded when its files change.
#[derive(Debug)]
struct ClientCert(Arc<Watched<CertifiedKey>>);

impl ResolvesClientCert for ClientCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.get())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

struct Inner {
    paths: TlsPaths,
    /// ALPN h2: gRPC.
    grpc: TlsConnector,
    /// No ALPN: quick calls (the master tells them from gRPC by their first bytes).
    plain: Arc<rustls::ClientConfig>,
    cert: Option<Arc<Watched<CertifiedKey>>>,
}

/// TLS towards a lunakv server (`LUNAKV_TLS_CACERT`, and with `LUNAKV_TLS_CERT` /
/// `LUNAKV_TLS_KEY` a client certificate). Cheap to clone.
#[derive(Clone)]
pub struct ClientTls(Arc<Inner>);

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("paths", &self.0.paths)
            .finish()
    }
}

impl ClientTls {
    /// From a client's files (`TlsPaths::client_from_env`); `None` without a CA (plaintext).
    pub fn from_paths(paths: &TlsPaths) -> Result<Option<ClientTls>, TlsError> {
        let Some(ca) = &paths.ca else {
            return Ok(None);
        };
        let file = ca.clone();
        let verifier = ServerVerifier(Watched::new(
            "the CA for the server's certificate",
            vec![ca.path.clone()],
            move || {
                let roots = files::roots(&file)?;
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|e| TlsError::File {
                        file: file.clone(),
                        reason: format!("cannot verify servers with it: {e}"),
                        fix: "give the CA certificate(s) that issued the server's certificate"
                            .into(),
                    })
            },
        )?);
        let cert = match (&paths.cert, &paths.key) {
            (Some(c), Some(k)) => {
                let (c2, k2) = (c.clone(), k.clone());
                Some(Arc::new(Watched::new(
                    "this client's TLS certificate",
                    vec![c.path.clone(), k.path.clone()],
                    move || files::certified_key(&c2, &k2),
                )?))
            }
            _ => None,
        };
        let b = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier));
        let plain = match &cert {
            Some(c) => b.with_client_cert_resolver(Arc::new(ClientCert(c.clone()))),
            None => b.with_no_client_auth(),
        };
        let mut grpc = plain.clone();
        grpc.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Some(ClientTls(Arc::new(Inner {
            paths: paths.clone(),
            grpc: TlsConnector::from(Arc::new(grpc)),
            plain: Arc::new(plain),
            cert,
        }))))
    }

    /// The files this client uses.
    pub fn paths(&self) -> &TlsPaths {
        &self.0.paths
    }

    /// What this client's certificate says, as it is now (`None` without one).
    pub fn certificate(&self) -> Option<CertSummary> {
        let ck = self.0.cert.as_ref()?.get();
        CertSummary::of(ck.cert.first()?.as_ref())
    }

    /// The name the server's certificate must carry: `LUNAKV_TLS_SERVER_NAME`, else `host`.
    pub fn server_name(&self, host: &str) -> io::Result<ServerName<'static>> {
        let name = self.0.paths.server_name.as_deref().unwrap_or(host);
        let name = name.trim_start_matches('[').trim_end_matches(']');
        ServerName::try_from(name.to_string()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{name:?} is not a name a TLS certificate can carry ({e}); set \
                     {ENV_TLS_SERVER_NAME} to the server's name in its certificate"
                ),
            )
        })
    }

    /// Dials `host_port` and shakes hands for gRPC (ALPN h2) within `wait`. Errors are
    /// [`ClientTls::explain`]ed, as are those of later reads (a refused client certificate
    /// shows on the first read under TLS 1.3).
    pub async fn connect(&self, host_port: &str, wait: Duration) -> io::Result<TlsIo> {
        self.connect_with(&self.0.grpc, host_port, wait).await
    }

    /// As [`ClientTls::connect`], without ALPN: for HTTP/1 over TLS (the master's admin port
    /// under `LUNAKV_ADMIN_TLS`, through `lunakv-http`).
    pub async fn connect_http1(&self, host_port: &str, wait: Duration) -> io::Result<TlsIo> {
        let connector = TlsConnector::from(self.0.plain.clone());
        self.connect_with(&connector, host_port, wait).await
    }

    async fn connect_with(
        &self,
        connector: &TlsConnector,
        host_port: &str,
        wait: Duration,
    ) -> io::Result<TlsIo> {
        let host = host_of(host_port);
        let name = self.server_name(host)?;
        let tcp = tokio::time::timeout(wait, TcpStream::connect(host_port))
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("cannot connect to {host_port} within {wait:?}"),
                )
            })??;
        let _ = tcp.set_nodelay(true);
        let mut s = tokio::time::timeout(wait, connector.connect(name, tcp))
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no TLS handshake with {host_port} within {wait:?}"),
                )
            })?
            .map_err(|e| self.explained(host_port, e))?;
        let early = accepted(&mut s, wait)
            .await
            .map_err(|e| self.explained(host_port, e))?;
        Ok(TlsIo {
            inner: crate::io::Prefixed::new(early, s),
            tls: self.clone(),
            server: host_port.to_string(),
        })
    }

    /// The TLS handshake on a blocking connection to `host_port` (quick calls).
    pub fn handshake_blocking(
        &self,
        host_port: &str,
        mut tcp: std::net::TcpStream,
    ) -> io::Result<rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>> {
        let name = self.server_name(host_of(host_port))?;
        let mut conn = rustls::ClientConnection::new(self.0.plain.clone(), name)
            .map_err(|e| io::Error::other(e.to_string()))?;
        while conn.is_handshaking() {
            conn.complete_io(&mut tcp)
                .map_err(|e| self.explained(host_port, e))?;
        }
        accepted_blocking(&mut conn, &mut tcp).map_err(|e| self.explained(host_port, e))?;
        Ok(rustls::StreamOwned::new(conn, tcp))
    }

    /// A connector for `tonic::transport::Endpoint::connect_with_connector`: the endpoint's
    /// URI stays `http://host:port`, and this connector brings TLS.
    pub fn connector(&self, wait: Duration) -> Connector {
        Connector {
            tls: self.clone(),
            wait,
        }
    }

    fn explained(&self, server: &str, e: io::Error) -> io::Error {
        if rustls_error(&e).is_none()
            && !matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
            )
        {
            return e;
        }
        io::Error::new(e.kind(), TlsFailure(self.explain(server, &e)))
    }

    /// What a TLS failure with `server` means and what fixes it, naming this client's
    /// certificate (path, subject) when the server refused it.
    pub fn explain(&self, server: &str, e: &io::Error) -> String {
        let p = &self.0.paths;
        let mine = || {
            let file = p.cert.as_ref().map_or_else(String::new, |f| f.to_string());
            match self.certificate() {
                Some(s) => format!("this client's certificate {file} ({s})"),
                None => format!("this client's certificate {file}"),
            }
        };
        let ca =
            p.ca.as_ref()
                .map_or_else(|| "LUNAKV_TLS_CACERT".to_string(), ToString::to_string);
        match rustls_error(e) {
            Some(rustls::Error::AlertReceived(a)) if p.cert.is_none() => format!(
                "{server} requires a client certificate and this client presents none (TLS alert \
                 {a:?}): set LUNAKV_TLS_CERT and LUNAKV_TLS_KEY (tls_cert and tls_key in \
                 mooncake_config.json) to a certificate issued by the CA the server trusts"
            ),
            Some(rustls::Error::AlertReceived(
                AlertDescription::UnknownCA | AlertDescription::DecryptError,
            )) => format!(
                "{server} refused {}: it is not issued by a CA the server trusts (the server's \
                 LUNAKV_TLS_CACERT); use a certificate issued by the pool's CA",
                mine()
            ),
            Some(rustls::Error::AlertReceived(AlertDescription::CertificateExpired)) => {
                if self.certificate().is_some_and(|s| s.expired) {
                    format!(
                        "{server} refused {}: it has expired; renew it (the file is reread when it \
                         changes, no restart needed)",
                        mine()
                    )
                } else {
                    format!(
                        "{server} refused {} as expired or not yet valid; check the clocks of \
                         both hosts",
                        mine()
                    )
                }
            }
            Some(rustls::Error::AlertReceived(a)) => {
                format!("{server} refused {} (TLS alert {a:?})", mine())
            }
            Some(rustls::Error::InvalidCertificate(c)) => match c {
                CertificateError::UnknownIssuer => format!(
                    "the certificate of {server} is not issued by the CA in {ca}: give this \
                     client the CA that issued the server's certificate, or the server a \
                     certificate from this CA"
                ),
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => format!(
                    "the certificate of {server} is not valid for the name this client expects \
                     ({c}): dial a name the certificate carries, or set {ENV_TLS_SERVER_NAME} to \
                     one"
                ),
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    format!("the certificate of {server} has expired ({c}): renew it on the server")
                }
                other => format!("the certificate of {server} was refused: {other}"),
            },
            Some(
                rustls::Error::InvalidMessage(_)
                | rustls::Error::InappropriateMessage { .. }
                | rustls::Error::InappropriateHandshakeMessage { .. },
            ) => format!(
                "{server} did not answer in TLS: it runs without TLS (set LUNAKV_TLS_CERT and \
                 LUNAKV_TLS_KEY there), or unset LUNAKV_TLS_CACERT here"
            ),
            Some(other) => format!("TLS with {server} failed: {other}"),
            None => format!(
                "{server} closed the connection during the TLS handshake ({e}): it runs without \
                 TLS (set LUNAKV_TLS_CERT and LUNAKV_TLS_KEY there) or is not a lunakv server"
            ),
        }
    }
}

/// How long a client waits after its TLS 1.3 handshake for the server's verdict on its
/// certificate before it carries on (a server that sends no session tickets gives none).
const VERDICT_WAIT: Duration = Duration::from_secs(2);

/// Under TLS 1.3 the server verifies a client certificate after the client's handshake is
/// done: a refusal arrives as an alert, an acceptance as the session tickets the server sends
/// next (rustls sends two). Waits for either, so a refused certificate fails the connect with
/// its reason rather than the first call with "connection closed". Returns application bytes
/// read meanwhile (a server that speaks first), to be read again.
async fn accepted(
    s: &mut tokio_rustls::client::TlsStream<TcpStream>,
    wait: Duration,
) -> io::Result<Vec<u8>> {
    let mut early = Vec::new();
    let conn = &s.get_ref().1;
    if conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3)
        || conn.tls13_tickets_received() > 0
    {
        return Ok(early);
    }
    let mut buf = [0u8; 4096];
    let verdict = std::future::poll_fn(|cx| {
        let mut rb = ReadBuf::new(&mut buf);
        match Pin::new(&mut *s).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection after the TLS handshake",
                )));
            }
            // The server spoke: it accepted this client, tickets or not.
            Poll::Ready(Ok(())) => {
                early.extend_from_slice(rb.filled());
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
        if s.get_ref().1.tls13_tickets_received() > 0 {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    });
    match tokio::time::timeout(wait.min(VERDICT_WAIT), verdict).await {
        Ok(r) => r.map(|()| early),
        Err(_) => Ok(early),
    }
}

/// [`accepted`] on a blocking connection; application bytes stay buffered in `conn`.
fn accepted_blocking(
    conn: &mut rustls::ClientConnection,
    tcp: &mut std::net::TcpStream,
) -> io::Result<()> {
    if conn.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
        return Ok(());
    }
    let before = tcp.read_timeout()?;
    tcp.set_read_timeout(Some(before.map_or(VERDICT_WAIT, |b| b.min(VERDICT_WAIT))))?;
    let r = (|| {
        while conn.tls13_tickets_received() == 0 {
            match conn.read_tls(tcp) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection after the TLS handshake",
                    ));
                }
                Ok(_) => {
                    let state = conn
                        .process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    if state.plaintext_bytes_to_read() > 0 {
                        return Ok(());
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })();
    tcp.set_read_timeout(before)?;
    r
}

/// `host` of `host:port` (`[v6]:port` keeps its brackets off).
fn host_of(host_port: &str) -> &str {
    let h = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    h.trim_start_matches('[').trim_end_matches(']')
}

/// A client TLS stream whose errors are explained ([`ClientTls::explain`]).
pub struct TlsIo {
    inner: crate::io::Prefixed<tokio_rustls::client::TlsStream<TcpStream>>,
    tls: ClientTls,
    server: String,
}

impl TlsIo {
    fn map(&self, e: io::Error) -> io::Error {
        if rustls_error(&e).is_some() {
            io::Error::new(e.kind(), TlsFailure(self.tls.explain(&self.server, &e)))
        } else {
            e
        }
    }
}

impl AsyncRead for TlsIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(self.map(e))),
            other => other,
        }
    }
}

impl AsyncWrite for TlsIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(self.map(e))),
            other => other,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// [`ClientTls::connector`].
#[derive(Clone)]
pub struct Connector {
    tls: ClientTls,
    wait: Duration,
}

type Connecting = Pin<Box<dyn Future<Output = io::Result<TokioIo<TlsIo>>> + Send>>;

impl tower::Service<http::Uri> for Connector {
    type Response = TokioIo<TlsIo>;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (tls, wait) = (self.tls.clone(), self.wait);
        Box::pin(async move {
            let auth = uri.authority().ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("no host:port in {uri}"),
                )
            })?;
            let host_port = if auth.port().is_some() {
                auth.to_string()
            } else {
                format!("{}:443", auth.host())
            };
            tls.connect(&host_port, wait).await.map(TokioIo::new)
        })
    }
}
