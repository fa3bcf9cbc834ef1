//! The tablespace's on-disk formats: the shard meta file, the block (slot) layout, journal
//! records and the checkpoint. Integers are little-endian; every structure carries an xxh3-64
//! checksum, so torn or corrupted bytes are detected, never interpreted.
//!
//! # Block, at `start * UNIT` in a container file (`UNIT` = 4096)
//! ```text
//! 0  u32 magic "KVB1"      4  u16 layout version (1), u8 class, u8 flags (0)
//! 8  u64 generation        16 u128 key hash
//! 32 u32 value length      36 u32 metadata length
//! 40 u16 model length      42 u16 compat_key length     44 u32 key length
//! 48 u64 checksum = xxh3_64(body, seed = xxh3_64(bytes 0..48))
//! 56 u64 reserved (0)
//! 64 body: model | compat_key | key | metadata | value, then zeros to a UNIT boundary
//! ```
//! A read is accepted only if the magic, checksum, generation, key hash and value length match
//! what the index expects *and* the stored namespace and key equal the requested ones.
//!
//! # Journal segment `journal-NNNNNNNNNNNN.log`
//! A 32-byte header (`"INFKVJ01"`, u32 shard, u64 segment, u32 reserved, u64 checksum of the
//! first 24 bytes), then records: `u32 payload length | u8 kind | payload | u64 checksum`
//! (xxh3_64 of length, kind and payload). Kinds: 1 put ([`PutRecord`], 56 bytes), 2 evict
//! (u64 generation, u128 hash), 3 namespace (u32 id, u16 + u16 lengths, model, compat_key).
//!
//! # Checkpoint `checkpoint`
//! `"INFKVCP1"`, u32 layout version, u32 shard, u64 first journal segment to replay, u64 next
//! generation, u32 namespace count, u64 entry count; the namespace records (as in the
//! journal); the entries as put payloads, lowest class first and least recently used first;
//! u64 checksum of everything before it. Written to `checkpoint.tmp`, synced, renamed.

use crate::proto::Namespace;
use infera_core::event::Retention;
use std::hash::Hasher;
use twox_hash::XxHash3_64;

/// XXH3-64 of `b` (the reference algorithm; twox-hash picks AVX2 or SSE2 at run time).
fn xxh3_64(b: &[u8]) -> u64 {
    XxHash3_64::oneshot(b)
}

/// XXH3-64 of `b` with `seed`.
fn xxh3_64_with_seed(b: &[u8], seed: u64) -> u64 {
    XxHash3_64::oneshot_with_seed(seed, b)
}

/// The allocation unit and alignment of blocks, in bytes.
pub const UNIT: u64 = crate::sys::aligned::ALIGN as u64;
/// Bytes of the block header.
pub const BLOCK_HEADER: usize = 64;
const BLOCK_MAGIC: u32 = u32::from_le_bytes(*b"KVB1");
const META_MAGIC: &[u8; 8] = b"INFKVTS1";
/// Journal segment file header magic.
pub const JOURNAL_MAGIC: &[u8; 8] = b"INFKVJ01";
/// Bytes of the journal segment header.
pub const JOURNAL_HEADER: usize = 32;
const CHECKPOINT_MAGIC: &[u8; 8] = b"INFKVCP1";
const LAYOUT_VERSION: u32 = 1;

/// Journal record kinds.
pub const KIND_PUT: u8 = 1;
/// An entry left (evicted, expired, replaced, removed or failed its checks).
pub const KIND_EVICT: u8 = 2;
/// A namespace id was assigned.
pub const KIND_NAMESPACE: u8 = 3;

/// The shape of a shard region, stored in `tablespace.meta`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub shard: u32,
    pub shards: u32,
    pub container_bytes: u64,
    pub containers: u32,
}

impl Geometry {
    /// Units per container.
    pub fn container_units(&self) -> u32 {
        (self.container_bytes / UNIT) as u32
    }

