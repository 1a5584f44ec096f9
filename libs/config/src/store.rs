//! `StoreConfig`: the configuration of the standalone store-client `lunakv-store`.
//!
//! Flag names and defaults are Mooncake `mooncake_client`'s, so llm-d's DaemonSet arguments work
//! unchanged: `--master_server_address=...:50051 --host=$(POD_IP) --port=50052
//! --global_segment_size=40GB --enable_offload=true --metadata_server=P2PHANDSHAKE`
//! (`--protocol=rdma` is served over RDMA where the build and a device allow, else over tcp with
//! one warning line, docs/RDMA.md).
//!
//! It loads through the one layered loader ([`crate::layered`]): serde defaults < a YAML/JSON
//! file (`--config`, keys = the flag names) < the environment < flags. The binary flattens
//! [`StoreArgs`] into its parser and hands the loader only the flags the command line gave:
//! ```ignore
//! let matches = Cli::command().get_matches_from(args);
//! let cli = Cli::from_arg_matches(&matches)?;
//! let loaded = StoreConfig::load(&cli.store.sources(&matches), &lunakv_config::process_env)?;
//! ```
//! Booleans take gflags' `--flag=value` form (`--enable_offload=true`, `=false`, `=1`, `=no`) as
//! well as a bare `--enable_offload`. Underscore names are canonical; dashed aliases are accepted.
//!
//! Environment ([`ENV_VARS`]): upstream's `MOONCAKE_OFFLOAD_FILE_STORAGE_PATH` and
//! `MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES` (env only, as upstream: the SSD tier,
//! `--enable_offload`, docs/OFFLOAD.md), and `LUNAKV_<FLAG>` twins of five lunakv flags. Unlike
//! the master's `LUNAKV_MASTER_<KEY>`, these names are not one prefix: they are upstream's or
//! already in deployments, so the store names each variable.

use std::path::PathBuf;

use clap::ArgAction;
use clap::ArgMatches;
use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use serde::{Deserialize, Deserializer, Serialize};

use crate::gflags::{Upstream, UpstreamFlag};
use crate::layered::{LayeredError, LoadedLayers, Names, Schema, Sources};
use crate::size::parse_size;
use crate::{ConfigError, ConfigWarning, Protocol};

pub const DEFAULT_MASTER_SERVER_ADDRESS: &str = "127.0.0.1:50051";
/// lunakv binds loopback by default. Upstream's transfer listeners open `0.0.0.0` and `[::]` whatever
/// `--host` says, which exposes the pool's memory to the network; lunakv binds exactly `--host`,
/// so a default that is safe on a laptop is loopback. Deployments pass `--host=$(POD_IP)`.
pub const DEFAULT_HOST: &str = "127.0.0.1";
/// The transfer port (upstream's default). 0 = ephemeral, for tests.
pub const DEFAULT_PORT: u16 = 50052;
/// Upstream `mooncake_client`'s default, spelled as upstream spells it.
pub const DEFAULT_GLOBAL_SEGMENT_SIZE: &str = "4 GB";
pub const DEFAULT_METADATA_SERVER: &str = "P2PHANDSHAKE";
pub const DEFAULT_CLUSTER_ID: &str = "mooncake_cluster";
/// Admin HTTP (/metrics, /health) of the store-client; the master's is 9003. 0 = ephemeral.
pub const DEFAULT_METRICS_PORT: u16 = 9004;
/// Most transfer connections one source IP may hold open (lunakv-transfer's default).
pub const DEFAULT_TRANSFER_MAX_CONNS_PER_PEER: u32 = 256;
/// A transfer connection idle this long is closed; pooled requesters reconnect unseen.
pub const DEFAULT_TRANSFER_IDLE_TIMEOUT_SEC: u64 = 120;
/// How long a store retries binding its transfer port while it is in use (after a kill -9 a
/// connection may hold it as its source port for a while).
pub const DEFAULT_BIND_RETRY_SEC: u64 = 30;
/// Upstream's default for MOONCAKE_OFFLOAD_FILE_STORAGE_PATH.
pub const DEFAULT_OFFLOAD_FILE_STORAGE_PATH: &str = "/data/file_storage";
/// Upstream's default for MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES: 2 TB (binary, as all sizes here).
pub const DEFAULT_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES: u64 = 2 << 40;
/// Seconds a graceful stop (SIGTERM) with the SSD tier spends writing DRAM objects to disk
/// before it unmounts. Kubernetes kills a pod 30 s after SIGTERM unless the pod says otherwise;
/// 20 s leaves room for the unmount (at most 5 s) and the exit inside that default.
pub const DEFAULT_OFFLOAD_DRAIN_TIMEOUT_SEC: u64 = 20;
/// Upper bound of `--offload_drain_timeout_sec`: a drain that long is a configuration mistake.
pub const MAX_OFFLOAD_DRAIN_TIMEOUT_SEC: u64 = 3600;
/// Env twin of `--offload_drain_timeout_sec` (the flag wins).
pub const OFFLOAD_DRAIN_TIMEOUT_ENV: &str = "LUNAKV_OFFLOAD_DRAIN_TIMEOUT_SEC";

