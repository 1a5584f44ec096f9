//! PROMOTE (wire op 13, the master's promotion on hit): the owner copies a disk object into a
//! reserved DRAM range and commits it under the same generation; missing or corrupt disk
//! objects answer STALE and commit nothing.

use std::time::Duration;

use lunakv_transfer::{
    ColdTier, SegmentServer, SegmentServerConfig, Target, TcpTransport, TransferEngine,
    TransferError, TransferOptions,
};

mod support;
use support::MemTier;

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
    let tier = MemTier::new();
    let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    tier.insert(42, bytes.clone());
    tier.insert(43, bytes.clone());
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
