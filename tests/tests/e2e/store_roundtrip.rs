//! Put/get across processes in both of the seed's modes, and the batch API.

use lunakv_client::{ClientError, ErrorCode, ReplicateConfig};
use lunakv_tests::{Master, Store, embedded, pattern, requester, tcp_requester};

fn master() -> (tempfile::TempDir, Master) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    (dir, m)
}

#[test]
fn standalone_store_round_trip_over_shm_and_tcp() {
    let (_d, m) = master();
    let store = Store::start(&m.addr(), "64MB", &[]);
    let writer = requester(&m.addr());
    let shm_reader = requester(&m.addr());
    let tcp_reader = tcp_requester(&m.addr());

    for (i, len) in [1usize, 4096, 64 << 10, 1 << 20, 4 << 20]
        .into_iter()
        .enumerate()
    {
        let key = format!("obj-{i}");
        let value = pattern(i as u64, len);
        writer.put(&key, &value).expect("put");
        assert_eq!(
            shm_reader.get(&key).expect("shm get"),
            value,
            "shm bytes of {key}"
        );
        assert_eq!(
            tcp_reader.get(&key).expect("tcp get"),
            value,
            "tcp bytes of {key}"
        );
        let mut buf = vec![0u8; len + 17];
        assert_eq!(
            tcp_reader.get_into(&key, &mut buf).expect("get_into"),
            len as u64
        );
        assert_eq!(&buf[..len], &value[..]);
        assert_eq!(shm_reader.get_size(&key).expect("size"), len as u64);
    }
    // The bytes live in the store's segment, not in the writer: they outlive it.
    drop(writer);
    assert_eq!(
        tcp_reader.get("obj-3").expect("after writer left"),
        pattern(3, 1 << 20)
    );
    assert_eq!(store.segment_name(), store.transfer.to_string());
}

#[test]
fn embedded_mode_clients_serve_each_other() {
    let (_d, m) = master();
    let a = embedded(&m.addr(), 16 << 20);
    let b = embedded(&m.addr(), 16 << 20);
    let seg_a = a.segment_name().expect("a hosts a segment");
    let seg_b = b.segment_name().expect("b hosts a segment");
    assert_ne!(seg_a, seg_b);

    // Pin a put to b's segment from a, and one to a's from b: each get crosses clients.
    let to_b = ReplicateConfig {
        preferred_segment: Some(seg_b.clone()),
        ..Default::default()
    };
    let to_a = ReplicateConfig {
        preferred_segment: Some(seg_a.clone()),
        ..Default::default()
    };
    let v1 = pattern(11, 300_000);
    let v2 = pattern(12, 123_457);
    a.put_parts("from-a", &[&v1[..100_000], &v1[100_000..]], &to_b)
        .expect("put a");
    b.put_parts("from-b", &[&v2], &to_a).expect("put b");
    assert_eq!(b.get("from-a").expect("b reads a's object"), v1);
    assert_eq!(a.get("from-b").expect("a reads b's object"), v2);

    // A pure requester reads from both embedded segments over tcp.
    let r = tcp_requester(&m.addr());
    assert_eq!(r.get("from-a").expect("requester"), v1);
    assert_eq!(r.get("from-b").expect("requester"), v2);

    // Closing b unmounts its segment: the object placed there is gone at once.
    b.close().expect("close b");
    let gone = r.get("from-a");
    assert!(
        matches!(gone, Err(ClientError::ObjectNotFound(_))),
        "got {gone:?}"
    );
    assert_eq!(r.get("from-b").expect("a's segment still serves"), v2);
}

#[test]
fn batch_operations() {
    let (_d, m) = master();
    let _store = Store::start(&m.addr(), "64MB", &[]);
    let c = requester(&m.addr());
    let other = tcp_requester(&m.addr());

    // 32 objects shaped like vLLM's: one piece per layer.
    let layers = 8;
    let piece = 16 << 10;
    let keys: Vec<String> = (0..32)
        .map(|i| format!("model@tp_rank:0@group:0@{i:016x}"))
        .collect();
    let values: Vec<Vec<u8>> = (0..32).map(|i| pattern(100 + i, layers * piece)).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();

    let exist_before = c.batch_exists(&key_refs);
    assert!(exist_before.iter().all(|r| matches!(r, Ok(false))));

    let items: Vec<(&str, Vec<&[u8]>)> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_str(), v.chunks(piece).collect()))
        .collect();
    let put = c.batch_put(&items, &ReplicateConfig::default());
    assert!(put.iter().all(Result::is_ok), "{put:?}");

    // Putting again: every key already exists (-705), nothing is overwritten.
    let again = c.batch_put(&items[..4], &ReplicateConfig::default());
    for r in &again {
        let e = r.as_ref().expect_err("duplicate put");
        assert_eq!(e.code(), ErrorCode::ObjectAlreadyExists);
    }

    assert!(
        other
            .batch_exists(&key_refs)
            .iter()
            .all(|r| matches!(r, Ok(true)))
    );

    let mut bufs: Vec<Vec<u8>> = (0..32).map(|_| vec![0u8; layers * piece]).collect();
    let mut dsts: Vec<Vec<&mut [u8]>> = bufs
        .iter_mut()
        .map(|b| b.chunks_mut(piece).collect())
        .collect();
    let got = other.batch_get_into(&key_refs, &mut dsts);
    assert!(
        got.iter()
            .all(|r| matches!(r, Ok(n) if *n == (layers * piece) as u64)),
        "{got:?}"
    );
    drop(dsts);
    assert_eq!(bufs, values);

    // batch_exists granted leases (as upstream's ExistKey does): removal needs force.
    let refused = c.batch_remove(&key_refs[..16], false);
    assert!(
        refused
            .iter()
            .all(|r| matches!(r, Err(ClientError::ObjectHasLease(_)))),
        "{refused:?}"
    );
    let removed = c.batch_remove(&key_refs[..16], true);
    assert!(removed.iter().all(Result::is_ok), "{removed:?}");
    let exist_after = other.batch_exists(&key_refs);
    for (i, r) in exist_after.iter().enumerate() {
        assert_eq!(*r.as_ref().expect("exists"), i >= 16, "key {i}");
    }
    // The other client had all 32 locations cached: a removed key must not be served from cache.
    for k in &key_refs[..16] {
        let r = other.get(k);
        assert!(
            matches!(r, Err(ClientError::ObjectNotFound(_))),
            "{k}: {r:?}"
        );
    }
    assert_eq!(other.remove_all(true).expect("remove_all"), 16);
    assert!(
        other
            .batch_exists(&key_refs)
            .iter()
            .all(|r| matches!(r, Ok(false)))
    );
}

#[test]
fn two_replicas_land_on_distinct_segments_and_survive_one_owner() {
    let (_d, m) = master();
    let mut s1 = Store::start(&m.addr(), "16MB", &[]);
    let _s2 = Store::start(&m.addr(), "16MB", &[]);
    let c = tcp_requester(&m.addr());
    let v = pattern(7, 1 << 20);
    let cfg = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    c.put_parts("twice", &[&v], &cfg)
        .expect("put with 2 replicas");
    let (status, body) = m.http_get("/query_key?key=twice");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&s1.segment_name()), "{body}");
    assert!(body.contains(&_s2.segment_name()), "{body}");
    // One owner dies: the other replica still serves the bytes.
    s1.proc.kill9();
    assert_eq!(c.get("twice").expect("served by the surviving replica"), v);
}
