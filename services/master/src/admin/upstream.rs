//! Upstream Mooncake master's admin routes that lunakv answers with upstream's path, method,
//! query parameters, body shape and status codes, from what the core knows:
//!
//! - `GET /kv_events/status`: the KV event publisher's counters (open, as `/kv_events` is).
//! - `GET /get_all_keys`: every key, one per line (streamed one index shard at a time).
//! - `GET /get_segments_detail`: every mounted segment with its allocator's usage.
//! - `GET /query_segment?segment=`: one segment's used and capacity bytes, as text.
//! - `GET /batch_query_keys?keys=a,b`: each key's replicas, read-only (no lease).
//! - `GET /api/v1/segments/status?segment=`: one segment's lifecycle status.
//! - `POST /api/v1/remove_all?force=&tenant_id=`: removes every object (of one tenant).
//! - `POST /api/v1/drain_jobs` (JSON body), `GET /api/v1/drain_jobs/query?job_id=`,
//!   `POST /api/v1/drain_jobs/cancel?job_id=`: drain jobs ([`crate::core`]'s drain module).
//!
//! All but `/kv_events/status` are guarded as the listings are ([`crate::auth`]); the
//! deviations from upstream are listed in docs/SECURITY.md ("Upstream's admin routes").

use std::collections::{BTreeMap, HashMap};

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use futures::StreamExt;
use lunakv_proto::ErrorCode;

use super::state::AdminState;
use crate::core::{
    DrainError, DrainRequest, JobStatus, MasterCore, ObjectState, SHARDS, is_job_id,
};
use crate::ha::recovery::Access;
use crate::metrics::Rpc;

/// Most keys one `/batch_query_keys` call may name.
pub const MAX_BATCH_QUERY_KEYS: usize = 1000;

/// Upstream's content type for its text listings.
const TEXT: &str = "text/plain; version=0.0.4";

fn text(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, TEXT)], body).into_response()
}

/// The gate's refusal ([`crate::rpc::service::admit`]) as upstream answers a master whose service plane
/// is not active: 503, with the reason and what to do (the follower's names the leader).
fn refused(st: &tonic::Status) -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::UnavailableInCurrentStatus,
        format!("service plane is not active: {}", st.message()),
    )
}

/// Upstream's `{"success": false, "error_code", "error_message"}`.
fn error(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(serde_json::json!({
            "success": false,
            "error_code": code.as_i32(),
            "error_message": message.into(),
        })),
    )
        .into_response()
}

/// `GET /kv_events/status`: upstream's publisher counters, from the stream upstream publishes
/// (lunakv's `mooncake` stream; the vLLM stream's counters are on `/kv_events`).
pub(super) async fn kv_events_status(State(s): State<AdminState>) -> Json<serde_json::Value> {
    let Some(p) = &s.events else {
        return Json(serde_json::json!({
            "enabled": false,
            "published_batches": 0,
            "published_events": 0,
            "dropped_events": 0,
            "skipped_unparsed_keys": 0,
        }));
    };
    let st = p.stats();
    let dropped = |r: &str| st.dropped.with_label_values(&[r]).get();
    Json(serde_json::json!({
        "enabled": true,
        "published_batches": st.batches.with_label_values(&["mooncake"]).get(),
        "published_events": st.published.with_label_values(&["mooncake"]).get(),
        "dropped_events": dropped("queue_full") + dropped("send_failed") + dropped("too_many_models"),
        "skipped_unparsed_keys": dropped("unparsed_key"),
    }))
}

/// `GET /get_all_keys`: the default tenant's keys, one per line, streamed one index shard at a
/// time so that a large pool costs the master one shard's key list at once, not the whole.
pub(super) async fn get_all_keys(State(s): State<AdminState>) -> Response {
    let core = s.slot.get();
    let chunks = futures::stream::iter(0..SHARDS).map(move |i| {
        let mut body = String::new();
        for k in core.default_tenant_keys_in_shard(i) {
            body.push_str(&k);
            body.push('\n');
        }
        Ok::<_, std::convert::Infallible>(Bytes::from(body))
    });
    (
        [(header::CONTENT_TYPE, TEXT)],
        Body::from_stream(
            chunks.filter(|c| std::future::ready(c.as_ref().is_ok_and(|b| !b.is_empty()))),
        ),
    )
        .into_response()
}

/// Upstream prints a size in GiB with C++'s default stream format: 6 significant digits,
/// trailing zeros dropped ("16 GiB", "0.5 GiB", "0.000976562 GiB").
pub(super) fn gib(bytes: u64) -> String {
    let v = bytes as f64 / (1u64 << 30) as f64;
    if v == 0.0 {
        return "0 GiB".into();
    }
    let digits = 5 - v.abs().log10().floor() as i32;
    let mut s = format!("{v:.prec$}", prec = digits.max(0) as usize);
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    format!("{s} GiB")
}

