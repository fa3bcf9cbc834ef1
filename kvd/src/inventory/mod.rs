//! kvd's inventory: every change of what a tier holds, published as KV events in vLLM's wire
//! layout (PROTOCOLS.md §6, "Inventory events"; the contract on the router's side is
//! `infera_core::kv_events::kvd`), so that the router credits a worker for the blocks its
//! node's kvd can load.
//!
//! # What is recorded
//! A block is named by its inventory hash, `infera_core::kv_events::kvd::inventory_hash` of
//! its namespace and key, computed where the key is at hand and kept beside the entry (L2's
//! entry, the L3 slot), so a removal needs no key:
//! - L2 (`Tier::Host`): an admitted key is stored (an overwrite of a held key again, with no
//!   removal); an evicted, replaced-by-collision or expired one is removed (an expired entry
//!   when it is next looked up or swept: the daemon sweeps every tier every second).
//! - L3 (`Tier::Disk`): a put recorded in the index is stored; an entry dropped from it
//!   (evicted for room, replaced, expired, a failed write or check) is removed. Entries the
//!   index recovered at start are not announced: the recovered index holds key hashes, not
//!   keys, so their inventory hashes are unknown (they are found by `get` as before, and a
//!   later put of the key announces it).
//! - L4 (`Tier::External`): a put queued for the store is stored; a removal kvd makes (a
//!   lower-class write of the key, a put dropped because the queue is full or the store down,
//!   a put the store refused) is removed. The store is shared and kvd keeps no index of it:
//!   blocks the store itself evicts, or whose queued write is lost to a store failure, stay
//!   announced until kvd removes the key or restarts.
//! - A `clear` op: `AllBlocksCleared` (the tiers drop the cleared entries without a removal
//!   each). So does the start of the daemon, an overflow of the recorder and a batch the sink
//!   refused (see [`recorder`]).
//!
//! # Cost on the data path
//! The stores compute an inventory hash only when publishing is on ([`Inventory::hash`] is
//! `None` otherwise; one XXH3 pass over a copy on the stack), before taking their locks where
//! they can, and under a lock only note the change: L2 into a vector of its own state, handed
//! to the [`Recorder`] in one append as its lock is released (one hold of the recorder's leaf
//! mutex per SET, whatever it evicted), L3 and L4 straight into the recorder (16 bytes into a
//! bounded buffer). Everything else (grouping into events, encoding, the socket) happens in
//! the publisher task. Order is kept within a tier (each notes its changes under the lock that
//! orders them); across tiers it is not defined, and the router needs none.
//!
//! # The port
//! [`InventorySink`] is where batches leave the crate: the binary implements it over a
//! ZeroMQ PUB socket and replay ring (vLLM's layout), this crate knows no transport.

pub mod load;
pub mod publisher;
pub mod recorder;

pub use load::{LoadMeter, Served, TierLoad};
pub use publisher::{HEARTBEAT_EVERY, PublishCounters, Publisher};
pub use recorder::{MAX_PENDING, Recorder};

use crate::proto::Namespace;
use infera_core::event::Tier;
use infera_core::kv_events::EngineBatch;
use infera_core::kv_events::kvd::inventory_hash;
use std::sync::Arc;

/// The tiers a kvd publishes, in the order of the per-tier arrays here: L2, L3, L4.
pub const TIERS: [Tier; 3] = [Tier::Host, Tier::Disk, Tier::External];

/// The index of `tier` in [`TIERS`].
pub fn tier_slot(tier: Tier) -> Option<usize> {
    TIERS.iter().position(|t| *t == tier)
}

/// Whether a tier gained or lost a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Stored,
    Removed,
}

/// One change of what a tier holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub tier: Tier,
    pub kind: ChangeKind,
    /// The block's inventory hash.
    pub hash: u64,
}

/// Why a sink did not take a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// Its queue is full (the transport fell behind); a later batch may go through.
    #[error("the kv-event publisher is behind: its queue is full")]
    Full,
    /// It stopped; no later batch will go through.
    #[error("the kv-event publisher has stopped")]
    Closed,
}

