//! `POST /v1/messages`: Anthropic's Messages API in front of the same pipeline as chat
//! completions. The request is translated into an OpenAI chat request (routed, hashed and
//! relayed like any other), and the engine's answer is translated back — the JSON body, or the
//! SSE stream event by event (`message_start`, `content_block_start`, `content_block_delta`,
//! `content_block_stop`, `message_delta`, `message_stop`; `error` when the stream fails).
//!
//! # Translation
//! | Messages | chat completions |
//! |---|---|
//! | `system` (string or text blocks) | a leading `system` message |
//! | `messages[].content` (string or `text` blocks) | the message's text |
//! | `image` blocks (`source` `url`, or `base64` with `media_type`) | `image_url` parts (a `data:` URL for base64), routed by load (PROTOCOLS.md §4) |
//! | `max_tokens` (required), `temperature`, `top_p`, `top_k`, `stop_sequences`, `stream` | the same knobs (`stop`), plus `stream_options.include_usage` |
//! | `metadata.user_id` | `user` |
//! | `cache_control` on any block (`ephemeral`, ttl `1h`) | `prompt_cache_retention` `short` (`long`), PROTOCOLS.md §5 |
//! | `finish_reason` `stop` / `length` / `tool_calls` | `stop_reason` `end_turn` (or `stop_sequence` when the engine names the matched stop string) / `max_tokens` / `tool_use` |
//! | `usage.prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens` | `usage.input_tokens`, `output_tokens`, `cache_read_input_tokens` |
//!
//! Document and tool blocks, and `tools`, are refused with a 400 naming them. Errors use Anthropic's shape:
//! `{"type": "error", "error": {"type": "invalid_request_error", "message": …}}`.

use super::http::ApiError;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use futures::StreamExt as _;
use http_body_util::BodyExt as _;
use infera_core::error::ErrorCode;
use serde_json::{Map, Value, json};

/// Translates a Messages request body into a chat completions body.
///
/// # Errors
/// A 400 naming the field at fault: a missing or non-integer `max_tokens`, malformed
/// `messages` or `system`, a content block that is neither text nor an image, or `tools`.
pub(crate) fn to_chat(body: &Value) -> Result<Value, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, m);
    let obj = body
        .as_object()
        .ok_or_else(|| bad("request body must be a JSON object".into()))?;
    let max_tokens = match obj.get("max_tokens") {
        Some(v) if v.as_u64().is_some_and(|n| n > 0) => v.clone(),
        Some(_) => return Err(bad("`max_tokens` must be a positive integer".into())),
        None => return Err(bad("`max_tokens` is required".into())),
    };
    if obj.get("tools").is_some_and(|t| !t.is_null()) {
        return Err(bad(
            "`tools` is not supported by this router's /v1/messages (text only)".into(),
        ));
    }
    let mut messages = Vec::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(system) => {
            messages.push(json!({"role": "system", "content": text_of(system, "system")?}))
        }
    }
    let Some(Value::Array(turns)) = obj.get("messages") else {
        return Err(bad("`messages` must be an array".into()));
    };
    for (i, turn) in turns.iter().enumerate() {
        let role = match turn.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(bad(format!(
                    "`messages[{i}].role` must be \"user\" or \"assistant\""
                )));
            }
        };
        let content = turn
            .get("content")
            .ok_or_else(|| bad(format!("`messages[{i}].content` is required")))?;
        let content = content_of(content, &format!("messages[{i}].content"))?;
        messages.push(json!({"role": role, "content": content}));
    }
    let mut out = Map::new();
    out.insert(
        "model".into(),
        obj.get("model").cloned().unwrap_or(Value::Null),
    );
    out.insert("messages".into(), Value::Array(messages));
    out.insert("max_tokens".into(), max_tokens);
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
        ("stream", "stream"),
        ("kv_transfer_params", "kv_transfer_params"),
    ] {
        if let Some(v) = obj.get(from).filter(|v| !v.is_null()) {
            out.insert(to.into(), v.clone());
        }
    }
    if let Some(user) = body.pointer("/metadata/user_id").filter(|v| v.is_string()) {
        out.insert("user".into(), user.clone());
    }
    if obj.get("stream").and_then(Value::as_bool) == Some(true) {
        out.insert("stream_options".into(), json!({"include_usage": true}));
    }
    if let Some(retention) = cache_retention(body) {
        out.insert("prompt_cache_retention".into(), json!(retention));
    }
    Ok(Value::Object(out))
}

