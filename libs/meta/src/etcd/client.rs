//! [`EtcdClient`]: a small etcd v3 client (KV, transactions, leases, watches), every call
//! bounded by its timeout, TLS and an etcd user when etcd is secured ([`EtcdSecurity`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::pb;
use super::pb::KeyValue;
use super::pb::auth_client::AuthClient;
use super::pb::kv_client::KvClient;
use super::pb::lease_client::LeaseClient;
use super::pb::watch_client::WatchClient;
use super::txn::{cmp_version, first_kv, op_get, op_put};
use crate::MetaError;

/// TLS towards etcd: the CA that signed etcd's certificate and, when etcd runs with
/// `--client-cert-auth`, this client's certificate and key (all PEM).
#[derive(Clone)]
pub struct EtcdTls {
    pub ca_pem: Vec<u8>,
    /// `(certificate, key)`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Where the CA came from (a file path), for messages.
    pub ca_source: String,
}

/// An etcd user (etcd's `auth enable`): its name and password.
#[derive(Clone)]
pub struct EtcdAuth {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The password never reaches a log line.
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// How to reach a secured etcd. The default is plain http without a user, as on loopback.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    pub tls: Option<EtcdTls>,
    pub auth: Option<EtcdAuth>,
}

impl std::fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdSecurity")
            .field("tls", &self.tls.as_ref().map(|t| &t.ca_source))
            .field("auth", &self.auth)
            .finish()
    }
}

impl EtcdSecurity {
    /// From what `LUNAKV_ETCD_*` named ([`lunakv_config::EtcdCredentials`]).
    pub fn from_credentials(c: &lunakv_config::EtcdCredentials) -> EtcdSecurity {
        EtcdSecurity {
            tls: c.ca.as_ref().map(|(path, pem)| EtcdTls {
                ca_pem: pem.clone(),
                identity: c.identity.clone(),
                ca_source: path.display().to_string(),
            }),
            auth: c.user.as_ref().map(|(user, password)| EtcdAuth {
                user: user.clone(),
                password: password.clone(),
            }),
        }
    }

    /// Reads `LUNAKV_ETCD_*` through `env` (production passes
    /// [`lunakv_config::process_env`]).
    pub fn from_env(
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<EtcdSecurity, lunakv_config::ConfigError> {
        lunakv_config::EtcdCredentials::from_env(env).map(|c| EtcdSecurity::from_credentials(&c))
    }
}

/// Adds the current auth token (if any) to every call as etcd's `token` metadata.
#[derive(Clone, Default)]
struct TokenInterceptor {
    token: Arc<parking_lot::RwLock<Option<MetadataValue<Ascii>>>>,
}

impl Interceptor for TokenInterceptor {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = self.token.read().clone() {
            req.metadata_mut().insert("token", t);
        }
        Ok(req)
    }
}

type Svc = InterceptedService<Channel, TokenInterceptor>;

/// A connection to an etcd cluster (cheap to clone; clones share the channel and the token).
#[derive(Clone)]
pub struct EtcdClient {
    kv: KvClient<Svc>,
    lease: LeaseClient<Svc>,
    watch: WatchClient<Svc>,
    auth_rpc: AuthClient<Channel>,
    auth: Option<EtcdAuth>,
    token: TokenInterceptor,
    /// Serialises re-authentication so that a burst of calls with an expired token
    /// authenticates once.
    auth_lock: Arc<tokio::sync::Mutex<()>>,
    /// Added to transport failures: what this client's TLS settings suggest checking.
    transport_hint: &'static str,
    endpoints: Arc<str>,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClient")
            .field("endpoints", &self.endpoints)
            .finish()
    }
}

/// The smallest key greater than every key starting with `prefix` (etcd's range_end for a
/// prefix). An empty prefix means "every key", spelled `\0` in etcd.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// One change of a watched key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    Put(KeyValue),
    Delete(Vec<u8>),
}

/// A live watch. Dropping it cancels the watch (the request stream closes).
pub struct EtcdWatch {
    _keep_open: mpsc::Sender<pb::WatchRequest>,
    stream: tonic::Streaming<pb::WatchResponse>,
    endpoints: Arc<str>,
}

