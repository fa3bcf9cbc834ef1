//! The tolerant decoder: one msgpack payload → [`EngineBatch`].
//!
//! The payload is parsed into a borrowed msgpack value tree (`rmpv::ValueRef`, depth-limited,
//! never pre-allocating from a length prefix), then walked. Each event is read as a tagged array
//! (fields by position after the tag) or a tagged map (fields by name, unknown names ignored), so
//! one batch may mix both. See the module docs of [`super`] for the layout and error policy.

use super::{DecodeError, EngineBatch, EngineEvent, is_indexable_spec_kind, tier_from_medium};
use crate::event::Tier;
use crate::hashing::ExtraKey;
use crate::ids::EngineHash;
use rmpv::ValueRef;

/// Nesting limit for the value tree: a batch needs about 6 levels; this leaves room for
/// `extra_keys` while keeping the parser's recursion shallow.
const MAX_DEPTH: usize = 32;

/// Field positions of `BlockStored` (after the tag), by name.
/// `cache_salt` is SGLang's (tagged maps only; vLLM puts the salt in `extra_keys`).
const STORED_FIELDS: [&str; 12] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "cache_salt",
];

/// Field positions of `BlockRemoved` (after the tag), by name.
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];
const TIER_LOAD_FIELDS: [&str; 3] = ["medium", "bytes_per_s", "block_bytes"];

/// Which KV-cache groups of one engine stream are indexable, learnt from `BlockStored` events
/// (which carry `group_idx` and `kv_cache_spec_kind`) and applied to `BlockRemoved` events (which
/// carry only `group_idx`). Keep one per stream (engine process and dp rank); a group never seen
/// is assumed indexable, and so is an event without `group_idx`.
#[derive(Debug, Clone, Default)]
pub struct GroupKinds {
    /// `(group_idx, indexable)`; engines have a handful of groups at most.
    groups: Vec<(i64, bool)>,
}

impl GroupKinds {
    /// Records the kind of a group.
    pub fn learn(&mut self, group: i64, indexable: bool) {
        match self.groups.iter_mut().find(|(g, _)| *g == group) {
            Some(entry) => entry.1 = indexable,
            None => self.groups.push((group, indexable)),
        }
    }

    /// Whether blocks of `group` are indexable (unknown groups are).
    pub fn indexable(&self, group: Option<i64>) -> bool {
        let Some(group) = group else { return true };
        self.groups
            .iter()
            .find(|(g, _)| *g == group)
            .is_none_or(|(_, ok)| *ok)
    }
}

/// Decodes one payload with no knowledge of earlier batches (group kinds are learnt within the
/// batch only). Use [`decode_batch_with`] on a stream.
///
/// # Errors
/// A [`DecodeError`] other than `Event` when the envelope is malformed; malformed events are
/// reported in [`EngineBatch::malformed`] instead.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, DecodeError> {
    decode_batch_with(payload, &mut GroupKinds::default())
}

/// Decodes one payload of a stream, learning and applying the stream's group kinds.
///
/// # Errors
/// As [`decode_batch`].
pub fn decode_batch_with(
    payload: &[u8],
    groups: &mut GroupKinds,
) -> Result<EngineBatch, DecodeError> {
    let mut rd = payload;
    let root = rmpv::decode::read_value_ref_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    let ValueRef::Array(items) = &root else {
        return Err(DecodeError::Envelope(format!(
            "expected an array [ts, events, dp_rank], got {}",
            type_name(&root)
        )));
    };
    if items.len() < 2 {
        return Err(DecodeError::Envelope(format!(
            "expected [ts, events] or [ts, events, dp_rank], got {} element(s)",
            items.len()
        )));
    }
    let ts = match &items[0] {
        ValueRef::F64(f) => *f,
        ValueRef::F32(f) => f64::from(*f),
        ValueRef::Integer(i) => i.as_f64().unwrap_or(f64::NAN),
        other => {
            return Err(DecodeError::Envelope(format!(
                "ts: expected a number, got {}",
                type_name(other)
            )));
        }
    };
    let ValueRef::Array(raw_events) = &items[1] else {
        return Err(DecodeError::Envelope(format!(
            "events: expected an array, got {}",
            type_name(&items[1])
        )));
    };
    let dp_rank = match items.get(2) {
        None | Some(ValueRef::Nil) => None,
        Some(ValueRef::Integer(i)) => match i.as_u64().and_then(|v| u32::try_from(v).ok()) {
            Some(r) => Some(r),
            None => {
                return Err(DecodeError::Envelope(format!(
                    "dp_rank: {i} is not a valid rank"
                )));
            }
        },
        Some(other) => {
            return Err(DecodeError::Envelope(format!(
                "dp_rank: expected an int or nil, got {}",
                type_name(other)
            )));
        }
    };

    let mut batch = EngineBatch {
        ts,
        dp_rank,
        events: Vec::with_capacity(raw_events.len()),
        skipped_unknown: 0,
        malformed: Vec::new(),
    };
    for (index, raw) in raw_events.iter().enumerate() {
        match decode_event(index, raw, groups) {
            Ok(Some(ev)) => batch.events.push(ev),
            Ok(None) => batch.skipped_unknown += 1,
            Err(e) => batch.malformed.push(e),
        }
    }
    Ok(batch)
}

