//! What the HA feed carries ([`super::warm`]): each change of the index and the snapshot a
//! standby starts from, as the leader's core sends them.

use super::types::SegmentDesc;

/// Changes buffered per standby before a lagging one is sent a new snapshot instead.
pub const FEED_CAPACITY: usize = 1 << 16;

/// A replica location as the index holds it (the segment by name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmReplicaLoc {
    pub segment: String,
    pub offset: u64,
    pub disk: bool,
}

/// One key's state; no replicas = the key is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub key: String,
    pub generation: u64,
    pub size: u64,
    pub replicas: Vec<WarmReplicaLoc>,
}

/// One change of the index, as standbys replicate it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexChange {
    Mounted {
        // Boxed: mounts are rare and a descriptor is large, entries are the stream's bulk.
        desc: Box<SegmentDesc>,
        client_id: String,
    },
    Unmounted {
        segment: String,
    },
    Entry(IndexEntry),
}

/// The whole index: segments (with their owners' client ids) and complete objects.
#[derive(Debug, Default, Clone)]
pub struct IndexSnapshot {
    pub segments: Vec<(SegmentDesc, String)>,
    pub entries: Vec<IndexEntry>,
}
