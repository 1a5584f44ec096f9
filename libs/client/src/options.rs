//! Client options: what `setup` needs, from a struct or from mooncake_config.json.

use std::path::PathBuf;
use std::time::Duration;

use lunakv_transfer::WireProtocol;

use crate::{ClientError, MasterWait};

/// The two topologies of the seed document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The client contributes `global_segment_size` bytes of its own DRAM, served in-process.
    Embedded,
    /// A pure requester against a `lunakv-store`'s pool (`global_segment_size == 0`).
    StandaloneStore,
}

/// Everything a [`crate::StoreClient`] needs. Field names follow mooncake_config.json.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// host:port of the master's gRPC endpoint.
    pub master_server_address: String,
    /// Address this client's segment listener binds and advertises (embedded mode).
    pub local_hostname: String,
    pub global_segment_size: u64,
    /// Upstream registers a staging buffer of this size with its transfer engine. lunakv moves
    /// bytes straight between caller buffers and segments, so it is only validated (> 0).
    pub local_buffer_size: u64,
    pub protocol: String,
    /// Use shared memory for segments on this host (default true; `LUNAKV_DISABLE_SHM=1` or
    /// `"enable_shm": false` turn it off).
    pub enable_shm: bool,
    /// Segment name ("host:port") that puts should land on first (MOONCAKE_PREFERRED_SEGMENT).
    pub preferred_segment: Option<String>,
    pub cluster_id: String,
    pub rpc_timeout: Duration,
    pub location_cache_capacity: usize,
    /// Directory for the embedded segment's shm socket (default: the system temp dir).
    pub shm_dir: Option<PathBuf>,
    /// The engine config's `enable_offload`, when it states one: at connect the client compares
    /// it with the master's and warns on a mismatch ([`crate::StoreClient::offload_mismatch`]).
    pub enable_offload: Option<bool>,
    /// Whether connecting waits for a master that is not reachable yet (default: no).
    pub master_wait: MasterWait,
    /// Upstream's `tenant_id`: the namespace of this client's keys (docs/TENANTS.md). Another
    /// tenant's client never sees or removes them; `"default"` is every older client's.
    pub tenant_id: String,
    /// Layer-wise sessions (`batch_put_session_start`, `batch_get_session_start`): at most this
    /// many keys with an open put or get session at once; more are refused.
    pub session_max_keys: usize,
    /// ... and at most this many bytes staged for them (a session holds its object's bytes in
    /// this process, see `StoreClient::batch_put_session_start`).
    pub session_max_bytes: u64,
    /// A session not used for this long is dropped when the next one starts, so a caller that
    /// never ends its sessions does not keep their memory. Longer than the master's default
    /// put_start_discard_timeout_sec (30 s), which frees an unended put's reservation.
    pub session_idle_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            master_server_address: "127.0.0.1:50051".to_owned(),
            local_hostname: "127.0.0.1".to_owned(),
            global_segment_size: 0,
            local_buffer_size: 64 << 20,
            protocol: "tcp".to_owned(),
            enable_shm: true,
            preferred_segment: None,
            cluster_id: "mooncake_cluster".to_owned(),
            rpc_timeout: Duration::from_secs(10),
            location_cache_capacity: 1 << 20,
            shm_dir: None,
            tenant_id: lunakv_proto::DEFAULT_TENANT.to_owned(),
            enable_offload: None,
            master_wait: MasterWait::NoWait,
            session_max_keys: 4096,
            session_max_bytes: 4 << 30,
            session_idle_timeout: Duration::from_secs(60),
        }
    }
}

impl ClientOptions {
    pub fn mode(&self) -> Mode {
        if self.global_segment_size > 0 {
            Mode::Embedded
        } else {
            Mode::StandaloneStore
        }
    }

    pub fn validate(&self) -> Result<(), ClientError> {
        if self.local_buffer_size == 0 {
            return Err(ClientError::Config(
                "local_buffer_size must be > 0".to_owned(),
            ));
        }
        if self.master_server_address.is_empty() {
            return Err(ClientError::Config(
                "master_server_address is empty: set it to the master's host:port, e.g. \"127.0.0.1:50051\"".to_owned(),
            ));
        }
        self.wire_protocol()?;
        if self.tenant_id != lunakv_proto::DEFAULT_TENANT {
            lunakv_proto::validate_tenant(&self.tenant_id)
                .map_err(|e| ClientError::Config(e.to_string()))?;
        }
        Ok(())
    }

    /// The requested protocol. "rdma" is always accepted (vLLM's and llm-d's default): the
    /// client serves it where the build and a device allow, else tcp with one warning line
    /// ([`lunakv_transfer::ProtocolChoice::resolve`]).
    pub fn wire_protocol(&self) -> Result<WireProtocol, ClientError> {
        WireProtocol::parse(&self.protocol).ok_or_else(|| {
            ClientError::Config(format!(
                "protocol '{}' is not a known protocol: use \"tcp\" or \"rdma\" (same-host segments use shared memory automatically)",
                self.protocol
            ))
        })
    }
}

/// How many copies to place and where; mirrors upstream's `ReplicateConfig`.
#[derive(Debug, Clone, Default)]
pub struct ReplicateConfig {
    pub replica_num: u32,
    pub preferred_segment: Option<String>,
    /// Upstream's list form: replicas land on these first, in order (after
    /// `preferred_segment`), each where it has room.
    pub preferred_segments: Vec<String>,
    pub with_soft_pin: bool,
    /// Upstream's `soft_pin_ttl_ms` (`None`: the master's default; 0: no pin).
    pub soft_pin_ttl_ms: Option<u64>,
    pub with_hard_pin: bool,
    /// Upstream's `group_ids`: one group id per key of the put (`""`: that key has none);
    /// `None`: no key has one. Objects of one group are evicted and removed together and read
    /// all or none (docs/GROUPS.md).
    pub group_ids: Option<Vec<String>>,
}

