//! Byte-level BPE over one pre-token, with the semantics of `tokenizers`' `BPE` model.
//!
//! The crate's model, for a pre-token whose bytes map (GPT-2 `ByteLevel`) to chars that are all
//! in the vocabulary and with no prefix/suffix/`ignore_merges`/dropout, starts from one symbol
//! per byte and repeatedly applies the merge of lowest rank among adjacent pairs, the leftmost
//! one on a tie (its heap orders by `(rank, position)`, and with distinct ids per vocab string a
//! stale heap entry is never taken for a live pair). Any algorithm that applies the same
//! sequence of merges gives the same ids; we use two:
//!
//! * **Linear** (up to [`LINEAR_MAX`] bytes): symbols and the packed `(rank, new id)` of each
//!   adjacent pair in two small vectors; scan for the minimum, merge, re-look-up the two pairs
//!   next to the merge. Quadratic, but with no allocation and 2-3 hash probes per merge it beats
//!   a heap on the short pieces that make up almost all text.
//! * **Heap** (longer pieces: long runs of symbols, base64, CJK runs): a linked list of symbols
//!   and a binary heap of `(rank, position)` with lazy invalidation, `O(n log n)`.
//!
//! Merge table: [`FxHashMap`] from `left << 32 | right` to `rank << 32 | new_id`, built from the
//! tokenizer.json merges in list order (a repeated pair keeps its last rank, as the crate's
//! `HashMap::collect` does).
//!
//! Word table: for every vocabulary token of 2..=15 bytes whose own BPE is that single token,
//! its bytes (packed with the length into a `u128`) map to its id; built once at load, never
//! written after, so it needs no lock. Most pre-tokens of real text are such tokens, so they
//! cost one probe instead of a merge loop.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rayon::prelude::*;
use rustc_hash::FxHashMap;

/// Pieces up to this many bytes use the linear merge loop.
pub(crate) const LINEAR_MAX: usize = 64;
/// Longest pre-token kept in the word table (the packed key holds 15 bytes and the length).
pub(crate) const WORD_MAX: usize = 15;

const NO_MERGE: u64 = u64::MAX;
const NONE: u32 = u32::MAX;

/// Merge rules, per-byte start symbols and the word table of one vocabulary.
#[derive(Debug)]
pub(crate) struct Bpe {
    byte_ids: [u32; 256],
    merges: FxHashMap<u64, u64>,
    words: FxHashMap<u128, u32>,
}

/// Reusable buffers for [`Bpe::encode_word`]; one per thread of work.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    syms: Vec<u32>,
    ranks: Vec<u64>,
    prev: Vec<u32>,
    next: Vec<u32>,
    heap: BinaryHeap<Reverse<(u32, u32)>>,
}

impl Bpe {
    /// `byte_ids[b]` is the id of byte `b`'s `ByteLevel` char; `merges` lists
    /// `(left id, right id, merged id)` by rank.
    pub(crate) fn new(
        byte_ids: [u32; 256],
        merges: impl IntoIterator<Item = (u32, u32, u32)>,
    ) -> Self {
        let merges = merges.into_iter();
        let mut map = FxHashMap::with_capacity_and_hasher(merges.size_hint().0, Default::default());
        for (rank, (left, right, merged)) in merges.into_iter().enumerate() {
            map.insert(
                pair_key(left, right),
                ((rank as u64) << 32) | u64::from(merged),
            );
        }
        Self {
            byte_ids,
            merges: map,
            words: FxHashMap::default(),
        }
    }

    /// Fills the word table from `(bytes, len, id)` of vocabulary tokens: a token goes in when
    /// its own BPE is that single token. The BPE runs are spread over the rayon pool.
    pub(crate) fn learn_words(&mut self, tokens: &[([u8; WORD_MAX], usize, u32)]) {
        let words: Vec<(u128, u32)> = tokens
            .par_iter()
            .map_init(
                || (Scratch::default(), Vec::new()),
                |(scratch, out), (bytes, len, id)| {
                    let bytes = &bytes[..*len];
                    out.clear();
                    self.merge(bytes, scratch, out);
                    (out.as_slice() == [*id]).then(|| (word_key(bytes), *id))
                },
            )
            .flatten()
            .collect();
        self.words.reserve(words.len());
        self.words.extend(words);
    }

