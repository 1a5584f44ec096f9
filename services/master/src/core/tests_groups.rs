//! Groups in the core: evicted whole or not at all, removed together, and never seen partial.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lunakv_proto::{ErrorCode, scope_key};

use super::tests::desc;
use super::*;
use crate::notifier::RecordingNotifier;

const BLOCK: u64 = 64;

fn new_core() -> Arc<MasterCore> {
    let cfg = CoreConfig {
        cluster_id: "c".into(),
        lease_ttl: Duration::from_secs(60),
        eviction_ratio: 0.01,
        // A few blocks per pool: one put is a large share of it.
        put_eviction_limit_ratio: 1.0,
        ..CoreConfig::default()
    };
    Arc::new(MasterCore::new(
        cfg,
        7,
        Arc::new(RecordingNotifier::default()),
    ))
}

fn grouped(group: &str, segment: Option<&str>) -> PutOptions {
    PutOptions {
        replica_num: 1,
        group: Some(group.into()),
        preferred_segments: segment.into_iter().map(String::from).collect(),
        ..PutOptions::default()
    }
}

async fn put(core: &MasterCore, key: &str, o: &PutOptions) {
    core.put_start("cl", key, BLOCK, o)
        .await
        .expect("put_start");
    core.put_end(key).expect("put_end");
}

/// Whether a get would find `key`, without leasing it as a get does.
fn present(core: &MasterCore, key: &str) -> bool {
    let shard = core.shard(key).lock();
    shard.get(key).is_some_and(|o| {
        o.state == ObjectState::Complete
            && o.group.as_ref().is_none_or(|g| !core.groups.is_broken(g))
    })
}

/// Each group's members that a reader finds: all or none, never some.
fn assert_no_partial_group(core: &MasterCore, groups: &BTreeMap<String, Vec<String>>) {
    for (g, keys) in groups {
        let found: Vec<bool> = keys.iter().map(|k| present(core, k)).collect();
        assert!(
            found.iter().all(|f| *f) || found.iter().all(|f| !f),
            "group {g} is partial: {found:?}"
        );
    }
}

#[tokio::test]
async fn eviction_takes_a_group_whole_or_not_at_all() {
    let core = new_core();
    core.mount("cl", "c", desc("a:1", BLOCK * 40), vec![])
        .expect("mount");
    let mut groups = BTreeMap::new();
    for g in 0..10 {
        let keys: Vec<String> = (0..4).map(|s| format!("g{g}@tp{s}")).collect();
        for k in &keys {
            put(&core, k, &grouped(&format!("g{g}"), None)).await;
        }
        groups.insert(format!("g{g}"), keys);
    }
    // The oldest group has one member leased: it stays, whole; the next oldest goes whole.
    core.get_replica_list("g0@tp2").expect("lease one member");
    assert_eq!(core.evict(BLOCK).await, 4, "one group of four");
    assert!(
        groups["g0"].iter().all(|k| present(&core, k)),
        "g0 stays whole"
    );
    assert!(
        groups["g1"].iter().all(|k| !present(&core, k)),
        "g1 went whole"
    );
    assert_no_partial_group(&core, &groups);
    // The pool keeps filling and evicting; no pass leaves a group partial.
    for g in 10..30 {
        let keys: Vec<String> = (0..4).map(|s| format!("g{g}@tp{s}")).collect();
        for k in &keys {
            put(&core, k, &grouped(&format!("g{g}"), None)).await;
        }
        groups.insert(format!("g{g}"), keys);
        assert_no_partial_group(&core, &groups);
    }
    assert!(
        core.metrics.evicted_key_count.get() >= 80,
        "the pool had to evict"
    );
}

