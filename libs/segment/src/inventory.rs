//! What an owner reports at mount: its objects as inventory items, in parts small enough for
//! the master's message limit, and the disk tier that contributes some of them.

use std::sync::Arc;

use lunakv_proto::master as pb;
use lunakv_transfer::ColdTier;

/// What the host needs from an owner's disk tier besides serving it ([`ColdTier`]): its
/// capacity and objects for the mount, and what it dropped for the next Ping.
pub trait DiskInventory: Send + Sync + 'static {
    /// Bytes the tier may hold; 0 when it is unusable.
    fn capacity(&self) -> u64;
    /// Every object on disk (`offset` unused), with the placement proof stored with it.
    fn objects(&self) -> Vec<lunakv_transfer::Entry>;
    /// `(key, generation, size)` dropped since the last call (size limit, failed checksum).
    fn take_dropped(&self) -> Vec<(String, u64, u64)>;
}

/// An owner's disk tier as the host plugs it in (two views of one object).
#[derive(Clone)]
pub struct HostDisk {
    pub cold: Arc<dyn ColdTier>,
    pub inventory: Arc<dyn DiskInventory>,
}

/// An entry as its owner reports it at mount, with its placement proof.
pub(crate) fn inventory_item(
    e: lunakv_transfer::Entry,
    kind: pb::ReplicaKind,
) -> pb::InventoryItem {
    let disk = kind == pb::ReplicaKind::LocalDisk;
    pb::InventoryItem {
        key: e.key,
        offset: if disk { 0 } else { e.offset },
        size: e.size,
        generation: e.generation,
        kind: kind as i32,
        proof: e.proof.map(|p| p.as_bytes().to_vec()).unwrap_or_default(),
    }
}

/// Encoded bytes per inventory part: well under the master's 4 MiB message limit.
const INVENTORY_PART_BYTES: usize = 1 << 20;

/// Splits an inventory into parts of at most [`INVENTORY_PART_BYTES`] encoded (at least one
/// item each, and one empty part for an empty inventory).
pub(crate) fn inventory_parts(items: Vec<pb::InventoryItem>) -> Vec<Vec<pb::InventoryItem>> {
    use lunakv_proto::prost::Message;
    let mut parts = vec![Vec::new()];
    let mut bytes = 0;
    for item in items {
        // Field tag + length prefix: a few bytes over the item itself.
        let len = item.encoded_len() + 8;
        let cur = parts.last_mut().expect("parts is never empty");
        if !cur.is_empty() && bytes + len > INVENTORY_PART_BYTES {
            parts.push(Vec::new());
            bytes = 0;
        }
        bytes += len;
        parts.last_mut().expect("parts is never empty").push(item);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inventory_parts_stay_under_the_message_limit_and_keep_every_item() {
        assert_eq!(inventory_parts(Vec::new()), vec![Vec::new()]);
        let items: Vec<pb::InventoryItem> = (0..40_000u64)
            .map(|i| pb::InventoryItem {
                key: format!("model@tp_rank:0@pp_rank:0@{i:064x}"),
                offset: i * 4096,
                size: 4096,
                generation: (7 << 32) | i,
                kind: pb::ReplicaKind::Memory as i32,
                // As with a pool token: every entry carries its proof.
                proof: vec![0xAB; 16],
            })
            .collect();
        let parts = inventory_parts(items.clone());
        assert!(parts.len() > 1);
        for p in &parts {
            let req = pb::MountInventoryRequest {
                items: p.clone(),
                ..Default::default()
            };
            let len = lunakv_proto::prost::Message::encoded_len(&req);
            assert!(len <= INVENTORY_PART_BYTES, "{len}");
        }
        assert_eq!(parts.concat(), items);
    }
}
