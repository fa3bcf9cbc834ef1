//! L4: a remote store shared by a fleet, behind L2 (`--long-backend lmcache|mooncake`) or
//! behind the L3 tablespace (`--l4-backend lmcache|mooncake`, see [`crate::long::Stacked`]).
//! [`L4`] implements [`LongStore`](crate::long::LongStore) over any [`RemoteStore`]: LMCache's
//! Redis/Valkey layout ([`redis`], through the small RESP client [`resp`]), LMCache's `lm://`
//! server protocol ([`lm`]), an S3 bucket ([`s3`], LMCache's `s3://`), or a Mooncake Store
//! cluster ([`mooncake`], through a sidecar running the store's own client).
//!
//! - **Never wrong bytes.** Every value is framed ([`frame`]: magic, version, length,
//!   checksum, the full key) and checked on read; a foreign, torn or colliding value is a miss,
//!   counted in `l4_rejected_total`. Store names are `<prefix>@kvd@<32 hex digits of the key
//!   hash>`: NUL-free, ASCII, within `lm://`'s 150 bytes and Mooncake's limits.
//! - **Never block a SET.** [`LongStore::put`](crate::long::LongStore::put) pushes the block
//!   onto an inbox (a lock held for a push, a few plain stores, no map, no wake: an idle writer
//!   looks at the inbox every 1 to 8 ms) and returns; the writer
//!   and every read absorb the inbox into the write-behind queue (see `queue.rs`), and reads
//!   of a queued key are answered from the queue. A queued
//!   removal hides the store's value of its key until it lands, so a get returns the last
//!   accepted value or nothing. The writer frames and sends batches on a thread of its own
//!   (a current-thread runtime, the store's twin client, a lower OS priority), so its work
//!   never holds a core the daemon's SETs need; a store without a twin (Mooncake's sidecar
//!   serves one call at a time) keeps it a task on the daemon's runtime.
//! - **Deadlines and a breaker.** Every remote operation runs under `rpc_timeout`; after
//!   `breaker_failures` consecutive failures the breaker opens: reads miss at once, puts are
//!   dropped (and counted), and the writer probes the store after `retry_interval` (the wait
//!   doubling after each failed probe, up to 30 s: a probe may start a process), closing the
//!   breaker when it answers. A store down at start is a warning (the breaker starts open)
//!   unless the daemon was told the L4 is required.
//! - **A full store is not a down one.** A put the store answers but does not keep (Redis at
//!   `maxmemory` answering `OOM`, a Mooncake holder with no room or a busy key: see each
//!   store's `put_batch`) is no failure: the breaker stays closed, reads go on, and the put is
//!   counted (`l4_refused_total`) and turned into a removal of its key, since the store may
//!   still hold the key's older value.
//! - **What the index knows.** The store is shared, so kvd keeps no index of it: `class_of`
//!   and `exists` see only queued puts; reads and `prefetch_hint`s ask the store. `clear` of a
//!   namespace hides every block of it written before the clear (by sequence number for this
//!   run's writes, by time for others') for the rest of this run, and removes nothing remotely
//!   (after a restart the store's blocks read again, as with the Python kvd, whose LMCache
//!   `clear` does nothing); `sweep` has nothing to do (frames carry their expiry; an expired
//!   block reads as a miss).
//! - A write the backend does not keep (a lower class, which L2 holds in RAM only) queues a
//!   removal of the key's L4 copy: the store may hold one from an earlier run or another
//!   daemon, and it must not answer once L2 evicts the newer value.
//! - Across a restart, a block whose write had not landed (the store was down at shutdown)
//!   reads as its previous value in the store, if any.
//! - **Inventory** ([`crate::inventory`], tier `External`): a queued put is noted `stored`, a
//!   removal kvd queues (a lower-class write, a dropped or refused put) `removed`, each under
//!   the inbox or queue lock that orders it; what the store evicts on its own is never seen.

