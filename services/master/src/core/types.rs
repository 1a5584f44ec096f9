//! The core's types: its config, the domain types the edges see, and the index's entries.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lunakv_config::master::AllocationStrategy;
use lunakv_proto::ErrorCode;

use crate::alloc::OffsetAllocator;
use crate::events::Tiers;

/// How long after the lookup that granted it a lease holds eviction off: the reader copies
/// right after its lookup, and the owner's pin protects the copy itself. A lease stays whole
/// against Remove (-706, as upstream's). The trace replays (docs/BENCH.md) measured a 5 s lease
/// costing 5-8% of the hits at 500-800 requests/s and a 100 ms one nothing. It is also what
/// makes the calls of one request one read for promotion's admission. Tests set
/// [`CoreConfig::read_window`] so their lookups' timing cannot matter.
pub(super) const READ_WINDOW: Duration = Duration::from_millis(100);

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
    /// Reads a disk-only object takes before it is promoted (1..=255).
    pub promotion_admission_threshold: u8,
    /// Promotions reserved and not yet confirmed, at most.
    pub promotion_queue_limit: usize,
    /// A lookup this recent still has its reader copying (eviction passes it over), and a read
    /// this soon after the last is the same request (promotion's admission). Not a flag:
    /// 100 ms (`READ_WINDOW`); tests set it so their timing cannot matter.
    pub read_window: Duration,
    /// Keys a client must put in a namespace before the unshared-instances rule counts it
    /// (`namespace_min_keys`; see [`crate::namespaces`]).
    pub namespace_min_keys: u64,
    /// Most objects in the index (0 = no limit).
    pub max_keys: u64,
    /// Share of total capacity one client may hold reserved by unfinished puts.
    pub put_reservation_limit_ratio: f64,
    /// Share of total capacity all unfinished puts together may hold.
    pub put_reservation_total_ratio: f64,
    /// Age of another holder's unfinished put before a PutStart short of room may reclaim it
    /// (`core::reclaim`).
    pub put_reclaim_grace: Duration,
    /// Share of total capacity one PutStart may evict for itself.
    pub put_eviction_limit_ratio: f64,
    /// How a new object's replicas pick their segments.
    pub placement: AllocationStrategy,
    /// How long a segment that joins settled ones ramps up its share of new puts (zero: off).
    pub placement_ramp: Duration,
    /// Which objects eviction takes first.
    pub eviction_policy: super::policy::EvictionPolicy,
    /// Upstream `--enable_multi_tenants`: a tenant without a quota may not put.
    pub multi_tenants: bool,
    /// Tenant -> DRAM quota in bytes (docs/TENANTS.md). Shared by every clone of the config,
    /// so each HA term's core and the admin API see one policy.
    pub quotas: TenantQuotas,
    /// The cluster's placement-proof key: each write placement on a segment that requires
    /// capabilities carries a proof under it (docs/SECURITY.md, "Verified inventories").
    pub inventory_key: Option<lunakv_transfer::InventoryKey>,
    /// Index only inventory items whose proof checks under `inventory_key` (the master has a
    /// pool token: an owner could otherwise claim any key it never got).
    pub verify_inventories: bool,
    /// A drain job's default rate: bytes handed out per second (0: unbounded).
    pub drain_max_bytes_per_sec: u64,
}

/// The quota policy in force, tenant -> bytes.
pub type TenantQuotas = std::sync::Arc<parking_lot::RwLock<std::collections::HashMap<String, u64>>>;

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
            promotion_admission_threshold: u8::try_from(c.promotion_admission_threshold)
                .unwrap_or(u8::MAX)
                .max(1),
            promotion_queue_limit: usize::try_from(c.promotion_queue_limit).unwrap_or(usize::MAX),
            read_window: READ_WINDOW,
            namespace_min_keys: c.namespace_min_keys,
            max_keys: c.max_keys,
            put_reservation_limit_ratio: c.put_reservation_limit_ratio,
            put_reservation_total_ratio: c.put_reservation_total_ratio,
            put_reclaim_grace: Duration::from_millis(c.put_reclaim_grace_ms),
            put_eviction_limit_ratio: c.put_eviction_limit_ratio,
            placement: c.allocation_strategy(),
            placement_ramp: Duration::from_millis(c.placement_ramp_ms),
            eviction_policy: super::policy::EvictionPolicy::parse(&c.eviction_policy)
                .unwrap_or(super::policy::EvictionPolicy::Cslru),
            multi_tenants: c.enable_multi_tenants,
            quotas: TenantQuotas::default(),
            inventory_key: None,
            verify_inventories: false,
            drain_max_bytes_per_sec: c.drain_max_bytes_per_sec,
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
    /// The owner's mount secret (MountSegment.data_secret) when it requires capabilities: the
    /// key of every capability issued for this segment. Never persisted nor shown.
    #[serde(skip)]
    pub data_secret: Option<lunakv_transfer::MountSecret>,
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
    /// The placement proof the owner kept with the entry; `None` when it sent none (or a
    /// malformed one).
    pub proof: Option<lunakv_transfer::PlacementProof>,
}

