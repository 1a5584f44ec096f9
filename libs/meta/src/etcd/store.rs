//! [`EtcdMetaStore`], the [`MetaStore`] on an [`EtcdClient`], and the [`WriteFence`] a leader
//! puts on its writes.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use async_trait::async_trait;

use super::client::EtcdClient;
use super::pb;
use super::pb::compare::CompareResult;
use super::txn::{cmp_lease, cmp_value, cmp_version, first_kv, op_delete, op_get, op_put};
use crate::{CasOutcome, MetaError, MetaStore, check_key};

/// A fence for writes: while set (lease != 0), every write of the store is a transaction that
/// succeeds only if `key` is still attached to `lease`. The master sets it to its leader key and
/// lease, so a deposed leader cannot change etcd even if its local lease check raced.
#[derive(Debug, Default)]
pub struct WriteFence {
    key: parking_lot::Mutex<Vec<u8>>,
    lease: AtomicI64,
}

impl WriteFence {
    pub fn new() -> Arc<WriteFence> {
        Arc::new(WriteFence::default())
    }

    /// Writes succeed only while `key` is attached to `lease`.
    pub fn set(&self, key: &[u8], lease: i64) {
        *self.key.lock() = key.to_vec();
        self.lease.store(lease, Ordering::SeqCst);
    }

    /// Every write is refused (a follower writes nothing).
    pub fn close(&self) {
        self.lease.store(-1, Ordering::SeqCst);
    }

    pub(super) fn compare(&self) -> Result<Option<pb::Compare>, MetaError> {
        match self.lease.load(Ordering::SeqCst) {
            0 => Ok(None),
            l if l < 0 => Err(MetaError::Backend {
                op: "write",
                message: "fenced: this master does not hold the leader lease".into(),
            }),
            l => Ok(Some(cmp_lease(&self.key.lock(), l))),
        }
    }
}

/// A [`MetaStore`] on etcd. Keys are stored as given (wrap it in [`crate::Prefixed`] for a
/// namespace). Optionally fenced by a [`WriteFence`].
#[derive(Debug, Clone)]
pub struct EtcdMetaStore {
    client: EtcdClient,
    fence: Option<Arc<WriteFence>>,
}

impl EtcdMetaStore {
    pub fn new(client: EtcdClient) -> EtcdMetaStore {
        EtcdMetaStore {
            client,
            fence: None,
        }
    }

    /// Writes go through `fence` (see [`WriteFence`]).
    pub fn with_fence(mut self, fence: Arc<WriteFence>) -> EtcdMetaStore {
        self.fence = Some(fence);
        self
    }

    pub fn client(&self) -> &EtcdClient {
        &self.client
    }

    pub(super) fn fence(&self) -> Result<Option<pb::Compare>, MetaError> {
        match &self.fence {
            Some(f) => f.compare(),
            None => Ok(None),
        }
    }

    fn fenced_out() -> MetaError {
        MetaError::Backend {
            op: "write",
            message: "fenced: the leader lease moved to another master; this write was refused"
                .into(),
        }
    }
}

#[async_trait]
impl MetaStore for EtcdMetaStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        check_key(key)?;
        Ok(self
            .client
            .get_kv(key.as_bytes())
            .await?
            .0
            .map(|kv| kv.value))
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<(), MetaError> {
        check_key(key)?;
        match self.fence()? {
            None => self.client.put_kv(key.as_bytes(), value, 0).await,
            Some(c) => {
                let r = self
                    .client
                    .txn(pb::TxnRequest {
                        compare: vec![c],
                        success: vec![op_put(key.as_bytes(), value, 0)],
                        failure: vec![],
                    })
                    .await?;
                if r.succeeded {
                    Ok(())
                } else {
                    Err(Self::fenced_out())
                }
            }
        }
    }

    async fn delete(&self, key: &str) -> Result<bool, MetaError> {
        check_key(key)?;
        let fence = self.fence()?;
        // Deleting reports whether the key existed: read it in the same transaction.
        let mut compare: Vec<pb::Compare> = fence.into_iter().collect();
        let fenced = !compare.is_empty();
        compare.push(pb::Compare {
            result: CompareResult::Greater as i32,
            ..cmp_version(key.as_bytes(), 0)
        });
        let r = self
            .client
            .txn(pb::TxnRequest {
                compare,
                success: vec![op_delete(key.as_bytes())],
                failure: vec![],
            })
            .await?;
        if r.succeeded {
            return Ok(true);
        }
        if fenced && !self.fence_holds().await? {
            return Err(Self::fenced_out());
        }
        Ok(false)
    }

    async fn list_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        let kvs = self.client.range_prefix(prefix.as_bytes()).await?;
        Ok(kvs
            .into_iter()
            .filter_map(|kv| String::from_utf8(kv.key).ok().map(|k| (k, kv.value)))
            .collect())
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<CasOutcome, MetaError> {
        check_key(key)?;
        let k = key.as_bytes();
        let mut compare: Vec<pb::Compare> = self.fence()?.into_iter().collect();
        let fenced = !compare.is_empty();
        compare.push(match expected {
            None => cmp_version(k, 0),
            // On a missing key etcd's value comparison is false, which is what we want.
            Some(v) => cmp_value(k, v),
        });
        let success = match new {
            Some(v) => op_put(k, v, 0),
            None => op_delete(k),
        };
        let r = self
            .client
            .txn(pb::TxnRequest {
                compare,
                success: vec![success],
                failure: vec![op_get(k)],
            })
            .await?;
        if r.succeeded {
            return Ok(CasOutcome::Swapped);
        }
        let current = first_kv(r.responses).map(|kv| kv.value);
        if fenced && current.as_deref() == expected && !self.fence_holds().await? {
            return Err(Self::fenced_out());
        }
        Ok(CasOutcome::Conflict { current })
    }
}

impl EtcdMetaStore {
    /// Whether the fence key is still attached to the fence lease (after a failed transaction,
    /// tells "the value differed" from "we were fenced out").
    async fn fence_holds(&self) -> Result<bool, MetaError> {
        let Some(f) = &self.fence else {
            return Ok(true);
        };
        let lease = f.lease.load(Ordering::SeqCst);
        let key = f.key.lock().clone();
        let (kv, _) = self.client.get_kv(&key).await?;
        Ok(kv.is_some_and(|kv| kv.lease == lease))
    }
}
