//! The tail: following the durable log for the peers' requests, and noticing when it stops.
//!
//! A replica cut off from the log enforces its share of each tenant's limits (see the
//! `tenants` module). The tail notices in two ways: its subscription fails, or it goes silent.
//! Silence alone says nothing (the peers may be idle), so the tail watches for this replica's
//! own appends: every event the write-behind appends comes back on the subscription, and when
//! the oldest one not back yet was appended [`STALL`] ago, the tail is stalled. It then counts
//! as cut off, and resubscribes. A replica that appends nothing serves no requests, and its
//! share does not matter.

use super::{Counters, PEERS_SEEN_US, REPLICA_PREFIX, is_request};
use crate::server::ServerState;
use futures::StreamExt as _;
use infera_core::log::{EventLog, LogError, NewEvent};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long this replica's own append may take to come back on its tail.
pub(super) const STALL: Duration = Duration::from_secs(10);
/// How often the tail checks.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The oldest append of this replica that its tail has not delivered back yet: its sequence
/// number and when it was appended.
#[derive(Debug, Default)]
pub(super) struct OwnTip {
    pending: Mutex<Option<(u64, Instant)>>,
}

impl OwnTip {
    /// The write-behind appended events up to `seq`.
    pub(super) fn appended(&self, seq: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if pending.is_none() {
            *pending = Some((seq, Instant::now()));
        }
    }

    /// Whether the tail, next to read `next`, has stalled; forgets what it has delivered, and
    /// restarts the clock of a stall it reports.
    fn stalled(&self, next: u64) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        match *pending {
            Some((seq, _)) if next > seq => {
                *pending = None;
                false
            }
            Some((seq, at)) if at.elapsed() >= STALL => {
                *pending = Some((seq, Instant::now()));
                true
            }
            _ => false,
        }
    }
}

/// Why the tail stopped reading a subscription.
enum Broke {
    /// It failed or stalled: cut off.
    CutOff,
    /// It ended, or skipped past a compaction.
    Resubscribe,
}

pub(super) async fn follow_peers(
    state: ServerState,
    log: Arc<dyn EventLog>,
    mut next: u64,
    counters: Arc<Counters>,
    own: Arc<OwnTip>,
    stop: CancellationToken,
) {
    let me = state.replica_id();
    let keys = state.inner.options.client.api_keys.clone();
    let mut charges = crate::server::tenants::PeerCharges::default();
    // Peer replicas by when their last request event was seen (µs), for the limits' share.
    let mut peers: HashMap<String, u64> = HashMap::new();
    let mut backoff = Duration::from_millis(50);
    let mut check = tokio::time::interval(CHECK_EVERY);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut stream = log.subscribe(next);
        let broke = loop {
            let item = tokio::select! {
                () = stop.cancelled() => return,
                _ = check.tick() => {
                    if own.stalled(next) {
                        tracing::warn!(from = next, stall = ?STALL,
                            "the durable event log's tail has not delivered this replica's own \
                             events; resubscribing");
                        break Broke::CutOff;
                    }
                    continue;
                }
                item = stream.next() => item,
            };
            match item {
                Some(Ok(env)) => {
                    backoff = Duration::from_millis(50);
                    next = env.seq + 1;
                    let peer = env
                        .source
                        .as_ref()
                        .filter(|s| s.worker.as_str().starts_with(REPLICA_PREFIX))
                        .filter(|s| s.worker.as_str() != me);
                    if let Some(source) = peer
                        && is_request(&env.event)
                    {
                        counters.peer_events.inc();
                        if let Some(keys) = &keys {
                            let now = state.service().clock().now_us();
                            keys.set_share(1);
                            counters.limit_share.set(1);
                            peers.insert(source.worker.as_str().to_owned(), now);
                            keys.charge_peer(&mut charges, &env.event, now);
                        }
                        state
                            .service()
                            .apply(vec![NewEvent::from_source(source.clone(), env.event)]);
                    }
                }
                Some(Err(LogError::Compacted { upto })) => {
                    tracing::warn!(
                        from = next,
                        upto,
                        "the durable log was compacted past the peers' events not yet seen; skipping them"
                    );
                    next = upto + 1;
                    break Broke::Resubscribe;
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, ?backoff, "following the durable event log failed; resubscribing");
                    break Broke::CutOff;
                }
                None => break Broke::Resubscribe,
            }
        };
        if let (Broke::CutOff, Some(keys)) = (broke, &keys) {
            // Cut off: keep to this replica's share among those seen lately.
            let now = state.service().clock().now_us();
            peers.retain(|_, at| now.saturating_sub(*at) < PEERS_SEEN_US);
            let replicas = u32::try_from(peers.len() + 1).unwrap_or(u32::MAX);
            keys.set_share(replicas);
            counters.limit_share.set(i64::from(replicas));
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