pub mod config;
pub mod frame;
pub mod lm;
mod long_store;
pub mod mooncake;
mod queue;
pub mod redis;
pub mod remote;
pub mod resp;
#[cfg(feature = "s3")]
pub mod s3;

pub use config::{L4Config, RemoteUrl};
pub use remote::{RemoteError, RemoteStore};

use crate::inventory::Inventory;
use crate::long::LongHit;
use crate::proto::Namespace;
use crate::stats::L4Stats;
use bytes::Bytes;
use frame::FrameInfo;
use futures::StreamExt;
use infera_core::event::Tier;
use queue::{Inbox, Op, Pending, Queue};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// Buckets of the "last write" table used by [`LongStore::is_current`]: small enough to stay
/// in a core's cache (every `long` SET writes one); a collision only costs a promotion.
const RECENT_BUCKETS: usize = 1 << 12;
/// Namespaces with their own clear cutoff; more fold into one cutoff for everything.
const MAX_CUTOFFS: usize = 1024;
/// Operations the inbox holds before the SET that finds it full absorbs it into the queue.
const INBOX_OPS: usize = 4096;

/// How an [`L4`] behaves.
#[derive(Debug, Clone, PartialEq)]
pub struct L4Options {
    /// The store name prefix (a tenant boundary).
    pub prefix: String,
    /// The largest value written (framing included); larger blocks are not stored.
    pub max_value_bytes: u64,
    /// Bytes of queued puts at most.
    pub queue_bytes: u64,
    /// Queued removals at most (see `queue.rs`).
    pub max_removals: usize,
    /// The deadline of every remote operation.
    pub op_timeout: Duration,
    /// Operations per remote batch at most.
    pub batch_items: usize,
    /// Bytes per remote batch at most (one larger value goes alone).
    pub batch_bytes: u64,
    /// Consecutive failures that open the breaker.
    pub breaker_failures: u32,
    /// How long an open breaker waits before it probes the store (doubling after each failed
    /// probe, up to 30 s).
    pub retry_interval: Duration,
}

impl Default for L4Options {
    fn default() -> Self {
        Self {
            prefix: "infera".to_owned(),
            max_value_bytes: 64 << 20,
            queue_bytes: 256 << 20,
            max_removals: 1 << 20,
            op_timeout: Duration::from_secs(30),
            batch_items: 32,
            batch_bytes: 32 << 20,
            breaker_failures: 3,
            retry_interval: Duration::from_secs(1),
        }
    }
}

/// Why an L4 could not start.
#[derive(Debug, thiserror::Error)]
pub enum L4OpenError {
    /// The store did not answer and the L4 is required.
    #[error("the L4 store {store} is not reachable: {reason}")]
    Unreachable { store: String, reason: String },
}

/// The name of the block `hash` in the store.
pub fn name(prefix: &str, hash: u128) -> String {
    format!("{prefix}@kvd@{hash:032x}")
}

#[derive(Debug, Default)]
struct Counters {
    puts: AtomicU64,
    refused: AtomicU64,
    removes: AtomicU64,
    gets: AtomicU64,
    hits: AtomicU64,
    rejected: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    breaker_opens: AtomicU64,
    reconnects: AtomicU64,
}

#[derive(Debug, Default)]
struct Cutoffs {
    /// `(own sequence, daemon clock)` below which everything is hidden.
    all: (u64, u64),
    by_ns: rustc_hash::FxHashMap<Namespace, (u64, u64)>,
}

