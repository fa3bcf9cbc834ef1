//! What migration reads from and writes into SSE frames: frame boundaries, the token ids an
//! engine reports beside its text (vLLM: `choices[0].token_ids` per chunk and
//! `prompt_token_ids` on the first; SGLang: `sglext.completion_token_ids` /
//! `sglext.prompt_token_ids`), their removal before the client sees a chunk it did not ask ids
//! for, and a completions chunk reshaped as the chat chunk a chat client reads.

use crate::event::Engine;
use serde_json::{Map, Value};

/// Request fields a completions continuation cannot honour: a chat request carrying one keeps
/// the text path.
pub(super) const CHAT_ONLY_FIELDS: [&str; 5] = [
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
];

/// The end (exclusive) of the first complete SSE frame in `buf`.
pub(super) fn frame_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2)
}

/// The payloads of a frame's `data: ` lines.
pub(super) fn data_lines(frame: &[u8]) -> impl Iterator<Item = &[u8]> {
    frame
        .split(|b| *b == b'\n')
        .filter_map(|l| {
            l.strip_prefix(b"data: ")
                .or_else(|| l.strip_prefix(b"data:"))
        })
        .map(|p| p.strip_suffix(b"\r").unwrap_or(p))
}

/// Whether the router may ask `engine` for token ids on `path` while streaming: vLLM on both
/// endpoints; SGLang on completions only (it refuses the field on streaming chat); ATOM not
/// (not known to accept it, and an engine that refuses unknown fields would fail requests).
pub(super) fn engine_reports_ids(engine: Engine, path: &str) -> bool {
    match engine {
        Engine::Vllm => true,
        Engine::Sglang => path == "/v1/completions",
        Engine::Atom => false,
    }
}

/// A list of token ids, or `None` for anything else (never a partial list).
fn ids(value: &Value) -> Option<Vec<u32>> {
    value
        .as_array()?
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// The ids generated in this chunk, or `None` when the engine did not say.
pub(super) fn delta_ids(chunk: &Value) -> Option<Vec<u32>> {
    ids(&chunk["choices"][0]["token_ids"]).or_else(|| {
        let ext = &chunk["sglext"];
        ids(&ext["completion_token_ids"][0]).or_else(|| ids(&ext["token_ids"]))
    })
}

/// The prompt's ids, which engines attach to the first chunk only.
pub(super) fn prompt_ids(chunk: &Value) -> Option<Vec<u32>> {
    ids(&chunk["prompt_token_ids"])
        .or_else(|| ids(&chunk["choices"][0]["prompt_token_ids"]))
        .or_else(|| ids(&chunk["sglext"]["prompt_token_ids"]))
}

/// Removes the id fields the router asked for from a chunk on its way to the client.
pub(super) fn strip_ids(chunk: &mut Map<String, Value>) {
    chunk.remove("prompt_token_ids");
    chunk.remove("sglext");
    if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            choice.remove("token_ids");
            choice.remove("prompt_token_ids");
        }
    }
}

/// Reshapes a completions chunk as a chat chunk: `choices[].text` becomes
/// `choices[].delta.content` (and completions-shaped `logprobs` are dropped).
pub(super) fn as_chat_chunk(chunk: &mut Map<String, Value>) {
    chunk.insert(
        "object".to_owned(),
        Value::String("chat.completion.chunk".to_owned()),
    );
    if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            if let Some(text) = choice.remove("text") {
                let content = if text.is_null() {
                    Value::String(String::new())
                } else {
                    text
                };
                let mut delta = Map::new();
                delta.insert("content".to_owned(), content);
                choice.insert("delta".to_owned(), Value::Object(delta));
                choice.remove("logprobs");
            }
        }
    }
}
