//! The overlap query: for each candidate slot, how many leading blocks of a request it holds.
//!
//! One pass over the request's blocks with a bitset of still-matching candidates: each block's
//! holder set is AND-ed in, the candidates that fall out record the block position where they
//! stopped, and the walk ends as soon as no candidate is left. Cost: one hash lookup per block up to
//! the deepest candidate's overlap + 1, plus a few word operations; no allocation when every
//! candidate slot is below 64 (the common fleet size); above that, two small scratch vectors and,
//! per block held by some slot ≥ 64, a second lookup for the high slots.

use super::WorkerSlot;
use super::holders::{LOW_SLOTS, TierHolders};
use crate::ids::BlockHash;

/// Saturating conversion of a block position to the output type.
fn depth_of(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

impl TierHolders {
    /// See [`super::KvIndex::overlap`].
    pub(crate) fn overlap(
        &self,
        blocks: &[BlockHash],
        candidates: &[WorkerSlot],
        out: &mut Vec<u32>,
    ) {
        out.clear();
        // Slots beyond the widest holder row hold nothing: they answer 0 without widening the
        // live set (a stray `WorkerSlot(u32::MAX)` must not allocate gigabytes).
        let limit = self.slot_limit();
        let max = candidates
            .iter()
            .map(|c| c.0)
            .filter(|&s| s < limit)
            .max()
            .unwrap_or(0);
        if max < LOW_SLOTS {
            self.overlap_low(blocks, candidates, out);
        } else {
            self.overlap_wide(blocks, candidates, max, out);
        }
    }

    /// Every candidate slot that can hold anything is below 64: the live set is one word.
    fn overlap_low(&self, blocks: &[BlockHash], candidates: &[WorkerSlot], out: &mut Vec<u32>) {
        let mut live = 0u64;
        for c in candidates.iter().filter(|c| c.0 < LOW_SLOTS) {
            live |= 1u64 << c.0;
        }
        let mut depth = [0u32; LOW_SLOTS as usize];
        for (i, b) in blocks.iter().enumerate() {
            let next = live & self.low_word(b.0).unwrap_or(0);
            let mut gone = live ^ next;
            while gone != 0 {
                depth[gone.trailing_zeros() as usize] = depth_of(i);
                gone &= gone - 1;
            }
            live = next;
            if live == 0 {
                break;
            }
        }
        let full = depth_of(blocks.len());
        while live != 0 {
            depth[live.trailing_zeros() as usize] = full;
            live &= live - 1;
        }
        out.extend(
            candidates
                .iter()
                .map(|c| depth.get(c.index()).copied().unwrap_or(0)),
        );
    }

    /// Some candidate slot is 64 or above: the live set spans `max / 64 + 1` words; candidates
    /// above `max` hold nothing.
    fn overlap_wide(
        &self,
        blocks: &[BlockHash],
        candidates: &[WorkerSlot],
        max: u32,
        out: &mut Vec<u32>,
    ) {
        let words = max as usize / 64 + 1;
        let mut live = vec![0u64; words];
        for c in candidates.iter().filter(|c| c.0 <= max) {
            live[c.index() / 64] |= 1u64 << (c.0 % 64);
        }
        let mut depth = vec![0u32; words * 64];
        let mut any = true;
        for (i, b) in blocks.iter().enumerate() {
            let (low, high) = match self.low_word(b.0) {
                Some(low) => (low, self.high_words(b.0)),
                None => (0, &[][..]),
            };
            any = false;
            for (j, l) in live.iter_mut().enumerate() {
                if *l == 0 {
                    continue;
                }
                let held = match j {
                    0 => low,
                    _ => high.get(j - 1).copied().unwrap_or(0),
                };
                let next = *l & held;
                let mut gone = *l ^ next;
                while gone != 0 {
                    depth[j * 64 + gone.trailing_zeros() as usize] = depth_of(i);
                    gone &= gone - 1;
                }
                *l = next;
                any |= next != 0;
            }
            if !any {
                break;
            }
        }
        if any {
            let full = depth_of(blocks.len());
            for (j, &l) in live.iter().enumerate() {
                let mut l = l;
                while l != 0 {
                    depth[j * 64 + l.trailing_zeros() as usize] = full;
                    l &= l - 1;
                }
            }
        }
        out.extend(
            candidates
                .iter()
                .map(|c| depth.get(c.index()).copied().unwrap_or(0)),
        );
    }
}
