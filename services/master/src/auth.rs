//! The pool token and the admin token at the master's two doors (docs/SECURITY.md).
//!
//! - gRPC: every call presents `authorization: Bearer <token>`. The pool token (or the admin
//!   token) admits any call but RemoveAll, which only the admin token admits when one is set.
//!   `grpc.health.v1` stays open for the kubelet's probes.
//! - Admin HTTP: the listings that reveal where objects live (`/query_key`,
//!   `/get_all_segments`, `/namespaces`) need the admin token (or the pool token when no admin
//!   token is set); `/metrics`, `/health`, `/role`, `/leader` stay open for Prometheus and probes.
//!
//! Nothing set: no check. The check sits in a tower layer in front of every service, so no
//! handler can forget it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

use lunakv_config::auth::{PoolTokens, Token};
use tonic::Status;

const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";
/// The calls that can wipe what others stored.
const ADMIN_RPCS: &[&str] = &[
    "/lunakv.master.v1.Master/RemoveAll",
    // One pattern can remove every key, as RemoveAll does.
    "/lunakv.master.v1.Master/RemoveByRegex",
];
/// Admin-port paths that reveal object locations or segment endpoints, or change the pool's
/// policy.
const GUARDED_HTTP: &[&str] = &[
    "/query_key",
    "/get_all_segments",
    "/namespaces",
    "/api/v1/tenant_quotas",
];

fn bearer(header: Option<&http::HeaderValue>) -> Option<&[u8]> {
    let v = header?.as_bytes();
    v.strip_prefix(b"Bearer ").or(Some(v))
}

fn any_matches(candidates: &[Option<&Token>], presented: Option<&[u8]>) -> bool {
    let Some(p) = presented else {
        return false;
    };
    candidates.iter().flatten().any(|t| t.matches(p))
}

/// Whether a gRPC call to `path` with `authorization` may proceed.
pub fn check_grpc(
    tokens: &PoolTokens,
    path: &str,
    authorization: Option<&http::HeaderValue>,
) -> Result<(), Status> {
    if tokens.is_empty() || path.starts_with(HEALTH_PREFIX) {
        return Ok(());
    }
    let presented = bearer(authorization);
    if ADMIN_RPCS.contains(&path) && tokens.admin.is_some() {
        if any_matches(&[tokens.admin.as_ref()], presented) {
            return Ok(());
        }
        let rpc = path.rsplit('/').next().unwrap_or(path);
        if presented.is_none() {
            return Err(Status::unauthenticated(format!(
                "{rpc} needs the pool's admin token: set LUNAKV_ADMIN_TOKEN (or \
                 LUNAKV_ADMIN_TOKEN_FILE) in this client's environment"
            )));
        }
        return Err(Status::permission_denied(format!(
            "{rpc} needs the pool's admin token: set LUNAKV_ADMIN_TOKEN (or \
             LUNAKV_ADMIN_TOKEN_FILE) in this client's environment"
        )));
    }
    if tokens.pool.is_none()
        || any_matches(&[tokens.pool.as_ref(), tokens.admin.as_ref()], presented)
    {
        return Ok(());
    }
    Err(Status::unauthenticated(if presented.is_some() {
        "lunakv-master refused this client's token: LUNAKV_AUTH_TOKEN (or LUNAKV_AUTH_TOKEN_FILE) \
         does not hold the pool's token"
    } else {
        "lunakv-master requires the pool token: set LUNAKV_AUTH_TOKEN (or \
         LUNAKV_AUTH_TOKEN_FILE) in this client's environment to the pool's token"
    }))
}

/// Whether an admin-port request for `path` with `authorization` may proceed; `Err` is the
/// body of a 401.
pub fn check_http(
    tokens: &PoolTokens,
    path: &str,
    authorization: Option<&http::HeaderValue>,
) -> Result<(), &'static str> {
    let need = tokens.admin.as_ref().or(tokens.pool.as_ref());
    let Some(need) = need else {
        return Ok(());
    };
    if !GUARDED_HTTP.contains(&path) || any_matches(&[Some(need)], bearer(authorization)) {
        return Ok(());
    }
    Err(
        "this route reveals where objects live or changes the pool's policy: send \
         `Authorization: Bearer <token>` with the pool's admin token (LUNAKV_ADMIN_TOKEN), or the \
         pool token when no admin token is set\n",
    )
}

/// The tower layer for the gRPC server.
#[derive(Clone)]
pub struct GrpcAuthLayer {
    tokens: Arc<PoolTokens>,
}