/// The store-client's configuration (see the module docs). Every field is a key of the
/// config file and the flag of the same name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// The master's host:port (or `etcd://h1:2379;h2:2379`).
    pub master_server_address: String,
    /// Address the transfer listener binds and advertises (exactly this address).
    pub host: String,
    /// Transfer port; 0 picks a free one.
    pub port: u16,
    /// DRAM this store serves: bytes or "40GB" (= 40 GiB).
    #[serde(with = "size_text")]
    pub global_segment_size: u64,
    /// Transfer protocol: tcp, or rdma (served over tcp, with one warning, where this build or
    /// machine has no RDMA).
    #[serde(deserialize_with = "protocol")]
    pub protocol: Protocol,
    /// Transfer metadata server; lunakv's master hosts the metadata, so only P2PHANDSHAKE applies.
    pub metadata_server: String,
    /// SSD offload tier in `offload_file_storage_path` (docs/OFFLOAD.md).
    pub enable_offload: bool,
    /// HA: find the master through etcd (`h1:2379;h2:2379`); overrides the master address.
    pub etcd_endpoints: Option<String>,
    /// HA cluster id (upstream's default), used in metadata key names.
    pub cluster_id: String,
    /// Unix socket for same-host requesters (memfd passing). Default: see `shm_socket_path`.
    pub shm_socket: Option<PathBuf>,
    /// Serve same-host requesters through shared memory.
    pub enable_shm: bool,
    /// Admin HTTP port for /metrics and /health; 0 picks a free one.
    pub metrics_port: u16,
    /// With the SSD tier: seconds a graceful stop spends writing DRAM objects to disk.
    pub offload_drain_timeout_sec: u64,
    /// Most transfer connections one source IP may hold open; 0 = no per-peer cap.
    pub transfer_max_conns_per_peer: u32,
    /// Most transfer connections in all; 0 = derived from the open-file limit.
    pub transfer_max_conns: u32,
    /// Seconds a transfer connection may send nothing before it is closed; 0 = never. Also the
    /// bound on one request's arrival when shorter than 30 s (plus 1 s per MiB received).
    pub transfer_idle_timeout_sec: u64,
    /// Seconds to keep retrying the transfer port's bind while it is in use; 0 = fail at once.
    pub bind_retry_sec: u64,
    /// MOONCAKE_OFFLOAD_FILE_STORAGE_PATH (no flag, as upstream).
    pub offload_file_storage_path: PathBuf,
    /// MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES (no flag, as upstream): bytes or "500GB".
    #[serde(with = "size_text")]
    pub offload_total_size_limit_bytes: u64,
}

