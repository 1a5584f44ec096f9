//! The server side: a certificate reloaded when its files change; with a CA, a client
//! certificate required and verified against it (reloaded too); every refused handshake logged
//! once per peer and reason, naming the peer, the certificate's subject and why.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lunakv_config::tls::{TlsFile, TlsPaths};
use parking_lot::Mutex;
use rustls::DistinguishedName;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::{CertificateDer, UnixTime};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::{CertSummary, TlsError, Watched, files, identity_of, provider, rustls_error};

/// Who is at the other end of an accepted connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The connection is a TLS session.
    pub tls: bool,
    /// The client certificate's identity ([`identity_of`]); `None` without mTLS.
    pub identity: Option<Arc<str>>,
}

/// A reloading certificate for [`rustls::ServerConfig::with_cert_resolver`].
#[derive(Debug)]
struct ReloadingCert(Watched<CertifiedKey>);

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.get())
    }
}

/// The certificate and key in `cert` and `key`, served as they are now and reloaded when they
/// change (the sidecar's `--cert-path`, every [`ServerTls`]). `what` names it in log lines.
pub fn cert_resolver(
    what: &'static str,
    cert: &TlsFile,
    key: &TlsFile,
) -> Result<Arc<dyn ResolvesServerCert>, TlsError> {
    let (c, k) = (cert.clone(), key.clone());
    let watched = Watched::new(what, vec![cert.path.clone(), key.path.clone()], move || {
        files::certified_key(&c, &k)
    })?;
    Ok(Arc::new(ReloadingCert(watched)))
}

thread_local! {
    /// Why the verifier refused the client certificate of the handshake this thread is
    /// driving: the verifier runs inside the accept future's poll, and the acceptor reads it
    /// right after that poll failed, on the same thread, to log one line with the peer.
    static REFUSED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Client certificates verified against the CA in a file, reloaded when it changes.
#[derive(Debug)]
struct ClientVerifier {
    ca: TlsFile,
    current: Watched<Arc<dyn ClientCertVerifier>>,
    /// A client may present no certificate (the master's admin port: probes and scrapes
    /// carry none); one it presents is still verified.
    optional: bool,
}

impl ClientVerifier {
    fn new(ca: &TlsFile, optional: bool) -> Result<ClientVerifier, TlsError> {
        let file = ca.clone();
        let current = Watched::new(
            "the CA for client certificates",
            vec![ca.path.clone()],
            move || {
                let roots = files::roots(&file)?;
                let b = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
                let b = if optional {
                    b.allow_unauthenticated()
                } else {
                    b
                };
                b.build().map_err(|e| TlsError::File {
                    file: file.clone(),
                    reason: format!("cannot verify client certificates with it: {e}"),
                    fix: "give the CA certificate(s) that issue the clients' certificates".into(),
                })
            },
        )?;
        Ok(ClientVerifier {
            ca: ca.clone(),
            current,
            optional,
        })
    }

    fn why(&self, e: &rustls::Error) -> String {
        match e {
            rustls::Error::InvalidCertificate(c) => match c {
                CertificateError::UnknownIssuer => {
                    format!("it is not issued by the CA in {}", self.ca)
                }
                // A CA of the same name signed it, but not this CA's key.
                #[allow(deprecated)]
                CertificateError::BadSignature
                | CertificateError::UnsupportedSignatureAlgorithm
                | CertificateError::UnsupportedSignatureAlgorithmContext { .. }
                | CertificateError::UnsupportedSignatureAlgorithmForPublicKeyContext { .. } => {
                    format!(
                        "it is not issued by the CA in {} (its signature does not verify with \
                         that CA's key)",
                        self.ca
                    )
                }
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    "it has expired".to_string()
                }
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    "it is not valid yet".to_string()
                }
                CertificateError::InvalidPurpose
                | CertificateError::InvalidPurposeContext { .. } => {
                    "it is not for client authentication (no clientAuth extended key usage)"
                        .to_string()
                }
                other => format!("it is invalid: {other}"),
            },
            other => format!("it was refused: {other}"),
        }
    }
}

impl ClientCertVerifier for ClientVerifier {
    fn client_auth_mandatory(&self) -> bool {
        !self.optional
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints: a lunakv client has one certificate to offer, and the CA may be reloaded.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current
            .get()
            .verify_client_cert(end_entity, intermediates, now)
            .inspect_err(|e| {
                let what = CertSummary::of(end_entity.as_ref()).map_or_else(
                    || "an unparsable certificate".to_string(),
                    |s| s.to_string(),
                );
                let line = format!(
                    "its client certificate ({what}) was refused: {}",
                    self.why(e)
                );
                REFUSED.with(|r| *r.borrow_mut() = Some(line));
            })
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.current
            .get()
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.current
            .get()
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.current.get().supported_verify_schemes()
    }
}

/// At most one log line per peer address and reason per this.
const LOG_EVERY: Duration = Duration::from_secs(30);
/// Reasons remembered at most (a flood of distinct ones starts over rather than grow).
const LOG_KEYS: usize = 1024;

/// TLS on a server's port (`LUNAKV_TLS_CERT`, `LUNAKV_TLS_KEY`; with `LUNAKV_TLS_CACERT`, mTLS).
pub struct ServerTls {
    service: &'static str,
    acceptor: TlsAcceptor,
    ca: Option<TlsFile>,
    /// Client certificates are asked for but a client may present none.
    optional: bool,
    logged: Mutex<HashMap<(IpAddr, String), Instant>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("service", &self.service)
            .field("ca", &self.ca)
            .finish()
    }
}

