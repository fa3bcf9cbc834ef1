//! Active health checks: liveness apart from request deadlines.
//!
//! A wedged engine (a hung GPU, a deadlocked scheduler) accepts connections and never answers.
//! Nothing fails, so neither the breaker nor failover notices, and a first-byte deadline short
//! enough to catch it would cut legitimate long prefills. So the server probes every worker on
//! its own: each [`HealthConfig::interval`] it asks the transport to probe each registered
//! worker ([`RequestTransport::probe`]: the engine's `/health`, over HTTP or through the NATS
//! worker), within
//! [`HealthConfig::timeout`]. After [`HealthConfig::unhealthy_threshold`] consecutive failures
//! the worker leaves routing (its ranks are excluded like an open breaker's); after
//! [`HealthConfig::healthy_threshold`] consecutive passes it returns. At the defaults (2 s, 2 s,
//! 3) a wedged engine leaves routing within about 8 s of the fault.
//!
//! Requests already on a worker that leaves routing do not wait for their deadlines: each
//! attempt races its worker's [`Health::watch`]. Before the first byte the attempt fails
//! as a timeout and is retried elsewhere (within `--request-max-retries`); a stream that
//! already started ends with a timeout error, which migrates it where `--migration-limit`
//! allows and otherwise ends it with an error event. The dropped reply cancels the engine's
//! work. A prefill/decode pair races both of its workers the same way.
//!
//! An engine can also answer its `/health` while its scheduler makes no progress (a stuck
//! collective, a scheduler loop that stopped stepping). The engines' own counters cannot tell
//! that from a long prefill: vLLM counts a prompt's tokens only when its prefill completes
//! (`vllm/v1/metrics/stats.py`, `IterationStats.update_from_output`), so a lone 128k-token
//! prefill shows flat counters for as long as it runs. A stream past its first byte can: a
//! decoding request yields tokens every engine step. So each worker's streams count their
//! chunks as they are relayed ([`Progress`]), and a round that finds a worker with streams
//! past their first byte whose chunk count has not moved for [`HealthConfig::stall_timeout`]
//! fails its probe, whatever `/health` answered (`infera_health_check_stalls_total`). At the
//! defaults (6 s) such a worker leaves routing within about 12 s.
//!
//! A worker no longer registered is forgotten at the next round. A transport that cannot probe
//! (NATS in JetStream mode) reports every worker healthy.
//!
//! [`RequestTransport::probe`]: crate::ports::transport::RequestTransport::probe

use super::Service;
use crate::ids::WorkerId;
use crate::ports::transport::{BodyStream, TransportError};
use futures::StreamExt as _;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::watch;

/// How workers are probed. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Between the starts of two rounds of probes.
    pub interval: Duration,
    /// The longest one probe may take.
    pub timeout: Duration,
    /// Consecutive failed probes that take a worker out of routing; 0 turns the checks off.
    pub unhealthy_threshold: u32,
    /// Consecutive passed probes that bring it back.
    pub healthy_threshold: u32,
    /// The most of a model's workers kept out of routing at once, by their health checks and
    /// their circuit breakers together, in percent (at least one worker): past it, the
    /// workers ejected last are routed again, so a fleet-wide slowdown never ejects everyone.
    pub max_ejection_percent: u32,
    /// How long a worker's streams past their first byte may all go without a chunk before
    /// its probes fail ([`Duration::ZERO`]: never).
    pub stall_timeout: Duration,
}

impl Default for HealthConfig {
    /// 2 s, 2 s, 3 failures, 2 passes: a wedged engine is out within about 8 s; at most half a
    /// model's workers out at once; streams flat for 6 s fail the probes (out within about
    /// 12 s of the stall).
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(2),
            unhealthy_threshold: 3,
            healthy_threshold: 2,
            max_ejection_percent: 50,
            stall_timeout: Duration::from_secs(6),
        }
    }
}

/// A worker's streams past their first byte, and the chunks relayed from them: the relay
/// counts, the health checks read (see the module docs).
#[derive(Debug, Default)]
pub struct Progress {
    streams: AtomicU32,
    chunks: AtomicU64,
}

/// The last reading of a worker's [`Progress`].
#[derive(Debug, Default)]
struct Seen {
    chunks: u64,
    /// Since when its streams have relayed nothing.
    flat_since: Option<tokio::time::Instant>,
}

/// A worker's probe record.
#[derive(Debug)]
struct Entry {
    failures: u32,
    passes: u32,
    /// Whether the worker is out of routing; watched by its requests in flight.
    out: watch::Sender<bool>,
    progress: Arc<Progress>,
    seen: Seen,
}

impl Default for Entry {
    fn default() -> Self {
        Self {
            failures: 0,
            passes: 0,
            out: watch::Sender::new(false),
            progress: Arc::default(),
            seen: Seen::default(),
        }
    }
}

