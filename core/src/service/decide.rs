//! The decision of one attempt: the router's pick among the workers whose circuit breaker is
//! not open, who pass their health checks and are not ejected as outliers, committed as
//! `RequestRouted` (both legs of a prefill/decode pair, each with its role, so both count as
//! load), and the [`Route`] the dispatcher drives.

use super::Service;
use super::attempt::Attempt;
use super::deadline::Prefill;
use super::metrics::{inc, route_key};
use super::pd;
use crate::event::{Event, Role, RoutedLeg};
use crate::ids::WorkerRank;
use crate::log::NewEvent;
use crate::policy::{DirectPick, RouteError, RouteRequest};
use crate::ports::trace::TARGET;
use crate::ports::transport::engine_dp_rank;

/// Where one attempt goes.
#[derive(Debug)]
pub enum Route {
    /// One worker (a mixed model, or a direct pick of one worker): its rank, its URL without a
    /// trailing slash, and the engine-side DP rank to pin the request to ([`engine_dp_rank`]).
    /// Built from the fleet's record without copying it: this is every mixed request's path.
    Single {
        rank: WorkerRank,
        url: String,
        dp_rank: Option<u32>,
        /// What the worker must prefill before the first byte (see [`super::deadline`]).
        prefill: Prefill,
    },
    /// A prefill and a decode worker, driven by their PD protocol.
    Pd(Box<pd::Pair>),
}

impl Route {
    /// The workers of the attempt.
    pub(super) fn workers(&self) -> Vec<crate::ids::WorkerId> {
        match self {
            Route::Single { rank, .. } => vec![rank.worker.clone()],
            Route::Pd(pair) => vec![
                pair.prefill.rank.worker.clone(),
                pair.decode.rank.worker.clone(),
            ],
        }
    }
}

impl Service {
    /// Decides, appends `RequestRouted` (both legs of a PD pair, each with its role) and
    /// applies it; returns the chosen worker(s). Workers whose circuit breaker is open are
    /// avoided. The caller owns the decision's load from here: an [`Attempt`] for it.
    ///
    /// # Errors
    /// The router's: no such model, no worker that can take it, a direct pick that is wrong.
    pub fn decide(
        &self,
        req: &mut RouteRequest,
        direct: Option<&DirectPick>,
    ) -> Result<Route, RouteError> {
        decide(self, req, direct, None)
    }
}

/// [`Service::decide`]; `tenant` is stamped on the `RequestRouted` it commits.
pub(super) fn decide(
    st: &Service,
    req: &mut RouteRequest,
    direct: Option<&DirectPick>,
    tenant: Option<&str>,
) -> Result<Route, RouteError> {
    let now = st.inner.clock.now_us();
    let metrics = &st.inner.metrics;
    let span = tracing::trace_span!(
        target: TARGET,
        "route",
        infera.policy = tracing::field::Empty,
        infera.worker = tracing::field::Empty,
        infera.overlap_blocks = tracing::field::Empty,
        infera.prompt_blocks = tracing::field::Empty,
        infera.candidates = tracing::field::Empty,
    );
    let _in_span = span.enter();
    let mut core = st.lock();
    // Workers whose circuit breaker is open are excluded like failed ranks, unless that leaves
    // no candidate (see `breaker`); an endpoint picker's choice is its own.
    let own = req.exclude.len();
    if direct.is_none() {
        let fleet = core.kernel.fleet();
        let open = st
            .inner
            .breaker
            .blocked(|w| fleet.worker(w).is_some(), metrics);
        let mut out = st.inner.health.out();
        out.extend(st.inner.outliers.ejected());
        if !(open.is_empty() && out.is_empty()) {
            let percent = st.inner.health.config().max_ejection_percent;
            let (blocked, released) = capped(fleet, &req.model, out, open, percent);
            if released > 0 {
                inc(&metrics.ejections_capped, released as u64);
            }
            req.exclude.extend(blocked_ranks(fleet, &blocked));
        }
    }
    let mut routed = core.kernel.route(req, direct, now);
    if req.exclude.len() > own {
        req.exclude.truncate(own);
        if let Err(RouteError::NoWorker { .. }) = &routed {
            tracing::warn!(model = %req.model,
                "every candidate's circuit breaker is open or its health checks fail; \
                 routing as if none were");
            routed = core.kernel.route(req, direct, now);
        }
    }
    let mut routed = match routed {
        Ok(r) => r,
        Err(e) => {
            metrics.decision(match &e {
                RouteError::UnknownModel { .. } => "unknown_model",
                _ => "no_worker",
            });
            return Err(e);
        }
    };
    let fleet = core.kernel.fleet();
    let target = |leg: &RoutedLeg| {
        fleet.worker(&leg.worker.worker).map(|w| pd::Leg {
            rank: leg.worker.clone(),
            url: w.url.trim_end_matches('/').to_owned(),
            record: w.clone(),
        })
    };
    let route = match routed.legs.as_slice() {
        [p, d] if p.role == Role::Prefill && d.role == Role::Decode => {
            match (target(p), target(d)) {
                (Some(prefill), Some(decode)) => {
                    Some(Route::Pd(Box::new(pd::Pair { prefill, decode })))
                }
                _ => None,
            }
        }
        [leg, ..] => fleet.worker(&leg.worker.worker).map(|w| Route::Single {
            rank: leg.worker.clone(),
            url: w.url.trim_end_matches('/').to_owned(),
            dp_rank: engine_dp_rank(&leg.worker, w),
            prefill: Prefill {
                uncached_tokens: req
                    .prompt_tokens
                    .saturating_sub(leg.overlap_blocks.saturating_mul(w.kv_block_size)),
                queued_tokens: fleet
                    .index()
                    .slot(&leg.worker)
                    .map_or(0, |s| fleet.queued_prefill_tokens_at(s)),
            },
        }),
        [] => None,
    };
    let Some(route) = route else {
        metrics.decision("no_worker");
        return Err(RouteError::NoWorker {
            model: req.model.clone(),
            role: "mixed",
        });
    };
    metrics.decision("routed");
    if let Some(first) = routed.legs.first() {
        metrics
            .models
            .routed(&req.model, routed.blocks.len(), first.overlap_blocks);
    }
    for leg in &routed.legs {
        let worker = fleet.worker(&leg.worker.worker).map_or_else(
            || leg.worker.worker.as_str().to_owned(),
            |w| route_key(w, &leg.worker),
        );
        metrics.pick(
            leg.role.as_str(),
            worker,
            leg.overlap_blocks,
            routed.blocks.len(),
        );
    }
    if let (Some(session), Some(first)) = (req.session, routed.legs.first()) {
        metrics
            .sessions
            .get_or_create(&[(
                "outcome",
                session_outcome(&core.kernel, session, first, now),
            )])
            .inc();
    }
    if !span.is_disabled() {
        record_decision(&span, &routed);
    }
    routed.tenant = tenant.map(str::to_owned);
    let applied = core.commit(vec![NewEvent::new(Event::RequestRouted(routed))]);
    drop(core);
    metrics.events_applied(applied as u64);
    Ok(route)
}

