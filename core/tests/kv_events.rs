//! KV-event decoding, encoding and ingest against the golden vectors in `fixtures/kv-events` and
//! hand-built payloads of every shape the engines send.

use infera_core::event::{Event, Tier};
use infera_core::hashing::hash_blocks;
use infera_core::ids::{BlockHash, EngineHash, WorkerRank};
use infera_core::kv_events::{
    DecodeError, EngineBatch, EngineEvent, GroupKinds, decode_batch, decode_batch_with,
    encode_batch_vllm, to_core_events,
};
use proptest::prelude::*;
use rmpv::Value;
use serde_json::Value as Json;

const GOLDEN: [&str; 5] = [
    "vllm_legacy_array_events",
    "vllm_main_map_events",
    "vllm_main_bytes_hashes",
    "sglang_array_events_page16",
    "atom_array_events",
];

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/../fixtures/kv-events/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn unhex(s: &str) -> Vec<u8> {
    let s = s.trim();
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn golden_payload(name: &str) -> Vec<u8> {
    unhex(&fixture(&format!("{name}.msgpack.hex")))
}

/// The batch a golden `.json` describes, read independently of the msgpack decoder.
fn expected_from_json(name: &str) -> EngineBatch {
    let j: Json = serde_json::from_str(&fixture(&format!("{name}.json"))).expect("json");
    let top = j.as_array().expect("envelope array");
    let hash = |v: &Json| -> EngineHash {
        if let Some(u) = v.as_u64() {
            EngineHash::from_u64(u)
        } else if let Some(i) = v.as_i64() {
            EngineHash::from_i64(i)
        } else {
            EngineHash::from_bytes(&unhex(v.as_str().expect("hex hash")))
        }
    };
    let tier = |v: Option<&Json>| match v.and_then(Json::as_str) {
        None | Some("GPU") => Tier::Gpu,
        Some("CPU") => Tier::Host,
        Some(other) => panic!("unexpected medium {other} in golden"),
    };
    let mut events = Vec::new();
    for ev in top[1].as_array().expect("events") {
        let tag = match ev {
            Json::Array(a) => a[0].as_str().expect("tag"),
            Json::Object(m) => m["type"].as_str().expect("type"),
            other => panic!("bad golden event {other}"),
        };
        let get = |pos: usize, name: &str| json_field(ev, pos, name);
        let hashes = |v: Option<&Json>| -> Vec<EngineHash> {
            v.and_then(Json::as_array)
                .expect("hashes")
                .iter()
                .map(hash)
                .collect()
        };
        events.push(match tag {
            "BlockStored" => EngineEvent::BlockStored {
                block_hashes: hashes(get(0, "block_hashes")),
                parent: get(1, "parent_block_hash")
                    .filter(|v| !v.is_null())
                    .map(hash),
                token_ids: get(2, "token_ids")
                    .and_then(Json::as_array)
                    .expect("tokens")
                    .iter()
                    .map(|t| t.as_u64().expect("token") as u32)
                    .collect(),
                block_size: get(3, "block_size").and_then(Json::as_u64).expect("bs") as u32,
                tier: tier(get(5, "medium")),
                lora_id: get(4, "lora_id").and_then(Json::as_i64),
                lora_name: get(6, "lora_name").and_then(Json::as_str).map(Box::from),
                // The captures carry no keys (`nil` per block, or no field): decoded as none.
                extra_keys: {
                    let keys = get(7, "extra_keys").and_then(Json::as_array);
                    assert!(keys.is_none_or(|k| k.iter().all(Json::is_null)));
                    None
                },
                cache_salt: get(11, "cache_salt").and_then(Json::as_str).map(Box::from),
                indexable: matches!(
                    get(9, "kv_cache_spec_kind").and_then(Json::as_str),
                    None | Some("full_attention")
                ),
            },
            "BlockRemoved" => EngineEvent::BlockRemoved {
                block_hashes: hashes(get(0, "block_hashes")),
                tier: tier(get(1, "medium")),
                indexable: true,
            },
            "AllBlocksCleared" => EngineEvent::AllBlocksCleared,
            other => panic!("unexpected golden kind {other}"),
        });
    }
    EngineBatch {
        ts: top[0].as_f64().expect("ts"),
        dp_rank: top.get(2).and_then(Json::as_u64).map(|r| r as u32),
        events,
        skipped_unknown: 0,
        malformed: Vec::new(),
    }
}

/// Field `pos` (after the tag) of a tagged-array event, or field `name` of a tagged-map event.
fn json_field<'a>(ev: &'a Json, pos: usize, name: &str) -> Option<&'a Json> {
    match ev {
        Json::Array(a) => a.get(pos + 1),
        Json::Object(m) => m.get(name),
        _ => None,
    }
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encode");
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn arr(items: Vec<Value>) -> Value {
    Value::Array(items)
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn uints(v: impl IntoIterator<Item = u64>) -> Value {
    arr(v.into_iter().map(Value::from).collect())
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&arr(vec![Value::F64(1.5), arr(events), Value::from(0)]))
}

