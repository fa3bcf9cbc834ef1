//! The recent-pick window behind the balance term (`--router-balance-tokens`).
//!
//! The fleet remembers where its last legs went: [`PICKS_PER_RANK`] for each routable rank (at
//! most [`MAX_PICKS`]), the oldest forgotten first, each with the end of the prompt it carried ([`PromptEnd`]). The
//! router compares each candidate's share of that window with the candidates' mean. In-flight
//! load alone cannot keep a fleet balanced when requests are short and a prefix is hot: the
//! holder is idle again by the time the next request sharing that prefix arrives, so it takes
//! all of them, and no other worker ever pays the one prefill that would let it share the
//! traffic. Counting recent picks makes a worker that took more than its share pay for it, so a
//! hot prefix spreads over a few holders.
//!
//! A request is never charged for its own conversation: a pick whose prompt the request
//! extends is one of its earlier turns, and each prompt length counts once as such (a
//! conversation has one turn of each length; many picks of one shared prefix, a system prompt
//! sent alone, are other requests). Like tips, the window is soft state: a snapshot does not
//! carry it.

use crate::ids::BlockHash;
use crate::index::WorkerSlot;
use std::collections::VecDeque;

/// Picks remembered per routable rank.
pub const PICKS_PER_RANK: usize = 64;
/// Picks remembered at most, whatever the fleet's size: a decision with the balance term on
/// reads the whole window.
pub const MAX_PICKS: usize = 4096;

/// The end of a prompt: its length in blocks and its last block. Hashes are chained, so a
/// prompt whose block at that position is the same extends it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PromptEnd {
    blocks: u32,
    last: BlockHash,
}

impl PromptEnd {
    /// The end of a prompt of `blocks`; `None` for an empty one.
    pub(super) fn of(blocks: &[BlockHash]) -> Option<Self> {
        blocks.last().map(|last| Self {
            blocks: u32::try_from(blocks.len()).unwrap_or(u32::MAX),
            last: *last,
        })
    }

    /// Its length in blocks.
    pub(super) fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Whether a prompt of `blocks` extends this one (or is it).
    pub(super) fn continued_by(&self, blocks: &[BlockHash]) -> bool {
        let n = self.blocks as usize;
        n > 0 && blocks.get(n - 1) == Some(&self.last)
    }
}

/// The last legs routed, oldest first.
#[derive(Debug, Clone, Default)]
pub(super) struct RecentPicks {
    picks: VecDeque<(WorkerSlot, PromptEnd)>,
}

impl RecentPicks {
    /// Remembers a leg to `slot` with a prompt of `blocks`, keeping at most [`PICKS_PER_RANK`]
    /// per rank of the `ranks` routable, and [`MAX_PICKS`] in all.
    pub(super) fn push(&mut self, slot: WorkerSlot, blocks: &[BlockHash], ranks: usize) {
        let Some(end) = PromptEnd::of(blocks) else {
            return;
        };
        let cap = (PICKS_PER_RANK * ranks.max(1)).min(MAX_PICKS);
        while self.picks.len() >= cap {
            self.picks.pop_front();
        }
        self.picks.push_back((slot, end));
    }

    /// Forgets the picks of the slots `gone` says left routing (their slots may be reused).
    pub(super) fn forget(&mut self, gone: impl Fn(WorkerSlot) -> bool) {
        self.picks.retain(|(slot, _)| !gone(*slot));
    }

    /// The picks per slot (indexed by slot) that are not the own conversation of a prompt of
    /// `blocks` (see the module docs).
    pub(super) fn count(&self, blocks: &[BlockHash], out: &mut Vec<u32>) {
        out.clear();
        let mut own: Vec<u32> = Vec::new();
        for (slot, end) in &self.picks {
            if end.continued_by(blocks) && !own.contains(&end.blocks) {
                own.push(end.blocks);
                continue;
            }
            let i = slot.index();
            if out.len() <= i {
                out.resize(i + 1, 0);
            }
            out[i] += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().map(|i| BlockHash(*i)).collect()
    }

    #[test]
    fn a_conversations_own_turns_are_left_out_once_per_length() {
        let mut r = RecentPicks::default();
        let (a, b) = (WorkerSlot(0), WorkerSlot(1));
        // Two turns of one conversation on a, the shared system prompt alone three times on b.
        r.push(a, &prompt(&[1, 2]), 2);
        r.push(a, &prompt(&[1, 2, 3]), 2);
        for _ in 0..3 {
            r.push(b, &prompt(&[1]), 2);
        }
        let mut out = Vec::new();
        r.count(&prompt(&[1, 2, 3, 4]), &mut out);
        // Its two turns are its own; one of the three system prompts counts as its first turn.
        assert_eq!(out, vec![0, 2]);
        // Another conversation under the same system prompt owns none of a's picks.
        r.count(&prompt(&[1, 9]), &mut out);
        assert_eq!(out, vec![2, 2]);
    }

    #[test]
    fn the_window_keeps_the_newest_picks_per_rank_and_forgets_gone_ranks() {
        let mut r = RecentPicks::default();
        let total = PICKS_PER_RANK * 2;
        for i in 0..total + 10 {
            let slot = WorkerSlot(u32::from(i >= total));
            r.push(slot, &prompt(&[100 + i as u64]), 2);
        }
        let mut out = Vec::new();
        r.count(&prompt(&[7]), &mut out);
        assert_eq!(out, vec![total as u32 - 10, 10]);
        r.forget(|s| s == WorkerSlot(0));
        r.count(&prompt(&[7]), &mut out);
        assert_eq!(out, vec![0, 10]);
        // An empty prompt leaves nothing to remember.
        r.push(WorkerSlot(0), &[], 2);
        r.count(&prompt(&[7]), &mut out);
        assert_eq!(out, vec![0, 10]);
    }
}
