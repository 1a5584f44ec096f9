//! The wire formats, msgpack by hand (a few arrays and maps; a serde layer would add nothing).
//!
//! Over 900 lines with its tests: the encoder is about 620 lines, and the tests below it decode
//! both formats' events and check their fields in upstream's order, beside the bytes they check.
//!
//! - **Mooncake, `rfc1527`** (upstream Mooncake main's master publisher, RFC #1527;
//!   `mooncake-store/src/kv_event/kv_event_publisher.cpp`): batch `[ts_ms, [event...], 0]`,
//!   each event a map of RFC #1527 names, one per object key and medium (`cpu` / `disk`):
//!   [`encode_rfc1527_batch`].
//! - **Mooncake, `array`** (upstream's older `docs/source/design/kv-event/`): batch
//!   `[ts, [event...]]`; `["BlockStoreEvent", key, [[kind, location]...], model_name,
//!   block_size, block_hash, parent_block_hash, token_ids]`, `["BlockUpdateEvent", key,
//!   replicas]`, `["RemoveAllEvent"]`.
//! - **vLLM** (`vllm/distributed/kv_events.py`): batch `[ts, [event...], data_parallel_rank]`
//!   (`EventBatch` is an array-like msgspec struct). Each event is, in the `tagged` form
//!   (today's vLLM: `KVCacheEvent` is `tag=True, omit_defaults=True` without `array_like`), a
//!   map whose `type` names the class, then the fields by name, defaulted ones omitted; in the
//!   `array` form (vLLM before its events became maps) `["BlockStored", block_hashes, ...]`
//!   by position.
//!
//! Block hashes come from the key: vLLM's Mooncake connector names each block
//! `[prefix@]<model>@tp_rank:<r>@...@<block hash hex>` ([`parse_vllm_key`]).

use rmp::encode;

use super::event::{PoolEvent, ReplicaRef, Tiers};

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
    /// The hash as vLLM publishes it with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (its
    /// default): `int.from_bytes(hash, "big") & (2**64 - 1)`, the last 8 bytes big-endian.
    pub fn to_vllm_int(&self) -> u64 {
        match self {
            BlockHash::Int(v) => *v,
            BlockHash::Bytes(b) => b
                .iter()
                .skip(b.len().saturating_sub(8))
                .fold(0u64, |acc, x| (acc << 8) | u64::from(*x)),
        }
    }

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

/// One event in Mooncake's older array format, appended to `buf`.
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

/// A Mooncake EventBatch in the older array form, `[ts, [events...]]`.
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

fn map(buf: &mut Vec<u8>, n: usize) {
    let _ = encode::write_map_len(buf, n as u32);
}

fn int(buf: &mut Vec<u8>, v: i64) {
    let _ = encode::write_sint(buf, v);
}

/// How the vLLM stream encodes its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VllmFormat {
    /// Today's vLLM: each event a map tagged with its class name.
    #[default]
    Tagged,
    /// vLLM before its events became maps: each event a positional array.
    Array,
}

/// The vLLM stream's settings that shape each message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmWire {
    pub format: VllmFormat,
    /// Hashes as vLLM's default sends them (see [`BlockHash::to_vllm_int`]).
    pub int_hashes: bool,
    pub block_size: u32,
    /// `ownership` of every event (tagged form); empty = not sent.
    pub ownership: String,
}

/// `locality` of the pool's blocks: they live outside every serving pod the stream speaks for.
pub const LOCALITY_REMOTE: &str = "REMOTE";

fn vllm_hash(buf: &mut Vec<u8>, h: &BlockHash, int_hashes: bool) {
    match h {
        _ if int_hashes => uint(buf, h.to_vllm_int()),
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
    wire: &VllmWire,
) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    arr(&mut buf, 3);
    f64v(&mut buf, ts);
    arr(&mut buf, events.len());
    for ev in events {
        match wire.format {
            VllmFormat::Tagged => encode_vllm_tagged(&mut buf, ev, wire),
            VllmFormat::Array => encode_vllm_array(&mut buf, ev, wire),
        }
    }
    // data_parallel_rank: the pool is one publisher. vLLM's publisher always sets it, so it
    // is never the omitted default (None).
    uint(&mut buf, 0);
    buf
}