impl EtcdWatch {
    /// The next batch of events; `Err` when the stream broke (etcd down, compacted, cancelled):
    /// re-read the key and watch again.
    pub async fn next(&mut self) -> Result<Vec<WatchEvent>, MetaError> {
        loop {
            let msg = self
                .stream
                .message()
                .await
                .map_err(|s| backend_status("watch", &self.endpoints, &s))?;
            let Some(resp) = msg else {
                return Err(MetaError::Backend {
                    op: "watch",
                    message: format!("etcd at {} closed the watch stream", self.endpoints),
                });
            };
            if resp.canceled {
                return Err(MetaError::Backend {
                    op: "watch",
                    message: format!(
                        "etcd cancelled the watch (compact revision {}): {}",
                        resp.compact_revision, resp.cancel_reason
                    ),
                });
            }
            if resp.events.is_empty() {
                // The "created" confirmation or a progress notification.
                continue;
            }
            return Ok(resp
                .events
                .into_iter()
                .filter_map(|e| {
                    let kv = e.kv?;
                    Some(if e.r#type == pb::event::EventType::Delete as i32 {
                        WatchEvent::Delete(kv.key)
                    } else {
                        WatchEvent::Put(kv)
                    })
                })
                .collect());
        }
    }
}

/// What to check when a call fails in transport, given how this client was configured.
fn transport_hint(security: &EtcdSecurity) -> &'static str {
    match &security.tls {
        None => {
            "; if etcd serves https, set LUNAKV_ETCD_CACERT to the CA that signed its certificate"
        }
        Some(t) if t.identity.is_none() => {
            "; if etcd requires client certificates (--client-cert-auth), set LUNAKV_ETCD_CERT \
             and LUNAKV_ETCD_KEY"
        }
        Some(_) => "",
    }
}

fn backend_status(op: &'static str, endpoints: &str, s: &tonic::Status) -> MetaError {
    let msg = s.message();
    // etcd's own words for its auth refusals (etcdserver/api/v3rpc/rpctypes), each with the fix.
    let hint = if msg.contains("user name is empty") {
        "; etcd has authentication on: set LUNAKV_ETCD_USER and LUNAKV_ETCD_PASSWORD to an etcd \
         user whose role can read and write lunakv's keys"
    } else if msg.contains("authentication failed") {
        "; check LUNAKV_ETCD_USER and LUNAKV_ETCD_PASSWORD (etcdctl user get NAME shows the user)"
    } else if msg.contains("permission denied") {
        "; the etcd user's role lacks this key: grant it readwrite on lunakv's prefix \
         (etcdctl role grant-permission ROLE --prefix=true readwrite mooncake-store/)"
    } else {
        ""
    };
    // Transport failures (refused connection, TLS handshake) carry the cause in the source
    // chain, not in the message.
    let mut cause = String::new();
    let mut src = std::error::Error::source(s);
    while let Some(e) = src {
        cause = format!(": {e}");
        src = e.source();
    }
    let tls_hint = if cause.contains("certificate") || cause.contains("InvalidCertificate") {
        "; the TLS handshake failed: check LUNAKV_ETCD_CACERT (the CA that signed etcd's \
         certificate) and, when etcd requires client certificates, LUNAKV_ETCD_CERT and \
         LUNAKV_ETCD_KEY"
    } else if cause.contains("tls") || cause.contains("TLS") {
        "; the TLS handshake failed: an https etcd needs LUNAKV_ETCD_CACERT, a plain-http etcd \
         must not be given one"
    } else {
        ""
    };
    MetaError::Backend {
        op,
        message: format!(
            "etcd at {endpoints}: {:?}: {msg}{cause}{hint}{tls_hint}",
            s.code()
        ),
    }
}

/// A fresh future for one call of `method` on a clone of `client`: the generated methods borrow
/// the client mutably, so a retried call needs its own clone and its own copy of the request.
macro_rules! rpc {
    ($client:expr, $method:ident, $req:expr) => {{
        let mut c = $client.clone();
        let r = $req.clone();
        async move { c.$method(r).await }
    }};
}

/// etcd says the token is unknown or expired (`ErrGRPCInvalidAuthToken`).
fn token_rejected(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Unauthenticated || s.message().contains("invalid auth token")
}

impl EtcdClient {
    /// A client for `endpoints` (each `host:port` or `http://host:port`). Lazy: nothing is
    /// dialled until the first call; use [`EtcdClient::check`] to fail fast at startup.
    pub fn connect(endpoints: &[String], timeout: Duration) -> Result<EtcdClient, MetaError> {
        EtcdClient::connect_with(endpoints, timeout, &EtcdSecurity::default())
    }