/// `GET /get_segments_detail`.
pub(super) async fn segments_detail(State(s): State<AdminState>) -> Response {
    let core = s.slot.get();
    let segments: Vec<serde_json::Value> = core
        .segments()
        .iter()
        .map(|seg| {
            let protocol = core
                .segment_desc(&seg.name)
                .map(|d| d.protocol)
                .unwrap_or_default();
            let pct = if seg.size > 0 {
                seg.used as f64 / seg.size as f64 * 100.0
            } else {
                0.0
            };
            serde_json::json!({
                "segment_name": seg.name,
                // lunakv names a segment once (no separate UUID): the name is its id.
                "segment_id": seg.name,
                "client_id": seg.client_id,
                // Replicas are offsets into the owner's segment: its base is 0 here.
                "base_address": "0x0",
                "size_bytes": seg.size,
                "size_human": gib(seg.size),
                "te_endpoint": seg.transfer_endpoint,
                "protocol": protocol,
                "status": seg.status,
                "allocator_used_bytes": seg.used,
                "allocator_capacity_bytes": seg.size,
                "allocator_usage_percent": pct,
            })
        })
        .collect();
    Json(serde_json::json!({
        "total_segments": segments.len(),
        "segments": segments,
    }))
    .into_response()
}

/// The `segment` parameter, or why not.
fn segment_param(q: &HashMap<String, String>) -> Option<&str> {
    q.get("segment")
        .map(String::as_str)
        .filter(|s| !s.is_empty())
}

/// `GET /query_segment?segment=NAME`: upstream's three lines of text.
pub(super) async fn query_segment(
    State(s): State<AdminState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(name) = segment_param(&q) else {
        return text(
            StatusCode::BAD_REQUEST,
            "Missing segment query parameter: give /query_segment?segment=NAME\n".into(),
        );
    };
    let core = s.slot.get();
    match core.segments().into_iter().find(|seg| seg.name == name) {
        Some(seg) => text(
            StatusCode::OK,
            format!(
                "{name}\nUsed(bytes): {}\nCapacity(bytes) : {}\n",
                seg.used, seg.size
            ),
        ),
        None => text(
            StatusCode::NOT_FOUND,
            format!("Failed to query segment: no segment {name:?} is mounted\n"),
        ),
    }
}

/// `GET /api/v1/segments/status?segment=NAME`: a mounted segment is `OK` (1), or `DRAINING`
/// (2) / `DRAINED` (3) by a drain job; lunakv has no graceful unmount status.
pub(super) async fn segment_status(
    State(s): State<AdminState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(name) = segment_param(&q) else {
        return error(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidParams,
            "Missing segment query parameter: give /api/v1/segments/status?segment=NAME",
        );
    };
    let Some(status) = s.slot.get().segment_status(name) else {
        return error(
            StatusCode::NOT_FOUND,
            ErrorCode::SegmentNotFound,
            ErrorCode::SegmentNotFound.name(),
        );
    };
    Json(serde_json::json!({
        "success": true,
        "segment": name,
        "status": status.code(),
        "status_name": status.name(),
        "error_code": 0,
        "error_message": "",
    }))
    .into_response()
}

/// Upstream's `{"success": false, "error": ...}` of `/batch_query_keys`.
fn simple_error(status: StatusCode, message: String) -> Response {
    (
        status,
        Json(serde_json::json!({"success": false, "error": message})),
    )
        .into_response()
}

/// One key of `/batch_query_keys`: upstream's `{"ok": true, "values": [descriptor...]}` (and
/// `local_disk_values` when the key has a disk copy) or `{"ok": false, "error": NAME}`.
fn key_result(core: &MasterCore, key: &str) -> serde_json::Value {
    let fail = |code: ErrorCode| serde_json::json!({"ok": false, "error": code.name()});
    // A NUL names another tenant's key: this route, as upstream's, reads the default tenant.
    if key.contains('\0') || lunakv_proto::validate_scoped_key(key).is_err() {
        return fail(ErrorCode::InvalidKey);
    }
    let Some(info) = core.query_key(key) else {
        return fail(ErrorCode::ObjectNotFound);
    };
    if info.state != ObjectState::Complete {
        return fail(ErrorCode::ReplicaIsNotReady);
    }
    let mut values = Vec::new();
    let mut disk = Vec::new();
    for r in &info.replicas {
        if r.kind == "memory" {
            let protocol = core
                .segment_desc(&r.segment)
                .map(|d| d.protocol)
                .unwrap_or_default();
            values.push(serde_json::json!({
                "size_": info.size,
                "buffer_address_": r.offset,
                "protocol_": protocol,
                "transport_endpoint_": r.transfer_endpoint,
            }));
        } else {
            disk.push(serde_json::json!({
                "client_id": info.client_id,
                "object_size": info.size,
                "transport_endpoint": r.transfer_endpoint,
            }));
        }
    }
    let mut out = serde_json::json!({"ok": true, "values": values});
    if !disk.is_empty() {
        out["local_disk_values"] = serde_json::Value::Array(disk);
    }
    out
}

