//! kvd's own framing of every L4 value, so a value read back is used only when it is exactly
//! a block kvd wrote under that key: a foreign value (another program's), a torn one (cut
//! short, or its two LMCache keys out of step) or a colliding one (another key's block under
//! the same store name) reads as a miss and is counted, never as wrong bytes.
//!
//! Layout (little-endian), 64 header bytes, then the key blob, then the value, then the
//! checksum (last, so a writer that streams a frame out takes it as the bytes go by, in one
//! pass over the value):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `IKL4` |
//! | 4 | 1 | version (2) |
//! | 5 | 1 | retention class (`Retention as u8`) |
//! | 6 | 2 | reserved (0) |
//! | 8 | 8 | value length |
//! | 16 | 8 | expiry, ms on the writer's wall clock (`u64::MAX`: none) |
//! | 24 | 8 | writer id (random per daemon run) |
//! | 32 | 8 | the writer's sequence number of this write |
//! | 40 | 8 | written at, ms on the writer's wall clock |
//! | 48 | 4 | key blob length |
//! | 52 | 4 | reserved (0) |
//! | 56 | 8 | reserved (0) |
//! | 64 + blob + value | 8 | trailer: XXH3-64 of everything before it |
//!
//! The key blob is the full key, not a digest of it: `u16` model length, model, `u16` compat
//! length, compat key, then the key bytes. A read compares it with the key asked for.

use crate::proto::Namespace;
use bytes::{BufMut, Bytes, BytesMut};
use infera_core::event::Retention;
use std::hash::Hasher;
use twox_hash::XxHash3_64;

const MAGIC: &[u8; 4] = b"IKL4";
const VERSION: u8 = 2;
/// Header bytes before the key blob.
pub const HEADER_BYTES: usize = 64;
/// The checksum after the value.
pub const TRAILER_BYTES: usize = 8;
const NO_EXPIRY: u64 = u64::MAX;

/// What a frame says besides its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameInfo {
    pub class: Retention,
    pub expires_at: Option<u64>,
    pub writer: u64,
    pub seq: u64,
    pub written_at: u64,
}

/// A framed value in parts (header + key blob, the value itself, the trailer), so a large
/// value is never copied to be framed. To a store, a value like any other (its parts joined).
#[derive(Debug, Clone)]
pub struct Framed {
    pub head: Bytes,
    pub body: Bytes,
    /// The trailer ([`encode`]); empty for a frame to seal, and for a value to store as it is.
    pub tail: Bytes,
    /// The trailer is left to the store, which takes it as it writes the frame out
    /// ([`copy_to`], [`write_to`]; see [`encode_unsealed`]).
    pub seal: bool,
}

impl Framed {
    /// Total length on the store.
    pub fn len(&self) -> usize {
        let tail = if self.seal {
            TRAILER_BYTES
        } else {
            self.tail.len()
        };
        self.head.len() + self.body.len() + tail
    }

    /// Whether the frame is empty (never: a frame has a header).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn key_blob(ns: &Namespace, key: &[u8]) -> Option<Vec<u8>> {
    let model = ns.model.as_bytes();
    let compat = ns.compat_key.as_bytes();
    let mut blob = Vec::with_capacity(4 + model.len() + compat.len() + key.len());
    blob.extend_from_slice(&u16::try_from(model.len()).ok()?.to_le_bytes());
    blob.extend_from_slice(model);
    blob.extend_from_slice(&u16::try_from(compat.len()).ok()?.to_le_bytes());
    blob.extend_from_slice(compat);
    blob.extend_from_slice(key);
    Some(blob)
}

fn hasher() -> XxHash3_64 {
    XxHash3_64::with_seed(0x4c34_6b76_6466_726d)
}

/// The trailer of a frame whose bytes before it are `head` (header and key blob) and `body`.
fn checksum(head: &[u8], body: &[u8]) -> u64 {
    let mut h = hasher();
    h.write(head);
    h.write(body);
    h.finish()
}

/// The length of the frame of `value` for `(ns, key)`, without building it; `None` when a
/// namespace part is longer than 64 KiB (such a key cannot be framed).
pub fn framed_len(ns: &Namespace, key: &[u8], value: usize) -> Option<usize> {
    let model = u16::try_from(ns.model.len()).ok()? as usize;
    let compat = u16::try_from(ns.compat_key.len()).ok()? as usize;
    Some(HEADER_BYTES + 4 + model + compat + key.len() + value + TRAILER_BYTES)
}

/// Frames `value` for `(ns, key)`; `None` when a namespace part is longer than 64 KiB.
pub fn encode(ns: &Namespace, key: &[u8], value: &Bytes, info: FrameInfo) -> Option<Framed> {
    encode_with(ns, key, value, info, true)
}

/// [`encode`] without the trailer ([`Framed::seal`] set), for a store that writes the frame
/// out with [`copy_to`] or [`write_to`], which take it as the bytes go by.
pub fn encode_unsealed(
    ns: &Namespace,
    key: &[u8],
    value: &Bytes,
    info: FrameInfo,
) -> Option<Framed> {
    encode_with(ns, key, value, info, false)
}

