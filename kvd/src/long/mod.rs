//! The long-term tier behind L2: one object-safe trait, [`LongStore`], used as
//! `Arc<dyn LongStore>`, and its resolver, [`open`], from the closed config enum
//! [`LongBackendConfig`] (`--long-backend tablespace|mooncake|lmcache`, `--l4-backend`).
//!
//! Implementations: the tablespace (L3, [`crate::tablespace`]); the L4 over a remote store
//! ([`crate::l4::L4`]: LMCache's Redis layout, `lm://` server or S3 bucket, or a Mooncake
//! Store); and
//! [`Stacked`], L3 with an L4 behind it (L2 → L3 → L4).
//!
//! # Contract
//! - The index is in memory and answers synchronously ([`LongStore::class_of`],
//!   [`LongStore::put`], [`LongStore::remove`]), so the tiered store can keep it in step with L2
//!   under the L2 lock: whatever order two writes of one key take there, they take here. (A
//!   remote L4 indexes only what it has queued; reads and [`LongStore::held`] ask the store.)
//! - Moving bytes is asynchronous: [`LongStore::put`] records the entry and queues its write,
//!   keeping the value readable from memory until the write lands; [`LongStore::get`] reads
//!   and verifies. Queued bytes are bounded by write permits ([`LongStore::write_permits`]),
//!   which the caller takes *before* the L2 lock (so back-pressure never blocks it), for a
//!   bounded prefix of its writes at a time and all at once: a caller never waits for permits
//!   while holding others that are not yet attached to queued writes, and queued writes finish
//!   on their own, so writers cannot deadlock however large or many their batches are. (The
//!   L4 never makes a writer wait: a put its queue cannot hold is dropped and counted.)
//! - Durability: by default a put is acknowledged once recorded (its journal record reaches
//!   the file within the journal's flush interval, its block within the I/O queue's drain). A
//!   backend opened with durable writes returns, with each put, a [`Durable`] future that
//!   resolves once the block is written and its journal record synced; concurrent writers
//!   share one sync (group commit).
//! - Only `short` and `long` blocks are ever given to a backend; a backend refuses anything
//!   else, and never makes room by evicting a higher class than the incoming block.
//! - A `get` returns the bytes last put under that exact key (namespace included) or nothing:
//!   never another key's bytes, never a half-written block, including after a crash.
//! - Inventory: once given one ([`LongStore::record_inventory`]), a backend notes each block it
//!   gains or loses in its tier ([`crate::inventory`]), under the lock that orders the change,
//!   and notes nothing for a `clear` (the store notes the clear as one).

mod stacked;

pub use stacked::Stacked;

use crate::inventory::Inventory;
use crate::l4::{L4, L4Config, L4OpenError};
use crate::proto::Namespace;
use crate::stats::LongStats;
use crate::tablespace::{Tablespace, TablespaceConfig};
use bytes::Bytes;
use infera_core::event::{Retention, Tier};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;

/// The long-term backend and its settings (`--long-backend`).
#[derive(Debug, Clone, PartialEq)]
pub enum LongBackendConfig {
    /// L3: container files on local devices.
    Tablespace(TablespaceConfig),
    /// L4 alone: an LMCache remote store or a Mooncake Store (`--long-backend lmcache|mooncake`).
    L4(L4Config),
    /// L3 with an L4 behind it (`--long-path(s)` with `--l4-backend lmcache|mooncake`).
    Stacked(TablespaceConfig, L4Config),
}

/// Why a backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum LongOpenError {
    /// The settings cannot work (sizes, paths, I/O mode on this device).
    #[error("{0}")]
    Invalid(String),
    /// The L4 store could not start.
    #[error(transparent)]
    L4(#[from] L4OpenError),
    /// Opening or recovering the on-disk region failed.
    #[error("cannot open the L3 region at {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: io::Error,
    },
}

