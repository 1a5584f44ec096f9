//! TLS with rustls (ring): the server side of `--secure-proxy` (a self-signed certificate, or
//! `--cert-path/{tls.crt,tls.key}` reloaded when the files change) and the client side for
//! `--enable-tls` stages (webpki roots, or no verification for `--tls-insecure-skip-verify`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::RwLock;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// TLS setup failures.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("bad PEM in {0}: {1}")]
    Pem(PathBuf, String),
    #[error("TLS setup failed: {0}")]
    Setup(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certified_key(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, TlsError> {
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Setup(format!("unsupported private key: {e}")))?;
    Ok(CertifiedKey::new(certs, signing))
}

fn self_signed() -> Result<CertifiedKey, TlsError> {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .map_err(|e| TlsError::Setup(format!("cannot generate a self-signed certificate: {e}")))?;
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::try_from(ck.signing_key.serialize_der())
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    certified_key(vec![cert], key)
}

fn load_dir(dir: &Path) -> Result<CertifiedKey, TlsError> {
    let crt = dir.join("tls.crt");
    let key = dir.join("tls.key");
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&crt)
        .map_err(|e| TlsError::Pem(crt.clone(), e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Pem(crt.clone(), e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::Pem(crt, "no certificate".into()));
    }
    let k = PrivateKeyDer::from_pem_file(&key)
        .map_err(|e| TlsError::Pem(key.clone(), e.to_string()))?;
    certified_key(certs, k)
}

/// Serves the current certificate; swapped by the reload task.
#[derive(Debug)]
struct Reloading {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().clone())
    }
}

/// The server config for `--secure-proxy`; with a cert dir, a task reloads it on change.
pub fn server_config(cert_dir: Option<&Path>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let key = match cert_dir {
        Some(d) => load_dir(d)?,
        None => self_signed()?,
    };
    let resolver = Arc::new(Reloading {
        current: RwLock::new(Arc::new(key)),
    });
    if let Some(d) = cert_dir {
        let (r, dir) = (resolver.clone(), d.to_path_buf());
        tokio::spawn(async move {
            let stamp = |d: &Path| -> Option<(SystemTime, SystemTime)> {
                let m = |f: &str| std::fs::metadata(d.join(f)).and_then(|m| m.modified()).ok();
                Some((m("tls.crt")?, m("tls.key")?))
            };
            let mut last = stamp(&dir);
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let now = stamp(&dir);
                if now == last {
                    continue;
                }
                last = now;
                match load_dir(&dir) {
                    Ok(k) => {
                        *r.current.write() = Arc::new(k);
                        tracing::info!(dir = %dir.display(), "TLS certificate reloaded");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "TLS certificate reload failed; keeping the old one")
                    }
                }
            }
        });
    }
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Accepts any certificate (`--tls-insecure-skip-verify`).
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The client config for upstream HTTPS.
pub fn client_config(skip_verify: bool) -> Result<rustls::ClientConfig, TlsError> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    let cfg = if skip_verify {
        b.dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider())))
            .with_no_client_auth()
    } else {
        let roots =
            rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        b.with_root_certificates(roots).with_no_client_auth()
    };
    Ok(cfg)
}
