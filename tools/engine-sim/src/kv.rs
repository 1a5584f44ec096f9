//! The simulated model: a whitespace "tokenizer", deterministic KV blocks derived from the
//! prompt, and output text derived from a checksum of the KV bytes. The decoder renders its
//! output from whatever KV it holds, so wrong or missing bytes show up as wrong text.

/// How the KV of a prompt is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Tokens per block (vLLM's block_size).
    pub block_tokens: usize,
    /// Bytes of KV per block (all layers, K and V).
    pub block_bytes: usize,
}

impl KvShape {
    /// Blocks holding `tokens` prompt tokens (the last one may be partial).
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens.max(1))
    }
}

/// Token ids of `text`: one per whitespace-separated word.
pub fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|w| fnv32(w.as_bytes()))
        .collect()
}

fn fnv32(b: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &x in b {
        h ^= u32::from(x);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Block hashes chained like vLLM's prefix cache: block i's hash covers all tokens up to its end.
pub fn block_hashes(tokens: &[u32], shape: KvShape) -> Vec<u64> {
    let mut h = 0x6c75_6e61_6b76_u64; // "lunakv"
    tokens
        .chunks(shape.block_tokens.max(1))
        .map(|c| {
            for &t in c {
                h = mix(h ^ u64::from(t));
            }
            h = mix(h ^ c.len() as u64);
            h
        })
        .collect()
}

/// Fills `out` with the KV bytes of the block whose chained hash is `hash`.
pub fn fill_block(hash: u64, out: &mut [u8]) {
    let mut x = hash | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// The KV of a whole prompt: `blocks_for(tokens)` blocks of `block_bytes`, contiguous.
pub fn compute_kv(tokens: &[u32], shape: KvShape) -> Vec<u8> {
    let hashes = block_hashes(tokens, shape);
    let mut kv = vec![0u8; hashes.len() * shape.block_bytes];
    for (h, block) in hashes.iter().zip(kv.chunks_mut(shape.block_bytes.max(1))) {
        fill_block(*h, block);
    }
    kv
}

/// A checksum of KV bytes (FNV-1a 64 over 8-byte words, then mixed).
pub fn checksum(kv: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for c in kv.chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h ^= u64::from_le_bytes(w);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h ^ kv.len() as u64)
}

const VOCAB: &[&str] = &[
    "moon",
    "cake",
    "lunar",
    "cache",
    "block",
    "tensor",
    "prefill",
    "decode",
    "stream",
    "token",
    "layer",
    "key",
    "value",
    "rust",
    "engine",
    "router",
    "sidecar",
    "bootstrap",
    "transfer",
    "memory",
    "orbit",
    "crater",
    "tide",
    "phase",
    "silver",
    "night",
    "light",
    "quiet",
    "swift",
    "bright",
    "deep",
    "far",
];

/// Output token `i` of a generation whose KV checksum is `sum`: a word with a leading space.
pub fn output_token(sum: u64, i: usize) -> String {
    let w = VOCAB[(mix(sum ^ (i as u64).wrapping_mul(0x9e37_79b9)) % VOCAB.len() as u64) as usize];
    format!(" {w}")
}

/// The whole output text of `n` tokens.
pub fn output_text(sum: u64, n: usize) -> String {
    (0..n).map(|i| output_token(sum, i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_is_deterministic_and_prefix_chained() {
        let shape = KvShape {
            block_tokens: 2,
            block_bytes: 64,
        };
        let a = tokenize("a b c d e");
        let b = tokenize("a b c d f");
        assert_eq!(shape.blocks_for(a.len()), 3);
        let (ka, kb) = (compute_kv(&a, shape), compute_kv(&b, shape));
        assert_eq!(ka.len(), 3 * 64);
        assert_eq!(ka[..128], kb[..128], "shared full-block prefix, same KV");
        assert_ne!(ka[128..], kb[128..]);
        assert_eq!(ka, compute_kv(&a, shape));
        assert_ne!(output_text(checksum(&ka), 8), output_text(checksum(&kb), 8));
        let mut flipped = ka.clone();
        flipped[77] ^= 1;
        assert_ne!(checksum(&ka), checksum(&flipped));
    }
}
