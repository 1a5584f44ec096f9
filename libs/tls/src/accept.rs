//! The accept loop of every port that may serve TLS (the master's RPC and admin ports, the
//! bootstrap's gRPC port): one place that backs off on accept errors, stops once the consumer is
//! gone, and sorts each connection (peek, handshake) in a task of its own, so a slow or silent
//! client holds up nobody else's accept.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Connections sorted but not yet taken by the server.
const QUEUED: usize = 64;
/// After a failed accept (EMFILE and friends): wait this long instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Accepts on `listener` until the returned receiver is dropped. Each connection (Nagle off: a
/// response written as two frames would stall on delayed ACKs) goes to `sort` in a task of its
/// own; what it returns is passed on, `None` is dropped. `port` names the port in log lines.
pub fn each_connection<T, F, Fut>(
    listener: TcpListener,
    port: &'static str,
    sort: F,
) -> mpsc::Receiver<T>
where
    T: Send + 'static,
    F: Fn(TcpStream, SocketAddr) -> Fut + Send + 'static,
    Fut: Future<Output = Option<T>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(QUEUED);
    tokio::spawn(async move {
        loop {
            let (stream, addr) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "{port}: accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let _ = stream.set_nodelay(true);
            let sorted = sort(stream, addr);
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Some(t) = sorted.await {
                    let _ = tx.send(t).await;
                }
            });
        }
    });
    rx
}
