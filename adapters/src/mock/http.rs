//! The mock's HTTP surface (axum): OpenAI completions and chat (streaming and not), models,
//! health and metrics, the PD legs a PD-role mock accepted (`GET /mock/pd-legs`), and SGLang's
//! `POST /abort_request` with the aborts it received (`GET /mock/pd-aborts`).
//!
//! A generation request is parsed, tokenized off the async threads (`spawn_blocking`), hashed
//! into router block hashes, checked against the cache size, looked up in the block store when
//! the mock has one (`kvd`), and submitted to the engine loop; the handler then follows the
//! request's [`Progress`] watch, and saves the request's blocks to the store once it finished,
//! before the answer ends. Streaming answers are SSE:
//! one `data: {chunk}` per generated token (the last one with `finish_reason`), an optional
//! usage chunk (`stream_options.include_usage`), then `data: [DONE]`. Dropping the response
//! (the client went away) drops the watch receiver, which the engine loop notices.

use super::engine::{Outcome, Progress, Submission};
use super::kvd::retention_of;
use super::metrics::{MockMetrics, StaticInfo};
use super::openai::{
    ApiError, ChatRequest, CompletionRequest, Endpoint, Prompt, ResponseMeta, filler, filler_start,
    filler_start_ids, output_tokens, parse_prompt, usage,
};
use super::sse::{StreamState, sse_response};
use crate::tokenize::{
    ChatContent, ChatExtras, ChatMessage, ContentPart, TemplateKwargs, Tokenizer,
};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use infera_core::hashing::identity::MmRun;
use infera_core::hashing::{KvIdentity, hash_prompt_blocks};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct AppState {
    pub model_name: String,
    /// The LoRA adapters served (`--lora-modules`, and loaded at run time), by name.
    pub adapters: std::sync::RwLock<Vec<String>>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub engine: mpsc::Sender<Submission>,
    pub metrics: Arc<MockMetrics>,
    pub info: StaticInfo,
    pub id_prefix: u64,
    pub next_id: AtomicU64,
    pub pd: Option<super::pd::MockPd>,
    pub pd_log: super::pd::LegLog,
    pub aborts: super::abort::Aborts,
    /// The block store behind the GPU cache, if any (see `kvd`).
    pub kvd: Option<super::kvd::Tier>,
    /// Merged into every chat before it renders (`MockConfig::chat_template_defaults`).
    pub template_defaults: TemplateKwargs,
    /// The token ids of each [`super::FILLER`] word (what `return_token_ids` reports).
    pub filler_ids: Vec<Vec<u32>>,
}

impl AppState {
    /// The adapters served now.
    pub fn adapters(&self) -> Vec<String> {
        self.adapters
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The token ids of generated word `word` (its place in the filler cycle).
    pub fn word_ids(&self, word: u32) -> &[u32] {
        self.filler_ids
            .get(word as usize % self.filler_ids.len().max(1))
            .map_or(&[], Vec::as_slice)
    }

    /// The token ids of each filler word, with `tokenizer` or one per byte.
    pub fn filler_ids(tokenizer: Option<&Tokenizer>) -> Vec<Vec<u32>> {
        super::FILLER
            .iter()
            .map(|word| match tokenizer {
                Some(t) => t.encode(word).unwrap_or_else(|_| byte_tokens(word)),
                None => byte_tokens(word),
            })
            .collect()
    }
}

/// The routes, with the body limit applied to every one.
pub(crate) fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/mock/pd-legs", get(pd_legs))
        .route("/abort_request", post(abort_request))
        .route("/mock/pd-aborts", get(pd_aborts))
        .route("/health", get(health))
        .route("/get_server_info", get(server_info))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

async fn pd_legs(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(json!({ "legs": st.pd_log.snapshot() })).into_response()
}

async fn pd_aborts(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(json!({ "aborts": st.aborts.snapshot() })).into_response()
}

/// SGLang's `POST /abort_request` (see [`super::abort`]).
async fn abort_request(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = parse_body::<Value>(body)
        .and_then(|v| st.aborts.abort(&v))
        .map(|v| axum::Json(v).into_response());
    respond(&st, result)
}

/// The PD role's check of one request (see [`super::pd`]); a mixed mock accepts anything.
fn pd_accept(
    st: &AppState,
    headers: &HeaderMap,
    fields: &super::pd::PdFields,
    max_tokens: Option<i64>,
    stream: bool,
) -> Result<super::pd::Accepted, ApiError> {
    let dp_rank = dp_rank_header(headers)?;
    match &st.pd {
        Some(pd) => super::pd::accept(pd, &st.pd_log, fields, dp_rank, max_tokens, stream),
        None => Ok(super::pd::Accepted::default()),
    }
}

/// The DP rank a request is pinned to (`X-data-parallel-rank`), if any.
///
/// # Errors
/// 400 when the header is not a non-negative integer (vLLM and SGLang read it as one).
fn dp_rank_header(headers: &HeaderMap) -> Result<Option<u32>, ApiError> {
    let Some(v) = headers.get(infera_core::ports::transport::DP_RANK_HEADER) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map(Some)
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "header {} must be a non-negative integer",
                infera_core::ports::transport::DP_RANK_HEADER
            ))
        })
}

