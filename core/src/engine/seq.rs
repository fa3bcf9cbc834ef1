//! A sequence of the [`super::scheduler`] and its block accounting: what it holds (`held`
//! published blocks, then `anon` anonymous ones), growing it (sharing, evicting, publishing) and
//! releasing it. See the scheduler's module docs, "Block accounting of a sequence".

use super::cache::{BlockCache, Lookup};
use super::{EngineStats, KvChange, Prefilled, SimRequest};
use crate::ids::BlockHash;

#[derive(Debug)]
pub(super) struct Seq {
    pub(super) id: u64,
    pub(super) blocks: Vec<BlockHash>,
    /// Effective prompt length (at least one token and the complete blocks given).
    pub(super) prompt: u64,
    /// Requested output tokens.
    pub(super) output: u32,
    pub(super) generated: u32,
    /// Tokens whose KV is allocated (computed, or being computed in this step).
    pub(super) kv_len: u64,
    pub(super) held: Vec<u32>,
    pub(super) anon: usize,
    /// Still publishing prompt blocks (false after a hash conflict).
    pub(super) hash_ok: bool,
    pub(super) decoding: bool,
    /// Hit figures of the first admission, reported once prefill completes.
    pub(super) first: Option<Prefilled>,
    pub(super) prefilled_sent: bool,
    /// Tokens scheduled in the current step (0: not scheduled).
    pub(super) step_tokens: u64,
}

impl Seq {
    pub(super) fn new(req: SimRequest, block_size: u64) -> Self {
        let from_blocks = req.blocks.len() as u64 * block_size;
        let prompt = u64::from(req.prompt_tokens).max(from_blocks).max(1);
        Self {
            id: req.id,
            held: Vec::with_capacity(req.blocks.len()),
            blocks: req.blocks,
            prompt,
            output: req.output_tokens,
            generated: 0,
            kv_len: 0,
            anon: 0,
            hash_ok: true,
            decoding: false,
            first: None,
            prefilled_sent: false,
            step_tokens: 0,
        }
    }

    pub(super) fn target_output(&self) -> u32 {
        self.output.max(1)
    }

    /// Tokens the (re)prefill must cover: the prompt plus tokens already generated.
    pub(super) fn prefill_len(&self) -> u64 {
        self.prompt + u64::from(self.generated)
    }

    /// Most KV tokens the sequence ever holds (the last token generated needs no KV).
    pub(super) fn max_kv_len(&self) -> u64 {
        self.prompt + u64::from(self.target_output()) - 1
    }
}

/// Releases everything `seq` holds (its published blocks stay cached).
pub(super) fn release(cache: &mut BlockCache, seq: &mut Seq) {
    for &slot in &seq.held {
        cache.release(slot);
    }
    seq.held.clear();
    cache.free_anonymous(seq.anon);
    seq.anon = 0;
    seq.kv_len = 0;
    seq.hash_ok = true;
}

