//! `infera server --auto-tune advise|apply`: the shadow replay of the server's own traffic
//! ([`infera_replay::shadow`]) on a thread of its own.
//!
//! The thread drains a tap of the committed events into a [`Window`] every 50 ms (never waited
//! for: a full tap drops and counts, `infera_event_tap_dropped_events_total{tap="shadow"}`) and,
//! every `--auto-tune-interval` once the window holds [`MIN_REQUESTS`] and took new ones, replays
//! it ([`shadow::assess`]) on the fleet as registered with the router's tunables as they are. It
//! runs at nice [`NICE`], one thread, so at most one core and below the request path, and within
//! a budget of [`CPU_SHARE`] of one core: each replay covers the window's latest requests, as
//! many as the last replay's speed says fit the budget. Each
//! assessment is published at `GET /v1/admin/tuning` and as `infera_tuning_*` metrics; a
//! fidelity gap beyond its noise and [`FIDELITY_WARN`] is logged once when it opens and once
//! when it closes. With `apply` the [`Tuner`]'s changes are committed as `RouterRetuned` events
//! (the router takes them in the same commit), logged, and the window starts again, so the
//! next assessment judges the new tunables on their own traffic.

use crate::config::server::{AutoTuneConfig, AutoTuneMode};
use anyhow::Context as _;
use infera_adapters::server::ServerState;
use infera_core::clock::{Clock, SystemClock};
use infera_core::event::{Event, RouterRetuned};
use infera_core::log::NewEvent;
use infera_core::service::drain_tap;
use infera_replay::shadow::adopt::{Change, Tuner};
use infera_replay::shadow::{self, Assessment, Budget, ShadowOptions, Window};
use infera_replay::sim::SimConfig;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// Batches of events the tap holds between drains.
const TAP_CAPACITY: usize = 1 << 16;
/// How often the thread takes what its tap queued.
const DRAIN_EVERY: Duration = Duration::from_millis(50);
/// The fewest requests a window needs to be replayed.
pub const MIN_REQUESTS: usize = 200;
/// The replay thread's nice value.
const NICE: i32 = 10;
/// A fidelity gap (predicted minus realised hit rate) this large, and beyond its noise, is
/// logged.
pub const FIDELITY_WARN: f64 = 0.05;
/// The share of one core the replays may take, averaged over the interval.
pub const CPU_SHARE: f64 = 0.1;
/// The most requests the first replay covers (later ones follow the measured speed).
const FIRST_LIMIT: usize = 50_000;
/// Changes listed at `/v1/admin/tuning`.
const CHANGES_KEPT: usize = 32;

/// The running shadow replay.
#[derive(Debug)]
pub struct AutoTune {
    thread: std::thread::JoinHandle<()>,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// `infera_tuning_*` on `/metrics`.
#[derive(Debug, Default, Clone)]
struct Exported {
    windows: Counter,
    replay_seconds: Counter<f64, AtomicU64>,
    changes: Family<[(&'static str, &'static str); 1], Counter>,
    window_requests: Gauge,
    window_bytes: Gauge,
    realised: FloatGauge,
    predicted: FloatGauge,
    recommended: FloatGauge,
    fidelity_gap: FloatGauge,
}

impl Exported {
    fn register(&self, r: &mut Registry) {
        r.register(
            "infera_tuning_windows",
            "Shadow replays of the traffic window run",
            self.windows.clone(),
        );
        r.register(
            "infera_tuning_replay_seconds",
            "Wall time spent replaying windows (on the niced shadow thread)",
            self.replay_seconds.clone(),
        );
        r.register(
            "infera_tuning_changes",
            "Router tunables changed by --auto-tune apply, by reason (adopt, rollback)",
            self.changes.clone(),
        );
        r.register(
            "infera_tuning_window_requests",
            "Finished requests in the shadow replay's window",
            self.window_requests.clone(),
        );
        r.register(
            "infera_tuning_window_bytes",
            "Memory the shadow replay's window holds (estimated)",
            self.window_bytes.clone(),
        );
        let gauges = [
            (
                "realised_hit_rate",
                "Prompt tokens served from cache over prompt tokens, as the engines reported, in the last window",
                &self.realised,
            ),
            (
                "predicted_hit_rate",
                "The shadow replay's hit rate for the current tunables in the last window",
                &self.predicted,
            ),
            (
                "recommended_hit_rate",
                "The shadow replay's hit rate for the recommended tunables in the last window",
                &self.recommended,
            ),
            (
                "fidelity_gap",
                "Predicted minus realised hit rate in the last window",
                &self.fidelity_gap,
            ),
        ];
        for (name, help, g) in gauges {
            r.register(format!("infera_tuning_{name}"), help, g.clone());
        }
    }