/// Placement options of a put.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Upstream's `group_ids` entry of this object (scoped by the key's tenant in the core).
    pub group: Option<String>,
    pub replica_num: u32,
    /// Segments to place replicas on first, in order, each where it has room.
    pub preferred_segments: Vec<String>,
    pub soft_pin: bool,
    /// The soft pin's lifetime (`None`: the master's default); capped at its maximum.
    pub soft_pin_ttl: Option<Duration>,
    pub hard_pin: bool,
}

/// Who makes a call, as the transport proved it (docs/SECURITY.md, "mTLS and identities").
/// Under mTLS, `identity` is the client certificate's (its CN, else its first SAN); without
/// mTLS it is `None` and every caller is the same, as before identities. `admin`: the identity
/// is one of the master's `LUNAKV_ADMIN_IDENTITIES`, or the call carries the admin token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    pub identity: Option<Arc<str>>,
    pub admin: bool,
    /// The address the call came from, when it came over the network; what a put's
    /// reservation is charged to when the caller has no certificate identity ([`Holder`]).
    pub peer: Option<std::net::IpAddr>,
}

impl Caller {
    /// A caller with this certificate identity.
    pub fn with_identity(identity: &str, admin: bool) -> Caller {
        Caller {
            identity: Some(Arc::from(identity)),
            admin,
            peer: None,
        }
    }

    /// Who a put by this caller under `client_id` is charged to: its certificate identity
    /// (mTLS), else the address it called from, else (in-process calls) the client id. Never
    /// the client id alone when more is known: anyone can declare a fresh one per put.
    pub fn holder(&self, client_id: &str) -> Holder {
        match (&self.identity, self.peer) {
            (Some(id), _) => Holder::Identity(id.clone()),
            (None, Some(ip)) => Holder::Address(ip),
            // Only in-process callers: the one case that copies the id.
            (None, None) => Holder::Client(Arc::from(client_id)),
        }
    }

    /// An admin identity acts on anyone's mounts and reservations. (The admin token alone
    /// does not: without mTLS nothing records who mounted or reserved what.)
    pub fn overrides_owners(&self) -> bool {
        self.admin && self.identity.is_some()
    }

    /// Whether this caller may act on what `owner` mounted or reserved: that identity, an
    /// admin identity, or anyone when it was made without one (no mTLS).
    pub fn may_act_for(&self, owner: Option<&Arc<str>>) -> bool {
        match owner {
            None => true,
            Some(o) => self.overrides_owners() || self.identity.as_deref() == Some(&**o),
        }
    }

    /// The identity for messages.
    pub fn name(&self) -> &str {
        self.identity
            .as_deref()
            .unwrap_or("(none: no client certificate)")
    }
}

/// Who an unfinished put's reserved bytes count against (docs/SECURITY.md, "Reservations").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Holder {
    Identity(Arc<str>),
    Address(std::net::IpAddr),
    Client(Arc<str>),
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Identity(id) => write!(f, "certificate identity {:?}", &**id),
            Holder::Address(ip) => write!(f, "address {ip}"),
            Holder::Client(c) => write!(f, "client {:?}", &**c),
        }
    }
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
    pub segment: Arc<SegmentDesc>,
    pub offset: u64,
    pub size: u64,
    /// A LOCAL_DISK replica: read it with LOAD from the owner, not READ.
    pub disk: bool,
    /// The capability for this range, when the owner requires them.
    pub capability: Option<lunakv_transfer::Capability>,
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
    /// Under mTLS: a segment or a reservation of another client identity.
    #[error(
        "{what} belongs to client identity {owner:?}, and this client's certificate identity is \
         {caller:?}: only that identity or an admin identity (the master's \
         LUNAKV_ADMIN_IDENTITIES) may do this"
    )]
    OtherIdentity {
        what: String,
        owner: String,
        caller: String,
    },
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
pub(super) struct ReplicaLoc {
    /// Shared with every replica on the segment ([`super::intern`]).
    pub(super) segment: Arc<str>,
    pub(super) mount_id: u64,
    pub(super) offset: u64,
    /// In the owner's disk tier (no DRAM range; `offset` unused).
    pub(super) disk: bool,
}