/// `GET /batch_query_keys?keys=k1,k2`: at most [`MAX_BATCH_QUERY_KEYS`] keys; read-only.
pub(super) async fn batch_query_keys(
    State(s): State<AdminState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let raw = q.get("keys").map(String::as_str).unwrap_or_default();
    if raw.is_empty() {
        return simple_error(
            StatusCode::BAD_REQUEST,
            "No keys provided. Use ?keys=key1,key2,...".into(),
        );
    }
    let n = raw.split(',').count();
    if n > MAX_BATCH_QUERY_KEYS {
        return simple_error(
            StatusCode::BAD_REQUEST,
            format!(
                "keys names {n} keys, more than the {MAX_BATCH_QUERY_KEYS} one call may ask \
                 for: split them over several calls"
            ),
        );
    }
    let core = s.slot.get();
    let data: BTreeMap<&str, serde_json::Value> =
        raw.split(',').map(|k| (k, key_result(&core, k))).collect();
    Json(serde_json::json!({"success": true, "data": data})).into_response()
}

/// A `force` that is not a boolean.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "force={0:?} is not a boolean: give force=true (or 1) to also remove objects that are leased \
     or still being written, or leave it out"
)]
pub(super) struct BadForce(String);

/// `force`: upstream takes `true` or `1`; lunakv also takes `false`, `0` or nothing, and
/// refuses anything else rather than guess.
pub(super) fn force_param(q: &HashMap<String, String>) -> Result<bool, BadForce> {
    match q.get("force").map(String::as_str) {
        None | Some("" | "false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(v) => Err(BadForce(v.to_string())),
    }
}

/// `POST /api/v1/remove_all?force=&tenant_id=`: every object of `tenant_id`, or without it of
/// every tenant; `{"success": true, "removed_count": N}`. Only the leader acts.
pub(super) async fn remove_all(
    State(s): State<AdminState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let force = match force_param(&q) {
        Ok(f) => f,
        Err(why) => {
            return error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidParams,
                why.to_string(),
            );
        }
    };
    let tenant = match q.get("tenant_id") {
        None => None,
        Some(t) => match lunakv_proto::validate_tenant(t) {
            Ok(()) => Some(t.clone()),
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidParams,
                    format!("tenant_id: {e}"),
                );
            }
        },
    };
    let gate = match admit_write(&s) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let core = gate.core.clone();
    let tenants: Vec<String> = match tenant {
        Some(t) => vec![t],
        None => {
            let mut all: Vec<String> = core.tenant_usage().into_keys().collect();
            if !all.iter().any(|t| t == lunakv_proto::DEFAULT_TENANT) {
                all.push(lunakv_proto::DEFAULT_TENANT.to_owned());
            }
            all
        }
    };
    let mut removed = 0;
    for t in &tenants {
        removed += core.remove_all(t, force).await;
    }
    core.metrics
        .record(Rpc::RemoveAll, false, gate.started.elapsed());
    if let Err(st) = crate::rpc::service::confirm(s.ha.as_deref(), &gate) {
        return refused(&st);
    }
    tracing::info!(
        removed,
        force,
        tenants = tenants.len(),
        "remove_all on the admin port"
    );
    Json(serde_json::json!({"success": true, "removed_count": removed})).into_response()
}

/// The gate of the admin API's writes, the RPCs' own ([`crate::rpc::service::admit`]): an HA follower,
/// or a master still rebuilding its index from the owners' inventories (which would put back
/// what a removal took, or hide objects from a drain), refuses with upstream's 503.
fn admit_write(s: &AdminState) -> Result<crate::rpc::service::Admitted, Box<Response>> {
    crate::rpc::service::admit(&s.slot, s.ha.as_deref(), &s.recovery, Access::Write)
        .map_err(|st| Box::new(refused(&st)))
}

