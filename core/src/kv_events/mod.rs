//! Engine KV events: decoding every wire shape vLLM, SGLang and ATOM publish, encoding vLLM's, and
//! turning decoded batches into the router's core events.
//!
//! This module is pure: no sockets. Transports deliver raw frames through the KV-event source
//! port ([`crate::ports::kv_events`]); [`pipeline`] is the one place that decodes them.
//!
//! # Wire layout (PROTOCOLS.md §3)
//!
//! ZeroMQ PUB multipart frames: `[topic, seq (u64 big-endian, 8 bytes), payload]` for vLLM and
//! SGLang (seq starts at 0 per engine process); ATOM sends `[payload]` or `[topic, payload]`.
//! The payload is one msgpack value, the batch:
//!
//! ```text
//! batch  = [ts: float, events: [event, ...], dp_rank: int | nil]   (older engines: [ts, events])
//! event  = ["BlockStored", f0, f1, ...]                  tagged array, fields by position
//!        | {"type": "BlockStored", "block_hashes": ..., ...}   tagged map, fields by name
//! BlockStored      fields: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!                          medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//!                          kv_cache_spec_sliding_window   (trailing fields may be absent);
//!                          SGLang's maps add cache_salt and session_id
//! BlockRemoved     fields: block_hashes, medium, group_idx
//! AllBlocksCleared fields: none (ATOM sends one nil)
//! KvdTierLoad      fields: medium, bytes_per_s (float or int), block_bytes   (ours: kvd's
//!                          measured load speed per tier, [`kvd`])
//! hash   = uint (vLLM, ATOM) | negative or positive int (SGLang's signed i64) | bin (vLLM digests)
//! token  = uint | [uint, uint]   (SGLang under EAGLE/MTP sends pairs; the first is the token)
//! medium = "GPU" | "cuda" | nil → Gpu;  "CPU" → Host;  "disk" → Disk;  any other → External
//!          (case-insensitive)
//! ```
//!
//! Every kind other than the three above (ATOM's `BlockTransferred`, future kinds) is skipped and
//! counted in [`EngineBatch::skipped_unknown`]. Only full-attention KV groups are indexable
//! (`kv_cache_spec_kind` absent, `full_attention` or `mla_attention`); events of other groups
//! (sliding window, mamba, ...) are decoded with `indexable: false` so the ingestor drops them.
//! `BlockRemoved` carries only `group_idx`: it inherits the flag of the `BlockStored` events of the
//! same group seen earlier on the same stream (see [`GroupKinds`]).
//!
//! # Errors
//!
//! A payload whose envelope is malformed (not msgpack, not an array of 2 or 3+ elements, `ts` not a
//! number, `events` not an array, `dp_rank` neither int nor nil, trailing bytes) is rejected whole
//! with a [`DecodeError`] naming what was wrong. A malformed event inside a good envelope does not
//! reject its neighbours: it is left out of [`EngineBatch::events`] and reported in
//! [`EngineBatch::malformed`] as a [`DecodeError::Event`] naming the event's index and field.
//! Decoding never panics on any input (a property test feeds it random bytes).

mod decode;
mod encode;
pub mod ingest;
pub mod kvd;
pub mod pipeline;
mod seq;

pub use decode::{GroupKinds, decode_batch, decode_batch_with};
pub use encode::encode_batch_vllm;
pub use ingest::{IngestOutcome, IngestStats, to_core_events};
pub use seq::{SeqStatus, StreamSeq};

use crate::event::Tier;
use crate::hashing::ExtraKey;
use crate::ids::EngineHash;

/// One decoded payload: a batch of events from one engine (one dp rank).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineBatch {
    /// The engine's timestamp (seconds since the epoch, as a float).
    pub ts: f64,
    /// The dp rank the engine put in the batch, if any (absent in 2-element batches).
    pub dp_rank: Option<u32>,
    /// The well-formed events of known kinds, in wire order.
    pub events: Vec<EngineEvent>,
    /// Events of kinds this decoder does not know (e.g. ATOM's `BlockTransferred`), skipped.
    pub skipped_unknown: u32,
    /// Events that were malformed and left out, each a [`DecodeError::Event`].
    pub malformed: Vec<DecodeError>,
}

