//! First-byte deadlines that scale with the work: how long an attempt may wait for its first
//! byte, derived from the prompt tokens the chosen worker must prefill (those it does not hold,
//! plus the prefill queued ahead of them) at the prefill rate the worker showed on its recent
//! requests, times a safety factor, between a floor and a cap.
//!
//! ```text
//! deadline = clamp(floor + factor × (uncached + queued) / rate(worker), floor, cap)
//! ```
//!
//! `rate(worker)` is a moving average of `uncached tokens / time to first byte` over the
//! worker's attempts that prefilled at least [`FirstByteConfig::min_sample_tokens`] (below that,
//! fixed costs dominate the time and say nothing about the rate); a worker without such an
//! attempt yet gets [`FirstByteConfig::cold_rate`]. The time to first byte includes the wait in
//! the engine's queue, so the measured rate errs low and the deadline long. A wedged engine is
//! not this module's concern: the health checks take it out of routing within seconds and fail
//! its requests over (see [`super::health`]); the deadline bounds an engine that answers its
//! health checks but not a request, without cutting a legitimate long prefill the way a flat
//! short deadline would.
//!
//! The transport applies the deadline unless an explicit one was configured
//! (`--http-req-first-byte-timeout`).

use super::Service;
use crate::ids::WorkerId;
use rustc_hash::FxHashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// The rates kept at most; past it the oldest worker's is forgotten (a worker rejoining starts
/// from the cold rate).
const MAX_WORKERS: usize = 4096;
/// The weight of a new sample in a worker's moving average.
const ALPHA: f64 = 0.2;

/// How deadlines are derived. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstByteConfig {
    /// The shortest deadline: the fixed costs of any request (scheduling, a first decode step,
    /// a cold CUDA graph) with room to spare.
    pub floor: Duration,
    /// The longest: what a flat deadline used to be.
    pub cap: Duration,
    /// How many times the expected prefill time an attempt may take.
    pub factor: f64,
    /// Prefill tokens per second assumed for a worker not yet measured: low, so a cold worker's
    /// long prompts are never cut.
    pub cold_rate: f64,
    /// The fewest prefilled tokens an attempt needs to count as a rate sample.
    pub min_sample_tokens: u32,
}

impl Default for FirstByteConfig {
    fn default() -> Self {
        Self {
            floor: Duration::from_secs(30),
            cap: Duration::from_secs(900),
            factor: 4.0,
            cold_rate: 1_000.0,
            min_sample_tokens: 512,
        }
    }
}

/// The work an attempt asks of its worker before the first byte.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefill {
    /// Prompt tokens the worker does not hold.
    pub uncached_tokens: u32,
    /// Prefill tokens queued on the worker ahead of this request.
    pub queued_tokens: u64,
}

/// The learned rates and the configuration. See the module docs.
#[derive(Debug, Default)]
pub struct FirstByte {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    config: FirstByteConfig,
    /// Tokens per second, with the order of the worker's first sample (for eviction).
    rates: FxHashMap<WorkerId, (f64, u64)>,
    samples: u64,
}

impl FirstByte {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The deadline of an attempt on `worker` with `work` to do.
    pub fn deadline(&self, worker: &WorkerId, work: Prefill) -> Duration {
        let st = self.state();
        let c = st.config;
        let rate = st.rates.get(worker).map_or(c.cold_rate, |(r, _)| *r);
        let tokens = f64::from(work.uncached_tokens) + work.queued_tokens as f64;
        let expected =
            Duration::try_from_secs_f64(c.factor * tokens / rate.max(1.0)).unwrap_or(c.cap);
        c.floor
            .saturating_add(expected)
            .clamp(c.floor, c.cap.max(c.floor))
    }

    /// Learns from an attempt on `worker` that prefilled `uncached_tokens` and answered its
    /// first byte after `elapsed`.
    pub fn observe(&self, worker: &WorkerId, uncached_tokens: u32, elapsed: Duration) {
        let mut st = self.state();
        if uncached_tokens < st.config.min_sample_tokens || elapsed.is_zero() {
            return;
        }
        let sample = f64::from(uncached_tokens) / elapsed.as_secs_f64();
        st.samples += 1;
        let order = st.samples;
        if let Some((rate, _)) = st.rates.get_mut(worker) {
            *rate += ALPHA * (sample - *rate);
            return;
        }
        if st.rates.len() >= MAX_WORKERS
            && let Some(oldest) = st
                .rates
                .iter()
                .min_by_key(|(_, (_, first))| *first)
                .map(|(w, _)| w.clone())
        {
            st.rates.remove(&oldest);
        }
        st.rates.insert(worker.clone(), (sample, order));
    }

