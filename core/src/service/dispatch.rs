//! The request path after the decision's inputs are ready (PROTOCOLS.md §2): decide, hand the
//! body to the [`RequestTransport`](crate::ports::transport::RequestTransport), relay status and
//! body; fail over
//! before the first response byte, up to `request_max_retries` more times, on an unreachable
//! worker, a 429 admission reject of the transport, a timeout (connect or first byte; the worker
//! was told to cancel), a 5xx, or a body that fails before its first byte (the first chunk is
//! read before the client gets the head, so a worker that answers its head and then hangs or
//! dies is failed over too). When every attempt was refused for load the client gets 429 with
//! `Retry-After`; when the last one timed out, 504; else 502.
//!
//! Each attempt's outcome before the first byte feeds the circuit breaker ([`super::breaker`]): workers
//! whose breaker is open are added to the request's exclusions when deciding, so no policy
//! picks them until their cooldown ends (unless no other candidate is left). So are workers
//! that fail their health checks ([`super::health`]); an attempt on a worker that leaves
//! routing fails as a timeout at once, before or after its first byte.
//!
//! Each attempt is an [`Attempt`] that owns the request's load in the fleet: it appends
//! `RequestPrefilled` at the first response byte — for a PD pair, when the prefill leg's answer
//! has arrived instead (the prompt is processed then, which the fleet's queued-prefill load and
//! the recorder mean; the TTFT stays the client's first byte) — and exactly one
//! `RequestFinished`, explicitly or on drop (`cancelled`) when the client goes away; a
//! `RequestPrefilled` never follows it. Each leg is pinned to the DP rank the router chose
//! (`X-data-parallel-rank`) when its worker fronts several. Streams are relayed frame by frame
//! as they arrive; a worker failure mid-stream (a broken connection, a lost or reordered chunk, a
//! timeout) ends the reply's stream with that failure, which the edge turns into an error event
//! (the OpenAI front: an SSE `error` with `code` 502 or 504, then `data: [DONE]`), never a
//! silently truncated or corrupted body — unless the stream can be continued on another worker
//! (`--migration-limit`, see [`super::migrate`]).
//!
//! A decision with a prefill and a decode leg is sent by [`pd`] (both legs, per their
//! protocol) and relayed as the decode leg's response. A leg the worker did not take (or a
//! prefill that answered 5xx) fails over like a single worker, excluding that leg's rank; a
//! prefill's 4xx is the client's answer; a pair that cannot be driven (protocols differ, a
//! registration lacks a parameter, the prefill's answer lacks the hand-off) is not retried.

use super::Service;
use super::admission::Share;
use super::attempt::{Attempt, Usage, status_of, usage_of};
use super::breaker::{Judge, Outcome, answer_outcome, breaker_outcome};
use super::decide::{Route, decide};
use super::health;
use super::metrics::{inc, route_key};
use super::migrate::{self, Migration};
use super::pd;
use super::reply::{Reply, ReplyBody, RequestError};
use crate::error::{ErrorCode, ServiceError};
use crate::event::{RequestStatus, Role};
use crate::ids::WorkerRank;
use crate::policy::{DirectPick, RouteError, RouteRequest};
use crate::ports::transport::{BodyStream, Inbound, Outbound, TransportError};
use bytes::Bytes;
use futures::StreamExt as _;
use serde_json::{Map, Value};

impl Service {
    /// Waits its turn in the router's queue when the model's workers are saturated (see
    /// [`super::admission`]; a direct pick does not wait), then decides and forwards, failing
    /// over before the first response byte. See the module docs.
    ///
    /// # Errors
    /// The queue's 503, a decision that cannot be made, a PD pair that cannot be driven, or
    /// every attempt failing before its first byte (429 when every one was refused for load,
    /// 504 when the last timed out, else 502).
    pub async fn forward(
        &self,
        req: RouteRequest,
        direct: Option<DirectPick>,
        share: Share,
        path: &'static str,
        body: Bytes,
        stream: bool,
    ) -> Result<Reply, RequestError> {
        forward(self, req, direct, share, path, body, stream).await
    }
}

