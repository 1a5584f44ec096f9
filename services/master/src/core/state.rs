//! [`MasterCore`]: the state every request goes through, and the few methods the other files'
//! rules share (the index's shards, generations, the events of a stored or changed object).
//! Each rule's methods live in their own file as further `impl MasterCore` blocks; this file
//! names only the leaf types its fields hold, so those files can use it without a circle.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use lunakv_proto::ErrorCode;
use parking_lot::Mutex;

use crate::events::{EventSink, PoolEvent, ReplicaRef, Tiers};
use crate::metrics::Metrics;
use crate::namespaces::NamespaceTracker;
use crate::notifier::OwnerClient;

use super::feed::{FEED_CAPACITY, IndexChange};
use super::groups::Groups;
use super::jobs::Jobs;
use super::types::{
    ClientEntry, CoreConfig, Holder, OpError, PendingFree, PendingPromotion, Quarantined,
    ReplicaLoc, Segment, WarnLimit,
};
use super::{index, intern, policy, reservations};

// One shard of the object index ([`index::Index`]). Keys and objects are boxed: the table then
// holds 24 bytes per slot instead of a whole [`Object`](super::types::Object), and a table that
// has just doubled (half its slots empty) wastes little (docs/BENCH.md, "Metadata").
use index::Index;

/// Number of object-index shards.
pub const SHARDS: usize = 64;

/// The master's state. Shared as `Arc<MasterCore>` by the edges and the background tasks.
pub struct MasterCore {
    pub(super) cfg: CoreConfig,
    pub(super) epoch: u32,
    pub(super) counter: AtomicU64,
    pub(super) next_mount_id: AtomicU64,
    pub(super) shards: Vec<Mutex<Index>>,
    /// Each group's members ([`groups`](super::groups)), kept by the shards.
    pub(super) groups: Arc<Groups>,
    pub(super) hasher: foldhash::quality::RandomState,
    pub(super) segments: Mutex<HashMap<String, Segment, foldhash::quality::RandomState>>,
    pub(super) clients: Mutex<HashMap<String, ClientEntry>>,
    /// Ranges of discarded puts, freed once their release deadline passes (or at once when
    /// their writer revokes them or dies).
    pub(super) quarantine: Mutex<Vec<Quarantined>>,
    /// Bytes each holder (and all) hold reserved by puts not yet ended: recounted by every
    /// [`Self::sweep_puts`] and raised by each PutStart in between (a leaf lock).
    pub(super) reserved: Mutex<reservations::Reservations>,
    /// Every put started and perhaps not yet ended, by generation, with its key (a leaf lock).
    /// A put's end takes it off; it may still hold puts that have since gone (revoked,
    /// removed): [`Self::sweep_puts`] checks each against the index and drops those. It lets
    /// the sweep visit the puts in flight instead of every object, which at a million keys cost
    /// a tenth of a core (docs/BENCH.md, "Metadata"). By generation, so that a put's end
    /// hashes a number, not its key.
    /// With each, the [`Holder`] its reserved bytes count against.
    pub(super) inflight: Mutex<HashMap<u64, (String, Holder), foldhash::fast::RandomState>>,
    /// Serializes reclaim rounds of PutStarts short of room ([`reclaim`](super::reclaim)), so two
    /// do not pick the same unfinished puts and each find less than it needs.
    pub(super) reclaim_lock: tokio::sync::Mutex<()>,
    /// At most one reclaim WARN a second.
    pub(super) reclaim_log: WarnLimit,
    /// Under mTLS, the client identity that started each put in flight, by generation, with its
    /// key (a leaf lock). Kept beside the index rather than in each object, which would cost
    /// every key its bytes; empty without mTLS. Entries leave at PutEnd, PutRevoke and discard,
    /// and [`Self::sweep_puts`] drops those whose put went another way.
    pub(super) put_owners: Mutex<HashMap<u64, PutOwner>>,
    /// The one copy of each client id and segment name the objects refer to.
    pub(super) names: intern::Interner,
    /// Objects in the index as of the last sweep (the key limit's cheap check).
    pub(super) approx_keys: AtomicU64,
    /// Ranges of puts whose writer died, to free on the next [`Self::release_orphaned`].
    pub(super) orphaned: Mutex<Vec<PendingFree>>,
    pub(super) eviction_lock: tokio::sync::Mutex<()>,
    /// cslru's candidate queues, taken only by eviction ([`policy`]).
    pub(super) queues: Mutex<policy::Queues>,
    /// cslru's ghost table and the chain ends put since the last scan (a leaf lock).
    pub(super) recent: Mutex<policy::Recent>,
    /// Promotions reserved by gets, waiting for [`MasterCore::run_promotions`] (a leaf lock).
    pub(super) promotions: Mutex<Vec<PendingPromotion>>,
    /// Promotions reserved and not yet confirmed or failed (`--promotion_queue_limit`).
    pub(super) promotions_in_flight: AtomicUsize,
    pub(super) promotion_wanted: tokio::sync::Notify,
    pub(super) notifier: Arc<dyn OwnerClient>,
    pub metrics: Metrics,
    /// Per key namespace: keys put per client and how many another client held (a leaf lock).
    pub namespaces: NamespaceTracker,
    /// Bytes of puts admitted against their tenant's quota and not yet in the index (a lock
    /// taken before the shards, see [`quota`](super::quota)).
    pub(super) quota_pending: Mutex<HashMap<String, u64>>,
    /// Puts refused for their tenant's quota, by tenant (a leaf lock; only tenants with a
    /// quota appear, so the policy bounds it).
    pub(super) quota_rejected: Mutex<HashMap<String, u64>>,
    /// KV events (docs/EVENTS.md): where the index's changes go, when publishing is on.
    pub(super) events: Option<EventSink>,
    /// HA: every change of the index, for the standbys' warm copies ([`warm`](super::warm));
    /// nothing is cloned into it while no standby listens.
    pub(super) feed: tokio::sync::broadcast::Sender<std::sync::Arc<IndexChange>>,
    /// HA: this core started from a standby's warm copy and that copy still answers reads
    /// until the owners' remounts confirmed it.
    pub(super) warm_start: std::sync::atomic::AtomicBool,
    /// Drain jobs ([`drain`](super::drain); a lock taken before a shard).
    pub(super) drains: Mutex<Jobs>,
}

