//! HTTPS on the admin port (`LUNAKV_ADMIN_TLS=1`, docs/SECURITY.md "mTLS and identities"):
//! the same certificate files as the RPC port, reloaded when they change; with
//! `LUNAKV_TLS_CACERT` a client certificate is asked for but optional, because the kubelet's
//! probes and Prometheus reach this port without one. A presented certificate is verified (a
//! refused one fails the handshake, logged naming it) and its identity reaches the admin
//! middleware as [`AdminPeer`], where an identity in `LUNAKV_ADMIN_IDENTITIES` admits the
//! guarded listings as the admin token does.
//!
//! A connection that does not open with a TLS handshake gets one plaintext `400` that says the
//! port serves HTTPS and what to set, and a log line (once per peer per 30 s); it never reaches
//! the router.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::{IncomingStream, Listener};
use lunakv_tls::grpc::{HANDSHAKE_WAIT, TLS_REQUIRED_HEADER, first_byte, opens_tls};
use lunakv_tls::{Peer, ServerTls};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

/// The caller of an admin-port request under HTTPS (axum's `ConnectInfo`).
#[derive(Debug, Clone)]
pub struct AdminPeer(pub Peer);

impl axum::extract::connect_info::Connected<IncomingStream<'_, TlsAdminListener>> for AdminPeer {
    fn connect_info(stream: IncomingStream<'_, TlsAdminListener>) -> AdminPeer {
        stream.remote_addr().clone()
    }
}

/// The admin port's listener under HTTPS: accepted connections are sorted by their first byte
/// and shaken hands with in tasks of their own (a slow client holds up no one); axum gets only
/// TLS sessions.
pub struct TlsAdminListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, AdminPeer)>,
    local: SocketAddr,
}

impl TlsAdminListener {
    /// Starts accepting on `listener` with `tls`.
    pub fn new(listener: TcpListener, tls: Arc<ServerTls>) -> std::io::Result<TlsAdminListener> {
        let local = listener.local_addr()?;
        let rx =
            lunakv_tls::accept::each_connection(listener, "admin port", move |stream, addr| {
                let tls = tls.clone();
                async move {
                    // Silent or gone: nothing to answer.
                    let first = first_byte(&stream).await.ok()??;
                    if !opens_tls(&[first]) {
                        refuse_plaintext(&tls, stream, addr).await;
                        return None;
                    }
                    let (s, peer) = tls.accept(stream, addr, HANDSHAKE_WAIT).await?;
                    Some((s, AdminPeer(peer)))
                }
            });
        Ok(TlsAdminListener { rx, local })
    }
}

impl Listener for TlsAdminListener {
    type Io = TlsStream<TcpStream>;
    type Addr = AdminPeer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task ends only with this listener; until then, nothing comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<AdminPeer> {
        Ok(AdminPeer(Peer {
            addr: self.local,
            tls: true,
            identity: None,
        }))
    }
}

/// The body of the answer to a plaintext request on the HTTPS admin port.
pub const PLAINTEXT_REFUSAL: &str = "lunakv-master's admin port serves HTTPS (LUNAKV_ADMIN_TLS=1) \
     and this request came in plaintext: use https:// with the pool's CA (LUNAKV_TLS_CACERT); \
     kubelet probes need `scheme: HTTPS`, Prometheus `scheme: https` and a tls_config with the \
     CA (deploy/k8s/README.md#mtls)\n";

/// Answers a plaintext connection with one `400` naming what to set, and logs it.
async fn refuse_plaintext(tls: &ServerTls, mut stream: TcpStream, addr: SocketAddr) {
    tls.log(
        addr,
        "a plaintext HTTP request on the admin port, which serves HTTPS (LUNAKV_ADMIN_TLS=1): \
         the client must use https:// (probes: scheme HTTPS; Prometheus: scheme https)"
            .into(),
    );
    // Read what the client sent first (a request head), so closing does not reset it before
    // it reads the answer.
    let _ = lunakv_tls::io::read_head(&mut stream, 4096, Duration::from_millis(200)).await;
    let head = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
         {TLS_REQUIRED_HEADER}: tls\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        PLAINTEXT_REFUSAL.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(PLAINTEXT_REFUSAL.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}
