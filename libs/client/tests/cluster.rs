//! The requester's retry, fallback, location-cache and failover paths against a real master and
//! real segments in this process ([`lunakv_cluster`]), on loopback ports bound to 0.
//!
//! Each test names one behaviour and asserts what the caller sees (the bytes, the error) and,
//! where the behaviour is about avoiding or making a master round trip, the master's own
//! request counters. None asserts on time.

use lunakv_client::{ClientError, ClientOptions, MasterWait, ReplicateConfig, StoreClient};
use lunakv_cluster::{Cluster, ClusterOptions, HaCluster, STEP_DEADLINE, wait_for};

/// A pure requester (standalone-store mode) against `c`, over tcp.
fn requester(c: &Cluster) -> StoreClient {
    requester_at(c.master_address())
}

/// A pure requester against `master` (`host:port` or `etcd://...`), over tcp.
fn requester_at(master: String) -> StoreClient {
    StoreClient::connect(ClientOptions {
        master_server_address: master,
        enable_shm: false,
        master_wait: MasterWait::NoWait,
        ..ClientOptions::default()
    })
    .expect("client connects")
}

fn two_segments() -> Cluster {
    Cluster::with(ClusterOptions {
        segments: 2,
        ..ClusterOptions::default()
    })
    .expect("cluster")
}

/// Puts `value` at `key` on segment `seg` only.
fn put_on(writer: &StoreClient, c: &Cluster, seg: usize, key: &str, value: &[u8]) {
    let cfg = ReplicateConfig {
        replica_num: 1,
        preferred_segment: Some(c.segment_name(seg)),
        ..ReplicateConfig::default()
    };
    writer.put_parts(key, &[value], &cfg).expect("put");
    let replicas = writer
        .batch_replicas(&[key])
        .pop()
        .expect("one")
        .expect("replicas");
    let on: Vec<_> = replicas
        .iter()
        .filter_map(|r| r.segment.as_ref().map(|s| s.name.clone()))
        .collect();
    assert_eq!(on, vec![c.segment_name(seg)], "{key} landed where asked");
}

fn lookups(c: &Cluster) -> u64 {
    c.master_requests("get_replica_list")
}

#[test]
fn a_cached_location_serves_the_next_get_without_the_master() {
    let c = Cluster::start().expect("cluster");
    let (writer, reader) = (requester(&c), requester(&c));
    writer.put("k", b"cached bytes").expect("put");

    assert_eq!(reader.get("k").expect("first get"), b"cached bytes");
    let after_first = lookups(&c);
    assert!(after_first >= 1, "the first get asked the master");
    assert_eq!(reader.get("k").expect("second get"), b"cached bytes");
    assert_eq!(lookups(&c), after_first, "the second get used the cache");
}

#[test]
fn a_cached_entry_of_a_removed_object_is_a_miss_not_old_bytes() {
    let c = Cluster::start().expect("cluster");
    let (writer, reader) = (requester(&c), requester(&c));
    writer.put("gone", b"old bytes").expect("put");
    assert_eq!(reader.get("gone").expect("cached"), b"old bytes");

    writer.remove("gone", true).expect("remove");
    let before = lookups(&c);
    match reader.get("gone") {
        Err(ClientError::ObjectNotFound(_)) => {}
        other => panic!("a removed object must be a miss, got {other:?}"),
    }
    assert!(
        lookups(&c) > before,
        "the owner's stale answer sent the reader back to the master"
    );
    // The stale entry is gone: the next get asks the master again instead of the dead location.
    let before = lookups(&c);
    assert!(matches!(
        reader.get("gone"),
        Err(ClientError::ObjectNotFound(_))
    ));
    assert!(lookups(&c) > before, "no stale entry left in the cache");
}

#[test]
fn a_cached_entry_of_a_re_put_object_reads_the_new_generation() {
    let c = Cluster::start().expect("cluster");
    let (writer, reader) = (requester(&c), requester(&c));
    writer.put("re", b"generation one").expect("put");
    assert_eq!(reader.get("re").expect("cached"), b"generation one");

    // Same size, same segment: the new object can sit where the old one was, so only the
    // generation tells them apart.
    writer.remove("re", true).expect("remove");
    writer.put("re", b"generation two").expect("re-put");
    assert_eq!(reader.get("re").expect("refreshed"), b"generation two");
    // And the refreshed entry is cached again.
    let before = lookups(&c);
    assert_eq!(reader.get("re").expect("cached again"), b"generation two");
    assert_eq!(lookups(&c), before);
}

#[test]
fn a_batch_get_with_stale_entries_refreshes_them() {
    let c = Cluster::start().expect("cluster");
    let (writer, reader) = (requester(&c), requester(&c));
    for k in ["b0", "b1"] {
        writer.put(k, format!("{k} one").as_bytes()).expect("put");
        reader.get(k).expect("cached");
    }
    writer.remove("b1", true).expect("remove");
    writer.put("b1", b"b1 two").expect("re-put");

    let (mut d0, mut d1) = (vec![0u8; 6], vec![0u8; 6]);
    let mut dsts = vec![vec![&mut d0[..]], vec![&mut d1[..]]];
    let got = reader.batch_get_into(&["b0", "b1"], &mut dsts);
    assert_eq!(got.len(), 2);
    assert_eq!(*got[0].as_ref().expect("b0"), 6);
    assert_eq!(*got[1].as_ref().expect("b1 refreshed"), 6);
    assert_eq!(&d0, b"b0 one");
    assert_eq!(&d1, b"b1 two");
}