/// Grows `seq`'s KV to `new_len` tokens: shares resident blocks it can, evicts what it must,
/// publishes prompt blocks that became full, and takes anonymous blocks for the rest.
///
/// Returns `false`, changing nothing, when the blocks cannot be found.
pub(super) fn grow(
    cache: &mut BlockCache,
    seq: &mut Seq,
    new_len: u64,
    bs: u64,
    kv: &mut Vec<KvChange>,
    stats: &mut EngineStats,
) -> bool {
    let target = new_len.div_ceil(bs) as usize;
    let held = seq.held.len();
    let owned = held + seq.anon;
    let full = if seq.hash_ok {
        ((new_len / bs) as usize).min(seq.blocks.len())
    } else {
        held
    };
    if target <= owned && full <= held {
        seq.kv_len = new_len;
        return true;
    }

    // Plan (read-only): how far the chain continues in the cache, and what that frees or takes.
    let mut shared_end = held;
    let mut parent = seq.held.last().copied();
    let mut unreferenced_shared = 0;
    let mut conflict = false;
    while shared_end < full {
        match cache.lookup(seq.blocks[shared_end], parent) {
            Lookup::Hit(slot) => {
                unreferenced_shared += usize::from(cache.refs(slot) == 0);
                parent = Some(slot);
                shared_end += 1;
            }
            Lookup::Conflict => {
                conflict = true;
                break;
            }
            Lookup::Absent => break,
        }
    }
    let anon_replaced = owned.min(shared_end) - held;
    let needed = target - owned.max(shared_end);
    if needed > cache.available() + anon_replaced - unreferenced_shared {
        return false;
    }

    // Commit: share, make room, then publish or take anonymous blocks up to `target`.
    let mut parent = seq.held.last().copied();
    for i in held..shared_end {
        if let Lookup::Hit(slot) = cache.lookup(seq.blocks[i], parent) {
            cache.acquire(slot);
            seq.held.push(slot);
            parent = Some(slot);
        }
    }
    cache.free_anonymous(anon_replaced);
    seq.anon -= anon_replaced;
    if conflict {
        seq.hash_ok = false;
    }
    if needed > cache.free() {
        let mut removed = Vec::new();
        let ok = cache.evict_until_free(needed, &mut removed);
        stats.blocks_removed += removed.len() as u64;
        if !removed.is_empty() {
            kv.push(KvChange::Removed { blocks: removed });
        }
        debug_assert!(ok, "capacity was checked before evicting");
        if !ok {
            return false;
        }
    }

    let run_parent = seq.held.last().map(|&slot| cache.hash_of(slot));
    let mut stored = Vec::new();
    for i in seq.held.len()..target {
        // Blocks before `held + anon` are already owned (anonymous); later ones are new.
        let existing = i < seq.held.len() + seq.anon;
        if seq.hash_ok
            && i == seq.held.len()
            && i < full
            && publish(cache, seq, existing, &mut stored)
        {
            continue;
        }
        if !existing && !take_anonymous(cache, seq) {
            break;
        }
    }
    if !stored.is_empty() {
        stats.blocks_stored += stored.len() as u64;
        kv.push(KvChange::Stored {
            parent: run_parent,
            blocks: stored,
        });
    }
    seq.kv_len = new_len;
    true
}

/// Publishes (or shares) the prompt block at `seq.held.len()`, which `seq` already owns as an
/// anonymous block if `existing`. Returns `false` if the block must stay (or become) anonymous.
fn publish(
    cache: &mut BlockCache,
    seq: &mut Seq,
    existing: bool,
    stored: &mut Vec<BlockHash>,
) -> bool {
    let hash = seq.blocks[seq.held.len()];
    let parent = seq.held.last().copied();
    let slot = match cache.lookup(hash, parent) {
        Lookup::Conflict => {
            seq.hash_ok = false;
            return false;
        }
        Lookup::Hit(slot) => {
            // Someone published it meanwhile: share theirs, give back ours.
            cache.acquire(slot);
            if existing {
                cache.free_anonymous(1);
            }
            slot
        }
        Lookup::Absent => {
            // An owned block is reused in place; a new one takes a block reserved by `grow`.
            if existing {
                cache.free_anonymous(1);
            }
            let Some(slot) = cache.insert(hash, parent) else {
                debug_assert!(false, "a free block was reserved");
                // Cannot fail: the block was just freed.
                let _ = existing && cache.alloc_anonymous(1);
                seq.hash_ok = false;
                return false;
            };
            stored.push(hash);
            slot
        }
    };
    if existing {
        seq.anon -= 1;
    }
    seq.held.push(slot);
    true
}

/// Takes one new anonymous block for `seq`; `false` only if `grow`'s reservation was wrong.
fn take_anonymous(cache: &mut BlockCache, seq: &mut Seq) -> bool {
    if cache.alloc_anonymous(1) {
        seq.anon += 1;
        true
    } else {
        debug_assert!(false, "a free block was reserved");
        false
    }
}
