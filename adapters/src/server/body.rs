//! Reading and parsing a client's request body within the server's memory bounds.
//!
//! # Reading
//! [`read_limited`] collects a body frame by frame: beyond the byte limit it answers 413 (at
//! once when `Content-Length` says so); with a [`ParseBudget`] every frame is charged to it as
//! it arrives, and a frame that does not fit is answered 503 with `Retry-After` — the server
//! refuses work rather than allocating past its budget. A body that misses the serve loop's
//! deadline ([`BodyTimeout`]) is answered 408. A body that must become a JSON tree (Anthropic
//! Messages, translated as one) is charged [`TREE_COST`] times its size.
//!
//! # Parsing
//! [`parse`] reads an OpenAI completions or chat body without building a JSON tree: the fields
//! the router needs (`model`, `stream`, `prompt`, `messages`, `kv_transfer_params`,
//! `prompt_cache_retention`, `session_id`) are borrowed as raw JSON text from the body and
//! everything else is skipped unparsed. A prompt of token ids goes straight into a `Vec<u32>`
//! ([`Prompt`]): a 30 MiB array costs its bytes, its ids and the forwarded copy, where a
//! `serde_json::Value` tree cost ~48× its size. The client's bytes are forwarded as they came,
//! with the retention stamp (PROTOCOLS.md §5) appended or spliced in place, and each inline image
//! part without a `uuid` given its content identifier as one (see `crate::tokenize::image`):
//! never re-encoded. A key given twice is refused (400), where a JSON tree kept the last.

use super::client::ParseBudget;
use super::http::{ApiError, Input};
use super::prompt::{Prompt, PromptSeed};
use crate::serve::BodyTimeout;
use crate::tokenize::{ChatContent, ChatExtras, ChatMessage};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use http_body_util::BodyExt as _;
use infera_core::event::Retention;
use serde::Deserialize;
use serde::de::{DeserializeSeed as _, Deserializer, IgnoredAny};
use serde_json::value::RawValue;
use std::fmt;
use tokio::sync::OwnedSemaphorePermit;

/// Reads `body` whole: 413 past `max` bytes, 503 when `budget` cannot take it, 408 past the
/// body deadline, 400 when the connection fails. Returns the bytes and their budget charge,
/// released when dropped.
pub(super) async fn read_limited(
    mut body: Body,
    headers: &HeaderMap,
    max: usize,
    budget: Option<&ParseBudget>,
) -> Result<(Bytes, Option<OwnedSemaphorePermit>), ApiError> {
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
    let mut held = None;
    let mut bytes: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| read_error(&e))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if bytes.len() + data.len() > max {
            return Err(too_large());
        }
        if let Some(budget) = budget
            && !budget.charge(&mut held, data.len())
        {
            return Err(over_budget(budget));
        }
        let needed = bytes.len() + data.len();
        if needed > bytes.capacity() {
            // Doubling, as a Vec grows, but never past the declared length.
            let grown = needed.max(bytes.capacity() * 2);
            let target = declared.map_or(grown, |d| grown.min(d as usize).max(needed));
            bytes.reserve_exact(target - bytes.len());
        }
        bytes.extend_from_slice(&data);
    }
    Ok((Bytes::from(bytes), held))
}

/// What a JSON tree of a body costs against the parse budget, in multiples of its text: up to
/// ~48× for arrays of small numbers, a few times for text.
pub(super) const TREE_COST: usize = 16;

/// Charges a body of `len` bytes, already charged once to `held`, for being parsed into a JSON
/// tree: [`TREE_COST`] times its size in all, but never more than the whole budget, so that a
/// body alone always fits.
///
/// # Errors
/// 503 with `Retry-After` when the budget cannot take it now.
pub(super) fn charge_tree(
    budget: &ParseBudget,
    held: &mut Option<OwnedSemaphorePermit>,
    len: usize,
) -> Result<(), ApiError> {
    let holding = held.as_ref().map_or(0, OwnedSemaphorePermit::num_permits);
    let more = len
        .saturating_mul(TREE_COST)
        .min(budget.bytes())
        .saturating_sub(holding);
    if budget.charge(held, more) {
        Ok(())
    } else {
        Err(over_budget(budget))
    }
}

