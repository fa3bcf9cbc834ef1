//! The per-worker circuit breaker (`--breaker-failure-threshold`, `--breaker-cooldown-s`,
//! `--breaker-max-cooldown-s`, with the Python Infera's defaults and semantics).
//!
//! Failover forgets a failed worker when the request ends; the breaker remembers it, so a worker
//! that is registered but broken for inference (it accepts, then hangs or answers 5xx) is not
//! picked again by the next request, nor by round-robin.
//!
//! # What counts
//! Only an attempt's outcome *before the first response byte* (mid-stream failures say the
//! worker served part of the request, and would trip on ordinary client disconnects):
//! - a failure: unreachable, a timeout (connect or first byte), a broken or lost reply, a 5xx;
//! - neutral: a 4xx (every worker would answer the same bad request alike) and a 429 (load,
//!   which the policy already routes around) — it only frees a half-open probe slot;
//! - a success: any other answer (2xx, 3xx).
//!
//! # States
//! `closed` routes normally. After `failure_threshold` consecutive failures it goes `open`: the
//! worker's ranks are added to the request's exclusions (the router's own failover mechanism,
//! so every policy honours it) for the cooldown. Then it is `half_open`: one probe at a time is
//! let through (the slot is claimed when the router picks the worker, and freed by the probe's
//! outcome, or after [`PROBE_TIMEOUT`] when none came). A successful probe closes it and resets
//! the cooldown; a failed one reopens it with the cooldown doubled, up to `max_cooldown`. When
//! every candidate is excluded by the breaker, the request is routed as if none were (a probably
//! bad worker beats a 503). A threshold of 0 turns the breaker off.
//!
//! Time is the server's [`Clock`], so tests drive cooldowns with a virtual one. Entries of
//! workers no longer registered are dropped when the router next looks.

use super::metrics::{Metrics, inc};
use crate::clock::{Clock, Micros, SystemClock};
use crate::ids::{WorkerId, WorkerRank};
use crate::ports::transport::TransportError;
use http::StatusCode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// How long a claimed half-open probe slot is honoured without an outcome (a client that went
/// away before the head leaves none).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(60);

/// The breaker's settings. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker; 0 turns it off.
    pub failure_threshold: u32,
    /// How long the first trip excludes a worker.
    pub cooldown: Duration,
    /// The ceiling of the cooldown, which doubles on each failed probe.
    pub max_cooldown: Duration,
}

impl Default for BreakerConfig {
    /// The Python Infera's defaults: 3 failures, 5 s, 60 s.
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            cooldown: Duration::from_secs(5),
            max_cooldown: Duration::from_secs(60),
        }
    }
}

/// One worker's breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Routed normally.
    Closed,
    /// Excluded until its cooldown ends.
    Open,
    /// Admitting one probe at a time.
    HalfOpen,
}

impl BreakerState {
    /// Its name in `/v1/workers`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// What one attempt said about its worker. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Success,
    Neutral,
    Failure,
}

#[derive(Debug)]
struct Entry {
    failures: u32,
    state: BreakerState,
    open_until: Micros,
    next_cooldown: Duration,
    probe_since: Option<Micros>,
}

#[derive(Debug)]
struct State {
    config: BreakerConfig,
    clock: Arc<dyn Clock>,
    entries: HashMap<WorkerId, Entry>,
}

/// The breakers of every worker. See the module docs.
#[derive(Debug)]
pub(crate) struct Breaker {
    state: Mutex<State>,
}

impl Default for Breaker {
    fn default() -> Self {
        Self::new(BreakerConfig::default(), Arc::new(SystemClock))
    }
}

