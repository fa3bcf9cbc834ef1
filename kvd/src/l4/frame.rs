//! kvd's own framing of every L4 value, so a value read back is used only when it is exactly
//! a block kvd wrote under that key: a foreign value (another program's), a torn one (cut
//! short, or its two LMCache keys out of step) or a colliding one (another key's block under
//! the same store name) reads as a miss and is counted, never as wrong bytes.
//!
//! Layout (little-endian), 64 header bytes, then the key blob, then the value:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `IKL4` |
//! | 4 | 1 | version (1) |
//! | 5 | 1 | retention class (`Retention as u8`) |
//! | 6 | 2 | reserved (0) |
//! | 8 | 8 | value length |
//! | 16 | 8 | expiry, ms on the writer's wall clock (`u64::MAX`: none) |
//! | 24 | 8 | writer id (random per daemon run) |
//! | 32 | 8 | the writer's sequence number of this write |
//! | 40 | 8 | written at, ms on the writer's wall clock |
//! | 48 | 4 | key blob length |
//! | 52 | 4 | reserved (0) |
//! | 56 | 8 | XXH3-64 of bytes 0..56, the key blob and the value |
//!
//! The key blob is the full key, not a digest of it: `u16` model length, model, `u16` compat
//! length, compat key, then the key bytes. A read compares it with the key asked for.

use crate::proto::Namespace;
use bytes::{BufMut, Bytes, BytesMut};
use infera_core::event::Retention;
use std::hash::Hasher;
use twox_hash::XxHash3_64;

const MAGIC: &[u8; 4] = b"IKL4";
const VERSION: u8 = 1;
/// Header bytes before the key blob.
pub const HEADER_BYTES: usize = 64;
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

/// A framed value in two parts (header + key blob, and the value itself), so a large value is
/// never copied to be framed. To a store, a value like any other (its two parts joined).
#[derive(Debug, Clone)]
pub struct Framed {
    pub head: Bytes,
    pub body: Bytes,
    /// The checksum is left to the store, which copies the frame out with [`write_sealed`]
    /// (see [`encode_unsealed`]); false for a value to store as it is.
    pub seal: bool,
}