/// The environment variable of each key that has one (see the module docs for why these are
/// named one by one). The flag wins over its variable.
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "offload_file_storage_path",
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
    ),
    (
        "offload_total_size_limit_bytes",
        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES",
    ),
    ("offload_drain_timeout_sec", OFFLOAD_DRAIN_TIMEOUT_ENV),
    (
        "transfer_max_conns_per_peer",
        "LUNAKV_TRANSFER_MAX_CONNS_PER_PEER",
    ),
    ("transfer_max_conns", "LUNAKV_TRANSFER_MAX_CONNS"),
    (
        "transfer_idle_timeout_sec",
        "LUNAKV_TRANSFER_IDLE_TIMEOUT_SEC",
    ),
    ("bind_retry_sec", "LUNAKV_BIND_RETRY_SEC"),
];

/// What the layered loader needs to know about the store.
pub const SCHEMA: Schema = Schema {
    service: "store",
    // Unused: the store names its variables in ENV_VARS.
    env_prefix: "",
    upstream: UPSTREAM_FLAGS,
};

/// The store's command line. Its clap defaults are the serde defaults (a test holds them
/// equal) and its `env` attributes the [`ENV_VARS`], so `--help` shows both; but only the
/// flags the command line gave become the flag layer ([`StoreArgs::sources`]), and the
/// loader reads the environment, so a file value is overridden only by a variable or a flag
/// actually set. clap still checks an environment value's type (its message names the flag).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, Serialize)]
#[command(after_help = crate::security_help::store_help())]
pub struct StoreArgs {
    /// YAML or JSON file of these settings, keys = the flag names (`port: 50052`); the
    /// environment overrides it and flags override both.
    #[arg(long = "config")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// The master's host:port.
    #[arg(long = "master_server_address", alias = "master-server-address", default_value = DEFAULT_MASTER_SERVER_ADDRESS)]
    pub master_server_address: String,

    /// Address the transfer listener binds and advertises (exactly this address; default loopback).
    #[arg(long = "host", default_value = DEFAULT_HOST)]
    pub host: String,

    /// Transfer port; 0 picks a free one.
    #[arg(long = "port", default_value_t = DEFAULT_PORT)]
    pub port: u16,

    /// DRAM this store serves: bytes or "40GB" (= 40 GiB).
    #[arg(long = "global_segment_size", alias = "global-segment-size", default_value = DEFAULT_GLOBAL_SEGMENT_SIZE, value_parser = parse_size)]
    pub global_segment_size: u64,

    /// Transfer protocol: tcp, or rdma (served over tcp, with one warning, where this build or
    /// machine has no RDMA).
    #[arg(long = "protocol", default_value = "tcp", value_parser = parse_protocol)]
    pub protocol: Protocol,

    /// Transfer metadata server; lunakv's master hosts the metadata, so only P2PHANDSHAKE applies.
    #[arg(long = "metadata_server", alias = "metadata-server", default_value = DEFAULT_METADATA_SERVER)]
    pub metadata_server: String,

