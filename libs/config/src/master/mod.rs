//! The master's configuration: Mooncake's `mooncake_master` flags and llm-d's `master.yaml` keys,
//! under upstream's names, plus lunakv's own (`data_dir`, `enable_offload`).
//!
//! Layers, lowest first: built-in defaults < `master.yaml` (`--config`) < environment
//! (`LUNAKV_MASTER_<KEY>`, e.g. `LUNAKV_MASTER_RPC_PORT=50052`) < command-line flags. Every layer
//! speaks the same key names. A key nobody knows is an error naming it and the closest valid
//! keys; keys upstream has but lunakv does not implement (HA, the HTTP metadata server, ...) are
//! accepted and reported back as warnings for the caller to log. [`MasterConfig::validate`] then
//! checks ranges with messages that name the field, the value and the fix.
//!
//! Files: `keys.rs`, every key once (type, default, help); `checks.rs`, the range checks;
//! `upstream.rs`, upstream's keys lunakv ignores or refuses; `values.rs`, the parsed values of
//! string keys. Here: the loader and the accessors.

mod checks;
mod keys;
mod upstream;
mod values;

#[cfg(test)]
mod tests;

pub use keys::{KEYS, MasterArgs, MasterConfig};
pub use upstream::UPSTREAM_KEYS;
pub use values::{AllocationStrategy, ServedModelNames};

/// Prefix of the environment variables that set master keys.
pub const ENV_PREFIX: &str = "LUNAKV_MASTER_";

impl MasterArgs {
    /// The layers these flags name: the file, and every flag given, by key.
    pub fn sources(&self) -> MasterConfigSources {
        MasterConfigSources {
            file: self.config.clone(),
            flags: crate::layered::flags_of(self),
        }
    }
}

/// A master configuration error. Messages name the key, the value and the fix.
pub type MasterConfigError = crate::layered::LayeredError;

/// A loaded configuration and the warnings the caller should log.
pub type LoadedMasterConfig = crate::layered::LoadedLayers<MasterConfig>;

/// Where configuration comes from; each later layer overrides the earlier ones.
pub type MasterConfigSources = crate::layered::Sources;

/// `(alias, key)`: upstream main's names of lunakv keys, in master.yaml as on the command line
/// (upstream main's `enable_kv_events` is the dev branch's `enable_kv_event_publish`).
pub const ALIASES: &[(&str, &str)] = &[("enable_kv_events", "enable_kv_event_publish")];

/// What the layered loader needs to know about the master.
pub const SCHEMA: crate::layered::Schema = crate::layered::Schema {
    service: "master",
    env_prefix: ENV_PREFIX,
    upstream: UPSTREAM_KEYS,
};

impl MasterConfig {
    /// Loads and validates the layered configuration. `env` reads one environment variable
    /// (production passes [`crate::process_env`]; tests pass a map) and is asked for
    /// `LUNAKV_MASTER_<KEY>` of every known key.
    pub fn load(
        sources: &MasterConfigSources,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<LoadedMasterConfig, MasterConfigError> {
        let file = match &sources.file {
            Some(path) => Some(crate::layered::read_file(&SCHEMA, path)?),
            None => None,
        };
        let names = crate::layered::Names {
            env: None,
            aliases: ALIASES,
        };
        let loaded = crate::layered::load_named::<MasterConfig>(
            &SCHEMA,
            &names,
            file.as_ref(),
            &sources.flags,
            env,
        )?;
        let config = loaded.config;
        let mut warnings = loaded.warnings;
        config.validate()?;
        if config.promotion_on_hit && !config.enable_offload {
            warnings.push(
                "promotion_on_hit = true has no effect without enable_offload = true".to_string(),
            );
        }
        Ok(LoadedMasterConfig { config, warnings })
    }

    /// The parsed `kv_events_vllm_served_model_name`.
    pub fn kv_events_vllm_served_models(&self) -> Result<ServedModelNames, MasterConfigError> {
        ServedModelNames::parse(&self.kv_events_vllm_served_model_name).map_err(|fix| {
            MasterConfigError::Invalid {
                field: "kv_events_vllm_served_model_name",
                value: format!("{:?}", self.kv_events_vllm_served_model_name),
                fix: fix.to_string(),
            }
        })
    }

    /// The endpoint the Mooncake stream binds and the key that named it:
    /// `kv_events_bind_endpoint` (upstream main's) when set, else `kv_event_publisher_endpoint`.
    pub fn kv_events_mooncake_endpoint(&self) -> (&'static str, &str) {
        if self.kv_events_bind_endpoint.is_empty() {
            (
                "kv_event_publisher_endpoint",
                &self.kv_event_publisher_endpoint,
            )
        } else {
            ("kv_events_bind_endpoint", &self.kv_events_bind_endpoint)
        }
    }

    /// The parsed `etcd_endpoints`.
    pub fn etcd(&self) -> Result<crate::EtcdEndpoints, MasterConfigError> {
        crate::EtcdEndpoints::parse("etcd_endpoints", &self.etcd_endpoints).map_err(|e| {
            MasterConfigError::Invalid {
                field: "etcd_endpoints",
                value: format!("{:?}", self.etcd_endpoints),
                fix: e.to_string(),
            }
        })
    }

    /// The address the admin/metrics listener binds: `metrics_host`, else `rpc_address`.
    pub fn metrics_bind_address(&self) -> &str {
        if self.metrics_host.is_empty() {
            &self.rpc_address
        } else {
            &self.metrics_host
        }
    }

    /// The host clients dial: `advertise_address`, else `rpc_address`.
    pub fn advertised_host(&self) -> &str {
        let a = self.advertise_address.trim();
        if a.is_empty() { &self.rpc_address } else { a }
    }

    /// `ha_lease_ttl_sec` as a duration.
    pub fn ha_lease_ttl(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.ha_lease_ttl_sec)
    }

    /// `put_start_discard_timeout_sec` as a duration.
    pub fn put_start_discard_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.put_start_discard_timeout_sec)
    }

    /// The parsed `allocation_strategy` ([`MasterConfig::validate`] has refused any other).
    pub fn allocation_strategy(&self) -> AllocationStrategy {
        AllocationStrategy::parse(&self.allocation_strategy).unwrap_or_default()
    }
}
