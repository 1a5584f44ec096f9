//! The two wire formats, msgpack by hand (a few arrays; a serde layer would add nothing).
//!
//! - **Mooncake** (upstream's `docs/source/design/kv-event/`): batch `[ts, [event...]]`;
//!   `["BlockStoreEvent", key, [[kind, location]...], model_name, block_size, block_hash,
//!   parent_block_hash, token_ids]`, `["BlockUpdateEvent", key, replicas]`, `["RemoveAllEvent"]`.
//! - **vLLM** (`vllm/distributed/kv_events.py`, msgspec tagged array-like structs, tag = class
//!   name first): batch `[ts, [event...], data_parallel_rank]`; `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`,
//!   `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. Trailing fields that
//!   vLLM gives defaults are omitted, as msgspec's `omit_defaults` does.
//!
//! Block hashes come from the key: vLLM's Mooncake connector names each block
//! `[prefix@]<model>@tp_rank:<r>@...@<block hash hex>` ([`parse_vllm_key`]).

use rmp::encode;

use super::{PoolEvent, ReplicaRef, Tiers};

/// What a vLLM-format store key says about its block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmKey<'a> {
    /// The model component (the last path component of the model name).
    pub model: &'a str,
    /// The block hash, hex as the key spells it.
    pub hash_hex: &'a str,
}

/// The model and block hash of a vLLM-format key, or `None` for any other key: the last
/// `@`-component must be 1 to 128 hex digits and a `tp_rank:` component must follow the model.
pub fn parse_vllm_key(key: &str) -> Option<VllmKey<'_>> {
    let (rest, hash_hex) = key.rsplit_once('@')?;
    if hash_hex.is_empty()
        || hash_hex.len() > 128
        || !hash_hex.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return None;
    }
    let parts: Vec<&str> = rest.split('@').collect();
    let rank = parts.iter().position(|p| p.starts_with("tp_rank:"))?;
    let model = *parts.get(rank.checked_sub(1)?)?;
    if model.is_empty() {
        return None;
    }
    Some(VllmKey { model, hash_hex })
}

/// A block hash as vLLM's events carry it (`ExternalBlockHash = bytes | int`): up to 16 hex
/// digits is an int hash (vLLM's builtin-hash mode), longer is the bytes of a sha256-style hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockHash {
    Int(u64),
    Bytes(Vec<u8>),
}

impl BlockHash {
    pub fn from_hex(hex: &str) -> Option<BlockHash> {
        if hex.len() <= 16 {
            return u64::from_str_radix(hex, 16).ok().map(BlockHash::Int);
        }
        let padded;
        let hex = if hex.len() % 2 == 1 {
            padded = format!("0{hex}");
            padded.as_str()
        } else {
            hex
        };
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
            .collect::<Option<Vec<u8>>>()
            .map(BlockHash::Bytes)
    }
}

/// Mooncake's replica kind of a replica.
pub fn replica_kind(r: &ReplicaRef) -> &'static str {
    if r.disk { "local_disk" } else { "memory" }
}

fn arr(buf: &mut Vec<u8>, n: usize) {
    // Writing into a Vec cannot fail.
    let _ = encode::write_array_len(buf, n as u32);
}

fn s(buf: &mut Vec<u8>, v: &str) {
    let _ = encode::write_str(buf, v);
}

fn uint(buf: &mut Vec<u8>, v: u64) {
    let _ = encode::write_uint(buf, v);
}

fn nil(buf: &mut Vec<u8>) {
    let _ = encode::write_nil(buf);
}

fn f64v(buf: &mut Vec<u8>, v: f64) {
    let _ = encode::write_f64(buf, v);
}

fn replicas(buf: &mut Vec<u8>, rs: &[ReplicaRef]) {
    arr(buf, rs.len());
    for r in rs {
        arr(buf, 2);
        s(buf, replica_kind(r));
        s(buf, &r.endpoint);
    }
}

/// One event in Mooncake's format, appended to `buf`.
pub fn encode_mooncake_event(buf: &mut Vec<u8>, ev: &PoolEvent, block_size: u32) {
    match ev {
        PoolEvent::Stored { key, replicas: rs } => {
            let parsed = parse_vllm_key(key);
            arr(buf, 8);
            s(buf, "BlockStoreEvent");
            s(buf, key);
            replicas(buf, rs);
            s(buf, parsed.as_ref().map_or("", |k| k.model));
            uint(buf, u64::from(block_size));
            match &parsed {
                Some(k) => s(buf, &format!("0x{}", k.hash_hex)),
                None => s(buf, ""),
            }
            // The key does not name the parent, and the put carries no tokens.
            s(buf, "");
            arr(buf, 0);
        }
        PoolEvent::Updated {
            key, replicas: rs, ..
        } => {
            arr(buf, 3);
            s(buf, "BlockUpdateEvent");
            s(buf, key);
            replicas(buf, rs);
        }
        PoolEvent::RemovedAll | PoolEvent::Reset => {
            arr(buf, 1);
            s(buf, "RemoveAllEvent");
        }
    }
}