#[test]
fn a_cached_entry_naming_a_segment_that_went_away_is_refreshed() {
    let mut c = two_segments();
    let (writer, reader) = (requester(&c), requester(&c));
    put_on(&writer, &c, 0, "moved", b"on segment 0");
    assert_eq!(reader.get("moved").expect("cached"), b"on segment 0");

    // Segment 0 unmounts (its objects are dropped); the object is written again elsewhere.
    c.stop_segment(0);
    writer.put("moved", b"on segment 1").expect("re-put");

    // The reader's entry names segment 0, which refuses connections now: one failed read, one
    // fresh location, the new bytes.
    assert_eq!(reader.get("moved").expect("refreshed"), b"on segment 1");
}

#[test]
fn an_object_whose_only_segment_went_away_is_a_miss() {
    let mut c = two_segments();
    let (writer, reader) = (requester(&c), requester(&c));
    put_on(&writer, &c, 0, "lost", b"only copy");
    assert_eq!(reader.get("lost").expect("cached"), b"only copy");

    c.stop_segment(0);
    match reader.get("lost") {
        Err(ClientError::ObjectNotFound(_)) => {}
        other => panic!("the master forgot the object with its segment: {other:?}"),
    }
}

#[test]
fn a_get_falls_back_to_the_next_replica_when_the_first_owner_is_gone() {
    let mut c = two_segments();
    let (writer, reader) = (requester(&c), requester(&c));
    let cfg = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    writer
        .put_parts("two", &[b"two copies"], &cfg)
        .expect("put two replicas");
    let replicas = reader
        .batch_replicas(&["two"])
        .pop()
        .expect("one")
        .expect("replicas");
    assert_eq!(replicas.len(), 2, "one replica per segment");
    assert_eq!(reader.get("two").expect("cached"), b"two copies");

    // The owner of the replica a reader tries first crashes: no unmount, so the master still
    // lists both replicas and only the client's fallback can serve the get.
    let first = replicas[0].segment.as_ref().expect("segment").name.clone();
    let crashed = (0..2).find(|&i| c.segment_name(i) == first).expect("ours");
    c.crash_segment(crashed);

    let before = lookups(&c);
    assert_eq!(reader.get("two").expect("second replica"), b"two copies");
    assert_eq!(
        lookups(&c),
        before,
        "the other replica of the cached location served it, without a new lookup"
    );
}

#[test]
fn cached_gets_keep_working_while_the_master_is_down() {
    let mut c = Cluster::start().expect("cluster");
    let (writer, reader) = (requester(&c), requester(&c));
    writer.put("warm", b"no master needed").expect("put");
    assert_eq!(reader.get("warm").expect("cached"), b"no master needed");

    c.stop_master().expect("stop");
    assert_eq!(
        reader
            .get("warm")
            .expect("served from the cache and the segment"),
        b"no master needed"
    );
    assert!(
        reader.get("never-put").is_err(),
        "an uncached key needs the master, which is down"
    );
}

#[test]
fn after_a_master_restart_calls_wait_out_the_rebuild_instead_of_reporting_misses() {
    let mut c = Cluster::start().expect("cluster");
    let (writer, reader) = (requester(&c), requester(&c));
    writer.put("kept", b"survives the restart").expect("put");
    writer.put("kept-2", b"also survives").expect("put");

    // The restarted master knows the segment from its meta store but not its objects until the
    // segment re-mounts with its inventory; until then it answers "rebuilding", which the
    // quick exists call hands to gRPC and gRPC retries. A client that took "rebuilding" for
    // an answer would report a miss (or an error) here.
    c.restart_master().expect("restart");
    assert!(reader.exists("kept").expect("exists after the restart"));
    assert_eq!(
        reader
            .get("kept-2")
            .expect("uncached get after the restart"),
        b"also survives"
    );
    wait_for("the segment to re-mount", STEP_DEADLINE, || {
        c.segment_mounted(0)
    });
    // And the restarted master takes new puts.
    writer
        .put("after", b"new term")
        .expect("put after the restart");
    assert_eq!(reader.get("after").expect("get"), b"new term");
}

#[test]
fn calls_follow_a_leader_change_to_the_new_leader_which_serves_every_object() {
    let Some(c) = HaCluster::start(2, ClusterOptions::default()) else {
        return;
    };
    let mut c = c.expect("HA cluster");
    let (writer, reader) = (
        requester_at(c.master_address()),
        requester_at(c.master_address()),
    );
    writer
        .put("before", b"written under the first leader")
        .expect("put");

    // A graceful stop hands over at once; calls in flight or next find the new leader
    // through etcd (or a refused connection), and wait out its rebuild from the segment's
    // inventory instead of reporting a miss.
    let old = c.leader().expect("one leader");
    c.stop_master(old).expect("stop the leader");
    assert!(
        reader.exists("before").expect("exists, at the new leader"),
        "the new leader rebuilt the object from the segment's inventory"
    );
    assert_eq!(
        reader.get("before").expect("get"),
        b"written under the first leader"
    );
    writer
        .put("after", b"written under the second leader")
        .expect("a put at the new leader");
    assert_eq!(
        reader.get("after").expect("get"),
        b"written under the second leader"
    );
    let new = c.wait_leader(Some(old));
    assert_ne!(new, old);
    assert!(
        c.segments_mounted(),
        "the segment re-mounted with the new leader"
    );
}
