//! Wiring: opens the MetaStore, builds the core, binds (or takes) the listeners, prints the
//! `listening` line, runs gRPC + admin HTTP + background tasks, and drains on shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lunakv_config::master::MasterConfig;
use lunakv_meta::{
    EtcdClient, EtcdMetaStore, EtcdSecurity, MetaError, MetaStore, Prefixed, RedbMetaStore,
    WriteFence, layout,
};
use lunakv_proto::master::master_server::MasterServer;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::admin::tenants::{PolicyFile, TenantAdmin};
use crate::auth::{AuthPolicy, TlsMode};
use crate::core::{CoreConfig, MasterCore};
use crate::events::publisher::{EventsError, Publisher};
use crate::events::{EventSink, EventStats, EventsConfig};
use crate::ha::election::{Election, HaState};
use crate::ha::recovery::{RECOVERY_GRACE, RecoveryGate};
use crate::notifier::{OwnerClient, TransferOwnerClient};
use crate::persist::{self, PersistError};
use crate::rpc::service::MasterService;
use crate::slot::CoreSlot;
use lunakv_config::auth::PoolTokens;
use std::collections::BTreeSet;

/// File name of the embedded metadata store inside `data_dir`.
pub const META_FILE: &str = "meta.redb";

/// How long in-flight requests get to finish after a shutdown signal.
pub const DRAIN_GRACE: Duration = Duration::from_secs(10);

/// Why the master could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "cannot bind the {what} listener on {addr}: {source}; pick a free port or another address"
    )]
    Bind {
        what: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error("the {what} server failed: {message}")]
    Server { what: &'static str, message: String },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Events(#[from] EventsError),
    #[error(transparent)]
    Tenants(#[from] crate::admin::tenants::PolicyError),
    #[error(
        "cannot reach etcd at {endpoints}: {message}; check --etcd_endpoints (\";\"-separated \
         host:port of etcd's client URLs) and that etcd is running"
    )]
    Etcd { endpoints: String, message: String },
}

/// The two listeners of a master. Bind them yourself (tests: port 0) or with [`Listeners::bind`].
#[derive(Debug)]
pub struct Listeners {
    pub rpc: TcpListener,
    pub admin: TcpListener,
}

impl Listeners {
    /// Binds `rpc_address:rpc_port` and `metrics_host:metrics_port` (default `rpc_address`)
    /// exactly (no wildcard unless configured).
    pub async fn bind(cfg: &MasterConfig) -> Result<Listeners, ServeError> {
        let bind = |what: &'static str, host: &str, port: u16| {
            let host = host.to_string();
            let addr = format!("{host}:{port}");
            async move {
                let a: SocketAddr = (
                    host.parse::<std::net::IpAddr>()
                        .map_err(|e| ServeError::Bind {
                            what,
                            addr: addr.clone(),
                            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
                        })?,
                    port,
                )
                    .into();
                TcpListener::bind(a)
                    .await
                    .map_err(|source| ServeError::Bind { what, addr, source })
            }
        };
        Ok(Listeners {
            rpc: bind("rpc", &cfg.rpc_address, cfg.rpc_port).await?,
            admin: bind(
                "admin/metrics",
                cfg.metrics_bind_address(),
                cfg.metrics_port,
            )
            .await?,
        })
    }
}

/// A master whose state is open but which does not serve yet.
pub struct Master {
    cfg: MasterConfig,
    slot: Arc<CoreSlot>,
    meta: Arc<dyn MetaStore>,
    tick: Duration,
    ha: Option<HaSetup>,
    /// A single master's rebuild window, and the segments it waits for.
    recovery: Arc<RecoveryGate>,
    known: BTreeSet<String>,
    /// The KV event publisher (`enable_kv_event_publish`); one per process, fed by each core.
    events: Option<Arc<Publisher>>,
    /// The tenant quota policy (`enable_multi_tenants`), shared by every core's config.
    tenants: Option<Arc<TenantAdmin>>,
    /// The pool and admin tokens callers must present (from the environment).
    tokens: Arc<PoolTokens>,
}