/// A Mooncake EventBatch `[ts, [events...]]`.
pub fn encode_mooncake_batch(ts: f64, events: &[PoolEvent], block_size: u32) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    arr(&mut buf, 2);
    f64v(&mut buf, ts);
    arr(&mut buf, events.len());
    for ev in events {
        encode_mooncake_event(&mut buf, ev, block_size);
    }
    buf
}

/// One vLLM-format event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmEvent {
    Stored { hash: BlockHash, medium: String },
    Removed { hash: BlockHash, medium: String },
    Cleared,
}

/// A pool event as vLLM events, each with the model it belongs to (`None` = every model):
/// a tier gained is a BlockStored with that tier's medium, a tier lost a BlockRemoved. Keys
/// that are not vLLM-format have no block hash and give nothing.
pub fn vllm_events(
    ev: &PoolEvent,
    medium_dram: &str,
    medium_ssd: &str,
) -> Vec<(Option<String>, VllmEvent)> {
    let (key, before, after) = match ev {
        PoolEvent::Stored { key, replicas } => (key, Tiers::default(), Tiers::of(replicas)),
        PoolEvent::Updated {
            key,
            before,
            replicas,
        } => (key, *before, Tiers::of(replicas)),
        PoolEvent::RemovedAll | PoolEvent::Reset => return vec![(None, VllmEvent::Cleared)],
    };
    let Some(k) = parse_vllm_key(key) else {
        return Vec::new();
    };
    let Some(hash) = BlockHash::from_hex(k.hash_hex) else {
        return Vec::new();
    };
    let model = Some(k.model.to_string());
    let tiers = [
        (before.dram, after.dram, medium_dram),
        (before.ssd, after.ssd, medium_ssd),
    ];
    // Gains before losses: an offload says "on SSD" before "gone from DRAM", so a consumer
    // never sees the block held nowhere in between.
    let gained = tiers
        .iter()
        .filter(|(had, has, _)| !had && *has)
        .map(|(_, _, m)| {
            let (hash, medium) = (hash.clone(), m.to_string());
            (model.clone(), VllmEvent::Stored { hash, medium })
        });
    let lost = tiers
        .iter()
        .filter(|(had, has, _)| *had && !has)
        .map(|(_, _, m)| {
            let (hash, medium) = (hash.clone(), m.to_string());
            (model.clone(), VllmEvent::Removed { hash, medium })
        });
    gained.chain(lost).collect()
}

fn hash(buf: &mut Vec<u8>, h: &BlockHash) {
    match h {
        BlockHash::Int(v) => uint(buf, *v),
        BlockHash::Bytes(b) => {
            let _ = encode::write_bin(buf, b);
        }
    }
}

