//! The write-behind queue and its writer task.
//!
//! - A SET never touches the queue: [`Inbox`] takes its operation (under a lock of its own,
//!   held for a push) and whoever next locks the queue (the writer, a read, a clear) absorbs
//!   the inbox first (boxing its puts), so the queue is current whenever it is looked at. A
//!   full inbox is absorbed by the SET that finds it full. A SET does not wake the writer (a
//!   wake is a system call: 8 µs per SET when the writer idles between SETs); an idle writer
//!   looks at the inbox on a tick of its own, 1 ms doubling to 8 ms while it stays idle.
//! - The queue holds at most one operation per key hash (a newer one replaces the older, which
//!   then never reaches the store): a put (the framed block, also answered to reads until it
//!   lands) or a removal. An operation stays queued while it is in flight and leaves only when
//!   the store acknowledged it and no newer one replaced it, so a read never falls through to
//!   an older value in the store.
//! - A clear turns the namespace's queued puts into removals, and so does the store refusing a
//!   put (full, or the key busy) when it lands.
//! - Puts are bounded in bytes; a put that does not fit, or that arrives while the breaker is
//!   open, becomes a removal (its L4 copy is dropped and counted; the store's older value must
//!   not answer for it). Removals are small and bounded in number; past the bound L4 reads are
//!   switched off for the rest of the run (an error is logged) rather than risk an old value.
//! - The writer sends batches (bounded in items and bytes; a batch's puts spread over the
//!   store's write streams) under a deadline each, framing the next batch (its checksums
//!   too, unless the store takes them as it writes, see `RemoteStore::seals`) while one is on
//!   the wire; a failed batch (and the one framed behind it) goes back to the front of the
//!   queue.
//!   Consecutive failures open the circuit breaker; while it is open the writer probes the
//!   store's health, first after the retry interval, then at a wait that doubles after each
//!   failed probe (up to 30 s), and closes it on success.

use super::frame::{self, FrameInfo, Framed};
use super::{Inner, RemoteStore, name};
use crate::inventory::Inventory;
use crate::proto::Namespace;
use bytes::Bytes;
use infera_core::event::Tier;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::timeout;

/// A queued put: the block and what its frame will say (framed, checksum included, by the
/// writer task, so a SET never pays for it).
#[derive(Debug, Clone)]
pub struct Pending {
    pub ns: Namespace,
    pub key: Bytes,
    pub value: Bytes,
    pub info: FrameInfo,
    /// The frame's length.
    pub len: u64,
}

/// One queued operation.
#[derive(Debug, Clone)]
pub enum Op {
    Put(Box<Pending>),
    Remove,
}

/// Operations not yet in the queue (under `Inner::inbox`): puts with their block inline (boxed
/// by whoever absorbs them, so a SET allocates nothing) and removals (small, so a dropped put
/// writes no more than it needs), each with its sequence number. Absorbing them in any order
/// gives the same queue: of a key's operations the one with the highest sequence number wins.
#[derive(Debug, Default)]
pub struct Inbox {
    pub puts: Vec<(u128, u64, Pending)>,
    pub removes: Vec<(u128, u64)>,
    /// Bytes of `puts`.
    pub bytes: u64,
    /// Puts dropped (counted here, under the inbox's lock, rather than with a locked
    /// instruction of their own).
    pub dropped: u64,
    /// The queue's bytes as of the last [`Queue::take`] (what puts check the queue's bound
    /// against without its lock; the queue only shrinks until the next take).
    pub queued: u64,
}

impl Inbox {
    /// Pushes a put (`Some`) or a removal of `hash`.
    pub fn push(&mut self, hash: u128, seq: u64, put: Option<Pending>) {
        match put {
            Some(p) => {
                self.bytes += p.len;
                self.puts.push((hash, seq, p));
            }
            None => self.removes.push((hash, seq)),
        }
    }

    /// Operations held.
    pub fn len(&self) -> usize {
        self.puts.len() + self.removes.len()
    }
}

/// The queue's state (under `Inner::queue`).
#[derive(Debug, Default)]
pub struct Queue {
    pub ops: FxHashMap<u128, (u64, Op)>,
    /// Taken from the inbox, not yet absorbed (empty but for its allocations between locks).
    arrived: Inbox,
    order: VecDeque<u128>,
    pub bytes: u64,
    pub removes: usize,
    /// Puts dropped since start (see [`Inbox::dropped`]).
    pub dropped: u64,
}

