//! What the transfer tests share: a disk tier in memory, standing in for lunakv-offload (the
//! store-client's tier, which this crate does not depend on). It keeps what lunakv-offload
//! keeps per generation (the bytes and the placement proof), bounds a shutdown drain to `room`
//! bytes, and drops the generations in `corrupt` at their first load, as a failed checksum does.

// Each test binary compiles this module and uses a part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use lunakv_transfer::{ColdItem, ColdTier, ColdTierError, PlacementProof};
use parking_lot::Mutex;

/// What the tier holds of one object: its bytes and its proof.
type Held = (Vec<u8>, Option<PlacementProof>);

#[derive(Default)]
pub struct MemTier {
    objects: Mutex<HashMap<u64, Held>>,
    /// Generations whose next load fails its checksum (dropped, never served).
    pub corrupt: Mutex<Vec<u64>>,
    /// Bytes a shutdown drain may write; `None` is no bound.
    room: Option<u64>,
}

impl MemTier {
    pub fn new() -> Arc<MemTier> {
        Arc::default()
    }

    /// A tier that takes at most `room` bytes in a drain.
    pub fn with_room(room: u64) -> Arc<MemTier> {
        Arc::new(MemTier {
            room: Some(room),
            ..MemTier::default()
        })
    }

    /// Puts an object on "disk" directly, as if an earlier run had stored it.
    pub fn insert(&self, generation: u64, bytes: Vec<u8>) {
        self.objects.lock().insert(generation, (bytes, None));
    }

    /// The generations held, in order.
    pub fn held(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.objects.lock().keys().copied().collect();
        v.sort_unstable();
        v
    }
}

impl ColdTier for MemTier {
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
        if self.corrupt.lock().contains(&generation) {
            self.objects.lock().remove(&generation);
            return Ok(false);
        }
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
    fn prepare_drain(&self) -> u64 {
        self.room.unwrap_or(u64::MAX)
    }
}
