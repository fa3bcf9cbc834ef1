//! The server's axum routes: request parsing and validation, retention stamping (PROTOCOLS.md §5),
//! tokenization on the blocking pool, hashing, and the status pages (`/v1/models`, `/health`,
//! `/v1/workers`, `/metrics`). Errors use the OpenAI shape `{"error": {"message", "type",
//! "code"}}` with one status per cause (400, 404, 413, 429 with `Retry-After`, 500, 502, 503,
//! 504).

use super::{ServerState, relay};
use crate::tokenize::{ChatMessage, TokenizeError};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use infera_core::event::Retention;
use infera_core::hashing::hash_blocks;
use infera_core::ids::{RequestId, WorkerRank};
use infera_core::policy::{DirectPick, PolicyKind, RouteError, RouteRequest};
use serde_json::{Map, Value, json};
use std::sync::atomic::{AtomicU64, Ordering};

/// The request-id header, echoed or generated.
pub(crate) const REQUEST_ID: &str = "x-infera-request-id";
/// Direct mode: the worker an external endpoint picker chose.
const WORKER_INSTANCE_ID: &str = "x-worker-instance-id";
/// Direct mode: the prefill worker of a disaggregated pair.
const PREFILL_INSTANCE_ID: &str = "x-prefill-instance-id";
/// Direct mode: the dp rank on the named worker.
const DP_RANK: &str = "x-dp-rank";

/// An error answered to the client.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    /// Sent as `Retry-After` (seconds) with a 429.
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
        match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::PAYLOAD_TOO_LARGE => "RequestTooLargeError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::BAD_GATEWAY => "BadGatewayError",
            StatusCode::GATEWAY_TIMEOUT => "TimeoutError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            s if s.is_client_error() => "BadRequestError",
            _ => "InternalServerError",
        }
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

/// The one mapping from a routing error to an HTTP status.
pub(crate) fn route_error(e: &RouteError) -> ApiError {
    let status = match e {
        RouteError::UnknownModel(_) => StatusCode::NOT_FOUND,
        RouteError::NoWorker { .. }
        | RouteError::UnknownWorker(_)
        | RouteError::Draining(_)
        | RouteError::UnknownRank { .. } => StatusCode::SERVICE_UNAVAILABLE,
        RouteError::WrongModel { .. } => StatusCode::BAD_REQUEST,
        RouteError::MissingBlockSize(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, e.to_string())
}

pub(crate) fn router(state: ServerState) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/cache/prewarm", post(super::prewarm::prewarm))
        .route("/v1/admin/profile/{action}", post(super::profile::profile))
        .route("/v1/models", get(models))
        .route("/v1/workers", get(workers))
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
            format!("infera-{:016x}-{n}", st.inner.id_prefix)
        })
}

