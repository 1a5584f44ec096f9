//! The admin and Prometheus HTTP listener (upstream's port 9003): `/metrics`, `/metrics/summary`,
//! `/health`, `/get_all_segments`, `/query_key?key=...`, and for HA `/role`, `/leader`,
//! `/ha_status` (upstream's names); lunakv's `/namespaces` (cross-instance key consistency).

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;

use crate::core::MasterCore;
use crate::events::publisher::Publisher;
use crate::ha::{CoreSlot, HaState, Role};

#[derive(Clone)]
struct AdminState {
    slot: Arc<CoreSlot>,
    ha: Option<Arc<HaState>>,
    events: Option<Arc<Publisher>>,
}

/// The admin routes over `core` (a single master).
pub fn router(core: Arc<MasterCore>) -> Router {
    router_ha(CoreSlot::new(core), None)
}

/// The admin routes over the current core of `slot`, with HA routes when `ha` is set.
pub fn router_ha(slot: Arc<CoreSlot>, ha: Option<Arc<HaState>>) -> Router {
    router_full(slot, ha, None)
}

/// [`router_ha`] with the KV event publisher's metrics and `/kv_events`.
pub fn router_full(
    slot: Arc<CoreSlot>,
    ha: Option<Arc<HaState>>,
    events: Option<Arc<Publisher>>,
) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/metrics/summary", get(summary))
        .route("/health", get(health))
        .route("/role", get(role))
        .route("/leader", get(leader))
        .route("/ha_status", get(ha_status))
        .route("/get_all_segments", get(segments))
        .route("/query_key", get(query_key))
        .route("/namespaces", get(namespaces))
        .route("/kv_events", get(kv_events))
        .with_state(AdminState { slot, ha, events })
}

async fn metrics(State(s): State<AdminState>) -> Response {
    let core = s.slot.get();
    core.refresh_gauges();
    let mut text = lunakv_telemetry::render(&core.metrics.registry);
    text.push_str(&core.namespaces.render_metrics());
    text.push_str(&render_segment_protocols(&core));
    if let Some(ha) = &s.ha {
        text.push_str(&lunakv_telemetry::render(&ha.metrics.registry));
    }
    if let Some(p) = &s.events {
        text.push_str(&lunakv_telemetry::render(&p.stats().registry));
    }
    text.push_str(&lunakv_telemetry::render_process("lunakv-master"));
    (
        [(header::CONTENT_TYPE, lunakv_telemetry::METRICS_CONTENT_TYPE)],
        text,
    )
        .into_response()
}

/// `master_segment_protocol_info{segment,requested,effective,reason} 1` per mounted segment:
/// a store or embedded engine asked for rdma but serving tcp shows up here, not only in its log.
fn render_segment_protocols(core: &MasterCore) -> String {
    use std::fmt::Write as _;
    let name = "master_segment_protocol_info";
    let mut o = format!(
        "# HELP {name} Protocol each mounted segment was configured with and the one it serves\n# TYPE {name} gauge\n"
    );
    for seg in core.segments() {
        let Some(d) = core.segment_desc(&seg.name) else {
            continue;
        };
        let requested = if d.requested_protocol.is_empty() {
            &d.protocol
        } else {
            &d.requested_protocol
        };
        let _ = writeln!(
            o,
            "{name}{{segment=\"{}\",requested=\"{}\",effective=\"{}\",reason=\"{}\"}} 1",
            lunakv_telemetry::escape_label(&d.name),
            lunakv_telemetry::escape_label(requested),
            lunakv_telemetry::escape_label(&d.protocol),
            lunakv_telemetry::escape_label(&d.protocol_reason)
        );
    }
    o
}

