//! The gRPC listener's connections, each checked once before tonic sees it: a client that does
//! not speak HTTP/2 (upstream Mooncake's coro_rpc client, or curl against the RPC port) is told
//! nothing on the wire (it would not understand) but named in the master's log, instead of
//! leaving both sides with "end of file". Quick calls ([`crate::quick`]) share the port and
//! are told apart here by their magic.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lunakv_proto::foreign::{ClientSpeaks, client_speaks};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::quick::QuickServer;

/// How long a new connection may stay silent before it is handed to tonic unchecked (an HTTP/2
/// client sends its preface at once).
const PEEK_WAIT: Duration = Duration::from_secs(2);
/// At most one log line per this interval for foreign clients: a misconfigured fleet must not
/// flood the log.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Accepts on `listener` until the returned stream is dropped; yields the connections that speak
/// HTTP/2 (or said nothing within [`PEEK_WAIT`]) and hands quick-call connections to `quick`.
pub(crate) fn grpc_connections(
    listener: TcpListener,
    quick: Arc<QuickServer>,
) -> ReceiverStream<io::Result<TcpStream>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let last_log = std::sync::Arc::new(Mutex::new(None::<Instant>));
        loop {
            let (stream, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "gRPC accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            // Nagle off: a response written as two frames would stall on delayed ACKs.
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            let last_log = last_log.clone();
            let quick = quick.clone();
            tokio::spawn(async move {
                match admit(&stream, peer, &last_log).await {
                    Admit::Grpc => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Admit::Quick => quick.accept(stream),
                    Admit::Closed => {}
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Where a new connection goes.
enum Admit {
    Grpc,
    Quick,
    Closed,
}

async fn admit(stream: &TcpStream, peer: SocketAddr, last_log: &Mutex<Option<Instant>>) -> Admit {
    let mut first = [0u8; 8];
    let n = match tokio::time::timeout(PEEK_WAIT, stream.peek(&mut first)).await {
        Ok(Ok(n)) => n,
        // Closed or broken already: tonic would drop it too.
        Ok(Err(_)) => return Admit::Closed,
        Err(_) => return Admit::Grpc,
    };
    if n == 0 {
        return Admit::Closed;
    }
    let speaks = client_speaks(&first[..n]);
    let what = match speaks {
        ClientSpeaks::Http2 => return Admit::Grpc,
        ClientSpeaks::Quick => return Admit::Quick,
        ClientSpeaks::CoroRpc => {
            "upstream Mooncake's coro_rpc (its mooncake package or mooncake_client); give that engine lunakv's mooncake package, or point it at an upstream mooncake_master"
        }
        ClientSpeaks::Http1 => {
            "HTTP/1 (a browser, curl or a scrape); /metrics, /health and the admin routes are on the admin port (metrics_port, default 9003)"
        }
        ClientSpeaks::Other => "an unknown protocol (TLS? lunakv-master's gRPC is plaintext)",
    };
    let mut last = last_log.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
        *last = Some(Instant::now());
        tracing::warn!(
            %peer,
            "a client that does not speak gRPC connected to the master's RPC port and was closed: it speaks {what}"
        );
    }
    Admit::Closed
}
