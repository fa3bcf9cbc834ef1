//! Taps on the committed event stream.
//!
//! A tap ([`Service::tap`]) receives every event committed after it was opened, in log
//! order, as the batches they were committed in. It exists for consumers that live outside the
//! router's lock — the trace recorder, a durable event log — and it never slows the request path
//! down: each tap is a bounded queue filled with `try_send` under the core lock; a batch that
//! does not fit is dropped and counted (`infera_event_tap_dropped_events_total{tap="…"}`),
//! never waited for. [`Service::close_taps`] ends every tap's stream (at shutdown, once no
//! request can commit anymore), so consumers can flush.

use super::{Plane, Service};
use crate::event::Envelope;
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;
use tokio::sync::mpsc;

/// A batch of committed events, shared by every tap.
pub type EventBatch = Arc<[Envelope]>;

/// What the events do not say about a request, for the trace recorder: its session (header
/// `x-session-id` or body field `session_id`) and, when asked for, its prompt's token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestMeta {
    /// The request's key (`<client id>#<n>`, see `RequestId`; its attempt ids share it).
    pub request_id: String,
    pub session_id: Option<String>,
    /// Only with [`Service::tap_request_meta`]'s `tokens`, and only for tokenized requests.
    pub token_ids: Option<Vec<u32>>,
    /// For a request naming a LoRA adapter: the adapter and its base model.
    pub adapter: Option<(String, String)>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// The prompt's images, as the router keyed them.
    pub images: Vec<crate::hashing::identity::MmRun>,
    /// The priority the request asked for (its body's `priority` or `x-infera-priority`),
    /// before its tenant's floor.
    pub priority: Option<i32>,
}

/// Hands `f` every event queued on a tap's receiving end, in order, without waiting. Returns
/// whether the tap is closed ([`Service::close_taps`]): nothing more will come.
pub fn drain_tap(rx: &mut mpsc::Receiver<EventBatch>, mut f: impl FnMut(&Envelope)) -> bool {
    loop {
        match rx.try_recv() {
            Ok(batch) => batch.iter().for_each(&mut f),
            Err(mpsc::error::TryRecvError::Empty) => return false,
            Err(mpsc::error::TryRecvError::Disconnected) => return true,
        }
    }
}

/// The open request-metadata tap.
#[derive(Debug)]
pub(crate) struct MetaTap {
    tx: mpsc::Sender<RequestMeta>,
    pub(crate) tokens: bool,
    counters: TapCounters,
}

/// One open tap, as the core sees it.
#[derive(Debug)]
pub(crate) struct Tap {
    name: &'static str,
    tx: mpsc::Sender<EventBatch>,
    counters: TapCounters,
}

/// A tap's counters: `infera_event_tap_{delivered,dropped}_events_total{tap="…"}`.
#[derive(Debug, Clone)]
pub(crate) struct TapCounters {
    delivered: Counter,
    dropped: Counter,
}

impl TapCounters {
    fn new(st: &Service, name: &'static str) -> Self {
        let label = [("tap", name)];
        let m = &st.inner.metrics;
        TapCounters {
            delivered: m.tap_delivered.get_or_create_owned(&label),
            dropped: m.tap_dropped.get_or_create_owned(&label),
        }
    }
}

impl Plane {
    /// Offers a committed batch to every tap, without waiting. The batch is moved into one
    /// shared allocation, never copied per tap or per event.
    pub(crate) fn feed_taps(&mut self, batch: Vec<Envelope>) {
        if self.taps.is_empty() || batch.is_empty() {
            return;
        }
        let n = batch.len() as u64;
        let shared: EventBatch = Arc::from(batch);
        self.taps
            .retain(|tap| match tap.tx.try_send(shared.clone()) {
                Ok(()) => {
                    tap.counters.delivered.inc_by(n);
                    true
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    let before = tap.counters.dropped.inc_by(n);
                    // Log the first loss, then about every 64k events lost.
                    if before == 0 || before >> 16 != (before + n) >> 16 {
                        tracing::warn!(
                            tap = tap.name,
                            dropped_total = before + n,
                            "event tap full: its consumer is behind, events dropped for it"
                        );
                    }
                    true
                }
                // The consumer went away: stop offering it anything.
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    tracing::error!(
                        tap = tap.name,
                        "event tap consumer stopped; it gets no more events"
                    );
                    false
                }
            });
    }
}

impl Service {
    /// Opens a tap named `name` (a Prometheus label value) holding up to `capacity` batches.
    /// See the module docs.
    pub fn tap(&self, name: &'static str, capacity: usize) -> mpsc::Receiver<EventBatch> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let counters = TapCounters::new(self, name);
        self.lock().taps.push(Tap { name, tx, counters });
        rx
    }

