//! The same conformance suite as the embedded backends, against a real etcd started on ephemeral
//! ports (Debian's etcd-server; the test fails with the fix when it is missing, and is skipped
//! only when LUNAKV_SKIP_ETCD=1 is set).

use std::sync::Arc;
use std::time::Duration;

use lunakv_meta::etcd::WatchEvent;
use lunakv_meta::{CasOutcome, EtcdClient, EtcdMetaStore, MetaStore, Prefixed, WriteFence};
use lunakv_meta::{conformance, testing};

fn client(etcd: &testing::EtcdServer) -> EtcdClient {
    EtcdClient::connect(&[etcd.endpoint()], Duration::from_secs(5)).expect("client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_store_conforms() {
    let Some(etcd) = testing::etcd_or_skip() else {
        return;
    };
    let c = client(&etcd);
    c.check().await.expect("etcd answers");
    conformance::run(&EtcdMetaStore::new(c.clone())).await;
    // Under a namespace too, as the master uses it.
    let inner: Arc<dyn MetaStore> = Arc::new(EtcdMetaStore::new(c));
    let ns = Prefixed::new(inner.clone(), "mooncake-store/test/");
    conformance::run(&ns).await;
    ns.put("x", b"1").await.expect("put");
    assert_eq!(
        inner.get("mooncake-store/test/x").await.expect("get"),
        Some(b"1".to_vec())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_cas_counter_loses_no_update() {
    let Some(etcd) = testing::etcd_or_skip() else {
        return;
    };
    let store: Arc<dyn MetaStore> = Arc::new(EtcdMetaStore::new(client(&etcd)));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let cur = s.get("ctr").await.expect("get");
                let n = cur.as_deref().map_or(0, |v| v[0]);
                match s
                    .compare_and_swap("ctr", cur.as_deref(), Some(&[n + 1]))
                    .await
                {
                    Ok(CasOutcome::Swapped) => break,
                    Ok(_) => continue,
                    Err(e) => panic!("cas: {e}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("join");
    }
    assert_eq!(store.get("ctr").await.expect("get"), Some(vec![8]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_leases_watches_and_fences() {
    let Some(etcd) = testing::etcd_or_skip() else {
        return;
    };
    let c = client(&etcd);
    let (lease, ttl) = c.lease_grant(Duration::from_secs(5)).await.expect("grant");
    assert_eq!(ttl, 5);
    assert_eq!(
        c.create_if_absent(b"leader", b"a", lease)
            .await
            .expect("create"),
        None,
        "the first candidate wins"
    );
    let other = c
        .create_if_absent(b"leader", b"b", 0)
        .await
        .expect("create")
        .expect("the second candidate sees the holder");
    assert_eq!(other.value, b"a".to_vec());
    assert_eq!(other.lease, lease);
    assert!(c.lease_keep_alive(lease).await.expect("keepalive") > 0);

    // A fenced store writes only while the leader key carries the fence lease.
    let fence = WriteFence::new();
    fence.set(b"leader", lease);
    let fenced = EtcdMetaStore::new(c.clone()).with_fence(fence.clone());
    fenced
        .put("f", b"1")
        .await
        .expect("fenced put while leading");
    assert_eq!(
        fenced
            .compare_and_swap("f", Some(b"1"), Some(b"2"))
            .await
            .expect("cas"),
        CasOutcome::Swapped
    );

    let (_, rev) = c.get_kv(b"leader").await.expect("get");
    let mut w = c.watch_key(b"leader", rev + 1).await.expect("watch");
    c.lease_revoke(lease).await.expect("revoke");
    let events = tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .expect("the watch reports the deletion promptly")
        .expect("watch");
    assert_eq!(events, vec![WatchEvent::Delete(b"leader".to_vec())]);
    assert_eq!(
        c.lease_keep_alive(lease).await.expect("keepalive"),
        0,
        "revoked"
    );

    let e = fenced.put("f", b"3").await.expect_err("fenced out");
    assert!(e.to_string().contains("fenced"), "{e}");
    assert!(
        fenced
            .compare_and_swap("f", Some(b"2"), Some(b"3"))
            .await
            .is_err()
    );
    assert!(fenced.delete("f").await.is_err());
    fence.close();
    assert!(
        fenced.put("f", b"3").await.is_err(),
        "a closed fence refuses"
    );
    assert_eq!(
        EtcdMetaStore::new(c).get("f").await.expect("get"),
        Some(b"2".to_vec()),
        "no fenced write landed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_etcd_is_a_clear_error() {
    // A port nothing listens on: the check fails within the timeout and names the endpoint.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let c = EtcdClient::connect(&[format!("127.0.0.1:{port}")], Duration::from_secs(1))
        .expect("lazy client");
    let e = c.check().await.expect_err("nothing listens there");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}
