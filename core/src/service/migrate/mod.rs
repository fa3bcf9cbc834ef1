//! Stream migration (`--migration-limit`, the Python Infera's flag; 0, the default, is off): a
//! stream whose worker fails mid-stream is continued on another worker instead of ending with an
//! error event, up to the limit per request, never on a worker that already failed it.
//!
//! # How
//! While relaying, every SSE frame the client receives is read: the generated text
//! (`choices[0].text`, or `choices[0].delta.content` for chat), its count of content frames
//! (one token each on vLLM and SGLang), the stream's `id`, and, where the engine reports them,
//! the token ids of the prompt and of every generated token. The router asks for those ids
//! itself (`return_token_ids`, on vLLM and on SGLang's completions; see [`frames`]) and takes
//! them back out of every chunk before the client reads it, so the client's stream looks the
//! same with migration on or off. On a failure the request is re-issued, its token budget
//! (`max_tokens`, `max_completion_tokens`) reduced by what was produced:
//! - **exactly**, when every generated token's id is known: as a completions request whose
//!   prompt is the prompt's ids followed by the generated ids, so the next worker resumes from
//!   the identical token sequence (a chat request too, unless it carries tools or a response
//!   format a completions request cannot honour; its continuation's chunks are reshaped into
//!   chat chunks);
//! - otherwise **by text**: the text so far appended (completions: to the prompt; chat: as a
//!   final assistant message with `continue_final_message`), re-tokenized by the next worker:
//!   the same words, not provably the same tokens.
//!
//! The continuation's frames are relayed with the first stream's `id`, and a chat
//! continuation's role-only opening frame is dropped, so the client reads one stream. The new
//! worker is decided like any attempt (a new `RequestRouted`, the failed ranks and open circuit
//! breakers excluded; its answer before the first byte feeds its breaker), and must answer its
//! first byte before it is used; otherwise the stream ends with the error event as without
//! migration. A mid-stream failure itself is not held against a worker's breaker.
//!
//! # Limits
//! Only mixed (not prefill/decode) streams of one choice (`n`, `best_of` ≤ 1) with a prompt
//! (text, or token ids when the engine reports the generated ids) or chat messages. Without
//! ids, a stream broken inside a frame the client already has part of cannot move. Sampling
//! state does not move, so a fixed seed is not reproduced.

mod frames;

use super::Service;
use super::attempt::Attempt;
use super::breaker::{Judge, Outcome, answer_outcome, breaker_outcome};
use super::dispatch::first_chunk;
use super::metrics::inc;
use crate::ids::WorkerRank;
use crate::policy::{RouteError, RouteRequest};
use crate::ports::transport::{BodyStream, Outbound};
use bytes::Bytes;
use frames::{CHAT_ONLY_FIELDS, data_lines, frame_end};
use futures::StreamExt as _;
use serde_json::{Map, Value, json};

const COMPLETIONS: &str = "/v1/completions";

/// One stream's migration state. See the module docs.
pub(super) struct Migration {
    st: Service,
    req: RouteRequest,
    path: &'static str,
    body: Map<String, Value>,
    chat: bool,
    client_id: String,
    left: u32,
    /// The rank serving the stream now.
    current: WorkerRank,
    text: String,
    tokens: u64,
    finished: bool,
    stream_id: Option<String>,
    /// A frame the client has only part of (frames passed through as they come).
    partial: Vec<u8>,
    /// The router asked the engine for token ids: they are taken out of every frame, and
    /// frames reach the client whole (held in `incoming` until complete).
    asked_ids: bool,
    /// The prompt's ids, from the first chunk that carried them.
    prompt_ids: Option<Vec<u32>>,
    /// The generated ids so far; only meaningful while `exact`.
    output_ids: Vec<u32>,
    /// Every content frame so far carried its ids.
    exact: bool,
    /// Relaying a continuation: its frames get the first stream's id.
    continued: bool,
    /// The continuation is a completions stream that a chat client reads.
    to_chat: bool,
    /// A frame not yet complete, held back from the client.
    incoming: Vec<u8>,
}

