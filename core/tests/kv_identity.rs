//! KV identity: the router keys a request's blocks exactly as the engine keys the blocks it
//! reports, so an adapter, a cache salt or an image never predicts a hit the engine cannot give.
//!
//! - The golden vector `fixtures/kv-events/vllm_identity_events` holds vLLM `BlockStored` events
//!   whose `extra_keys` are laid out as `generate_block_hash_extra_keys`
//!   (`vllm/v1/core/kv_cache_utils.py`) builds them; ingesting them must give the router hashes
//!   a request of the same identity computes.
//! - The property: blocks stored under one identity, looked up by a request of the same tokens
//!   under another, overlap exactly as far as both identities key the blocks alike.

use infera_core::event::{Event, Tier};
use infera_core::hashing::{ExtraKey, KvIdentity, MmRun, hash_prompt_blocks};
use infera_core::ids::{BlockHash, EngineHash, WorkerRank};
use infera_core::index::KvIndex;
use infera_core::kv_events::{
    EngineBatch, EngineEvent, decode_batch, encode_batch_vllm, to_core_events,
};
use proptest::prelude::*;
use serde_json::Value as Json;

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/../fixtures/kv-events/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn worker() -> WorkerRank {
    WorkerRank::new("10.0.0.7:8000", 0)
}

fn no_parent(_: Tier, _: EngineHash) -> Option<BlockHash> {
    None
}

fn identity_of(case: &Json) -> KvIdentity {
    let text = |k: &str| case[k].as_str().map(Box::from);
    KvIdentity {
        lora: text("lora"),
        salt: text("salt"),
        mm: case["mm"]
            .as_array()
            .expect("mm")
            .iter()
            .map(|m| MmRun {
                offset: m["offset"].as_u64().expect("offset") as u32,
                length: m["length"].as_u64().expect("length") as u32,
                id: m["id"].as_str().expect("id").into(),
            })
            .collect(),
    }
}

#[test]
fn vllm_extra_keys_ingest_to_the_hashes_a_request_of_that_identity_computes() {
    let bytes = fixture_bytes("vllm_identity_events.msgpack.hex");
    let doc: Json = serde_json::from_str(&fixture("vllm_identity_events.json")).expect("json");
    let bs = doc["block_size"].as_u64().expect("block_size") as usize;
    let batch = decode_batch(&bytes).expect("decode");
    assert!(batch.malformed.is_empty(), "{:?}", batch.malformed);
    let out = to_core_events(&batch, &worker(), bs as u32, &no_parent);
    assert_eq!(out.stats.dropped(), 0);
    let cases = doc["events"].as_array().expect("events");
    assert_eq!(out.events.len(), cases.len());
    let mut plain_differs = 0;
    for (event, case) in out.events.iter().zip(cases) {
        let Event::KvBlocksStored(stored) = event else {
            panic!("{event:?}")
        };
        let range = case["tokens"].as_array().expect("tokens");
        let (from, to) = (range[0].as_u64().unwrap(), range[1].as_u64().unwrap());
        let tokens: Vec<u32> = (from as u32..to as u32).collect();
        let identity = identity_of(case);
        assert_eq!(
            stored.router_hashes,
            hash_prompt_blocks(&tokens, bs, &identity),
            "{case}"
        );
        let plain = hash_prompt_blocks(&tokens, bs, &KvIdentity::default());
        plain_differs += usize::from(stored.router_hashes[0] != plain[0]);
    }
    // Every case but the image's (whose run starts inside block 0 too) keys its first block.
    assert_eq!(plain_differs, cases.len());
}

