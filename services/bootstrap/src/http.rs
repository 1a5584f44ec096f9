//! vLLM's bootstrap HTTP API: `POST /register`, `GET /query`, plus `GET /health` and
//! `GET /metrics` (Prometheus text).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use crate::state::{BootstrapState, RegisterError, Table, Worker};

#[derive(Clone)]
struct App {
    state: Arc<dyn BootstrapState>,
    lease: Duration,
    counters: Arc<Counters>,
}

/// HTTP API counters, served at `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    registrations: AtomicU64,
    rejected: AtomicU64,
    queries: AtomicU64,
}

/// The router for the HTTP listener.
pub fn router(state: Arc<dyn BootstrapState>, lease: Duration) -> Router {
    Router::new()
        .route("/register", post(register))
        .route("/query", get(query))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .with_state(App {
            state,
            lease,
            counters: Arc::default(),
        })
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
    body: Result<Json<RegisterBody>, JsonRejection>,
) -> Response {
    let Json(b) = match body {
        Ok(b) => b,
        Err(e) => return detail(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let ttl = b
        .lease_ttl_ms
        .filter(|&ms| ms > 0)
        .map(Duration::from_millis)
        .unwrap_or(app.lease);
    let w = Worker {
        engine_id: b.engine_id,
        dp_rank: b.dp_rank,
        tp_rank: b.tp_rank,
        pp_rank: b.pp_rank,
        addr: b.addr,
    };
    match app.state.register(w, ttl).await {
        Ok(_) => {
            app.counters.registrations.fetch_add(1, Ordering::Relaxed);
            Json(json!({ "status": "ok" })).into_response()
        }
        Err(e @ RegisterError::Unavailable(_)) => {
            detail(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        Err(e) => {
            app.counters.rejected.fetch_add(1, Ordering::Relaxed);
            detail(StatusCode::BAD_REQUEST, e.to_string())
        }
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
    app.counters.queries.fetch_add(1, Ordering::Relaxed);
    match app.state.query().await {
        Ok(t) => Json(query_json(&t)).into_response(),
        Err(e) => detail(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn metrics(State(app): State<App>) -> Response {
    use std::fmt::Write;
    let (table, workers) = match (app.state.query().await, app.state.workers().await) {
        (Ok(t), Ok(w)) => (t, w.len()),
        (Err(e), _) | (_, Err(e)) => return detail(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let c = &app.counters;
    let rows: [(&str, &str, &str, u64); 5] = [
        (
            "engines",
            "gauge",
            "Data-parallel ranks with a live engine.",
            table.entries.len() as u64,
        ),
        (
            "workers",
            "gauge",
            "Live worker registrations (leases not lapsed).",
            workers as u64,
        ),
        (
            "registrations_total",
            "counter",
            "Accepted POST /register calls (first registrations and renewals).",
            c.registrations.load(Ordering::Relaxed),
        ),
        (
            "registrations_rejected_total",
            "counter",
            "Refused registrations (engine id mismatch, duplicate, invalid).",
            c.rejected.load(Ordering::Relaxed),
        ),
        (
            "queries_total",
            "counter",
            "GET /query calls.",
            c.queries.load(Ordering::Relaxed),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, v) in rows {
        let _ = writeln!(out, "# HELP lunakv_bootstrap_{name} {help}");
        let _ = writeln!(out, "# TYPE lunakv_bootstrap_{name} {kind}");
        let _ = writeln!(out, "lunakv_bootstrap_{name} {v}");
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}