    /// The rate learned for `worker`, if any.
    pub fn rate(&self, worker: &WorkerId) -> Option<f64> {
        self.state().rates.get(worker).map(|(r, _)| *r)
    }

    /// Replaces the configuration (the learned rates stay).
    pub fn configure(&self, config: FirstByteConfig) {
        self.state().config = config;
    }
}

impl Service {
    /// Sets how first-byte deadlines are derived (the defaults are [`FirstByteConfig`]'s).
    pub fn set_first_byte(&self, config: FirstByteConfig) {
        self.inner.first_byte.configure(config);
    }

    /// The first-byte deadline an attempt on `worker` with `work` to do gets now.
    pub fn first_byte_deadline(&self, worker: &WorkerId, work: Prefill) -> Duration {
        self.inner.first_byte.deadline(worker, work)
    }

    /// The prefill rate (tokens per second) learned for `worker`, if any.
    pub fn prefill_rate(&self, worker: &WorkerId) -> Option<f64> {
        self.inner.first_byte.rate(worker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(uncached_tokens: u32) -> Prefill {
        Prefill {
            uncached_tokens,
            queued_tokens: 0,
        }
    }

    #[test]
    fn the_deadline_grows_with_the_work_between_the_floor_and_the_cap() {
        let fb = FirstByte::default();
        let w = WorkerId::new("w:1");
        let c = FirstByteConfig::default();
        assert_eq!(fb.deadline(&w, work(0)), c.floor);
        // 128k tokens at the cold rate of 1,000/s, times 4: 512 s past the floor.
        assert_eq!(
            fb.deadline(&w, work(128_000)),
            c.floor + Duration::from_secs(512)
        );
        let queued = Prefill {
            uncached_tokens: 1_000,
            queued_tokens: 9_000,
        };
        assert_eq!(fb.deadline(&w, queued), c.floor + Duration::from_secs(40));
        assert_eq!(fb.deadline(&w, work(u32::MAX)), c.cap);
        let flood = Prefill {
            uncached_tokens: u32::MAX,
            queued_tokens: u64::MAX,
        };
        assert_eq!(fb.deadline(&w, flood), c.cap, "no overflow at any queue");
    }

    #[test]
    fn a_fast_worker_gets_shorter_deadlines_and_small_prompts_teach_nothing() {
        let fb = FirstByte::default();
        let (fast, cold) = (WorkerId::new("fast:1"), WorkerId::new("cold:1"));
        fb.observe(&fast, 100, Duration::from_millis(1));
        assert_eq!(
            fb.rate(&fast),
            None,
            "fixed costs dominate a 100-token prefill"
        );
        // 8k tokens in 0.4 s: 20k tokens/s.
        fb.observe(&fast, 8_000, Duration::from_millis(400));
        assert_eq!(fb.rate(&fast), Some(20_000.0));
        let floor = FirstByteConfig::default().floor;
        assert_eq!(
            fb.deadline(&fast, work(100_000)),
            floor + Duration::from_secs(20)
        );
        assert_eq!(
            fb.deadline(&cold, work(100_000)),
            floor + Duration::from_secs(400)
        );
        // A slower sample moves the average a fifth of the way.
        fb.observe(&fast, 10_000, Duration::from_secs(1));
        assert_eq!(fb.rate(&fast), Some(18_000.0));
    }

    #[test]
    fn the_configuration_applies_and_the_table_stays_bounded() {
        let fb = FirstByte::default();
        fb.configure(FirstByteConfig {
            floor: Duration::from_millis(200),
            cap: Duration::from_secs(2),
            ..FirstByteConfig::default()
        });
        let w = WorkerId::new("w:1");
        assert_eq!(fb.deadline(&w, work(0)), Duration::from_millis(200));
        assert_eq!(fb.deadline(&w, work(1_000_000)), Duration::from_secs(2));
        for i in 0..=MAX_WORKERS {
            fb.observe(
                &WorkerId::new(format!("w{i}")),
                1_000,
                Duration::from_secs(1),
            );
        }
        assert_eq!(fb.state().rates.len(), MAX_WORKERS);
        assert_eq!(
            fb.rate(&WorkerId::new("w0")),
            None,
            "the oldest is forgotten"
        );
        assert!(fb.rate(&WorkerId::new(format!("w{MAX_WORKERS}"))).is_some());
    }
}
