//! KV identity beyond the tokens: what else an engine keys a cached block by.
//!
//! vLLM 0.33 (`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`) hashes each
//! block as `(parent, tokens, extra_keys)`, where `extra_keys` is, in this order:
//!
//! 1. the LoRA adapter, on every block of an adapter's request;
//! 2. each multimodal item whose placeholder run overlaps the block, with the run's offset from
//!    the block's first token (negative when the run started in an earlier block);
//! 3. the request's `cache_salt`, on the first block only (it then reaches every later block
//!    through the chain);
//! 4. a digest of the block's prompt embeddings, when the prompt is embeddings.
//!
//! Internally each key is tagged (`("lora", name, path)`, `("mm", id, offset)`, …); its
//! `BlockStored` events publish them untagged (`to_event_extra_keys`): the adapter's name, the
//! salt, `[mm_id, offset]` pairs and bare digests, one entry (or `nil`) per block.
//! The router folds the published keys into its own chain: a block with keys hashes as
//!
//! ```text
//! h[i] = XXH3-64([le_u64(h[i-1])] ‖ le_u32 tokens ‖ 0xFF ‖ key₀ ‖ key₁ ‖ …)
//! key  = 0x01 le_u32(len) utf-8                       a string (adapter name, salt)
//!      | 0x02 le_u32(len) utf-8 le_i64(offset)        a multimodal item and its offset
//!      | 0x03 le_u32(len) bytes                       bytes (an embeddings digest)
//!      | 0x04 le_i64(value)                           an integer
//!      | 0x05 le_u32(len) msgpack                     anything else, as the engine sent it
//! ```
//!
//! and a block with no keys hashes exactly as before (`crate::hashing`), so plain text keeps
//! its golden values. Equal keys and tokens give equal hashes; a different adapter, salt or image
//! gives a different block, as in the engine. The router computes a request's keys from the
//! request ([`KvIdentity`]); ingest takes them from the event.

use crate::ids::BlockHash;
use xxhash_rust::xxh3::Xxh3;

/// One element of a block's extra keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// A string: a LoRA adapter's name or a cache salt.
    Str(Box<str>),
    /// A multimodal item's identifier and the offset of its placeholder run from the block's
    /// first token.
    Mm { id: Box<str>, offset: i64 },
    /// Opaque bytes (a prompt-embeddings digest).
    Bytes(Box<[u8]>),
    /// An integer.
    Int(i64),
    /// A key of a shape this version does not know, as its msgpack encoding: it never equals
    /// anything the router computes, so such blocks are indexed but never predicted.
    Raw(Box<[u8]>),
}

impl ExtraKey {
    fn write(&self, h: &mut Xxh3) {
        let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        match self {
            ExtraKey::Str(s) => {
                h.update(&[1]);
                h.update(&len(s.len()));
                h.update(s.as_bytes());
            }
            ExtraKey::Mm { id, offset } => {
                h.update(&[2]);
                h.update(&len(id.len()));
                h.update(id.as_bytes());
                h.update(&offset.to_le_bytes());
            }
            ExtraKey::Bytes(b) => {
                h.update(&[3]);
                h.update(&len(b.len()));
                h.update(b);
            }
            ExtraKey::Int(v) => {
                h.update(&[4]);
                h.update(&v.to_le_bytes());
            }
            ExtraKey::Raw(b) => {
                h.update(&[5]);
                h.update(&len(b.len()));
                h.update(b);
            }
        }
    }
}

/// Hashes one block of `tokens` after `parent` with its extra `keys`; with no keys this is
/// [`super::hash_block`].
pub fn hash_block_keyed(tokens: &[u32], parent: Option<BlockHash>, keys: &[ExtraKey]) -> BlockHash {
    if keys.is_empty() {
        return super::hash_block(tokens, parent);
    }
    let mut h = Xxh3::new();
    if let Some(p) = parent {
        h.update(&p.0.to_le_bytes());
    }
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.update(&[0xFF]);
    for k in keys {
        k.write(&mut h);
    }
    BlockHash(h.digest())
}

/// One multimodal item of a prompt: its placeholder run and the identifier the engine keys it by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MmRun {
    /// Index of the run's first placeholder token in the prompt.
    pub offset: u32,
    /// Placeholder tokens in the run.
    pub length: u32,
    /// The item's identifier (vLLM's `mm_hash`, or the `uuid` the client or router gave it).
    pub id: Box<str>,
}

/// What besides its tokens identifies a request's KV blocks (see the module docs). The default
/// is plain text: no adapter, no salt, no multimodal items.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct KvIdentity {
    /// The LoRA adapter the request runs under (vLLM's `lora_name`).
    pub lora: Option<Box<str>>,
    /// The request's `cache_salt`.
    pub salt: Option<Box<str>>,
    /// Multimodal items, sorted by offset, not overlapping.
    pub mm: Vec<MmRun>,
}

impl KvIdentity {
    /// Whether blocks of this identity hash as plain text.
    pub fn is_plain(&self) -> bool {
        self.lora.is_none() && self.salt.is_none() && self.mm.is_empty()
    }

    /// The extra keys of the block of tokens `[start, end)`, in vLLM's order: adapter,
    /// multimodal items, salt (first block only).
    pub fn block_keys(&self, start: u32, end: u32, out: &mut Vec<ExtraKey>) {
        out.clear();
        if let Some(lora) = &self.lora {
            out.push(ExtraKey::Str(lora.clone()));
        }
        for run in &self.mm {
            let run_end = run.offset.saturating_add(run.length);
            if run.offset < end && start < run_end {
                out.push(ExtraKey::Mm {
                    id: run.id.clone(),
                    offset: i64::from(run.offset) - i64::from(start),
                });
            }
        }
        if start == 0
            && let Some(salt) = &self.salt
        {
            out.push(ExtraKey::Str(salt.clone()));
        }
    }
}