    /// SSD offload tier in MOONCAKE_OFFLOAD_FILE_STORAGE_PATH (docs/OFFLOAD.md). `--enable_offload=true|false`.
    #[arg(
        long = "enable_offload", alias = "enable-offload", default_value = "false",
        action = ArgAction::Set, num_args = 0..=1, require_equals = true,
        default_missing_value = "true", value_parser = BoolishValueParser::new()
    )]
    pub enable_offload: bool,

    /// HA: find the master through etcd (`h1:2379;h2:2379`, upstream's form); overrides
    /// --master_server_address, which may also be written `etcd://h1:2379;h2:2379`.
    #[arg(long = "etcd_endpoints", alias = "etcd-endpoints")]
    pub etcd_endpoints: Option<String>,

    /// HA cluster id (upstream's default), used in metadata key names.
    #[arg(long = "cluster_id", alias = "cluster-id", default_value = DEFAULT_CLUSTER_ID)]
    pub cluster_id: String,

    /// Unix socket for same-host requesters (memfd passing). Default: see `shm_socket_path`.
    #[arg(long = "shm_socket", alias = "shm-socket")]
    pub shm_socket: Option<PathBuf>,

    /// Serve same-host requesters through shared memory. `--enable_shm=false` forces tcp.
    #[arg(
        long = "enable_shm", alias = "enable-shm", default_value = "true",
        action = ArgAction::Set, num_args = 0..=1, require_equals = true,
        default_missing_value = "true", value_parser = BoolishValueParser::new()
    )]
    pub enable_shm: bool,

    /// Admin HTTP port for /metrics and /health; 0 picks a free one.
    #[arg(long = "metrics_port", alias = "metrics-port", default_value_t = DEFAULT_METRICS_PORT)]
    pub metrics_port: u16,

    /// With --enable_offload: on SIGTERM/SIGINT, seconds spent writing the objects still in DRAM
    /// to the SSD tier (newest first) before unmounting, so a restart on the same directory
    /// serves them; what does not fit in time is dropped (and counted). 0 = drop them at once.
    /// Keep it below the pod's terminationGracePeriodSeconds (docs/OFFLOAD.md).
    #[arg(
        long = "offload_drain_timeout_sec", alias = "offload-drain-timeout-sec",
        env = OFFLOAD_DRAIN_TIMEOUT_ENV, default_value_t = DEFAULT_OFFLOAD_DRAIN_TIMEOUT_SEC
    )]
    pub offload_drain_timeout_sec: u64,

    /// Most transfer connections one source IP may hold open; more are closed at accept and
    /// counted in lunakv_store_transfer_connections_refused_total. 0 = no per-peer cap.
    #[arg(long = "transfer_max_conns_per_peer", alias = "transfer-max-conns-per-peer", env = "LUNAKV_TRANSFER_MAX_CONNS_PER_PEER", default_value_t = DEFAULT_TRANSFER_MAX_CONNS_PER_PEER)]
    pub transfer_max_conns_per_peer: u32,

    /// Most transfer connections in all; 0 = derived from the open-file limit (3 descriptors
    /// each, a reserve kept for shm requesters and the master, at most 8192).
    #[arg(
        long = "transfer_max_conns",
        alias = "transfer-max-conns",
        env = "LUNAKV_TRANSFER_MAX_CONNS",
        default_value_t = 0
    )]
    pub transfer_max_conns: u32,

    /// Seconds a transfer connection may send nothing before it is closed; 0 = never. One
    /// request must also arrive whole within 30 s of its first bytes, or within this when
    /// shorter, plus 1 s per MiB received (a peer trickling bytes is never idle).
    #[arg(long = "transfer_idle_timeout_sec", alias = "transfer-idle-timeout-sec", env = "LUNAKV_TRANSFER_IDLE_TIMEOUT_SEC", default_value_t = DEFAULT_TRANSFER_IDLE_TIMEOUT_SEC)]
    pub transfer_idle_timeout_sec: u64,

    /// Seconds to keep retrying the transfer port's bind while it is in use; 0 = fail at once.
    #[arg(long = "bind_retry_sec", alias = "bind-retry-sec", env = "LUNAKV_BIND_RETRY_SEC", default_value_t = DEFAULT_BIND_RETRY_SEC)]
    pub bind_retry_sec: u64,
}

impl StoreArgs {
    /// The layers these arguments name: the file, and every flag given on the command line, by
    /// key (clap's defaults and environment values are left to the loader).
    pub fn sources(&self, matches: &ArgMatches) -> Sources {
        let given = |key: &str| matches.value_source(key) == Some(ValueSource::CommandLine);
        Sources {
            file: self.config.clone(),
            flags: crate::layered::flags_of(self)
                .into_iter()
                .filter(|(k, _)| given(k))
                .collect(),
        }
    }
}

