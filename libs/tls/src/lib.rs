//! TLS for lunakv's ports, with rustls (ring): the master's and the bootstrap's gRPC ports
//! (mTLS: a client certificate from the pool's CA, whose identity the master acts on) and the
//! routing sidecar's `--secure-proxy`.
//!
//! - Certificates, keys and CA bundles come from PEM files and are reread when they change
//!   ([`Watched`]: at most once per [`RELOAD_CHECK`], at a handshake, so a renewed Secret is
//!   served without a restart and nothing polls in the background). A file that fails to load
//!   at start is an error naming it and where its path came from; one that fails to reload keeps
//!   the old one and logs why.
//! - [`server::ServerTls`]: a server's certificate, and with a CA, client certificates required
//!   and verified; every refusal is logged once per peer and reason, naming the peer, the
//!   certificate's subject and why ([`describe`]).
//! - [`client::ClientTls`]: a client's CA (the server is verified against it), its certificate
//!   when it has one; handshake failures become messages that name this client's certificate
//!   (path, subject) and what the server said ([`client::ClientTls::explain`]).
//! - [`io::Prefixed`]: a stream whose first bytes were read to tell protocols apart, so the
//!   master can sort TLS connections (gRPC, quick calls) after decrypting them.
//! - [`grpc`]: a tonic port with TLS: TLS and plaintext connections sorted by their first byte,
//!   the [`Peer`] of each call as a request extension, and plaintext limited to
//!   `grpc.health.v1` (the kubelet's probes speak no TLS).
//!
//! Where the files are named is `lunakv_config::tls` (`LUNAKV_TLS_CERT`, `LUNAKV_TLS_KEY`,
//! `LUNAKV_TLS_CACERT`); docs/SECURITY.md, "mTLS and identities".
#![forbid(unsafe_code)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use lunakv_config::tls::TlsFile;
use rustls::crypto::CryptoProvider;

pub mod accept;
pub mod client;
pub mod describe;
mod files;
pub mod grpc;
pub mod io;
mod reload;
pub mod server;

pub use client::{ClientTls, TlsFailure};
pub use describe::{CertSummary, identity_of};
pub use files::{certified_key, certs};
pub use reload::Watched;
pub use server::{Peer, ServerTls};

/// How often a handshake looks whether a certificate, key or CA file changed.
pub const RELOAD_CHECK: Duration = Duration::from_secs(2);

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file that cannot be used: where its path came from, the path, what is wrong, the fix.
    #[error("{file}: {reason}; {fix}")]
    File {
        file: TlsFile,
        reason: String,
        fix: String,
    },
    #[error("TLS setup failed: {0}")]
    Setup(String),
}

/// The one crypto provider (ring) every config is built with.
pub fn provider() -> Arc<CryptoProvider> {
    static P: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// A rustls error inside an I/O error (a handshake's, or a read's after it), if any.
pub fn rustls_error(e: &std::io::Error) -> Option<&rustls::Error> {
    e.get_ref()?.downcast_ref::<rustls::Error>()
}
