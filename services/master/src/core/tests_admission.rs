//! The SSD tier as the policy's second level: which DRAM evictions it admits (a chain's end
//! never read is dropped, under cslru only) and which disk hits come back to DRAM
//! (`--promotion_admission_threshold`, `--promotion_queue_limit`, eviction for an admitted
//! promotion into a full pool).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tests::{item, offload_desc};
use super::*;
use crate::notifier::RecordingNotifier;

const BLOCK: u64 = 64;
const DISK_GEN: u64 = 7 << 32;

fn core_of(
    policy: EvictionPolicy,
    blocks: u64,
    tune: impl FnOnce(&mut CoreConfig),
    inventory: Vec<InventoryItem>,
) -> (Arc<MasterCore>, Arc<RecordingNotifier>) {
    let mut cfg = CoreConfig {
        cluster_id: "c".into(),
        lease_ttl: Duration::from_millis(1),
        eviction_policy: policy,
        enable_offload: true,
        put_reservation_limit_ratio: 1.0,
        put_reservation_total_ratio: 1.0,
        put_eviction_limit_ratio: 1.0,
        ..CoreConfig::default()
    };
    tune(&mut cfg);
    let n = Arc::new(RecordingNotifier::default());
    let core = Arc::new(MasterCore::new(cfg, 7, n.clone()));
    core.mount("cl", "c", offload_desc("a:1", BLOCK * blocks), inventory)
        .expect("mount");
    (core, n)
}

fn disk_item(key: &str, n: u64) -> InventoryItem {
    InventoryItem {
        disk: true,
        ..item(key, 0, BLOCK, DISK_GEN | n)
    }
}

/// Puts `keys` as one batch in prefix order, as vLLM saves a request's blocks; returns their
/// generations.
async fn put_chain(core: &MasterCore, keys: &[&str]) -> Vec<u64> {
    let opts = PutOptions {
        replica_num: 1,
        ..Default::default()
    };
    let mut gens = Vec::new();
    for k in keys {
        let (g, _) = core.put_start("cl", k, BLOCK, &opts).await.expect("put");
        gens.push(g);
    }
    let now = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        let end = ChainEnd::of(i, keys.len());
        core.put_end_at(&Caller::default(), k, chain_stamp(now, i), end)
            .expect("put_end");
    }
    gens
}

fn read(core: &MasterCore, key: &str) -> Location {
    core.lookup("", key, Touch::Read(Instant::now()))
        .expect("read")
}

fn offloaded(n: &RecordingNotifier) -> Vec<u64> {
    n.offloads
        .lock()
        .iter()
        .flat_map(|c| c.entries.iter().map(|(g, _)| *g))
        .collect()
}

