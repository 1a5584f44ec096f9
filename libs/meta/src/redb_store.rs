//! The embedded [`MetaStore`]: one redb file. redb is synchronous, so every call runs on the
//! blocking pool; the database handle is shared by an `Arc`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::{CasOutcome, MetaError, MetaStore, check_key};

const TABLE: TableDefinition<'static, &str, &[u8]> = TableDefinition::new("lunakv_meta");

/// A [`MetaStore`] in a redb file. Only one process may have the file open at a time (redb
/// locks it), which also stops two masters from sharing one data directory by mistake.
#[derive(Clone)]
pub struct RedbMetaStore {
    db: Arc<Database>,
    path: PathBuf,
}

impl std::fmt::Debug for RedbMetaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbMetaStore")
            .field("path", &self.path)
            .finish()
    }
}

fn backend(op: &'static str) -> impl FnOnce(redb::Error) -> MetaError {
    move |e| MetaError::Backend {
        op,
        message: e.to_string(),
    }
}

impl RedbMetaStore {
    /// Opens `path`, creating the file (and its parent directories) if missing. Blocking: call it
    /// at startup or from `spawn_blocking`.
    pub fn open(path: impl AsRef<Path>) -> Result<RedbMetaStore, MetaError> {
        let path = path.as_ref().to_path_buf();
        let open_err = |message: String| MetaError::Open {
            location: path.display().to_string(),
            message,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                open_err(format!("cannot create directory {}: {e}", parent.display()))
            })?;
        }
        let db = Database::create(&path).map_err(|e| {
            open_err(format!(
                "{e} (is another lunakv-master using this data_dir?)"
            ))
        })?;
        // Create the table up front so that read transactions never see it missing.
        let txn = db.begin_write().map_err(|e| open_err(e.to_string()))?;
        txn.open_table(TABLE).map_err(|e| open_err(e.to_string()))?;
        txn.commit().map_err(|e| open_err(e.to_string()))?;
        Ok(RedbMetaStore {
            db: Arc::new(db),
            path,
        })
    }

    /// The file this store lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn blocking<T, F>(&self, op: &'static str, f: F) -> Result<T, MetaError>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T, redb::Error> + Send + 'static,
    {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(|e| MetaError::Backend {
                op,
                message: format!("blocking task failed: {e}"),
            })?
            .map_err(backend(op))
    }
}

#[async_trait]
impl MetaStore for RedbMetaStore {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        check_key(key)?;
        let key = key.to_string();
        self.blocking("get", move |db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(TABLE)?;
            Ok(table.get(key.as_str())?.map(|v| v.value().to_vec()))
        })
        .await
    }

    async fn put(&self, key: &str, value: &[u8]) -> Result<(), MetaError> {
        check_key(key)?;
        let (key, value) = (key.to_string(), value.to_vec());
        self.blocking("put", move |db| {
            let txn = db.begin_write()?;
            {
                let mut table = txn.open_table(TABLE)?;
                table.insert(key.as_str(), value.as_slice())?;
            }
            txn.commit()?;
            Ok(())
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, MetaError> {
        check_key(key)?;
        let key = key.to_string();
        self.blocking("delete", move |db| {
            let txn = db.begin_write()?;
            let existed = {
                let mut table = txn.open_table(TABLE)?;
                table.remove(key.as_str())?.is_some()
            };
            txn.commit()?;
            Ok(existed)
        })
        .await
    }

    async fn list_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError> {
        let prefix = prefix.to_string();
        self.blocking("list_prefix", move |db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(TABLE)?;
            let mut out = Vec::new();
            for item in table.range(prefix.as_str()..)? {
                let (k, v) = item?;
                let k = k.value();
                if !k.starts_with(prefix.as_str()) {
                    break;
                }
                out.push((k.to_string(), v.value().to_vec()));
            }
            Ok(out)
        })
        .await
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<CasOutcome, MetaError> {
        check_key(key)?;
        let key = key.to_string();
        let expected = expected.map(<[u8]>::to_vec);
        let new = new.map(<[u8]>::to_vec);
        self.blocking("compare_and_swap", move |db| {
            // redb has a single writer: the read-compare-write below is atomic.
            let txn = db.begin_write()?;
            let outcome = {
                let mut table = txn.open_table(TABLE)?;
                let current = table.get(key.as_str())?.map(|v| v.value().to_vec());
                if current != expected {
                    CasOutcome::Conflict { current }
                } else {
                    match &new {
                        Some(v) => {
                            table.insert(key.as_str(), v.as_slice())?;
                        }
                        None => {
                            table.remove(key.as_str())?;
                        }
                    }
                    CasOutcome::Swapped
                }
            };
            txn.commit()?;
            Ok(outcome)
        })
        .await
    }
}