/// The fields of one event, by position (tagged array) or by name (tagged map).
enum Fields<'a, 'v> {
    Array(&'a [ValueRef<'v>]),
    Map(&'a [(ValueRef<'v>, ValueRef<'v>)]),
}

impl<'a, 'v> Fields<'a, 'v> {
    /// The field at position `pos` of `names` (0 = first field after the tag); `None` if absent.
    fn get(&self, names: &[&str], pos: usize) -> Option<&'a ValueRef<'v>> {
        match self {
            Fields::Array(items) => items.get(pos + 1),
            Fields::Map(entries) => {
                let name = names.get(pos)?;
                entries
                    .iter()
                    .find(|(k, _)| str_of(k) == Some(name))
                    .map(|(_, v)| v)
            }
        }
    }
}

/// Builds the error for one field of one event.
struct Ctx<'k> {
    index: usize,
    kind: &'k str,
}

impl Ctx<'_> {
    fn err(&self, field: &'static str, problem: impl Into<String>) -> DecodeError {
        DecodeError::Event {
            index: self.index,
            kind: self.kind.to_owned(),
            field,
            problem: problem.into(),
        }
    }
}

/// `Ok(None)` for an unknown kind.
fn decode_event(
    index: usize,
    raw: &ValueRef<'_>,
    groups: &mut GroupKinds,
) -> Result<Option<EngineEvent>, DecodeError> {
    let unknown = Ctx { index, kind: "?" };
    let (tag, fields) = match raw {
        ValueRef::Array(items) => (items.first(), Fields::Array(items)),
        ValueRef::Map(entries) => (
            entries
                .iter()
                .find(|(k, _)| str_of(k) == Some("type"))
                .map(|(_, v)| v),
            Fields::Map(entries),
        ),
        other => {
            return Err(unknown.err(
                "event",
                format!("expected a tagged array or map, got {}", type_name(other)),
            ));
        }
    };
    let Some(tag) = tag else {
        return Err(unknown.err("type", "missing"));
    };
    let Some(kind) = str_of(tag) else {
        return Err(unknown.err("type", format!("expected a string, got {}", type_name(tag))));
    };
    let cx = Ctx { index, kind };
    match kind {
        "BlockStored" => decode_stored(&cx, &fields, groups).map(Some),
        "BlockRemoved" => decode_removed(&cx, &fields, groups).map(Some),
        "AllBlocksCleared" => Ok(Some(EngineEvent::AllBlocksCleared)),
        "KvdTierLoad" => decode_tier_load(&cx, &fields).map(Some),
        _ => Ok(None),
    }
}

