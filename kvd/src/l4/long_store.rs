//! [`LongStore`] for [`L4`]: the tiered store's view of the remote tier (see the module docs
//! of [`crate::l4`] for what each operation means over a shared store).

use super::frame::{self, FrameInfo};
use super::queue::{Op, Pending};
use super::{L4, MAX_CUTOFFS, name};
use crate::inventory::Inventory;
use crate::long::{LongBlock, LongHit, LongRejected, LongStore, Put, WritePermit};
use crate::proto::Namespace;
use crate::stats::LongStats;
use bytes::Bytes;
use infera_core::event::{Retention, Tier};
use std::io;
use std::sync::atomic::Ordering;

#[async_trait::async_trait]
impl LongStore for L4 {
    fn kind(&self) -> &'static str {
        self.inner.remote.backend()
    }

    fn class_of(&self, hash: u128, now: u64) -> Option<Retention> {
        match self.inner.lock().ops.get(&hash) {
            Some((_, Op::Put(p))) if p.info.expires_at.is_none_or(|t| t > now) => {
                Some(p.info.class)
            }
            _ => None,
        }
    }

    fn is_current(&self, hash: u128, generation: u64) -> bool {
        self.inner.bucket(hash).load(Ordering::Acquire) <= generation
    }

    fn durable_writes(&self) -> bool {
        false
    }

    fn permits_wait(&self) -> bool {
        false
    }

    async fn write_permits(&self, sizes: &[u64]) -> Vec<WritePermit> {
        // Never waits: a put that does not fit in the queue is dropped instead.
        sizes.iter().map(|_| WritePermit::unbounded()).collect()
    }

    fn try_write_permit(&self, _bytes: u64) -> Option<WritePermit> {
        Some(WritePermit::unbounded())
    }

    fn put(
        &self,
        block: LongBlock,
        _permit: WritePermit,
        now: u64,
        _spill: bool,
    ) -> Result<Put, LongRejected> {
        let inner = &self.inner;
        if !matches!(block.class, Retention::Short | Retention::Long) {
            return Err(LongRejected::ClassNotStored);
        }
        let len = frame::framed_len(&block.ns, &block.key, block.value.len())
            .map(|l| l as u64)
            .filter(|l| *l <= inner.front.max_value_bytes);
        let recorded = self.inventory.get();
        let inventory = recorded.and_then(|inv| inv.hash(&block.ns, &block.key));
        // Noted under the inbox's lock, which orders the key's operations.
        let note_removal = || {
            if let Some(inv) = recorded {
                inv.removed(Tier::External, inventory);
            }
        };
        self.push(block.hash, now, |inbox, seq| match len {
            None => {
                note_removal();
                (None, Err(LongRejected::TooLarge))
            }
            Some(len)
                if inner.breaker_open()
                    || inbox.queued + inbox.bytes + len > inner.front.queue_bytes =>
            {
                inbox.dropped += 1;
                note_removal();
                (None, Ok(seq))
            }
            Some(len) => {
                if let Some(inv) = recorded {
                    inv.stored(Tier::External, inventory);
                }
                let info = FrameInfo {
                    class: block.class,
                    expires_at: block.expires_at,
                    // Stamped when framed (`queue::prepare`): the writer id is not on
                    // the SET's cache lines.
                    writer: 0,
                    seq,
                    written_at: now,
                };
                let pending = Pending {
                    ns: block.ns,
                    key: block.key,
                    value: block.value,
                    info,
                    len,
                };
                (Some(pending), Ok(seq))
            }
        })
        .map(|generation| Put {
            generation,
            durable: None,
        })
    }

    fn remove(&self, hash: u128) {
        self.push(hash, 0, |_, _| (None, ()));
    }

    fn remove_key(&self, ns: &Namespace, key: &[u8], hash: u128) {
        let Some(inv) = self.inventory.get() else {
            return self.remove(hash);
        };
        let inventory = inv.hash(ns, key);
        self.push(hash, 0, |_, _| {
            inv.removed(Tier::External, inventory);
            (None, ())
        });
    }

    fn record_inventory(&self, inventory: &Inventory) {
        let _ = self.inventory.set(inventory.clone());
        let _ = self.inner.inventory.set(inventory.clone());
    }

    async fn get(&self, ns: &Namespace, key: &[u8], hash: u128, now: u64) -> Option<LongHit> {
        let key = Bytes::copy_from_slice(key);
        self.read(ns, &[(key, hash)], now).await.pop().flatten()
    }

    async fn get_many(
        &self,
        ns: &Namespace,
        reqs: &[(Bytes, u128)],
        now: u64,
    ) -> Vec<Option<LongHit>> {
        self.read(ns, reqs, now).await
    }

    async fn held(&self, _ns: &Namespace, reqs: &[(Bytes, u128)], now: u64) -> Vec<bool> {
        let inner = &self.inner;
        let mut out = vec![false; reqs.len()];
        let mut ask = Vec::new();
        {
            let q = inner.lock();
            for (i, (_, hash)) in reqs.iter().enumerate() {
                match q.ops.get(hash) {
                    Some((_, Op::Put(p))) => out[i] = p.info.expires_at.is_none_or(|t| t > now),
                    Some((_, Op::Remove)) => {}
                    None => ask.push(i),
                }
            }
        }
        if ask.is_empty() || inner.breaker_open() || inner.reads_off.load(Ordering::Acquire) {
            return out;
        }
        let names: Vec<String> = ask
            .iter()
            .map(|i| name(&inner.options.prefix, reqs[*i].1))
            .collect();
        let result =
            tokio::time::timeout(inner.options.op_timeout, inner.remote.exists_batch(&names)).await;
        if let Ok(Ok(found)) = &result {
            for (i, there) in ask.iter().zip(found) {
                out[*i] = *there;
            }
        }
        inner.outcome("exists", result);
        out
    }

    fn clear(&self, ns: &Namespace) -> u64 {
        let inner = &self.inner;
        let mut q = inner.lock();
        // Every operation sequenced before the clear is absorbed before it is applied.
        let seq = {
            let mut inbox = inner.inbox();
            let seq = inner.front.seq.fetch_add(1, Ordering::AcqRel) + 1;
            q.take(&mut inbox);
            seq
        };
        inner.absorb(&mut q);
        let cutoff = (seq, inner.front.clock.load(Ordering::Relaxed));
        {
            let mut c = inner.cutoffs.lock().unwrap_or_else(|p| p.into_inner());
            if (ns.model.is_empty() && ns.compat_key.is_empty()) || c.by_ns.len() >= MAX_CUTOFFS {
                c.all = cutoff;
                c.by_ns.clear();
            } else {
                c.by_ns.insert(ns.clone(), cutoff);
            }
        }
        let cleared = q.clear_namespace(ns, seq);
        drop(q);
        inner.wake.notify_one();
        cleared
    }

    fn sweep(&self, _now: u64) -> usize {
        0
    }

    fn stats(&self) -> LongStats {
        LongStats {
            l4: self.l4_stats(),
            ..LongStats::default()
        }
    }

    async fn flush(&self) -> io::Result<()> {
        let inner = &self.inner;
        let mut landed = inner.landed.subscribe();
        // Not before its idle tick otherwise.
        inner.wake.notify_one();
        loop {
            if inner.lock().is_empty() {
                return Ok(());
            }
            if inner.breaker_open() {
                return Err(io::Error::other(format!(
                    "the L4 store {} is down; {} operations not written",
                    inner.remote.describe(),
                    inner.lock().ops.len()
                )));
            }
            if landed.changed().await.is_err() {
                return Ok(());
            }
        }
    }

    async fn checkpoint(&self) -> io::Result<()> {
        Ok(())
    }

    async fn close(&self) -> io::Result<()> {
        let flushed = tokio::time::timeout(self.inner.options.op_timeout, self.flush()).await;
        self.inner.stop.cancel();
        match flushed {
            Ok(result) => result,
            Err(_) => Err(io::Error::other(
                "the L4 queue did not drain before shutdown",
            )),
        }
    }
}