/// One event as msgspec encodes a `tag=True, omit_defaults=True` struct: a map, the tag
/// (`type`: the class name) first, then the fields in declaration order. Fields without a
/// default are always written (nil included); defaulted ones only when set.
fn encode_vllm_tagged(buf: &mut Vec<u8>, ev: &VllmEvent, wire: &VllmWire) {
    let ownership = (!wire.ownership.is_empty()).then_some(wire.ownership.as_str());
    // locality and ownership: the tier fields after the defaulted ones.
    let tier_fields = |buf: &mut Vec<u8>| {
        s(buf, "locality");
        s(buf, LOCALITY_REMOTE);
        if let Some(o) = ownership {
            s(buf, "ownership");
            s(buf, o);
        }
    };
    let extra = 1 + usize::from(ownership.is_some());
    match ev {
        VllmEvent::Stored { hash: h, medium } => {
            // BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
            // medium, lora_name have no default; extra_keys, group_idx, kv_cache_spec_*,
            // session_id stay at theirs (None) and are omitted.
            map(buf, 8 + extra);
            s(buf, "type");
            s(buf, "BlockStored");
            s(buf, "block_hashes");
            arr(buf, 1);
            vllm_hash(buf, h, wire.int_hashes);
            s(buf, "parent_block_hash");
            nil(buf);
            s(buf, "token_ids");
            arr(buf, 0);
            s(buf, "block_size");
            uint(buf, u64::from(wire.block_size));
            s(buf, "lora_id");
            nil(buf);
            s(buf, "medium");
            s(buf, medium);
            s(buf, "lora_name");
            nil(buf);
            tier_fields(buf);
        }
        VllmEvent::Removed { hash: h, medium } => {
            // BlockRemoved: block_hashes, medium; group_idx omitted.
            map(buf, 3 + extra);
            s(buf, "type");
            s(buf, "BlockRemoved");
            s(buf, "block_hashes");
            arr(buf, 1);
            vllm_hash(buf, h, wire.int_hashes);
            s(buf, "medium");
            s(buf, medium);
            tier_fields(buf);
        }
        VllmEvent::Cleared => {
            map(buf, 1);
            s(buf, "type");
            s(buf, "AllBlocksCleared");
        }
    }
}

/// One event in the array form (older vLLM: `array_like=True`, tag first).
fn encode_vllm_array(buf: &mut Vec<u8>, ev: &VllmEvent, wire: &VllmWire) {
    let (block_size, int_hashes) = (wire.block_size, wire.int_hashes);
    match ev {
        VllmEvent::Stored { hash: h, medium } => {
            // block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
            // lora_name; extra_keys, group_idx and the kv_cache_spec fields have defaults.
            arr(buf, 8);
            s(buf, "BlockStored");
            arr(buf, 1);
            vllm_hash(buf, h, int_hashes);
            nil(buf);
            arr(buf, 0);
            uint(buf, u64::from(block_size));
            nil(buf);
            s(buf, medium);
            nil(buf);
        }
        VllmEvent::Removed { hash: h, medium } => {
            arr(buf, 3);
            s(buf, "BlockRemoved");
            arr(buf, 1);
            vllm_hash(buf, h, int_hashes);
            s(buf, medium);
        }
        VllmEvent::Cleared => {
            arr(buf, 1);
            s(buf, "AllBlocksCleared");
        }
    }
}

/// How the Mooncake stream encodes its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MooncakeFormat {
    /// Upstream main's master publisher (RFC #1527 maps).
    #[default]
    Rfc1527,
    /// The older dev-branch arrays.
    Array,
}

/// The `rfc1527` stream's settings that shape each message (upstream main's flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RfcWire {
    /// `backend_id`: the cache owner.
    pub backend_id: String,
    /// Add vLLM's names (`type`, `block_hashes`, `parent_block_hash`).
    pub emit_legacy_compat: bool,
    /// Add `object_key`; off, an event without a parsed `seq_hashes` names nothing and is
    /// skipped.
    pub emit_object_key: bool,
    /// `block_size` when known (> 0), else nil as upstream's master.
    pub block_size: u32,
}

