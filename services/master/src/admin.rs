//! The admin and Prometheus HTTP listener (upstream's port 9003): `/metrics`, `/metrics/summary`,
//! `/health`, `/get_all_segments`, `/query_key?key=...`.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;

use crate::core::MasterCore;

/// The admin routes over `core`.
pub fn router(core: Arc<MasterCore>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/metrics/summary", get(summary))
        .route("/health", get(|| async { "OK" }))
        .route("/get_all_segments", get(segments))
        .route("/query_key", get(query_key))
        .with_state(core)
}

async fn metrics(State(core): State<Arc<MasterCore>>) -> Response {
    core.refresh_gauges();
    (
        [(header::CONTENT_TYPE, lunakv_telemetry::METRICS_CONTENT_TYPE)],
        lunakv_telemetry::render(&core.metrics.registry),
    )
        .into_response()
}

async fn summary(State(core): State<Arc<MasterCore>>) -> String {
    let cap = core.total_capacity();
    let used = core.allocated_bytes();
    format!(
        "cluster_id: {}\nsegments: {}\ncapacity_bytes: {cap}\nallocated_bytes: {used}\n\
         usage: {:.1}%\nkeys: {}\nactive_clients: {}\nevicted_keys: {}\n",
        core.config().cluster_id,
        core.segments().len(),
        core.usage_ratio() * 100.0,
        core.key_count(),
        core.active_clients(),
        core.metrics.evicted_key_count.get(),
    )
}

async fn segments(State(core): State<Arc<MasterCore>>) -> Response {
    Json(core.segments()).into_response()
}

async fn query_key(
    State(core): State<Arc<MasterCore>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(key) = q.get("key").filter(|k| !k.is_empty()) else {
        return (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({"error": "give the key: /query_key?key=NAME"})),
        )
            .into_response();
    };
    match core.query_key(key) {
        Some(info) => Json(info).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": format!("key {key:?} not found"), "code": -704})),
        )
            .into_response(),
    }
}