/// Where the daemon's inventory batches go (see the module docs).
pub trait InventorySink: Send + Sync + std::fmt::Debug {
    /// Takes one batch for publication. Called from the publisher task: it must not block
    /// (queue the batch, or refuse it).
    ///
    /// # Errors
    /// [`SinkError`] when the batch was not taken; the publisher then counts its changes as
    /// dropped and starts the next batch with `AllBlocksCleared`.
    fn publish(&self, batch: &EngineBatch) -> Result<(), SinkError>;
}

/// A daemon's publication: the sink, and the endpoints `hello_ack` advertises
/// (`kv_events_endpoint`, `kv_events_replay_endpoint`), as bound.
#[derive(Debug, Clone)]
pub struct InventoryPublishing {
    pub sink: Arc<dyn InventorySink>,
    /// The PUB endpoint subscribers connect to (`tcp://HOST:PORT`, the port resolved).
    pub endpoint: String,
    /// The replay endpoint, if any.
    pub replay_endpoint: Option<String>,
}

/// A store's handle on the recorder: cheap to clone, and doing nothing (no hashing either)
/// when publishing is off.
#[derive(Debug, Clone, Default)]
pub struct Inventory(Option<Arc<Recorder>>);

impl Inventory {
    /// Publishing off.
    pub fn off() -> Self {
        Self(None)
    }

    /// Recording into `recorder`.
    pub fn recording(recorder: Arc<Recorder>) -> Self {
        Self(Some(recorder))
    }

    /// Whether changes are recorded.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// The inventory hash of `(ns, key)`, when recording.
    pub fn hash(&self, ns: &Namespace, key: &[u8]) -> Option<u64> {
        self.0.as_ref().map(|_| hash_of(ns, key))
    }

    /// Appends `changes` (emptied) in one hold of the recorder's lock: a store's changes
    /// gathered under its own lock.
    pub fn append(&self, changes: &mut Vec<Change>) {
        match &self.0 {
            Some(recorder) => recorder.append(changes),
            None => changes.clear(),
        }
    }

    /// Notes that `tier` now holds the block named `hash` (nothing for `None`).
    pub fn stored(&self, tier: Tier, hash: Option<u64>) {
        if let (Some(recorder), Some(hash)) = (&self.0, hash) {
            recorder.record(tier, ChangeKind::Stored, hash);
        }
    }

    /// Notes that `tier` dropped the block named `hash` (nothing for `None`).
    pub fn removed(&self, tier: Tier, hash: Option<u64>) {
        if let (Some(recorder), Some(hash)) = (&self.0, hash) {
            recorder.record(tier, ChangeKind::Removed, hash);
        }
    }

    /// Notes a `clear` op: every tier dropped what it held.
    pub fn cleared(&self) {
        if let Some(recorder) = &self.0 {
            recorder.cleared();
        }
    }
}

/// [`inventory_hash`] of `(ns, key)`: the same XXH3-64 of `model ‖ 0 ‖ compat_key ‖ 0 ‖ key`,
/// in one pass over a copy on the stack (a block key and its namespace are short) instead of
/// the streaming hasher's five calls; the same function for longer input.
pub fn hash_of(ns: &Namespace, key: &[u8]) -> u64 {
    let (model, compat) = (ns.model.as_bytes(), ns.compat_key.as_bytes());
    let len = model.len() + compat.len() + key.len() + 2;
    let mut stack = [0u8; 128];
    let Some(buf) = stack.get_mut(..len) else {
        return inventory_hash(&ns.model, &ns.compat_key, key).0;
    };
    let (m, rest) = buf.split_at_mut(model.len());
    m.copy_from_slice(model);
    let (c, rest) = rest[1..].split_at_mut(compat.len());
    c.copy_from_slice(compat);
    rest[1..].copy_from_slice(key);
    twox_hash::XxHash3_64::oneshot(buf)
}

#[cfg(test)]
mod l4_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;