/// Builds the configured backend; for the tablespace this recovers the region from disk
/// (blocking work, run on the blocking pool).
///
/// # Errors
/// [`LongOpenError`].
pub async fn open(config: &LongBackendConfig) -> Result<Arc<dyn LongStore>, LongOpenError> {
    match config {
        LongBackendConfig::Tablespace(ts) => Ok(Arc::new(open_tablespace(ts).await?)),
        LongBackendConfig::L4(l4) => Ok(Arc::new(open_l4(l4).await?)),
        LongBackendConfig::Stacked(ts, l4) => {
            let l3 = open_tablespace(ts).await?;
            Ok(Arc::new(Stacked::new(
                Arc::new(l3),
                Arc::new(open_l4(l4).await?),
            )))
        }
    }
}

async fn open_tablespace(ts: &TablespaceConfig) -> Result<Tablespace, LongOpenError> {
    let ts = ts.clone();
    tokio::task::spawn_blocking(move || Tablespace::open(&ts))
        .await
        .map_err(|e| LongOpenError::Invalid(format!("the L3 recovery task failed: {e}")))?
}

async fn open_l4(config: &L4Config) -> Result<L4, LongOpenError> {
    tracing::info!(store = %config.remote_url, prefix = %config.prefix, "kvd L4 (LMCache layout)");
    Ok(L4::open(config.store(), config.options(), config.required).await?)
}

/// One block for the long-term tier.
#[derive(Debug, Clone)]
pub struct LongBlock {
    /// `crate::store::key_hash(ns, key)`.
    pub hash: u128,
    pub ns: Namespace,
    pub key: Bytes,
    pub value: Bytes,
    /// Engine metadata (msgpack), stored and returned as is.
    pub metadata: Option<Bytes>,
    /// `short` or `long`.
    pub class: Retention,
    /// Absolute expiry (milliseconds on the daemon's wall clock).
    pub expires_at: Option<u64>,
}

/// A block read back.
#[derive(Debug, Clone)]
pub struct LongHit {
    pub value: Bytes,
    pub class: Retention,
    pub expires_at: Option<u64>,
    /// The entry's generation (see [`LongStore::is_current`]).
    pub generation: u64,
    /// The tier that served it (`Disk` for L3, `External` for L4).
    pub tier: Tier,
}

/// Why a backend refused a block (the key's older entry is gone either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LongRejected {
    /// Room could only be made by evicting a higher class.
    #[error("would_displace_higher_priority")]
    WouldDisplace,
    /// Larger than the region (or a shard of it), or a field too long for the slot header.
    #[error("too_large")]
    TooLarge,
    /// `none` and `ephemeral` never reach a backend.
    #[error("class_not_stored")]
    ClassNotStored,
}

/// Room in a backend's write queue, held until the write completes.
#[derive(Debug)]
pub struct WritePermit {
    _permit: Option<OwnedSemaphorePermit>,
}

impl WritePermit {
    /// A permit backed by a semaphore.
    pub fn new(permit: OwnedSemaphorePermit) -> Self {
        Self {
            _permit: Some(permit),
        }
    }

    /// A permit that bounds nothing (for backends without a queue, and tests).
    pub fn unbounded() -> Self {
        Self { _permit: None }
    }
}

/// Resolves once a put is durable: its block written and its journal record synced.
///
/// # Errors
/// The I/O error that kept it from being durable (the entry is then gone from the backend).
pub type Durable = Pin<Box<dyn Future<Output = io::Result<()>> + Send>>;

/// A recorded put.
pub struct Put {
    /// The entry's generation (see [`LongStore::is_current`]).
    pub generation: u64,
    /// With durable writes: what to await before acknowledging the write.
    pub durable: Option<Durable>,
}

impl std::fmt::Debug for Put {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Put")
            .field("generation", &self.generation)
            .field("durable", &self.durable.is_some())
            .finish()
    }
}

/// See the module docs.
#[async_trait::async_trait]
pub trait LongStore: Send + Sync + std::fmt::Debug {
    /// The backend's name, for logs.
    fn kind(&self) -> &'static str;

    /// The class of the live (unexpired) entry for `hash`, from memory.
    fn class_of(&self, hash: u128, now: u64) -> Option<Retention>;

    /// Whether the live entry for `hash` is still generation `generation`.
    fn is_current(&self, hash: u128, generation: u64) -> bool;