/// SGLang's request id of a request (`rid`), if its body names one.
///
/// # Errors
/// 400 when `rid` is not a non-empty string.
fn rid_of(fields: &super::pd::PdFields) -> Result<Option<String>, ApiError> {
    match &fields.rid {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(r)) if !r.is_empty() => Ok(Some(r.clone())),
        Some(other) => Err(ApiError::bad_request(format!(
            "`rid` must be a non-empty string, got {other}"
        ))),
    }
}

async fn health() -> Response {
    axum::Json(json!({ "status": "ok" })).into_response()
}

/// SGLang's server description, as much of it as the router reads: the served model and the
/// chat template defaults.
async fn server_info(State(st): State<Arc<AppState>>) -> Response {
    let defaults = (!st.template_defaults.is_empty()).then_some(&st.template_defaults);
    axum::Json(json!({
        "served_model_name": st.model_name,
        "default_chat_template_kwargs": defaults,
    }))
    .into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text = st.metrics.render();
    (
        [(
            header::CONTENT_TYPE,
            infera_core::service::metrics::text::CONTENT_TYPE,
        )],
        text,
    )
        .into_response()
}

/// The base model, then each adapter with the base as `parent`, as vLLM lists them.
async fn models(State(st): State<Arc<AppState>>) -> Response {
    let max_model_len = st.info.gpu_blocks as u64 * u64::from(st.info.block_size);
    let created = unix_now();
    let base = json!({
        "id": st.model_name,
        "object": "model",
        "created": created,
        "owned_by": "infera-mock",
        "root": st.model_name,
        "parent": null,
        "max_model_len": max_model_len,
    });
    let adapters = st.adapters().into_iter().map(|name| {
        json!({
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "infera-mock",
            "root": format!("/adapters/{name}"),
            "parent": st.model_name,
            "max_model_len": max_model_len,
        })
    });
    let data: Vec<Value> = std::iter::once(base).chain(adapters).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// The body of vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
#[derive(Debug, serde::Deserialize)]
struct LoraAdapter {
    lora_name: String,
}

/// Loads an adapter at run time (vLLM with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): 400 when it is
/// loaded already, as vLLM answers.
async fn load_lora_adapter(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = (|| {
        let req: LoraAdapter = parse_body(body)?;
        if req.lora_name.is_empty() || req.lora_name == st.model_name {
            return Err(ApiError::bad_request("`lora_name` must name an adapter"));
        }
        let mut adapters = st
            .adapters
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if adapters.contains(&req.lora_name) {
            return Err(ApiError::bad_request(format!(
                "The lora adapter '{}' has already been loaded.",
                req.lora_name
            )));
        }
        adapters.push(req.lora_name.clone());
        Ok(format!(
            "Success: LoRA adapter '{}' added successfully.",
            req.lora_name
        )
        .into_response())
    })();
    respond(&st, result)
}

/// Unloads an adapter: 404 when it is not loaded.
async fn unload_lora_adapter(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = (|| {
        let req: LoraAdapter = parse_body(body)?;
        let mut adapters = st
            .adapters
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = adapters.len();
        adapters.retain(|a| *a != req.lora_name);
        if adapters.len() == before {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("The lora adapter '{}' cannot be found.", req.lora_name),
            ));
        }
        Ok(format!(
            "Success: LoRA adapter '{}' removed successfully.",
            req.lora_name
        )
        .into_response())
    })();
    respond(&st, result)
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let result = async {
        let req: CompletionRequest = parse_body(body)?;
        let identity = identity(&st, req.model.as_deref(), req.cache_salt)?;
        let rid = rid_of(&req.pd)?;
        let pd = pd_accept(
            &st,
            &headers,
            &req.pd,
            req.max_tokens,
            req.stream.unwrap_or(false),
        )?;
        let out = output_tokens(req.max_tokens, req.n)?;
        let out = pd.cap.map_or(out, |cap| out.min(cap));
        let (tokens, first_word) = match parse_prompt(&req.prompt)? {
            Prompt::Tokens(ids) => {
                let first_word = filler_start_ids(&ids, &st.filler_ids);
                (ids, first_word)
            }
            Prompt::Text(text) => {
                let first_word = filler_start(&text);
                (tokenize_text(&st, text).await?, first_word)
            }
        };
        let include_usage = req.stream_options.and_then(|o| o.include_usage);
        let reply = Reply {
            endpoint: Endpoint::Completions,
            stream: req.stream.unwrap_or(false),
            include_usage: include_usage.unwrap_or(false),
            handoff: pd.handoff,
            rid,
            retention: retention_of(req.pd.kv_transfer_params.as_ref())?,
            first_word,
            return_ids: req.return_token_ids.unwrap_or(false),
            identity,
        };
        generate(&st, tokens, out, reply, received).await
    }
    .await;
    respond(&st, result)
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received = Instant::now();
    let result = async {
        let req: ChatRequest = parse_body(body)?;
        let mut identity = identity(&st, req.model.as_deref(), req.cache_salt)?;
        let rid = rid_of(&req.pd)?;
        let max_tokens = req.max_completion_tokens.or(req.max_tokens);
        let pd = pd_accept(
            &st,
            &headers,
            &req.pd,
            max_tokens,
            req.stream.unwrap_or(false),
        )?;
        let out = output_tokens(max_tokens, req.n)?;
        let out = pd.cap.map_or(out, |cap| out.min(cap));
        if req.messages.is_empty() {
            return Err(ApiError::bad_request("`messages` must not be empty"));
        }
        // A chat continuation ends with the assistant's text so far.
        let first_word = match req.messages.last() {
            Some(ChatMessage {
                role,
                content: Some(ChatContent::Text(text)),
                ..
            }) if role == "assistant" => filler_start(text),
            _ => 0,
        };
        let (tokens, mm) = tokenize_chat(&st, req.messages, req.extras).await?;
        identity.mm = mm;
        let include_usage = req.stream_options.and_then(|o| o.include_usage);
        let reply = Reply {
            endpoint: Endpoint::Chat,
            stream: req.stream.unwrap_or(false),
            include_usage: include_usage.unwrap_or(false),
            handoff: pd.handoff,
            rid,
            retention: retention_of(req.pd.kv_transfer_params.as_ref())?,
            first_word,
            return_ids: req.return_token_ids.unwrap_or(false),
            identity,
        };
        generate(&st, tokens, out, reply, received).await
    }
    .await;
    respond(&st, result)
}

