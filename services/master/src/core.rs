//! The master's state and rules, free of gRPC: segment registry, object index, leases, pins,
//! eviction, zombie puts and client liveness. The gRPC and HTTP edges call into [`MasterCore`].
//!
//! Locks: the object index is split into [`SHARDS`] shards, each a `parking_lot::Mutex`; segments
//! and clients have one mutex each. Order: a shard, then segments, then clients; no lock is held
//! across an `.await`. A removed object leaves the index at once, but its ranges go back to the
//! allocator only after the owner acknowledged the FREE ([`MasterCore::release`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lunakv_proto::ErrorCode;
use parking_lot::Mutex;
use rand::seq::SliceRandom;

use crate::alloc::{OffsetAllocator, align_up};
use crate::events::{EventSink, PoolEvent, ReplicaRef, Tiers};
use crate::metrics::Metrics;
use crate::namespaces::NamespaceTracker;
use crate::notifier::{FreeEntry, OffloadEntry, OwnerClient, Promote};

/// Number of object-index shards.
pub const SHARDS: usize = 64;

/// Timing and policy knobs, as durations (tests use milliseconds).
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub cluster_id: String,
    pub lease_ttl: Duration,
    pub soft_pin_ttl: Duration,
    pub max_soft_pin_ttl: Duration,
    pub eviction_ratio: f64,
    pub high_watermark: f64,
    pub client_ttl: Duration,
    pub put_discard_timeout: Duration,
    pub put_release_timeout: Duration,
    /// How long an owner has to acknowledge a FREE before the range is freed anyway.
    pub free_timeout: Duration,
    /// SSD tier: offloading owners may mount; their evicted objects move to disk.
    pub enable_offload: bool,
    /// SSD tier: a get of a disk-only object asks its owner to bring it back to DRAM.
    pub promotion_on_hit: bool,
    /// Keys a client must put in a namespace before the unshared-instances rule counts it
    /// (`namespace_min_keys`; see [`crate::namespaces`]).
    pub namespace_min_keys: u64,
    /// Most objects in the index (0 = no limit).
    pub max_keys: u64,
    /// Share of total capacity one client may hold reserved by unfinished puts.
    pub put_reservation_limit_ratio: f64,
}

impl CoreConfig {
    pub fn from_master(c: &lunakv_config::master::MasterConfig) -> CoreConfig {
        CoreConfig {
            cluster_id: c.cluster_id.clone(),
            lease_ttl: Duration::from_millis(c.default_kv_lease_ttl),
            soft_pin_ttl: Duration::from_millis(c.default_kv_soft_pin_ttl),
            max_soft_pin_ttl: Duration::from_millis(c.max_kv_soft_pin_ttl),
            eviction_ratio: c.eviction_ratio,
            high_watermark: c.eviction_high_watermark_ratio,
            client_ttl: Duration::from_secs(c.client_ttl),
            put_discard_timeout: Duration::from_secs(c.put_start_discard_timeout_sec),
            put_release_timeout: Duration::from_secs(c.put_start_release_timeout_sec),
            free_timeout: Duration::from_secs(2),
            enable_offload: c.enable_offload,
            promotion_on_hit: c.promotion_on_hit,
            namespace_min_keys: c.namespace_min_keys,
            max_keys: c.max_keys,
            put_reservation_limit_ratio: c.put_reservation_limit_ratio,
        }
    }
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig::from_master(&lunakv_config::master::MasterConfig::default())
    }
}

/// What a peer needs to reach a segment (the domain form of `SegmentDescriptor`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SegmentDesc {
    pub name: String,
    pub transfer_endpoint: String,
    pub size: u64,
    pub host_id: String,
    pub shm_socket: String,
    /// The protocol the owner serves ("tcp" or "rdma").
    pub protocol: String,
    pub enable_offload: bool,
    /// SSD tier limit of the owner; 0 = no usable disk tier. (Absent in older persisted records.)
    #[serde(default)]
    pub disk_capacity: u64,
    /// The owner's segment server instance ([`lunakv_transfer::SegmentInfo::instance_id`]);
    /// empty from owners that predate it.
    #[serde(default)]
    pub instance_id: String,
    /// The protocol the owner was configured with ("rdma" while `protocol` is "tcp": RDMA was
    /// unavailable there). Older owners and persisted records leave it empty (= `protocol`).
    #[serde(default)]
    pub requested_protocol: String,
    /// Why `protocol` differs from `requested_protocol`; empty when they agree.
    #[serde(default)]
    pub protocol_reason: String,
}

/// One object a segment already holds, reported at mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryItem {
    pub key: String,
    pub offset: u64,
    pub size: u64,
    pub generation: u64,
    /// In the owner's disk tier rather than at `offset` of its DRAM.
    pub disk: bool,
}

/// Placement options of a put.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PutOptions {
    pub replica_num: u32,
    pub preferred_segment: Option<String>,
    pub soft_pin: bool,
    pub hard_pin: bool,
}

/// A per-item failure: a Mooncake code and a message for humans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpError {
    pub code: ErrorCode,
    pub message: String,
}

impl OpError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> OpError {
        OpError {
            code,
            message: message.into(),
        }
    }
}

/// A replica as clients see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaView {
    pub segment: SegmentDesc,
    pub offset: u64,
    pub size: u64,
    /// A LOCAL_DISK replica: read it with LOAD from the owner, not READ.
    pub disk: bool,
}

/// Where an object is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub generation: u64,
    pub size: u64,
    pub replicas: Vec<ReplicaView>,
    pub lease_ttl: Duration,
}

/// Object lifecycle in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ObjectState {
    Processing,
    Complete,
}

/// Errors that are not per-item: they become a `tonic::Status`.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(
        "cluster_id mismatch: this master serves cluster {ours:?} but the mount says {theirs:?}; \
         start the client with cluster_id {ours:?} or point it at the master of {theirs:?}"
    )]
    ClusterMismatch { ours: String, theirs: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("segment {0:?} is not mounted")]
    SegmentNotFound(String),
    #[error(
        "segment {segment:?} belongs to client {owner:?} (instance {instance:?}), not to \
         {caller:?}: only its owner may unmount it; a dead owner's segment goes after client_ttl"
    )]
    NotOwner {
        segment: String,
        owner: String,
        instance: String,
        caller: String,
    },
    /// A MountInventory part nobody awaits (the master restarted, or the segment was mounted
    /// again or completed since): the owner must start its mount over, so it is ABORTED, which
    /// owners retry, not INVALID_ARGUMENT, which a starting store treats as fatal.
    #[error(
        "no inventory of segment {segment:?} (instance {instance:?}) from client {client:?} is \
         awaited: mount the segment again with its inventory"
    )]
    InventoryNotAwaited {
        segment: String,
        instance: String,
        client: String,
    },
    #[error(
        "offload mismatch: store-client segment {segment:?} has --enable_offload=true but this \
         master runs without it, so objects evicted from its DRAM could never be found on its \
         disk; start lunakv-master with --enable_offload=true (and \"enable_offload\": true in \
         mooncake_config.json), or start the store-client with --enable_offload=false"
    )]
    OffloadMismatch { segment: String },
}

#[derive(Debug, Clone)]
struct ReplicaLoc {
    segment: String,
    mount_id: u64,
    offset: u64,
    /// In the owner's disk tier (no DRAM range; `offset` unused).
    disk: bool,
}

#[derive(Debug, Clone)]
struct Object {
    generation: u64,
    size: u64,
    replicas: Vec<ReplicaLoc>,
    state: ObjectState,
    client_id: String,
    put_start: Instant,
    lease_until: Option<Instant>,
    soft_pin_until: Option<Instant>,
    hard_pinned: bool,
    last_access: Instant,
    /// A promotion on hit is in flight (at most one per object).
    promoting: bool,
}

impl Object {
    fn leased(&self, now: Instant) -> bool {
        self.lease_until.is_some_and(|t| t > now)
    }

    fn soft_pinned(&self, now: Instant) -> bool {
        self.soft_pin_until.is_some_and(|t| t > now)
    }
}

struct Segment {
    desc: SegmentDesc,
    client_id: String,
    mount_id: u64,
    alloc: OffsetAllocator,
    /// The owner's whole inventory is indexed. Until then nothing is placed here: the
    /// allocator does not yet know every range the owner holds, and a new object could land on
    /// one of them.
    complete: bool,
}

struct ClientEntry {
    last_seen: Instant,
    segments: BTreeSet<String>,
}

/// A range waiting for its owner's acknowledgement before it returns to the allocator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingFree {
    pub endpoint: String,
    pub segment: String,
    pub mount_id: u64,
    pub generation: u64,
    /// The DRAM range, or [`lunakv_transfer::DISK_OFFSET`] for a disk copy (no range to free).
    pub offset: u64,
}

/// An object whose DRAM copy its owner is asked to move to disk (eviction with offload).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingOffload {
    pub key: String,
    pub endpoint: String,
    pub segment: String,
    pub mount_id: u64,
    pub generation: u64,
    pub offset: u64,
}

/// A disk-only object its owner is asked to copy back into DRAM (promotion on hit): the DRAM
/// range at `offset` is reserved in the allocator, not yet a replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingPromotion {
    pub key: String,
    pub endpoint: String,
    pub segment: String,
    pub mount_id: u64,
    pub generation: u64,
    pub offset: u64,
    pub size: u64,
}

