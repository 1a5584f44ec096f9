//! The cslru eviction order ([`super::policy`]): probation before protection, the ghost table,
//! chains losing their tails first, lookups past a miss changing nothing, the protected share
//! and how it adapts, and leases as a preference under pressure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::notifier::RecordingNotifier;

const BLOCK: u64 = 64;

fn core() -> Arc<MasterCore> {
    core_with(Duration::from_millis(1), 10)
}

/// A cslru core whose leases last `lease_ttl`, over one segment of `blocks` blocks.
fn core_with(lease_ttl: Duration, blocks: u64) -> Arc<MasterCore> {
    core_of(EvictionPolicy::Cslru, lease_ttl, blocks)
}

/// A core evicting in `policy`'s order, with no reservation or eviction bound in the way.
fn core_of(policy: EvictionPolicy, lease_ttl: Duration, blocks: u64) -> Arc<MasterCore> {
    let cfg = CoreConfig {
        cluster_id: "c".into(),
        lease_ttl,
        eviction_policy: policy,
        put_reservation_limit_ratio: 1.0,
        put_reservation_total_ratio: 1.0,
        put_eviction_limit_ratio: 1.0,
        ..CoreConfig::default()
    };
    let core = Arc::new(MasterCore::new(
        cfg,
        7,
        Arc::new(RecordingNotifier::default()),
    ));
    core.mount("cl", "c", desc(BLOCK * blocks), vec![])
        .expect("mount");
    core
}

fn desc(size: u64) -> SegmentDesc {
    super::tests::desc("a:1", size)
}

fn opts() -> PutOptions {
    PutOptions {
        replica_num: 1,
        ..Default::default()
    }
}

/// Puts `keys` as one batch (one chain, prefix order), as vLLM saves a request's blocks.
async fn put_chain(core: &MasterCore, keys: &[&str]) {
    for k in keys {
        core.put_start("cl", k, BLOCK, &opts())
            .await
            .expect("put_start");
    }
    let now = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        core.put_end_at(
            &Caller::default(),
            k,
            chain_stamp(now, i),
            if keys.len() > 1 {
                ChainEnd::of(i, keys.len())
            } else {
                ChainEnd::No
            },
        )
        .expect("put_end");
    }
}