/// Upstream `mooncake_client` flags lunakv-store does not define: ignored with the reason or
/// refused with the fix (read from upstream's client_service main; docs/FLAGS.md).
pub const UPSTREAM_FLAGS: &[UpstreamFlag] = &[
    UpstreamFlag {
        name: "device_names",
        boolean: false,
        treatment: Upstream::Ignored(
            "the RDMA device is chosen with LUNAKV_RDMA_DEVICE (docs/RDMA.md)",
        ),
    },
    UpstreamFlag {
        name: "threads",
        boolean: false,
        treatment: Upstream::Ignored("the segment server sizes its own threads"),
    },
    UpstreamFlag {
        name: "local_buffer_size",
        boolean: false,
        treatment: Upstream::Ignored(
            "the store serves its own segment and needs no staging buffer",
        ),
    },
    UpstreamFlag {
        name: "start_offload_rpc_server",
        boolean: true,
        treatment: Upstream::Ignored("disk-tier reads go through the transfer port"),
    },
    UpstreamFlag {
        name: "graceful_unmount_seconds",
        boolean: false,
        treatment: Upstream::Ignored(
            "SIGTERM drains to the SSD tier for --offload_drain_timeout_sec, then unmounts",
        ),
    },
    UpstreamFlag {
        name: "tenant_id",
        boolean: false,
        treatment: Upstream::OnlyValue {
            value: "default",
            fix: crate::messages::TENANT_REFUSAL,
        },
    },
    UpstreamFlag {
        name: "deployment_mode",
        boolean: false,
        treatment: Upstream::OnlyValue {
            value: "Centralization",
            fix: "lunakv has a master-based (Centralization) pool only; P2P mode is not implemented",
        },
    },
    p2p("tiered_backend_config"),
    p2p("client_rpc_port"),
    p2p("rpc_thread_num"),
    p2p("lock_shard_count"),
    p2p("route_cache_max_memory"),
    p2p("route_cache_ttl_ms"),
    p2p("heartbeat_rpc_port"),
    UpstreamFlag {
        name: "config_path",
        boolean: false,
        treatment: Upstream::Refused(
            "upstream's client config file is not read: pass the settings as flags (upstream's names), or as lunakv's --config YAML of the same keys",
        ),
    },
    redis("redis_cluster_id"),
    redis("redis_username"),
    redis("redis_password"),
    redis("redis_db_index"),
    redis("redis_master_view_ttl_sec"),
    redis("redis_heartbeat_interval_sec"),
    etcd_tls("etcd_ca_file"),
    etcd_tls("etcd_cert_file"),
    etcd_tls("etcd_key_file"),
];

const fn p2p(name: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean: false,
        treatment: Upstream::Ignored("a P2P-mode setting; lunakv's pool is master-based"),
    }
}

const fn redis(name: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean: false,
        treatment: Upstream::Refused(
            "lunakv finds an HA master through etcd only: --master_server_address=etcd://h1:2379;h2:2379",
        ),
    }
}

const fn etcd_tls(name: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean: false,
        treatment: Upstream::Refused(
            "etcd TLS is not supported yet; reach etcd over plain http inside the cluster",
        ),
    }
}

/// Sizes as text, so the loader reads `"40GB"` from a variable or a flag as a size (the
/// loader takes a key's type from its serialized default), and any size spelling back.
mod size_text {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::size::format_size(*bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        crate::size::deserialize(d)
    }
}

fn protocol<'de, D: Deserializer<'de>>(d: D) -> Result<Protocol, D::Error> {
    let s = String::deserialize(d)?;
    Protocol::parse_for("protocol", &s).map_err(serde::de::Error::custom)
}

