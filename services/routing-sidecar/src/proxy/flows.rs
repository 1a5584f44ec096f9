//! The connector flows of a disaggregated request: prefill then decode, in sequence (NIXL v2,
//! shared storage) or through mooncake's bootstrap (the engines' addresses cached, a failed
//! attempt retried with a fresh lookup).

// As in the parent: a flow's `Err` is the client's error `Response`.
#![allow(clippy::result_large_err)]

use super::*;

impl Proxy {
    pub(super) async fn disaggregate(
        &self,
        req: Request<Incoming>,
        target: String,
    ) -> Response<Body> {
        let shared = &self.shared;
        shared.metrics.disaggregated.inc();
        let (mut parts, body) = req.into_parts();
        parts.headers.remove(PREFILLER_HEADER);
        strip_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        parts.headers.remove(header::CONTENT_LENGTH);
        let Some((host, port)) =
            split_host_port(&target).and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        else {
            return error_response(
                StatusCode::BAD_REQUEST,
                format!("{PREFILLER_HEADER} '{target}' is not host:port"),
            );
        };
        if let Some(allow) = &shared.allow
            && !allow.allows(&host, port)
        {
            shared.metrics.ssrf_denied.inc();
            tracing::warn!(%target, "prefill target refused by SSRF protection");
            return error_response(
                StatusCode::FORBIDDEN,
                "Forbidden: prefill target not allowed by SSRF protection",
            );
        }
        // `_permit` lives until this function returns: the body, parsed and copied for both
        // legs, is held until then.
        let (original, _permit) = match self.read_json(body).await {
            Ok(m) => m,
            Err(r) => return r,
        };
        let path = parts.uri.path().to_string();
        let host_port = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let scheme = if shared.cfg.tls.prefiller {
            "https"
        } else {
            "http"
        };
        let prefill_url = format!("{scheme}://{host_port}{path}");
        let decode_url = format!(
            "{}{}",
            self.decoder,
            parts
                .uri
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or(&path)
        );
        let ctx = Ctx {
            headers: parts.headers,
            prefill_url,
            decode_url,
            host,
            host_port,
        };
        match shared.cfg.connector {
            Connector::Mooncake => self.mooncake(&ctx, original).await,
            Connector::NixlV2 => self.sequential(&ctx, original, true).await,
            Connector::SharedStorage => self.sequential(&ctx, original, false).await,
        }
    }

    /// The prefill body every connector shares: no streaming, one token.
    fn prefill_body(original: &Map<String, Value>, params: Value) -> Map<String, Value> {
        let mut b = original.clone();
        if !params.is_null() {
            b.insert("kv_transfer_params".into(), params);
        } else {
            b.remove("kv_transfer_params");
        }
        b.insert("stream".into(), Value::Bool(false));
        b.remove("stream_options");
        b.insert("max_tokens".into(), json!(1));
        if b.contains_key("max_completion_tokens") {
            b.insert("max_completion_tokens".into(), json!(1));
        }
        b
    }

