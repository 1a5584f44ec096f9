//! A view of a [`MetaStore`] under a key prefix, like an etcd namespace.

use std::sync::Arc;

use async_trait::async_trait;

use crate::{CasOutcome, MetaError, MetaStore, check_key};

/// Every key is stored as `prefix + key`; listings strip the prefix again. Lets several
/// clusters (or tests) share one backend.
#[derive(Debug, Clone)]
pub struct Prefixed {
    inner: Arc<dyn MetaStore>,
    prefix: String,
}

impl Prefixed {
    pub fn new(inner: Arc<dyn MetaStore>, prefix: impl Into<String>) -> Prefixed {
        Prefixed {
            inner,
            prefix: prefix.into(),
        }
    }

    fn full(&self, key: &str) -> Result<String, MetaError> {
        check_key(key)?;
        Ok(format!("{}{key}", self.prefix))
    }
}

#[async_trait]
impl MetaStore for Prefixed {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        self.inner.get(&self.full(key)?).await
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<(), MetaError> {
        self.inner.put(&self.full(key)?, value).await
    }

    async fn delete(&self, key: &str) -> Result<bool, MetaError> {
        self.inner.delete(&self.full(key)?).await
    }

    async fn list_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        let items = self
            .inner
            .list_prefix(&format!("{}{prefix}", self.prefix))
            .await?;
        Ok(items
            .into_iter()
            .filter_map(|(k, v)| k.strip_prefix(&self.prefix).map(|k| (k.to_string(), v)))
            .collect())
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<CasOutcome, MetaError> {
        self.inner
            .compare_and_swap(&self.full(key)?, expected, new)
            .await
    }
}
