//! The bootstrap's command line ([`BootstrapArgs`]) and what it resolves to: the
//! [`BootstrapConfig`] and the table, embedded or in etcd ([`BootstrapArgs::state`]).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use lunakv_meta::{EtcdClient, EtcdMetaStore, EtcdSecurity};
use lunakv_telemetry::wait::PeerWait;

use crate::{
    BootstrapConfig, BootstrapError, BootstrapState, Limits, MemoryState, SharedState,
    parse_duration, port_from_env,
};

/// vLLM-compatible Mooncake P/D bootstrap service with leased registrations.
#[derive(Debug, clap::Parser)]
#[command(name = "lunakv-bootstrap", version)]
pub struct BootstrapArgs {
    /// Address the listeners bind [default: 127.0.0.1; upstream binds 0.0.0.0].
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP port [default: MOONCAKE_BOOTSTRAP_PORT, VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998].
    #[arg(long)]
    pub port: Option<u16>,
    /// gRPC port.
    #[arg(long = "grpc-port", default_value_t = crate::DEFAULT_GRPC_PORT)]
    pub grpc_port: u16,
    /// Default lease of a registration (e.g. 10s, 500ms; at most 1h).
    #[arg(long = "lease-ttl", default_value = "10s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// Renew the lease of workers whose side-channel addr accepts a TCP connection.
    #[arg(long = "probe-workers", default_value_t = true, action = clap::ArgAction::Set)]
    pub probe_workers: bool,
    /// Also probe addrs that are not on the registering peer's host (only where NAT hides the
    /// engines' addresses and only trusted peers reach the bootstrap: any peer could otherwise
    /// make the service dial any address).
    #[arg(long = "probe-any-host", default_value_t = false, action = clap::ArgAction::Set)]
    pub probe_any_host: bool,
    /// Live workers the table holds at most; a new one beyond is refused (507).
    #[arg(long = "max-registrations", default_value_t = Limits::DEFAULT.max_registrations)]
    pub max_registrations: usize,
    /// Live workers one source IP may register; a new one beyond is refused (429).
    #[arg(long = "max-registrations-per-peer", default_value_t = Limits::DEFAULT.max_per_peer)]
    pub max_registrations_per_peer: usize,
    /// Keep the table in etcd so replicas share it (comma or `;` list of host:port); unset =
    /// embedded, in memory.
    #[arg(long = "etcd-endpoints", env = "LUNAKV_BOOTSTRAP_ETCD_ENDPOINTS")]
    pub etcd_endpoints: Option<String>,
    /// With etcd: the cluster the keys go under (`mooncake-store/<cluster-id>/bootstrap/...`).
    #[arg(long = "cluster-id", default_value = "default")]
    pub cluster_id: String,
    /// With etcd: which table the replicas share (one per prefill deployment).
    #[arg(long = "group", default_value = "default")]
    pub group: String,
}

impl BootstrapArgs {
    /// The listeners' configuration; the HTTP port falls back to the environment (`env` reads
    /// one variable), then to [`crate::DEFAULT_HTTP_PORT`]. Not yet validated.
    pub fn config(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<BootstrapConfig, BootstrapError> {
        let env_port = port_from_env(env)?;
        Ok(BootstrapConfig {
            host: self.host,
            http_port: self.port.or(env_port).unwrap_or(crate::DEFAULT_HTTP_PORT),
            grpc_port: self.grpc_port,
            lease: self.lease_ttl,
            probe_workers: self.probe_workers,
            probe_any_host: self.probe_any_host,
            limits: Limits {
                max_registrations: self.max_registrations,
                max_per_peer: self.max_registrations_per_peer,
            },
        })
    }

    /// The table: embedded, or in etcd when endpoints are given. An etcd that does not answer
    /// yet (started together with this service) is waited for: one WARN line, one more every
    /// 30 s, one INFO line when it answers. Malformed flags and endpoints fail at once.
    pub async fn state(&self, limits: Limits) -> Result<Arc<dyn BootstrapState>, BootstrapError> {
        let Some(eps) = self
            .etcd_endpoints
            .as_deref()
            .filter(|e| !e.trim().is_empty())
        else {
            return Ok(Arc::new(MemoryState::new().with_limits(limits)));
        };
        for (flag, v) in [("--cluster-id", &self.cluster_id), ("--group", &self.group)] {
            if v.is_empty() || v.contains('/') {
                return Err(BootstrapError::Config(format!(
                    "{flag} '{v}' must be a non-empty name without '/'"
                )));
            }
        }
        let endpoints: Vec<String> = eps
            .split([',', ';'])
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect();
        let security = EtcdSecurity::from_env(&lunakv_config::process_env)
            .map_err(|e| BootstrapError::Config(e.to_string()))?;
        let client = EtcdClient::connect_with(&endpoints, Duration::from_secs(3), &security)
            .map_err(|e| BootstrapError::Config(format!("--etcd-endpoints={eps}: {e}")))?;
        let prefix = SharedState::prefix_for(&self.cluster_id, &self.group);
        let mut waiting = PeerWait::new(
            format!("etcd at {eps}"),
            format!("(--etcd-endpoints) to share the bootstrap table {prefix}"),
        );
        // Every failure of a reachable-or-not etcd is one waiting can fix: the endpoints parsed.
        while let Err(e) = client.check().await {
            waiting.retry_after(&e).await;
        }
        waiting.reached();
        tracing::info!(etcd = %eps, %prefix, "bootstrap table shared through etcd");
        Ok(Arc::new(
            SharedState::new(Arc::new(EtcdMetaStore::new(client)), prefix).with_limits(limits),
        ))
    }
}