    fn upstream_request(
        url: &str,
        headers: &HeaderMap,
        body: Bytes,
        extra: Option<(&'static str, String)>,
    ) -> Result<Request<Body>, Response<Body>> {
        let mut r = Request::new(body::full(body));
        *r.method_mut() = Method::POST;
        *r.uri_mut() = url.parse().map_err(|e| {
            error_response(
                StatusCode::BAD_REQUEST,
                format!("bad upstream url {url}: {e}"),
            )
        })?;
        *r.headers_mut() = headers.clone();
        // Called inside the leg's span: the engine's span becomes its child.
        lunakv_telemetry::propagate::inject_http(&tracing::Span::current(), r.headers_mut());
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some((k, v)) = extra
            && let Ok(v) = HeaderValue::from_str(&v)
        {
            r.headers_mut().insert(HeaderName::from_static(k), v);
        }
        Ok(r)
    }

    /// A leg's body, serialized: the legs hold bytes, not a second parsed copy, so a buffered
    /// request costs at most [`crate::body::BODY_COPIES`] times its size.
    fn json_bytes(m: &Map<String, Value>) -> Bytes {
        // A map of JSON values with string keys always serializes.
        Bytes::from(serde_json::to_vec(m).unwrap_or_default())
    }

    /// Sends a prefill request and buffers its (small, non-streaming) answer.
    async fn prefill(
        &self,
        ctx: &Ctx,
        bytes: Bytes,
        dp_rank: Option<u32>,
    ) -> Result<Answer, UpstreamError> {
        let extra = dp_rank.map(|r| ("x-data-parallel-rank", r.to_string()));
        let req = Self::upstream_request(&ctx.prefill_url, &ctx.headers, bytes, extra)
            .map_err(|_| UpstreamError::Other(ctx.prefill_url.clone(), "bad url".into()))?;
        let resp = self
            .shared
            .prefill_client
            .request(req)
            .await
            .map_err(|e| classify(&ctx.prefill_url, e))?;
        let (parts, b) = resp.into_parts();
        let body = b
            .collect()
            .await
            .map_err(|e| UpstreamError::Other(ctx.prefill_url.clone(), e.to_string()))?
            .to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    async fn decode(&self, ctx: &Ctx, bytes: Bytes) -> Result<Response<Incoming>, UpstreamError> {
        let req = Self::upstream_request(&ctx.decode_url, &ctx.headers, bytes, None)
            .map_err(|_| UpstreamError::Other(ctx.decode_url.clone(), "bad url".into()))?;
        self.shared
            .decode_client
            .request(req)
            .await
            .map_err(|e| classify(&ctx.decode_url, e))
    }

    fn cached_tokens(a: &Answer) -> (Option<Value>, Option<u64>) {
        let v: Option<Value> = serde_json::from_slice(&a.body).ok();
        let cached = v
            .as_ref()
            .and_then(|v| v.pointer("/usage/prompt_tokens_details/cached_tokens"))
            .and_then(|c| c.as_u64());
        (v, cached)
    }

    /// A prefill engine that refuses connections is logged once per period (see [`PeerLog`]);
    /// any other failure once per request.
    fn log_prefill_failure(&self, ctx: &Ctx, e: &UpstreamError, what: &str) {
        match e {
            UpstreamError::Connect(..) => {
                self.shared
                    .peers
                    .unreachable(PREFILL_ENGINE, &ctx.host_port, e);
            }
            UpstreamError::Other(..) => tracing::warn!(error = %e, "{what}"),
        }
    }

    fn prefill_error(&self, e: &UpstreamError) -> Response<Body> {
        match e {
            UpstreamError::Connect(..) => error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("The prefill node is not ready: {e}"),
            ),
            UpstreamError::Other(..) => {
                error_response(StatusCode::BAD_GATEWAY, format!("prefill failed: {e}"))
            }
        }
    }

    /// Counts and sleeps before retry `n+1`; false when `--prefill-max-retries` is used up.
    async fn next_retry(&self, n: &mut u32) -> bool {
        let cfg = &self.shared.cfg;
        if *n >= cfg.prefill_max_retries {
            return false;
        }
        *n += 1;
        self.shared.metrics.prefill_retries.inc();
        tokio::time::sleep(cfg.prefill_retry_backoff).await;
        true
    }

    /// nixlv2 (`nixl` = true) and shared-storage: prefill first, then decode.
    async fn sequential(
        &self,
        ctx: &Ctx,
        original: Map<String, Value>,
        nixl: bool,
    ) -> Response<Body> {
        let params = if nixl {
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        } else {
            Value::Null
        };
        let pbody = Self::json_bytes(&Self::prefill_body(&original, params));
        let rid = Self::request_id(&ctx.headers);
        let mut n = 0;
        let a = loop {
            let span = tracing::info_span!("prefill", target = %ctx.host_port, request_id = ?rid, attempt = n);
            let fail = match self
                .prefill(ctx, pbody.clone(), None)
                .instrument(span)
                .await
            {
                Ok(a) if a.status.is_success() => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    break a;
                }
                Ok(a) => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    self.shared.metrics.prefill_failures.inc();
                    tracing::warn!(status = %a.status, "prefill answered an error");
                    if !a.retryable() {
                        return a.into_response();
                    }
                    a.into_response()
                }
                Err(e) => {
                    self.shared.metrics.prefill_failures.inc();
                    self.log_prefill_failure(ctx, &e, "prefill failed");
                    self.prefill_error(&e)
                }
            };
            if !self.next_retry(&mut n).await {
                return fail;
            }
        };
        let (v, cached) = Self::cached_tokens(&a);
        let mut dbody = original;
        if nixl {
            match v
                .as_ref()
                .and_then(|v| v.get("kv_transfer_params"))
                .filter(|p| p.is_object())
            {
                Some(p) => {
                    dbody.insert("kv_transfer_params".into(), p.clone());
                }
                None => {
                    // Upstream would decode anyway and the engine would silently recompute.
                    return error_response(
                        StatusCode::BAD_GATEWAY,
                        "the prefill response carries no kv_transfer_params; refusing a silent decode-side recompute",
                    );
                }
            }
        }
        let span = tracing::info_span!("decode", request_id = ?rid, disaggregated = true);
        // Only the decode body's bytes stay alive while it runs.
        drop(pbody);
        let dbody = {
            let bytes = Self::json_bytes(&dbody);
            drop(dbody);
            bytes
        };
        match self.decode(ctx, dbody).instrument(span).await {
            Ok(resp) => self.relay(resp, cached).await,
            Err(e) => self.decode_error(e),
        }
    }

    /// Looks up the prefill host's engines: cached, or `GET /query` on its bootstrap server.
    async fn engines(&self, ctx: &Ctx) -> Result<(Arc<Engines>, bool), Response<Body>> {
        let key = format!("{}:{}", ctx.host, self.shared.cfg.bootstrap_port);
        if let Some(e) = self.shared.cache.get(&key) {
            return Ok((e, true));
        }
        self.shared.metrics.bootstrap_queries.inc();
        let authority = self.bootstrap_authority(ctx);
        let url = format!("http://{authority}/query");
        let answer = |msg: &str| {
            error_response(
                StatusCode::BAD_GATEWAY,
                format!("bootstrap query {url} failed: {msg}"),
            )
        };
        let fail = |msg: String| {
            tracing::warn!(%url, "bootstrap query failed: {msg}");
            answer(&msg)
        };
        let mut req = Request::new(body::empty());
        *req.uri_mut() = url.parse().map_err(|e| fail(format!("{e}")))?;
        let span = lunakv_telemetry::propagate::http_client_span(&Method::GET, req.uri());
        lunakv_telemetry::propagate::inject_http(&span, req.headers_mut());
        let call = async {
            let resp = self.shared.prefill_client.request(req).await.map_err(|e| {
                match classify(&url, e) {
                    // Refused: logged per bootstrap once per period, not per request.
                    e @ UpstreamError::Connect(..) => QueryError::Refused(e),
                    e @ UpstreamError::Other(..) => QueryError::Failed(e.to_string()),
                }
            })?;
            self.shared.peers.reachable(PREFILL_BOOTSTRAP, &authority);
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| QueryError::Failed(e.to_string()))?
                .to_bytes();
            if !status.is_success() {
                return Err(QueryError::Failed(format!("answered {status}")));
            }
            serde_json::from_slice::<Value>(&body)
                .map_err(|e| QueryError::Failed(format!("not JSON: {e}")))
        };
        let v = match tokio::time::timeout(BOOTSTRAP_TIMEOUT, call)
            .instrument(span)
            .await
            .unwrap_or_else(|_| {
                Err(QueryError::Failed(format!(
                    "no answer within {BOOTSTRAP_TIMEOUT:?}"
                )))
            }) {
            Ok(v) => v,
            Err(QueryError::Failed(msg)) => return Err(fail(msg)),
            Err(QueryError::Refused(refused)) => {
                self.shared
                    .peers
                    .unreachable(PREFILL_BOOTSTRAP, &authority, &refused);
                return Err(answer(&refused.to_string()));
            }
        };
        let engines = Engines::from_query(&v)
            .ok_or_else(|| fail("no prefill engine is registered".into()))?;
        let engines = Arc::new(engines);
        self.shared.cache.insert(&key, engines.clone());
        Ok((engines, false))
    }

    fn bootstrap_authority(&self, ctx: &Ctx) -> String {
        let p = self.shared.cfg.bootstrap_port;
        if ctx.host.contains(':') {
            format!("[{}]:{p}", ctx.host)
        } else {
            format!("{}:{p}", ctx.host)
        }
    }

    fn drop_cache(&self, ctx: &Ctx, why: &str) {
        let key = format!("{}:{}", ctx.host, self.shared.cfg.bootstrap_port);
        if self.shared.cache.drop_entry(&key) {
            self.shared.metrics.bootstrap_cache_drops.inc();
            tracing::info!(%key, why, "dropped the bootstrap cache entry");
        }
    }

    /// mooncake: prefill and decode concurrently on one transfer_id. Unlike upstream, a failed
    /// prefill cancels the decode and is retried or returned; it never turns into a silent
    /// decode-side recompute (llm-d-router #1220) or a client left waiting (vLLM #55870).
    async fn mooncake(&self, ctx: &Ctx, original: Map<String, Value>) -> Response<Body> {
        let rid = Self::request_id(&ctx.headers);
        let mut stale_retry_left = true;
        let mut n = 0;
        loop {
            let span =
                tracing::info_span!("pd", target = %ctx.host_port, request_id = ?rid, attempt = n);
            let fail = match self
                .mooncake_attempt(ctx, &original, &mut stale_retry_left)
                .instrument(span)
                .await
            {
                Attempt::Done(r) => return r,
                Attempt::Relay(resp, cached) => return self.relay(resp, cached).await,
                Attempt::Retry(r) => r,
            };
            if !self.next_retry(&mut n).await {
                return fail;
            }
        }
    }

    fn prefill_failed(&self, ctx: &Ctx, r: Response<Body>, retry: bool) -> Attempt {
        self.shared.metrics.prefill_failures.inc();
        if retry {
            self.drop_cache(ctx, "prefill failed");
            Attempt::Retry(r)
        } else {
            Attempt::Done(r)
        }
    }

    async fn mooncake_attempt(
        &self,
        ctx: &Ctx,
        original: &Map<String, Value>,
        stale_retry_left: &mut bool,
    ) -> Attempt {
        loop {
            let (engines, from_cache) = match self.engines(ctx).await {
                Ok(e) => e,
                Err(r) => {
                    self.shared.metrics.prefill_failures.inc();
                    return Attempt::Retry(r);
                }
            };
            let (dp, engine_id) = engines.pick().clone();
            let transfer_id = format!(
                "xfer-{}",
                uuid::Builder::from_random_bytes(rand::random()).into_uuid()
            );
            // Each leg's map is serialized and dropped at once: with the original, the two
            // serialized bodies and one map being built, at most four copies are alive.
            let pbody = Self::json_bytes(&Self::prefill_body(
                original,
                json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer_id}),
            ));
            let dbody = {
                let mut d = original.clone();
                d.insert(
                    "kv_transfer_params".into(),
                    json!({"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": transfer_id,
                           "remote_bootstrap_addr": format!("http://{}", self.bootstrap_authority(ctx)),
                           "remote_engine_id": engine_id}),
                );
                Self::json_bytes(&d)
            };
            let prefill = self
                .prefill(ctx, pbody, Some(dp))
                .instrument(tracing::info_span!("prefill", %transfer_id, dp));
            let decode = self
                .decode(ctx, dbody)
                .instrument(tracing::info_span!("decode", %transfer_id));
            tokio::pin!(prefill);
            tokio::pin!(decode);
            let mut early = None;
            let p = loop {
                tokio::select! {
                    biased;
                    p = &mut prefill => break p,
                    d = &mut decode, if early.is_none() => early = Some(d),
                }
            };
            // On a failed prefill, returning drops `decode`, which cancels the decode leg.
            let a = match p {
                Ok(a) if a.status.is_success() => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    a
                }
                Ok(a) => {
                    self.shared.peers.reachable(PREFILL_ENGINE, &ctx.host_port);
                    tracing::warn!(status = %a.status, "prefill answered an error; decode cancelled");
                    let retry = a.retryable();
                    return self.prefill_failed(ctx, a.into_response(), retry);
                }
                Err(e) => {
                    self.log_prefill_failure(ctx, &e, "prefill failed; decode cancelled");
                    return self.prefill_failed(ctx, self.prefill_error(&e), true);
                }
            };
            let (_, cached) = Self::cached_tokens(&a);
            let d = match early {
                Some(d) => d,
                None => decode.await,
            };
            if d.is_ok() {
                self.shared.peers.reachable(DECODE_ENGINE, &self.decoder);
            }
            match d {
                Ok(resp) if resp.status().is_success() => return Attempt::Relay(resp, cached),
                Ok(resp) if from_cache && *stale_retry_left => {
                    // The cached engine id may be stale (the prefill engine restarted): look it
                    // up again once; nothing has reached the client yet.
                    *stale_retry_left = false;
                    tracing::info!(status = %resp.status(), "decode failed with a cached bootstrap entry; looking it up again");
                    self.drop_cache(ctx, "decode failed with a cached engine id");
                }
                Ok(resp) => {
                    self.shared.metrics.decode_errors.inc();
                    return Attempt::Done(self.relay(resp, None).await);
                }
                Err(e) => return Attempt::Done(self.decode_error(e)),
            }
        }
    }
}

/// Result of one mooncake attempt.
enum Attempt {
    Done(Response<Body>),
    /// Retry with a fresh bootstrap lookup (the failure is logged and counted already); the
    /// response is what the client gets if no retry is left.
    Retry(Response<Body>),
    /// Both legs succeeded: relay the decode response.
    Relay(Response<Incoming>, Option<u64>),
}

/// Per-request values the connector flows share.
struct Ctx {
    headers: HeaderMap,
    prefill_url: String,
    decode_url: String,
    host: String,
    host_port: String,
}