/// PROTOCOLS.md §5: Anthropic `cache_control` anywhere in the request (`ephemeral` with ttl `1h`
/// → long, plain `ephemeral` → short), the longest one found, as a `prompt_cache_retention`.
fn cache_retention(body: &Value) -> Option<&'static str> {
    fn walk(v: &Value, best: &mut Option<&'static str>) {
        match v {
            Value::Object(m) => {
                if let Some(cc) = m.get("cache_control")
                    && cc.get("type").and_then(Value::as_str) == Some("ephemeral")
                {
                    let long = cc.get("ttl").and_then(Value::as_str) == Some("1h");
                    if long {
                        *best = Some("long");
                    } else if best.is_none() {
                        *best = Some("short");
                    }
                }
                m.values().for_each(|v| walk(v, best));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, best)),
            _ => {}
        }
    }
    let mut best = None;
    walk(body, &mut best);
    best
}

/// A message's content: its text (see [`text_of`]), or, when it has `image` blocks, OpenAI
/// content parts (`text`, and `image_url` with the image's URL or a `data:` URL of its base64).
fn content_of(content: &Value, field: &str) -> Result<Value, ApiError> {
    let Value::Array(blocks) = content else {
        return text_of(content, field).map(Value::String);
    };
    if !blocks
        .iter()
        .any(|b| b.get("type") == Some(&json!("image")))
    {
        return text_of(content, field).map(Value::String);
    }
    let mut parts = Vec::with_capacity(blocks.len());
    for (j, block) in blocks.iter().enumerate() {
        if block.get("type") != Some(&json!("image")) {
            let text = block_text(block, &format!("{field}[{j}]"))?;
            parts.push(json!({"type": "text", "text": text}));
            continue;
        }
        let source = block.get("source").unwrap_or(&Value::Null);
        let text = |key: &str| source.get(key).and_then(Value::as_str);
        let url = match (text("type"), text("url"), text("media_type"), text("data")) {
            (Some("url"), Some(url), _, _) => url.to_owned(),
            (Some("base64"), _, Some(media), Some(data)) => format!("data:{media};base64,{data}"),
            _ => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "`{field}[{j}].source` must be {{\"type\": \"url\", \"url\"}} or \
                         {{\"type\": \"base64\", \"media_type\", \"data\"}}"
                    ),
                ));
            }
        };
        parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
    }
    Ok(Value::Array(parts))
}

/// The text of a string or of an array of `text` blocks.
fn text_of(content: &Value, field: &str) -> Result<String, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, m);
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, block) in blocks.iter().enumerate() {
                text.push_str(block_text(block, &format!("{field}[{j}]"))?);
            }
            Ok(text)
        }
        _ => Err(bad(format!(
            "`{field}` must be a string or an array of text blocks"
        ))),
    }
}

/// The text of one `text` block at `at`.
fn block_text<'a>(block: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, m);
    match block.get("type").and_then(Value::as_str) {
        Some("text") => block
            .get("text")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("`{at}.text` must be a string"))),
        Some(other) => Err(bad(format!(
            "`{at}` is a {other:?} block; this router's /v1/messages takes text and image \
             blocks only"
        ))),
        None => Err(bad(format!("`{at}.type` is required"))),
    }
}

fn stop_reason(choice: &Value) -> Value {
    match choice.get("finish_reason").and_then(Value::as_str) {
        None => Value::Null,
        Some("length") => json!("max_tokens"),
        Some("tool_calls") => json!("tool_use"),
        Some(_) if choice.get("stop_reason").is_some_and(Value::is_string) => {
            json!("stop_sequence")
        }
        Some(_) => json!("end_turn"),
    }
}

fn stop_sequence(choice: &Value) -> Value {
    choice
        .get("stop_reason")
        .filter(|v| v.is_string())
        .cloned()
        .unwrap_or(Value::Null)
}

fn usage(usage: Option<&Value>) -> Value {
    let get = |p: &str| usage.and_then(|u| u.pointer(p)).and_then(Value::as_u64);
    let mut out = json!({
        "input_tokens": get("/prompt_tokens").unwrap_or(0),
        "output_tokens": get("/completion_tokens").unwrap_or(0),
    });
    if let Some(cached) = get("/prompt_tokens_details/cached_tokens") {
        out["cache_read_input_tokens"] = json!(cached);
    }
    out
}