/// A segment as the admin view shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SegmentInfo {
    pub name: String,
    pub transfer_endpoint: String,
    pub client_id: String,
    pub size: u64,
    pub used: u64,
    pub objects: u64,
    pub last_ping_ms_ago: u64,
    pub host_id: String,
    pub enable_offload: bool,
    pub disk_capacity: u64,
    pub disk_used: u64,
    pub disk_objects: u64,
}

/// One object as the admin view shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ObjectInfo {
    pub key: String,
    pub generation: u64,
    pub size: u64,
    pub state: ObjectState,
    pub client_id: String,
    pub replicas: Vec<ReplicaInfo>,
    pub lease_remaining_ms: u64,
    pub soft_pinned: bool,
    pub hard_pinned: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ReplicaInfo {
    pub segment: String,
    pub transfer_endpoint: String,
    pub offset: u64,
    /// "memory" or "local_disk".
    pub kind: &'static str,
}

/// A discarded put's ranges, held until its writer can no longer be copying into them.
struct Quarantined {
    until: Instant,
    key: String,
    client_id: String,
    frees: Vec<PendingFree>,
}

/// Result of a mount.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountOutcome {
    pub accepted: u64,
    pub rejected_generations: Vec<u64>,
    /// Replicas of older copies displaced by the inventory: free them through their owners.
    pub displaced: Vec<PendingFree>,
}

/// The master's state. Shared as `Arc<MasterCore>` by the edges and the background tasks.
pub struct MasterCore {
    cfg: CoreConfig,
    epoch: u32,
    counter: AtomicU64,
    next_mount_id: AtomicU64,
    shards: Vec<Mutex<HashMap<String, Object>>>,
    hasher: std::collections::hash_map::RandomState,
    segments: Mutex<HashMap<String, Segment>>,
    clients: Mutex<HashMap<String, ClientEntry>>,
    /// Ranges of discarded puts, freed once their release deadline passes (or at once when
    /// their writer revokes them or dies).
    quarantine: Mutex<Vec<Quarantined>>,
    /// Bytes each client holds reserved by puts it has not ended: recounted by every
    /// [`Self::sweep_puts`] and raised by each PutStart in between (a leaf lock).
    reserved: Mutex<HashMap<String, u64>>,
    /// Objects in the index as of the last sweep (the key limit's cheap check).
    approx_keys: AtomicU64,
    /// Ranges of puts whose writer died, to free on the next [`Self::release_orphaned`].
    orphaned: Mutex<Vec<PendingFree>>,
    eviction_lock: tokio::sync::Mutex<()>,
    /// Promotions reserved by gets, waiting for [`MasterCore::run_promotions`] (a leaf lock).
    promotions: Mutex<Vec<PendingPromotion>>,
    promotion_wanted: tokio::sync::Notify,
    notifier: Arc<dyn OwnerClient>,
    pub metrics: Metrics,
    /// Per key namespace: keys put per client and how many another client held (a leaf lock).
    pub namespaces: NamespaceTracker,
    /// KV events (docs/EVENTS.md): where the index's changes go, when publishing is on.
    events: Option<EventSink>,
}