impl ServerTls {
    /// TLS for `service` ("lunakv-master") from its files (`TlsPaths::server_from_env`);
    /// `None` when no certificate is configured (plaintext). `alpn`: the protocols offered
    /// (`h2` for gRPC).
    pub fn from_paths(
        service: &'static str,
        paths: &TlsPaths,
        alpn: &[&[u8]],
    ) -> Result<Option<ServerTls>, TlsError> {
        ServerTls::build(service, paths, alpn, false)
    }

    /// As [`ServerTls::from_paths`], but with a CA a client certificate is asked for and
    /// optional: one presented is verified (a refused one fails the handshake) and names the
    /// caller ([`Peer::identity`]); a client without one is served without an identity. For
    /// ports that probes and scrapers reach without certificates (the master's admin port).
    pub fn with_optional_client_certificates(
        service: &'static str,
        paths: &TlsPaths,
        alpn: &[&[u8]],
    ) -> Result<Option<ServerTls>, TlsError> {
        ServerTls::build(service, paths, alpn, true)
    }

    fn build(
        service: &'static str,
        paths: &TlsPaths,
        alpn: &[&[u8]],
        optional: bool,
    ) -> Result<Option<ServerTls>, TlsError> {
        let (Some(cert), Some(key)) = (&paths.cert, &paths.key) else {
            return Ok(None);
        };
        let resolver = cert_resolver("the server's TLS certificate", cert, key)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?;
        let mut cfg = match &paths.ca {
            Some(ca) => builder
                .with_client_cert_verifier(Arc::new(ClientVerifier::new(ca, optional)?))
                .with_cert_resolver(resolver),
            None => builder.with_no_client_auth().with_cert_resolver(resolver),
        };
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Some(ServerTls {
            service,
            acceptor: TlsAcceptor::from(Arc::new(cfg)),
            ca: paths.ca.clone(),
            optional,
            logged: Mutex::new(HashMap::new()),
        }))
    }

    /// Whether every client must present a certificate from the CA (mTLS).
    pub fn requires_client_certificates(&self) -> bool {
        self.ca.is_some() && !self.optional
    }

    /// "mtls" or "tls", as the services' listening lines name this setup.
    pub fn mode_name(&self) -> &'static str {
        if self.requires_client_certificates() {
            "mtls"
        } else {
            "tls"
        }
    }

    /// Whether client certificates are asked for (required or optional), so callers may have
    /// identities.
    pub fn asks_client_certificates(&self) -> bool {
        self.ca.is_some()
    }

    /// The service this port belongs to, as log lines and refusals name it.
    pub fn service(&self) -> &'static str {
        self.service
    }

    /// The rustls acceptor (for servers that drive the handshake themselves).
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// The TLS handshake on an accepted connection, within `wait`. A refused or failed one is
    /// logged (once per peer and reason per 30 s) and `None`.
    pub async fn accept(
        &self,
        stream: TcpStream,
        addr: SocketAddr,
        wait: Duration,
    ) -> Option<(TlsStream<TcpStream>, Peer)> {
        REFUSED.with(|r| r.borrow_mut().take());
        let r = tokio::time::timeout(wait, self.acceptor.accept(stream)).await;
        let why = match r {
            Ok(Ok(s)) => {
                let identity = s
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .and_then(|c| identity_of(c.as_ref()))
                    .map(Arc::from);
                return Some((
                    s,
                    Peer {
                        addr,
                        tls: true,
                        identity,
                    },
                ));
            }
            Ok(Err(e)) => REFUSED
                .with(|r| r.borrow_mut().take())
                .unwrap_or_else(|| self.reason(&e)),
            Err(_) => format!("no TLS handshake within {wait:?}"),
        };
        self.log(addr, why);
        None
    }

    fn reason(&self, e: &std::io::Error) -> String {
        match rustls_error(e) {
            Some(rustls::Error::NoCertificatesPresented) => format!(
                "it presented no client certificate; {} requires one issued by the CA in {}",
                self.service,
                self.ca
                    .as_ref()
                    .map_or_else(|| "LUNAKV_TLS_CACERT".to_string(), ToString::to_string)
            ),
            Some(rustls::Error::AlertReceived(a)) => format!(
                "the client ended the handshake (TLS alert {a:?}): it does not trust this \
                 server's certificate, or does not accept its name; give it the CA that issued \
                 this certificate, and a server name the certificate carries"
            ),
            Some(other) => format!("the TLS handshake failed: {other}"),
            None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                "the client closed the connection during the TLS handshake".to_string()
            }
            None => format!("the TLS handshake failed: {e}"),
        }
    }

    /// Logs a refused connection from `addr` and `why`, at most once per peer and reason per
    /// 30 s (a plaintext request on a TLS port, for one).
    pub fn log(&self, addr: SocketAddr, why: String) {
        {
            let mut logged = self.logged.lock();
            if logged.len() >= LOG_KEYS {
                logged.clear();
            }
            let now = Instant::now();
            let key = (addr.ip(), why.clone());
            if logged
                .get(&key)
                .is_some_and(|t| now.duration_since(*t) < LOG_EVERY)
            {
                return;
            }
            logged.insert(key, now);
        }
        tracing::warn!(peer = %addr, "{} refused a TLS connection from {addr}: {why}", self.service);
    }
}
