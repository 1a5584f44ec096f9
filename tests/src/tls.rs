//! TLS pieces for the P/D tests: a test CA that issues server certificates, a TLS front that
//! terminates TLS for an engine simulator (which serves plain HTTP, as vLLM usually does behind
//! a TLS-terminating mesh), and a blocking HTTPS client that either verifies against given roots
//! or accepts anything.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::pd::{Resp, exchange};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate authority for one test.
pub struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

/// A server certificate and its key, PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl TestCa {
    pub fn new() -> TestCa {
        TestCa::named("lunakv test CA")
    }

    /// A CA whose subject CN is `cn`.
    pub fn named(cn: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().expect("ca key");
        TestCa {
            issuer: rcgen::CertifiedIssuer::self_signed(params, key).expect("ca cert"),
        }
    }

    /// A server certificate for `localhost` and `ip`.
    pub fn issue(&self, ip: IpAddr) -> Issued {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("leaf params");
        params.subject_alt_names.push(rcgen::SanType::IpAddress(ip));
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    /// A client certificate whose subject CN is `cn` (etcd's `--client-cert-auth` takes the CN
    /// as the user name).
    pub fn issue_client(&self, cn: &str) -> Issued {
        self.client_leaf(cn, |_| {})
    }

    /// A client certificate for `cn`, its parameters changed by `adjust` before signing.
    fn client_leaf(&self, cn: &str, adjust: impl FnOnce(&mut rcgen::CertificateParams)) -> Issued {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("leaf params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        adjust(&mut params);
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A client certificate for `cn` that expired a year before now (rcgen's `not_after`).
    pub fn issue_client_expired(&self, cn: &str) -> Issued {
        self.client_leaf(cn, |p| {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        })
    }

    /// Writes the CA certificate to `dir/name`; its path.
    pub fn write_ca(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.ca_pem()).expect("write the CA");
        p
    }

    /// Roots that trust this CA only.
    pub fn roots(&self) -> rustls::RootCertStore {
        let mut r = rustls::RootCertStore::empty();
        r.add(self.issuer.der().clone()).expect("add the CA");
        r
    }
}

impl Issued {
    /// Writes `dir/<name>.crt` and `dir/<name>.key` (each renamed into place, so a watcher
    /// never reads half a file); their paths.
    pub fn write(
        &self,
        dir: &std::path::Path,
        name: &str,
    ) -> (std::path::PathBuf, std::path::PathBuf) {
        let put = |file: String, text: &str| {
            let tmp = dir.join(format!(".{file}.tmp"));
            std::fs::write(&tmp, text).expect("write");
            std::fs::rename(&tmp, dir.join(&file)).expect("rename");
            dir.join(file)
        };
        (
            put(format!("{name}.crt"), &self.cert_pem),
            put(format!("{name}.key"), &self.key_pem),
        )
    }
}

/// The certificate a TLS server at `addr` presents to a client that trusts `roots` (as
/// `localhost`) and shows `client` (cert PEM, key PEM), if any.
pub fn served_certificate(
    addr: SocketAddr,
    roots: rustls::RootCertStore,
    client: Option<&Issued>,
) -> Result<CertificateDer<'static>, HttpsError> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let cfg = match client {
        Some(c) => {
            use rustls_pki_types::pem::PemObject;
            let certs = vec![
                CertificateDer::from_pem_slice(c.cert_pem.as_bytes())
                    .map_err(|e| std::io::Error::other(e.to_string()))?,
            ];
            let key = PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes())
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            b.with_client_auth_cert(certs, key)?
        }
        None => b.with_no_client_auth(),
    };
    let mut conn =
        rustls::ClientConnection::new(Arc::new(cfg), ServerName::try_from("localhost")?)?;
    let mut tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    tcp.set_read_timeout(Some(Duration::from_secs(5)))?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)?;
    }
    conn.peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned())
        .ok_or(HttpsError::NoCertificate)
}

/// Why [`https_request`] got no answer (a refused certificate is a [`HttpsError::Tls`]).
#[derive(Debug, thiserror::Error)]
pub enum HttpsError {
    #[error(transparent)]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    SidecarTls(#[from] lunakv_sidecar::tls::TlsError),
    #[error(transparent)]
    Name(#[from] rustls_pki_types::InvalidDnsNameError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("the server presented no certificate")]
    NoCertificate,
}

/// One HTTPS request. `roots` = verify the server against them (as `localhost`), `None` =
/// accept any certificate. Returns the answer and the certificate the server presented.
pub fn https_request(
    addr: SocketAddr,
    roots: Option<rustls::RootCertStore>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(Resp, CertificateDer<'static>), HttpsError> {
    let cfg = match roots {
        Some(r) => rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(r)
            .with_no_client_auth(),
        // The sidecar's own `--tls-insecure-skip-verify` client configuration.
        None => lunakv_sidecar::tls::client_config(true)?,
    };
    let name = ServerName::try_from("localhost")?;
    let conn = rustls::ClientConnection::new(Arc::new(cfg), name)?;
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    tcp.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let resp = exchange(&mut tls, addr, method, path, headers, body)?;
    let cert = tls
        .conn
        .peer_certificates()
        .and_then(|c| c.first().cloned())
        .ok_or(HttpsError::NoCertificate)?;
    Ok((resp, cert.into_owned()))
}

/// Terminates TLS (a self-signed certificate) on `bind` and forwards each connection to
/// `backend` in plain TCP; counts completed handshakes.
pub struct TlsFront {
    pub addr: SocketAddr,
    pub handshakes: Arc<AtomicU64>,
    _rt: tokio::runtime::Runtime,
}

impl TlsFront {
    pub fn start(bind: IpAddr, backend: SocketAddr) -> TlsFront {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert");
        let key = PrivateKeyDer::try_from(ck.signing_key.serialize_der()).expect("key");
        let cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let listener = rt
            .block_on(tokio::net::TcpListener::bind((bind, 0)))
            .expect("bind the TLS front");
        let addr = listener.local_addr().expect("addr");
        let handshakes = Arc::new(AtomicU64::new(0));
        let h = handshakes.clone();
        rt.spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let (acceptor, h) = (acceptor.clone(), h.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(s).await else {
                        return;
                    };
                    h.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut up) = tokio::net::TcpStream::connect(backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                    }
                });
            }
        });
        TlsFront {
            addr,
            handshakes,
            _rt: rt,
        }
    }

    pub fn handshakes(&self) -> u64 {
        self.handshakes.load(Ordering::Relaxed)
    }
}