    fn assessed(&self, a: &Assessment, seconds: f64) {
        self.windows.inc();
        self.replay_seconds.inc_by(seconds);
        self.predicted.set(a.current().hit_rate);
        self.recommended.set(a.recommendation().hit_rate);
        if let Some(real) = a.realised.hit_rate {
            self.realised.set(real);
        }
        if let Some(gap) = a.fidelity_gap {
            self.fidelity_gap.set(gap);
        }
    }
}

/// The fleet-wide settings the shadow replay simulates with, from the server's own (the router's
/// tunables are read at each replay; the fleet's size and engines from its registrations).
pub fn sim_base(fleet: infera_core::fleet::FleetConfig, queue_threshold: Option<f64>) -> SimConfig {
    SimConfig {
        fleet,
        queue_threshold,
        ..SimConfig::default()
    }
}

/// The shadow thread's state between windows.
struct Shadow {
    state: ServerState,
    config: AutoTuneConfig,
    base: SimConfig,
    window: Window,
    tuner: Tuner,
    exported: Exported,
    changes: VecDeque<serde_json::Value>,
    last: Option<Assessment>,
    /// Windows replayed.
    windows: u64,
    budget: Budget,
    /// `Window::added` at the last replay: a window with nothing new is not replayed again.
    replayed_upto: u64,
    status: String,
    /// Whether the last assessment's fidelity gap was past the warning line.
    diverged: bool,
}

impl AutoTune {
    /// Starts the shadow replay over what `state` commits from now on.
    ///
    /// # Errors
    /// The thread cannot be spawned.
    pub fn start(
        state: &ServerState,
        config: AutoTuneConfig,
        base: SimConfig,
    ) -> anyhow::Result<Self> {
        let exported = Exported::default();
        state.service().register_metrics(|r| exported.register(r));
        let mut rx = state.service().tap("shadow", TAP_CAPACITY);
        let mut shadow = Shadow {
            state: state.clone(),
            config,
            base,
            window: Window::new(ShadowOptions {
                window_us: u64::try_from(config.window.as_micros()).unwrap_or(u64::MAX),
                max_bytes: config.max_bytes,
            }),
            tuner: Tuner::default(),
            exported,
            changes: VecDeque::new(),
            last: None,
            windows: 0,
            budget: Budget::new(CPU_SHARE, config.interval, FIRST_LIMIT, MIN_REQUESTS),
            replayed_upto: 0,
            status: "collecting".into(),
            diverged: false,
        };
        shadow.publish(0.0);
        let thread = std::thread::Builder::new()
            .name("infera-shadow".into())
            .spawn(move || {
                let tid = rustix::thread::gettid();
                if let Err(e) = rustix::process::setpriority_process(Some(tid), NICE) {
                    tracing::warn!(error = %e, "auto-tune: cannot lower the shadow thread's priority");
                }
                let mut next = Instant::now() + config.interval;
                loop {
                    std::thread::sleep(DRAIN_EVERY);
                    if drain_tap(&mut rx, |e| shadow.window.feed(e)) {
                        break;
                    }
                    if Instant::now() >= next {
                        shadow.round();
                        next = Instant::now() + config.interval;
                    }
                }
            })
            .context("cannot start the shadow replay thread")?;
        tracing::info!(
            mode = ?config.mode,
            window_s = config.window.as_secs(),
            interval_s = config.interval.as_secs(),
            "auto-tune: shadow replay of this server's traffic; GET /v1/admin/tuning"
        );
        Ok(Self { thread })
    }