/// A store configuration error: a layer's key or value ([`LayeredError`]), or a value the
/// store's checks refuse ([`ConfigError`]). Both name the key or flag, the value and the fix.
#[derive(Debug, thiserror::Error)]
pub enum StoreConfigError {
    #[error(transparent)]
    Layers(#[from] LayeredError),
    #[error(transparent)]
    Invalid(#[from] ConfigError),
}

fn parse_protocol(s: &str) -> Result<Protocol, ConfigError> {
    Protocol::parse_for("protocol", s)
}

impl Default for StoreConfig {
    /// The same values as running `lunakv-store` with no flags.
    fn default() -> Self {
        StoreConfig {
            master_server_address: DEFAULT_MASTER_SERVER_ADDRESS.to_string(),
            host: DEFAULT_HOST.to_string(),
            port: DEFAULT_PORT,
            global_segment_size: 4 << 30,
            protocol: Protocol::Tcp,
            metadata_server: DEFAULT_METADATA_SERVER.to_string(),
            enable_offload: false,
            cluster_id: DEFAULT_CLUSTER_ID.to_string(),
            etcd_endpoints: None,
            shm_socket: None,
            enable_shm: true,
            metrics_port: DEFAULT_METRICS_PORT,
            transfer_max_conns_per_peer: DEFAULT_TRANSFER_MAX_CONNS_PER_PEER,
            transfer_max_conns: 0,
            transfer_idle_timeout_sec: DEFAULT_TRANSFER_IDLE_TIMEOUT_SEC,
            bind_retry_sec: DEFAULT_BIND_RETRY_SEC,
            offload_file_storage_path: PathBuf::from(DEFAULT_OFFLOAD_FILE_STORAGE_PATH),
            offload_total_size_limit_bytes: DEFAULT_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES,
            offload_drain_timeout_sec: DEFAULT_OFFLOAD_DRAIN_TIMEOUT_SEC,
        }
    }
}

impl StoreConfig {
    /// Loads the layers ([`StoreArgs::sources`], then [`ENV_VARS`] through `env`) and validates
    /// the result. Warnings are returned for the caller to log.
    pub fn load(
        sources: &Sources,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<LoadedLayers<StoreConfig>, StoreConfigError> {
        let file = match &sources.file {
            Some(path) => Some(crate::layered::read_file(&SCHEMA, path)?),
            None => None,
        };
        let names = Names {
            env: Some(ENV_VARS),
            aliases: &[],
        };
        let loaded = crate::layered::load_named::<StoreConfig>(
            &SCHEMA,
            &names,
            file.as_ref(),
            &sources.flags,
            env,
        )?;
        let mut warnings = loaded.warnings;
        warnings.extend(loaded.config.validate()?.iter().map(ToString::to_string));
        Ok(LoadedLayers {
            config: loaded.config,
            warnings,
        })
    }

    /// Checks, in this order: master address, host, global_segment_size, protocol, ports,
    /// offload_drain_timeout_sec, cluster_id. Warnings: offload not implemented, metadata server ignored.
    pub fn validate(&self) -> Result<Vec<ConfigWarning>, ConfigError> {
        self.master_address()?;
        let host = self.host.trim();
        if host.is_empty() {
            return Err(ConfigError::Missing {
                field: "--host".to_string(),
                fix: "give the address to bind and advertise, e.g. --host=127.0.0.1 or --host=$(POD_IP)".to_string(),
            });
        }
        if host.contains(char::is_whitespace)
            || (host.contains(':') && host.parse::<std::net::Ipv6Addr>().is_err())
        {
            return Err(ConfigError::Invalid {
                field: "--host".to_string(),
                value: self.host.clone(),
                reason: "a host is a name or an IP address, without a port".to_string(),
                fix: "write e.g. --host=10.0.0.5 --port=50052".to_string(),
            });
        }
        if self.global_segment_size == 0 {
            return Err(ConfigError::Invalid {
                field: "--global_segment_size".to_string(),
                value: "0".to_string(),
                reason: "a store-client must serve some memory".to_string(),
                fix: "give the DRAM to serve, e.g. --global_segment_size=40GB".to_string(),
            });
        }
        // `--protocol=rdma` is a valid value here; whether this build and machine can serve it
        // (the `rdma` feature, a device) is decided by the binary, which probes the device and
        // falls back to tcp with one warning line.
        if self.port != 0 && self.port == self.metrics_port {
            return Err(ConfigError::Invalid {
                field: "--metrics_port".to_string(),
                value: self.metrics_port.to_string(),
                reason: "it is also the transfer --port".to_string(),
                fix: format!(
                    "use another port, e.g. --metrics_port={DEFAULT_METRICS_PORT}, or 0 for a free one"
                ),
            });
        }
        if self.offload_drain_timeout_sec > MAX_OFFLOAD_DRAIN_TIMEOUT_SEC {
            return Err(ConfigError::Invalid {
                field: "--offload_drain_timeout_sec".to_string(),
                value: self.offload_drain_timeout_sec.to_string(),
                reason: format!(
                    "more than {MAX_OFFLOAD_DRAIN_TIMEOUT_SEC} s; a stop must finish inside the pod's grace period"
                ),
                fix: format!(
                    "give seconds below terminationGracePeriodSeconds, e.g. --offload_drain_timeout_sec={DEFAULT_OFFLOAD_DRAIN_TIMEOUT_SEC}"
                ),
            });
        }
        if self.cluster_id.trim().is_empty() {
            return Err(ConfigError::Missing {
                field: "--cluster_id".to_string(),
                fix: format!("omit it for the default ({DEFAULT_CLUSTER_ID}) or give a name"),
            });
        }
        let mut warnings = Vec::new();
        if !self.metadata_server.is_empty() && self.metadata_server != crate::client::P2P_HANDSHAKE
        {
            warnings.push(ConfigWarning::MetadataServerIgnored {
                field: "--metadata_server",
                value: self.metadata_server.clone(),
            });
        }
        Ok(warnings)
    }

    /// Where the master is: `--etcd_endpoints` if given, else `--master_server_address`
    /// (`host:port` or `etcd://h1:2379;h2:2379`).
    pub fn master_address(&self) -> Result<crate::MasterAddress, ConfigError> {
        match self
            .etcd_endpoints
            .as_deref()
            .filter(|e| !e.trim().is_empty())
        {
            Some(e) => {
                crate::EtcdEndpoints::parse("--etcd_endpoints", e).map(crate::MasterAddress::Etcd)
            }
            None => {
                crate::MasterAddress::parse("--master_server_address", &self.master_server_address)
            }
        }
    }

    /// `--shm_socket` names the socket file itself (not a directory to put it in).
    pub fn shm_socket_is_exact(&self) -> bool {
        self.shm_socket
            .as_ref()
            .is_some_and(|p| !(p.as_os_str().to_string_lossy().ends_with('/') || p.is_dir()))
    }

    /// The unix socket path for same-host requesters. The file name carries the segment's
    /// identity, `lunakv-store-<cluster_id>-<host>-<port>.sock`, so two stacks sharing a runtime
    /// directory (two clusters, or two network namespaces of one host) never share a socket. It
    /// sits in `--shm_socket` when that names a directory (an existing one, or a path ending in
    /// `/`, as the k8s overlays pass a hostPath), else in `$XDG_RUNTIME_DIR`, else `/tmp`. Any
    /// other `--shm_socket` is the socket's exact path. `bound_port` is the transfer port
    /// actually bound (so `--port=0` gets a unique name).
    pub fn shm_socket_path(
        &self,
        bound_port: u16,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> PathBuf {
        let dir = match &self.shm_socket {
            Some(p) if !self.shm_socket_is_exact() => p.clone(),
            Some(p) => return p.clone(),
            None => PathBuf::from(
                env("XDG_RUNTIME_DIR")
                    .filter(|d| !d.is_empty())
                    .unwrap_or_else(|| "/tmp".to_string()),
            ),
        };
        let name = format!(
            "lunakv-store-{}-{}-{bound_port}.sock",
            self.cluster_id, self.host
        );
        // Only characters that are safe in one path component (a cluster id is free text).
        let name: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        dir.join(name)
    }
}
