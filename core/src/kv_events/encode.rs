//! The vLLM ≥ 0.26 encoder, used by the mock engine so that it publishes exactly what vLLM does.
//!
//! Layout (msgspec's encoding of vLLM's structs: every int in its most compact msgpack form, the
//! timestamp always a float64, map keys in declaration order):
//!
//! ```text
//! [ts: float64, [event, ...], dp_rank: int | nil]
//! BlockStored      {"type", "block_hashes": [uint], "parent_block_hash": uint | nil,
//!                   "token_ids": [uint], "block_size", "lora_id": int | nil, "medium",
//!                   "lora_name": str | nil, "extra_keys": [[key, ...] | nil; blocks],
//!                   "group_idx": 0 | 1,
//!                   "kv_cache_spec_kind": "full_attention" | "sliding_window"}
//! BlockRemoved     {"type", "block_hashes": [uint], "medium", "group_idx": 0 | 1}
//! AllBlocksCleared {"type"}
//! KvdTierLoad      {"type", "medium", "bytes_per_s": float64, "block_bytes": uint}   (ours)
//! ```
//!
//! Engine hashes are written as their 64-bit value (vLLM's default int hashes). Indexable events
//! are written as group 0, `full_attention`; non-indexable ones as group 1, `sliding_window`, so a
//! decoder's [`super::GroupKinds`] flags that group's removals too.

use super::{EngineBatch, EngineEvent, medium_of_tier};
use crate::hashing::ExtraKey;

/// Encodes a batch as vLLM ≥ 0.26 publishes it (tagged maps, u64 hashes).
///
/// [`EngineBatch::skipped_unknown`] and [`EngineBatch::malformed`] are not encoded.
pub fn encode_batch_vllm(batch: &EngineBatch) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + batch.events.len() * 256));
    w.array_len(3);
    w.f64(batch.ts);
    w.array_len(batch.events.len());
    for ev in &batch.events {
        match ev {
            EngineEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                tier,
                lora_id,
                lora_name,
                extra_keys,
                // vLLM carries the salt in `extra_keys`.
                cache_salt: _,
                indexable,
            } => {
                w.map_len(11);
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.array_len(block_hashes.len());
                for h in block_hashes {
                    w.uint(h.0);
                }
                w.str("parent_block_hash");
                match parent {
                    Some(p) => w.uint(p.0),
                    None => w.nil(),
                }
                w.str("token_ids");
                w.array_len(token_ids.len());
                for &t in token_ids {
                    w.uint(u64::from(t));
                }
                w.str("block_size");
                w.uint(u64::from(*block_size));
                w.str("lora_id");
                match lora_id {
                    Some(id) => w.int(*id),
                    None => w.nil(),
                }
                w.str("medium");
                w.str(medium_of_tier(*tier));
                w.str("lora_name");
                match lora_name {
                    Some(name) => w.str(name),
                    None => w.nil(),
                }
                w.str("extra_keys");
                w.array_len(block_hashes.len());
                for i in 0..block_hashes.len() {
                    match extra_keys.as_ref().and_then(|k| k.get(i)) {
                        Some(keys) if !keys.is_empty() => {
                            w.array_len(keys.len());
                            keys.iter().for_each(|k| w.key(k));
                        }
                        _ => w.nil(),
                    }
                }
                w.str("group_idx");
                w.uint(group_of(*indexable));
                w.str("kv_cache_spec_kind");
                w.str(if *indexable {
                    "full_attention"
                } else {
                    "sliding_window"
                });
            }
            EngineEvent::BlockRemoved {
                block_hashes,
                tier,
                indexable,
            } => {
                w.map_len(4);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.array_len(block_hashes.len());
                for h in block_hashes {
                    w.uint(h.0);
                }
                w.str("medium");
                w.str(medium_of_tier(*tier));
                w.str("group_idx");
                w.uint(group_of(*indexable));
            }
            EngineEvent::AllBlocksCleared => {
                w.map_len(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
            EngineEvent::TierLoad {
                tier,
                bytes_per_s,
                block_bytes,
            } => {
                w.map_len(4);
                w.str("type");
                w.str("KvdTierLoad");
                w.str("medium");
                w.str(medium_of_tier(*tier));
                w.str("bytes_per_s");
                w.f64(*bytes_per_s);
                w.str("block_bytes");
                w.uint(*block_bytes);
            }
        }
    }
    match batch.dp_rank {
        Some(r) => w.uint(u64::from(r)),
        None => w.nil(),
    }
    w.0
}

/// Group 0 is full attention; non-indexable blocks are written as group 1, a sliding window.
fn group_of(indexable: bool) -> u64 {
    if indexable { 0 } else { 1 }
}

/// A msgpack writer into a `Vec` (infallible), each value in its most compact form.
struct Writer(Vec<u8>);