/// The tenant of every event: lunakv's streams carry the default tenant's keys.
pub const RFC_TENANT: &str = "default";

/// One RFC #1527 event: an object key gained or lost a medium, or everything went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RfcEvent<'a> {
    Stored { key: &'a str, medium: &'static str },
    Removed { key: &'a str, medium: &'static str },
    Cleared,
}

/// The medium of the pool's DRAM and of its SSD tier, as upstream's master names them.
pub const RFC_MEDIUM_DRAM: &str = "cpu";
pub const RFC_MEDIUM_SSD: &str = "disk";

/// A pool event as RFC #1527 events: `stored` per medium gained, then `removed` per medium
/// lost (gains first, as on the vLLM stream, so a moved object is never held nowhere), media
/// in upstream's sorted order; `cleared` for `remove_all` and a new core.
pub fn rfc1527_events(ev: &PoolEvent) -> Vec<RfcEvent<'_>> {
    let (key, before, after) = match ev {
        PoolEvent::Stored { key, replicas } => (key, Tiers::default(), Tiers::of(replicas)),
        PoolEvent::Updated {
            key,
            before,
            replicas,
        } => (key, *before, Tiers::of(replicas)),
        PoolEvent::RemovedAll | PoolEvent::Reset => return vec![RfcEvent::Cleared],
    };
    let tiers = [
        (before.dram, after.dram, RFC_MEDIUM_DRAM),
        (before.ssd, after.ssd, RFC_MEDIUM_SSD),
    ];
    let gained = tiers
        .iter()
        .filter(|(had, has, _)| !had && *has)
        .map(|&(_, _, medium)| RfcEvent::Stored { key, medium });
    let lost = tiers
        .iter()
        .filter(|(had, has, _)| *had && !has)
        .map(|&(_, _, medium)| RfcEvent::Removed { key, medium });
    gained.chain(lost).collect()
}

