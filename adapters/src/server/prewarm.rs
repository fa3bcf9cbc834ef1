//! `POST /v1/cache/prewarm` (PROTOCOLS.md §4): ask the KV-cache daemon to promote blocks into RAM
//! before the requests that need them arrive.
//!
//! Body: `{"model", "block_hashes": ["<hex>", …], "compat_key", "deadline_ms"}` → 202
//! `{"accepted": true, "n_keys": N}`. Instead of `block_hashes`, ours also takes a `prompt` (as
//! `/v1/completions` does) or `messages` (as chat does) and derives the keys itself: the engine
//! connectors' keys of the prompt's complete blocks at the model's block size (a SHA-256 chain
//! over the token ids, `infera_core::ports::kv_store::block_keys`), which a real engine's
//! connector and the mock engine save and load under. 400 for bad input, 404 for a prompt of a model no worker serves, 503
//! without a daemon (`--kvd-socket-path`) or when it cannot be reached. The hint is
//! fire-and-forget: the daemon drops it if its deadline passes first.
//!
//! The daemon is behind the [`KvPrefetch`] port, set with [`ServerState::set_prefetch`].
//! A non-hex key (any non-ASCII character included) is a 400 naming it, never a panic.

use super::ServerState;
use super::http::{ApiError, Input, parse_chat, parse_prompt};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse as _, Response};
use infera_core::ports::kv_store::block_keys;
use infera_core::ports::prefetch::KvPrefetch;
use serde_json::{Value, json};
use std::sync::Arc;

/// Deadline of a hint that names none.
pub const DEFAULT_DEADLINE_MS: u64 = 1_000;
/// Most keys one prewarm may name.
pub const MAX_KEYS: usize = 1 << 16;

impl ServerState {
    /// Serves `POST /v1/cache/prewarm` through `prefetch` (without one it answers 503).
    pub fn set_prefetch(&self, prefetch: Arc<dyn KvPrefetch>) {
        *self
            .inner
            .prefetch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(prefetch);
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, message)
}

pub(super) fn hex_key(i: usize, v: &Value) -> Result<Vec<u8>, ApiError> {
    let s = v
        .as_str()
        .ok_or_else(|| bad(format!("`block_hashes[{i}]` must be a hex string")))?;
    let s = s.strip_prefix("0x").unwrap_or(s);
    if s.is_empty() || s.len() % 2 != 0 || s.len() > 128 {
        return Err(bad(format!(
            "`block_hashes[{i}]` must be an even number (2..=128) of hex digits"
        )));
    }
    // Byte pairs, not string slices: a non-ASCII character must be an error, never a slice
    // through the middle of its UTF-8 encoding.
    let digit = |c: u8| (c as char).to_digit(16);
    s.as_bytes()
        .chunks_exact(2)
        .map(|pair| match (digit(pair[0]), digit(pair[1])) {
            (Some(hi), Some(lo)) => Ok((hi * 16 + lo) as u8),
            _ => Err(bad(format!("`block_hashes[{i}]` is not hex: {s:?}"))),
        })
        .collect()
}

pub(crate) async fn prewarm(
    State(st): State<ServerState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match handle(&st, &headers, body).await {
        Ok(n) => (
            StatusCode::ACCEPTED,
            axum::Json(json!({"accepted": true, "n_keys": n})),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn handle(st: &ServerState, headers: &HeaderMap, body: Body) -> Result<usize, ApiError> {
    // The body and its JSON tree are charged to the parse budget until the keys are sent.
    let options = &st.inner.options;
    let budget = &options.client.parse_budget;
    let (bytes, mut charge) =
        super::body::read_limited(body, headers, options.service.max_body_bytes, Some(budget))
            .await?;
    super::body::charge_tree(budget, &mut charge, bytes.len())?;
    let json: Value = serde_json::from_slice(&bytes)
        .map_err(|e| bad(format!("request body is not valid JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad("request body must be a JSON object"))?;
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`model` is required and must be a string"))?
        .to_owned();
    let compat_key = match obj.get("compat_key") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(bad("`compat_key` must be a string")),
    };
    let deadline_ms = match obj.get("deadline_ms") {
        None | Some(Value::Null) => DEFAULT_DEADLINE_MS,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| bad("`deadline_ms` must be a non-negative integer"))?,
    };
    let given = ["block_hashes", "prompt", "messages"]
        .into_iter()
        .filter(|k| obj.get(*k).is_some_and(|v| !v.is_null()))
        .collect::<Vec<_>>();
    let keys: Vec<Vec<u8>> = match given.as_slice() {
        ["block_hashes"] => match &obj["block_hashes"] {
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| hex_key(i, v))
                .collect::<Result<_, _>>()?,
            _ => return Err(bad("`block_hashes` must be an array of hex strings")),
        },
        [field] => {
            let input: Input = if *field == "prompt" {
                parse_prompt(obj.get("prompt"))?
            } else {
                parse_chat(&json)?
            };
            let (block_size, base) = st
                .service()
                .with_fleet(|f| {
                    f.workers()
                        .find(|w| w.serves(&model))
                        .map(|w| (w.kv_block_size, w.model_name.clone()))
                })
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::NOT_FOUND,
                        format!("no worker serves model {model:?}, so its block size is unknown"),
                    )
                })?;
            let tokens = st.service().tokenize(st, &base, input, None).await?;
            block_keys(&tokens.ids, block_size.max(1) as usize)
        }
        [] => return Err(bad("give `block_hashes`, `prompt` or `messages`")),
        _ => {
            return Err(bad(format!(
                "give only one of `block_hashes`, `prompt` or `messages` (got {})",
                given.join(", ")
            )));
        }
    };
    if keys.is_empty() {
        return Err(bad("no keys to prewarm (a prompt shorter than one block?)"));
    }
    if keys.len() > MAX_KEYS {
        return Err(bad(format!(
            "{} keys; at most {MAX_KEYS} per prewarm",
            keys.len()
        )));
    }
    let prefetch = st
        .inner
        .prefetch
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "prewarm needs a KV-cache daemon: start the server with --kvd-socket-path",
            )
        })?;
    let n = keys.len();
    prefetch
        .prefetch(&model, &compat_key, keys, deadline_ms)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the KV-cache daemon is unreachable: {e}"),
            )
        })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::hex_key;
    use serde_json::json;

    #[test]
    fn hex_keys_decode_and_non_ascii_is_an_error_not_a_panic() {
        assert_eq!(hex_key(0, &json!("0x00ff10")).ok(), Some(vec![0, 255, 16]));
        for bad in ["aé0", "é", "0g", "abc", "", "0x"] {
            let err = hex_key(3, &json!(bad)).expect_err(bad);
            assert!(err.message.contains("block_hashes[3]"), "{bad}");
        }
    }
}
