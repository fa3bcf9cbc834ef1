//! kvd's inventory as KV events: what a node's KV-cache daemon holds in host RAM (L2), on NVMe
//! (L3) and in the shared store (L4), so that the router credits a hit there (PROTOCOLS.md §3,
//! "kvd inventory").
//!
//! # Wire
//! A kvd publishes on the KV-event wire of vLLM ([`super`]): `BlockStored` / `BlockRemoved` with
//! `medium` `CPU` (L2), `DISK` (L3) or `EXTERNAL` (L4), no token ids and block size 0, and as
//! block hashes the blocks' *inventory hashes* ([`inventory_hash`]: the namespace and the
//! connector's key, which is all a kvd knows of a block); `AllBlocksCleared` when it starts, and
//! `KvdTierLoad` per tier with the speed of its recent loads.
//!
//! # Identity
//! A kvd is a pseudo worker rank, [`source_rank`] of its events endpoint, that is never routed
//! to. A worker names its node's kvd in its registration ([`KVD_EVENTS_ENDPOINT`], written by the
//! launcher from the kvd's `hello_ack`); [`link_of`] reads it, with a wildcard host taken as the
//! worker URL's host (one node, one host). The server subscribes to each kvd that a registered
//! worker names, once, and its events are folded for as long as one does
//! ([`crate::fleet::FleetState::links_kvd`]).
//!
//! # Request side
//! A kvd cannot see tokens, so the router derives the same names from the request:
//! [`request_hashes`] is [`inventory_hash`] of the connectors' keys
//! ([`scoped_block_keys`](crate::ports::kv_store::scoped_block_keys) under [`identity_scope`]), the blocks the worker's connector would
//! load. Both are pure functions of the prompt, the model and the request's KV identity.

use super::{EngineBatch, EngineEvent, IngestOutcome};
use crate::event::{
    Engine, Event, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, Tier, TierLoadMeasured,
    WorkerRecord,
};
use crate::hashing::KvIdentity;
use crate::ids::{BlockHash, EngineHash, WorkerId, WorkerRank};
use crate::ports::kv_events::resolve_wildcard_host;
use crate::ports::kv_store::KEY_BYTES;
#[cfg(test)]
use crate::ports::kv_store::scoped_block_keys;
use xxhash_rust::xxh3::Xxh3;

/// Our registration field: the PUB endpoint where the worker's node kvd publishes its
/// inventory (`tcp://HOST:PORT`, a wildcard host meaning the worker URL's host).
pub const KVD_EVENTS_ENDPOINT: &str = "kvd_events_endpoint";
/// Our registration field: that kvd's replay socket.
pub const KVD_EVENTS_REPLAY_ENDPOINT: &str = "kvd_events_replay_endpoint";
/// Our registration field: the namespace compat key the worker's connector writes under
/// (absent: `""`).
pub const KVD_COMPAT_KEY: &str = "kvd_compat_key";

/// What names a kvd's pseudo worker rank.
const SOURCE_PREFIX: &str = "kvd:";

/// A worker's node kvd, as its registration names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KvdLink {
    /// The events endpoint, with a wildcard host resolved.
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub compat_key: String,
}

impl KvdLink {
    /// The kvd's pseudo worker rank.
    pub fn source(&self) -> WorkerRank {
        source_rank(&self.endpoint)
    }
}

/// The kvd that `record`'s worker loads blocks from, if it names one.
pub fn link_of(record: &WorkerRecord) -> Option<KvdLink> {
    let field = |name: &str| record.extra.get(name).and_then(serde_json::Value::as_str);
    let endpoint = resolve_wildcard_host(field(KVD_EVENTS_ENDPOINT)?, &record.url)?;
    Some(KvdLink {
        endpoint,
        replay_endpoint: field(KVD_EVENTS_REPLAY_ENDPOINT)
            .and_then(|e| resolve_wildcard_host(e, &record.url)),
        compat_key: field(KVD_COMPAT_KEY).unwrap_or_default().to_owned(),
    })
}

/// The pseudo worker rank of the kvd publishing on `endpoint`.
pub fn source_rank(endpoint: &str) -> WorkerRank {
    WorkerRank::new(WorkerId::new(format!("{SOURCE_PREFIX}{endpoint}")), 0)
}

/// The events endpoint of the kvd `worker` names, if it names a kvd rather than an engine.
pub fn source_endpoint(worker: &WorkerId) -> Option<&str> {
    worker.as_str().strip_prefix(SOURCE_PREFIX)
}

/// Whether `worker` names a kvd rather than an engine.
pub fn is_source(worker: &WorkerId) -> bool {
    source_endpoint(worker).is_some()
}

/// The record a KV-event transport subscribes to for `link`: its endpoints, one rank.
pub fn source_record(link: &KvdLink, model: &str) -> WorkerRecord {
    let rank = link.source();
    let mut record = WorkerRecord::mixed(rank.worker, String::new(), model, Engine::Vllm, 0);
    record.kv_events_endpoint = Some(link.endpoint.clone());
    record.set_kv_events_replay_endpoint(link.replay_endpoint.clone());
    record
}

