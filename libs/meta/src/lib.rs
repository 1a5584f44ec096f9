//! # lunakv-meta
//!
//! The [`MetaStore`]: a small key-value store for *cluster facts that must survive a process*
//! (the master's epoch counter, the cluster id a data directory was created for, segments'
//! transfer endpoints). Never the hot object index: that lives in master memory and is rebuilt
//! from owners' inventories.
//!
//! Keys are UTF-8 strings, conventionally `/`-separated under a prefix (`master/epoch`,
//! `segments/host:port`); values are opaque bytes. The operation set (get, put, delete, list by
//! prefix, compare-and-swap) is what etcd offers natively, so the etcd backend is a second
//! implementation of the same trait passing the same [`conformance`] suite.
//!
//! Implementations:
//! - [`RedbMetaStore`]: an embedded redb file, the single-node default (used by `lunakv-master`);
//! - [`EtcdMetaStore`]: etcd, for HA (`lunakv-master --enable_ha`); [`etcd::EtcdClient`] also
//!   serves leader election and leader-following;
//! - [`MemMetaStore`]: in memory, for tests;
//! - [`Prefixed`]: scopes any store under a key prefix (like etcd's namespace / a chroot).
//!
//! [`testing`] starts a real etcd on ephemeral ports for tests.
#![forbid(unsafe_code)]

pub mod conformance;
pub mod etcd;
pub mod layout;
mod mem;
mod prefixed;
mod redb_store;
pub mod testing;

pub use etcd::{EtcdAuth, EtcdClient, EtcdMetaStore, EtcdSecurity, EtcdTls, WriteFence};
pub use mem::MemMetaStore;
pub use prefixed::Prefixed;
pub use redb_store::RedbMetaStore;

use async_trait::async_trait;

/// Errors of a [`MetaStore`] backend.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// The backing file or service could not be opened.
    #[error("cannot open meta store at {location}: {message}")]
    Open { location: String, message: String },
    /// A read or write failed in the backend.
    #[error("meta store {op} failed: {message}")]
    Backend { op: &'static str, message: String },
    /// The key is not acceptable (empty, or too long for the backend).
    #[error("invalid meta key {key:?}: {reason}")]
    InvalidKey { key: String, reason: String },
}

/// Outcome of [`MetaStore::compare_and_swap`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CasOutcome {
    /// The current value matched and the new value (or deletion) was applied.
    Swapped,
    /// The current value did not match; nothing changed. Carries what is there now.
    Conflict { current: Option<Vec<u8>> },
}

/// Small, durable cluster facts. Object-safe: callers hold an `Arc<dyn MetaStore>`.
#[async_trait]
pub trait MetaStore: Send + Sync + std::fmt::Debug {
    /// The value at `key`, or `None`.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError>;
    /// Sets `key` to `value`, replacing any previous value.
    async fn put(&self, key: &str, value: &[u8]) -> Result<(), MetaError>;
    /// Deletes `key`; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, MetaError>;
    /// Every `(key, value)` whose key starts with `prefix`, in ascending key order.
    async fn list_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError>;
    /// Atomically: if the current value equals `expected` (`None` = the key is absent), set it
    /// to `new` (`None` = delete it). Maps onto one etcd transaction.
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<CasOutcome, MetaError>;
}

/// Longest key any backend accepts (etcd's default request limit is far above; this keeps keys
/// human-sized).
pub const MAX_META_KEY_LEN: usize = 1024;

pub(crate) fn check_key(key: &str) -> Result<(), MetaError> {
    if key.is_empty() {
        return Err(MetaError::InvalidKey {
            key: key.to_string(),
            reason: "empty key".into(),
        });
    }
    if key.len() > MAX_META_KEY_LEN {
        return Err(MetaError::InvalidKey {
            key: key.chars().take(64).collect(),
            reason: format!("{} bytes, limit is {MAX_META_KEY_LEN}", key.len()),
        });
    }
    Ok(())
}
