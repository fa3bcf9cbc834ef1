//! The request path after parsing (PROTOCOLS.md §2): decide, hand the body to the configured
//! [`RequestTransport`](super::transport::RequestTransport), relay status and body; fail over
//! before the first response byte, up to `request_max_retries` more times, on an unreachable
//! worker, a 429 admission reject of the transport, a timeout (connect or first byte; the worker
//! was told to cancel), a 5xx, or a body that fails before its first byte (the first chunk is
//! read before the client gets the head, so a worker that answers its head and then hangs or
//! dies is failed over too). When every attempt was refused for load the client gets 429 with
//! `Retry-After`; when the last one timed out, 504; else 502.
//!
//! Each attempt's outcome before the first byte feeds the circuit breaker (`breaker`): workers
//! whose breaker is open are added to the request's exclusions when deciding, so no policy
//! picks them until their cooldown ends (unless no other candidate is left).
//!
//! Each attempt is an [`Attempt`] that owns the request's load in the fleet: it appends
//! `RequestPrefilled` at the first response byte — for a PD pair, when the prefill leg's answer
//! has arrived instead (the prompt is processed then, which the fleet's queued-prefill load and
//! the recorder mean; the TTFT stays the client's first byte) — and exactly one
//! `RequestFinished`, explicitly or on drop (`cancelled`) when the client goes away; a
//! `RequestPrefilled` never follows it. Each leg is pinned to the DP rank the router chose
//! (`X-data-parallel-rank`) when its worker fronts several. Streams are relayed frame by frame
//! as they arrive; a worker failure mid-stream (a broken connection, a lost or reordered chunk, a
//! timeout) ends the client's stream with an SSE error event (`code` 502 or 504) and
//! `data: [DONE]`, never with a silently truncated or corrupted body — unless the stream can be
//! continued on another worker (`--migration-limit`, see `migrate`).
//!
//! A decision with a prefill and a decode leg is sent by [`pd`] (both legs, per their
//! protocol) and relayed as the decode leg's response. A leg the worker did not take (or a
//! prefill that answered 5xx) fails over like a single worker, excluding that leg's rank; a
//! prefill's 4xx is the client's answer; a pair that cannot be driven (protocols differ, a
//! registration lacks a parameter, the prefill's answer lacks the hand-off) is not retried.

use super::ServerState;
use super::attempt::{Attempt, Usage, attempt_id, status_of, usage_of};
use super::breaker::{Judge, Outcome, answer_outcome, breaker_outcome};
use super::http::{ApiError, route_error};
use super::metrics::{inc, route_key};
use super::migrate::{self, Migration};
use super::pd;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::Response;
use futures::StreamExt as _;
use infera_core::event::{Event, RequestStatus, Role, RoutedLeg};
use infera_core::ids::WorkerRank;
use infera_core::log::NewEvent;
use infera_core::policy::{DirectPick, RouteError, RouteRequest};
use infera_core::ports::transport::{
    BodyStream, Inbound, Outbound, TransportError, engine_dp_rank,
};
use serde_json::{Map, Value, json};
use std::convert::Infallible;

/// Where one attempt goes.
pub(super) enum Route {
    /// One worker (a mixed model, or a direct pick of one worker): its rank, its URL without a
    /// trailing slash, and the engine-side DP rank to pin the request to ([`engine_dp_rank`]).
    /// Built from the fleet's record without copying it: this is every mixed request's path.
    Single {
        rank: WorkerRank,
        url: String,
        dp_rank: Option<u32>,
    },
    /// A prefill and a decode worker, driven by their PD protocol ([`pd`]).
    Pd(Box<pd::Pair>),
}

impl Route {
    /// The workers of the attempt.
    fn workers(&self) -> Vec<infera_core::ids::WorkerId> {
        match self {
            Route::Single { rank, .. } => vec![rank.worker.clone()],
            Route::Pd(pair) => vec![
                pair.prefill.rank.worker.clone(),
                pair.decode.rank.worker.clone(),
            ],
        }
    }
}

