//! lunakv-bootstrap over HTTP (vLLM's API) and gRPC (Register / Query / Deregister / Watch).

use std::time::Duration;

use lunakv_proto::bootstrap as pb;
use lunakv_proto::bootstrap::bootstrap_client::BootstrapClient;
use lunakv_tests::pd::{Bootstrap, fresh_host, post, post_from, request};
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
    // Registered from the engines' own host, as a pod registers its own IP.
    assert_eq!(
        post_from(host, b.http, "/register", &reg("live", 0, 0, &live)).status,
        200
    );
    assert_eq!(
        post_from(
            host,
            b.http,
            "/register",
            &reg("dead", 1, 0, &format!("tcp://{host}:1"))
        )
        .status,
        200
    );
    // Both leases ran out in the same probe round: once the dead engine is gone, the live one
    // has been probed and kept.
    let q = wait_until(Duration::from_secs(15), || {
        let q = b.query();
        q.get("1").is_none().then_some(q)
    })
    .unwrap_or_else(|| panic!("the dead engine is still registered: {}", b.query()));
    assert_eq!(q["0"]["engine_id"], "live", "{q}");
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

/// A counter or gauge from the bootstrap's `/metrics`.
fn metric(b: &Bootstrap, name: &str) -> u64 {
    let text = request(b.http, "GET", "/metrics", &[], b"").text();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
}

#[test]
fn registrations_beyond_the_cap_are_refused_and_existing_ones_still_answer() {
    let b = Bootstrap::start(
        fresh_host(),
        0,
        &["--probe-workers=false", "--max-registrations=5"],
    );
    for dp in 0..5 {
        let r = post(
            b.http,
            "/register",
            &[],
            &reg(&format!("E{dp}"), dp, 0, &format!("tcp://10.0.0.{dp}:1")),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = post(
        b.http,
        "/register",
        &[],
        &reg("E5", 5, 0, "tcp://10.0.0.5:1"),
    );
    assert_eq!(r.status, 507, "{}", r.text());
    let msg = r.json()["detail"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("5 live registrations") && msg.contains("--max-registrations"),
        "{msg}"
    );
    // The same over gRPC.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt.block_on(async {
        let mut c = BootstrapClient::connect(format!("http://{}", b.grpc))
            .await
            .unwrap();
        c.register(pb::RegisterRequest {
            worker: Some(pb::Worker {
                engine_id: "G".into(),
                dp_rank: 9,
                tp_rank: 0,
                pp_rank: 0,
                addr: "tcp://10.0.0.9:1".into(),
            }),
            lease_ttl_ms: 0,
        })
        .await
        .unwrap_err()
    });
    assert_eq!(
        err.code(),
        lunakv_proto::tonic::Code::ResourceExhausted,
        "{err}"
    );
    assert!(err.message().contains("--max-registrations"), "{err}");
    // Everything registered before the cap still answers, and renewals still go through.
    let q = b.query();
    assert_eq!(q.as_object().map(|o| o.len()), Some(5), "{q}");
    assert_eq!(q["4"]["engine_id"], "E4");
    assert_eq!(
        post(
            b.http,
            "/register",
            &[],
            &reg("E0", 0, 0, "tcp://10.0.0.0:1")
        )
        .status,
        200
    );
    assert_eq!(
        metric(&b, "lunakv_bootstrap_registrations_over_limit_total"),
        2
    );
    assert_eq!(metric(&b, "lunakv_bootstrap_registrations_limit"), 5);
}