#[tokio::test]
async fn a_group_that_loses_a_member_is_not_found_then_gone() {
    let core = new_core();
    core.mount("cl", "c", desc("a:1", BLOCK * 40), vec![])
        .expect("mount a");
    core.mount("cl2", "c", desc("b:1", BLOCK * 40), vec![])
        .expect("mount b");
    put(&core, "k0", &grouped("g", Some("a:1"))).await;
    put(&core, "k1", &grouped("g", Some("a:1"))).await;
    put(&core, "k2", &grouped("g", Some("b:1"))).await;
    let solo = PutOptions {
        replica_num: 1,
        preferred_segments: vec!["a:1".into()],
        ..Default::default()
    };
    put(&core, "solo", &solo).await;
    assert_eq!(core.group_count(), 1);
    // b:1's owner goes: k2 is lost, so k0 and k1 answer not found at once.
    core.unmount("b:1").expect("unmount");
    for k in ["k0", "k1"] {
        let e = core.get_replica_list(k).expect_err("group broken");
        assert_eq!(e.code, ErrorCode::ObjectNotFound);
        assert!(e.message.contains("group"), "{e:?}");
    }
    assert_eq!(core.drop_broken_groups().await, 2);
    assert!(core.query_key("k0").is_none() && core.query_key("k1").is_none());
    assert_eq!(core.group_count(), 0);
    assert!(present(&core, "solo"));
}

#[tokio::test]
async fn removing_one_member_removes_its_group_and_only_its_tenants() {
    let core = new_core();
    core.mount("cl", "c", desc("a:1", BLOCK * 40), vec![])
        .expect("mount");
    for t in ["default", "t1"] {
        for s in 0..3 {
            put(&core, &scope_key(t, &format!("k{s}")), &grouped("g", None)).await;
        }
    }
    assert_eq!(
        core.group_count(),
        2,
        "one group name, two tenants, two groups"
    );
    core.remove("k1", false).await.expect("remove");
    for s in 0..3 {
        assert!(
            core.query_key(&format!("k{s}")).is_none(),
            "k{s} went with k1"
        );
        assert!(
            present(&core, &scope_key("t1", &format!("k{s}"))),
            "t1's group stays"
        );
    }
}

#[tokio::test]
async fn a_member_whose_put_never_ended_does_not_break_its_group() {
    let core = new_core();
    core.mount("cl", "c", desc("a:1", BLOCK * 40), vec![])
        .expect("mount");
    put(&core, "k0", &grouped("g", None)).await;
    core.put_start("cl", "k1", BLOCK, &grouped("g", None))
        .await
        .expect("open");
    core.put_revoke("cl", "k1").await.expect("revoke");
    assert!(
        present(&core, "k0"),
        "a revoked put was never part of what readers saw"
    );
    assert_eq!(core.drop_broken_groups().await, 0);
}

#[tokio::test]
async fn a_group_still_settling_is_evicted_after_every_settled_one() {
    let core = new_core();
    core.mount("cl", "c", desc("a:1", BLOCK * 8), vec![])
        .expect("mount");
    // Settled objects, older than the settle time as far as eviction knows.
    for i in 0..6 {
        put(
            &core,
            &format!("old{i}"),
            &PutOptions {
                replica_num: 1,
                ..Default::default()
            },
        )
        .await;
    }
    for i in 0..6 {
        let mut shard = core.shard(&format!("old{i}")).lock();
        if let Some(mut o) = shard.get_mut(&format!("old{i}")) {
            o.put_start -= Duration::from_secs(60);
            o.last_access += Duration::from_secs(1);
        }
    }
    // Rank 0's shard of a chunk is in; it is the least recently used object of all, yet the
    // put of rank 1's shard evicts settled objects and leaves the group to be completed.
    put(&core, "c@tp0", &grouped("chunk", None)).await;
    put(
        &core,
        "x",
        &PutOptions {
            replica_num: 1,
            ..Default::default()
        },
    )
    .await;
    put(&core, "c@tp1", &grouped("chunk", None)).await;
    assert!(present(&core, "c@tp0") && present(&core, "c@tp1"));
    assert!(
        core.metrics.evicted_key_count.get() >= 1,
        "something settled went instead"
    );
}