fn tokens(n: u32) -> Vec<u32> {
    (1000..1000 + n).collect()
}

// ---------------------------------------------------------------- golden vectors

#[test]
fn every_golden_vector_decodes_to_its_json() {
    for name in GOLDEN {
        let got = decode_batch(&golden_payload(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, expected_from_json(name), "{name}");
        assert!(got.malformed.is_empty(), "{name}");
        assert!(!got.events.is_empty(), "{name}");
    }
}

#[test]
fn golden_hash_values_match_hash_values_json() {
    let hv: Json = serde_json::from_str(&fixture("hash_values.json")).expect("json");
    let stored_hashes =
        |name: &str| match &decode_batch(&golden_payload(name)).expect("decode").events[0] {
            EngineEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
            other => panic!("{other:?}"),
        };
    let ints: Vec<EngineHash> = hv["vllm_int_hashes"]
        .as_array()
        .expect("ints")
        .iter()
        .map(|v| EngineHash::from_u64(v.as_u64().expect("u64")))
        .collect();
    assert_eq!(stored_hashes("vllm_main_map_events"), ints);
    assert_eq!(stored_hashes("vllm_legacy_array_events"), ints);
    let bytes: Vec<EngineHash> = hv["vllm_bytes_hashes_hex"]
        .as_array()
        .expect("hex")
        .iter()
        .map(|v| EngineHash::from_bytes(&unhex(v.as_str().expect("str"))))
        .collect();
    assert_eq!(stored_hashes("vllm_main_bytes_hashes"), bytes);
    let sg = hv["sglang_hashes_int64"].as_array().expect("sglang");
    assert_eq!(
        stored_hashes("sglang_array_events_page16"),
        vec![EngineHash::from_i64(sg[0].as_i64().expect("i64"))]
    );
}

#[test]
fn encoder_is_byte_compatible_with_vllm_main() {
    let payload = golden_payload("vllm_main_map_events");
    let batch = decode_batch(&payload).expect("decode");
    assert_eq!(encode_batch_vllm(&batch), payload);
}

#[test]
fn encoder_output_of_every_golden_round_trips() {
    for name in GOLDEN {
        let batch = decode_batch(&golden_payload(name)).expect("decode");
        // Bytes hashes are folded to u64 on decode, so they re-decode as those u64 values.
        let again = decode_batch(&encode_batch_vllm(&batch)).expect("re-decode");
        assert_eq!(again, batch, "{name}");
    }
}

// ---------------------------------------------------------------- shapes

#[test]
fn array_and_map_events_mix_in_one_batch() {
    let payload = batch(vec![
        arr(vec![
            s("BlockStored"),
            uints([11, 12]),
            Value::Nil,
            uints(tokens(32).into_iter().map(u64::from)),
            Value::from(16),
            Value::Nil,
            s("GPU"),
        ]),
        map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", uints([12])),
            ("medium", s("CPU")),
        ]),
        arr(vec![s("AllBlocksCleared")]),
        map(vec![("type", s("AllBlocksCleared"))]),
    ]);
    let b = decode_batch(&payload).expect("decode");
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.ts, 1.5);
    assert_eq!(
        b.events,
        vec![
            EngineEvent::BlockStored {
                block_hashes: vec![EngineHash(11), EngineHash(12)],
                parent: None,
                token_ids: tokens(32),
                block_size: 16,
                tier: Tier::Gpu,
                lora_id: None,
                lora_name: None,
                extra_keys: None,
                cache_salt: None,
                indexable: true,
            },
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash(12)],
                tier: Tier::Host,
                indexable: true,
            },
            EngineEvent::AllBlocksCleared,
            EngineEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn two_element_envelope_has_no_dp_rank() {
    let payload = encode(&arr(vec![
        Value::F64(2.0),
        arr(vec![arr(vec![s("AllBlocksCleared")])]),
    ]));
    let b = decode_batch(&payload).expect("decode");
    assert_eq!(b.dp_rank, None);
    assert_eq!(b.events, vec![EngineEvent::AllBlocksCleared]);
}

