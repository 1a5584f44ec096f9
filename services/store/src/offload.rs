//! The store-client's SSD tier: a [`lunakv_offload::DiskTier`] plugged into the segment server
//! (OFFLOAD/LOAD/FREE of disk copies) and into the host (mount inventory, dropped objects).

use std::sync::Arc;

use lunakv_offload::{DiskObject, DiskTier, LoadError, StoreItem};
use lunakv_segment::DiskInventory;
use lunakv_transfer::{
    ColdDropped, ColdItem, ColdStored, ColdTier, ColdTierError, Entry, PlacementProof,
};

/// Env var choosing the disk eviction policy at the size limit: `clock` (default), `fifo`
/// (upstream's) or `lru` ([`lunakv_offload::EvictionPolicy`]).
pub const EVICTION_POLICY_ENV: &str = "LUNAKV_OFFLOAD_EVICTION_POLICY";

/// Adapts a [`DiskTier`] to the transfer and host traits.
pub(crate) struct Tier(pub(crate) Arc<DiskTier>);

fn store_items<'a>(items: &[ColdItem<'a>]) -> Vec<StoreItem<'a>> {
    items
        .iter()
        .map(|i| StoreItem {
            key: i.key,
            generation: i.generation,
            bytes: i.bytes,
            proof: i.proof.map(|p| *p.as_bytes()),
        })
        .collect()
}

impl ColdTier for Tier {
    fn store(&self, items: &[ColdItem<'_>]) -> Result<Vec<u64>, ColdTierError> {
        self.0
            .store_batch(&store_items(items))
            .map_err(ColdTierError::new)
    }

    fn store_reporting(&self, items: &[ColdItem<'_>]) -> Result<ColdStored, ColdTierError> {
        let s = self
            .0
            .store_batch_reporting(&store_items(items))
            .map_err(ColdTierError::new)?;
        Ok(ColdStored {
            stored: s.stored,
            dropped: s
                .dropped
                .into_iter()
                .map(|o| ColdDropped {
                    key: o.key,
                    generation: o.generation,
                    size: o.size,
                })
                .collect(),
        })
    }

    fn report_later(&self, dropped: Vec<ColdDropped>) {
        // The proof only matters for objects still held; a dropped one is reported by key,
        // generation and size.
        self.0.requeue_dropped(
            dropped
                .into_iter()
                .map(|d| DiskObject {
                    key: d.key,
                    generation: d.generation,
                    size: d.size,
                    proof: None,
                })
                .collect(),
        );
    }

    fn size_of(&self, generation: u64) -> Option<u64> {
        self.0.size_of(generation)
    }

    fn proof_of(&self, generation: u64) -> Option<PlacementProof> {
        PlacementProof::from_slice(&self.0.proof_of(generation)?)
    }

    fn load(&self, generation: u64, dst: &mut [u8]) -> Result<bool, ColdTierError> {
        match self.0.load(generation, dst) {
            Ok(()) => Ok(true),
            // Corrupt objects are dropped (and logged, counted, reported) by the tier.
            Err(LoadError::NotFound(_) | LoadError::Corrupt { .. }) => Ok(false),
            Err(e) => Err(ColdTierError::new(e)),
        }
    }

    fn remove(&self, generations: &[u64]) {
        if let Err(e) = self.0.remove(generations) {
            tracing::warn!(error = %e, "removing objects from the disk tier failed");
        }
    }

    fn prepare_drain(&self) -> u64 {
        // The drain's objects then sit in buckets newer than every older object, so the size
        // limit (oldest bucket first) drops all of those before any drained one; up to the
        // limit, the drain never drops what it wrote itself.
        self.0.seal();
        self.0.config().limit_bytes
    }
}

impl DiskInventory for Tier {
    fn capacity(&self) -> u64 {
        self.0.config().limit_bytes
    }

    fn objects(&self) -> Vec<Entry> {
        self.0
            .inventory()
            .into_iter()
            .map(|o| Entry {
                key: o.key,
                offset: 0,
                size: o.size,
                generation: o.generation,
                proof: o.proof.and_then(|p| PlacementProof::from_slice(&p)),
            })
            .collect()
    }

    fn take_dropped(&self) -> Vec<(String, u64, u64)> {
        self.0
            .take_dropped()
            .into_iter()
            .map(|o| (o.key, o.generation, o.size))
            .collect()
    }
}