#[test]
fn one_peer_cannot_take_the_whole_table() {
    let b = Bootstrap::start(
        fresh_host(),
        0,
        &["--probe-workers=false", "--max-registrations-per-peer=2"],
    );
    for dp in 0..2 {
        let r = post(
            b.http,
            "/register",
            &[],
            &reg("A", dp, 0, "tcp://10.0.0.1:1"),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = post(
        b.http,
        "/register",
        &[],
        &reg("A", 2, 0, "tcp://10.0.0.1:1"),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    let msg = r.json()["detail"].as_str().unwrap_or_default().to_string();
    assert!(msg.contains("--max-registrations-per-peer=2"), "{msg}");
    // Another host registers as before.
    let other = fresh_host();
    let r = post_from(
        other,
        b.http,
        "/register",
        &reg("B", 2, 0, &format!("tcp://{other}:1")),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn an_out_of_range_lease_is_refused_naming_the_field() {
    let b = Bootstrap::start(fresh_host(), 0, &["--probe-workers=false"]);
    let mut body = reg("A", 0, 0, "tcp://10.0.0.1:1");
    body["lease_ttl_ms"] = json!(u64::MAX);
    let r = post(b.http, "/register", &[], &body);
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["detail"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("lease_ttl_ms=18446744073709551615") && msg.contains("1..=3600000"),
        "{msg}"
    );
    assert_eq!(b.query(), json!({}), "nothing was registered");
    // gRPC: the same check.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt.block_on(async {
        let mut c = BootstrapClient::connect(format!("http://{}", b.grpc))
            .await
            .unwrap();
        c.register(pb::RegisterRequest {
            worker: Some(pb::Worker {
                engine_id: "A".into(),
                dp_rank: 0,
                tp_rank: 0,
                pp_rank: 0,
                addr: "tcp://10.0.0.1:1".into(),
            }),
            lease_ttl_ms: u64::MAX,
        })
        .await
        .unwrap_err()
    });
    assert_eq!(err.code(), lunakv_proto::tonic::Code::InvalidArgument);
    assert!(err.message().contains("lease_ttl_ms="), "{err}");
    // The largest allowed lease is accepted and does not expire at once.
    body["lease_ttl_ms"] = json!(3_600_000u64);
    assert_eq!(post(b.http, "/register", &[], &body).status, 200);
    assert_eq!(b.query()["0"]["engine_id"], "A");
}

/// Connections `l` has waiting (non-blocking accept until none is left).
fn accepted(l: &std::net::TcpListener) -> usize {
    l.set_nonblocking(true).unwrap();
    std::iter::from_fn(|| l.accept().ok()).count()
}

#[test]
fn the_prober_never_dials_an_address_off_the_registering_peers_host() {
    let host = fresh_host();
    let b = Bootstrap::start(host, 0, &["--lease-ttl=600ms"]);
    // The victim: a listener on another host. Our registration comes from 127.0.0.1.
    let victim_host = fresh_host();
    let victim = std::net::TcpListener::bind((victim_host, 0)).unwrap();
    let r = post(
        b.http,
        "/register",
        &[],
        &reg(
            "X",
            0,
            0,
            &format!("tcp://{}", victim.local_addr().unwrap()),
        ),
    );
    assert_eq!(r.status, 200, "accepted, but never probed: {}", r.text());
    // The control: an engine on its own host, registered from that host, is probed.
    let engine_host = fresh_host();
    let engine = std::net::TcpListener::bind((engine_host, 0)).unwrap();
    let r = post_from(
        engine_host,
        b.http,
        "/register",
        &reg(
            "E",
            1,
            0,
            &format!("tcp://{}", engine.local_addr().unwrap()),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // Every probe round dials every target it probes; wait for three rounds at the engine.
    let mut seen = 0;
    let rounds = wait_until(Duration::from_secs(10), || {
        seen += accepted(&engine);
        (seen >= 3).then_some(())
    });
    assert!(rounds.is_some(), "the prober never reached the engine");
    assert_eq!(accepted(&victim), 0, "the prober dialled another host");
    // Unprobed, its lease lapses; the probed engine stays.
    let lapsed = wait_until(Duration::from_secs(5), || {
        b.query().get("0").is_none().then_some(())
    });
    assert!(lapsed.is_some(), "{}", b.query());
    assert_eq!(b.query()["1"]["engine_id"], "E");
    assert_eq!(accepted(&victim), 0, "the prober dialled another host");
    assert_eq!(
        metric(&b, "lunakv_bootstrap_registrations_unprobed_total"),
        1
    );
}

fn tonic_code_already_exists() -> lunakv_proto::tonic::Code {
    lunakv_proto::tonic::Code::AlreadyExists
}