impl Framed {
    /// Total length on the store.
    pub fn len(&self) -> usize {
        self.head.len() + self.body.len()
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

fn checksum(head: &[u8], blob: &[u8], body: &[u8]) -> u64 {
    let mut h = hasher();
    h.write(&head[..56]);
    h.write(blob);
    h.write(body);
    h.finish()
}

/// The length of the frame of `value` for `(ns, key)`, without building it; `None` when a
/// namespace part is longer than 64 KiB (such a key cannot be framed).
pub fn framed_len(ns: &Namespace, key: &[u8], value: usize) -> Option<usize> {
    let model = u16::try_from(ns.model.len()).ok()? as usize;
    let compat = u16::try_from(ns.compat_key.len()).ok()? as usize;
    Some(HEADER_BYTES + 4 + model + compat + key.len() + value)
}

/// Frames `value` for `(ns, key)`; `None` when a namespace part is longer than 64 KiB.
pub fn encode(ns: &Namespace, key: &[u8], value: &Bytes, info: FrameInfo) -> Option<Framed> {
    encode_with(ns, key, value, info, true)
}

/// [`encode`] without the checksum (its eight bytes zero, [`Framed::seal`] set), for a store
/// that copies the frame out with [`write_sealed`], which takes it during the copy.
pub fn encode_unsealed(
    ns: &Namespace,
    key: &[u8],
    value: &Bytes,
    info: FrameInfo,
) -> Option<Framed> {
    encode_with(ns, key, value, info, false)
}

/// The bytes of a value copied and checksummed at a time by [`write_sealed`]: small enough to
/// be checksummed from the core's cache right after its copy.
const SEAL_PIECE: usize = 128 << 10;

/// Copies `framed` out through `write(offset in the frame, bytes)`, checksumming each piece of
/// the value right after its copy (from cache, not memory) and writing the checksum last: one
/// pass over the value where [`encode`] and a copy make two. The bytes written are those of
/// [`encode`]'s frame.
pub fn write_sealed(framed: &Framed, mut write: impl FnMut(usize, &[u8])) {
    let (fields, blob) = (&framed.head[..56], &framed.head[HEADER_BYTES..]);
    let mut h = hasher();
    write(0, fields);
    h.write(fields);
    write(HEADER_BYTES, blob);
    h.write(blob);
    let mut at = framed.head.len();
    for piece in framed.body.chunks(SEAL_PIECE) {
        write(at, piece);
        h.write(piece);
        at += piece.len();
    }
    write(56, &h.finish().to_le_bytes());
}

/// A frame's header with its checksum (`sum`) in place.
fn sealed_head(framed: &Framed, sum: u64) -> Bytes {
    let mut head = BytesMut::from(&framed.head[..]);
    head[56..HEADER_BYTES].copy_from_slice(&sum.to_le_bytes());
    head.freeze()
}

fn checksum_of(framed: &Framed) -> u64 {
    checksum(&framed.head, &framed.head[HEADER_BYTES..], &framed.body)
}

/// Below this many bytes of frames to seal, a batch's checksums are taken by its writer as it
/// goes: handing them to a helper thread costs more than it saves.
const AHEAD_MIN: usize = 1 << 20;

/// The checksums of a batch's frames to seal ([`Framed::seal`]), for a store that sends the
/// frames one after the other (a socket's writer): the first is taken by the writer when
/// asked, the others in order on a blocking thread meanwhile, so a writer that is busy
/// copying frames into its socket finds each next checksum ready (at 16 GB/s from memory
/// against a few GB/s sent) instead of taking them all before its first byte goes out.
#[derive(Debug, Default)]
pub struct SealAhead {
    /// Frames still to hand out, in order.
    frames: std::collections::VecDeque<Framed>,
    /// Whether the first was handed out.
    started: bool,
    /// The helper's checksums of the frames after the first, in order (none for a small batch,
    /// or outside a runtime).
    ahead: Option<tokio::sync::mpsc::UnboundedReceiver<u64>>,
}

impl SealAhead {
    /// Starts on the frames to seal among `frames`, which are asked for in this order.
    pub fn start<'a>(frames: impl IntoIterator<Item = &'a Framed>) -> Self {
        let frames: std::collections::VecDeque<Framed> =
            frames.into_iter().filter(|f| f.seal).cloned().collect();
        let bytes: usize = frames.iter().map(Framed::len).sum();
        let runtime = tokio::runtime::Handle::try_current().ok();
        let ahead = runtime
            .filter(|_| frames.len() > 1 && bytes >= AHEAD_MIN)
            .map(|rt| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let rest: Vec<Framed> = frames.iter().skip(1).cloned().collect();
                // Stops early once the writer is gone (its batch failed or timed out).
                rt.spawn_blocking(move || {
                    for framed in &rest {
                        if tx.send(checksum_of(framed)).is_err() {
                            return;
                        }
                    }
                });
                rx
            });
        Self {
            frames,
            started: false,
            ahead,
        }
    }

