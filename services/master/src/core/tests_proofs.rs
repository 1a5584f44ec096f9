//! Verified inventories in the core (docs/SECURITY.md): write placements carry a placement
//! proof under the cluster's key, and a master that verifies indexes only inventory items whose
//! proof checks, so an owner cannot claim an object the master never placed with it.

use std::sync::Arc;
use std::time::Duration;

use lunakv_transfer::{InventoryKey, MountSecret, PlacementProof};

use super::tests::desc;
use super::*;
use crate::notifier::RecordingNotifier;

const SIZE: u64 = 4096;

fn core(key: InventoryKey, verify: bool) -> Arc<MasterCore> {
    let cfg = CoreConfig {
        cluster_id: "c".into(),
        lease_ttl: Duration::from_secs(60),
        inventory_key: Some(key),
        verify_inventories: verify,
        ..CoreConfig::default()
    };
    Arc::new(MasterCore::new(
        cfg,
        7,
        Arc::new(RecordingNotifier::default()),
    ))
}

fn secured(name: &str) -> SegmentDesc {
    SegmentDesc {
        data_secret: Some(MountSecret::generate()),
        ..desc(name, 1 << 20)
    }
}

fn item(key: &str, offset: u64, generation: u64, proof: Option<PlacementProof>) -> InventoryItem {
    InventoryItem {
        key: key.into(),
        offset,
        size: SIZE,
        generation,
        disk: false,
        proof,
    }
}

/// Puts `key` on the one mounted segment; returns (generation, offset, the placement's proof).
async fn put(core: &MasterCore, key: &str) -> (u64, u64, Option<PlacementProof>) {
    let (generation, views) = core
        .put_start("writer", key, SIZE, &PutOptions::default())
        .await
        .expect("put_start");
    core.put_end(key).expect("put_end");
    let v = &views[0];
    (
        generation,
        v.offset,
        v.capability.as_ref().and_then(|c| c.proof()),
    )
}

#[tokio::test]
async fn a_write_placement_carries_a_proof_of_exactly_that_put() {
    let key = InventoryKey::generate();
    let c = core(key, true);
    c.mount("owner", "c", secured("s:1"), vec![]).unwrap();
    let (generation, _, proof) = put(&c, "model/0/a").await;
    let proof = proof.expect("a secured segment's placement carries a proof");
    assert!(proof.verify(&key, "model/0/a", generation, SIZE));
    assert!(!proof.verify(&key, "model/0/b", generation, SIZE));
    // Reads get no proof: only a writer hands one to the owner.
    let loc = c.get_replica_list("model/0/a").unwrap();
    assert_eq!(loc.replicas[0].capability.and_then(|c| c.proof()), None);
    // An owner without capabilities gets no capability, so no proof either.
    let open = core(key, false);
    open.mount("owner", "c", desc("o:1", 1 << 20), vec![])
        .unwrap();
    assert_eq!(put(&open, "k").await.2, None);
}

#[tokio::test]
async fn a_remount_keeps_proven_entries_and_rejects_forged_ones() {
    let key = InventoryKey::generate();
    let before = core(key, true);
    before
        .mount("victim", "c", secured("victim:1"), vec![])
        .unwrap();
    let (g1, o1, p1) = put(&before, "model/0/victim").await;
    let (g2, o2, p2) = put(&before, "model/0/other").await;

    // A master restart: the same cluster key, an empty index, owners remount.
    let after = core(key, true);
    let out = after
        .mount(
            "victim",
            "c",
            secured("victim:1"),
            vec![
                item("model/0/victim", o1, g1, p1),
                item("model/0/other", o2, g2, p2),
            ],
        )
        .unwrap();
    assert_eq!(
        (out.accepted, out.rejected_generations.len()),
        (2, 0),
        "genuine entries keep their place"
    );

    // An attacker with the pool token mounts a segment of its own and claims the victim's key
    // at a higher generation: without a proof, with a proof of another put, with garbage.
    let forged_gen = g1 + 1000;
    let stolen = p2.map(|p| *p.as_bytes());
    let attempts = [
        None,
        stolen.and_then(|b| PlacementProof::from_slice(&b)),
        PlacementProof::from_slice(&[0xAB; 16]),
        Some(PlacementProof::issue(
            &InventoryKey::generate(),
            "model/0/victim",
            forged_gen,
            SIZE,
        )),
    ];
    let n = attempts.len();
    let forged: Vec<InventoryItem> = attempts
        .into_iter()
        .enumerate()
        .map(|(i, p)| item("model/0/victim", i as u64 * SIZE, forged_gen + i as u64, p))
        .collect();
    let out = after
        .mount("attacker", "c", secured("attacker:1"), forged)
        .unwrap();
    assert_eq!(out.accepted, 0);
    assert_eq!(out.rejected_generations.len(), n);
    assert_eq!(after.metrics.inventory_unproven_total.get(), n as u64);
    let loc = after.get_replica_list("model/0/victim").unwrap();
    assert_eq!(
        (loc.generation, loc.replicas[0].segment.name.as_str()),
        (g1, "victim:1"),
        "the victim's key still points at the victim's bytes"
    );
}

#[tokio::test]
async fn without_verification_an_unproven_inventory_is_indexed() {
    // No pool token on the master: loopback's default, and what happens without one.
    let c = core(InventoryKey::generate(), false);
    let out = c
        .mount(
            "owner",
            "c",
            desc("s:1", 1 << 20),
            vec![item("k", 0, 9 << 32, None)],
        )
        .unwrap();
    assert_eq!(out.accepted, 1);
}
