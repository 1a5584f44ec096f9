//! The master's configuration: Mooncake's `mooncake_master` flags and llm-d's `master.yaml` keys,
//! under upstream's names, plus lunakv's own (`data_dir`, `enable_offload`).
//!
//! Layers, lowest first: built-in defaults < `master.yaml` (`--config`) < environment
//! (`LUNAKV_MASTER_<KEY>`, e.g. `LUNAKV_MASTER_RPC_PORT=50052`) < command-line flags. Every layer
//! speaks the same key names. A key nobody knows is an error naming it and the closest valid
//! keys; keys upstream has but lunakv does not implement (HA, the HTTP metadata server, ...) are
//! accepted and reported back as warnings for the caller to log. [`MasterConfig::validate`] then
//! checks ranges with messages that name the field, the value and the fix.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::gflags::{Upstream, UpstreamFlag};

/// Prefix of the environment variables that set master keys.
pub const ENV_PREFIX: &str = "LUNAKV_MASTER_";

/// The master's settings. Durations carry their unit in the name, as upstream's do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MasterConfig {
    /// gRPC port (upstream `--rpc_port`, alias `--port`).
    pub rpc_port: u16,
    /// Address both listeners bind. lunakv defaults to loopback, where upstream binds 0.0.0.0:
    /// the master API has no authentication, so exposing it must be a deliberate choice
    /// (set `0.0.0.0` in a pod, where the network policy is the boundary).
    pub rpc_address: String,
    /// Admin and Prometheus HTTP port.
    pub metrics_port: u16,
    /// Address the admin/metrics listener binds (upstream `--metrics_host`). Default (empty):
    /// `rpc_address`. Lets a pod keep its API on the pod IP and its scrape port elsewhere.
    pub metrics_host: String,
    /// Lease granted by GetReplicaList / ExistKey, in milliseconds (llm-d's master.yaml: 5000).
    pub default_kv_lease_ttl: u64,
    /// Soft-pin duration for puts that ask for one, in milliseconds.
    pub default_kv_soft_pin_ttl: u64,
    /// Upper bound on any soft pin, in milliseconds.
    pub max_kv_soft_pin_ttl: u64,
    /// Share of total capacity freed by one eviction pass.
    pub eviction_ratio: f64,
    /// Usage share at which background eviction starts.
    pub eviction_high_watermark_ratio: f64,
    /// Seconds without a Ping after which a client is declared dead.
    pub client_ttl: u64,
    /// Cluster name; mounts from another cluster are refused.
    pub cluster_id: String,
    /// Seconds after which a put started and never ended stops holding its key.
    pub put_start_discard_timeout_sec: u64,
    /// Seconds after which the space of such a put is given back (it may still be written
    /// until then).
    pub put_start_release_timeout_sec: u64,
    /// lunakv: directory of the embedded metadata file (`meta.redb`).
    pub data_dir: PathBuf,
    /// SSD tier (upstream `--enable_offload`): store-clients that offload may mount, and objects
    /// evicted from their DRAM move to their disk instead of being dropped (docs/OFFLOAD.md).
    pub enable_offload: bool,
    /// Upstream `--promotion_on_hit`: a get of a disk-only object also brings it back into the
    /// owner's DRAM.
    pub promotion_on_hit: bool,
    /// Upstream `--promotion_admission_threshold`: reads a disk-only object takes before it is
    /// promoted, 1..=255 (upstream counts in a count-min sketch; lunakv counts each object
    /// exactly, so a cold key never rides on a hot one's count).
    pub promotion_admission_threshold: u32,
    /// Upstream `--promotion_queue_limit`: promotions reserved and not yet confirmed; past it a
    /// hit does not promote (the next one tries again).
    pub promotion_queue_limit: u64,
    /// lunakv: keys a client must put in one vLLM key namespace before the cross-instance rule
    /// counts it; two such clients that never share a key flag the namespace (`lunakv doctor`).
    pub namespace_min_keys: u64,
    /// lunakv: most objects the index may hold (0 = no limit). At the limit the least recently
    /// used ones are dropped and, if none can be, puts are refused: the master's memory is
    /// bounded (~530 B per vLLM-shaped key) instead of growing until it is killed.
    pub max_keys: u64,
    /// lunakv: share of the pool's capacity one client may hold reserved by puts it started and
    /// has not ended; a PutStart past it is refused, so one stuck writer cannot block every put.
    pub put_reservation_limit_ratio: f64,
    /// lunakv: share of the pool's capacity all unfinished puts together may hold reserved; a
    /// PutStart past it is refused, so callers at many addresses cannot pin the whole pool.
    pub put_reservation_total_ratio: f64,
    /// lunakv: how long (ms) another holder's unfinished put must have been started before a
    /// PutStart that finds no room may reclaim it (free it through its owner, which then
    /// refuses the zombie's late writes): attackers at many addresses cannot pin the pool
    /// until the discard timeout, and a live writer gets this long to end its put.
    pub put_reclaim_grace_ms: u64,
    /// lunakv: share of the pool's capacity one PutStart may evict to make room for itself; a
    /// put that needs more is refused, so one pool-sized put cannot empty the pool.
    pub put_eviction_limit_ratio: f64,
    /// lunakv: a drain job's default rate, in bytes its moves may copy per second (a request's
    /// `max_bytes_per_sec` overrides it; 0: unbounded), so a drain does not starve gets.
    pub drain_max_bytes_per_sec: u64,
    /// lunakv: which objects eviction takes first: `cslru` (default; a chain-aware segmented
    /// LRU with a ghost table, docs/BENCH.md "Hits on real traffic") or `lru` (upstream's: the
    /// least recently used `eviction_ratio` of the pool at the high watermark).
    pub eviction_policy: String,
    /// Upstream `--allocation_strategy`: how a new object's replicas pick their segments among
    /// those with room for it: `random` (upstream's default) or `free_ratio_first` (the
    /// emptiest first, so stores of different sizes fill evenly). See [`AllocationStrategy`].
    pub allocation_strategy: String,
    /// lunakv: how long a segment that joins a pool of settled segments ramps up, in ms (0 =
    /// off). While it ramps, it takes at most `max(1/segments, elapsed/ramp)` of new puts, the
    /// others making room by eviction as a full pool does, so a restarted store does not attract
    /// every put at once (upstream MC#3688: the emptiest segment takes them all).
    pub placement_ramp_ms: u64,
    /// Upstream `--enable_multi_tenants`: admit every tenant's puts against its quota from the
    /// tenant policy, and refuse tenants the policy does not name (docs/TENANTS.md). Without
    /// it tenants still have their own key namespaces and usage, but no quota.
    pub enable_multi_tenants: bool,
    /// Upstream `--tenant_quota_connector_type`: where the tenant policy lives. `file` only.
    pub tenant_quota_connector_type: String,
    /// Upstream `--tenant_quota_connector_uri`: the policy file (upstream's YAML schema,
    /// `version: 1`, `tenants: [{name, quota}]`); the admin API writes its changes back to it.
    pub tenant_quota_connector_uri: String,
    /// HA (upstream `--enable_ha`): campaign for leadership in etcd; followers redirect clients.
    pub enable_ha: bool,
    /// etcd client endpoints, `;`-separated as upstream (`h1:2379;h2:2379`; `etcd://` accepted).
    pub etcd_endpoints: String,
    /// HA backend (upstream `--ha_backend_type`); only `etcd` is implemented.
    pub ha_backend_type: String,
    /// lunakv: the host published in the leader key for clients to dial, when `rpc_address` is
    /// a wildcard (0.0.0.0 / ::). Default: `rpc_address`.
    pub advertise_address: String,
    /// lunakv: TTL of the leader's etcd lease in seconds. It bounds failover when a leader's
    /// host dies or is cut off; 2 s is etcd's smallest lease with its default
    /// `--heartbeat-interval`/`--election-timeout` (a smaller request is raised to it).
    pub ha_lease_ttl_sec: u64,
    /// lunakv: standbys dial the leader's RPC port; when it refuses connections (its process is
    /// gone, the host is up) they revoke its lease at once instead of waiting for it to expire.
    /// Turn off where master-to-master traffic is rejected with a TCP reset by policy.
    pub ha_fast_takeover: bool,
    /// lunakv: standbys keep a warm copy of the leader's index (streamed from it), so a new
    /// leader answers reads before the owners' remounts. Off by default: it measured faster
    /// reads but a slower rebuild (docs/HA.md, "Warm standby").
    pub ha_warm_standby: bool,
    /// KV events (upstream `--enable_kv_event_publish`; `--enable_kv_events` is accepted as a
    /// flag alias): publish the index's changes on a ZMQ PUB socket (docs/EVENTS.md).
    pub enable_kv_event_publish: bool,
    /// Upstream `--kv_event_publisher_endpoint`: the PUB socket the Mooncake-format stream binds.
    /// Upstream binds `tcp://*:19997`; lunakv binds loopback unless told otherwise, like its
    /// other listeners. `tcp://host:*` takes any free port (the master prints it).
    pub kv_event_publisher_endpoint: String,
    /// Upstream `--kv_event_publisher_replay_endpoint`: the ROUTER socket answering replay
    /// requests; empty = no replay.
    pub kv_event_publisher_replay_endpoint: String,
    /// Upstream `--kv_event_publisher_topic`: the first frame of every message.
    pub kv_event_publisher_topic: String,
    /// Upstream `--kv_event_publisher_hwm`: ZMQ send high-water mark per subscriber, in
    /// messages; a subscriber that far behind loses batches (and sees the gap).
    pub kv_event_publisher_hwm: u64,
    /// Upstream `--kv_event_publisher_max_batch_size`: most events per message.
    pub kv_event_publisher_max_batch_size: u64,
    /// Upstream's publisher `max_queue_size`: events waiting for the publisher thread; more are
    /// dropped and counted (`master_kv_events_dropped_total{reason="queue_full"}`).
    pub kv_event_publisher_max_queue_size: u64,
    /// Upstream's publisher `buffer_steps`: batches kept for replay.
    pub kv_event_publisher_buffer_steps: u64,
    /// lunakv: tokens per block reported in the events' `block_size` (0 = not known; the put
    /// does not carry it).
    pub kv_event_block_size: u64,
    /// lunakv: a second stream in vLLM's KV-event format (for llm-d's KV-cache indexer). Empty
    /// = off. Bound when it has a wildcard (`tcp://*:5557`), connected otherwise (llm-d's
    /// central mode: the scheduler binds, publishers connect).
    pub kv_events_vllm_endpoint: String,
    /// lunakv: comma-separated `address:port` of the serving pods that can load from this
    /// pool; the vLLM stream announces pool blocks on `kv@<pod>@<model>` for each. A
    /// `name:port` (a headless Service) stands for every address the name resolves to, resolved
    /// again every 10 s.
    pub kv_events_vllm_pods: String,
    /// lunakv: the vLLM stream's `medium` of a block in the pool's DRAM / in its SSD tier
    /// (vLLM's own names: `CPU` for host memory, `STORAGE` for disk).
    pub kv_events_vllm_medium_dram: String,
    pub kv_events_vllm_medium_ssd: String,
    /// lunakv: the vLLM stream's encoding: `tagged` (today's vLLM: each event a map tagged by
    /// its class name) or `array` (older vLLM: each event a positional array).
    pub kv_events_vllm_format: String,
    /// lunakv: the vLLM stream's block hashes as vLLM's default
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` sends them (the hash's last 8 bytes as an
    /// unsigned int); false = the key's hash bytes as they are.
    pub kv_events_vllm_int_hashes: bool,
    /// lunakv: the vLLM stream's `ownership` of the pool's blocks (vLLM: the secondary
    /// offloading tier that generated the event); empty = not sent. `tagged` format only.
    pub kv_events_vllm_ownership: String,
    /// lunakv: the model name the vLLM stream's topics carry (`kv@<pod>@<model>`), as the
    /// engine serves it (`--served-model-name`). Empty: the key's model component (the last
    /// path component of the model, `Qwen3-8B` for `Qwen/Qwen3-8B`). One name applies to every
    /// key; `key_model=served` pairs, comma-separated, map each key model.
    pub kv_events_vllm_served_model_name: String,
    /// lunakv: the Mooncake stream's encoding: `rfc1527` (upstream main's master publisher:
    /// one msgpack map per object and medium) or `array` (the older dev-branch form:
    /// `BlockStoreEvent` / `BlockUpdateEvent` / `RemoveAllEvent` arrays).
    pub kv_events_mooncake_format: String,
    /// Upstream main's `--kv_events_bind_endpoint`: where the Mooncake stream binds; when set
    /// it replaces `kv_event_publisher_endpoint`.
    pub kv_events_bind_endpoint: String,
    /// Upstream main's `--kv_events_backend_id`: the cache owner named by every `rfc1527`
    /// event's `backend_id`. Empty: `cluster_id` (the pool is the owner).
    pub kv_events_backend_id: String,
    /// Upstream main's `--kv_events_emit_legacy_compat`: `rfc1527` events also carry vLLM's
    /// field names (`type`, `block_hashes`, `parent_block_hash`).
    pub kv_events_emit_legacy_compat: bool,
    /// Upstream main's `--kv_events_emit_object_key`: `rfc1527` events carry `object_key`.
    /// Off, an event whose key is not a decimal or `0x` hash names no block and is not sent.
    pub kv_events_emit_object_key: bool,
    /// Upstream main's `--kv_events_queue_capacity`: events waiting for the publisher, a
    /// second bound next to `kv_event_publisher_max_queue_size` (the smaller applies; 0 = no
    /// bound from this key, the master's memory stays bounded by the other).
    pub kv_events_queue_capacity: u64,
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            rpc_port: 50051,
            rpc_address: "127.0.0.1".to_string(),
            metrics_port: 9003,
            metrics_host: String::new(),
            default_kv_lease_ttl: 5000,
            default_kv_soft_pin_ttl: 1_800_000,
            max_kv_soft_pin_ttl: 86_400_000,
            eviction_ratio: 0.05,
            eviction_high_watermark_ratio: 0.95,
            client_ttl: 10,
            cluster_id: "mooncake_cluster".to_string(),
            put_start_discard_timeout_sec: 30,
            put_start_release_timeout_sec: 600,
            data_dir: PathBuf::from("./lunakv-master-data"),
            enable_offload: false,
            promotion_on_hit: false,
            promotion_admission_threshold: 2,
            promotion_queue_limit: 50_000,
            namespace_min_keys: 64,
            max_keys: 50_000_000,
            put_reservation_limit_ratio: 0.5,
            put_reservation_total_ratio: 0.75,
            put_reclaim_grace_ms: 1000,
            put_eviction_limit_ratio: 0.1,
            drain_max_bytes_per_sec: 1 << 30,
            eviction_policy: "cslru".to_string(),
            allocation_strategy: "random".to_string(),
            placement_ramp_ms: 30_000,
            enable_multi_tenants: false,
            tenant_quota_connector_type: "file".to_string(),
            tenant_quota_connector_uri: String::new(),
            enable_ha: false,
            etcd_endpoints: String::new(),
            ha_backend_type: "etcd".to_string(),
            advertise_address: String::new(),
            ha_lease_ttl_sec: 2,
            ha_fast_takeover: true,
            ha_warm_standby: false,
            enable_kv_event_publish: false,
            kv_event_publisher_endpoint: "tcp://127.0.0.1:19997".to_string(),
            kv_event_publisher_replay_endpoint: String::new(),
            kv_event_publisher_topic: "mooncake".to_string(),
            kv_event_publisher_hwm: 100_000,
            kv_event_publisher_max_batch_size: 50,
            kv_event_publisher_max_queue_size: 100_000,
            kv_event_publisher_buffer_steps: 10_000,
            kv_event_block_size: 0,
            kv_events_vllm_endpoint: String::new(),
            kv_events_vllm_pods: String::new(),
            kv_events_vllm_medium_dram: "CPU".to_string(),
            kv_events_vllm_medium_ssd: "STORAGE".to_string(),
            kv_events_vllm_format: "tagged".to_string(),
            kv_events_vllm_int_hashes: true,
            kv_events_vllm_ownership: "lunakv".to_string(),
            kv_events_vllm_served_model_name: String::new(),
            kv_events_mooncake_format: "rfc1527".to_string(),
            kv_events_bind_endpoint: String::new(),
            kv_events_backend_id: String::new(),
            kv_events_emit_legacy_compat: true,
            kv_events_emit_object_key: true,
            kv_events_queue_capacity: 65536,
        }
    }
}

/// The master's command line: one `Option` per key of [`MasterConfig`], named as the key, so
/// that serialized it is the flag layer (unset flags leave lower layers alone). A new key
/// adds its field there (with its default) and here.
// The field docs are clap's --help text, shown verbatim: `<KEY>` there is a placeholder.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Debug, Default, clap::Args, Serialize)]
#[command(after_help = crate::security_help::master_help())]
pub struct MasterArgs {
    /// master.yaml (llm-d's keys); flags override it, environment LUNAKV_MASTER_<KEY> sits between.
    #[arg(long, alias = "config_path")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// gRPC port [default: 50051].
    #[arg(long = "rpc_port", visible_alias = "port")]
    pub rpc_port: Option<u16>,
    /// Address both listeners bind [default: 127.0.0.1; upstream binds 0.0.0.0].
    #[arg(long = "rpc_address")]
    pub rpc_address: Option<String>,
    /// Admin + Prometheus HTTP port [default: 9003].
    #[arg(long = "metrics_port")]
    pub metrics_port: Option<u16>,
    /// Address the admin + Prometheus listener binds [default: rpc_address].
    #[arg(long = "metrics_host")]
    pub metrics_host: Option<String>,
    /// Lease granted on reads, ms [default: 5000].
    #[arg(long = "default_kv_lease_ttl")]
    pub default_kv_lease_ttl: Option<u64>,
    /// Soft pin duration, ms [default: 1800000].
    #[arg(long = "default_kv_soft_pin_ttl")]
    pub default_kv_soft_pin_ttl: Option<u64>,
    /// Longest soft pin, ms [default: 86400000].
    #[arg(long = "max_kv_soft_pin_ttl")]
    pub max_kv_soft_pin_ttl: Option<u64>,
    /// Share of capacity one eviction pass frees [default: 0.05].
    #[arg(long = "eviction_ratio")]
    pub eviction_ratio: Option<f64>,
    /// Usage share that starts eviction [default: 0.95].
    #[arg(long = "eviction_high_watermark_ratio")]
    pub eviction_high_watermark_ratio: Option<f64>,
    /// Seconds of silence before a client is declared dead [default: 10].
    #[arg(long = "client_ttl")]
    pub client_ttl: Option<u64>,
    /// Cluster name [default: mooncake_cluster].
    #[arg(long = "cluster_id")]
    pub cluster_id: Option<String>,
    /// Seconds before a put never ended stops holding its key [default: 30].
    #[arg(long = "put_start_discard_timeout_sec")]
    pub put_start_discard_timeout_sec: Option<u64>,
    /// Seconds before such a put's space is reused [default: 600].
    #[arg(long = "put_start_release_timeout_sec")]
    pub put_start_release_timeout_sec: Option<u64>,
    /// Directory of the embedded metadata file [default: ./lunakv-master-data].
    #[arg(long = "data_dir")]
    pub data_dir: Option<PathBuf>,
    /// SSD tier: let offloading store-clients mount; evictions move objects to their disk.
    #[arg(long = "enable_offload", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub enable_offload: Option<bool>,
    /// SSD tier: a get of a disk-only object also promotes it back to the owner's DRAM.
    #[arg(long = "promotion_on_hit", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub promotion_on_hit: Option<bool>,
    /// SSD tier: reads of a disk-only object before it is promoted, 1-255 [default: 2].
    #[arg(long = "promotion_admission_threshold")]
    pub promotion_admission_threshold: Option<u32>,
    /// SSD tier: promotions in flight at most; past it a hit does not promote [default: 50000].
    #[arg(long = "promotion_queue_limit")]
    pub promotion_queue_limit: Option<u64>,
    /// Keys a client must put in a vLLM key namespace before the cross-instance sharing rule
    /// counts it [default: 64].
    #[arg(long = "namespace_min_keys")]
    pub namespace_min_keys: Option<u64>,
    /// Most objects the index may hold; the least recently used go at the limit (0 = no
    /// limit) [default: 50000000].
    #[arg(long = "max_keys")]
    pub max_keys: Option<u64>,
    /// Share of the pool one client may hold reserved by unfinished puts [default: 0.5].
    #[arg(long = "put_reservation_limit_ratio")]
    pub put_reservation_limit_ratio: Option<f64>,
    /// Share of the pool all unfinished puts together may hold reserved [default: 0.75].
    #[arg(long = "put_reservation_total_ratio")]
    pub put_reservation_total_ratio: Option<f64>,
    /// Age (ms) of another caller's unfinished put before a PutStart that finds no room may
    /// reclaim it [default: 1000].
    #[arg(long = "put_reclaim_grace_ms")]
    pub put_reclaim_grace_ms: Option<u64>,
    /// Share of the pool one PutStart may evict to make room for itself [default: 0.1].
    #[arg(long = "put_eviction_limit_ratio")]
    pub put_eviction_limit_ratio: Option<f64>,
    /// Bytes per second a drain job's moves may copy, unless its request says (0: unbounded)
    /// [default: 1073741824].
    #[arg(long = "drain_max_bytes_per_sec")]
    pub drain_max_bytes_per_sec: Option<u64>,
    /// Eviction order: cslru (segmented LRU with ghosts, chain-aware) or lru (upstream's) [default: cslru].
    #[arg(long = "eviction_policy")]
    pub eviction_policy: Option<String>,
    /// Replica placement: random or free_ratio_first (emptiest segments first) [default: random].
    #[arg(long = "allocation_strategy")]
    pub allocation_strategy: Option<String>,
    /// Share of new puts a segment that joins settled ones may take ramps up over this many ms; 0 = off [default: 30000].
    #[arg(long = "placement_ramp_ms")]
    pub placement_ramp_ms: Option<u64>,
    /// Tenants: admit puts against each tenant's quota; unknown tenants are refused [default: false].
    #[arg(long = "enable_multi_tenants", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub enable_multi_tenants: Option<bool>,
    /// Tenants: where the quota policy lives; only "file" [default: file].
    #[arg(long = "tenant_quota_connector_type")]
    pub tenant_quota_connector_type: Option<String>,
    /// Tenants: the quota policy file (YAML: version 1, tenants: [{name, quota}]).
    #[arg(long = "tenant_quota_connector_uri")]
    pub tenant_quota_connector_uri: Option<String>,
    /// HA: campaign for leadership in etcd; standbys redirect clients to the leader.
    #[arg(long = "enable_ha", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub enable_ha: Option<bool>,
    /// etcd endpoints for HA, ";"-separated: "h1:2379;h2:2379" (etcd:// accepted).
    #[arg(long = "etcd_endpoints", alias = "ha_backend_connstring")]
    pub etcd_endpoints: Option<String>,
    /// HA backend [default: etcd; the only one implemented].
    #[arg(long = "ha_backend_type")]
    pub ha_backend_type: Option<String>,
    /// Host published in etcd for clients to dial [default: rpc_address].
    #[arg(long = "advertise_address")]
    pub advertise_address: Option<String>,
    /// HA: TTL of the leader's etcd lease in seconds; bounds failover when a leader's host
    /// dies [default: 2, etcd's smallest].
    #[arg(long = "ha_lease_ttl_sec")]
    pub ha_lease_ttl_sec: Option<u64>,
    /// HA: standbys revoke the lease of a leader whose RPC port refuses connections (its
    /// process is gone) instead of waiting for it to expire [default: true].
    #[arg(long = "ha_fast_takeover", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub ha_fast_takeover: Option<bool>,
    /// HA: standbys keep a warm copy of the leader's index, so a new leader answers reads
    /// before the owners remount [default: false].
    #[arg(long = "ha_warm_standby", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub ha_warm_standby: Option<bool>,
    /// KV events: publish the pool's block changes on ZMQ (docs/EVENTS.md) [default: false].
    /// `--enable_kv_events` is upstream's newer name.
    #[arg(long = "enable_kv_event_publish", visible_alias = "enable_kv_events", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub enable_kv_event_publish: Option<bool>,
    /// KV events: PUB endpoint of the Mooncake-format stream [default: tcp://127.0.0.1:19997].
    #[arg(long = "kv_event_publisher_endpoint")]
    pub kv_event_publisher_endpoint: Option<String>,
    /// KV events: ROUTER endpoint answering replay requests [default: none].
    #[arg(long = "kv_event_publisher_replay_endpoint")]
    pub kv_event_publisher_replay_endpoint: Option<String>,
    /// KV events: topic frame [default: mooncake].
    #[arg(long = "kv_event_publisher_topic")]
    pub kv_event_publisher_topic: Option<String>,
    /// KV events: ZMQ send high-water mark per subscriber, messages [default: 100000].
    #[arg(long = "kv_event_publisher_hwm")]
    pub kv_event_publisher_hwm: Option<u64>,
    /// KV events: most events per batch [default: 50].
    #[arg(long = "kv_event_publisher_max_batch_size")]
    pub kv_event_publisher_max_batch_size: Option<u64>,
    /// KV events: events queued for the publisher; more are dropped and counted [default: 100000].
    #[arg(long = "kv_event_publisher_max_queue_size")]
    pub kv_event_publisher_max_queue_size: Option<u64>,
    /// KV events: batches kept for replay [default: 10000].
    #[arg(long = "kv_event_publisher_buffer_steps")]
    pub kv_event_publisher_buffer_steps: Option<u64>,
    /// KV events: tokens per block reported in events [default: 0 = unknown].
    #[arg(long = "kv_event_block_size")]
    pub kv_event_block_size: Option<u64>,
    /// KV events: vLLM-format stream endpoint; bound with a wildcard, else connected [default: off].
    #[arg(long = "kv_events_vllm_endpoint")]
    pub kv_events_vllm_endpoint: Option<String>,
    /// KV events: serving pods (address:port, or a name:port resolved every 10 s, comma-separated)
    /// the vLLM stream speaks for.
    #[arg(long = "kv_events_vllm_pods")]
    pub kv_events_vllm_pods: Option<String>,
    /// KV events: vLLM stream medium of the pool's DRAM [default: CPU].
    #[arg(long = "kv_events_vllm_medium_dram")]
    pub kv_events_vllm_medium_dram: Option<String>,
    /// KV events: vLLM stream medium of the SSD tier [default: STORAGE].
    #[arg(long = "kv_events_vllm_medium_ssd")]
    pub kv_events_vllm_medium_ssd: Option<String>,
    /// KV events: vLLM stream encoding, tagged (today's vLLM) or array (older vLLM, positional) [default: tagged].
    #[arg(long = "kv_events_vllm_format")]
    pub kv_events_vllm_format: Option<String>,
    /// KV events: vLLM stream hashes as ints (the last 8 bytes), as vLLM's default [default: true].
    #[arg(long = "kv_events_vllm_int_hashes", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub kv_events_vllm_int_hashes: Option<bool>,
    /// KV events: vLLM stream ownership of the pool's blocks; empty = not sent [default: lunakv].
    #[arg(long = "kv_events_vllm_ownership")]
    pub kv_events_vllm_ownership: Option<String>,
    /// KV events: the served model name in the vLLM stream's topics, or key_model=served pairs
    /// [default: the key's model component].
    #[arg(long = "kv_events_vllm_served_model_name")]
    pub kv_events_vllm_served_model_name: Option<String>,
    /// KV events: Mooncake stream encoding, rfc1527 (upstream main) or array (older) [default: rfc1527].
    #[arg(long = "kv_events_mooncake_format")]
    pub kv_events_mooncake_format: Option<String>,
    /// KV events (upstream main): PUB bind endpoint of the Mooncake stream; replaces
    /// kv_event_publisher_endpoint when set.
    #[arg(long = "kv_events_bind_endpoint")]
    pub kv_events_bind_endpoint: Option<String>,
    /// KV events (upstream main): backend_id of rfc1527 events [default: cluster_id].
    #[arg(long = "kv_events_backend_id")]
    pub kv_events_backend_id: Option<String>,
    /// KV events (upstream main): add vLLM's type/block_hashes names to rfc1527 events [default: true].
    #[arg(long = "kv_events_emit_legacy_compat", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub kv_events_emit_legacy_compat: Option<bool>,
    /// KV events (upstream main): add object_key to rfc1527 events [default: true].
    #[arg(long = "kv_events_emit_object_key", num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub kv_events_emit_object_key: Option<bool>,
    /// KV events (upstream main): most queued events; 0 = only kv_event_publisher_max_queue_size
    /// bounds the queue [default: 65536].
    #[arg(long = "kv_events_queue_capacity")]
    pub kv_events_queue_capacity: Option<u64>,
}

impl MasterArgs {
    /// The layers these flags name: the file, and every flag given, by key.
    pub fn sources(&self) -> MasterConfigSources {
        MasterConfigSources {
            file: self.config.clone(),
            flags: crate::layered::flags_of(self),
        }
    }
}

/// Upstream `mooncake_master` flags and config keys lunakv does not define: each is ignored
/// with the reason (in the file, the environment or on the command line) or refused with the
/// fix. Read from upstream's master.cpp; lunakv's own keys are `KEYS`.
pub const UPSTREAM_KEYS: &[UpstreamFlag] = &[
    ignored("max_threads", false, THREADS),
    ignored("rpc_thread_num", false, THREADS),
    ignored(
        "enable_metric_reporting",
        true,
        "metrics are always served on metrics_port (/metrics)",
    ),
    ignored(
        "rpc_conn_timeout_seconds",
        false,
        "gRPC connections are HTTP/2 and closed by the client or by keepalive",
    ),
    ignored(
        "rpc_enable_tcp_no_delay",
        true,
        "the gRPC server always sets TCP_NODELAY",
    ),
    ignored(
        "memory_allocator",
        false,
        "each segment has one offset allocator; there is no cachelib",
    ),
    ignored("enable_http_metadata_server", true, NO_METADATA_SERVER),
    ignored("http_metadata_server_port", false, NO_METADATA_SERVER),
    ignored("http_metadata_server_host", false, NO_METADATA_SERVER),
    ignored("root_fs_dir", false, SSD_ON_STORES),
    ignored("global_file_segment_size", false, SSD_ON_STORES),
    ignored("enable_disk_eviction", true, SSD_ON_STORES),
    ignored("quota_bytes", false, SSD_ON_STORES),
    ignored(
        "offload_on_evict",
        true,
        "evicted objects always go to the SSD tier when enable_offload is on",
    ),
    ignored("offloading_queue_limit", false, SSD_ON_STORES),
    ignored(
        "allow_evict_soft_pinned_objects",
        true,
        "soft-pinned objects are evicted last, after every unpinned one",
    ),
    ignored("enable_snapshot", true, NO_SNAPSHOTS),
    ignored("snapshot_interval_seconds", false, NO_SNAPSHOTS),
    ignored("snapshot_child_timeout_seconds", false, NO_SNAPSHOTS),
    ignored("snapshot_retention_count", false, NO_SNAPSHOTS),
    ignored("snapshot_backup_dir", false, NO_SNAPSHOTS),
    ignored("snapshot_object_store_type", false, NO_SNAPSHOTS),
    ignored("snapshot_payload_store_type", false, NO_SNAPSHOTS),
    ignored("snapshot_payload_backend_type", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_store_type", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_backend_type", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_store_connstring", false, NO_SNAPSHOTS),
    ignored("snapshot_catalog_backend_connstring", false, NO_SNAPSHOTS),
    refused(
        "enable_snapshot_restore",
        true,
        "the index is rebuilt from the store-clients' inventories when a master starts; there is no snapshot to restore",
    ),
    ignored("max_total_finished_tasks", false, NO_TASKS),
    ignored("max_total_pending_tasks", false, NO_TASKS),
    ignored("max_total_processing_tasks", false, NO_TASKS),
    ignored("pending_task_timeout_sec", false, NO_TASKS),
    ignored("processing_task_timeout_sec", false, NO_TASKS),
    ignored("max_retry_attempts", false, NO_TASKS),
    refused(
        "rpc_interface",
        false,
        "resolve the interface's IPv4 address and pass it as --rpc_address (in a pod: --rpc_address=$(POD_IP))",
    ),
    refused("enable_cxl", true, NO_CXL),
    refused("cxl_path", false, NO_CXL),
    refused("cxl_size", false, NO_CXL),
    ignored(
        "kv_event_publisher_send_interval_ms",
        false,
        "lunakv sends each KV event batch as soon as it is drained (docs/EVENTS.md)",
    ),
    ignored(
        "kv_event_publisher_auto_port",
        true,
        "lunakv binds the KV event port it is given; a taken port is a startup error naming it, not a silent move to a port no subscriber knows",
    ),
    // Upstream flags added by mid-2026 (master.cpp at 3b5a594).
    ignored("enable_oplog", true, NO_OPLOG),
    ignored("oplog_poll_interval_ms", false, NO_OPLOG),
    ignored("oplog_batch_max_entries", false, NO_OPLOG),
    ignored("batch_oplog_retry_timeout_sec", false, NO_OPLOG),
    UpstreamFlag {
        name: "dynamic_replication_mode",
        boolean: false,
        treatment: Upstream::OnlyValue {
            value: "off",
            fix: "lunakv places replica_num replicas when an object is put; there is no dynamic fan-out of hot objects",
        },
    },
    ignored("dynamic_replication_heat_window_seconds", false, NO_DYNAMIC),
    ignored("kv_events_additional_salt", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_block_size", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_dp_rank", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_lora_name", false, DEPRECATED_EVENT_FIELD),
    ignored("kv_events_model_name", false, DEPRECATED_EVENT_FIELD),
    ignored(
        "kv_events_tenant_id",
        false,
        "deprecated upstream (each event carries its object's tenant there); lunakv's streams carry the default tenant's keys only (docs/TENANTS.md)",
    ),
    ignored("nof_eviction_high_watermark_ratio", false, NO_NOF),
    ignored("nof_eviction_ratio", false, NO_NOF),
    ignored("nof_heartbeat_interval_sec", false, NO_NOF),
    ignored("nof_heartbeat_probe_timeout_ms", false, NO_NOF),
    ignored("offload_cap_ratio", false, NO_OFFLOAD_QUEUE),
    ignored("offload_force_evict", true, NO_OFFLOAD_QUEUE),
    ignored("pod_name", false, NO_POD_ROUTING),
    ignored("pod_namespace", false, NO_POD_ROUTING),
    ignored("promotion_max_per_heartbeat", false, NO_PROMOTION_QUEUE),
];

const THREADS: &str = "the tokio runtime sizes its worker threads to the CPUs it may use";
const NO_METADATA_SERVER: &str = "the master keeps segment metadata itself, so no HTTP metadata server is needed (clients say metadata_server P2PHANDSHAKE)";
const SSD_ON_STORES: &str = "the SSD tier lives on the store-clients (lunakv-store --enable_offload, MOONCAKE_OFFLOAD_* variables; docs/OFFLOAD.md)";
const NO_SNAPSHOTS: &str = "a master rebuilds its index from the store-clients' inventories (and, with --enable_ha, keeps its view in etcd), so there are no snapshots";
const NO_TASKS: &str = "lunakv has no copy/move task manager";
const NO_CXL: &str = "lunakv has no CXL memory support; remove the flag";
const NO_OPLOG: &str = "HA standbys copy the leader's index over ReplicateIndex and elect through etcd (--enable_ha, docs/HA.md); there is no OpLog";
const NO_DYNAMIC: &str = "lunakv places replica_num replicas when an object is put; there is no dynamic fan-out of hot objects";
const DEPRECATED_EVENT_FIELD: &str = "deprecated upstream and not emitted on events there either; an indexer learns it when its engines register";
const NO_NOF: &str =
    "lunakv has no NVMe-oF tier; the SSD tier lives on the store-clients (docs/OFFLOAD.md)";
const NO_OFFLOAD_QUEUE: &str = "eviction with --enable_offload offloads every evicted object through its owner; there is no offload queue to cap";
const NO_POD_ROUTING: &str =
    "clients reach segments by their advertised address; there is no label-based routing";
const NO_PROMOTION_QUEUE: &str = "the master hands each promotion to the object's owner when a read admits it (--promotion_admission_threshold, --promotion_queue_limit), not through the owners' heartbeats";

const fn ignored(name: &'static str, boolean: bool, why: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean,
        treatment: Upstream::Ignored(why),
    }
}

const fn refused(name: &'static str, boolean: bool, fix: &'static str) -> UpstreamFlag {
    UpstreamFlag {
        name,
        boolean,
        treatment: Upstream::Refused(fix),
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

    /// Checks every value; the first failure is returned.
    pub fn validate(&self) -> Result<(), MasterConfigError> {
        check_ratio("eviction_ratio", self.eviction_ratio, "0.05")?;
        check_ratio(
            "eviction_high_watermark_ratio",
            self.eviction_high_watermark_ratio,
            "0.95",
        )?;
        check_positive(
            "default_kv_lease_ttl",
            self.default_kv_lease_ttl,
            "ms",
            "5000",
        )?;
        check_positive(
            "default_kv_soft_pin_ttl",
            self.default_kv_soft_pin_ttl,
            "ms",
            "1800000",
        )?;
        check_positive(
            "max_kv_soft_pin_ttl",
            self.max_kv_soft_pin_ttl,
            "ms",
            "86400000",
        )?;
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
        check_positive("client_ttl", self.client_ttl, "s", "10")?;
        check_positive("namespace_min_keys", self.namespace_min_keys, "keys", "64")?;
        // Upstream clamps the threshold into 1..=255 at flag-parse time; a value it would
        // silently change is refused here instead.
        if !(1..=255).contains(&self.promotion_admission_threshold) {
            return Err(MasterConfigError::Invalid {
                field: "promotion_admission_threshold",
                value: self.promotion_admission_threshold.to_string(),
                fix: "use 1 (promote on the first read) to 255; the default is 2".to_string(),
            });
        }
        check_positive(
            "promotion_queue_limit",
            self.promotion_queue_limit,
            "promotions",
            "50000",
        )?;
        check_ratio(
            "put_reservation_limit_ratio",
            self.put_reservation_limit_ratio,
            "0.5",
        )?;
        check_ratio(
            "put_reservation_total_ratio",
            self.put_reservation_total_ratio,
            "0.75",
        )?;
        check_ratio(
            "put_eviction_limit_ratio",
            self.put_eviction_limit_ratio,
            "0.1",
        )?;
        // 0 would reclaim a put the moment it started, before its writer could copy a byte.
        check_positive(
            "put_reclaim_grace_ms",
            self.put_reclaim_grace_ms,
            "ms",
            "1000",
        )?;
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
            "30",
        )?;
        check_positive(
            "put_start_release_timeout_sec",
            self.put_start_release_timeout_sec,
            "s",
            "600",
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
                     (default 9003)",
                    self.rpc_port
                ),
            });
        }
        if self.cluster_id.trim().is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "cluster_id",
                value: format!("{:?}", self.cluster_id),
                fix: "name the cluster (default \"mooncake_cluster\"); clients mount with the \
                      same id"
                    .to_string(),
            });
        }
        self.validate_ha()?;
        self.validate_kv_events()?;
        if self.data_dir.as_os_str().is_empty() {
            return Err(MasterConfigError::Invalid {
                field: "data_dir",
                value: "\"\"".to_string(),
                fix: "give a directory for the master's metadata file, e.g. \
                      ./lunakv-master-data"
                    .to_string(),
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
        let positive = |field: &'static str, v: u64, default: &str| {
            if v == 0 || v > i32::MAX as u64 {
                Err(MasterConfigError::Invalid {
                    field,
                    value: v.to_string(),
                    fix: format!("give a count from 1 to {} (default {default})", i32::MAX),
                })
            } else {
                Ok(())
            }
        };
        positive(
            "kv_event_publisher_hwm",
            self.kv_event_publisher_hwm,
            "100000",
        )?;
        positive(
            "kv_event_publisher_max_batch_size",
            self.kv_event_publisher_max_batch_size,
            "50",
        )?;
        positive(
            "kv_event_publisher_max_queue_size",
            self.kv_event_publisher_max_queue_size,
            "100000",
        )?;
        if self.kv_event_publisher_buffer_steps > 10_000_000 {
            return Err(MasterConfigError::Invalid {
                field: "kv_event_publisher_buffer_steps",
                value: self.kv_event_publisher_buffer_steps.to_string(),
                fix: "keep at most 10000000 batches for replay (default 10000; 0 = none)"
                    .to_string(),
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
                    fix: "name both media (defaults CPU and STORAGE, vLLM's names); llm-d weighs \
                          tiers by these names"
                        .to_string(),
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
                    "give at most {} events (default 65536; 0 leaves the bound to \
                     kv_event_publisher_max_queue_size)",
                    i32::MAX
                ),
            });
        }
        self.kv_events_vllm_served_models()?;
        Ok(())
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
                fix: "use 1..=60 seconds: the leader lease bounds how long a dead leader's host \
                      blocks failover (2, the default, is etcd's smallest lease)"
                    .to_string(),
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
}

/// Which model name the vLLM stream's topics carry (`kv_events_vllm_served_model_name`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ServedModelNames {
    /// The key's model component.
    #[default]
    FromKey,
    /// One served name for every key.
    All(String),
    /// `(key model, served name)` pairs; a key model not listed keeps its own name.
    Map(Vec<(String, String)>),
}

/// Why a `kv_events_vllm_served_model_name` value was refused: the fix.
const SERVED_MODEL_FIX: &str = "give the served model name (Qwen/Qwen3-8B), or key_model=served \
     pairs, comma-separated (Qwen3-8B=Qwen/Qwen3-8B,Llama-3.1-8B=meta-llama/Llama-3.1-8B); \
     names cannot contain '@' (it separates a topic's parts)";

impl ServedModelNames {
    /// Parses the setting; the error is the fix.
    pub fn parse(value: &str) -> Result<ServedModelNames, &'static str> {
        let entries: Vec<&str> = value
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        if entries.iter().any(|e| e.contains('@')) {
            return Err(SERVED_MODEL_FIX);
        }
        match entries.as_slice() {
            [] => Ok(ServedModelNames::FromKey),
            [one] if !one.contains('=') => Ok(ServedModelNames::All((*one).to_string())),
            many => many
                .iter()
                .map(|e| match e.split_once('=') {
                    Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() => {
                        Ok((k.trim().to_string(), v.trim().to_string()))
                    }
                    _ => Err(SERVED_MODEL_FIX),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(ServedModelNames::Map),
        }
    }

    /// The served name of a key's model component.
    pub fn served<'a>(&'a self, key_model: &'a str) -> &'a str {
        match self {
            ServedModelNames::FromKey => key_model,
            ServedModelNames::All(name) => name,
            ServedModelNames::Map(pairs) => pairs
                .iter()
                .find(|(k, _)| k == key_model)
                .map_or(key_model, |(_, v)| v),
        }
    }
}

/// How the master places a new object's replicas (upstream's `--allocation_strategy`). Both
/// consider only segments whose largest free range fits the object, so a segment with much
/// free space in small holes is never picked only to fail (upstream's `free_ratio_first` ranks
/// by free bytes alone). Preferred segments (`preferred_segments`) come first either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllocationStrategy {
    /// Uniformly at random among the segments with room (upstream's default).
    #[default]
    Random,
    /// The segments with the highest share of free bytes first; ties at random.
    FreeRatioFirst,
}

impl AllocationStrategy {
    /// Parses `--allocation_strategy`, naming the values lunakv implements on refusal.
    pub fn parse(value: &str) -> Result<AllocationStrategy, MasterConfigError> {
        match value {
            "random" => Ok(AllocationStrategy::Random),
            "free_ratio_first" => Ok(AllocationStrategy::FreeRatioFirst),
            other => Err(MasterConfigError::Invalid {
                field: "allocation_strategy",
                value: format!("{other:?}"),
                fix: "use random (the default) or free_ratio_first; upstream's \
                      ssd_free_ratio_first, local_first and cxl are not implemented (for \
                      local_first, name the local segment in ReplicateConfig's \
                      preferred_segment)"
                    .to_string(),
            }),
        }
    }
}

impl MasterConfig {
    /// The parsed `allocation_strategy` ([`MasterConfig::validate`] has refused any other).
    pub fn allocation_strategy(&self) -> AllocationStrategy {
        AllocationStrategy::parse(&self.allocation_strategy).unwrap_or_default()
    }
}

fn check_ratio(field: &'static str, v: f64, default: &str) -> Result<(), MasterConfigError> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        return Ok(());
    }
    Err(MasterConfigError::Invalid {
        field,
        value: v.to_string(),
        fix: format!("it must be a ratio in (0, 1], e.g. {default}"),
    })
}

fn check_positive(
    field: &'static str,
    v: u64,
    unit: &str,
    default: &str,
) -> Result<(), MasterConfigError> {
    if v > 0 {
        return Ok(());
    }
    Err(MasterConfigError::Invalid {
        field,
        value: v.to_string(),
        fix: format!("it must be > 0 {unit} (default {default})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_flags(flags: &[(&str, &str)]) -> Result<LoadedMasterConfig, MasterConfigError> {
        MasterConfig::load(
            &MasterConfigSources {
                flags: flags
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            },
            &no_env,
        )
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn load_file(path: PathBuf) -> Result<LoadedMasterConfig, MasterConfigError> {
        MasterConfig::load(
            &MasterConfigSources {
                file: Some(path),
                ..Default::default()
            },
            &no_env,
        )
    }

    fn invalid_field(r: Result<LoadedMasterConfig, MasterConfigError>) -> &'static str {
        match r {
            Err(MasterConfigError::Invalid { field, .. }) => field,
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    fn yaml(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("master.yaml");
        std::fs::write(&path, text).expect("write");
        (dir, path)
    }

    #[test]
    fn defaults_match_upstream_and_llm_d() {
        let c = MasterConfig::default();
        assert_eq!(c.rpc_port, 50051);
        assert_eq!(c.metrics_port, 9003);
        assert_eq!(c.rpc_address, "127.0.0.1");
        assert_eq!(c.default_kv_lease_ttl, 5000);
        assert_eq!(c.default_kv_soft_pin_ttl, 1_800_000);
        assert_eq!(c.eviction_ratio, 0.05);
        assert_eq!(c.eviction_high_watermark_ratio, 0.95);
        assert_eq!(c.client_ttl, 10);
        assert_eq!(c.cluster_id, "mooncake_cluster");
        assert_eq!(c.put_start_discard_timeout_sec, 30);
        assert_eq!(c.put_start_release_timeout_sec, 600);
        assert!(!c.enable_offload);
        c.validate().expect("defaults are valid");
        let loaded = MasterConfig::load(&MasterConfigSources::default(), &no_env).expect("load");
        assert_eq!(loaded.config, c);
        assert!(loaded.warnings.is_empty());
    }

    #[test]
    fn llm_d_master_yaml_loads_with_warnings_for_ignored_keys() {
        let (_d, path) = yaml(
            "rpc_port: 50051\nmetrics_port: 9003\nhttp_metadata_server_port: 8080\n\
             default_kv_lease_ttl: 5000\ndefault_kv_soft_pin_ttl: 1800000\neviction_ratio: 0.05\n\
             eviction_high_watermark_ratio: 0.95\nroot_fs_dir: /data/mooncake-offload\n\
             cluster_id: mooncake_cluster\nenable_ha: false\netcd_endpoints: \"h1:2379;h2:2379\"\n",
        );
        let loaded = load_file(path).expect("load");
        assert_eq!(
            loaded.config,
            MasterConfig {
                etcd_endpoints: "h1:2379;h2:2379".into(),
                ..MasterConfig::default()
            }
        );
        assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings);
        assert!(loaded.warnings[0].contains("http_metadata_server_port"));
    }

    #[test]
    fn layers_file_then_env_then_flags() {
        let (_d, path) = yaml("rpc_port: 1000\nmetrics_port: 1001\nclient_ttl: 3\n");
        let env = |name: &str| match name {
            "LUNAKV_MASTER_METRICS_PORT" => Some("2001".to_string()),
            "LUNAKV_MASTER_CLIENT_TTL" => Some("4".to_string()),
            "LUNAKV_MASTER_ADDR" => Some("ignored".to_string()),
            _ => None,
        };
        let loaded = MasterConfig::load(
            &MasterConfigSources {
                file: Some(path),
                flags: vec![("client_ttl".into(), "5".into())],
            },
            &env,
        )
        .expect("load");
        assert_eq!(loaded.config.rpc_port, 1000, "file beats default");
        assert_eq!(loaded.config.metrics_port, 2001, "env beats file");
        assert_eq!(loaded.config.client_ttl, 5, "flag beats env");
    }

    #[test]
    fn ha_settings_are_checked_when_enabled() {
        let c = load_flags(&[
            ("enable_ha", "true"),
            ("etcd_endpoints", "etcd://h1:2379;h2:2379"),
        ])
        .expect("load")
        .config;
        assert!(c.enable_ha);
        assert_eq!(c.etcd().expect("endpoints").to_string(), "h1:2379;h2:2379");
        let e = load_flags(&[("enable_ha", "true")]).expect_err("no endpoints");
        assert!(e.to_string().contains("--etcd_endpoints="), "{e}");
        let e = load_flags(&[("enable_ha", "true"), ("etcd_endpoints", "h1:2379;;h2")])
            .expect_err("malformed");
        assert!(e.to_string().contains("etcd_endpoints"), "{e}");
        assert!(e.to_string().contains("h1:2379;h2:2379"), "{e}");
        let e = load_flags(&[
            ("enable_ha", "true"),
            ("etcd_endpoints", "h1:2379"),
            ("ha_backend_type", "redis"),
        ])
        .expect_err("redis");
        assert!(e.to_string().contains("only etcd"), "{e}");
        let e = load_flags(&[
            ("enable_ha", "true"),
            ("etcd_endpoints", "h1:2379"),
            ("rpc_address", "0.0.0.0"),
        ])
        .expect_err("wildcard");
        assert!(e.to_string().contains("--advertise_address"), "{e}");
    }

    #[test]
    fn allocation_strategy_takes_upstreams_two_placements_and_names_the_rest() {
        assert_eq!(
            MasterConfig::default().allocation_strategy(),
            AllocationStrategy::Random
        );
        let c = load_flags(&[("allocation_strategy", "free_ratio_first")])
            .expect("load")
            .config;
        assert_eq!(c.allocation_strategy(), AllocationStrategy::FreeRatioFirst);
        for bad in ["cxl", "ssd_free_ratio_first", "Random"] {
            let e = load_flags(&[("allocation_strategy", bad)]).expect_err(bad);
            let msg = e.to_string();
            assert!(
                msg.contains("allocation_strategy")
                    && msg.contains(bad)
                    && msg.contains("free_ratio_first"),
                "{msg}"
            );
        }
    }

    #[test]
    fn string_keys_stay_strings_from_env_and_flags() {
        let c = load_flags(&[("cluster_id", "123"), ("enable_offload", "true")])
            .expect("load")
            .config;
        assert_eq!(c.cluster_id, "123");
        assert!(c.enable_offload);
    }

    #[test]
    fn unknown_key_is_an_error_with_suggestions() {
        let (_d, path) = yaml("rpc_prot: 50051\n");
        let err = load_file(path).expect_err("unknown key");
        let msg = err.to_string();
        assert!(msg.contains("\"rpc_prot\""), "{msg}");
        assert!(msg.contains("did you mean rpc_port"), "{msg}");
        let env = |name: &str| (name == "LUNAKV_MASTER_EVICTION_RATIO").then(|| "lots".to_string());
        let err =
            MasterConfig::load(&MasterConfigSources::default(), &env).expect_err("bad env value");
        let msg = err.to_string();
        assert!(
            msg.contains("LUNAKV_MASTER_EVICTION_RATIO") && msg.contains("lots"),
            "{msg}"
        );
        let err = load_flags(&[("zzz", "1")]).expect_err("unknown");
        assert!(err.to_string().contains("valid keys: rpc_port"), "{err}");
    }

    #[test]
    fn bad_values_name_key_value_and_source() {
        let err = load_flags(&[("rpc_port", "fifty")]).expect_err("bad number");
        let msg = err.to_string();
        assert!(
            msg.contains("rpc_port") && msg.contains("fifty") && msg.contains("--rpc_port"),
            "{msg}"
        );
        let err = load_flags(&[("enable_offload", "\"false\"")]).expect_err("bad bool");
        assert!(err.to_string().contains("write true or false"), "{err}");
        let err = load_flags(&[("rpc_port", "70000")]).expect_err("port out of range");
        assert!(err.to_string().contains("rpc_port"), "{err}");
        let (_d, path) = yaml("client_ttl: [1]\n");
        let err = load_file(path).expect_err("type error");
        assert!(err.to_string().contains("client_ttl"), "{err}");
    }

    #[test]
    fn malformed_and_non_mapping_files_are_errors() {
        let (_d, path) = yaml("rpc_port: [\n");
        let err = load_file(path.clone()).expect_err("bad yaml");
        assert!(matches!(err, MasterConfigError::Parse { .. }), "{err}");
        std::fs::write(&path, "- a\n- b\n").expect("write");
        let err = load_file(path.clone()).expect_err("list");
        assert!(err.to_string().contains("must be a mapping"), "{err}");
        std::fs::write(&path, "").expect("write");
        load_file(path).expect("an empty file is the defaults");
        let err = load_file(PathBuf::from("/nonexistent/master.yaml")).expect_err("missing file");
        assert!(
            err.to_string().contains("/nonexistent/master.yaml"),
            "{err}"
        );
    }

    #[test]
    fn ratios_must_be_in_zero_one() {
        for bad in ["0", "1.5", "-0.1", "NaN"] {
            assert_eq!(
                invalid_field(load_flags(&[("eviction_ratio", bad)])),
                "eviction_ratio"
            );
            assert_eq!(
                invalid_field(load_flags(&[("eviction_high_watermark_ratio", bad)])),
                "eviction_high_watermark_ratio"
            );
        }
        load_flags(&[
            ("eviction_ratio", "1"),
            ("eviction_high_watermark_ratio", "1.0"),
        ])
        .expect("1 is allowed");
        let msg = load_flags(&[("eviction_ratio", "0")])
            .expect_err("zero")
            .to_string();
        assert!(
            msg.contains("eviction_ratio = 0") && msg.contains("(0, 1]"),
            "{msg}"
        );
    }

    #[test]
    fn ttls_must_be_positive() {
        for field in [
            "default_kv_lease_ttl",
            "default_kv_soft_pin_ttl",
            "client_ttl",
            "put_start_discard_timeout_sec",
        ] {
            assert_eq!(invalid_field(load_flags(&[(field, "0")])), field);
        }
        // max_kv_soft_pin_ttl = 0 is caught either as non-positive or below the default.
        assert_eq!(
            invalid_field(load_flags(&[("max_kv_soft_pin_ttl", "0")])),
            "max_kv_soft_pin_ttl"
        );
        assert_eq!(
            invalid_field(load_flags(&[
                ("put_start_release_timeout_sec", "0"),
                ("put_start_discard_timeout_sec", "1")
            ])),
            "put_start_release_timeout_sec"
        );
    }

    #[test]
    fn soft_pin_max_must_cover_default() {
        let msg = load_flags(&[("max_kv_soft_pin_ttl", "1000")])
            .expect_err("max < default")
            .to_string();
        assert!(
            msg.contains("max_kv_soft_pin_ttl = 1000") && msg.contains("1800000"),
            "{msg}"
        );
    }

    #[test]
    fn release_timeout_must_cover_discard_timeout() {
        assert_eq!(
            invalid_field(load_flags(&[
                ("put_start_discard_timeout_sec", "60"),
                ("put_start_release_timeout_sec", "30")
            ])),
            "put_start_release_timeout_sec"
        );
        load_flags(&[
            ("put_start_discard_timeout_sec", "1"),
            ("put_start_release_timeout_sec", "1"),
        ])
        .expect("equal is fine");
    }

    #[test]
    fn ports_and_address_are_checked() {
        assert_eq!(
            invalid_field(load_flags(&[
                ("rpc_port", "7000"),
                ("metrics_port", "7000")
            ])),
            "metrics_port"
        );
        load_flags(&[("rpc_port", "0"), ("metrics_port", "0")]).expect("ephemeral ports for tests");
        let msg = load_flags(&[("rpc_address", "localhost:1")])
            .expect_err("not an ip")
            .to_string();
        assert!(
            msg.contains("rpc_address") && msg.contains("0.0.0.0"),
            "{msg}"
        );
        load_flags(&[("rpc_address", "::1")]).expect("ipv6");
    }

    #[test]
    fn cluster_id_and_data_dir_must_be_set() {
        assert_eq!(
            invalid_field(load_flags(&[("cluster_id", " ")])),
            "cluster_id"
        );
        assert_eq!(invalid_field(load_flags(&[("data_dir", "")])), "data_dir");
    }

    #[test]
    fn offload_is_a_real_switch_and_promotion_needs_it() {
        let loaded =
            load_flags(&[("enable_offload", "true"), ("promotion_on_hit", "true")]).expect("load");
        assert!(loaded.config.enable_offload && loaded.config.promotion_on_hit);
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let loaded = load_flags(&[("promotion_on_hit", "true")]).expect("load");
        assert!(loaded.warnings.iter().any(|w| w.contains("enable_offload")));
    }

    #[test]
    fn promotion_admission_takes_upstreams_range_and_is_no_longer_ignored() {
        let c = load_flags(&[]).expect("defaults").config;
        assert_eq!(
            (c.promotion_admission_threshold, c.promotion_queue_limit),
            (2, 50_000)
        );
        let loaded = load_flags(&[
            ("promotion_admission_threshold", "1"),
            ("promotion_queue_limit", "8"),
        ])
        .expect("load");
        assert_eq!(loaded.config.promotion_admission_threshold, 1);
        assert_eq!(loaded.config.promotion_queue_limit, 8);
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        for bad in ["0", "256"] {
            let msg = load_flags(&[("promotion_admission_threshold", bad)])
                .expect_err(bad)
                .to_string();
            assert!(
                msg.contains("promotion_admission_threshold") && msg.contains("255"),
                "{msg}"
            );
        }
        assert_eq!(
            invalid_field(load_flags(&[("promotion_queue_limit", "0")])),
            "promotion_queue_limit"
        );
    }

    #[test]
    fn kv_event_settings_are_checked_only_when_enabled() {
        let loaded = load_flags(&[("kv_event_publisher_endpoint", "nonsense")]).expect("off");
        assert!(!loaded.config.enable_kv_event_publish);
        let loaded = load_flags(&[("enable_kv_event_publish", "true")]).expect("defaults");
        assert_eq!(loaded.config.kv_event_publisher_topic, "mooncake");
        assert_eq!(loaded.config.kv_event_publisher_max_batch_size, 50);
        let err = load_flags(&[
            ("enable_kv_event_publish", "true"),
            ("kv_event_publisher_endpoint", "127.0.0.1:19997"),
        ])
        .expect_err("no scheme");
        let msg = err.to_string();
        assert!(
            msg.contains("kv_event_publisher_endpoint") && msg.contains("tcp://"),
            "{msg}"
        );
        let err = load_flags(&[
            ("enable_kv_event_publish", "true"),
            ("kv_events_vllm_pods", "10.0.0.5:8000,pod-b"),
        ])
        .expect_err("pod without a port");
        assert!(err.to_string().contains("\"pod-b\""), "{err}");
        let err = load_flags(&[
            ("enable_kv_event_publish", "true"),
            ("kv_event_publisher_max_queue_size", "0"),
        ])
        .expect_err("empty queue");
        assert!(
            err.to_string()
                .contains("kv_event_publisher_max_queue_size")
        );
        let loaded = load_flags(&[("kv_event_publisher_auto_port", "false")]).expect("ignored");
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.contains("kv_event_publisher_auto_port"))
        );
    }

    #[test]
    fn event_formats_default_to_todays_consumers_and_refuse_unknown_values() {
        let c = MasterConfig::default();
        assert_eq!(
            (
                c.kv_events_vllm_format.as_str(),
                c.kv_events_vllm_int_hashes,
                c.kv_events_vllm_medium_dram.as_str(),
                c.kv_events_vllm_medium_ssd.as_str(),
                c.kv_events_mooncake_format.as_str(),
            ),
            ("tagged", true, "CPU", "STORAGE", "rfc1527")
        );
        assert_eq!(
            (
                c.kv_events_emit_legacy_compat,
                c.kv_events_emit_object_key,
                c.kv_events_queue_capacity
            ),
            (true, true, 65536),
            "upstream main's defaults"
        );
        for (key, value, fix) in [
            ("kv_events_vllm_format", "map", "tagged"),
            ("kv_events_mooncake_format", "rfc", "rfc1527"),
            (
                "kv_events_vllm_served_model_name",
                "a=b,c",
                "key_model=served",
            ),
            ("kv_events_vllm_served_model_name", "org@model", "'@'"),
            ("kv_events_bind_endpoint", "0.0.0.0:5557", "tcp://"),
        ] {
            let err =
                load_flags(&[("enable_kv_event_publish", "true"), (key, value)]).expect_err(value);
            let msg = err.to_string();
            assert!(
                msg.contains(key) && msg.contains(value) && msg.contains(fix),
                "{msg}"
            );
        }
    }

    #[test]
    fn served_model_names_apply_to_every_key_or_per_key_model() {
        assert_eq!(ServedModelNames::parse(" "), Ok(ServedModelNames::FromKey));
        let all = ServedModelNames::parse("Qwen/Qwen3-8B").expect("one name");
        assert_eq!(all.served("Qwen3-8B"), "Qwen/Qwen3-8B");
        let map = ServedModelNames::parse("Qwen3-8B=Qwen/Qwen3-8B, m = org/m").expect("pairs");
        assert_eq!(map.served("Qwen3-8B"), "Qwen/Qwen3-8B");
        assert_eq!(map.served("m"), "org/m");
        assert_eq!(
            map.served("other"),
            "other",
            "unlisted keys keep their model"
        );
        assert!(ServedModelNames::parse("=x").is_err());
    }

    #[test]
    fn upstream_mains_enable_kv_events_key_works_in_master_yaml() {
        let (_dir, path) = yaml("enable_kv_events: true\nkv_events_backend_id: pool-a\n");
        let c = load_file(path).expect("loads").config;
        assert!(c.enable_kv_event_publish);
        assert_eq!(c.kv_events_backend_id, "pool-a");
    }

    /// Upstream main's event command line (mooncake-store-deployment-guide.md, "KV Cache
    /// Event Publisher") starts lunakv-master with every flag taken, none ignored or refused.
    #[test]
    fn upstream_mains_event_flags_are_taken_with_their_values() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: MasterArgs,
        }
        let cli = Cli::parse_from([
            "mooncake_master",
            "--enable_kv_events",
            "--kv_events_bind_endpoint=tcp://0.0.0.0:5557",
            "--kv_events_backend_id=store-node-1",
            "--kv_events_emit_legacy_compat=false",
            "--kv_events_emit_object_key=true",
            "--kv_events_queue_capacity=0",
        ]);
        let s = cli.args.sources();
        let flags: Vec<(&str, &str)> = s.flags.iter().map(|(k, v)| (&**k, &**v)).collect();
        let loaded = load_flags(&flags).expect("starts");
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let c = loaded.config;
        assert!(c.enable_kv_event_publish);
        assert_eq!(
            c.kv_events_mooncake_endpoint(),
            ("kv_events_bind_endpoint", "tcp://0.0.0.0:5557")
        );
        assert_eq!(c.kv_events_backend_id, "store-node-1");
        assert!(!c.kv_events_emit_legacy_compat && c.kv_events_emit_object_key);
        assert_eq!(c.kv_events_queue_capacity, 0);
        assert_eq!(
            MasterConfig::default().kv_events_mooncake_endpoint(),
            ("kv_event_publisher_endpoint", "tcp://127.0.0.1:19997")
        );
    }

    #[test]
    fn every_flag_of_upstreams_master_is_ours_or_judged() {
        use clap::CommandFactory;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: MasterArgs,
        }
        // Every DEFINE_* of kvcache-ai/Mooncake mooncake-store/src/master.cpp at 3b5a594
        // (2026-08-22): each must be a lunakv flag (or alias) or in UPSTREAM_KEYS, so an
        // upstream command line never meets a bare "unexpected argument".
        const UPSTREAM: &[&str] = &[
            "allow_evict_soft_pinned_objects",
            "batch_oplog_retry_timeout_sec",
            "cluster_id",
            "config_path",
            "cxl_path",
            "cxl_size",
            "default_kv_lease_ttl",
            "default_kv_soft_pin_ttl",
            "dynamic_replication_heat_window_seconds",
            "dynamic_replication_mode",
            "enable_cxl",
            "enable_disk_eviction",
            "enable_ha",
            "enable_http_metadata_server",
            "enable_kv_events",
            "enable_metric_reporting",
            "enable_multi_tenants",
            "enable_offload",
            "enable_oplog",
            "enable_snapshot",
            "enable_snapshot_restore",
            "eviction_high_watermark_ratio",
            "eviction_ratio",
            "global_file_segment_size",
            "ha_backend_connstring",
            "ha_backend_type",
            "http_metadata_server_host",
            "http_metadata_server_port",
            "kv_events_additional_salt",
            "kv_events_backend_id",
            "kv_events_bind_endpoint",
            "kv_events_block_size",
            "kv_events_dp_rank",
            "kv_events_emit_legacy_compat",
            "kv_events_emit_object_key",
            "kv_events_lora_name",
            "kv_events_model_name",
            "kv_events_queue_capacity",
            "kv_events_tenant_id",
            "max_kv_soft_pin_ttl",
            "max_retry_attempts",
            "max_total_finished_tasks",
            "max_total_pending_tasks",
            "max_total_processing_tasks",
            "memory_allocator",
            "metrics_host",
            "metrics_port",
            "nof_eviction_high_watermark_ratio",
            "nof_eviction_ratio",
            "nof_heartbeat_interval_sec",
            "nof_heartbeat_probe_timeout_ms",
            "offload_cap_ratio",
            "offload_force_evict",
            "offload_on_evict",
            "offloading_queue_limit",
            "oplog_batch_max_entries",
            "oplog_poll_interval_ms",
            "pending_task_timeout_sec",
            "pod_name",
            "pod_namespace",
            "port",
            "processing_task_timeout_sec",
            "promotion_admission_threshold",
            "promotion_max_per_heartbeat",
            "promotion_on_hit",
            "promotion_queue_limit",
            "put_start_discard_timeout_sec",
            "put_start_release_timeout_sec",
            "root_fs_dir",
            "rpc_address",
            "rpc_conn_timeout_seconds",
            "rpc_enable_tcp_no_delay",
            "rpc_interface",
            "rpc_thread_num",
            "snapshot_backup_dir",
            "snapshot_catalog_backend_connstring",
            "snapshot_catalog_backend_type",
            "snapshot_catalog_store_connstring",
            "snapshot_catalog_store_type",
            "snapshot_child_timeout_seconds",
            "snapshot_interval_seconds",
            "snapshot_object_store_type",
            "snapshot_payload_backend_type",
            "snapshot_payload_store_type",
            "snapshot_retention_count",
            "tenant_quota_connector_type",
            "tenant_quota_connector_uri",
        ];
        let cmd = Cli::command();
        let ours: Vec<String> = cmd
            .get_arguments()
            .flat_map(|a| {
                a.get_long()
                    .into_iter()
                    .chain(a.get_all_aliases().into_iter().flatten())
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect();
        let missing: Vec<&str> = UPSTREAM
            .iter()
            .copied()
            .filter(|f| !ours.iter().any(|o| o == f))
            .filter(|f| !UPSTREAM_KEYS.iter().any(|u| u.name == *f))
            .collect();
        assert!(
            missing.is_empty(),
            "upstream flags lunakv neither takes nor judges: {missing:?}"
        );
    }

    #[test]
    fn args_become_the_flag_layer() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: MasterArgs,
        }
        let cli = Cli::parse_from([
            "m",
            "--config=/x.yaml",
            "--rpc_port=7",
            "--eviction_ratio=0.5",
            "--enable_offload",
            "--data_dir=/d",
        ]);
        let s = cli.args.sources();
        assert_eq!(s.file, Some(PathBuf::from("/x.yaml")));
        let flags: Vec<(&str, &str)> = s.flags.iter().map(|(k, v)| (&**k, &**v)).collect();
        assert_eq!(
            flags,
            [
                ("rpc_port", "7"),
                ("eviction_ratio", "0.5"),
                ("data_dir", "/d"),
                ("enable_offload", "true")
            ]
        );
        let c = load_flags(&flags).expect("load").config;
        assert_eq!((c.rpc_port, c.eviction_ratio), (7, 0.5));
        assert!(c.enable_offload);
    }
}
