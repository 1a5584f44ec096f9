//! Listeners: one per data-parallel rank (`--port`+i -> model server port+i), optional TLS,
//! HTTP/1 and HTTP/2 (hyper-util auto), graceful drain on shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceBuilder;

use crate::body::Body;
use crate::cache::BootstrapCache;
use crate::config::SidecarConfig;
use crate::layers::{InflightLayer, RequestIdLayer};
use crate::metrics::Metrics;
use crate::peers::PeerLog;
use crate::proxy::{DecoderBase, HttpClient, Proxy, Shared};
use crate::ssrf::Allowlist;
use crate::{SidecarError, tls};

/// How long shutdown waits for in-flight requests.
const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Bound listeners plus everything needed to serve them.
pub struct Bound {
    shared: Arc<Shared>,
    listeners: Vec<(TcpListener, Arc<str>, DecoderBase)>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl Bound {
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.listeners
            .iter()
            .filter_map(|(l, _, _)| l.local_addr().ok())
            .collect()
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }
}

fn client(cfg: &SidecarConfig, skip_verify: bool) -> Result<HttpClient, SidecarError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    let tls = tls::client_config(skip_verify)?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(cfg.idle_conn_timeout)
        .pool_max_idle_per_host(cfg.max_idle_conns_per_host)
        .pool_timer(TokioTimer::new())
        .build::<_, Body>(https))
}

/// Creates the clients and binds every listener (port 0 picks free ports, one per rank).
pub async fn bind(cfg: SidecarConfig) -> Result<Bound, SidecarError> {
    let metrics = Arc::new(Metrics::default());
    let mut background = Vec::new();
    let allow = if cfg.ssrf {
        let a = Allowlist::new(&cfg.ssrf_allowlist, cfg.ssrf_allowlist_file.as_ref());
        if let Some(f) = &cfg.ssrf_allowlist_file {
            background.push(a.watch(f.clone(), Duration::from_secs(1)));
        }
        if cfg.ssrf_allowlist.is_empty() && cfg.ssrf_allowlist_file.is_none() {
            tracing::warn!(
                "SSRF protection is on with an empty allowlist: every prefill target is refused"
            );
        }
        Some(a)
    } else {
        None
    };
    let tls = if cfg.secure_proxy {
        Some(tokio_rustls::TlsAcceptor::from(tls::server_config(
            cfg.cert_path.as_deref(),
        )?))
    } else {
        None
    };
    let scheme = if cfg.tls.decoder { "https" } else { "http" };
    let mut listeners = Vec::new();
    for i in 0..cfg.data_parallel_size {
        let port = if cfg.port == 0 { 0 } else { cfg.port + i };
        let addr = SocketAddr::new(cfg.host, port);
        let l = TcpListener::bind(addr)
            .await
            .map_err(|source| SidecarError::Bind { addr, source })?;
        let host = &cfg.model_server_host;
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        let decoder: Arc<str> = format!("{scheme}://{host}:{}", cfg.vllm_port + i).into();
        let base = DecoderBase::parse(&decoder).map_err(|e| {
            SidecarError::Config(crate::ConfigError::Invalid(format!(
                "--model-server-host {}: {e}",
                cfg.model_server_host
            )))
        })?;
        listeners.push((l, decoder, base));
    }
    // The decode engine usually starts after this sidecar (vLLM loads its model first): say
    // so once, and once when it answers, instead of once per request meanwhile.
    let peers = Arc::new(PeerLog::default());
    for (_, decoder, base) in &listeners {
        background.push(tokio::spawn(crate::peers::wait_for_decoder(
            peers.clone(),
            base.authority.to_string(),
            decoder.to_string(),
        )));
    }
    let shared = Arc::new(Shared {
        prefill_client: client(&cfg, cfg.skip_verify.prefiller)?,
        decode_client: client(&cfg, cfg.skip_verify.decoder)?,
        cache: BootstrapCache::new(1024),
        body_budget: crate::body::BodyBudget::new(cfg.max_buffered_body_bytes, metrics.clone()),
        allow,
        metrics,
        peers,
        cfg,
    });
    Ok(Bound {
        shared,
        listeners,
        tls,
        background,
    })
}

/// Serves until `shutdown` resolves, then stops accepting and drains (at most 10 s).
pub async fn serve(
    bound: Bound,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), SidecarError> {
    let addrs = bound.local_addrs();
    let (stop_tx, stop_rx) = watch::channel(false);
    let graceful = Arc::new(hyper_util::server::graceful::GracefulShutdown::new());
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).keep_alive(true);
    let mut acceptors = Vec::new();
    for (listener, decoder, decoder_base) in bound.listeners {
        let stack = ServiceBuilder::new()
            .layer(RequestIdLayer)
            .layer(InflightLayer::new(bound.shared.metrics.clone()))
            .service(Proxy {
                shared: bound.shared.clone(),
                decoder,
                decoder_base,
            });
        let mut stop = stop_rx.clone();
        let (builder, tls, graceful) = (builder.clone(), bound.tls.clone(), graceful.clone());
        acceptors.push(tokio::spawn(async move {
            loop {
                let (stream, peer) = tokio::select! {
                    _ = stop.changed() => return,
                    r = listener.accept() => match r {
                        Ok(x) => x,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    },
                };
                let _ = stream.set_nodelay(true);
                let svc = TowerToHyperService::new(stack.clone());
                let (builder, tls, watcher) = (builder.clone(), tls.clone(), graceful.watcher());
                tokio::spawn(async move {
                    let r = match tls {
                        Some(tls) => match tls.accept(stream).await {
                            Ok(s) => {
                                watcher
                                    .watch(
                                        builder.serve_connection(TokioIo::new(s), svc).into_owned(),
                                    )
                                    .await
                            }
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                        },
                        None => {
                            watcher
                                .watch(
                                    builder
                                        .serve_connection(TokioIo::new(stream), svc)
                                        .into_owned(),
                                )
                                .await
                        }
                    };
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
        }));
    }
    let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    lunakv_telemetry::announce(
        "lunakv-sidecar",
        &[
            ("http", &list.first().cloned().unwrap_or_default()),
            ("listeners", &list.join(",")),
            ("connector", &bound.shared.cfg.connector.name()),
            ("secure", &bound.tls.is_some()),
        ],
    );
    tracing::info!(listeners = %list.join(","), connector = bound.shared.cfg.connector.name(), "lunakv-sidecar serving");
    shutdown.await;
    tracing::info!("shutting down: no new connections, draining in-flight requests");
    let _ = stop_tx.send(true);
    for a in acceptors {
        let _ = a.await;
    }
    // The acceptors (the only other owners) have returned.
    match Arc::try_unwrap(graceful) {
        Ok(g) => {
            if tokio::time::timeout(DRAIN_GRACE, g.shutdown())
                .await
                .is_err()
            {
                tracing::warn!(
                    "drain timed out after {DRAIN_GRACE:?}; exiting with requests in flight"
                );
            }
        }
        Err(_) => tracing::warn!("cannot drain: an acceptor is still running"),
    }
    for b in bound.background {
        b.abort();
    }
    Ok(())
}