/// A vLLM `KVEventBatch` `[ts, [events...], data_parallel_rank]`.
pub fn encode_vllm_batch<'a>(
    ts: f64,
    events: impl ExactSizeIterator<Item = &'a VllmEvent>,
    block_size: u32,
) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 64);
    arr(&mut buf, 3);
    f64v(&mut buf, ts);
    arr(&mut buf, events.len());
    for ev in events {
        match ev {
            VllmEvent::Stored { hash: h, medium } => {
                // block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                // lora_name; extra_keys, group_idx and the kv_cache_spec fields have defaults.
                arr(&mut buf, 8);
                s(&mut buf, "BlockStored");
                arr(&mut buf, 1);
                hash(&mut buf, h);
                nil(&mut buf);
                arr(&mut buf, 0);
                uint(&mut buf, u64::from(block_size));
                nil(&mut buf);
                s(&mut buf, medium);
                nil(&mut buf);
            }
            VllmEvent::Removed { hash: h, medium } => {
                arr(&mut buf, 3);
                s(&mut buf, "BlockRemoved");
                arr(&mut buf, 1);
                hash(&mut buf, h);
                s(&mut buf, medium);
            }
            VllmEvent::Cleared => {
                arr(&mut buf, 1);
                s(&mut buf, "AllBlocksCleared");
            }
        }
    }
    // data_parallel_rank: the pool is one publisher.
    uint(&mut buf, 0);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "prefix@Qwen3-0.6B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@\
                       0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";

    #[test]
    fn parses_vllm_keys_and_refuses_others() {
        let k = parse_vllm_key(KEY).expect("vLLM key");
        assert_eq!(k.model, "Qwen3-0.6B");
        assert!(k.hash_hex.starts_with("0a1b") && k.hash_hex.len() == 64);
        let k = parse_vllm_key("m@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1@ff").expect("no prefix");
        assert_eq!((k.model, k.hash_hex), ("m", "ff"));
        for bad in [
            "plain-key",
            "m@tp_rank:0@group:0@",
            "m@tp_rank:0@group:0@xyz",
            "@tp_rank:0@ff",
            "tp_rank:0@ff",
            "m@pp_rank:0@ff",
        ] {
            assert_eq!(parse_vllm_key(bad), None, "{bad}");
        }
    }

    #[test]
    fn block_hashes_are_ints_up_to_64_bits_and_bytes_beyond() {
        assert_eq!(BlockHash::from_hex("ff"), Some(BlockHash::Int(255)));
        assert_eq!(
            BlockHash::from_hex("ffffffffffffffff"),
            Some(BlockHash::Int(u64::MAX))
        );
        assert_eq!(
            BlockHash::from_hex("10000000000000000"),
            Some(BlockHash::Bytes(vec![1, 0, 0, 0, 0, 0, 0, 0, 0]))
        );
    }

    fn stored() -> PoolEvent {
        PoolEvent::Stored {
            key: KEY.to_string(),
            replicas: vec![ReplicaRef {
                disk: false,
                endpoint: "10.0.0.1:50052".into(),
            }],
        }
    }

    #[test]
    fn mooncake_store_event_layout() {
        let b = encode_mooncake_batch(1.5, &[stored(), PoolEvent::RemovedAll], 16);
        // [1.5, [[ "BlockStoreEvent", key, [["memory", ep]], model, 16, "0x..", "", []], ["RemoveAllEvent"]]]
        let mut want = vec![0x92, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.extend_from_slice(&[0x92, 0x98, 0xaf]);
        want.extend_from_slice(b"BlockStoreEvent");
        assert_eq!(&b[..want.len()], &want[..]);
        let tail: &[u8] = &[0xa0, 0x90, 0x91, 0xae];
        let end = b.len() - 14;
        assert_eq!(
            &b[end - 4..end],
            tail,
            "parent \"\", tokens [], then RemoveAllEvent"
        );
        assert_eq!(&b[end..], b"RemoveAllEvent");
        let text = String::from_utf8_lossy(&b);
        assert!(text.contains("memory") && text.contains("10.0.0.1:50052"));
        assert!(text.contains("Qwen3-0.6B") && text.contains("0x0a1b2c3d"));
    }

    #[test]
    fn update_event_has_three_fields() {
        let ev = PoolEvent::Updated {
            key: "k".into(),
            before: Tiers {
                dram: true,
                ssd: false,
            },
            replicas: vec![],
        };
        let mut b = Vec::new();
        encode_mooncake_event(&mut b, &ev, 0);
        let mut want = vec![0x93, 0xb0];
        want.extend_from_slice(b"BlockUpdateEvent");
        want.extend_from_slice(&[0xa1, b'k', 0x90]);
        assert_eq!(b, want);
    }

    #[test]
    fn vllm_offload_is_stored_on_ssd_then_removed_from_dram() {
        let ev = PoolEvent::Updated {
            key: KEY.to_string(),
            before: Tiers {
                dram: true,
                ssd: false,
            },
            replicas: vec![ReplicaRef {
                disk: true,
                endpoint: "h:1".into(),
            }],
        };
        let out = vllm_events(&ev, "dram", "ssd");
        assert_eq!(out.len(), 2);
        assert!(matches!(&out[0].1, VllmEvent::Stored { medium, .. } if medium == "ssd"));
        assert!(matches!(&out[1].1, VllmEvent::Removed { medium, .. } if medium == "dram"));
        assert_eq!(out[0].0.as_deref(), Some("Qwen3-0.6B"));
        assert!(
            vllm_events(
                &PoolEvent::Updated {
                    key: "plain".into(),
                    before: Tiers::default(),
                    replicas: vec![]
                },
                "a",
                "b"
            )
            .is_empty()
        );
    }

    #[test]
    fn vllm_block_stored_field_order() {
        let ev = VllmEvent::Stored {
            hash: BlockHash::Int(7),
            medium: "m".into(),
        };
        let b = encode_vllm_batch(0.0, [ev].iter(), 16);
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&0f64.to_be_bytes());
        want.extend_from_slice(&[0x91, 0x98, 0xab]);
        want.extend_from_slice(b"BlockStored");
        // [7], nil, [], 16, nil, "m", nil; then dp rank 0
        want.extend_from_slice(&[0x91, 0x07, 0xc0, 0x90, 0x10, 0xc0, 0xa1, b'm', 0xc0, 0x00]);
        assert_eq!(b, want);
    }
}