impl ReplicateConfig {
    /// Why these group ids do not fit a put of `n` keys (one entry per key), if they do not.
    pub(crate) fn group_ids_mismatch(&self, n: usize) -> Option<String> {
        self.group_ids.as_ref().filter(|g| g.len() != n).map(|g| {
            format!(
                "group_ids has {} entries for {n} keys: give one per key (\"\" for a key without \
                 a group)",
                g.len()
            )
        })
    }

    /// The group id of key `i` of the put (`""`: none).
    pub(crate) fn group_of(&self, i: usize) -> String {
        self.group_ids
            .as_ref()
            .and_then(|g| g.get(i).cloned())
            .unwrap_or_default()
    }

    /// This config for the items at `idx` of a put of `n` items (the group ids follow their
    /// keys when a caller drops some items). Group ids that do not match `n` stay as they are,
    /// so the put refuses them by name instead of pairing them with the wrong keys.
    pub fn select(&self, n: usize, idx: &[usize]) -> ReplicateConfig {
        ReplicateConfig {
            group_ids: self.group_ids.as_ref().map(|g| {
                if g.len() != n {
                    return g.clone();
                }
                idx.iter()
                    .map(|&i| g.get(i).cloned().unwrap_or_default())
                    .collect()
            }),
            ..self.clone()
        }
    }
}

impl ClientOptions {
    /// Builds options from a loaded, validated mooncake_config.json. `"protocol": "rdma"` is
    /// kept as asked; connect serves tcp with one warning line where RDMA is unavailable.
    pub fn from_mooncake_config(
        cfg: &lunakv_config::MooncakeConfig,
    ) -> Result<ClientOptions, ClientError> {
        // host:port or etcd://h1:2379;h2:2379 (HA: the link finds and follows the leader).
        let master = cfg
            .master_address()
            .map_err(|e| ClientError::Config(e.to_string()))?;
        let local_hostname = if cfg.local_hostname.is_empty() {
            "127.0.0.1".to_owned()
        } else {
            // "host:port" forms appear in upstream configs; the segment listener picks its own port.
            cfg.local_hostname
                .rsplit_once(':')
                .filter(|(_, p)| p.parse::<u16>().is_ok() && !cfg.local_hostname.ends_with(']'))
                .map(|(h, _)| h.to_owned())
                .unwrap_or_else(|| cfg.local_hostname.clone())
        };
        let opts = ClientOptions {
            master_server_address: master.to_string(),
            local_hostname,
            global_segment_size: cfg.global_segment_size,
            local_buffer_size: cfg.local_buffer_size,
            protocol: cfg.protocol.as_str().to_owned(),
            enable_shm: cfg.enable_shm,
            preferred_segment: cfg.preferred_segment.clone(),
            enable_offload: Some(cfg.enable_offload),
            tenant_id: tenant_or_default(&cfg.tenant_id),
            ..ClientOptions::default()
        };
        opts.validate()?;
        Ok(opts)
    }
}

/// Upstream's normalisation of a configured tenant: empty means the default tenant.
pub fn tenant_or_default(tenant: &str) -> String {
    match tenant.trim() {
        "" => lunakv_proto::DEFAULT_TENANT.to_owned(),
        t => t.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_is_accepted_and_unknown_protocols_are_refused_in_one_line() {
        for p in ["rdma", "RDMA", "tcp"] {
            let o = ClientOptions {
                protocol: p.to_owned(),
                ..ClientOptions::default()
            };
            assert!(o.validate().is_ok(), "{p} must be accepted on any machine");
        }
        let o = ClientOptions {
            protocol: "nvlink".to_owned(),
            ..ClientOptions::default()
        };
        let ClientError::Config(msg) = o.validate().unwrap_err() else {
            panic!("a config error");
        };
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("'nvlink'") && msg.contains("\"tcp\""), "{msg}");
    }

    /// llm-d's HA configs (and the ha overlay) name the master as etcd://...: vLLM's setup
    /// through mooncake_config.json must accept it as the CLI and the store do.
    #[test]
    fn a_mooncake_config_may_name_the_master_through_etcd() {
        let text = r#"{"local_hostname": "10.0.0.7", "metadata_server": "P2PHANDSHAKE",
            "master_server_address": "etcd://lunakv-etcd-0.lunakv-etcd:2379;lunakv-etcd-1.lunakv-etcd:2379",
            "global_segment_size": 0, "local_buffer_size": "16MB", "protocol": "tcp"}"#;
        let cfg = lunakv_config::MooncakeConfig::from_json_str(text, "test")
            .unwrap()
            .config;
        let o = ClientOptions::from_mooncake_config(&cfg).unwrap();
        assert_eq!(
            o.master_server_address,
            "etcd://lunakv-etcd-0.lunakv-etcd:2379;lunakv-etcd-1.lunakv-etcd:2379"
        );
        let text = text.replace("etcd://", "redis://");
        let cfg = lunakv_config::MooncakeConfig::from_json_str(&text, "test")
            .unwrap()
            .config;
        let ClientError::Config(msg) = ClientOptions::from_mooncake_config(&cfg).unwrap_err()
        else {
            panic!("a config error");
        };
        assert!(msg.contains("redis://") && msg.contains("etcd://"), "{msg}");
    }
}
