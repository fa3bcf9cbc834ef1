//! OpenAI request parsing and response shapes for the mock engine, as vLLM serves them.
//!
//! Requests are parsed leniently about *which* fields appear (unknown fields are ignored, as
//! OpenAI clients send many) and strictly about the *types* of the fields the mock reads: a
//! wrong type, a batch of prompts, `n > 1` or `max_tokens < 1` is a 400 in OpenAI's error shape
//! `{"error": {"message", "type", "code"}}`.
//!
//! Generated text is deterministic filler: token `i` of every response is
//! [`FILLER[i % FILLER.len()]`](FILLER), each a common English word with its leading space,
//! which common BPE vocabularies (the fixture's included) encode as exactly one token, so the
//! text's token count matches `usage.completion_tokens`.

use crate::tokenize::ChatMessage;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

/// `max_tokens` when the request does not say.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// The words generated tokens cycle through (one token each).
pub const FILLER: [&str; 10] = [
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " with",
];

/// Where an answer starts in the [`FILLER`] cycle: after the word `text` ends with, so a prompt
/// that carries the start of an earlier answer (as the server's continuation of a migrated
/// stream does) is continued word for word; at the first word otherwise.
pub fn filler_start(text: &str) -> u32 {
    FILLER
        .iter()
        .position(|word| text.ends_with(word))
        .map_or(0, |i| (i as u32 + 1) % FILLER.len() as u32)
}

/// Where an answer starts in the [`FILLER`] cycle for a prompt of token ids: after the word
/// whose ids (`word_ids`, one entry per [`FILLER`] word) the prompt ends with, as
/// [`filler_start`] does for text.
pub fn filler_start_ids(prompt: &[u32], word_ids: &[Vec<u32>]) -> u32 {
    word_ids
        .iter()
        .position(|ids| !ids.is_empty() && prompt.ends_with(ids))
        .map_or(0, |i| (i as u32 + 1) % FILLER.len() as u32)
}

/// The text of generated tokens `from..to`.
pub fn filler(from: u32, to: u32) -> String {
    (from..to)
        .map(|i| FILLER[i as usize % FILLER.len()])
        .collect()
}

/// An error answered in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// vLLM's own error types (the mock speaks an engine's wire, not the server's
    /// `infera_core::error` table).
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::PAYLOAD_TOO_LARGE | StatusCode::BAD_REQUEST => "BadRequestError",
            s if s.is_client_error() => "BadRequestError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body: `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The body of `POST /v1/completions` (the fields the mock reads).
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// vLLM's `cache_salt`: keys the prompt's blocks (the first, and so every later one).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// PD fields (a PD-role mock checks them).
    #[serde(flatten)]
    pub pd: super::pd::PdFields,
    pub prompt: Value,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<i64>,
    /// vLLM's `return_token_ids`: the prompt's ids on the first chunk, each chunk's ids on it.
    #[serde(default)]
    pub return_token_ids: Option<bool>,
}

/// The body of `POST /v1/chat/completions` (the fields the mock reads).
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// vLLM's `cache_salt`: keys the prompt's blocks (the first, and so every later one).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// PD fields (a PD-role mock checks them).
    #[serde(flatten)]
    pub pd: super::pd::PdFields,
    pub messages: Vec<ChatMessage>,
    /// What the template renders besides the messages (`tools`, `chat_template_kwargs`…).
    #[serde(flatten)]
    pub extras: crate::tokenize::ChatExtras,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<i64>,
    /// vLLM's `return_token_ids` (see [`CompletionRequest::return_token_ids`]).
    #[serde(default)]
    pub return_token_ids: Option<bool>,
}

/// A completion prompt: text to tokenize, or token ids as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// Reads `prompt`: a string, a list of token ids, or a one-element list of either.
///
/// # Errors
/// 400 naming what is wrong (batches of several prompts are not supported by the mock).
pub fn parse_prompt(value: &Value) -> Result<Prompt, ApiError> {
    match value {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) if items.is_empty() => {
            Err(ApiError::bad_request("`prompt` must not be empty"))
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            token_ids(items).map(Prompt::Tokens)
        }
        Value::Array(items) if items.len() == 1 => match &items[0] {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(inner) => token_ids(inner).map(Prompt::Tokens),
            _ => Err(ApiError::bad_request(
                "`prompt` must be a string, a list of token ids, or a list holding one of those",
            )),
        },
        Value::Array(_) => Err(ApiError::bad_request(
            "`prompt` holds several prompts; the mock engine serves one prompt per request",
        )),
        _ => Err(ApiError::bad_request(
            "`prompt` must be a string or a list of token ids",
        )),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "`prompt[{i}]` must be a token id (an integer from 0 to {}), got {v}",
                        u32::MAX
                    ))
                })
        })
        .collect()
}