/// An object's replicas, held inside it up to one: most pools keep one replica per object,
/// and a separate allocation cost a cache miss on every lookup and 48 bytes per key
/// (docs/BENCH.md, "Metadata").
pub(super) type Replicas = smallvec::SmallVec<[ReplicaLoc; 1]>;

#[derive(Debug, Clone)]
pub(super) struct Object {
    pub(super) generation: u64,
    pub(super) size: u64,
    pub(super) replicas: Replicas,
    pub(super) state: ObjectState,
    /// Shared with the client's other objects ([`super::intern`]).
    pub(super) client_id: Arc<str>,
    pub(super) put_start: Instant,
    pub(super) lease_until: Option<Instant>,
    pub(super) soft_pin_until: Option<Instant>,
    pub(super) hard_pinned: bool,
    pub(super) last_access: Instant,
    /// A promotion on hit is in flight (at most one per object).
    pub(super) promoting: bool,
    /// Requests that read it since it became disk-only (reads within the read window of the
    /// last count as one), saturating: promotion's admission count
    /// (`--promotion_admission_threshold`). Kept beside the other small fields, so an object
    /// is no larger for it.
    pub(super) disk_reads: u8,
    /// How long each read extends its soft pin, in ms (the put's ttl, capped; 0: not pinned).
    pub(super) soft_pin_ms: u32,
    /// The group this object lives and dies with ([`super::groups`]), scoped by its tenant.
    pub(super) group: Option<Arc<str>>,
    /// Its segment under `--eviction_policy=cslru` ([`super::policy`]).
    pub(super) tier: super::policy::Tier,
}

impl Object {
    /// Bytes its DRAM replicas take in their segments (each rounded up as the allocator does).
    pub(super) fn dram_bytes(&self) -> u64 {
        let dram = self.replicas.iter().filter(|r| !r.disk).count() as u64;
        crate::alloc::align_up(self.size)
            .unwrap_or(self.size)
            .saturating_mul(dram)
    }

    /// A complete object the index learned from an owner's inventory or a warm copy, not from
    /// a put: no lease, no pins, accessed now.
    pub(super) fn complete(
        generation: u64,
        size: u64,
        replicas: Replicas,
        client_id: Arc<str>,
        now: Instant,
    ) -> Object {
        Object {
            generation,
            size,
            replicas,
            state: ObjectState::Complete,
            client_id,
            put_start: now,
            lease_until: None,
            soft_pin_until: None,
            hard_pinned: false,
            last_access: now,
            promoting: false,
            disk_reads: 0,
            soft_pin_ms: 0,
            tier: super::policy::Tier::PROBATION,
            group: None,
        }
    }

    pub(super) fn leased(&self, now: Instant) -> bool {
        self.lease_until.is_some_and(|t| t > now)
    }

    pub(super) fn soft_pinned(&self, now: Instant) -> bool {
        self.soft_pin_until.is_some_and(|t| t > now)
    }
}

pub(super) struct Segment {
    /// Shared with every [`ReplicaView`] a read hands out: a location costs a reference count,
    /// not the descriptor's strings.
    pub(super) desc: Arc<SegmentDesc>,
    pub(super) client_id: String,
    /// The client identity that mounted it (mTLS; `None` without).
    pub(super) owner: Option<Arc<str>>,
    pub(super) mount_id: u64,
    pub(super) alloc: OffsetAllocator,
    /// The owner's whole inventory is indexed. Until then nothing is placed here: the
    /// allocator does not yet know every range the owner holds, and a new object could land on
    /// one of them.
    pub(super) complete: bool,
    /// When `complete` became true: the start of its placement ramp ([`super::puts`]).
    pub(super) opened_at: Option<Instant>,
    /// HA: replicas of this segment that came from a standby's warm copy and that the owner's
    /// inventory has not confirmed yet ([`super::warm`]); None once reconciled.
    pub(super) warm: Option<WarmSegment>,
    /// OK, or DRAINING/DRAINED by a drain job ([`super::drain`]): then it takes no placements.
    pub(super) status: SegmentStatus,
}