/// Decides, appends `RequestRouted` (both legs of a PD pair, each with its role) and applies
/// it; returns the chosen worker(s).
pub(super) fn decide(
    st: &ServerState,
    req: &mut RouteRequest,
    direct: Option<&DirectPick>,
) -> Result<Route, RouteError> {
    let now = st.inner.clock.now_us();
    let metrics = &st.inner.metrics;
    let mut core = st.lock();
    // Workers whose circuit breaker is open are excluded like failed ranks, unless that leaves
    // no candidate (see `breaker`); an endpoint picker's choice is its own.
    let own = req.exclude.len();
    if direct.is_none() {
        let fleet = core.kernel.fleet();
        let blocked = st
            .inner
            .breaker
            .blocked(|w| fleet.worker(w).is_some(), metrics);
        req.exclude.extend(blocked_ranks(fleet, &blocked));
    }
    let mut routed = core.kernel.route(req, direct, now);
    if req.exclude.len() > own {
        req.exclude.truncate(own);
        if let Err(RouteError::NoWorker { .. }) = &routed {
            tracing::warn!(model = %req.model,
                "every candidate's circuit breaker is open; routing as if none were");
            routed = core.kernel.route(req, direct, now);
        }
    }
    let routed = match routed {
        Ok(r) => r,
        Err(e) => {
            metrics.decision(match &e {
                RouteError::UnknownModel(_) => "unknown_model",
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
    let applied = core.commit(vec![NewEvent::new(Event::RequestRouted(routed))]);
    drop(core);
    metrics.events_applied(applied as u64);
    Ok(route)
}

/// Every rank of the registered workers in `workers`.
fn blocked_ranks<'a>(
    fleet: &'a infera_core::fleet::FleetState,
    workers: &'a [infera_core::ids::WorkerId],
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
pub(super) fn decide_single(
    st: &ServerState,
    req: &mut RouteRequest,
) -> Result<Option<(WorkerRank, String, Option<u32>)>, RouteError> {
    match decide(st, req, None)? {
        Route::Single { rank, url, dp_rank } => Ok(Some((rank, url, dp_rank))),
        Route::Pd(_) => {
            drop(Attempt::new(st, req, true));
            Ok(None)
        }
    }
}

/// Decides and forwards, failing over before the first response byte. See the module docs.
pub(crate) async fn forward(
    st: &ServerState,
    mut req: RouteRequest,
    direct: Option<DirectPick>,
    path: &'static str,
    body: Bytes,
    stream: bool,
) -> Result<Response, ApiError> {
    // `req.request_id` is the request's key (see `RequestId`); the engine and the logs see the
    // client's own id.
    let key = req.request_id.0.clone();
    let base_id = req.request_id.client_id().to_owned();
    // The worker an endpoint picker named is not replaced by another.
    let attempts = if direct.is_some() {
        1
    } else {
        st.inner.options.request_max_retries.saturating_add(1)
    };
    let transport = &st.inner.transport;
    let mut last_error: Option<TransportError> = None;
    // The client's body as JSON, parsed once for the legs of a PD pair.
    let mut pd_base: Option<Map<String, Value>> = None;
    // The body sent to a single worker, when it asks for token ids (set per attempt).
    let mut asked_ids: Option<Bytes>;
    for attempt in 0..attempts {
        req.request_id = attempt_id(st, &key);
        asked_ids = None;
        if attempt > 0 {
            inc(&st.inner.metrics.retries, 1);
        }
        let route = match decide(st, &mut req, direct.as_ref()) {
            Ok(x) => x,
            Err(RouteError::NoWorker { .. }) if last_error.is_some() => break,
            Err(e) => return Err(route_error(&e)),
        };
        let judge = Judge::new(
            st,
            if direct.is_some() {
                Vec::new()
            } else {
                route.workers()
            },
        );
        let single = matches!(route, Route::Single { .. });
        let mut guard = Attempt::new(st, &req, !single);
        guard.observe_sla(&req.model, stream);
        let (rank, outcome) = match route {
            Route::Single { rank, url, dp_rank } => {
                // A stream that may migrate asks its engine for token ids (see `migrate`).
                asked_ids = if stream && direct.is_none() {
                    migrate::asking_ids(st, &rank, path, &body)
                } else {
                    None
                };
                let sent = asked_ids.clone().unwrap_or_else(|| body.clone());
                let outbound =
                    Outbound::new(rank.worker.clone(), url, path, sent, stream, &base_id)
                        .with_dp_rank(dp_rank);
                let outcome =
                    transport
                        .send(outbound)
                        .await
                        .map_err(|error| pd::LegError::Transport {
                            role: Role::Mixed,
                            rank: rank.clone(),
                            error,
                        });
                (rank, outcome)
            }
            Route::Pd(pair) => {
                let base: &Map<String, Value> = match &mut pd_base {
                    Some(b) => b,
                    slot @ None => slot.insert(pd_body(&body)?),
                };
                let outcome = match pd::resolve(&pair.prefill.record, &pair.decode.record) {
                    Ok(protocol) => {
                        inc(&st.inner.metrics.pd_requests, 1);
                        let shape = pd::Shape::new(
                            protocol,
                            &pair,
                            pd::new_room(st.inner.id_prefix),
                            path == "/v1/chat/completions",
                        );
                        let max = st.inner.options.max_body_bytes;
                        let prefilled = guard.pd_legs(
                            route_key(&pair.prefill.record, &pair.prefill.rank),
                            route_key(&pair.decode.record, &pair.decode.rank),
                        );
                        pd::send(
                            transport,
                            shape,
                            path,
                            base,
                            stream,
                            &req.request_id.0,
                            max,
                            prefilled,
                        )
                        .await
                    }
                    Err(e) => Err(pd::LegError::Pd(e)),
                };
                (pair.decode.rank, outcome)
            }
        };
        let last_attempt = attempt + 1 == attempts;
        match outcome {
            Err(pd::LegError::Transport { role, rank, error }) => {
                st.inner.metrics.transport_error(&error);
                match role {
                    Role::Prefill => {
                        inc(&st.inner.metrics.pd_prefill_failures, 1);
                        st.inner.metrics.pd_bootstrap_failure("prefill_unreachable");
                    }
                    Role::Decode => st.inner.metrics.pd_bootstrap_failure("decode_unreachable"),
                    Role::Mixed => {}
                }
                judge.record(&rank, breaker_outcome(&error));
                guard.finish(failure_status(&error), Usage::default());
                if !fails_over(&error) {
                    return Err(transport_error(error));
                }
                tracing::warn!(request_id = %base_id, worker = %rank.worker.as_str(),
                    dp_rank = rank.dp_rank, leg = role.as_str(), transport = transport.name(),
                    error = %error, "worker did not take the request; failing over");
                last_error = Some(error);
                req.exclude.push(rank);
            }
            Err(pd::LegError::Status { rank, response }) => {
                inc(&st.inner.metrics.pd_prefill_failures, 1);
                let failed = response.status.is_server_error();
                st.inner.metrics.pd_bootstrap_failure(if failed {
                    "prefill_5xx"
                } else {
                    "prefill_4xx"
                });
                judge.record(
                    &rank,
                    if failed {
                        Outcome::Failure
                    } else {
                        Outcome::Neutral
                    },
                );
                if failed && !last_attempt {
                    tracing::warn!(request_id = %base_id, worker = %rank.worker.as_str(),
                        status = %response.status,
                        "PD prefill leg answered 5xx before any byte; failing over");
                    guard.finish(RequestStatus::WorkerError, Usage::default());
                    last_error = Some(TransportError::Unreachable(format!(
                        "prefill worker {} answered {}",
                        rank.worker.as_str(),
                        response.status
                    )));
                    req.exclude.push(rank);
                } else {
                    // The prefill's own error is the client's answer; the decode leg is gone.
                    return Ok(relay(guard, response, false, None).await);
                }
            }
            Err(pd::LegError::Pd(e)) => {
                tracing::error!(request_id = %base_id, error = %e, "PD pair cannot be driven");
                inc(&st.inner.metrics.pd_pair_errors, 1);
                st.inner.metrics.pd_bootstrap_failure(match e {
                    pd::PdError::Handoff { .. } => "handoff_extract_failed",
                    _ => "protocol_unresolved",
                });
                judge.release();
                guard.finish(RequestStatus::WorkerError, Usage::default());
                return Err(ApiError::new(e.status(), e.to_string()));
            }
            Ok(resp) if resp.status.is_server_error() && !last_attempt => {
                if !single {
                    st.inner.metrics.pd_bootstrap_failure("decode_5xx");
                }
                tracing::warn!(request_id = %base_id, worker = %rank.worker.as_str(),
                    status = %resp.status, "worker answered 5xx before any byte; failing over");
                judge.record(&rank, Outcome::Failure);
                guard.finish(RequestStatus::WorkerError, Usage::default());
                last_error = Some(TransportError::Unreachable(format!(
                    "worker {} answered {}",
                    rank.worker.as_str(),
                    resp.status
                )));
                req.exclude.push(rank);
            }
            Ok(mut resp) => match first_chunk(&mut resp.body).await {
                // Nothing reached the client yet: the worker failed before its first byte.
                Some(Err(error)) => {
                    st.inner.metrics.transport_error(&error);
                    judge.record(&rank, Outcome::Failure);
                    guard.finish(failure_status(&error), Usage::default());
                    tracing::warn!(request_id = %base_id, worker = %rank.worker.as_str(),
                        error = %error, "worker failed before its first byte; failing over");
                    last_error = Some(error);
                    req.exclude.push(rank);
                }
                first => {
                    judge.record(&rank, answer_outcome(resp.status));
                    if let Some(Ok(chunk)) = first {
                        resp.body = futures::stream::once(async move { Ok(chunk) })
                            .chain(resp.body)
                            .boxed();
                    }
                    let movable = stream && single && direct.is_none();
                    let migration = (movable && resp.status.is_success())
                        .then(|| {
                            let asked = asked_ids.is_some();
                            Migration::new(st, &req, path, &body, rank, &base_id, asked)
                        })
                        .flatten();
                    return Ok(relay(guard, resp, stream, migration).await);
                }
            },
        }
    }
    Err(match last_error {
        Some(e @ TransportError::Overloaded { .. }) => transport_error(e),
        Some(e @ TransportError::Timeout(_)) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "no worker answered within its deadline after {attempts} attempt(s); last error: {e}"
            ),
        ),
        other => ApiError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "no worker could serve the request after {attempts} attempt(s); last error: {}",
                other.map(|e| e.to_string()).unwrap_or_default()
            ),
        ),
    })
}

