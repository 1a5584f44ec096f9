//! The behaviour every [`MetaStore`] backend must show. Backend tests call [`run`] with a fresh
//! store (or one they share: every key used here lives under `conformance/`, cleared first), so
//! the etcd backend can run the same suite against a real cluster.
//!
//! Failures panic with a message naming the check, as test assertions do.

use crate::{CasOutcome, MetaStore};

const P: &str = "conformance/";

async fn clear(store: &dyn MetaStore) {
    let items = store.list_prefix(P).await.expect("list_prefix for cleanup");
    for (k, _) in items {
        store.delete(&k).await.expect("delete for cleanup");
    }
}

/// Runs the whole suite against `store`.
pub async fn run(store: &dyn MetaStore) {
    clear(store).await;
    get_put_delete(store).await;
    list_by_prefix(store).await;
    compare_and_swap(store).await;
    binary_values(store).await;
    rejects_bad_keys(store).await;
    clear(store).await;
}

async fn get_put_delete(store: &dyn MetaStore) {
    let k = "conformance/a";
    assert_eq!(
        store.get(k).await.expect("get"),
        None,
        "missing key reads None"
    );
    store.put(k, b"1").await.expect("put");
    assert_eq!(store.get(k).await.expect("get"), Some(b"1".to_vec()));
    store.put(k, b"22").await.expect("overwrite");
    assert_eq!(
        store.get(k).await.expect("get"),
        Some(b"22".to_vec()),
        "put replaces"
    );
    assert!(
        store.delete(k).await.expect("delete"),
        "delete reports an existing key"
    );
    assert!(
        !store.delete(k).await.expect("delete"),
        "delete reports a missing key"
    );
    assert_eq!(
        store.get(k).await.expect("get"),
        None,
        "deleted key reads None"
    );
}

async fn list_by_prefix(store: &dyn MetaStore) {
    for k in ["seg/b", "seg/a", "seg/c/x", "segx", "sef", "seh"] {
        store
            .put(&format!("{P}{k}"), k.as_bytes())
            .await
            .expect("put");
    }
    let got = store.list_prefix(&format!("{P}seg/")).await.expect("list");
    let keys: Vec<_> = got.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "conformance/seg/a",
            "conformance/seg/b",
            "conformance/seg/c/x"
        ],
        "list_prefix returns exactly the prefixed keys, sorted"
    );
    assert_eq!(got[0].1, b"seg/a".to_vec(), "list_prefix returns values");
    let none = store.list_prefix(&format!("{P}zzz")).await.expect("list");
    assert!(none.is_empty(), "an unused prefix lists nothing");
    let all = store.list_prefix(P).await.expect("list");
    assert_eq!(all.len(), 6, "the suite's own prefix lists every key");
    clear(store).await;
}

async fn compare_and_swap(store: &dyn MetaStore) {
    let k = "conformance/cas";
    assert_eq!(
        store
            .compare_and_swap(k, None, Some(b"1"))
            .await
            .expect("cas"),
        CasOutcome::Swapped,
        "create-if-absent succeeds on a missing key"
    );
    assert_eq!(
        store
            .compare_and_swap(k, None, Some(b"2"))
            .await
            .expect("cas"),
        CasOutcome::Conflict {
            current: Some(b"1".to_vec())
        },
        "create-if-absent fails on a present key and reports it"
    );
    assert_eq!(
        store
            .compare_and_swap(k, Some(b"0"), Some(b"2"))
            .await
            .expect("cas"),
        CasOutcome::Conflict {
            current: Some(b"1".to_vec())
        },
        "a wrong expectation changes nothing"
    );
    assert_eq!(store.get(k).await.expect("get"), Some(b"1".to_vec()));
    assert_eq!(
        store
            .compare_and_swap(k, Some(b"1"), Some(b"2"))
            .await
            .expect("cas"),
        CasOutcome::Swapped
    );
    assert_eq!(store.get(k).await.expect("get"), Some(b"2".to_vec()));
    assert_eq!(
        store
            .compare_and_swap(k, Some(b"2"), None)
            .await
            .expect("cas"),
        CasOutcome::Swapped,
        "cas to None deletes"
    );
    assert_eq!(store.get(k).await.expect("get"), None);
    assert_eq!(
        store
            .compare_and_swap(k, Some(b"2"), None)
            .await
            .expect("cas"),
        CasOutcome::Conflict { current: None },
        "expecting a value on a missing key conflicts"
    );
}

async fn binary_values(store: &dyn MetaStore) {
    let k = "conformance/bin";
    let v: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    store.put(k, &v).await.expect("put");
    assert_eq!(
        store.get(k).await.expect("get"),
        Some(v),
        "values are raw bytes"
    );
    store.put(k, b"").await.expect("put empty");
    assert_eq!(
        store.get(k).await.expect("get"),
        Some(Vec::new()),
        "an empty value is not a missing key"
    );
    store.delete(k).await.expect("delete");
}

async fn rejects_bad_keys(store: &dyn MetaStore) {
    assert!(
        store.put("", b"x").await.is_err(),
        "an empty key is refused"
    );
    let long = format!("{P}{}", "k".repeat(crate::MAX_META_KEY_LEN));
    assert!(
        store.put(&long, b"x").await.is_err(),
        "an oversized key is refused"
    );
}
