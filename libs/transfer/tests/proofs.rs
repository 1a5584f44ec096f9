//! Placement proofs at the owner (docs/SECURITY.md, "Verified inventories"): the proof the
//! master attaches to a write capability is kept with the entry, whichever way the bytes came
//! (tcp WRITE, shm COMMIT, the in-process path), follows it to the disk tier and back (OFFLOAD,
//! PROMOTE), and comes back in the inventory the owner mounts with. Real sockets and memfds; the
//! disk tier is an in-memory double of lunakv-offload.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use lunakv_transfer::cap::{RIGHT_READ, RIGHT_WRITE, WRITE_TTL};
use lunakv_transfer::{
    Capability, ColdItem, ColdTier, ColdTierError, Grant, InventoryKey, MountSecret,
    PlacementProof, SegmentServer, SegmentServerConfig, Target, TcpTransport, TransferEngine,
    TransferOptions,
};
use parking_lot::Mutex;

const LEN: u64 = 4096;

/// What the tier holds of one object: its bytes and its proof.
type Held = (Vec<u8>, Option<PlacementProof>);

/// A disk tier in memory that keeps what lunakv-offload keeps: bytes and proof per generation.
#[derive(Default)]
struct Tier {
    objects: Mutex<HashMap<u64, Held>>,
}

impl ColdTier for Tier {
    fn store(&self, items: &[ColdItem<'_>]) -> Result<Vec<u64>, ColdTierError> {
        let mut o = self.objects.lock();
        Ok(items
            .iter()
            .map(|i| {
                o.insert(i.generation, (i.bytes.to_vec(), i.proof));
                i.generation
            })
            .collect())
    }
    fn size_of(&self, generation: u64) -> Option<u64> {
        self.objects
            .lock()
            .get(&generation)
            .map(|v| v.0.len() as u64)
    }
    fn proof_of(&self, generation: u64) -> Option<PlacementProof> {
        self.objects.lock().get(&generation).and_then(|v| v.1)
    }
    fn load(&self, generation: u64, dst: &mut [u8]) -> Result<bool, ColdTierError> {
        match self.objects.lock().get(&generation) {
            Some((v, _)) if v.len() == dst.len() => {
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

struct Owner {
    server: SegmentServer,
    secret: MountSecret,
    _dir: tempfile::TempDir,
}

fn owner() -> Owner {
    let dir = tempfile::tempdir().unwrap();
    let server = SegmentServer::start(SegmentServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        size: 4 << 20,
        shm_socket: Some(dir.path().join("seg.sock")),
        ..Default::default()
    })
    .unwrap();
    let secret = MountSecret::generate();
    assert!(server.require_capabilities(secret));
    Owner {
        server,
        secret,
        _dir: dir,
    }
}

/// What the master hands a writer for (key, generation) at `offset`: a write capability with
/// the placement proof after it.
fn placement(o: &Owner, ik: &InventoryKey, key: &str, generation: u64, offset: u64) -> Target {
    let name = o.server.info().name;
    let g = Grant {
        segment: &name,
        generation,
        offset,
        len: LEN,
    };
    let cap = Capability::issue(&o.secret, &g, RIGHT_READ | RIGHT_WRITE, WRITE_TTL)
        .with_proof(PlacementProof::issue(ik, key, generation, LEN));
    // Through the proto's bytes, as a client gets it.
    let cap = Capability::from_slice(cap.as_bytes()).expect("a proven capability parses");
    Target {
        capability: Some(cap),
        ..Target::from(&o.server.info())
    }
}

fn proof_in_inventory(o: &Owner, generation: u64) -> Option<PlacementProof> {
    o.server
        .inventory()
        .into_iter()
        .find(|e| e.generation == generation)
        .expect("the entry is in the inventory")
        .proof
}

#[test]
fn every_write_path_keeps_the_proof_and_the_inventory_returns_it() {
    let o = owner();
    let ik = InventoryKey::generate();
    let bytes = vec![5u8; LEN as usize];
    let paths: [(&str, TransferEngine); 3] = [
        (
            "tcp",
            TransferEngine::new(TransferOptions {
                enable_shm: false,
                ..TransferOptions::default()
            }),
        ),
        ("shm", TransferEngine::new(TransferOptions::default())),
        ("in-process", {
            let e = TransferEngine::new(TransferOptions::default());
            e.attach_local(&o.server);
            e
        }),
    ];
    for (i, (path, e)) in paths.iter().enumerate() {
        let generation = 7 << 32 | (i as u64 + 1);
        let key = format!("model/0/{path}");
        let offset = i as u64 * LEN;
        e.write(
            &placement(&o, &ik, &key, generation, offset),
            generation,
            &key,
            offset,
            &[&bytes],
        )
        .unwrap_or_else(|err| panic!("{path}: {err}"));
        let p = proof_in_inventory(&o, generation)
            .unwrap_or_else(|| panic!("{path}: the entry lost its proof"));
        assert!(p.verify(&ik, &key, generation, LEN), "{path}");
    }
    // Else the "shm" write went over tcp and COMMIT was never exercised.
    assert!(
        o.server.stats().shm_attaches >= 1,
        "the shm engine never attached"
    );
}

#[test]
fn the_proof_follows_the_entry_to_disk_and_back() {
    let o = owner();
    let ik = InventoryKey::generate();
    let tier = Arc::new(Tier::default());
    assert!(o.server.set_cold_tier(tier.clone()));
    let e = TransferEngine::new(TransferOptions {
        enable_shm: false,
        ..TransferOptions::default()
    });
    let (generation, key) = (9 << 32 | 1, "model/0/cold");
    e.write(
        &placement(&o, &ik, key, generation, 0),
        generation,
        key,
        0,
        &[&vec![3u8; LEN as usize]],
    )
    .unwrap();
    let master = TcpTransport::new(1, Duration::from_secs(5));
    let endpoint = o.server.info().transfer_endpoint;
    master.set_owner_key(&endpoint, Some(o.secret));
    let failed = master
        .offload(&endpoint, &[(generation, 0)], Duration::from_secs(1))
        .unwrap();
    assert!(failed.is_empty(), "offload failed for {failed:?}");
    assert!(
        o.server.inventory().is_empty(),
        "the DRAM entry went to disk"
    );
    let on_disk = tier
        .proof_of(generation)
        .expect("the disk tier got the proof");
    assert!(on_disk.verify(&ik, key, generation, LEN));
    master
        .promote(&endpoint, generation, key, 8 * LEN, LEN)
        .unwrap();
    assert_eq!(proof_in_inventory(&o, generation), Some(on_disk));
}

#[test]
fn a_write_without_a_proof_has_none() {
    let o = owner();
    let name = o.server.info().name;
    let generation = 11 << 32 | 1;
    let g = Grant {
        segment: &name,
        generation,
        offset: 0,
        len: LEN,
    };
    let t = Target {
        capability: Some(Capability::issue(
            &o.secret,
            &g,
            RIGHT_READ | RIGHT_WRITE,
            WRITE_TTL,
        )),
        ..Target::from(&o.server.info())
    };
    TransferEngine::new(TransferOptions::default())
        .write(&t, generation, "k", 0, &[&vec![1u8; LEN as usize]])
        .unwrap();
    assert_eq!(proof_in_inventory(&o, generation), None);
}