    /// `tablespace.meta`'s bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(48);
        b.extend_from_slice(META_MAGIC);
        b.extend_from_slice(&LAYOUT_VERSION.to_le_bytes());
        b.extend_from_slice(&self.shard.to_le_bytes());
        b.extend_from_slice(&self.shards.to_le_bytes());
        b.extend_from_slice(&self.containers.to_le_bytes());
        b.extend_from_slice(&self.container_bytes.to_le_bytes());
        let sum = xxh3_64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses `tablespace.meta`; `None` when it is not a valid meta file of this layout.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != 40 || &b[..8] != META_MAGIC || xxh3_64(&b[..32]) != u64_at(b, 32) {
            return None;
        }
        (u32_at(b, 8) == LAYOUT_VERSION).then(|| Geometry {
            shard: u32_at(b, 12),
            shards: u32_at(b, 16),
            containers: u32_at(b, 20),
            container_bytes: u64_at(b, 24),
        })
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn u128_at(b: &[u8], at: usize) -> u128 {
    let mut x = [0u8; 16];
    x.copy_from_slice(&b[at..at + 16]);
    u128::from_le_bytes(x)
}

fn class_code(class: Retention) -> u8 {
    class as u8
}

fn class_of(code: u8) -> Option<Retention> {
    Retention::ALL.get(code as usize).copied()
}

/// What a block stores, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct BlockParts<'a> {
    pub generation: u64,
    pub hash: u128,
    pub class: Retention,
    pub ns: &'a Namespace,
    pub key: &'a [u8],
    pub metadata: &'a [u8],
    pub value: &'a [u8],
}

impl BlockParts<'_> {
    /// Header plus body, before padding.
    pub fn stored_len(&self) -> usize {
        BLOCK_HEADER
            + self.ns.model.len()
            + self.ns.compat_key.len()
            + self.key.len()
            + self.metadata.len()
            + self.value.len()
    }

    /// Whether every length fits its header field.
    pub fn fits_header(&self) -> bool {
        self.ns.model.len() <= u16::MAX as usize
            && self.ns.compat_key.len() <= u16::MAX as usize
            && self.key.len() <= u32::MAX as usize
            && self.metadata.len() <= u32::MAX as usize
            && self.value.len() <= u32::MAX as usize
    }

    /// Units the block occupies.
    pub fn units(&self) -> u32 {
        (self.stored_len() as u64).div_ceil(UNIT) as u32
    }

    /// Writes the block into `out` (at least `units() * UNIT` bytes, which it fills, padding
    /// with zeros). The body is copied [`HASH_SLICE`] bytes at a time and each slice is summed
    /// right after its copy, while it is still in the cache, so a large value crosses memory
    /// once rather than once for the copy and again for the checksum.
    pub fn encode_into(&self, out: &mut [u8]) {
        let total = self.stored_len();
        let h = &mut out[..BLOCK_HEADER];
        h[0..4].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&1u16.to_le_bytes());
        h[6] = class_code(self.class);
        h[7] = 0;
        h[8..16].copy_from_slice(&self.generation.to_le_bytes());
        h[16..32].copy_from_slice(&self.hash.to_le_bytes());
        h[32..36].copy_from_slice(&(self.value.len() as u32).to_le_bytes());
        h[36..40].copy_from_slice(&(self.metadata.len() as u32).to_le_bytes());
        h[40..42].copy_from_slice(&(self.ns.model.len() as u16).to_le_bytes());
        h[42..44].copy_from_slice(&(self.ns.compat_key.len() as u16).to_le_bytes());
        h[44..48].copy_from_slice(&(self.key.len() as u32).to_le_bytes());
        h[56..64].fill(0);
        let mut sum = XxHash3_64::with_seed(xxh3_64(&out[..48]));
        let mut at = BLOCK_HEADER;
        for part in [
            self.ns.model.as_bytes(),
            self.ns.compat_key.as_bytes(),
            self.key,
            self.metadata,
            self.value,
        ] {
            for slice in part.chunks(HASH_SLICE) {
                let to = &mut out[at..at + slice.len()];
                to.copy_from_slice(slice);
                sum.write(to);
                at += slice.len();
            }
        }
        let padded = (total as u64).div_ceil(UNIT) as usize * UNIT as usize;
        out[total..padded].fill(0);
        out[48..56].copy_from_slice(&sum.finish().to_le_bytes());
    }
}

/// Bytes [`BlockParts::encode_into`] copies before summing them (well inside an L2 cache).
const HASH_SLICE: usize = 64 << 10;

/// What a read expects of a block.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    pub generation: u64,
    pub hash: u128,
    pub value_len: u32,
    pub ns: &'a Namespace,
    pub key: &'a [u8],
}