/// What a probe's outcome changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    Left,
    Returned,
}

/// Every worker's probe record. See the module docs.
#[derive(Debug, Default)]
pub struct Health {
    config: Mutex<HealthConfig>,
    workers: Mutex<HashMap<WorkerId, Entry>>,
    /// How many are out: every decision asks, and almost always none is.
    out_count: AtomicUsize,
}

impl Health {
    fn workers(&self) -> MutexGuard<'_, HashMap<WorkerId, Entry>> {
        self.workers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn config(&self) -> HealthConfig {
        *self.config.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn set_config(&self, config: HealthConfig) {
        *self.config.lock().unwrap_or_else(PoisonError::into_inner) = config;
    }

    /// Records one probe of `worker`; says whether it left or returned to routing.
    pub(crate) fn record(&self, worker: &WorkerId, passed: bool) -> Option<Change> {
        let config = self.config();
        let mut workers = self.workers();
        let entry = workers.entry(worker.clone()).or_default();
        let out = *entry.out.borrow();
        if passed {
            entry.failures = 0;
            entry.passes = entry.passes.saturating_add(1);
            if out && entry.passes >= config.healthy_threshold.max(1) {
                entry.out.send_replace(false);
                self.out_count.fetch_sub(1, Ordering::Relaxed);
                return Some(Change::Returned);
            }
        } else {
            entry.passes = 0;
            entry.failures = entry.failures.saturating_add(1);
            if !out
                && config.unhealthy_threshold > 0
                && entry.failures >= config.unhealthy_threshold
            {
                entry.out.send_replace(true);
                self.out_count.fetch_add(1, Ordering::Relaxed);
                return Some(Change::Left);
            }
        }
        None
    }

    /// Whether `worker` holds streams past their first byte that have relayed nothing for the
    /// stall timeout, read at `now` (each round reads once).
    pub(crate) fn stalled(&self, worker: &WorkerId, now: tokio::time::Instant) -> bool {
        let timeout = self.config().stall_timeout;
        let mut workers = self.workers();
        let entry = workers.entry(worker.clone()).or_default();
        let chunks = entry.progress.chunks.load(Ordering::Relaxed);
        let streams = entry.progress.streams.load(Ordering::Relaxed);
        let seen = &mut entry.seen;
        if timeout.is_zero() || streams == 0 || chunks != seen.chunks {
            seen.chunks = chunks;
            seen.flat_since = None;
            return false;
        }
        now.duration_since(*seen.flat_since.get_or_insert(now)) >= timeout
    }

    /// The workers out of routing now.
    pub(crate) fn out(&self) -> Vec<WorkerId> {
        if self.out_count.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        self.workers()
            .iter()
            .filter(|(_, e)| *e.out.borrow())
            .map(|(w, _)| w.clone())
            .collect()
    }

    /// Forgets the workers for which `registered` is false and that nothing holds: a worker
    /// whose requests still watch it or whose streams still count on it is kept, so one that
    /// registers again (its lease lost and renewed) keeps its watchers and its progress.
    pub(crate) fn retain(&self, registered: impl Fn(&WorkerId) -> bool) {
        let mut workers = self.workers();
        workers.retain(|w, e| {
            registered(w) || e.out.receiver_count() > 0 || Arc::strong_count(&e.progress) > 1
        });
        let out = workers.values().filter(|e| *e.out.borrow()).count();
        self.out_count.store(out, Ordering::Relaxed);
    }

    /// What an attempt on `worker` watches, from one lookup: a future that resolves when the
    /// worker leaves routing (at once if it is out), and the progress its stream counts on
    /// (see [`guard_body`]). While the checks are off the future never resolves and the
    /// progress counts for no one: neither is kept, since no round would forget them.
    pub fn watch(&self, worker: &WorkerId) -> (impl Future<Output = ()> + use<>, Arc<Progress>) {
        let kept = (self.config().unhealthy_threshold > 0).then(|| {
            let mut workers = self.workers();
            let held = |e: &Entry| (e.out.subscribe(), Arc::clone(&e.progress));
            match workers.get(worker) {
                Some(entry) => held(entry),
                None => held(workers.entry(worker.clone()).or_default()),
            }
        });
        let (rx, progress) = match kept {
            Some((rx, progress)) => (Some(rx), progress),
            None => (None, Arc::default()),
        };
        let left = async move {
            let left = match rx {
                Some(mut rx) => rx.wait_for(|out| *out).await.is_ok(),
                None => false,
            };
            if !left {
                std::future::pending::<()>().await;
            }
        };
        (left, progress)
    }
}

/// The error of a request whose worker left routing.
pub(crate) fn left_error(worker: &WorkerId) -> TransportError {
    TransportError::Timeout(format!(
        "worker {} failed its health checks (no answer, or no progress on its streams) and \
         left routing",
        worker.as_str()
    ))
}

/// `body`, ended with [`left_error`] when `left` resolves first, with the worker that left
/// routing; its chunks counted on `progress` (its streaming worker's) from the first.
pub fn guard_body(
    body: BodyStream,
    left: impl Future<Output = WorkerId> + Send + 'static,
    progress: Arc<Progress>,
) -> BodyStream {
    Guarded {
        body,
        left: Some(Box::pin(left)),
        progress,
        streaming: false,
    }
    .boxed()
}

/// See [`guard_body`]. Written out: as `unfold` and `select!` it cost 71 ns a chunk, this 31.
struct Guarded {
    body: BodyStream,
    /// `None` once a worker left: the stream has ended.
    left: Option<std::pin::Pin<Box<dyn Future<Output = WorkerId> + Send>>>,
    progress: Arc<Progress>,
    /// Counted in `progress.streams`: past its first chunk, not ended.
    streaming: bool,
}

impl Guarded {
    fn stop_streaming(&mut self) {
        if std::mem::take(&mut self.streaming) {
            self.progress.streams.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.stop_streaming();
    }
}

impl futures::Stream for Guarded {
    type Item = Result<bytes::Bytes, TransportError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let Some(left) = self.left.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(worker) = left.as_mut().poll(cx) {
            self.left = None;
            self.stop_streaming();
            return Poll::Ready(Some(Err(left_error(&worker))));
        }
        let next = self.body.poll_next_unpin(cx);
        match &next {
            Poll::Ready(Some(Ok(_))) => {
                if !self.streaming {
                    self.streaming = true;
                    self.progress.streams.fetch_add(1, Ordering::Relaxed);
                }
                self.progress.chunks.fetch_add(1, Ordering::Relaxed);
            }
            Poll::Ready(_) => self.stop_streaming(),
            Poll::Pending => {}
        }
        next
    }
}

impl Service {
    /// Sets how workers are probed (see [`HealthConfig`]); takes effect at the next round.
    pub fn set_health(&self, config: HealthConfig) {
        self.inner.health.set_config(config);
    }

