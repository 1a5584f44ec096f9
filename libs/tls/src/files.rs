//! PEM files: certificate chains, private keys, CA bundles. Every refusal names the file, where
//! its path came from, and the fix.

use lunakv_config::tls::TlsFile;
use rustls::RootCertStore;
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::{TlsError, provider};

fn bad(file: &TlsFile, reason: impl Into<String>, fix: &str) -> TlsError {
    TlsError::File {
        file: file.clone(),
        reason: reason.into(),
        fix: fix.to_string(),
    }
}

fn read(file: &TlsFile) -> Result<Vec<u8>, TlsError> {
    std::fs::read(&file.path).map_err(|e| {
        bad(
            file,
            format!("cannot read it: {e}"),
            "point it at a readable PEM file (a mounted Secret, for example)",
        )
    })
}

/// The certificates of a PEM file, in order (a chain: the end entity first; or a CA bundle).
pub fn certs(file: &TlsFile) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(file)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| {
            bad(
                file,
                format!("bad PEM: {e}"),
                "give a PEM file of -----BEGIN CERTIFICATE----- blocks",
            )
        })?;
    if certs.is_empty() {
        return Err(bad(
            file,
            "it holds no certificate (-----BEGIN CERTIFICATE-----)",
            "give the PEM certificate file (tls.crt, ca.crt), not a key, a DER file or a directory",
        ));
    }
    Ok(certs)
}

fn key(file: &TlsFile) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(file)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        bad(
            file,
            format!("no private key in it ({e})"),
            "give the PEM private key (-----BEGIN PRIVATE KEY----- or an RSA/EC key), e.g. tls.key",
        )
    })
}

/// A certificate chain and its key, checked to belong together.
pub fn certified_key(cert: &TlsFile, key_file: &TlsFile) -> Result<CertifiedKey, TlsError> {
    let chain = certs(cert)?;
    let k = key(key_file)?;
    let ck = CertifiedKey::from_der(chain, k, &provider()).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => bad(
            key_file,
            format!("this key does not belong to the certificate in {cert}"),
            "give the key that was issued with that certificate (the same Secret's tls.key)",
        ),
        other => bad(
            key_file,
            format!("unusable private key: {other}"),
            "give an RSA, ECDSA or Ed25519 key in PEM",
        ),
    })?;
    if let Some(s) = ck
        .cert
        .first()
        .and_then(|c| crate::CertSummary::of(c.as_ref()))
        && s.expired
    {
        tracing::warn!(certificate = %cert, summary = %s, "this certificate has expired: peers will refuse it; renew it (the file is reread when it changes)");
    }
    Ok(ck)
}

/// The trust anchors of a CA bundle.
pub(crate) fn roots(ca: &TlsFile) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for c in certs(ca)? {
        store.add(c).map_err(|e| {
            bad(
                ca,
                format!("a certificate in it is not a usable CA: {e}"),
                "give the CA certificate(s) in PEM (ca.crt of the issuer)",
            )
        })?;
    }
    Ok(store)
}
