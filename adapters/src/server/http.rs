//! The server's axum routes: the request front (body read and parsed by the `body` module
//! within the parse budget, retention stamped per PROTOCOLS.md §5, then the request service:
//! prepare and forward; its reply and errors translated back), the admin routes behind the `client` module's token guard, and the status
//! pages (`/v1/models`, `/health`, `/v1/workers`, `/metrics`). Errors use the OpenAI shape
//! `{"error": {"message", "type", "code"}}` with one status per cause (400, 401, 404, 408, 413,
//! 429 and 503 with `Retry-After`, 500, 502, 504).

use super::ServerState;
use super::body::Shape;
use crate::tokenize::{ChatExtras, ChatMessage};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt as _;
use futures::stream::BoxStream;
use infera_core::error::{ErrorCode, ServiceError as _};
use infera_core::hashing::KvIdentity;
use infera_core::ids::{SessionKey, WorkerRank};
use infera_core::policy::{DirectPick, RouteError};
use infera_core::ports::trace::TARGET;
use infera_core::ports::transport::TransportError;
use infera_core::service::metrics::text;
use infera_core::service::{Prepared, Reply, ReplyBody, RequestError, RequestKeys, Share};
use infera_core::tenancy::Tenant;
use serde::Deserialize as _;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tracing::Instrument as _;

/// The request-id header, echoed or generated.
pub(crate) const REQUEST_ID: &str = "x-infera-request-id";
/// Direct mode: the worker an external endpoint picker chose.
const WORKER_INSTANCE_ID: &str = "x-worker-instance-id";
/// Direct mode: the prefill worker of a disaggregated pair.
const PREFILL_INSTANCE_ID: &str = "x-prefill-instance-id";
/// Direct mode: the dp rank on the named worker.
const DP_RANK: &str = "x-dp-rank";
/// The request's priority in the router's queue when the body has no `priority`.
const PRIORITY: &str = "x-infera-priority";

/// An error answered to the client.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    /// Sent as `Retry-After` (seconds) with a 429 or 503.
    pub(crate) retry_after_s: Option<u32>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after_s: None,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn kind(&self) -> &'static str {
        ErrorCode::of_status(self.status).openai_type()
    }

    pub(crate) fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        Self {
            status: e.status(),
            message: e.message,
            retry_after_s: e.retry_after_s,
        }
    }
}

/// A worker's answer as the client's response. A stream that the service ends with a failure
/// ends with an SSE error event (`code` 502 or 504) and `data: [DONE]`, never silently
/// truncated.
pub(super) fn reply_response(reply: Reply) -> Response {
    let mut out = Response::builder().status(reply.status);
    if let Some(ct) = reply.content_type {
        out = out.header(header::CONTENT_TYPE, ct);
    }
    match reply.body {
        ReplyBody::Full(bytes) => out.body(Body::from(bytes)),
        ReplyBody::Stream(s) => out
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(with_error_event(s))),
    }
    .unwrap_or_else(|_| Response::new(Body::empty()))
}

/// `s` with its failure (the last item, if any) as an OpenAI SSE error event, in a frame of
/// its own.
fn with_error_event(
    s: BoxStream<'static, Result<Bytes, TransportError>>,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    let mut last_byte = b'\n';
    s.map(move |item| {
        Ok(match item {
            Ok(data) => {
                last_byte = data.last().copied().unwrap_or(last_byte);
                data
            }
            Err(e) => {
                let err =
                    ApiError::new(e.code().http_status(), format!("worker stream failed: {e}"));
                let sep = if last_byte == b'\n' { "" } else { "\n\n" };
                Bytes::from(format!("{sep}data: {}\n\ndata: [DONE]\n\n", err.body()))
            }
        })
    })
}

/// A routing error as the client's answer (its status from [`ErrorCode`]'s table).
pub(crate) fn route_error(e: &RouteError) -> ApiError {
    ApiError::new(e.code().http_status(), e.to_string())
}

pub(crate) fn router(state: ServerState) -> axum::Router {
    // Admin routes first: the guard covers the routes added before it.
    axum::Router::new()
        .route("/v1/admin/profile/{action}", post(super::profile::profile))
        .route(
            "/v1/admin/scale",
            get(super::scale::get_scale).post(super::scale::post_scale),
        )
        .route("/v1/admin/tuning", get(super::tuning::get_tuning))
        .route("/v1/workers", get(workers))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            super::client::require_admin,
        ))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/cache/prewarm", post(super::prewarm::prewarm))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
    /// Anthropic's Messages API, served as a chat completion ([`super::anthropic`]).
    Messages,
}