/// Everything a SET reads or writes ([`L4::push`]) but its key's bucket of `recent`, on two
/// cache lines of their own: the writer's counters and queue, written on every batch, never
/// share a line with them (each such write moves the line to the writer's core, and the next
/// SET waits for it back), and a SET fetches two lines, not one per field spread over `Inner`.
/// Each further line a SET touches shows at its p99: in the SET study, SETs that also asked
/// the store for its name (a field of `Inner`, then a call) ran 20 to 30 points above SETs
/// that did not.
#[derive(Debug)]
#[repr(align(128))]
struct Front {
    /// Taken after `Inner::queue` where both are held.
    inbox: Mutex<Inbox>,
    seq: AtomicU64,
    clock: AtomicU64,
    /// Per bucket of key hashes, the sequence number of its latest write.
    recent: Box<[AtomicU64; RECENT_BUCKETS]>,
    /// `L4Options::max_value_bytes` and `queue_bytes`.
    max_value_bytes: u64,
    queue_bytes: u64,
    breaker: AtomicBool,
}

/// State shared with the writer task.
#[derive(Debug)]
struct Inner {
    front: Front,
    remote: Arc<dyn RemoteStore>,
    options: L4Options,
    writer_id: u64,
    queue: Mutex<Queue>,
    cutoffs: Mutex<Cutoffs>,
    failures: AtomicU32,
    reads_off: AtomicBool,
    counters: Counters,
    /// Wakes an idle writer before its tick (a full inbox, a flush, a clear, the breaker
    /// closing).
    wake: Notify,
    landed: watch::Sender<u64>,
    /// Mirrors the breaker: `true` while closed.
    up: watch::Sender<bool>,
    stop: CancellationToken,
    /// Where the writer notes the puts the store refused.
    inventory: OnceLock<Inventory>,
}