/// Whether a transport error before the first byte is tried on another worker: an unreachable
/// or overloaded worker, and one that timed out (connect or first byte; it was told to cancel).
fn fails_over(e: &TransportError) -> bool {
    e.retry_elsewhere() || matches!(e, TransportError::Timeout(_))
}

/// The first non-empty chunk of `body` (`None` when it ended without one).
pub(super) async fn first_chunk(body: &mut BodyStream) -> Option<Result<Bytes, TransportError>> {
    loop {
        match body.next().await? {
            Ok(chunk) if chunk.is_empty() => {}
            item => return Some(item),
        }
    }
}

/// The client's (already stamped) body as an object, for rewriting into PD legs.
fn pd_body(body: &Bytes) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the forwarded body is not a JSON object",
        )),
    }
}

/// The request status a transport failure is recorded with.
fn failure_status(e: &TransportError) -> RequestStatus {
    match e {
        TransportError::Overloaded { .. } => RequestStatus::Rejected,
        TransportError::Timeout(_) => RequestStatus::Timeout,
        _ => RequestStatus::WorkerError,
    }
}

/// The client's answer to a transport failure before any byte.
fn transport_error(e: TransportError) -> ApiError {
    let retry_after = match &e {
        TransportError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
        _ => None,
    };
    let mut err = ApiError::new(e.status(), e.to_string());
    err.retry_after_s = retry_after;
    err
}