    /// Waits for the thread, once `state.close_taps()` ended its stream.
    pub fn finish(self) {
        if self.thread.join().is_err() {
            tracing::error!("the shadow replay thread panicked");
        }
    }
}

impl Shadow {
    /// One interval: the window moves on and, when it holds enough, is replayed.
    fn round(&mut self) {
        self.window.advance(SystemClock.now_us());
        let set = |g: &Gauge, v: u64| g.set(i64::try_from(v).unwrap_or(i64::MAX));
        set(&self.exported.window_requests, self.window.len() as u64);
        set(&self.exported.window_bytes, self.window.bytes());
        if self.window.len() < MIN_REQUESTS {
            self.status = format!(
                "collecting: {} of the {MIN_REQUESTS} finished requests a replay needs",
                self.window.len()
            );
            self.publish(0.0);
            return;
        }
        if self.window.added == self.replayed_upto {
            return;
        }
        self.replayed_upto = self.window.added;
        let service = self.state.service();
        let workers: Vec<_> = service.with_fleet(|f| f.workers().cloned().collect());
        let base = SimConfig {
            router: service.lock().kernel.router_config().clone(),
            ..self.base.clone()
        };
        let started = Instant::now();
        let assessed = shadow::assess(&self.window, &base, &workers, self.budget.limit);
        let seconds = started.elapsed().as_secs_f64();
        if let Ok(Some(a)) = &assessed {
            self.budget.spent(a.requests, seconds);
        }
        match assessed {
            Err(e) => {
                tracing::warn!(error = %e, "auto-tune: the window cannot be replayed");
                self.status = format!("error: {e}");
            }
            Ok(None) => {
                self.status = "waiting for a worker that serves the window's model".into();
            }
            Ok(Some(a)) => {
                self.exported.assessed(&a, seconds);
                self.windows += 1;
                self.check_fidelity(&a);
                self.status = "assessed".into();
                if self.config.mode == AutoTuneMode::Apply
                    && let Some(change) = self.tuner.decide(&a)
                {
                    self.apply(&change);
                }
                self.last = Some(a);
            }
        }
        self.publish(seconds);
    }

    fn check_fidelity(&mut self, a: &Assessment) {
        let (Some(gap), Some(noise), Some(real)) =
            (a.fidelity_gap, a.fidelity_noise, a.realised.hit_rate)
        else {
            return;
        };
        let diverged = gap.abs() > FIDELITY_WARN.max(noise);
        if diverged && !self.diverged {
            tracing::warn!(
                model = %a.model,
                predicted = a.current().hit_rate,
                realised = real,
                noise,
                "auto-tune: the shadow replay and the fleet disagree on the hit rate (a block \
                 size, chat template or tokenizer that is not the engines', engines that drop \
                 KV events, or capacities they did not register); its advice is suspect until \
                 they agree"
            );
        } else if !diverged && self.diverged {
            tracing::info!(
                gap,
                "auto-tune: the shadow replay agrees with the fleet again"
            );
        }
        self.diverged = diverged;
    }

    fn apply(&mut self, change: &Change) {
        let event = RouterRetuned {
            from: change.from,
            to: change.to,
            by: "auto-tune".into(),
            reason: change.reason.as_str().into(),
            predicted_hit_rate: Some(change.predicted_hit_rate),
            realised_hit_rate: Some(change.realised_hit_rate),
        };
        self.state
            .service()
            .apply(vec![NewEvent::new(Event::RouterRetuned(event))]);
        self.exported
            .changes
            .get_or_create(&[("reason", change.reason.as_str())])
            .inc();
        tracing::info!(
            reason = change.reason.as_str(),
            from = %shadow::flags(&change.from),
            to = %shadow::flags(&change.to),
            predicted = change.predicted_hit_rate,
            realised = change.realised_hit_rate,
            "auto-tune: router tunables changed"
        );
        self.window.clear();
        if self.changes.len() == CHANGES_KEPT {
            self.changes.pop_front();
        }
        self.changes.push_back(serde_json::json!({
            "at_unix_us": SystemClock.now_us(),
            "change": change,
        }));
    }

    fn publish(&self, replay_seconds: f64) {
        let current = self
            .state
            .service()
            .lock()
            .kernel
            .router_config()
            .tunables();
        self.state.publish_tuning(serde_json::json!({
            "mode": self.config.mode,
            "status": self.status,
            "current": shadow::flags(&current),
            "window": {
                "requests": self.window.len(),
                "added": self.window.added,
                "replayed": self.replayed_upto,
                "bytes": self.window.bytes(),
                "evicted": self.window.evicted,
                "window_s": self.config.window.as_secs_f64(),
                "interval_s": self.config.interval.as_secs_f64(),
                "memory_bytes": self.config.max_bytes,
            },
            "windows": self.windows,
            "replay_limit": self.budget.limit,
            "replay_seconds": replay_seconds,
            "assessment": self.last,
            "changes": self.changes,
        }));
    }
}
