//! The publisher task: every [`PUBLISH_EVERY`] (or as soon as [`super::recorder::WAKE_AT`]
//! changes wait) it drains the [`Recorder`], turns the changes into one [`EngineBatch`] and
//! hands it to the [`InventorySink`].
//!
//! A batch is `AllBlocksCleared` first when the recorder asks for it (at start, after a
//! `clear` op, an overflow or a refused batch), then the changes in the order they were
//! recorded, consecutive changes of one kind and tier making one `BlockStored` or
//! `BlockRemoved`, then a `KvdTierLoad` per tier whose load is due: the first time the tier has
//! samples, and then at most once per [`LOAD_EVERY`], when its rate moved by more than
//! [`LOAD_CHANGE`] from the last one published. When nothing changed for [`HEARTBEAT_EVERY`],
//! an empty batch goes out: its seq lets a subscriber that missed the daemon's first batch (a
//! SUB socket reconnecting to a restarted daemon drops what was sent before it connected)
//! still see the seq go back, and clear what it knew of the old process.

use super::load::LoadMeter;
use super::recorder::Recorder;
use super::{Change, ChangeKind, InventorySink, TIERS};
use infera_core::event::Tier;
use infera_core::ids::EngineHash;
use infera_core::kv_events::kvd::{removed_event, stored_event};
use infera_core::kv_events::{EngineBatch, EngineEvent};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often waiting changes are published.
pub const PUBLISH_EVERY: Duration = Duration::from_millis(50);
/// The longest the publisher stays silent: then it sends an empty batch.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// A tier's load is published at most this often.
pub const LOAD_EVERY: Duration = Duration::from_secs(5);
/// ... and only when its rate moved by more than this fraction.
pub const LOAD_CHANGE: f64 = 0.10;

/// What the publisher counted (the `infera_kvd_inventory_*` metrics).
#[derive(Debug, Default)]
pub struct PublishCounters {
    batches: AtomicU64,
    events: AtomicU64,
    dropped: AtomicU64,
}

impl PublishCounters {
    /// Batches the sink took.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Events in them.
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// Block changes never published (overflow, refused batches).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Publisher {
    recorder: Arc<Recorder>,
    load: Arc<LoadMeter>,
    sink: Arc<dyn InventorySink>,
    counters: Arc<PublishCounters>,
    /// Per tier (as [`TIERS`]): when its load was last published, and the rate then.
    announced: [Option<(Instant, f64)>; 3],
    /// The buffer the recorder gets back at the next drain.
    spare: Vec<Change>,
    refused: u64,
    /// When the sink last took a batch.
    last: Option<Instant>,
}

impl Publisher {
    /// A publisher of `recorder`'s changes and `load`'s speeds to `sink`.
    pub fn new(
        recorder: Arc<Recorder>,
        load: Arc<LoadMeter>,
        sink: Arc<dyn InventorySink>,
        counters: Arc<PublishCounters>,
    ) -> Self {
        Self {
            recorder,
            load,
            sink,
            counters,
            announced: [None; 3],
            spare: Vec::new(),
            refused: 0,
            last: None,
        }
    }

    /// Publishes what is due at `now` (the publisher's clock); returns the events published.
    pub fn round(&mut self, now: Instant) -> usize {
        let mut changes = std::mem::take(&mut self.spare);
        let drained = self.recorder.drain(&mut changes);
        self.counters
            .dropped
            .fetch_add(drained.dropped, Ordering::Relaxed);
        let mut events = Vec::new();
        if drained.clear {
            events.push(EngineEvent::AllBlocksCleared);
        }
        group(&changes, &mut events);
        let block_changes = changes.len() as u64;
        changes.clear();
        self.spare = changes;
        let before = self.announced;
        self.tier_loads(now, &mut events);
        let quiet = self
            .last
            .is_none_or(|at| now.duration_since(at) >= HEARTBEAT_EVERY);
        if events.is_empty() && !quiet {
            return 0;
        }
        let n = events.len();
        let batch = EngineBatch {
            ts: unix_seconds(),
            dp_rank: None,
            events,
            ..EngineBatch::default()
        };
        match self.sink.publish(&batch) {
            Ok(()) => {
                self.last = Some(now);
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
                self.counters.events.fetch_add(n as u64, Ordering::Relaxed);
                n
            }
            Err(error) => {
                self.refused += 1;
                if self.refused.is_power_of_two() {
                    tracing::warn!(%error, refused = self.refused, block_changes,
                        "kvd inventory batch not published; the next one starts with a clear");
                }
                self.counters
                    .dropped
                    .fetch_add(block_changes, Ordering::Relaxed);
                self.recorder.restart();
                self.announced = before;
                0
            }
        }
    }

    /// Appends a `KvdTierLoad` for each tier whose load is due (see the module docs).
    fn tier_loads(&mut self, now: Instant, events: &mut Vec<EngineEvent>) {
        for (i, tier) in TIERS.into_iter().enumerate() {
            let Some(load) = self.load.load(tier) else {
                continue;
            };
            let due = match self.announced[i] {
                None => true,
                Some((at, rate)) => {
                    now.duration_since(at) >= LOAD_EVERY
                        && (load.bytes_per_s - rate).abs() > LOAD_CHANGE * rate.abs()
                }
            };
            if due {
                self.announced[i] = Some((now, load.bytes_per_s));
                events.push(EngineEvent::TierLoad {
                    tier,
                    bytes_per_s: load.bytes_per_s,
                    block_bytes: load.block_bytes,
                });
            }
        }
    }

    /// Publishes every [`PUBLISH_EVERY`], or when the recorder wakes it, until `stop`; then
    /// once more, so that the changes made before the stop go out.
    pub async fn run(mut self, stop: CancellationToken) {
        let recorder = self.recorder.clone();
        let mut tick = tokio::time::interval(PUBLISH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
                () = recorder.woken() => {}
            }
            self.round(Instant::now());
        }
        self.round(Instant::now());
    }
}

/// Appends one event per run of consecutive changes of one kind and tier.
fn group(changes: &[Change], events: &mut Vec<EngineEvent>) {
    let mut start = 0;
    while start < changes.len() {
        let (kind, tier) = (changes[start].kind, changes[start].tier);
        let end = changes[start..]
            .iter()
            .position(|c| c.kind != kind || c.tier != tier)
            .map_or(changes.len(), |n| start + n);
        let hashes = changes[start..end]
            .iter()
            .map(|c| EngineHash(c.hash))
            .collect();
        events.push(event(kind, tier, hashes));
        start = end;
    }
}

fn event(kind: ChangeKind, tier: Tier, block_hashes: Vec<EngineHash>) -> EngineEvent {
    match kind {
        ChangeKind::Stored => stored_event(tier, block_hashes),
        ChangeKind::Removed => removed_event(tier, block_hashes),
    }
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
