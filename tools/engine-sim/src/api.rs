//! The OpenAI-compatible surface: `/v1/completions`, `/v1/chat/completions` (streaming and
//! not), `/health`, `/v1/models`, `/metrics` (as vLLM serves it, with the simulator's counters),
//! plus the simulator's `/sim/stats` and `/sim/kv/transfer`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::kv::{self, checksum, compute_kv, output_text, output_token, tokenize};
use crate::pd::{self, Remote, TransferRequestMsg};
use crate::{Role, Sim};

pub fn router(sim: Arc<Sim>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/sim/stats", get(stats))
        .route("/sim/kv/transfer", post(transfer))
        .fallback(unrouted)
        .with_state(sim)
        // Requests continue their caller's trace; probes and stats scrapes start none.
        .layer(lunakv_telemetry::propagate::HttpServerLayer::new().quiet(&[
            "/health",
            "/v1/models",
            "/metrics",
            "/sim/stats",
        ]))
}

/// vLLM's error body.
pub fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    let kind = match status.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    (
        status,
        axum::Json(json!({"error": {"message": msg.into(), "type": kind, "param": null, "code": status.as_u16()}})),
    )
        .into_response()
}

/// Any other path: counted (tests see where a proxy sent a request) and answered 404.
async fn unrouted(State(sim): State<Arc<Sim>>, uri: axum::http::Uri) -> Response {
    *sim.stats
        .unrouted
        .lock()
        .entry(uri.path().to_string())
        .or_default() += 1;
    error(
        StatusCode::NOT_FOUND,
        format!("{} is not served by lunakv-engine-sim", uri.path()),
    )
}

async fn models(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{"id": sim.cfg.model, "object": "model", "owned_by": "lunakv-engine-sim"}]}))
        .into_response()
}