fn over_budget(budget: &ParseBudget) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "the server is parsing its limit of {} bytes of request bodies; retry shortly",
            budget.bytes()
        ),
    );
    e.retry_after_s = Some(1);
    e
}

fn read_error(e: &axum::Error) -> ApiError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(t) = s.downcast_ref::<BodyTimeout>() {
            return ApiError::new(StatusCode::REQUEST_TIMEOUT, t.to_string());
        }
        source = s.source();
    }
    ApiError::new(
        StatusCode::BAD_REQUEST,
        format!("cannot read the request body: {e}"),
    )
}

/// An OpenAI body, as the router reads it.
#[derive(Debug)]
pub(super) struct Parsed {
    pub model: String,
    pub stream: bool,
    pub input: Input,
    /// The client's retention hint (PROTOCOLS.md §5), if any.
    pub retention: Option<Retention>,
    /// What the engine gets: the client's bytes with the retention stamp.
    pub forward: Bytes,
    /// The conversation: `prompt_cache_key` (OpenAI's), else `session_id`, when a non-empty
    /// string (the Python Infera reads the same two, in that order).
    pub session_id: Option<String>,
    /// vLLM's `cache_salt`: the engine keys the prompt's first block (and so all of them) by it.
    pub cache_salt: Option<Box<str>>,
    /// vLLM's `priority` (lower is more urgent), for the router's queue.
    pub priority: Option<i32>,
}

/// Which array the prompt is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    /// `prompt` (completions).
    Prompt,
    /// `messages` (chat).
    Messages,
}

/// The top-level fields the router reads, as raw JSON text borrowed from the body. A field
/// present as `null` is `Some("null")`, unlike an absent one.
#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(default, borrow, deserialize_with = "present")]
    model: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    stream: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    prompt: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    messages: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    kv_transfer_params: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    prompt_cache_retention: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    session_id: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    prompt_cache_key: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    cache_salt: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    priority: Option<&'a RawValue>,
    // What a chat template renders besides the messages (see `ChatExtras`).
    #[serde(default, borrow, deserialize_with = "present")]
    tools: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    reasoning_effort: Option<&'a RawValue>,
    #[serde(default, borrow, deserialize_with = "present")]
    add_generation_prompt: Option<&'a RawValue>,
}

/// A chat body's [`ChatExtras`], each field read from its raw JSON (`null` as absent).
fn chat_extras(fields: &Fields<'_>) -> Result<ChatExtras, ApiError> {
    fn field<T: serde::de::DeserializeOwned>(
        raw: Option<&RawValue>,
        name: &str,
    ) -> Result<Option<T>, ApiError> {
        raw.map(|r| {
            serde_json::from_str::<Option<T>>(r.get())
                .map_err(|e| bad(format!("`{name}` is malformed: {e}")))
        })
        .transpose()
        .map(Option::flatten)
    }
    Ok(ChatExtras {
        tools: field(fields.tools, "tools")?,
        chat_template_kwargs: field(fields.chat_template_kwargs, "chat_template_kwargs")?,
        reasoning_effort: field(fields.reasoning_effort, "reasoning_effort")?,
        add_generation_prompt: field(fields.add_generation_prompt, "add_generation_prompt")?,
    })
}

/// `kv_transfer_params`, as the router reads it.
#[derive(Deserialize)]
struct KvParams<'a> {
    #[serde(default, borrow, deserialize_with = "present")]
    infera_retention: Option<&'a RawValue>,
}

fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, message)
}

