//! The event log: the single writer of router state.
//!
//! Contract (every implementation — memory, JetStream, SQL — passes the same conformance suite):
//! - `append` assigns consecutive sequence numbers starting at `last_seq() + 1`, atomically per batch,
//!   and stamps each envelope with the log clock's time.
//! - `read(from, max)` returns envelopes with `seq >= from` in order; asking for a sequence number
//!   that compaction removed is [`LogError::Compacted`], never a silent skip.
//! - `compact(snapshot)` stores a projection dump taken at `snapshot.upto` and drops envelopes with
//!   `seq <= upto`. Rebuilding = apply the snapshot's events, then everything after `upto`.
//! - `subscribe(from)` yields every envelope from `from` on, then waits for new ones; it ends only
//!   with an error (compaction overtook it, or the log closed).

use crate::clock::Clock;
use crate::event::{EVENT_FORMAT_VERSION, Envelope, Event, Seq, Source};
use crate::projection::Projection;
use async_trait::async_trait;
use futures::stream::BoxStream;
use std::sync::{Arc, RwLock};
use tokio::sync::watch;

/// An event about to be appended.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub source: Option<Source>,
    pub event: Event,
}

impl NewEvent {
    pub fn new(event: Event) -> Self {
        Self {
            source: None,
            event,
        }
    }

    pub fn from_source(source: Source, event: Event) -> Self {
        Self {
            source: Some(source),
            event,
        }
    }
}

impl From<Event> for NewEvent {
    fn from(event: Event) -> Self {
        Self::new(event)
    }
}

/// Sequence numbers assigned to one appended batch: `first..=last` (empty when `first > last`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqRange {
    pub first: Seq,
    pub last: Seq,
}

/// A projection dump standing in for every event up to and including `upto`.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub upto: Seq,
    pub events: Vec<Event>,
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The requested position was compacted away; rebuild from the snapshot instead.
    #[error("event log compacted through seq {upto}; rebuild from the snapshot")]
    Compacted { upto: Seq },
    /// A snapshot must not reach past the end of the log.
    #[error("snapshot at seq {upto} is past the end of the log (last seq {last})")]
    SnapshotAhead { upto: Seq, last: Seq },
    /// The backing store failed; retrying may help.
    #[error("event log backend failed: {0}")]
    Backend(String),
    /// The log was shut down.
    #[error("event log closed")]
    Closed,
}

impl LogError {
    /// Whether retrying the same call later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, LogError::Backend(_))
    }
}

/// An append-only, compactable log of [`Envelope`]s.
#[async_trait]
pub trait EventLog: Send + Sync + std::fmt::Debug {
    /// Appends a batch atomically and returns the sequence numbers it received.
    async fn append(&self, batch: Vec<NewEvent>) -> Result<SeqRange, LogError>;
    /// Reads up to `max` envelopes with `seq >= from`.
    async fn read(&self, from: Seq, max: usize) -> Result<Vec<Envelope>, LogError>;
    /// The last assigned sequence number (0 when empty).
    async fn last_seq(&self) -> Result<Seq, LogError>;
    /// The latest snapshot, if the log was ever compacted.
    async fn snapshot(&self) -> Result<Option<Snapshot>, LogError>;
    /// Replaces everything up to `snapshot.upto` by the snapshot.
    async fn compact(&self, snapshot: Snapshot) -> Result<(), LogError>;
    /// Every envelope from `from` on, waiting for new ones.
    fn subscribe(&self, from: Seq) -> BoxStream<'static, Result<Envelope, LogError>>;
}

/// Rebuilds `projection` from `log`: the snapshot's events, then the tail. Returns the last seq applied.
pub async fn rebuild<P: Projection + ?Sized>(
    log: &dyn EventLog,
    projection: &mut P,
) -> Result<Seq, LogError> {
    let mut next = 1;
    if let Some(snap) = log.snapshot().await? {
        for event in snap.events {
            let env = Envelope {
                v: EVENT_FORMAT_VERSION,
                seq: snap.upto,
                ts_us: 0,
                source: None,
                event,
            };
            projection.apply(&env);
        }
        next = snap.upto + 1;
    }
    let mut last = next - 1;
    loop {
        let batch = log.read(next, 4096).await?;
        let Some(tail) = batch.last() else { break };
        last = tail.seq;
        next = last + 1;
        for env in &batch {
            projection.apply(env);
        }
    }
    Ok(last)
}