/// The decision on its span: the policy, the pick, and the best-scored candidates as
/// `worker:rank cost=C overlap=N`, cheapest first.
fn record_decision(span: &tracing::Span, routed: &crate::event::RequestRouted) {
    use std::fmt::Write as _;
    span.record("infera.policy", routed.policy.as_str());
    if let Some(first) = routed.legs.first() {
        span.record("infera.worker", first.worker.worker.as_str());
        span.record("infera.overlap_blocks", i64::from(first.overlap_blocks));
    }
    span.record("infera.prompt_blocks", routed.blocks.len() as i64);
    let mut candidates = String::new();
    for c in &routed.top {
        let sep = if candidates.is_empty() { "" } else { "; " };
        let _ = write!(
            candidates,
            "{sep}{}:{} cost={:.3} overlap={}",
            c.worker.worker.as_str(),
            c.worker.dp_rank,
            c.cost,
            c.overlap_blocks
        );
    }
    span.record("infera.candidates", candidates.as_str());
}

/// Whether the session's first leg stayed where it was pinned: `new` (no live pin), `kept` or
/// `moved`.
fn session_outcome(
    kernel: &crate::kernel::Kernel,
    session: crate::ids::SessionKey,
    leg: &RoutedLeg,
    now: crate::clock::Micros,
) -> &'static str {
    let fleet = kernel.fleet();
    let ttl_us = kernel
        .router_config()
        .sessions
        .ttl_s
        .saturating_mul(1_000_000);
    match fleet.session_pin(session, leg.role, now, ttl_us) {
        None => "new",
        Some(slot) if fleet.index().slot(&leg.worker) == Some(slot) => "kept",
        Some(_) => "moved",
    }
}

/// The ejected workers (out of routing by their health checks or as outliers, `out`, or by an
/// open breaker, `open`) to exclude for a request of `model`: of the model's own, at most
/// `percent` of its workers (at least one), `out` first; how many were released past the cap.
pub(super) fn capped(
    fleet: &crate::fleet::FleetState,
    model: &str,
    out: Vec<crate::ids::WorkerId>,
    open: Vec<crate::ids::WorkerId>,
    percent: u32,
) -> (Vec<crate::ids::WorkerId>, usize) {
    let serves = |w: &crate::ids::WorkerId| fleet.worker(w).is_some_and(|r| r.serves(model));
    let mut ejected = Vec::with_capacity(out.len() + open.len());
    for w in out.into_iter().chain(open) {
        if !ejected.contains(&w) {
            ejected.push(w);
        }
    }
    ejected.retain(|w| serves(w));
    let workers = fleet.workers().filter(|r| r.serves(model)).count();
    let cap = (workers * percent as usize / 100).max(1);
    let released = ejected.len().saturating_sub(cap);
    ejected.truncate(cap);
    (ejected, released)
}

/// Every rank of the registered workers in `workers`.
fn blocked_ranks<'a>(
    fleet: &'a crate::fleet::FleetState,
    workers: &'a [crate::ids::WorkerId],
) -> impl Iterator<Item = WorkerRank> + 'a {
    workers
        .iter()
        .filter_map(|w| fleet.worker(w))
        .flat_map(|r| {
            (0..r.dp_size.max(1)).map(|i| WorkerRank::new(r.worker_id.clone(), r.dp_rank + i))
        })
}

/// Decides one mixed worker for `req` (a migrating stream's next worker): its rank, URL and
/// engine DP rank; `None` when the model is served by prefill/decode pairs (that decision is
/// finished at once, as cancelled).
pub(crate) fn decide_single(
    st: &Service,
    req: &mut RouteRequest,
) -> Result<Option<(WorkerRank, String, Option<u32>)>, RouteError> {
    match decide(st, req, None, None)? {
        Route::Single {
            rank, url, dp_rank, ..
        } => Ok(Some((rank, url, dp_rank))),
        Route::Pd(_) => {
            drop(Attempt::new(st, req, true));
            Ok(None)
        }
    }
}