impl Inner {
    /// Locks the queue and absorbs the inbox into it.
    fn lock(&self) -> MutexGuard<'_, Queue> {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.take(&mut self.inbox());
        self.absorb(&mut queue);
        queue
    }

    /// Absorbs what `take` took (see `Queue::absorb`); past the removal bound, L4 reads are
    /// switched off for the rest of the run rather than risk an old value.
    fn absorb(&self, queue: &mut Queue) {
        if queue.absorb(self.options.max_removals) && !self.reads_off.swap(true, Ordering::AcqRel) {
            tracing::error!(
                "kvd L4: more than {} removals queued (the store has been down for long); \
                 L4 reads are off until restart so that no stale block is served",
                self.options.max_removals
            );
        }
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.front.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bucket(&self, hash: u128) -> &AtomicU64 {
        &self.front.recent[(hash as usize) & (RECENT_BUCKETS - 1)]
    }

    fn breaker_open(&self) -> bool {
        self.front.breaker.load(Ordering::Acquire)
    }

    /// Moves the daemon's clock on to `now` (written only when it moves, so the SETs' line
    /// stays in their core's cache).
    fn advance_clock(&self, now: u64) {
        if self.front.clock.load(Ordering::Relaxed) < now {
            self.front.clock.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// Counts a remote operation's outcome and trips the breaker; whether it succeeded.
    fn outcome<T>(
        &self,
        what: &str,
        result: Result<Result<T, RemoteError>, tokio::time::error::Elapsed>,
    ) -> bool {
        let error = match result {
            Ok(Ok(_)) => {
                self.failures.store(0, Ordering::Relaxed);
                return true;
            }
            Ok(Err(error)) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                error.to_string()
            }
            Err(_) => {
                self.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                format!("no answer within {:?}", self.options.op_timeout)
            }
        };
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= self.options.breaker_failures
            && !self.front.breaker.swap(true, Ordering::AcqRel)
        {
            self.counters.breaker_opens.fetch_add(1, Ordering::Relaxed);
            self.up.send_replace(false);
            tracing::warn!(
                store = %self.remote.describe(), %error,
                "kvd L4 {what} failed; breaker open, L4 reads miss and writes are dropped until it answers"
            );
        } else {
            tracing::debug!(store = %self.remote.describe(), %error, "kvd L4 {what} failed");
        }
        false
    }

    /// One health probe of an open breaker through `remote` (the writer's client); closes it
    /// on success, and says whether it did.
    async fn probe(&self, remote: &dyn RemoteStore) -> bool {
        let answer = tokio::time::timeout(self.options.op_timeout, remote.health()).await;
        let answered = matches!(answer, Ok(Ok(())));
        if answered {
            self.failures.store(0, Ordering::Relaxed);
            self.front.breaker.store(false, Ordering::Release);
            self.up.send_replace(true);
            self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
            tracing::info!(store = %self.remote.describe(), "kvd L4 store answers again; breaker closed");
            self.wake.notify_one();
        }
        answered
    }

    fn hidden(&self, ns: &Namespace, info: &FrameInfo) -> bool {
        let cutoffs = self.cutoffs.lock().unwrap_or_else(|p| p.into_inner());
        let below = |(seq, at): (u64, u64)| {
            if info.writer == self.writer_id {
                info.seq <= seq
            } else {
                info.written_at <= at
            }
        };
        below(cutoffs.all) || cutoffs.by_ns.get(ns).is_some_and(|c| below(*c))
    }
}

/// How much lower than the daemon's the writer thread's OS priority is (its nice value): under
/// contention SETs preempt it and it still gets about a tenth of a core, so L4 writes keep
/// moving under a sustained load.
const WRITER_NICE: i32 = 10;

/// Starts the writer: on a thread of its own, with a current-thread runtime and the store's
/// twin, at a lower OS priority, when the store has a twin ([`RemoteStore::twin`]); else as a
/// task on the caller's runtime. Threads the writer starts (a Mooncake chunk's second copier)
/// inherit its priority.
fn start_writer(inner: &Arc<Inner>) {
    let threaded = inner.remote.twin().and_then(|twin| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .thread_name("kvd-l4-writer")
            .enable_all()
            .build()
            .map_err(|error| tracing::warn!(%error, "kvd L4 writer: no runtime of its own"))
            .ok()?;
        let writer = inner.clone();
        let (started, start) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("kvd-l4-writer".into())
            .spawn(move || {
                let tid = rustix::thread::gettid();
                if let Err(error) = rustix::process::setpriority_process(Some(tid), WRITER_NICE) {
                    tracing::debug!(%error, "kvd L4 writer keeps the daemon's priority");
                }
                let _ = started.send(());
                runtime.block_on(queue::writer(writer, twin));
            })
            .map_err(|error| tracing::warn!(%error, "kvd L4 writer: no thread of its own"))
            .ok()?;
        // The thread runs at its priority once `open` returns.
        start.recv().ok()
    });
    if threaded.is_none() {
        tokio::spawn(queue::writer(inner.clone(), inner.remote.clone()));
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct L4 {
    inner: Arc<Inner>,
    /// Where puts and removals are noted (beside `inner`, on the line a SET reads anyway).
    inventory: OnceLock<Inventory>,
}

/// The writer stops with its L4 (a writer thread would outlive the daemon's runtime).
impl Drop for L4 {
    fn drop(&mut self) {
        self.inner.stop.cancel();
    }
}

impl L4 {
    /// An L4 over `remote`, its writer task spawned on the current runtime. The store is asked
    /// for its health first: when it does not answer, `required` makes that an error, else the
    /// L4 starts with its breaker open (and a warning).
    ///
    /// # Errors
    /// [`L4OpenError::Unreachable`].
    pub async fn open(
        remote: Arc<dyn RemoteStore>,
        options: L4Options,
        required: bool,
    ) -> Result<Self, L4OpenError> {
        let health = tokio::time::timeout(options.op_timeout, remote.health()).await;
        let down = match health {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!("no answer within {:?}", options.op_timeout)),
        };
        if let Some(reason) = &down {
            if required {
                return Err(L4OpenError::Unreachable {
                    store: remote.describe(),
                    reason: reason.clone(),
                });
            }
            tracing::warn!(store = %remote.describe(), %reason,
                "kvd L4 store not reachable at start; running with L4 reads and writes off until it answers");
        }
        let writer_id = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish()
        };
        let inner = Arc::new(Inner {
            front: Front {
                inbox: Mutex::new(Inbox::default()),
                seq: AtomicU64::new(0),
                // The daemon's clock is wall-clock milliseconds; start from the wall clock so
                // a clear before any other operation still hides earlier runs' blocks.
                clock: AtomicU64::new(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64),
                ),
                recent: Box::new([const { AtomicU64::new(0) }; RECENT_BUCKETS]),
                max_value_bytes: options.max_value_bytes,
                queue_bytes: options.queue_bytes,
                breaker: AtomicBool::new(down.is_some()),
            },
            remote,
            options,
            writer_id,
            queue: Mutex::new(Queue::default()),
            cutoffs: Mutex::new(Cutoffs::default()),
            failures: AtomicU32::new(0),
            reads_off: AtomicBool::new(false),
            counters: Counters::default(),
            wake: Notify::new(),
            landed: watch::channel(0).0,
            up: watch::channel(down.is_none()).0,
            stop: CancellationToken::new(),
            inventory: OnceLock::new(),
        });
        start_writer(&inner);
        Ok(Self {
            inner,
            inventory: OnceLock::new(),
        })
    }

    /// Whether the breaker is closed (the store answered last time).
    pub fn is_up(&self) -> bool {
        !self.inner.breaker_open()
    }

    /// The breaker's state as it changes: `true` while closed.
    pub fn watch_up(&self) -> watch::Receiver<bool> {
        self.inner.up.subscribe()
    }

    /// The next sequence number, for a write of `hash` at `now`. Taken only under the inbox's
    /// lock (`_held`), so plain loads and stores keep sequence numbers (and each bucket's
    /// latest) in order without a locked instruction.
    fn next_seq(&self, _held: &Inbox, hash: u128, now: u64) -> u64 {
        let inner = &self.inner;
        let seq = inner.front.seq.load(Ordering::Relaxed) + 1;
        inner.front.seq.store(seq, Ordering::Release);
        inner.bucket(hash).store(seq, Ordering::Release);
        inner.advance_clock(now);
        seq
    }

    /// Pushes the operation `make` chooses (seeing the inbox and the operation's sequence
    /// number) for `hash` at `now` onto the inbox; returns what `make` returned with it. A
    /// full inbox is absorbed here and the writer woken; otherwise the writer finds the push
    /// at its next tick (a wake is a system call, which a SET does not pay).
    fn push<R>(
        &self,
        hash: u128,
        now: u64,
        make: impl FnOnce(&mut Inbox, u64) -> (Option<Pending>, R),
    ) -> R {
        let mut inbox = self.inner.inbox();
        // Taken under the inbox's lock (see `next_seq`).
        let seq = self.next_seq(&inbox, hash, now);
        let (op, out) = make(&mut inbox, seq);
        inbox.push(hash, seq, op);
        let full = inbox.len() >= INBOX_OPS;
        drop(inbox);
        if full {
            drop(self.inner.lock());
            self.inner.wake.notify_one();
        }
        out
    }

    /// Reads blocks (one remote batch per `batch_items`); see [`LongStore::get_many`].
    async fn read(&self, ns: &Namespace, reqs: &[(Bytes, u128)], now: u64) -> Vec<Option<LongHit>> {
        let inner = &self.inner;
        let start = inner.front.seq.load(Ordering::Acquire);
        inner.advance_clock(now);
        let mut out: Vec<Option<LongHit>> = vec![None; reqs.len()];
        let mut remote = Vec::new();
        {
            let q = inner.lock();
            for (i, (key, hash)) in reqs.iter().enumerate() {
                match q.ops.get(hash) {
                    Some((_, Op::Put(p))) => {
                        if p.ns == *ns && p.key == *key && p.info.expires_at.is_none_or(|t| t > now)
                        {
                            out[i] = Some(LongHit {
                                value: p.value.clone(),
                                class: p.info.class,
                                expires_at: p.info.expires_at,
                                generation: start,
                                tier: Tier::External,
                            });
                        }
                    }
                    Some((_, Op::Remove)) => {}
                    None => remote.push(i),
                }
            }
        }
        let off = inner.breaker_open() || inner.reads_off.load(Ordering::Acquire);
        if !off && !remote.is_empty() {
            // Spread over the store's streams (at most `batch_items` blocks each), so large
            // blocks overlap on the wire.
            let streams = inner.remote.streams().max(1);
            let per = remote
                .len()
                .div_ceil(streams)
                .clamp(1, inner.options.batch_items.max(1));
            let reads: Vec<_> = remote
                .chunks(per)
                .map(|chunk| self.fetch(chunk.to_vec(), reqs))
                .collect();
            let mut reads = futures::stream::iter(reads).buffered(streams);
            while let Some((chunk, result)) = reads.next().await {
                let values = match result {
                    Ok(Ok(values)) if values.len() == chunk.len() => values,
                    other => {
                        inner.outcome("get", other.map(|r| r.map(|_| ())));
                        break;
                    }
                };
                inner.failures.store(0, Ordering::Relaxed);
                for (i, value) in chunk.iter().zip(values) {
                    out[*i] = self.check(ns, &reqs[*i].0, value, now, start);
                }
            }
        }
        let hits = out.iter().filter(|h| h.is_some()).count() as u64;
        inner
            .counters
            .gets
            .fetch_add(reqs.len() as u64, Ordering::Relaxed);
        inner.counters.hits.fetch_add(hits, Ordering::Relaxed);
        out
    }

    /// One remote read of the blocks `chunk` (indexes into `reqs`), under the deadline.
    async fn fetch(
        &self,
        chunk: Vec<usize>,
        reqs: &[(Bytes, u128)],
    ) -> (
        Vec<usize>,
        Result<Result<Vec<Option<Bytes>>, RemoteError>, tokio::time::error::Elapsed>,
    ) {
        let inner = &self.inner;
        let names: Vec<String> = chunk
            .iter()
            .map(|i| name(&inner.options.prefix, reqs[*i].1))
            .collect();
        let got =
            tokio::time::timeout(inner.options.op_timeout, inner.remote.get_batch(&names)).await;
        (chunk, got)
    }

    /// A stored value as a hit, if it is a live frame of `(ns, key)` not hidden by a clear.
    fn check(
        &self,
        ns: &Namespace,
        key: &[u8],
        value: Option<Bytes>,
        now: u64,
        start: u64,
    ) -> Option<LongHit> {
        let value = value.filter(|v| !v.is_empty())?;
        match frame::decode(&value, ns, key) {
            Ok((body, info)) => {
                if self.inner.hidden(ns, &info) || info.expires_at.is_some_and(|t| t <= now) {
                    return None;
                }
                Some(LongHit {
                    value: body,
                    class: info.class,
                    expires_at: info.expires_at,
                    generation: start,
                    tier: Tier::External,
                })
            }
            Err(reject) => {
                self.inner.counters.rejected.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%reject, "kvd L4 value refused");
                None
            }
        }
    }

    /// The L4 counters.
    pub fn l4_stats(&self) -> L4Stats {
        let c = &self.inner.counters;
        let q = self.inner.lock();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        L4Stats {
            up: u64::from(self.is_up()),
            queued_bytes: q.bytes,
            queued_ops: q.ops.len() as u64,
            puts_total: get(&c.puts),
            dropped_total: q.dropped,
            refused_total: get(&c.refused),
            removes_total: get(&c.removes),
            gets_total: get(&c.gets),
            hits_total: get(&c.hits),
            rejected_total: get(&c.rejected),
            errors_total: get(&c.errors),
            timeouts_total: get(&c.timeouts),
            breaker_opens_total: get(&c.breaker_opens),
            reconnects_total: get(&c.reconnects),
        }
    }
}
