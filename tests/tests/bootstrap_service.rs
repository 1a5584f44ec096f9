//! lunakv-bootstrap over HTTP (vLLM's API) and gRPC (Register / Query / Deregister / Watch).

use std::time::Duration;

use lunakv_proto::bootstrap as pb;
use lunakv_proto::bootstrap::bootstrap_client::BootstrapClient;
use lunakv_tests::pd::{Bootstrap, fresh_host, post};
use lunakv_tests::wait_until;
use serde_json::json;

fn reg(engine: &str, dp: u32, tp: u32, addr: &str) -> serde_json::Value {
    json!({"engine_id": engine, "dp_rank": dp, "tp_rank": tp, "pp_rank": 0, "addr": addr})
}

#[test]
fn http_api_matches_vllm_and_leases_lapse() {
    let b = Bootstrap::start(
        fresh_host(),
        0,
        &["--lease-ttl=600ms", "--probe-workers=false"],
    );
    let r = post(
        b.http,
        "/register",
        &[],
        &reg("A", 0, 0, "tcp://10.0.0.1:1"),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"status": "ok"}));
    assert_eq!(
        post(
            b.http,
            "/register",
            &[],
            &reg("A", 0, 1, "tcp://10.0.0.1:2")
        )
        .status,
        200
    );
    let r = post(
        b.http,
        "/register",
        &[],
        &reg("B", 0, 2, "tcp://10.0.0.9:1"),
    );
    assert_eq!(r.status, 400);
    assert!(
        r.json()["detail"]
            .as_str()
            .unwrap()
            .contains("Engine ID mismatch")
    );
    let r = post(
        b.http,
        "/register",
        &[],
        &reg("A", 0, 0, "tcp://10.0.0.1:7"),
    );
    assert_eq!(r.status, 400);
    assert!(r.json()["detail"].as_str().unwrap().contains("Duplicate"));
    assert_eq!(
        post(b.http, "/register", &[], &json!({"engine_id": 1})).status,
        400
    );
    assert_eq!(
        b.query(),
        json!({"0": {"engine_id": "A", "worker_addr": {"0": {"0": "tcp://10.0.0.1:1"}, "1": {"0": "tcp://10.0.0.1:2"}}}})
    );
    // Renewing (same worker again) keeps it past one lease; then it lapses and frees the rank.
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(
            post(
                b.http,
                "/register",
                &[],
                &reg("A", 0, 0, "tcp://10.0.0.1:1")
            )
            .status,
            200
        );
    }
    assert_eq!(
        b.query()["0"]["worker_addr"].as_object().unwrap().len(),
        1,
        "tp 1 was not renewed"
    );
    let gone = wait_until(Duration::from_secs(3), || {
        (b.query() == json!({})).then_some(())
    });
    assert!(
        gone.is_some(),
        "a dead engine must disappear after its lease"
    );
    assert_eq!(
        post(
            b.http,
            "/register",
            &[],
            &reg("B", 0, 0, "tcp://10.0.0.9:1")
        )
        .status,
        200
    );
}

#[test]
fn dead_engines_are_probed_away_live_ones_kept() {
    // An engine that never renews (vLLM) stays while its side channel answers.
    let host = fresh_host();
    let listener = std::net::TcpListener::bind((host, 0)).unwrap();
    let live = format!("tcp://{}", listener.local_addr().unwrap());
    let b = Bootstrap::start(host, 0, &["--lease-ttl=600ms"]);
    assert_eq!(
        post(b.http, "/register", &[], &reg("live", 0, 0, &live)).status,
        200
    );
    assert_eq!(
        post(
            b.http,
            "/register",
            &[],
            &reg("dead", 1, 0, &format!("tcp://{host}:1"))
        )
        .status,
        200
    );
    std::thread::sleep(Duration::from_millis(1500));
    let q = b.query();
    assert_eq!(q["0"]["engine_id"], "live", "{q}");
    assert!(q.get("1").is_none(), "{q}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_register_query_deregister_watch() {
    let b = Bootstrap::start(fresh_host(), 0, &["--probe-workers=false"]);
    let mut c = BootstrapClient::connect(format!("http://{}", b.grpc))
        .await
        .unwrap();
    let mut watch = c.watch(pb::WatchRequest {}).await.unwrap().into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert!(first.entries.is_empty());
    let w = pb::Worker {
        engine_id: "E".into(),
        dp_rank: 0,
        tp_rank: 0,
        pp_rank: 0,
        addr: "tcp://h:1".into(),
    };
    let r = c
        .register(pb::RegisterRequest {
            worker: Some(w.clone()),
            lease_ttl_ms: 5000,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.lease_ttl_ms, 5000);
    let next = watch.message().await.unwrap().unwrap();
    assert_eq!(next.entries[0].engine_id, "E");
    // HTTP sees the gRPC registration.
    assert_eq!(b.query()["0"]["engine_id"], "E");
    // Restart in place on the same addr replaces.
    let w2 = pb::Worker {
        engine_id: "E2".into(),
        ..w.clone()
    };
    let r = c
        .register(pb::RegisterRequest {
            worker: Some(w2),
            lease_ttl_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.replaced_engine_ids, vec!["E".to_string()]);
    let err = c
        .register(pb::RegisterRequest {
            worker: Some(pb::Worker {
                engine_id: "X".into(),
                addr: "tcp://other:1".into(),
                ..w
            }),
            lease_ttl_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic_code_already_exists());
    let q = c.query(pb::QueryRequest {}).await.unwrap().into_inner();
    assert_eq!(q.entries[0].engine_id, "E2");
    let d = c
        .deregister(pb::DeregisterRequest {
            engine_id: "E2".into(),
            all: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.removed, 1);
    let mut last = watch.message().await.unwrap().unwrap();
    while !last.entries.is_empty() {
        last = watch.message().await.unwrap().unwrap();
    }
}

fn tonic_code_already_exists() -> lunakv_proto::tonic::Code {
    lunakv_proto::tonic::Code::AlreadyExists
}