/// Checks a block read back; returns the byte range of its value within `b`, or why not.
pub fn verify(b: &[u8], want: &Expect<'_>) -> Result<std::ops::Range<usize>, &'static str> {
    if b.len() < BLOCK_HEADER || u32_at(b, 0) != BLOCK_MAGIC || u16_at(b, 4) != 1 {
        return Err("no block header");
    }
    if u64_at(b, 8) != want.generation || u128_at(b, 16) != want.hash {
        return Err("another generation or key");
    }
    let value_len = u32_at(b, 32) as usize;
    let meta_len = u32_at(b, 36) as usize;
    let model_len = u16_at(b, 40) as usize;
    let compat_len = u16_at(b, 42) as usize;
    let key_len = u32_at(b, 44) as usize;
    if value_len != want.value_len as usize {
        return Err("another length");
    }
    let total = BLOCK_HEADER + model_len + compat_len + key_len + meta_len + value_len;
    if total > b.len() {
        return Err("longer than its slot");
    }
    let seed = xxh3_64(&b[..48]);
    if xxh3_64_with_seed(&b[BLOCK_HEADER..total], seed) != u64_at(b, 48) {
        return Err("checksum mismatch");
    }
    let mut at = BLOCK_HEADER;
    let mut next = |n: usize| {
        let r = at..at + n;
        at += n;
        r
    };
    let (model, compat, key) = (next(model_len), next(compat_len), next(key_len));
    if &b[model] != want.ns.model.as_bytes()
        || &b[compat] != want.ns.compat_key.as_bytes()
        || &b[key] != want.key
    {
        return Err("another key under the same hash");
    }
    let _metadata = next(meta_len);
    Ok(next(value_len))
}

/// One index entry as the journal and the checkpoint store it (56 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutRecord {
    pub generation: u64,
    pub hash: u128,
    pub ns: u32,
    pub class: Retention,
    pub expires_at: Option<u64>,
    pub container: u32,
    pub start: u32,
    pub units: u32,
    pub value_len: u32,
}

/// Bytes of an encoded [`PutRecord`].
pub const PUT_LEN: usize = 56;

impl PutRecord {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.hash.to_le_bytes());
        out.extend_from_slice(&self.ns.to_le_bytes());
        out.extend_from_slice(&[class_code(self.class), 0, 0, 0]);
        out.extend_from_slice(&self.expires_at.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&self.container.to_le_bytes());
        out.extend_from_slice(&self.start.to_le_bytes());
        out.extend_from_slice(&self.units.to_le_bytes());
        out.extend_from_slice(&self.value_len.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != PUT_LEN {
            return None;
        }
        Some(Self {
            generation: u64_at(b, 0),
            hash: u128_at(b, 8),
            ns: u32_at(b, 24),
            class: class_of(b[28])?,
            expires_at: Some(u64_at(b, 32)).filter(|t| *t != 0),
            container: u32_at(b, 40),
            start: u32_at(b, 44),
            units: u32_at(b, 48),
            value_len: u32_at(b, 52),
        })
    }
}

/// A decoded journal record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Put(PutRecord),
    Evict { generation: u64, hash: u128 },
    Namespace { id: u32, ns: Namespace },
}

fn frame(kind: u8, payload: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.push(kind);
    out.extend_from_slice(payload);
    let sum = xxh3_64(&out[start..]);
    out.extend_from_slice(&sum.to_le_bytes());
}

fn ns_payload(id: u32, ns: &Namespace, out: &mut Vec<u8>) {
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&(ns.model.len() as u16).to_le_bytes());
    out.extend_from_slice(&(ns.compat_key.len() as u16).to_le_bytes());
    out.extend_from_slice(ns.model.as_bytes());
    out.extend_from_slice(ns.compat_key.as_bytes());
}

fn ns_decode(b: &[u8]) -> Option<(u32, Namespace, usize)> {
    if b.len() < 8 {
        return None;
    }
    let (ml, cl) = (u16_at(b, 4) as usize, u16_at(b, 6) as usize);
    let end = 8 + ml + cl;
    if b.len() < end {
        return None;
    }
    let model = std::str::from_utf8(&b[8..8 + ml]).ok()?;
    let compat = std::str::from_utf8(&b[8 + ml..end]).ok()?;
    Some((u32_at(b, 0), Namespace::new(model, compat), end))
}