fn size(op: &Op) -> (u64, usize) {
    match op {
        Op::Put(p) => (p.len, 0),
        Op::Remove => (0, 1),
    }
}

impl Queue {
    /// Moves `inbox`'s operations to [`Queue::absorb`]'s hands (an exchange of buffers, so the
    /// inbox's lock is held for no longer than a push), counting their bytes as queued.
    pub fn take(&mut self, inbox: &mut Inbox) {
        debug_assert!(self.arrived.len() == 0);
        std::mem::swap(&mut self.arrived.puts, &mut inbox.puts);
        std::mem::swap(&mut self.arrived.removes, &mut inbox.removes);
        self.dropped += std::mem::take(&mut inbox.dropped);
        // Absorbing them may replace older operations, never add more.
        inbox.queued = self.bytes + std::mem::take(&mut inbox.bytes);
    }

    /// Queues the operations taken from the inbox, each replacing an older one of its key. A
    /// removal past `max_removals` (of a key with nothing queued) is not queued; returns
    /// whether that happened.
    pub fn absorb(&mut self, max_removals: usize) -> bool {
        let mut overflow = false;
        let mut arrived = std::mem::take(&mut self.arrived);
        arrived.bytes = 0;
        for (hash, seq, put) in arrived.puts.drain(..) {
            if self.newer(hash, seq) {
                self.insert(hash, seq, Op::Put(Box::new(put)));
            }
        }
        for (hash, seq) in arrived.removes.drain(..) {
            if !self.newer(hash, seq) {
                continue;
            }
            if self.removes >= max_removals && !self.ops.contains_key(&hash) {
                overflow = true;
            } else {
                self.insert(hash, seq, Op::Remove);
            }
        }
        self.arrived = arrived;
        overflow
    }

    /// Whether an operation of `hash` at `seq` is newer than the one queued, if any (one
    /// queued later, by a clear's removal, is not replaced).
    fn newer(&self, hash: u128, seq: u64) -> bool {
        self.ops.get(&hash).is_none_or(|(at, _)| *at < seq)
    }

    /// Queues `op` for `hash` at `seq`, replacing any older one.
    fn insert(&mut self, hash: u128, seq: u64, op: Op) {
        let (bytes, removes) = size(&op);
        self.bytes += bytes;
        self.removes += removes;
        match self.ops.insert(hash, (seq, op)) {
            Some((_, old)) => self.forget(&old),
            None => self.order.push_back(hash),
        }
    }

    fn forget(&mut self, op: &Op) {
        let (bytes, removes) = size(op);
        self.bytes -= bytes;
        self.removes -= removes;
    }

    /// Turns the queued puts of `ns` (all when `ns` is empty) into removals: their blocks
    /// must not land, and the store's older values of their keys must not outlive the clear.
    /// Returns how many.
    pub fn clear_namespace(&mut self, ns: &Namespace, seq: u64) -> u64 {
        let all = ns.model.is_empty() && ns.compat_key.is_empty();
        let hit: Vec<u128> = self
            .ops
            .iter()
            .filter(|(_, (_, op))| matches!(op, Op::Put(p) if all || p.ns == *ns))
            .map(|(h, _)| *h)
            .collect();
        for hash in &hit {
            if let Some((at, op)) = self.ops.get_mut(hash) {
                // A new sequence number: a put of this key in flight must not take the
                // removal with it when it lands.
                *at = seq;
                let old = std::mem::replace(op, Op::Remove);
                self.forget(&old);
                self.removes += 1;
            }
        }
        hit.len() as u64
    }

    /// Takes the next batch (cloned; the operations stay queued until [`Queue::landed`]).
    fn batch(&mut self, max_items: usize, max_bytes: u64) -> Vec<(u128, u64, Op)> {
        let mut out = Vec::new();
        let mut bytes = 0;
        while out.len() < max_items {
            let Some(hash) = self.order.pop_front() else {
                break;
            };
            let Some((seq, op)) = self.ops.get(&hash) else {
                continue;
            };
            let len = size(op).0;
            if !out.is_empty() && bytes + len > max_bytes {
                self.order.push_front(hash);
                break;
            }
            bytes += len;
            out.push((hash, *seq, op.clone()));
        }
        out
    }