impl Service {
    /// Sets `--migration-limit`: how many times one stream may move to another worker when its
    /// own fails mid-stream (0, the default, turns migration off).
    pub fn set_migration_limit(&self, limit: u32) {
        self.inner
            .migration_limit
            .store(limit, std::sync::atomic::Ordering::Relaxed);
    }

    fn migration_limit(&self) -> u32 {
        self.inner
            .migration_limit
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The body to send `rank` for a stream that may migrate: `body` with `return_token_ids` when
/// migration is on, the worker's engine reports ids on `path` and the client did not set the
/// field itself; `None` to send `body` as it is.
pub(super) fn asking_ids(
    st: &Service,
    rank: &WorkerRank,
    path: &str,
    body: &Bytes,
) -> Option<Bytes> {
    if st.migration_limit() == 0 {
        return None;
    }
    let engine = st.with_fleet(|f| f.worker(&rank.worker).map(|w| w.engine))?;
    if !frames::engine_reports_ids(engine, path) {
        return None;
    }
    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    if map.contains_key("return_token_ids") {
        return None;
    }
    map.insert("return_token_ids".to_owned(), Value::Bool(true));
    serde_json::to_vec(&map).ok().map(Bytes::from)
}

impl Migration {
    /// The migration state of a stream to `rank`, when `limit` > 0 and the request can move;
    /// `asked_ids`: the router added `return_token_ids` to what it sent ([`asking_ids`]).
    pub(super) fn new(
        st: &Service,
        req: &RouteRequest,
        path: &'static str,
        body: &Bytes,
        rank: WorkerRank,
        client_id: &str,
        asked_ids: bool,
    ) -> Option<Box<Self>> {
        let limit = st.migration_limit();
        if limit == 0 {
            return None;
        }
        let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(body) else {
            return None;
        };
        let one = |k: &str| body.get(k).and_then(Value::as_u64).is_none_or(|n| n <= 1);
        let chat = path == "/v1/chat/completions";
        let reported = asked_ids || body.get("return_token_ids") == Some(&Value::Bool(true));
        let movable = one("n")
            && one("best_of")
            && if chat {
                body.get("messages").is_some_and(Value::is_array)
            } else {
                match body.get("prompt") {
                    Some(Value::String(_)) => true,
                    // Token ids move only as token ids.
                    Some(Value::Array(items)) => {
                        reported && items.iter().all(|v| v.as_u64().is_some())
                    }
                    _ => false,
                }
            };
        movable.then(|| {
            Box::new(Self {
                st: st.clone(),
                req: req.clone(),
                path,
                body,
                chat,
                client_id: client_id.to_owned(),
                left: limit,
                current: rank,
                text: String::new(),
                tokens: 0,
                finished: false,
                stream_id: None,
                partial: Vec::new(),
                asked_ids,
                prompt_ids: None,
                output_ids: Vec::new(),
                exact: reported,
                continued: false,
                to_chat: false,
                incoming: Vec::new(),
            })
        })
    }

    /// Takes what the worker sent and returns what the client gets: the same bytes while
    /// nothing needs rewriting, else whole frames, rewritten (ids taken out, a continuation's
    /// frames given the first stream's id and shape).
    pub(super) fn pass(&mut self, data: Bytes) -> Bytes {
        if !self.asked_ids && !self.continued {
            self.partial.extend_from_slice(&data);
            while let Some(end) = frame_end(&self.partial) {
                let frame: Vec<u8> = self.partial.drain(..end).collect();
                for payload in data_lines(&frame) {
                    if let Some(v) = self.read(payload) {
                        self.record(&v);
                    }
                }
            }
            return data;
        }
        self.incoming.extend_from_slice(&data);
        let mut out = Vec::with_capacity(self.incoming.len());
        while let Some(end) = frame_end(&self.incoming) {
            let frame: Vec<u8> = self.incoming.drain(..end).collect();
            let payload = data_lines(&frame).next();
            let Some(Value::Object(mut v)) = payload.and_then(|p| self.read(p)) else {
                out.extend_from_slice(&frame);
                continue;
            };
            if self.to_chat {
                frames::as_chat_chunk(&mut v);
            }
            let delta = &v["choices"][0]["delta"];
            let role_only = self.continued
                && self.chat
                && delta.get("role").is_some()
                && delta["content"].as_str().is_none_or(str::is_empty);
            let v = Value::Object(v);
            self.record(&v);
            let Value::Object(mut v) = v else {
                continue;
            };
            if role_only {
                continue;
            }
            if self.asked_ids {
                frames::strip_ids(&mut v);
            }
            if self.continued
                && let Some(id) = &self.stream_id
            {
                v.insert("id".to_owned(), Value::String(id.clone()));
            }
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(Value::Object(v).to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        Bytes::from(out)
    }

    /// One frame's JSON; `[DONE]` marks the stream finished.
    fn read(&mut self, payload: &[u8]) -> Option<Value> {
        if payload == b"[DONE]" {
            self.finished = true;
            return None;
        }
        serde_json::from_slice::<Value>(payload).ok()
    }

    /// Notes what a frame the client gets carries.
    fn record(&mut self, v: &Value) {
        if self.stream_id.is_none() {
            self.stream_id = v.get("id").and_then(Value::as_str).map(str::to_owned);
        }
        if self.prompt_ids.is_none() {
            self.prompt_ids = frames::prompt_ids(v);
        }
        let choice = &v["choices"][0];
        let piece = if self.chat {
            &choice["delta"]["content"]
        } else {
            &choice["text"]
        };
        let ids = frames::delta_ids(v);
        match (&ids, piece.as_str().filter(|p| !p.is_empty())) {
            (Some(ids), _) if !ids.is_empty() => self.output_ids.extend_from_slice(ids),
            // Text without its ids: the continuation can only carry text.
            (_, Some(_)) => self.exact = false,
            _ => {}
        }
        if let Some(piece) = piece.as_str().filter(|p| !p.is_empty()) {
            self.text.push_str(piece);
            self.tokens += 1;
        }
        if !choice["finish_reason"].is_null() {
            self.finished = true;
        }
    }

    /// Continues the stream on another worker after its worker failed; `None` when it cannot
    /// (no migration left, the stream had ended or broke inside a frame the client has part
    /// of, no other worker, or the new one did not answer its first byte).
    pub(super) async fn resume(&mut self) -> Option<(Attempt, BodyStream)> {
        let st = self.st.clone();
        let metrics = &st.inner.metrics;
        if self.finished {
            return None;
        }
        if self.left == 0 || !self.partial.is_empty() {
            metrics.migration_failed(if self.left == 0 { "limit" } else { "poisoned" });
            return None;
        }
        // A frame held back is one the client never saw: the continuation produces it again.
        self.incoming.clear();
        self.left -= 1;
        let failed = self.current.clone();
        self.req.exclude.push(failed.clone());
        let key = self.req.request_id.request_key().to_owned();
        self.req.request_id = self.st.attempt_id(&key);
        let (rank, url, dp_rank) = match super::decide::decide_single(&self.st, &mut self.req) {
            Ok(Some(x)) => x,
            Ok(None) | Err(RouteError::NoWorker { .. }) => {
                tracing::warn!(request_id = %self.client_id, "no other worker to migrate to");
                metrics.migration_failed("no_candidate");
                return None;
            }
            Err(e) => {
                tracing::warn!(request_id = %self.client_id, error = %e, "cannot migrate");
                metrics.migration_failed("no_candidate");
                return None;
            }
        };
        let mut guard = Attempt::new(&self.st, &self.req, false);
        let Some((path, body, exact)) = self.continuation(&rank) else {
            guard.finish_failed();
            return None;
        };
        let judge = Judge::new(&self.st, vec![rank.worker.clone()]);
        let out = Outbound::new(rank.worker.clone(), url, path, body, true, &self.client_id)
            .with_dp_rank(dp_rank);
        let mut resp = match self.st.inner.transport.send(out).await {
            Ok(r) if r.status.is_success() => r,
            Ok(r) => {
                judge.record(&rank, answer_outcome(r.status));
                guard.finish_failed();
                metrics.migration_failed("no_first_byte");
                return None;
            }
            Err(e) => {
                judge.record(&rank, breaker_outcome(&e));
                guard.finish_failed();
                metrics.migration_failed("no_first_byte");
                return None;
            }
        };
        match first_chunk(&mut resp.body).await {
            Some(Ok(chunk)) => {
                judge.record(&rank, Outcome::Success);
                tracing::warn!(request_id = %self.client_id, from = %failed.worker.as_str(),
                    to = %rank.worker.as_str(), tokens = self.tokens, exact,
                    "stream migrated to another worker");
                inc(&metrics.migrations, 1);
                metrics
                    .migrations_by_reason
                    .get_or_create(&[("reason", "stream_broken")])
                    .inc();
                if exact {
                    inc(&metrics.migrations_exact, 1);
                }
                self.current = rank;
                self.continued = true;
                guard.first_byte();
                let body = futures::stream::once(async move { Ok(chunk) })
                    .chain(resp.body)
                    .boxed();
                Some((guard, body))
            }
            _ => {
                judge.record(&rank, Outcome::Failure);
                guard.finish_failed();
                metrics.migration_failed("no_first_byte");
                None
            }
        }
    }

    /// Whether the continuation can carry token ids: every generated token's id and the
    /// prompt's are known, and a chat request asks nothing a completions request cannot do.
    fn exact_ready(&self) -> bool {
        self.exact
            && self.prompt_ids.is_some()
            && !(self.chat && CHAT_ONLY_FIELDS.iter().any(|f| self.body.contains_key(*f)))
    }

    /// The path and body that continue the generation on `rank`, and whether they carry token
    /// ids; `None` when its token budget is spent. Sets how the continuation's frames are read
    /// (`asked_ids`, `to_chat`).
    fn continuation(&mut self, rank: &WorkerRank) -> Option<(&'static str, Bytes, bool)> {
        let mut body = self.body.clone();
        let exact = self.exact_ready();
        let produced = if exact {
            self.output_ids.len() as u64
        } else {
            self.tokens
        };
        for key in ["max_tokens", "max_completion_tokens"] {
            if let Some(n) = body.get(key).and_then(Value::as_u64) {
                let left = n.checked_sub(produced).filter(|l| *l > 0)?;
                body.insert(key.to_owned(), json!(left));
            }
        }
        let path = if exact {
            let mut prompt = self.prompt_ids.clone().unwrap_or_default();
            prompt.extend_from_slice(&self.output_ids);
            for key in [
                "messages",
                "continue_final_message",
                "add_generation_prompt",
            ] {
                body.remove(key);
            }
            if let Some(n) = body.remove("max_completion_tokens") {
                body.entry("max_tokens").or_insert(n);
            }
            body.insert("prompt".to_owned(), json!(prompt));
            self.to_chat = self.chat;
            COMPLETIONS
        } else if self.chat {
            let messages = body.get_mut("messages")?.as_array_mut()?;
            messages.push(json!({"role": "assistant", "content": self.text}));
            body.insert("continue_final_message".to_owned(), json!(true));
            body.insert("add_generation_prompt".to_owned(), json!(false));
            self.to_chat = false;
            self.path
        } else {
            let prompt = body.get("prompt")?.as_str()?;
            let carried = format!("{prompt}{}", self.text);
            body.insert("prompt".to_owned(), Value::String(carried));
            self.path
        };
        // Keep reading ids where the new worker reports them, so a second migration is exact
        // too; the client's own choice stands.
        let bytes = Bytes::from(serde_json::to_vec(&body).ok()?);
        if self.body.contains_key("return_token_ids") {
            return Some((path, bytes, exact));
        }
        let asked = asking_ids(&self.st, rank, path, &bytes);
        self.asked_ids = asked.is_some();
        if !self.asked_ids {
            self.exact = false;
        }
        Some((path, asked.unwrap_or(bytes), exact))
    }
}

#[cfg(test)]
mod tests;