#[derive(Debug, Default)]
struct MemoryInner {
    /// Seq of `entries[0]`.
    base: Seq,
    entries: Vec<Envelope>,
    snapshot: Option<Snapshot>,
}

/// The in-memory log: the live server's default and replay's only log.
///
/// Appends also have synchronous forms ([`MemoryLog::append_sync`], [`MemoryLog::append_with`])
/// for the single-threaded simulator, which must not pay for an async runtime per event, and for
/// the server's core, which applies what it appends under its own lock.
#[derive(Debug, Clone)]
pub struct MemoryLog {
    inner: Arc<RwLock<MemoryInner>>,
    clock: Arc<dyn Clock>,
    tip: watch::Sender<Seq>,
}

impl MemoryLog {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        let inner = MemoryInner {
            base: 1,
            ..Default::default()
        };
        Self {
            inner: Arc::new(RwLock::new(inner)),
            clock,
            tip: watch::Sender::new(0),
        }
    }

    /// Appends without awaiting; returns the envelopes as stored (for applying them at once).
    pub fn append_sync(&self, batch: Vec<NewEvent>) -> Vec<Envelope> {
        self.append_with(batch, <[Envelope]>::to_vec)
    }

    /// Appends without awaiting and hands `f` the envelopes as stored, before any reader can see
    /// them: a caller that applies them at once (the server's core, the simulator) reads them in
    /// place instead of paying for a copy of every event.
    pub fn append_with<T>(&self, batch: Vec<NewEvent>, f: impl FnOnce(&[Envelope]) -> T) -> T {
        let ts_us = self.clock.now_us();
        let mut inner = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let mut seq = inner.base + inner.entries.len() as Seq;
        let start = inner.entries.len();
        inner.entries.reserve(batch.len());
        for e in batch {
            inner.entries.push(Envelope {
                v: EVENT_FORMAT_VERSION,
                seq,
                ts_us,
                source: e.source,
                event: e.event,
            });
            seq += 1;
        }
        let out = f(&inner.entries[start..]);
        drop(inner);
        self.tip.send_replace(seq - 1);
        out
    }

    /// [`EventLog::compact`] without awaiting.
    ///
    /// # Errors
    /// [`LogError::SnapshotAhead`] when the snapshot claims events the log does not hold.
    pub fn compact_sync(&self, snapshot: Snapshot) -> Result<(), LogError> {
        let mut inner = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let last = inner.base + inner.entries.len() as Seq - 1;
        if snapshot.upto > last {
            return Err(LogError::SnapshotAhead {
                upto: snapshot.upto,
                last,
            });
        }
        let drop_n = (snapshot.upto + 1).saturating_sub(inner.base) as usize;
        let len = inner.entries.len();
        inner.entries.drain(..drop_n.min(len));
        inner.base = snapshot.upto + 1;
        inner.snapshot = Some(snapshot);
        Ok(())
    }

    /// Number of envelopes held (after compaction).
    pub fn len(&self) -> usize {
        self.inner.read().map(|i| i.entries.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read_sync(&self, from: Seq, max: usize) -> Result<Vec<Envelope>, LogError> {
        let inner = self.inner.read().unwrap_or_else(|p| p.into_inner());
        if let Some(snap) = &inner.snapshot
            && from <= snap.upto
        {
            return Err(LogError::Compacted { upto: snap.upto });
        }
        let from = from.max(inner.base);
        let start = (from - inner.base) as usize;
        if start >= inner.entries.len() {
            return Ok(Vec::new());
        }
        let end = inner.entries.len().min(start.saturating_add(max));
        Ok(inner.entries[start..end].to_vec())
    }
}

#[async_trait]
impl EventLog for MemoryLog {
    async fn append(&self, batch: Vec<NewEvent>) -> Result<SeqRange, LogError> {
        let n = batch.len() as Seq;
        let stored = self.append_sync(batch);
        let last = stored
            .last()
            .map(|e| e.seq)
            .unwrap_or(self.last_seq().await?);
        Ok(SeqRange {
            first: last + 1 - n,
            last,
        })
    }

    async fn read(&self, from: Seq, max: usize) -> Result<Vec<Envelope>, LogError> {
        self.read_sync(from, max)
    }

    async fn last_seq(&self) -> Result<Seq, LogError> {
        let inner = self.inner.read().unwrap_or_else(|p| p.into_inner());
        Ok(inner.base + inner.entries.len() as Seq - 1)
    }

    async fn snapshot(&self) -> Result<Option<Snapshot>, LogError> {
        Ok(self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .snapshot
            .clone())
    }

    async fn compact(&self, snapshot: Snapshot) -> Result<(), LogError> {
        self.compact_sync(snapshot)
    }

    fn subscribe(&self, from: Seq) -> BoxStream<'static, Result<Envelope, LogError>> {
        let log = self.clone();
        let rx = self.tip.subscribe();
        let state = (
            log,
            rx,
            from.max(1),
            std::collections::VecDeque::new(),
            false,
        );
        Box::pin(futures::stream::unfold(
            state,
            |(log, mut rx, mut next, mut buf, done)| async move {
                if done {
                    return None;
                }
                loop {
                    if let Some(env) = buf.pop_front() {
                        return Some((Ok(env), (log, rx, next, buf, false)));
                    }
                    match log.read_sync(next, 1024) {
                        Err(e) => return Some((Err(e), (log, rx, next, buf, true))),
                        Ok(batch) if !batch.is_empty() => {
                            next = batch.last().map(|e| e.seq + 1).unwrap_or(next);
                            buf.extend(batch);
                        }
                        Ok(_) => {
                            if rx.changed().await.is_err() {
                                return Some((Err(LogError::Closed), (log, rx, next, buf, true)));
                            }
                        }
                    }
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::VirtualClock;
    use crate::event::{RequestPrefilled, WorkerDeregistered};
    use crate::ids::{RequestId, WorkerId};
    use futures::StreamExt;

    fn ev(i: u32) -> NewEvent {
        NewEvent::new(Event::RequestPrefilled(RequestPrefilled {
            request_id: RequestId::new(format!("r{i}")),
        }))
    }

    fn log() -> MemoryLog {
        MemoryLog::new(Arc::new(VirtualClock::new(42)))
    }

    #[tokio::test]
    async fn append_assigns_consecutive_seqs() {
        let log = log();
        assert_eq!(log.last_seq().await.ok(), Some(0));
        let r = log.append(vec![ev(1), ev(2)]).await.expect("append");
        assert_eq!(r, SeqRange { first: 1, last: 2 });
        let r = log.append(vec![ev(3)]).await.expect("append");
        assert_eq!(r, SeqRange { first: 3, last: 3 });
        let all = log.read(1, 10).await.expect("read");
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert!(all.iter().all(|e| e.ts_us == 42));
        assert_eq!(log.read(3, 10).await.expect("read").len(), 1);
        assert!(log.read(4, 10).await.expect("read").is_empty());
    }

    #[tokio::test]
    async fn compaction_reports_itself_instead_of_skipping() {
        let log = log();
        log.append(vec![ev(1), ev(2), ev(3)]).await.expect("append");
        let snap = Snapshot {
            upto: 2,
            events: vec![Event::WorkerDeregistered(WorkerDeregistered {
                worker: WorkerId::new("a:1"),
                reason: String::new(),
            })],
        };
        log.compact(snap.clone()).await.expect("compact");
        assert!(matches!(
            log.read(1, 10).await,
            Err(LogError::Compacted { upto: 2 })
        ));
        assert_eq!(log.read(3, 10).await.expect("read")[0].seq, 3);
        assert_eq!(log.snapshot().await.expect("snap"), Some(snap));
        assert_eq!(log.append(vec![ev(4)]).await.expect("append").first, 4);
        let ahead = Snapshot {
            upto: 99,
            events: vec![],
        };
        assert!(matches!(
            log.compact(ahead).await,
            Err(LogError::SnapshotAhead { .. })
        ));
    }

    #[tokio::test]
    async fn subscribe_sees_history_then_new_events() {
        let log = log();
        log.append(vec![ev(1), ev(2)]).await.expect("append");
        let mut sub = log.subscribe(2);
        let first = sub.next().await.expect("item").expect("ok");
        assert_eq!(first.seq, 2);
        let waiter = tokio::spawn(async move { sub.next().await });
        log.append(vec![ev(3)]).await.expect("append");
        let got = waiter.await.expect("join").expect("item").expect("ok");
        assert_eq!(got.seq, 3);
    }
}
