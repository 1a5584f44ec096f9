//! The admin router: upstream's routes and lunakv's, each handler here or in
//! `admin/upstream.rs`, and the tenant quota API over [`super::tenants`].

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use lunakv_proto::ErrorCode;

use crate::admin::tenants::{AdminError, TenantAdmin};
use crate::core::MasterCore;
use crate::events::publisher::Publisher;
use crate::ha::election::{HaState, Role};
use crate::ha::recovery::RecoveryGate;
use crate::slot::CoreSlot;

use super::state::AdminState;
use super::upstream::{
    batch_query_keys, cancel_drain_job, create_drain_job, get_all_keys, kv_events_status,
    query_drain_job, query_segment, remove_all, segment_status, segments_detail,
};

/// The admin routes over `core` (a single master).
pub fn router(core: Arc<MasterCore>) -> Router {
    router_ha(CoreSlot::new(core), None)
}

/// The admin routes over the current core of `slot`, with HA routes when `ha` is set.
pub fn router_ha(slot: Arc<CoreSlot>, ha: Option<Arc<HaState>>) -> Router {
    router_full(slot, ha, Arc::default(), None)
}

/// [`router_ha`] with the gate of a single master's rebuild (the one the RPCs pass), the KV
/// event publisher's metrics and `/kv_events`.
pub fn router_full(
    slot: Arc<CoreSlot>,
    ha: Option<Arc<HaState>>,
    recovery: Arc<RecoveryGate>,
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
        .route("/kv_events/status", get(kv_events_status))
        .route("/get_all_keys", get(get_all_keys))
        .route("/get_segments_detail", get(segments_detail))
        .route("/query_segment", get(query_segment))
        .route("/batch_query_keys", get(batch_query_keys))
        .route("/api/v1/segments/status", get(segment_status))
        .route("/api/v1/remove_all", post(remove_all))
        .route("/api/v1/drain_jobs", post(create_drain_job))
        .route("/api/v1/drain_jobs/query", get(query_drain_job))
        .route("/api/v1/drain_jobs/cancel", post(cancel_drain_job))
        .with_state(AdminState {
            slot,
            ha,
            recovery,
            events,
        })
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
/// Read from the core at scrape time; the labels keep this order.
fn render_segment_protocols(core: &MasterCore) -> String {
    let mut info = lunakv_telemetry::metrics::Scraped::gauge(
        "master_segment_protocol_info",
        "Protocol each mounted segment was configured with and the one it serves",
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
        info.add_gauge(
            &[
                ("segment", &d.name),
                ("requested", requested),
                ("effective", &d.protocol),
                ("reason", &d.protocol_reason),
            ],
            1.0,
        );
    }
    let registry = prometheus::Registry::new();
    lunakv_telemetry::metrics::register(&registry, info);
    lunakv_telemetry::render(&registry)
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

#[derive(Clone)]
struct TenantState {
    slot: Arc<CoreSlot>,
    ha: Option<Arc<HaState>>,
    tenants: Option<Arc<TenantAdmin>>,
}

/// Upstream's `/api/v1/tenant_quotas`: list (GET), one tenant (GET `?tenant_id=`), set
/// (PUT `?tenant_id=` with `{"requested_quota_bytes": N}`), drop (DELETE `?tenant_id=`).
/// Bodies and statuses are upstream's: `{"success": true, "data": ...}`, or `{"success":
/// false, "error_code", "error_message"}` with 400/404/409/503.
pub fn tenant_routes(
    slot: Arc<CoreSlot>,
    ha: Option<Arc<HaState>>,
    tenants: Option<Arc<TenantAdmin>>,
) -> Router {
    Router::new()
        .route(
            "/api/v1/tenant_quotas",
            get(tenant_get).put(tenant_put).delete(tenant_delete),
        )
        .with_state(TenantState { slot, ha, tenants })
}

fn tenant_error(status: StatusCode, code: ErrorCode, message: String) -> Response {
    (
        status,
        Json(serde_json::json!({
            "success": false,
            "error_code": code.as_i32(),
            "error_message": message,
        })),
    )
        .into_response()
}

/// Why the tenant API cannot act; answered as upstream answers.
enum Refusal {
    NotLeader,
    ModeOff,
    BadTenant(String),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::NotLeader => tenant_error(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::UnavailableInCurrentStatus,
                "this master is not the leader: send tenant quota changes to the leader (/leader)"
                    .into(),
            ),
            Refusal::ModeOff => tenant_error(
                StatusCode::CONFLICT,
                ErrorCode::UnavailableInCurrentStatus,
                "UNAVAILABLE_IN_CURRENT_MODE: this master runs without --enable_multi_tenants, \
                 so tenants have no quotas; start it with --enable_multi_tenants=true and \
                 --tenant_quota_connector_uri=/path/tenant_quotas.yaml"
                    .into(),
            ),
            Refusal::BadTenant(why) => tenant_error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidParams,
                format!("{why}: give ?tenant_id=<tenant>"),
            ),
        }
    }
}