/// Fills the pool with single-block batches (their own chain's end, still written to disk)
/// until everything put before is evicted from DRAM.
async fn push_out(core: &MasterCore, blocks: u64) {
    for i in 0..blocks * 2 {
        put_chain(core, &[&format!("filler{i}")]).await;
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[tokio::test]
async fn a_chain_end_never_read_is_dropped_instead_of_written_to_disk() {
    let (core, n) = core_of(EvictionPolicy::Cslru, 8, |_| {}, vec![]);
    let a = put_chain(&core, &["a0", "a1", "a2"]).await;
    let b = put_chain(&core, &["b0", "b1", "b2"]).await;
    read(&core, "b2");
    push_out(&core, 8).await;
    // The protected block goes last: empty DRAM.
    std::thread::sleep(Duration::from_millis(2));
    core.evict(u64::MAX).await;
    let disk = offloaded(&n);
    assert!(
        disk.contains(&a[0]) && disk.contains(&a[1]),
        "heads go to disk"
    );
    assert!(
        disk.contains(&b[2]),
        "a chain end that was read goes to disk"
    );
    assert!(!disk.contains(&a[2]), "an unread chain end is not written");
    assert!(core.query_key("a2").is_none(), "and leaves the index");
    assert!(core.query_key("a1").is_some() && core.query_key("b2").is_some());
    assert_eq!(core.metrics.offload_declined_total.get(), 1);

    // Upstream's order (lru) writes every eviction to disk.
    let (lru, n) = core_of(EvictionPolicy::Lru, 8, |_| {}, vec![]);
    let a = put_chain(&lru, &["a0", "a1", "a2"]).await;
    push_out(&lru, 8).await;
    assert!(offloaded(&n).contains(&a[2]));
    assert_eq!(lru.metrics.offload_declined_total.get(), 0);
}

#[tokio::test]
async fn a_disk_object_is_promoted_on_the_request_that_reaches_the_threshold() {
    // The read window decides what one request is; each core fixes it so that no stall of a
    // busy machine between two calls can change the answer.
    let with_window = |window: Duration| {
        core_of(
            EvictionPolicy::Cslru,
            8,
            move |c| {
                c.promotion_on_hit = true;
                c.lease_ttl = Duration::from_secs(600);
                c.read_window = window;
            },
            vec![disk_item("d", 1)],
        )
    };
    let (core, _) = with_window(Duration::from_secs(300));
    assert_eq!(
        core.cfg.promotion_admission_threshold, 2,
        "upstream's default"
    );
    // One request as vLLM makes it: an existence check of its keys, then the get (a cached
    // client skips the get's lookup). Calls past a miss change nothing.
    core.lookup("", "d", Touch::Look).expect("exists");
    read(&core, "d");
    assert!(read(&core, "d").replicas[0].disk, "served from disk");
    read(&core, "d");
    assert_eq!(
        core.pending_promotions(),
        0,
        "the calls of one request count once"
    );

    // Every read its own request (no window): the second admits it.
    let (core, n) = with_window(Duration::ZERO);
    core.lookup("", "d", Touch::Look).expect("exists");
    read(&core, "d");
    assert_eq!(core.pending_promotions(), 0, "one request is not enough");
    read(&core, "d");
    assert_eq!(core.pending_promotions(), 1, "the second request is");
    assert_eq!(core.run_promotions().await, 1);
    assert_eq!(n.promotes.lock().len(), 1);
    let loc = read(&core, "d");
    assert!(!loc.replicas[0].disk && loc.replicas[1].disk);
    let tier = core.shard("d").lock().get("d").map(|o| o.tier);
    assert!(
        tier.is_some_and(|t| t.protected()),
        "admitted by its reads, it comes back protected"
    );

    let (first, _) = core_of(
        EvictionPolicy::Cslru,
        8,
        |c| {
            c.promotion_on_hit = true;
            c.promotion_admission_threshold = 1;
        },
        vec![disk_item("d", 1)],
    );
    read(&first, "d");
    assert_eq!(first.pending_promotions(), 1, "threshold 1: the first read");
}

#[tokio::test]
async fn an_admitted_promotion_into_a_full_pool_evicts_to_make_room() {
    let promote = |c: &mut CoreConfig| {
        c.promotion_on_hit = true;
        c.promotion_admission_threshold = 1;
    };
    let (core, n) = core_of(EvictionPolicy::Cslru, 4, promote, vec![disk_item("d", 1)]);
    for i in 0..4 {
        put_chain(&core, &[&format!("k{i}")]).await;
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(core.allocated_bytes(), 4 * BLOCK, "full");
    read(&core, "d");
    assert_eq!(core.pending_promotions(), 1, "admitted without room");
    assert_eq!(core.run_promotions().await, 1);
    assert!(!read(&core, "d").replicas[0].disk, "promoted");
    assert_eq!(
        offloaded(&n).len(),
        1,
        "the oldest block made room, to disk"
    );
    assert!(core.allocated_bytes() <= 4 * BLOCK);

    // Upstream's order promotes only into free room.
    let (lru, _) = core_of(EvictionPolicy::Lru, 4, promote, vec![disk_item("d", 1)]);
    for i in 0..4 {
        put_chain(&lru, &[&format!("k{i}")]).await;
    }
    read(&lru, "d");
    assert_eq!(lru.pending_promotions(), 0);
}

#[tokio::test]
async fn the_queue_limit_bounds_promotions_in_flight() {
    let (core, _) = core_of(
        EvictionPolicy::Cslru,
        8,
        |c| {
            c.promotion_on_hit = true;
            c.promotion_admission_threshold = 1;
            c.promotion_queue_limit = 1;
        },
        vec![disk_item("d1", 1), disk_item("d2", 2)],
    );
    read(&core, "d1");
    read(&core, "d2");
    assert_eq!(core.pending_promotions(), 1, "one in flight at most");
    assert_eq!(core.run_promotions().await, 1);
    read(&core, "d2");
    assert_eq!(core.pending_promotions(), 1, "room again once it is done");
    assert_eq!(core.run_promotions().await, 1);
}
