//! The events themselves: a change of the index and the replicas and tiers it names, as the
//! core emits them and [`super::wire`] encodes them.

/// Where a replica lives, as the events name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRef {
    /// In the owner's SSD tier (`local_disk`), else its DRAM segment (`memory`).
    pub disk: bool,
    /// The owner's transfer endpoint (`host:port`).
    pub endpoint: String,
}

/// Which tiers hold an object: the vLLM stream turns a change into BlockStored / BlockRemoved
/// per medium.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tiers {
    pub dram: bool,
    pub ssd: bool,
}

impl Tiers {
    pub fn of(replicas: &[ReplicaRef]) -> Tiers {
        Tiers {
            dram: replicas.iter().any(|r| !r.disk),
            ssd: replicas.iter().any(|r| r.disk),
        }
    }
}

/// A change of the master's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolEvent {
    /// A key became readable: its put ended, or an owner's inventory brought it back.
    Stored {
        key: String,
        replicas: Vec<ReplicaRef>,
    },
    /// A key's replicas changed; `replicas` empty = the key is gone. `before` says which tiers
    /// held it before the change.
    Updated {
        key: String,
        before: Tiers,
        replicas: Vec<ReplicaRef>,
    },
    /// `remove_all`: every key is gone.
    RemovedAll,
    /// A core started (master start, new HA leader term): whatever subscribers knew from
    /// earlier publishers is void, and the index is re-announced as owners remount.
    Reset,
}
