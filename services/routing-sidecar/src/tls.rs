//! TLS with rustls (ring): the server side of `--secure-proxy` (a self-signed certificate, or
//! `--cert-path/{tls.crt,tls.key}` reloaded when the files change) and the client side for
//! `--enable-tls` stages (webpki roots, or no verification for `--tls-insecure-skip-verify`).

use std::path::Path;
use std::sync::Arc;

use lunakv_config::tls::TlsFile;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::ResolvesServerCert;
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

pub use lunakv_tls::TlsError;
use lunakv_tls::provider;

fn self_signed() -> Result<Arc<dyn ResolvesServerCert>, TlsError> {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .map_err(|e| TlsError::Setup(format!("cannot generate a self-signed certificate: {e}")))?;
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::try_from(ck.signing_key.serialize_der())
        .map_err(|e| TlsError::Setup(e.to_string()))?;
    let ck = CertifiedKey::from_der(vec![cert], key, &provider())
        .map_err(|e| TlsError::Setup(format!("unsupported private key: {e}")))?;
    Ok(Arc::new(rustls::sign::SingleCertAndKey::from(ck)))
}

/// The server config for `--secure-proxy`: `--cert-path/{tls.crt,tls.key}`, reloaded when the
/// files change (lunakv-tls, the same reloading as the master's and the bootstrap's), or a
/// self-signed certificate.
pub fn server_config(cert_dir: Option<&Path>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let resolver = match cert_dir {
        Some(d) => {
            let file = |name: &str| TlsFile {
                path: d.join(name),
                origin: "--cert-path".to_string(),
            };
            lunakv_tls::server::cert_resolver(
                "the sidecar's TLS certificate",
                &file("tls.crt"),
                &file("tls.key"),
            )?
        }
        None => self_signed()?,
    };
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
