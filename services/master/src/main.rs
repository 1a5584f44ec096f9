//! `lunakv-master`: parse flags, load the layered config, init telemetry, serve until
//! SIGTERM/SIGINT, drain.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::Context;
use clap::{CommandFactory, Parser};
use lunakv_master::{Listeners, MasterConfig, MasterConfigSources};

/// The lunakv master: placement and metadata for the KV-cache pool (Mooncake-compatible flags).
#[derive(Debug, Parser)]
#[command(name = "lunakv-master", version)]
struct Cli {
    /// master.yaml (llm-d's keys); flags override it, environment LUNAKV_MASTER_<KEY> sits between.
    #[arg(long, alias = "config_path")]
    config: Option<PathBuf>,
    /// gRPC port [default: 50051].
    #[arg(long = "rpc_port", visible_alias = "port")]
    rpc_port: Option<u16>,
    /// Address both listeners bind [default: 127.0.0.1; upstream binds 0.0.0.0].
    #[arg(long = "rpc_address")]
    rpc_address: Option<String>,
    /// Admin + Prometheus HTTP port [default: 9003].
    #[arg(long = "metrics_port")]
    metrics_port: Option<u16>,
    /// Address the admin + Prometheus listener binds [default: rpc_address].
    #[arg(long = "metrics_host")]
    metrics_host: Option<String>,
    /// Lease granted on reads, ms [default: 5000].
    #[arg(long = "default_kv_lease_ttl")]
    default_kv_lease_ttl: Option<u64>,
    /// Soft pin duration, ms [default: 1800000].
    #[arg(long = "default_kv_soft_pin_ttl")]
    default_kv_soft_pin_ttl: Option<u64>,
    /// Longest soft pin, ms [default: 86400000].
    #[arg(long = "max_kv_soft_pin_ttl")]
    max_kv_soft_pin_ttl: Option<u64>,
    /// Share of capacity one eviction pass frees [default: 0.05].
    #[arg(long = "eviction_ratio")]
    eviction_ratio: Option<f64>,
    /// Usage share that starts eviction [default: 0.95].
    #[arg(long = "eviction_high_watermark_ratio")]
    eviction_high_watermark_ratio: Option<f64>,
    /// Seconds of silence before a client is declared dead [default: 10].
    #[arg(long = "client_ttl")]
    client_ttl: Option<u64>,
    /// Cluster name [default: mooncake_cluster].
    #[arg(long = "cluster_id")]
    cluster_id: Option<String>,
    /// Seconds before a put never ended stops holding its key [default: 30].
    #[arg(long = "put_start_discard_timeout_sec")]
    put_start_discard_timeout_sec: Option<u64>,
    /// Seconds before such a put's space is reused [default: 600].
    #[arg(long = "put_start_release_timeout_sec")]
    put_start_release_timeout_sec: Option<u64>,
    /// Directory of the embedded metadata file [default: ./lunakv-master-data].
    #[arg(long = "data_dir")]
    data_dir: Option<PathBuf>,
    /// SSD tier: let offloading store-clients mount; evictions move objects to their disk.
    #[arg(long = "enable_offload", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    enable_offload: Option<bool>,
    /// SSD tier: a get of a disk-only object also promotes it back to the owner's DRAM.
    #[arg(long = "promotion_on_hit", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    promotion_on_hit: Option<bool>,
    /// Keys a client must put in a vLLM key namespace before the cross-instance sharing rule
    /// counts it [default: 64].
    #[arg(long = "namespace_min_keys")]
    namespace_min_keys: Option<u64>,
    /// Most objects the index may hold; the least recently used go at the limit (0 = no
    /// limit) [default: 50000000].
    #[arg(long = "max_keys")]
    max_keys: Option<u64>,
    /// Share of the pool one client may hold reserved by unfinished puts [default: 0.5].
    #[arg(long = "put_reservation_limit_ratio")]
    put_reservation_limit_ratio: Option<f64>,
    /// HA: campaign for leadership in etcd; standbys redirect clients to the leader.
    #[arg(long = "enable_ha", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    enable_ha: Option<bool>,
    /// etcd endpoints for HA, ";"-separated: "h1:2379;h2:2379" (etcd:// accepted).
    #[arg(long = "etcd_endpoints", alias = "ha_backend_connstring")]
    etcd_endpoints: Option<String>,
    /// HA backend [default: etcd; the only one implemented].
    #[arg(long = "ha_backend_type")]
    ha_backend_type: Option<String>,
    /// Host published in etcd for clients to dial [default: rpc_address].
    #[arg(long = "advertise_address")]
    advertise_address: Option<String>,
    /// HA: TTL of the leader's etcd lease in seconds; bounds failover when a leader's host
    /// dies [default: 2, etcd's smallest].
    #[arg(long = "ha_lease_ttl_sec")]
    ha_lease_ttl_sec: Option<u64>,
    /// HA: standbys revoke the lease of a leader whose RPC port refuses connections (its
    /// process is gone) instead of waiting for it to expire [default: true].
    #[arg(long = "ha_fast_takeover", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    ha_fast_takeover: Option<bool>,
    /// KV events: publish the pool's block changes on ZMQ (docs/EVENTS.md) [default: false].
    /// `--enable_kv_events` is upstream's newer name.
    #[arg(long = "enable_kv_event_publish", visible_alias = "enable_kv_events", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    enable_kv_event_publish: Option<bool>,
    /// KV events: PUB endpoint of the Mooncake-format stream [default: tcp://127.0.0.1:19997].
    #[arg(long = "kv_event_publisher_endpoint")]
    kv_event_publisher_endpoint: Option<String>,
    /// KV events: ROUTER endpoint answering replay requests [default: none].
    #[arg(long = "kv_event_publisher_replay_endpoint")]
    kv_event_publisher_replay_endpoint: Option<String>,
    /// KV events: topic frame [default: mooncake].
    #[arg(long = "kv_event_publisher_topic")]
    kv_event_publisher_topic: Option<String>,
    /// KV events: ZMQ send high-water mark per subscriber, messages [default: 100000].
    #[arg(long = "kv_event_publisher_hwm")]
    kv_event_publisher_hwm: Option<u64>,
    /// KV events: most events per batch [default: 50].
    #[arg(long = "kv_event_publisher_max_batch_size")]
    kv_event_publisher_max_batch_size: Option<u64>,
    /// KV events: events queued for the publisher; more are dropped and counted [default: 100000].
    #[arg(long = "kv_event_publisher_max_queue_size")]
    kv_event_publisher_max_queue_size: Option<u64>,
    /// KV events: batches kept for replay [default: 10000].
    #[arg(long = "kv_event_publisher_buffer_steps")]
    kv_event_publisher_buffer_steps: Option<u64>,
    /// KV events: tokens per block reported in events [default: 0 = unknown].
    #[arg(long = "kv_event_block_size")]
    kv_event_block_size: Option<u64>,
    /// KV events: vLLM-format stream endpoint; bound with a wildcard, else connected [default: off].
    #[arg(long = "kv_events_vllm_endpoint")]
    kv_events_vllm_endpoint: Option<String>,
    /// KV events: serving pods (address:port, comma-separated) the vLLM stream speaks for.
    #[arg(long = "kv_events_vllm_pods")]
    kv_events_vllm_pods: Option<String>,
    /// KV events: vLLM stream medium of the pool's DRAM [default: lunakv_dram].
    #[arg(long = "kv_events_vllm_medium_dram")]
    kv_events_vllm_medium_dram: Option<String>,
    /// KV events: vLLM stream medium of the SSD tier [default: lunakv_ssd].
    #[arg(long = "kv_events_vllm_medium_ssd")]
    kv_events_vllm_medium_ssd: Option<String>,
}