/// The Messages error body for `status` and `message` (the type from [`ErrorCode`]'s table).
pub(crate) fn error_body(status: StatusCode, message: &str) -> Value {
    let kind = ErrorCode::of_status(status).anthropic_type();
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// Translates the relayed chat completions response into a Messages response.
pub(crate) async fn from_chat(resp: Response, stream: bool, model: &str, id: &str) -> Response {
    let msg_id = format!("msg_{id}");
    let status = resp.status();
    let (mut parts, body) = resp.into_parts();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let message = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| {
                v.pointer("/error/message")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        parts.headers.remove(header::CONTENT_LENGTH);
        let body = error_body(status, &message).to_string();
        return Response::from_parts(parts, Body::from(body));
    }
    parts.headers.remove(header::CONTENT_LENGTH);
    if !stream {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let out = match serde_json::from_slice::<Value>(&bytes) {
            Ok(chat) => message_of(&chat, model, &msg_id),
            Err(e) => {
                parts.status = StatusCode::BAD_GATEWAY;
                error_body(
                    StatusCode::BAD_GATEWAY,
                    &format!("the engine's answer is not JSON: {e}"),
                )
            }
        };
        return Response::from_parts(parts, Body::from(out.to_string()));
    }
    let mut sse = SseTranslator::new(model, &msg_id);
    let events = body.into_data_stream().map(move |chunk| {
        let out = match chunk {
            Ok(bytes) => sse.push(&bytes),
            Err(e) => sse.fail(&format!("stream failed: {e}")),
        };
        Ok::<_, std::convert::Infallible>(Bytes::from(out))
    });
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    Response::from_parts(parts, Body::from_stream(events))
}

fn message_of(chat: &Value, model: &str, msg_id: &str) -> Value {
    let choice = chat.pointer("/choices/0").cloned().unwrap_or(Value::Null);
    let text = choice
        .pointer("/message/content")
        .and_then(Value::as_str)
        .unwrap_or_default();
    json!({
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason(&choice),
        "stop_sequence": stop_sequence(&choice),
        "usage": usage(chat.get("usage")),
    })
}

/// Rewrites a chat completions SSE stream into Messages events, whatever the chunking.
#[derive(Debug)]
pub(crate) struct SseTranslator {
    model: String,
    msg_id: String,
    pending: Vec<u8>,
    started: bool,
    stop_reason: Value,
    stop_sequence: Value,
    usage: Value,
    finished: bool,
}

fn event(out: &mut String, name: &str, data: &Value) {
    out.push_str("event: ");
    out.push_str(name);
    out.push_str("\ndata: ");
    out.push_str(&data.to_string());
    out.push_str("\n\n");
}

impl SseTranslator {
    pub(crate) fn new(model: &str, msg_id: &str) -> Self {
        Self {
            model: model.to_owned(),
            msg_id: msg_id.to_owned(),
            pending: Vec::new(),
            started: false,
            stop_reason: Value::Null,
            stop_sequence: Value::Null,
            usage: usage(None),
            finished: false,
        }
    }

    fn start(&mut self, out: &mut String) {
        if self.started {
            return;
        }
        self.started = true;
        let message = json!({
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        });
        event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": message}),
        );
        event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}),
        );
    }

    /// Takes the next bytes of the chat stream; returns the Messages events they complete.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> String {
        let mut out = String::new();
        self.pending.extend_from_slice(bytes);
        while let Some(end) = find_event_end(&self.pending) {
            let raw: Vec<u8> = self.pending.drain(..end.0).collect();
            self.pending.drain(..end.1);
            self.on_event(&String::from_utf8_lossy(&raw), &mut out);
        }
        out
    }

    /// Ends the stream with an `error` event (the chat stream broke).
    pub(crate) fn fail(&mut self, message: &str) -> String {
        let mut out = String::new();
        if !self.finished {
            self.finished = true;
            event(
                &mut out,
                "error",
                &error_body(StatusCode::BAD_GATEWAY, message),
            );
        }
        out
    }

    fn on_event(&mut self, raw: &str, out: &mut String) {
        if self.finished {
            return;
        }
        let data: String = raw
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect::<Vec<_>>()
            .join("\n");
        if data.is_empty() {
            return;
        }
        if data == "[DONE]" {
            self.finish(out);
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
            out.push_str(&self.fail("the engine sent a chunk that is not JSON"));
            return;
        };
        if let Some(message) = chunk.pointer("/error/message").and_then(Value::as_str) {
            let message = message.to_owned();
            out.push_str(&self.fail(&message));
            return;
        }
        self.start(out);
        if let Some(choice) = chunk.pointer("/choices/0") {
            if let Some(text) = choice.pointer("/delta/content").and_then(Value::as_str)
                && !text.is_empty()
            {
                event(
                    out,
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}}),
                );
            }
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
                self.stop_reason = stop_reason(choice);
                self.stop_sequence = stop_sequence(choice);
            }
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = usage(Some(u));
        }
    }

    fn finish(&mut self, out: &mut String) {
        self.start(out);
        self.finished = true;
        event(
            out,
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        );
        event(
            out,
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": self.usage}),
        );
        event(out, "message_stop", &json!({"type": "message_stop"}));
    }
}

/// The end of the first complete SSE event in `buf`: (event length, separator length).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests;