    /// Number of entries in the word table.
    #[cfg(test)]
    pub(crate) fn words(&self) -> usize {
        self.words.len()
    }

    /// Appends the ids of the pre-token `bytes` to `out`.
    #[inline]
    pub(crate) fn encode_word(&self, bytes: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        match bytes.len() {
            0 => {}
            1 => out.push(self.byte_ids[bytes[0] as usize]),
            len => {
                if len <= WORD_MAX
                    && let Some(&id) = self.words.get(&word_key(bytes))
                {
                    out.push(id);
                    return;
                }
                self.merge(bytes, scratch, out);
            }
        }
    }

    /// BPE without the word table.
    fn merge(&self, bytes: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if bytes.len() <= LINEAR_MAX {
            self.merge_linear(bytes, scratch, out);
        } else {
            self.merge_heap(bytes, scratch, out);
        }
    }

    #[inline]
    fn lookup(&self, left: u32, right: u32) -> u64 {
        self.merges
            .get(&pair_key(left, right))
            .copied()
            .unwrap_or(NO_MERGE)
    }

    pub(crate) fn merge_linear(&self, bytes: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let syms = &mut scratch.syms;
        let ranks = &mut scratch.ranks;
        syms.clear();
        syms.extend(bytes.iter().map(|&b| self.byte_ids[b as usize]));
        ranks.clear();
        ranks.extend(syms.windows(2).map(|w| self.lookup(w[0], w[1])));
        loop {
            // Packed values order by rank first; equal ranks mean the same pair, and the strict
            // comparison keeps the leftmost.
            let mut best = NO_MERGE;
            let mut at = 0;
            for (k, &r) in ranks.iter().enumerate() {
                if r < best {
                    best = r;
                    at = k;
                }
            }
            if best == NO_MERGE {
                break;
            }
            syms[at] = best as u32;
            syms.remove(at + 1);
            ranks.remove(at);
            if at > 0 {
                ranks[at - 1] = self.lookup(syms[at - 1], syms[at]);
            }
            if at < ranks.len() {
                ranks[at] = self.lookup(syms[at], syms[at + 1]);
            }
        }
        out.extend_from_slice(syms);
    }

    pub(crate) fn merge_heap(&self, bytes: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let n = bytes.len();
        if n == 0 {
            return;
        }
        let Scratch {
            syms,
            prev,
            next,
            heap,
            ..
        } = scratch;
        syms.clear();
        syms.extend(bytes.iter().map(|&b| self.byte_ids[b as usize]));
        prev.clear();
        prev.extend((0..n as u32).map(|k| k.wrapping_sub(1)));
        next.clear();
        next.extend((1..=n as u32).map(|k| if (k as usize) < n { k } else { NONE }));
        heap.clear();
        for k in 0..n - 1 {
            let merge = self.lookup(syms[k], syms[k + 1]);
            if merge != NO_MERGE {
                heap.push(Reverse(((merge >> 32) as u32, k as u32)));
            }
        }
        // `syms[k] == NONE` marks a symbol merged into its left neighbour.
        while let Some(Reverse((rank, pos))) = heap.pop() {
            let pos = pos as usize;
            let right = next[pos];
            if syms[pos] == NONE || right == NONE {
                continue;
            }
            let right = right as usize;
            let merge = self.lookup(syms[pos], syms[right]);
            // A stale entry: the pair at `pos` changed since it was pushed.
            if merge == NO_MERGE || (merge >> 32) as u32 != rank {
                continue;
            }
            syms[pos] = merge as u32;
            syms[right] = NONE;
            let after = next[right];
            next[pos] = after;
            if after != NONE {
                prev[after as usize] = pos as u32;
            }
            let before = prev[pos];
            if before != NONE {
                let m = self.lookup(syms[before as usize], syms[pos]);
                if m != NO_MERGE {
                    heap.push(Reverse(((m >> 32) as u32, before)));
                }
            }
            if after != NONE {
                let m = self.lookup(syms[pos], syms[after as usize]);
                if m != NO_MERGE {
                    heap.push(Reverse(((m >> 32) as u32, pos as u32)));
                }
            }
        }
        let mut k = 0;
        while k != NONE as usize {
            out.push(syms[k]);
            k = next[k] as usize;
        }
    }
}