    /// [`EtcdClient::connect`] to a secured etcd: over TLS when `security.tls` is set (plain
    /// `host:port` endpoints then mean `https://`), as `security.auth`'s user when set.
    pub fn connect_with(
        endpoints: &[String],
        timeout: Duration,
        security: &EtcdSecurity,
    ) -> Result<EtcdClient, MetaError> {
        let joined: Arc<str> = endpoints.join(";").into();
        let tls = match &security.tls {
            None => None,
            Some(t) => {
                let mut cfg =
                    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&t.ca_pem));
                if let Some((cert, key)) = &t.identity {
                    cfg = cfg.identity(Identity::from_pem(cert, key));
                }
                Some(cfg)
            }
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        if endpoints.is_empty() {
            return Err(MetaError::Open {
                location: "etcd".into(),
                message: "no etcd endpoints given: pass host:port, e.g. 127.0.0.1:2379".into(),
            });
        }
        let mut eps = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let uri = if e.contains("://") {
                e.clone()
            } else {
                format!("{scheme}://{e}")
            };
            if uri.starts_with("https://") && tls.is_none() {
                return Err(MetaError::Open {
                    location: format!("etcd {e}"),
                    message: "an https:// endpoint needs the CA that signed etcd's certificate: \
                              set LUNAKV_ETCD_CACERT"
                        .into(),
                });
            }
            let mut ep = Endpoint::from_shared(uri.clone()).map_err(|err| MetaError::Open {
                location: format!("etcd {e}"),
                message: format!("{err}: write the endpoint as host:port, e.g. 127.0.0.1:2379"),
            })?;
            if let Some(cfg) = &tls
                && uri.starts_with("https://")
            {
                ep = ep.tls_config(cfg.clone()).map_err(|err| MetaError::Open {
                    location: format!("etcd {e}"),
                    message: format!(
                        "TLS settings refused ({err}): check the PEM files named by \
                         LUNAKV_ETCD_CACERT, LUNAKV_ETCD_CERT and LUNAKV_ETCD_KEY"
                    ),
                })?;
            }
            let ep = ep
                .connect_timeout(timeout.min(Duration::from_secs(3)))
                .tcp_nodelay(true)
                // Keep-alive pings detect a dead etcd member on an idle watch stream. etcd
                // enforces a minimum ping interval (`--grpc-keepalive-min-time`, 5 s by
                // default) and, with no stream open, no pings at all: a client that pings more
                // often gets GOAWAY "too_many_pings" after two strikes, which broke every watch
                // about every 8 s. So ping at twice that minimum, and only
                // while a stream is open; calls are bounded by `timeout` anyway.
                .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(false);
            eps.push(ep);
        }
        let channel = if eps.len() == 1 {
            eps.remove(0).connect_lazy()
        } else {
            Channel::balance_list(eps.into_iter())
        };
        let token = TokenInterceptor::default();
        Ok(EtcdClient {
            kv: KvClient::with_interceptor(channel.clone(), token.clone()),
            lease: LeaseClient::with_interceptor(channel.clone(), token.clone()),
            watch: WatchClient::with_interceptor(channel.clone(), token.clone()),
            auth_rpc: AuthClient::new(channel),
            auth: security.auth.clone(),
            token,
            auth_lock: Arc::new(tokio::sync::Mutex::new(())),
            transport_hint: transport_hint(security),
            endpoints: joined,
            timeout,
        })
    }

    fn status_error(&self, op: &'static str, s: &tonic::Status) -> MetaError {
        let e = backend_status(op, &self.endpoints, s);
        let transport = matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
        );
        match e {
            MetaError::Backend { op, message } if transport && !message.contains("LUNAKV_ETCD") => {
                MetaError::Backend {
                    op,
                    message: format!("{message}{}", self.transport_hint),
                }
            }
            other => other,
        }
    }

    /// Authenticates as the configured user unless a token is already held (no-op without a
    /// user).
    async fn ensure_token(&self) -> Result<(), MetaError> {
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        if self.token.token.read().is_some() {
            return Ok(());
        }
        let _one = self.auth_lock.lock().await;
        if self.token.token.read().is_some() {
            return Ok(());
        }
        let req = pb::AuthenticateRequest {
            name: auth.user.clone(),
            password: auth.password.clone(),
        };
        let r = self
            .once("authenticate", self.auth_rpc.clone().authenticate(req))
            .await
            .map_err(|e| match e {
                MetaError::Backend { op, message } => MetaError::Backend {
                    op,
                    message: format!("as etcd user {:?}: {message}", auth.user),
                },
                other => other,
            })?;
        let value = MetadataValue::try_from(r.token.as_str()).map_err(|_| MetaError::Backend {
            op: "authenticate",
            message: format!(
                "etcd at {} returned a token that is not ASCII",
                self.endpoints
            ),
        })?;
        *self.token.token.write() = Some(value);
        Ok(())
    }

    /// One attempt, bounded by the timeout.
    pub(super) async fn once<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, MetaError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(self.status_error(op, &s)),
            Err(_) => Err(MetaError::Backend {
                op,
                message: format!(
                    "etcd at {} did not answer within {:?}",
                    self.endpoints, self.timeout
                ),
            }),
        }
    }

    /// The endpoints, `;`-separated, for messages.
    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// A call with the token in place; when etcd rejects the token (expired), authenticate
    /// again and make the call once more. `call` builds the request afresh for the retry.
    pub(super) async fn bounded<T, Fut>(
        &self,
        op: &'static str,
        mut call: impl FnMut() -> Fut,
    ) -> Result<T, MetaError>
    where
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.ensure_token().await?;
        let first = tokio::time::timeout(self.timeout, call()).await;
        if let Ok(Err(s)) = &first
            && self.auth.is_some()
            && token_rejected(s)
        {
            *self.token.token.write() = None;
            self.ensure_token().await?;
            return self.once(op, call()).await;
        }
        match first {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(self.status_error(op, &s)),
            Err(_) => Err(MetaError::Backend {
                op,
                message: format!(
                    "etcd at {} did not answer within {:?}",
                    self.endpoints, self.timeout
                ),
            }),
        }
    }

    /// One cheap read, to tell at startup whether etcd answers at all.
    pub async fn check(&self) -> Result<(), MetaError> {
        let req = pb::RangeRequest {
            key: b"lunakv-health-probe".to_vec(),
            count_only: true,
            ..Default::default()
        };
        match self.bounded("range", || rpc!(self.kv, range, req)).await {
            // etcd answered, and the user is authenticated: that its role cannot read this
            // probe key is not a failure (operators grant lunakv's prefix only).
            Err(MetaError::Backend { message, .. }) if message.contains("permission denied") => {
                Ok(())
            }
            other => other.map(|_| ()),
        }
    }

    /// The key-value at `key` (with its revisions and lease) and the store's revision.
    pub async fn get_kv(&self, key: &[u8]) -> Result<(Option<KeyValue>, i64), MetaError> {
        let req = pb::RangeRequest {
            key: key.to_vec(),
            ..Default::default()
        };
        let r = self.bounded("get", || rpc!(self.kv, range, req)).await?;
        let rev = r.header.map(|h| h.revision).unwrap_or_default();
        Ok((r.kvs.into_iter().next(), rev))
    }

    /// Every key-value whose key starts with `prefix`, in key order.
    pub async fn range_prefix(&self, prefix: &[u8]) -> Result<Vec<KeyValue>, MetaError> {
        let key = if prefix.is_empty() {
            vec![0]
        } else {
            prefix.to_vec()
        };
        let req = pb::RangeRequest {
            key,
            range_end: prefix_end(prefix),
            sort_order: pb::range_request::SortOrder::Ascend as i32,
            sort_target: pb::range_request::SortTarget::Key as i32,
            ..Default::default()
        };
        Ok(self
            .bounded("list_prefix", || rpc!(self.kv, range, req))
            .await?
            .kvs)
    }

    /// Sets `key`, attached to `lease` (0 = none).
    pub async fn put_kv(&self, key: &[u8], value: &[u8], lease: i64) -> Result<(), MetaError> {
        let req = pb::PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
            ..Default::default()
        };
        self.bounded("put", || rpc!(self.kv, put, req)).await?;
        Ok(())
    }

    /// Deletes `key`; whether it existed.
    pub async fn delete_kv(&self, key: &[u8]) -> Result<bool, MetaError> {
        let req = pb::DeleteRangeRequest {
            key: key.to_vec(),
            ..Default::default()
        };
        Ok(self
            .bounded("delete", || rpc!(self.kv, delete_range, req))
            .await?
            .deleted
            > 0)
    }

    /// A raw transaction.
    pub async fn txn(&self, req: pb::TxnRequest) -> Result<pb::TxnResponse, MetaError> {
        self.bounded("txn", || rpc!(self.kv, txn, req)).await
    }

    /// Creates `key` = `value` (attached to `lease`) only if it does not exist. `Ok(None)` when
    /// created, `Ok(Some(current))` when someone else holds it.
    pub async fn create_if_absent(
        &self,
        key: &[u8],
        value: &[u8],
        lease: i64,
    ) -> Result<Option<KeyValue>, MetaError> {
        let req = pb::TxnRequest {
            compare: vec![cmp_version(key, 0)],
            success: vec![op_put(key, value, lease)],
            failure: vec![op_get(key)],
        };
        let r = self.txn(req).await?;
        if r.succeeded {
            return Ok(None);
        }
        Ok(first_kv(r.responses))
    }

    /// Grants a lease of `ttl`; returns its id and the TTL etcd granted, in seconds.
    pub async fn lease_grant(&self, ttl: Duration) -> Result<(i64, i64), MetaError> {
        let req = pb::LeaseGrantRequest {
            ttl: ttl.as_secs().max(1) as i64,
            id: 0,
        };
        let r = self
            .bounded("lease_grant", || rpc!(self.lease, lease_grant, req))
            .await?;
        if !r.error.is_empty() {
            return Err(MetaError::Backend {
                op: "lease_grant",
                message: r.error,
            });
        }
        Ok((r.id, r.ttl))
    }

    /// Renews `lease` once; returns the TTL left in seconds, 0 when the lease has expired.
    pub async fn lease_keep_alive(&self, lease: i64) -> Result<i64, MetaError> {
        // One request per stream: a renewal every second or so does not need a long-lived
        // stream, and a fresh stream never carries a stale, half-broken connection state.
        let reqs = [pb::LeaseKeepAliveRequest { id: lease }];
        let mut stream = self
            .bounded("lease_keep_alive", || {
                let mut c = self.lease.clone();
                async move { c.lease_keep_alive(tokio_stream::iter(reqs)).await }
            })
            .await?;
        let msg = tokio::time::timeout(self.timeout, stream.message()).await;
        match msg {
            Ok(Ok(Some(r))) => Ok(r.ttl),
            Ok(Ok(None)) => Ok(0),
            Ok(Err(s)) => Err(self.status_error("lease_keep_alive", &s)),
            Err(_) => Err(MetaError::Backend {
                op: "lease_keep_alive",
                message: format!("etcd at {} did not answer in time", self.endpoints),
            }),
        }
    }

    /// Revokes `lease`, deleting every key attached to it.
    pub async fn lease_revoke(&self, lease: i64) -> Result<(), MetaError> {
        let req = pb::LeaseRevokeRequest { id: lease };
        self.bounded("lease_revoke", || rpc!(self.lease, lease_revoke, req))
            .await?;
        Ok(())
    }

    /// Watches `key` from `start_revision` (0 = from now).
    pub async fn watch_key(&self, key: &[u8], start_revision: i64) -> Result<EtcdWatch, MetaError> {
        let (tx, rx) = mpsc::channel(1);
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                pb::WatchCreateRequest {
                    key: key.to_vec(),
                    start_revision,
                    ..Default::default()
                },
            )),
        };
        tx.send(create).await.map_err(|_| MetaError::Backend {
            op: "watch",
            message: "watch request channel closed".into(),
        })?;
        // The request stream cannot be replayed, so a watch makes one attempt; its caller
        // re-watches on error, and the token is fresh by then.
        self.ensure_token().await?;
        let stream = self
            .once(
                "watch",
                self.watch
                    .clone()
                    .watch(tokio_stream::wrappers::ReceiverStream::new(rx)),
            )
            .await
            .inspect_err(|e| {
                let m = e.to_string();
                if m.contains("Unauthenticated") || m.contains("invalid auth token") {
                    *self.token.token.write() = None;
                }
            })?;
        Ok(EtcdWatch {
            _keep_open: tx,
            stream,
            endpoints: self.endpoints.clone(),
        })
    }
}

/// How often an etcd channel pings while a stream (a watch) is open: above etcd's default
/// `--grpc-keepalive-min-time` (5 s) with room for timer jitter, so etcd never counts a strike.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