async fn handle(st: ServerState, ep: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let id = request_id(&st, &headers);
    let mut resp = match pipeline(&st, ep, &headers, body, &id).await {
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
    resp
}

/// What to tokenize.
pub(super) enum Input {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

async fn pipeline(
    st: &ServerState,
    ep: Endpoint,
    headers: &HeaderMap,
    body: Body,
    id: &str,
) -> Result<Response, ApiError> {
    let max = st.inner.options.max_body_bytes;
    let bytes = read_body(body, headers, max).await?;
    let mut json: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}")))?;
    if ep == Endpoint::Messages {
        json = super::anthropic::to_chat(&json)?;
    }
    let obj = json
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    let model = match obj.get("model") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_request("`model` must be a string")),
        None => return Err(ApiError::bad_request("`model` is required")),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad_request("`stream` must be a boolean")),
    };
    let input = match ep {
        Endpoint::Completions => parse_prompt(obj.get("prompt"))?,
        Endpoint::Chat | Endpoint::Messages => parse_messages(obj.get("messages"))?,
    };
    let (retention, stamped) = stamp_retention(obj)?;
    let direct = if st.inner.options.direct {
        Some(direct_pick(headers)?)
    } else {
        None
    };
    // The client's bytes go on as they came wherever the stamp allows: re-encoding a long
    // prompt costs as much as parsing it.
    let forward_body = match stamped {
        Stamped::Kept if ep != Endpoint::Messages => bytes,
        Stamped::Added(stamp) if ep != Endpoint::Messages => append_params(&bytes, stamp),
        _ => Bytes::from(serde_json::to_vec(&json).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("re-encoding the body: {e}"),
            )
        })?),
    };

    let block_sizes: Vec<u32> = st.with_fleet(|f| {
        let mut v: Vec<u32> = f
            .workers()
            .filter(|w| w.model_name == model)
            .map(|w| w.kv_block_size)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    });
    if block_sizes.is_empty() {
        super::metrics::inc(&st.inner.metrics.decisions_unknown_model, 1);
        return Err(route_error(&RouteError::UnknownModel(model)));
    }
    // Round-robin ignores the prefix, so its requests are not tokenized at all.
    let needs_prefix = direct.is_some() || st.inner.options.router.policy != PolicyKind::RoundRobin;
    let tokens = if needs_prefix {
        tokenize(st, input).await?
    } else {
        Vec::new()
    };
    let hashes = if needs_prefix {
        block_sizes
            .into_iter()
            .map(|bs| (bs, hash_blocks(&tokens, bs.max(1) as usize, None)))
            .collect()
    } else {
        Vec::new()
    };
    if let Some(with_tokens) = st.meta_wants_tokens() {
        let session_id = headers
            .get("x-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| {
                json.get("session_id")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .filter(|s| !s.is_empty() && s.len() <= 256);
        st.feed_meta(super::RequestMeta {
            request_id: id.to_owned(),
            session_id,
            token_ids: (with_tokens && needs_prefix).then(|| tokens.clone()),
        });
    }
    let req = RouteRequest {
        request_id: RequestId::new(id),
        model,
        prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
        hashes,
        retention,
        exclude: Vec::<WorkerRank>::new(),
    };
    let model = req.model.clone();
    let resp = relay::forward(st, req, direct, ep.path(), forward_body, stream).await?;
    Ok(if ep == Endpoint::Messages {
        super::anthropic::from_chat(resp, stream, &model, id).await
    } else {
        resp
    })
}

/// The worker(s) named by the request's headers in direct mode.
fn direct_pick(headers: &HeaderMap) -> Result<DirectPick, ApiError> {
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
    let worker = text(WORKER_INSTANCE_ID)?.ok_or_else(|| {
        ApiError::bad_request(format!(
            "--router-mode direct: the {WORKER_INSTANCE_ID} header (the endpoint picker's choice) \
             is required"
        ))
    })?;
    let dp_rank = text(DP_RANK)?
        .map(|v| {
            v.parse::<u32>().map_err(|_| {
                ApiError::bad_request(format!("header {DP_RANK} must be a non-negative integer"))
            })
        })
        .transpose()?;
    Ok(DirectPick {
        worker,
        prefill: text(PREFILL_INSTANCE_ID)?,
        dp_rank,
    })
}

pub(super) async fn read_body(
    body: Body,
    headers: &HeaderMap,
    max: usize,
) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is larger than the server's limit of {max} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, max).await.map_err(|e| {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(s) = source {
            if s.is::<http_body_util::LengthLimitError>() {
                return too_large();
            }
            source = s.source();
        }
        ApiError::bad_request(format!("cannot read the request body: {e}"))
    })
}

pub(super) fn parse_prompt(value: Option<&Value>) -> Result<Input, ApiError> {
    const SHAPE: &str =
        "`prompt` must be a string, a list of token ids, or a list holding one of those";
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::bad_request(format!("`prompt[{i}]` must be a token id, got {v}"))
                    })
            })
            .collect()
    };
    match value {
        None => Err(ApiError::bad_request("`prompt` is required")),
        Some(Value::String(s)) => Ok(Input::Text(s.clone())),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(ApiError::bad_request("`prompt` must not be empty"))
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            ids(items).map(Input::Tokens)
        }
        Some(Value::Array(items)) if items.len() == 1 => match &items[0] {
            Value::String(s) => Ok(Input::Text(s.clone())),
            Value::Array(inner) => ids(inner).map(Input::Tokens),
            _ => Err(ApiError::bad_request(SHAPE)),
        },
        Some(Value::Array(_)) => Err(ApiError::bad_request(
            "`prompt` holds several prompts; send one prompt per request",
        )),
        Some(_) => Err(ApiError::bad_request(SHAPE)),
    }
}