impl Endpoint {
    /// The request span's name: the method and the route (OpenTelemetry's HTTP server spans).
    fn span_name(self) -> &'static str {
        match self {
            Endpoint::Completions => "POST /v1/completions",
            Endpoint::Chat => "POST /v1/chat/completions",
            Endpoint::Messages => "POST /v1/messages",
        }
    }

    /// The engine path the request is forwarded to.
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat | Endpoint::Messages => "/v1/chat/completions",
        }
    }
}

async fn completions(State(st): State<ServerState>, headers: HeaderMap, body: Body) -> Response {
    handle(st, Endpoint::Completions, headers, body).await
}

async fn chat_completions(
    State(st): State<ServerState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(st, Endpoint::Chat, headers, body).await
}

async fn messages(State(st): State<ServerState>, headers: HeaderMap, body: Body) -> Response {
    handle(st, Endpoint::Messages, headers, body).await
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn request_id(st: &ServerState, headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map(str::to_owned)
        .unwrap_or_else(|| {
            let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            format!("infera-{:016x}-{n}", st.service().id_prefix())
        })
}

/// The request's span (see `infera_core::ports::trace`), the client's `traceparent` its
/// parent; disabled unless traces are exported.
fn request_span(st: &ServerState, ep: Endpoint, id: &str, headers: &HeaderMap) -> tracing::Span {
    let span = tracing::trace_span!(
        target: TARGET,
        "request",
        otel.name = ep.span_name(),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = "POST",
        url.path = ep.span_name().trim_start_matches("POST "),
        infera.request_id = id,
        gen_ai.request.model = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    if let Some(trace) = st.service().trace_context()
        && !span.is_disabled()
    {
        trace.adopt(&span, headers);
    }
    span
}

async fn handle(st: ServerState, ep: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let id = request_id(&st, &headers);
    let span = request_span(&st, ep, &id, &headers);
    let tenant = match &st.inner.options.client.api_keys {
        None => Ok(Arc::clone(&st.inner.anonymous)),
        Some(keys) => keys.authenticate(&headers),
    };
    let answered = match &tenant {
        Ok(tenant) => {
            pipeline(&st, ep, &headers, body, &id, tenant)
                .instrument(span.clone())
                .await
        }
        Err(e) => Err(e.clone()),
    };
    let mut resp = match answered {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(request_id = %id, status = %e.status, error = %e.message, "request rejected");
            if ep == Endpoint::Messages {
                let body = super::anthropic::error_body(e.status, &e.message);
                (e.status, axum::Json(body)).into_response()
            } else {
                e.into_response()
            }
        }
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    if !span.is_disabled() {
        span.record(
            "http.response.status_code",
            i64::from(resp.status().as_u16()),
        );
        if resp.status().is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
    }
    match tenant {
        Ok(t) if t.limits.any() => {
            let now = st.service().clock().now_us();
            super::tenants::rate_headers(resp.headers_mut(), t.usage.standing(now));
        }
        Ok(_) => {}
        Err(_) => {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
    }
    resp
}

/// What to tokenize: the front's prompt type for the service's tokenizer port (`pub` for that
/// impl; the module is private).
#[derive(Debug, Clone)]
pub enum Input {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>, ChatExtras),
}

async fn pipeline(
    st: &ServerState,
    ep: Endpoint,
    headers: &HeaderMap,
    body: Body,
    id: &str,
    tenant: &Arc<Tenant>,
) -> Result<Response, ApiError> {
    let options = &st.inner.options;
    let parse =
        tracing::trace_span!(target: TARGET, "parse", infera.body_bytes = tracing::field::Empty);
    let (bytes, mut parse_charge) = super::body::read_limited(
        body,
        headers,
        options.service.max_body_bytes,
        Some(&options.client.parse_budget),
    )
    .instrument(parse.clone())
    .await?;
    let _parsing = parse.enter();
    parse.record("infera.body_bytes", bytes.len() as i64);
    let (bytes, shape) = match ep {
        Endpoint::Completions => (bytes, Shape::Prompt),
        Endpoint::Chat => (bytes, Shape::Messages),
        // Anthropic bodies are translated as a tree, then read as the chat body they become.
        Endpoint::Messages => {
            super::body::charge_tree(&options.client.parse_budget, &mut parse_charge, bytes.len())?;
            let json: Value = serde_json::from_slice(&bytes).map_err(|e| {
                ApiError::bad_request(format!("request body is not valid JSON: {e}"))
            })?;
            let chat = serde_json::to_vec(&super::anthropic::to_chat(&json)?).map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("re-encoding the body: {e}"),
                )
            })?;
            (Bytes::from(chat), Shape::Messages)
        }
    };
    let super::body::Parsed {
        model,
        stream,
        input,
        retention,
        forward: forward_body,
        session_id,
        cache_salt,
        priority,
    } = super::body::parse(bytes, shape, options.client.default_retention)?;
    drop(_parsing);
    tracing::Span::current().record("gen_ai.request.model", model.as_str());
    let seen = retention.map_or("none", infera_core::event::Retention::as_str);
    st.service().metrics().retention_seen(seen);
    let direct = if options.direct {
        direct_pick(headers)?
    } else {
        None
    };

    st.ensure_served(&model).await?;
    let key = st.service().request_key(id);
    // The conversation: the `x-session-id` header, else the body's (see `body::Parsed`).
    let session_id = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .or(session_id);
    let Prepared {
        req,
        tokens,
        images,
        tokenized,
    } = st
        .service()
        .prepare(
            st,
            &key,
            model,
            input,
            RequestKeys {
                retention,
                direct: direct.is_some(),
                identity: KvIdentity {
                    salt: cache_salt.clone(),
                    ..KvIdentity::default()
                },
                session: session_id.as_deref().map(SessionKey::of),
            },
        )
        .instrument(tracing::trace_span!(target: TARGET, "tokenize"))
        .await?;
    let asked = priority.or_else(|| {
        headers
            .get(PRIORITY)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok())
    });
    if let Some(with_tokens) = st.service().meta_wants_tokens() {
        let base = st
            .service()
            .with_fleet(|f| f.served(&req.model).and_then(|s| s.parent.clone()));
        st.service().feed_meta(super::RequestMeta {
            request_id: key,
            session_id: session_id.filter(|s| s.len() <= 256),
            token_ids: (with_tokens && tokenized).then_some(tokens),
            adapter: base.map(|base| (req.model.clone(), base)),
            cache_salt: cache_salt.map(String::from),
            images,
            priority: asked,
        });
    }
    // Parsed: the body's charge to the parse budget ends here.
    drop(parse_charge);
    let permit = if tenant.limits.any() {
        // Round-robin does not tokenize: its prompts are counted at 4 bytes a token.
        let prompt = if tokenized {
            u64::from(req.prompt_tokens)
        } else {
            forward_body.len() as u64 / 4
        };
        let now = st.service().clock().now_us();
        let share = options.client.api_keys.as_ref().map_or(1, |k| k.share());
        match tenant.usage.admit(now, prompt, share) {
            Ok(p) => Some(p),
            Err(refusal) => {
                st.service().rate_limited(&tenant.name, refusal.limit);
                return Err(super::tenants::limited(tenant, refusal));
            }
        }
    } else {
        None
    };
    let share = Share::of(tenant, tenant.priority(asked), permit);
    let model = req.model.clone();
    let reply = st
        .service()
        .forward(req, direct, share, ep.path(), forward_body, stream)
        .await?;
    let resp = reply_response(reply);
    Ok(if ep == Endpoint::Messages {
        super::anthropic::from_chat(resp, stream, &model, id).await
    } else {
        resp
    })
}

