//! KV events across an HA failover (docs/EVENTS.md): a real etcd, two `lunakv-master
//! --enable_ha --enable_kv_event_publish`, a store-client, a subscriber on each master. When the
//! leader is killed, the new leader's stream starts with `cleared` and then re-announces every
//! object the owner's inventory brings back as `stored`.
//!
//! Fails with the fix when etcd is not installed; `LUNAKV_SKIP_ETCD=1` skips it.
//!
//! Also: upstream Mooncake main's event command line starts lunakv-master, and every message
//! of its stream decodes as upstream's RFC #1527 docs define it (no etcd needed).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lunakv_client::{ClientOptions, StoreClient};
use lunakv_meta::testing;
use lunakv_tests::{Master, Store, free_port, requester, wait_until};

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

/// A map event's field by name.
fn field<'a>(e: &'a rmpv::Value, name: &str) -> Option<&'a rmpv::Value> {
    e.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

/// Each event of a message (the master's default RFC #1527 maps) as (event_type, object_key).
fn events_of(payload: &[u8]) -> Vec<(String, String)> {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let batch = v.as_array().expect("EventBatch");
    batch[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            let text = |name| {
                field(e, name)
                    .and_then(rmpv::Value::as_str)
                    .unwrap_or_default()
                    .to_string()
            };
            (text("event_type"), text("object_key"))
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
            .filter(|(t, _)| t == "stored")
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
        Some("cleared"),
        "the new leader's stream opens with a cleared event: {got:?}"
    );
    let first_store = got.iter().position(|(t, _)| t == "stored");
    assert!(first_store.is_some_and(|i| i > 0), "{got:?}");
    // The old leader's subscribers see nothing more from it; the client reaches the new one.
    client
        .put("after-failover", b"x")
        .expect("put after failover");
    drop(masters.remove(leader));
}

/// One message checked as upstream's RFC #1527 docs define the Mooncake master's stream
/// (docs/source/api-reference/http/conductor-indexer.md, "Mooncake Store master publisher",
/// and the field provenance matrix): three frames, `[timestamp, [events], dp_rank]`, each
/// event a map with the envelope, per-object `tenant_id` and `medium` (`cpu` / `disk`), the
/// configured `backend_id`, `seq_hashes` (one u64 when the key is decimal / `0x` hex, else
/// empty), `object_key`, `base_block_idx` 0 on stored, and the legacy `type` / `block_hashes`
/// aliases that agree with them. Returns (event_id, event_type, object_key, medium).
fn decode_rfc1527(frames: &[Vec<u8>], backend_id: &str) -> Vec<(u64, String, String, String)> {
    assert_eq!(frames.len(), 3, "topic, sequence, payload");
    assert_eq!(frames[1].len(), 8, "an 8-byte big-endian sequence");
    let v = rmpv::decode::read_value(&mut &frames[2][..]).expect("msgpack");
    let batch = v.as_array().expect("[timestamp, [events], dp_rank]");
    assert_eq!(batch.len(), 3, "{v}");
    assert!(
        batch[0].as_i64().is_some() || batch[0].as_f64().is_some(),
        "{v}"
    );
    assert_eq!(batch[2].as_u64(), Some(0), "dp_rank 0 from the master");
    let mut out = Vec::new();
    for e in batch[1].as_array().expect("events") {
        let get = |name: &str| field(e, name).unwrap_or_else(|| panic!("no {name} in {e}"));
        let text = |name: &str| {
            get(name)
                .as_str()
                .unwrap_or_else(|| panic!("{name} in {e}"))
        };
        let id = get("event_id").as_u64().expect("event_id is a u64");
        let ts = get("timestamp");
        assert!(
            ts.is_nil() || ts.as_u64().is_some(),
            "timestamp: u64 ms or null"
        );
        let kind = text("event_type").to_string();
        assert_eq!(text("backend_id"), backend_id);
        assert!(!text("tenant_id").is_empty());
        for envelope in [
            "model_name",
            "block_size",
            "additional_salt",
            "lora_name",
            "dp_rank",
        ] {
            let _ = get(envelope);
        }
        let legacy = text("type");
        match kind.as_str() {
            "stored" | "removed" => {
                let medium = text("medium").to_string();
                assert!(medium == "cpu" || medium == "disk", "{e}");
                let key = text("object_key").to_string();
                let hashes: Vec<u64> = get("seq_hashes")
                    .as_array()
                    .expect("seq_hashes is a list")
                    .iter()
                    .map(|h| h.as_u64().expect("u64 seq hash"))
                    .collect();
                let want = if let Some(hex) = key.strip_prefix("0x") {
                    u64::from_str_radix(hex, 16).ok()
                } else {
                    key.parse::<u64>().ok()
                };
                assert_eq!(hashes, want.into_iter().collect::<Vec<_>>(), "{e}");
                let aliases: Vec<i64> = get("block_hashes")
                    .as_array()
                    .expect("block_hashes alias")
                    .iter()
                    .map(|h| h.as_i64().expect("int"))
                    .collect();
                assert_eq!(
                    aliases,
                    hashes.iter().map(|h| *h as i64).collect::<Vec<_>>()
                );
                if kind == "stored" {
                    assert_eq!(legacy, "BlockStored");
                    assert_eq!(get("base_block_idx").as_u64(), Some(0));
                    let _ = (get("parent_hash"), get("token_ids"));
                } else {
                    assert_eq!(legacy, "BlockRemoved");
                    let _ = get("base_block_idx");
                }
                out.push((id, kind, key, medium));
            }
            "cleared" => {
                assert_eq!(legacy, "AllBlocksCleared");
                out.push((id, kind, String::new(), String::new()));
            }
            other => panic!("event_type {other:?}: {e}"),
        }
    }
    out
}

