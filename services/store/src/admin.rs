//! The store-client's admin HTTP: /metrics (Prometheus text), /health (liveness: the process
//! answers) and /ready (readiness: 200 once the segment is mounted with the master, 503 before,
//! while re-mounting after a master restart, and once unmounted at shutdown).

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use lunakv_segment::MountStatus;
use lunakv_transfer::SegmentServer;

use crate::Metrics;

/// What the admin routes read. Built before the mount, so they answer while the store waits
/// for its master.
#[derive(Clone)]
pub(crate) struct AdminState {
    pub(crate) server: Arc<SegmentServer>,
    pub(crate) segment: String,
    pub(crate) size: u64,
    pub(crate) status: MountStatus,
    pub(crate) master: String,
    pub(crate) metrics: Metrics,
}

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: AdminState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/health", get(|| async { "OK" }))
        .route("/ready", get(ready))
        .with_state(state);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!(error = %e, "admin server stopped");
    }
}

async fn ready(State(s): State<AdminState>) -> impl IntoResponse {
    if s.status.is_mounted() {
        (StatusCode::OK, "ready".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: segment {} is not mounted with lunakv-master at {} (waiting for the \
                 master, re-mounting after a master restart, or shutting down)",
                s.segment, s.master
            ),
        )
    }
}

/// Moves a counter up to the cumulative `total` read from the server's stats. Scrapes are
/// serialized (see `metrics_text`), so two cannot both add the same difference.
fn advance(c: &prometheus::IntCounter, total: u64) {
    let cur = c.get();
    if total > cur {
        c.inc_by(total - cur);
    }
}

async fn metrics_text(State(s): State<AdminState>) -> impl IntoResponse {
    let _one_scrape_at_a_time = s.metrics.scrape.lock().unwrap_or_else(|p| p.into_inner());
    let st = s.server.stats();
    let m = &s.metrics;
    m.capacity.set(s.size as i64);
    m.mounted.set(i64::from(s.status.is_mounted()));
    m.used.set(st.used_bytes as i64);
    m.objects.set(st.entries as i64);
    advance(&m.bytes_read, st.bytes_read);
    advance(&m.bytes_written, st.bytes_written);
    advance(&m.reads, st.reads);
    advance(&m.writes, st.writes);
    advance(&m.shm_attaches, st.shm_attaches);
    let set = |g: &prometheus::IntGauge, v: u64| g.set(i64::try_from(v).unwrap_or(i64::MAX));
    set(&m.drain_drained, m.drain.drained());
    set(&m.drain_drained_bytes, m.drain.drained_bytes());
    set(&m.drain_dropped, m.drain.dropped());
    let cs = s.server.conn_stats();
    m.conns_open.set((cs.open_tcp + cs.open_shm) as i64);
    advance(&m.conns_refused, cs.refused_total);
    advance(&m.bad_frames, cs.bad_frames_total);
    advance(&m.caps_refused, s.server.refused_total());
    let split = lunakv_transfer::device::split_stats();
    advance(&m.device_refused_2d, split.refused_2d);
    advance(&m.device_split_runs, split.split_runs);
    if let Some(t) = &m.tier {
        let d = t.stats();
        set(&m.disk_capacity, d.capacity_bytes);
        set(&m.disk_used, d.used_bytes);
        set(&m.disk_live, d.live_bytes);
        set(&m.disk_objects, d.objects);
        advance(&m.disk_written, d.bytes_written_total);
        advance(&m.disk_loaded, d.bytes_loaded_total);
        advance(&m.disk_loads, d.loads_total);
        advance(&m.disk_evicted, d.evicted_objects_total);
        advance(&m.disk_corrupt, d.corrupt_objects_total);
        advance(&m.disk_write_errors, d.write_errors_total);
        advance(&m.disk_compactions, d.compactions_total);
        advance(&m.disk_compacted, d.compacted_bytes_total);
        advance(&m.disk_second_chances, d.second_chances_total);
    }
    (
        [(header::CONTENT_TYPE, lunakv_telemetry::METRICS_CONTENT_TYPE)],
        lunakv_telemetry::render(&m.registry)
            + &render_op_times(&s.server.op_times())
            + &lunakv_telemetry::render_process("lunakv-store"),
    )
}

/// `lunakv_store_transfer_op_duration_seconds{op}`, from the segment server's fixed buckets
/// (the transfer library keeps atomics, not a prometheus histogram), read at scrape time.
fn render_op_times(ops: &[lunakv_transfer::OpTimesSnapshot]) -> String {
    let mut h = lunakv_telemetry::metrics::Scraped::histogram(
        "lunakv_store_transfer_op_duration_seconds",
        "Time the segment server spent per op, from its header to its reply (tcp write/read \
         carry the bytes; shm commit/pin do not)",
    );
    for o in ops {
        h.add_histogram(
            &[("op", o.op.label())],
            lunakv_transfer::OP_TIME_BOUNDS
                .iter()
                .copied()
                .zip(o.cumulative.iter().copied()),
            o.count,
            o.sum_seconds,
        );
    }
    let registry = prometheus::Registry::new();
    lunakv_telemetry::metrics::register(&registry, h);
    lunakv_telemetry::render(&registry)
}