impl Cli {
    fn flags(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut add = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                out.push((k.to_string(), v));
            }
        };
        let s = |v: &Option<u64>| v.map(|v| v.to_string());
        add("rpc_port", self.rpc_port.map(|v| v.to_string()));
        add("rpc_address", self.rpc_address.clone());
        add("metrics_port", self.metrics_port.map(|v| v.to_string()));
        add("metrics_host", self.metrics_host.clone());
        add("default_kv_lease_ttl", s(&self.default_kv_lease_ttl));
        add("default_kv_soft_pin_ttl", s(&self.default_kv_soft_pin_ttl));
        add("max_kv_soft_pin_ttl", s(&self.max_kv_soft_pin_ttl));
        add("eviction_ratio", self.eviction_ratio.map(|v| v.to_string()));
        let wm = self.eviction_high_watermark_ratio.map(|v| v.to_string());
        add("eviction_high_watermark_ratio", wm);
        add("client_ttl", s(&self.client_ttl));
        add("cluster_id", self.cluster_id.clone());
        add(
            "put_start_discard_timeout_sec",
            s(&self.put_start_discard_timeout_sec),
        );
        add(
            "put_start_release_timeout_sec",
            s(&self.put_start_release_timeout_sec),
        );
        add(
            "data_dir",
            self.data_dir.as_ref().map(|p| p.display().to_string()),
        );
        add("enable_offload", self.enable_offload.map(|v| v.to_string()));
        add(
            "promotion_on_hit",
            self.promotion_on_hit.map(|v| v.to_string()),
        );
        add("namespace_min_keys", s(&self.namespace_min_keys));
        add("max_keys", s(&self.max_keys));
        add(
            "put_reservation_limit_ratio",
            self.put_reservation_limit_ratio.map(|v| v.to_string()),
        );
        add("enable_ha", self.enable_ha.map(|v| v.to_string()));
        add("etcd_endpoints", self.etcd_endpoints.clone());
        add("ha_backend_type", self.ha_backend_type.clone());
        add("advertise_address", self.advertise_address.clone());
        add("ha_lease_ttl_sec", s(&self.ha_lease_ttl_sec));
        add(
            "ha_fast_takeover",
            self.ha_fast_takeover.map(|v| v.to_string()),
        );
        add(
            "enable_kv_event_publish",
            self.enable_kv_event_publish.map(|v| v.to_string()),
        );
        for (k, v) in [
            (
                "kv_event_publisher_endpoint",
                &self.kv_event_publisher_endpoint,
            ),
            (
                "kv_event_publisher_replay_endpoint",
                &self.kv_event_publisher_replay_endpoint,
            ),
            ("kv_event_publisher_topic", &self.kv_event_publisher_topic),
            ("kv_events_vllm_endpoint", &self.kv_events_vllm_endpoint),
            ("kv_events_vllm_pods", &self.kv_events_vllm_pods),
            (
                "kv_events_vllm_medium_dram",
                &self.kv_events_vllm_medium_dram,
            ),
            ("kv_events_vllm_medium_ssd", &self.kv_events_vllm_medium_ssd),
        ] {
            add(k, v.clone());
        }
        for (k, v) in [
            ("kv_event_publisher_hwm", &self.kv_event_publisher_hwm),
            (
                "kv_event_publisher_max_batch_size",
                &self.kv_event_publisher_max_batch_size,
            ),
            (
                "kv_event_publisher_max_queue_size",
                &self.kv_event_publisher_max_queue_size,
            ),
            (
                "kv_event_publisher_buffer_steps",
                &self.kv_event_publisher_buffer_steps,
            ),
            ("kv_event_block_size", &self.kv_event_block_size),
        ] {
            add(k, s(v));
        }
        out
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Upstream's command lines are gflags (`-rpc_port=50051`, `--noenable_ha`): docs/FLAGS.md.
    let argv = lunakv_config::gflags::normalize(
        &Cli::command(),
        lunakv_config::master::UPSTREAM_KEYS,
        std::env::args_os(),
    )?;
    let cli = Cli::parse_from(&argv.args);
    // Held until main returns: dropping it flushes the spans still queued (docs/TRACING.md).
    let _telemetry = lunakv_telemetry::init("lunakv-master");
    for w in argv.warnings() {
        tracing::warn!("{w}");
    }
    let sources = MasterConfigSources {
        file: cli.config.clone(),
        flags: cli.flags(),
    };
    let loaded = MasterConfig::load(&sources, &lunakv_config::process_env)
        .context("invalid master configuration")?;
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let cfg = loaded.config;
    let listeners = Listeners::bind(&cfg).await?;
    lunakv_master::serve(
        cfg,
        listeners,
        lunakv_telemetry::shutdown_signal("lunakv-master"),
    )
    .await?;
    Ok(())
}