    /// Whether puts come with a [`Durable`] future (`--durable-long-writes`).
    fn durable_writes(&self) -> bool;

    /// Waits for room to queue writes of the leading `sizes` (bytes each), taken all at once,
    /// and returns one permit per size of that prefix: at least one, and no more than a bounded
    /// share of the queue (so a batch larger than the queue goes through in several rounds,
    /// each written and released independently of the caller). Empty only for empty `sizes`.
    async fn write_permits(&self, sizes: &[u64]) -> Vec<WritePermit>;

    /// Whether writers wait for [`LongStore::write_permits`]: false for a backend that never
    /// makes them wait (its queue drops what does not fit), whose writers then take none.
    fn permits_wait(&self) -> bool {
        true
    }

    /// Room to queue `bytes` now, or `None` (spills are dropped rather than waited for).
    fn try_write_permit(&self, bytes: u64) -> Option<WritePermit>;

    /// Records `block`, replacing any entry of its key, and queues its write; `spill` counts
    /// it as L2's eviction of a `short` block. Never blocks.
    ///
    /// # Errors
    /// [`LongRejected`]; the key's older entry is removed even then.
    fn put(
        &self,
        block: LongBlock,
        permit: WritePermit,
        now: u64,
        spill: bool,
    ) -> Result<Put, LongRejected>;

    /// Removes the entry for `hash`.
    fn remove(&self, hash: u128);

    /// Removes the entry of `(ns, key)`, whose hash is `hash`: [`LongStore::remove`], for a
    /// caller that has the key at hand (a backend that keeps no index of its keys, the L4,
    /// names the block in its inventory from it).
    fn remove_key(&self, ns: &Namespace, key: &[u8], hash: u128) {
        let _ = (ns, key);
        self.remove(hash);
    }

    /// Notes the blocks this backend gains and loses in `inventory` from now on (see the
    /// module docs); by default nothing is noted. Called once, before the backend serves.
    fn record_inventory(&self, inventory: &Inventory) {
        let _ = inventory;
    }

    /// Reads the block of `(ns, key)`; `None` on a miss, an expired entry, or a slot that fails
    /// its checks (which also drops the entry). I/O errors are counted and logged, and read as
    /// a miss.
    async fn get(&self, ns: &Namespace, key: &[u8], hash: u128, now: u64) -> Option<LongHit>;

    /// Reads several blocks of one namespace, `(key, hash)` each, in order (a remote backend
    /// batches them); by default one [`LongStore::get`] each, concurrently.
    async fn get_many(
        &self,
        ns: &Namespace,
        reqs: &[(Bytes, u128)],
        now: u64,
    ) -> Vec<Option<LongHit>> {
        let reads = reqs.iter().map(|(key, hash)| self.get(ns, key, *hash, now));
        futures::future::join_all(reads).await
    }

    /// Whether a read of each `(key, hash)` may find a block, without reading it (what a
    /// `prefetch_hint` asks before promoting); by default from the index.
    async fn held(&self, _ns: &Namespace, reqs: &[(Bytes, u128)], now: u64) -> Vec<bool> {
        reqs.iter()
            .map(|(_, hash)| self.class_of(*hash, now).is_some())
            .collect()
    }

    /// Drops the namespace's entries, or all for the empty namespace; returns how many.
    fn clear(&self, ns: &Namespace) -> u64;

    /// Removes entries expired at `now`; returns how many.
    fn sweep(&self, now: u64) -> usize;

    /// The backend's counters.
    fn stats(&self) -> LongStats;

    /// Waits until every write queued so far is durable.
    ///
    /// # Errors
    /// The first I/O error writing data or the journal.
    async fn flush(&self) -> io::Result<()>;

    /// Writes a checkpoint so a restart replays little (called periodically).
    ///
    /// # Errors
    /// The I/O error writing it; the previous checkpoint and journal stay valid.
    async fn checkpoint(&self) -> io::Result<()>;

    /// Flushes, checkpoints and stops the backend's threads.
    ///
    /// # Errors
    /// As [`LongStore::flush`] and [`LongStore::checkpoint`].
    async fn close(&self) -> io::Result<()>;
}
