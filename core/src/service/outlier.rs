//! Outlier ejection: a worker that answers its health checks but serves far worse than its
//! peers (a GPU throttled to a crawl, a bad link, an engine failing one request in two) leaves
//! routing for a while.
//!
//! Every attempt leaves samples on its worker: its outcome before the first byte (as the
//! circuit breaker judges it; a 4xx or 429 says nothing and is not kept) and, for one worker
//! that answered, its time to first byte per unit of work: `ttft × 1024 / work`, where `work`
//! is the prompt tokens the worker did not hold plus the prefill queued on it plus 1,024 for
//! the fixed cost of any request. A worker keeps its last [`SAMPLES`] of each, for at most
//! [`WINDOW_INTERVALS`] evaluation intervals.
//!
//! Each [`OutlierConfig::interval`] the workers are compared within their peer group (the same
//! model and role); only workers with at least [`OutlierConfig::min_requests`] samples of a
//! kind are judged by it, or serve as peers. A worker is an outlier when
//! - the median over its samples of their ratio to the median of its peers' samples of like
//!   work (the same power of two of `work`) is more than [`OutlierConfig::ttft_factor`], over
//!   at least `min_requests` samples that have such peers; or
//! - its failure rate is at least [`OutlierConfig::error_margin`] above its peers' median.
//!
//! Like work is compared with like work because the time per token is not constant: attention
//! makes a 128k-token prefill several times as costly per token as a 1k-token one, and routing
//! by cache and by session sends long conversations to the same workers. A worker serving only
//! long prompts is compared with the peers' long prompts, or not at all.
//!
//! Both rules compare a worker with its peers, so a fleet-wide slowdown or a fleet-wide error
//! ejects nobody. They stand in for Envoy's success-rate rule, whose `mean − 1.9σ` threshold
//! cannot fire with fewer than six hosts (one outlier among `n` lies at most `(n−1)/√n` standard
//! deviations from the mean); a median needs one peer. Consecutive failures are the circuit
//! breaker's (Envoy's consecutive-5xx rule, see [`super::breaker`]).
//!
//! An outlier is ejected for [`OutlierConfig::base_ejection`] times the number of its
//! ejections, at most [`OutlierConfig::max_ejection`]; each interval it spends in routing
//! without being ejected takes one off that number (Envoy's rule). Ejections never take more
//! of a group out than `--max-ejection-percent` (at least one), counting the workers already
//! out for failing their health checks; the router's cap applies on top, with the breaker's.
//! Requests already on an outlier go on: it is slow, not wedged (a wedged worker is the health
//! checks' concern, and they fail its requests over).

use super::Service;
use super::metrics::inc;
use crate::clock::Micros;
use crate::event::Role;
use crate::ids::WorkerId;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// The samples of each kind a worker keeps.
pub const SAMPLES: usize = 20;
/// How many evaluation intervals a sample is kept.
pub const WINDOW_INTERVALS: u64 = 3;
/// The fixed cost of any request, in prompt tokens, added to its work.
const FIXED_TOKENS: u64 = 1024;
/// The workers with samples kept at most; past it a new worker's samples are dropped until
/// the next evaluation forgets the deregistered ones.
const MAX_WORKERS: usize = 4096;

/// How outliers are found and ejected. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutlierConfig {
    /// Between two evaluations.
    pub interval: Duration,
    /// The samples of a kind a worker (and a peer) needs to be judged by that kind.
    pub min_requests: u32,
    /// How many times its peers' median time per unit of work makes a worker an outlier; 0
    /// turns the rule off.
    pub ttft_factor: f64,
    /// How far above its peers' median failure rate (a fraction) makes a worker an outlier; 0
    /// turns the rule off.
    pub error_margin: f64,
    /// The first ejection's length; the n-th lasts n times as long.
    pub base_ejection: Duration,
    /// The longest ejection.
    pub max_ejection: Duration,
}

impl Default for OutlierConfig {
    /// 10 s, 10 samples, 5×, 50 points, 30 s growing to 300 s (Envoy's interval and times).
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            min_requests: 10,
            ttft_factor: 5.0,
            error_margin: 0.5,
            base_ejection: Duration::from_secs(30),
            max_ejection: Duration::from_secs(300),
        }
    }
}

impl OutlierConfig {
    fn on(&self) -> bool {
        self.ttft_factor > 0.0 || self.error_margin > 0.0
    }
}

/// Why a worker was ejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Its time to first byte per unit of work.
    Ttft,
    /// Its failure rate.
    Errors,
}