#[test]
fn bytes_hashes_are_folded_and_stable() {
    let digest = [7u8; 32];
    let payload = batch(vec![map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![Value::Binary(digest.to_vec())])),
        ("parent_block_hash", Value::Binary(vec![9u8; 32])),
        ("token_ids", uints(0..16u64)),
        ("block_size", Value::from(16)),
    ])]);
    match &decode_batch(&payload).expect("decode").events[0] {
        EngineEvent::BlockStored {
            block_hashes,
            parent,
            ..
        } => {
            assert_eq!(block_hashes, &vec![EngineHash::from_bytes(&digest)]);
            assert_eq!(parent, &Some(EngineHash::from_bytes(&[9u8; 32])));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn sglang_signed_hashes_and_eagle_token_pairs() {
    let pairs: Vec<Value> = tokens(16)
        .into_iter()
        .map(|t| arr(vec![Value::from(t), Value::from(t + 1)]))
        .collect();
    let payload = batch(vec![arr(vec![
        s("BlockStored"),
        arr(vec![Value::from(-5i64)]),
        Value::from(-3740211244669619095i64),
        arr(pairs),
        Value::from(16),
        Value::Nil,
        s("GPU"),
    ])]);
    match &decode_batch(&payload).expect("decode").events[0] {
        EngineEvent::BlockStored {
            block_hashes,
            parent,
            token_ids,
            ..
        } => {
            assert_eq!(block_hashes, &vec![EngineHash::from_i64(-5)]);
            assert_eq!(parent, &Some(EngineHash::from_i64(-3740211244669619095)));
            assert_eq!(token_ids, &tokens(16));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_kinds_are_skipped_and_counted() {
    let payload = batch(vec![
        arr(vec![
            s("BlockTransferred"),
            uints([1, 2]),
            s("GPU"),
            s("CPU"),
        ]),
        map(vec![("type", s("SomethingNew")), ("x", Value::from(1))]),
        arr(vec![s("AllBlocksCleared")]),
    ]);
    let b = decode_batch(&payload).expect("decode");
    assert_eq!(b.skipped_unknown, 2);
    assert_eq!(b.events, vec![EngineEvent::AllBlocksCleared]);
    assert!(b.malformed.is_empty());
}

#[test]
fn non_full_attention_groups_are_flagged_and_their_removals_too() {
    let stored = |group: i64, kind: &str| {
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", uints([1])),
            ("parent_block_hash", Value::Nil),
            ("token_ids", uints(0..16u64)),
            ("block_size", Value::from(16)),
            ("group_idx", Value::from(group)),
            ("kv_cache_spec_kind", s(kind)),
        ])
    };
    let removed = |group: i64| {
        map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", uints([1])),
            ("medium", s("GPU")),
            ("group_idx", Value::from(group)),
        ])
    };
    let flags = |b: &EngineBatch| -> Vec<bool> {
        b.events
            .iter()
            .map(|e| match e {
                EngineEvent::BlockStored { indexable, .. }
                | EngineEvent::BlockRemoved { indexable, .. } => *indexable,
                EngineEvent::AllBlocksCleared | EngineEvent::TierLoad { .. } => true,
            })
            .collect()
    };
    let b = decode_batch(&batch(vec![
        stored(0, "full_attention"),
        stored(1, "sliding_window"),
        stored(2, "mla_attention"),
        removed(0),
        removed(1),
    ]))
    .expect("decode");
    assert_eq!(flags(&b), vec![true, false, true, true, false]);

    // Across batches of one stream, a removal inherits its group's kind.
    let mut groups = GroupKinds::default();
    decode_batch_with(&batch(vec![stored(3, "mamba")]), &mut groups).expect("first");
    let b = decode_batch_with(&batch(vec![removed(3), removed(0)]), &mut groups).expect("second");
    assert_eq!(flags(&b), vec![false, true]);
}

// ---------------------------------------------------------------- errors

#[test]
fn malformed_events_name_index_and_field_and_spare_their_neighbours() {
    let payload = batch(vec![
        arr(vec![s("AllBlocksCleared")]),
        arr(vec![
            s("BlockStored"),
            s("not-a-list"),
            Value::Nil,
            uints([1]),
            Value::from(16),
        ]),
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", uints([1])),
            ("token_ids", arr(vec![s("x")])),
            ("block_size", Value::from(16)),
        ]),
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", uints([1])),
        ]),
        arr(vec![s("BlockRemoved"), uints([1]), Value::from(3)]),
        Value::from(42),
        arr(vec![Value::from(1)]),
        map(vec![("block_hashes", uints([1]))]),
        arr(vec![
            s("BlockStored"),
            uints([1]),
            Value::Nil,
            uints([u64::from(u32::MAX) + 1]),
            Value::from(16),
        ]),
        arr(vec![s("AllBlocksCleared")]),
    ]);
    let b = decode_batch(&payload).expect("envelope is fine");
    assert_eq!(b.events.len(), 2);
    let got: Vec<(usize, &str)> = b
        .malformed
        .iter()
        .map(|e| match e {
            DecodeError::Event { index, field, .. } => (*index, *field),
            other => panic!("{other}"),
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (1, "block_hashes"),
            (2, "token_ids"),
            (3, "token_ids"),
            (4, "medium"),
            (5, "event"),
            (6, "type"),
            (7, "type"),
            (8, "token_ids"),
        ]
    );
    let msg = b.malformed[0].to_string();
    assert!(
        msg.contains("#1") && msg.contains("BlockStored") && msg.contains("block_hashes"),
        "{msg}"
    );
    assert!(b.malformed.iter().all(|e| !e.is_envelope()));
}