impl Writer {
    /// One extra key as vLLM's msgspec writes it (a tuple as an array).
    fn key(&mut self, k: &ExtraKey) {
        match k {
            ExtraKey::Str(s) => self.str(s),
            ExtraKey::Mm { id, offset } => {
                self.array_len(2);
                self.str(id);
                self.int(*offset);
            }
            ExtraKey::Bytes(b) => {
                if let Ok(n) = u8::try_from(b.len()) {
                    self.0.extend_from_slice(&[0xc4, n]);
                } else if let Ok(n) = u16::try_from(b.len()) {
                    self.0.push(0xc5);
                    self.0.extend_from_slice(&n.to_be_bytes());
                } else {
                    self.0.push(0xc6);
                    self.0.extend_from_slice(&(b.len() as u32).to_be_bytes());
                }
                self.0.extend_from_slice(b);
            }
            ExtraKey::Int(v) => self.int(*v),
            ExtraKey::Raw(b) => self.0.extend_from_slice(b),
        }
    }

    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            self.0.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.0.push(0xcd);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.0.push(0xce);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn int(&mut self, v: i64) {
        if let Ok(u) = u64::try_from(v) {
            return self.uint(u);
        }
        if v >= -32 {
            self.0.push(v as u8);
        } else if let Ok(v) = i8::try_from(v) {
            self.0.extend_from_slice(&[0xd0, v as u8]);
        } else if let Ok(v) = i16::try_from(v) {
            self.0.push(0xd1);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i32::try_from(v) {
            self.0.push(0xd2);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn str(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.0.push(0xa0 | n as u8);
        } else if let Ok(n) = u8::try_from(n) {
            self.0.extend_from_slice(&[0xd9, n]);
        } else if let Ok(n) = u16::try_from(n) {
            self.0.push(0xda);
            self.0.extend_from_slice(&n.to_be_bytes());
        } else {
            self.0.push(0xdb);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    fn array_len(&mut self, n: usize) {
        self.container_len(n, 0x90, 0xdc, 0xdd);
    }

    fn map_len(&mut self, n: usize) {
        self.container_len(n, 0x80, 0xde, 0xdf);
    }

    fn container_len(&mut self, n: usize, fix: u8, m16: u8, m32: u8) {
        if n < 16 {
            self.0.push(fix | n as u8);
        } else if let Ok(n) = u16::try_from(n) {
            self.0.push(m16);
            self.0.extend_from_slice(&n.to_be_bytes());
        } else {
            self.0.push(m32);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::decode_batch;
    use super::*;
    use crate::event::Tier;
    use crate::ids::EngineHash;

    #[test]
    fn every_int_width_round_trips() {
        let hashes: Vec<EngineHash> = [0u64, 127, 128, 255, 256, 65_535, 65_536, u64::MAX]
            .into_iter()
            .map(EngineHash::from_u64)
            .collect();
        let batch = EngineBatch {
            ts: 1.25,
            dp_rank: Some(300),
            events: vec![
                EngineEvent::BlockStored {
                    block_hashes: hashes.clone(),
                    parent: Some(EngineHash::from_u64(5)),
                    token_ids: (0..128).map(|i| i * 40_000).collect(),
                    block_size: 16,
                    tier: Tier::Host,
                    lora_id: Some(-40_000),
                    lora_name: Some("alice".into()),
                    // Every key kind, and empty entries (written as nil, read back as empty).
                    extra_keys: Some(vec![
                        vec![ExtraKey::Str("alice".into()), ExtraKey::Str("salt".into())],
                        vec![ExtraKey::Mm {
                            id: "img".repeat(20).into(),
                            offset: -6,
                        }],
                        vec![ExtraKey::Bytes(vec![7; 300].into())],
                        vec![ExtraKey::Int(-40_000)],
                        Vec::new(),
                        vec![ExtraKey::Bytes(vec![1; 70_000].into())],
                        vec![],
                        vec![ExtraKey::Mm {
                            id: "i".into(),
                            offset: 3,
                        }],
                    ]),
                    cache_salt: None,
                    indexable: false,
                },
                EngineEvent::BlockRemoved {
                    block_hashes: hashes,
                    tier: Tier::Disk,
                    indexable: true,
                },
                EngineEvent::AllBlocksCleared,
            ],
            ..Default::default()
        };
        let bytes = encode_batch_vllm(&batch);
        assert_eq!(decode_batch(&bytes).expect("decode"), batch);
    }

    #[test]
    fn negative_ints_use_compact_forms() {
        for (v, want) in [
            (-1i64, vec![0xff]),
            (-32, vec![0xe0]),
            (-33, vec![0xd0, 0xdf]),
            (-129, vec![0xd1, 0xff, 0x7f]),
        ] {
            let mut w = Writer(Vec::new());
            w.int(v);
            assert_eq!(w.0, want, "{v}");
        }
    }
}