fn respond(st: &AppState, result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(|e| {
        st.metrics.http_errors.inc();
        e.into_response()
    })
}

fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        let status = rejection.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!("request body is too large: {}", rejection.body_text())
        } else {
            format!("cannot read the request body: {}", rejection.body_text())
        };
        ApiError::new(status, message)
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON request body: {e}")))
}

/// The KV identity of a request for `model` with `cache_salt`, as vLLM keys its blocks: an
/// adapter's name, the salt. A model this engine does not serve is a 404, as vLLM answers.
fn identity(
    st: &AppState,
    model: Option<&str>,
    cache_salt: Option<String>,
) -> Result<KvIdentity, ApiError> {
    let lora = match model {
        None => None,
        Some(m) if m == st.model_name => None,
        Some(m) if st.adapters().iter().any(|a| a == m) => Some(Box::from(m)),
        Some(m) => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "The model `{m}` does not exist; this mock engine serves `{}`",
                    std::iter::once(st.model_name.clone())
                        .chain(st.adapters())
                        .collect::<Vec<_>>()
                        .join("`, `")
                ),
            ));
        }
    };
    if cache_salt.as_deref() == Some("") {
        return Err(ApiError::bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
        ));
    }
    Ok(KvIdentity {
        lora,
        salt: cache_salt.map(Box::from),
        mm: Vec::new(),
    })
}