/// Puts one block per call, each newer than the last.
async fn put_each(core: &MasterCore, keys: &[&str]) {
    for k in keys {
        put_chain(core, &[k]).await;
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn present(core: &MasterCore, keys: &[&str]) -> Vec<bool> {
    keys.iter().map(|k| core.query_key(k).is_some()).collect()
}

fn protected(core: &MasterCore, key: &str) -> bool {
    core.shard(key)
        .lock()
        .get(key)
        .is_some_and(|o| o.tier.protected())
}

#[tokio::test]
async fn a_block_read_on_probation_outlives_newer_unread_ones() {
    let core = core();
    let keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9"];
    put_each(&core, &keys).await;
    core.lookup("", "k0", Touch::Read(Instant::now()))
        .expect("read k0");
    assert!(protected(&core, "k0"));
    std::thread::sleep(Duration::from_millis(2));
    put_each(&core, &["n0", "n1"]).await;
    assert_eq!(
        present(&core, &["k0", "k1", "k2", "k3"]),
        [true, false, false, true],
        "probation's oldest go; the block that was read stays"
    );
}

#[tokio::test]
async fn a_block_put_again_soon_after_its_eviction_comes_back_protected() {
    let core = core();
    let keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9"];
    put_each(&core, &keys).await;
    put_each(&core, &["n0"]).await;
    assert_eq!(present(&core, &["k0"]), [false]);
    put_each(&core, &["k0"]).await;
    assert!(protected(&core, "k0"), "the ghost table remembered k0");
    put_each(&core, &["n1", "n2", "n3"]).await;
    assert!(
        present(&core, &["k0"])[0],
        "protected: newer unread blocks go first"
    );
}

#[tokio::test]
async fn a_chain_loses_its_tail_before_its_head() {
    let core = core();
    put_each(&core, &["a0", "a1", "a2", "a3", "a4"]).await;
    put_chain(&core, &["c0", "c1", "c2", "c3", "c4"]).await;
    // The chain's end first (cold), then the older single blocks, then the chain's deepest.
    put_each(&core, &["n0"]).await;
    assert_eq!(
        present(&core, &["c4", "a0"]),
        [false, true],
        "the chain's end goes first"
    );
    put_each(&core, &["n1", "n2", "n3", "n4", "n5", "n6", "n7"]).await;
    assert_eq!(
        present(&core, &["c0", "c1", "c2", "c3"]),
        [true, true, false, false],
        "then the deepest of the chain, never a head before its tail"
    );
}

#[tokio::test]
async fn a_lookup_past_the_first_miss_changes_nothing() {
    let core = core();
    put_each(&core, &["k0"]).await;
    let before = core.shard("k0").lock().get("k0").map(|o| o.last_access);
    core.lookup("", "k0", Touch::Look).expect("found");
    let o = core.query_key("k0").expect("k0");
    assert_eq!(o.lease_remaining_ms, 0, "no lease");
    assert!(!protected(&core, "k0"));
    assert_eq!(
        core.shard("k0").lock().get("k0").map(|o| o.last_access),
        before
    );
}

#[tokio::test]
async fn the_protected_segment_is_trimmed_to_its_share() {
    let core = core();
    let keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9"];
    put_each(&core, &keys).await;
    for k in keys {
        core.lookup("", k, Touch::Read(Instant::now()))
            .expect("read");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(keys.iter().all(|k| protected(&core, k)));
    put_each(&core, &["n0"]).await;
    let share = core.recent.lock().share.get();
    let held = keys.iter().filter(|k| protected(&core, k)).count();
    assert!(
        held as f64 <= share * 10.0,
        "at most the share ({share}) stays protected: {held}"
    );
    assert_eq!(
        present(&core, &["k0", "k9"]),
        [false, true],
        "the oldest protected block was demoted and then evicted"
    );
}

/// Puts `n` single blocks named `{prefix}{i}`, each newer than the last.
async fn put_fresh(core: &MasterCore, prefix: &str, n: usize) {
    for i in 0..n {
        put_each(core, &[&format!("{prefix}{i}")]).await;
    }
}

#[tokio::test]
async fn blocks_that_come_back_move_the_share_towards_the_segment_that_lost_them() {
    let core = core();
    let share = || core.recent.lock().share.get();
    // Once-used blocks evicted from probation and put again: probation was too small.
    put_fresh(&core, "a", 12).await;
    let start = share();
    put_fresh(&core, "a", 2).await;
    assert!(share() < start, "probation grows: {start} -> {}", share());
    // A block that had been read (protected, then demoted and evicted) and comes back: the
    // protected segment was too small.
    let core = core_with(Duration::from_millis(1), 10);
    let share = || core.recent.lock().share.get();
    put_fresh(&core, "p", 10).await;
    for i in 0..10 {
        core.lookup("", &format!("p{i}"), Touch::Read(Instant::now()))
            .expect("read");
        std::thread::sleep(Duration::from_millis(1));
    }
    put_fresh(&core, "n", 10).await;
    assert_eq!(present(&core, &["p0"]), [false], "p0 was evicted");
    let before = share();
    put_each(&core, &["p0"]).await;
    assert!(protected(&core, "p0"));
    assert!(
        share() > before,
        "the protected segment grows: {before} -> {}",
        share()
    );
}

#[tokio::test]
async fn a_leased_block_goes_only_when_nothing_else_is_left() {
    let core = core_with(Duration::from_secs(60), 4);
    put_each(&core, &["k0", "k1", "k2", "k3"]).await;
    core.lookup("", "k0", Touch::Read(Instant::now()))
        .expect("lease k0");
    put_each(&core, &["n0"]).await;
    assert_eq!(
        present(&core, &["k0", "k1"]),
        [true, false],
        "the unleased one went"
    );
    for k in ["k2", "k3", "n0"] {
        core.lookup("", k, Touch::Read(Instant::now()))
            .expect("lease");
    }
    put_each(&core, &["n1"]).await;
    assert_eq!(
        present(&core, &["n1"]),
        [true],
        "with every block leased, a put still lands (a lease does not freeze the pool)"
    );
    assert!(core.metrics.eviction_lease_skipped_total.get() > 0);
}

#[tokio::test]
async fn a_lease_holds_eviction_off_only_while_its_reader_copies() {
    let core = core_with(Duration::from_secs(30), 4);
    put_each(&core, &["k0"]).await;
    // Judged at chosen instants, not after sleeps: the lease runs from the lookup's clock.
    let read_at = Instant::now();
    core.lookup("", "k0", Touch::Read(read_at))
        .expect("read k0");
    let reading = |at: Instant| {
        let shard = core.shard("k0").lock();
        let o = shard.get("k0").expect("k0");
        (core.reading(o, at), o.leased(at))
    };
    assert_eq!(
        reading(read_at),
        (true, true),
        "just read: eviction passes it over"
    );
    assert_eq!(
        reading(read_at + Duration::from_secs(10)),
        (false, true),
        "past the read window eviction may take it; the lease still refuses a remove"
    );
    assert!(core.remove("k0", false).await.is_err());
}

/// The conversation trace replayed straight into the core (no network, no store), as the
/// replay tool's calls reach it: prints each policy's hit rate at 3M tokens (REPLAY_CAP
/// blocks, REPLAY_N requests). `cargo test -p lunakv-master --release --lib core_replay --
/// --ignored --nocapture`; `lunakv bench --trace` is the end-to-end figure.
#[tokio::test]
#[ignore = "a benchmark"]
async fn core_replay() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/mooncake-traces/conversation_trace.jsonl"
    );
    let Ok(text) = std::fs::read_to_string(path) else {
        eprintln!("no trace at {path}");
        return;
    };
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse().ok());
    let n: usize = env("REPLAY_N").unwrap_or(usize::MAX);
    let cap: u64 = env("REPLAY_CAP").map_or(5859, |c: usize| c as u64);
    let trace: Vec<(u64, Vec<u64>)> = text
        .lines()
        .take(n)
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let ids = v["hash_ids"]
                .as_array()?
                .iter()
                .filter_map(|x| x.as_u64())
                .collect();
            Some((v["input_length"].as_u64()?, ids))
        })
        .collect();
    for policy in [EvictionPolicy::Cslru, EvictionPolicy::Lru] {
        let core = core_of(policy, Duration::from_millis(1), cap);
        let (mut hit, mut input) = (0u64, 0u64);
        let started = Instant::now();
        for (len, ids) in &trace {
            input += len;
            let keys: Vec<String> = ids.iter().map(|i| format!("b{i}")).collect();
            let now = Instant::now();
            let mut run = 0;
            let mut present = Vec::new();
            for (i, k) in keys.iter().enumerate() {
                let touch = if run == i {
                    Touch::Read(chain_stamp(now, i))
                } else {
                    Touch::Look
                };
                let ok = core.lookup("", k, touch).is_ok();
                if ok && run == i {
                    run += 1;
                }
                present.push(ok);
            }
            hit += (run as u64 * 512).min(*len);
            let missing: Vec<&String> = keys
                .iter()
                .enumerate()
                .filter(|(i, _)| *i >= run && !present[*i])
                .map(|(_, k)| k)
                .collect();
            for k in &missing {
                let _ = core.put_start("cl", k, BLOCK, &opts()).await;
            }
            let now = Instant::now();
            for (i, k) in missing.iter().enumerate() {
                let end = ChainEnd::of(i, missing.len());
                let _ = core.put_end_at(&Caller::default(), k, chain_stamp(now, i), end);
            }
        }
        println!(
            "core replay {policy:?}: hit rate {:.4} ({} requests, {cap} blocks, {:?})",
            hit as f64 / input as f64,
            trace.len(),
            started.elapsed()
        );
    }
}

