//! The master's range checks: each names the key, the value and the fix.

use super::{AllocationStrategy, MasterConfig, MasterConfigError};

impl MasterConfig {
    /// Checks every value; the first failure is returned.
    pub fn validate(&self) -> Result<(), MasterConfigError> {
        check_ratio("eviction_ratio", self.eviction_ratio)?;
        check_ratio(
            "eviction_high_watermark_ratio",
            self.eviction_high_watermark_ratio,
        )?;
        check_positive("default_kv_lease_ttl", self.default_kv_lease_ttl, "ms")?;
        check_positive(
            "default_kv_soft_pin_ttl",
            self.default_kv_soft_pin_ttl,
            "ms",
        )?;
        check_positive("max_kv_soft_pin_ttl", self.max_kv_soft_pin_ttl, "ms")?;
        if self.max_kv_soft_pin_ttl < self.default_kv_soft_pin_ttl {
            return Err(MasterConfigError::Invalid {
                field: "max_kv_soft_pin_ttl",
                value: self.max_kv_soft_pin_ttl.to_string(),
                fix: format!(
                    "it must be >= default_kv_soft_pin_ttl ({}); raise it or lower the default",
                    self.default_kv_soft_pin_ttl
                ),
            });
        }
        check_positive("client_ttl", self.client_ttl, "s")?;
        check_positive("namespace_min_keys", self.namespace_min_keys, "keys")?;
        // Upstream clamps the threshold into 1..=255 at flag-parse time; a value it would
        // silently change is refused here instead.
        if !(1..=255).contains(&self.promotion_admission_threshold) {
            return Err(MasterConfigError::Invalid {
                field: "promotion_admission_threshold",
                value: self.promotion_admission_threshold.to_string(),
                fix: format!(
                    "use 1 (promote on the first read) to 255; the default is {}",
                    default_of("promotion_admission_threshold")
                ),
            });
        }
        check_positive(
            "promotion_queue_limit",
            self.promotion_queue_limit,
            "promotions",
        )?;
        check_ratio(
            "put_reservation_limit_ratio",
            self.put_reservation_limit_ratio,
        )?;
        check_ratio(
            "put_reservation_total_ratio",
            self.put_reservation_total_ratio,
        )?;
        check_ratio("put_eviction_limit_ratio", self.put_eviction_limit_ratio)?;
        // 0 would reclaim a put the moment it started, before its writer could copy a byte.
        check_positive("put_reclaim_grace_ms", self.put_reclaim_grace_ms, "ms")?;
        AllocationStrategy::parse(&self.allocation_strategy)?;
        if !matches!(self.eviction_policy.as_str(), "cslru" | "lru") {
            return Err(MasterConfigError::Invalid {
                field: "eviction_policy",
                value: self.eviction_policy.clone(),
                fix: "use cslru (the default: segmented LRU with a ghost table, chain-aware) or \
                      lru (upstream's order)"
                    .to_string(),
            });
        }
        self.validate_tenants()?;
        check_positive(
            "put_start_discard_timeout_sec",
            self.put_start_discard_timeout_sec,
            "s",
        )?;
        check_positive(
            "put_start_release_timeout_sec",
            self.put_start_release_timeout_sec,
            "s",
        )?;
        if self.put_start_release_timeout_sec < self.put_start_discard_timeout_sec {
            return Err(MasterConfigError::Invalid {
                field: "put_start_release_timeout_sec",
                value: self.put_start_release_timeout_sec.to_string(),
                fix: format!(
                    "it must be >= put_start_discard_timeout_sec ({}): space is released only \
                     after the put is discarded",
                    self.put_start_discard_timeout_sec
                ),
            });
        }
        if self.rpc_address.parse::<std::net::IpAddr>().is_err() {
            return Err(MasterConfigError::Invalid {
                field: "rpc_address",
                value: format!("{:?}", self.rpc_address),
                fix: "give an IP address to bind, e.g. 127.0.0.1 (this host only) or 0.0.0.0 \
                      (every interface)"
                    .to_string(),
            });
        }
        if !self.metrics_host.is_empty() && self.metrics_host.parse::<std::net::IpAddr>().is_err() {
            return Err(MasterConfigError::Invalid {
                field: "metrics_host",
                value: format!("{:?}", self.metrics_host),
                fix: "give an IP address for the admin/metrics listener, e.g. 0.0.0.0, or leave \
                      it unset to bind rpc_address"
                    .to_string(),
            });
        }
        if self.rpc_port != 0
            && self.rpc_port == self.metrics_port
            && self.metrics_bind_address() == self.rpc_address
        {
            return Err(MasterConfigError::Invalid {
                field: "metrics_port",
                value: self.metrics_port.to_string(),
                fix: format!(
                    "it equals rpc_port ({}); give the admin/metrics listener its own port \
                     (default {})",
                    self.rpc_port,
                    default_of("metrics_port")
                ),
            });
        }
        if self.cluster_id.trim().is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "cluster_id",
                value: format!("{:?}", self.cluster_id),
                fix: format!(
                    "name the cluster (default {:?}); clients mount with the same id",
                    default_of("cluster_id")
                ),
            });
        }
        self.validate_ha()?;
        self.validate_kv_events()?;
        if self.data_dir.as_os_str().is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "data_dir",
                value: "\"\"".to_string(),
                fix: format!(
                    "give a directory for the master's metadata file, e.g. {}",
                    default_of("data_dir")
                ),
            });
        }
        Ok(())
    }

    /// Tenant quota settings (upstream's multi-tenancy flags).
    fn validate_tenants(&self) -> Result<(), MasterConfigError> {
        if self.tenant_quota_connector_type != "file" {
            return Err(MasterConfigError::Invalid {
                field: "tenant_quota_connector_type",
                value: format!("{:?}", self.tenant_quota_connector_type),
                fix: "lunakv reads the tenant quota policy from a file only (etcd is not \
                      implemented): use --tenant_quota_connector_type=file with \
                      --tenant_quota_connector_uri=/path/tenant_quotas.yaml"
                    .to_string(),
            });
        }
        let uri = self.tenant_quota_connector_uri.trim();
        if self.enable_multi_tenants && uri.is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "tenant_quota_connector_uri",
                value: "\"\"".to_string(),
                fix: "enable_multi_tenants needs the policy file: give \
                      --tenant_quota_connector_uri=/path/tenant_quotas.yaml (`version: 1` and \
                      `tenants: []` to start empty and add tenants through the admin API)"
                    .to_string(),
            });
        }
        if !self.enable_multi_tenants && !uri.is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "tenant_quota_connector_uri",
                value: format!("{uri:?}"),
                fix: "quotas apply only with --enable_multi_tenants=true: add it, or remove \
                      the policy file from the command line"
                    .to_string(),
            });
        }
        Ok(())
    }

    /// KV event settings: only checked when `enable_kv_event_publish` is on.
    fn validate_kv_events(&self) -> Result<(), MasterConfigError> {
        if !self.enable_kv_event_publish {
            return Ok(());
        }
        let endpoint = |field: &'static str, v: &str, required: bool| {
            if (v.is_empty() && !required)
                || ["tcp://", "ipc://", "inproc://"]
                    .iter()
                    .any(|p| v.starts_with(p) && v.len() > p.len())
            {
                Ok(())
            } else {
                Err(MasterConfigError::Invalid {
                    field,
                    value: format!("{v:?}"),
                    fix: "give a ZMQ endpoint: tcp://host:port (tcp://127.0.0.1:* for any free \
                          port), ipc:///path or inproc://name"
                        .to_string(),
                })
            }
        };
        endpoint(
            "kv_event_publisher_endpoint",
            &self.kv_event_publisher_endpoint,
            true,
        )?;
        endpoint(
            "kv_event_publisher_replay_endpoint",
            &self.kv_event_publisher_replay_endpoint,
            false,
        )?;
        endpoint(
            "kv_events_vllm_endpoint",
            &self.kv_events_vllm_endpoint,
            false,
        )?;
        let positive = |field: &'static str, v: u64| {
            if v == 0 || v > i32::MAX as u64 {
                Err(MasterConfigError::Invalid {
                    field,
                    value: v.to_string(),
                    fix: format!(
                        "give a count from 1 to {} (default {})",
                        i32::MAX,
                        default_of(field)
                    ),
                })
            } else {
                Ok(())
            }
        };
        positive("kv_event_publisher_hwm", self.kv_event_publisher_hwm)?;
        positive(
            "kv_event_publisher_max_batch_size",
            self.kv_event_publisher_max_batch_size,
        )?;
        positive(
            "kv_event_publisher_max_queue_size",
            self.kv_event_publisher_max_queue_size,
        )?;
        if self.kv_event_publisher_buffer_steps > 10_000_000 {
            return Err(MasterConfigError::Invalid {
                field: "kv_event_publisher_buffer_steps",
                value: self.kv_event_publisher_buffer_steps.to_string(),
                fix: format!(
                    "keep at most 10000000 batches for replay (default {}; 0 = none)",
                    default_of("kv_event_publisher_buffer_steps")
                ),
            });
        }
        for pod in self
            .kv_events_vllm_pods
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let ok = pod.rsplit_once(':').is_some_and(|(h, p)| {
                !h.is_empty() && !pod.contains('@') && p.parse::<u16>().is_ok()
            });
            if !ok {
                return Err(MasterConfigError::Invalid {
                    field: "kv_events_vllm_pods",
                    value: format!("{pod:?}"),
                    fix: "list each serving pod as address:port (what llm-d's scheduler calls \
                          the endpoint), comma-separated: 10.0.0.5:8000,10.0.0.6:8000, or a \
                          name:port that resolves to them (a headless Service: vllm.ns.svc:8000)"
                        .to_string(),
                });
            }
        }
        for (field, medium) in [
            (
                "kv_events_vllm_medium_dram",
                &self.kv_events_vllm_medium_dram,
            ),
            ("kv_events_vllm_medium_ssd", &self.kv_events_vllm_medium_ssd),
        ] {
            if medium.is_empty() {
                return Err(MasterConfigError::Invalid {
                    field,
                    value: "\"\"".to_string(),
                    fix: format!(
                        "name both media (defaults {} and {}, vLLM's names); llm-d weighs tiers \
                         by these names",
                        default_of("kv_events_vllm_medium_dram"),
                        default_of("kv_events_vllm_medium_ssd")
                    ),
                });
            }
        }
        if !matches!(self.kv_events_vllm_format.as_str(), "tagged" | "array") {
            return Err(MasterConfigError::Invalid {
                field: "kv_events_vllm_format",
                value: format!("{:?}", self.kv_events_vllm_format),
                fix: "use tagged (the default: today's vLLM, events as maps tagged by class name) \
                      or array (vLLM before 0.11, events as positional arrays)"
                    .to_string(),
            });
        }
        if !matches!(self.kv_events_mooncake_format.as_str(), "rfc1527" | "array") {
            return Err(MasterConfigError::Invalid {
                field: "kv_events_mooncake_format",
                value: format!("{:?}", self.kv_events_mooncake_format),
                fix: "use rfc1527 (the default: upstream Mooncake main's master publisher) or \
                      array (the older BlockStoreEvent / BlockUpdateEvent arrays)"
                    .to_string(),
            });
        }
        endpoint(
            "kv_events_bind_endpoint",
            &self.kv_events_bind_endpoint,
            false,
        )?;
        if self.kv_events_queue_capacity > i32::MAX as u64 {
            return Err(MasterConfigError::Invalid {
                field: "kv_events_queue_capacity",
                value: self.kv_events_queue_capacity.to_string(),
                fix: format!(
                    "give at most {} events (default {}; 0 leaves the bound to \
                     kv_event_publisher_max_queue_size)",
                    i32::MAX,
                    default_of("kv_events_queue_capacity")
                ),
            });
        }
        self.kv_events_vllm_served_models()?;
        Ok(())
    }

    /// HA settings: only checked when `enable_ha` is on (llm-d's master.yaml carries
    /// `etcd_endpoints` with `enable_ha: false`).
    fn validate_ha(&self) -> Result<(), MasterConfigError> {
        if !self.enable_ha {
            return Ok(());
        }
        if self.ha_backend_type != "etcd" {
            return Err(MasterConfigError::Invalid {
                field: "ha_backend_type",
                value: format!("{:?}", self.ha_backend_type),
                fix: "only etcd is implemented: use --ha_backend_type=etcd (the default) with \
                      --etcd_endpoints"
                    .to_string(),
            });
        }
        if self.etcd_endpoints.trim().is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "etcd_endpoints",
                value: "\"\"".to_string(),
                fix: "--enable_ha needs etcd: pass --etcd_endpoints=\"h1:2379;h2:2379\""
                    .to_string(),
            });
        }
        self.etcd()?;
        if !(1..=60).contains(&self.ha_lease_ttl_sec) {
            return Err(MasterConfigError::Invalid {
                field: "ha_lease_ttl_sec",
                value: self.ha_lease_ttl_sec.to_string(),
                fix: format!(
                    "use 1..=60 seconds: the leader lease bounds how long a dead leader's host \
                     blocks failover ({}, the default, is etcd's smallest lease)",
                    default_of("ha_lease_ttl_sec")
                ),
            });
        }
        let wildcard = self
            .rpc_address
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified());
        if wildcard && self.advertise_address.trim().is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "advertise_address",
                value: "\"\"".to_string(),
                fix: format!(
                    "rpc_address {} is a wildcard, which clients cannot dial: set \
                     --advertise_address to this master's reachable host (e.g. $(POD_IP))",
                    self.rpc_address
                ),
            });
        }
        Ok(())
    }
}

/// The default of `field`, as messages show it.
fn default_of(field: &str) -> String {
    MasterConfig::default_text(field).unwrap_or_default()
}

fn check_ratio(field: &'static str, v: f64) -> Result<(), MasterConfigError> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        return Ok(());
    }
    Err(MasterConfigError::Invalid {
        field,
        value: v.to_string(),
        fix: format!("it must be a ratio in (0, 1], e.g. {}", default_of(field)),
    })
}

fn check_positive(field: &'static str, v: u64, unit: &str) -> Result<(), MasterConfigError> {
    if v > 0 {
        return Ok(());
    }
    Err(MasterConfigError::Invalid {
        field,
        value: v.to_string(),
        fix: format!("it must be > 0 {unit} (default {})", default_of(field)),
    })
}