/// One KV-cache event as the engine reported it (engine hashes, not router hashes).
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Consecutive blocks of one sequence were stored, `block_size` tokens each.
    BlockStored {
        /// The engine's keys, one per block.
        block_hashes: Vec<EngineHash>,
        /// The engine key of the block just before the first one (`None` at a sequence start).
        parent: Option<EngineHash>,
        /// The tokens of all the blocks, `block_size` per block.
        token_ids: Vec<u32>,
        block_size: u32,
        tier: Tier,
        lora_id: Option<i64>,
        /// The adapter's name (vLLM keys an adapter's blocks by it).
        lora_name: Option<Box<str>>,
        /// Each block's extra keys (see [`crate::hashing::identity`]), when the engine reports
        /// them (`extra_keys`, vLLM 0.11+): one entry per block, empty for a plain block.
        extra_keys: Option<Vec<Vec<ExtraKey>>>,
        /// The request's salt, as SGLang reports it (vLLM reports it in `extra_keys`).
        cache_salt: Option<Box<str>>,
        /// False for blocks of a non-full-attention KV group: the ingestor drops them.
        indexable: bool,
    },
    /// Blocks were evicted.
    BlockRemoved {
        block_hashes: Vec<EngineHash>,
        tier: Tier,
        /// False for blocks of a non-full-attention KV group: the ingestor drops them.
        indexable: bool,
    },
    /// The engine dropped its whole cache.
    AllBlocksCleared,
    /// How fast the publisher loads blocks of `tier` back into engines (ours, sent by kvd: the
    /// median of its recent loads, and their mean block size in bytes).
    TierLoad {
        tier: Tier,
        bytes_per_s: f64,
        block_bytes: u64,
    },
}

impl EngineEvent {
    /// The event's wire tag.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineEvent::BlockStored { .. } => "BlockStored",
            EngineEvent::BlockRemoved { .. } => "BlockRemoved",
            EngineEvent::AllBlocksCleared => "AllBlocksCleared",
            EngineEvent::TierLoad { .. } => "KvdTierLoad",
        }
    }
}

/// Why a payload, or one event of it, could not be decoded.
///
/// No variant is worth retrying: the bytes are what the engine sent. The subscriber counts them
/// and moves on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// The payload is not one complete msgpack value.
    #[error("kv-event payload is not valid msgpack: {0}")]
    Msgpack(String),
    /// The payload holds more than the batch.
    #[error("kv-event payload has {0} trailing byte(s) after the batch")]
    TrailingBytes(usize),
    /// The batch envelope `[ts, events, dp_rank]` is malformed.
    #[error("kv-event batch envelope: {0}")]
    Envelope(String),
    /// One event is malformed; the rest of its batch decoded.
    #[error("kv-event #{index} ({kind}): field `{field}`: {problem}")]
    Event {
        /// Position of the event in the batch's event list.
        index: usize,
        /// The event's tag, or `?` when the tag itself is what is wrong.
        kind: String,
        /// The field that is wrong (`type` for the tag, `event` for the event's shape).
        field: &'static str,
        problem: String,
    },
}

impl DecodeError {
    /// True when the whole payload was rejected (anything but [`DecodeError::Event`]).
    pub fn is_envelope(&self) -> bool {
        !matches!(self, DecodeError::Event { .. })
    }
}

/// Maps an engine's `medium` string to a tier (`None` means the engine's default, the GPU).
pub fn tier_from_medium(medium: Option<&str>) -> Tier {
    match medium {
        None => Tier::Gpu,
        Some(m) if m.eq_ignore_ascii_case("gpu") || m.eq_ignore_ascii_case("cuda") => Tier::Gpu,
        Some(m) if m.eq_ignore_ascii_case("cpu") => Tier::Host,
        Some(m) if m.eq_ignore_ascii_case("disk") => Tier::Disk,
        Some(_) => Tier::External,
    }
}

/// The `medium` string vLLM writes for a tier.
pub fn medium_of_tier(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Host => "CPU",
        Tier::Disk => "DISK",
        Tier::External => "EXTERNAL",
    }
}

/// Whether a `kv_cache_spec_kind` names a group the router indexes (full attention).
pub fn is_indexable_spec_kind(kind: Option<&str>) -> bool {
    matches!(kind, None | Some("full_attention") | Some("mla_attention"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medium_maps_to_tiers() {
        assert_eq!(tier_from_medium(None), Tier::Gpu);
        assert_eq!(tier_from_medium(Some("GPU")), Tier::Gpu);
        assert_eq!(tier_from_medium(Some("cuda")), Tier::Gpu);
        assert_eq!(tier_from_medium(Some("CPU")), Tier::Host);
        assert_eq!(tier_from_medium(Some("cpu")), Tier::Host);
        assert_eq!(tier_from_medium(Some("disk")), Tier::Disk);
        assert_eq!(tier_from_medium(Some("lmcache")), Tier::External);
        for t in Tier::ALL {
            assert_eq!(tier_from_medium(Some(medium_of_tier(t))), t);
        }
    }

    #[test]
    fn spec_kinds() {
        assert!(is_indexable_spec_kind(None));
        assert!(is_indexable_spec_kind(Some("full_attention")));
        assert!(is_indexable_spec_kind(Some("mla_attention")));
        assert!(!is_indexable_spec_kind(Some("sliding_window")));
        assert!(!is_indexable_spec_kind(Some("mamba")));
    }
}