impl Reason {
    /// Its `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Ttft => "ttft",
            Reason::Errors => "errors",
        }
    }
}

/// A worker as an evaluation sees it.
#[derive(Debug, Clone, Copy)]
pub struct Member<'a> {
    pub worker: &'a WorkerId,
    pub model: &'a str,
    pub role: Role,
    /// Out of routing for another reason (its health checks): counts toward the cap.
    pub out: bool,
}

/// One ejection an evaluation made.
#[derive(Debug, Clone, PartialEq)]
pub struct Ejection {
    pub worker: WorkerId,
    pub reason: Reason,
    /// The worker's median (seconds per 1,024 tokens of work, or failure rate) and its peers'.
    pub value: f64,
    pub peers: f64,
    pub until: Micros,
}

/// What one evaluation did.
#[derive(Debug, Default, PartialEq)]
pub struct Evaluation {
    pub ejected: Vec<Ejection>,
    pub returned: Vec<WorkerId>,
    /// Outliers left in routing because their group was at the cap.
    pub capped: usize,
}

#[derive(Debug, Default)]
struct Entry {
    /// (when, bucket of work, seconds per 1,024 tokens of work).
    ttft: VecDeque<(Micros, u8, f32)>,
    /// (when, failed).
    outcomes: VecDeque<(Micros, bool)>,
    ejected_until: Option<Micros>,
    ejections: u32,
    /// Its time per unit of work against its peers' at the last evaluation, if judged.
    ratio: Option<f64>,
}

fn push<T>(ring: &mut VecDeque<T>, sample: T) {
    if ring.len() == SAMPLES {
        ring.pop_front();
    }
    ring.push_back(sample);
}

#[derive(Debug, Default)]
struct State {
    config: OutlierConfig,
    workers: FxHashMap<WorkerId, Entry>,
}

/// Every worker's samples and ejection. See the module docs.
#[derive(Debug, Default)]
pub struct Outliers {
    state: Mutex<State>,
    /// How many are ejected: every decision asks, and almost always none is.
    ejected: AtomicUsize,
}

impl Outliers {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The settings ([`OutlierConfig::default`] until set).
    pub fn config(&self) -> OutlierConfig {
        self.state().config
    }

    /// Replaces the settings; samples and ejections stay.
    pub fn configure(&self, config: OutlierConfig) {
        self.state().config = config;
    }

    fn sample(&self, worker: &WorkerId, add: impl FnOnce(&mut Entry)) {
        let mut st = self.state();
        if let Some(entry) = st.workers.get_mut(worker) {
            add(entry);
        } else if st.workers.len() < MAX_WORKERS {
            add(st.workers.entry(worker.clone()).or_default());
        }
    }

    /// Records an attempt's first byte on `worker`, `elapsed` after it was sent with
    /// `work_tokens` to prefill (its uncached and queued tokens).
    pub fn first_byte(&self, worker: &WorkerId, work_tokens: u64, elapsed: Duration, now: Micros) {
        let work = work_tokens.saturating_add(FIXED_TOKENS);
        let per_work = elapsed.as_secs_f64() * FIXED_TOKENS as f64 / work as f64;
        let bucket = work.ilog2() as u8;
        self.sample(worker, |e| {
            push(&mut e.ttft, (now, bucket, per_work as f32))
        });
    }

    /// Records an attempt's outcome on `worker` before its first byte.
    pub fn outcome(&self, worker: &WorkerId, failed: bool, now: Micros) {
        self.sample(worker, |e| push(&mut e.outcomes, (now, failed)));
    }

    /// The workers ejected now.
    pub fn ejected(&self) -> Vec<WorkerId> {
        if self.ejected.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        self.state()
            .workers
            .iter()
            .filter(|(_, e)| e.ejected_until.is_some())
            .map(|(w, _)| w.clone())
            .collect()
    }

    /// Each judged worker's time per unit of work against its peers' at like work, as of the
    /// last evaluation.
    pub fn ratios(&self) -> Vec<(WorkerId, f64)> {
        self.state()
            .workers
            .iter()
            .filter_map(|(w, e)| Some((w.clone(), e.ratio?)))
            .collect()
    }