    /// Opens the request-metadata tap (one per server; a second call replaces the first), with
    /// prompt token ids when `tokens`. Same rules as [`Service::tap`]: never waited for,
    /// drops counted under `tap="request-meta"`.
    pub fn tap_request_meta(&self, capacity: usize, tokens: bool) -> mpsc::Receiver<RequestMeta> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let counters = TapCounters::new(self, "request-meta");
        *self.meta_tap() = Some(MetaTap {
            tx,
            tokens,
            counters,
        });
        rx
    }

    fn meta_tap(&self) -> std::sync::MutexGuard<'_, Option<MetaTap>> {
        self.inner
            .meta_tap
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a metadata tap wants token ids.
    pub fn meta_wants_tokens(&self) -> Option<bool> {
        self.meta_tap().as_ref().map(|t| t.tokens)
    }

    /// Offers one request's metadata to the metadata tap, without waiting.
    pub fn feed_meta(&self, meta: RequestMeta) {
        let mut slot = self.meta_tap();
        let Some(tap) = slot.as_ref() else { return };
        match tap.tx.try_send(meta) {
            Ok(()) => {
                tap.counters.delivered.inc();
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                tap.counters.dropped.inc();
            }
            Err(mpsc::error::TrySendError::Closed(_)) => *slot = None,
        }
    }

    /// Ends every tap's stream; later commits reach no tap.
    pub fn close_taps(&self) {
        *self.meta_tap() = None;
        let closed = std::mem::take(&mut self.lock().taps);
        for tap in closed {
            tracing::debug!(tap = tap.name, "event tap closed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Event;
    use crate::ids::WorkerId;
    use crate::service::test_support::{record, state};

    #[tokio::test]
    async fn taps_see_commits_in_order_drop_when_full_and_end_when_closed() {
        let st = state();
        st.register_worker(record("before"));
        let mut roomy = st.tap("roomy", 16);
        let mut tight = st.tap("tight", 1);
        for i in 0..3 {
            st.register_worker(record(&format!("w{i}")));
        }
        st.deregister_worker(WorkerId::new("w0"), "gone".into());
        let mut seen = Vec::new();
        st.close_taps();
        while let Some(batch) = roomy.recv().await {
            seen.extend(batch.iter().map(|e| (e.seq, e.event.clone())));
        }
        assert_eq!(seen.len(), 4, "only commits after the tap opened: {seen:?}");
        assert!(seen.windows(2).all(|w| w[0].0 + 1 == w[1].0), "log order");
        assert!(matches!(&seen[3].1, Event::WorkerDeregistered(d) if d.worker.as_str() == "w0"));
        // The tight tap kept the first batch and counted the rest as dropped.
        assert_eq!(tight.recv().await.map(|b| b.len()), Some(1));
        assert!(tight.recv().await.is_none());
        st.register_worker(record("after-close"));

        let added = Counter::<u64>::default();
        added.inc_by(7);
        st.register_metrics(|r| r.register("x", "A family a component added", added));
        let text = st.render_metrics();
        assert!(
            text.contains("infera_event_tap_delivered_events_total{tap=\"roomy\"} 4"),
            "{text}"
        );
        assert!(
            text.contains("infera_event_tap_dropped_events_total{tap=\"tight\"} 3"),
            "{text}"
        );
        assert!(text.contains("\nx_total 7\n"), "{text}");
    }

    #[tokio::test]
    async fn draining_takes_what_is_queued_and_says_when_the_tap_closed() {
        let st = state();
        let mut rx = st.tap("drained", 16);
        st.register_worker(record("a"));
        st.register_worker(record("b"));
        let mut seen = Vec::new();
        assert!(!drain_tap(&mut rx, |e| seen.push(e.seq)));
        assert_eq!(seen.len(), 2);
        assert!(seen[0] < seen[1]);
        assert!(
            !drain_tap(&mut rx, |e| seen.push(e.seq)),
            "nothing new, still open"
        );
        st.register_worker(record("c"));
        st.close_taps();
        assert!(drain_tap(&mut rx, |e| seen.push(e.seq)));
        assert_eq!(
            seen.len(),
            3,
            "what was queued before the close still comes"
        );
    }

    #[tokio::test]
    async fn a_consumer_that_went_away_is_no_longer_fed() {
        let st = state();
        let gone = st.tap("gone", 4);
        drop(gone);
        st.register_worker(record("w"));
        assert!(st.lock().taps.is_empty());
        assert_eq!(st.worker_count(), 1, "commits go on without it");
    }
}