    /// A batch landed: each operation leaves unless a newer one replaced it meanwhile (which
    /// then goes back in line). A put the store `refused` (by key hash) stays, as a removal of
    /// its key at the back of the line: the store may still hold an older value of the key,
    /// which must not answer for it (and the put, noted `stored`, is noted `removed`).
    fn landed(
        &mut self,
        batch: &[(u128, u64, Op)],
        refused: &[u128],
        inventory: Option<&Inventory>,
    ) {
        for (hash, seq, sent) in batch {
            let Some((now, op)) = self.ops.get_mut(hash) else {
                continue;
            };
            if *now != *seq {
                self.order.push_back(*hash);
            } else if refused.contains(hash) {
                if let (Some(inv), Op::Put(p)) = (inventory, sent) {
                    inv.removed(Tier::External, inv.hash(&p.ns, &p.key));
                }
                let old = std::mem::replace(op, Op::Remove);
                self.forget(&old);
                self.removes += 1;
                self.order.push_back(*hash);
            } else if let Some((_, op)) = self.ops.remove(hash) {
                self.forget(&op);
            }
        }
    }

    /// A batch failed: its operations go back to the front of the line.
    fn failed(&mut self, batch: &[(u128, u64, Op)]) {
        for (hash, _, _) in batch.iter().rev() {
            if self.ops.contains_key(hash) {
                self.order.push_front(*hash);
            }
        }
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// The longest wait between two probes of a store that stays down (the wait starts at the
/// retry interval and doubles after each failed probe): a probe can cost the daemon's host
/// real work (Mooncake's is a new sidecar process).
const RETRY_MAX: Duration = Duration::from_secs(30);
/// How long an idle writer first waits before it looks at the inbox again (SETs do not wake
/// it, see `L4::push`); each idle look doubles it, up to [`IDLE_TICK_MAX`], and work
/// found resets it. A block waits at most this long before its write starts.
const IDLE_TICK: Duration = Duration::from_millis(1);
const IDLE_TICK_MAX: Duration = Duration::from_millis(8);

/// The writer task: runs until `inner.stop` is cancelled, writing through `remote` (the
/// store's twin on a writer thread, see [`super::RemoteStore::twin`]).
pub async fn writer(inner: Arc<Inner>, remote: Arc<dyn RemoteStore>) {
    let mut probed = tokio::time::Instant::now();
    let mut wait = inner.options.retry_interval;
    let mut ready: Option<Prepared> = None;
    let mut idle = IDLE_TICK;
    loop {
        if inner.breaker_open() {
            if let Some(ready) = ready.take() {
                inner.lock().failed(&ready.ops);
            }
            // The dropped puts' removals keep arriving: absorbed here, not by the SETs, every
            // idle tick or once the inbox is full (a SET then wakes the writer). A shorter
            // tick woke the daemon's host for nothing: over kvd's socket, SET p99 with the
            // L4 down was +7.8 % with a 1 ms tick (`kvd/benches/README.md`).
            tokio::select! {
                () = inner.stop.cancelled() => return,
                () = inner.wake.notified() => {}
                () = tokio::time::sleep(IDLE_TICK_MAX) => {}
            }
            drop(inner.lock());
            if probed.elapsed() >= wait {
                let retry = inner.options.retry_interval;
                wait = if inner.probe(remote.as_ref()).await {
                    retry
                } else {
                    (wait * 2).min(retry.max(RETRY_MAX))
                };
                probed = tokio::time::Instant::now();
            }
            continue;
        }
        let current = match ready.take() {
            Some(current) => current,
            None => match take(&inner) {
                ops if !ops.is_empty() => prepare(&inner, ops),
                _ => {
                    if !park(&inner, &mut idle).await {
                        return;
                    }
                    continue;
                }
            },
        };
        idle = IDLE_TICK;
        // The next batch is framed (its checksums taken) while this one is on the wire.
        let next = take(&inner);
        let (sent, next) = futures::join!(send(&inner, remote.as_ref(), &current), async {
            (!next.is_empty()).then(|| prepare(&inner, next))
        });
        {
            let mut q = inner.lock();
            if let Some(refused) = sent {
                q.landed(&current.ops, &refused, inner.inventory.get());
                ready = next;
            } else {
                // Both go back to the front of the line, in their order.
                if let Some(next) = next {
                    q.failed(&next.ops);
                }
                q.failed(&current.ops);
            }
        }
        inner.landed.send_modify(|n| *n += 1);
    }
}

/// Waits until woken or until the idle tick `idle` passed, then doubles the tick (up to
/// [`IDLE_TICK_MAX`]); false once the writer is to stop.
async fn park(inner: &Inner, idle: &mut Duration) -> bool {
    let tick = *idle;
    *idle = (tick * 2).min(IDLE_TICK_MAX);
    tokio::select! {
        () = inner.stop.cancelled() => false,
        () = inner.wake.notified() => true,
        () = tokio::time::sleep(tick) => true,
    }
}

/// A batch taken from the queue (its operations stay queued until it lands), framed.
struct Prepared {
    ops: Vec<(u128, u64, Op)>,
    puts: Vec<(String, Framed)>,
    /// The key hash of each of `puts`.
    put_hashes: Vec<u128>,
    removes: Vec<String>,
}

/// The next batch (cloned from the queue; empty when nothing is queued).
fn take(inner: &Inner) -> Vec<(u128, u64, Op)> {
    inner
        .lock()
        .batch(inner.options.batch_items, inner.options.batch_bytes)
}

/// Names and frames (checksums) a batch's operations.
fn prepare(inner: &Inner, ops: Vec<(u128, u64, Op)>) -> Prepared {
    let mut puts = Vec::new();
    let mut put_hashes = Vec::new();
    let mut removes = Vec::new();
    let encode = if inner.remote.seals() {
        frame::encode_unsealed
    } else {
        frame::encode
    };
    for (hash, _, op) in &ops {
        let n = name(&inner.options.prefix, *hash);
        match op {
            Op::Put(p) => {
                let info = FrameInfo {
                    writer: inner.writer_id,
                    ..p.info
                };
                if let Some(framed) = encode(&p.ns, &p.key, &p.value, info) {
                    puts.push((n, framed));
                    put_hashes.push(*hash);
                }
            }
            Op::Remove => removes.push(n),
        }
    }
    Prepared {
        ops,
        puts,
        put_hashes,
        removes,
    }
}

/// Sends one batch (puts, then removals): `None` unless the store answered all of it, else
/// the key hashes of the puts it refused (full, or the key busy: it is up, so a refusal is no
/// failure and leaves the breaker alone).
async fn send(inner: &Inner, remote: &dyn RemoteStore, batch: &Prepared) -> Option<Vec<u128>> {
    let Prepared {
        puts,
        put_hashes,
        removes,
        ..
    } = batch;
    let deadline = inner.options.op_timeout;
    let mut refused = Vec::new();
    if !puts.is_empty() {
        // Spread over the store's write streams: the batch's keys are distinct, so their order
        // does not matter.
        let per = puts.len().div_ceil(remote.write_streams().max(1));
        let sends = puts
            .chunks(per)
            .map(|chunk| timeout(deadline, remote.put_batch(chunk)));
        let mut ok = true;
        for (c, result) in futures::future::join_all(sends)
            .await
            .into_iter()
            .enumerate()
        {
            if let Ok(Ok(indices)) = &result {
                refused.extend(indices.iter().filter_map(|i| put_hashes.get(c * per + i)));
            }
            ok &= inner.outcome("put", result);
        }
        if !ok {
            return None;
        }
        let counters = &inner.counters;
        let kept = puts.len().saturating_sub(refused.len());
        counters.puts.fetch_add(kept as u64, Ordering::Relaxed);
        counters
            .refused
            .fetch_add(refused.len() as u64, Ordering::Relaxed);
    }
    if !removes.is_empty() {
        let result = timeout(deadline, remote.remove_batch(removes)).await;
        if !inner.outcome("remove", result) {
            return None;
        }
        inner
            .counters
            .removes
            .fetch_add(removes.len() as u64, Ordering::Relaxed);
    }
    Some(refused)
}

#[cfg(test)]
mod tests {
    use super::*;
    use infera_core::event::Retention;

    fn put(ns: &str, len: u64) -> Option<Pending> {
        Some(Pending {
            ns: Namespace::new(ns, ""),
            key: Bytes::from_static(b"k"),
            value: Bytes::new(),
            info: FrameInfo {
                class: Retention::Long,
                expires_at: None,
                writer: 1,
                seq: 0,
                written_at: 0,
            },
            len,
        })
    }

    fn absorb(q: &mut Queue, ops: Vec<(u128, u64, Option<Pending>)>, max_removals: usize) -> bool {
        let mut inbox = Inbox::default();
        let bytes: u64 = ops.iter().flat_map(|(_, _, p)| p).map(|p| p.len).sum();
        for (hash, seq, op) in ops {
            inbox.push(hash, seq, op);
        }
        let before = q.bytes;
        q.take(&mut inbox);
        assert!(inbox.len() == 0 && inbox.bytes == 0);
        assert_eq!(inbox.queued, before + bytes);
        q.absorb(max_removals)
    }

    #[test]
    fn a_later_operation_replaces_an_earlier_one_of_its_key_and_bytes_follow() {
        let mut q = Queue::default();
        assert!(!absorb(
            &mut q,
            vec![(1, 1, put("m", 10)), (2, 2, put("m", 5))],
            8
        ));
        assert_eq!((q.ops.len(), q.bytes, q.removes), (2, 15, 0));
        assert!(!absorb(&mut q, vec![(1, 3, None)], 8));
        assert_eq!((q.ops.len(), q.bytes, q.removes), (2, 5, 1));
        assert!(matches!(q.ops[&1], (3, Op::Remove)));
    }

    #[test]
    fn a_put_sequenced_before_a_clear_does_not_undo_it() {
        let mut q = Queue::default();
        absorb(&mut q, vec![(1, 1, put("m", 10))], 8);
        // The clear (sequence 3) turns the queued put into a removal; a put of the same key
        // taken at sequence 2, absorbed only now, is older and must not replace it.
        assert_eq!(q.clear_namespace(&Namespace::new("m", ""), 3), 1);
        absorb(&mut q, vec![(1, 2, put("m", 10))], 8);
        assert!(matches!(q.ops[&1], (3, Op::Remove)));
        assert_eq!((q.bytes, q.removes), (0, 1));
    }

    #[test]
    fn removals_past_the_bound_are_refused_and_reported() {
        let mut q = Queue::default();
        assert!(!absorb(&mut q, vec![(1, 1, None), (2, 2, put("m", 4))], 1));
        // A removal of a key already queued still replaces it; a new key's is refused.
        assert!(!absorb(&mut q, vec![(2, 3, None)], 2));
        assert!(absorb(&mut q, vec![(3, 4, None)], 2));
        assert_eq!((q.ops.len(), q.removes, q.bytes), (2, 2, 0));
        assert!(!q.ops.contains_key(&3));
    }

    #[test]
    fn a_refused_put_stays_as_a_removal_unless_a_newer_operation_replaced_it() {
        let mut q = Queue::default();
        absorb(&mut q, vec![(1, 1, put("m", 10)), (2, 2, put("m", 6))], 8);
        let batch = q.batch(8, 1 << 20);
        assert_eq!(batch.len(), 2);
        // Key 2 was written again while the batch was in flight.
        absorb(&mut q, vec![(2, 3, put("m", 4))], 8);
        q.landed(&batch, &[1, 2], None);
        // Key 1's put, refused, is a removal at its own sequence number, back in line; key 2's
        // newer put is untouched.
        assert!(matches!(q.ops[&1], (1, Op::Remove)));
        assert!(matches!(&q.ops[&2], (3, Op::Put(p)) if p.len == 4));
        assert_eq!((q.bytes, q.removes), (4, 1));
        let next = q.batch(8, 1 << 20);
        assert!(
            next.iter()
                .any(|(h, _, op)| *h == 1 && matches!(op, Op::Remove))
        );
        // The removal lands and leaves.
        q.landed(&next, &[], None);
        assert!(!q.ops.contains_key(&1));
        assert_eq!(q.removes, 0);
    }
}