async fn tokenize_text(st: &AppState, text: String) -> Result<Vec<u32>, ApiError> {
    let Some(tokenizer) = st.tokenizer.clone() else {
        return Ok(byte_tokens(&text));
    };
    tokio::task::spawn_blocking(move || tokenizer.encode(&text))
        .await
        .map_err(|e| internal(format!("tokenizer task failed: {e}")))?
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))
}

/// A chat's prompt tokens and its images' runs. With a vision model's tokenizer the images
/// are expanded and keyed as vLLM does (by each part's `uuid`, which the router stamps, else by
/// its content); otherwise each non-text part becomes a `<kind>` text placeholder.
async fn tokenize_chat(
    st: &AppState,
    mut messages: Vec<ChatMessage>,
    mut extras: ChatExtras,
) -> Result<(Vec<u32>, Vec<MmRun>), ApiError> {
    extras.with_defaults(&st.template_defaults);
    let images = st
        .tokenizer
        .as_ref()
        .and_then(|t| t.keyed_images(&messages, None))
        .unwrap_or_default();
    if images.is_empty() {
        for m in &mut messages {
            if let Some(ChatContent::Parts(parts)) = &mut m.content {
                for p in parts.iter_mut().filter(|p| p.kind != "text") {
                    *p = ContentPart::text(format!("<{}>", p.kind));
                }
            }
        }
    }
    let Some(tokenizer) = st.tokenizer.clone() else {
        return Ok((byte_tokens(&plain_chat(&messages)), Vec::new()));
    };
    tokio::task::spawn_blocking(move || {
        tokenizer.encode_chat_keyed(&messages, &extras, None, &images)
    })
    .await
    .map_err(|e| internal(format!("tokenizer task failed: {e}")))?
    .map_err(|e| ApiError::bad_request(format!("cannot render or tokenize the messages: {e}")))
}

/// Without a tokenizer: one token per UTF-8 byte (prefixes stay prefixes, so caching works).
fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Without a tokenizer: `role: content` lines and an open assistant turn.
fn plain_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(&m.role);
        out.push_str(": ");
        match &m.content {
            Some(ChatContent::Text(t)) => out.push_str(t),
            Some(ChatContent::Parts(parts)) => {
                for p in parts {
                    out.push_str(p.text.as_deref().unwrap_or_default());
                }
            }
            None => {}
        }
        out.push('\n');
    }
    out.push_str("assistant:");
    out
}

fn internal(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
}

/// How a generation request wants its answer.
struct Reply {
    endpoint: Endpoint,
    stream: bool,
    include_usage: bool,
    /// A PD prefill leg's hand-off, added to a unary answer.
    handoff: Option<Value>,
    /// SGLang's `rid`: `/abort_request` can end the request.
    rid: Option<String>,
    /// How long the block store should keep the request's blocks (`none`: never saved).
    retention: infera_core::event::Retention,
    /// Where the answer starts in the filler cycle ([`filler_start`]).
    first_word: u32,
    /// vLLM's `return_token_ids`: the prompt's ids and each chunk's ids in the answer.
    return_ids: bool,
    /// What the prompt's blocks are keyed by besides their tokens.
    identity: KvIdentity,
}