/// The key of a put in flight and the client identity that started it ([`MasterCore`]'s
/// `put_owners`).
type PutOwner = (Box<str>, Arc<str>);

impl MasterCore {
    /// A core for `epoch` (the high 32 bits of every generation it hands out).
    pub fn new(cfg: CoreConfig, epoch: u32, notifier: Arc<dyn OwnerClient>) -> MasterCore {
        let cfg_min_keys = cfg.namespace_min_keys;
        let groups = Arc::new(Groups::default());
        MasterCore {
            cfg,
            epoch,
            counter: AtomicU64::new(1),
            next_mount_id: AtomicU64::new(1),
            shards: (0..SHARDS)
                .map(|_| Mutex::new(Index::new(groups.clone())))
                .collect(),
            groups,
            hasher: foldhash::quality::RandomState::default(),
            segments: Mutex::new(HashMap::default()),
            clients: Mutex::new(HashMap::new()),
            quarantine: Mutex::new(Vec::new()),
            reserved: Mutex::new(reservations::Reservations::default()),
            inflight: Mutex::new(HashMap::default()),
            reclaim_lock: tokio::sync::Mutex::new(()),
            reclaim_log: WarnLimit::default(),
            put_owners: Mutex::new(HashMap::new()),
            names: intern::Interner::default(),
            approx_keys: AtomicU64::new(0),
            orphaned: Mutex::new(Vec::new()),
            eviction_lock: tokio::sync::Mutex::new(()),
            queues: Mutex::new(policy::Queues::new()),
            recent: Mutex::new(policy::Recent::new()),
            promotions: Mutex::new(Vec::new()),
            promotions_in_flight: AtomicUsize::new(0),
            promotion_wanted: tokio::sync::Notify::new(),
            notifier,
            metrics: Metrics::new(),
            namespaces: NamespaceTracker::new(cfg_min_keys),
            quota_pending: Mutex::new(HashMap::new()),
            quota_rejected: Mutex::new(HashMap::new()),
            events: None,
            feed: tokio::sync::broadcast::channel(FEED_CAPACITY).0,
            warm_start: std::sync::atomic::AtomicBool::new(false),
            drains: Mutex::new(Jobs::default()),
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
    pub(super) fn replica_refs(&self, replicas: &[ReplicaLoc]) -> Vec<ReplicaRef> {
        let segs = self.segments.lock();
        replicas
            .iter()
            .map(|r| ReplicaRef {
                disk: r.disk,
                endpoint: segs
                    .get(&*r.segment)
                    .filter(|s| s.mount_id == r.mount_id)
                    .map_or_else(
                        || r.segment.to_string(),
                        |s| s.desc.transfer_endpoint.clone(),
                    ),
            })
            .collect()
    }

    /// Where `key`'s events go: the streams speak for the default tenant's keys only (an
    /// engine subscribing to them knows its keys unscoped; docs/TENANTS.md).
    pub(super) fn events_for(&self, key: &str) -> Option<&EventSink> {
        self.events
            .as_ref()
            .filter(|_| index::tenant_of(key) == lunakv_proto::DEFAULT_TENANT)
    }

    pub(super) fn emit_stored(
        &self,
        key: &str,
        (generation, size): (u64, u64),
        replicas: &[ReplicaLoc],
    ) {
        self.replicate(key, generation, size, replicas);
        if let Some(sink) = self.events_for(key) {
            sink.emit(PoolEvent::Stored {
                key: key.to_string(),
                replicas: self.replica_refs(replicas),
            });
        }
    }

    /// A complete object's replicas changed from the tiers in `before` to `replicas` (empty:
    /// the object is gone).
    pub(super) fn emit_updated(
        &self,
        key: &str,
        (generation, size): (u64, u64),
        before: Tiers,
        replicas: &[ReplicaLoc],
    ) {
        self.replicate(key, generation, size, replicas);
        if let Some(sink) = self.events_for(key) {
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

    pub(super) fn shard(&self, key: &str) -> &Mutex<Index> {
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    pub(super) fn next_generation(&self) -> Result<u64, OpError> {
        let c = self.counter.fetch_add(1, Ordering::Relaxed);
        if c > u64::from(u32::MAX) {
            return Err(OpError::new(
                ErrorCode::InternalError,
                "generation counter exhausted for this epoch: restart the master",
            ));
        }
        Ok((u64::from(self.epoch) << 32) | c)
    }
}