/// Parses an OpenAI completions (`Shape::Prompt`) or chat (`Shape::Messages`) body.
///
/// # Errors
/// A 400 naming the field at fault, as the JSON-tree parse did.
pub(super) fn parse(bytes: Bytes, shape: Shape, default: Retention) -> Result<Parsed, ApiError> {
    let not_json = |e: serde_json::Error| bad(format!("request body is not valid JSON: {e}"));
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        serde_json::from_slice::<IgnoredAny>(&bytes).map_err(not_json)?;
        return Err(bad("request body must be a JSON object"));
    }
    let fields: Fields<'_> = serde_json::from_slice(&bytes).map_err(not_json)?;
    let model = match fields.model {
        None => return Err(bad("`model` is required")),
        Some(raw) => serde_json::from_str::<String>(raw.get())
            .map_err(|_| bad("`model` must be a string"))?,
    };
    let stream = match fields.stream {
        None => false,
        Some(raw) => serde_json::from_str::<Option<bool>>(raw.get())
            .map_err(|_| bad("`stream` must be a boolean"))?
            .unwrap_or(false),
    };
    let input = match shape {
        Shape::Prompt => match fields.prompt {
            None => return Err(bad("`prompt` is required")),
            Some(raw) => {
                // Every id but the last is followed by a comma.
                let most_ids = memchr::memchr_iter(b',', raw.get().as_bytes()).count() + 1;
                prompt_input(&mut serde_json::Deserializer::from_str(raw.get()), most_ids)?
            }
        },
        Shape::Messages => match fields.messages {
            None => return Err(bad("`messages` is required")),
            Some(raw) => Input::Chat(
                messages_input(raw.get().starts_with('['), || {
                    serde_json::from_str::<Vec<ChatMessage>>(raw.get())
                })?,
                chat_extras(&fields)?,
            ),
        },
    };
    let session_id = [fields.prompt_cache_key, fields.session_id]
        .into_iter()
        .flatten()
        .filter_map(|raw| serde_json::from_str::<String>(raw.get()).ok())
        .map(|s| s.trim().to_owned())
        .find(|s| !s.is_empty());
    let cache_salt = match fields.cache_salt {
        None => None,
        Some(raw) => serde_json::from_str::<Option<String>>(raw.get())
            .map_err(|_| bad("`cache_salt` must be a string"))?
            .filter(|s| !s.is_empty())
            .map(Box::from),
    };
    let priority = match fields.priority {
        None => None,
        Some(raw) => serde_json::from_str::<Option<i32>>(raw.get())
            .map_err(|_| bad("`priority` must be an integer"))?,
    };
    let (retention, edit) = retention(&fields, &bytes, default)?;
    let mut splices = match (&input, fields.messages) {
        (Input::Chat(messages, _), Some(raw)) => image_uuids(&bytes, raw, messages),
        _ => Vec::new(),
    };
    match edit {
        Edit::None => {}
        Edit::Append(stamp) => {
            let end = bytes
                .iter()
                .rposition(|b| !b.is_ascii_whitespace())
                .unwrap_or(0);
            splices.push(Splice {
                at: end,
                remove: bytes.len() - end,
                insert: format!(",\"kv_transfer_params\":{{\"infera_retention\":\"{stamp}\"}}}}"),
            });
        }
        Edit::Splice(splice) => splices.push(splice),
    }
    let forward = spliced(&bytes, splices);
    Ok(Parsed {
        model,
        stream,
        input,
        retention,
        forward,
        session_id,
        cache_salt,
        priority,
    })
}

/// The messages of `messages`: 400 unless a non-empty array of messages.
pub(super) fn messages_input<E: fmt::Display>(
    is_array: bool,
    parse: impl FnOnce() -> Result<Vec<ChatMessage>, E>,
) -> Result<Vec<ChatMessage>, ApiError> {
    if !is_array {
        return Err(bad("`messages` must be an array"));
    }
    let messages = parse().map_err(|e| bad(format!("`messages` is malformed: {e}")))?;
    if messages.is_empty() {
        return Err(bad("`messages` must not be empty"));
    }
    Ok(messages)
}

/// The prompt input read from `d` (the value of `prompt`), whose token ids number at most
/// `most_ids` (0: unknown).
pub(super) fn prompt_input<'de, D: Deserializer<'de>>(
    d: D,
    most_ids: usize,
) -> Result<Input, ApiError> {
    match PromptSeed(most_ids).deserialize(d) {
        Ok(Prompt(result)) => result.map_err(bad),
        Err(e) => Err(bad(format!("`prompt` is malformed: {e}"))),
    }
}