    /// The header to send for `framed`: as it is unless it is to seal, else the next frame's
    /// header, sealed (the frames to seal must be asked for in the order given to
    /// [`SealAhead::start`]; one asked out of order would be stored with a checksum that does
    /// not match, and read as torn: a miss, never wrong bytes).
    pub async fn head(&mut self, framed: &Framed) -> Bytes {
        if !framed.seal {
            return framed.head.clone();
        }
        let Some(next) = self.frames.pop_front() else {
            return sealed_head(framed, checksum_of(framed));
        };
        let first = !std::mem::replace(&mut self.started, true);
        let sum = match &mut self.ahead {
            Some(rx) if !first => match rx.recv().await {
                Some(sum) => sum,
                None => checksum_of(&next),
            },
            _ => checksum_of(&next),
        };
        sealed_head(&next, sum)
    }
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
    head.put_u64_le(if sealed {
        checksum(&head, &blob, value)
    } else {
        0
    });
    head.put_slice(&blob);
    Some(Framed {
        head: head.freeze(),
        body: value.clone(),
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
        .ok_or(Reject::Torn)?;
    if total != stored.len() as u64 {
        return Err(Reject::Torn);
    }
    let blob_end = HEADER_BYTES + blob_len as usize;
    let (blob, body) = (&stored[HEADER_BYTES..blob_end], &stored[blob_end..]);
    if checksum(&stored[..56], blob, body) != u64_at(stored, 56) {
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
    Ok((stored.slice(blob_end..), info))
}

/// The two parts as one buffer (for stores that take one value, and tests).
pub fn joined(framed: &Framed) -> Bytes {
    let mut out = BytesMut::with_capacity(framed.len());
    out.put_slice(&framed.head);
    out.put_slice(&framed.body);
    out.freeze()
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

    #[test]
    fn a_frame_sealed_while_copied_is_the_encoded_frame() {
        let ns = Namespace::new("m", "fp8");
        // Over two pieces and a part, so the checksum runs across pieces.
        let value = Bytes::from(
            (0..2 * SEAL_PIECE + 77)
                .map(|i| i as u8)
                .collect::<Vec<_>>(),
        );
        let sealed = joined(&encode(&ns, b"k", &value, info()).unwrap());
        let unsealed = encode_unsealed(&ns, b"k", &value, info()).unwrap();
        assert!(unsealed.seal);
        assert_ne!(joined(&unsealed), sealed, "the checksum is left out");
        let mut out = vec![0xAAu8; unsealed.len()];
        write_sealed(&unsealed, |at, bytes| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
        });
        assert_eq!(out, sealed);
        assert!(decode(&sealed, &ns, b"k").is_ok());
    }

    /// Frames sealed ahead (the first by the writer, the rest by the helper thread) are
    /// `encode`'s frames, in a runtime or not; a frame not to seal keeps its header.
    #[test]
    fn frames_sealed_ahead_are_the_encoded_frames() {
        let ns = Namespace::new("m", "fp8");
        let values: Vec<Bytes> = (0..5u8)
            .map(|i| Bytes::from(vec![i; AHEAD_MIN / 3 + usize::from(i)]))
            .collect();
        let key = |i: usize| format!("k{i}").into_bytes();
        let info = |i: usize| FrameInfo {
            seq: i as u64,
            ..info()
        };
        let sealed: Vec<Framed> = (0..5)
            .map(|i| encode(&ns, &key(i), &values[i], info(i)).unwrap())
            .collect();
        let mut frames: Vec<Framed> = (0..5)
            .map(|i| encode_unsealed(&ns, &key(i), &values[i], info(i)).unwrap())
            .collect();
        // One of them is another program's value, stored as it is.
        frames[2] = Framed {
            seal: false,
            ..sealed[2].clone()
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let heads = |seals: &mut SealAhead| {
            frames
                .iter()
                .map(|f| rt.block_on(seals.head(f)))
                .collect::<Vec<_>>()
        };
        let mut ahead = rt.block_on(async { SealAhead::start(&frames) });
        assert!(ahead.ahead.is_some(), "the helper takes them over 1 MiB");
        let mut inline = SealAhead::start(&frames);
        assert!(inline.ahead.is_none(), "no runtime, no helper");
        for seals in [&mut ahead, &mut inline] {
            let got = heads(seals);
            for (i, head) in got.iter().enumerate() {
                assert_eq!(head, &sealed[i].head, "frame {i}");
            }
        }
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
        assert_eq!(
            decode(&Bytes::from_static(b"not ours"), &ns, b"k"),
            Err(Reject::Foreign)
        );
        assert_eq!(decode(&Bytes::new(), &ns, b"k"), Err(Reject::Foreign));
    }
}