/// The name a kvd publishes for the block stored under `key` in namespace
/// `(model, compat_key)`: XXH3-64 of `model ‖ 0 ‖ compat_key ‖ 0 ‖ key`, so that one prefix in
/// two namespaces is two blocks, as in the daemon.
pub fn inventory_hash(model: &str, compat_key: &str, key: &[u8]) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(model.as_bytes());
    h.update(&[0]);
    h.update(compat_key.as_bytes());
    h.update(&[0]);
    h.update(key);
    BlockHash(h.digest())
}

/// The inventory hashes of the complete blocks of a prompt a worker of `model` would load
/// through its connector: [`inventory_hash`] of
/// [`scoped_block_keys`](crate::ports::kv_store::scoped_block_keys) under
/// [`identity_scope`].
pub fn request_hashes(
    model: &str,
    compat_key: &str,
    tokens: &[u32],
    block_size: usize,
    identity: &KvIdentity,
) -> Vec<BlockHash> {
    use sha2::{Digest as _, Sha256};
    if block_size == 0 {
        return Vec::new();
    }
    // The chain of `scoped_block_keys`, without a heap key per block (a test checks that both
    // agree): each key is hashed into its name as it is made.
    let scope = identity_scope(identity);
    let mut prev: Option<[u8; KEY_BYTES]> = (!scope.is_empty()).then(|| {
        let mut h = Sha256::new();
        h.update(b"infera-kv-scope\0");
        h.update(&scope);
        truncate(&h.finalize())
    });
    let mut bytes: Vec<u8> = Vec::with_capacity(block_size * 4);
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        let mut h = Sha256::new();
        if let Some(p) = &prev {
            h.update(p);
        }
        bytes.clear();
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        h.update(&bytes);
        let key = truncate(&h.finalize());
        out.push(inventory_hash(model, compat_key, &key));
        prev = Some(key);
    }
    out
}

fn truncate(digest: &[u8]) -> [u8; KEY_BYTES] {
    let mut key = [0u8; KEY_BYTES];
    key.copy_from_slice(&digest[..KEY_BYTES]);
    key
}

/// The connectors' key scope of a request's KV identity (empty for plain text): the compact
/// JSON object, keys sorted, of what the engine keys the blocks by besides tokens —
/// `{"lora":NAME,"mm":[[ID,OFFSET,LENGTH],…],"salt":SALT}`, absent members left out — as
/// `infera_kvd.vllm_connector.identity_scope` and the mock engine write it.
pub fn identity_scope(identity: &KvIdentity) -> Vec<u8> {
    if identity.is_plain() {
        return Vec::new();
    }
    let mut parts = serde_json::Map::new();
    if let Some(lora) = &identity.lora {
        parts.insert("lora".into(), lora.as_ref().into());
    }
    if !identity.mm.is_empty() {
        let runs = identity
            .mm
            .iter()
            .map(|r| serde_json::json!([r.id.as_ref(), r.offset, r.length]))
            .collect();
        parts.insert("mm".into(), serde_json::Value::Array(runs));
    }
    if let Some(salt) = &identity.salt {
        parts.insert("salt".into(), salt.as_ref().into());
    }
    // serde_json's map is ordered by key: the output is sorted, as Python's `sort_keys`.
    serde_json::to_vec(&parts).unwrap_or_default()
}

/// The event a kvd publishes when `tier` gained the blocks named `block_hashes`.
pub fn stored_event(tier: Tier, block_hashes: Vec<EngineHash>) -> EngineEvent {
    EngineEvent::BlockStored {
        block_hashes,
        parent: None,
        token_ids: Vec::new(),
        block_size: 0,
        tier,
        lora_id: None,
        lora_name: None,
        extra_keys: None,
        cache_salt: None,
        indexable: true,
    }
}

/// The event a kvd publishes when `tier` lost the blocks named `block_hashes`.
pub fn removed_event(tier: Tier, block_hashes: Vec<EngineHash>) -> EngineEvent {
    EngineEvent::BlockRemoved {
        block_hashes,
        tier,
        indexable: true,
    }
}

