//! What the master keeps in its [`MetaStore`]: the cluster id a data directory belongs to, the
//! epoch counter (bumped at every start; the high 32 bits of every generation) and the transfer
//! endpoints of mounted segments. The object index is never persisted: owners' inventories
//! rebuild it.

use lunakv_meta::{CasOutcome, MetaError, MetaStore};

use crate::core::SegmentDesc;

const CLUSTER_ID_KEY: &str = "master/cluster_id";
const EPOCH_KEY: &str = "master/epoch";
const SEGMENTS_PREFIX: &str = "segments/";
const INVENTORY_KEY: &str = "master/inventory_key";

/// Errors while reading or updating the persisted facts.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error(
        "data_dir {data_dir} belongs to cluster {stored:?} but this master is configured with \
         cluster_id {configured:?}: start it with --cluster_id {stored} or give it a fresh \
         --data_dir"
    )]
    ClusterMismatch {
        data_dir: String,
        stored: String,
        configured: String,
    },
    #[error("stored value of {key} is corrupt ({value:?}); delete the data_dir to start over")]
    Corrupt { key: &'static str, value: String },
    #[error("the epoch counter is exhausted (4294967295 restarts); start with a fresh data_dir")]
    EpochExhausted,
}

/// Records `cluster_id` in a fresh store, or checks it against the recorded one.
pub async fn check_cluster_id(
    store: &dyn MetaStore,
    cluster_id: &str,
    data_dir: &str,
) -> Result<(), PersistError> {
    let stored = match store
        .compare_and_swap(CLUSTER_ID_KEY, None, Some(cluster_id.as_bytes()))
        .await?
    {
        CasOutcome::Swapped => return Ok(()),
        CasOutcome::Conflict { current } => current.unwrap_or_default(),
    };
    let stored = String::from_utf8_lossy(&stored).into_owned();
    if stored == cluster_id {
        Ok(())
    } else {
        Err(PersistError::ClusterMismatch {
            data_dir: data_dir.to_string(),
            stored,
            configured: cluster_id.to_string(),
        })
    }
}

/// The first epoch of a fresh store: random in [1, 2^31], so two clusters never hand out the
/// same generations (a requester that reached the wrong stack's segment would otherwise find
/// "its" generation there and read foreign bytes) and 2^31 restarts or campaigns stay.
fn first_epoch() -> u32 {
    rand::random_range(1..=1u32 << 31)
}

/// Increments the persisted epoch and returns the new value (a random base on a fresh store,
/// see `first_epoch`).
pub async fn bump_epoch(store: &dyn MetaStore) -> Result<u32, PersistError> {
    loop {
        let current = store.get(EPOCH_KEY).await?;
        let n: u32 = match &current {
            None => first_epoch() - 1,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| PersistError::Corrupt {
                    key: EPOCH_KEY,
                    value: String::from_utf8_lossy(v).into_owned(),
                })?,
        };
        let next = n.checked_add(1).ok_or(PersistError::EpochExhausted)?;
        let next_text = next.to_string();
        if store
            .compare_and_swap(EPOCH_KEY, current.as_deref(), Some(next_text.as_bytes()))
            .await?
            == CasOutcome::Swapped
        {
            return Ok(next);
        }
    }
}

/// The cluster's placement-proof key: created once by the first master (compare-and-create, so
/// masters racing in an HA group agree on one), then read by every master and restart.
pub async fn inventory_key(
    store: &dyn MetaStore,
) -> Result<lunakv_transfer::InventoryKey, PersistError> {
    let fresh = lunakv_transfer::InventoryKey::generate();
    let stored = match store
        .compare_and_swap(INVENTORY_KEY, None, Some(fresh.as_bytes()))
        .await?
    {
        CasOutcome::Swapped => return Ok(fresh),
        CasOutcome::Conflict { current } => current.unwrap_or_default(),
    };
    lunakv_transfer::InventoryKey::from_slice(&stored).ok_or_else(|| PersistError::Corrupt {
        key: INVENTORY_KEY,
        value: format!("{} bytes, expected 32", stored.len()),
    })
}

/// Records a mounted segment's descriptor.
pub async fn save_segment(store: &dyn MetaStore, desc: &SegmentDesc) -> Result<(), PersistError> {
    let value = serde_json::to_vec(desc).map_err(|e| PersistError::Corrupt {
        key: "segments/*",
        value: e.to_string(),
    })?;
    store
        .put(&format!("{SEGMENTS_PREFIX}{}", desc.name), &value)
        .await?;
    Ok(())
}

/// Forgets an unmounted segment.
pub async fn forget_segment(store: &dyn MetaStore, name: &str) -> Result<(), PersistError> {
    store.delete(&format!("{SEGMENTS_PREFIX}{name}")).await?;
    Ok(())
}

/// Segments recorded by a previous run (they are expected to remount).
pub async fn known_segments(store: &dyn MetaStore) -> Result<Vec<SegmentDesc>, PersistError> {
    let items = store.list_prefix(SEGMENTS_PREFIX).await?;
    Ok(items
        .into_iter()
        .filter_map(|(k, v)| match serde_json::from_slice(&v) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(key = %k, error = %e, "ignoring an unreadable segment record");
                None
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lunakv_meta::MemMetaStore;

    #[tokio::test]
    async fn epoch_increments_and_cluster_id_is_checked() {
        let s = MemMetaStore::new();
        let first = bump_epoch(&s).await.expect("bump");
        assert!((1..=1 << 31).contains(&first), "{first}");
        assert_eq!(bump_epoch(&s).await.expect("bump"), first + 1);
        // Two fresh clusters start from different bases (a repeat has odds of 2^-31).
        let other = bump_epoch(&MemMetaStore::new()).await.expect("bump");
        assert_ne!(other, first, "two fresh clusters share generations");
        check_cluster_id(&s, "a", "/d").await.expect("first");
        check_cluster_id(&s, "a", "/d").await.expect("same");
        let msg = check_cluster_id(&s, "b", "/d")
            .await
            .expect_err("mismatch")
            .to_string();
        assert!(
            msg.contains("\"a\"") && msg.contains("\"b\"") && msg.contains("--cluster_id a"),
            "{msg}"
        );
        s.put(EPOCH_KEY, b"x").await.expect("put");
        assert!(matches!(
            bump_epoch(&s).await,
            Err(PersistError::Corrupt { .. })
        ));
    }

    #[tokio::test]
    async fn the_inventory_key_is_created_once_and_kept() {
        let s = MemMetaStore::new();
        let a = inventory_key(&s).await.unwrap();
        assert_eq!(inventory_key(&s).await.unwrap(), a);
        s.put(INVENTORY_KEY, b"short").await.unwrap();
        let e = inventory_key(&s).await.unwrap_err().to_string();
        assert!(
            e.contains("master/inventory_key") && e.contains("5 bytes"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn segments_round_trip() {
        let s = MemMetaStore::new();
        let d = SegmentDesc {
            name: "h:1".into(),
            transfer_endpoint: "h:1".into(),
            size: 10,
            host_id: "x".into(),
            shm_socket: String::new(),
            protocol: "tcp".into(),
            enable_offload: false,
            disk_capacity: 0,
            instance_id: "abc".into(),
            requested_protocol: "tcp".into(),
            protocol_reason: String::new(),
            data_secret: None,
        };
        save_segment(&s, &d).await.expect("save");
        assert_eq!(known_segments(&s).await.expect("list"), vec![d]);
        forget_segment(&s, "h:1").await.expect("forget");
        assert!(known_segments(&s).await.expect("list").is_empty());
    }
}