fn us(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Breaker {
    pub(crate) fn new(config: BreakerConfig, clock: Arc<dyn Clock>) -> Self {
        Self {
            state: Mutex::new(State {
                config,
                clock,
                entries: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the settings and the clock; forgets every worker.
    pub(crate) fn configure(&self, config: BreakerConfig, clock: Arc<dyn Clock>) {
        *self.lock() = State {
            config,
            clock,
            entries: HashMap::new(),
        };
    }

    /// The workers not to route to now. An open breaker whose cooldown ended becomes half-open;
    /// the entries of workers `registered` denies are dropped.
    pub(crate) fn blocked(
        &self,
        registered: impl Fn(&WorkerId) -> bool,
        metrics: &Metrics,
    ) -> Vec<WorkerId> {
        let mut st = self.lock();
        if st.entries.is_empty() {
            return Vec::new();
        }
        let now = st.clock.now_us();
        st.entries.retain(|w, _| registered(w));
        let mut out = Vec::new();
        for (worker, e) in &mut st.entries {
            if e.state == BreakerState::Open && now >= e.open_until {
                e.state = BreakerState::HalfOpen;
                e.probe_since = None;
                tracing::info!(
                    worker = worker.as_str(),
                    "breaker half-open: admitting one probe"
                );
            }
            let probing = e
                .probe_since
                .is_some_and(|t| now.saturating_sub(t) < us(PROBE_TIMEOUT));
            match e.state {
                BreakerState::Open => out.push(worker.clone()),
                BreakerState::HalfOpen if probing => out.push(worker.clone()),
                _ => {}
            }
        }
        gauges(&st, metrics);
        out
    }

    /// The router picked `worker`: a half-open breaker's probe slot is taken.
    pub(crate) fn picked(&self, worker: &WorkerId) {
        let mut st = self.lock();
        let now = st.clock.now_us();
        if let Some(e) = st.entries.get_mut(worker)
            && e.state == BreakerState::HalfOpen
        {
            e.probe_since = Some(now);
        }
    }

    /// Records an attempt's outcome on `worker` (before its first response byte).
    pub(crate) fn record(&self, worker: &WorkerId, outcome: Outcome, metrics: &Metrics) {
        let mut st = self.lock();
        if st.config.failure_threshold == 0 {
            return;
        }
        let (now, config) = (st.clock.now_us(), st.config);
        match outcome {
            Outcome::Neutral => {
                if let Some(e) = st.entries.get_mut(worker) {
                    e.probe_since = None;
                }
            }
            Outcome::Success => {
                if let Some(e) = st.entries.remove(worker)
                    && e.state != BreakerState::Closed
                {
                    tracing::info!(
                        worker = worker.as_str(),
                        "breaker closed: the worker recovered"
                    );
                }
            }
            Outcome::Failure => {
                let e = st.entries.entry(worker.clone()).or_insert(Entry {
                    failures: 0,
                    state: BreakerState::Closed,
                    open_until: 0,
                    next_cooldown: config.cooldown,
                    probe_since: None,
                });
                e.failures = e.failures.saturating_add(1);
                e.probe_since = None;
                let was = e.state;
                if was == BreakerState::HalfOpen {
                    e.next_cooldown = e.next_cooldown.saturating_mul(2).min(config.max_cooldown);
                } else if was == BreakerState::Closed && e.failures < config.failure_threshold {
                    return;
                }
                e.state = BreakerState::Open;
                e.open_until = now.saturating_add(us(e.next_cooldown));
                // A failure while already open (the all-open fallback) extends it, no new trip.
                if was != BreakerState::Open {
                    inc(&metrics.breaker_trips, 1);
                    metrics
                        .worker_breaker_trips
                        .get_or_create(&[("worker_id", worker.as_str().to_owned())])
                        .inc();
                    tracing::warn!(
                        worker = worker.as_str(),
                        failures = e.failures,
                        cooldown_s = e.next_cooldown.as_secs_f64(),
                        "breaker open: worker taken out of routing"
                    );
                }
            }
        }
        gauges(&st, metrics);
    }

    /// The breaker state of `worker` (as of its last transition).
    pub(crate) fn state_of(&self, worker: &WorkerId) -> BreakerState {
        self.lock()
            .entries
            .get(worker)
            .map_or(BreakerState::Closed, |e| e.state)
    }
}

/// What a transport error before the first byte says about the worker: a 429 is load
/// (neutral), anything else a failure.
pub(crate) fn breaker_outcome(e: &TransportError) -> Outcome {
    match e {
        TransportError::Overloaded { .. } => Outcome::Neutral,
        _ => Outcome::Failure,
    }
}

/// What a worker's answer says about it: 5xx a failure, 4xx neutral, anything else a success.
pub(crate) fn answer_outcome(status: StatusCode) -> Outcome {
    if status.is_server_error() {
        Outcome::Failure
    } else if status.is_client_error() {
        Outcome::Neutral
    } else {
        Outcome::Success
    }
}

/// One attempt's workers as the breaker sees them: their probe slots are taken when it starts,
/// and given back by its outcome ([`Judge::record`]), or neutrally when it is dropped without
/// one (the client went away first).
#[derive(Debug)]
pub(crate) struct Judge<'a> {
    st: &'a super::Service,
    /// The attempt's workers (both legs of a PD pair); none under `--router-mode direct`.
    workers: Vec<WorkerId>,
    done: bool,
}

impl<'a> Judge<'a> {
    pub(crate) fn new(st: &'a super::Service, workers: Vec<WorkerId>) -> Self {
        for w in &workers {
            st.inner.breaker.picked(w);
        }
        Self {
            st,
            workers,
            done: false,
        }
    }

    /// Records `outcome` for the worker of `rank`, with the breaker and as an outlier sample;
    /// the attempt's other worker (a PD pair's) gets a success when this is one, else only its
    /// probe slot back.
    pub(crate) fn record(mut self, rank: &WorkerRank, outcome: Outcome) {
        self.done = true;
        let inner = &self.st.inner;
        let now = (!self.workers.is_empty()).then(|| inner.clock.now_us());
        for w in &self.workers {
            let o = if *w == rank.worker || outcome == Outcome::Success {
                outcome
            } else {
                Outcome::Neutral
            };
            inner.breaker.record(w, o, &inner.metrics);
            if let Some(now) = now
                && o != Outcome::Neutral
            {
                inner.outliers.outcome(w, o == Outcome::Failure, now);
            }
        }
    }

    /// Gives every worker its probe slot back, judging none.
    pub(crate) fn release(self) {}
}

impl Drop for Judge<'_> {
    fn drop(&mut self) {
        if !self.done {
            for w in &self.workers {
                let inner = &self.st.inner;
                inner.breaker.record(w, Outcome::Neutral, &inner.metrics);
            }
        }
    }
}

impl super::Service {
    /// Sets the circuit breaker's settings (`--breaker-*`) and the clock its cooldowns run on;
    /// forgets every worker's failures. A server starts with [`BreakerConfig::default`].
    pub fn set_breaker(&self, config: BreakerConfig, clock: Arc<dyn Clock>) {
        self.inner.breaker.configure(config, clock);
    }

    /// The breaker state of `worker`, as of its last transition (an open breaker whose
    /// cooldown ended turns half-open when the router next decides).
    pub fn breaker_state(&self, worker: &WorkerId) -> BreakerState {
        self.inner.breaker.state_of(worker)
    }
}

/// Sets the gauges of open and half-open breakers.
fn gauges(st: &State, metrics: &Metrics) {
    let count = |s| st.entries.values().filter(|e| e.state == s).count() as i64;
    metrics.breaker_open.set(count(BreakerState::Open));
    metrics.breaker_half_open.set(count(BreakerState::HalfOpen));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::VirtualClock;

    const S: Micros = 1_000_000;

    fn setup() -> (Breaker, Arc<VirtualClock>, Metrics) {
        let clock = Arc::new(VirtualClock::new(1_000 * S));
        let breaker = Breaker::new(BreakerConfig::default(), clock.clone());
        (breaker, clock, Metrics::default())
    }

    fn blocked(b: &Breaker, m: &Metrics) -> Vec<WorkerId> {
        b.blocked(|_| true, m)
    }

    #[test]
    fn three_consecutive_failures_open_and_a_success_in_between_resets() {
        let (b, _, m) = setup();
        let w = WorkerId::new("w:1");
        b.record(&w, Outcome::Failure, &m);
        b.record(&w, Outcome::Failure, &m);
        b.record(&w, Outcome::Success, &m);
        b.record(&w, Outcome::Failure, &m);
        b.record(&w, Outcome::Neutral, &m);
        b.record(&w, Outcome::Failure, &m);
        assert!(blocked(&b, &m).is_empty());
        b.record(&w, Outcome::Failure, &m);
        assert_eq!(blocked(&b, &m), vec![w.clone()]);
        assert_eq!(b.state_of(&w), BreakerState::Open);
        assert_eq!(m.breaker_trips.get(), 1);
        assert_eq!(m.breaker_open.get(), 1);
    }

    #[test]
    fn cooldown_ends_in_one_probe_whose_failure_doubles_it_up_to_the_cap() {
        let (b, clock, m) = setup();
        let w = WorkerId::new("w:1");
        for _ in 0..3 {
            b.record(&w, Outcome::Failure, &m);
        }
        // 5 s, then 10, 20, 40, 60, 60.
        for cooldown in [5, 10, 20, 40, 60, 60] {
            clock.advance(cooldown * S - 1);
            assert_eq!(blocked(&b, &m), vec![w.clone()], "cooldown {cooldown}");
            clock.advance(1);
            assert!(blocked(&b, &m).is_empty(), "cooldown {cooldown}");
            assert_eq!(b.state_of(&w), BreakerState::HalfOpen);
            b.picked(&w);
            // One probe at a time.
            assert_eq!(blocked(&b, &m), vec![w.clone()]);
            b.record(&w, Outcome::Failure, &m);
            assert_eq!(b.state_of(&w), BreakerState::Open);
        }
        assert_eq!(m.breaker_trips.get(), 7);
        clock.advance(60 * S);
        assert!(blocked(&b, &m).is_empty());
        b.picked(&w);
        b.record(&w, Outcome::Success, &m);
        assert_eq!(b.state_of(&w), BreakerState::Closed);
        assert_eq!(m.breaker_open.get(), 0);
        // Closed again with the first cooldown: three failures, 5 s.
        for _ in 0..3 {
            b.record(&w, Outcome::Failure, &m);
        }
        clock.advance(5 * S);
        assert!(blocked(&b, &m).is_empty());
    }

    #[test]
    fn a_neutral_probe_frees_the_slot_and_an_unclaimed_slot_expires() {
        let (b, clock, m) = setup();
        let w = WorkerId::new("w:1");
        for _ in 0..3 {
            b.record(&w, Outcome::Failure, &m);
        }
        clock.advance(5 * S);
        assert!(blocked(&b, &m).is_empty());
        b.picked(&w);
        assert_eq!(blocked(&b, &m), vec![w.clone()]);
        b.record(&w, Outcome::Neutral, &m);
        assert!(blocked(&b, &m).is_empty());
        assert_eq!(b.state_of(&w), BreakerState::HalfOpen);
        b.picked(&w);
        clock.advance(us(PROBE_TIMEOUT));
        assert!(blocked(&b, &m).is_empty());
    }

    #[test]
    fn threshold_zero_is_off_and_deregistered_workers_are_forgotten() {
        let clock = Arc::new(VirtualClock::new(0));
        let m = Metrics::default();
        let off = Breaker::new(
            BreakerConfig {
                failure_threshold: 0,
                ..BreakerConfig::default()
            },
            clock.clone(),
        );
        let w = WorkerId::new("w:1");
        for _ in 0..10 {
            off.record(&w, Outcome::Failure, &m);
        }
        assert!(blocked(&off, &m).is_empty());
        let b = Breaker::new(BreakerConfig::default(), clock);
        for _ in 0..3 {
            b.record(&w, Outcome::Failure, &m);
        }
        assert!(b.blocked(|_| false, &m).is_empty());
        assert_eq!(b.state_of(&w), BreakerState::Closed);
        assert_eq!(m.breaker_open.get(), 0);
    }
}
