//! The shutdown drain (`SegmentServer::begin_drain`): DRAM-only entries go to the disk tier
//! newest first, within the room and the time it is given; objects the master frees during the
//! drain lose their drained copy again, objects it offloads keep theirs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lunakv_transfer::{
    ColdItem, ColdTier, ColdTierError, DrainProgress, SegmentServer, SegmentServerConfig, Target,
    TcpTransport, TransferEngine, TransferOptions,
};
use parking_lot::Mutex;

/// A disk tier in memory that takes at most `room` bytes in a drain.
struct FakeTier {
    objects: Mutex<HashMap<u64, Vec<u8>>>,
    room: u64,
}

impl FakeTier {
    fn new(room: u64) -> Arc<FakeTier> {
        Arc::new(FakeTier {
            objects: Mutex::default(),
            room,
        })
    }

    fn held(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.objects.lock().keys().copied().collect();
        v.sort_unstable();
        v
    }
}

impl ColdTier for FakeTier {
    fn store(&self, items: &[ColdItem<'_>]) -> Result<Vec<u64>, ColdTierError> {
        let mut o = self.objects.lock();
        Ok(items
            .iter()
            .map(|i| {
                o.insert(i.generation, i.bytes.to_vec());
                i.generation
            })
            .collect())
    }
    fn size_of(&self, generation: u64) -> Option<u64> {
        self.objects.lock().get(&generation).map(|v| v.len() as u64)
    }
    fn proof_of(&self, _generation: u64) -> Option<lunakv_transfer::PlacementProof> {
        None
    }
    fn load(&self, generation: u64, dst: &mut [u8]) -> Result<bool, ColdTierError> {
        match self.objects.lock().get(&generation) {
            Some(v) if v.len() == dst.len() => {
                dst.copy_from_slice(v);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn remove(&self, generations: &[u64]) {
        let mut o = self.objects.lock();
        for g in generations {
            o.remove(g);
        }
    }
    fn prepare_drain(&self) -> u64 {
        self.room
    }
}

const LEN: usize = 1000;

fn bytes(g: u64) -> Vec<u8> {
    (0..LEN).map(|i| (g as usize * 13 + i) as u8).collect()
}

/// A segment with `n` entries, generations 101.. committed in that order at offsets 4096*i.
fn segment(tier: Arc<FakeTier>, n: u64) -> (SegmentServer, Target) {
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 1 << 20,
        shm_socket: None,
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    assert!(server.set_cold_tier(tier));
    let t = Target::from(&server.info());
    let engine = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    for i in 0..n {
        let g = 101 + i;
        engine
            .write(&t, g, &format!("k{g}"), 4096 * i, &[&bytes(g)])
            .unwrap();
    }
    (server, t)
}

fn later() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

#[test]
fn drains_newest_first_within_the_room_and_counts_the_rest_as_dropped() {
    let tier = FakeTier::new(3 * LEN as u64 + 500);
    let (server, _) = segment(tier.clone(), 6);
    let progress = Arc::new(DrainProgress::default());
    let mut d = server
        .begin_drain(progress.clone())
        .expect("a cold tier is plugged in");
    d.run(later(), 3);
    assert_eq!(progress.drained(), 3);
    let r = d.finish();
    assert_eq!(tier.held(), vec![104, 105, 106], "the three newest");
    assert_eq!((r.drained, r.dropped, r.no_room), (3, 3, 3));
    assert_eq!(r.drained_bytes, 3 * LEN as u64);
    assert!(!r.budget_spent && !r.write_failed);
    assert_eq!(progress.dropped(), 3);
    let mut buf = vec![0u8; LEN];
    assert!(tier.load(106, &mut buf).unwrap());
    assert_eq!(buf, bytes(106));
}

#[test]
fn a_spent_budget_drains_nothing_and_drops_everything() {
    let tier = FakeTier::new(u64::MAX);
    let (server, _) = segment(tier.clone(), 4);
    let mut d = server
        .begin_drain(Arc::new(DrainProgress::default()))
        .unwrap();
    d.run(Instant::now(), 3);
    let r = d.finish();
    assert!(tier.held().is_empty());
    assert_eq!((r.drained, r.dropped), (0, 4));
    assert!(r.budget_spent);
}

#[test]
fn objects_the_master_frees_during_the_drain_lose_their_copy_offloaded_ones_keep_it() {
    let tier = FakeTier::new(u64::MAX);
    let (server, t) = segment(tier.clone(), 5);
    // 101 was offloaded by the master before the drain (and promoted back): already on disk.
    tier.objects.lock().insert(101, bytes(101));
    let mut d = server
        .begin_drain(Arc::new(DrainProgress::default()))
        .unwrap();
    d.run(later(), 3);
    assert_eq!(tier.held(), vec![101, 102, 103, 104, 105]);
    let tcp = TcpTransport::new(1, Duration::from_secs(5));
    // The master removes 102 (FREE of its DRAM range) and evicts 103 to disk (OFFLOAD), both
    // unaware of the drained copies.
    tcp.free(&t.endpoint, &[(102, 4096)], Duration::from_secs(1))
        .unwrap();
    let failed = tcp
        .offload(&t.endpoint, &[(103, 2 * 4096)], Duration::from_secs(1))
        .unwrap();
    assert!(failed.is_empty());
    // A put during the drain: the next pass takes it.
    let engine = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    engine
        .write(&t, 200, "k200", 8 * 4096, &[&bytes(200)])
        .unwrap();
    d.run(later(), 1);
    server.shutdown();
    let r = d.finish();
    assert_eq!(
        tier.held(),
        vec![101, 103, 104, 105, 200],
        "the removed object must not come back after a restart"
    );
    assert_eq!(r.freed_meanwhile, 1);
    assert_eq!(r.already_on_disk, 1);
    assert_eq!((r.drained, r.dropped), (4, 0));
}
