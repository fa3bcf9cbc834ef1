//! [`KvEventSubscriber`]: one SUB socket connected to one engine endpoint (one dp rank).
//!
//! The background task connects (retrying until the engine is up, reconnecting after it goes
//! away), subscribes, and for each message: splits the frames, runs the seq through a
//! [`StreamSeq`], decodes the payload with the stream's [`GroupKinds`], and sends items on a
//! bounded channel. A gap or restart is sent *before* the batch that revealed it. Garbage never
//! stops the task: it is counted in [`SubscriberStats`], logged at most once per
//! [`LOG_EVERY`] with the number suppressed, and sent as [`SubscriberItem::Malformed`].

use super::frames::split_frames;
use bytes::Bytes;
use infera_adapters::kv_events::{
    EngineBatch, GroupKinds, SeqStatus, StreamSeq, decode_batch_with,
};
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SubSocket};

/// At most one garbage / error log line per this interval (per subscriber).
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// Where and how to subscribe.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The engine's PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// Topic prefix to subscribe to; empty for every message (needed for ATOM's bare payloads).
    pub topic: String,
    /// Capacity of the item channel.
    pub channel_capacity: usize,
}

impl SubscriberConfig {
    /// Every topic, a channel of 1024 items.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            topic: String::new(),
            channel_capacity: 1024,
        }
    }
}

/// What the subscriber yields.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscriberItem {
    /// One decoded batch (its malformed events, if any, are in `batch.malformed`).
    Batch {
        /// The engine's seq, if its messages carry one.
        seq: Option<u64>,
        topic: Option<Bytes>,
        batch: EngineBatch,
        /// The engine's msgpack payload, verbatim (what a relay republishes).
        payload: Bytes,
    },
    /// Batches with these seqs were lost (sent before the batch after them).
    Gap { missing: RangeInclusive<u64> },
    /// The seq went back: the engine restarted and its cache is empty (sent before the batch).
    Restart { expected: u64, got: u64 },
    /// A message that could not be used.
    Malformed { reason: String },
}

/// Counters of one subscriber, readable while it runs.
#[derive(Debug, Default)]
pub struct SubscriberStats {
    /// Batches decoded and sent.
    pub batches: AtomicU64,
    /// Events in those batches.
    pub events: AtomicU64,
    /// Events of unknown kinds skipped.
    pub skipped_unknown: AtomicU64,
    /// Malformed events inside otherwise good batches.
    pub malformed_events: AtomicU64,
    /// Messages that were not KV-event messages (bad frames or payloads).
    pub garbage: AtomicU64,
    /// Gaps seen, and the number of batches they lost.
    pub gaps: AtomicU64,
    pub missing_batches: AtomicU64,
    /// Engine restarts seen.
    pub restarts: AtomicU64,
    /// Socket receive or connect errors (the task keeps going).
    pub socket_errors: AtomicU64,
}

impl SubscriberStats {
    fn inc(c: &AtomicU64, by: u64) {
        c.fetch_add(by, Ordering::Relaxed);
    }

    /// A plain-number read of a counter.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// A running subscription. Dropping it stops the task; [`KvEventSubscriber::shutdown`] also
/// waits for it.
#[derive(Debug)]
pub struct KvEventSubscriber {
    rx: mpsc::Receiver<SubscriberItem>,
    stats: Arc<SubscriberStats>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl KvEventSubscriber {
    /// Starts subscribing. Must be called inside a tokio runtime. Returns at once; the task
    /// connects in the background and keeps retrying until the engine is reachable.
    pub fn spawn(config: SubscriberConfig) -> Self {
        let (tx, rx) = mpsc::channel(config.channel_capacity.max(1));
        let stats = Arc::new(SubscriberStats::default());
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(config, tx, Arc::clone(&stats), cancel.clone()));
        Self {
            rx,
            stats,
            cancel,
            task: Some(task),
        }
    }

    /// The next item; `None` once the subscriber has stopped.
    pub async fn recv(&mut self) -> Option<SubscriberItem> {
        self.rx.recv().await
    }

    /// The subscriber's counters (shared; they keep updating).
    pub fn stats(&self) -> Arc<SubscriberStats> {
        Arc::clone(&self.stats)
    }

    /// A token that stops the subscriber when cancelled.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Stops the task and waits for it to end (its socket is closed by then).
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            // A panic in the task has already been reported by tokio; nothing to add.
            let _ = task.await;
        }
    }
}