/// The worker(s) named by the request's headers in direct mode; `None` without the worker
/// header, which the policy then picks for (as the Python Infera does).
fn direct_pick(headers: &HeaderMap) -> Result<Option<DirectPick>, ApiError> {
    let text = |name: &str| -> Result<Option<String>, ApiError> {
        match headers.get(name) {
            None => Ok(None),
            Some(v) => v
                .to_str()
                .ok()
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(|v| Some(v.to_owned()))
                .ok_or_else(|| {
                    ApiError::bad_request(format!("header {name} must be visible ASCII"))
                }),
        }
    };
    let Some(worker) = text(WORKER_INSTANCE_ID)? else {
        return Ok(None);
    };
    let dp_rank = text(DP_RANK)?
        .map(|v| {
            v.parse::<u32>().map_err(|_| {
                ApiError::bad_request(format!("header {DP_RANK} must be a non-negative integer"))
            })
        })
        .transpose()?;
    Ok(Some(DirectPick {
        worker,
        prefill: text(PREFILL_INSTANCE_ID)?,
        dp_rank,
    }))
}

/// Reads `body` whole (see [`super::body::read_limited`]), outside the parse budget.
pub(super) async fn read_body(
    body: Body,
    headers: &HeaderMap,
    max: usize,
) -> Result<Bytes, ApiError> {
    super::body::read_limited(body, headers, max, None)
        .await
        .map(|(bytes, _)| bytes)
}

