//! vLLM's bootstrap HTTP API: `POST /register`, `GET /query`, plus `GET /health`.

use std::collections::BTreeMap;
use std::sync::Arc;
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

use crate::state::{BootstrapState, Table, Worker};

#[derive(Clone)]
struct App {
    state: Arc<dyn BootstrapState>,
    lease: Duration,
}

/// The router for the HTTP listener.
pub fn router(state: Arc<dyn BootstrapState>, lease: Duration) -> Router {
    Router::new()
        .route("/register", post(register))
        .route("/query", get(query))
        .route("/health", get(|| async { StatusCode::OK }))
        .with_state(App { state, lease })
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
    match app.state.register(w, ttl) {
        Ok(_) => Json(json!({ "status": "ok" })).into_response(),
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
    Json(query_json(&app.state.query())).into_response()
}