impl GrpcAuthLayer {
    pub fn new(tokens: Arc<PoolTokens>) -> GrpcAuthLayer {
        GrpcAuthLayer { tokens }
    }
}

impl<S> tower::Layer<S> for GrpcAuthLayer {
    type Service = GrpcAuth<S>;

    fn layer(&self, inner: S) -> GrpcAuth<S> {
        GrpcAuth {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GrpcAuth<S> {
    inner: S,
    tokens: Arc<PoolTokens>,
}

impl<S, B> tower::Service<http::Request<B>> for GrpcAuth<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match check_grpc(
            &self.tokens,
            req.uri().path(),
            req.headers().get(http::header::AUTHORIZATION),
        ) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(status) => {
                let resp = status.into_http();
                Box::pin(async move { Ok(resp) })
            }
        }
    }
}

/// axum middleware for the admin port.
pub async fn admin_http(
    tokens: Arc<PoolTokens>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match check_http(
        &tokens,
        req.uri().path(),
        req.headers().get(http::header::AUTHORIZATION),
    ) {
        Ok(()) => next.run(req).await,
        Err(body) => (http::StatusCode::UNAUTHORIZED, body).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(pool: Option<&str>, admin: Option<&str>) -> PoolTokens {
        let env = |k: &str| match k {
            "LUNAKV_AUTH_TOKEN" => pool.map(str::to_string),
            "LUNAKV_ADMIN_TOKEN" => admin.map(str::to_string),
            _ => None,
        };
        PoolTokens::from_env(&env).unwrap()
    }

    fn h(v: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(v).unwrap()
    }

    const POOL: &str = "pool-token-0123456789";
    const ADMIN: &str = "admin-token-0123456789";
    const PUT: &str = "/lunakv.master.v1.Master/PutStart";
    const RM_ALL: &str = "/lunakv.master.v1.Master/RemoveAll";

    #[test]
    fn grpc_calls_need_the_pool_token_and_remove_all_the_admin_token() {
        let open = tokens(None, None);
        assert!(check_grpc(&open, RM_ALL, None).is_ok());

        let t = tokens(Some(POOL), Some(ADMIN));
        let pool = h(&format!("Bearer {POOL}"));
        let admin = h(&format!("Bearer {ADMIN}"));
        assert_eq!(
            check_grpc(&t, PUT, None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(check_grpc(&t, PUT, Some(&h("Bearer wrong-token-0123456789"))).is_err());
        assert!(check_grpc(&t, PUT, Some(&pool)).is_ok());
        assert!(check_grpc(&t, PUT, Some(&admin)).is_ok());
        let e = check_grpc(&t, RM_ALL, Some(&pool)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("LUNAKV_ADMIN_TOKEN"),
            "{}",
            e.message()
        );
        assert!(check_grpc(&t, RM_ALL, Some(&admin)).is_ok());
        // A pattern can remove every key too.
        let by_regex = "/lunakv.master.v1.Master/RemoveByRegex";
        assert_eq!(
            check_grpc(&t, by_regex, Some(&pool)).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert!(check_grpc(&t, by_regex, Some(&admin)).is_ok());
        assert!(check_grpc(&t, "/grpc.health.v1.Health/Check", None).is_ok());

        // Only a pool token: RemoveAll takes it.
        let p = tokens(Some(POOL), None);
        assert!(check_grpc(&p, RM_ALL, Some(&pool)).is_ok());
        // Only an admin token: ordinary calls are open, RemoveAll is not.
        let a = tokens(None, Some(ADMIN));
        assert!(check_grpc(&a, PUT, None).is_ok());
        assert_eq!(
            check_grpc(&a, RM_ALL, None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }

    #[test]
    fn admin_listings_need_a_token_and_metrics_stay_open() {
        let t = tokens(Some(POOL), Some(ADMIN));
        assert!(check_http(&t, "/metrics", None).is_ok());
        assert!(check_http(&t, "/health", None).is_ok());
        assert!(check_http(&t, "/query_key", None).is_err());
        assert!(check_http(&t, "/query_key", Some(&h(&format!("Bearer {POOL}")))).is_err());
        assert!(check_http(&t, "/query_key", Some(&h(&format!("Bearer {ADMIN}")))).is_ok());
        let p = tokens(Some(POOL), None);
        assert!(check_http(&p, "/get_all_segments", Some(&h(&format!("Bearer {POOL}")))).is_ok());
        assert!(check_http(&tokens(None, None), "/query_key", None).is_ok());
    }
}