/// Hashes the complete blocks of a prompt's `tokens` under `identity` (see [`super::hash_blocks`]
/// for the chain); plain text takes the unkeyed fast path.
pub fn hash_prompt_blocks(
    tokens: &[u32],
    block_size: usize,
    identity: &KvIdentity,
) -> Vec<BlockHash> {
    hash_blocks_under(tokens, block_size, None, identity)
}

/// Like [`hash_prompt_blocks`] for blocks that continue a sequence after `parent` (`None`: they
/// start it). Block offsets count from `tokens[0]`, so only a sequence's first block takes the
/// salt.
pub fn hash_blocks_under(
    tokens: &[u32],
    block_size: usize,
    parent: Option<BlockHash>,
    identity: &KvIdentity,
) -> Vec<BlockHash> {
    if identity.is_plain() {
        return super::hash_blocks(tokens, block_size, parent);
    }
    let mut out = Vec::with_capacity(tokens.len().checked_div(block_size).unwrap_or(0));
    if block_size == 0 {
        return out;
    }
    let mut keys = Vec::new();
    let mut prev = parent;
    for (i, block) in tokens.chunks_exact(block_size).enumerate() {
        let start = u32::try_from(i * block_size).unwrap_or(u32::MAX);
        let end = start.saturating_add(u32::try_from(block_size).unwrap_or(u32::MAX));
        identity.block_keys(start, end, &mut keys);
        let h = hash_block_keyed(block, prev, &keys);
        out.push(h);
        prev = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::hash_blocks;

    fn toks() -> Vec<u32> {
        (0..64).collect()
    }

    fn lora(name: &str) -> KvIdentity {
        KvIdentity {
            lora: Some(name.into()),
            ..KvIdentity::default()
        }
    }

    #[test]
    fn plain_identity_keeps_the_plain_hashes() {
        assert_eq!(
            hash_prompt_blocks(&toks(), 16, &KvIdentity::default()),
            hash_blocks(&toks(), 16, None)
        );
        assert_eq!(
            hash_block_keyed(&toks()[..16], None, &[]),
            hash_blocks(&toks(), 16, None)[0]
        );
    }

    #[test]
    fn an_adapter_changes_every_block_and_each_adapter_differs() {
        let plain = hash_blocks(&toks(), 16, None);
        let a = hash_prompt_blocks(&toks(), 16, &lora("alice"));
        let b = hash_prompt_blocks(&toks(), 16, &lora("bob"));
        for i in 0..4 {
            assert_ne!(a[i], plain[i]);
            assert_ne!(a[i], b[i]);
        }
        assert_eq!(a, hash_prompt_blocks(&toks(), 16, &lora("alice")));
    }

    #[test]
    fn a_salt_keys_the_first_block_only() {
        let salted = KvIdentity {
            salt: Some("tenant-a".into()),
            ..KvIdentity::default()
        };
        let mut keys = Vec::new();
        salted.block_keys(0, 16, &mut keys);
        assert_eq!(keys, [ExtraKey::Str("tenant-a".into())]);
        salted.block_keys(16, 32, &mut keys);
        assert!(keys.is_empty());
        // Yet every block differs, through the chain.
        let plain = hash_blocks(&toks(), 16, None);
        let h = hash_prompt_blocks(&toks(), 16, &salted);
        assert!(h.iter().zip(&plain).all(|(a, b)| a != b));
    }

    #[test]
    fn a_multimodal_run_keys_the_blocks_it_overlaps_with_its_offset() {
        let image = KvIdentity {
            mm: vec![MmRun {
                offset: 20,
                length: 20,
                id: "img".into(),
            }],
            ..KvIdentity::default()
        };
        let mut keys = Vec::new();
        image.block_keys(0, 16, &mut keys);
        assert!(keys.is_empty(), "the run starts after block 0");
        image.block_keys(16, 32, &mut keys);
        assert_eq!(
            keys,
            [ExtraKey::Mm {
                id: "img".into(),
                offset: 4
            }]
        );
        image.block_keys(32, 48, &mut keys);
        assert_eq!(
            keys,
            [ExtraKey::Mm {
                id: "img".into(),
                offset: -12
            }]
        );
        image.block_keys(48, 64, &mut keys);
        assert!(keys.is_empty(), "the run ended at 40");
        let plain = hash_blocks(&toks(), 16, None);
        let h = hash_prompt_blocks(&toks(), 16, &image);
        assert_eq!(
            h[0], plain[0],
            "a block before the image is shared with plain text"
        );
        assert_ne!(h[1], plain[1]);
    }

    #[test]
    fn key_kinds_are_framed_apart() {
        let t = &toks()[..16];
        let s = hash_block_keyed(t, None, &[ExtraKey::Str("x".into())]);
        let b = hash_block_keyed(t, None, &[ExtraKey::Bytes(b"x".to_vec().into())]);
        let two = hash_block_keyed(
            t,
            None,
            &[ExtraKey::Str("a".into()), ExtraKey::Str("b".into())],
        );
        let one = hash_block_keyed(t, None, &[ExtraKey::Str("ab".into())]);
        assert_ne!(s, b);
        assert_ne!(two, one);
    }
}