    /// One evaluation at `now` over the registered `members`, ejecting at most `percent` of a
    /// group (see the module docs); forgets every other worker.
    pub fn evaluate(&self, members: &[Member<'_>], percent: u32, now: Micros) -> Evaluation {
        let mut st = self.state();
        let config = st.config;
        let mut done = Evaluation::default();
        let registered: FxHashMap<&WorkerId, &Member<'_>> =
            members.iter().map(|m| (m.worker, m)).collect();
        st.workers.retain(|w, _| registered.contains_key(w));
        let oldest = now.saturating_sub(us(config.interval).saturating_mul(WINDOW_INTERVALS));
        for (worker, e) in &mut st.workers {
            while e.ttft.front().is_some_and(|(t, _, _)| *t < oldest) {
                e.ttft.pop_front();
            }
            while e.outcomes.front().is_some_and(|(t, _)| *t < oldest) {
                e.outcomes.pop_front();
            }
            if e.ejected_until.is_some_and(|until| until <= now) {
                e.ejected_until = None;
                done.returned.push(worker.clone());
            }
        }
        // Those in routing through the whole interval: one off their count unless ejected now.
        let stayed: Vec<WorkerId> = st
            .workers
            .iter()
            .filter(|(w, e)| {
                e.ejections > 0 && e.ejected_until.is_none() && !done.returned.contains(w)
            })
            .map(|(w, _)| w.clone())
            .collect();
        if config.on() {
            let mut groups: FxHashMap<(&str, Role), Vec<&Member<'_>>> = FxHashMap::default();
            for m in members {
                groups.entry((m.model, m.role)).or_default().push(m);
            }
            for group in groups.values() {
                judge(&mut st.workers, group, &config, percent, now, &mut done);
            }
        }
        for w in &stayed {
            if let Some(e) = st.workers.get_mut(w)
                && e.ejected_until.is_none()
            {
                e.ejections -= 1;
            }
        }
        let ejected = st
            .workers
            .values()
            .filter(|e| e.ejected_until.is_some())
            .count();
        self.ejected.store(ejected, Ordering::Relaxed);
        done
    }
}

fn us(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    })
}

/// A worker's time per unit of work against its peers' at like work: the median ratio, and
/// the medians of the samples compared on each side.
#[derive(Debug, Clone, Copy)]
struct Slowness {
    ratio: f64,
    mine: f64,
    peers: f64,
}

