//! The pool token and the admin token at the master's two doors (docs/SECURITY.md).
//!
//! - gRPC: every call presents `authorization: Bearer <token>`. The pool token (or the admin
//!   token) admits any call but RemoveAll, which only the admin token admits when one is set.
//!   `grpc.health.v1` stays open for the kubelet's probes.
//! - Admin HTTP: the listings that reveal where objects live (`/query_key`,
//!   `/get_all_segments`, `/namespaces`, upstream's `/get_all_keys` and the like), the tenant
//!   API and `POST /api/v1/remove_all` need the admin token (or the pool token when no admin
//!   token is set; `GUARDED_HTTP`); `/metrics`, `/health`, `/role`, `/leader` stay open for
//!   Prometheus and probes.
//!   With `LUNAKV_ADMIN_TLS=1` the port serves HTTPS ([`crate::admin::tls`]) and a client
//!   certificate whose identity is in `LUNAKV_ADMIN_IDENTITIES` admits them too.
//!
//! - mTLS (`LUNAKV_TLS_CERT`, `LUNAKV_TLS_KEY`, `LUNAKV_TLS_CACERT`): the connection's client
//!   certificate names the caller ([`Peer::identity`]), which reaches the handlers as a
//!   [`Caller`]. The admin RPCs then need an identity in `LUNAKV_ADMIN_IDENTITIES` (or the admin
//!   token). With TLS on, a plaintext connection gets only `grpc.health.v1` (the kubelet's
//!   probes); every other call is refused naming the variables to set.
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

use lunakv_tls::Peer;

use crate::core::Caller;

const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";
/// The calls that can wipe what others stored, or read what only masters may.
const ADMIN_RPCS: &[&str] = &[
    "/lunakv.master.v1.Master/RemoveAll",
    // One pattern can remove every key, as RemoveAll does.
    "/lunakv.master.v1.Master/RemoveByRegex",
    // A standby's copy of the index carries every owner's mount secret.
    "/lunakv.master.v1.Master/ReplicateIndex",
    // An eviction control: it moves any engine's object out of DRAM now (and loses it where the
    // owner cannot write it to disk). `lunakv doctor` proves the SSD tier with it, as an admin.
    "/lunakv.master.v1.Master/OffloadKey",
];

/// The call that streams the index to a standby: it carries every store's mount secret, which
/// lets its holder forge the master's FREE and any capability. Unlike the other admin calls, the
/// pool token never admits it, even when no admin token is set: only an admin (the admin token,
/// or under mTLS an identity in `LUNAKV_ADMIN_IDENTITIES`) may call it, and masters call it as
/// admins ([`standby_credential_missing`]).
const REPLICATE_INDEX: &str = "/lunakv.master.v1.Master/ReplicateIndex";

/// The calls that open a segment to placements: under mTLS with `LUNAKV_MOUNT_IDENTITIES`, only
/// those identities may make them. Any other admitted caller could otherwise mount a segment of
/// its own, and new objects would be placed there: it would serve their bytes.
const MOUNT_RPCS: &[&str] = &[
    "/lunakv.master.v1.Master/MountSegment",
    "/lunakv.master.v1.Master/MountInventory",
];

/// What the RPC port's connections speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// Plaintext (no `LUNAKV_TLS_CERT`).
    #[default]
    Off,
    /// TLS, no client certificates asked (no `LUNAKV_TLS_CACERT`).
    On,
    /// TLS with a client certificate from the CA required: every caller has an identity.
    Mutual,
}

/// What the master's doors check: the tokens, TLS, and which client identities are admins.
#[derive(Debug, Default)]
pub struct AuthPolicy {
    pub tokens: PoolTokens,
    pub tls: TlsMode,
    /// `LUNAKV_ADMIN_IDENTITIES`.
    pub admin_identities: Vec<String>,
    /// `LUNAKV_MOUNT_IDENTITIES` (empty: any admitted caller may mount).
    pub mount_identities: Vec<String>,
}

impl AuthPolicy {
    /// Only tokens (as before TLS).
    pub fn tokens(tokens: PoolTokens) -> AuthPolicy {
        AuthPolicy {
            tokens,
            ..AuthPolicy::default()
        }
    }

    fn is_admin_identity(&self, identity: Option<&str>) -> bool {
        identity.is_some_and(|id| self.admin_identities.iter().any(|a| a == id))
    }
}

