//! Block hashing: the router's own, engine-independent identity of a prompt prefix.
//!
//! A prompt of token ids is cut into complete blocks of `block_size` tokens; a trailing partial
//! block is not hashed. Block `i` hashes to
//!
//! ```text
//! h[0] = XXH3-64(le_u32(t[0]) ‖ … ‖ le_u32(t[B-1]))
//! h[i] = XXH3-64(le_u64(h[i-1]) ‖ le_u32(t[iB]) ‖ … ‖ le_u32(t[iB+B-1]))
//! ```
//!
//! so equal hashes mean equal prefixes (up to 64-bit collisions). A block the engine keys by more
//! than its tokens (a LoRA adapter, a cache salt, an image) folds those keys in after its tokens
//! ([`identity`]). Golden values live in
//! `fixtures/hashing/golden.json` and must never change: recorded traces and snapshots depend on them.

pub mod identity;

pub use identity::{
    ExtraKey, KvIdentity, MmRun, hash_block_keyed, hash_blocks_under, hash_prompt_blocks,
};

use crate::ids::BlockHash;
use xxhash_rust::xxh3::Xxh3;

/// Hashes the complete blocks of `tokens`, chained after `parent` (the hash of the block just
/// before `tokens[0]`, or `None` at the start of a prompt).
///
/// Returns one hash per complete block; `block_size == 0` yields no blocks.
pub fn hash_blocks(tokens: &[u32], block_size: usize, parent: Option<BlockHash>) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len().checked_div(block_size).unwrap_or(0));
    extend_block_hashes(tokens, block_size, parent, &mut out);
    out
}

/// Like [`hash_blocks`], appending to `out` (lets callers reuse a buffer on hot paths).
pub fn extend_block_hashes(
    tokens: &[u32],
    block_size: usize,
    parent: Option<BlockHash>,
    out: &mut Vec<BlockHash>,
) {
    if block_size == 0 {
        return;
    }
    let mut prev = parent;
    // Layout per block: [le_u64 parent (absent for the first block)] ++ [le_u32 token]*.
    let mut buf = vec![0u8; 8 + 4 * block_size];
    out.reserve(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        for (dst, t) in buf[8..].chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        let bytes = match prev {
            Some(p) => {
                buf[..8].copy_from_slice(&p.0.to_le_bytes());
                &buf[..]
            }
            None => &buf[8..],
        };
        let h = BlockHash(xxhash_rust::xxh3::xxh3_64(bytes));
        out.push(h);
        prev = Some(h);
    }
}

/// Hashes one block given its parent; the building block of [`hash_blocks`].
pub fn hash_block(tokens: &[u32], parent: Option<BlockHash>) -> BlockHash {
    let mut h = Xxh3::new();
    if let Some(p) = parent {
        h.update(&p.0.to_le_bytes());
    }
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    BlockHash(h.digest())
}

/// Deterministic synthetic token ids for a block named by an opaque id (a trace's `hash_ids`),
/// so that prefix sharing in a trace becomes prefix sharing of real token sequences.
pub fn synthetic_block_tokens(block_id: u64, block_size: usize, out: &mut Vec<u32>) {
    let mut s = block_id ^ 0x9E37_79B9_7F4A_7C15;
    for _ in 0..block_size {
        s = crate::rng::splitmix64(&mut s);
        // Keep ids inside a 100k vocabulary so they are valid for real tokenizers too.
        out.push((s % 100_000) as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_blocks_are_not_hashed() {
        let toks: Vec<u32> = (0..40).collect();
        assert_eq!(hash_blocks(&toks, 16, None).len(), 2);
        assert!(hash_blocks(&toks[..15], 16, None).is_empty());
        assert!(hash_blocks(&toks, 0, None).is_empty());
    }

    #[test]
    fn chaining_matches_single_block_hashing() {
        let toks: Vec<u32> = (100..164).collect();
        let all = hash_blocks(&toks, 16, None);
        let mut parent = None;
        for (i, chunk) in toks.chunks_exact(16).enumerate() {
            let h = hash_block(chunk, parent);
            assert_eq!(h, all[i]);
            parent = Some(h);
        }
        // Continuing from a parent gives the same tail as hashing the whole prompt.
        let tail = hash_blocks(&toks[32..], 16, Some(all[1]));
        assert_eq!(tail, all[2..]);
    }

    #[test]
    fn same_block_under_different_prefixes_differs() {
        let a: Vec<u32> = [vec![1u32; 16], vec![7u32; 16]].concat();
        let b: Vec<u32> = [vec![2u32; 16], vec![7u32; 16]].concat();
        assert_ne!(hash_blocks(&a, 16, None)[1], hash_blocks(&b, 16, None)[1]);
    }

    #[test]
    fn golden_values_never_change() {
        let text = include_str!("../../fixtures/hashing/golden.json");
        let golden: serde_json::Value = serde_json::from_str(text).expect("golden json");
        let cases = golden["cases"].as_array().expect("cases");
        assert!(!cases.is_empty());
        for case in cases {
            let toks: Vec<u32> = case["tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|v| v.as_u64().expect("token") as u32)
                .collect();
            let bs = case["block_size"].as_u64().expect("block_size") as usize;
            let want: Vec<u64> = case["hashes"]
                .as_array()
                .expect("hashes")
                .iter()
                .map(|v| u64::from_str_radix(v.as_str().expect("hex"), 16).expect("hex"))
                .collect();
            let got: Vec<u64> = hash_blocks(&toks, bs, None).iter().map(|h| h.0).collect();
            assert_eq!(got, want, "golden case {}", case["name"]);
        }
    }
}