fn decode_stored(
    cx: &Ctx<'_>,
    f: &Fields<'_, '_>,
    groups: &mut GroupKinds,
) -> Result<EngineEvent, DecodeError> {
    let n = &STORED_FIELDS;
    let block_hashes = hash_list(cx, "block_hashes", f.get(n, 0))?;
    let parent = match f.get(n, 1) {
        None | Some(ValueRef::Nil) => None,
        Some(v) => Some(hash(v).ok_or_else(|| {
            cx.err(
                "parent_block_hash",
                format!("expected an int, bin or nil, got {}", type_name(v)),
            )
        })?),
    };
    let token_ids = token_list(cx, f.get(n, 2))?;
    let block_size = match f.get(n, 3) {
        Some(ValueRef::Integer(i)) => i
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| cx.err("block_size", format!("{i} is out of range")))?,
        Some(v) => {
            return Err(cx.err(
                "block_size",
                format!("expected an int, got {}", type_name(v)),
            ));
        }
        None => return Err(cx.err("block_size", "missing")),
    };
    let lora_id = opt_i64(cx, "lora_id", f.get(n, 4))?;
    let tier = medium(cx, f.get(n, 5))?;
    let lora_name = opt_str(cx, "lora_name", f.get(n, 6))?;
    let extra_keys = extra_keys(cx, f.get(n, 7))?;
    let cache_salt = opt_str(cx, "cache_salt", f.get(n, 11))?;
    let group = opt_i64(cx, "group_idx", f.get(n, 8))?;
    let spec_kind = match f.get(n, 9) {
        None | Some(ValueRef::Nil) => None,
        Some(v) => Some(str_of(v).ok_or_else(|| {
            cx.err(
                "kv_cache_spec_kind",
                format!("expected a string or nil, got {}", type_name(v)),
            )
        })?),
    };
    let indexable = is_indexable_spec_kind(spec_kind);
    if let Some(g) = group {
        groups.learn(g, indexable);
    }
    Ok(EngineEvent::BlockStored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        tier,
        lora_id,
        lora_name,
        extra_keys,
        cache_salt,
        indexable,
    })
}

/// `extra_keys`: nil, or one entry per block, each nil or an array of keys (vLLM sends tuples
/// as arrays); `None` when no block has a key. A string is a string key (adapter name, salt), `[string, int]` a multimodal item
/// and its offset, a bin bytes, an int an int; any other shape is kept as its msgpack bytes.
fn extra_keys(
    cx: &Ctx<'_>,
    v: Option<&ValueRef<'_>>,
) -> Result<Option<Vec<Vec<ExtraKey>>>, DecodeError> {
    let blocks = match v {
        None | Some(ValueRef::Nil) => return Ok(None),
        Some(ValueRef::Array(blocks)) => blocks,
        Some(other) => {
            return Err(cx.err(
                "extra_keys",
                format!("expected an array or nil, got {}", type_name(other)),
            ));
        }
    };
    let key = |k: &ValueRef<'_>| match k {
        ValueRef::String(s) if s.as_str().is_some() => {
            ExtraKey::Str(s.as_str().unwrap_or_default().into())
        }
        ValueRef::Integer(i) if i.as_i64().is_some() => ExtraKey::Int(i.as_i64().unwrap_or(0)),
        ValueRef::Binary(b) => ExtraKey::Bytes((*b).into()),
        ValueRef::Array(pair) => match pair.as_slice() {
            [ValueRef::String(id), ValueRef::Integer(off)]
                if id.as_str().is_some() && off.as_i64().is_some() =>
            {
                ExtraKey::Mm {
                    id: id.as_str().unwrap_or_default().into(),
                    offset: off.as_i64().unwrap_or(0),
                }
            }
            _ => raw_key(k),
        },
        _ => raw_key(k),
    };
    blocks
        .iter()
        .enumerate()
        .map(|(i, b)| match b {
            ValueRef::Nil => Ok(Vec::new()),
            ValueRef::Array(keys) => Ok(keys.iter().map(key).collect()),
            other => Err(cx.err(
                "extra_keys",
                format!(
                    "element {i}: expected an array or nil, got {}",
                    type_name(other)
                ),
            )),
        })
        .collect::<Result<Vec<Vec<ExtraKey>>, _>>()
        // Plain blocks only (vLLM sends `nil` per block): the same as no keys.
        .map(|keys| keys.iter().any(|k| !k.is_empty()).then_some(keys))
}