/// Admin-port paths that reveal object locations, keys or segment endpoints, or change the
/// pool's policy or contents (`/api/v1/remove_all`: the admin token when one is set, as the
/// RemoveAll RPC).
const GUARDED_HTTP: &[&str] = &[
    "/query_key",
    "/get_all_segments",
    "/namespaces",
    "/api/v1/tenant_quotas",
    "/get_all_keys",
    "/get_segments_detail",
    "/query_segment",
    "/batch_query_keys",
    "/api/v1/segments/status",
    "/api/v1/remove_all",
    "/api/v1/drain_jobs",
    "/api/v1/drain_jobs/query",
    "/api/v1/drain_jobs/cancel",
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

/// Whether a gRPC call to `path` with `authorization`, over the connection of `peer` (`None`:
/// plaintext), may proceed, and as which [`Caller`].
pub fn check_grpc(
    policy: &AuthPolicy,
    path: &str,
    authorization: Option<&http::HeaderValue>,
    peer: Option<&Peer>,
) -> Result<Caller, Status> {
    if path.starts_with(HEALTH_PREFIX) {
        return Ok(Caller::default());
    }
    let tokens = &policy.tokens;
    if policy.tls != TlsMode::Off && !peer.is_some_and(|p| p.tls) {
        return Err(lunakv_tls::grpc::plaintext_refusal(
            "lunakv-master",
            policy.tls == TlsMode::Mutual,
        ));
    }
    let identity = peer.and_then(|p| p.identity.clone());
    let presented = bearer(authorization);
    let admin_token = tokens.admin.is_some() && any_matches(&[tokens.admin.as_ref()], presented);
    let caller = Caller {
        admin: admin_token || policy.is_admin_identity(identity.as_deref()),
        identity,
        peer: peer.map(|p| p.addr.ip()),
    };
    let rpc = path.rsplit('/').next().unwrap_or(path);
    if ADMIN_RPCS.contains(&path)
        && let Some(id) = &caller.identity
        && !caller.admin
    {
        return Err(Status::permission_denied(format!(
            "{rpc} needs an admin identity: this client's certificate identity {id:?} is not one \
             of the master's LUNAKV_ADMIN_IDENTITIES; call it with a certificate whose CN is \
             listed there, or with the pool's admin token (LUNAKV_ADMIN_TOKEN)"
        )));
    }
    if MOUNT_RPCS.contains(&path)
        && !policy.mount_identities.is_empty()
        && let Some(id) = &caller.identity
        && !caller.admin
        && !policy.mount_identities.iter().any(|m| **m == **id)
    {
        return Err(Status::permission_denied(format!(
            "{rpc} needs a mount identity: this client's certificate identity {id:?} is not one              of the master's LUNAKV_MOUNT_IDENTITIES ({}); mount from a store-client's (or an              embedded engine's) certificate, or add this CN to that list",
            policy.mount_identities.join(",")
        )));
    }
    // Secrets exist once owners talk to the master over a private channel (a token, or TLS):
    // from then on, only an admin gets them.
    if path == REPLICATE_INDEX
        && !caller.admin
        && (!tokens.is_empty() || policy.tls != TlsMode::Off)
    {
        let holds_pool = any_matches(&[tokens.pool.as_ref()], presented);
        let msg = format!(
            "{rpc} streams every store's mount secret, so only an admin may call it (standby \
             masters call it as admins): present the pool's admin token (LUNAKV_ADMIN_TOKEN), or \
             under mTLS a certificate whose CN is in the master's LUNAKV_ADMIN_IDENTITIES{}",
            if holds_pool {
                "; the pool token does not admit it"
            } else {
                ""
            }
        );
        return Err(if holds_pool {
            Status::permission_denied(msg)
        } else {
            Status::unauthenticated(msg)
        });
    }
    if tokens.is_empty() {
        return Ok(caller);
    }
    if ADMIN_RPCS.contains(&path) && tokens.admin.is_some() && caller.identity.is_none() {
        if admin_token {
            return Ok(caller);
        }
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
        return Ok(caller);
    }
    Err(Status::unauthenticated(if presented.is_some() {
        "lunakv-master refused this client's token: LUNAKV_AUTH_TOKEN (or LUNAKV_AUTH_TOKEN_FILE) \
         does not hold the pool's token"
    } else {
        "lunakv-master requires the pool token: set LUNAKV_AUTH_TOKEN (or \
         LUNAKV_AUTH_TOKEN_FILE) in this client's environment to the pool's token"
    }))
}

/// Why standby masters could not follow their leader's `ReplicateIndex` under `policy`, if
/// they could not: with a pool token or TLS on, that call needs an admin credential, and a
/// master presents the admin token, or under mTLS its own certificate (an admin identity).
/// `None` where they can (or where nothing is checked).
pub fn standby_credential_missing(policy: &AuthPolicy) -> Option<String> {
    let secured = !policy.tokens.is_empty() || policy.tls != TlsMode::Off;
    let admin_identity = policy.tls == TlsMode::Mutual && !policy.admin_identities.is_empty();
    if !secured || policy.tokens.admin.is_some() || admin_identity {
        return None;
    }
    Some(
        "--ha_warm_standby: standby masters follow the leader's ReplicateIndex, which carries \
         every store's mount secret and so needs an admin credential, and this master has none \
         (the pool token never admits it): set LUNAKV_ADMIN_TOKEN (or LUNAKV_ADMIN_TOKEN_FILE) \
         on every master, or under mTLS list the masters' certificate CNs in \
         LUNAKV_ADMIN_IDENTITIES; or turn --ha_warm_standby off"
            .into(),
    )
}

/// What the admin HTTP port checks on its guarded routes.
#[derive(Debug, Default)]
pub struct AdminHttpPolicy {
    pub tokens: PoolTokens,
    /// `LUNAKV_ADMIN_IDENTITIES`.
    pub admin_identities: Vec<String>,
    /// The port serves HTTPS and asks for (optional) client certificates
    /// (`LUNAKV_ADMIN_TLS=1` with `LUNAKV_TLS_CACERT`): an admin identity admits, and with
    /// identities listed the guarded routes are closed to callers with neither.
    pub certificates: bool,
    /// The RPC port serves TLS (`LUNAKV_TLS_*`): the pool is not open, so its listings are not
    /// either, even without a token; a stranger who may not call GetReplicaList must not read
    /// the same locations off this port.
    pub secured: bool,
}

impl AdminHttpPolicy {
    /// Only tokens (a plaintext admin port).
    pub fn tokens(tokens: PoolTokens) -> AdminHttpPolicy {
        AdminHttpPolicy {
            tokens,
            ..AdminHttpPolicy::default()
        }
    }
}

/// Whether an admin-port request for `path` with `authorization`, from a caller whose client
/// certificate names `identity` (`None`: none presented, or plaintext), may proceed; `Err` is
/// the status (401 or 403) and a body that names what to send or set.
pub fn check_http(
    policy: &AdminHttpPolicy,
    path: &str,
    authorization: Option<&http::HeaderValue>,
    identity: Option<&str>,
) -> Result<(), (http::StatusCode, String)> {
    if !GUARDED_HTTP.contains(&path) {
        return Ok(());
    }
    let certs = policy.certificates && !policy.admin_identities.is_empty();
    if certs && identity.is_some_and(|id| policy.admin_identities.iter().any(|a| a == id)) {
        return Ok(());
    }
    let tokens = &policy.tokens;
    let need = tokens.admin.as_ref().or(tokens.pool.as_ref());
    match need {
        None if !certs && !policy.secured => return Ok(()),
        Some(t) if any_matches(&[Some(t)], bearer(authorization)) => return Ok(()),
        _ => {}
    }
    const WHY: &str =
        "this route reveals where objects live or changes the pool's policy or contents";
    let token = match need {
        Some(_) => {
            "send `Authorization: Bearer <token>` with the pool's admin token \
             (LUNAKV_ADMIN_TOKEN), or the pool token when no admin token is set"
        }
        None => "",
    };
    if let Some(id) = identity.filter(|_| certs) {
        let or = if token.is_empty() { "" } else { ", or " };
        return Err((
            http::StatusCode::FORBIDDEN,
            format!(
                "{WHY}: this client's certificate identity {id:?} is not one of the master's \
                 LUNAKV_ADMIN_IDENTITIES; call it with a certificate whose CN is listed there\
                 {or}{token}\n"
            ),
        ));
    }
    let cert = if certs {
        "present a client certificate from the pool's CA whose CN is in the master's \
         LUNAKV_ADMIN_IDENTITIES (LUNAKV_TLS_CERT, LUNAKV_TLS_KEY)"
    } else {
        ""
    };
    if cert.is_empty() && token.is_empty() {
        // TLS on the RPC port, and neither a token nor admin certificates here: nobody may
        // list until the operator configures one of them.
        return Err((
            http::StatusCode::UNAUTHORIZED,
            format!(
                "{WHY}, and this master's RPC port requires TLS while this port has no \
                 credential to check: set LUNAKV_ADMIN_TOKEN on the master and send \
                 `Authorization: Bearer <token>`, or serve this port as HTTPS \
                 (LUNAKV_ADMIN_TLS=1) and call it with a certificate whose CN is in \
                 LUNAKV_ADMIN_IDENTITIES\n"
            ),
        ));
    }
    let or = if !cert.is_empty() && !token.is_empty() {
        ", or "
    } else {
        ""
    };
    Err((
        http::StatusCode::UNAUTHORIZED,
        format!("{WHY}: {cert}{or}{token}\n"),
    ))
}

/// The tower layer for the gRPC server.
#[derive(Clone)]
pub struct GrpcAuthLayer {
    policy: Arc<AuthPolicy>,
}

impl GrpcAuthLayer {
    pub fn new(policy: Arc<AuthPolicy>) -> GrpcAuthLayer {
        GrpcAuthLayer { policy }
    }
}

impl<S> tower::Layer<S> for GrpcAuthLayer {
    type Service = GrpcAuth<S>;

    fn layer(&self, inner: S) -> GrpcAuth<S> {
        GrpcAuth {
            inner,
            policy: self.policy.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GrpcAuth<S> {
    inner: S,
    policy: Arc<AuthPolicy>,
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

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match check_grpc(
            &self.policy,
            req.uri().path(),
            req.headers().get(http::header::AUTHORIZATION),
            req.extensions().get::<Peer>(),
        ) {
            Ok(caller) => {
                req.extensions_mut().insert(caller);
                Box::pin(self.inner.call(req))
            }
            Err(status) => {
                let resp = status.into_http();
                Box::pin(async move { Ok(resp) })
            }
        }
    }
}

/// axum middleware for the admin port; under HTTPS the caller's certificate identity comes
/// from the connection ([`crate::admin::tls::AdminPeer`]).
pub async fn admin_http(
    policy: Arc<AdminHttpPolicy>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let identity = req
        .extensions()
        .get::<axum::extract::ConnectInfo<crate::admin::tls::AdminPeer>>()
        .and_then(|c| c.0.0.identity.clone());
    match check_http(
        &policy,
        req.uri().path(),
        req.headers().get(http::header::AUTHORIZATION),
        identity.as_deref(),
    ) {
        Ok(()) => next.run(req).await,
        Err((status, body)) => (status, body).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_tokens(pool: Option<&str>, admin: Option<&str>) -> PoolTokens {
        let env = |k: &str| match k {
            "LUNAKV_AUTH_TOKEN" => pool.map(str::to_string),
            "LUNAKV_ADMIN_TOKEN" => admin.map(str::to_string),
            _ => None,
        };
        PoolTokens::from_env(&env).unwrap()
    }

    fn tokens(pool: Option<&str>, admin: Option<&str>) -> AuthPolicy {
        AuthPolicy::tokens(pool_tokens(pool, admin))
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
        assert!(check_grpc(&open, RM_ALL, None, None).is_ok());

        let t = tokens(Some(POOL), Some(ADMIN));
        let pool = h(&format!("Bearer {POOL}"));
        let admin = h(&format!("Bearer {ADMIN}"));
        assert_eq!(
            check_grpc(&t, PUT, None, None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(check_grpc(&t, PUT, Some(&h("Bearer wrong-token-0123456789")), None).is_err());
        assert!(check_grpc(&t, PUT, Some(&pool), None).is_ok());
        assert!(check_grpc(&t, PUT, Some(&admin), None).is_ok());
        let e = check_grpc(&t, RM_ALL, Some(&pool), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("LUNAKV_ADMIN_TOKEN"),
            "{}",
            e.message()
        );
        assert!(check_grpc(&t, RM_ALL, Some(&admin), None).is_ok());
        // A pattern can remove every key too.
        let by_regex = "/lunakv.master.v1.Master/RemoveByRegex";
        assert_eq!(
            check_grpc(&t, by_regex, Some(&pool), None)
                .unwrap_err()
                .code(),
            tonic::Code::PermissionDenied
        );
        assert!(check_grpc(&t, by_regex, Some(&admin), None).is_ok());
        assert!(check_grpc(&t, "/grpc.health.v1.Health/Check", None, None).is_ok());

        // Only a pool token: RemoveAll takes it.
        let p = tokens(Some(POOL), None);
        assert!(check_grpc(&p, RM_ALL, Some(&pool), None).is_ok());
        // Only an admin token: ordinary calls are open, RemoveAll is not.
        let a = tokens(None, Some(ADMIN));
        assert!(check_grpc(&a, PUT, None, None).is_ok());
        assert_eq!(
            check_grpc(&a, RM_ALL, None, None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }

    /// The index stream carries every store's mount secret; a pool-token
    /// holder gets it in no configuration, while the admin token and admin identities do.
    #[test]
    fn replicate_index_needs_an_admin_credential_in_every_secured_mode() {
        const REPL: &str = "/lunakv.master.v1.Master/ReplicateIndex";
        let pool = h(&format!("Bearer {POOL}"));
        let admin = h(&format!("Bearer {ADMIN}"));
        // Only a pool token: RemoveAll takes it, ReplicateIndex does not.
        let p = tokens(Some(POOL), None);
        let e = check_grpc(&p, REPL, Some(&pool), None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("LUNAKV_ADMIN_TOKEN"),
            "{}",
            e.message()
        );
        assert_eq!(
            check_grpc(&p, REPL, None, None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(
            standby_credential_missing(&p)
                .unwrap()
                .contains("LUNAKV_ADMIN_TOKEN")
        );
        // Both tokens: the admin token admits it.
        let t = tokens(Some(POOL), Some(ADMIN));
        assert!(check_grpc(&t, REPL, Some(&pool), None).is_err());
        assert!(check_grpc(&t, REPL, Some(&admin), None).is_ok());
        assert!(standby_credential_missing(&t).is_none());
        // TLS without client certificates and no token: nobody is an admin.
        let tls = AuthPolicy {
            tls: TlsMode::On,
            ..AuthPolicy::default()
        };
        let plain_tls = Peer {
            addr: "127.0.0.1:1".parse().unwrap(),
            tls: true,
            identity: None,
        };
        assert!(check_grpc(&tls, REPL, None, Some(&plain_tls)).is_err());
        assert!(check_grpc(&tls, PUT, None, Some(&plain_tls)).is_ok());
        assert!(standby_credential_missing(&tls).is_some());
        // mTLS: an admin identity (a master's own certificate) admits it, another does not.
        let mtls = AuthPolicy {
            tls: TlsMode::Mutual,
            admin_identities: vec!["lunakv-master".into()],
            tokens: pool_tokens(Some(POOL), None),
            ..AuthPolicy::default()
        };
        let conn = |id: &str| Peer {
            addr: "127.0.0.1:1".parse().unwrap(),
            tls: true,
            identity: Some(Arc::from(id)),
        };
        assert!(check_grpc(&mtls, REPL, Some(&pool), Some(&conn("lunakv-master"))).is_ok());
        assert_eq!(
            check_grpc(&mtls, REPL, Some(&pool), Some(&conn("lunakv-engine")))
                .unwrap_err()
                .code(),
            tonic::Code::PermissionDenied
        );
        assert!(standby_credential_missing(&mtls).is_none());
        // Nothing set: nothing is checked, and owners draw no secrets.
        let open = tokens(None, None);
        assert!(check_grpc(&open, REPL, None, None).is_ok());
        assert!(standby_credential_missing(&open).is_none());
    }

    #[test]
    fn under_mtls_identities_name_callers_and_admin_rpcs_need_an_admin_identity() {
        let mtls = AuthPolicy {
            tls: TlsMode::Mutual,
            admin_identities: vec!["ops".into()],
            ..AuthPolicy::default()
        };
        let conn = |id: &str| Peer {
            addr: "127.0.0.1:1".parse().unwrap(),
            tls: true,
            identity: Some(Arc::from(id)),
        };
        // Plaintext gets the health service only, and a refusal that names the variables.
        assert!(check_grpc(&mtls, "/grpc.health.v1.Health/Check", None, None).is_ok());
        let e = check_grpc(&mtls, PUT, None, None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("LUNAKV_TLS_CERT"), "{}", e.message());
        let c = check_grpc(&mtls, PUT, None, Some(&conn("alice"))).unwrap();
        assert_eq!(c.identity.as_deref(), Some("alice"));
        assert!(!c.admin);
        let e = check_grpc(&mtls, RM_ALL, None, Some(&conn("alice"))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("\"alice\"") && e.message().contains("LUNAKV_ADMIN_IDENTITIES"),
            "{}",
            e.message()
        );
        let c = check_grpc(&mtls, RM_ALL, None, Some(&conn("ops"))).unwrap();
        assert!(c.admin && c.overrides_owners());
        // Eviction controls are admin calls too.
        const OFFLOAD: &str = "/lunakv.master.v1.Master/OffloadKey";
        let e = check_grpc(&mtls, OFFLOAD, None, Some(&conn("alice"))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(check_grpc(&mtls, OFFLOAD, None, Some(&conn("ops"))).is_ok());
        // The admin token keeps working under mTLS.
        let both = AuthPolicy {
            tokens: pool_tokens(Some(POOL), Some(ADMIN)),
            ..mtls
        };
        let admin = h(&format!("Bearer {ADMIN}"));
        assert!(check_grpc(&both, RM_ALL, Some(&admin), Some(&conn("alice"))).is_ok());
        let pool = h(&format!("Bearer {POOL}"));
        assert!(check_grpc(&both, RM_ALL, Some(&pool), Some(&conn("alice"))).is_err());
        assert!(check_grpc(&both, RM_ALL, Some(&pool), Some(&conn("ops"))).is_ok());
        assert!(
            check_grpc(&both, PUT, None, Some(&conn("ops"))).is_err(),
            "an admin identity still needs the pool token where one is set"
        );
    }

    #[test]
    fn with_mount_identities_only_those_identities_and_admins_mount() {
        let conn = |id: &str| Peer {
            addr: "127.0.0.1:1".parse().unwrap(),
            tls: true,
            identity: Some(Arc::from(id)),
        };
        const MOUNT: &str = "/lunakv.master.v1.Master/MountSegment";
        const MORE: &str = "/lunakv.master.v1.Master/MountInventory";
        let open = AuthPolicy {
            tls: TlsMode::Mutual,
            ..AuthPolicy::default()
        };
        assert!(check_grpc(&open, MOUNT, None, Some(&conn("engine"))).is_ok());
        let closed = AuthPolicy {
            admin_identities: vec!["ops".into()],
            mount_identities: vec!["lunakv-store".into()],
            ..open
        };
        assert!(check_grpc(&closed, MOUNT, None, Some(&conn("lunakv-store"))).is_ok());
        assert!(check_grpc(&closed, MOUNT, None, Some(&conn("ops"))).is_ok());
        for rpc in [MOUNT, MORE] {
            let e = check_grpc(&closed, rpc, None, Some(&conn("lunakv-engine"))).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied);
            assert!(
                e.message().contains("\"lunakv-engine\"")
                    && e.message().contains("LUNAKV_MOUNT_IDENTITIES"),
                "{}",
                e.message()
            );
        }
        // Other calls of that identity are not affected.
        assert!(check_grpc(&closed, PUT, None, Some(&conn("lunakv-engine"))).is_ok());
    }

    #[test]
    fn admin_listings_need_a_token_and_metrics_stay_open() {
        let t = AdminHttpPolicy::tokens(pool_tokens(Some(POOL), Some(ADMIN)));
        assert!(check_http(&t, "/metrics", None, None).is_ok());
        assert!(check_http(&t, "/health", None, None).is_ok());
        assert!(check_http(&t, "/query_key", None, None).is_err());
        let pool = h(&format!("Bearer {POOL}"));
        let admin = h(&format!("Bearer {ADMIN}"));
        assert!(check_http(&t, "/query_key", Some(&pool), None).is_err());
        assert!(check_http(&t, "/query_key", Some(&admin), None).is_ok());
        // Upstream's listings, remove_all and drain jobs: the same guard; its counters stay open.
        for path in [
            "/get_all_keys",
            "/get_segments_detail",
            "/query_segment",
            "/batch_query_keys",
            "/api/v1/segments/status",
            "/api/v1/remove_all",
            "/api/v1/drain_jobs",
            "/api/v1/drain_jobs/query",
            "/api/v1/drain_jobs/cancel",
        ] {
            assert_eq!(
                check_http(&t, path, None, None).unwrap_err().0,
                http::StatusCode::UNAUTHORIZED,
                "{path}"
            );
            assert!(check_http(&t, path, Some(&pool), None).is_err(), "{path}");
            assert!(check_http(&t, path, Some(&admin), None).is_ok(), "{path}");
        }
        assert!(check_http(&t, "/kv_events/status", None, None).is_ok());
        let p = AdminHttpPolicy::tokens(pool_tokens(Some(POOL), None));
        assert!(check_http(&p, "/get_all_segments", Some(&pool), None).is_ok());
        let open = AdminHttpPolicy::tokens(pool_tokens(None, None));
        assert!(check_http(&open, "/query_key", None, None).is_ok());
        // Without client certificates on the port, an identity counts for nothing.
        let plain = AdminHttpPolicy {
            admin_identities: vec!["ops".into()],
            ..AdminHttpPolicy::tokens(pool_tokens(None, Some(ADMIN)))
        };
        assert!(check_http(&plain, "/query_key", None, Some("ops")).is_err());
    }

    /// Under (m)TLS without a token, the listings used to answer anyone on
    /// the plaintext admin port; they need a credential in every secured mode.
    #[test]
    fn with_tls_on_the_rpc_port_the_listings_are_never_open() {
        let mtls_plain = AdminHttpPolicy {
            admin_identities: vec!["ops".into()],
            secured: true,
            ..AdminHttpPolicy::default()
        };
        let (code, body) = check_http(&mtls_plain, "/query_key", None, None).unwrap_err();
        assert_eq!(code, http::StatusCode::UNAUTHORIZED);
        assert!(
            body.contains("LUNAKV_ADMIN_TOKEN") && body.contains("LUNAKV_ADMIN_TLS"),
            "{body}"
        );
        assert!(check_http(&mtls_plain, "/get_all_segments", None, Some("ops")).is_err());
        assert!(check_http(&mtls_plain, "/metrics", None, None).is_ok());
        assert!(check_http(&mtls_plain, "/health", None, None).is_ok());
        // HTTPS with optional client certificates but no admin identity listed: still closed.
        let https_no_admins = AdminHttpPolicy {
            certificates: true,
            secured: true,
            ..AdminHttpPolicy::default()
        };
        assert!(check_http(&https_no_admins, "/namespaces", None, Some("alice")).is_err());
        // A token admits as before.
        let with_token = AdminHttpPolicy {
            tokens: pool_tokens(None, Some(ADMIN)),
            ..mtls_plain
        };
        let admin = h(&format!("Bearer {ADMIN}"));
        assert!(check_http(&with_token, "/query_key", Some(&admin), None).is_ok());
    }

    #[test]
    fn under_admin_tls_an_admin_identity_admits_the_listings() {
        let certs = AdminHttpPolicy {
            admin_identities: vec!["ops".into()],
            certificates: true,
            ..AdminHttpPolicy::default()
        };
        assert!(check_http(&certs, "/metrics", None, None).is_ok());
        assert!(check_http(&certs, "/role", None, None).is_ok());
        let (code, body) = check_http(&certs, "/query_key", None, None).unwrap_err();
        assert_eq!(code, http::StatusCode::UNAUTHORIZED);
        assert!(body.contains("LUNAKV_ADMIN_IDENTITIES"), "{body}");
        assert!(check_http(&certs, "/query_key", None, Some("ops")).is_ok());
        let (code, body) = check_http(&certs, "/namespaces", None, Some("alice")).unwrap_err();
        assert_eq!(code, http::StatusCode::FORBIDDEN);
        assert!(
            body.contains("\"alice\"") && body.contains("LUNAKV_ADMIN_IDENTITIES"),
            "{body}"
        );
        // The admin token keeps working, and is named.
        let both = AdminHttpPolicy {
            tokens: pool_tokens(Some(POOL), Some(ADMIN)),
            ..certs
        };
        let admin = h(&format!("Bearer {ADMIN}"));
        assert!(check_http(&both, "/query_key", Some(&admin), Some("alice")).is_ok());
        assert!(check_http(&both, "/query_key", Some(&admin), None).is_ok());
        let (_, body) = check_http(&both, "/query_key", None, None).unwrap_err();
        assert!(
            body.contains("LUNAKV_ADMIN_TOKEN") && body.contains("LUNAKV_ADMIN_IDENTITIES"),
            "{body}"
        );
    }
}