/// The completions input of a parsed `prompt` (see [`super::prompt`]).
pub(super) fn parse_prompt(value: Option<&Value>) -> Result<Input, ApiError> {
    match value {
        None => Err(ApiError::bad_request("`prompt` is required")),
        Some(v) => super::body::prompt_input(v, 0),
    }
}

/// The chat input of a parsed chat body: its `messages` and what else its template renders.
pub(super) fn parse_chat(body: &Value) -> Result<Input, ApiError> {
    let value = body
        .get("messages")
        .ok_or_else(|| ApiError::bad_request("`messages` is required"))?;
    let messages =
        super::body::messages_input(value.is_array(), || Vec::<ChatMessage>::deserialize(value))?;
    let extras = ChatExtras::deserialize(body)
        .map_err(|e| ApiError::bad_request(format!("the chat request is malformed: {e}")))?;
    Ok(Input::Chat(messages, extras))
}

async fn models(State(st): State<ServerState>) -> Response {
    let data: Vec<Value> = st.service().with_fleet(|f| {
        f.models()
            .into_iter()
            .map(|(id, served)| {
                // vLLM lists an adapter with its base model as `parent` (and `root`).
                let parent = served.parent.as_deref();
                json!({"id": id, "object": "model", "owned_by": "infera",
                       "root": parent.unwrap_or(id), "parent": parent})
            })
            .collect()
    });
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(st): State<ServerState>) -> Response {
    let n = st.worker_count();
    axum::Json(json!({"status": "ok", "active_workers": n})).into_response()
}

async fn workers(State(st): State<ServerState>) -> Response {
    let (health_out, outliers) = st.service().ejected_workers();
    let data: Vec<Value> = st.service().with_fleet(|f| {
        f.workers()
            .map(|w| {
                let ranks: Vec<Value> = (w.dp_rank..w.dp_rank + w.dp_size.max(1))
                    .map(|r| {
                        let rank = WorkerRank::new(w.worker_id.clone(), r);
                        json!({
                            "dp_rank": r,
                            "inflight": f.inflight_on(&rank),
                            "active_blocks": f.active_blocks(&rank),
                            "queued_prefill_tokens": f.queued_prefill_tokens(&rank),
                            "cached_blocks": f.index().blocks_of(&rank, infera_core::event::Tier::Gpu),
                        })
                    })
                    .collect();
                let draining = f.drain_reason(&w.worker_id);
                let kvd = f.kvd_link(&w.worker_id).map(|link| kvd_view(f, link));
                json!({
                    "record": w,
                    "kvd": kvd,
                    "draining": draining.is_some(),
                    "drain_reason": draining,
                    "breaker": st.service().breaker_state(&w.worker_id).as_str(),
                    "health_out": health_out.contains(&w.worker_id),
                    "outlier_ejected": outliers.contains(&w.worker_id),
                    "load": ranks,
                })
            })
            .collect()
    });
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// What the router knows of a worker's node kvd: its blocks per lower tier and the speeds it
/// measured (bytes per second).
fn kvd_view(
    f: &infera_core::fleet::FleetState,
    link: &infera_core::kv_events::kvd::KvdLink,
) -> Value {
    use infera_core::event::Tier;
    let source = link.source();
    let slot = f.index().slot(&source);
    let tiers: serde_json::Map<String, Value> = [Tier::Host, Tier::Disk, Tier::External]
        .into_iter()
        .map(|t| {
            let speed = slot.and_then(|s| f.tier_load(s, t)).map(|l| l.bytes_per_s);
            let view =
                json!({"blocks": f.index().blocks_of(&source, t), "load_bytes_per_s": speed});
            (t.as_str().to_owned(), view)
        })
        .collect();
    json!({"endpoint": link.endpoint, "tiers": tiers})
}

async fn metrics(State(st): State<ServerState>) -> Response {
    let exposition = st.service().render_metrics();
    ([(header::CONTENT_TYPE, text::CONTENT_TYPE)], exposition).into_response()
}
