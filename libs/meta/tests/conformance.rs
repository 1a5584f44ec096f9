//! Runs the conformance suite against every embedded backend, and checks that the redb file
//! keeps its contents across a close and reopen.

use std::sync::Arc;

use lunakv_meta::{MemMetaStore, MetaStore, Prefixed, RedbMetaStore, conformance};

#[tokio::test]
async fn mem_store_conforms() {
    conformance::run(&MemMetaStore::new()).await;
}

#[tokio::test]
async fn redb_store_conforms() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RedbMetaStore::open(dir.path().join("sub/meta.redb")).expect("open");
    conformance::run(&store).await;
}

#[tokio::test]
async fn prefixed_store_conforms_and_isolates() {
    let inner: Arc<dyn MetaStore> = Arc::new(MemMetaStore::new());
    let a = Prefixed::new(inner.clone(), "cluster-a/");
    conformance::run(&a).await;
    a.put("x", b"1").await.expect("put");
    assert_eq!(
        inner.get("cluster-a/x").await.expect("get"),
        Some(b"1".to_vec())
    );
    let b = Prefixed::new(inner.clone(), "cluster-b/");
    assert_eq!(b.get("x").await.expect("get"), None);
    assert_eq!(a.list_prefix("").await.expect("list").len(), 1);
}

#[tokio::test]
async fn redb_store_persists_across_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("meta.redb");
    {
        let store = RedbMetaStore::open(&path).expect("open");
        store.put("master/epoch", b"7").await.expect("put");
        store.put("segments/h:1", b"{}").await.expect("put");
        store.put("gone", b"x").await.expect("put");
        store.delete("gone").await.expect("delete");
    }
    let store = RedbMetaStore::open(&path).expect("reopen");
    assert_eq!(
        store.get("master/epoch").await.expect("get"),
        Some(b"7".to_vec())
    );
    assert_eq!(store.get("gone").await.expect("get"), None);
    assert_eq!(store.list_prefix("segments/").await.expect("list").len(), 1);
    conformance::run(&store).await;
}

#[tokio::test]
async fn redb_store_is_usable_as_dyn_from_many_tasks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn MetaStore> =
        Arc::new(RedbMetaStore::open(dir.path().join("m.redb")).expect("open"));
    let mut tasks = Vec::new();
    for i in 0..8u8 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            // Increment a counter by CAS from eight tasks at once: no update may be lost.
            loop {
                let cur = s.get("ctr").await.expect("get");
                let n = cur.as_deref().map_or(0, |v| v[0]);
                let next = [n + 1];
                match s.compare_and_swap("ctr", cur.as_deref(), Some(&next)).await {
                    Ok(lunakv_meta::CasOutcome::Swapped) => break,
                    Ok(_) => continue,
                    Err(e) => panic!("cas failed in task {i}: {e}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("join");
    }
    assert_eq!(store.get("ctr").await.expect("get"), Some(vec![8]));
}