/// Turns one batch of kvd `source`'s inventory into core events: its hashes are the router's
/// already (inventory hashes name blocks the same way on both sides).
pub fn to_core_events(batch: &EngineBatch, source: &WorkerRank) -> IngestOutcome {
    let mut out = IngestOutcome::default();
    let stats = &mut out.stats;
    for ev in &batch.events {
        let event = match ev {
            EngineEvent::BlockStored {
                block_hashes, tier, ..
            } => {
                stats.stored += 1;
                stats.stored_blocks += block_hashes.len() as u32;
                Event::KvBlocksStored(KvBlocksStored {
                    worker: source.clone(),
                    tier: *tier,
                    block_size: 0,
                    engine_hashes: block_hashes.clone(),
                    router_hashes: block_hashes.iter().map(|h| BlockHash(h.0)).collect(),
                    parent: None,
                })
            }
            EngineEvent::BlockRemoved {
                block_hashes, tier, ..
            } => {
                stats.removed += 1;
                stats.removed_blocks += block_hashes.len() as u32;
                Event::KvBlocksRemoved(KvBlocksRemoved {
                    worker: source.clone(),
                    tier: *tier,
                    engine_hashes: block_hashes.clone(),
                    router_hashes: Vec::new(),
                })
            }
            EngineEvent::AllBlocksCleared => {
                stats.cleared += 1;
                Event::KvCacheCleared(KvCacheCleared {
                    worker: source.clone(),
                    tier: None,
                })
            }
            EngineEvent::TierLoad {
                tier,
                bytes_per_s,
                block_bytes,
            } => Event::TierLoadMeasured(TierLoadMeasured {
                source: source.clone(),
                tier: *tier,
                bytes_per_s: *bytes_per_s,
                block_bytes: *block_bytes,
            }),
        };
        out.events.push(event);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::hashing::MmRun;
    use crate::kv_events::{decode_batch, encode_batch_vllm};

    fn record(url: &str, endpoint: Option<&str>) -> WorkerRecord {
        let mut r = WorkerRecord::mixed(WorkerId::new("w"), url.into(), "m", Engine::Vllm, 16);
        if let Some(e) = endpoint {
            r.extra.insert(KVD_EVENTS_ENDPOINT.into(), e.into());
        }
        r
    }

    #[test]
    fn workers_on_one_node_name_one_kvd() {
        let a = link_of(&record("http://node7:8000", Some("tcp://*:5570"))).unwrap();
        let b = link_of(&record("http://node7:8001", Some("tcp://0.0.0.0:5570"))).unwrap();
        let c = link_of(&record("http://node8:8000", Some("tcp://*:5570"))).unwrap();
        assert_eq!(a.endpoint, "tcp://node7:5570");
        assert_eq!(a.source(), b.source());
        assert_ne!(a.source(), c.source());
        assert!(is_source(&a.source().worker));
        assert!(!is_source(&WorkerId::new("node7:8000")));
        assert_eq!(link_of(&record("http://node7:8000", None)), None);
        assert_eq!(
            link_of(&record("http://n:1", Some("ipc:///tmp/kvd"))),
            None,
            "only tcp endpoints are subscribed"
        );
    }

    #[test]
    fn inventory_hashes_follow_the_connector_keys_and_the_namespace() {
        let tokens: Vec<u32> = (0..64).collect();
        let plain = KvIdentity::default();
        let hashes = request_hashes("m", "", &tokens, 16, &plain);
        let keys = scoped_block_keys(&tokens, 16, &[]);
        assert_eq!(hashes.len(), 4);
        assert_eq!(hashes[2], inventory_hash("m", "", &keys[2]));
        assert_ne!(request_hashes("other", "", &tokens, 16, &plain), hashes);
        assert_ne!(request_hashes("m", "fp8", &tokens, 16, &plain), hashes);
        let salted = KvIdentity {
            salt: Some("tenant-a".into()),
            ..KvIdentity::default()
        };
        assert_ne!(request_hashes("m", "", &tokens, 16, &salted)[0], hashes[0]);
        let scoped = scoped_block_keys(&tokens, 16, &identity_scope(&salted));
        assert_eq!(
            request_hashes("m", "", &tokens, 16, &salted)[3],
            inventory_hash("m", "", &scoped[3])
        );
    }

    #[test]
    fn the_scope_is_python_sorted_compact_json() {
        let id = KvIdentity {
            lora: Some("sql".into()),
            salt: Some("s".into()),
            mm: vec![MmRun {
                offset: 3,
                length: 4,
                id: "img".into(),
            }],
        };
        // json.dumps({"lora": "sql", "salt": "s", "mm": [["img", 3, 4]]}, sort_keys=True,
        //            separators=(",", ":"), ensure_ascii=False)
        assert_eq!(
            String::from_utf8(identity_scope(&id)).unwrap(),
            r#"{"lora":"sql","mm":[["img",3,4]],"salt":"s"}"#
        );
        assert!(identity_scope(&KvIdentity::default()).is_empty());
    }

    #[test]
    fn a_kvd_batch_round_trips_the_wire_into_index_events() {
        let source = source_rank("tcp://n:5570");
        let batch = EngineBatch {
            ts: 1.0,
            dp_rank: None,
            events: vec![
                EngineEvent::AllBlocksCleared,
                stored_event(Tier::Host, vec![EngineHash(7), EngineHash(8)]),
                removed_event(Tier::Disk, vec![EngineHash(7)]),
                EngineEvent::TierLoad {
                    tier: Tier::External,
                    bytes_per_s: 1.5e9,
                    block_bytes: 4096,
                },
            ],
            ..EngineBatch::default()
        };
        let decoded = decode_batch(&encode_batch_vllm(&batch)).unwrap();
        assert_eq!(decoded.events, batch.events);
        let out = to_core_events(&decoded, &source);
        assert_eq!(out.events.len(), 4);
        match &out.events[1] {
            Event::KvBlocksStored(s) => {
                assert_eq!(s.router_hashes, vec![BlockHash(7), BlockHash(8)]);
                assert_eq!(s.tier, Tier::Host);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            &out.events[3],
            Event::TierLoadMeasured(t) if t.tier == Tier::External && t.block_bytes == 4096
        ));
    }
}
