//! The HTTP request transport (PROTOCOLS §2): decide, forward the client's body to
//! `worker.url + path`, relay status and body; fail over before the first response byte.
//!
//! Each attempt is an [`Attempt`] that owns the request's load in the fleet: it appends
//! `RequestPrefilled` at the first response byte and exactly one `RequestFinished` — explicitly,
//! or on drop (`cancelled`) when the client goes away. Streams are relayed frame by frame as they
//! arrive; a worker failure mid-stream ends the client's stream with an SSE error event and
//! `data: [DONE]`.
//!
//! The client is hyper-util's pooled HTTP/1 client (plain HTTP, no TLS: workers are in-cluster).

use super::http::{ApiError, REQUEST_ID, route_error};
use super::metrics::inc;
use super::{Core, ServerState};
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::Response;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use infera_core::event::{Event, RequestFinished, RequestPrefilled, RequestStatus};
use infera_core::ids::{RequestId, WorkerRank};
use infera_core::log::NewEvent;
use infera_core::policy::{DirectPick, RouteError, RouteRequest};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::time::Instant;

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Decides, appends `RequestRouted` and applies it; returns the chosen rank and its URL.
fn decide(
    st: &ServerState,
    req: &RouteRequest,
    direct: Option<&DirectPick>,
) -> Result<(WorkerRank, String), RouteError> {
    let now = st.inner.clock.now_us();
    let metrics = &st.inner.metrics;
    let mut core = st.lock();
    let Core { fleet, router, .. } = &mut *core;
    let decision = match direct {
        Some(pick) => router.decide_direct(fleet, req, pick, now),
        None => router.decide(fleet, req, now),
    };
    let routed = match decision {
        Ok(r) => r,
        Err(e) => {
            match &e {
                RouteError::UnknownModel(_) => inc(&metrics.decisions_unknown_model, 1),
                _ => inc(&metrics.decisions_no_worker, 1),
            }
            return Err(e);
        }
    };
    let Some(leg) = routed.legs.first().cloned() else {
        inc(&metrics.decisions_no_worker, 1);
        return Err(RouteError::NoWorker {
            model: req.model.clone(),
            role: "mixed",
        });
    };
    let url = fleet
        .worker(&leg.worker.worker)
        .map(|w| w.url.trim_end_matches('/').to_owned())
        .unwrap_or_default();
    inc(&metrics.picks, 1);
    inc(&metrics.pick_request_blocks, routed.blocks.len() as u64);
    if leg.overlap_blocks > 0 {
        inc(&metrics.pick_cache_hits, 1);
    }
    let applied = core.commit(vec![NewEvent::new(Event::RequestRouted(routed))]);
    drop(core);
    metrics.events_applied(applied as u64);
    Ok((leg.worker, url))
}

/// One attempt's lifecycle in the fleet. See the module docs.
#[derive(Debug)]
struct Attempt {
    st: ServerState,
    id: RequestId,
    started: Instant,
    prompt_tokens: u32,
    ttft_us: Option<u64>,
    done: bool,
}

impl Attempt {
    fn prefilled(&mut self) {
        if self.ttft_us.is_some() {
            return;
        }
        self.ttft_us = Some(self.started.elapsed().as_micros() as u64);
        self.st.apply(vec![NewEvent::new(Event::RequestPrefilled(
            RequestPrefilled {
                request_id: self.id.clone(),
            },
        ))]);
    }

    fn finish(&mut self, status: RequestStatus, usage: Usage) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let m = &self.st.inner.metrics;
        inc(
            match status {
                RequestStatus::Ok => &m.requests_ok,
                RequestStatus::ClientError | RequestStatus::Rejected => &m.requests_client_error,
                RequestStatus::Cancelled => &m.requests_cancelled,
                RequestStatus::WorkerError | RequestStatus::Timeout => &m.requests_worker_error,
            },
            1,
        );
        inc(
            &m.request_duration_us_sum,
            self.started.elapsed().as_micros() as u64,
        );
        inc(&m.request_duration_count, 1);
        self.st.apply(vec![NewEvent::new(Event::RequestFinished(
            RequestFinished {
                request_id: self.id.clone(),
                status,
                ttft_us: self.ttft_us,
                tokens_in: usage.prompt_tokens.unwrap_or(self.prompt_tokens),
                tokens_out: usage.completion_tokens.unwrap_or(0),
                cached_tokens: usage.cached_tokens,
            },
        ))]);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.finish(RequestStatus::Cancelled, Usage::default());
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    cached_tokens: Option<u32>,
}

fn usage_of(body: &[u8]) -> Usage {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Usage::default();
    };
    let u = &v["usage"];
    let n = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    Usage {
        prompt_tokens: n(&u["prompt_tokens"]),
        completion_tokens: n(&u["completion_tokens"]),
        cached_tokens: n(&u["prompt_tokens_details"]["cached_tokens"]),
    }
}

