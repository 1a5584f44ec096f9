//! lunakv-bootstrap with its table in a real etcd (`--etcd-endpoints`): two replicas share
//! registrations, leases and replacement. Real binaries on loopback; etcd from
//! `lunakv_meta::testing` (fails with the fix when etcd is missing, `LUNAKV_SKIP_ETCD=1` skips).

use std::sync::Arc;
use std::time::Duration;

use lunakv_meta::{EtcdClient, EtcdMetaStore, MetaStore, testing};
use lunakv_tests::pd::{Bootstrap, Sim, fresh_host, post};
use lunakv_tests::wait_until;
use serde_json::json;

fn replica(etcd: &str, group: &str) -> Bootstrap {
    Bootstrap::start(
        fresh_host(),
        0,
        &[
            &format!("--etcd-endpoints={etcd}"),
            "--cluster-id=pd-test",
            &format!("--group={group}"),
            "--lease-ttl=1500ms",
        ],
    )
}

/// The engine id `b` shows for dp rank 0, or "" when the rank is empty.
fn engine_on(b: &Bootstrap) -> String {
    b.query()["0"]["engine_id"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn etcd_keys(endpoint: &str, prefix: &str) -> Vec<String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = EtcdClient::connect(&[endpoint.to_string()], Duration::from_secs(3)).unwrap();
        let store: Arc<dyn MetaStore> = Arc::new(EtcdMetaStore::new(c));
        store
            .list_prefix(prefix)
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    })
}

#[test]
fn two_replicas_share_registrations_leases_and_replacement() {
    let Some(etcd) = testing::etcd_or_skip() else {
        return;
    };
    let a = replica(&etcd.endpoint(), "g1");
    let b = replica(&etcd.endpoint(), "g1");
    let other = replica(&etcd.endpoint(), "g2");

    // An engine registers through A (and renews there); B serves it.
    let host = fresh_host();
    let mut p = Sim::prefill(host, &a, &[]);
    assert_eq!(engine_on(&a), p.engine_id);
    assert_eq!(engine_on(&b), p.engine_id, "B sees A's registration");
    assert_eq!(
        b.query()["0"]["worker_addr"]["0"]["0"],
        format!("tcp://{}", p.http)
    );
    assert_eq!(engine_on(&other), "", "another group is another table");
    assert_eq!(
        etcd_keys(&etcd.endpoint(), "mooncake-store/pd-test/bootstrap/g1/"),
        vec!["mooncake-store/pd-test/bootstrap/g1/dp/0".to_string()]
    );
    // B enforces what A registered: another engine on the same dp rank is refused.
    let r = post(
        b.http,
        "/register",
        &[],
        &json!({"engine_id": "intruder", "dp_rank": 0, "tp_rank": 1, "pp_rank": 0,
                "addr": "tcp://10.9.9.9:1"}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("Engine ID mismatch"), "{}", r.text());

    // Restarted in place with a new engine id, registering through B: it replaces the stale
    // entry for both replicas.
    let old = p.engine_id.clone();
    let port = p.http.port();
    p.proc.kill9();
    let p2 = Sim::start(
        host,
        port,
        "prefill",
        &[
            format!("--bootstrap=http://{}", b.http),
            "--lease-ttl-ms=1500".into(),
        ],
    );
    p2.wait_registered();
    assert_ne!(p2.engine_id, old);
    assert_eq!(engine_on(&b), p2.engine_id, "replaced, not refused");
    assert_eq!(engine_on(&a), p2.engine_id, "A sees the replacement");

    // The engine dies: its lease lapses (neither replica's prober reaches it) and it is gone
    // from both.
    let mut p2 = p2;
    p2.proc.kill9();
    let gone = wait_until(Duration::from_secs(10), || {
        (engine_on(&a).is_empty() && engine_on(&b).is_empty()).then_some(())
    });
    assert!(gone.is_some(), "a: {} b: {}", a.query(), b.query());
    let swept = wait_until(Duration::from_secs(5), || {
        etcd_keys(&etcd.endpoint(), "mooncake-store/pd-test/bootstrap/g1/")
            .is_empty()
            .then_some(())
    });
    assert!(
        swept.is_some(),
        "the lapsed entry was never deleted from etcd"
    );
}

#[test]
fn unreachable_etcd_is_waited_for_and_named_malformed_endpoints_fail() {
    // Started before etcd (one rollout): the bootstrap waits, naming the endpoints, instead of
    // exiting (tests/tests/e2e/startup_order.rs has it serve once etcd comes up).
    let port = lunakv_tests::free_port();
    let mut b = lunakv_tests::Proc::spawn(
        "lunakv-bootstrap",
        &[
            "--port=0".to_string(),
            "--grpc-port=0".to_string(),
            format!("--etcd-endpoints=127.0.0.1:{port}"),
        ],
        &[],
    );
    b.wait_for_line(
        &format!("waiting for etcd at 127.0.0.1:{port}"),
        Duration::from_secs(20),
    );
    assert!(b.alive(), "{}", b.output());
    assert_eq!(b.terminate(Duration::from_secs(10)), Some(0));

    // An endpoint that is not host:port cannot be waited out.
    let out = std::process::Command::new(lunakv_tests::bin("lunakv-bootstrap"))
        .args(["--port=0", "--grpc-port=0", "--etcd-endpoints=http://[::1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--etcd-endpoints=http://[::1"), "{err}");
}