/// The bytes of a value written out and checksummed at a time by [`copy_to`] and
/// [`write_to`]: small enough to be checksummed from the core's cache (2 MiB of L2 on the
/// build VM) right before its copy, large enough that a socket's writer makes few system
/// calls (pieces of 128 KiB, four times the calls: Redis puts of 1 / 4 MiB blocks at 75–77 /
/// 80–86 % of a plain client in two runs, against 76–86 / 83–96 % in five).
const SEAL_PIECE: usize = 512 << 10;

/// The pieces of `framed` in order (the head, then the value a [`SEAL_PIECE`] at a time),
/// each taken into the trailer of a frame to seal as it is handed out, so the copy that
/// follows reads it from cache; then [`Pieces::trailer`]. The one walk behind [`copy_to`]
/// and [`write_to`].
struct Pieces<'a> {
    framed: &'a Framed,
    /// Bytes of the frame handed out so far.
    at: usize,
    hasher: Option<XxHash3_64>,
}

impl<'a> Pieces<'a> {
    fn new(framed: &'a Framed) -> Self {
        Self {
            framed,
            at: 0,
            hasher: framed.seal.then(hasher),
        }
    }

    /// The trailer: taken along the way, or the frame's own.
    fn trailer(self) -> Bytes {
        match self.hasher {
            Some(h) => Bytes::copy_from_slice(&h.finish().to_le_bytes()),
            None => self.framed.tail.clone(),
        }
    }
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let (head, body) = (&self.framed.head[..], &self.framed.body[..]);
        let piece = if self.at < head.len() {
            head
        } else {
            let from = self.at - head.len();
            &body[from..body.len().min(from + SEAL_PIECE)]
        };
        if piece.is_empty() {
            return None;
        }
        self.at += piece.len();
        if let Some(h) = &mut self.hasher {
            h.write(piece);
        }
        Some(piece)
    }
}

/// Copies `framed` out through `write(offset in the frame, bytes)`, a frame to seal with its
/// trailer taken as it goes (one pass over the value, each piece checksummed from cache right
/// before its copy). The bytes written are those of [`encode`]'s frame.
pub fn copy_to(framed: &Framed, mut write: impl FnMut(usize, &[u8])) {
    let mut at = 0;
    let mut pieces = Pieces::new(framed);
    for piece in pieces.by_ref() {
        write(at, piece);
        at += piece.len();
    }
    write(at, &pieces.trailer());
}

/// Writes `framed` to `w` (a socket's writer) as [`copy_to`] copies it: the first byte goes
/// out before the last checksum is taken, and each piece is checksummed right before it is
/// written.
///
/// # Errors
/// `w`'s.
pub async fn write_to<W>(framed: &Framed, w: &mut W) -> std::io::Result<()>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let mut pieces = Pieces::new(framed);
    for piece in pieces.by_ref() {
        w.write_all(piece).await?;
    }
    w.write_all(&pieces.trailer()).await
}

fn encode_with(
    ns: &Namespace,
    key: &[u8],
    value: &Bytes,
    info: FrameInfo,
    sealed: bool,
) -> Option<Framed> {
    let blob = key_blob(ns, key)?;
    let mut head = BytesMut::with_capacity(HEADER_BYTES + blob.len());
    head.put_slice(MAGIC);
    head.put_u8(VERSION);
    head.put_u8(info.class as u8);
    head.put_u16_le(0);
    head.put_u64_le(value.len() as u64);
    head.put_u64_le(info.expires_at.unwrap_or(NO_EXPIRY));
    head.put_u64_le(info.writer);
    head.put_u64_le(info.seq);
    head.put_u64_le(info.written_at);
    head.put_u32_le(u32::try_from(blob.len()).ok()?);
    head.put_u32_le(0);
    head.put_u64_le(0);
    head.put_slice(&blob);
    let head = head.freeze();
    let tail = if sealed {
        Bytes::copy_from_slice(&checksum(&head, value).to_le_bytes())
    } else {
        Bytes::new()
    };
    Some(Framed {
        head,
        body: value.clone(),
        tail,
        seal: !sealed,
    })
}

/// Why a stored value is not a block of the key asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    /// Not kvd's framing (another program's value, or an unknown version).
    #[error("foreign")]
    Foreign,
    /// Shorter or longer than its header says, or its checksum fails.
    #[error("torn")]
    Torn,
    /// A block of another key.
    #[error("colliding")]
    Colliding,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Checks `stored` as a frame of `(ns, key)` and returns its value (a slice of `stored`).