fn status_of(code: StatusCode) -> RequestStatus {
    if code.is_success() {
        RequestStatus::Ok
    } else if code.is_client_error() {
        RequestStatus::ClientError
    } else {
        RequestStatus::WorkerError
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
    let base_id = req.request_id.0.clone();
    // The worker an endpoint picker named is not replaced by another.
    let attempts = if direct.is_some() {
        1
    } else {
        st.inner.options.request_max_retries.saturating_add(1)
    };
    let mut last_error: Option<String> = None;
    for attempt in 0..attempts {
        if attempt > 0 {
            req.request_id = RequestId::new(format!("{base_id}#{attempt}"));
            inc(&st.inner.metrics.retries, 1);
        }
        let (rank, url) = match decide(st, &req, direct.as_ref()) {
            Ok(x) => x,
            Err(RouteError::NoWorker { .. }) if last_error.is_some() => break,
            Err(e) => return Err(route_error(&e)),
        };
        let mut guard = Attempt {
            st: st.clone(),
            id: req.request_id.clone(),
            started: Instant::now(),
            prompt_tokens: req.prompt_tokens,
            ttft_us: None,
            done: false,
        };
        let target = format!("{url}{path}");
        let mut builder = Request::post(&target).header(header::CONTENT_TYPE, "application/json");
        if let Ok(v) = HeaderValue::from_str(&base_id) {
            builder = builder.header(REQUEST_ID, v);
        }
        let http_req = builder.body(Full::new(body.clone())).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot build the request to {target}: {e}"),
            )
        })?;
        let last_attempt = attempt + 1 == attempts;
        match st.inner.client.request(http_req).await {
            Err(e) => {
                tracing::warn!(request_id = %base_id, worker = %rank.worker.as_str(),
                    dp_rank = rank.dp_rank, error = %e, "worker unreachable; failing over");
                guard.finish(RequestStatus::WorkerError, Usage::default());
                last_error = Some(format!("worker {} at {url}: {e}", rank.worker.as_str()));
                req.exclude.push(rank);
            }
            Ok(resp) if resp.status().is_server_error() && !last_attempt => {
                tracing::warn!(request_id = %base_id, worker = %rank.worker.as_str(),
                    status = %resp.status(), "worker answered 5xx before any byte; failing over");
                guard.finish(RequestStatus::WorkerError, Usage::default());
                last_error = Some(format!(
                    "worker {} answered {}",
                    rank.worker.as_str(),
                    resp.status()
                ));
                req.exclude.push(rank);
            }
            Ok(resp) => return Ok(relay(guard, resp, stream).await),
        }
    }
    Err(ApiError::new(
        StatusCode::BAD_GATEWAY,
        format!(
            "no worker could serve the request after {attempts} attempt(s); last error: {}",
            last_error.unwrap_or_default()
        ),
    ))
}

async fn relay(mut guard: Attempt, resp: hyper::Response<Incoming>, stream: bool) -> Response {
    let (parts, body) = resp.into_parts();
    let is_sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut out = Response::builder().status(parts.status);
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        out = out.header(header::CONTENT_TYPE, ct.clone());
    }
    if !(stream || is_sse) {
        return match body.collect().await {
            Ok(collected) => {
                let bytes = collected.to_bytes();
                guard.prefilled();
                guard.finish(status_of(parts.status), usage_of(&bytes));
                out.body(Body::from(bytes))
                    .unwrap_or_else(|_| Response::new(Body::empty()))
            }
            Err(e) => {
                guard.finish(RequestStatus::WorkerError, Usage::default());
                let err = ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    format!("worker response failed midway: {e}"),
                );
                axum::response::IntoResponse::into_response(err)
            }
        };
    }
    let status = status_of(parts.status);
    let state = Some(StreamRelay {
        body,
        guard,
        status,
        last_byte: b'\n',
        usage: Usage::default(),
    });
    let s = futures::stream::unfold(state, |state| async move {
        let mut r = state?;
        loop {
            match r.body.frame().await {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: nothing to relay
                    };
                    if data.is_empty() {
                        continue;
                    }
                    r.guard.prefilled();
                    r.scan_usage(&data);
                    r.last_byte = data.last().copied().unwrap_or(b'\n');
                    return Some((Ok::<Bytes, Infallible>(data), Some(r)));
                }
                None => {
                    r.guard.finish(r.status, r.usage);
                    return None;
                }
                Some(Err(e)) => {
                    r.guard.finish(RequestStatus::WorkerError, Usage::default());
                    let err = json!({"error": {"message": format!("worker stream failed: {e}"),
                        "type": "BadGatewayError", "code": 502}});
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
    body: Incoming,
    guard: Attempt,
    status: RequestStatus,
    last_byte: u8,
    /// The usage of the stream's usage chunk (`stream_options.include_usage`), when seen whole
    /// within one frame.
    usage: Usage,
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