/// Submits the request to the engine and answers it; `received`: when the handler started.
async fn generate(
    st: &Arc<AppState>,
    tokens: Vec<u32>,
    out: u32,
    reply: Reply,
    received: Instant,
) -> Result<Response, ApiError> {
    let Reply {
        endpoint,
        stream,
        include_usage,
        handoff,
        rid,
        retention,
        first_word,
        return_ids,
        identity,
    } = reply;
    let prompt_ids = return_ids.then(|| tokens.clone());
    if tokens.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty (0 tokens)"));
    }
    let prompt_tokens = u32::try_from(tokens.len())
        .map_err(|_| ApiError::bad_request("the prompt has more than 2^32 tokens"))?;
    let bs = u64::from(st.info.block_size);
    let footprint = (u64::from(prompt_tokens) + u64::from(out) - 1).div_ceil(bs);
    if footprint > st.info.gpu_blocks as u64 {
        return Err(ApiError::bad_request(format!(
            "this request needs {footprint} KV blocks ({prompt_tokens} prompt tokens + {out} \
             output tokens, {bs} tokens per block) but the engine has {}; shorten the prompt \
             or max_tokens",
            st.info.gpu_blocks
        )));
    }
    let blocks = hash_prompt_blocks(&tokens, st.info.block_size as usize, &identity);
    let (lower_blocks, save) = match &st.kvd {
        Some(tier) => tier.admit(&tokens, &identity, retention, &st.metrics).await,
        None => (0, None),
    };
    let live = rid.as_deref().map(|r| st.aborts.register(r));
    let seq = st.next_id.fetch_add(1, Ordering::Relaxed);
    let (progress, rx) = watch::channel(Progress::default());
    st.engine
        .send(Submission {
            id: seq,
            blocks,
            tokens,
            prompt_tokens,
            output_tokens: out,
            progress,
            received,
            lower_blocks,
            identity: identity.clone(),
        })
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the mock engine is shutting down",
            )
        })?;
    st.metrics.requests.inc();
    st.metrics.prompt_tokens.inc_by(u64::from(prompt_tokens));
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let meta = ResponseMeta {
        endpoint,
        id: format!("{prefix}-{:016x}{seq:08x}", st.id_prefix),
        created: unix_now(),
        // vLLM answers an adapter's request under the adapter's name.
        model: identity
            .lora
            .as_deref()
            .map_or_else(|| st.model_name.clone(), str::to_owned),
    };
    if stream {
        Ok(sse_response(StreamState {
            app: Arc::clone(st),
            save,
            rx,
            meta,
            prompt_tokens,
            include_usage,
            sent: 0,
            first_word,
            prompt_ids,
            queue: VecDeque::new(),
            done: false,
            live,
        }))
    } else {
        let (p, aborted) = match &live {
            None => (wait_outcome(rx).await?, false),
            Some(live) => {
                let mut rx = rx;
                tokio::select! {
                    p = wait_outcome(rx.clone()) => (p?, false),
                    () = live.token.cancelled() => {
                        let p = *rx.borrow_and_update();
                        // Dropping the receivers detaches the request: the engine aborts it.
                        drop(rx);
                        (p, true)
                    }
                }
            }
        };
        if let (Some(tier), Some(job), false) = (&st.kvd, save, aborted) {
            tier.save(job, &st.metrics).await;
        }
        let text = filler(first_word, first_word + p.tokens);
        let mut body = meta.full(text, usage(prompt_tokens, p.tokens, p.cached_tokens));
        if aborted {
            body["choices"][0]["finish_reason"] = "abort".into();
        }
        if let Some(ids) = prompt_ids {
            let generated: Vec<u32> = (first_word..first_word + p.tokens)
                .flat_map(|w| st.word_ids(w).iter().copied())
                .collect();
            body["prompt_token_ids"] = json!(ids);
            body["choices"][0]["token_ids"] = json!(generated);
        }
        if let (Some(h), Some(obj)) = (handoff, body.as_object_mut()) {
            obj.insert("kv_transfer_params".into(), h);
        }
        Ok(axum::Json(body).into_response())
    }
}

/// Waits until the request leaves the engine.
async fn wait_outcome(mut rx: watch::Receiver<Progress>) -> Result<Progress, ApiError> {
    loop {
        let closed = rx.changed().await.is_err();
        let p = *rx.borrow_and_update();
        match p.outcome {
            Some(Outcome::Finished) => return Ok(p),
            Some(Outcome::Rejected) => return Err(rejected()),
            None if closed => return Err(engine_stopped()),
            None => {}
        }
    }
}

pub(super) fn rejected() -> ApiError {
    ApiError::bad_request("the request can never fit in this engine's KV cache")
}

pub(super) fn engine_stopped() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the mock engine stopped before the request finished",
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