impl Record {
    /// Appends the framed record to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut payload = Vec::with_capacity(PUT_LEN);
        let kind = match self {
            Record::Put(p) => {
                p.encode(&mut payload);
                KIND_PUT
            }
            Record::Evict { generation, hash } => {
                payload.extend_from_slice(&generation.to_le_bytes());
                payload.extend_from_slice(&hash.to_le_bytes());
                KIND_EVICT
            }
            Record::Namespace { id, ns } => {
                ns_payload(*id, ns, &mut payload);
                KIND_NAMESPACE
            }
        };
        frame(kind, &payload, out);
    }

    /// Decodes the record at the start of `b`: the record and its framed length, or `None`
    /// when the bytes are torn or corrupt (replay stops there).
    pub fn decode(b: &[u8]) -> Option<(Self, usize)> {
        if b.len() < 13 {
            return None;
        }
        let len = u32_at(b, 0) as usize;
        let end = 5usize.checked_add(len)?;
        if b.len() < end + 8 || xxh3_64(&b[..end]) != u64_at(b, end) {
            return None;
        }
        let payload = &b[5..end];
        let record = match b[4] {
            KIND_PUT => Record::Put(PutRecord::decode(payload)?),
            KIND_EVICT if payload.len() == 24 => Record::Evict {
                generation: u64_at(payload, 0),
                hash: u128_at(payload, 8),
            },
            KIND_NAMESPACE => {
                let (id, ns, used) = ns_decode(payload)?;
                if used != payload.len() {
                    return None;
                }
                Record::Namespace { id, ns }
            }
            _ => return None,
        };
        Some((record, end + 8))
    }
}

/// A journal segment's header.
pub fn journal_header(shard: u32, segment: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(JOURNAL_HEADER);
    b.extend_from_slice(JOURNAL_MAGIC);
    b.extend_from_slice(&shard.to_le_bytes());
    b.extend_from_slice(&segment.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    let sum = xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

/// Checks a journal segment's header; the segment number it names.
pub fn parse_journal_header(b: &[u8], shard: u32) -> Option<u64> {
    if b.len() < JOURNAL_HEADER
        || &b[..8] != JOURNAL_MAGIC
        || xxh3_64(&b[..24]) != u64_at(b, 24)
        || u32_at(b, 8) != shard
    {
        return None;
    }
    Some(u64_at(b, 12))
}

/// A checkpoint's content.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    pub replay_from: u64,
    pub next_generation: u64,
    pub namespaces: Vec<(u32, Namespace)>,
    /// Least recently used first (within each class).
    pub entries: Vec<PutRecord>,
}

impl Checkpoint {
    pub fn encode(&self, shard: u32) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.entries.len() * PUT_LEN);
        b.extend_from_slice(CHECKPOINT_MAGIC);
        b.extend_from_slice(&LAYOUT_VERSION.to_le_bytes());
        b.extend_from_slice(&shard.to_le_bytes());
        b.extend_from_slice(&self.replay_from.to_le_bytes());
        b.extend_from_slice(&self.next_generation.to_le_bytes());
        b.extend_from_slice(&(self.namespaces.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        for (id, ns) in &self.namespaces {
            ns_payload(*id, ns, &mut b);
        }
        for e in &self.entries {
            e.encode(&mut b);
        }
        let sum = xxh3_64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    /// Parses a checkpoint of `shard`; `None` when torn, corrupt or another shard's.
    pub fn decode(b: &[u8], shard: u32) -> Option<Self> {
        if b.len() < 52 || &b[..8] != CHECKPOINT_MAGIC {
            return None;
        }
        let body = b.len() - 8;
        if xxh3_64(&b[..body]) != u64_at(b, body) {
            return None;
        }
        if u32_at(b, 8) != LAYOUT_VERSION || u32_at(b, 12) != shard {
            return None;
        }
        let mut c = Checkpoint {
            replay_from: u64_at(b, 16),
            next_generation: u64_at(b, 24),
            ..Checkpoint::default()
        };
        let ns_count = u32_at(b, 32) as usize;
        let count = u64_at(b, 36) as usize;
        let mut at = 44;
        for _ in 0..ns_count {
            let (id, ns, used) = ns_decode(&b[at..body])?;
            c.namespaces.push((id, ns));
            at += used;
        }
        if body.checked_sub(at)? != count.checked_mul(PUT_LEN)? {
            return None;
        }
        c.entries = b[at..body]
            .chunks_exact(PUT_LEN)
            .map(PutRecord::decode)
            .collect::<Option<_>>()?;
        Some(c)
    }
}

#[cfg(test)]
#[path = "layout_tests.rs"]
mod tests;