/// One group's outliers, ejected up to the group's cap.
fn judge(
    workers: &mut FxHashMap<WorkerId, Entry>,
    group: &[&Member<'_>],
    config: &OutlierConfig,
    percent: u32,
    now: Micros,
    done: &mut Evaluation,
) {
    let min = config.min_requests.max(1) as usize;
    let judged = |w: &WorkerId| workers.get(w).filter(|e| e.ttft.len() >= min);
    // The samples of the members with the volume, by bucket of work.
    let mut buckets: FxHashMap<u8, Vec<(&WorkerId, f64)>> = FxHashMap::default();
    for m in group {
        for (_, bucket, v) in judged(m.worker).into_iter().flat_map(|e| &e.ttft) {
            buckets
                .entry(*bucket)
                .or_default()
                .push((m.worker, f64::from(*v)));
        }
    }
    // A member's slowness: the median of its samples' ratios to its peers' median at the same
    // bucket of work, where there is one; with its own median and its peers'.
    let slowness = |me: &WorkerId| -> Option<Slowness> {
        let e = judged(me)?;
        let mut references: FxHashMap<u8, Option<f64>> = FxHashMap::default();
        let (mut ratios, mut mine, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
        for (_, bucket, v) in &e.ttft {
            let reference = *references.entry(*bucket).or_insert_with(|| {
                let peers = buckets.get(bucket)?.iter().filter(|(w, _)| *w != me);
                median(peers.map(|(_, v)| *v).collect())
            });
            if let Some(r) = reference.filter(|r| *r > 0.0) {
                ratios.push(f64::from(*v) / r);
                mine.push(f64::from(*v));
                theirs.push(r);
            }
        }
        if ratios.len() < min {
            return None;
        }
        Some(Slowness {
            ratio: median(ratios)?,
            mine: median(mine)?,
            peers: median(theirs)?,
        })
    };
    let failure_rate = |w: &WorkerId| {
        workers.get(w).filter(|e| e.outcomes.len() >= min).map(|e| {
            e.outcomes.iter().filter(|(_, failed)| *failed).count() as f64 / e.outcomes.len() as f64
        })
    };
    let stats: Vec<(&WorkerId, Option<Slowness>, Option<f64>)> = group
        .iter()
        .map(|m| (m.worker, slowness(m.worker), failure_rate(m.worker)))
        .collect();
    let cap = (group.len() * percent as usize / 100).max(1);
    let mut out = group
        .iter()
        .filter(|m| {
            m.out
                || workers
                    .get(m.worker)
                    .is_some_and(|e| e.ejected_until.is_some())
        })
        .count();
    for (worker, ttft, _) in &stats {
        if let Some(e) = workers.get_mut(*worker) {
            e.ratio = ttft.map(|s| s.ratio);
        }
    }
    for (worker, ttft, errors) in &stats {
        let Some(entry) = workers.get(*worker) else {
            continue;
        };
        if entry.ejected_until.is_some() {
            continue;
        }
        let slow = ttft
            .filter(|s| config.ttft_factor > 0.0 && s.ratio > config.ttft_factor)
            .map(|s| (s.mine, s.peers));
        let peer_errors = median(
            stats
                .iter()
                .filter(|s| s.0 != *worker)
                .filter_map(|s| s.2)
                .collect(),
        );
        let failing = errors.zip(peer_errors).filter(|(mine, peers)| {
            config.error_margin > 0.0 && *mine - peers >= config.error_margin
        });
        let (reason, (value, peers)) = match (slow, failing) {
            (_, Some(f)) => (Reason::Errors, f),
            (Some(s), None) => (Reason::Ttft, s),
            (None, None) => continue,
        };
        if out >= cap {
            done.capped += 1;
            continue;
        }
        out += 1;
        let Some(entry) = workers.get_mut(*worker) else {
            continue;
        };
        entry.ejections = entry.ejections.saturating_add(1);
        let length = config
            .base_ejection
            .saturating_mul(entry.ejections)
            .min(config.max_ejection.max(config.base_ejection));
        let until = now.saturating_add(us(length));
        entry.ejected_until = Some(until);
        entry.ttft.clear();
        entry.outcomes.clear();
        done.ejected.push(Ejection {
            worker: (*worker).clone(),
            reason,
            value,
            peers,
            until,
        });
    }
}

impl Service {
    /// Sets how outliers are found and ejected (see [`OutlierConfig`]); takes effect at the
    /// next evaluation.
    pub fn set_outliers(&self, config: OutlierConfig) {
        self.inner.outliers.configure(config);
    }

    /// The workers out of routing now for failing their health checks or as outliers.
    pub fn ejected_workers(&self) -> (Vec<WorkerId>, Vec<WorkerId>) {
        (self.inner.health.out(), self.inner.outliers.ejected())
    }

    /// Compares every registered worker with its peers once and ejects the outliers (see the
    /// module docs).
    pub fn detect_outliers(&self) -> Evaluation {
        let now = self.inner.clock.now_us();
        let health_out = self.inner.health.out();
        let percent = self.inner.health.config().max_ejection_percent;
        let done = self.with_fleet(|f| {
            let members: Vec<Member<'_>> = f
                .workers()
                .map(|r| Member {
                    worker: &r.worker_id,
                    model: &r.model_name,
                    role: r.disagg_mode,
                    out: health_out.contains(&r.worker_id),
                })
                .collect();
            self.inner.outliers.evaluate(&members, percent, now)
        });
        let metrics = &self.inner.metrics;
        for e in &done.ejected {
            tracing::warn!(worker = %e.worker.as_str(), reason = e.reason.as_str(),
                worker_median = e.value, peers_median = e.peers,
                ejected_s = (e.until.saturating_sub(now)) as f64 / 1e6,
                "worker serves far worse than its peers: ejected from routing");
            metrics
                .outlier_ejections
                .get_or_create(&[("reason", e.reason.as_str())])
                .inc();
        }
        for w in &done.returned {
            tracing::info!(worker = %w.as_str(), "outlier ejection over: back in routing");
        }
        inc(&metrics.outliers_capped, done.capped as u64);
        metrics.outlier_ttft_ratio.clear();
        for (w, ratio) in self.inner.outliers.ratios() {
            metrics
                .outlier_ttft_ratio
                .get_or_create(&[("worker_id", w.0)])
                .set(ratio);
        }
        done
    }

    /// Evaluates outliers every [`OutlierConfig::interval`] until dropped; returns at once when
    /// both rules are off.
    pub(super) async fn run_outlier_detection(&self) {
        let config = self.inner.outliers.config();
        if !config.on() {
            return;
        }
        let mut tick = tokio::time::interval(config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.detect_outliers();
        }
    }
}

#[cfg(test)]
mod tests;