pub(super) fn parse_messages(value: Option<&Value>) -> Result<Input, ApiError> {
    let value = value.ok_or_else(|| ApiError::bad_request("`messages` is required"))?;
    if !value.is_array() {
        return Err(ApiError::bad_request("`messages` must be an array"));
    }
    let messages: Vec<ChatMessage> = serde_json::from_value(value.clone())
        .map_err(|e| ApiError::bad_request(format!("`messages` is malformed: {e}")))?;
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` must not be empty"));
    }
    Ok(Input::Chat(messages))
}

/// How stamping the retention changed the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stamped {
    /// The client set `kv_transfer_params.infera_retention` itself.
    Kept,
    /// The body had no `kv_transfer_params`; it now holds just the stamp.
    Added(&'static str),
    /// An existing `kv_transfer_params` object gained the stamp.
    Edited,
}

/// The client's JSON object `body` with `"kv_transfer_params":{"infera_retention":stamp}` as
/// its last member: the object [`stamp_retention`] built, without re-encoding the rest.
/// `body` parsed as a JSON object that has `model`, so it ends with `}` after optional
/// whitespace and has a member before the new one.
fn append_params(body: &[u8], stamp: &str) -> Bytes {
    let end = body
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .unwrap_or(0);
    let mut out = Vec::with_capacity(body.len() + 64);
    out.extend_from_slice(&body[..end]);
    out.extend_from_slice(b",\"kv_transfer_params\":{\"infera_retention\":\"");
    out.extend_from_slice(stamp.as_bytes());
    out.extend_from_slice(b"\"}}");
    Bytes::from(out)
}

/// Reads the client's retention hint (PROTOCOLS.md §5) and stamps
/// `kv_transfer_params.infera_retention` into the body (client value kept, else derived from
/// `prompt_cache_retention`, else `long`). Returns the hint the router scales with and how the
/// body changed.
fn stamp_retention(obj: &mut Map<String, Value>) -> Result<(Option<Retention>, Stamped), ApiError> {
    let mut hint = None;
    let absent = !obj.contains_key("kv_transfer_params");
    match obj.get("kv_transfer_params") {
        None | Some(Value::Null) => {}
        Some(Value::Object(p)) => match p.get("infera_retention") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                hint = Some(Retention::parse(s).ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "`kv_transfer_params.infera_retention` must be none, short or long, got {s:?}"
                    ))
                })?);
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    "`kv_transfer_params.infera_retention` must be a string",
                ));
            }
        },
        Some(_) => {
            return Err(ApiError::bad_request(
                "`kv_transfer_params` must be an object",
            ));
        }
    }
    // The client's own stamp leaves the body as it came.
    let kept = hint.is_some();
    if hint.is_none() {
        hint = match obj.get("prompt_cache_retention").and_then(Value::as_str) {
            Some("24h" | "1h" | "long") => Some(Retention::Long),
            Some("5m" | "short") => Some(Retention::Short),
            Some("none" | "off") => Some(Retention::None),
            _ => None,
        };
    }
    let stamp = hint.unwrap_or(Retention::Long).as_str();
    let params = obj
        .entry("kv_transfer_params")
        .or_insert_with(|| Value::Object(Map::new()));
    if params.is_null() {
        *params = Value::Object(Map::new());
    }
    if let Value::Object(p) = params {
        let slot = p.entry("infera_retention").or_insert(Value::Null);
        if slot.is_null() {
            *slot = Value::String(stamp.to_owned());
        }
    }
    let stamped = if absent {
        Stamped::Added(stamp)
    } else if kept {
        Stamped::Kept
    } else {
        Stamped::Edited
    };
    Ok((hint, stamped))
}

pub(super) async fn tokenize(st: &ServerState, input: Input) -> Result<Vec<u32>, ApiError> {
    let tokenizer = st.inner.tokenizer.clone();
    let template = st.inner.options.chat_template.clone();
    let joined = tokio::task::spawn_blocking(move || match input {
        Input::Tokens(ids) => Ok(ids),
        Input::Text(text) => tokenizer.encode(&text),
        Input::Chat(messages) => tokenizer.encode_chat(&messages, template.as_deref()),
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("tokenizer task failed: {e}"),
        )
    })?;
    joined.map_err(|e| {
        super::metrics::inc(&st.inner.metrics.tokenizer_failures, 1);
        tracing::warn!(error = %e, "router tokenizer failed on a request");
        match e {
            TokenizeError::Template(t) => ApiError::bad_request(format!("chat template: {t}")),
            other => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, other.to_string()),
        }
    })
}

async fn models(State(st): State<ServerState>) -> Response {
    let data: Vec<Value> = st.with_fleet(|f| {
        f.models()
            .into_iter()
            .map(|m| json!({"id": m, "object": "model", "owned_by": "infera"}))
            .collect()
    });
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(st): State<ServerState>) -> Response {
    let n = st.worker_count();
    axum::Json(json!({"status": "ok", "active_workers": n})).into_response()
}

async fn workers(State(st): State<ServerState>) -> Response {
    let data: Vec<Value> = st.with_fleet(|f| {
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
                json!({
                    "record": w,
                    "draining": draining.is_some(),
                    "drain_reason": draining,
                    "load": ranks,
                })
            })
            .collect()
    });
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(st): State<ServerState>) -> Response {
    let (inflight, workers, active) = st.with_fleet(|f| {
        let active: u64 = f
            .workers()
            .flat_map(|w| {
                (w.dp_rank..w.dp_rank + w.dp_size.max(1))
                    .map(|r| WorkerRank::new(w.worker_id.clone(), r))
            })
            .map(|r| f.active_blocks(&r))
            .sum();
        (f.inflight_requests(), f.worker_count(), active)
    });
    let mut text = st.inner.metrics.render(inflight, workers, active);
    st.render_extra_metrics(&mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What the engine receives for a client body: the stamped object, and the bytes forwarded.
    fn forwarded(body: &str) -> (Option<Retention>, Value) {
        let mut json: Value = serde_json::from_str(body).unwrap();
        let obj = json.as_object_mut().unwrap();
        let (hint, stamped) = stamp_retention(obj).unwrap();
        let bytes = match stamped {
            Stamped::Kept => Bytes::copy_from_slice(body.as_bytes()),
            Stamped::Added(stamp) => append_params(body.as_bytes(), stamp),
            Stamped::Edited => Bytes::from(serde_json::to_vec(&json).unwrap()),
        };
        let sent: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            sent, json,
            "the forwarded bytes say what the stamped object says"
        );
        (hint, sent)
    }

    #[test]
    fn retention_is_stamped_for_the_engine() {
        // No hint: `long`, appended after the client's own members (trailing space kept out).
        let (hint, sent) = forwarded("{\"model\":\"m\",\"prompt\":\"hi\"}  \n");
        assert_eq!(hint, None);
        assert_eq!(
            sent["kv_transfer_params"],
            json!({"infera_retention": "long"})
        );
        assert_eq!(sent["prompt"], "hi");
        // OpenAI's prompt_cache_retention maps onto a class.
        let (hint, sent) = forwarded(r#"{"model":"m","prompt_cache_retention":"5m"}"#);
        assert_eq!(hint, Some(Retention::Short));
        assert_eq!(sent["kv_transfer_params"]["infera_retention"], "short");
        // The client's own stamp wins and its other transfer params stay.
        let (hint, sent) = forwarded(
            r#"{"model":"m","prompt_cache_retention":"24h","kv_transfer_params":{"infera_retention":"none","x":1}}"#,
        );
        assert_eq!(hint, Some(Retention::None));
        assert_eq!(
            sent["kv_transfer_params"],
            json!({"infera_retention": "none", "x": 1})
        );
        // Existing params without a stamp, or null, gain one.
        let (_, sent) = forwarded(r#"{"model":"m","kv_transfer_params":{"x":1}}"#);
        assert_eq!(
            sent["kv_transfer_params"],
            json!({"infera_retention": "long", "x": 1})
        );
        let (_, sent) = forwarded(r#"{"model":"m","kv_transfer_params":null}"#);
        assert_eq!(
            sent["kv_transfer_params"],
            json!({"infera_retention": "long"})
        );
    }

    #[test]
    fn bad_retention_hints_are_refused_naming_the_field() {
        for body in [
            json!({"model": "m", "kv_transfer_params": 3}),
            json!({"model": "m", "kv_transfer_params": {"infera_retention": 1}}),
            json!({"model": "m", "kv_transfer_params": {"infera_retention": "forever"}}),
        ] {
            let mut body = body;
            let err = stamp_retention(body.as_object_mut().unwrap()).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert!(
                err.message.contains("kv_transfer_params"),
                "{}",
                err.message
            );
        }
    }
}