/// Master CPU per evicted key with 1M keys resident: puts into a full pool (each evicting one
/// key) against the same puts into a pool with room, interleaved in rounds, on one thread.
/// Prints the difference per key. `cargo test -p lunakv-master --release --lib eviction_cost
/// -- --ignored --nocapture` (EVICT_KEYS to change the resident count).
#[tokio::test(flavor = "current_thread")]
#[ignore = "a benchmark"]
async fn eviction_cost() {
    let keys: u64 = std::env::var("EVICT_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let batch = 20_000u64;
    let rounds = 5;
    for policy in [EvictionPolicy::Cslru, EvictionPolicy::Lru] {
        let full = core_of(policy, Duration::from_millis(1), keys);
        let roomy = core_of(policy, Duration::from_millis(1), keys + batch * rounds);
        let fill = |core: Arc<MasterCore>| async move {
            let now = Instant::now();
            for i in 0..keys {
                let k = format!("r{i}");
                core.put_start("cl", &k, BLOCK, &opts())
                    .await
                    .expect("fill");
                core.put_end_at(&Caller::default(), &k, now, ChainEnd::No)
                    .expect("fill end");
            }
        };
        fill(full.clone()).await;
        fill(roomy.clone()).await;
        let mut t = [Duration::ZERO; 2];
        for round in 0..rounds {
            for (i, core) in [&full, &roomy].into_iter().enumerate() {
                let started = Instant::now();
                for j in 0..batch {
                    let k = format!("n{round}-{j}");
                    core.put_start("cl", &k, BLOCK, &opts()).await.expect("put");
                    core.put_end_at(&Caller::default(), &k, Instant::now(), ChainEnd::No)
                        .expect("put end");
                }
                t[i] += started.elapsed();
            }
        }
        let n = (batch * rounds) as f64;
        let evicted = full.metrics.evicted_keys_total.get();
        println!(
            "eviction cost ({policy:?}) at {keys} keys: {:.2} us per put with eviction, {:.2} us \
         without, {:.2} us per evicted key ({evicted} evicted)",
            t[0].as_secs_f64() * 1e6 / n,
            t[1].as_secs_f64() * 1e6 / n,
            (t[0].saturating_sub(t[1])).as_secs_f64() * 1e6 / evicted.max(1) as f64,
        );
        assert!(evicted >= batch * rounds, "every put evicted: {evicted}");
    }
}