async fn relay(
    mut guard: Attempt,
    resp: Inbound,
    stream: bool,
    migration: Option<Box<Migration>>,
) -> Response {
    let Inbound {
        status: code,
        content_type,
        mut body,
    } = resp;
    let is_sse = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut out = Response::builder().status(code);
    if let Some(ct) = content_type {
        out = out.header(header::CONTENT_TYPE, ct);
    }
    if !(stream || is_sse) {
        let mut bytes = Vec::new();
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(data) => bytes.extend_from_slice(&data),
                Err(e) => {
                    guard.st.inner.metrics.transport_error(&e);
                    guard.finish(failure_status(&e), Usage::default());
                    let err =
                        ApiError::new(e.status(), format!("worker response failed midway: {e}"));
                    return axum::response::IntoResponse::into_response(err);
                }
            }
        }
        guard.first_byte();
        guard.finish(status_of(code), usage_of(&bytes));
        return out
            .body(Body::from(bytes))
            .unwrap_or_else(|_| Response::new(Body::empty()));
    }
    let status = status_of(code);
    let state = Some(StreamRelay {
        body,
        guard,
        status,
        last_byte: b'\n',
        usage: Usage::default(),
        migration,
    });
    let s = futures::stream::unfold(state, |state| async move {
        let mut r = state?;
        loop {
            match r.body.next().await {
                Some(Ok(mut data)) => {
                    if let Some(m) = &mut r.migration {
                        data = m.pass(data);
                    }
                    if data.is_empty() {
                        continue;
                    }
                    r.guard.first_byte();
                    r.guard.count_frames(&data);
                    r.scan_usage(&data);
                    r.last_byte = data.last().copied().unwrap_or(b'\n');
                    return Some((Ok::<Bytes, Infallible>(data), Some(r)));
                }
                None => {
                    r.guard.finish(r.status, r.usage);
                    return None;
                }
                Some(Err(e)) => {
                    r.guard.st.inner.metrics.transport_error(&e);
                    r.guard.finish(failure_status(&e), Usage::default());
                    if let Some(m) = &mut r.migration
                        && let Some((guard, body)) = m.resume().await
                    {
                        (r.guard, r.body, r.usage) = (guard, body, Usage::default());
                        continue;
                    }
                    let code = e.status();
                    let kind = if code == StatusCode::GATEWAY_TIMEOUT {
                        "TimeoutError"
                    } else {
                        "BadGatewayError"
                    };
                    let err = json!({"error": {"message": format!("worker stream failed: {e}"),
                        "type": kind, "code": code.as_u16()}});
                    let sep = if r.last_byte == b'\n' { "" } else { "\n\n" };
                    let tail = format!("{sep}data: {err}\n\ndata: [DONE]\n\n");
                    return Some((Ok(Bytes::from(tail)), None));
                }
            }
        }
    });
    out.header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(s))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

struct StreamRelay {
    body: BodyStream,
    guard: Attempt,
    status: RequestStatus,
    last_byte: u8,
    /// The usage of the stream's usage chunk (`stream_options.include_usage`), when seen whole
    /// within one frame.
    usage: Usage,
    /// How the stream moves to another worker when its own fails (`--migration-limit`).
    migration: Option<Box<Migration>>,
}

impl StreamRelay {
    fn scan_usage(&mut self, data: &[u8]) {
        if !data.windows(7).any(|w| w == b"\"usage\"") {
            return;
        }
        for line in data.split(|b| *b == b'\n') {
            if let Some(payload) = line.strip_prefix(b"data: ") {
                let u = usage_of(payload);
                if u.prompt_tokens.is_some() || u.completion_tokens.is_some() {
                    self.usage = u;
                }
            }
        }
    }
}
