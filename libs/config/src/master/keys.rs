//! The master's keys, each declared once: its type, default, `--help` line and upstream alias.
//! [`key_table!`](crate::key_table!) makes [`MasterConfig`], its `Default`, [`MasterArgs`] (the
//! flag layer) and [`KEYS`] from this table; `LUNAKV_MASTER_<KEY>` and the `master.yaml` keys
//! are the same names ([`super::ENV_PREFIX`]). A new key is one entry here (and its check in
//! `checks.rs` if it has one).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::key_table::Shown;

crate::key_table! {
    /// The master's settings. Durations carry their unit in the name, as upstream's do.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct MasterConfig;

    /// The master's command line: one `Option` per key of [`MasterConfig`], named as the key, so
    /// that serialized it is the flag layer (unset flags leave lower layers alone).
    // The help of `--config` is clap's --help text, shown verbatim: `<KEY>` there is a
    // placeholder.
    #[allow(rustdoc::invalid_html_tags)]
    #[derive(Debug, Default, clap::Args, Serialize)]
    #[command(after_help = crate::security_help::master_help())]
    pub struct MasterArgs {
        /// master.yaml (llm-d's keys); flags override it, environment LUNAKV_MASTER_<KEY> sits between.
        #[arg(long, alias = "config_path")]
        #[serde(skip)]
        pub config: Option<PathBuf>,
    }

    pub const KEYS;

    /// gRPC port (upstream `--rpc_port`, alias `--port`).
    rpc_port: u16 = 50051
        => "gRPC port",
        arg(visible_alias = "port");
    /// Address both listeners bind. lunakv defaults to loopback, where upstream binds 0.0.0.0:
    /// the master API has no authentication, so exposing it must be a deliberate choice
    /// (set `0.0.0.0` in a pod, where the network policy is the boundary).
    rpc_address: String = "127.0.0.1".to_string()
        => "Address both listeners bind",
        shown Shown::Note("; upstream binds 0.0.0.0");
    /// Admin and Prometheus HTTP port.
    metrics_port: u16 = 9003
        => "Admin + Prometheus HTTP port";
    /// Address the admin/metrics listener binds (upstream `--metrics_host`). Default (empty):
    /// `rpc_address`. Lets a pod keep its API on the pod IP and its scrape port elsewhere.
    metrics_host: String = String::new()
        => "Address the admin + Prometheus listener binds",
        shown Shown::Text("rpc_address");
    /// Lease granted by GetReplicaList / ExistKey, in milliseconds (llm-d's master.yaml: 5000).
    default_kv_lease_ttl: u64 = 5000
        => "Lease granted on reads, ms";
    /// Soft-pin duration for puts that ask for one, in milliseconds.
    default_kv_soft_pin_ttl: u64 = 1_800_000
        => "Soft pin duration, ms";
    /// Upper bound on any soft pin, in milliseconds.
    max_kv_soft_pin_ttl: u64 = 86_400_000
        => "Longest soft pin, ms";
    /// Share of total capacity freed by one eviction pass.
    eviction_ratio: f64 = 0.05
        => "Share of capacity one eviction pass frees";
    /// Usage share at which background eviction starts.
    eviction_high_watermark_ratio: f64 = 0.95
        => "Usage share that starts eviction";
    /// Seconds without a Ping after which a client is declared dead.
    client_ttl: u64 = 10
        => "Seconds of silence before a client is declared dead";
    /// Cluster name; mounts from another cluster are refused.
    cluster_id: String = "mooncake_cluster".to_string()
        => "Cluster name";
    /// Seconds after which a put started and never ended stops holding its key.
    put_start_discard_timeout_sec: u64 = 30
        => "Seconds before a put never ended stops holding its key";
    /// Seconds after which the space of such a put is given back (it may still be written
    /// until then).
    put_start_release_timeout_sec: u64 = 600
        => "Seconds before such a put's space is reused";
    /// lunakv: directory of the embedded metadata file (`meta.redb`).
    data_dir: PathBuf = PathBuf::from("./lunakv-master-data")
        => "Directory of the embedded metadata file";
    /// SSD tier (upstream `--enable_offload`): store-clients that offload may mount, and objects
    /// evicted from their DRAM move to their disk instead of being dropped (docs/OFFLOAD.md).
    enable_offload: bool = false
        => "SSD tier: let offloading store-clients mount; evictions move objects to their disk",
        shown Shown::Hidden;
    /// Upstream `--promotion_on_hit`: a get of a disk-only object also brings it back into the
    /// owner's DRAM.
    promotion_on_hit: bool = false
        => "SSD tier: a get of a disk-only object also promotes it back to the owner's DRAM",
        shown Shown::Hidden;
    /// Upstream `--promotion_admission_threshold`: reads a disk-only object takes before it is
    /// promoted, 1..=255 (upstream counts in a count-min sketch; lunakv counts each object
    /// exactly, so a cold key never rides on a hot one's count).
    promotion_admission_threshold: u32 = 2
        => "SSD tier: reads of a disk-only object before it is promoted, 1-255";
    /// Upstream `--promotion_queue_limit`: promotions reserved and not yet confirmed; past it a
    /// hit does not promote (the next one tries again).
    promotion_queue_limit: u64 = 50_000
        => "SSD tier: promotions in flight at most; past it a hit does not promote";
    /// lunakv: keys a client must put in one vLLM key namespace before the cross-instance rule
    /// counts it; two such clients that never share a key flag the namespace (`lunakv doctor`).
    namespace_min_keys: u64 = 64
        => "Keys a client must put in a vLLM key namespace before the cross-instance sharing rule counts it";
    /// lunakv: most objects the index may hold (0 = no limit). At the limit the least recently
    /// used ones are dropped and, if none can be, puts are refused: the master's memory is
    /// bounded (~530 B per vLLM-shaped key) instead of growing until it is killed.
    max_keys: u64 = 50_000_000
        => "Most objects the index may hold; the least recently used go at the limit (0 = no limit)";
    /// lunakv: share of the pool's capacity one client may hold reserved by puts it started and
    /// has not ended; a PutStart past it is refused, so one stuck writer cannot block every put.
    put_reservation_limit_ratio: f64 = 0.5
        => "Share of the pool one client may hold reserved by unfinished puts";
    /// lunakv: share of the pool's capacity all unfinished puts together may hold reserved; a
    /// PutStart past it is refused, so callers at many addresses cannot pin the whole pool.
    put_reservation_total_ratio: f64 = 0.75
        => "Share of the pool all unfinished puts together may hold reserved";
    /// lunakv: how long (ms) another holder's unfinished put must have been started before a
    /// PutStart that finds no room may reclaim it (free it through its owner, which then
    /// refuses the zombie's late writes): attackers at many addresses cannot pin the pool
    /// until the discard timeout, and a live writer gets this long to end its put.
    put_reclaim_grace_ms: u64 = 1000
        => "Age (ms) of another caller's unfinished put before a PutStart that finds no room may reclaim it";
    /// lunakv: share of the pool's capacity one PutStart may evict to make room for itself; a
    /// put that needs more is refused, so one pool-sized put cannot empty the pool.
    put_eviction_limit_ratio: f64 = 0.1
        => "Share of the pool one PutStart may evict to make room for itself";
    /// lunakv: a drain job's default rate, in bytes its moves may copy per second (a request's
    /// `max_bytes_per_sec` overrides it; 0: unbounded), so a drain does not starve gets.
    drain_max_bytes_per_sec: u64 = 1 << 30
        => "Bytes per second a drain job's moves may copy, unless its request says (0: unbounded)";
    /// lunakv: which objects eviction takes first: `cslru` (default; a chain-aware segmented
    /// LRU with a ghost table, docs/BENCH.md "Hits on real traffic") or `lru` (upstream's: the
    /// least recently used `eviction_ratio` of the pool at the high watermark).
    eviction_policy: String = "cslru".to_string()
        => "Eviction order: cslru (segmented LRU with ghosts, chain-aware) or lru (upstream's)";
    /// Upstream `--allocation_strategy`: how a new object's replicas pick their segments among
    /// those with room for it: `random` (upstream's default) or `free_ratio_first` (the
    /// emptiest first, so stores of different sizes fill evenly). See [`AllocationStrategy`](super::AllocationStrategy).
    allocation_strategy: String = "random".to_string()
        => "Replica placement: random or free_ratio_first (emptiest segments first)";
    /// lunakv: how long a segment that joins a pool of settled segments ramps up, in ms (0 =
    /// off). While it ramps, it takes at most `max(1/segments, elapsed/ramp)` of new puts, the
    /// others making room by eviction as a full pool does, so a restarted store does not attract
    /// every put at once (upstream MC#3688: the emptiest segment takes them all).
    placement_ramp_ms: u64 = 30_000
        => "Share of new puts a segment that joins settled ones may take ramps up over this many ms; 0 = off";
    /// Upstream `--enable_multi_tenants`: admit every tenant's puts against its quota from the
    /// tenant policy, and refuse tenants the policy does not name (docs/TENANTS.md). Without
    /// it tenants still have their own key namespaces and usage, but no quota.
    enable_multi_tenants: bool = false
        => "Tenants: admit puts against each tenant's quota; unknown tenants are refused";
    /// Upstream `--tenant_quota_connector_type`: where the tenant policy lives. `file` only.
    tenant_quota_connector_type: String = "file".to_string()
        => "Tenants: where the quota policy lives; only \"file\"";
    /// Upstream `--tenant_quota_connector_uri`: the policy file (upstream's YAML schema,
    /// `version: 1`, `tenants: [{name, quota}]`); the admin API writes its changes back to it.
    tenant_quota_connector_uri: String = String::new()
        => "Tenants: the quota policy file (YAML: version 1, tenants: [{name, quota}])",
        shown Shown::Hidden;
    /// HA (upstream `--enable_ha`): campaign for leadership in etcd; followers redirect clients.
    enable_ha: bool = false
        => "HA: campaign for leadership in etcd; standbys redirect clients to the leader",
        shown Shown::Hidden;
    /// etcd client endpoints, `;`-separated as upstream (`h1:2379;h2:2379`; `etcd://` accepted).
    etcd_endpoints: String = String::new()
        => "etcd endpoints for HA, \";\"-separated: \"h1:2379;h2:2379\" (etcd:// accepted)",
        shown Shown::Hidden,
        arg(alias = "ha_backend_connstring");
    /// HA backend (upstream `--ha_backend_type`); only `etcd` is implemented.
    ha_backend_type: String = "etcd".to_string()
        => "HA backend",
        shown Shown::Note("; the only one implemented");
    /// lunakv: the host published in the leader key for clients to dial, when `rpc_address` is
    /// a wildcard (0.0.0.0 / ::). Default: `rpc_address`.
    advertise_address: String = String::new()
        => "Host published in etcd for clients to dial",
        shown Shown::Text("rpc_address");
    /// lunakv: TTL of the leader's etcd lease in seconds. It bounds failover when a leader's
    /// host dies or is cut off; 2 s is etcd's smallest lease with its default
    /// `--heartbeat-interval`/`--election-timeout` (a smaller request is raised to it).
    ha_lease_ttl_sec: u64 = 2
        => "HA: TTL of the leader's etcd lease in seconds; bounds failover when a leader's host dies",
        shown Shown::Note(", etcd's smallest");
    /// lunakv: standbys dial the leader's RPC port; when it refuses connections (its process is
    /// gone, the host is up) they revoke its lease at once instead of waiting for it to expire.
    /// Turn off where master-to-master traffic is rejected with a TCP reset by policy.
    ha_fast_takeover: bool = true
        => "HA: standbys revoke the lease of a leader whose RPC port refuses connections (its process is gone) instead of waiting for it to expire";
    /// lunakv: standbys keep a warm copy of the leader's index (streamed from it), so a new
    /// leader answers reads before the owners' remounts. Off by default: it measured faster
    /// reads but a slower rebuild (docs/HA.md, "Warm standby").
    ha_warm_standby: bool = false
        => "HA: standbys keep a warm copy of the leader's index, so a new leader answers reads before the owners remount";
    /// KV events (upstream `--enable_kv_event_publish`; `--enable_kv_events` is accepted as a
    /// flag alias): publish the index's changes on a ZMQ PUB socket (docs/EVENTS.md).
    enable_kv_event_publish: bool = false
        => "KV events: publish the pool's block changes on ZMQ (docs/EVENTS.md) {default}. `--enable_kv_events` is upstream's newer name",
        arg(visible_alias = "enable_kv_events");
    /// Upstream `--kv_event_publisher_endpoint`: the PUB socket the Mooncake-format stream binds.
    /// Upstream binds `tcp://*:19997`; lunakv binds loopback unless told otherwise, like its
    /// other listeners. `tcp://host:*` takes any free port (the master prints it).
    kv_event_publisher_endpoint: String = "tcp://127.0.0.1:19997".to_string()
        => "KV events: PUB endpoint of the Mooncake-format stream";
    /// Upstream `--kv_event_publisher_replay_endpoint`: the ROUTER socket answering replay
    /// requests; empty = no replay.
    kv_event_publisher_replay_endpoint: String = String::new()
        => "KV events: ROUTER endpoint answering replay requests",
        shown Shown::Text("none");
    /// Upstream `--kv_event_publisher_topic`: the first frame of every message.
    kv_event_publisher_topic: String = "mooncake".to_string()
        => "KV events: topic frame";
    /// Upstream `--kv_event_publisher_hwm`: ZMQ send high-water mark per subscriber, in
    /// messages; a subscriber that far behind loses batches (and sees the gap).
    kv_event_publisher_hwm: u64 = 100_000
        => "KV events: ZMQ send high-water mark per subscriber, messages";
    /// Upstream `--kv_event_publisher_max_batch_size`: most events per message.
    kv_event_publisher_max_batch_size: u64 = 50
        => "KV events: most events per batch";
    /// Upstream's publisher `max_queue_size`: events waiting for the publisher thread; more are
    /// dropped and counted (`master_kv_events_dropped_total{reason="queue_full"}`).
    kv_event_publisher_max_queue_size: u64 = 100_000
        => "KV events: events queued for the publisher; more are dropped and counted";
    /// Upstream's publisher `buffer_steps`: batches kept for replay.
    kv_event_publisher_buffer_steps: u64 = 10_000
        => "KV events: batches kept for replay";
    /// lunakv: tokens per block reported in the events' `block_size` (0 = not known; the put
    /// does not carry it).
    kv_event_block_size: u64 = 0
        => "KV events: tokens per block reported in events",
        shown Shown::Note(" = unknown");
    /// lunakv: a second stream in vLLM's KV-event format (for llm-d's KV-cache indexer). Empty
    /// = off. Bound when it has a wildcard (`tcp://*:5557`), connected otherwise (llm-d's
    /// central mode: the scheduler binds, publishers connect).
    kv_events_vllm_endpoint: String = String::new()
        => "KV events: vLLM-format stream endpoint; bound with a wildcard, else connected",
        shown Shown::Text("off");
    /// lunakv: comma-separated `address:port` of the serving pods that can load from this
    /// pool; the vLLM stream announces pool blocks on `kv@<pod>@<model>` for each. A
    /// `name:port` (a headless Service) stands for every address the name resolves to, resolved
    /// again every 10 s.
    kv_events_vllm_pods: String = String::new()
        => "KV events: serving pods (address:port, or a name:port resolved every 10 s, comma-separated) the vLLM stream speaks for",
        shown Shown::Hidden;
    /// lunakv: the vLLM stream's `medium` of a block in the pool's DRAM / in its SSD tier
    /// (vLLM's own names: `CPU` for host memory, `STORAGE` for disk).
    kv_events_vllm_medium_dram: String = "CPU".to_string()
        => "KV events: vLLM stream medium of the pool's DRAM";
    kv_events_vllm_medium_ssd: String = "STORAGE".to_string()
        => "KV events: vLLM stream medium of the SSD tier";
    /// lunakv: the vLLM stream's encoding: `tagged` (today's vLLM: each event a map tagged by
    /// its class name) or `array` (older vLLM: each event a positional array).
    kv_events_vllm_format: String = "tagged".to_string()
        => "KV events: vLLM stream encoding, tagged (today's vLLM) or array (older vLLM, positional)";
    /// lunakv: the vLLM stream's block hashes as vLLM's default
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` sends them (the hash's last 8 bytes as an
    /// unsigned int); false = the key's hash bytes as they are.
    kv_events_vllm_int_hashes: bool = true
        => "KV events: vLLM stream hashes as ints (the last 8 bytes), as vLLM's default";
    /// lunakv: the vLLM stream's `ownership` of the pool's blocks (vLLM: the secondary
    /// offloading tier that generated the event); empty = not sent. `tagged` format only.
    kv_events_vllm_ownership: String = "lunakv".to_string()
        => "KV events: vLLM stream ownership of the pool's blocks; empty = not sent";
    /// lunakv: the model name the vLLM stream's topics carry (`kv@<pod>@<model>`), as the
    /// engine serves it (`--served-model-name`). Empty: the key's model component (the last
    /// path component of the model, `Qwen3-8B` for `Qwen/Qwen3-8B`). One name applies to every
    /// key; `key_model=served` pairs, comma-separated, map each key model.
    kv_events_vllm_served_model_name: String = String::new()
        => "KV events: the served model name in the vLLM stream's topics, or key_model=served pairs",
        shown Shown::Text("the key's model component");
    /// lunakv: the Mooncake stream's encoding: `rfc1527` (upstream main's master publisher:
    /// one msgpack map per object and medium) or `array` (the older dev-branch form:
    /// `BlockStoreEvent` / `BlockUpdateEvent` / `RemoveAllEvent` arrays).
    kv_events_mooncake_format: String = "rfc1527".to_string()
        => "KV events: Mooncake stream encoding, rfc1527 (upstream main) or array (older)";
    /// Upstream main's `--kv_events_bind_endpoint`: where the Mooncake stream binds; when set
    /// it replaces `kv_event_publisher_endpoint`.
    kv_events_bind_endpoint: String = String::new()
        => "KV events (upstream main): PUB bind endpoint of the Mooncake stream; replaces kv_event_publisher_endpoint when set",
        shown Shown::Hidden;
    /// Upstream main's `--kv_events_backend_id`: the cache owner named by every `rfc1527`
    /// event's `backend_id`. Empty: `cluster_id` (the pool is the owner).
    kv_events_backend_id: String = String::new()
        => "KV events (upstream main): backend_id of rfc1527 events",
        shown Shown::Text("cluster_id");
    /// Upstream main's `--kv_events_emit_legacy_compat`: `rfc1527` events also carry vLLM's
    /// field names (`type`, `block_hashes`, `parent_block_hash`).
    kv_events_emit_legacy_compat: bool = true
        => "KV events (upstream main): add vLLM's type/block_hashes names to rfc1527 events";
    /// Upstream main's `--kv_events_emit_object_key`: `rfc1527` events carry `object_key`.
    /// Off, an event whose key is not a decimal or `0x` hash names no block and is not sent.
    kv_events_emit_object_key: bool = true
        => "KV events (upstream main): add object_key to rfc1527 events";
    /// Upstream main's `--kv_events_queue_capacity`: events waiting for the publisher, a
    /// second bound next to `kv_event_publisher_max_queue_size` (the smaller applies; 0 = no
    /// bound from this key, the master's memory stays bounded by the other).
    kv_events_queue_capacity: u64 = 65536
        => "KV events (upstream main): most queued events; 0 = only kv_event_publisher_max_queue_size bounds the queue";
}