/// How the body changes for the retention stamp.
enum Edit {
    /// The client stamped it.
    None,
    /// `"kv_transfer_params":{"infera_retention":…}` appended as the last member.
    Append(&'static str),
    /// Spliced into the client's `kv_transfer_params`.
    Splice(Splice),
}

/// `remove` bytes at `at` replaced by `insert`.
#[derive(Debug)]
struct Splice {
    at: usize,
    remove: usize,
    insert: String,
}

/// `body` with `splices` (which do not overlap) made.
fn spliced(body: &Bytes, mut splices: Vec<Splice>) -> Bytes {
    if splices.is_empty() {
        return body.clone();
    }
    splices.sort_unstable_by_key(|s| s.at);
    let grown: usize = splices.iter().map(|s| s.insert.len()).sum();
    let mut out = Vec::with_capacity(body.len() + grown);
    let mut from = 0;
    for s in splices {
        out.extend_from_slice(&body[from..s.at]);
        out.extend_from_slice(s.insert.as_bytes());
        from = s.at + s.remove;
    }
    out.extend_from_slice(&body[from..]);
    Bytes::from(out)
}

/// The `uuid` each inline image part of `messages` (the raw JSON `raw`, borrowed from `body`)
/// gets when the client gave none: its content identifier, as the part's first member, so the
/// engine keys the image as the router does.
fn image_uuids(body: &[u8], raw: &RawValue, messages: &[ChatMessage]) -> Vec<Splice> {
    #[derive(Deserialize)]
    struct Message<'a> {
        #[serde(default, borrow)]
        content: Option<&'a RawValue>,
    }
    let wanted = |m: &ChatMessage| {
        m.non_text().any(|p| {
            p.uuid.is_none() && p.image_url.as_ref().is_some_and(|i| i.content_id.is_some())
        })
    };
    if !messages.iter().any(wanted) {
        return Vec::new();
    }
    let Ok(raws) = serde_json::from_str::<Vec<Message<'_>>>(raw.get()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (message, raw) in messages.iter().zip(raws) {
        let (Some(ChatContent::Parts(parts)), Some(content)) = (&message.content, raw.content)
        else {
            continue;
        };
        let Ok(raw_parts) = serde_json::from_str::<Vec<&RawValue>>(content.get()) else {
            continue;
        };
        for (part, raw_part) in parts.iter().zip(raw_parts) {
            let id = match (&part.uuid, &part.image_url) {
                (None, Some(image)) => image.content_id.as_deref(),
                _ => None,
            };
            let text = raw_part.get();
            if let Some(id) = id
                && text.starts_with('{')
            {
                out.push(Splice {
                    at: offset(body, raw_part) + 1,
                    remove: 0,
                    insert: format!("\"uuid\":\"{id}\","),
                });
            }
        }
    }
    out
}

/// The client's retention hint and the stamp the body needs (PROTOCOLS.md §5): the client's
/// own `kv_transfer_params.infera_retention` kept, else derived from `prompt_cache_retention`,
/// else `default` (`--default-retention`, `long` unless set).
fn retention(
    fields: &Fields<'_>,
    body: &[u8],
    default: Retention,
) -> Result<(Option<Retention>, Edit), ApiError> {
    let mut hint = None;
    let mut missing: Option<&RawValue> = None;
    let mut params: Option<&RawValue> = None;
    match fields.kv_transfer_params {
        None => {}
        Some(raw) if raw.get() == "null" => params = Some(raw),
        Some(raw) if raw.get().starts_with('{') => {
            let p: KvParams<'_> = serde_json::from_str(raw.get())
                .map_err(|e| bad(format!("`kv_transfer_params` is malformed: {e}")))?;
            match p.infera_retention {
                None => params = Some(raw),
                Some(r) if r.get() == "null" => missing = Some(r),
                Some(r) => {
                    let s = serde_json::from_str::<String>(r.get()).map_err(|_| {
                        bad("`kv_transfer_params.infera_retention` must be a string")
                    })?;
                    hint = Some(Retention::parse(&s).ok_or_else(|| {
                        bad(format!(
                            "`kv_transfer_params.infera_retention` must be none, short or long, \
                             got {s:?}"
                        ))
                    })?);
                }
            }
        }
        Some(_) => return Err(bad("`kv_transfer_params` must be an object")),
    }
    if hint.is_some() {
        return Ok((hint, Edit::None));
    }
    hint = fields
        .prompt_cache_retention
        .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        .and_then(|s| match s.as_str() {
            "24h" | "1h" | "long" => Some(Retention::Long),
            "5m" | "short" => Some(Retention::Short),
            "none" | "off" => Some(Retention::None),
            _ => None,
        });
    let stamp = hint.unwrap_or(default).as_str();
    let edit = match (fields.kv_transfer_params, params, missing) {
        (None, _, _) => Edit::Append(stamp),
        // `"infera_retention": null` becomes the stamp.
        (_, _, Some(null)) => Edit::Splice(Splice {
            at: offset(body, null),
            remove: null.get().len(),
            insert: format!("\"{stamp}\""),
        }),
        // `null` becomes an object holding the stamp.
        (_, Some(p), _) if p.get() == "null" => Edit::Splice(Splice {
            at: offset(body, p),
            remove: p.get().len(),
            insert: format!("{{\"infera_retention\":\"{stamp}\"}}"),
        }),
        // An object without the stamp gains it as its first member.
        (_, Some(p), _) => {
            let empty = p.get()[1..].trim_start().starts_with('}');
            Edit::Splice(Splice {
                at: offset(body, p) + 1,
                remove: 0,
                insert: format!(
                    "\"infera_retention\":\"{stamp}\"{}",
                    if empty { "" } else { "," }
                ),
            })
        }
        (Some(_), None, None) => Edit::None,
    };
    Ok((hint, edit))
}

