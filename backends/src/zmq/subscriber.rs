//! [`KvEventSubscriber`]: one SUB socket connected to one engine endpoint (one dp rank).
//!
//! The background task connects (retrying until the engine is up, reconnecting after it goes
//! away), subscribes, and for each message splits the frames and sends them, undecoded, on a
//! bounded channel (decoding and seq tracking are the KV pipeline's, in `infera-core`). A
//! message that cannot be framed never stops the task: it is counted in [`SubscriberStats`],
//! logged at most once per [`LOG_EVERY`] with the number suppressed, and sent as
//! [`SubscriberItem::Malformed`].

use super::frames::{KvFrames, split_frames};
use bytes::Bytes;
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
    /// One message's frames: topic, the engine's seq if it sends one, the payload verbatim.
    Frames(KvFrames),
    /// A message that could not be framed.
    Malformed { reason: String },
}

/// Counters of one subscriber, readable while it runs.
#[derive(Debug, Default)]
pub struct SubscriberStats {
    /// Messages framed and sent.
    pub messages: AtomicU64,
    /// Messages that were not KV-event messages (wrong frame count or seq frame).
    pub garbage: AtomicU64,
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

    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => break,
            m = socket.recv() => m,
        };
        let item = match msg {
            Ok(m) => handle(m.into_vec(), &stats, &mut log, endpoint),
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
        tokio::select! {
            () = cancel.cancelled() => return,
            r = tx.send(item) => if r.is_err() {
                // The consumer dropped its receiver: nobody is listening any more.
                return;
            },
        }
    }
}

/// One message → the item to send.
fn handle(
    frames: Vec<Bytes>,
    stats: &SubscriberStats,
    log: &mut LogLimiter,
    endpoint: &str,
) -> SubscriberItem {
    match split_frames(frames) {
        Ok(frames) => {
            SubscriberStats::inc(&stats.messages, 1);
            SubscriberItem::Frames(frames)
        }
        Err(e) => {
            SubscriberStats::inc(&stats.garbage, 1);
            let reason = e.to_string();
            if let Some(suppressed) = log.allow() {
                tracing::warn!(endpoint, %reason, suppressed, "kv-event message skipped");
            }
            SubscriberItem::Malformed { reason }
        }
    }
}