/// The admin of a leading master in multi-tenant mode.
fn tenant_admin(s: &TenantState) -> Result<&Arc<TenantAdmin>, Refusal> {
    if s.ha.as_ref().is_some_and(|h| h.leading_term().is_none()) {
        return Err(Refusal::NotLeader);
    }
    s.tenants.as_ref().ok_or(Refusal::ModeOff)
}

fn tenant_param(q: &HashMap<String, String>) -> Result<&str, Refusal> {
    let t = q.get("tenant_id").map(String::as_str).unwrap_or_default();
    lunakv_proto::validate_tenant(t)
        .map(|()| t)
        .map_err(|e| Refusal::BadTenant(e.to_string()))
}

/// The admin and the `?tenant_id=` of a change.
fn tenant_change(
    s: &TenantState,
    q: &HashMap<String, String>,
) -> Result<(Arc<TenantAdmin>, String), Refusal> {
    let admin = tenant_admin(s)?.clone();
    Ok((admin, tenant_param(q)?.to_owned()))
}

fn tenant_snapshot(core: &MasterCore, tenant: &str) -> serde_json::Value {
    let quota = core.tenant_quotas().get(tenant).copied();
    let charged = core.tenant_usage_of(tenant).dram_bytes;
    serde_json::json!({
        "tenant_id": tenant,
        "requested_quota_bytes": quota.unwrap_or(0),
        "effective_quota_bytes": quota.unwrap_or(0),
        "charged_bytes": charged,
        "admission_closed": quota.is_none(),
        "over_quota": quota.is_some_and(|q| charged > q),
        "has_explicit_policy": quota.is_some(),
    })
}

fn admin_failure(e: &AdminError) -> Response {
    let status = match e {
        AdminError::Invalid(_) => StatusCode::BAD_REQUEST,
        AdminError::NotRegistered(_) => StatusCode::NOT_FOUND,
        AdminError::NotEmpty { .. } => StatusCode::CONFLICT,
        AdminError::Policy(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    tenant_error(status, e.code(), e.to_string())
}

async fn tenant_get(
    State(s): State<TenantState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = tenant_admin(&s) {
        return r.into_response();
    }
    let core = s.slot.get();
    if q.contains_key("tenant_id") {
        let tenant = match tenant_param(&q) {
            Ok(t) => t,
            Err(r) => return r.into_response(),
        };
        if !core.tenant_quotas().contains_key(tenant) {
            return admin_failure(&AdminError::NotRegistered(tenant.to_owned()));
        }
        return Json(serde_json::json!({"success": true, "data": tenant_snapshot(&core, tenant)}))
            .into_response();
    }
    let data: Vec<_> = core
        .tenant_quotas()
        .keys()
        .map(|t| tenant_snapshot(&core, t))
        .collect();
    Json(serde_json::json!({"success": true, "data": data})).into_response()
}

async fn tenant_put(
    State(s): State<TenantState>,
    Query(q): Query<HashMap<String, String>>,
    body: axum::body::Bytes,
) -> Response {
    let (admin, tenant) = match tenant_change(&s, &q) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    #[derive(serde::Deserialize)]
    struct Body {
        requested_quota_bytes: u64,
    }
    let bytes = match serde_json::from_slice::<Body>(&body) {
        Ok(b) => b.requested_quota_bytes,
        Err(e) => {
            return tenant_error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidParams,
                format!("Invalid JSON body: {e}; send {{\"requested_quota_bytes\": <bytes>}}"),
            );
        }
    };
    if let Err(e) = admin.upsert(&tenant, bytes).await {
        return admin_failure(&e);
    }
    tracing::info!(%tenant, bytes, "tenant quota set");
    let core = s.slot.get();
    Json(serde_json::json!({"success": true, "data": tenant_snapshot(&core, &tenant)}))
        .into_response()
}

async fn tenant_delete(
    State(s): State<TenantState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let (admin, tenant) = match tenant_change(&s, &q) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    let core = s.slot.get();
    let before = tenant_snapshot(&core, &tenant);
    let u = core.tenant_usage_of(&tenant);
    if let Err(e) = admin.delete(&tenant, (u.objects, u.dram_bytes)).await {
        return admin_failure(&e);
    }
    tracing::info!(%tenant, "tenant quota removed");
    Json(serde_json::json!({"success": true, "data": before})).into_response()
}
