//! KV events across an HA failover (docs/EVENTS.md): a real etcd, two `lunakv-master
//! --enable_ha --enable_kv_event_publish`, a store-client, a subscriber on each master. When the
//! leader is killed, the new leader's stream starts with `RemoveAllEvent` and then re-announces
//! every object the owner's inventory brings back as a `BlockStoreEvent`.
//!
//! Fails with the fix when etcd is not installed; `LUNAKV_SKIP_ETCD=1` skips it.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lunakv_client::{ClientOptions, StoreClient};
use lunakv_meta::testing;
use lunakv_tests::{Master, Store, wait_until};

const EVENTS: [&str; 2] = [
    "--enable_kv_event_publish=true",
    "--kv_event_publisher_endpoint=tcp://127.0.0.1:*",
];

fn events_endpoint(m: &Master) -> String {
    let (code, body) = m.http_get("/kv_events");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    v["endpoint"].as_str().expect("endpoint").to_string()
}

/// Each event of a message as (type, key).
fn events_of(payload: &[u8]) -> Vec<(String, String)> {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let batch = v.as_array().expect("EventBatch");
    batch[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            let e = e.as_array().expect("event");
            let kind = e[0].as_str().unwrap_or_default().to_string();
            let key = e
                .get(1)
                .and_then(|k| k.as_str())
                .unwrap_or_default()
                .to_string();
            (kind, key)
        })
        .collect()
}

/// Receives on `sub` until `done` holds for what was received, or `timeout`.
fn collect(
    sub: &zmq::Socket,
    timeout: Duration,
    done: impl Fn(&[(String, String)]) -> bool,
) -> Vec<(String, String)> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    while !done(&got) {
        assert!(Instant::now() < deadline, "timed out; received {got:?}");
        if let Ok(frames) = sub.recv_multipart(0) {
            assert_eq!(frames.len(), 3);
            got.extend(events_of(&frames[2]));
        }
    }
    got
}

#[test]
fn a_new_leader_announces_remove_all_then_re_announces_the_pool() {
    let Some(etcd) = testing::etcd_or_skip() else {
        return;
    };
    let dirs: Vec<tempfile::TempDir> = (0..2).map(|_| tempfile::tempdir().expect("dir")).collect();
    let mut masters: Vec<Master> = dirs
        .iter()
        .map(|d| Master::start_ha(d.path(), &etcd.endpoint(), &EVENTS))
        .collect();
    let leader = wait_until(Duration::from_secs(20), || {
        let l: Vec<usize> = (0..2)
            .filter(|&i| masters[i].role().as_deref() == Some("leader"))
            .collect();
        (l.len() == 1).then(|| l[0])
    })
    .expect("a leader");
    let standby = 1 - leader;
    let ctx = zmq::Context::new();
    let subs: Vec<zmq::Socket> = masters
        .iter()
        .map(|m| {
            let s = ctx.socket(zmq::SUB).expect("socket");
            s.set_subscribe(b"").expect("subscribe");
            s.set_rcvtimeo(200).expect("timeout");
            s.connect(&events_endpoint(m)).expect("connect");
            s
        })
        .collect();
    // The subscriptions have to reach both publishers.
    std::thread::sleep(Duration::from_millis(500));
    let _store = Store::start(&etcd.etcd_url(), "64MB", &["--enable_shm=false"]);
    let client = StoreClient::connect(ClientOptions {
        master_server_address: etcd.etcd_url(),
        enable_shm: false,
        ..ClientOptions::default()
    })
    .expect("client");
    let keys: Vec<String> = (0..3)
        .map(|i| format!("Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:064x}"))
        .collect();
    for k in &keys {
        client.put(k, b"kv").expect("put");
    }
    let want: BTreeSet<String> = keys.iter().cloned().collect();
    let stored = |got: &[(String, String)]| -> BTreeSet<String> {
        got.iter()
            .filter(|(t, _)| t == "BlockStoreEvent")
            .map(|(_, k)| k.clone())
            .collect()
    };
    collect(&subs[leader], Duration::from_secs(15), |g| {
        stored(g).is_superset(&want)
    });

    masters[leader].proc.kill9();
    // The standby takes over; the owner remounts with its inventory.
    let got = collect(&subs[standby], Duration::from_secs(60), |g| {
        stored(g).is_superset(&want)
    });
    assert_eq!(
        got.first().map(|(t, _)| t.as_str()),
        Some("RemoveAllEvent"),
        "the new leader's stream opens with a remove-all: {got:?}"
    );
    let first_store = got.iter().position(|(t, _)| t == "BlockStoreEvent");
    assert!(first_store.is_some_and(|i| i > 0), "{got:?}");
    // The old leader's subscribers see nothing more from it; the client reaches the new one.
    client
        .put("after-failover", b"x")
        .expect("put after failover");
    drop(masters.remove(leader));
}
