//! In-memory [`MetaStore`], for tests and throwaway masters.

use std::collections::BTreeMap;

use async_trait::async_trait;
use parking_lot::Mutex;

use crate::{CasOutcome, MetaError, MetaStore, check_key};

/// A [`MetaStore`] in a `BTreeMap`; nothing survives the process.
#[derive(Debug, Default)]
pub struct MemMetaStore {
    map: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemMetaStore {
    pub fn new() -> MemMetaStore {
        MemMetaStore::default()
    }
}

#[async_trait]
impl MetaStore for MemMetaStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        check_key(key)?;
        Ok(self.map.lock().get(key).cloned())
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<(), MetaError> {
        check_key(key)?;
        self.map.lock().insert(key.to_string(), value.to_vec());
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<bool, MetaError> {
        check_key(key)?;
        Ok(self.map.lock().remove(key).is_some())
    }

    async fn list_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        let map = self.map.lock();
        Ok(map
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<CasOutcome, MetaError> {
        check_key(key)?;
        let mut map = self.map.lock();
        let current = map.get(key);
        if current.map(Vec::as_slice) != expected {
            return Ok(CasOutcome::Conflict {
                current: current.cloned(),
            });
        }
        match new {
            Some(v) => map.insert(key.to_string(), v.to_vec()),
            None => map.remove(key),
        };
        Ok(CasOutcome::Swapped)
    }
}