impl Drop for KvEventSubscriber {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Rate-limited warnings.
struct LogLimiter {
    last: Option<Instant>,
    suppressed: u64,
}

impl LogLimiter {
    /// `Some(suppressed since last time)` when a line may be logged now.
    fn allow(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self.last.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

async fn run(
    config: SubscriberConfig,
    tx: mpsc::Sender<SubscriberItem>,
    stats: Arc<SubscriberStats>,
    cancel: CancellationToken,
) {
    let endpoint = config.endpoint.as_str();
    let mut log = LogLimiter {
        last: None,
        suppressed: 0,
    };
    let mut socket = SubSocket::new();
    // Subscriptions are remembered and sent to every peer on (re)connect.
    if let Err(e) = socket.subscribe(&config.topic).await {
        tracing::warn!(endpoint, error = %e, "kv-event subscribe failed");
        SubscriberStats::inc(&stats.socket_errors, 1);
    }
    let connected = tokio::select! {
        () = cancel.cancelled() => return,
        r = socket.connect(endpoint) => r,
    };
    if let Err(e) = connected {
        tracing::error!(endpoint, error = %e, "kv-event subscriber cannot connect; stopping");
        SubscriberStats::inc(&stats.socket_errors, 1);
        // The consumer sees the channel close; the error is in the log and the stats.
        return;
    }
    tracing::info!(endpoint, topic = %config.topic, "kv-event subscriber connected");

    let mut seq_state = StreamSeq::default();
    let mut groups = GroupKinds::default();
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => break,
            m = socket.recv() => m,
        };
        let items = match msg {
            Ok(m) => handle(
                m.into_vec(),
                &mut seq_state,
                &mut groups,
                &stats,
                &mut log,
                endpoint,
            ),
            Err(e) => {
                SubscriberStats::inc(&stats.socket_errors, 1);
                if let Some(suppressed) = log.allow() {
                    tracing::warn!(endpoint, error = %e, suppressed, "kv-event receive failed; the socket reconnects");
                }
                // The peer went away; give the reconnect task a moment instead of spinning.
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                continue;
            }
        };
        for item in items {
            tokio::select! {
                () = cancel.cancelled() => return,
                r = tx.send(item) => if r.is_err() {
                    // The consumer dropped its receiver: nobody is listening any more.
                    return;
                },
            }
        }
    }
}

/// One message → the items to send (0 to 3: gap/restart, then the batch or a malformed note).
fn handle(
    frames: Vec<Bytes>,
    seq_state: &mut StreamSeq,
    groups: &mut GroupKinds,
    stats: &SubscriberStats,
    log: &mut LogLimiter,
    endpoint: &str,
) -> Vec<SubscriberItem> {
    let mut garbage = |reason: String| {
        SubscriberStats::inc(&stats.garbage, 1);
        if let Some(suppressed) = log.allow() {
            tracing::warn!(endpoint, %reason, suppressed, "kv-event message skipped");
        }
        vec![SubscriberItem::Malformed { reason }]
    };
    let frames = match split_frames(frames) {
        Ok(f) => f,
        Err(e) => return garbage(e.to_string()),
    };
    let mut items = Vec::new();
    if let Some(seq) = frames.seq {
        match seq_state.observe(seq) {
            SeqStatus::InOrder => {}
            SeqStatus::Gap { missing } => {
                SubscriberStats::inc(&stats.gaps, 1);
                SubscriberStats::inc(&stats.missing_batches, missing.end() - missing.start() + 1);
                tracing::warn!(
                    endpoint,
                    first = missing.start(),
                    last = missing.end(),
                    "kv-event gap"
                );
                items.push(SubscriberItem::Gap { missing });
            }
            SeqStatus::Restart { expected, got } => {
                SubscriberStats::inc(&stats.restarts, 1);
                tracing::warn!(
                    endpoint,
                    expected,
                    got,
                    "kv-event seq went back: engine restarted"
                );
                // A new engine process: its groups may differ.
                *groups = GroupKinds::default();
                items.push(SubscriberItem::Restart { expected, got });
            }
        }
    }
    match decode_batch_with(&frames.payload, groups) {
        Ok(batch) => {
            SubscriberStats::inc(&stats.batches, 1);
            SubscriberStats::inc(&stats.events, batch.events.len() as u64);
            SubscriberStats::inc(&stats.skipped_unknown, u64::from(batch.skipped_unknown));
            if !batch.malformed.is_empty() {
                SubscriberStats::inc(&stats.malformed_events, batch.malformed.len() as u64);
                if let Some(suppressed) = log.allow() {
                    tracing::warn!(endpoint, first = %batch.malformed[0], count = batch.malformed.len(), suppressed, "kv-event batch has malformed events");
                }
            }
            items.push(SubscriberItem::Batch {
                seq: frames.seq,
                topic: frames.topic,
                batch,
                payload: frames.payload,
            });
            items
        }
        Err(e) => {
            let mut out = items;
            out.extend(garbage(e.to_string()));
            out
        }
    }
}