/// The tokens this master enforces (docs/SECURITY.md).
fn pool_tokens() -> Result<Arc<PoolTokens>, ServeError> {
    PoolTokens::from_env(&lunakv_config::process_env)
        .map(Arc::new)
        .map_err(|e| ServeError::Config(e.to_string()))
}

/// Placement proofs: every master issues them under the cluster's key (kept in `meta`), and
/// one that admits only known callers (a pool token, or mTLS: `LUNAKV_TLS_CACERT` beside its
/// certificate) indexes only proven inventory items (docs/SECURITY.md, "Verified
/// inventories"). Without either, any caller may mount anything, and nothing is checked.
async fn placement_proofs(
    core_cfg: &mut CoreConfig,
    meta: &dyn MetaStore,
    tokens: &PoolTokens,
) -> Result<(), ServeError> {
    let mtls = lunakv_config::tls::TlsPaths::server_from_env(&lunakv_config::process_env)
        .map_err(|e| ServeError::Config(e.to_string()))?
        .requires_client_certificates();
    core_cfg.inventory_key = Some(persist::inventory_key(meta).await?);
    core_cfg.verify_inventories = tokens.pool.is_some() || mtls;
    Ok(())
}

/// Loads the tenant quota policy into `core_cfg` when multi-tenant mode is on.
fn load_tenants(
    cfg: &MasterConfig,
    core_cfg: &CoreConfig,
) -> Result<Option<Arc<TenantAdmin>>, ServeError> {
    if !cfg.enable_multi_tenants {
        return Ok(None);
    }
    let admin = TenantAdmin::load(
        PolicyFile::new(cfg.tenant_quota_connector_uri.trim()),
        core_cfg.quotas.clone(),
    )?;
    tracing::info!(
        policy = %admin.file().path().display(),
        tenants = core_cfg.quotas.read().len(),
        "multi-tenant mode: puts are admitted against each tenant's quota"
    );
    Ok(Some(Arc::new(admin)))
}

/// Starts the KV event publisher when the config asks for it.
fn start_events(cfg: &MasterConfig) -> Result<Option<Arc<Publisher>>, ServeError> {
    let Some(ec) = EventsConfig::from_master(cfg) else {
        return Ok(None);
    };
    // Which forms go out: a subscriber that cannot decode them asks this line first.
    let (mooncake_format, vllm_format) = (ec.mooncake_format, ec.vllm_wire.format);
    let p = Publisher::start(ec, Arc::new(EventStats::new()))?;
    tracing::info!(endpoints = ?p.endpoints(), ?mooncake_format, ?vllm_format, "publishing KV events");
    Ok(Some(Arc::new(p)))
}

/// What an HA master adds: the etcd client, the unfenced cluster namespace (election, epoch),
/// the fence of its writes, and what a new term's core is built from.
struct HaSetup {
    state: Arc<HaState>,
    etcd: EtcdClient,
    election_meta: Arc<dyn MetaStore>,
    fence: Arc<WriteFence>,
    core_cfg: CoreConfig,
    notifier: Arc<dyn OwnerClient>,
    events: Option<EventSink>,
}

impl Master {
    /// Opens `data_dir/meta.redb`, checks the cluster id, bumps the epoch; frees go to owners
    /// through the transfer library.
    pub async fn open(cfg: MasterConfig) -> Result<Master, ServeError> {
        if cfg.enable_ha {
            return Master::open_ha(cfg, Arc::new(TransferOwnerClient::new())).await;
        }
        let path: PathBuf = cfg.data_dir.join(META_FILE);
        let meta = tokio::task::spawn_blocking(move || RedbMetaStore::open(path))
            .await
            .map_err(|e| ServeError::Server {
                what: "meta store",
                message: e.to_string(),
            })??;
        Master::open_with(cfg, Arc::new(meta), Arc::new(TransferOwnerClient::new())).await
    }