/// Why an owner's inventory entry was not indexed (logged; the owner drops the entry).
#[derive(Debug, thiserror::Error)]
enum InventoryReject {
    #[error(transparent)]
    Key(#[from] lunakv_proto::KeyError),
    #[error("size 0")]
    SizeZero,
    #[error("a newer copy (generation {0}) is indexed")]
    Newer(u64),
    #[error("this segment already holds a replica of it")]
    Duplicate,
    #[error("size {size} differs from the indexed replica's {indexed}")]
    SizeMismatch { size: u64, indexed: u64 },
    #[error("a disk object, and this master runs without --enable_offload")]
    DiskWithoutOffload,
    #[error("segment unmounted during mount")]
    Unmounted,
    #[error(transparent)]
    Reserve(#[from] crate::alloc::ReserveError),
}

fn tiers_of(replicas: &[ReplicaLoc]) -> Tiers {
    Tiers {
        dram: replicas.iter().any(|r| !r.disk),
        ssd: replicas.iter().any(|r| r.disk),
    }
}

impl MasterCore {
    /// A core for `epoch` (the high 32 bits of every generation it hands out).
    pub fn new(cfg: CoreConfig, epoch: u32, notifier: Arc<dyn OwnerClient>) -> MasterCore {
        let cfg_min_keys = cfg.namespace_min_keys;
        MasterCore {
            cfg,
            epoch,
            counter: AtomicU64::new(1),
            next_mount_id: AtomicU64::new(1),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
            segments: Mutex::new(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
            quarantine: Mutex::new(Vec::new()),
            reserved: Mutex::new(HashMap::new()),
            approx_keys: AtomicU64::new(0),
            orphaned: Mutex::new(Vec::new()),
            eviction_lock: tokio::sync::Mutex::new(()),
            promotions: Mutex::new(Vec::new()),
            promotion_wanted: tokio::sync::Notify::new(),
            notifier,
            metrics: Metrics::new(),
            namespaces: NamespaceTracker::new(cfg_min_keys),
            events: None,
        }
    }

    /// This core publishes its index's changes into `sink`, starting with a
    /// [`PoolEvent::Reset`]: a new core (a restart, a new HA term) starts from an empty index,
    /// which the owners' inventories then refill (each key re-announced as stored).
    pub fn with_events(mut self, sink: Option<EventSink>) -> MasterCore {
        if let Some(s) = &sink {
            s.emit(PoolEvent::Reset);
        }
        self.events = sink;
        self
    }

    /// Where this core's KV events go, when it publishes them.
    pub fn events(&self) -> Option<&crate::events::publisher::EventEndpoints> {
        self.events.as_ref().map(EventSink::endpoints)
    }

    /// The events' names for `replicas` (a segments lock: call with at most a shard held).
    fn replica_refs(&self, replicas: &[ReplicaLoc]) -> Vec<ReplicaRef> {
        let segs = self.segments.lock();
        replicas
            .iter()
            .map(|r| ReplicaRef {
                disk: r.disk,
                endpoint: segs
                    .get(&r.segment)
                    .filter(|s| s.mount_id == r.mount_id)
                    .map_or_else(|| r.segment.clone(), |s| s.desc.transfer_endpoint.clone()),
            })
            .collect()
    }

    fn emit_stored(&self, key: &str, replicas: &[ReplicaLoc]) {
        if let Some(sink) = &self.events {
            sink.emit(PoolEvent::Stored {
                key: key.to_string(),
                replicas: self.replica_refs(replicas),
            });
        }
    }

    /// A complete object's replicas changed from the tiers in `before` to `replicas` (empty:
    /// the object is gone).
    fn emit_updated(&self, key: &str, before: Tiers, replicas: &[ReplicaLoc]) {
        if let Some(sink) = &self.events {
            sink.emit(PoolEvent::Updated {
                key: key.to_string(),
                before,
                replicas: self.replica_refs(replicas),
            });
        }
    }

    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Object>> {
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    fn next_generation(&self) -> Result<u64, OpError> {
        let c = self.counter.fetch_add(1, Ordering::Relaxed);
        if c > u64::from(u32::MAX) {
            return Err(OpError::new(
                ErrorCode::InternalError,
                "generation counter exhausted for this epoch: restart the master",
            ));
        }
        Ok((u64::from(self.epoch) << 32) | c)
    }

    // === segments and clients ===

    /// Mounts a segment for `client_id`, indexing the objects its inventory reports. A segment
    /// of the same name mounted before is replaced (its replicas are dropped).
    pub fn mount(
        &self,
        client_id: &str,
        cluster_id: &str,
        desc: SegmentDesc,
        inventory: Vec<InventoryItem>,
    ) -> Result<MountOutcome, CoreError> {
        self.mount_parts(client_id, cluster_id, desc, inventory, false)
    }

    /// [`MasterCore::mount`] with the first part of the inventory. With `inventory_follows`
    /// the rest arrives through [`MasterCore::mount_inventory`] (an inventory can be larger
    /// than one gRPC message) and the segment takes no placements until its last part.
    pub fn mount_parts(
        &self,
        client_id: &str,
        cluster_id: &str,
        desc: SegmentDesc,
        inventory: Vec<InventoryItem>,
        inventory_follows: bool,
    ) -> Result<MountOutcome, CoreError> {
        if cluster_id != self.cfg.cluster_id {
            return Err(CoreError::ClusterMismatch {
                ours: self.cfg.cluster_id.clone(),
                theirs: cluster_id.to_string(),
            });
        }
        if desc.enable_offload && !self.cfg.enable_offload {
            self.metrics.offload_mismatch_total.inc();
            return Err(CoreError::OffloadMismatch {
                segment: desc.name.clone(),
            });
        }
        if self.cfg.enable_offload && !desc.enable_offload {
            self.metrics.offload_mismatch_total.inc();
            tracing::warn!(segment = %desc.name, "offload mismatch: this master runs with --enable_offload=true but store-client {} mounted without it; objects evicted from its DRAM are dropped, not offloaded. Start that store-client with --enable_offload=true and MOONCAKE_OFFLOAD_FILE_STORAGE_PATH, or the master without --enable_offload", desc.name);
        } else if desc.enable_offload && desc.disk_capacity == 0 {
            tracing::warn!(segment = %desc.name, "store-client has --enable_offload=true but no usable disk tier (see its log: offload directory); its evictions drop objects");
        }
        let mount_id = self.next_mount_id.fetch_add(1, Ordering::Relaxed);
        let name = desc.name.clone();
        let replaced = {
            let mut segs = self.segments.lock();
            let old = segs.insert(
                name.clone(),
                Segment {
                    alloc: OffsetAllocator::new(desc.size),
                    desc: desc.clone(),
                    client_id: client_id.to_string(),
                    mount_id,
                    complete: false,
                },
            );
            old.map(|o| (o.client_id, o.mount_id))
        };
        if let Some((old_client, old_mount)) = replaced {
            tracing::info!(segment = %name, %old_client, "segment mounted again; dropping its old replicas");
            if let Some(c) = self.clients.lock().get_mut(&old_client) {
                c.segments.remove(&name);
            }
            self.drop_replicas(&name, old_mount);
        }
        {
            let mut clients = self.clients.lock();
            let c = clients
                .entry(client_id.to_string())
                .or_insert_with(|| ClientEntry {
                    last_seen: Instant::now(),
                    segments: BTreeSet::new(),
                });
            c.last_seen = Instant::now();
            c.segments.insert(name.clone());
        }
        let out = self.index_inventory(client_id, &desc, mount_id, inventory, !inventory_follows);
        tracing::info!(segment = %name, client_id, size = desc.size, accepted = out.accepted, rejected = out.rejected_generations.len(), inventory_follows, "segment mounted");
        Ok(out)
    }

    /// A further part of the inventory of a segment mounted with `inventory_follows`; `last`
    /// opens it to placements. Refused unless `client_id` owns the mount `instance_id` names:
    /// an owner that meets this refusal mounts again from the start.
    pub fn mount_inventory(
        &self,
        client_id: &str,
        segment_name: &str,
        instance_id: &str,
        items: Vec<InventoryItem>,
        last: bool,
    ) -> Result<MountOutcome, CoreError> {
        let (desc, mount_id) = {
            let segs = self.segments.lock();
            let not_awaited = || CoreError::InventoryNotAwaited {
                segment: segment_name.to_string(),
                instance: instance_id.to_string(),
                client: client_id.to_string(),
            };
            let seg = segs.get(segment_name).ok_or_else(not_awaited)?;
            if seg.client_id != client_id || seg.desc.instance_id != instance_id || seg.complete {
                return Err(not_awaited());
            }
            (seg.desc.clone(), seg.mount_id)
        };
        if let Some(c) = self.clients.lock().get_mut(client_id) {
            c.last_seen = Instant::now();
        }
        let out = self.index_inventory(client_id, &desc, mount_id, items, last);
        if last {
            tracing::info!(segment = %segment_name, client_id, "segment inventory complete; placing objects there");
        }
        Ok(out)
    }

    /// Indexes `items` into the mount `mount_id`; `complete` then opens the segment to
    /// placements (if that mount is still the current one).
    fn index_inventory(
        &self,
        client_id: &str,
        desc: &SegmentDesc,
        mount_id: u64,
        items: Vec<InventoryItem>,
        complete: bool,
    ) -> MountOutcome {
        let mut out = MountOutcome::default();
        for item in items {
            match self.index_inventory_item(client_id, desc, mount_id, &item) {
                Ok(displaced) => {
                    out.accepted += 1;
                    out.displaced.extend(displaced);
                }
                Err(reason) => {
                    tracing::warn!(segment = %desc.name, key = %item.key, generation = item.generation, %reason, "inventory entry rejected");
                    out.rejected_generations.push(item.generation);
                }
            }
        }
        if complete
            && let Some(seg) = self.segments.lock().get_mut(&desc.name)
            && seg.mount_id == mount_id
        {
            seg.complete = true;
        }
        out
    }

    /// Segments whose owner's whole inventory is indexed.
    pub fn complete_segments(&self) -> BTreeSet<String> {
        self.segments
            .lock()
            .iter()
            .filter(|(_, s)| s.complete)
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn index_inventory_item(
        &self,
        client_id: &str,
        desc: &SegmentDesc,
        mount_id: u64,
        item: &InventoryItem,
    ) -> Result<Vec<PendingFree>, InventoryReject> {
        lunakv_proto::validate_key(&item.key)?;
        if item.size == 0 {
            return Err(InventoryReject::SizeZero);
        }
        let now = Instant::now();
        let mut shard = self.shard(&item.key).lock();
        let mut displaced = Vec::new();
        if let Some(existing) = shard.get(&item.key) {
            if existing.generation > item.generation {
                return Err(InventoryReject::Newer(existing.generation));
            }
            if existing.generation == item.generation
                && existing
                    .replicas
                    .iter()
                    .any(|r| r.segment == desc.name && r.disk == item.disk)
            {
                return Err(InventoryReject::Duplicate);
            }
            if existing.generation == item.generation && existing.size != item.size {
                return Err(InventoryReject::SizeMismatch {
                    size: item.size,
                    indexed: existing.size,
                });
            }
        }
        if item.disk && !self.cfg.enable_offload {
            return Err(InventoryReject::DiskWithoutOffload);
        }
        {
            let mut segs = self.segments.lock();
            let seg = segs
                .get_mut(&desc.name)
                .filter(|s| s.mount_id == mount_id)
                .ok_or(InventoryReject::Unmounted)?;
            // A disk object holds no DRAM range.
            if !item.disk {
                seg.alloc.reserve(item.offset, item.size)?;
            }
        }
        let loc = ReplicaLoc {
            segment: desc.name.clone(),
            mount_id,
            offset: if item.disk {
                lunakv_transfer::DISK_OFFSET
            } else {
                item.offset
            },
            disk: item.disk,
        };
        match shard.get_mut(&item.key) {
            Some(existing) if existing.generation == item.generation => {
                let before = tiers_of(&existing.replicas);
                existing.replicas.push(loc);
                self.emit_updated(&item.key, before, &existing.replicas);
            }
            Some(existing) => {
                // An older copy: the inventory's is newer, so it wins.
                displaced = self.pending_frees(existing);
                *existing = Object {
                    generation: item.generation,
                    size: item.size,
                    replicas: vec![loc],
                    state: ObjectState::Complete,
                    client_id: client_id.to_string(),
                    put_start: now,
                    lease_until: None,
                    soft_pin_until: None,
                    hard_pinned: false,
                    last_access: now,
                    promoting: false,
                };
                self.emit_stored(&item.key, &existing.replicas);
            }
            None => {
                self.emit_stored(&item.key, std::slice::from_ref(&loc));
                shard.insert(
                    item.key.clone(),
                    Object {
                        generation: item.generation,
                        size: item.size,
                        replicas: vec![loc],
                        state: ObjectState::Complete,
                        client_id: client_id.to_string(),
                        put_start: now,
                        lease_until: None,
                        soft_pin_until: None,
                        hard_pinned: false,
                        last_access: now,
                        promoting: false,
                    },
                );
            }
        }
        Ok(displaced)
    }

    /// [`Self::unmount`] on behalf of `client_id`: only the client that mounted the segment,
    /// and (when `instance_id` is given) only for the server instance it mounted.
    pub fn unmount_owned(
        &self,
        client_id: &str,
        segment_name: &str,
        instance_id: &str,
    ) -> Result<u64, CoreError> {
        {
            let segs = self.segments.lock();
            let seg = segs
                .get(segment_name)
                .ok_or_else(|| CoreError::SegmentNotFound(segment_name.to_string()))?;
            if seg.client_id != client_id
                || (!instance_id.is_empty() && seg.desc.instance_id != instance_id)
            {
                self.metrics.foreign_unmounts_refused_total.inc();
                return Err(CoreError::NotOwner {
                    segment: segment_name.to_string(),
                    owner: seg.client_id.clone(),
                    instance: seg.desc.instance_id.clone(),
                    caller: client_id.to_string(),
                });
            }
        }
        self.unmount(segment_name)
    }

    /// Unmounts a segment: its replicas are dropped (objects left without one disappear).
    /// Returns the number of objects that disappeared.
    pub fn unmount(&self, segment_name: &str) -> Result<u64, CoreError> {
        let seg = self
            .segments
            .lock()
            .remove(segment_name)
            .ok_or_else(|| CoreError::SegmentNotFound(segment_name.to_string()))?;
        if let Some(c) = self.clients.lock().get_mut(&seg.client_id) {
            c.segments.remove(segment_name);
        }
        let dropped = self.drop_replicas(segment_name, seg.mount_id);
        tracing::info!(segment = segment_name, dropped, "segment unmounted");
        Ok(dropped)
    }

    fn drop_replicas(&self, segment: &str, mount_id: u64) -> u64 {
        let mut dropped = 0;
        for shard in &self.shards {
            shard.lock().retain(|k, o| {
                let before = o.replicas.len();
                let tiers = tiers_of(&o.replicas);
                o.replicas
                    .retain(|r| !(r.segment == segment && r.mount_id == mount_id));
                if o.replicas.len() != before && o.state == ObjectState::Complete {
                    self.emit_updated(k, tiers, &o.replicas);
                }
                let keep = !o.replicas.is_empty();
                if !keep {
                    dropped += 1;
                }
                keep
            });
        }
        dropped
    }

    /// A client's liveness signal. Returns `true` ("remount required") when the client was not
    /// known (the master restarted or declared it dead), or when one of the segments it says
    /// it serves (`mounted`) is not mounted for it here; it is known from then on.
    pub fn ping(&self, client_id: &str, touched_keys: &[String], mounted: &[String]) -> bool {
        let now = Instant::now();
        let remount = {
            let mut clients = self.clients.lock();
            match clients.get_mut(client_id) {
                Some(c) => {
                    c.last_seen = now;
                    mounted.iter().any(|s| !c.segments.contains(s))
                }
                None => {
                    clients.insert(
                        client_id.to_string(),
                        ClientEntry {
                            last_seen: now,
                            segments: BTreeSet::new(),
                        },
                    );
                    true
                }
            }
        };
        for key in touched_keys {
            if let Some(o) = self.shard(key).lock().get_mut(key) {
                o.last_access = now;
            }
        }
        remount
    }

    /// Declares clients silent for `client_ttl` dead and unmounts their segments. Returns the
    /// clients removed, each with the segments unmounted.
    pub fn expire_clients(&self) -> Vec<(String, Vec<String>)> {
        let now = Instant::now();
        let dead: Vec<(String, BTreeSet<String>)> = {
            let mut clients = self.clients.lock();
            let ids: Vec<String> = clients
                .iter()
                .filter(|(_, c)| now.duration_since(c.last_seen) >= self.cfg.client_ttl)
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| clients.remove(&id).map(|c| (id, c.segments)))
                .collect()
        };
        let mut out = Vec::new();
        for (id, _) in &dead {
            self.orphan_puts_of(id);
        }
        for (id, segs) in dead {
            if segs.is_empty() {
                // A pure requester that went away (an engine restart): nothing to clean up.
                tracing::info!(client_id = %id, "requester silent past client_ttl; forgotten");
            } else {
                tracing::warn!(client_id = %id, segments = segs.len(), ttl_s = self.cfg.client_ttl.as_secs_f64(), "client silent past client_ttl; unmounting its segments");
            }
            let mut unmounted = Vec::new();
            for s in segs {
                let owned = self
                    .segments
                    .lock()
                    .get(&s)
                    .is_some_and(|seg| seg.client_id == id);
                // A concurrent unmount may have won; that is fine.
                if owned && self.unmount(&s).is_ok() {
                    unmounted.push(s);
                }
            }
            out.push((id, unmounted));
        }
        out
    }

    /// A dead writer's unfinished puts and quarantined ranges: out of the index now, their
    /// ranges freed by the next [`Self::release_orphaned`].
    fn orphan_puts_of(&self, client_id: &str) {
        let mut frees = self.unquarantine(|q| q.client_id == client_id);
        let mut puts = 0u64;
        for shard in &self.shards {
            let mut shard = shard.lock();
            let keys: Vec<String> = shard
                .iter()
                .filter(|(_, o)| o.state == ObjectState::Processing && o.client_id == client_id)
                .map(|(k, _)| k.clone())
                .collect();
            for k in keys {
                if let Some(o) = shard.remove(&k) {
                    frees.extend(self.pending_frees(&o));
                    puts += 1;
                }
            }
        }
        self.reserved.lock().remove(client_id);
        if !frees.is_empty() {
            tracing::warn!(
                client_id,
                unfinished_puts = puts,
                ranges = frees.len(),
                "client died with puts in progress; their reservations are freed now"
            );
            self.orphaned.lock().extend(frees);
        }
    }

    // === puts ===

    /// Starts a put: places `replica_num` replicas on distinct segments, evicting once if
    /// nothing fits. The object is invisible until [`Self::put_end`].
    pub async fn put_start(
        &self,
        client_id: &str,
        key: &str,
        size: u64,
        opts: &PutOptions,
    ) -> Result<(u64, Vec<ReplicaView>), OpError> {
        self.admit_put(client_id, size, opts).await?;
        match self.try_place(client_id, key, size, opts) {
            Err(e) if e.code == ErrorCode::NoAvailableHandle => {}
            other => return other,
        }
        if self.total_capacity() > 0 {
            // Bounded: at most max(eviction_ratio x capacity, this put's bytes), and only for
            // a put that fits one segment (admit_put refused the rest).
            let need = align_up(size)
                .unwrap_or(u64::MAX)
                .saturating_mul(u64::from(opts.replica_num.max(1)));
            self.evict(need).await;
        }
        let r = self.try_place(client_id, key, size, opts);
        if matches!(&r, Err(e) if e.code == ErrorCode::NoAvailableHandle) {
            self.metrics.put_start_alloc_failures_total.inc();
        }
        r
    }

    /// What no eviction can fix is refused before anything is evicted: an object larger than
    /// every segment (it would wipe the pool and fail anyway), a client past its reservation
    /// limit, and the index at `max_keys` with nothing evictable.
    async fn admit_put(
        &self,
        client_id: &str,
        size: u64,
        opts: &PutOptions,
    ) -> Result<(), OpError> {
        let len = align_up(size).unwrap_or(u64::MAX);
        let (largest, capacity, complete) = {
            let segs = self.segments.lock();
            (
                segs.values().map(|s| s.alloc.capacity()).max(),
                segs.values().map(|s| s.alloc.capacity()).sum::<u64>(),
                segs.values().filter(|s| s.complete).count(),
            )
        };
        if largest.is_some() && complete == 0 {
            // Evicting would only drop objects the inventories just brought back.
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                "every mounted segment is still receiving its owner's inventory: retry in a \
                 moment",
            ));
        }
        if let Some(largest) = largest
            && len > largest
        {
            self.metrics.put_start_oversized_total.inc();
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                format!(
                    "an object of {size} bytes can never fit: the largest segment holds \
                     {largest} bytes (the pool {capacity}); split the object or start \
                     store-clients with a larger --global_segment_size"
                ),
            ));
        }
        let wanted = len.saturating_mul(u64::from(opts.replica_num.max(1)));
        let limit = (capacity as f64 * self.cfg.put_reservation_limit_ratio) as u64;
        let held = self.reserved.lock().get(client_id).copied().unwrap_or(0);
        if capacity > 0 && held > 0 && held.saturating_add(wanted) > limit {
            self.metrics.put_start_reservation_refused_total.inc();
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                format!(
                    "client {client_id:?} already holds {held} bytes in puts it has not ended; \
                     one client may hold at most {limit} (put_reservation_limit_ratio {} of \
                     the pool): end or revoke those puts first",
                    self.cfg.put_reservation_limit_ratio
                ),
            ));
        }
        let max = self.cfg.max_keys;
        if max > 0 && self.approx_keys.load(Ordering::Relaxed) >= max {
            self.enforce_key_limit().await;
            if self.key_count() >= max {
                self.metrics.put_start_key_limit_refused_total.inc();
                return Err(OpError::new(
                    ErrorCode::NoAvailableHandle,
                    format!(
                        "the master holds max_keys = {max} objects and none can be evicted \
                         (leased, pinned or being put); raise max_keys or remove objects"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn try_place(
        &self,
        client_id: &str,
        key: &str,
        size: u64,
        opts: &PutOptions,
    ) -> Result<(u64, Vec<ReplicaView>), OpError> {
        let now = Instant::now();
        let mut shard = self.shard(key).lock();
        if let Some(o) = shard.get(key) {
            if o.client_id != client_id {
                // Another instance holds this block: the cross-instance sharing doctor checks.
                self.namespaces.record_put(client_id, key, true);
            }
            let what = match o.state {
                ObjectState::Complete => "exists",
                ObjectState::Processing => "is being put",
            };
            return Err(OpError::new(
                ErrorCode::ObjectAlreadyExists,
                format!("key {key:?} {what} (generation {})", o.generation),
            ));
        }
        let mut segs = self.segments.lock();
        if segs.is_empty() {
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                "no segment is mounted: start a store-client or an embedded client with \
                 global_segment_size > 0",
            ));
        }
        let len = align_up(size).unwrap_or(u64::MAX);
        let mut order: Vec<&String> = segs
            .iter()
            .filter(|(_, s)| s.complete && s.alloc.largest_free() >= len)
            .map(|(n, _)| n)
            .collect();
        order.shuffle(&mut rand::rng());
        if let Some(p) = &opts.preferred_segment
            && let Some(pos) = order.iter().position(|n| *n == p)
        {
            let pref = order.remove(pos);
            order.insert(0, pref);
        }
        let complete = segs.values().filter(|s| s.complete).count();
        let wanted = (opts.replica_num.max(1) as usize).min(complete);
        if order.len() < wanted {
            let largest = segs.values().map(|s| s.alloc.largest_free()).max();
            return Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                format!(
                    "no room for {size} bytes x {wanted} replica(s): largest free range is {} \
                     bytes",
                    largest.unwrap_or(0)
                ),
            ));
        }
        let chosen: Vec<String> = order.into_iter().take(wanted).cloned().collect();
        let mut replicas = Vec::with_capacity(wanted);
        let mut views = Vec::with_capacity(wanted);
        for name in &chosen {
            let Some(seg) = segs.get_mut(name) else {
                continue;
            };
            // largest_free >= len was checked under this same lock, so best fit succeeds.
            let Some(offset) = seg.alloc.allocate(size) else {
                continue;
            };
            replicas.push(ReplicaLoc {
                segment: name.clone(),
                mount_id: seg.mount_id,
                offset,
                disk: false,
            });
            views.push(ReplicaView {
                segment: seg.desc.clone(),
                offset,
                size,
                disk: false,
            });
        }
        drop(segs);
        let placed = replicas.len() as u64;
        let generation = self.next_generation()?;
        let soft_ttl = self.cfg.soft_pin_ttl.min(self.cfg.max_soft_pin_ttl);
        shard.insert(
            key.to_string(),
            Object {
                generation,
                size,
                replicas,
                state: ObjectState::Processing,
                client_id: client_id.to_string(),
                put_start: now,
                lease_until: None,
                soft_pin_until: opts.soft_pin.then(|| now + soft_ttl),
                hard_pinned: opts.hard_pin,
                last_access: now,
                promoting: false,
            },
        );
        drop(shard);
        *self
            .reserved
            .lock()
            .entry(client_id.to_string())
            .or_default() += len.saturating_mul(placed);
        self.approx_keys.fetch_add(1, Ordering::Relaxed);
        self.namespaces.record_put(client_id, key, false);
        Ok((generation, views))
    }

    /// Publishes a put: from now on gets and exists see it.
    pub fn put_end(&self, key: &str) -> Result<(), OpError> {
        let mut shard = self.shard(key).lock();
        let o = shard
            .get_mut(key)
            .ok_or_else(|| not_found(key, "no put in progress"))?;
        let first = o.state == ObjectState::Processing;
        if first {
            self.unreserve(o);
        }
        o.state = ObjectState::Complete;
        o.last_access = Instant::now();
        if first {
            self.emit_stored(key, &o.replicas);
        }
        Ok(())
    }

    /// Abandons a put in progress; its ranges are freed through their owners. A put already
    /// discarded as a zombie is still held in quarantine: its writer's revoke frees it now
    /// (`client_id` empty = any client).
    pub async fn put_revoke(&self, client_id: &str, key: &str) -> Result<(), OpError> {
        let frees = {
            let mut shard = self.shard(key).lock();
            match shard.get(key) {
                None => {
                    let frees = self.unquarantine(|q| {
                        q.key == key && (client_id.is_empty() || q.client_id == client_id)
                    });
                    if frees.is_empty() {
                        return Err(not_found(key, "no put in progress"));
                    }
                    tracing::info!(
                        key,
                        client_id,
                        "revoke of a discarded put: its ranges are freed now"
                    );
                    self.metrics
                        .put_reservations_reclaimed_total
                        .inc_by(frees.len() as u64);
                    frees
                }
                Some(o) if o.state == ObjectState::Complete => {
                    return Err(OpError::new(
                        ErrorCode::InvalidWrite,
                        format!("key {key:?} is complete; remove it instead of revoking"),
                    ));
                }
                Some(_) => shard
                    .remove(key)
                    .map(|o| {
                        self.unreserve(&o);
                        self.pending_frees(&o)
                    })
                    .unwrap_or_default(),
            }
        };
        self.release(frees).await;
        Ok(())
    }

    // === reads ===

    /// The location of a complete object; grants (extends) a lease on it.
    pub fn get_replica_list(&self, key: &str) -> Result<Location, OpError> {
        self.get_replica_list_for("", key)
    }

    /// [`Self::get_replica_list`] on behalf of `client_id` (exists and get lookups): finding a
    /// key another client put counts as a shared key of its namespace.
    pub fn get_replica_list_for(&self, client_id: &str, key: &str) -> Result<Location, OpError> {
        let now = Instant::now();
        let mut shard = self.shard(key).lock();
        let o = shard
            .get_mut(key)
            .ok_or_else(|| not_found(key, "not found"))?;
        if o.state != ObjectState::Complete {
            return Err(not_found(key, "its put has not ended yet"));
        }
        if !client_id.is_empty() && o.client_id != client_id {
            self.namespaces.record_found_from_other(client_id, key);
        }
        let lease_until = now + self.cfg.lease_ttl;
        o.lease_until = Some(o.lease_until.map_or(lease_until, |t| t.max(lease_until)));
        o.last_access = now;
        if o.soft_pin_until.is_some() {
            o.soft_pin_until = Some(now + self.cfg.soft_pin_ttl.min(self.cfg.max_soft_pin_ttl));
        }
        let mut segs = self.segments.lock();
        let replicas = o
            .replicas
            .iter()
            .filter_map(|r| {
                segs.get(&r.segment)
                    .filter(|s| s.mount_id == r.mount_id)
                    .map(|s| ReplicaView {
                        segment: s.desc.clone(),
                        offset: if r.disk { 0 } else { r.offset },
                        size: o.size,
                        disk: r.disk,
                    })
            })
            .collect();
        let disk_only = o.replicas.iter().all(|r| r.disk);
        let promotion = if disk_only && self.cfg.promotion_on_hit && !o.promoting {
            // Reserve a DRAM range on a disk replica's owner; no room means no promotion (it
            // is not worth an eviction), and the next hit tries again.
            o.replicas.iter().filter(|r| r.disk).find_map(|r| {
                let seg = segs
                    .get_mut(&r.segment)
                    .filter(|s| s.mount_id == r.mount_id && s.complete)?;
                let offset = seg.alloc.allocate(o.size)?;
                Some(PendingPromotion {
                    key: key.to_string(),
                    endpoint: seg.desc.transfer_endpoint.clone(),
                    segment: r.segment.clone(),
                    mount_id: r.mount_id,
                    generation: o.generation,
                    offset,
                    size: o.size,
                })
            })
        } else {
            None
        };
        drop(segs);
        if disk_only {
            self.metrics.disk_hits_total.inc();
        }
        if let Some(p) = promotion {
            o.promoting = true;
            self.promotions.lock().push(p);
            self.promotion_wanted.notify_one();
        }
        Ok(Location {
            generation: o.generation,
            size: o.size,
            replicas,
            lease_ttl: self.cfg.lease_ttl,
        })
    }

    // === removal ===

    /// Removes an object. A leased object (-706) or a put in progress (-703) is kept unless
    /// `force`. Answers after the owners acknowledged the FREE (or timed out).
    pub async fn remove(&self, key: &str, force: bool) -> Result<(), OpError> {
        let frees = {
            let mut shard = self.shard(key).lock();
            let o = shard.get(key).ok_or_else(|| not_found(key, "not found"))?;
            let now = Instant::now();
            if !force && o.state == ObjectState::Processing {
                return Err(OpError::new(
                    ErrorCode::ReplicaIsNotReady,
                    format!("key {key:?} is being put; retry after PutEnd or use force"),
                ));
            }
            if !force && o.leased(now) {
                return Err(OpError::new(
                    ErrorCode::ObjectHasLease,
                    format!(
                        "key {key:?} is leased to a reader for up to {} ms more; retry later or \
                         use force",
                        o.lease_until
                            .map_or(0, |t| t.saturating_duration_since(now).as_millis())
                    ),
                ));
            }
            let o = shard.remove(key);
            if let Some(o) = &o
                && o.state == ObjectState::Complete
            {
                self.emit_updated(key, tiers_of(&o.replicas), &[]);
            }
            o.map(|o| self.pending_frees(&o)).unwrap_or_default()
        };
        self.release(frees).await;
        Ok(())
    }

    /// Removes every complete, unleased object (with `force`: every object). Returns how many.
    pub async fn remove_all(&self, force: bool) -> u64 {
        let now = Instant::now();
        let mut frees = Vec::new();
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            let keys: Vec<String> = shard
                .iter()
                .filter(|(_, o)| force || (o.state == ObjectState::Complete && !o.leased(now)))
                .map(|(k, _)| k.clone())
                .collect();
            for k in keys {
                if let Some(o) = shard.remove(&k) {
                    frees.extend(self.pending_frees(&o));
                    removed += 1;
                }
            }
        }
        if let Some(sink) = &self.events {
            sink.emit(PoolEvent::RemovedAll);
        }
        self.release(frees).await;
        removed
    }

    fn pending_frees(&self, o: &Object) -> Vec<PendingFree> {
        self.frees_of(o.generation, &o.replicas)
    }

    /// FREEs for `replicas` of `generation`: DRAM ranges, and disk copies (offset
    /// [`lunakv_transfer::DISK_OFFSET`]) so the owner's disk tier forgets them too and a
    /// restart cannot bring a removed object back.
    fn frees_of(&self, generation: u64, replicas: &[ReplicaLoc]) -> Vec<PendingFree> {
        let segs = self.segments.lock();
        replicas
            .iter()
            .filter_map(|r| {
                segs.get(&r.segment)
                    .filter(|s| s.mount_id == r.mount_id)
                    .map(|s| PendingFree {
                        endpoint: s.desc.transfer_endpoint.clone(),
                        segment: r.segment.clone(),
                        mount_id: r.mount_id,
                        generation,
                        offset: if r.disk {
                            lunakv_transfer::DISK_OFFSET
                        } else {
                            r.offset
                        },
                    })
            })
            .collect()
    }

    /// Asks each owner (in parallel, one call per owner) to drop the entries, then returns the
    /// ranges to their allocators. An owner that does not answer within `free_timeout` is
    /// logged and its ranges are freed anyway (it is dead or about to be declared dead).
    pub async fn release(&self, frees: Vec<PendingFree>) {
        if frees.is_empty() {
            return;
        }
        let timeout = self.cfg.free_timeout;
        let notifier = &self.notifier;
        let owners = frees.iter().map(|f| {
            let entry = FreeEntry::from_wire(f.generation, f.offset);
            (f.endpoint.clone(), entry)
        });
        fan_out_by_owner(owners, |endpoint, entries| async move {
            let r = tokio::time::timeout(
                timeout + Duration::from_millis(500),
                notifier.free(&endpoint, &entries, timeout),
            )
            .await;
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(%endpoint, entries = entries.len(), error = %e, "owner did not acknowledge FREE; freeing the ranges anyway"),
                Err(_) => tracing::warn!(%endpoint, entries = entries.len(), "FREE timed out; freeing the ranges anyway"),
            }
        })
        .await;
        let mut segs = self.segments.lock();
        for f in frees {
            if f.offset == lunakv_transfer::DISK_OFFSET {
                continue;
            }
            if let Some(seg) = segs
                .get_mut(&f.segment)
                .filter(|s| s.mount_id == f.mount_id)
            {
                seg.alloc.free(f.offset);
            }
        }
    }

    // === eviction and sweeps ===

    /// Allocated share of total capacity, in [0, 1].
    pub fn usage_ratio(&self) -> f64 {
        let (used, cap) = self.usage();
        if cap == 0 {
            0.0
        } else {
            used as f64 / cap as f64
        }
    }

    /// Evicts if usage is at or above the high watermark. Returns keys evicted.
    pub async fn evict_if_needed(&self) -> u64 {
        if self.total_capacity() > 0 && self.usage_ratio() >= self.cfg.high_watermark {
            self.evict(0).await
        } else {
            0
        }
    }

    /// Evicts at least `max(eviction_ratio * capacity, min_bytes)` bytes of DRAM if it can:
    /// complete, unleased, unpinned objects, least recently used first; soft-pinned ones only
    /// after all others; hard-pinned, leased and in-progress ones never. With offload on, an
    /// object whose owner has a disk tier is not dropped: its owner writes it to disk before the
    /// DRAM range is freed, and it stays indexed with a LOCAL_DISK replica. An object that already
    /// has a disk copy just loses its DRAM replicas. Returns keys evicted from DRAM.
    pub async fn evict(&self, min_bytes: u64) -> u64 {
        let _guard = self.eviction_lock.lock().await;
        let now = Instant::now();
        let target =
            ((self.total_capacity() as f64 * self.cfg.eviction_ratio) as u64).max(min_bytes);
        // (soft pinned, last access, key, generation, DRAM bytes)
        let mut candidates: Vec<(bool, Instant, String, u64, u64)> = Vec::new();
        for shard in &self.shards {
            for (k, o) in shard.lock().iter() {
                let in_dram = o.replicas.iter().filter(|r| !r.disk).count() as u64;
                if in_dram > 0
                    && o.state == ObjectState::Complete
                    && !o.leased(now)
                    && !o.hard_pinned
                {
                    let bytes = align_up(o.size).unwrap_or(o.size) * in_dram;
                    candidates.push((
                        o.soft_pinned(now),
                        o.last_access,
                        k.clone(),
                        o.generation,
                        bytes,
                    ));
                }
            }
        }
        candidates.sort_by_key(|c| (c.0, c.1));
        let mut freed = 0u64;
        let mut evicted = 0u64;
        let mut frees = Vec::new();
        let mut offloads = Vec::new();
        for (_, _, key, generation, bytes) in candidates {
            if freed >= target {
                break;
            }
            let mut shard = self.shard(&key).lock();
            // Re-check: a reader may have leased it since the scan.
            let Some(o) = shard.get_mut(&key).filter(|o| {
                o.generation == generation
                    && o.state == ObjectState::Complete
                    && !o.leased(Instant::now())
                    && !o.hard_pinned
            }) else {
                continue;
            };
            let has_disk = o.replicas.iter().any(|r| r.disk);
            let before = tiers_of(&o.replicas);
            let spill_to = if has_disk || !self.cfg.enable_offload {
                None
            } else {
                let segs = self.segments.lock();
                o.replicas.iter().filter(|r| !r.disk).find_map(|r| {
                    segs.get(&r.segment)
                        .filter(|s| {
                            s.mount_id == r.mount_id
                                && s.desc.enable_offload
                                && s.desc.disk_capacity >= o.size
                        })
                        .map(|s| (r.clone(), s.desc.transfer_endpoint.clone()))
                })
            };
            if has_disk || spill_to.is_some() {
                // The object survives on disk; its DRAM replicas go (the one being offloaded
                // is freed by the OFFLOAD round trip, after the owner made it durable).
                let mem: Vec<ReplicaLoc> = o
                    .replicas
                    .iter()
                    .filter(|r| !r.disk)
                    .filter(|r| {
                        spill_to
                            .as_ref()
                            .is_none_or(|(t, _)| !(t.segment == r.segment && t.offset == r.offset))
                    })
                    .cloned()
                    .collect();
                frees.extend(self.frees_of(o.generation, &mem));
                o.replicas.retain(|r| r.disk);
                if let Some((t, endpoint)) = spill_to {
                    offloads.push(PendingOffload {
                        key: key.clone(),
                        endpoint,
                        segment: t.segment.clone(),
                        mount_id: t.mount_id,
                        generation: o.generation,
                        offset: t.offset,
                    });
                    o.replicas.push(ReplicaLoc {
                        offset: lunakv_transfer::DISK_OFFSET,
                        disk: true,
                        ..t
                    });
                }
                self.emit_updated(&key, before, &o.replicas);
                freed += bytes;
                evicted += 1;
            } else if let Some(o) = shard.remove(&key) {
                self.emit_updated(&key, before, &[]);
                frees.extend(self.pending_frees(&o));
                freed += bytes;
                evicted += 1;
            }
        }
        if evicted > 0 {
            tracing::debug!(
                evicted,
                offloaded = offloads.len(),
                freed,
                target,
                "eviction pass"
            );
            self.metrics.evicted(evicted);
            self.metrics.successful_evictions_total.inc();
        }
        self.release(frees).await;
        self.run_offloads(offloads).await;
        evicted
    }

    /// Moves one object's DRAM copy to its owner's disk tier now, as eviction would (the
    /// explicit request behind `lunakv doctor`'s SSD check). Answers once the owner made the
    /// bytes durable; an object already on disk is left as it is.
    pub async fn offload_key(&self, key: &str) -> Result<(), OpError> {
        if !self.cfg.enable_offload {
            return Err(OpError::new(
                ErrorCode::InvalidParams,
                "the master runs without --enable_offload: start it with --enable_offload=true \
                 to use the SSD tier",
            ));
        }
        let item = {
            let mut shard = self.shard(key).lock();
            let o = shard
                .get_mut(key)
                .ok_or_else(|| not_found(key, "not found"))?;
            if o.state != ObjectState::Complete {
                return Err(not_found(key, "its put has not ended yet"));
            }
            if o.replicas.iter().any(|r| r.disk) {
                return Ok(());
            }
            let segs = self.segments.lock();
            let target = o.replicas.iter().position(|r| {
                segs.get(&r.segment).is_some_and(|s| {
                    s.mount_id == r.mount_id
                        && s.desc.enable_offload
                        && s.desc.disk_capacity >= o.size
                })
            });
            let Some(i) = target else {
                return Err(OpError::new(
                    ErrorCode::InvalidParams,
                    format!(
                        "key {key:?} has no replica on a store-client with a usable disk tier: \
                         start lunakv-store with --enable_offload=true and a writable \
                         --offload_dir (or MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)"
                    ),
                ));
            };
            let before = tiers_of(&o.replicas);
            let r = o.replicas.remove(i);
            let endpoint = segs
                .get(&r.segment)
                .map(|s| s.desc.transfer_endpoint.clone())
                .unwrap_or_default();
            drop(segs);
            let item = PendingOffload {
                key: key.to_string(),
                endpoint,
                segment: r.segment.clone(),
                mount_id: r.mount_id,
                generation: o.generation,
                offset: r.offset,
            };
            o.replicas.push(ReplicaLoc {
                offset: lunakv_transfer::DISK_OFFSET,
                disk: true,
                ..r
            });
            self.emit_updated(key, before, &o.replicas);
            item
        };
        let generation = item.generation;
        self.run_offloads(vec![item]).await;
        let on_disk = self
            .shard(key)
            .lock()
            .get(key)
            .is_some_and(|o| o.generation == generation && o.replicas.iter().any(|r| r.disk));
        if on_disk {
            Ok(())
        } else {
            Err(OpError::new(
                ErrorCode::InternalError,
                format!(
                    "the owner of {key:?} could not write it to disk: see the store-client's log"
                ),
            ))
        }
    }

    /// Sends OFFLOAD to each owner (in parallel, one call per owner), then returns the DRAM
    /// ranges to their allocators. Objects an owner could not store (disk full, unwritable,
    /// unreachable) lose their LOCAL_DISK replica: a plain eviction, never a dangling replica.
    pub async fn run_offloads(&self, items: Vec<PendingOffload>) {
        if items.is_empty() {
            return;
        }
        let timeout = self.cfg.free_timeout;
        let notifier = &self.notifier;
        let owners = items.iter().map(|f| {
            let entry = OffloadEntry {
                generation: f.generation,
                offset: f.offset,
            };
            (f.endpoint.clone(), entry)
        });
        let failed: HashSet<u64> = fan_out_by_owner(owners, |endpoint, entries| async move {
            // Writing a whole eviction pass to disk takes a while: allow for it.
            let budget = timeout + Duration::from_secs(120);
            let r = tokio::time::timeout(budget, notifier.offload(&endpoint, &entries, timeout))
                .await;
            let all = || entries.iter().map(|e| e.generation).collect::<Vec<u64>>();
            match r {
                Ok(Ok(bad)) => {
                    if !bad.is_empty() {
                        tracing::warn!(%endpoint, failed = bad.len(), of = entries.len(), "owner could not offload some objects (see its log); they are evicted");
                    }
                    bad
                }
                Ok(Err(e)) => {
                    tracing::warn!(%endpoint, entries = entries.len(), error = %e, "OFFLOAD failed; the objects are evicted");
                    all()
                }
                Err(_) => {
                    tracing::warn!(%endpoint, entries = entries.len(), "OFFLOAD timed out; the objects are evicted");
                    all()
                }
            }
        })
        .await
        .into_iter()
        .flatten()
        .collect();
        let mut dropped = 0u64;
        for f in &items {
            if !failed.contains(&f.generation) {
                continue;
            }
            let mut shard = self.shard(&f.key).lock();
            if let Some(o) = shard
                .get_mut(&f.key)
                .filter(|o| o.generation == f.generation)
            {
                let before = tiers_of(&o.replicas);
                o.replicas
                    .retain(|r| !(r.disk && r.segment == f.segment && r.mount_id == f.mount_id));
                self.emit_updated(&f.key, before, &o.replicas);
                if o.replicas.is_empty() {
                    shard.remove(&f.key);
                    dropped += 1;
                }
            }
        }
        let ok = items.len() as u64 - failed.len().min(items.len()) as u64;
        self.metrics.offloaded_keys_total.inc_by(ok);
        self.metrics
            .offload_failures_total
            .inc_by(failed.len() as u64);
        if dropped > 0 {
            tracing::debug!(dropped, "objects lost on a failed offload");
        }
        let mut segs = self.segments.lock();
        for f in items {
            if let Some(seg) = segs
                .get_mut(&f.segment)
                .filter(|s| s.mount_id == f.mount_id)
            {
                seg.alloc.free(f.offset);
            }
        }
    }

    /// Resolves when a get reserved a promotion (`--promotion_on_hit`); the background task
    /// then calls [`Self::run_promotions`].
    pub async fn promotion_wanted(&self) {
        self.promotion_wanted.notified().await;
    }

    /// Promotions reserved by gets and not yet run.
    pub fn pending_promotions(&self) -> usize {
        self.promotions.lock().len()
    }

    /// Runs the promotions reserved by gets, in parallel: each owner copies its disk object into
    /// the reserved DRAM range (PROMOTE) and commits the entry under the same generation. Once it
    /// confirmed, the object gains a MEMORY replica (first, so readers prefer it) and keeps its
    /// disk one. A failed promotion, or one whose object was removed or replaced meanwhile, gives
    /// the range back through its owner (FREE, then the allocator). Returns promotions done.
    pub async fn run_promotions(&self) -> u64 {
        let items = std::mem::take(&mut *self.promotions.lock());
        if items.is_empty() {
            return 0;
        }
        let budget = self.cfg.free_timeout + Duration::from_secs(60);
        let notifier = &self.notifier;
        // One call per promotion, not per owner: each copies its own object from disk.
        let results = futures::future::join_all(items.into_iter().map(|p| async move {
            let req = Promote {
                generation: p.generation,
                key: p.key.clone(),
                offset: p.offset,
                len: p.size,
            };
            let r = tokio::time::timeout(budget, notifier.promote(&p.endpoint, &req)).await;
            let ok = match r {
                Ok(Ok(())) => true,
                Ok(Err(e)) => {
                    tracing::warn!(key = %p.key, endpoint = %p.endpoint, error = %e, "promotion failed; the object stays on disk");
                    false
                }
                Err(_) => {
                    tracing::warn!(key = %p.key, endpoint = %p.endpoint, "promotion timed out; the object stays on disk");
                    false
                }
            };
            (p, ok)
        }))
        .await;
        let mut frees = Vec::new();
        let mut done = 0u64;
        let mut failed = 0u64;
        for (p, ok) in results {
            if !ok {
                failed += 1;
            }
            let mounted = || {
                self.segments
                    .lock()
                    .get(&p.segment)
                    .is_some_and(|s| s.mount_id == p.mount_id)
            };
            let mut shard = self.shard(&p.key).lock();
            let object = shard
                .get_mut(&p.key)
                .filter(|o| o.generation == p.generation);
            let kept = match object {
                Some(o) => {
                    o.promoting = false;
                    if ok && mounted() {
                        let before = tiers_of(&o.replicas);
                        o.replicas.insert(
                            0,
                            ReplicaLoc {
                                segment: p.segment.clone(),
                                mount_id: p.mount_id,
                                offset: p.offset,
                                disk: false,
                            },
                        );
                        self.emit_updated(&p.key, before, &o.replicas);
                        true
                    } else {
                        false
                    }
                }
                None => false,
            };
            drop(shard);
            if kept {
                done += 1;
            } else {
                frees.push(PendingFree {
                    endpoint: p.endpoint,
                    segment: p.segment,
                    mount_id: p.mount_id,
                    generation: p.generation,
                    offset: p.offset,
                });
            }
        }
        self.metrics.promotions_total.inc_by(done);
        self.metrics.promotion_failures_total.inc_by(failed);
        if done > 0 || failed > 0 {
            tracing::debug!(done, failed, "promotions on hit");
        }
        self.release(frees).await;
        done
    }

    /// The owner's disk tier dropped these objects (its size limit, a failed checksum): forget
    /// their LOCAL_DISK replicas on `client_id`'s segments. Returns objects that disappeared.
    pub fn disk_dropped(&self, client_id: &str, items: &[(String, u64)]) -> u64 {
        if items.is_empty() {
            return 0;
        }
        let owned: HashSet<(String, u64)> = self
            .segments
            .lock()
            .iter()
            .filter(|(_, s)| s.client_id == client_id)
            .map(|(n, s)| (n.clone(), s.mount_id))
            .collect();
        let mut gone = 0;
        for (key, generation) in items {
            let mut shard = self.shard(key).lock();
            let Some(o) = shard.get_mut(key).filter(|o| o.generation == *generation) else {
                continue;
            };
            let before = tiers_of(&o.replicas);
            o.replicas
                .retain(|r| !(r.disk && owned.contains(&(r.segment.clone(), r.mount_id))));
            if tiers_of(&o.replicas) != before {
                self.emit_updated(key, before, &o.replicas);
            }
            if o.replicas.is_empty() {
                shard.remove(key);
                gone += 1;
            }
        }
        self.metrics
            .disk_dropped_keys_total
            .inc_by(items.len() as u64);
        gone
    }

    /// Per segment: (disk objects, disk bytes) the index holds.
    fn disk_usage(&self) -> HashMap<String, (u64, u64)> {
        let mut out: HashMap<String, (u64, u64)> = HashMap::new();
        for shard in &self.shards {
            for o in shard.lock().values() {
                for r in o.replicas.iter().filter(|r| r.disk) {
                    let e = out.entry(r.segment.clone()).or_default();
                    e.0 += 1;
                    e.1 += o.size;
                }
            }
        }
        out
    }

    /// (disk capacity of mounted segments, disk bytes indexed, disk objects indexed).
    pub fn disk_totals(&self) -> (u64, u64, u64) {
        let cap = self
            .segments
            .lock()
            .values()
            .map(|s| s.desc.disk_capacity)
            .sum();
        let (objects, bytes) = self
            .disk_usage()
            .values()
            .fold((0, 0), |(a, b), (o, by)| (a + o, b + by));
        (cap, bytes, objects)
    }

    /// Drops puts started more than `put_discard_timeout` ago and never ended (their keys become
    /// free at once), and frees the ranges of those whose release deadline has passed.
    /// Returns the number of puts discarded.
    pub async fn sweep_puts(&self) -> u64 {
        let now = Instant::now();
        let mut discarded = 0;
        let mut keys = 0u64;
        let mut reserved: HashMap<String, u64> = HashMap::new();
        for shard in &self.shards {
            let mut shard = shard.lock();
            keys += shard.len() as u64;
            for o in shard.values() {
                if o.state == ObjectState::Processing {
                    let bytes = align_up(o.size).unwrap_or(o.size) * o.replicas.len() as u64;
                    *reserved.entry(o.client_id.clone()).or_default() += bytes;
                }
            }
            let stale: Vec<String> = shard
                .iter()
                .filter(|(_, o)| {
                    o.state == ObjectState::Processing
                        && now.duration_since(o.put_start) >= self.cfg.put_discard_timeout
                })
                .map(|(k, _)| k.clone())
                .collect();
            for k in stale {
                if let Some(o) = shard.remove(&k) {
                    tracing::warn!(key = %k, client_id = %o.client_id, generation = o.generation, "put never ended; discarded");
                    let frees = self.pending_frees(&o);
                    // The writer may still be copying into these ranges: they stay allocated
                    // until put_start + put_release_timeout, its revoke, or its death.
                    self.quarantine.lock().push(Quarantined {
                        until: o.put_start + self.cfg.put_release_timeout,
                        key: k.clone(),
                        client_id: o.client_id.clone(),
                        frees,
                    });
                    discarded += 1;
                }
            }
        }
        // Discarded puts are no longer reservations (their ranges wait in quarantine).
        *self.reserved.lock() = reserved;
        self.approx_keys.store(keys, Ordering::Relaxed);
        let due = self.unquarantine(|q| q.until <= now);
        self.release(due).await;
        discarded
    }

    /// A put of `o` ended or was revoked: its bytes no longer count against its client
    /// (other exits are corrected by the next sweep's recount).
    fn unreserve(&self, o: &Object) {
        let bytes = align_up(o.size).unwrap_or(o.size) * o.replicas.len() as u64;
        if let Some(r) = self.reserved.lock().get_mut(&o.client_id) {
            *r = r.saturating_sub(bytes);
        }
    }

    /// Takes the quarantined puts `pick` selects; returns their ranges to free.
    fn unquarantine(&self, pick: impl Fn(&Quarantined) -> bool) -> Vec<PendingFree> {
        let mut q = self.quarantine.lock();
        let (due, keep): (Vec<_>, Vec<_>) = q.drain(..).partition(|e| pick(e));
        *q = keep;
        due.into_iter().flat_map(|e| e.frees).collect()
    }

    /// Frees what [`Self::expire_clients`] took from dead writers: their unfinished puts and
    /// quarantined ranges (nobody is left to copy into them).
    pub async fn release_orphaned(&self) {
        let frees = std::mem::take(&mut *self.orphaned.lock());
        if !frees.is_empty() {
            self.metrics
                .put_reservations_reclaimed_total
                .inc_by(frees.len() as u64);
            self.release(frees).await;
        }
    }

    /// At `max_keys`: drops the least recently used objects (DRAM and disk copies alike) down
    /// to 95% of the limit. Leased, pinned and unfinished objects stay. Returns keys dropped.
    pub async fn enforce_key_limit(&self) -> u64 {
        let max = self.cfg.max_keys;
        if max == 0 {
            return 0;
        }
        let _guard = self.eviction_lock.lock().await;
        let count = self.key_count();
        self.approx_keys.store(count, Ordering::Relaxed);
        if count < max {
            return 0;
        }
        let excess = count - max * 19 / 20;
        let now = Instant::now();
        let mut candidates: Vec<(bool, Instant, String, u64)> = Vec::new();
        for shard in &self.shards {
            for (k, o) in shard.lock().iter() {
                if o.state == ObjectState::Complete && !o.leased(now) && !o.hard_pinned {
                    candidates.push((o.soft_pinned(now), o.last_access, k.clone(), o.generation));
                }
            }
        }
        candidates.sort_by_key(|c| (c.0, c.1));
        let mut frees = Vec::new();
        let mut dropped = 0u64;
        for (_, _, key, generation) in candidates.into_iter().take(excess as usize) {
            let mut shard = self.shard(&key).lock();
            if shard
                .get(&key)
                .is_some_and(|o| o.generation == generation && !o.leased(Instant::now()))
                && let Some(o) = shard.remove(&key)
            {
                self.emit_updated(&key, tiers_of(&o.replicas), &[]);
                frees.extend(self.pending_frees(&o));
                dropped += 1;
            }
        }
        self.release(frees).await;
        self.approx_keys
            .fetch_sub(dropped.min(count), Ordering::Relaxed);
        self.metrics.key_limit_evictions_total.inc_by(dropped);
        self.metrics.evicted(dropped);
        tracing::warn!(
            max_keys = max,
            dropped,
            "object index at max_keys: dropped the least recently used objects"
        );
        dropped
    }

    // === views ===

    fn usage(&self) -> (u64, u64) {
        let segs = self.segments.lock();
        segs.values().fold((0, 0), |(u, c), s| {
            (u + s.alloc.used(), c + s.alloc.capacity())
        })
    }

    pub fn total_capacity(&self) -> u64 {
        self.usage().1
    }

    pub fn allocated_bytes(&self) -> u64 {
        self.usage().0
    }

    pub fn key_count(&self) -> u64 {
        self.shards.iter().map(|s| s.lock().len() as u64).sum()
    }

    pub fn active_clients(&self) -> u64 {
        self.clients.lock().len() as u64
    }

    /// Refreshes the gauges from the current state (before a scrape).
    pub fn refresh_gauges(&self) {
        let (used, cap) = self.usage();
        let m = &self.metrics;
        m.allocated_bytes
            .set(i64::try_from(used).unwrap_or(i64::MAX));
        m.total_capacity_bytes
            .set(i64::try_from(cap).unwrap_or(i64::MAX));
        let keys = i64::try_from(self.key_count()).unwrap_or(i64::MAX);
        m.key_count.set(keys);
        m.keys.set(keys);
        m.max_keys
            .set(i64::try_from(self.cfg.max_keys).unwrap_or(i64::MAX));
        m.active_clients
            .set(i64::try_from(self.active_clients()).unwrap_or(i64::MAX));
        let (disk_cap, disk_used, disk_keys) = self.disk_totals();
        m.disk_capacity_bytes
            .set(i64::try_from(disk_cap).unwrap_or(i64::MAX));
        m.disk_used_bytes
            .set(i64::try_from(disk_used).unwrap_or(i64::MAX));
        let disk_keys = i64::try_from(disk_keys).unwrap_or(i64::MAX);
        m.disk_key_count.set(disk_keys);
        m.disk_keys.set(disk_keys);
    }

    pub fn segments(&self) -> Vec<SegmentInfo> {
        let now = Instant::now();
        let last_seen: HashMap<String, Instant> = self
            .clients
            .lock()
            .iter()
            .map(|(id, c)| (id.clone(), c.last_seen))
            .collect();
        let disk = self.disk_usage();
        let segs = self.segments.lock();
        let mut out: Vec<SegmentInfo> = segs
            .values()
            .map(|s| SegmentInfo {
                enable_offload: s.desc.enable_offload,
                disk_capacity: s.desc.disk_capacity,
                disk_used: disk.get(&s.desc.name).map_or(0, |d| d.1),
                disk_objects: disk.get(&s.desc.name).map_or(0, |d| d.0),
                name: s.desc.name.clone(),
                transfer_endpoint: s.desc.transfer_endpoint.clone(),
                client_id: s.client_id.clone(),
                size: s.desc.size,
                used: s.alloc.used(),
                objects: s.alloc.allocations() as u64,
                last_ping_ms_ago: last_seen
                    .get(&s.client_id)
                    .map_or(0, |t| now.duration_since(*t).as_millis() as u64),
                host_id: s.desc.host_id.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    pub fn segment_desc(&self, name: &str) -> Option<SegmentDesc> {
        self.segments.lock().get(name).map(|s| s.desc.clone())
    }

    /// An object's metadata, without granting a lease (admin view).
    pub fn query_key(&self, key: &str) -> Option<ObjectInfo> {
        let now = Instant::now();
        let shard = self.shard(key).lock();
        let o = shard.get(key)?;
        let segs = self.segments.lock();
        Some(ObjectInfo {
            key: key.to_string(),
            generation: o.generation,
            size: o.size,
            state: o.state,
            client_id: o.client_id.clone(),
            replicas: o
                .replicas
                .iter()
                .map(|r| ReplicaInfo {
                    segment: r.segment.clone(),
                    transfer_endpoint: segs
                        .get(&r.segment)
                        .map(|s| s.desc.transfer_endpoint.clone())
                        .unwrap_or_default(),
                    offset: r.offset,
                    kind: if r.disk { "local_disk" } else { "memory" },
                })
                .collect(),
            lease_remaining_ms: o
                .lease_until
                .map_or(0, |t| t.saturating_duration_since(now).as_millis() as u64),
            soft_pinned: o.soft_pinned(now),
            hard_pinned: o.hard_pinned,
        })
    }
}

fn not_found(key: &str, why: &str) -> OpError {
    OpError::new(ErrorCode::ObjectNotFound, format!("key {key:?}: {why}"))
}

/// Groups `items` by owner endpoint and makes one `call` per owner, all owners at once; returns
/// once every owner answered (or its call timed out), so a dead owner delays a batch by at most
/// its own timeout, never one per owner.
async fn fan_out_by_owner<T, R, Fut>(
    items: impl IntoIterator<Item = (String, T)>,
    call: impl Fn(String, Vec<T>) -> Fut,
) -> Vec<R>
where
    Fut: std::future::Future<Output = R>,
{
    let mut by_owner: HashMap<String, Vec<T>> = HashMap::new();
    for (endpoint, item) in items {
        by_owner.entry(endpoint).or_default().push(item);
    }
    futures::future::join_all(by_owner.into_iter().map(|(e, v)| call(e, v))).await
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