/// Upstream's `ParseSeqHashFromObjectKey`: the whole key as a decimal or `0x`-prefixed hex
/// u64, else none.
pub fn parse_seq_hash(key: &str) -> Option<u64> {
    let (digits, radix) = match key.get(..2) {
        Some("0x" | "0X") => (&key[2..], 16),
        _ => (key, 10),
    };
    if digits.is_empty() || !digits.bytes().all(|b| (b as char).is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// An encoded `rfc1527` message: the payload (`None` when no event is left to send) and how
/// many events it holds and skipped.
#[derive(Debug)]
pub struct RfcBatch {
    pub payload: Option<Vec<u8>>,
    pub events: u64,
    /// Events with neither a parsed `seq_hashes` nor `object_key` (emit_object_key off).
    pub skipped: u64,
}

/// An RFC #1527 batch `[ts_ms, [event...], 0]`, event ids from `*next_event_id` on. Field
/// order and types follow upstream's master publisher so a consumer written against it reads
/// the same bytes.
pub fn encode_rfc1527_batch(
    ts_ms: i64,
    events: &[PoolEvent],
    next_event_id: &mut u64,
    wire: &RfcWire,
) -> RfcBatch {
    let mut skipped = 0;
    let rfc: Vec<(RfcEvent<'_>, Option<u64>)> = events
        .iter()
        .flat_map(rfc1527_events)
        .filter_map(|e| {
            let hash = match &e {
                RfcEvent::Stored { key, .. } | RfcEvent::Removed { key, .. } => parse_seq_hash(key),
                RfcEvent::Cleared => return Some((e, None)),
            };
            if hash.is_none() && !wire.emit_object_key {
                skipped += 1;
                return None;
            }
            Some((e, hash))
        })
        .collect();
    if rfc.is_empty() {
        return RfcBatch {
            payload: None,
            events: 0,
            skipped,
        };
    }
    let mut buf = Vec::with_capacity(64 + rfc.len() * 320);
    arr(&mut buf, 3);
    int(&mut buf, ts_ms);
    arr(&mut buf, rfc.len());
    for (e, hash) in &rfc {
        encode_rfc1527_event(&mut buf, e, *hash, *next_event_id, ts_ms, wire);
        *next_event_id += 1;
    }
    // Batch-level dp_rank: a storage pool has no data-parallel context.
    uint(&mut buf, 0);
    RfcBatch {
        payload: Some(buf),
        events: rfc.len() as u64,
        skipped,
    }
}

fn encode_rfc1527_event(
    buf: &mut Vec<u8>,
    e: &RfcEvent<'_>,
    hash: Option<u64>,
    event_id: u64,
    ts_ms: i64,
    wire: &RfcWire,
) {
    let legacy = wire.emit_legacy_compat;
    let (event_type, legacy_type, key, medium) = match e {
        RfcEvent::Stored { key, medium } => ("stored", "BlockStored", *key, Some(*medium)),
        RfcEvent::Removed { key, medium } => ("removed", "BlockRemoved", *key, Some(*medium)),
        RfcEvent::Cleared => ("cleared", "AllBlocksCleared", "", None),
    };
    let stored = matches!(e, RfcEvent::Stored { .. });
    // The envelope (11 fields, + group_id), then the block fields of stored / removed.
    let mut n = 12 + usize::from(legacy);
    if medium.is_some() {
        n += 1 + usize::from(legacy) + usize::from(wire.emit_object_key);
        n += if stored { 3 + usize::from(legacy) } else { 1 };
    }
    map(buf, n);
    s(buf, "event_id");
    uint(buf, event_id);
    s(buf, "timestamp");
    int(buf, ts_ms);
    s(buf, "event_type");
    s(buf, event_type);
    if legacy {
        s(buf, "type");
        s(buf, legacy_type);
    }
    // Per-block context a storage pool does not know: the indexer has it from registration.
    s(buf, "model_name");
    nil(buf);
    s(buf, "block_size");
    if wire.block_size > 0 {
        uint(buf, u64::from(wire.block_size));
    } else {
        nil(buf);
    }
    s(buf, "additional_salt");
    nil(buf);
    s(buf, "lora_name");
    nil(buf);
    s(buf, "tenant_id");
    s(buf, RFC_TENANT);
    s(buf, "backend_id");
    s(buf, &wire.backend_id);
    s(buf, "group_id");
    nil(buf);
    s(buf, "medium");
    match medium {
        Some(m) => s(buf, m),
        None => nil(buf),
    }
    s(buf, "dp_rank");
    nil(buf);
    if medium.is_none() {
        return;
    }
    if wire.emit_object_key {
        s(buf, "object_key");
        s(buf, key);
    }
    s(buf, "seq_hashes");
    arr(buf, usize::from(hash.is_some()));
    if let Some(h) = hash {
        uint(buf, h);
    }
    if legacy {
        s(buf, "block_hashes");
        arr(buf, usize::from(hash.is_some()));
        if let Some(h) = hash {
            // Upstream writes the alias as a signed 64-bit int (vLLM's Python ints), so a
            // hash with the top bit set reads negative there; the same bits here.
            int(buf, h as i64);
        }
    }
    s(buf, "base_block_idx");
    if stored {
        // A pool object is a standalone block: depth 0 (RFC #1527 wants base_block_idx or
        // parent_hash on a stored event).
        uint(buf, 0);
        s(buf, "parent_hash");
        nil(buf);
        s(buf, "token_ids");
        nil(buf);
        if legacy {
            s(buf, "parent_block_hash");
            nil(buf);
        }
    } else {
        nil(buf);
    }
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

    fn stored_replicas() -> Vec<ReplicaRef> {
        vec![ReplicaRef {
            disk: false,
            endpoint: "10.0.0.1:50052".into(),
        }]
    }

    fn stored() -> PoolEvent {
        PoolEvent::Stored {
            key: KEY.to_string(),
            replicas: stored_replicas(),
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

    fn vllm_wire(format: VllmFormat, int_hashes: bool) -> VllmWire {
        VllmWire {
            format,
            int_hashes,
            block_size: 16,
            ownership: "lunakv".into(),
        }
    }

    fn value(b: &[u8]) -> rmpv::Value {
        let mut r = b;
        let v = rmpv::decode::read_value(&mut r).expect("msgpack");
        assert!(r.is_empty(), "trailing bytes");
        v
    }

    /// The (key, value) pairs of a map, keys as text, in wire order.
    fn fields(v: &rmpv::Value) -> Vec<(String, rmpv::Value)> {
        v.as_map()
            .expect("a map")
            .iter()
            .map(|(k, v)| (k.as_str().expect("text key").to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn int_hashes_are_the_last_eight_bytes_big_endian() {
        let h = BlockHash::from_hex(KEY.rsplit_once('@').unwrap().1).expect("hash");
        // int.from_bytes(h, "big") & (2**64 - 1) of ...0a1b2c3d4e5f6071_8293a4b5c6d7e8f9
        assert_eq!(h.to_vllm_int(), 0x8293_a4b5_c6d7_e8f9);
        assert_eq!(BlockHash::Int(42).to_vllm_int(), 42);
        assert_eq!(BlockHash::Bytes(vec![1, 2]).to_vllm_int(), 0x0102);
    }

    /// Today's vLLM (`KVCacheEvent`: `tag=True, omit_defaults=True`, not array-like): each
    /// event a map, `type` first, the fields without defaults always, the pool's tier fields
    /// last; the batch stays an array.
    #[test]
    fn vllm_tagged_events_are_maps_in_msgspec_order() {
        let h = BlockHash::from_hex(KEY.rsplit_once('@').unwrap().1).expect("hash");
        let evs = [
            VllmEvent::Stored {
                hash: h.clone(),
                medium: "CPU".into(),
            },
            VllmEvent::Removed {
                hash: h,
                medium: "STORAGE".into(),
            },
            VllmEvent::Cleared,
        ];
        let b = encode_vllm_batch(1.5, evs.iter(), &vllm_wire(VllmFormat::Tagged, true));
        let v = value(&b);
        let batch = v.as_array().expect("array-like batch");
        assert_eq!(batch.len(), 3);
        assert_eq!(batch[0].as_f64(), Some(1.5));
        assert_eq!(batch[2].as_u64(), Some(0), "data_parallel_rank");
        let events = batch[1].as_array().expect("events");
        let names =
            |e: &rmpv::Value| -> Vec<String> { fields(e).into_iter().map(|f| f.0).collect() };
        assert_eq!(
            names(&events[0]),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "locality",
                "ownership"
            ]
        );
        let stored = fields(&events[0]);
        assert_eq!(stored[0].1.as_str(), Some("BlockStored"));
        assert_eq!(
            stored[1].1,
            rmpv::Value::Array(vec![rmpv::Value::from(0x8293_a4b5_c6d7_e8f9u64)]),
            "an unsigned int, as vLLM's default"
        );
        assert!(stored[2].1.is_nil() && stored[5].1.is_nil() && stored[7].1.is_nil());
        assert_eq!(stored[4].1.as_u64(), Some(16));
        assert_eq!(stored[6].1.as_str(), Some("CPU"));
        assert_eq!(stored[8].1.as_str(), Some("REMOTE"));
        assert_eq!(stored[9].1.as_str(), Some("lunakv"));
        assert_eq!(
            names(&events[1]),
            ["type", "block_hashes", "medium", "locality", "ownership"]
        );
        assert_eq!(fields(&events[1])[0].1.as_str(), Some("BlockRemoved"));
        assert_eq!(
            fields(&events[2]),
            [("type".to_string(), rmpv::Value::from("AllBlocksCleared"))]
        );
        // No ownership configured: the field is omitted (its default), not sent empty.
        let wire = VllmWire {
            ownership: String::new(),
            ..vllm_wire(VllmFormat::Tagged, false)
        };
        let b = encode_vllm_batch(0.0, evs[..1].iter(), &wire);
        let v = value(&b);
        let e = &v.as_array().unwrap()[1].as_array().unwrap()[0];
        assert!(!names(e).contains(&"ownership".to_string()));
        assert!(
            matches!(&fields(e)[1].1, rmpv::Value::Array(a) if matches!(a[0], rmpv::Value::Binary(_))),
            "bytes without int hashes"
        );
    }

    #[test]
    fn vllm_block_stored_field_order() {
        let ev = VllmEvent::Stored {
            hash: BlockHash::Int(7),
            medium: "m".into(),
        };
        let b = encode_vllm_batch(0.0, [ev].iter(), &vllm_wire(VllmFormat::Array, false));
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&0f64.to_be_bytes());
        want.extend_from_slice(&[0x91, 0x98, 0xab]);
        want.extend_from_slice(b"BlockStored");
        // [7], nil, [], 16, nil, "m", nil; then dp rank 0
        want.extend_from_slice(&[0x91, 0x07, 0xc0, 0x90, 0x10, 0xc0, 0xa1, b'm', 0xc0, 0x00]);
        assert_eq!(b, want);
    }

    fn rfc_wire(legacy: bool, object_key: bool) -> RfcWire {
        RfcWire {
            backend_id: "store-node-1".into(),
            emit_legacy_compat: legacy,
            emit_object_key: object_key,
            block_size: 0,
        }
    }

    #[test]
    fn seq_hashes_parse_like_upstreams_key_util() {
        assert_eq!(parse_seq_hash("12345"), Some(12345));
        assert_eq!(parse_seq_hash("0x2a"), Some(42));
        assert_eq!(parse_seq_hash("0XFF"), Some(255));
        assert_eq!(parse_seq_hash("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "0x",
            "abc",
            "12a",
            "+1",
            "-1",
            "18446744073709551616",
            KEY,
        ] {
            assert_eq!(parse_seq_hash(bad), None, "{bad}");
        }
    }

    /// Upstream main's master publisher, field by field: stored (depth 0, nil parent and
    /// tokens), removed, and cleared; legacy aliases and object_key on (its defaults).
    #[test]
    fn rfc1527_events_carry_upstreams_fields_in_its_order() {
        let offload = PoolEvent::Updated {
            key: "0x2a".into(),
            before: Tiers {
                dram: true,
                ssd: false,
            },
            replicas: vec![ReplicaRef {
                disk: true,
                endpoint: "h:1".into(),
            }],
        };
        let mut id = 7;
        let b = encode_rfc1527_batch(
            1_700_000_000_123,
            &[stored(), offload, PoolEvent::RemovedAll],
            &mut id,
            &rfc_wire(true, true),
        );
        assert_eq!((b.events, b.skipped, id), (4, 0, 11));
        let v = value(b.payload.as_deref().expect("events"));
        let batch = v.as_array().expect("[ts, events, dp_rank]");
        assert_eq!(batch.len(), 3);
        assert_eq!(
            batch[0].as_i64(),
            Some(1_700_000_000_123),
            "ms since the epoch"
        );
        assert_eq!(batch[2].as_u64(), Some(0));
        let events = batch[1].as_array().unwrap();
        let envelope = [
            "event_id",
            "timestamp",
            "event_type",
            "type",
            "model_name",
            "block_size",
            "additional_salt",
            "lora_name",
            "tenant_id",
            "backend_id",
            "group_id",
            "medium",
            "dp_rank",
        ];
        let stored_names: Vec<&str> = envelope
            .iter()
            .copied()
            .chain([
                "object_key",
                "seq_hashes",
                "block_hashes",
                "base_block_idx",
                "parent_hash",
                "token_ids",
                "parent_block_hash",
            ])
            .collect();
        let get = |e: &rmpv::Value, k: &str| {
            fields(e)
                .into_iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v)
                .unwrap_or_else(|| panic!("no {k}"))
        };
        let names =
            |e: &rmpv::Value| -> Vec<String> { fields(e).into_iter().map(|f| f.0).collect() };
        assert_eq!(names(&events[0]), stored_names);
        assert_eq!(get(&events[0], "event_id").as_u64(), Some(7));
        assert_eq!(get(&events[0], "event_type").as_str(), Some("stored"));
        assert_eq!(get(&events[0], "type").as_str(), Some("BlockStored"));
        assert_eq!(get(&events[0], "tenant_id").as_str(), Some("default"));
        assert_eq!(get(&events[0], "backend_id").as_str(), Some("store-node-1"));
        assert_eq!(get(&events[0], "medium").as_str(), Some("cpu"));
        assert_eq!(get(&events[0], "object_key").as_str(), Some(KEY));
        assert_eq!(get(&events[0], "seq_hashes"), rmpv::Value::Array(vec![]));
        assert_eq!(get(&events[0], "base_block_idx").as_u64(), Some(0));
        for nil_field in [
            "model_name",
            "block_size",
            "dp_rank",
            "parent_hash",
            "token_ids",
        ] {
            assert!(get(&events[0], nil_field).is_nil(), "{nil_field}");
        }
        // The offload: stored on disk first, then removed from cpu; the key is a hash.
        assert_eq!(get(&events[1], "event_type").as_str(), Some("stored"));
        assert_eq!(get(&events[1], "medium").as_str(), Some("disk"));
        assert_eq!(
            get(&events[1], "seq_hashes"),
            rmpv::Value::Array(vec![rmpv::Value::from(42u64)])
        );
        assert_eq!(
            names(&events[2]),
            envelope
                .iter()
                .copied()
                .chain(["object_key", "seq_hashes", "block_hashes", "base_block_idx"])
                .collect::<Vec<_>>()
        );
        assert_eq!(get(&events[2], "event_type").as_str(), Some("removed"));
        assert_eq!(get(&events[2], "medium").as_str(), Some("cpu"));
        assert!(get(&events[2], "base_block_idx").is_nil());
        assert_eq!(names(&events[3]), envelope);
        assert_eq!(get(&events[3], "event_type").as_str(), Some("cleared"));
        assert_eq!(get(&events[3], "type").as_str(), Some("AllBlocksCleared"));
        assert!(get(&events[3], "medium").is_nil());
        assert_eq!(get(&events[3], "event_id").as_u64(), Some(10));
    }

    /// Without legacy aliases the vLLM names go; without object_key a key that is no hash
    /// names nothing and is skipped, a hash key still goes (upstream main's behaviour).
    #[test]
    fn rfc1527_flags_drop_aliases_and_keyless_events() {
        let hash_key = PoolEvent::Stored {
            key: "12345".into(),
            replicas: stored_replicas(),
        };
        let mut id = 0;
        let b = encode_rfc1527_batch(1, &[stored(), hash_key], &mut id, &rfc_wire(false, false));
        assert_eq!((b.events, b.skipped, id), (1, 1, 1));
        let v = value(b.payload.as_deref().expect("the hash key"));
        let e = &v.as_array().unwrap()[1].as_array().unwrap()[0];
        let names: Vec<String> = fields(e).into_iter().map(|f| f.0).collect();
        for gone in ["type", "block_hashes", "parent_block_hash", "object_key"] {
            assert!(!names.contains(&gone.to_string()), "{gone} in {names:?}");
        }
        let mut id = 0;
        let b = encode_rfc1527_batch(1, &[stored()], &mut id, &rfc_wire(true, false));
        assert!(b.payload.is_none(), "nothing to send");
        assert_eq!((b.skipped, id), (1, 0), "skipped events take no id");
    }

    #[test]
    fn rfc1527_legacy_block_hashes_are_signed_as_upstreams() {
        let ev = PoolEvent::Stored {
            key: format!("{}", u64::MAX),
            replicas: stored_replicas(),
        };
        let mut id = 0;
        let b = encode_rfc1527_batch(1, &[ev], &mut id, &rfc_wire(true, true));
        let v = value(b.payload.as_deref().expect("an event"));
        let e = &v.as_array().unwrap()[1].as_array().unwrap()[0];
        let f = fields(e);
        let find = |k: &str| f.iter().find(|(n, _)| n == k).unwrap().1.clone();
        assert_eq!(
            find("seq_hashes"),
            rmpv::Value::Array(vec![u64::MAX.into()])
        );
        assert_eq!(
            find("block_hashes"),
            rmpv::Value::Array(vec![(-1i64).into()])
        );
    }
}