/// Checks the options every request shares and returns `max_tokens`.
///
/// # Errors
/// 400 for `n` other than 1 or `max_tokens` below 1 or above `u32::MAX`.
pub fn output_tokens(max_tokens: Option<i64>, n: Option<i64>) -> Result<u32, ApiError> {
    if let Some(n) = n
        && n != 1
    {
        return Err(ApiError::bad_request(format!(
            "`n` must be 1 for the mock engine, got {n}"
        )));
    }
    match max_tokens {
        None => Ok(DEFAULT_MAX_TOKENS),
        Some(m) => u32::try_from(m).ok().filter(|&m| m >= 1).ok_or_else(|| {
            ApiError::bad_request(format!("`max_tokens` must be at least 1, got {m}"))
        }),
    }
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What every response of one request shares.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// The `usage` object.
pub fn usage(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": u64::from(prompt_tokens) + u64::from(completion_tokens),
        "prompt_tokens_details": { "cached_tokens": cached_tokens },
    })
}

impl ResponseMeta {
    /// The whole non-streaming response.
    pub fn full(&self, text: String, usage: Value) -> Value {
        match self.endpoint {
            Endpoint::Completions => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": "length",
                    "stop_reason": null,
                }],
                "usage": usage,
            }),
            Endpoint::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": { "role": "assistant", "content": text },
                    "logprobs": null,
                    "finish_reason": "length",
                    "stop_reason": null,
                }],
                "usage": usage,
            }),
        }
    }

    /// A streamed chunk carrying `text` (chat: as `delta.content`; `role` on the first).
    pub fn chunk(&self, text: &str, first: bool, finish: bool) -> Value {
        let finish_reason = if finish { json!("length") } else { Value::Null };
        match self.endpoint {
            Endpoint::Completions => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }],
            }),
            Endpoint::Chat => {
                let delta = if first {
                    json!({ "role": "assistant", "content": text })
                } else {
                    json!({ "content": text })
                };
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{
                        "index": 0,
                        "delta": delta,
                        "logprobs": null,
                        "finish_reason": finish_reason,
                    }],
                })
            }
        }
    }

    /// The streamed usage chunk (`choices` empty), sent when `include_usage` is set.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_in_every_accepted_shape() {
        assert_eq!(
            parse_prompt(&json!("hi")),
            Ok(Prompt::Text("hi".to_owned()))
        );
        assert_eq!(
            parse_prompt(&json!([1, 2, 3])),
            Ok(Prompt::Tokens(vec![1, 2, 3]))
        );
        assert_eq!(
            parse_prompt(&json!(["hi"])),
            Ok(Prompt::Text("hi".to_owned()))
        );
        assert_eq!(
            parse_prompt(&json!([[7, 8]])),
            Ok(Prompt::Tokens(vec![7, 8]))
        );
        for bad in [
            json!([]),
            json!(["a", "b"]),
            json!([1, -2]),
            json!([1.5]),
            json!(7),
            json!({"a": 1}),
        ] {
            let err = parse_prompt(&bad).expect_err("rejected");
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[test]
    fn output_tokens_defaults_and_bounds() {
        assert_eq!(output_tokens(None, None), Ok(DEFAULT_MAX_TOKENS));
        assert_eq!(output_tokens(Some(5), Some(1)), Ok(5));
        assert!(output_tokens(Some(0), None).is_err());
        assert!(output_tokens(Some(-3), None).is_err());
        assert!(output_tokens(Some(4), Some(2)).is_err());
    }

    #[test]
    fn filler_cycles() {
        assert_eq!(filler(0, 3), " the of and");
        assert_eq!(filler(10, 11), " the");
        assert_eq!(filler(4, 4), "");
        assert_eq!(filler_start("Hello!"), 0);
        assert_eq!(filler_start("Hello! the of"), 2);
        assert_eq!(filler_start(&format!("x{}", filler(0, 10))), 0);
        let start = filler_start(" a the");
        assert_eq!(filler(start, start + 2), " of and");
    }
}