    /// Like [`Master::open`] with an explicit store and notifier.
    pub async fn open_with(
        cfg: MasterConfig,
        meta: Arc<dyn MetaStore>,
        notifier: Arc<dyn OwnerClient>,
    ) -> Result<Master, ServeError> {
        let core_cfg = CoreConfig::from_master(&cfg);
        Master::with_core_config(cfg, core_cfg, meta, notifier).await
    }

    /// Full control: the core's durations may be shorter than the config's whole seconds
    /// (tests use milliseconds).
    pub async fn with_core_config(
        cfg: MasterConfig,
        mut core_cfg: CoreConfig,
        meta: Arc<dyn MetaStore>,
        notifier: Arc<dyn OwnerClient>,
    ) -> Result<Master, ServeError> {
        let tokens = pool_tokens()?;
        persist::check_cluster_id(
            meta.as_ref(),
            &cfg.cluster_id,
            &cfg.data_dir.display().to_string(),
        )
        .await?;
        let epoch = persist::bump_epoch(meta.as_ref()).await?;
        placement_proofs(&mut core_cfg, meta.as_ref(), &tokens).await?;
        let known = persist::known_segments(meta.as_ref()).await?;
        tracing::info!(
            epoch,
            cluster_id = %cfg.cluster_id,
            known_segments = known.len(),
            "master state opened; owners remount with their inventories on their next ping"
        );
        let events = start_events(&cfg)?;
        let tenants = load_tenants(&cfg, &core_cfg)?;
        let core = Arc::new(
            MasterCore::new(core_cfg, epoch, notifier)
                .with_events(events.as_ref().map(|p| p.sink())),
        );
        // Until the owners remounted, "not found" would be a lie: object RPCs answer
        // UNAVAILABLE (rebuilding) and clients retry (docs/HA.md).
        let known: BTreeSet<String> = known.into_iter().map(|d| d.name).collect();
        let recovery = Arc::new(RecoveryGate::default());
        recovery.begin(known.clone(), RECOVERY_GRACE);
        Ok(Master {
            cfg,
            slot: CoreSlot::new(core),
            meta,
            tick: Duration::from_millis(100),
            ha: None,
            recovery,
            known,
            events,
            tenants,
            tokens,
        })
    }

    /// An HA master (`enable_ha`): checks that etcd answers (an unreachable etcd at startup is
    /// an error that names the endpoints), then starts as a follower; the election loop starts
    /// with [`Master::run`]. Cluster facts live in etcd under `mooncake-store/<cluster_id>/`.
    pub async fn open_ha(
        cfg: MasterConfig,
        notifier: Arc<dyn OwnerClient>,
    ) -> Result<Master, ServeError> {
        let endpoints = cfg.etcd().map_err(|e| ServeError::Config(e.to_string()))?;
        let security = EtcdSecurity::from_env(&lunakv_config::process_env)
            .map_err(|e| ServeError::Config(e.to_string()))?;
        let etcd = EtcdClient::connect_with(
            &endpoints.to_strings(),
            crate::ha::election::ETCD_CALL_TIMEOUT,
            &security,
        )
        .map_err(|e| ServeError::Etcd {
            endpoints: endpoints.to_string(),
            message: e.to_string(),
        })?;
        // etcd not up yet is what a rolling start looks like: wait for it (one WARN, then one
        // every 30 s) instead of exiting into a crash loop. The endpoints parsed, so nothing
        // here is a configuration error.
        let mut waiting = lunakv_telemetry::wait::PeerWait::new(
            format!("etcd at {endpoints}"),
            "(--etcd_endpoints) to campaign for leadership",
        );
        while let Err(e) = etcd.check().await {
            waiting.retry_after(&e).await;
        }
        waiting.reached();
        let prefix = layout::cluster_prefix(&cfg.cluster_id);
        let election_meta: Arc<dyn MetaStore> = Arc::new(Prefixed::new(
            Arc::new(EtcdMetaStore::new(etcd.clone())),
            prefix.clone(),
        ));
        // Closed until this master wins: a follower writes nothing to etcd.
        let fence = WriteFence::new();
        fence.close();
        let meta: Arc<dyn MetaStore> = Arc::new(Prefixed::new(
            Arc::new(EtcdMetaStore::new(etcd.clone()).with_fence(fence.clone())),
            prefix.clone(),
        ));
        let tokens = pool_tokens()?;
        let mut core_cfg = CoreConfig::from_master(&cfg);
        placement_proofs(&mut core_cfg, election_meta.as_ref(), &tokens).await?;
        let tenants = load_tenants(&cfg, &core_cfg)?;
        // A placeholder core: followers never serve from it; each won term gets a fresh one.
        let core = Arc::new(MasterCore::new(core_cfg.clone(), 0, notifier.clone()));
        // Every master binds its sockets; only a leader's core feeds them (each won term
        // starts with a reset, docs/EVENTS.md).
        let events = start_events(&cfg)?;
        tracing::info!(etcd = %endpoints, %prefix, cluster_id = %cfg.cluster_id, "HA enabled: starting as a follower");
        Ok(Master {
            slot: CoreSlot::new(core),
            meta,
            tick: Duration::from_millis(100),
            recovery: Arc::default(),
            known: BTreeSet::new(),
            ha: Some(HaSetup {
                state: HaState::new(&cfg.cluster_id, &endpoints.to_string()),
                etcd,
                election_meta,
                fence,
                core_cfg,
                notifier,
                events: events.as_ref().map(|p| p.sink()),
            }),
            events,
            tenants,
            tokens,
            cfg,
        })
    }