#[inline]
fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// Up to 15 bytes little-endian, the length in the top byte (so keys of different lengths
/// differ even when the shorter one ends in zero bytes).
#[inline]
fn word_key(bytes: &[u8]) -> u128 {
    let len = bytes.len();
    let load = |b: &[u8]| {
        let mut word = [0u8; 8];
        word.copy_from_slice(b);
        u64::from_le_bytes(word)
    };
    let (lo, hi) = if len >= 8 {
        // The last eight bytes, shifted down so that bytes[8..] start at bit 0.
        let hi = if len == 8 {
            0
        } else {
            load(&bytes[len - 8..]) >> (8 * (16 - len))
        };
        (load(&bytes[..8]), hi)
    } else {
        let lo = bytes
            .iter()
            .enumerate()
            .fold(0u64, |acc, (i, &b)| acc | (u64::from(b) << (8 * i)));
        (lo, 0)
    };
    u128::from(lo) | (u128::from(hi) << 64) | ((len as u128) << 120)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Bytes map to ids 0..256; merges over a tiny alphabet so that many overlap.
    fn toy() -> Bpe {
        let mut byte_ids = [0u32; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = b as u32;
        }
        // a=97 b=98 c=99; merged ids from 1000.
        let merges = vec![
            (97, 97, 1000),     // aa
            (98, 99, 1001),     // bc
            (1000, 98, 1002),   // aab
            (97, 98, 1003),     // ab
            (1003, 99, 1004),   // abc
            (1000, 1000, 1005), // aaaa
            (99, 97, 1006),     // ca
            (1001, 1006, 1007), // bcca? (b c + c a)
            (1006, 1000, 1008), // caaa
        ];
        Bpe::new(byte_ids, merges)
    }

    #[test]
    fn known_merges() {
        let bpe = toy();
        let mut scratch = Scratch::default();
        for (word, want) in [
            (&b"aaab"[..], &[1000, 1003][..]),
            (b"aab", &[1002]),
            (b"abc", &[97, 1001]),
            (b"aaaa", &[1005]),
            (b"x", &[120]),
        ] {
            let (mut linear, mut heap) = (Vec::new(), Vec::new());
            bpe.merge_linear(word, &mut scratch, &mut linear);
            bpe.merge_heap(word, &mut scratch, &mut heap);
            assert_eq!(linear, want, "{word:?}");
            assert_eq!(heap, want, "{word:?}");
        }
    }

    #[test]
    fn word_keys_pack_bytes_and_length() {
        for len in 0..=WORD_MAX {
            let bytes: Vec<u8> = (1..=len as u8).collect();
            let mut buf = [0u8; 16];
            buf[..len].copy_from_slice(&bytes);
            buf[15] = len as u8;
            assert_eq!(word_key(&bytes), u128::from_le_bytes(buf), "len {len}");
        }
        assert_ne!(word_key(b"a"), word_key(b"a\0"));
    }

    proptest! {
        #[test]
        fn linear_and_heap_agree(word in prop::collection::vec(prop::sample::select(vec![b'a', b'b', b'c']), 1..120)) {
            let bpe = toy();
            let mut scratch = Scratch::default();
            let (mut linear, mut heap) = (Vec::new(), Vec::new());
            bpe.merge_linear(&word, &mut scratch, &mut linear);
            bpe.merge_heap(&word, &mut scratch, &mut heap);
            prop_assert_eq!(linear, heap);
        }
    }
}