/// A key of an unknown shape, as its msgpack bytes (never equal to a key the router computes).
fn raw_key(k: &ValueRef<'_>) -> ExtraKey {
    let mut buf = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value_ref(&mut buf, k);
    ExtraKey::Raw(buf.into())
}

fn decode_removed(
    cx: &Ctx<'_>,
    f: &Fields<'_, '_>,
    groups: &GroupKinds,
) -> Result<EngineEvent, DecodeError> {
    let n = &REMOVED_FIELDS;
    let block_hashes = hash_list(cx, "block_hashes", f.get(n, 0))?;
    let tier = medium(cx, f.get(n, 1))?;
    let group = opt_i64(cx, "group_idx", f.get(n, 2))?;
    Ok(EngineEvent::BlockRemoved {
        block_hashes,
        tier,
        indexable: groups.indexable(group),
    })
}

fn decode_tier_load(cx: &Ctx<'_>, f: &Fields<'_, '_>) -> Result<EngineEvent, DecodeError> {
    let n = &TIER_LOAD_FIELDS;
    let tier = medium(cx, f.get(n, 0))?;
    let bytes_per_s = match f.get(n, 1) {
        Some(ValueRef::F64(v)) => *v,
        Some(ValueRef::F32(v)) => f64::from(*v),
        Some(ValueRef::Integer(i)) => i.as_f64().unwrap_or(0.0),
        Some(v) => {
            return Err(cx.err(
                "bytes_per_s",
                format!("expected a number, got {}", type_name(v)),
            ));
        }
        None => return Err(cx.err("bytes_per_s", "missing")),
    };
    if !bytes_per_s.is_finite() || bytes_per_s < 0.0 {
        return Err(cx.err("bytes_per_s", format!("{bytes_per_s} is not a speed")));
    }
    let block_bytes = match f.get(n, 2) {
        Some(ValueRef::Integer(i)) => i
            .as_u64()
            .ok_or_else(|| cx.err("block_bytes", format!("{i} is out of range")))?,
        Some(v) => {
            return Err(cx.err(
                "block_bytes",
                format!("expected an int, got {}", type_name(v)),
            ));
        }
        None => return Err(cx.err("block_bytes", "missing")),
    };
    Ok(EngineEvent::TierLoad {
        tier,
        bytes_per_s,
        block_bytes,
    })
}

/// An engine hash: uint, signed int, or bytes.
fn hash(v: &ValueRef<'_>) -> Option<EngineHash> {
    match v {
        ValueRef::Integer(i) => i
            .as_u64()
            .map(EngineHash::from_u64)
            .or_else(|| i.as_i64().map(EngineHash::from_i64)),
        ValueRef::Binary(b) => Some(EngineHash::from_bytes(b)),
        _ => None,
    }
}

fn hash_list(
    cx: &Ctx<'_>,
    field: &'static str,
    v: Option<&ValueRef<'_>>,
) -> Result<Vec<EngineHash>, DecodeError> {
    let items = match v {
        Some(ValueRef::Array(items)) => items,
        Some(other) => {
            return Err(cx.err(
                field,
                format!("expected an array, got {}", type_name(other)),
            ));
        }
        None => return Err(cx.err(field, "missing")),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, h)| {
            hash(h).ok_or_else(|| {
                cx.err(
                    field,
                    format!("element {i}: expected an int or bin, got {}", type_name(h)),
                )
            })
        })
        .collect()
}

/// Token ids; an element may be an EAGLE/MTP pair `[token, draft]`, whose first is kept.
fn token_list(cx: &Ctx<'_>, v: Option<&ValueRef<'_>>) -> Result<Vec<u32>, DecodeError> {
    let items = match v {
        Some(ValueRef::Array(items)) => items,
        Some(other) => {
            return Err(cx.err(
                "token_ids",
                format!("expected an array, got {}", type_name(other)),
            ));
        }
        None => return Err(cx.err("token_ids", "missing")),
    };
    let token = |i: usize, t: &ValueRef<'_>| -> Result<u32, DecodeError> {
        let t = match t {
            ValueRef::Array(pair) => pair
                .first()
                .ok_or_else(|| cx.err("token_ids", format!("element {i}: empty token pair")))?,
            t => t,
        };
        match t {
            ValueRef::Integer(n) => n
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| cx.err("token_ids", format!("element {i}: {n} is not a token id"))),
            other => Err(cx.err(
                "token_ids",
                format!("element {i}: expected an int, got {}", type_name(other)),
            )),
        }
    };
    items.iter().enumerate().map(|(i, t)| token(i, t)).collect()
}