    /// How often the background tasks run (default 100 ms).
    pub fn with_tick(mut self, tick: Duration) -> Master {
        self.tick = tick;
        self
    }

    /// The current core (in HA mode it changes with each won term).
    pub fn core(&self) -> Arc<MasterCore> {
        self.slot.get()
    }

    /// The HA state, when HA is enabled.
    pub fn ha(&self) -> Option<&Arc<HaState>> {
        self.ha.as_ref().map(|h| &h.state)
    }

    /// Serves until `shutdown` resolves, then drains (at most [`DRAIN_GRACE`]).
    pub async fn run(
        self,
        listeners: Listeners,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let rpc_addr = local_addr(&listeners.rpc, "rpc")?;
        let admin_addr = local_addr(&listeners.admin, "admin/metrics")?;
        let tokens = self.tokens.clone();
        // A standby presents the strongest token it has to the leader's ReplicateIndex: the
        // admin token; the pool token only beside an admin identity's certificate (mTLS), as
        // the pool token alone never admits that call.
        let standby_token = tokens
            .admin
            .as_ref()
            .or(tokens.pool.as_ref())
            .map(|t| t.as_str().to_string());
        if !tokens.is_empty() {
            tracing::info!(
                pool_token = tokens.pool.is_some(),
                admin_token = tokens.admin.is_some(),
                "callers must present the pool's token (docs/SECURITY.md)"
            );
        }
        let RpcSecurity {
            tls,
            policy,
            leader_tls,
            admin_tls,
        } = rpc_security(&tokens)?;
        // Standbys that cannot follow would keep retrying a refused stream; say so at start.
        if self.ha.is_some()
            && self.cfg.ha_warm_standby
            && let Some(why) = crate::auth::standby_credential_missing(&policy)
        {
            return Err(ServeError::Config(why));
        }
        let admin_policy = Arc::new(crate::auth::AdminHttpPolicy {
            tokens: (*tokens).clone(),
            admin_identities: policy.admin_identities.clone(),
            certificates: admin_tls
                .as_ref()
                .is_some_and(|t| t.asks_client_certificates()),
            secured: policy.tls != TlsMode::Off,
        });
        let (stop_tx, stop_rx) = watch::channel(false);
        let put_end = Arc::new(Notify::new());

        let ha_state = self.ha.as_ref().map(|h| h.state.clone());
        let svc = MasterService::with_slot(
            self.slot.clone(),
            self.meta.clone(),
            put_end.clone(),
            ha_state.clone(),
            self.recovery.clone(),
        );
        if self.ha.is_none() && !self.known.is_empty() {
            tokio::spawn(crate::ha::recovery::forget_unmounted(
                self.known.clone(),
                self.slot.clone(),
                self.meta.clone(),
                stop_rx.clone(),
                || true,
            ));
        }
        // Held until this returns: dropping it stops the quick connections' threads.
        let (lanes, _lanes) = crate::rpc::lanes::Lanes::start(
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        )
        .map_err(|e| ServeError::Server {
            what: "quick-call",
            message: format!("cannot start its threads: {e}"),
        })?;
        let quick = crate::rpc::quick::QuickServer::new(svc.clone(), policy.clone(), lanes);
        let (health_reporter, health) = tonic_health::server::health_reporter();
        tokio::spawn(report_health(
            health_reporter,
            ha_state.clone(),
            stop_rx.clone(),
        ));
        let (reflection_v1, reflection_v1alpha) = lunakv_proto::reflection();
        let mut rx = stop_rx.clone();
        let grpc = tokio::spawn(
            tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .layer(crate::auth::GrpcAuthLayer::new(policy.clone()))
                // Each call a span under its caller's trace; heartbeats only inside a trace.
                .trace_fn(lunakv_telemetry::propagate::grpc_server_span_quiet(&[
                    "Ping",
                ]))
                .add_service(MasterServer::new(svc))
                .add_service(health)
                .add_service(reflection_v1)
                .add_service(reflection_v1alpha)
                .serve_with_incoming_shutdown(
                    crate::rpc::incoming::grpc_connections(listeners.rpc, quick, tls.clone()),
                    async move {
                        let _ = rx.changed().await;
                    },
                ),
        );
        let mut rx = stop_rx.clone();
        let router = crate::admin::routes::router_full(
            self.slot.clone(),
            ha_state.clone(),
            self.recovery.clone(),
            self.events.clone(),
        )
        .merge(crate::admin::routes::tenant_routes(
            self.slot.clone(),
            ha_state.clone(),
            self.tenants.clone(),
        ))
        .layer(axum::middleware::from_fn(move |req, next| {
            crate::auth::admin_http(admin_policy.clone(), req, next)
        }));
        let admin_stop = async move {
            let _ = rx.changed().await;
        };
        let admin = match &admin_tls {
            // HTTPS: each request carries its caller's certificate identity, if any.
            Some(t) => {
                let listener = crate::admin::tls::TlsAdminListener::new(listeners.admin, t.clone())
                    .map_err(|source| ServeError::Bind {
                        what: "admin/metrics",
                        addr: admin_addr.to_string(),
                        source,
                    })?;
                tokio::spawn(
                    axum::serve(
                        listener,
                        router
                            .into_make_service_with_connect_info::<crate::admin::tls::AdminPeer>(),
                    )
                    .with_graceful_shutdown(admin_stop)
                    .into_future(),
                )
            }
            None => tokio::spawn(
                axum::serve(listeners.admin, router)
                    .with_graceful_shutdown(admin_stop)
                    .into_future(),
            ),
        };
        let background = tokio::spawn(background(
            self.slot.clone(),
            self.meta.clone(),
            put_end,
            self.tick,
            ha_state.clone(),
            stop_rx.clone(),
        ));
        let election = self.ha.map(|h| {
            let host = self.cfg.advertised_host().to_string();
            let warm = self
                .cfg
                .ha_warm_standby
                .then(|| crate::ha::standby::WarmCopy::new(&h.state.metrics));
            let election = Election {
                ha: h.state,
                etcd: h.etcd,
                meta: h.election_meta,
                fence: h.fence,
                service_meta: self.meta.clone(),
                slot: self.slot.clone(),
                core_cfg: h.core_cfg,
                notifier: h.notifier,
                events: h.events,
                address: host_port(&host, rpc_addr.port()),
                admin: host_port(&host, admin_addr.port()),
                lease_ttl: self.cfg.ha_lease_ttl(),
                fast_takeover: self.cfg.ha_fast_takeover,
                warm,
                token: standby_token,
                tls: leader_tls,
            };
            tokio::spawn(election.run(stop_rx))
        });

        // A block: the `dyn Display` borrows are not Send and must end before the awaits.
        {
            let events = self.events.as_ref().map(|p| p.endpoints());
            let mut fields: Vec<(&str, &dyn std::fmt::Display)> =
                vec![("rpc", &rpc_addr), ("admin", &admin_addr)];
            if election.is_some() {
                fields.push(("ha", &"etcd"));
            }
            if admin_tls.is_some() {
                fields.push(("admin_tls", &"https"));
            }
            let mode = tls.as_ref().map(|t| t.mode_name());
            if let Some(mode) = &mode {
                fields.push(("tls", mode));
            }
            if let Some(e) = &events {
                fields.push(("events", &e.endpoint));
                if let Some(r) = &e.replay_endpoint {
                    fields.push(("events_replay", r));
                }
                if let Some(v) = &e.vllm_endpoint {
                    fields.push(("events_vllm", v));
                }
            }
            lunakv_telemetry::announce("lunakv-master", &fields);
        }
        tracing::info!(%rpc_addr, %admin_addr, cluster_id = %self.cfg.cluster_id, "lunakv-master serving");

        shutdown.await;
        tracing::info!("shutting down: draining in-flight requests");
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(DRAIN_GRACE, async {
            if let Some(e) = election {
                let _ = e.await;
            }
            let g = grpc.await;
            let a = admin.await;
            let _ = background.await;
            (g, a)
        })
        .await;
        match drained {
            Err(_) => {
                tracing::warn!(grace_s = DRAIN_GRACE.as_secs(), "drain timed out; exiting");
                Ok(())
            }
            Ok((g, a)) => {
                flatten("rpc", g)?;
                flatten("admin/metrics", a)?;
                tracing::info!("lunakv-master stopped");
                Ok(())
            }
        }
    }
}