/// A write of the admin API under the RPCs' gate: admitted, done, and acknowledged only while
/// still leading in the same term, as an RPC's mutation.
fn gated<T>(s: &AdminState, write: impl FnOnce(&MasterCore) -> T) -> Result<T, Box<Response>> {
    let gate = admit_write(s)?;
    let out = write(&gate.core);
    crate::rpc::service::confirm(s.ha.as_deref(), &gate).map_err(|st| Box::new(refused(&st)))?;
    Ok(out)
}

/// The refusal of a route on an HA follower (upstream's WithActiveService).
fn not_leader(route: &str) -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::UnavailableInCurrentStatus,
        format!(
            "service plane is not active: this master is not the leader; send {route} to the \
             leader (/leader)"
        ),
    )
}

/// Upstream's ErrorCodeToHttpStatus for the drain calls' errors.
fn drain_error(e: &DrainError) -> Response {
    let status = match e.code() {
        ErrorCode::InvalidParams => StatusCode::BAD_REQUEST,
        ErrorCode::JobNotFound | ErrorCode::SegmentNotFound => StatusCode::NOT_FOUND,
        ErrorCode::UnavailableInCurrentStatus => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e.code(), e.to_string())
}

/// The `job_id` parameter (a UUID's text form), or upstream's 400.
fn job_id_param(q: &HashMap<String, String>) -> Result<&str, Box<Response>> {
    match q.get("job_id").map(String::as_str) {
        Some(id) if is_job_id(id) => Ok(id),
        _ => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidParams,
            "Missing or invalid job_id: give ?job_id=<the id POST /api/v1/drain_jobs answered> \
             (a UUID)",
        ))),
    }
}

/// `POST /api/v1/drain_jobs` with `{"segments": [...], "target_segments": [...],
/// "max_concurrency": N}` (and lunakv's `max_bytes_per_sec`): `{"success": true, "job_id",
/// "status": "CREATED"}`. Only the leader acts.
pub(super) async fn create_drain_job(State(s): State<AdminState>, body: Bytes) -> Response {
    let req: DrainRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidParams,
                format!(
                    "Invalid JSON body: {e}; send {{\"segments\": [\"host:port\"], \
                     \"target_segments\": [], \"max_concurrency\": 4}}"
                ),
            );
        }
    };
    let created = match gated(&s, |core| core.create_drain(&req)) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    match created {
        Ok(id) => Json(serde_json::json!({
            "success": true,
            "job_id": id,
            "status": JobStatus::Created.name(),
            "error_code": 0,
            "error_message": "",
        }))
        .into_response(),
        Err(e) => drain_error(&e),
    }
}

/// `GET /api/v1/drain_jobs/query?job_id=`: upstream's HttpQueryDrainJobResponse, plus lunakv's
/// `blocked_keys` (the keys that fit nowhere, at most 100; also in `message` once it failed).
pub(super) async fn query_drain_job(
    State(s): State<AdminState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let id = match job_id_param(&q) {
        Ok(id) => id,
        Err(r) => return *r,
    };
    // Jobs live in the leader's core: a follower would answer "not found" for a running one.
    if s.ha.as_ref().is_some_and(|h| h.leading_term().is_none()) {
        return not_leader("drain job queries");
    }
    match s.slot.get().query_drain(id) {
        Ok(r) => Json(serde_json::json!({
            "success": true,
            "job_id": r.job_id,
            // JobType::DRAIN, the only type.
            "type": 0,
            "type_name": "DRAIN",
            "status": r.status as i32,
            "status_name": r.status.name(),
            "created_at_ms_epoch": r.created_at_ms,
            "last_updated_at_ms_epoch": r.updated_at_ms,
            "segments": r.segments,
            "succeeded_units": r.succeeded,
            "failed_units": r.failed,
            "blocked_units": r.blocked,
            "active_units": r.active,
            "migrated_bytes": r.migrated_bytes,
            "message": r.message,
            "blocked_keys": r.blocked_keys,
            "error_code": 0,
            "error_message": "",
        }))
        .into_response(),
        Err(e) => drain_error(&e),
    }
}

/// `POST /api/v1/drain_jobs/cancel?job_id=`: `{"success": true, "job_id", "status":
/// "CANCELED"}`; its segments are OK again. Only the leader acts.
pub(super) async fn cancel_drain_job(
    State(s): State<AdminState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let id = match job_id_param(&q) {
        Ok(id) => id,
        Err(r) => return *r,
    };
    let canceled = match gated(&s, |core| core.cancel_drain(id)) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    match canceled {
        Ok(()) => Json(serde_json::json!({
            "success": true,
            "job_id": id,
            "status": JobStatus::Canceled.name(),
            "error_code": 0,
            "error_message": "",
        }))
        .into_response(),
        Err(e) => drain_error(&e),
    }
}