/// `OK` for a single master; with HA `OK role=leader|follower term=N leader=host:port`
/// (both roles are healthy: a follower is a ready standby).
async fn health(State(s): State<AdminState>) -> String {
    match &s.ha {
        None => "OK".to_string(),
        Some(ha) => {
            let l = ha.leader();
            format!(
                "OK role={} term={} leader={}",
                ha.role().as_str(),
                l.as_ref().map_or(0, |l| l.term),
                l.as_ref().map_or("none", |l| l.address.as_str())
            )
        }
    }
}

async fn role(State(s): State<AdminState>) -> &'static str {
    match &s.ha {
        None => "leader",
        Some(ha) => ha.role().as_str(),
    }
}

async fn leader(State(s): State<AdminState>) -> Response {
    let Some(ha) = &s.ha else {
        return Json(serde_json::json!({"ha": false, "role": "leader"})).into_response();
    };
    match ha.leader() {
        Some(l) => Json(serde_json::json!({
            "address": l.address, "admin": l.admin, "term": l.term,
        }))
        .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"error": "no leader elected yet"})),
        )
            .into_response(),
    }
}

async fn ha_status(State(s): State<AdminState>) -> Response {
    let Some(ha) = &s.ha else {
        return Json(serde_json::json!({"ha": false})).into_response();
    };
    let l = ha.leader();
    Json(serde_json::json!({
        "ha": true,
        "role": ha.role().as_str(),
        "is_leader": ha.role() == Role::Leader,
        "cluster_id": ha.cluster_id,
        "etcd_endpoints": ha.etcd_endpoints,
        "etcd_up": ha.metrics.etcd_up.get() == 1,
        "leader": l.as_ref().map(|l| &l.address),
        "term": l.as_ref().map_or(0, |l| l.term),
        "lease_left_ms": ha.lease_left().map(|d| d.as_millis() as u64),
        "lease_ttl_ms": ha.granted_ttl().map(|d| d.as_millis() as u64),
        "fast_takeover": ha.fast_takeover(),
        "fast_takeovers_total": ha.metrics.fast_takeovers_total.get(),
        "leader_changes_total": ha.metrics.leader_changes_total.get(),
    }))
    .into_response()
}

async fn summary(State(s): State<AdminState>) -> String {
    let core = s.slot.get();
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

async fn segments(State(s): State<AdminState>) -> Response {
    Json(s.slot.get().segments()).into_response()
}

async fn query_key(
    State(s): State<AdminState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let core = s.slot.get();
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

/// Per vLLM key namespace: keys put per client, shared keys, and the unshared-instances verdict.
async fn namespaces(State(s): State<AdminState>) -> Response {
    Json(s.slot.get().namespaces.report()).into_response()
}

/// `/kv_events`: whether this master publishes KV events, where, and the counters
/// (`lunakv status` shows it; docs/EVENTS.md).
async fn kv_events(State(s): State<AdminState>) -> Json<serde_json::Value> {
    let Some(p) = &s.events else {
        return Json(serde_json::json!({ "enabled": false }));
    };
    let st = p.stats();
    let by = |v: &prometheus::IntCounterVec, l: &str| v.with_label_values(&[l]).get();
    let e = p.endpoints();
    Json(serde_json::json!({
        "enabled": true,
        "endpoint": e.endpoint,
        "replay_endpoint": e.replay_endpoint,
        "topic": e.topic,
        "vllm_endpoint": e.vllm_endpoint,
        "vllm_pods": e.vllm_pods,
        "published": { "mooncake": by(&st.published, "mooncake"), "vllm": by(&st.published, "vllm") },
        "dropped": { "queue_full": by(&st.dropped, "queue_full"), "send_failed": by(&st.dropped, "send_failed") },
        "subscribers": {
            "mooncake": st.subscribers.with_label_values(&["mooncake"]).get(),
            "vllm": st.subscribers.with_label_values(&["vllm"]).get(),
        },
        "replay_requests": st.replay_requests.get(),
        "leading": s.ha.as_ref().is_none_or(|h| h.leading_term().is_some()),
    }))
}