/// The RPC port's TLS and the auth policy of its calls.
struct RpcSecurity {
    tls: Option<Arc<lunakv_tls::ServerTls>>,
    policy: Arc<AuthPolicy>,
    /// A standby follows the leader's ReplicateIndex with the same files, as a client.
    leader_tls: Option<lunakv_tls::ClientTls>,
    /// `LUNAKV_ADMIN_TLS=1`: the admin port's HTTPS, client certificates optional.
    admin_tls: Option<Arc<lunakv_tls::ServerTls>>,
}

/// TLS on the RPC port (`LUNAKV_TLS_*`) and on the admin port (`LUNAKV_ADMIN_TLS`), and the
/// auth policy of the RPC port's calls (tokens, TLS, `LUNAKV_ADMIN_IDENTITIES`); every refusal
/// names the variable and the fix.
fn rpc_security(tokens: &lunakv_config::auth::PoolTokens) -> Result<RpcSecurity, ServeError> {
    let env = &lunakv_config::process_env;
    let config = |e: lunakv_config::ConfigError| ServeError::Config(e.to_string());
    let paths = lunakv_config::tls::TlsPaths::server_from_env(env).map_err(config)?;
    let tls = lunakv_tls::ServerTls::from_paths("lunakv-master", &paths, &[b"h2"])
        .map_err(|e| ServeError::Config(e.to_string()))?
        .map(Arc::new);
    let admin_identities = lunakv_config::tls::admin_identities(env).map_err(config)?;
    let mount_identities = lunakv_config::tls::mount_identities(env).map_err(config)?;
    let mode = match &tls {
        None => TlsMode::Off,
        Some(t) if t.requires_client_certificates() => TlsMode::Mutual,
        Some(_) => TlsMode::On,
    };
    match mode {
        TlsMode::Mutual => {
            tracing::info!(
                cert = %paths.cert.as_ref().map(|f| f.path.display().to_string()).unwrap_or_default(),
                ca = %paths.ca.as_ref().map(|f| f.path.display().to_string()).unwrap_or_default(),
                admin_identities = ?admin_identities,
                mount_identities = ?mount_identities,
                "the RPC port serves mTLS: every caller presents a certificate from the CA, whose \
                 identity owns its mounts and puts (docs/SECURITY.md)"
            );
            if admin_identities.is_empty() && tokens.admin.is_none() {
                tracing::warn!(
                    "no LUNAKV_ADMIN_IDENTITIES (and no LUNAKV_ADMIN_TOKEN): RemoveAll, \
                     RemoveByRegex and ReplicateIndex (a standby's warm copy) are refused to \
                     every caller; list the admins' and the masters' certificate CNs there"
                );
            }
        }
        TlsMode::On => tracing::info!(
            "the RPC port serves TLS without client certificates (no LUNAKV_TLS_CACERT): callers \
             are not identified"
        ),
        TlsMode::Off if !admin_identities.is_empty() || !mount_identities.is_empty() => {
            tracing::warn!(
                "LUNAKV_ADMIN_IDENTITIES or LUNAKV_MOUNT_IDENTITIES is set but the RPC port has \
                 no mTLS (LUNAKV_TLS_CERT, LUNAKV_TLS_KEY, LUNAKV_TLS_CACERT): no caller has an \
                 identity, so it has no effect"
            )
        }
        TlsMode::Off => {}
    }
    let leader_tls =
        lunakv_tls::ClientTls::from_paths(&paths).map_err(|e| ServeError::Config(e.to_string()))?;
    let admin_tls = if lunakv_config::tls::admin_tls(env).map_err(config)? {
        let t = lunakv_tls::ServerTls::with_optional_client_certificates(
            "lunakv-master",
            &paths,
            // axum serves HTTP/1 here (no `http2` feature): offer only that.
            &[b"http/1.1"],
        )
        .map_err(|e| ServeError::Config(e.to_string()))?
        .ok_or_else(|| {
            ServeError::Config(
                "LUNAKV_ADMIN_TLS=1 serves the admin port as HTTPS with the RPC port's \
                 certificate, and none is set: set LUNAKV_TLS_CERT and LUNAKV_TLS_KEY (and \
                 LUNAKV_TLS_CACERT for client certificates), or unset LUNAKV_ADMIN_TLS"
                    .into(),
            )
        })?;
        tracing::info!(
            client_certificates = t.asks_client_certificates(),
            "the admin port serves HTTPS (LUNAKV_ADMIN_TLS): /metrics, /health, /role and \
             /leader stay open to callers without a certificate; the listings and the tenant \
             API admit the admin token or a certificate whose identity is in \
             LUNAKV_ADMIN_IDENTITIES (docs/SECURITY.md)"
        );
        Some(Arc::new(t))
    } else {
        None
    };
    Ok(RpcSecurity {
        admin_tls,
        tls,
        policy: Arc::new(AuthPolicy {
            tokens: tokens.clone(),
            tls: mode,
            admin_identities,
            mount_identities,
        }),
        leader_tls,
    })
}