async fn forward(
    st: &Service,
    mut req: RouteRequest,
    direct: Option<DirectPick>,
    share: Share,
    path: &'static str,
    body: Bytes,
    stream: bool,
) -> Result<Reply, RequestError> {
    let mut admitted = match direct {
        Some(_) => None,
        None => {
            st.admit(&req.model, &share, u64::from(req.prompt_tokens))
                .await?
        }
    };
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
        req.request_id = st.attempt_id(&key);
        asked_ids = None;
        if attempt > 0 {
            inc(&st.inner.metrics.retries, 1);
        }
        let tenant = (share.permit.is_some() || *share.tenant != *crate::tenancy::ANONYMOUS)
            .then_some(&*share.tenant);
        let decided = decide(st, &mut req, direct.as_ref(), tenant);
        // The decision is committed: the queue's next waiter may go.
        drop(admitted.take());
        let route = match decided {
            Ok(x) => x,
            Err(RouteError::NoWorker { .. }) if last_error.is_some() => break,
            Err(e) => return Err(RequestError::of(&e)),
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
        guard.observe_sla(stream);
        guard.charge_to(&share);
        let (rank, outcome) = match route {
            Route::Single {
                rank,
                url,
                dp_rank,
                prefill,
            } => {
                // A stream that may migrate asks its engine for token ids (see `migrate`).
                asked_ids = if stream && direct.is_none() {
                    migrate::asking_ids(st, &rank, path, &body)
                } else {
                    None
                };
                let sent = asked_ids.clone().unwrap_or_else(|| body.clone());
                let deadline = st.inner.first_byte.deadline(&rank.worker, prefill);
                guard.prefilling(rank.worker.clone(), prefill);
                let mut outbound =
                    Outbound::new(rank.worker.clone(), url, path, sent, stream, &base_id)
                        .with_dp_rank(dp_rank)
                        .with_first_byte_deadline(deadline);
                guard.trace_into(&mut outbound.headers);
                // A worker that leaves routing (its health checks fail) fails this attempt
                // over at once, before or after its first byte (see `health`).
                let (left, progress) = left_rank(&st.inner.health, &rank);
                let outcome = match unless_left(transport.send(outbound), left, progress).await {
                    Ok(sent) => sent.map_err(|error| pd::LegError::Transport {
                        role: Role::Mixed,
                        rank: rank.clone(),
                        error,
                    }),
                    Err(gone) => Err(pd::LegError::Transport {
                        role: Role::Mixed,
                        error: health::left_error(&gone.worker),
                        rank: gone,
                    }),
                };
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
                        let mut trace = http::HeaderMap::new();
                        guard.trace_into(&mut trace);
                        let sent = pd::send(
                            transport,
                            shape,
                            path,
                            base,
                            stream,
                            &req.request_id.0,
                            max,
                            &trace,
                            prefilled,
                        );
                        // Either leg's worker leaving routing fails the pair over, before the
                        // first byte (dropping the legs aborts them) or after (the decode
                        // stream ends; the prefill leg's KV may never come).
                        let health = &st.inner.health;
                        let (p, d) = (&pair.prefill.rank, &pair.decode.rank);
                        let ((left_p, _), (left_d, progress)) =
                            (left_rank(health, p), left_rank(health, d));
                        let left = async move {
                            tokio::select! {
                                gone = left_p => gone,
                                gone = left_d => gone,
                            }
                        };
                        match unless_left(sent, left, progress).await {
                            Ok(sent) => sent,
                            Err(gone) => Err(pd::LegError::Transport {
                                role: if gone == *p {
                                    Role::Prefill
                                } else {
                                    Role::Decode
                                },
                                error: health::left_error(&gone.worker),
                                rank: gone,
                            }),
                        }
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
                    return relay(guard, response, false, None).await;
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
                return Err(RequestError::of(&e));
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
                    return relay(guard, resp, stream, migration).await;
                }
            },
        }
    }
    Err(match last_error {
        Some(e @ TransportError::Overloaded { .. }) => transport_error(e),
        Some(e @ TransportError::Timeout(_)) => RequestError::new(
            ErrorCode::GatewayTimeout,
            format!(
                "no worker answered within its deadline after {attempts} attempt(s); last error: {e}"
            ),
        ),
        other => RequestError::new(
            ErrorCode::BadGateway,
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
pub(crate) async fn first_chunk(body: &mut BodyStream) -> Option<Result<Bytes, TransportError>> {
    loop {
        match body.next().await? {
            Ok(chunk) if chunk.is_empty() => {}
            item => return Some(item),
        }
    }
}

/// The client's (already stamped) body as an object, for rewriting into PD legs.
fn pd_body(body: &Bytes) -> Result<Map<String, Value>, RequestError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(RequestError::new(
            ErrorCode::Internal,
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
fn transport_error(e: TransportError) -> RequestError {
    let retry_after = match &e {
        TransportError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
        _ => None,
    };
    let mut err = RequestError::of(&e);
    err.retry_after_s = retry_after;
    err
}

/// The client's answer from a worker's response: read whole, or relayed as a stream (see
/// [`ReplyBody::Stream`]); the attempt is finished at its end.
async fn relay(
    mut guard: Attempt,
    resp: Inbound,
    stream: bool,
    migration: Option<Box<Migration>>,
) -> Result<Reply, RequestError> {
    let Inbound {
        status: code,
        content_type,
        mut body,
    } = resp;
    let is_sse = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !(stream || is_sse) {
        let mut bytes = Vec::new();
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(data) => bytes.extend_from_slice(&data),
                Err(e) => {
                    guard.st.inner.metrics.transport_error(&e);
                    guard.finish(failure_status(&e), Usage::default());
                    return Err(RequestError::new(
                        e.code(),
                        format!("worker response failed midway: {e}"),
                    ));
                }
            }
        }
        guard.first_byte();
        guard.finish(status_of(code), usage_of(&bytes));
        return Ok(Reply {
            status: code,
            content_type,
            body: ReplyBody::Full(Bytes::from(bytes)),
        });
    }
    let status = status_of(code);
    let state = Some(StreamRelay {
        body,
        guard,
        status,
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
                    return Some((Ok(data), Some(r)));
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
                    return Some((Err(e), None));
                }
            }
        }
    });
    Ok(Reply {
        status: code,
        content_type,
        body: ReplyBody::Stream(s.boxed()),
    })
}