impl Segment {
    /// New objects (puts, promotions, drain moves) may be placed here.
    pub(super) fn placeable(&self) -> bool {
        self.complete && self.status == SegmentStatus::Ok
    }
}

pub(super) struct ClientEntry {
    pub(super) last_seen: Instant,
    pub(super) segments: BTreeSet<String>,
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
/// range at `offset` is reserved in the allocator (or, with `None`, is to be once eviction
/// made room), not yet a replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingPromotion {
    pub key: String,
    pub endpoint: String,
    pub segment: String,
    pub mount_id: u64,
    pub generation: u64,
    /// The DRAM range reserved for it; `None` until an eviction made room (cslru).
    pub offset: Option<u64>,
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
    /// OK, DRAINING or DRAINED (upstream's segment status names).
    pub status: &'static str,
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
pub(super) struct Quarantined {
    pub(super) until: Instant,
    pub(super) key: String,
    pub(super) client_id: String,
    /// The client identity that started the put (mTLS; `None` without).
    pub(super) owner: Option<Arc<str>>,
    pub(super) frees: Vec<PendingFree>,
}

/// Result of a mount.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountOutcome {
    pub accepted: u64,
    pub rejected_generations: Vec<u64>,
    /// Replicas of older copies displaced by the inventory: free them through their owners.
    pub displaced: Vec<PendingFree>,
}

/// Why an owner's inventory entry was not indexed (logged; the owner drops the entry).
#[derive(Debug, thiserror::Error)]
pub(super) enum InventoryReject {
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
    #[error("no valid placement proof: this master did not place that object there")]
    Unproven,
}

/// A provisional segment's unconfirmed entries, by (key, disk).
#[derive(Debug, Default)]
pub(crate) struct WarmSegment {
    pub(super) unconfirmed: HashSet<(String, bool)>,
    /// The owner mounted again (its inventory is arriving).
    pub(super) remounted: bool,
}

/// At most one reclaim WARN per this long; the rounds in between are counted in the next.
const WARN_EVERY: Duration = Duration::from_secs(1);

/// The reclaim WARN's rate limit: when the last one went out, and the rounds since.
#[derive(Default)]
pub(super) struct WarnLimit {
    state: parking_lot::Mutex<(Option<Instant>, u64)>,
}

impl WarnLimit {
    /// `Some(suppressed)` when a WARN may go out now (with the rounds not logged since).
    pub(super) fn check(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock();
        match s.0 {
            Some(last) if now.duration_since(last) < WARN_EVERY => {
                s.1 += 1;
                None
            }
            _ => {
                let suppressed = s.1;
                *s = (Some(now), 0);
                Some(suppressed)
            }
        }
    }
}

/// A segment's lifecycle as upstream's `/api/v1/segments/status` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum SegmentStatus {
    /// Mounted; takes placements once its inventory is complete.
    #[default]
    Ok,
    /// A drain job moves its objects away: readable, no new placements.
    Draining,
    /// A drain job emptied it: no new placements until it is mounted again.
    Drained,
}

impl SegmentStatus {
    /// Upstream's number (UNDEFINED is 0).
    pub fn code(self) -> i32 {
        match self {
            SegmentStatus::Ok => 1,
            SegmentStatus::Draining => 2,
            SegmentStatus::Drained => 3,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SegmentStatus::Ok => "OK",
            SegmentStatus::Draining => "DRAINING",
            SegmentStatus::Drained => "DRAINED",
        }
    }
}

/// The tiers an object's `replicas` sit on (its events' `before`).
pub(super) fn tiers_of(replicas: &[ReplicaLoc]) -> Tiers {
    Tiers {
        dram: replicas.iter().any(|r| !r.disk),
        ssd: replicas.iter().any(|r| r.disk),
    }
}

/// An [`ErrorCode::ObjectNotFound`] for `key`, saying why.
pub(super) fn not_found(key: &str, why: &str) -> OpError {
    OpError::new(ErrorCode::ObjectNotFound, format!("key {key:?}: {why}"))
}

/// Groups `items` by owner endpoint and makes one `call` per owner, all owners at once; returns
/// once every owner answered (or its call timed out), so a dead owner delays a batch by at most
/// its own timeout, never one per owner.
pub(super) async fn fan_out_by_owner<T, R, Fut>(
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