fn flatten<E: std::fmt::Display>(
    what: &'static str,
    r: Result<Result<(), E>, tokio::task::JoinError>,
) -> Result<(), ServeError> {
    match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(ServeError::Server {
            what,
            message: e.to_string(),
        }),
        Err(e) => Err(ServeError::Server {
            what,
            message: e.to_string(),
        }),
    }
}

fn local_addr(l: &TcpListener, what: &'static str) -> Result<SocketAddr, ServeError> {
    l.local_addr().map_err(|source| ServeError::Bind {
        what,
        addr: "(bound listener)".into(),
        source,
    })
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Eviction at the watermark, zombie puts and client liveness, every `tick` (and on PutEnd).
/// In HA mode only while this master leads with a valid lease: a deposed leader must not expire
/// clients, forget segments or evict.
async fn background(
    slot: Arc<CoreSlot>,
    meta: Arc<dyn MetaStore>,
    put_end: Arc<Notify>,
    tick: Duration,
    ha: Option<Arc<HaState>>,
    mut stop: watch::Receiver<bool>,
) {
    let leading = || ha.as_ref().is_none_or(|h| h.leading_term().is_some());
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let core = slot.get();
        tokio::select! {
            _ = stop.changed() => return,
            _ = core.promotion_wanted() => {
                // Promotions on hit run beside the sweeps, never in a get's path (and, like
                // eviction, only while leading).
                if leading() {
                    tokio::spawn(async move { core.run_promotions().await });
                }
            }
            _ = interval.tick() => {
                if !leading() {
                    continue;
                }
                let core = slot.get();
                core.sweep_puts().await;
                for (_client, segments) in core.expire_clients() {
                    for s in segments {
                        if let Err(e) = persist::forget_segment(meta.as_ref(), &s).await {
                            tracing::warn!(segment = %s, error = %e, "cannot forget segment in meta store");
                        }
                    }
                }
                core.release_orphaned().await;
                core.enforce_key_limit().await;
                core.evict_if_needed().await;
                // Groups broken by an owner that died or a disk copy lost (docs/GROUPS.md).
                core.drop_broken_groups().await;
            }
            _ = put_end.notified() => {
                if leading() {
                    slot.get().evict_if_needed().await;
                }
            }
        }
    }
}