fn fixture_bytes(name: &str) -> Vec<u8> {
    let hex = fixture(name);
    let hex = hex.trim();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

/// `sglang_identity_events`: two pages of one sequence as SGLang 0.5.23 publishes them (tagged
/// maps with the adapter's `lora_name`, the request's `cache_salt` and `session_id`; SGLang has
/// no `extra_keys`), tokens 500..532.
#[test]
fn sglang_pages_are_keyed_by_their_adapter_and_salt() {
    let tokens: Vec<u32> = (500..532).collect();
    let wire = fixture_bytes("sglang_identity_events.msgpack.hex");
    let decoded = decode_batch(&wire).expect("decode");
    assert!(decoded.malformed.is_empty(), "{:?}", decoded.malformed);
    let out = to_core_events(&decoded, &worker(), 16, &no_parent);
    let hashes: Vec<BlockHash> = out
        .events
        .iter()
        .flat_map(|e| match e {
            Event::KvBlocksStored(s) => s.router_hashes.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    let identity = KvIdentity {
        lora: Some("sql".into()),
        salt: Some("tenant-a".into()),
        mm: Vec::new(),
    };
    assert_eq!(hashes, hash_prompt_blocks(&tokens, 16, &identity));
    let unsalted = KvIdentity {
        salt: None,
        ..identity
    };
    assert_ne!(hashes[0], hash_prompt_blocks(&tokens, 16, &unsalted)[0]);
}

/// An identity drawn from a few adapters, salts and images, each possibly absent.
fn identity() -> impl Strategy<Value = KvIdentity> {
    let name = |names: &'static [&'static str]| {
        prop::option::of(prop::sample::select(names)).prop_map(|n| n.map(Box::from))
    };
    let image = prop::option::of((
        prop::sample::select(&["cat.png", "dog.png"][..]),
        0u32..96,
        1u32..40,
    ));
    (name(&["alice", "bob"]), name(&["s1", "s2"]), image).prop_map(|(lora, salt, image)| {
        KvIdentity {
            lora,
            salt,
            mm: image
                .map(|(id, offset, length)| MmRun {
                    offset,
                    length,
                    id: id.into(),
                })
                .into_iter()
                .collect(),
        }
    })
}

/// The events a vLLM engine publishes for a prompt of `tokens` under `identity`.
fn stored_batch(tokens: &[u32], bs: usize, identity: &KvIdentity) -> EngineBatch {
    let blocks = tokens.len() / bs;
    let mut extra_keys = Vec::with_capacity(blocks);
    let mut keys = Vec::new();
    for i in 0..blocks {
        identity.block_keys((i * bs) as u32, ((i + 1) * bs) as u32, &mut keys);
        extra_keys.push(keys.clone());
    }
    EngineBatch {
        ts: 1.0,
        dp_rank: Some(0),
        events: vec![EngineEvent::BlockStored {
            block_hashes: (0..blocks as u64)
                .map(|h| EngineHash::from_u64(h + 1))
                .collect(),
            parent: None,
            token_ids: tokens[..blocks * bs].to_vec(),
            block_size: bs as u32,
            tier: Tier::Gpu,
            lora_id: None,
            lora_name: identity.lora.clone(),
            extra_keys: Some(extra_keys),
            cache_salt: None,
            indexable: true,
        }],
        ..EngineBatch::default()
    }
}

/// The leading blocks both identities key alike (the blocks the engine would share).
fn shared_blocks(a: &KvIdentity, b: &KvIdentity, blocks: usize, bs: usize) -> usize {
    let (mut ka, mut kb): (Vec<ExtraKey>, Vec<ExtraKey>) = (Vec::new(), Vec::new());
    (0..blocks)
        .take_while(|&i| {
            let (start, end) = ((i * bs) as u32, ((i + 1) * bs) as u32);
            a.block_keys(start, end, &mut ka);
            b.block_keys(start, end, &mut kb);
            ka == kb
        })
        .count()
}

proptest! {
    #[test]
    fn another_identity_never_predicts_a_block_the_engine_keyed_otherwise(
        stored in identity(),
        asked in identity(),
        tokens in prop::collection::vec(0u32..50_000, 16..160),
    ) {
        let bs = 16;
        let mut index = KvIndex::new();
        let slot = index.ensure_slot(&worker());
        // Through the wire format, as the engine's events arrive.
        let wire = encode_batch_vllm(&stored_batch(&tokens, bs, &stored));
        let batch = decode_batch(&wire).expect("decode");
        let out = to_core_events(&batch, &worker(), bs as u32, &no_parent);
        prop_assert_eq!(out.stats.dropped(), 0);
        for e in &out.events {
            if let Event::KvBlocksStored(s) = e {
                index.apply_stored(s);
            }
        }
        let request = hash_prompt_blocks(&tokens, bs, &asked);
        let mut overlap = Vec::new();
        index.overlap(Tier::Gpu, &request, &[slot], &mut overlap);
        let blocks = tokens.len() / bs;
        let shared = shared_blocks(&stored, &asked, blocks, bs);
        prop_assert_eq!(overlap[0] as usize, shared);
        if stored == asked {
            prop_assert_eq!(shared, blocks, "the same identity keeps the whole prefix");
        }
        if stored.lora != asked.lora || stored.salt != asked.salt {
            prop_assert_eq!(overlap[0], 0, "another adapter or salt shares no block");
        }
    }
}
