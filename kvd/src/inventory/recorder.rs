//! [`Recorder`]: the bounded buffer between the stores, which note every change of what a tier
//! holds, and the publisher task, which drains it.
//!
//! A store calls [`Recorder::record`] (or [`Recorder::append`] with what it gathered) while it
//! holds its own lock (L2's, an L3 shard's, the L4 inbox's), so the call does nothing but take
//! this buffer's lock, push 16 bytes a change and let go: no I/O, no await, no allocation
//! beyond the buffer's amortised growth (the publisher hands its drained buffer back, so after
//! warm-up the two buffers only trade places). This lock is a leaf: nothing is taken while it
//! is held.
//!
//! # Overflow
//! At most `limit` changes wait. One more means the publisher fell behind (its sink refused
//! batches, or the stores changed faster than it drains): the waiting changes are discarded and
//! counted as dropped, and the next batch starts with `AllBlocksCleared`. A discarded removal
//! must never be outlived by its earlier store, so none of the waiting changes may be
//! published after the clear; the changes recorded after the overflow are, since they
//! describe what the tiers did after the point the router starts over from. The router then
//! forgets this kvd's blocks and learns them again as they are stored: it may miss blocks the
//! kvd holds, never believe in blocks it dropped.

use super::{Change, ChangeKind};
use infera_core::event::Tier;
use std::sync::{Mutex, MutexGuard};
use tokio::sync::Notify;

/// Changes that may wait for the publisher at most (1 MiB of buffer).
pub const MAX_PENDING: usize = 65_536;
/// Waiting changes that wake the publisher before its next tick.
pub const WAKE_AT: usize = 4_096;

#[derive(Debug)]
struct Pending {
    changes: Vec<Change>,
    /// The next batch starts with `AllBlocksCleared` (at start, after a `clear` op, after an
    /// overflow or a batch the sink refused).
    clear: bool,
    /// Changes discarded since the last drain.
    dropped: u64,
}

/// What [`Recorder::drain`] took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// The batch must start with `AllBlocksCleared`.
    pub clear: bool,
    /// Changes discarded since the last drain (overflow).
    pub dropped: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Recorder {
    pending: Mutex<Pending>,
    wake: Notify,
    limit: usize,
    wake_at: usize,
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new(MAX_PENDING)
    }
}

impl Recorder {
    /// A recorder holding at most `limit` waiting changes, whose first batch is a clear.
    pub fn new(limit: usize) -> Self {
        let limit = limit.max(1);
        Self {
            pending: Mutex::new(Pending {
                changes: Vec::new(),
                clear: true,
                dropped: 0,
            }),
            wake: Notify::new(),
            limit,
            wake_at: WAKE_AT.min(limit),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Every update leaves the buffer consistent; a panicking holder cannot corrupt it.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes one change (see the module docs for the bound).
    pub fn record(&self, tier: Tier, kind: ChangeKind, hash: u64) {
        let change = Change { tier, kind, hash };
        let wake = {
            let mut p = self.lock();
            if p.changes.len() >= self.limit {
                p.dropped += p.changes.len() as u64;
                p.changes.clear();
                p.clear = true;
            }
            p.changes.push(change);
            p.changes.len() == self.wake_at
        };
        if wake {
            self.wake.notify_one();
        }
    }

    /// Notes `changes` in order (emptied; its capacity kept) in one hold of the lock. Past the
    /// bound, as [`Recorder::record`]: the waiting changes are dropped (and, were there more
    /// than the bound in `changes` alone, those too).
    pub fn append(&self, changes: &mut Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        let wake = {
            let mut p = self.lock();
            let before = p.changes.len();
            if before + changes.len() > self.limit {
                p.dropped += before as u64;
                p.changes.clear();
                p.clear = true;
                if changes.len() > self.limit {
                    p.dropped += changes.len() as u64;
                    changes.clear();
                }
            }
            let start = p.changes.len();
            p.changes.append(changes);
            start < self.wake_at && p.changes.len() >= self.wake_at
        };
        if wake {
            self.wake.notify_one();
        }
    }

    /// A `clear` op emptied every tier: whatever waits is moot, the next batch is a clear.
    pub fn cleared(&self) {
        let mut p = self.lock();
        p.changes.clear();
        p.clear = true;
    }

    /// A drained batch never reached the router (the sink refused it): the next batch starts
    /// with a clear.
    pub fn restart(&self) {
        self.lock().clear = true;
    }

    /// Moves the waiting changes into `into` (which must be empty; its capacity becomes the
    /// buffer's) and resets the clear flag and the drop count.
    pub fn drain(&self, into: &mut Vec<Change>) -> Drained {
        debug_assert!(into.is_empty());
        let mut p = self.lock();
        std::mem::swap(&mut p.changes, into);
        Drained {
            clear: std::mem::take(&mut p.clear),
            dropped: std::mem::take(&mut p.dropped),
        }
    }

    /// Changes waiting now.
    pub fn len(&self) -> usize {
        self.lock().changes.len()
    }

    /// Whether no change waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves once [`WAKE_AT`] changes wait (or at once, if they did since the last wait).
    pub async fn woken(&self) {
        self.wake.notified().await;
    }
}