struct StreamRelay {
    body: BodyStream,
    guard: Attempt,
    status: RequestStatus,
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

/// Resolves with `rank` once its worker leaves routing, and the progress a stream from it
/// counts on (see [`health::Health::watch`]).
fn left_rank(
    health: &health::Health,
    rank: &WorkerRank,
) -> (
    impl std::future::Future<Output = WorkerRank> + Send + use<>,
    std::sync::Arc<health::Progress>,
) {
    let ((left, progress), rank) = (health.watch(&rank.worker), rank.clone());
    let left = async move {
        left.await;
        rank
    };
    (left, progress)
}

/// Races an attempt's `sent` against `left` (one of its workers leaving routing): the response,
/// whose body ends with the health error if a worker leaves later and counts its chunks on
/// `progress` (the streaming worker's); or the rank that left first.
async fn unless_left<E>(
    sent: impl std::future::Future<Output = Result<Inbound, E>>,
    left: impl std::future::Future<Output = WorkerRank> + Send + 'static,
    progress: std::sync::Arc<health::Progress>,
) -> Result<Result<Inbound, E>, WorkerRank> {
    let mut left = Box::pin(left);
    tokio::select! {
        sent = sent => Ok(sent.map(|mut resp| {
            let left = async move { left.await.worker };
            resp.body = health::guard_body(resp.body, left, progress);
            resp
        })),
        gone = &mut left => Err(gone),
    }
}