///
/// # Errors
/// [`Reject`].
pub fn decode(stored: &Bytes, ns: &Namespace, key: &[u8]) -> Result<(Bytes, FrameInfo), Reject> {
    if stored.len() < HEADER_BYTES || &stored[..4] != MAGIC || stored[4] != VERSION {
        return Err(Reject::Foreign);
    }
    let class = Retention::ALL
        .into_iter()
        .find(|c| *c as u8 == stored[5])
        .ok_or(Reject::Foreign)?;
    let len = u64_at(stored, 8);
    let mut blob_len = [0u8; 4];
    blob_len.copy_from_slice(&stored[48..52]);
    let blob_len = u32::from_le_bytes(blob_len) as u64;
    let total = (HEADER_BYTES as u64)
        .checked_add(blob_len)
        .and_then(|t| t.checked_add(len))
        .and_then(|t| t.checked_add(TRAILER_BYTES as u64))
        .ok_or(Reject::Torn)?;
    if total != stored.len() as u64 {
        return Err(Reject::Torn);
    }
    let blob_end = HEADER_BYTES + blob_len as usize;
    let value_end = stored.len() - TRAILER_BYTES;
    let blob = &stored[HEADER_BYTES..blob_end];
    if checksum(&stored[..blob_end], &stored[blob_end..value_end]) != u64_at(stored, value_end) {
        return Err(Reject::Torn);
    }
    if key_blob(ns, key).as_deref() != Some(blob) {
        return Err(Reject::Colliding);
    }
    let expires = u64_at(stored, 16);
    let info = FrameInfo {
        class,
        expires_at: (expires != NO_EXPIRY).then_some(expires),
        writer: u64_at(stored, 24),
        seq: u64_at(stored, 32),
        written_at: u64_at(stored, 40),
    };
    Ok((stored.slice(blob_end..value_end), info))
}

/// The frame as one buffer, as a store holds it (for tests and benches).
pub fn joined(framed: &Framed) -> Bytes {
    let mut out = vec![0u8; framed.len()];
    copy_to(framed, |at, bytes| {
        out[at..at + bytes.len()].copy_from_slice(bytes)
    });
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> FrameInfo {
        FrameInfo {
            class: Retention::Long,
            expires_at: Some(7),
            writer: 1,
            seq: 2,
            written_at: 3,
        }
    }

    #[test]
    fn a_frame_reads_back_only_under_its_key() {
        let ns = Namespace::new("m", "fp8");
        let value = Bytes::from_static(b"block bytes");
        let stored = joined(&encode(&ns, b"k", &value, info()).unwrap());
        assert_eq!(framed_len(&ns, b"k", value.len()), Some(stored.len()));
        let (back, got) = decode(&stored, &ns, b"k").unwrap();
        assert_eq!((back, got), (value, info()));
        assert_eq!(decode(&stored, &ns, b"j"), Err(Reject::Colliding));
        let other = Namespace::new("m", "");
        assert_eq!(decode(&stored, &other, b"k"), Err(Reject::Colliding));
    }

    /// A frame to seal, copied out or written to a socket's writer, is `encode`'s frame;
    /// a value stored as it is goes out as it is.
    #[test]
    fn frames_sealed_as_they_go_out_are_the_encoded_frames() {
        let ns = Namespace::new("m", "fp8");
        // Over two pieces and a part, so the checksum runs across pieces.
        let value = Bytes::from(
            (0..2 * SEAL_PIECE + 77)
                .map(|i| i as u8)
                .collect::<Vec<_>>(),
        );
        let sealed = joined(&encode(&ns, b"k", &value, info()).unwrap());
        let unsealed = encode_unsealed(&ns, b"k", &value, info()).unwrap();
        assert!(unsealed.seal && unsealed.tail.is_empty());
        assert_eq!(unsealed.len(), sealed.len());
        let mut copied = vec![0xAAu8; unsealed.len()];
        copy_to(&unsealed, |at, bytes| {
            copied[at..at + bytes.len()].copy_from_slice(bytes);
        });
        assert_eq!(copied, sealed);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut written = Vec::new();
        rt.block_on(write_to(&unsealed, &mut written)).unwrap();
        assert_eq!(written, sealed);
        assert!(decode(&sealed, &ns, b"k").is_ok());
        let foreign = Framed {
            head: Bytes::from_static(b"another program's "),
            body: Bytes::from_static(b"value"),
            tail: Bytes::new(),
            seal: false,
        };
        let mut written = Vec::new();
        rt.block_on(write_to(&foreign, &mut written)).unwrap();
        assert_eq!(written, b"another program's value");
        assert_eq!(joined(&foreign), &b"another program's value"[..]);
    }

    #[test]
    fn torn_and_foreign_values_are_refused() {
        let ns = Namespace::new("m", "");
        let stored = joined(&encode(&ns, b"k", &Bytes::from(vec![9u8; 300]), info()).unwrap());
        assert_eq!(
            decode(&stored.slice(..stored.len() - 1), &ns, b"k"),
            Err(Reject::Torn)
        );
        let mut flipped = stored.to_vec();
        flipped[200] ^= 1;
        assert_eq!(decode(&Bytes::from(flipped), &ns, b"k"), Err(Reject::Torn));
        // A frame of version 1 (its checksum in the header) is not read as this version's.
        let mut older = stored.to_vec();
        older[4] = 1;
        assert_eq!(decode(&Bytes::from(older), &ns, b"k"), Err(Reject::Foreign));
        assert_eq!(
            decode(&Bytes::from_static(b"not ours"), &ns, b"k"),
            Err(Reject::Foreign)
        );
        assert_eq!(decode(&Bytes::new(), &ns, b"k"), Err(Reject::Foreign));
    }
}
