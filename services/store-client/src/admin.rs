//! The store-client's admin HTTP: /metrics (Prometheus text) and /health.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use lunakv_client::SegmentHost;

use crate::Metrics;

#[derive(Clone)]
struct AdminState {
    host: Arc<SegmentHost>,
    metrics: Metrics,
}

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    host: Arc<SegmentHost>,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/health", get(|| async { "OK" }))
        .with_state(AdminState { host, metrics });
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!(error = %e, "admin server stopped");
    }
}

async fn metrics_text(State(s): State<AdminState>) -> impl IntoResponse {
    let st = s.host.server().stats();
    let m = &s.metrics;
    m.capacity.set(s.host.info().size as i64);
    m.used.set(st.used_bytes as i64);
    m.objects.set(st.entries as i64);
    m.bytes_read.set(st.bytes_read as i64);
    m.bytes_written.set(st.bytes_written as i64);
    m.reads.set(st.reads as i64);
    m.writes.set(st.writes as i64);
    m.shm_attaches.set(st.shm_attaches as i64);
    let set = |g: &prometheus::IntGauge, v: u64| g.set(i64::try_from(v).unwrap_or(i64::MAX));
    set(&m.drain_drained, m.drain.drained());
    set(&m.drain_drained_bytes, m.drain.drained_bytes());
    set(&m.drain_dropped, m.drain.dropped());
    let cs = s.host.server().conn_stats();
    m.conns_open.set((cs.open_tcp + cs.open_shm) as i64);
    m.conns_refused.set(cs.refused_total as i64);
    m.bad_frames.set(cs.bad_frames_total as i64);
    if let Some(t) = &m.tier {
        let d = t.stats();
        set(&m.disk_capacity, d.capacity_bytes);
        set(&m.disk_used, d.used_bytes);
        set(&m.disk_live, d.live_bytes);
        set(&m.disk_objects, d.objects);
        set(&m.disk_written, d.bytes_written_total);
        set(&m.disk_loaded, d.bytes_loaded_total);
        set(&m.disk_loads, d.loads_total);
        set(&m.disk_evicted, d.evicted_objects_total);
        set(&m.disk_corrupt, d.corrupt_objects_total);
        set(&m.disk_write_errors, d.write_errors_total);
        set(&m.disk_compactions, d.compactions_total);
        set(&m.disk_compacted, d.compacted_bytes_total);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        lunakv_telemetry::render(&m.registry),
    )
}
