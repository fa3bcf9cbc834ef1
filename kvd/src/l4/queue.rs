//! The write-behind queue and its writer task.
//!
//! - The queue holds at most one operation per key hash (a newer one replaces the older, which
//!   then never reaches the store): a put (the framed block, also answered to reads until it
//!   lands) or a removal. An operation stays queued while it is in flight and leaves only when
//!   the store acknowledged it and no newer one replaced it, so a read never falls through to
//!   an older value in the store.
//! - A clear turns the namespace's queued puts into removals.
//! - Puts are bounded in bytes; a put that does not fit, or that arrives while the breaker is
//!   open, becomes a removal (its L4 copy is dropped and counted; the store's older value must
//!   not answer for it). Removals are small and bounded in number; past the bound L4 reads are
//!   switched off for the rest of the run (an error is logged) rather than risk an old value.
//! - The writer sends batches (bounded in items and bytes; a batch's puts spread over the
//!   store's write streams) under a deadline each; a failed batch goes back to the queue.
//!   Consecutive failures open the circuit breaker; while it is open the writer probes the
//!   store's health every retry interval and closes it on success.

use super::frame::{self, FrameInfo};
use super::{Inner, RemoteStore, name};
use crate::proto::Namespace;
use bytes::Bytes;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
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

/// The queue's state (under `Inner::queue`).
#[derive(Debug, Default)]
pub struct Queue {
    pub ops: FxHashMap<u128, (u64, Op)>,
    order: VecDeque<u128>,
    pub bytes: u64,
    pub removes: usize,
}

fn size(op: &Op) -> (u64, usize) {
    match op {
        Op::Put(p) => (p.len, 0),
        Op::Remove => (0, 1),
    }
}

impl Queue {
    /// Whether a put of `len` bytes for `hash` fits in `limit` bytes.
    pub fn fits(&self, hash: u128, len: u64, limit: u64) -> bool {
        let old = self.ops.get(&hash).map_or(0, |(_, op)| size(op).0);
        self.bytes - old + len <= limit
    }

    /// Queues `op` for `hash` at `seq`, replacing any older one.
    pub fn insert(&mut self, hash: u128, seq: u64, op: Op) {
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
    /// then goes back in line).
    fn landed(&mut self, batch: &[(u128, u64, Op)]) {
        for (hash, seq, _) in batch {
            match self.ops.get(hash) {
                Some((now, _)) if now == seq => {
                    if let Some((_, op)) = self.ops.remove(hash) {
                        self.forget(&op);
                    }
                }
                Some(_) => self.order.push_back(*hash),
                None => {}
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

/// The writer task: runs until `inner.stop` is cancelled, writing through `remote` (the
/// store's twin on a writer thread, see [`super::RemoteStore::twin`]).
pub async fn writer(inner: Arc<Inner>, remote: Arc<dyn RemoteStore>) {
    loop {
        if inner.breaker.load(Ordering::Acquire) {
            tokio::select! {
                () = inner.stop.cancelled() => return,
                () = tokio::time::sleep(inner.options.retry_interval) => {}
            }
            inner.probe(remote.as_ref()).await;
            continue;
        }
        let batch = inner
            .lock()
            .batch(inner.options.batch_items, inner.options.batch_bytes);
        if batch.is_empty() {
            let wake = inner.wake.notified();
            tokio::pin!(wake);
            wake.as_mut().enable();
            if !inner.lock().is_empty() && !inner.breaker.load(Ordering::Acquire) {
                continue;
            }
            tokio::select! {
                () = inner.stop.cancelled() => return,
                () = wake => {}
            }
            continue;
        }
        let ok = write(&inner, remote.as_ref(), &batch).await;
        {
            let mut q = inner.lock();
            if ok {
                q.landed(&batch);
            } else {
                q.failed(&batch);
            }
        }
        inner.landed.send_modify(|n| *n += 1);
    }
}

/// Sends one batch (puts, then removals); whether the store acknowledged all of it.
async fn write(inner: &Inner, remote: &dyn RemoteStore, batch: &[(u128, u64, Op)]) -> bool {
    let mut puts = Vec::new();
    let mut removes = Vec::new();
    for (hash, _, op) in batch {
        let n = name(&inner.options.prefix, *hash);
        match op {
            Op::Put(p) => {
                if let Some(framed) = frame::encode(&p.ns, &p.key, &p.value, p.info) {
                    puts.push((n, framed));
                }
            }
            Op::Remove => removes.push(n),
        }
    }
    let deadline = inner.options.op_timeout;
    if !puts.is_empty() {
        // Spread over the store's write streams: the batch's keys are distinct, so their order
        // does not matter.
        let per = puts.len().div_ceil(remote.write_streams().max(1));
        let sends = puts
            .chunks(per)
            .map(|chunk| timeout(deadline, remote.put_batch(chunk)));
        let mut ok = true;
        for result in futures::future::join_all(sends).await {
            ok &= inner.outcome("put", result);
        }
        if !ok {
            return false;
        }
        inner
            .counters
            .puts
            .fetch_add(puts.len() as u64, Ordering::Relaxed);
    }
    if !removes.is_empty() {
        let result = timeout(deadline, remote.remove_batch(&removes)).await;
        if !inner.outcome("remove", result) {
            return false;
        }
        inner
            .counters
            .removes
            .fetch_add(removes.len() as u64, Ordering::Relaxed);
    }
    true
}
