//! The HTTP listener: hyper-util serving the axum router, with uvicorn's idle keep-alive.
//!
//! vLLM serves through uvicorn, which closes a keep-alive connection that carries no request for
//! `--timeout-keep-alive` seconds (5 by default). A proxy that keeps idle connections longer
//! sends its next request into a socket the engine is closing and gets a reset: the 502s of
//! llm-d #1564. The simulator closes idle connections the same way (hyper's header-read timeout
//! runs from the end of one response to the head of the next request, which is exactly the idle
//! time), and counts who closed each connection so a test can see which side let go first.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::{Sim, api};

/// How long shutdown waits for open requests.
const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// True if a connection ended because it sat idle past the keep-alive.
fn idle_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_timeout())
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Accepts connections until `shutdown` resolves, then drains.
pub async fn serve(
    sim: Arc<Sim>,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let router = api::router(sim.clone());
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(sim.cfg.keep_alive);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        sim.stats.connections.inc();
        let conn = builder
            .serve_connection_with_upgrades(
                TokioIo::new(stream),
                TowerToHyperService::new(router.clone()),
            )
            .into_owned();
        let conn = graceful.watch(conn);
        let sim = sim.clone();
        tokio::spawn(async move {
            let counter = match conn.await {
                Err(e) if idle_timeout(&*e) => &sim.stats.connections_closed_idle,
                _ => &sim.stats.connections_closed_by_peer,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        });
    }
    if tokio::time::timeout(DRAIN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain timed out after {DRAIN_GRACE:?}; exiting with requests open");
    }
}