    /// Probes every registered worker once, concurrently, and takes the ones that failed
    /// their threshold out of routing (see the module docs).
    pub async fn check_health(&self) {
        let config = self.inner.health.config();
        let workers: Vec<_> = self.with_fleet(|f| f.workers().cloned().collect());
        let registered: std::collections::HashSet<&WorkerId> =
            workers.iter().map(|r| &r.worker_id).collect();
        self.inner.health.retain(|w| registered.contains(w));
        let transport = &self.inner.transport;
        let probes = workers.iter().map(|record| async move {
            let passed = match tokio::time::timeout(config.timeout, transport.probe(record)).await {
                Ok(Ok(())) => true,
                Ok(Err(e)) => {
                    tracing::debug!(worker = %record.worker_id.as_str(), error = %e,
                        "health probe failed");
                    false
                }
                Err(_) => false,
            };
            (record.worker_id.clone(), passed)
        });
        let now = tokio::time::Instant::now();
        for (worker, answered) in futures::future::join_all(probes).await {
            let stalled = self.inner.health.stalled(&worker, now);
            if stalled {
                tracing::debug!(worker = %worker.as_str(), after = ?config.stall_timeout,
                    "health probe failed: the worker's streams make no progress");
                self.inner.metrics.health_stalls.inc();
            }
            match self.inner.health.record(&worker, answered && !stalled) {
                Some(Change::Left) => {
                    tracing::warn!(worker = %worker.as_str(),
                        failures = config.unhealthy_threshold, timeout = ?config.timeout,
                        "worker failed its health checks: out of routing, its requests fail over");
                    self.inner.metrics.health_ejections.inc();
                }
                Some(Change::Returned) => {
                    tracing::info!(worker = %worker.as_str(),
                        "worker passes its health checks again: back in routing");
                }
                None => {}
            }
        }
    }

    /// Runs the health checks and outlier detection (see [`super::outlier`]) until dropped.
    pub async fn run_ejection(&self) {
        tokio::join!(self.run_health_checks(), self.run_outlier_detection());
    }

    /// Probes the fleet every [`HealthConfig::interval`] until dropped (a probe round that
    /// overruns delays the next one; none overlap). Returns at once when the checks are off.
    async fn run_health_checks(&self) {
        let config = self.inner.health.config();
        if config.unhealthy_threshold == 0 {
            return;
        }
        let mut tick = tokio::time::interval(config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.check_health().await;
        }
    }
}

#[cfg(test)]
mod tests;