/// The simulator's counters in the Prometheus text format, where vLLM serves its own: the compose
/// stack's Prometheus scrapes both engines, and a proxy in front of one (the routing sidecar)
/// passes scrapes through as it would to vLLM.
async fn metrics(State(sim): State<Arc<Sim>>) -> Response {
    let mut text = sim.metrics_text();
    text.push_str(&lunakv_telemetry::render_process("lunakv-engine-sim"));
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

async fn stats(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(sim.stats_json()).into_response()
}

async fn transfer(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    if sim.cfg.role == Role::Decode {
        return error(
            StatusCode::BAD_REQUEST,
            "this engine is not a prefill engine",
        );
    }
    let msg: TransferRequestMsg = match serde_json::from_slice(&body) {
        Ok(m) => m,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("bad transfer request: {e}"),
            );
        }
    };
    axum::Json(pd::serve_transfer(sim, msg).await).into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(sim): State<Arc<Sim>>, headers: HeaderMap, body: Bytes) -> Response {
    match rank_for(&sim, &headers) {
        Ok(sim) => generate(sim, Kind::Completion, headers, body).await,
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

async fn chat(State(sim): State<Arc<Sim>>, headers: HeaderMap, body: Bytes) -> Response {
    match rank_for(&sim, &headers) {
        Ok(sim) => generate(sim, Kind::Chat, headers, body).await,
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

/// Why a generate request is refused (400) or failed (500); the message goes back in the
/// OpenAI-shaped error body.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("X-data-parallel-rank {rank}: this engine serves dp ranks {ranks:?}")]
    UnservedRank { rank: u32, ranks: Vec<u32> },
    #[error("X-data-parallel-rank {0:?} is not a rank number")]
    BadRank(HeaderValue),
    #[error("'{0}' is required")]
    Missing(&'static str),
    #[error(transparent)]
    KvTask(#[from] tokio::task::JoinError),
}

/// The rank `X-data-parallel-rank` asks for (vLLM's internal DP load balancing), else this one.
fn rank_for(sim: &Arc<Sim>, headers: &HeaderMap) -> Result<Arc<Sim>, RequestError> {
    let Some(v) = headers.get("x-data-parallel-rank") else {
        return Ok(sim.clone());
    };
    match v.to_str().ok().and_then(|s| s.trim().parse::<u32>().ok()) {
        Some(dp) if dp == sim.cfg.dp_rank => Ok(sim.clone()),
        Some(dp) => sim.dp_peer(dp).ok_or_else(|| RequestError::UnservedRank {
            rank: dp,
            ranks: sim.dp_ranks(),
        }),
        None => Err(RequestError::BadRank(v.clone())),
    }
}

fn prompt_text(kind: Kind, req: &Value) -> Result<String, RequestError> {
    match kind {
        Kind::Completion => match req.get("prompt") {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Array(a)) => Ok(a
                .iter()
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(" ")),
            _ => Err(RequestError::Missing("prompt")),
        },
        Kind::Chat => {
            let msgs = req
                .get("messages")
                .and_then(|m| m.as_array())
                .ok_or(RequestError::Missing("messages"))?;
            let mut out = String::new();
            for m in msgs {
                let role = m.get("role").and_then(|r| r.as_str()).unwrap_or("user");
                let content = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                        .collect::<Vec<_>>()
                        .join(" "),
                    _ => String::new(),
                };
                out.push_str(&format!("{role}: {content}\n"));
            }
            Ok(out)
        }
    }
}

/// The prompt's KV. Small KV is computed in place: a thread-pool hop would cost more than the
/// work (and would be CPU the benchmark's proxy has to compete with).
async fn kv_of(tokens: &[u32], shape: kv::KvShape) -> Result<Vec<u8>, RequestError> {
    const INLINE_BYTES: usize = 64 << 10;
    if shape.blocks_for(tokens.len()) * shape.block_bytes <= INLINE_BYTES {
        return Ok(compute_kv(tokens, shape));
    }
    let toks = tokens.to_vec();
    Ok(tokio::task::spawn_blocking(move || compute_kv(&toks, shape)).await?)
}

/// Simulated GPU time: a wait that leaves the host CPU free. Not `tokio::time::sleep`: its
/// timer wheel ticks in whole milliseconds, which would add up to 1 ms of rounding to every
/// simulated step and swamp the sub-millisecond differences the benchmark compares. A parked
/// blocking-pool thread wakes within tens of microseconds and burns no CPU while it waits.
async fn sleep(d: Duration) {
    if d.is_zero() {
        return;
    }
    if tokio::task::spawn_blocking(move || std::thread::sleep(d))
        .await
        .is_err()
    {
        // The blocking pool is shutting down; fall back to the coarse timer.
        tokio::time::sleep(d).await;
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Decrements the in-flight gauge when a response (or its stream) is done or dropped.
struct Inflight(Arc<Sim>);

impl Inflight {
    fn new(sim: &Arc<Sim>) -> Inflight {
        sim.stats.inflight.inc();
        Inflight(sim.clone())
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.stats.inflight.dec();
    }
}

async fn generate(sim: Arc<Sim>, kind: Kind, headers: HeaderMap, body: Bytes) -> Response {
    sim.stats.requests.inc();
    let guard = Inflight::new(&sim);
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "request body must be a JSON object",
            );
        }
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")),
    };
    let prompt = match prompt_text(kind, &req) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let tokens = tokenize(&prompt);
    let max_tokens = req
        .get("max_completion_tokens")
        .and_then(|v| v.as_u64())
        .or_else(|| req.get("max_tokens").and_then(|v| v.as_u64()))
        .unwrap_or(16)
        .clamp(1, 4096) as usize;
    let stream = req.get("stream").and_then(|v| v.as_bool()).unwrap_or(false);
    let include_usage = req
        .pointer("/stream_options/include_usage")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let params = req
        .get("kv_transfer_params")
        .cloned()
        .unwrap_or(Value::Null);
    let flag = |k: &str| params.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
    let s = |k: &str| params.get(k).and_then(|v| v.as_str()).map(str::to_string);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    sim.stats.last_request_id.lock().clone_from(&request_id);
    if headers.contains_key("x-prefiller-host-port") {
        sim.stats
            .prefiller_header_seen
            .fetch_add(1, Ordering::Relaxed);
    }
    let shape = sim.cfg.shape;
    let blocks = shape.blocks_for(tokens.len());
    let full_blocks = tokens.len() / shape.block_tokens.max(1);

    let mut resp_params = Value::Null;
    let (kv, cached_tokens) = if flag("do_remote_decode") {
        if sim.cfg.role == Role::Decode {
            return error(
                StatusCode::BAD_REQUEST,
                "do_remote_decode sent to a decode-only engine",
            );
        }
        let asked_more = |k: &str| req.get(k).and_then(|v| v.as_u64()).is_some_and(|n| n > 1);
        if stream || asked_more("max_tokens") || asked_more("max_completion_tokens") {
            sim.stats
                .prefill_requests_not_minimal
                .fetch_add(1, Ordering::Relaxed);
        }
        // The decoder's side channel waits on this: the KV exists once the prefill is done.
        sleep(sim.cfg.service.prefill(tokens.len())).await;
        let kv = match kv_of(&tokens, shape).await {
            Ok(kv) => kv,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        let cached = sim.prefix_hits(&tokens) * shape.block_tokens;
        sim.stats.remote_prefills_served.inc();
        match s("transfer_id") {
            // MooncakeConnector: the decoder comes to us with the transfer_id.
            Some(id) => sim.parked.put(&id, kv.clone()),
            // NIXL-style: hand back what the decoder needs to find us.
            None => {
                let id = format!("nixl-{request_id}");
                sim.parked.put(&id, kv.clone());
                resp_params = json!({
                    "do_remote_prefill": true,
                    "do_remote_decode": false,
                    "remote_engine_id": sim.cfg.engine_id,
                    "remote_block_ids": (0..blocks).collect::<Vec<_>>(),
                    "remote_host": sim.http_addr.ip().to_string(),
                    "remote_port": sim.http_addr.port(),
                    "remote_request_id": id,
                    "tp_size": 1,
                });
            }
        }
        (kv, cached.min(full_blocks * shape.block_tokens))
    } else if flag("do_remote_prefill") {
        if sim.cfg.role == Role::Prefill {
            return error(
                StatusCode::BAD_REQUEST,
                "do_remote_prefill sent to a prefill-only engine",
            );
        }
        let remote = match (
            s("remote_bootstrap_addr"),
            s("remote_engine_id"),
            s("transfer_id"),
        ) {
            (Some(b), Some(e), Some(t)) => Remote::Bootstrap {
                bootstrap_addr: b,
                engine_id: e,
                transfer_id: t,
            },
            (None, Some(e), _) => {
                let host = s("remote_host");
                let port = params.get("remote_port").and_then(|v| v.as_u64());
                let id = s("remote_request_id").or_else(|| s("transfer_id"));
                match (host, port, id) {
                    (Some(h), Some(p), Some(id)) => Remote::Direct {
                        host: h,
                        port: p as u16,
                        engine_id: e,
                        transfer_id: id,
                    },
                    _ => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            "kv_transfer_params: do_remote_prefill needs remote_bootstrap_addr+transfer_id or remote_host+remote_port+remote_request_id",
                        );
                    }
                }
            }
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "kv_transfer_params: do_remote_prefill needs remote_engine_id",
                );
            }
        };
        sim.stats.remote_decodes.inc();
        match pd::pull(&sim, remote, blocks).await {
            Ok(kv) => (kv, tokens.len()),
            Err(e) => {
                sim.stats.transfers_failed.inc();
                tracing::warn!(error = %e, "remote prefill failed; failing the request (no silent recompute)");
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("KV transfer from the remote prefill engine failed: {e}"),
                );
            }
        }
    } else {
        sleep(sim.cfg.service.prefill(tokens.len())).await;
        let kv = match kv_of(&tokens, shape).await {
            Ok(kv) => kv,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        sim.stats.local_prefills.fetch_add(1, Ordering::Relaxed);
        let cached = sim.prefix_hits(&tokens) * shape.block_tokens;
        (kv, cached)
    };
    let sum = checksum(&kv);
    let usage = |completion: usize| {
        json!({
            "prompt_tokens": tokens.len(),
            "completion_tokens": completion,
            "total_tokens": tokens.len() + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    };
    let (id, object, chunk_object) = match kind {
        Kind::Completion => (
            format!("cmpl-{request_id}"),
            "text_completion",
            "text_completion",
        ),
        Kind::Chat => (
            format!("chatcmpl-{request_id}"),
            "chat.completion",
            "chat.completion.chunk",
        ),
    };
    let model = req
        .get("model")
        .and_then(|m| m.as_str())
        .unwrap_or(&sim.cfg.model)
        .to_string();
    let created = now_secs();
    let rid = HeaderValue::from_str(&request_id).ok();

    // A local prefill produced the first token; KV that came from a remote prefill still needs
    // one decode step for it (see `ServiceTime`).
    let first_token_free = flag("do_remote_decode") || !flag("do_remote_prefill");
    let step = sim.cfg.service.decode_per_token;
    let delay_before = move |i: usize| {
        if i == 0 && first_token_free {
            Duration::ZERO
        } else {
            step
        }
    };
    if !stream {
        sleep((0..max_tokens).map(delay_before).sum()).await;
        let text = output_text(sum, max_tokens);
        let choice = match kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
            Kind::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
        };
        let body = json!({
            "id": id, "object": object, "created": created, "model": model,
            "choices": [choice], "usage": usage(max_tokens),
            "kv_transfer_params": resp_params,
        });
        drop(guard);
        let mut r = axum::Json(body).into_response();
        if let Some(rid) = rid {
            r.headers_mut().insert("x-request-id", rid);
        }
        return r;
    }

    // Streaming: one chunk per token, then finish, optional usage chunk, then [DONE].
    let usage_v = usage(max_tokens);
    let frames = max_tokens + usize::from(include_usage) + 1;
    let chunks = futures::stream::unfold((0usize, guard), move |(i, guard)| {
        let (id, model, usage_v) = (id.clone(), model.clone(), usage_v.clone());
        async move {
            if i >= frames {
                return None;
            }
            let frame = |v: Value| Bytes::from(format!("data: {v}\n\n"));
            let out = if i < max_tokens {
                sleep(delay_before(i)).await;
                let tok = output_token(sum, i);
                let finish = if i + 1 == max_tokens {
                    json!("length")
                } else {
                    Value::Null
                };
                let choice = match kind {
                    Kind::Completion => {
                        json!({"index": 0, "text": tok, "logprobs": null, "finish_reason": finish})
                    }
                    Kind::Chat => {
                        let delta = if i == 0 {
                            json!({"role": "assistant", "content": tok})
                        } else {
                            json!({"content": tok})
                        };
                        json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
                    }
                };
                frame(
                    json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [choice]}),
                )
            } else if include_usage && i == max_tokens {
                frame(
                    json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [], "usage": usage_v}),
                )
            } else {
                Bytes::from_static(b"data: [DONE]\n\n")
            };
            Some((Ok::<_, Infallible>(out), (i + 1, guard)))
        }
    });
    let mut r = Response::new(Body::from_stream(chunks));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Some(rid) = rid {
        r.headers_mut().insert("x-request-id", rid);
    }
    r
}

impl Sim {
    /// Leading full blocks of `tokens` this engine has seen before (its prefix cache), and
    /// remembers them.
    pub fn prefix_hits(&self, tokens: &[u32]) -> usize {
        let shape = self.cfg.shape;
        let full = tokens.len() / shape.block_tokens.max(1);
        let hashes = kv::block_hashes(&tokens[..full * shape.block_tokens], shape);
        let mut seen = self.prefix_cache.lock();
        let hits = hashes.iter().take_while(|h| seen.contains(*h)).count();
        if seen.len() > 1 << 20 {
            seen.clear();
        }
        seen.extend(hashes);
        hits
    }
}