#[test]
fn invalid_and_truncated_payloads_are_clear_errors() {
    // A batch cut inside its timestamp.
    let e = decode_batch(&[0x93, 0xcb, 0x41]).expect_err("truncated float");
    assert!(matches!(e, DecodeError::Msgpack(_)), "{e}");
    assert!(e.to_string().contains("not valid msgpack"), "{e}");
    // The reserved marker 0xc1 reads as nil: not a batch.
    let e = decode_batch(&[0xc1]).expect_err("reserved marker");
    assert!(e.is_envelope(), "{e}");
    let e = decode_batch(&[]).expect_err("empty");
    assert!(matches!(e, DecodeError::Msgpack(_)), "{e}");
    // Every strict prefix of every golden vector is rejected, never a panic.
    for name in GOLDEN {
        let p = golden_payload(name);
        for cut in 0..p.len() {
            let e = decode_batch(&p[..cut]).expect_err("truncated");
            assert!(e.is_envelope(), "{name} cut at {cut}: {e}");
        }
    }
    // A map where the envelope should be.
    let e = decode_batch(&encode(&map(vec![("ts", Value::F64(1.0))]))).expect_err("map");
    assert!(e.to_string().contains("envelope"), "{e}");
    // Absurd nesting hits the depth limit rather than the stack.
    let deep = vec![0x91u8; 100_000];
    assert!(decode_batch(&deep).is_err());
    // A huge declared length with no data behind it.
    assert!(decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn mutated_golden_bytes_never_panic(
        which in 0usize..GOLDEN.len(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
    ) {
        let mut p = golden_payload(GOLDEN[which]);
        for (pos, byte) in flips {
            let n = p.len();
            p[pos % n] = byte;
        }
        if let Ok(b) = decode_batch(&p) {
            // Whatever decodes, re-encodes and decodes again.
            let _ = decode_batch(&encode_batch_vllm(&b));
        }
    }
}

// ---------------------------------------------------------------- ingest

fn worker() -> WorkerRank {
    WorkerRank::new("10.0.0.5:30000", 0)
}

fn no_parent(_: Tier, _: EngineHash) -> Option<BlockHash> {
    None
}

fn router_hashes(e: &Event) -> Vec<BlockHash> {
    match e {
        Event::KvBlocksStored(s) => s.router_hashes.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn ingest_rehashes_tokens_chained_within_a_batch() {
    // SGLang: one event per page, the second naming the first as its parent.
    let b = decode_batch(&golden_payload("sglang_array_events_page16")).expect("decode");
    let all_tokens: Vec<u32> = b
        .events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::BlockStored { token_ids, .. } => Some(token_ids.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    let want = hash_blocks(&all_tokens, 16, None);
    let out = to_core_events(&b, &worker(), 16, &no_parent);
    assert_eq!(out.stats.stored, 2);
    assert_eq!(out.stats.removed, 1);
    assert_eq!(out.stats.cleared, 1);
    assert_eq!(out.stats.dropped(), 0);
    assert_eq!(router_hashes(&out.events[0]), want[..1]);
    assert_eq!(router_hashes(&out.events[1]), want[1..]);
    match &out.events[2] {
        Event::KvBlocksRemoved(r) => {
            assert_eq!(r.engine_hashes.len(), 1);
            assert!(r.router_hashes.is_empty());
        }
        other => panic!("{other:?}"),
    }
    match &out.events[3] {
        Event::KvCacheCleared(c) => {
            assert_eq!(c.tier, None);
            assert_eq!(c.worker, worker());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn ingest_chains_after_a_parent_known_to_the_index() {
    let toks = tokens(48);
    let full = hash_blocks(&toks, 16, None);
    let b = EngineBatch {
        events: vec![EngineEvent::BlockStored {
            block_hashes: vec![EngineHash(22), EngineHash(23)],
            parent: Some(EngineHash(21)),
            token_ids: toks[16..].to_vec(),
            block_size: 16,
            tier: Tier::Host,
            lora_id: None,
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            indexable: true,
        }],
        ..Default::default()
    };
    let lookup =
        |t: Tier, h: EngineHash| (t == Tier::Host && h == EngineHash(21)).then_some(full[0]);
    let out = to_core_events(&b, &worker(), 16, &lookup);
    assert_eq!(router_hashes(&out.events[0]), full[1..]);
    match &out.events[0] {
        Event::KvBlocksStored(s) => {
            assert_eq!(s.tier, Tier::Host);
            assert_eq!(s.parent, Some(EngineHash(21)));
            assert_eq!(s.engine_hashes, vec![EngineHash(22), EngineHash(23)]);
        }
        other => panic!("{other:?}"),
    }
    // The same parent in another tier is unknown.
    let mut other_tier = b.clone();
    if let EngineEvent::BlockStored { tier, .. } = &mut other_tier.events[0] {
        *tier = Tier::Gpu;
    }
    let out = to_core_events(&other_tier, &worker(), 16, &lookup);
    assert!(out.events.is_empty());
    assert_eq!(out.stats.unknown_parent, 1);
}

#[test]
fn ingest_drops_and_counts_what_it_cannot_index() {
    let stored =
        |hashes: Vec<u64>, parent: Option<u64>, toks: Vec<u32>, bs: u32| EngineEvent::BlockStored {
            block_hashes: hashes.into_iter().map(EngineHash).collect(),
            parent: parent.map(EngineHash),
            token_ids: toks,
            block_size: bs,
            tier: Tier::Gpu,
            lora_id: None,
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            indexable: true,
        };
    let b = EngineBatch {
        dp_rank: Some(3),
        events: vec![
            // unknown parent
            stored(vec![2], Some(1), tokens(16), 16),
            // block size mismatch
            stored(vec![3], None, tokens(32), 32),
            // token count not blocks × block size
            stored(vec![4, 5], None, tokens(20), 16),
            // non-full-attention
            EngineEvent::BlockStored {
                block_hashes: vec![EngineHash(6)],
                parent: None,
                token_ids: tokens(16),
                block_size: 16,
                tier: Tier::Gpu,
                lora_id: None,
                lora_name: None,
                extra_keys: None,
                cache_salt: None,
                indexable: false,
            },
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash(6)],
                tier: Tier::Gpu,
                indexable: false,
            },
            // fine, then removed, then used as a parent: unknown
            stored(vec![7], None, tokens(16), 16),
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash(7)],
                tier: Tier::Gpu,
                indexable: true,
            },
            stored(vec![8], Some(7), tokens(16), 16),
            // the index knows 9, but the cache was cleared in this batch
            EngineEvent::AllBlocksCleared,
            stored(vec![10], Some(9), tokens(16), 16),
        ],
        ..Default::default()
    };
    let lookup = |_: Tier, h: EngineHash| (h == EngineHash(9)).then_some(BlockHash(99));
    let out = to_core_events(&b, &worker(), 16, &lookup);
    let s = out.stats;
    assert_eq!(s.unknown_parent, 3);
    assert_eq!(s.block_size_mismatch, 1);
    assert_eq!(s.token_count_mismatch, 1);
    assert_eq!(s.dropped_non_full_attention, 2);
    assert_eq!(s.dp_rank_mismatch, 1);
    assert_eq!((s.stored, s.removed, s.cleared), (1, 1, 1));
    assert_eq!(s.dropped(), 7);
    let kinds: Vec<&str> = out.events.iter().map(Event::kind).collect();
    assert_eq!(
        kinds,
        vec!["kv_blocks_stored", "kv_blocks_removed", "kv_cache_cleared"]
    );
}
