//! The gRPC listener's connections, each checked once before tonic sees it: a client that does
//! not speak HTTP/2 (upstream Mooncake's coro_rpc client, or curl against the RPC port) is told
//! nothing on the wire (it would not understand) but named in the master's log, instead of
//! leaving both sides with "end of file". Quick calls ([`crate::rpc::quick`]) share the port and
//! are told apart here by their magic.
//!
//! With TLS on (`LUNAKV_TLS_CERT`), a connection that opens with a TLS handshake is decrypted
//! first ([`lunakv_tls::ServerTls::accept`]: with mTLS, a client certificate from the CA is
//! required, and its identity travels with the connection as a [`Peer`]); the gRPC-or-quick
//! sorting then reads the decrypted bytes. A plaintext connection still reaches tonic or the
//! quick server, where the auth layer answers only `grpc.health.v1` and refuses every other
//! call naming the variables to set ([`crate::auth::check_grpc`]).

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lunakv_proto::foreign::{ClientSpeaks, client_speaks};
use lunakv_tls::grpc::{HANDSHAKE_WAIT, ServerIo, opens_tls};
use lunakv_tls::io::{Prefixed, read_head};
use lunakv_tls::{Peer, ServerTls};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;

use crate::rpc::quick::QuickServer;

/// How long a new connection may stay silent before it is handed to tonic unchecked (an HTTP/2
/// client sends its preface at once).
const PEEK_WAIT: Duration = Duration::from_secs(2);
/// At most one log line per this interval for foreign clients: a misconfigured fleet must not
/// flood the log.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Accepts on `listener` until the returned stream is dropped; yields the connections that speak
/// HTTP/2 (or said nothing within [`PEEK_WAIT`]) and hands quick-call connections to `quick`.
/// With `tls`, TLS connections are decrypted first.
pub(crate) fn grpc_connections(
    listener: TcpListener,
    quick: Arc<QuickServer>,
    tls: Option<Arc<ServerTls>>,
) -> ReceiverStream<io::Result<ServerIo>> {
    let last_log = Arc::new(Mutex::new(None::<Instant>));
    ReceiverStream::new(lunakv_tls::accept::each_connection(
        listener,
        "gRPC",
        move |stream, peer| {
            let (last_log, quick, tls) = (last_log.clone(), quick.clone(), tls.clone());
            async move {
                sort(stream, peer, &last_log, tls.as_deref(), &quick)
                    .await
                    .map(Ok)
            }
        },
    ))
}

/// Where a connection goes: tonic (returned), the quick server, or closed.
async fn sort(
    stream: TcpStream,
    peer: SocketAddr,
    last_log: &Mutex<Option<Instant>>,
    tls: Option<&ServerTls>,
    quick: &Arc<QuickServer>,
) -> Option<ServerIo> {
    let mut first = [0u8; 8];
    let n = match tokio::time::timeout(PEEK_WAIT, stream.peek(&mut first)).await {
        Ok(Ok(0)) | Ok(Err(_)) => return None,
        Ok(Ok(n)) => n,
        // Silent: tonic decides.
        Err(_) => 0,
    };
    if let Some(tls) = tls
        && opens_tls(&first[..n])
    {
        let (mut s, p) = tls.accept(stream, peer, HANDSHAKE_WAIT).await?;
        let head = read_head(&mut s, 8, PEEK_WAIT).await.ok()?;
        let speaks = if head.is_empty() {
            ClientSpeaks::Http2
        } else {
            client_speaks(&head)
        };
        let io = Prefixed::new(head, s);
        return match speaks {
            ClientSpeaks::Http2 => Some(ServerIo::tls(io, p)),
            ClientSpeaks::Quick => {
                quick.accept(io, p);
                None
            }
            other => {
                foreign(other, peer, last_log, tls_note(Some(tls)));
                None
            }
        };
    }
    let speaks = if n == 0 {
        ClientSpeaks::Http2
    } else {
        client_speaks(&first[..n])
    };
    match speaks {
        ClientSpeaks::Http2 => Some(ServerIo::plain(stream, peer)),
        ClientSpeaks::Quick => {
            quick.accept_tcp(
                stream,
                Peer {
                    addr: peer,
                    tls: false,
                    identity: None,
                },
            );
            None
        }
        other => {
            foreign(other, peer, last_log, tls_note(tls));
            None
        }
    }
}

fn tls_note(tls: Option<&ServerTls>) -> &'static str {
    match tls {
        Some(_) => "",
        None => {
            " (TLS? this lunakv-master's RPC port is plaintext: set LUNAKV_TLS_CERT and \
             LUNAKV_TLS_KEY to serve TLS)"
        }
    }
}

fn foreign(speaks: ClientSpeaks, peer: SocketAddr, last_log: &Mutex<Option<Instant>>, note: &str) {
    let what = match speaks {
        ClientSpeaks::Http2 | ClientSpeaks::Quick => return,
        ClientSpeaks::CoroRpc => {
            "upstream Mooncake's coro_rpc (its mooncake package or mooncake_client); give that engine lunakv's mooncake package, or point it at an upstream mooncake_master"
        }
        ClientSpeaks::Http1 => {
            "HTTP/1 (a browser, curl or a scrape); /metrics, /health and the admin routes are on the admin port (metrics_port, default 9003)"
        }
        ClientSpeaks::Other => "an unknown protocol",
    };
    let mut last = last_log.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
        *last = Some(Instant::now());
        tracing::warn!(
            %peer,
            "a client that does not speak gRPC connected to the master's RPC port and was closed: it speaks {what}{note}"
        );
    }
}