/// Upstream main's documented command line (mooncake-store-deployment-guide.md, "KV Cache
/// Event Publisher"), every event flag with its value, starts lunakv-master; the stream it
/// binds there decodes message by message as the RFC #1527 docs define it.
#[test]
fn an_upstream_main_event_command_line_publishes_rfc1527_events() {
    let dir = tempfile::tempdir().expect("dir");
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let bind = format!("--kv_events_bind_endpoint={endpoint}");
    let master = Master::start(
        dir.path(),
        &[
            "--enable_kv_events",
            &bind,
            "--kv_events_backend_id=store-node-1",
            "--kv_events_emit_legacy_compat=true",
            "--kv_events_emit_object_key=true",
            "--kv_events_queue_capacity=65536",
        ],
    );
    assert_eq!(events_endpoint(&master), endpoint);
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("socket");
    sub.set_subscribe(b"").expect("subscribe");
    sub.set_rcvtimeo(200).expect("timeout");
    sub.connect(&endpoint).expect("connect");
    std::thread::sleep(Duration::from_millis(500));
    let _store = Store::start(&master.addr(), "64MB", &[]);
    let client = requester(&master.addr());
    let keys = [
        "0x2a".to_string(),
        "12345".to_string(),
        format!("Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{:064x}", 7),
    ];
    for k in &keys {
        client.put(k, b"kv").expect("put");
    }
    client.remove(&keys[0], true).expect("remove");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    let mut seqs = Vec::new();
    while !got
        .iter()
        .any(|(_, t, k, _): &(u64, String, String, String)| t == "removed" && *k == keys[0])
    {
        assert!(Instant::now() < deadline, "timed out; received {got:?}");
        if let Ok(frames) = sub.recv_multipart(0) {
            seqs.push(u64::from_be_bytes(
                frames[1][..].try_into().expect("8 bytes"),
            ));
            got.extend(decode_rfc1527(&frames, "store-node-1"));
        }
    }
    let stored: BTreeSet<&str> = got
        .iter()
        .filter(|(_, t, _, m)| t == "stored" && m == "cpu")
        .map(|(_, _, k, _)| k.as_str())
        .collect();
    assert_eq!(stored, keys.iter().map(String::as_str).collect());
    let ids: Vec<u64> = got.iter().map(|(id, ..)| *id).collect();
    assert!(
        ids.windows(2).all(|w| w[1] == w[0] + 1),
        "event ids are consecutive: {ids:?}"
    );
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
}