fn opt_i64(
    cx: &Ctx<'_>,
    field: &'static str,
    v: Option<&ValueRef<'_>>,
) -> Result<Option<i64>, DecodeError> {
    match v {
        None | Some(ValueRef::Nil) => Ok(None),
        Some(ValueRef::Integer(i)) => i
            .as_i64()
            .map(Some)
            .ok_or_else(|| cx.err(field, format!("{i} is out of range"))),
        Some(other) => Err(cx.err(
            field,
            format!("expected an int or nil, got {}", type_name(other)),
        )),
    }
}

fn opt_str(
    cx: &Ctx<'_>,
    field: &'static str,
    v: Option<&ValueRef<'_>>,
) -> Result<Option<Box<str>>, DecodeError> {
    match v {
        None | Some(ValueRef::Nil) => Ok(None),
        Some(v) => str_of(v).map(|s| Some(Box::from(s))).ok_or_else(|| {
            cx.err(
                field,
                format!("expected a string or nil, got {}", type_name(v)),
            )
        }),
    }
}

fn medium(cx: &Ctx<'_>, v: Option<&ValueRef<'_>>) -> Result<Tier, DecodeError> {
    match v {
        None | Some(ValueRef::Nil) => Ok(tier_from_medium(None)),
        Some(v) => str_of(v).map(|m| tier_from_medium(Some(m))).ok_or_else(|| {
            cx.err(
                "medium",
                format!("expected a string or nil, got {}", type_name(v)),
            )
        }),
    }
}

fn str_of<'a>(v: &'a ValueRef<'_>) -> Option<&'a str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

fn type_name(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "a bool",
        ValueRef::Integer(_) => "an int",
        ValueRef::F32(_) | ValueRef::F64(_) => "a float",
        ValueRef::String(_) => "a string",
        ValueRef::Binary(_) => "a bin",
        ValueRef::Array(_) => "an array",
        ValueRef::Map(_) => "a map",
        ValueRef::Ext(..) => "an ext",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_events_inherit_their_groups_kind_across_batches() {
        let mut g = GroupKinds::default();
        g.learn(1, false);
        g.learn(0, true);
        assert!(g.indexable(Some(0)));
        assert!(!g.indexable(Some(1)));
        assert!(g.indexable(Some(7)), "unknown groups are indexable");
        assert!(g.indexable(None));
        g.learn(1, true);
        assert!(g.indexable(Some(1)));
    }

    #[test]
    fn envelope_errors_name_the_part() {
        // fixint 1: not an array.
        let e = decode_batch(&[0x01]).expect_err("not an array");
        assert!(e.to_string().contains("expected an array"), "{e}");
        // [1]: too short.
        let e = decode_batch(&[0x91, 0x01]).expect_err("short");
        assert!(e.to_string().contains("1 element"), "{e}");
        // ["x", []]: ts not a number.
        let e = decode_batch(&[0x92, 0xa1, b'x', 0x90]).expect_err("ts");
        assert!(e.to_string().contains("ts:"), "{e}");
        // [1.0 as int, 5]: events not an array.
        let e = decode_batch(&[0x92, 0x01, 0x05]).expect_err("events");
        assert!(e.to_string().contains("events:"), "{e}");
        // [1, [], "r"]: dp_rank wrong type.
        let e = decode_batch(&[0x93, 0x01, 0x90, 0xa1, b'r']).expect_err("dp_rank");
        assert!(e.to_string().contains("dp_rank:"), "{e}");
        // trailing byte.
        let e = decode_batch(&[0x92, 0x01, 0x90, 0xc0]).expect_err("trailing");
        assert_eq!(e, DecodeError::TrailingBytes(1));
        assert!(e.is_envelope());
    }
}