/// Opens the master from `cfg` and serves on `listeners` until `shutdown` resolves.
pub async fn serve(
    cfg: MasterConfig,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let mut shutdown = Box::pin(shutdown);
    // Opening can wait for etcd (HA); a SIGTERM then stops the wait.
    let master = tokio::select! {
        m = Master::open(cfg) => m?,
        () = &mut shutdown => {
            tracing::info!("shutting down before serving (etcd never answered)");
            return Ok(());
        }
    };
    master.run(listeners, shutdown).await
}

/// A master running in the background (for tests and embedding).
pub struct RunningMaster {
    pub rpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub core: Arc<MasterCore>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl RunningMaster {
    /// `http://rpc_addr`, for `MasterClient::connect`.
    pub fn rpc_url(&self) -> String {
        format!("http://{}", self.rpc_addr)
    }

    /// Stops the master and waits for it to drain.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        (&mut self.task).await.map_err(|e| ServeError::Server {
            what: "master",
            message: e.to_string(),
        })?
    }
}

/// Binds `cfg`'s addresses (port 0 = any free port) and runs `master` in a task.
pub async fn start_master(master: Master) -> Result<RunningMaster, ServeError> {
    let listeners = Listeners::bind(&master.cfg).await?;
    let rpc_addr = local_addr(&listeners.rpc, "rpc")?;
    let admin_addr = local_addr(&listeners.admin, "admin/metrics")?;
    let core = master.slot.get();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(master.run(listeners, async move {
        let _ = rx.await;
    }));
    Ok(RunningMaster {
        rpc_addr,
        admin_addr,
        core,
        stop: Some(tx),
        task,
    })
}

/// [`Master::open`] + [`start_master`].
pub async fn start(cfg: MasterConfig) -> Result<RunningMaster, ServeError> {
    start_master(Master::open(cfg).await?).await
}

/// `grpc.health.v1`: the process (`""`) is SERVING while it runs; the `lunakv.master.v1.Master`
/// service is SERVING on a single master, and under HA only while this master leads (a
/// follower redirects every call). Probes that must not depend on leadership (a Deployment's
/// readiness: followers must count as ready) ask for `""`.
async fn report_health(
    reporter: tonic_health::server::HealthReporter,
    ha: Option<Arc<HaState>>,
    mut stop: watch::Receiver<bool>,
) {
    let Some(ha) = ha else {
        reporter.set_serving::<MasterServer<MasterService>>().await;
        return;
    };
    let mut leading = None;
    loop {
        let now = ha.role() == crate::ha::election::Role::Leader;
        if leading != Some(now) {
            if now {
                reporter.set_serving::<MasterServer<MasterService>>().await;
            } else {
                reporter
                    .set_not_serving::<MasterServer<MasterService>>()
                    .await;
            }
            leading = Some(now);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stop.changed() => {
                reporter.set_not_serving::<MasterServer<MasterService>>().await;
                return;
            }
        }
    }
}