/// Where `raw`, borrowed from `body`, starts in it.
fn offset(body: &[u8], raw: &RawValue) -> usize {
    (raw.get().as_ptr() as usize).saturating_sub(body.as_ptr() as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// The hint and what the engine receives for a completions body, checked against the
    /// object the JSON-tree stamping built.
    fn forwarded(body: &str) -> (Option<Retention>, Value) {
        let parsed = parse(
            Bytes::copy_from_slice(body.as_bytes()),
            Shape::Prompt,
            Retention::Long,
        )
        .unwrap();
        let sent: Value = serde_json::from_slice(&parsed.forward).unwrap();
        let mut want: Value = serde_json::from_str(body).unwrap();
        let params = &mut want["kv_transfer_params"];
        if params.is_null() {
            *params = json!({});
        }
        if params["infera_retention"].is_null() {
            params["infera_retention"] = json!(sent["kv_transfer_params"]["infera_retention"]);
        }
        assert_eq!(sent, want, "only the stamp differs from the client's body");
        (parsed.retention, sent)
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
        // `--default-retention` (INFERA_ROUTER_DEFAULT_RETENTION) replaces `long` there.
        let body = b"{\"model\":\"m\",\"prompt\":\"hi\"}";
        let parsed = parse(Bytes::from_static(body), Shape::Prompt, Retention::None).unwrap();
        let sent: Value = serde_json::from_slice(&parsed.forward).unwrap();
        assert_eq!(
            (
                parsed.retention,
                &sent["kv_transfer_params"]["infera_retention"]
            ),
            (None, &json!("none"))
        );
        // OpenAI's prompt_cache_retention maps onto a class.
        let (hint, sent) = forwarded(r#"{"model":"m","prompt":[1],"prompt_cache_retention":"5m"}"#);
        assert_eq!(hint, Some(Retention::Short));
        assert_eq!(sent["kv_transfer_params"]["infera_retention"], "short");
        // The client's own stamp wins, its bytes go on untouched.
        let body = r#"{"model":"m","prompt":"x","prompt_cache_retention":"24h","kv_transfer_params":{"infera_retention":"none","x":1}}"#;
        let parsed = parse(
            Bytes::from_static(body.as_bytes()),
            Shape::Prompt,
            Retention::Long,
        )
        .unwrap();
        assert_eq!(parsed.retention, Some(Retention::None));
        assert_eq!(&parsed.forward[..], body.as_bytes());
        // Existing params without a stamp, a null stamp, an empty object or null gain one.
        for body in [
            r#"{"model":"m","prompt":"x","kv_transfer_params":{"x":1}}"#,
            r#"{"model":"m","prompt":"x","kv_transfer_params":{ "x" : [1, {"y": 2}] , "z":null}}"#,
            r#"{"model":"m","prompt":"x","kv_transfer_params":{"infera_retention":null,"x":1}}"#,
            r#"{"model":"m","prompt":"x","kv_transfer_params":{ }}"#,
            r#"{"model":"m","prompt":"x","kv_transfer_params":null}"#,
        ] {
            let (_, sent) = forwarded(body);
            assert_eq!(
                sent["kv_transfer_params"]["infera_retention"], "long",
                "{body}"
            );
        }
    }

    #[test]
    fn bad_bodies_are_refused_naming_the_field() {
        for (body, needle) in [
            (
                r#"{"model":"m","prompt":"x","kv_transfer_params":3}"#,
                "kv_transfer_params",
            ),
            (
                r#"{"model":"m","prompt":"x","kv_transfer_params":{"infera_retention":1}}"#,
                "kv_transfer_params.infera_retention",
            ),
            (
                r#"{"model":"m","prompt":"x","kv_transfer_params":{"infera_retention":"forever"}}"#,
                "none, short or long",
            ),
            (r#"{"prompt":"x"}"#, "`model` is required"),
            (r#"{"model":null,"prompt":"x"}"#, "`model` must be a string"),
            (
                r#"{"model":"m","prompt":"x","stream":"yes"}"#,
                "`stream` must be a boolean",
            ),
            (r#"{"model":"m"}"#, "`prompt` is required"),
            (r#"{"model":"m","prompt":[]}"#, "must not be empty"),
            ("[1]", "must be a JSON object"),
            ("{\"model\":", "not valid JSON"),
            (
                r#"{"model":"m","model":"n","prompt":"x"}"#,
                "duplicate field",
            ),
        ] {
            let e = parse(
                Bytes::from_static(body.as_bytes()),
                Shape::Prompt,
                Retention::Long,
            )
            .unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
        for (body, needle) in [
            (
                r#"{"model":"m","messages":{}}"#,
                "`messages` must be an array",
            ),
            (r#"{"model":"m","messages":[]}"#, "must not be empty"),
            (
                r#"{"model":"m","messages":[{"x":1}]}"#,
                "`messages` is malformed",
            ),
        ] {
            let e = parse(
                Bytes::from_static(body.as_bytes()),
                Shape::Messages,
                Retention::Long,
            )
            .unwrap_err();
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }

    #[test]
    fn a_chat_body_and_its_session_are_read() {
        let body = r#"{"model":"m","stream":true,"session_id":"s1","messages":[{"role":"user","content":"hi"}]}"#;
        let parsed = parse(
            Bytes::from_static(body.as_bytes()),
            Shape::Messages,
            Retention::Long,
        )
        .unwrap();
        assert_eq!(parsed.model, "m");
        assert!(parsed.stream);
        assert_eq!(parsed.session_id.as_deref(), Some("s1"));
        assert!(matches!(parsed.input, Input::Chat(m, _) if m.len() == 1));
        let session = |extra: &str| {
            let body = format!(r#"{{"model":"m",{extra}"prompt":"hi"}}"#);
            parse(Bytes::from(body), Shape::Prompt, Retention::Long)
                .unwrap()
                .session_id
        };
        let both = r#""session_id":"s1","prompt_cache_key":" k1 ","#;
        assert_eq!(session(both).as_deref(), Some("k1"), "OpenAI's key first");
        assert_eq!(
            session(r#""prompt_cache_key":"","session_id":"s1","#).as_deref(),
            Some("s1")
        );
        assert_eq!(session(r#""session_id":7,"#), None);
        assert_eq!(session(""), None);
    }

    #[test]
    fn inline_images_are_stamped_with_their_content_id_and_nothing_else_changes() {
        let png = crate::tokenize::image::tests::png(64, 32);
        let url = crate::tokenize::image::tests::data_url("image/png", &png);
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image_url", "image_url": {"url": url}, "uuid": "mine"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ]},
        ], "kv_transfer_params": {"infera_retention": "short"}});
        let parsed = parse(
            Bytes::from(body.to_string()),
            Shape::Messages,
            Retention::Long,
        )
        .unwrap();
        let sent: Value = serde_json::from_slice(&parsed.forward).unwrap();
        let Input::Chat(messages, _) = &parsed.input else {
            panic!("a chat");
        };
        let Some(ChatContent::Parts(parts)) = &messages[1].content else {
            panic!("parts");
        };
        let id = parts[1]
            .image_url
            .as_ref()
            .unwrap()
            .content_id
            .clone()
            .unwrap();
        let mut want = body.clone();
        want["messages"][1]["content"][1]["uuid"] = json!(&*id);
        assert_eq!(
            sent, want,
            "the inline image alone gains a uuid; the client's is kept"
        );
        let text = String::from_utf8(parsed.forward.to_vec()).unwrap();
        assert!(
            text.contains(&format!("{{\"uuid\":\"{id}\",")),
            "spliced in: {text:.300}"
        );
    }
}
