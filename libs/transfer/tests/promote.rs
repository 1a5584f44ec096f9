//! PROMOTE (wire op 13, the master's promotion on hit): the owner copies a disk object into a
//! reserved DRAM range and commits it under the same generation; missing or corrupt disk
//! objects answer STALE and commit nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use lunakv_transfer::{
    ColdItem, ColdTier, ColdTierError, SegmentServer, SegmentServerConfig, Target, TcpTransport,
    TransferEngine, TransferError, TransferOptions,
};
use parking_lot::Mutex;

/// A disk tier in memory; objects in `corrupt` fail their checksum (dropped, never served).
#[derive(Default)]
struct FakeTier {
    objects: Mutex<HashMap<u64, Vec<u8>>>,
    corrupt: Mutex<Vec<u64>>,
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
        if self.corrupt.lock().contains(&generation) {
            self.objects.lock().remove(&generation);
            return Ok(false);
        }
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
}

#[test]
fn promote_fills_the_range_and_commits_under_the_same_generation() {
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 1 << 20,
        shm_socket: None,
        advertise_host: None,
        ..Default::default()
    })
    .unwrap();
    let tier = Arc::new(FakeTier::default());
    let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    tier.objects.lock().insert(42, bytes.clone());
    tier.objects.lock().insert(43, bytes.clone());
    tier.corrupt.lock().push(43);
    assert!(server.set_cold_tier(tier.clone()));
    let t = Target::from(&server.info());
    let tcp = TcpTransport::new(1, Duration::from_secs(5));
    let engine = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    let mut out = vec![0u8; bytes.len()];
    // Not promoted yet: a READ of the range is STALE.
    assert!(matches!(
        engine.read(&t, 42, 8192, &mut [&mut out[..]]),
        Err(TransferError::Stale { .. })
    ));
    tcp.promote(&t.endpoint, 42, "k", 8192, 5000)
        .expect("promote");
    engine
        .read(&t, 42, 8192, &mut [&mut out[..]])
        .expect("read the DRAM entry");
    assert_eq!(out, bytes);
    assert!(server.inventory().iter().any(|e| e.generation == 42));
    assert!(tier.size_of(42).is_some(), "the disk copy stays");
    // Unknown, wrong-sized and corrupt disk objects: STALE, nothing committed.
    for (g, len) in [(99, 5000), (42, 4000), (43, 5000)] {
        assert!(
            matches!(
                tcp.promote(&t.endpoint, g, "k", 65536, len),
                Err(TransferError::Stale { .. })
            ),
            "generation {g} len {len}"
        );
    }
    assert!(!server.inventory().iter().any(|e| e.generation == 43));
    // Outside the segment: refused.
    assert!(matches!(
        tcp.promote(&t.endpoint, 42, "k", 1 << 20, 5000),
        Err(TransferError::OutOfBounds { .. })
    ));
}
