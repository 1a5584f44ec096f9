//! vLLM's bootstrap HTTP API: `POST /register`, `GET /query`, plus `GET /health` and
//! `GET /metrics` (Prometheus text).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use crate::api::Api;
use crate::state::{RegisterError, Table, Worker};

type App = Arc<Api>;

/// The router for the HTTP listener; serve it with
/// `into_make_service_with_connect_info::<SocketAddr>()` (registrations need the peer's IP).
pub(crate) fn router(api: Arc<Api>) -> Router {
    Router::new()
        .route("/register", post(register))
        .route("/query", get(query))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .with_state(api)
        // Lease renewals and probes come every few seconds: spans only inside a trace.
        .layer(lunakv_telemetry::propagate::HttpServerLayer::new().quiet(&[
            "/register",
            "/health",
            "/metrics",
        ]))
}

/// The body vLLM's workers send.
#[derive(Debug, Deserialize)]
struct RegisterBody {
    engine_id: String,
    #[serde(default)]
    dp_rank: u32,
    #[serde(default)]
    tp_rank: u32,
    #[serde(default)]
    pp_rank: u32,
    addr: String,
    /// lunakv extension: requested lease in ms.
    #[serde(default)]
    lease_ttl_ms: Option<u64>,
}

fn detail(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "detail": msg.into() }))).into_response()
}

async fn register(
    State(app): State<App>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: Result<Json<RegisterBody>, JsonRejection>,
) -> Response {
    let Json(b) = match body {
        Ok(b) => b,
        Err(e) => {
            app.metrics.rejected.inc();
            return detail(StatusCode::BAD_REQUEST, e.body_text());
        }
    };
    let w = Worker {
        engine_id: b.engine_id,
        dp_rank: b.dp_rank,
        tp_rank: b.tp_rank,
        pp_rank: b.pp_rank,
        addr: b.addr,
    };
    match app.register(w, b.lease_ttl_ms, peer.ip()).await {
        Ok(_) => Json(json!({ "status": "ok" })).into_response(),
        Err(e @ RegisterError::Unavailable(_)) => {
            detail(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        // The table cannot grow: 507 Insufficient Storage; one peer's share: 429.
        Err(e @ RegisterError::TableFull { .. }) => {
            detail(StatusCode::INSUFFICIENT_STORAGE, e.to_string())
        }
        Err(e @ RegisterError::PeerFull { .. }) => {
            detail(StatusCode::TOO_MANY_REQUESTS, e.to_string())
        }
        Err(e) => detail(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

/// The `/query` JSON for a table.
pub fn query_json(t: &Table) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for (dp, e) in &t.entries {
        let workers: BTreeMap<String, BTreeMap<String, String>> = e
            .workers
            .iter()
            .map(|(tp, pps)| {
                (
                    tp.to_string(),
                    pps.iter()
                        .map(|(pp, a)| (pp.to_string(), a.clone()))
                        .collect(),
                )
            })
            .collect();
        out.insert(
            dp.to_string(),
            json!({ "engine_id": e.engine_id, "worker_addr": workers }),
        );
    }
    serde_json::Value::Object(out)
}

async fn query(State(app): State<App>) -> Response {
    app.metrics.queries.inc();
    match app.state.query().await {
        Ok(t) => Json(query_json(&t)).into_response(),
        Err(e) => detail(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn metrics(State(app): State<App>) -> Response {
    let (table, workers) = match (app.state.query().await, app.state.workers().await) {
        (Ok(t), Ok(w)) => (t, w.len()),
        (Err(e), _) | (_, Err(e)) => return detail(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let m = &app.metrics;
    let limits = app.cfg.limits;
    let gauge = |g: &prometheus::IntGauge, v: usize| g.set(i64::try_from(v).unwrap_or(i64::MAX));
    gauge(&m.engines, table.entries.len());
    gauge(&m.workers, workers);
    gauge(&m.registrations_limit, limits.max_registrations);
    gauge(&m.per_peer_limit, limits.max_per_peer);
    let mut out = m.render();
    out.push_str(&lunakv_telemetry::render_process("lunakv-bootstrap"));
    (
        [(
            axum::http::header::CONTENT_TYPE,
            lunakv_telemetry::METRICS_CONTENT_TYPE,
        )],
        out,
    )
        .into_response()
}
